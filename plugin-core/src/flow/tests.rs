//! The decision matrix: every path a request can take through [`Flow`].

use super::*;
use crate::breaker::Breaker;
use crate::problem::types;
use crate::testing::{MemStore, Recorder, Req};
use alloc::format;
use idemgate_wire::{RateOutcome, RateRequest, WaitPolicy};

/// One gateway: its shared data, breaker and metrics.
struct Gateway {
    config: Config,
    shared: MemStore,
    breaker: Breaker,
    rec: Recorder,
    now: u64,
    next_owner: u64,
    /// This gateway's waiter secret (random per VM in the filter).
    secret: [u8; 32],
    /// This gateway's digest memo (per worker in the filter), kept across requests.
    digests: crate::DigestMemo,
}

impl Gateway {
    fn new(json: &str) -> Gateway {
        Gateway {
            config: crate::config::parse(json.as_bytes()).unwrap(),
            shared: MemStore::default(),
            breaker: Breaker::default(),
            rec: Recorder::default(),
            now: 1_000_000,
            next_owner: 1,
            secret: [7; 32],
            digests: crate::DigestMemo::new(),
        }
    }

    fn rules(rules: &str) -> Gateway {
        Gateway::new(&format!(
            r#"{{"sidecar":{{"cluster":"s"}},"rules":{rules}}}"#
        ))
    }

    fn with<R>(&mut self, f: impl FnOnce(&Config, &mut Env<'_>) -> R) -> R {
        self.next_owner += 1;
        let mut env = Env {
            now_ms: self.now,
            shared: &self.shared,
            breaker: &mut self.breaker,
            telemetry: &mut self.rec,
            owner: self.next_owner,
            waiter_secret: Some(&self.secret),
            digests: &mut self.digests,
        };
        f(&self.config, &mut env)
    }

    fn start(&mut self, req: &Req) -> (Option<Flow>, Action) {
        self.start_with_eos(req, true)
    }

    fn start_with_eos(&mut self, req: &Req, end_of_stream: bool) -> (Option<Flow>, Action) {
        self.with(|c, env| match Flow::route(c, req) {
            None => (None, Action::pass()),
            Some(route) => Flow::on_request_headers(c, route, req, end_of_stream, env),
        })
    }

    /// Starts a request that must produce a claim; returns the flow and the decoded claim.
    fn claim(&mut self, req: &Req) -> (Flow, ClaimRequest, u64) {
        let (flow, action) = self.start(req);
        let Action::Decide(call) = action else {
            panic!("expected a claim, got {action:?}")
        };
        assert_eq!(call.path, paths::CLAIM);
        let (claim, payload): (ClaimRequest, &[u8]) = idemgate_wire::decode(&call.body).unwrap();
        assert!(payload.is_empty());
        (flow.unwrap(), claim, call.timeout_ms)
    }

    fn answer(&mut self, flow: &mut Flow, answer: Answer<'_>) -> Action {
        self.with(|c, env| flow.on_decision(c, answer, env))
    }

    fn answer_with(&mut self, flow: &mut Flow, outcome: &ClaimOutcome, payload: &[u8]) -> Action {
        let body = idemgate_wire::encode(outcome, payload);
        self.answer(
            flow,
            Answer::Http {
                status: 200,
                body: &body,
            },
        )
    }

    fn grant(&mut self, flow: &mut Flow, fence: u64) -> Action {
        let g = ClaimOutcome::Granted {
            owner: format!("owner-{fence}"),
            fence,
            lease_ms: 30_000,
            waited_ms: 0,
        };
        self.answer_with(flow, &g, &[])
    }

    fn respond(&mut self, flow: &mut Flow, status: &str, content_type: &str, chunks: &[&[u8]]) {
        let headers = vec![
            (":status".to_string(), status.as_bytes().to_vec()),
            ("content-type".to_string(), content_type.as_bytes().to_vec()),
            ("set-cookie".to_string(), b"secret".to_vec()),
        ];
        self.with(|c, env| flow.on_response_headers(c, &headers, chunks.is_empty(), env));
        for (i, chunk) in chunks.iter().enumerate() {
            let data: &[u8] = if flow.wants_response_body() {
                chunk
            } else {
                &[]
            };
            let eos = i + 1 == chunks.len();
            self.with(|c, env| flow.on_response_body(c, data, eos, env));
        }
    }

    fn end(&mut self, flow: &mut Flow) -> bool {
        self.with(|c, env| flow.on_stream_end(c, env))
    }

    /// The tick's lease work for `flow` at time `at`.
    fn due(&mut self, flow: &mut Flow, at: u64) -> Option<Callout> {
        let now = core::mem::replace(&mut self.now, at);
        let due = self.with(|c, env| flow.renewal_due(c, env));
        self.now = now;
        due
    }

    fn count(&self, c: Counter) -> usize {
        self.rec.count_of(c)
    }
}

fn post(key: &str) -> Req {
    Req::new("POST", "/payments")
        .with("idempotency-key", key)
        .with("content-type", "application/json")
}

fn reply(action: Action) -> Reply {
    match action {
        Action::Respond(r) => r,
        other => panic!("expected a local reply, got {other:?}"),
    }
}

fn header<'a>(r: &'a Reply, name: &str) -> Option<&'a str> {
    r.headers.iter().find(|(n, _)| n == name).map(|(_, v)| &**v)
}

fn problem_type(r: &Reply) -> String {
    let p: idemgate_wire::Problem = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(p.status, r.status);
    assert_eq!(header(r, "content-type"), Some("application/problem+json"));
    p.type_uri
}

fn release(flow: &mut Flow) -> (&'static str, Vec<u8>) {
    let call = flow.take_release().expect("a release callout");
    (call.path, call.body)
}

const REJECT: &str = r#"[{"match":{"path_prefix":"/payments"}}]"#;
const QUEUE: &str = r#"[{"match":{"path_prefix":"/payments"},"on_conflict":"queue","queue":{"max_wait":"10s","max_queue":4}}]"#;

#[test]
fn no_rule_passes_untouched_after_one_header_read() {
    let mut gw = Gateway::rules(REJECT);
    let get = Req::new("GET", "/payments").with("idempotency-key", "k");
    let (flow, action) = gw.start(&get);
    assert!(flow.is_none() && action == Action::pass());
    assert_eq!(get.reads(), 1);
    assert!(gw.start(&Req::new("POST", "/other")).0.is_none());
    assert!(gw.rec.counts.is_empty());
}

#[test]
fn first_call_is_granted_fenced_and_its_response_stored() {
    let mut gw = Gateway::rules(REJECT);
    let (mut flow, claim, timeout) = gw.claim(&post("k1"));
    assert_eq!(claim.key.len(), 64);
    assert!(!claim.key.contains("k1"));
    assert_eq!(claim.mode, Mode::Idempotency);
    assert_eq!(claim.lease_ms, 30_000);
    assert!(claim.fingerprint.is_some());
    assert_eq!(claim.wait, None);
    assert_eq!(timeout, 1_000);
    let action = gw.grant(&mut flow, 7);
    assert_eq!(
        action,
        Action::Continue(vec![("x-fencing-token".into(), "7".into())])
    );
    assert_eq!(flow.fence(), Some(7));
    gw.respond(&mut flow, "201", "application/json", &[b"{\"id\":", b"1}"]);
    let (path, body) = release(&mut flow);
    assert_eq!(path, paths::COMPLETE);
    let (complete, payload): (CompleteRequest, &[u8]) = idemgate_wire::decode(&body).unwrap();
    assert_eq!(complete.owner, "owner-7");
    assert_eq!(complete.key, claim.key);
    assert_eq!(complete.retention_ms, 86_400_000);
    let stored = complete.response.unwrap();
    assert_eq!(stored.status, 201);
    assert_eq!(
        stored.headers,
        vec![("content-type".to_string(), "application/json".to_string())]
    );
    assert_eq!(payload, b"{\"id\":1}");
    assert!(!gw.end(&mut flow));
    assert!(flow.take_release().is_none(), "released exactly once");
    assert_eq!(gw.count(Counter::Granted), 1);
}

#[test]
fn duplicate_in_flight_on_this_gateway_is_rejected_without_a_callout() {
    let mut gw = Gateway::rules(REJECT);
    let (mut first, _, _) = gw.claim(&post("k"));
    gw.grant(&mut first, 1);
    gw.now += 1_000;
    let r = reply(gw.start(&post("k")).1);
    assert_eq!(r.status, 409);
    assert_eq!(problem_type(&r), types::IN_PROGRESS);
    assert_eq!(header(&r, "retry-after"), Some("29"));
    assert_eq!(
        (gw.count(Counter::LocalHits), gw.count(Counter::Rejected)),
        (1, 1)
    );
    // Other callers (another scope) are unaffected.
    let other = Req::new("POST", "/payments").with("idempotency-key", "k2");
    assert!(matches!(gw.start(&other).1, Action::Decide(_)));
}

