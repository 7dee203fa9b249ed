//! The scenarios, one function each.

use idemgate_e2e::client::*;
use idemgate_e2e::harness::*;
use idemgate_e2e::stack::Stack;
use idemgate_host::HeaderMap;
use idemgate_host::gateway::bootstrap::{Bootstrap, LISTENER};
use idemgate_host::testing::{Request, TestStream};

const PAYMENTS: &str = r#"[{"name":"payments","match":{"path_prefix":"/payments"}}]"#;

#[test]
fn first_call_goes_upstream_fenced_and_duplicates_replay_byte_for_byte() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", PAYMENTS), 1);
    let first = gw.worker(0).stream();
    first.send_request(post("/payments", "order-1", r#"{"amount":10}"#));
    assert!(
        first.upstream_headers().is_none(),
        "held while the claim is out"
    );
    gw.pump();
    let fence1 = fence(&first).expect("granted and fenced");
    assert_eq!(first.upstream_body(), br#"{"amount":10}"#);
    let body = b"{\"id\":\"pay_1\",\"amount\":10}";
    first.respond(
        201,
        HeaderMap::from([
            ("content-type", "application/json"),
            ("set-cookie", "s=1"),
            ("etag", "\"v1\""),
        ]),
        body,
    );
    gw.pump();
    assert_eq!(first.response_status(), Some(201));

    // Same gateway: replayed from the local tier, no callout.
    let again = gw.worker(0).stream();
    again.send_request(post("/payments", "order-1", r#"{"amount":10}"#));
    assert!(gw.pending().is_empty());
    assert_eq!(again.response_status(), Some(201));
    assert_eq!(again.response_body(), body);
    let headers = again.response_headers().unwrap();
    assert_eq!(headers.get("idempotent-replayed").as_deref(), Some("true"));
    assert_eq!(headers.get("etag").as_deref(), Some("\"v1\""));
    assert_eq!(headers.get("set-cookie"), None);

    // Another gateway: replayed from the sidecar.
    let other = Gateway::boot(stack.addr, &config("", PAYMENTS), 1);
    let remote = other.worker(0).stream();
    remote.send_request(post("/payments", "order-1", r#"{"amount":10}"#));
    other.pump();
    assert!(remote.upstream_headers().is_none());
    assert_eq!(remote.response_status(), Some(201));
    assert_eq!(remote.response_body(), body);
    assert_eq!(
        remote
            .response_headers()
            .unwrap()
            .get("idempotent-replayed")
            .as_deref(),
        Some("true")
    );
    assert!(fence1 > 0);
    assert_eq!(gw.counter("idemgate.requests.granted"), 1);
    assert_eq!(gw.counter("idemgate.local.hits"), 1);
    assert_eq!(other.counter("idemgate.requests.replayed"), 1);
}

/// The root sends claims when its own wake-up queue notifies it — on the worker's next
/// event-loop turn, with no virtual time passing — not a tick later. With several workers each
/// one is woken itself: Envoy notifies only the last VM that registered a queue name.
#[test]
fn claims_go_out_on_the_next_event_loop_turn_of_each_worker() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", PAYMENTS), 2);
    let on_first = gw.worker(0).stream();
    let on_second = gw.worker(1).stream();
    on_first.send_request(post("/payments", "wake-1", "{}"));
    on_second.send_request(post("/payments", "wake-2", "{}"));
    let before = gw.host.now();
    gw.host.settle();
    assert_eq!(gw.host.now(), before);
    let sent: Vec<(usize, String)> = gw.pending().into_iter().map(|(w, _, p)| (w, p)).collect();
    assert_eq!(
        sent,
        [(0, "/v1/claim".to_string()), (1, "/v1/claim".to_string())]
    );
}

#[test]
fn requests_matching_no_rule_pass_untouched() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", PAYMENTS), 1);
    let get = gw.worker(0).stream();
    get.send_request(Request::get("/payments"));
    assert!(get.upstream_complete());
    assert!(gw.pending().is_empty());
    assert_eq!(get.upstream_headers().unwrap().get("x-fencing-token"), None);
}

/// A worker hands its counters to the host on its tick; what it counted since its last tick is
/// handed over when its plugin is done (a configuration change or Envoy draining it), not lost.
#[test]
fn counts_since_the_last_tick_reach_the_host_when_the_plugin_is_done() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", PAYMENTS), 1);
    let passed = |gw: &Gateway| {
        gw.host
            .metric("idemgate.requests.pass")
            .map_or(0, |m| m.value)
    };
    for _ in 0..3 {
        let get = gw.worker(0).stream();
        get.send_request(Request::get("/payments"));
        assert!(get.upstream_complete());
    }
    assert_eq!(passed(&gw), 0, "counted, not yet handed over: no tick ran");
    gw.worker(0).shutdown();
    assert_eq!(passed(&gw), 3);
}

#[test]
fn concurrent_duplicates_on_many_workers_and_gateways_make_one_upstream_call() {
    let stack = Stack::start();
    let gateways = [
        Gateway::boot(stack.addr, &config("", PAYMENTS), 2),
        Gateway::boot(stack.addr, &config("", PAYMENTS), 2),
    ];
    let mut streams = Vec::new();
    for round in 0..3 {
        for gw in &gateways {
            for worker in 0..2 {
                let s = gw.worker(worker + round).stream();
                s.send_request(post("/payments", "same-key", r#"{"amount":5}"#));
                streams.push(s);
            }
        }
    }
    for gw in &gateways {
        gw.pump();
    }
    let upstream: Vec<_> = streams
        .iter()
        .filter(|s| s.upstream_headers().is_some())
        .collect();
    assert_eq!(upstream.len(), 1, "exactly one call reaches the backend");
    for s in streams.iter().filter(|s| s.upstream_headers().is_none()) {
        assert_eq!(s.response_status(), Some(409));
        assert_eq!(problem_type(s), "urn:idemgate:problem:in-progress");
        assert!(s.response_headers().unwrap().get("retry-after").is_some());
    }
    let local_hits: i64 = gateways
        .iter()
        .map(|g| g.counter("idemgate.local.hits"))
        .sum();
    assert_eq!(
        local_hits, 10,
        "all but one duplicate per gateway are caught without a callout"
    );
    upstream[0].respond(
        201,
        HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    for gw in &gateways {
        gw.pump();
    }
}

#[test]
fn queued_lock_holders_run_in_arrival_order() {
    let stack = Stack::start();
    let rules = r#"[{"mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp"},"key":{"path_param":"agent_id"},"on_conflict":"queue","queue":{"max_wait":"20s","max_queue":8}}]"#;
    let gw = Gateway::boot(stack.addr, &config("", rules), 2);
    let put = |tool: &str| {
        Request::put("/agents/agent-7/mcp")
            .header("content-type", "application/json")
            .body(format!("{{\"tool\":\"{tool}\"}}"))
    };
    let first = gw.worker(0).stream();
    first.send_request(put("web_search"));
    gw.pump();
    let mut fences = vec![fence(&first).expect("first holder")];

    // Three more arrive while it runs; each waits at the sidecar (a long-poll per claim).
    let mut seen: Vec<(usize, u32)> = Vec::new();
    let mut waiters = Vec::new();
    for (i, tool) in ["davinci", "file_read", "naver_news"]
        .into_iter()
        .enumerate()
    {
        let worker = (i + 1) % 2;
        let s = gw.worker(worker).stream();
        s.send_request(put(tool));
        gw.host.advance(std::time::Duration::from_millis(2));
        let (w, token, _) = gw
            .pending()
            .into_iter()
            .find(|(w, t, _)| !seen.contains(&(*w, *t)))
            .unwrap_or_else(|| {
                panic!(
                    "its claim was dispatched: {:?} {:?}",
                    s.local_reply(),
                    gw.host
                        .logs()
                        .iter()
                        .map(|l| l.message.clone())
                        .collect::<Vec<_>>()
                )
            });
        seen.push((w, token));
        let key = claim_key(gw.worker(w), token);
        let vm = gw.worker(w).clone();
        let forward = std::thread::spawn(move || vm.forward_callout(token));
        // The sidecar queues it before the next one arrives.
        stack.wait_for_queue(&key, i as u64 + 1);
        waiters.push((s, forward));
    }
    let mut holder = first;
    for (next, forward) in waiters {
        assert!(next.upstream_headers().is_none(), "waits its turn");
        holder.respond(
            200,
            HeaderMap::from([("content-type", "application/json")]),
            "{}",
        );
        // The release goes out once the root is woken, and wakes the next waiter.
        gw.pump_except(&seen);
        assert!(forward.join().unwrap(), "the long-poll answered");
        fences.push(fence(&next).unwrap_or_else(|| {
            panic!(
                "granted in turn: {:?} {} {:?}",
                next.response_status(),
                next.response_body_text(),
                gw.host
                    .logs()
                    .iter()
                    .map(|l| l.message.clone())
                    .collect::<Vec<_>>()
            )
        }));
        holder = next;
    }
    holder.respond(200, HeaderMap::new(), "");
    gw.pump();
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences increase in arrival order: {fences:?}"
    );
    assert_eq!(gw.counter("idemgate.requests.queued"), 3);
    assert_eq!(
        gw.host
            .metric("idemgate.queue.wait_ms")
            .unwrap()
            .histogram
            .count(),
        3
    );
}

const QUEUED_AGENT_LOCK: &str = r#"[{"name":"mcp","mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp"},"key":{"path_param":"agent_id"},"on_conflict":"queue","queue":{"max_wait":"20s","max_queue":8},"lease":"30s"}]"#;

fn put_tool(agent: &str, tool: &str) -> Request {
    Request::put(&format!("/agents/{agent}/mcp"))
        .header("content-type", "application/json")
        .body(format!("{{\"tool\":\"{tool}\"}}"))
}

/// A request whose claim waits at the sidecar: sent on `worker`, its claim forwarded on a
/// thread (the long-poll) once it is queued. Returns the stream, the claim's callout and the
/// thread.
fn queued(
    gw: &Gateway,
    stack: &Stack,
    worker: usize,
    request: Request,
    ahead: u64,
) -> (
    TestStream,
    (usize, u32),
    idemgate_wire::ClaimRequest,
    std::thread::JoinHandle<bool>,
) {
    let before: Vec<(usize, u32)> = gw.pending().into_iter().map(|(w, t, _)| (w, t)).collect();
    let s = gw.worker(worker).stream();
    s.send_request(request);
    gw.host.advance(std::time::Duration::from_millis(2));
    let (w, token, _) = gw
        .pending()
        .into_iter()
        .find(|(w, t, p)| p == idemgate_wire::paths::CLAIM && !before.contains(&(*w, *t)))
        .expect("its claim was dispatched");
    let call = gw
        .worker(w)
        .pending_callouts()
        .into_iter()
        .find(|c| c.token == token)
        .unwrap();
    let (claim, _): (idemgate_wire::ClaimRequest, &[u8]) =
        idemgate_wire::decode(&call.body).unwrap();
    let vm = gw.worker(w).clone();
    let forward = std::thread::spawn(move || vm.forward_callout(token));
    stack.wait_for_queue(&claim.key, ahead);
    (s, (w, token), claim, forward)
}

/// Redis restarted empty while a call runs on this gateway: the sidecar forgets the holder
/// and grants the request queued behind it. This gateway's local tier still shows the holder
/// running, and vetoes the grant until it ends (before, the two ran side by side).
#[test]
fn the_local_tier_vetoes_a_queue_grant_while_this_gateway_runs_the_key() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", QUEUED_AGENT_LOCK), 2);
    let holder = gw.worker(0).stream();
    holder.send_request(put_tool("agent-9", "holder"));
    gw.pump();
    assert!(fence(&holder).is_some(), "the holder runs");
    let (waiter, call, _, forward) = queued(&gw, &stack, 1, put_tool("agent-9", "waiter"), 1);
    stack.empty_redis();
    assert!(
        forward.join().unwrap(),
        "the sidecar answered the long-poll"
    );
    gw.host.advance(std::time::Duration::from_millis(2));
    assert!(
        waiter.upstream_headers().is_none(),
        "granted by the sidecar, but not beside the holder this gateway runs"
    );
    assert_eq!(gw.counter("idemgate.local.vetoes"), 1);
    for _ in 0..5 {
        gw.host.advance(std::time::Duration::from_millis(100));
        assert!(
            waiter.upstream_headers().is_none(),
            "held while the holder runs"
        );
    }
    holder.respond(
        200,
        HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    gw.pump_except(&[call]);
    // The next tick lets it through, with the grant's fence.
    gw.host.advance(std::time::Duration::from_millis(100));
    assert!(fence(&waiter).is_some(), "runs once the holder ended");
    waiter.respond(
        200,
        HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    gw.pump_except(&[call]);
    assert_eq!(gw.counter("idemgate.requests.granted"), 2);
}

/// `failure_mode: local`: a request granted through the queue holds this gateway's slot, so
/// with the sidecar gone a duplicate here is refused (before, it ran beside the first).
#[test]
fn fail_local_catches_a_duplicate_of_a_request_granted_through_the_queue() {
    let mut stack = Stack::start();
    let gw = Gateway::boot(
        stack.addr,
        &config(r#""failure_mode":"local""#, QUEUED_AGENT_LOCK),
        2,
    );
    let holder = gw.worker(0).stream();
    holder.send_request(put_tool("agent-5", "holder"));
    gw.pump();
    let (waiter, call, _, forward) = queued(&gw, &stack, 1, put_tool("agent-5", "waiter"), 1);
    holder.respond(
        200,
        HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    gw.pump_except(&[call]);
    assert!(forward.join().unwrap());
    gw.host.advance(std::time::Duration::from_millis(2));
    assert!(fence(&waiter).is_some(), "handed the key in turn");

    stack.kill_sidecar();
    for worker in 0..2 {
        let dup = gw.worker(worker).stream();
        dup.send_request(put_tool("agent-5", "dup"));
        gw.pump();
        assert_eq!(
            dup.response_status(),
            Some(409),
            "the queued grant holds this gateway's slot: {:?}",
            dup.upstream_headers()
        );
        assert_eq!(problem_type(&dup), "urn:idemgate:problem:in-progress");
    }
    waiter.respond(200, HeaderMap::new(), "");
    let next = gw.worker(0).stream();
    next.send_request(put_tool("agent-5", "next"));
    gw.pump();
    assert_eq!(
        next.upstream_headers()
            .and_then(|h| h.get("x-idemgate-degraded")),
        Some("local".to_string()),
        "free again once the call ended"
    );
}

/// `failure_mode: local` with every probed slot held by other keys (one slot here; an
/// attacker can choose keys that collide): the request cannot be recorded on this gateway,
/// so it fails closed (before, it was forwarded, and so was its duplicate).
#[test]
fn fail_local_refuses_a_request_whose_local_claim_cannot_be_made() {
    let gw = Gateway::boot(
        dead_address(),
        &config(
            r#""failure_mode":"local","local":{"slots":1,"probes":1}"#,
            PAYMENTS,
        ),
        2,
    );
    let first = gw.worker(0).stream();
    first.send_request(post("/payments", "pay-a", "{}"));
    gw.pump();
    assert!(first.upstream_headers().is_some(), "holds the one slot");
    for worker in 0..2 {
        let s = gw.worker(worker).stream();
        s.send_request(post("/payments", "pay-b", "{}"));
        gw.pump();
        assert!(s.upstream_headers().is_none(), "never forwarded unrecorded");
        assert_eq!(s.response_status(), Some(503));
        assert_eq!(problem_type(&s), "urn:idemgate:problem:unavailable");
        assert!(s.response_headers().unwrap().get("retry-after").is_some());
    }
    let dup = gw.worker(1).stream();
    dup.send_request(post("/payments", "pay-a", "{}"));
    assert_eq!(
        dup.response_status(),
        Some(409),
        "409 when another request here holds it"
    );
    assert_eq!(gw.counter("idemgate.local.unavailable"), 2);
}

/// A queued client that goes away gives its place up by name: the claim names an
/// unguessable waiter (unique per claim, different per VM) and the root sends `/v1/leave`
/// with it when the stream ends.
#[test]
fn a_queued_client_that_leaves_gives_its_place_up_by_name() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", QUEUED_AGENT_LOCK), 2);
    let holder = gw.worker(0).stream();
    holder.send_request(put_tool("agent-3", "holder"));
    gw.pump();
    let (quitter, call, claim, forward) = queued(&gw, &stack, 1, put_tool("agent-3", "quitter"), 1);
    let (stays, stays_call, other, other_forward) =
        queued(&gw, &stack, 0, put_tool("agent-3", "stays"), 2);
    let name = claim
        .waiter
        .clone()
        .expect("a queued claim names its waiter");
    let other_name = other.waiter.clone().unwrap();
    assert_eq!(name.len(), 32);
    assert!(name.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_ne!(name, other_name);
    quitter.abort();
    gw.host.advance(std::time::Duration::from_millis(2));
    let leave = gw
        .worker(call.0)
        .pending_callouts()
        .into_iter()
        .find(|c| c.headers.get(":path").as_deref() == Some(idemgate_wire::paths::LEAVE))
        .expect("the root sent a leave at once");
    let (body, _): (idemgate_wire::LeaveRequest, &[u8]) =
        idemgate_wire::decode(&leave.body).unwrap();
    assert_eq!((body.key, body.waiter), (claim.key, name));
    gw.worker(call.0).forward_callout(leave.token);
    // Whatever the sidecar does with it, the key is not lost: the holder's release hands it
    // on (a grant for the gone client is aborted) and the request that stayed runs.
    holder.respond(
        200,
        HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    gw.pump_except(&[call, stays_call]);
    assert!(forward.join().unwrap());
    gw.pump_except(&[stays_call]);
    assert!(other_forward.join().unwrap());
    gw.pump();
    assert!(fence(&stays).is_some(), "the request that stayed runs");
    assert_eq!(gw.counter("idemgate.requests.abandoned"), 1);
}

#[test]
fn client_abort_releases_the_key_at_every_phase() {
    let stack = Stack::start();
    // `release`: aborts after forwarding free the key at once (the default, `hold`, keeps it
    // until the lease ends: tests/faults/client_abort.rs).
    let rules =
        r#"[{"name":"payments","match":{"path_prefix":"/payments"},"on_client_abort":"release"}]"#;
    let gw = Gateway::boot(stack.addr, &config("", rules), 1);

    // Aborted after the grant, before any response: the key is released, not stored.
    let a = gw.worker(0).stream();
    a.send_request(post("/payments", "k-abort", "{}"));
    gw.pump();
    let fence_a = fence(&a).unwrap();
    a.abort();
    gw.pump();
    let b = gw.worker(0).stream();
    b.send_request(post("/payments", "k-abort", "{}"));
    gw.pump();
    assert!(fence(&b).unwrap() > fence_a, "the retry runs again");

    // Aborted while its claim is still out: the late grant is released by the root.
    let c = gw.worker(0).stream();
    c.send_request(post("/payments", "k-late", "{}"));
    gw.host.advance(std::time::Duration::from_millis(2));
    let (_, token, _) = gw.pending().pop().expect("claim dispatched");
    c.abort();
    assert!(
        gw.worker(0).forward_callout(token),
        "the answer still reaches the root"
    );
    gw.pump();
    let d = gw.worker(0).stream();
    d.send_request(post("/payments", "k-late", "{}"));
    gw.pump();
    assert!(fence(&d).is_some(), "not held past the abort");
    assert_eq!(gw.counter("idemgate.requests.abandoned"), 1);

    // Aborted mid-response: nothing stored, the key is free again.
    let e = gw.worker(0).stream();
    e.send_request(post("/payments", "k-mid", "{}"));
    gw.pump();
    e.send_response_headers(
        HeaderMap::from([(":status", "200"), ("content-type", "application/json")]),
        false,
    );
    e.send_response_body("{\"partial\"", false);
    e.abort();
    gw.pump();
    let f = gw.worker(0).stream();
    f.send_request(post("/payments", "k-mid", "{}"));
    gw.pump();
    assert!(fence(&f).is_some());
}

#[test]
fn upstream_errors_are_not_stored() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", PAYMENTS), 1);
    let a = gw.worker(0).stream();
    a.send_request(post("/payments", "k-500", "{}"));
    gw.pump();
    a.respond(
        503,
        HeaderMap::from([("content-type", "application/json")]),
        "{\"error\":1}",
    );
    gw.pump();
    let b = gw.worker(0).stream();
    b.send_request(post("/payments", "k-500", "{}"));
    gw.pump();
    assert!(fence(&b).is_some(), "the client's retry runs again");
}

#[test]
fn sidecar_down_fails_closed_by_default_and_the_breaker_stops_callouts() {
    let gw = Gateway::boot(dead_address(), &config("", PAYMENTS), 1);
    for i in 0..5 {
        let s = gw.worker(0).stream();
        s.send_request(post("/payments", &format!("k{i}"), "{}"));
        gw.pump();
        assert_eq!(s.response_status(), Some(503));
        assert_eq!(problem_type(&s), "urn:idemgate:problem:unavailable");
        assert_eq!(
            s.response_headers().unwrap().get("retry-after").as_deref(),
            Some("5")
        );
    }
    let s = gw.worker(0).stream();
    s.send_request(post("/payments", "k-breaker", "{}"));
    assert_eq!(
        s.response_status(),
        Some(503),
        "answered at once: the breaker is open"
    );
    assert!(gw.pending().is_empty());
    assert_eq!(gw.counter("idemgate.sidecar.breaker_open"), 1);
    assert_eq!(gw.counter("idemgate.requests.failed_closed"), 6);
}

#[test]
fn sidecar_down_fail_open_forwards_marked() {
    let gw = Gateway::boot(
        dead_address(),
        &config(r#""failure_mode":"open""#, PAYMENTS),
        1,
    );
    let s = gw.worker(0).stream();
    s.send_request(post("/payments", "k", "{}"));
    gw.pump();
    assert_eq!(
        s.upstream_headers()
            .unwrap()
            .get("x-idemgate-degraded")
            .as_deref(),
        Some("open")
    );
    assert_eq!(gw.counter("idemgate.requests.failed_open"), 1);
}

#[test]
fn sidecar_down_fail_local_decides_on_shared_data() {
    let gw = Gateway::boot(
        dead_address(),
        &config(r#""failure_mode":"local""#, PAYMENTS),
        2,
    );
    let a = gw.worker(0).stream();
    a.send_request(post("/payments", "k", "{}"));
    gw.pump();
    assert_eq!(
        a.upstream_headers()
            .unwrap()
            .get("x-idemgate-degraded")
            .as_deref(),
        Some("local")
    );
    let dup = gw.worker(1).stream();
    dup.send_request(post("/payments", "k", "{}"));
    assert_eq!(
        dup.response_status(),
        Some(409),
        "another worker's duplicate is caught locally"
    );
    a.respond(
        201,
        HeaderMap::from([("content-type", "application/json")]),
        "{\"ok\":true}",
    );
    let replay = gw.worker(1).stream();
    replay.send_request(post("/payments", "k", "{}"));
    assert_eq!(replay.response_body(), b"{\"ok\":true}");
}

#[test]
fn sidecar_down_fail_local_keeps_a_long_call_protected_past_its_lease() {
    // Lease 1 s, tick 100 ms: the local entry is extended from the tick (no grant to renew
    // at the sidecar), so a duplicate 3 leases later is still caught on another worker.
    let rules = r#"[{"match":{"path_prefix":"/payments"},"lease":"1s"}]"#;
    let gw = Gateway::boot(
        dead_address(),
        &config(r#""failure_mode":"local""#, rules),
        2,
    );
    let a = gw.worker(0).stream();
    a.send_request(post("/payments", "k-long", "{}"));
    gw.pump();
    assert!(a.upstream_headers().is_some(), "forwarded, marked local");
    for _ in 0..30 {
        gw.host.advance(std::time::Duration::from_millis(100));
    }
    let dup = gw.worker(1).stream();
    dup.send_request(post("/payments", "k-long", "{}"));
    assert_eq!(
        dup.response_status(),
        Some(409),
        "three leases later the running call still holds the key"
    );
    assert!(gw.counter("idemgate.lease.renewals") >= 5);
    a.respond(
        201,
        HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    let replay = gw.worker(1).stream();
    replay.send_request(post("/payments", "k-long", "{}"));
    assert_eq!(replay.response_status(), Some(201));
}

#[test]
fn shared_data_stays_bounded_over_100k_keys() {
    // Fail open with the sidecar down: after the breaker opens, every request is decided on
    // the local tier alone, so this exercises the table without 100k network round trips.
    let extra = r#""failure_mode":"open","local":{"slots":256,"probes":4}"#;
    let gw = Gateway::boot(dead_address(), &config(extra, PAYMENTS), 2);
    for i in 0..100_000u32 {
        let s = gw.worker(i as usize).stream();
        s.send_request(post("/payments", &format!("key-{i}"), "{}"));
        // Five failures per worker open its breaker.
        if i < 10 {
            gw.pump();
        }
        s.respond(
            201,
            HeaderMap::from([("content-type", "application/json")]),
            "{}",
        );
    }
    assert!(
        gw.shared_keys() <= 256 + 1,
        "{} shared-data keys",
        gw.shared_keys()
    );
    assert_eq!(gw.counter("idemgate.requests.failed_open"), 100_000);
}

#[test]
fn invalid_configuration_is_rejected_naming_the_field() {
    let host = idemgate_host::testing::TestHost::new().cluster(SIDECAR);
    let bad = config("", r#"[{},{},{"key":{"header":"bad header"}}]"#);
    let booted = host
        .plugin("target/idemgate.wasm")
        .vm_id(VM_ID)
        .config(bad)
        .boot();
    assert!(booted.is_err(), "on_configure returns false");
    assert!(
        !host.logs_containing("rules[2].key.header: ").is_empty(),
        "logs: {:?}",
        host.logs()
            .into_iter()
            .map(|l| l.message)
            .collect::<Vec<_>>()
    );
}

#[test]
fn body_fingerprints_with_allow_on_headers_stop_iteration() {
    let stack = Stack::start();
    let extra = r#""allow_on_headers_stop_iteration":true"#;
    let rules = r#"[{"match":{"path_prefix":"/payments"},"fingerprint":{"max_body_bytes":32}}]"#;
    let gw = Gateway::boot_with(stack.addr, &config(extra, rules), 1, true);
    let a = gw.worker(0).stream();
    a.send_request(post("/payments", "k", r#"{"amount":1}"#));
    gw.pump();
    assert_eq!(
        a.upstream_body(),
        br#"{"amount":1}"#,
        "the whole body went up after the grant"
    );
    a.respond(
        201,
        HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    gw.pump();
    let b = gw.worker(0).stream();
    b.send_request(post("/payments", "k", r#"{"amount":2}"#));
    gw.pump();
    assert_eq!(b.response_status(), Some(422));
    assert_eq!(problem_type(&b), "urn:idemgate:problem:key-reused");
    let big = gw.worker(0).stream();
    big.send_request(post("/payments", "k2", &"x".repeat(64)));
    gw.pump();
    assert_eq!(big.response_status(), Some(413));
    assert!(big.upstream_headers().is_none());
}

#[test]
fn shadow_mode_never_blocks() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config(r#""shadow":true"#, PAYMENTS), 1);
    let a = gw.worker(0).stream();
    a.send_request(post("/payments", "k", "{}"));
    gw.pump();
    let b = gw.worker(0).stream();
    b.send_request(post("/payments", "k", "{}"));
    gw.pump();
    assert!(a.upstream_headers().is_some() && b.upstream_headers().is_some());
    assert_eq!(gw.counter("idemgate.shadow.would_block"), 1);
    let missing = gw.worker(0).stream();
    missing.send_request(Request::post("/payments").body("{}"));
    assert!(missing.upstream_headers().is_some());
}

/// Queue policy, idempotency mode: a duplicate from another gateway waits at the sidecar in
/// a long-poll; one on another worker of the gateway running the call waits on its shared
/// data, without a claim, and is answered by that worker's poll. Both get the response.
#[test]
fn queued_duplicates_get_the_stored_response_here_from_shared_data_elsewhere_from_the_sidecar() {
    let stack = Stack::start();
    let rules = r#"[{"match":{"path_prefix":"/payments"},"on_conflict":"queue","queue":{"max_wait":"20s"}}]"#;
    let gw = Gateway::boot(stack.addr, &config("", rules), 2);
    let other = Gateway::boot(stack.addr, &config("", rules), 1);
    let first = gw.worker(0).stream();
    first.send_request(post("/payments", "k-q", r#"{"amount":3}"#));
    gw.pump();
    assert!(fence(&first).is_some());
    let remote = other.worker(0).stream();
    remote.send_request(post("/payments", "k-q", r#"{"amount":3}"#));
    other.host.advance(std::time::Duration::from_millis(2));
    let (w, token, path) = other.pending().pop().expect("the remote duplicate's claim");
    assert_eq!(path, idemgate_wire::paths::CLAIM);
    let key = claim_key(other.worker(w), token);
    let vm = other.worker(w).clone();
    let waiting = std::thread::spawn(move || vm.forward_callout(token));
    stack.wait_for_queue(&key, 1);
    let dup = gw.worker(1).stream();
    dup.send_request(post("/payments", "k-q", r#"{"amount":3}"#));
    gw.host.advance(std::time::Duration::from_millis(2));
    assert!(
        gw.pending().is_empty(),
        "no claim for a duplicate of a call running here"
    );
    for s in [&remote, &dup] {
        assert!(
            s.upstream_headers().is_none() && s.response_status().is_none(),
            "held"
        );
    }
    let body = br#"{"id":"pay_9","amount":3}"#;
    first.respond(
        201,
        HeaderMap::from([("content-type", "application/json")]),
        body,
    );
    gw.pump();
    gw.host.advance(std::time::Duration::from_millis(2));
    assert!(waiting.join().unwrap());
    for s in [&remote, &dup] {
        assert_eq!(s.response_status(), Some(201));
        assert_eq!(s.response_body(), body);
        assert_eq!(
            s.response_headers()
                .unwrap()
                .get("idempotent-replayed")
                .as_deref(),
            Some("true")
        );
        assert!(s.upstream_headers().is_none(), "one upstream call");
    }
    assert_eq!(gw.counter("idemgate.requests.queued"), 1);
    assert_eq!(gw.counter("idemgate.requests.replayed"), 1);
}

#[test]
fn long_calls_renew_their_lease_from_the_tick() {
    let stack = Stack::start();
    let rules = r#"[{"match":{"path_prefix":"/payments"},"lease":"2s"}]"#;
    let gw = Gateway::boot(stack.addr, &config("", rules), 1);
    let s = gw.worker(0).stream();
    s.send_request(post("/payments", "k-long", "{}"));
    gw.pump();
    assert!(fence(&s).is_some());
    gw.host.advance(std::time::Duration::from_millis(1_100));
    let pending = gw.pending();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].2, idemgate_wire::paths::RENEW);
    gw.pump();
    assert_eq!(gw.counter("idemgate.lease.renewals"), 1);
    s.respond(
        201,
        HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    gw.pump();
    assert_eq!(gw.counter("idemgate.lease.lost"), 0);
}

#[test]
fn live_gateway_concurrent_duplicates_make_one_backend_call_and_all_get_its_response() {
    let stack = Stack::start();
    let body = r#"{"id":"pay_42","status":"captured"}"#;
    let (backend, hits) = backend(std::time::Duration::from_millis(500), body);
    let plugin = config(
        "",
        r#"[{"name":"payments","match":{"path_prefix":"/payments"},"on_conflict":"queue","queue":{"max_wait":"20s","max_queue":32}}]"#,
    );
    let gateway = Bootstrap::idemgate(backend, stack.addr, &plugin)
        .start(4)
        .expect("gateway starts (build target/idemgate.wasm with `cargo xtask wasm`)");
    let addr = gateway.listener_address(LISTENER).unwrap();
    let clients: Vec<_> = (0..16)
        .map(|_| {
            std::thread::spawn(move || {
                http(
                    addr,
                    "POST",
                    "/payments",
                    &[
                        ("idempotency-key", "\"live-1\""),
                        ("content-type", "application/json"),
                    ],
                    "{\"amount\":42}",
                )
            })
        })
        .collect();
    let replies: Vec<Reply> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    assert_eq!(
        hits.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one backend call: {replies:?}"
    );
    for r in &replies {
        assert_eq!((r.status, r.body.as_str()), (201, body), "{r:?}");
    }
    let replayed = replies
        .iter()
        .filter(|r| r.header("idempotent-replayed") == Some("true"))
        .count();
    assert_eq!(replayed, 15);
    gateway.shutdown();
}

#[test]
fn the_shipped_envoy_config_configures_the_filter() {
    // Only the plugin configuration is taken from envoy/envoy.yaml (the harness's Envoy
    // config subset is not the point here).
    let root = idemgate_host::target_dir().join("..");
    let text = std::fs::read_to_string(root.join("envoy/envoy.yaml")).unwrap();
    let envoy: serde_norway::Value = serde_norway::from_str(&text).unwrap();
    let filter = &envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["http_filters"][0]["typed_config"]["config"];
    let configuration = filter["configuration"]["value"]
        .as_str()
        .expect("a StringValue configuration");
    let vm_id = filter["vm_config"]["vm_id"].as_str().unwrap_or_default();
    let host = idemgate_host::testing::TestHost::new().cluster("idemgate_sidecar");
    let vm = host
        .plugin("target/idemgate.wasm")
        .vm_id(vm_id)
        .config(configuration)
        .boot()
        .unwrap_or_else(|e| {
            panic!(
                "{e}: {:?}",
                host.logs()
                    .into_iter()
                    .map(|l| l.message)
                    .collect::<Vec<_>>()
            )
        });
    let s = vm.stream();
    s.send_request(
        Request::post("/payments")
            .header("x-user-id", "u")
            .body("{}"),
    );
    assert_eq!(
        s.response_status(),
        Some(400),
        "payments need an idempotency key"
    );
    let tools = vm.stream();
    tools.send_request(
        Request::post("/agents/a1/tools")
            .header("x-user-id", "u")
            .body("{}"),
    );
    vm.host().advance(std::time::Duration::from_millis(2));
    assert_eq!(
        vm.pending_callouts().len(),
        1,
        "the agent lock is claimed at the sidecar"
    );
}

#[test]
fn a_shadow_rule_forwards_would_be_blocks_marked_logged_and_counted_per_rule() {
    const KEY: &str = "raw-key-SECRET-7";
    let stack = Stack::start();
    // The shadow rule also limits each key to one request a second: a duplicate passes two
    // would-be blocks (over the limit, then in progress here) and counts as one, the first.
    let rules = r#"[{"name":"tried","match":{"path_prefix":"/payments"},"shadow":true,
                     "rate":{"tier":"local","limits":[{"by":"key","requests":1,"per":"1s"}]}},
                    {"name":"enforced","match":{"path_prefix":"/orders"}}]"#;
    let gw = Gateway::boot(
        stack.addr,
        &config(r#""would_block_header":"x-idemgate-would-block""#, rules),
        1,
    );
    let forged = |request: Request| request.header("x-idemgate-would-block", "forged");
    let first = gw.worker(0).stream();
    first.send_request(forged(post("/payments", KEY, "{}")));
    gw.pump();
    assert!(fence(&first).is_some(), "granted");
    let mark = |stream: &TestStream| {
        stream
            .upstream_headers()
            .expect("forwarded")
            .get("x-idemgate-would-block")
    };
    assert_eq!(
        mark(&first),
        None,
        "a client's mark never reaches the backend"
    );

    // A duplicate while the first runs: forwarded, marked with the first decision it escaped.
    let dup = gw.worker(0).stream();
    dup.send_request(forged(post("/payments", KEY, "{}")));
    gw.pump();
    assert_eq!(mark(&dup).as_deref(), Some("rate_limited"));
    assert_eq!(gw.counter("idemgate.rule.tried.would_block"), 1);
    assert_eq!(gw.counter("idemgate.shadow.would_block"), 1);
    assert_eq!(gw.counter("idemgate.rule.tried.rejected"), 1);
    assert_eq!(gw.counter("idemgate.rule.tried.granted"), 1);
    let logged = gw.host.logs_containing("(shadow: forwarded)");
    assert_eq!(logged.len(), 1, "once per request: {logged:?}");
    assert!(
        logged[0].contains("rule tried rate_limited #"),
        "{logged:?}"
    );
    assert!(!logged[0].contains(KEY), "{logged:?}");
    let state = |name: &str| {
        gw.worker(0)
            .with(|vm| vm.filter_state(dup.id(), name.as_bytes()))
            .map(|v| String::from_utf8(v).unwrap())
    };
    assert_eq!(
        state("idemgate.would_block").as_deref(),
        Some("rate_limited")
    );
    assert_eq!(state("idemgate.decision").as_deref(), Some("rejected"));

    // A request no rule matches loses a forged mark too.
    let unmatched = gw.worker(0).stream();
    unmatched.send_request(forged(Request::get("/elsewhere")));
    assert_eq!(mark(&unmatched), None);

    // The other rule still blocks, and marks nothing.
    let order = gw.worker(0).stream();
    order.send_request(post("/orders", KEY, "{}"));
    gw.pump();
    let again = gw.worker(0).stream();
    again.send_request(post("/orders", KEY, "{}"));
    gw.pump();
    assert_eq!(again.response_status(), Some(409));
    assert_eq!(gw.counter("idemgate.rule.enforced.rejected"), 1);
    assert_eq!(gw.counter("idemgate.rule.enforced.would_block"), 0);
}
