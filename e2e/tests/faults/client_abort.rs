//! Clients that go away: while queued, while the upstream runs (work the backend finishes
//! detached), while the request body streams.

use crate::rig::*;
use std::time::Duration;

const TOOLS_HOLD: &str = r#"[{"name":"tools","mode":"lock","match":{"path_template":"/agents/{agent}/tools"},"key":{"path_param":"agent"},"lease":"2s"}]"#;
const TOOLS_RELEASE: &str = r#"[{"name":"tools","mode":"lock","match":{"path_template":"/agents/{agent}/tools"},"key":{"path_param":"agent"},"lease":"2s","on_client_abort":"release"}]"#;

fn attach_request(agent: &str, tool: &str, extra: &str) -> String {
    let body = format!(r#"{{"tool":"{tool}"}}"#);
    format!(
        "POST /agents/{agent}/tools HTTP/1.1\r\nhost: api.test\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra}\r\n{body}",
        body.len()
    )
}

fn attach(rig: &Rig, agent: &str, tool: &str) -> Call {
    rig.send(
        "POST",
        &format!("/agents/{agent}/tools"),
        &[
            ("content-type", "application/json"),
            ("x-demo-work-ms", "50"),
        ],
        &format!(r#"{{"tool":"{tool}"}}"#),
    )
}

/// A client starts a 1 s attach the backend finishes even without it, and leaves after
/// 300 ms; another client retries at once.
fn abort_then_retry(rig: &Rig) -> Call {
    send_and_abort(
        rig.addr,
        &attach_request(
            "a1",
            "first",
            "x-demo-detach: 1\r\nx-demo-work-ms: 1000\r\n",
        ),
        Duration::from_millis(300),
    );
    attach(rig, "a1", "retry")
}

#[test]
fn client_abort_after_forwarding_holds_the_key_until_the_lease_ends() {
    let rig = Rig::start(Options {
        rules: TOOLS_HOLD,
        ..Options::default()
    });
    let retry = abort_then_retry(&rig);
    assert_eq!(retry.status(), 409, "the key is still held: {retry:?}");
    assert_eq!(retry.problem_type(), "urn:idemgate:problem:in-progress");
    // The lease ends (no renewals after the abort), then the retry runs, alone.
    let retry = until_status(200, Duration::from_secs(15), || attach(&rig, "a1", "retry"));
    assert_eq!(retry.status(), 200, "{retry:?}");
    let stats = rig.stats();
    assert_eq!(
        stats.max_overlap, 1,
        "never ran beside the detached call: {stats:?}"
    );
    assert_eq!(stats.stale_refused, 0);
    assert_eq!(stats.agent_tools["a1"], ["first", "retry"]);
    assert_eq!(rig.counter("idemgate.requests.abandoned_upstream"), 1);
    rig.assert_no_lock_held_after(Duration::from_secs(2));
}

#[test]
fn client_abort_release_policy_lets_the_retry_run_beside_detached_work() {
    // The opt-in old behaviour, shown for contrast: the retry overlaps the detached call,
    // and only the fencing token keeps the late write out.
    let rig = Rig::start(Options {
        rules: TOOLS_RELEASE,
        ..Options::default()
    });
    let retry = abort_then_retry(&rig);
    // Released at once (the abort callout leaves once the root is woken).
    let retry = if retry.status() == 409 {
        until_status(200, Duration::from_secs(10), || attach(&rig, "a1", "retry"))
    } else {
        retry
    };
    assert_eq!(retry.status(), 200, "{retry:?}");
    // Wait for the detached call to finish its write.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while rig.stats().stale_refused == 0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", rig.stats());
        std::thread::sleep(Duration::from_millis(50));
    }
    let stats = rig.stats();
    assert_eq!(stats.max_overlap, 2, "{stats:?}");
    assert_eq!(
        stats.agent_tools["a1"],
        ["retry"],
        "the stale write was refused"
    );
    assert_eq!(rig.counter("idemgate.requests.abandoned_upstream"), 0);
}

#[test]
fn client_abort_while_queued_or_while_the_body_streams_leaks_nothing() {
    let rig = Rig::start(Options {
        rules: r#"[{"name":"tools","mode":"lock","match":{"path_template":"/agents/{agent}/tools"},"key":{"path_param":"agent"},"lease":"2s","on_conflict":"queue","queue":{"max_wait":"10s"}}]"#,
        ..Options::default()
    });
    let addr = rig.addr;
    // Queued behind a 1 s holder, the client leaves: it never runs, the holder's release
    // hands the key on, and the next caller gets it.
    let holder = std::thread::spawn(move || {
        send(
            addr,
            "POST",
            "/agents/q1/tools",
            &[
                ("content-type", "application/json"),
                ("x-demo-work-ms", "1000"),
            ],
            r#"{"tool":"holder"}"#,
        )
    });
    std::thread::sleep(Duration::from_millis(200));
    send_and_abort(
        addr,
        &attach_request("q1", "quitter", ""),
        Duration::from_millis(300),
    );
    assert_eq!(holder.join().unwrap().status(), 200);
    let next = until_status(200, Duration::from_secs(15), || attach(&rig, "q1", "next"));
    assert_eq!(next.status(), 200, "{next:?}");
    assert_eq!(rig.stats().agent_tools["q1"], ["holder", "next"]);

    // The body streams (10 of 100 bytes) when the client leaves: the backend never gets a
    // whole request; the key is held until its lease ends, then free.
    let partial = "POST /agents/b1/tools HTTP/1.1\r\nhost: api.test\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"tool\":\"x";
    send_and_abort(addr, partial, Duration::from_millis(300));
    let after = until_status(200, Duration::from_secs(15), || attach(&rig, "b1", "whole"));
    assert_eq!(after.status(), 200, "{after:?}");
    let stats = rig.stats();
    assert_eq!(stats.agent_tools["b1"], ["whole"]);
    assert_eq!(stats.max_overlap, 1, "{stats:?}");
    rig.assert_no_lock_held_after(Duration::from_secs(2));
}
