//! A holder cut off past its lease: the key goes to the next caller with a higher fencing
//! token, and the backend refuses the old holder's late write.

use crate::rig::*;
use idemgate_rig::fault_proxy::Fault;
use std::time::{Duration, Instant};

const TOOLS: &str = r#"[{"name":"tools","mode":"lock","match":{"path_template":"/agents/{agent}/tools"},"key":{"path_param":"agent"},"lease":"1s","on_conflict":"queue","queue":{"max_wait":"10s"}}]"#;

#[test]
fn a_holder_partitioned_past_its_lease_is_fenced_out_by_the_backend() {
    let rig = Rig::start(Options {
        rules: TOOLS,
        ..Options::default()
    });
    let other = rig.second_gateway(TOOLS);
    let other_addr = other.addr();
    let addr = rig.addr;
    // Gateway A's holder runs 3 s; its lease is 1 s, renewed every 0.5 s from the tick.
    let stalled = std::thread::spawn(move || {
        send(
            addr,
            "POST",
            "/agents/a7/tools",
            &[
                ("content-type", "application/json"),
                ("x-demo-work-ms", "3000"),
            ],
            r#"{"tool":"stalled"}"#,
        )
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while rig.held_keys().is_empty() {
        assert!(Instant::now() < deadline, "never granted");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Gateway A loses the sidecar: its renewals stop arriving, the lease runs out.
    rig.sidecar_proxy().set(Fault::Blackhole);
    let next = send(
        other_addr,
        "POST",
        "/agents/a7/tools",
        &[
            ("content-type", "application/json"),
            ("x-demo-work-ms", "50"),
        ],
        r#"{"tool":"next"}"#,
    );
    assert_eq!(
        next.status(),
        200,
        "granted once the lease ran out: {next:?}"
    );
    let stalled = stalled.join().unwrap();
    assert_eq!(
        stalled.status(),
        409,
        "the late write is refused: {stalled:?}"
    );
    assert!(
        stalled.reply.body.contains("stale fencing token"),
        "{stalled:?}"
    );
    let stats = rig.stats();
    assert_eq!(stats.stale_refused, 1, "{stats:?}");
    assert_eq!(stats.agent_tools["a7"], ["next"]);
    let fences = &stats.fences["agent:a7"];
    assert_eq!(fences.len(), 1, "only the newer holder wrote: {stats:?}");
    assert!(
        rig.counter("idemgate.sidecar.errors") >= 1,
        "renewals failed"
    );
    rig.sidecar_proxy().set(Fault::None);
    other.shutdown();
    rig.assert_no_lock_held_after(Duration::from_secs(1));
}
