//! Redis dies, restarts empty, turns slow, or disappears behind a partition.

use crate::rig::*;
use idemgate_rig::fault_proxy::Fault;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[test]
fn redis_killed_and_restarted_empty_mid_run_executes_nothing_twice() {
    let mut rig = Rig::start(Options::default());
    let addr = rig.addr;
    let outage_over = AtomicBool::new(false);
    let calls = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let mut calls = Vec::new();
            // Waves of fresh keys, each sent 4 times at once, until the outage is over
            // and two more waves ran (bounded).
            let mut after = 0;
            for wave in 0..40 {
                calls.extend(duplicate_payments(
                    addr,
                    &keys(&format!("redis-kill-{wave}"), 6),
                    4,
                    200,
                ));
                if outage_over.load(Ordering::SeqCst) {
                    after += 1;
                    if after == 2 {
                        break;
                    }
                }
            }
            calls
        });
        std::thread::sleep(Duration::from_millis(400));
        rig.redis_mut().stop();
        std::thread::sleep(Duration::from_millis(700));
        rig.redis_mut().restart().expect("redis restarts (empty)");
        outage_over.store(true, Ordering::SeqCst);
        load.join().unwrap()
    });
    assert_all_answered(&calls, &[201, 409, 503]);
    let stats = rig.stats();
    assert_eq!(stats.double_charges, 0, "{stats:?}");
    let keys_sent = calls.len() as u64 / 4;
    assert!(stats.charges <= keys_sent, "{stats:?}");
    let unavailable = calls.iter().filter(|c| c.status() == 503).count() as i64;
    assert!(unavailable > 0, "the outage was felt");
    assert_eq!(
        rig.counter("idemgate.requests.failed_closed"),
        unavailable,
        "every 503 is counted"
    );
    // Recovered: a fresh key goes through again.
    let after = until_status(201, Duration::from_secs(20), || {
        pay(addr, "redis-kill-after", 10)
    });
    assert_eq!(after.status(), 201, "{after:?}");
    rig.assert_no_lock_held_after(Duration::from_secs(2));
}

#[test]
fn redis_slow_then_blackholed_answers_within_bounds_and_recovers() {
    let rig = Rig::start(Options {
        sidecar_timeout: "5s",
        store_timeout: Duration::from_secs(2),
        ..Options::default()
    });
    // Slow: 200 ms each way on every Redis exchange. Everything still works, once per key.
    rig.redis_proxy()
        .set(Fault::Latency(Duration::from_millis(200)));
    let slow_keys = keys("redis-slow", 4);
    let calls = duplicate_payments(rig.addr, &slow_keys, 3, 100);
    assert_all_answered(&calls, &[201, 409]);
    let stats = rig.stats();
    assert_eq!(stats.charges, 4, "each key ran exactly once: {stats:?}");
    assert_eq!(stats.double_charges, 0);

    // Blackholed: the sidecar's Redis calls time out (2 s), it answers 503, the filter fails
    // closed within its callout timeout.
    rig.redis_proxy().set(Fault::Blackhole);
    let calls = duplicate_payments(rig.addr, &keys("redis-hole", 2), 2, 100);
    assert_all_answered(&calls, &[409, 503]);
    assert!(calls.iter().any(|c| c.status() == 503));
    for call in calls.iter().filter(|c| c.status() == 503) {
        assert_eq!(call.problem_type(), "urn:idemgate:problem:unavailable");
        assert!(call.reply.header("retry-after").is_some());
    }
    assert!(rig.counter("idemgate.requests.failed_closed") >= 1);
    assert_eq!(rig.stats().charges, 4, "nothing ran during the partition");

    rig.redis_proxy().set(Fault::None);
    let healed = until_status(201, Duration::from_secs(20), || {
        pay(rig.addr, "redis-healed", 10)
    });
    assert_eq!(healed.status(), 201, "{healed:?}");
    assert_eq!(rig.stats().double_charges, 0);
    rig.assert_no_lock_held_after(Duration::from_secs(2));
}