#[test]
fn only_flows_with_work_left_need_keeping() {
    let mut gw = Gateway::rules(REJECT);
    let (mut first, _, _) = gw.claim(&post("k"));
    assert!(!first.is_done(), "its claim is out");
    gw.grant(&mut first, 1);
    assert!(!first.is_done(), "forwarded, holding both tiers' claims");
    // A duplicate answered here holds nothing and owes nothing: the glue drops it.
    let (dup, action) = gw.start(&post("k"));
    assert_eq!(reply(action).status, 409);
    assert!(dup.unwrap().is_done());
}

#[test]
fn duplicate_in_flight_on_another_gateway_is_rejected_by_the_sidecar() {
    let mut gw = Gateway::rules(REJECT);
    let (mut flow, _, _) = gw.claim(&post("k"));
    let busy = ClaimOutcome::Busy {
        retry_after_ms: 2_500,
        queue_len: 0,
        waited: false,
    };
    let r = reply(gw.answer_with(&mut flow, &busy, &[]));
    assert_eq!((r.status, header(&r, "retry-after")), (409, Some("3")));
    // The local slot was given back: a retry here goes to the sidecar again.
    assert!(matches!(gw.start(&post("k")).1, Action::Decide(_)));
}

#[test]
fn queued_duplicate_waits_at_the_sidecar_and_gets_the_stored_response() {
    let mut gw = Gateway::rules(QUEUE);
    let (mut first, first_claim, _) = gw.claim(&post("k"));
    assert_eq!(
        first_claim.wait,
        Some(WaitPolicy {
            budget_ms: 10_000,
            per_waiter_ms: 0,
            max_budget_ms: 10_000,
            max_queue: 4
        })
    );
    gw.grant(&mut first, 1);
    // Another gateway (its own shared data): its duplicate waits in the sidecar's queue.
    let mut gw = Gateway::rules(QUEUE);
    let (mut second, claim, timeout) = gw.claim(&post("k"));
    assert_eq!(claim.key, first_claim.key);
    assert!(
        timeout > 10_000,
        "the callout outlives the longest wait budget"
    );
    let done = ClaimOutcome::Completed {
        response: StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
        },
        waited_ms: 800,
    };
    let r = reply(gw.answer_with(&mut second, &done, b"{\"id\":1}"));
    assert_eq!((r.status, r.body.as_slice()), (201, &b"{\"id\":1}"[..]));
    assert_eq!(header(&r, "idempotent-replayed"), Some("true"));
    assert_eq!(
        (gw.count(Counter::Queued), gw.count(Counter::Replayed)),
        (1, 1)
    );
    assert!(gw.rec.samples.contains(&(Histogram::QueueWaitMs, 800)));
    assert!(!gw.end(&mut second));
    assert!(second.take_release().is_none());
}

#[test]
fn queued_lock_is_granted_in_turn() {
    let mut gw = Gateway::rules(
        r#"[{"mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp"},"key":{"path_param":"agent_id"},"on_conflict":"queue"}]"#,
    );
    let (mut flow, claim, _) = gw.claim(&Req::new("PUT", "/agents/a1/mcp"));
    assert_eq!((claim.mode, claim.fingerprint), (Mode::Lock, None));
    let granted = ClaimOutcome::Granted {
        owner: "o".into(),
        fence: 9,
        lease_ms: 30_000,
        waited_ms: 120,
    };
    assert!(
        matches!(gw.answer_with(&mut flow, &granted, &[]), Action::Continue(h) if h[0].1 == "9")
    );
    gw.respond(&mut flow, "200", "text/event-stream", &[b"data: x\n\n"]);
    let (path, body) = release(&mut flow);
    assert_eq!(
        path,
        paths::COMPLETE,
        "a lock is released whatever the response"
    );
    let (complete, _): (CompleteRequest, &[u8]) = idemgate_wire::decode(&body).unwrap();
    assert_eq!(complete.response, None);
    assert_eq!(gw.count(Counter::Queued), 1);
}

/// Lock mode, queued: a held agent lock on this gateway, then a queued request for it.
const QUEUED_LOCK: &str = r#"[{"mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp"},"key":{"path_param":"agent_id"},"on_conflict":"queue","queue":{"max_wait":"10s"},"lease":"30s"}]"#;

fn put(agent: &str) -> Req {
    Req::new("PUT", &format!("/agents/{agent}/mcp"))
}

fn granted_after_wait(fence: u64) -> ClaimOutcome {
    ClaimOutcome::Granted {
        owner: format!("owner-{fence}"),
        fence,
        lease_ms: 30_000,
        waited_ms: 100,
    }
}

fn tick(gw: &mut Gateway, flow: &mut Flow) -> Option<Action> {
    gw.with(|c, env| flow.on_local_wait_tick(c, env, &mut Lookups::default()))
}

