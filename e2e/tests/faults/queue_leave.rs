//! Clients that give up while queued: the filter names each queued claim's waiter and the
//! root sends `/v1/leave` when the stream ends, so their places do not fill the queue.

use crate::rig::*;
use idemgate_e2e::client::http;
use std::time::{Duration, Instant};

/// Lock mode, queued, at most 8 waiters per agent (what 30 quitters would fill).
const QUEUED_TOOLS: &str = r#"[{"name":"tools","mode":"lock","match":{"path_template":"/agents/{agent}/tools"},"key":{"path_param":"agent"},"lease":"5s","on_conflict":"queue","queue":{"max_wait":"10s","max_queue":8}}]"#;

fn attach_request(tool: &str) -> String {
    let body = format!(r#"{{"tool":"{tool}"}}"#);
    format!(
        "POST /agents/q7/tools HTTP/1.1\r\nhost: api.test\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// A sidecar gauge or counter from its `/metrics` (0 when absent).
fn sidecar_metric(rig: &Rig, line_prefix: &str) -> f64 {
    let metrics = http(rig.sidecar_addr(), "GET", "/metrics", &[], "");
    metrics
        .body
        .lines()
        .find_map(|l| l.strip_prefix(line_prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn clients_that_give_up_while_queued_leave_their_places() {
    let rig = Rig::start(Options {
        rules: QUEUED_TOOLS,
        ..Options::default()
    });
    let addr = rig.addr;
    let holder = std::thread::spawn(move || attach_tool(addr, "q7", "holder", "1500"));
    std::thread::sleep(Duration::from_millis(200));

    // 30 clients with a 300 ms timeout queue behind the holder and give up.
    let quitters: Vec<_> = (0..30)
        .map(|i| {
            std::thread::spawn(move || {
                send_and_abort(
                    addr,
                    &attach_request(&format!("quitter-{i}")),
                    Duration::from_millis(300),
                );
            })
        })
        .collect();
    for q in quitters {
        q.join().unwrap();
    }
    // Every place they took (the queue holds 8) is given up, by name, within a few ticks.
    let deadline = Instant::now() + Duration::from_secs(3);
    while rig.counter("idemgate.queue.left") < 8
        || sidecar_metric(&rig, "idemgate_sidecar_waiters ") > 0.0
    {
        assert!(
            Instant::now() < deadline,
            "places left: {} (filter), waiters still queued at the sidecar: {}",
            rig.counter("idemgate.queue.left"),
            sidecar_metric(&rig, "idemgate_sidecar_waiters ")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(rig.counter("idemgate.queue.left"), 8);
    assert_eq!(rig.counter("idemgate.requests.abandoned"), 8);

    // A legitimate request now is queued (not refused queue-full) and runs as soon as the
    // holder finishes.
    let legit = attach_tool(addr, "q7", "legit", "50");
    let holder = holder.join().unwrap();
    assert_eq!(holder.status(), 200, "{holder:?}");
    assert_eq!(legit.status(), 200, "{legit:?}");
    assert!(
        legit.took < Duration::from_millis(1_500),
        "handed the key at the holder's end, not after dead places: {:?}",
        legit.took
    );
    let stats = rig.stats();
    assert_eq!(
        stats.agent_tools["q7"],
        ["holder", "legit"],
        "no quitter ran"
    );
    assert_eq!(stats.max_overlap, 1, "{stats:?}");
    assert_eq!(rig.counter("idemgate.release.failures"), 0);
    rig.assert_no_lock_held_after(Duration::from_secs(5));
}
