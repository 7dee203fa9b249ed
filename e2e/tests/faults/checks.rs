//! The rig's own checks must be able to fail: a lock deliberately left behind is seen by
//! both halves of [`Rig::assert_no_lock_held_after`] (the sidecar's listing and Redis's
//! records), and neither sees it once it is released.

use crate::rig::*;
use idemgate_e2e::client::http;
use idemgate_wire::{ClaimOutcome, ClaimRequest, Mode, paths};

#[test]
fn the_lock_leak_check_sees_a_lock_left_behind() {
    let rig = Rig::start(Options::default());
    // Claimed straight at the sidecar and never completed: a lock left behind.
    let claim = ClaimRequest {
        key: "left-behind".into(),
        mode: Mode::Lock,
        lease_ms: 60_000,
        fingerprint: None,
        wait: None,
        waiter: None,
    };
    let frame = String::from_utf8(idemgate_wire::encode(&claim, &[])).unwrap();
    let reply = http(rig.sidecar_addr(), "POST", paths::CLAIM, &[], &frame);
    let (outcome, _): (ClaimOutcome, _) =
        idemgate_wire::decode(reply.body.as_bytes()).expect("a claim answer");
    assert!(
        matches!(outcome, ClaimOutcome::Granted { .. }),
        "{outcome:?}"
    );

    assert_eq!(rig.held_keys(), ["left-behind"]);
    assert_eq!(rig.redis_locks(), ["idemgate:{left-behind}:record"]);

    let release = http(
        rig.sidecar_addr(),
        "POST",
        "/admin/v1/release",
        &[("content-type", "application/json")],
        r#"{"key":"left-behind"}"#,
    );
    assert_eq!(release.status, 200, "{release:?}");
    // The record stays (it keeps the fence) but holds nothing: both halves agree.
    assert!(rig.held_keys().is_empty());
    assert!(rig.redis_locks().is_empty());
    rig.assert_no_lock_held_after(std::time::Duration::ZERO);
}
