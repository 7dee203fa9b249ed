//! Redis-specific behaviour: outages, recovery, lost notifications, credentials in the URL,
//! key layout.

use crate::util::{Harness, claim_req, granted};
use hyper::StatusCode;
use idemgate_sidecar::testing::RedisServer;
use idemgate_wire::{ClaimOutcome, Mode, OwnerOutcome, paths, problem_types};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_answers_503_without_false_grants_and_recovers() {
    let redis = RedisServer::start().unwrap();
    let store = redis.store_config();
    let mut h = Harness::on_store(store, Some(redis), |c| {
        c.store_timeout = Duration::from_millis(500);
    })
    .await;
    let c = h.client.clone();
    let (holder, fence_before) = granted(&c.claim(&claim_req("k-out", Mode::Lock, 60_000)).await.0);

    h.redis.as_mut().unwrap().stop();
    for _ in 0..5 {
        let reply = c
            .post(paths::CLAIM, &claim_req("k-out", Mode::Lock, 60_000), &[])
            .await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(reply.problem().type_uri, problem_types::STORE_UNAVAILABLE);
        assert!(reply.headers.contains_key("retry-after"));
    }
    assert_eq!(
        c.get("/readyz").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert!(
        c.metric("idemgate_sidecar_store_errors_total{kind=\"transient\"}")
            .await
            >= 5.0
    );

    // Back (empty: no persistence): the same sidecar recovers by itself.
    h.redis.as_mut().unwrap().restart().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while c.get("/readyz").await.status != StatusCode::OK {
        assert!(
            tokio::time::Instant::now() < deadline,
            "sidecar did not recover"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, fence_after) = granted(&c.claim(&claim_req("k-out", Mode::Lock, 60_000)).await.0);
    // The fence counter was lost with Redis's data, yet fences never go back.
    assert!(fence_after > fence_before);
    assert_eq!(
        c.complete("k-out", &holder, 1000, None).await,
        OwnerOutcome::Stale
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_notification_is_covered_by_the_recheck_interval() {
    let redis = RedisServer::start().unwrap();
    let store = redis.store_config();
    let h = Harness::on_store(store, Some(redis), |c| {
        c.recheck = Duration::from_millis(200);
    })
    .await;
    let c = h.client.clone();
    let key = "k-lost";
    granted(&c.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let waiter = c.queued_waiter(key).await;
    // The key becomes free behind the sidecar's back: nobody publishes a hand-off, and the
    // holder's lease has a minute to go. Only the re-check can find the free key.
    h.redis
        .as_ref()
        .unwrap()
        .clear_record_field("idemgate:{k-lost}:record", "owner")
        .unwrap();
    match waiter.await.unwrap() {
        // Bounded by the re-check interval, not by the 30 s wait budget (generous margin).
        ClaimOutcome::Granted { waited_ms, .. } => assert!(waited_ms < 20_000, "{waited_ms}"),
        other => panic!("the waiter was not granted: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_in_the_url_is_used() {
    let redis = RedisServer::start_with(&["--requirepass", "pw-123"]).unwrap();
    let store = redis.store_config_with_prefix("custom.prefix");
    let h = Harness::on_store(store, Some(redis), |_| {}).await;
    let (owner, _) = granted(
        &h.client
            .claim(&claim_req("k/auth{x}", Mode::Lock, 60_000))
            .await
            .0,
    );
    let keys = h.redis.as_ref().unwrap().cli(&["--scan"]).unwrap();
    assert!(
        keys.contains("custom.prefix:{k/auth%7Bx%7D}:record"),
        "{keys}"
    );
    let list: serde_json::Value =
        serde_json::from_slice(&h.client.get("/admin/v1/keys").await.body).unwrap();
    assert_eq!(list["keys"][0], "k/auth{x}");
    assert_eq!(
        h.client.complete("k/auth{x}", &owner, 1000, None).await,
        OwnerOutcome::Released
    );
    // A wrong password: the sidecar runs but is not ready and answers 503.
    let wrong = {
        let mut url = h.redis.as_ref().unwrap().url();
        url = url.replace("pw-123", "nope");
        idemgate_sidecar::StoreConfig::Redis(idemgate_sidecar::RedisConfig {
            urls: vec![url],
            topology: idemgate_sidecar::RedisTopology::Standalone,
            prefix: "idemgate".into(),
            tls: Default::default(),
        })
    };
    let (_, reply) = Harness::claim_on_unusable_store(wrong).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!matches!(
        serde_json::from_slice::<ClaimOutcome>(&reply.body),
        Ok(ClaimOutcome::Granted { .. })
    ));
}

/// At `maxmemory` with `noeviction` every claim is refused: `/readyz` must say so too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_is_not_ready() {
    let redis =
        RedisServer::start_with(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
            .unwrap();
    let store = redis.store_config();
    let h = Harness::on_store(store, Some(redis), |_| {}).await;
    assert_eq!(h.client.get("/readyz").await.status, StatusCode::OK);
    let body = vec![b'x'; 64 * 1024];
    // Stored bodies fill it fast; a complete is refused first (while it runs, Redis holds
    // its body about three times over: the arguments, the script's copy, the new record),
    // and small writes still fit for a while after it: claims fill the rest.
    let mut storing = true;
    let mut full = false;
    for i in 0..20_000 {
        let key = format!("k-full-{i}");
        let claim = claim_req(&key, Mode::Idempotency, 60_000);
        let reply = h.client.post(paths::CLAIM, &claim, &[]).await;
        if reply.status == StatusCode::SERVICE_UNAVAILABLE {
            full = true;
            break;
        }
        if !storing {
            continue;
        }
        let (outcome, _) = idemgate_wire::decode::<ClaimOutcome>(&reply.body).unwrap();
        let (owner, _) = granted(&outcome);
        let complete = idemgate_wire::CompleteRequest {
            key,
            owner,
            retention_ms: 600_000,
            response: Some(idemgate_wire::StoredResponse {
                status: 201,
                headers: vec![],
            }),
        };
        let reply = h.client.post(paths::COMPLETE, &complete, &body).await;
        storing = reply.status != StatusCode::SERVICE_UNAVAILABLE;
    }
    assert!(full, "Redis never filled up");
    // Refused at the edge, where the request's own buffers tipped it over; with the limit
    // now clearly below what Redis holds, every write is refused, the probe's too.
    let redis = h.redis.as_ref().unwrap();
    redis.cli(&["CONFIG", "SET", "maxmemory", "1mb"]).unwrap();
    let ready = h.client.get("/readyz").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
}
