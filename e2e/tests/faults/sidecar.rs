//! The sidecar dies mid long-poll and comes back, is cut off by a partition, or answers
//! garbage.

use crate::rig::*;
use idemgate_rig::fault_proxy::Fault;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

const QUEUED_PAYMENTS: &str = r#"[{"name":"payments","match":{"path_prefix":"/payments"},"lease":"2s","on_conflict":"queue","queue":{"max_wait":"10s"}}]"#;

/// Waits (bounded) until the one held key has `n` waiters; returns the stored key.
fn wait_for_waiters(rig: &Rig, n: u64) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(key) = rig.held_keys().pop() {
            let info = idemgate_e2e::client::http(
                rig.sidecar_addr(),
                "GET",
                &format!("/admin/v1/keys/{key}"),
                &[],
                "",
            );
            let info: serde_json::Value = serde_json::from_str(&info.body).unwrap_or_default();
            if info["queue_len"].as_u64() == Some(n) {
                return key;
            }
        }
        assert!(Instant::now() < deadline, "never saw {n} waiters");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sidecar_killed_mid_long_poll_and_restarted_loses_nothing() {
    // Without the local tier: duplicates on one gateway would wait on its shared data for the
    // holder; here they wait at the sidecar in long-polls, as duplicates from other gateways do.
    let mut rig = Rig::start(Options {
        rules: QUEUED_PAYMENTS,
        plugin_extra: r#""local":{"enabled":false}"#,
        ..Options::default()
    });
    let addr = rig.addr;
    let holder = std::thread::spawn(move || pay(addr, "sidecar-kill", 1_500));
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            std::thread::spawn(move || pay(addr, "sidecar-kill", 1_500))
        })
        .collect();
    wait_for_waiters(&rig, 3);
    rig.kill_sidecar();
    rig.restart_sidecar();
    let waiters: Vec<Call> = waiters.into_iter().map(|w| w.join().unwrap()).collect();
    // Their long-polls were cut: failed closed, promptly, never run.
    assert_all_answered(&waiters, &[503]);
    for w in &waiters {
        assert_eq!(w.problem_type(), "urn:idemgate:problem:unavailable");
    }
    let holder = holder.join().unwrap();
    assert_eq!(holder.status(), 201, "{holder:?}");
    // The holder's completion reached the new sidecar: a retry is a replay.
    let retry = pay(addr, "sidecar-kill", 10);
    assert_eq!(retry.status(), 201);
    assert_eq!(
        retry.reply.header("idempotent-replayed"),
        Some("true"),
        "{retry:?}"
    );
    let stats = rig.stats();
    assert_eq!((stats.charges, stats.double_charges), (1, 0), "{stats:?}");
    assert!(rig.counter("idemgate.requests.failed_closed") >= 3);
    rig.assert_no_lock_held_after(Duration::from_secs(2));
}

#[test]
fn gateway_sidecar_partition_fails_closed_and_orphaned_grants_expire() {
    let rig = Rig::start(Options::default());
    rig.sidecar_proxy().set(Fault::Blackhole);
    // Each claim times out after the 1 s callout timeout: 503, never forwarded.
    let calls = duplicate_payments(rig.addr, &keys("partition", 3), 1, 10);
    assert_all_answered(&calls, &[503]);
    // Once a worker's breaker opens (3 consecutive failures on that worker), it answers
    // without a callout for its 1 s cooldown. Calls go out in concurrent rounds: one at a
    // time, each taking the 1 s callout timeout, could keep landing on the other worker until
    // a breaker's cooldown has passed, and then only ever meet half-open probes.
    let mut more = Vec::new();
    for round in 0..10 {
        more.extend(duplicate_payments(
            rig.addr,
            &keys(&format!("partition-breaker-{round}"), 4),
            1,
            10,
        ));
        if rig.counter("idemgate.sidecar.breaker_open") > 0 {
            break;
        }
    }
    assert_all_answered(&more, &[503]);
    assert!(rig.counter("idemgate.sidecar.breaker_open") >= 1);
    assert!(rig.counter("idemgate.requests.failed_closed") >= 4);
    assert!(rig.counter("idemgate.sidecar.errors") >= 3);
    assert_eq!(rig.stats().executions, 0);

    // Healed. A claim held back by the partition can still reach the sidecar (if its
    // connection survived) and be granted to an owner that gave up: such a key is busy until
    // its lease ends, then runs once.
    rig.sidecar_proxy().set(Fault::None);
    let retried = until_status(201, Duration::from_secs(15), || {
        pay(rig.addr, "partition-0", 10)
    });
    assert_eq!(retried.status(), 201, "{retried:?}");
    let stats = rig.stats();
    assert_eq!((stats.charges, stats.double_charges), (1, 0), "{stats:?}");
    rig.assert_no_lock_held_after(Duration::from_secs(2));
}