#[test]
fn queued_claims_name_their_waiter_and_leave_when_the_client_goes() {
    let mut gw = Gateway::rules(QUEUE);
    let (mut first, claim, _) = gw.claim(&post("k"));
    let name = claim
        .waiter
        .clone()
        .expect("a queued claim names its waiter");
    assert_eq!(name.len(), 32);
    assert!(name.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(Limits::default().claim(&claim).is_ok());
    gw.grant(&mut first, 1);
    let (mut second, claim2, _) = gw.claim(&post("k2"));
    let name2 = claim2.waiter.clone().unwrap();
    assert_ne!(name, name2, "unique per claim");
    // Another gateway (its own secret) names the same request differently: the name cannot
    // be derived from what a client sees.
    let mut other = Gateway::rules(QUEUE);
    other.secret = [8; 32];
    other.next_owner = gw.next_owner - 1;
    let (_, claim3, _) = other.claim(&post("k"));
    assert_ne!(claim3.waiter.unwrap(), name2);

    // The client gives up while queued: its place is left by name, at once.
    assert!(gw.end(&mut second), "kept for the claim's answer");
    let (path, body) = release(&mut second);
    assert_eq!(path, paths::LEAVE);
    let (leave, _): (LeaveRequest, &[u8]) = idemgate_wire::decode(&body).unwrap();
    assert_eq!((leave.key, leave.waiter), (claim2.key, name2));
    assert!(
        Limits::default()
            .leave(&LeaveRequest {
                key: claim.key.clone(),
                waiter: name,
            })
            .is_ok()
    );
    // A grant that was on its way is aborted, as before.
    gw.answer_with(&mut second, &granted_after_wait(2), &[]);
    assert_eq!(release(&mut second).0, paths::ABORT);

    // The leave's answers: released is counted, stale (answered meanwhile) loses no lease.
    let mut rec = Recorder::default();
    let released = idemgate_wire::encode(&OwnerOutcome::Released, &[]);
    let stale = idemgate_wire::encode(&OwnerOutcome::Stale, &[]);
    let http = |body| Answer::Http { status: 200, body };
    assert_eq!(
        on_leave_answer(http(&released), &mut rec),
        ReleaseResult::Done
    );
    assert_eq!(
        on_leave_answer(http(&stale), &mut rec),
        ReleaseResult::Stale
    );
    assert_eq!(
        on_leave_answer(Answer::Failed, &mut rec),
        ReleaseResult::Retry
    );
    assert_eq!(
        (
            rec.count_of(Counter::QueueLeft),
            rec.count_of(Counter::LeaseLost)
        ),
        (1, 0)
    );

    // With the breaker open no leave goes out (the place ends with its budget).
    let (mut third, _, _) = gw.claim(&post("k3"));
    for _ in 0..5 {
        gw.breaker.failure(&gw.config.breaker, gw.now);
    }
    assert!(gw.end(&mut third));
    assert!(third.take_release().is_none());

    // Claims that do not wait name no waiter and leave nothing.
    let mut reject = Gateway::rules(REJECT);
    let (mut flow, claim, _) = reject.claim(&post("k"));
    assert_eq!(claim.waiter, None);
    assert!(reject.end(&mut flow));
    assert!(flow.take_release().is_none());
}

#[test]
fn queue_grants_hold_the_local_slot_so_fail_local_catches_a_later_duplicate() {
    let json =
        format!(r#"{{"sidecar":{{"cluster":"s"}},"failure_mode":"local","rules":{QUEUED_LOCK}}}"#);
    let mut gw = Gateway::new(&json);
    let (mut first, _, _) = gw.claim(&put("a1"));
    assert!(matches!(gw.grant(&mut first, 1), Action::Continue(_)));
    let (mut second, _, _) = gw.claim(&put("a1"));
    // A finishes; the sidecar hands the key to the queued request.
    gw.respond(&mut first, "200", "application/json", &[b"{}"]);
    let action = gw.answer_with(&mut second, &granted_after_wait(2), &[]);
    assert_eq!(
        action,
        Action::Continue(vec![("x-fencing-token".into(), "2".into())])
    );
    // The sidecar goes down: a duplicate here meets the running call's local entry.
    let (mut third, _, _) = gw.claim(&put("a1"));
    let r = reply(gw.answer(&mut third, Answer::Failed));
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (409, types::IN_PROGRESS)
    );
    // Once it ends, the next one runs (marked local).
    gw.respond(&mut second, "200", "application/json", &[b"{}"]);
    let (mut fourth, _, _) = gw.claim(&put("a1"));
    assert_eq!(
        gw.answer(&mut fourth, Answer::Failed),
        Action::Continue(vec![("x-idemgate-degraded".into(), "local".into())])
    );
}

#[test]
fn fail_local_fails_closed_when_no_local_slot_can_be_taken() {
    // One slot: any two keys collide, as keys an attacker chose would.
    let json = |rules: &str| {
        format!(
            r#"{{"sidecar":{{"cluster":"s"}},"failure_mode":"local","local":{{"slots":1,"probes":1}},"rules":{rules}}}"#
        )
    };
    let mut gw = Gateway::new(&json(REJECT));
    let (mut holder, _, _) = gw.claim(&post("a"));
    assert!(matches!(
        gw.answer(&mut holder, Answer::Failed),
        Action::Continue(_)
    ));
    // Another key finds no slot: refused at once, before any callout, and so is its duplicate.
    for _ in 0..2 {
        let r = reply(gw.start(&post("x")).1);
        assert_eq!(
            (r.status, problem_type(&r).as_str()),
            (503, types::UNAVAILABLE)
        );
    }
    assert_eq!(gw.count(Counter::LocalUnavailable), 2);
    // The holder's own duplicate is a 409, as the README promises.
    assert_eq!(reply(gw.start(&post("a")).1).status, 409);

    // Queue policy: the slot is taken at the grant; without one the grant is given back.
    let mut gw = Gateway::new(&json(QUEUED_LOCK));
    let (mut holder, _, _) = gw.claim(&put("a"));
    gw.grant(&mut holder, 1);
    let (mut other, _, _) = gw.claim(&put("b"));
    let r = reply(gw.answer_with(&mut other, &granted_after_wait(2), &[]));
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (503, types::UNAVAILABLE)
    );
    let (path, body) = release(&mut other);
    assert_eq!(path, paths::ABORT);
    let (abort, _): (AbortRequest, &[u8]) = idemgate_wire::decode(&body).unwrap();
    assert_eq!(abort.owner, "owner-2");
    // The sidecar down too: refused the same way.
    let (mut down, _, _) = gw.claim(&put("b"));
    assert_eq!(reply(gw.answer(&mut down, Answer::Failed)).status, 503);

    // Other failure modes keep deciding at the sidecar when no slot is free.
    let mut gw =
        Gateway::new(r#"{"sidecar":{"cluster":"s"},"local":{"slots":1,"probes":1},"rules":[{}]}"#);
    let (mut holder, _, _) = gw.claim(&post("a"));
    gw.grant(&mut holder, 1);
    let (mut flow, _, _) = gw.claim(&post("x"));
    assert!(matches!(gw.grant(&mut flow, 2), Action::Continue(_)));
}

#[test]
fn local_tier_vetoes_a_queue_grant_while_another_request_here_runs_the_key() {
    let mut gw = Gateway::new(&format!(
        r#"{{"sidecar":{{"cluster":"s"}},"failure_mode":"local","rules":{QUEUED_LOCK}}}"#
    ));
    let (mut holder, _, _) = gw.claim(&put("a1"));
    gw.grant(&mut holder, 1);
    let (mut waiter, _, _) = gw.claim(&put("a1"));
    // Redis restarted empty: the sidecar forgot the holder and grants the waiter.
    assert_eq!(
        gw.answer_with(&mut waiter, &granted_after_wait(2), &[]),
        Action::Wait,
        "not beside the holder this gateway sees running"
    );
    assert!(waiter.holds_request() && waiter.waits_locally());
    assert_eq!(gw.count(Counter::LocalVetoes), 1);
    gw.now += 1_000;
    assert_eq!(tick(&mut gw, &mut waiter), None, "still running");
    // The grant is kept alive meanwhile.
    assert!(gw.due(&mut waiter, gw.now + 15_000).is_some());
    // The holder ends: the next tick lets the waiter through with its own fence, holding
    // the local slot.
    gw.respond(&mut holder, "200", "application/json", &[b"{}"]);
    assert_eq!(
        tick(&mut gw, &mut waiter),
        Some(Action::Continue(vec![(
            "x-fencing-token".into(),
            "2".into()
        )]))
    );
    assert!(waiter.watches_response());
    let (mut dup, _, _) = gw.claim(&put("a1"));
    assert_eq!(
        reply(gw.answer(&mut dup, Answer::Failed)).status,
        409,
        "the waiter holds this gateway's slot now"
    );
    gw.respond(&mut waiter, "200", "application/json", &[b"{}"]);
    assert_eq!(release(&mut waiter).0, paths::COMPLETE);
}

#[test]
fn a_vetoed_grant_is_given_back_on_every_other_path() {
    // The wait budget (10 s from the claim) runs out while the holder still runs.
    let mut gw = Gateway::rules(QUEUED_LOCK);
    let (mut holder, _, _) = gw.claim(&put("a1"));
    gw.grant(&mut holder, 1);
    let (mut waiter, _, _) = gw.claim(&put("a1"));
    gw.answer_with(&mut waiter, &granted_after_wait(2), &[]);
    gw.now += 10_000;
    let r = reply(tick(&mut gw, &mut waiter).unwrap());
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (503, types::WAIT_EXPIRED)
    );
    let (path, body) = release(&mut waiter);
    assert_eq!(path, paths::ABORT);
    let (abort, _): (AbortRequest, &[u8]) = idemgate_wire::decode(&body).unwrap();
    assert_eq!(abort.owner, "owner-2");
    assert!(!gw.end(&mut waiter));

    // The client leaves while it waits here: nothing ran, the grant goes back at once.
    let (mut waiter, _, _) = gw.claim(&put("a1"));
    gw.answer_with(&mut waiter, &granted_after_wait(3), &[]);
    assert!(!gw.end(&mut waiter), "no answer still due");
    assert_eq!(release(&mut waiter).0, paths::ABORT);
    assert_eq!(tick(&mut gw, &mut waiter), None);
    // The holder's slot is untouched by all this.
    assert_eq!(gw.count(Counter::LocalVetoes), 2);
    gw.respond(&mut holder, "200", "application/json", &[b"{}"]);

    // Shadow mode never waits nor blocks: the grant is forwarded, the veto only counted.
    let mut gw = Gateway::new(&format!(
        r#"{{"sidecar":{{"cluster":"s"}},"shadow":true,"rules":{QUEUED_LOCK}}}"#
    ));
    let (mut holder, _, _) = gw.claim(&put("a1"));
    gw.grant(&mut holder, 1);
    let (mut dup, _, _) = gw.claim(&put("a1"));
    assert_eq!(
        gw.grant(&mut dup, 2),
        Action::Continue(vec![("x-fencing-token".into(), "2".into())])
    );
    assert!(dup.take_release().is_none(), "the grant is kept: it runs");
    assert_eq!(gw.count(Counter::ShadowWouldBlock), 1);
}

#[test]
fn queued_requests_take_no_local_slot_while_they_wait_so_hand_offs_are_fifo() {
    // Waiters on this gateway hold nothing here: whichever the sidecar grants first runs at
    // once (a waiter holding the slot would block the earlier one the sidecar picked).
    let mut gw = Gateway::rules(QUEUED_LOCK);
    let (mut holder, _, _) = gw.claim(&put("a1"));
    gw.grant(&mut holder, 1);
    let (mut second, _, _) = gw.claim(&put("a1"));
    gw.respond(&mut holder, "200", "application/json", &[b"{}"]);
    // A third arrives after the holder's local release, before the sidecar's hand-off.
    let (mut third, _, _) = gw.claim(&put("a1"));
    assert!(matches!(
        gw.answer_with(&mut second, &granted_after_wait(2), &[]),
        Action::Continue(_)
    ));
    gw.respond(&mut second, "200", "application/json", &[b"{}"]);
    assert!(matches!(
        gw.answer_with(&mut third, &granted_after_wait(3), &[]),
        Action::Continue(_)
    ));
    assert_eq!(gw.count(Counter::LocalVetoes), 0);
}

