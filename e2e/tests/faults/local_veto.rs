//! Redis loses its data while a call runs: the sidecar forgets the holder and grants the
//! requests queued behind it. The gateway running the holder knows better — its local tier
//! vetoes those grants until the holder ends, so queued requests never run beside it.

use crate::rig::*;
use std::time::Duration;

const QUEUED_TOOLS: &str = r#"[{"name":"tools","mode":"lock","match":{"path_template":"/agents/{agent}/tools"},"key":{"path_param":"agent"},"lease":"5s","on_conflict":"queue","queue":{"max_wait":"10s","max_queue":16}}]"#;

#[test]
fn redis_emptied_queued_waiters_never_run_beside_this_gateways_holder() {
    let rig = Rig::start(Options {
        rules: QUEUED_TOOLS,
        ..Options::default()
    });
    let addr = rig.addr;
    let holder = std::thread::spawn(move || attach_tool(addr, "v1", "holder", "1500"));
    std::thread::sleep(Duration::from_millis(200));
    let waiters: Vec<_> = (0..5)
        .map(|i| std::thread::spawn(move || attach_tool(addr, "v1", &format!("w{i}"), "50")))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // Redis empties (a restart without persistence) while the holder runs.
    rig.redis().cli(&["FLUSHALL"]).expect("FLUSHALL");

    let holder = holder.join().unwrap();
    let waiters: Vec<Call> = waiters.into_iter().map(|w| w.join().unwrap()).collect();
    assert_eq!(holder.status(), 200, "{holder:?}");
    assert_all_answered(waiters.iter(), &[200]);
    let stats = rig.stats();
    assert_eq!(
        stats.max_overlap, 1,
        "no waiter ran beside the holder: {stats:?}"
    );
    let tools = &stats.agent_tools["v1"];
    assert_eq!(tools.len(), 6, "{tools:?}");
    assert_eq!(tools[0], "holder");
    assert!(
        rig.counter("idemgate.local.vetoes") >= 1,
        "the sidecar granted a waiter beside the holder and the local tier held it back"
    );
    rig.assert_no_lock_held_after(Duration::from_secs(5));
}