/// A fake sidecar that answers every request with `answer` and closes.
fn fake_sidecar(answer: &'static [u8]) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                conn.set_read_timeout(Some(Duration::from_millis(200))).ok();
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf);
                let _ = conn.write_all(answer);
            });
        }
    });
    addr
}

#[test]
fn sidecar_answering_500_or_garbage_fails_closed() {
    // HTTP/1.1 to the sidecar, so the fake answers below are what the callout client parses.
    let rig = Rig::start(Options {
        sidecar_http2: false,
        ..Options::default()
    });
    let answers: [&[u8]; 4] = [
        b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-type: application/x-idemgate-v1\r\ncontent-length: 9\r\nconnection: close\r\n\r\nnot json\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 40\r\nconnection: close\r\n\r\n{\"outcome\":\"granted\"}\n",
        b"\x00\x01 this is not HTTP\r\n\r\n",
    ];
    let mut before = 0;
    for (i, answer) in answers.into_iter().enumerate() {
        // Drop pooled connections to the previous sidecar, then point at the fake one.
        rig.sidecar_proxy().set(Fault::Close);
        std::thread::sleep(Duration::from_millis(100));
        rig.sidecar_proxy().retarget(fake_sidecar(answer));
        rig.sidecar_proxy().set(Fault::None);
        // Past the breaker's cooldown, so this answer is really asked for.
        std::thread::sleep(Duration::from_millis(1_100));
        let call = pay(rig.addr, &format!("garbage-{i}"), 10);
        assert_all_answered(std::slice::from_ref(&call), &[503]);
        assert_eq!(call.problem_type(), "urn:idemgate:problem:unavailable");
        let errors = rig.counter("idemgate.sidecar.errors");
        assert!(errors > before, "answer {i} counted as a sidecar error");
        before = errors;
    }
    assert_eq!(rig.stats().executions, 0, "nothing ran on a garbage grant");
}

#[test]
fn two_sidecars_one_dies_the_other_gateway_is_unaffected() {
    let rig = Rig::start(Options::default());
    let doomed = rig.another_sidecar();
    let other = rig.gateway_to(doomed.addr(), PAYMENTS);
    let gateways = [rig.addr, other.addr()];
    let before: Vec<_> = (0..3)
        .flat_map(|wave| duplicates_on_both(gateways, wave))
        .collect();
    doomed.kill().expect("the doomed sidecar dies");
    let after: Vec<_> = (3..6)
        .flat_map(|wave| duplicates_on_both(gateways, wave))
        .collect();
    assert_all_answered(before.iter().map(|(_, c)| c), &[201, 409]);
    // After the death: gateway B fails closed, gateway A decides as before.
    assert_all_answered(after.iter().map(|(_, c)| c), &[201, 409, 503]);
    let (on_a, on_b): (Vec<_>, Vec<_>) = after.iter().partition(|(g, _)| *g == 0);
    assert!(on_a.iter().all(|(_, c)| c.status() != 503), "{on_a:?}");
    assert!(on_b.iter().any(|(_, c)| c.status() == 503), "{on_b:?}");
    let stats = rig.stats();
    assert_eq!(stats.double_charges, 0, "{stats:?}");
    assert_eq!(stats.charges, 6 * 3, "each key ran once: {stats:?}");
    other.shutdown();
    rig.assert_no_lock_held_after(Duration::from_secs(2));
}

/// Three keys, each sent twice to each gateway at once; calls tagged with their gateway.
fn duplicates_on_both(gateways: [SocketAddr; 2], wave: usize) -> Vec<(usize, Call)> {
    let threads: Vec<_> = (0..3)
        .flat_map(|k| [(0, k), (0, k), (1, k), (1, k)])
        .map(|(g, k)| {
            let addr = gateways[g];
            std::thread::spawn(move || (g, pay(addr, &format!("two-{wave}-{k}"), 100)))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}
