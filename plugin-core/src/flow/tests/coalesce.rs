//! Duplicates coalescing on this gateway (idempotency mode, queue policy): they wait on the
//! local tier for the outcome of the request holding the key here, not at the sidecar.

use super::*;

/// Fingerprints the `x-amount` header, so a duplicate can be "another request".
const PARKING: &str = r#"[{"match":{"path_prefix":"/payments"},"fingerprint":{"headers":["x-amount"]},"on_conflict":"queue","queue":{"max_wait":"10s","max_queue":4}}]"#;

fn pay(key: &str, amount: &str) -> Req {
    post(key).with("x-amount", amount)
}

/// Starts a duplicate that must park: no callout, the request held.
fn park(gw: &mut Gateway, req: &Req) -> Flow {
    let (flow, action) = gw.start(req);
    assert_eq!(action, Action::Wait, "parks instead of claiming");
    let flow = flow.unwrap();
    assert!(flow.holds_request() && flow.waits_locally());
    flow
}

/// One tick over `flows` (sharing what it read, as the glue's tick does: a flow the tick
/// already knows is unchanged is skipped).
fn tick_all(gw: &mut Gateway, flows: &mut [Flow]) -> Vec<Option<Action>> {
    let mut seen = Lookups::default();
    flows
        .iter_mut()
        .map(|flow| {
            if seen.unchanged(flow, gw.now) {
                return None;
            }
            gw.with(|c, env| flow.on_local_wait_tick(c, env, &mut seen))
        })
        .collect()
}

#[test]
fn duplicates_wait_here_for_the_holder_and_get_its_response_with_one_claim() {
    let mut gw = Gateway::rules(PARKING);
    let (mut holder, claim, _) = gw.claim(&pay("k", "1"));
    assert!(claim.wait.is_some());
    let mut parked: Vec<Flow> = (0..5).map(|_| park(&mut gw, &pay("k", "1"))).collect();
    assert_eq!(gw.count(Counter::LocalHits), 5);
    gw.now += 50;
    assert!(tick_all(&mut gw, &mut parked).iter().all(Option::is_none));
    assert!(matches!(gw.grant(&mut holder, 1), Action::Continue(_)));
    gw.now += 100;
    let reads = gw.shared.gets.get();
    assert!(tick_all(&mut gw, &mut parked).iter().all(Option::is_none));
    assert_eq!(
        gw.shared.gets.get() - reads,
        1,
        "one tick reads a key once, however many wait on it"
    );
    let mut seen = Lookups::default();
    assert!(
        !seen.unchanged(&parked[0], gw.now),
        "not read yet this tick"
    );
    gw.with(|c, env| parked[0].on_local_wait_tick(c, env, &mut seen));
    assert!(seen.unchanged(&parked[1], gw.now));
    assert!(
        !seen.unchanged(&parked[1], gw.now + 10_000),
        "a waiter whose budget ran out is not skipped"
    );
    gw.respond(&mut holder, "201", "application/json", &[b"{\"id\":1}"]);
    assert_eq!(release(&mut holder).0, paths::COMPLETE);
    gw.now += 2;
    let reads = gw.shared.gets.get();
    let answers = tick_all(&mut gw, &mut parked);
    assert_eq!(
        gw.shared.gets.get() - reads,
        1,
        "the tick that answers them reads the completed key once, not once per duplicate"
    );
    for action in answers {
        let r = reply(action.expect("answered"));
        assert_eq!((r.status, r.body.as_slice()), (201, &b"{\"id\":1}"[..]));
        assert_eq!(header(&r, "idempotent-replayed"), Some("true"));
    }
    for flow in &mut parked {
        assert!(flow.take_release().is_none(), "nothing to release");
        assert!(flow.is_done());
    }
    assert_eq!(gw.count(Counter::Replayed), 5);
    assert_eq!(gw.count(Counter::Queued), 5);
    assert!(gw.rec.samples.contains(&(Histogram::QueueWaitMs, 152)));
}

#[test]
fn a_duplicate_of_another_request_gets_422_at_once_as_the_sidecar_answers_it() {
    // Queue mode parks a duplicate, and reject mode refuses one with 409; a request with
    // another fingerprint under the key is neither: the sidecar answers it `mismatch` at
    // once whoever holds the key, and so does this gateway's slot.
    let reject = PARKING.replace(
        r#""on_conflict":"queue","queue":{"max_wait":"10s","max_queue":4}"#,
        r#""on_conflict":"reject""#,
    );
    for rules in [PARKING, reject.as_str()] {
        let mut gw = Gateway::rules(rules);
        let (mut holder, _, _) = gw.claim(&pay("k", "1"));
        let (_, action) = gw.start(&pay("k", "2"));
        let r = reply(action);
        assert_eq!(
            (r.status, problem_type(&r).as_str()),
            (422, types::MISMATCH),
            "{rules}"
        );
        // Answered without a callout (a claim would be `Action::Decide`).
        assert_eq!(gw.count(Counter::Mismatch), 1);
        // The holder still holds the key here: a duplicate of it waits for its outcome.
        gw.grant(&mut holder, 1);
        let (same, action) = gw.start(&pay("k", "1"));
        if rules == PARKING {
            assert_eq!(action, Action::Wait);
            let mut same = [same.unwrap()];
            gw.respond(&mut holder, "201", "application/json", &[b"{}"]);
            let r = reply(tick_all(&mut gw, &mut same).remove(0).unwrap());
            assert_eq!(r.status, 201);
        } else {
            assert_eq!(reply(action).status, 409);
        }
    }
}

