//! Redis topologies beyond a standalone server: a three-node Cluster (keys spread over
//! slots, every script stays in one slot, listing scans every primary), a primary's failover
//! on a Cluster with replicas, and a master found through a Sentinel.

use crate::util::{Harness, claim_req, granted, waiting};
use hyper::StatusCode;
use idemgate_sidecar::testing::{RedisCluster, RedisSentinel};
use idemgate_wire::{ClaimOutcome, Mode, OwnerOutcome, StoredResponse, paths, problem_types};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_queues_and_replays_work_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let h = Harness::on_store(cluster.store_config(), None, |_| {}).await;
    let c = &h.client;
    // Many keys land on all three nodes.
    for i in 0..30 {
        let key = format!("cluster-key-{i}");
        let req = claim_req(&key, Mode::Idempotency, 60_000);
        let (owner, _) = granted(&c.claim(&req).await.0);
        assert!(matches!(c.claim(&req).await.0, ClaimOutcome::Busy { .. }));
        let response = StoredResponse {
            status: 200,
            headers: vec![],
        };
        let body = format!("body-{i}");
        assert_eq!(
            c.complete(&key, &owner, 60_000, Some((response, body.as_bytes())))
                .await,
            OwnerOutcome::Released
        );
        match c.claim(&req).await {
            (ClaimOutcome::Completed { .. }, payload) => assert_eq!(&payload[..], body.as_bytes()),
            other => panic!("unexpected {other:?}"),
        }
    }
    for node in cluster.nodes() {
        let keys: u64 = node.cli(&["dbsize"]).unwrap().trim().parse().unwrap();
        assert!(keys > 0, "every node holds some keys");
    }
    // Every primary has its own clock, so no claim is granted on a reading of another's:
    // each of the 30 keys' three claims (fresh, busy, replay) ran the claim script, which
    // reads `TIME` on the key's own primary (the complete, on the sidecar that answered its
    // claim, reads none).
    let time_calls: u64 = cluster
        .nodes()
        .iter()
        .map(|node| {
            let info = node.cli(&["INFO", "commandstats"]).unwrap();
            info.lines()
                .find_map(|l| l.strip_prefix("cmdstat_time:calls="))
                .and_then(|rest| rest.split(',').next()?.parse().ok())
                .unwrap_or(0)
        })
        .sum();
    assert!(time_calls >= 90, "{time_calls} TIME calls for 90 claims");
    // Listing held keys scans every primary.
    let mut held = Vec::new();
    for i in 0..12 {
        let key = format!("held-{i}");
        let (owner, _) = granted(&c.claim(&claim_req(&key, Mode::Lock, 60_000)).await.0);
        held.push((key, owner));
    }
    let list: serde_json::Value =
        serde_json::from_slice(&c.get("/admin/v1/keys?limit=100").await.body).unwrap();
    let mut listed: Vec<&str> = list["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    listed.sort_unstable();
    let mut expected: Vec<&str> = held.iter().map(|(k, _)| k.as_str()).collect();
    expected.sort_unstable();
    assert_eq!(listed, expected);
    assert_eq!(list["truncated"], false);
    let page: serde_json::Value =
        serde_json::from_slice(&c.get("/admin/v1/keys?limit=5").await.body).unwrap();
    assert_eq!(page["keys"].as_array().map(Vec::len), Some(5));
    assert_eq!(page["truncated"], true);
    for (key, owner) in &held {
        assert_eq!(
            c.complete(key, owner, 1000, None).await,
            OwnerOutcome::Released
        );
    }
    // Queued hand-off (pub/sub notification across the cluster bus).
    let key = "cluster-queue";
    let (holder, fence) = granted(&c.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let mut waiters = Vec::new();
    for i in 0..10 {
        let client = c.clone();
        waiters.push(tokio::spawn(async move {
            client
                .claim(&waiting(claim_req(key, Mode::Lock, 10_000), 30_000, 100))
                .await
                .0
        }));
        c.wait_for_key(key, "waiters to queue", |info| info.queue_len == i + 1)
            .await;
    }
    c.complete(key, &holder, 1000, None).await;
    let mut last = fence;
    for waiter in waiters {
        let (owner, next) = granted(&waiter.await.unwrap());
        assert!(next > last);
        last = next;
        c.complete(key, &owner, 1000, None).await;
    }
}

/// A primary that dies in service: while the Cluster fails over, claims of its keys are
/// answered 503 `store-unavailable` (problem+json, never a grant the store did not record,
/// never a hang past the store timeout), other keys are still granted, and once the replica
/// is promoted the same sidecar grants every key again: no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_failover_costs_its_keys_a_few_seconds_of_503_not_a_restart() {
    primary_lost("the kill", |cluster, index| cluster.stop_node(index)).await;
}

