//! What a request reports for its access-log line and the per-rule numbers: a shadowed
//! request's would-be block counted once, with the reason an enforcing rule answers with;
//! a shadowed local veto as what it would have been; a wait that ran out as its own decision.

use super::*;
use crate::metrics::{Decision, Noted};

/// What the glue keeps for the filter state from the counts and samples since `from`, as
/// its `Telemetry` feeds them to a step's `Noted`.
fn noted_since(gw: &Gateway, from: (usize, usize)) -> Noted {
    let mut noted = Noted::default();
    for counter in &gw.rec.counts[from.0..] {
        noted.count(*counter);
    }
    for (histogram, value) in &gw.rec.samples[from.1..] {
        noted.record(*histogram, *value);
    }
    noted
}

fn mark(gw: &Gateway) -> (usize, usize) {
    (gw.rec.counts.len(), gw.rec.samples.len())
}

/// Checks `action` is the 503 `wait-expired` answer; the decision and wait noted since `from`.
fn wait_expired_noted(
    gw: &Gateway,
    action: Action,
    from: (usize, usize),
) -> (Option<Decision>, Option<u64>) {
    let r = reply(action);
    assert_eq!(
        (r.status, problem_type(&r)),
        (503, types::WAIT_EXPIRED.into())
    );
    let noted = noted_since(gw, from);
    (noted.decision, noted.wait_ms)
}

/// A shadow rule limiting each key to one request a second (`tier`), rejecting duplicates.
fn shadow_limited(tier: &str) -> Gateway {
    Gateway::rules(&format!(
        r#"[{{"match":{{"path_prefix":"/payments"}},"shadow":true,
             "rate":{{"tier":"{tier}","limits":[{{"by":"key","requests":1,"per":"1s"}}]}}}}]"#
    ))
}

#[test]
fn a_shadowed_request_is_counted_once_with_the_first_decision_that_would_have_answered_it() {
    // One step: over the local limit, then a duplicate of a running call on this gateway.
    let mut gw = shadow_limited("local");
    let (mut first, _, _) = gw.claim(&post("k"));
    gw.grant(&mut first, 1);
    let from = mark(&gw);
    let (dup, action) = gw.start(&post("k"));
    assert_eq!(action, Action::pass(), "shadow mode forwards it");
    assert!(dup.is_some());
    assert_eq!(gw.count(Counter::RateLimitedLocal), 1);
    assert_eq!(gw.count(Counter::Rejected), 1, "the duplicate was seen too");
    assert_eq!(
        gw.count(Counter::ShadowWouldBlock),
        1,
        "{:?}",
        gw.rec.counts
    );
    let noted = noted_since(&gw, from);
    assert_eq!(noted.would_block, Some(Decision::RateLimited));
    assert_eq!(noted.decision, Some(Decision::Rejected));

    // Two steps: the sidecar limits it, then answers the claim busy.
    let mut gw = shadow_limited("global");
    let (mut dup, _) = rate_callout(&mut gw, &post("k"));
    let from = mark(&gw);
    assert!(matches!(
        rate_answer(&mut gw, &mut dup, &[LIMITED]),
        Action::Decide(Callout {
            path: paths::CLAIM,
            ..
        })
    ));
    assert_eq!(
        noted_since(&gw, from).would_block,
        Some(Decision::RateLimited)
    );
    let from = mark(&gw);
    let busy = ClaimOutcome::Busy {
        retry_after_ms: 1,
        queue_len: 0,
        waited: false,
    };
    assert_eq!(gw.answer_with(&mut dup, &busy, &[]), Action::pass());
    assert_eq!(gw.count(Counter::Rejected), 1);
    assert_eq!(
        gw.count(Counter::ShadowWouldBlock),
        1,
        "{:?}",
        gw.rec.counts
    );
    let claim_step = noted_since(&gw, from);
    assert_eq!(
        (claim_step.decision, claim_step.would_block),
        (Some(Decision::Rejected), None),
        "already counted and logged at the rate step"
    );

    // Every request still counts once of its own.
    let (mut other, _) = rate_callout(&mut gw, &post("k2"));
    rate_answer(&mut gw, &mut other, &[LIMITED]);
    assert_eq!(gw.count(Counter::ShadowWouldBlock), 2);
}

#[test]
fn a_shadowed_local_veto_is_decided_as_the_refusal_it_would_have_been() {
    let mut gw = Gateway::new(&format!(
        r#"{{"sidecar":{{"cluster":"s"}},"shadow":true,"rules":{QUEUED_LOCK}}}"#
    ));
    let (mut holder, _, _) = gw.claim(&put("a1"));
    gw.grant(&mut holder, 1);
    // The sidecar lost the holder's claim and grants the duplicate: this gateway runs the key.
    let (mut dup, _, _) = gw.claim(&put("a1"));
    let from = mark(&gw);
    assert_eq!(
        gw.grant(&mut dup, 2),
        Action::Continue(vec![("x-fencing-token".into(), "2".into())]),
        "shadow mode forwards it, with its grant"
    );
    assert_eq!(gw.count(Counter::LocalVetoes), 1);
    let noted = noted_since(&gw, from);
    assert_eq!(noted.decision, Some(Decision::Rejected), "not `granted`");
    assert_eq!(noted.would_block, Some(Decision::Rejected));
    assert_eq!(gw.count(Counter::ShadowWouldBlock), 1);
}

#[test]
fn a_wait_that_runs_out_is_its_own_decision_with_the_time_it_waited() {
    // At the sidecar: the claim's answer comes when the budget is spent. (With the local
    // tier on, a duplicate on the holder's own gateway waits there instead.)
    let mut gw = Gateway::new(&format!(
        r#"{{"sidecar":{{"cluster":"s"}},"local":{{"enabled":false}},"rules":{QUEUE}}}"#
    ));
    let (mut first, _, _) = gw.claim(&post("k"));
    gw.grant(&mut first, 1);
    let (mut waiter, _, _) = gw.claim(&post("k"));
    let from = mark(&gw);
    gw.now += 10_000;
    let expired = ClaimOutcome::Busy {
        retry_after_ms: 4_000,
        queue_len: 1,
        waited: true,
    };
    let action = gw.answer_with(&mut waiter, &expired, &[]);
    assert_eq!(
        wait_expired_noted(&gw, action, from),
        (Some(Decision::WaitExpired), Some(10_000))
    );
    assert_eq!(
        (
            gw.count(Counter::WaitExpired),
            gw.count(Counter::Rejected),
            gw.count(Counter::Queued)
        ),
        (1, 0, 1)
    );

    // On this gateway, after a local veto: the decision too (the wait recorded is the
    // sidecar's, here none: it granted at once, having lost the holder's claim).
    let mut gw = Gateway::rules(QUEUED_LOCK);
    let (mut holder, _, _) = gw.claim(&put("a1"));
    gw.grant(&mut holder, 1);
    let (mut waiter, _, _) = gw.claim(&put("a1"));
    assert_eq!(gw.grant(&mut waiter, 2), Action::Wait, "vetoed: waits here");
    gw.now += 10_500;
    let from = mark(&gw);
    let action = tick(&mut gw, &mut waiter).expect("the wait ended");
    assert_eq!(
        wait_expired_noted(&gw, action, from),
        (Some(Decision::WaitExpired), None)
    );
    assert_eq!(gw.count(Counter::Rejected), 0);
}
