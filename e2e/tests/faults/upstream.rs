//! The upstream fails: 5xx, timeout, reset. Nothing is stored, the key is released, and the
//! client's retry runs again.

use crate::rig::*;
use idemgate_rig::fault_proxy::Fault;
use std::time::Duration;

#[test]
fn upstream_5xx_timeout_and_reset_release_the_key_and_the_retry_runs_again() {
    let rig = Rig::start(Options {
        route_timeout: Duration::from_secs(1),
        ..Options::default()
    });
    let addr = rig.addr;
    let headers = |key: &'static str, extra: (&'static str, &'static str)| {
        [
            ("idempotency-key", key),
            ("content-type", "application/json"),
            extra,
        ]
    };

    // 5xx: answered as is, not stored.
    let failed = rig.send(
        "POST",
        "/payments",
        &headers("up-500", ("x-demo-status", "500")),
        r#"{"amount":1}"#,
    );
    assert_eq!(failed.status(), 500);
    // The release is asynchronous (the root dispatches it once woken): a retry sent
    // within milliseconds can still meet the key, so clients retry as they would on 409.
    let retry = until_status(201, Duration::from_secs(10), || pay(addr, "up-500", 10));
    assert_eq!(retry.status(), 201, "{retry:?}");
    assert_eq!(retry.reply.header("idempotent-replayed"), None);

    // Timeout: the route gives up after 1 s (504); the backend's handler is cancelled with
    // the upstream connection, so the retry is the only charge.
    let slow = rig.send(
        "POST",
        "/payments",
        &headers("up-timeout", ("x-demo-work-ms", "3000")),
        r#"{"amount":1}"#,
    );
    assert_eq!(slow.status(), 504, "{slow:?}");
    let retry = until_status(201, Duration::from_secs(10), || pay(addr, "up-timeout", 10));
    assert_eq!(retry.status(), 201, "{retry:?}");

    // Reset: the backend's connection is reset (503 from the router), released.
    rig.backend_proxy().set(Fault::Reset);
    let reset = pay(addr, "up-reset", 10);
    assert_eq!(reset.status(), 503, "{reset:?}");
    rig.backend_proxy().set(Fault::None);
    let retry = until_status(201, Duration::from_secs(10), || pay(addr, "up-reset", 10));
    assert_eq!(retry.status(), 201, "{retry:?}");

    // Past the timed-out call's own work time: it never committed.
    std::thread::sleep(Duration::from_millis(2_500));
    let stats = rig.stats();
    assert_eq!((stats.charges, stats.double_charges), (3, 0), "{stats:?}");
    assert!(rig.counter("idemgate.requests.granted") >= 6);
    rig.assert_no_lock_held_after(Duration::from_secs(2));
}