/// The same for a primary that hangs (a frozen host, a partition) rather than dies: its
/// keys' claims fail only by the store timeout, which must be enough for the sidecar to
/// find the promoted replica (and load its scripts there: the script cache is not
/// replicated) without waiting on the hung node again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_primarys_failover_costs_its_keys_a_few_seconds_of_503_not_a_restart() {
    primary_lost("the freeze", |cluster, index| {
        cluster.freeze_node(index).unwrap();
    })
    .await;
}

/// Claims in rounds of 30 fresh keys on a Cluster with replicas (a one-second store
/// timeout) while one primary is lost by `lose`, until a whole round is granted again.
async fn primary_lost(lost_by: &str, lose: impl FnOnce(&mut RedisCluster, usize)) {
    let mut cluster = RedisCluster::with_replicas().unwrap();
    let h = Harness::on_store(cluster.store_config(), None, |c| {
        c.store_timeout = Duration::from_secs(1);
    })
    .await;
    let c = &h.client;
    let round = |n: usize| async move {
        let mut statuses = Vec::new();
        for i in 0..30 {
            let key = format!("failover-{n}-{i}");
            let started = Instant::now();
            let reply = c
                .post(paths::CLAIM, &claim_req(&key, Mode::Lock, 60_000), &[])
                .await;
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "a claim took {:?}, past the store timeout",
                started.elapsed()
            );
            if reply.status == StatusCode::OK {
                let (outcome, _) = c.claim(&claim_req(&key, Mode::Lock, 60_000)).await;
                assert!(matches!(outcome, ClaimOutcome::Busy { .. }), "{outcome:?}");
            } else {
                assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
                assert_eq!(reply.problem().type_uri, problem_types::STORE_UNAVAILABLE);
            }
            statuses.push(reply.status);
        }
        statuses
    };
    assert!(round(0).await.iter().all(|s| *s == StatusCode::OK));
    let primary = cluster
        .nodes()
        .iter()
        .position(|n| n.cli(&["ROLE"]).unwrap().starts_with("master"))
        .unwrap();
    lose(&mut cluster, primary);
    let lost = Instant::now();
    let deadline = lost + Duration::from_secs(20);
    let mut refused_rounds = 0;
    for n in 1.. {
        let statuses = round(n).await;
        let refused = statuses.iter().filter(|s| **s != StatusCode::OK).count();
        if refused == 0 {
            break;
        }
        assert!(
            refused < statuses.len(),
            "the other primaries' keys were refused too"
        );
        refused_rounds += 1;
        assert!(Instant::now() < deadline, "no recovery after the failover");
    }
    assert!(
        refused_rounds > 0,
        "the dead primary's keys were never refused"
    );
    eprintln!(
        "every key granted again {:?} after {lost_by}, {refused_rounds} rounds with refusals",
        lost.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_is_found_through_a_sentinel() {
    let sentinel = RedisSentinel::start().unwrap();
    let h = Harness::on_store(sentinel.store_config(), None, |_| {}).await;
    let c = &h.client;
    let key = "sentinel-key";
    let (holder, fence) = granted(&c.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let waiter = c.queued_waiter(key).await;
    assert_eq!(
        c.complete(key, &holder, 1000, None).await,
        OwnerOutcome::Released
    );
    let (_, next) = granted(&waiter.await.unwrap());
    assert!(next > fence);
    let on_master = sentinel.master().cli(&["--scan"]).unwrap();
    assert!(
        on_master.contains("idemgate:{sentinel-key}:record"),
        "{on_master}"
    );
}