#[test]
fn queue_limits_answer_429_and_503() {
    let mut gw = Gateway::rules(QUEUE);
    let (mut a, _, _) = gw.claim(&post("a"));
    let full = ClaimOutcome::QueueFull {
        retry_after_ms: 1_000,
        queue_len: 4,
    };
    let r = reply(gw.answer_with(&mut a, &full, &[]));
    assert_eq!(
        (
            r.status,
            problem_type(&r).as_str(),
            header(&r, "retry-after")
        ),
        (429, types::QUEUE_FULL, Some("1"))
    );
    let (mut b, _, _) = gw.claim(&post("b"));
    let expired = ClaimOutcome::Busy {
        retry_after_ms: 4_000,
        queue_len: 2,
        waited: true,
    };
    let r = reply(gw.answer_with(&mut b, &expired, &[]));
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (503, types::WAIT_EXPIRED)
    );
}

#[test]
fn duplicate_after_completion_is_replayed_locally_byte_for_byte() {
    let mut gw = Gateway::rules(REJECT);
    let (mut first, _, _) = gw.claim(&post("k"));
    gw.grant(&mut first, 1);
    gw.respond(
        &mut first,
        "201",
        "application/json",
        &[b"{\"id\":", b"\"p_1\"}"],
    );
    gw.now += 60_000;
    let r = reply(gw.start(&post("k")).1);
    assert_eq!(
        (r.status, r.body.as_slice()),
        (201, &b"{\"id\":\"p_1\"}"[..])
    );
    assert_eq!(
        r.headers,
        vec![
            ("content-type".into(), "application/json".into()),
            ("idempotent-replayed".into(), "true".into())
        ]
    );
    assert_eq!(
        (gw.count(Counter::LocalHits), gw.count(Counter::Replayed)),
        (1, 1)
    );
}

#[test]
fn replay_from_the_sidecar_fills_the_local_tier() {
    let mut gw = Gateway::rules(REJECT);
    let (mut flow, _, _) = gw.claim(&post("k"));
    let done = ClaimOutcome::Completed {
        response: StoredResponse {
            status: 200,
            headers: vec![],
        },
        waited_ms: 0,
    };
    assert_eq!(reply(gw.answer_with(&mut flow, &done, b"ok")).status, 200);
    let r = reply(gw.start(&post("k")).1);
    assert_eq!((r.status, r.body.as_slice()), (200, &b"ok"[..]));
    assert_eq!(gw.count(Counter::LocalHits), 1);
}

#[test]
fn key_reuse_with_another_request_is_422() {
    let mut gw = Gateway::rules(REJECT);
    let (mut first, _, _) = gw.claim(&post("k"));
    gw.grant(&mut first, 1);
    gw.respond(&mut first, "201", "application/json", &[b"{}"]);
    let other = Req::new("POST", "/payments/2")
        .with("idempotency-key", "k")
        .with("content-type", "application/json");
    let r = reply(gw.start(&other).1);
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (422, types::MISMATCH)
    );
    // And the sidecar's verdict for a request this gateway has not seen.
    let (mut flow, _, _) = gw.claim(&post("k-other"));
    let r = reply(gw.answer_with(&mut flow, &ClaimOutcome::Mismatch, &[]));
    assert_eq!(r.status, 422);
    assert_eq!(gw.count(Counter::Mismatch), 2);
}

#[test]
fn missing_and_invalid_keys() {
    let mut gw = Gateway::rules(REJECT);
    let r = reply(gw.start(&Req::new("POST", "/payments")).1);
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (400, types::MISSING_KEY)
    );
    assert!(header(&r, "retry-after").is_none());
    let r = reply(
        gw.start(&Req::new("POST", "/payments").with("idempotency-key", &"x".repeat(256)))
            .1,
    );
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (400, types::INVALID_KEY)
    );
    assert_eq!(
        (gw.count(Counter::MissingKey), gw.count(Counter::InvalidKey)),
        (1, 1)
    );
    let mut optional = Gateway::rules(r#"[{"key":{"required":false}}]"#);
    let (flow, action) = optional.start(&Req::new("POST", "/payments"));
    assert!(flow.is_none() && action == Action::pass());
    assert_eq!(optional.count(Counter::Bypassed), 1);
}

#[test]
fn cas_lost_to_another_worker_is_a_local_duplicate() {
    let mut gw = Gateway::rules(REJECT);
    let (_, probe, _) = gw.claim(&post("probe"));
    let _ = probe;
    // Compute the stored key of "k" by claiming it on a scratch gateway.
    let mut scratch = Gateway::rules(REJECT);
    let (_, claim, _) = scratch.claim(&post("k"));
    gw.shared.interfere_once(claim.key, gw.now + 5_000);
    let r = reply(gw.start(&post("k")).1);
    assert_eq!((r.status, header(&r, "retry-after")), (409, Some("5")));
}

#[test]
fn sidecar_failures_fail_closed_by_default() {
    let failures: [Answer<'_>; 5] = [
        Answer::Failed,
        Answer::Http {
            status: 504,
            body: b"upstream request timeout",
        },
        Answer::Http {
            status: 503,
            body: b"{\"type\":\"urn:idemgate:problem:store-unavailable\"}",
        },
        Answer::Http {
            status: 200,
            body: b"{\"outcome\":\"granted\"",
        },
        Answer::Http {
            status: 200,
            body: b"{\"outcome\":\"granted\",\"owner\":\"has space\",\"fence\":1,\"lease_ms\":5}",
        },
    ];
    for failure in failures {
        let mut gw = Gateway::rules(REJECT);
        let (mut flow, _, _) = gw.claim(&post("k"));
        let r = reply(gw.answer(&mut flow, failure));
        assert_eq!(
            (
                r.status,
                problem_type(&r).as_str(),
                header(&r, "retry-after")
            ),
            (503, types::UNAVAILABLE, Some("5"))
        );
        assert_eq!(
            (
                gw.count(Counter::FailedClosed),
                gw.count(Counter::SidecarErrors)
            ),
            (1, 1)
        );
        assert!(flow.take_release().is_none());
        // The local slot is free again: the client's retry is not a local duplicate.
        assert!(matches!(gw.start(&post("k")).1, Action::Decide(_)));
    }
}