#[test]
fn when_the_holder_aborts_one_parked_duplicate_takes_the_claim_over_within_its_budget() {
    let mut gw = Gateway::rules(PARKING);
    let (mut holder, _, _) = gw.claim(&pay("k", "1"));
    let mut parked: Vec<Flow> = (0..3).map(|_| park(&mut gw, &pay("k", "1"))).collect();
    gw.grant(&mut holder, 1);
    gw.now += 4_000;
    // A 500 is not stored: the key is aborted and freed here.
    gw.respond(&mut holder, "500", "application/json", &[b"{}"]);
    assert_eq!(release(&mut holder).0, paths::ABORT);
    let mut actions = tick_all(&mut gw, &mut parked);
    let Some(Action::Decide(call)) = actions.remove(0) else {
        panic!("the first takes the claim over")
    };
    assert!(actions.iter().all(Option::is_none), "the others wait on it");
    let (claim, _): (ClaimRequest, &[u8]) = idemgate_wire::decode(&call.body).unwrap();
    let wait = claim.wait.unwrap();
    assert_eq!(
        (wait.budget_ms, wait.max_budget_ms),
        (6_000, 6_000),
        "what is left of the budget it started parked with"
    );
    let (taker, rest) = parked.split_first_mut().unwrap();
    assert!(matches!(gw.grant(taker, 2), Action::Continue(h) if h[0].1 == "2"));
    gw.respond(taker, "201", "application/json", &[b"{\"id\":2}"]);
    for action in tick_all(&mut gw, rest) {
        let r = reply(action.unwrap());
        assert_eq!((r.status, r.body.as_slice()), (201, &b"{\"id\":2}"[..]));
    }
}

#[test]
fn a_parked_duplicate_honours_its_wait_budget_and_a_client_abort_leaves_nothing() {
    let mut gw = Gateway::rules(PARKING);
    let (mut holder, _, _) = gw.claim(&pay("k", "1"));
    gw.grant(&mut holder, 1);
    let mut parked = [park(&mut gw, &pay("k", "1"))];
    let mut gone = park(&mut gw, &pay("k", "1"));
    assert!(!gw.end(&mut gone), "nothing left to wait for");
    assert!(gone.take_release().is_none());
    gw.now += 9_999;
    assert!(tick_all(&mut gw, &mut parked)[0].is_none());
    gw.now += 1;
    let r = reply(tick_all(&mut gw, &mut parked).remove(0).unwrap());
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (503, types::WAIT_EXPIRED)
    );
    assert!(header(&r, "retry-after").is_some());
    assert_eq!(
        (gw.count(Counter::WaitExpired), gw.count(Counter::Rejected)),
        (1, 0),
        "a parked wait that runs out is decided `wait_expired`, as one at the sidecar is"
    );
    assert!(parked[0].take_release().is_none());
    // The holder's entry is untouched: its response still reaches later duplicates.
    gw.respond(&mut holder, "201", "application/json", &[b"{}"]);
    assert_eq!(reply(gw.start(&pay("k", "1")).1).status, 201);
}

#[test]
fn the_holder_waiting_at_the_sidecar_behind_another_gateway_answers_the_parked_ones() {
    let mut gw = Gateway::rules(PARKING);
    let (mut holder, claim, _) = gw.claim(&pay("k", "1"));
    assert!(claim.wait.is_some(), "the holder itself may queue there");
    let mut parked = [park(&mut gw, &pay("k", "1"))];
    // The call ran on another gateway: the sidecar answers the holder with its response.
    let done = ClaimOutcome::Completed {
        response: StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
        },
        waited_ms: 300,
    };
    assert_eq!(reply(gw.answer_with(&mut holder, &done, b"{}")).status, 201);
    let r = reply(tick_all(&mut gw, &mut parked).remove(0).unwrap());
    assert_eq!(
        (r.status, header(&r, "idempotent-replayed")),
        (201, Some("true"))
    );
}

#[test]
fn lock_mode_and_shadow_mode_never_park() {
    let mut gw = Gateway::rules(QUEUED_LOCK);
    let (mut holder, _, _) = gw.claim(&put("a1"));
    gw.grant(&mut holder, 1);
    // Each queued lock waits its own turn at the sidecar.
    gw.claim(&put("a1"));
    let mut gw = Gateway::new(&format!(
        r#"{{"sidecar":{{"cluster":"s"}},"shadow":true,"rules":{PARKING}}}"#
    ));
    let (mut holder, _, _) = gw.claim(&pay("k", "1"));
    gw.grant(&mut holder, 1);
    gw.claim(&pay("k", "1"));
}
