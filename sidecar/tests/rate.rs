//! The global rate tier (`POST /v1/rate`), one behavioural suite for both stores, plus a
//! Redis Cluster run (every limit is one key, one slot).

use crate::util::{Backend, Client, Harness, store_suite};
use idemgate_sidecar::testing::RedisCluster;
use idemgate_wire::{RateCheck, RateOutcome, RateRequest, paths};
use std::time::{Duration, Instant};

store_suite!(
    a_burst_then_limited_with_an_accurate_retry_after,
    concurrent_checks_never_spend_a_unit_twice,
    checks_stop_at_the_first_limited_one,
    malformed_checks_are_refused,
);

fn check(key: &str, interval_us: u64, burst: u32) -> RateCheck {
    RateCheck {
        key: key.into(),
        interval_us,
        burst,
    }
}

async fn rate(client: &Client, checks: Vec<RateCheck>) -> RateOutcome {
    let reply = client.post(paths::RATE, &RateRequest { checks }, &[]).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    idemgate_wire::decode::<RateOutcome>(&reply.body).unwrap().0
}

async fn a_burst_then_limited_with_an_accurate_retry_after(backend: Backend) {
    let h = Harness::start(backend).await;
    // 5 per 2 s (one per 400 ms), burst 5.
    let limit = || vec![check("burst-key", 400_000, 5)];
    for remaining in (0..5).rev() {
        let out = rate(&h.client, limit()).await;
        assert!(out.results[0].allowed);
        assert!(out.results[0].remaining <= remaining);
    }
    let limited = rate(&h.client, limit()).await.results[0];
    assert!(!limited.allowed);
    assert_eq!(limited.remaining, 0);
    assert!((1..=400).contains(&limited.retry_after_ms), "{limited:?}");
    // Waiting the advertised time is enough (bounded: at most a few waits).
    let started = Instant::now();
    let mut wait = limited.retry_after_ms;
    loop {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let out = rate(&h.client, limit()).await.results[0];
        if out.allowed {
            break;
        }
        // Only the time taken by the request itself can be missing (clock granularity).
        assert!(out.retry_after_ms <= 5, "waited {wait} ms, still {out:?}");
        wait = out.retry_after_ms;
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    // A different key has its own burst.
    assert!(
        rate(&h.client, vec![check("other-key", 400_000, 5)])
            .await
            .results[0]
            .allowed
    );
}

async fn concurrent_checks_never_spend_a_unit_twice(backend: Backend) {
    let h = Harness::start(backend).await;
    // One unit a minute, burst 50: 200 concurrent checks, exactly 50 pass (the refill
    // during the test is far below one unit).
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let client = h.client.clone();
        tasks.push(tokio::spawn(async move {
            rate(&client, vec![check("hot-key", 60_000_000, 50)])
                .await
                .results[0]
                .allowed
        }));
    }
    let mut allowed = 0;
    for task in tasks {
        if task.await.unwrap() {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 50);
}

async fn checks_stop_at_the_first_limited_one(backend: Backend) {
    let h = Harness::start(backend).await;
    let both = || {
        vec![
            check("caller", 60_000_000, 1),
            check("resource", 60_000_000, 3),
        ]
    };
    let first = rate(&h.client, both()).await;
    assert_eq!(first.results.len(), 2);
    assert!(first.results.iter().all(|r| r.allowed));
    let second = rate(&h.client, both()).await;
    assert_eq!(second.results.len(), 1, "stopped at the caller's limit");
    assert!(!second.results[0].allowed);
    // The resource limit was not spent by the limited request.
    let resource = rate(&h.client, vec![check("resource", 60_000_000, 3)]).await;
    assert_eq!(resource.results[0].remaining, 1);
    // Every answer is counted by its decision.
    let text = String::from_utf8_lossy(&h.client.get("/metrics").await.body).into_owned();
    for line in [
        "idemgate_sidecar_rate_decisions_total{outcome=\"allowed\"} 2",
        "idemgate_sidecar_rate_decisions_total{outcome=\"limited\"} 1",
    ] {
        assert!(text.contains(line), "{line} missing in\n{text}");
    }
}

async fn malformed_checks_are_refused(backend: Backend) {
    let h = Harness::start(backend).await;
    let (bad, too_large) = (
        idemgate_wire::problem_types::BAD_REQUEST,
        idemgate_wire::problem_types::TOO_LARGE,
    );
    for (checks, status, type_uri) in [
        (vec![], 400, bad),
        (vec![check("k", 0, 1)], 400, bad),
        (vec![check("k", 1, 0)], 400, bad),
        (vec![check("k", 3_600_000_000, 25)], 400, bad),
        (vec![check("", 1, 1)], 400, bad),
        (vec![check(&"k".repeat(129), 1, 1)], 413, too_large),
        (vec![check("k", 1, 1); 5], 413, too_large),
    ] {
        let reply = h
            .client
            .post(paths::RATE, &RateRequest { checks }, &[])
            .await;
        assert_eq!(reply.status, status);
        assert_eq!(reply.problem().type_uri, type_uri);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let h = Harness::on_store(cluster.store_config(), None, |_| {}).await;
    // Keys land on all three nodes; each limit holds on its own.
    for i in 0..12 {
        let key = format!("cluster-rate-{i}");
        for _ in 0..3 {
            assert!(
                rate(&h.client, vec![check(&key, 60_000_000, 3)])
                    .await
                    .results[0]
                    .allowed
            );
        }
        assert!(
            !rate(&h.client, vec![check(&key, 60_000_000, 3)])
                .await
                .results[0]
                .allowed
        );
    }
    for node in cluster.nodes() {
        let keys: u64 = node.cli(&["dbsize"]).unwrap().trim().parse().unwrap();
        assert!(keys > 0, "every node holds some limits");
    }
}