#[test]
fn fail_open_forwards_marked_and_keeps_the_local_claim() {
    let mut gw = Gateway::new(r#"{"sidecar":{"cluster":"s"},"failure_mode":"open","rules":[{}]}"#);
    let (mut flow, _, _) = gw.claim(&post("k"));
    assert_eq!(
        gw.answer(&mut flow, Answer::Failed),
        Action::Continue(vec![("x-idemgate-degraded".into(), "open".into())])
    );
    assert_eq!(gw.count(Counter::FailedOpen), 1);
    assert_eq!(
        reply(gw.start(&post("k")).1).status,
        409,
        "duplicates here are still caught locally"
    );
    gw.respond(&mut flow, "201", "application/json", &[b"{}"]);
    assert!(
        flow.take_release().is_none(),
        "nothing to release at the sidecar without a grant"
    );
    assert_eq!(
        reply(gw.start(&post("k")).1).status,
        201,
        "replayed from the local tier"
    );
}

#[test]
fn fail_local_decides_on_shared_data() {
    let json =
        r#"{"sidecar":{"cluster":"s"},"failure_mode":"local","rules":[{"on_conflict":"queue"}]}"#;
    let mut gw = Gateway::new(json);
    let (mut first, _, _) = gw.claim(&post("k"));
    assert_eq!(
        gw.answer(&mut first, Answer::Failed),
        Action::Continue(vec![("x-idemgate-degraded".into(), "local".into())])
    );
    // Queue policy, local duplicate, sidecar down: it waits here for the first's outcome.
    let (second, action) = gw.start(&post("k"));
    let mut second = second.unwrap();
    assert_eq!(action, Action::Wait);
    gw.respond(&mut first, "201", "application/json", &[b"{}"]);
    let r = reply(tick(&mut gw, &mut second).unwrap());
    assert_eq!(
        (r.status, header(&r, "idempotent-replayed")),
        (201, Some("true"))
    );
    assert_eq!(gw.count(Counter::FailedLocal), 1);
}

#[test]
fn fail_local_forwards_keep_their_local_entry_past_one_lease() {
    let json = r#"{"sidecar":{"cluster":"s"},"failure_mode":"local","rules":[{"lease":"10s"}]}"#;
    let mut gw = Gateway::new(json);
    let (mut first, _, _) = gw.claim(&post("k"));
    let start = gw.now;
    assert!(matches!(
        gw.answer(&mut first, Answer::Failed),
        Action::Continue(_)
    ));
    assert_eq!(gw.due(&mut first, start + 4_999), None);
    assert_eq!(gw.count(Counter::LeaseRenewals), 0, "not before half-lease");
    // Ticks at half-lease extend the entry without a callout: no grant to renew.
    for tick in 1..=5 {
        assert_eq!(gw.due(&mut first, start + tick * 5_000), None);
    }
    assert_eq!(gw.count(Counter::LeaseRenewals), 5);
    gw.now = start + 29_000;
    let r = reply(gw.start(&post("k")).1);
    assert_eq!(
        r.status, 409,
        "three leases later the call still holds the key"
    );
    // The response releases it as usual.
    gw.respond(&mut first, "201", "application/json", &[b"{}"]);
    let replay = reply(gw.start(&post("k")).1);
    assert_eq!(replay.status, 201);
    // A flow whose entry was taken over (a tick came after expiry) counts a lost lease.
    let (mut late, _, _) = gw.claim(&post("k2"));
    let start = gw.now;
    gw.answer(&mut late, Answer::Failed);
    gw.now = start + 10_001;
    let (_taker, _, _) = gw.claim(&post("k2"));
    assert_eq!(gw.due(&mut late, start + 10_002), None);
    assert_eq!(gw.count(Counter::LeaseLost), 1);
}

#[test]
fn breaker_opens_and_skips_the_callout() {
    let mut gw = Gateway::rules(REJECT);
    for i in 0..5 {
        let (mut flow, _, _) = gw.claim(&post(&format!("k{i}")));
        assert_eq!(reply(gw.answer(&mut flow, Answer::Failed)).status, 503);
    }
    let r = reply(gw.start(&post("next")).1);
    assert_eq!(r.status, 503);
    assert_eq!(gw.count(Counter::BreakerOpen), 1);
    // After the cooldown one probe goes out; its success closes the breaker.
    gw.now += 5_000;
    let (mut probe, _, _) = gw.claim(&post("probe"));
    assert_eq!(reply(gw.start(&post("during-probe")).1).status, 503);
    assert!(matches!(gw.grant(&mut probe, 1), Action::Continue(_)));
    assert!(matches!(gw.start(&post("after")).1, Action::Decide(_)));
}

#[test]
fn client_abort_at_each_phase_releases_everything() {
    // While the claim is out: the slot is freed now, a late grant is aborted.
    let mut gw = Gateway::rules(REJECT);
    let (mut flow, _, _) = gw.claim(&post("k"));
    assert!(gw.end(&mut flow), "kept until the claim's answer arrives");
    assert!(
        matches!(gw.start(&post("k")).1, Action::Decide(_)),
        "local slot freed"
    );
    assert_eq!(gw.grant(&mut flow, 3), Action::pass());
    let (path, body) = release(&mut flow);
    assert_eq!(path, paths::ABORT);
    let (abort, _): (AbortRequest, &[u8]) = idemgate_wire::decode(&body).unwrap();
    assert_eq!(abort.owner, "owner-3");
    assert_eq!(gw.count(Counter::Abandoned), 1);
    // Abandoned, and the sidecar answered something else: nothing to release.
    let (mut flow, _, _) = gw.claim(&post("k2"));
    gw.end(&mut flow);
    gw.answer_with(
        &mut flow,
        &ClaimOutcome::Busy {
            retry_after_ms: 1,
            queue_len: 0,
            waited: false,
        },
        &[],
    );
    assert!(flow.take_release().is_none());

    // Upstream, before or during the response, with `on_client_abort: release`.
    for respond_first in [false, true] {
        let mut gw = Gateway::rules(r#"[{"on_client_abort":"release"}]"#);
        let (mut flow, _, _) = gw.claim(&post("k"));
        gw.grant(&mut flow, 1);
        if respond_first {
            let headers = vec![(":status".to_string(), b"200".to_vec())];
            gw.with(|c, env| flow.on_response_headers(c, &headers, false, env));
            gw.with(|c, env| flow.on_response_body(c, b"partial", false, env));
        }
        assert!(!gw.end(&mut flow));
        assert_eq!(release(&mut flow).0, paths::ABORT);
        assert!(
            matches!(gw.start(&post("k")).1, Action::Decide(_)),
            "local slot freed"
        );
    }

    // While the body is being fingerprinted: nothing was claimed yet.
    let mut gw = Gateway::new(
        r#"{"sidecar":{"cluster":"s"},"allow_on_headers_stop_iteration":true,"rules":[{}]}"#,
    );
    let (flow, action) = gw.start_with_eos(&post("k"), false);
    let mut flow = flow.unwrap();
    assert_eq!(action, Action::Pause);
    assert!(!gw.end(&mut flow));
    assert!(flow.take_release().is_none());
}

#[test]
fn client_abort_after_forwarding_holds_the_key_until_its_lease_ends() {
    // The default (`hold`): the backend may still be running the call.
    for respond_first in [false, true] {
        let mut gw = Gateway::rules(r#"[{"lease":"10s"}]"#);
        let (mut flow, _, _) = gw.claim(&post("k"));
        gw.grant(&mut flow, 1);
        if respond_first {
            let headers = vec![(":status".to_string(), b"200".to_vec())];
            gw.with(|c, env| flow.on_response_headers(c, &headers, false, env));
            gw.with(|c, env| flow.on_response_body(c, b"partial", false, env));
        }
        assert!(!gw.end(&mut flow), "nothing to wait for");
        assert!(flow.take_release().is_none(), "the sidecar claim is kept");
        assert_eq!(gw.count(Counter::AbandonedUpstream), 1);
        gw.now += 6_000;
        assert!(
            gw.with(|c, env| flow.renewal_due(c, env)).is_none(),
            "no longer renewed past half the lease"
        );
        let (_, retry) = gw.start(&post("k"));
        assert_eq!(reply(retry).status, 409, "a retry meets the held key");
        gw.now += 4_001;
        assert!(
            matches!(gw.start(&post("k")).1, Action::Decide(_)),
            "claimable once the lease ran out"
        );
    }
}

#[test]
fn upstream_errors_abort_so_the_retry_runs_again() {
    for status in ["500", "503", "504", "408", "429"] {
        let mut gw = Gateway::rules(REJECT);
        let (mut flow, _, _) = gw.claim(&post("k"));
        gw.grant(&mut flow, 1);
        gw.respond(&mut flow, status, "application/json", &[b"{}"]);
        assert_eq!(release(&mut flow).0, paths::ABORT, "{status}");
        assert!(matches!(gw.start(&post("k")).1, Action::Decide(_)));
    }
}

#[test]
fn body_fingerprint_with_allow_on_headers_stop_iteration() {
    let json = r#"{"sidecar":{"cluster":"s"},"allow_on_headers_stop_iteration":true,"rules":[{"fingerprint":{"max_body_bytes":8}}]}"#;
    let claim_with = |body: &[u8]| {
        let mut gw = Gateway::new(json);
        let (flow, action) = gw.start_with_eos(&post("k"), false);
        let mut flow = flow.unwrap();
        assert_eq!(action, Action::Pause);
        assert!(flow.holds_request());
        let mut reads = 0;
        let mut read = |n: usize| {
            reads += 1;
            Some(body[..n].to_vec())
        };
        let half = body.len() / 2;
        assert_eq!(
            gw.with(|c, env| flow.on_request_body(c, &post("k"), half, false, &mut read, env)),
            Action::Pause
        );
        let action =
            gw.with(|c, env| flow.on_request_body(c, &post("k"), body.len(), true, &mut read, env));
        assert_eq!(
            reads,
            usize::from(!body.is_empty() && body.len() <= 8),
            "the body is read once, at its end"
        );
        action
    };
    let fp = |action: Action| {
        let Action::Decide(call) = action else {
            panic!("{action:?}")
        };
        let (claim, _): (ClaimRequest, &[u8]) = idemgate_wire::decode(&call.body).unwrap();
        claim.fingerprint.unwrap()
    };
    assert_ne!(fp(claim_with(b"{\"a\":1}")), fp(claim_with(b"{\"a\":2}")));
    assert_eq!(fp(claim_with(b"{\"a\":1}")), fp(claim_with(b"{\"a\":1}")));
    let r = reply(claim_with(b"123456789"));
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (413, types::TOO_LARGE)
    );
    // A body-less request fingerprints like an empty body.
    let mut gw = Gateway::new(json);
    let (_, a) = gw.start_with_eos(&post("k"), true);
    assert_eq!(fp(a), fp(claim_with(b"")));
}

#[test]
fn shadow_mode_decides_counts_and_never_blocks() {
    let mut gw = Gateway::new(
        r#"{"sidecar":{"cluster":"s"},"shadow":true,"rules":[{"on_conflict":"queue"}]}"#,
    );
    let (flow, action) = gw.start(&Req::new("POST", "/x"));
    assert!(flow.is_none() && action == Action::pass());
    let (mut first, claim, _) = gw.claim(&post("k"));
    assert_eq!(claim.wait, None, "shadow mode never waits");
    gw.grant(&mut first, 1);
    let (mut dup, _, _) = gw.claim(&post("k"));
    let busy = ClaimOutcome::Busy {
        retry_after_ms: 1,
        queue_len: 0,
        waited: false,
    };
    assert_eq!(gw.answer_with(&mut dup, &busy, &[]), Action::pass());
    let (mut down, _, _) = gw.claim(&post("k3"));
    assert_eq!(gw.answer(&mut down, Answer::Failed), Action::pass());
    assert_eq!(gw.count(Counter::ShadowWouldBlock), 3);
    assert!(!gw.end(&mut dup) && dup.take_release().is_none());
}

#[test]
fn a_rules_shadow_overrides_the_top_level_one() {
    // Shadow on one rule only: its local duplicate is forwarded and counted; the other rule
    // still refuses.
    let mut gw = Gateway::new(
        r#"{"sidecar":{"cluster":"s"},"rules":[
            {"name":"tried","match":{"path_prefix":"/tried"},"shadow":true},
            {"name":"enforced"}]}"#,
    );
    let tried = |key: &str| Req::new("POST", "/tried").with("idempotency-key", key);
    let (mut first, _, _) = gw.claim(&tried("k"));
    gw.grant(&mut first, 1);
    assert_eq!(gw.start(&tried("k")).1, Action::pass());
    assert_eq!(gw.count(Counter::ShadowWouldBlock), 1);
    let (mut other, _, _) = gw.claim(&post("k"));
    gw.grant(&mut other, 2);
    assert_eq!(reply(gw.start(&post("k")).1).status, 409);
    assert_eq!(gw.count(Counter::ShadowWouldBlock), 1);

    // Shadow everywhere but on one rule: that rule blocks.
    let mut gw =
        Gateway::new(r#"{"sidecar":{"cluster":"s"},"shadow":true,"rules":[{"shadow":false}]}"#);
    let (mut first, _, _) = gw.claim(&post("k"));
    gw.grant(&mut first, 1);
    assert_eq!(reply(gw.start(&post("k")).1).status, 409);
    assert_eq!(gw.count(Counter::ShadowWouldBlock), 0);
}

#[test]
fn renewals_on_half_lease_and_lease_loss() {
    let mut gw = Gateway::rules(REJECT);
    let (mut flow, _, _) = gw.claim(&post("k"));
    gw.grant(&mut flow, 1);
    let cfg = gw.config.clone();
    assert!(gw.due(&mut flow, gw.now + 14_999).is_none());
    let call = gw.due(&mut flow, gw.now + 15_000).unwrap();
    assert!(
        gw.due(&mut flow, gw.now + 15_001).is_none(),
        "one renewal at a time"
    );
    let (renew, _): (RenewRequest, &[u8]) = idemgate_wire::decode(&call.body).unwrap();
    assert_eq!((renew.owner.as_str(), renew.lease_ms), ("owner-1", 30_000));
    gw.now += 15_000;
    let ok = idemgate_wire::encode(&OwnerOutcome::Renewed { lease_ms: 30_000 }, &[]);
    gw.with(|_, env| {
        flow.on_renew_answer(
            &cfg,
            Answer::Http {
                status: 200,
                body: &ok,
            },
            env,
        )
    });
    assert!(gw.due(&mut flow, gw.now + 14_999).is_none());
    // The renewal moved this gateway's entry too: past the first lease a duplicate here is
    // still rejected locally (it ends 30 s after the renewal, 20 s from here).
    gw.now += 20_000;
    let r = reply(gw.start(&post("k")).1);
    assert_eq!((r.status, header(&r, "retry-after")), (409, Some("10")));
    gw.now -= 20_000;
    let _ = gw.due(&mut flow, gw.now + 15_000).unwrap();
    gw.with(|_, env| flow.on_renew_answer(&cfg, Answer::Failed, env));
    assert!(
        gw.due(&mut flow, gw.now + 15_000).is_some(),
        "a failed renewal is retried"
    );
    let stale = idemgate_wire::encode(&OwnerOutcome::Stale, &[]);
    gw.with(|_, env| {
        flow.on_renew_answer(
            &cfg,
            Answer::Http {
                status: 200,
                body: &stale,
            },
            env,
        )
    });
    assert!(gw.due(&mut flow, u64::MAX - 1).is_none());
    assert_eq!(
        (
            gw.count(Counter::LeaseRenewals),
            gw.count(Counter::LeaseLost)
        ),
        (1, 1)
    );
}

#[test]
fn release_answers() {
    let mut rec = Recorder::default();
    let released = idemgate_wire::encode(&OwnerOutcome::Released, &[]);
    let stale = idemgate_wire::encode(&OwnerOutcome::Stale, &[]);
    assert_eq!(
        on_release_answer(
            Answer::Http {
                status: 200,
                body: &released
            },
            &mut rec
        ),
        ReleaseResult::Done
    );
    assert_eq!(
        on_release_answer(
            Answer::Http {
                status: 200,
                body: &stale
            },
            &mut rec
        ),
        ReleaseResult::Stale
    );
    assert_eq!(
        on_release_answer(
            Answer::Http {
                status: 503,
                body: b""
            },
            &mut rec
        ),
        ReleaseResult::Retry
    );
    assert_eq!(
        on_release_answer(Answer::Failed, &mut rec),
        ReleaseResult::Retry
    );
    assert_eq!(
        on_release_answer(
            Answer::Http {
                status: 200,
                body: b"[]"
            },
            &mut rec
        ),
        ReleaseResult::Retry
    );
}

#[test]
fn scope_headers_and_properties_separate_callers() {
    let mut gw = Gateway::rules(
        r#"[{"scope":{"headers":["x-user-id"],"properties":[["source","principal"]]}}]"#,
    );
    let a = post("k")
        .with("x-user-id", "alice")
        .with_property(&["source", "principal"], "spiffe://a");
    let b = post("k")
        .with("x-user-id", "alice")
        .with_property(&["source", "principal"], "spiffe://b");
    let (_, ca, _) = gw.claim(&a);
    let (_, cb, _) = gw.claim(&b);
    assert_ne!(ca.key, cb.key);
}

#[test]
fn local_tier_host_errors_fall_back_to_the_sidecar() {
    let mut gw = Gateway::rules(REJECT);
    gw.shared.fail.set(true);
    let (mut flow, _, _) = gw.claim(&post("k"));
    assert_eq!(gw.count(Counter::LocalUnavailable), 1);
    gw.grant(&mut flow, 1);
    gw.respond(&mut flow, "201", "application/json", &[b"{}"]);
    assert_eq!(release(&mut flow).0, paths::COMPLETE);
}

// === rate limits ===

fn rate_rules(tier: &str, extra: &str) -> String {
    format!(
        r#"[{{"scope":{{"headers":["x-user"]}},"rate":{{"tier":"{tier}","limits":[{{"by":"scope","requests":2,"per":"1s"}}]{extra}}}}}]"#
    )
}

fn user_post(key: &str) -> Req {
    post(key).with("x-user", "alice")
}

/// Starts a request and expects the `/v1/rate` callout; returns the flow and the checks.
fn rate_callout(gw: &mut Gateway, req: &Req) -> (Flow, RateRequest) {
    let (flow, action) = gw.start(req);
    let Action::Decide(call) = action else {
        panic!("expected the rate callout, got {action:?}")
    };
    assert_eq!(call.path, paths::RATE);
    let (request, _): (RateRequest, &[u8]) = idemgate_wire::decode(&call.body).unwrap();
    (flow.unwrap(), request)
}

fn rate_answer(gw: &mut Gateway, flow: &mut Flow, results: &[idemgate_wire::RateResult]) -> Action {
    let body = idemgate_wire::encode(
        &RateOutcome {
            results: results.to_vec(),
        },
        &[],
    );
    gw.answer(
        flow,
        Answer::Http {
            status: 200,
            body: &body,
        },
    )
}

const ALLOWED: idemgate_wire::RateResult = idemgate_wire::RateResult {
    allowed: true,
    remaining: 1,
    retry_after_ms: 0,
    reset_ms: 500,
};
const LIMITED: idemgate_wire::RateResult = idemgate_wire::RateResult {
    allowed: false,
    remaining: 0,
    retry_after_ms: 1_200,
    reset_ms: 1_000,
};

#[test]
fn local_rate_limit_answers_429_without_a_callout_and_refills() {
    let mut gw = Gateway::rules(&rate_rules("local", ""));
    for k in ["a", "b"] {
        gw.claim(&user_post(k));
    }
    let r = reply(gw.start(&user_post("c")).1);
    assert_eq!(r.status, 429);
    assert_eq!(problem_type(&r), "urn:idemgate:problem:rate-limited");
    assert_eq!(header(&r, "retry-after"), Some("1"));
    assert_eq!(header(&r, "ratelimit-policy"), Some("\"scope\";q=2;w=1"));
    assert_eq!(header(&r, "ratelimit"), Some("\"scope\";r=0;t=1"));
    // Another caller has its own budget.
    gw.claim(&post("d").with("x-user", "bob"));
    // Half a second later one more request of the caller fits, and only one.
    gw.now += 500;
    gw.claim(&user_post("e"));
    assert_eq!(reply(gw.start(&user_post("f")).1).status, 429);
    assert_eq!(
        (
            gw.count(Counter::RateAllowedLocal),
            gw.count(Counter::RateLimitedLocal)
        ),
        (4, 2)
    );
    assert_eq!(
        gw.rec.rate.iter().filter(|(_, limited)| *limited).count(),
        2
    );
}

/// A body-fingerprinted request over its local limit is answered at request headers: its
/// body is neither buffered nor hashed, and the limit is spent once per request.
#[test]
fn local_rate_limit_answers_before_the_body() {
    let mut gw = Gateway::new(&format!(
        r#"{{"sidecar":{{"cluster":"s"}},"allow_on_headers_stop_iteration":true,"rules":{}}}"#,
        rate_rules("local", "")
    ));
    for k in ["a", "b"] {
        let (flow, action) = gw.start_with_eos(&user_post(k), false);
        assert_eq!(action, Action::Pause, "waits for the body to fingerprint");
        let mut flow = flow.unwrap();
        let mut read = |n: usize| Some(vec![b'x'; n]);
        let action =
            gw.with(|c, env| flow.on_request_body(c, &user_post(k), 4, true, &mut read, env));
        assert!(matches!(action, Action::Decide(_)), "{action:?}");
    }
    let (_, action) = gw.start_with_eos(&user_post("c"), false);
    assert_eq!(reply(action).status, 429);
    assert_eq!(
        (
            gw.count(Counter::RateAllowedLocal),
            gw.count(Counter::RateLimitedLocal)
        ),
        (2, 1)
    );
}

#[test]
fn global_rate_check_comes_before_the_claim() {
    let mut gw = Gateway::rules(&rate_rules("global", r#","expose":true"#));
    let (mut flow, request) = rate_callout(&mut gw, &user_post("k"));
    assert_eq!(request.checks.len(), 1);
    assert_eq!(
        (request.checks[0].interval_us, request.checks[0].burst),
        (500_000, 2)
    );
    assert!(flow.holds_request());
    let Action::Decide(claim) = rate_answer(&mut gw, &mut flow, &[ALLOWED]) else {
        panic!("the key's claim follows")
    };
    assert_eq!(claim.path, paths::CLAIM);
    gw.grant(&mut flow, 7);
    assert_eq!(
        flow.take_response_headers(),
        vec![
            (
                "ratelimit-policy".to_string(),
                "\"scope\";q=2;w=1".to_string()
            ),
            ("ratelimit".to_string(), "\"scope\";r=1;t=1".to_string()),
        ]
    );
    let (mut limited, _) = rate_callout(&mut gw, &user_post("k2"));
    let r = reply(rate_answer(&mut gw, &mut limited, &[LIMITED]));
    assert_eq!((r.status, header(&r, "retry-after")), (429, Some("2")));
    assert_eq!(gw.count(Counter::RateLimitedGlobal), 1);
    // An answer that cannot belong to the checks sent is a sidecar failure (closed: 503).
    let (mut garbage, _) = rate_callout(&mut gw, &user_post("k3"));
    let r = reply(rate_answer(&mut gw, &mut garbage, &[ALLOWED, ALLOWED]));
    assert_eq!(r.status, 503);
    assert_eq!(gw.count(Counter::SidecarErrors), 1);
    // The client leaving while the check is out leaves nothing to release.
    let (mut gone, _) = rate_callout(&mut gw, &user_post("k4"));
    assert!(!gw.end(&mut gone));
    assert_eq!(gone.take_release(), None);
}

#[test]
fn rate_failures_follow_the_failure_mode() {
    // open: the request goes on to its claim.
    let json = |mode: &str, tier: &str| {
        format!(
            r#"{{"sidecar":{{"cluster":"s"}},"failure_mode":"{mode}","rules":{}}}"#,
            rate_rules(tier, "")
        )
    };
    let mut gw = Gateway::new(&json("open", "global"));
    let (mut flow, _) = rate_callout(&mut gw, &user_post("k"));
    assert!(matches!(
        gw.answer(&mut flow, Answer::Failed),
        Action::Decide(Callout {
            path: paths::CLAIM,
            ..
        })
    ));
    assert_eq!(gw.count(Counter::FailedOpen), 1);
    // local with a global-only tier: the shared-data table decides instead.
    let mut gw = Gateway::new(&json("local", "global"));
    for (i, k) in ["a", "b", "c"].into_iter().enumerate() {
        let (mut flow, _) = rate_callout(&mut gw, &user_post(k));
        let action = gw.answer(&mut flow, Answer::Failed);
        if i < 2 {
            assert!(matches!(action, Action::Decide(_)), "{k}: {action:?}");
        } else {
            assert_eq!(reply(action).status, 429, "{k}");
        }
    }
    // Breaker open: no callout at all, the failure mode at once.
    let mut gw = Gateway::new(&json("closed", "local_then_global"));
    for k in 0..5 {
        let (mut flow, _) = rate_callout(&mut gw, &user_post(&format!("x{k}")));
        gw.answer(&mut flow, Answer::Failed);
        gw.now += 1_000;
    }
    let r = reply(gw.start(&user_post("y")).1);
    assert_eq!(r.status, 503);
    assert_eq!(gw.count(Counter::BreakerOpen), 1);
}

#[test]
fn shadow_rate_limits_count_and_never_block() {
    let mut gw = Gateway::rules(&rate_rules("local", r#","shadow":true"#));
    for k in ["a", "b", "c", "d"] {
        gw.claim(&user_post(k));
    }
    assert_eq!(gw.count(Counter::ShadowWouldBlock), 2);
    assert_eq!(gw.count(Counter::RateLimitedLocal), 2);
}

#[test]
fn rate_config_errors_name_the_field() {
    for (rate, path) in [
        (r#"{"limits":[]}"#, "rules[0].rate.limits"),
        (
            r#"{"limits":[{"by":"scope","requests":0,"per":"1s"}]}"#,
            "rules[0].rate.limits[0].requests",
        ),
        (
            r#"{"limits":[{"by":"scope","requests":2000000,"per":"1s"}]}"#,
            "rules[0].rate.limits[0].requests",
        ),
        (
            r#"{"limits":[{"by":"scope","requests":1,"per":"1h","burst":25}]}"#,
            "rules[0].rate.limits[0].burst",
        ),
        (
            r#"{"limits":[{"by":"caller","requests":1,"per":"1s"}]}"#,
            "rules[0].rate.limits[0].by",
        ),
        (
            r#"{"limits":[{"by":"key","requests":1,"per":"1s"}],"tier":"x"}"#,
            "rules[0].rate.tier",
        ),
    ] {
        let json = format!(r#"{{"sidecar":{{"cluster":"s"}},"rules":[{{"rate":{rate}}}]}}"#);
        let e = crate::config::parse(json.as_bytes()).unwrap_err();
        assert_eq!(e.path, path, "{rate}: {e}");
    }
}

/// A webhook rule: the key is the delivered event's id, in the JSON body.
fn webhooks(extra: &str) -> Gateway {
    Gateway::new(&format!(
        r#"{{"sidecar":{{"cluster":"s"}},"allow_on_headers_stop_iteration":true,"rules":[{{"match":{{"path_prefix":"/webhooks"}},"scope":{{"headers":["x-user"]}},"key":{{"body_pointer":"/data/id"{extra}}},"fingerprint":{{"max_body_bytes":32}}}}]}}"#
    ))
}

fn delivery() -> Req {
    Req::new("POST", "/webhooks/orders")
        .with("content-type", "application/json")
        .with("x-user", "shop-1")
}

/// Delivers `chunks` as Envoy buffers them (each callback sees all buffered so far); the
/// body is read once, whole, at its end. Returns the flow and the last action.
fn deliver(gw: &mut Gateway, req: &Req, chunks: &[&str]) -> (Option<Flow>, Action) {
    let (flow, action) = gw.start_with_eos(req, chunks.is_empty());
    let Some(mut flow) = flow else {
        return (None, action);
    };
    if chunks.is_empty() {
        return (Some(flow), action);
    }
    assert_eq!(action, Action::Pause, "the key waits for the body");
    assert!(flow.holds_request());
    let body = chunks.concat();
    let mut reads = Vec::new();
    let mut action = Action::Pause;
    let mut buffered = 0;
    for (i, chunk) in chunks.iter().enumerate() {
        assert_eq!(action, Action::Pause, "every chunk but the last is held");
        buffered += chunk.len();
        let eos = i + 1 == chunks.len();
        let mut read = |n: usize| {
            reads.push(n);
            Some(body.as_bytes()[..n].to_vec())
        };
        action = gw.with(|c, env| flow.on_request_body(c, req, buffered, eos, &mut read, env));
    }
    assert!(reads.len() <= 1, "read at most once: {reads:?}");
    (Some(flow), action)
}

fn claim_of(action: &Action) -> ClaimRequest {
    let Action::Decide(call) = action else {
        panic!("expected a claim, got {action:?}")
    };
    assert_eq!(call.path, paths::CLAIM);
    idemgate_wire::decode::<ClaimRequest>(&call.body).unwrap().0
}

#[test]
fn a_webhook_key_is_read_from_the_body_in_any_chunks() {
    let mut gw = webhooks("");
    let one = r#"{"data":{"id":"evt_1"}}"#;
    let (_, whole) = deliver(&mut gw, &delivery(), &[one]);
    let mut gw = webhooks("");
    let (flow, chunked) = deliver(
        &mut gw,
        &delivery(),
        &[r#"{"da"#, r#"ta":{"id"#, r#"":"evt_1"}}"#],
    );
    let (whole, chunked) = (claim_of(&whole), claim_of(&chunked));
    assert_eq!(whole.key, chunked.key, "chunking does not change the key");
    assert_eq!(whole.fingerprint, chunked.fingerprint);
    assert!(
        flow.unwrap().holds_request(),
        "paused while the claim is out"
    );
    // Another event, and another caller, are other keys; the body is fingerprinted.
    let mut gw = webhooks("");
    let other = claim_of(&deliver(&mut gw, &delivery(), &[r#"{"data":{"id":"evt_2"}}"#]).1);
    assert_ne!(other.key, whole.key);
    let mut gw = webhooks("");
    let shop2 = Req::new("POST", "/webhooks/orders").with("x-user", "shop-2");
    assert_ne!(claim_of(&deliver(&mut gw, &shop2, &[one]).1).key, whole.key);
    let mut gw = webhooks("");
    let resent = claim_of(&deliver(&mut gw, &delivery(), &[r#"{"data":{"id":"evt_1"},"n":2}"#]).1);
    assert_eq!(resent.key, whole.key);
    assert_ne!(resent.fingerprint, whole.fingerprint);
}

#[test]
fn a_duplicate_delivery_on_this_gateway_is_caught_by_the_local_tier() {
    let mut gw = webhooks("");
    let body = r#"{"data":{"id":"evt_1"}}"#;
    let (flow, first) = deliver(&mut gw, &delivery(), &[body]);
    claim_of(&first);
    let mut flow = flow.unwrap();
    gw.grant(&mut flow, 1);
    let (_, duplicate) = deliver(&mut gw, &delivery(), &[body]);
    let r = reply(duplicate);
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (409, types::IN_PROGRESS)
    );
    gw.respond(&mut flow, "200", "application/json", &[b"{\"ok\":true}"]);
    let (_, again) = deliver(&mut gw, &delivery(), &[body]);
    let r = reply(again);
    assert_eq!(
        (r.status, header(&r, "idempotent-replayed")),
        (200, Some("true"))
    );
}

#[test]
fn a_webhook_body_up_to_the_cap_is_read_and_one_byte_more_is_413() {
    // 32 bytes exactly (the cap), in two chunks.
    let at_cap = r#"{"data":{"id":"evt_1"},"p":"xx"}"#;
    assert_eq!(at_cap.len(), 32);
    let mut gw = webhooks("");
    let (_, action) = deliver(&mut gw, &delivery(), &[&at_cap[..10], &at_cap[10..]]);
    claim_of(&action);
    let over = r#"{"data":{"id":"evt_1"},"p":"xxx"}"#;
    let mut gw = webhooks("");
    // Refused as soon as the buffered body passes the cap, before its end.
    let (flow, action) = gw.start_with_eos(&delivery(), false);
    let mut flow = flow.unwrap();
    assert_eq!(action, Action::Pause);
    let mut read = |_: usize| -> Option<Vec<u8>> { panic!("an oversized body is never read") };
    let action =
        gw.with(|c, env| flow.on_request_body(c, &delivery(), over.len(), false, &mut read, env));
    let r = reply(action);
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (413, types::TOO_LARGE)
    );
    assert!(!flow.holds_request() && flow.take_release().is_none());
    assert!(!gw.with(|c, env| flow.on_stream_end(c, env)));
    assert_eq!(gw.count(Counter::TooLarge), 1);
    // Nothing was claimed here: the same event right after is claimed normally.
    let (_, action) = deliver(&mut gw, &delivery(), &[at_cap]);
    claim_of(&action);
}

#[test]
fn a_body_that_is_not_json_is_400_and_claims_nothing() {
    for extra in ["", r#","required":false"#] {
        let mut gw = webhooks(extra);
        let (flow, action) = deliver(&mut gw, &delivery(), &["id=evt_1&x=", "1"]);
        let r = reply(action);
        assert_eq!(
            (r.status, problem_type(&r).as_str()),
            (400, types::NOT_JSON),
            "{extra}"
        );
        let mut flow = flow.unwrap();
        assert!(!flow.holds_request() && flow.take_release().is_none());
        assert_eq!(gw.count(Counter::InvalidKey), 1);
    }
}

#[test]
fn a_missing_body_key_follows_key_required() {
    for body in [
        r#"{"data":{}}"#,
        r#"{"data":{"id":null}}"#,
        r#"{"data":[1]}"#,
    ] {
        let mut gw = webhooks("");
        let r = reply(deliver(&mut gw, &delivery(), &[body]).1);
        assert_eq!(
            (r.status, problem_type(&r).as_str()),
            (400, types::MISSING_KEY),
            "{body}"
        );
        let mut gw = webhooks(r#","required":false"#);
        let (_, action) = deliver(&mut gw, &delivery(), &[body]);
        assert_eq!(action, Action::pass(), "{body}: passes unguarded");
        assert_eq!(gw.count(Counter::Bypassed), 1);
    }
    // A request without a body has no key either, and is answered at its headers.
    let mut gw = webhooks("");
    let (flow, action) = deliver(&mut gw, &delivery(), &[]);
    assert!(flow.is_none());
    assert_eq!(reply(action).status, 400);
    let mut gw = webhooks(r#","required":false"#);
    let (flow, action) = deliver(&mut gw, &delivery(), &[]);
    assert!(flow.is_none());
    assert_eq!(action, Action::pass());
}

#[test]
fn a_webhook_request_that_reads_two_ways_is_refused_at_its_headers() {
    let mut gw = webhooks("");
    let twice = delivery().with("x-user", "shop-2");
    let (flow, action) = gw.start_with_eos(&twice, false);
    assert!(flow.is_none(), "nothing waits for the body");
    let r = reply(action);
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (400, types::AMBIGUOUS)
    );
}

#[test]
fn a_client_gone_while_its_body_is_read_leaves_nothing_held() {
    let mut gw = webhooks("");
    let (flow, _) = gw.start_with_eos(&delivery(), false);
    let mut flow = flow.unwrap();
    assert!(!gw.with(|c, env| flow.on_stream_end(c, env)));
    assert!(flow.take_release().is_none());
    let (_, action) = deliver(&mut gw, &delivery(), &[r#"{"data":{"id":"evt_1"}}"#]);
    claim_of(&action);
}

mod coalesce;
mod grpc;
mod observe;
