//! The Redis layout's own edges: one record per lock whose lease ends by its deadline (not
//! by the key expiring), whose expiry only bounds how long an idle record lives, which holds
//! a stored response for its retention, and whose queue keys the common path never touches.

use crate::util::{Harness, claim_req, granted};
use idemgate_sidecar::testing::RedisServer;
use idemgate_wire::{ClaimOutcome, Mode, OwnerOutcome, StoredResponse};
use std::time::Duration;

/// How long the short-retention test keeps its stored response, in ms: above the 50 ms a
/// kept reading of Redis's clock may lead it.
const SHORT_RETENTION_MS: u64 = 100;

fn record(key: &str) -> String {
    format!("idemgate:{{{key}}}:record")
}

fn int(redis: &RedisServer, args: &[&str]) -> i64 {
    redis.cli(args).unwrap().trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_common_path_touches_one_key() {
    let h = Harness::start(crate::util::Backend::Redis).await;
    let redis = h.redis.as_ref().unwrap();
    let key = "k-one";
    for mode in [Mode::Lock, Mode::Idempotency] {
        let (owner, _) = granted(&h.client.claim(&claim_req(key, mode, 30_000)).await.0);
        assert_eq!(h.client.abort(key, &owner).await, OwnerOutcome::Released);
    }
    assert_eq!(redis.cli(&["--scan"]).unwrap().trim(), record(key));
    // No waiters were ever queued: no queue mark in the record.
    assert_eq!(redis.record_field(&record(key), "q").unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_decided_by_its_deadline() {
    let h = Harness::start(crate::util::Backend::Redis).await;
    let redis = h.redis.as_ref().unwrap();
    let key = "k-deadline";
    let (old, fence) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 300)).await.0);
    h.client
        .wait_for_key(key, "the lease to run out", |info| info.holder.is_none())
        .await;
    // The record outlives the lease, keeping the fence; nobody lists the key as held.
    assert_eq!(int(redis, &["EXISTS", &record(key)]), 1);
    let info = h.client.inspect(key).await;
    assert_eq!(info.last_fence, fence);
    let list: serde_json::Value =
        serde_json::from_slice(&h.client.get("/admin/v1/keys").await.body).unwrap();
    assert_eq!(list["keys"], serde_json::json!([]));
    // The old owner is refused although its fields are still in the record.
    assert_eq!(
        h.client.complete(key, &old, 1000, None).await,
        OwnerOutcome::Stale
    );
    assert_eq!(h.client.renew(key, &old, 1000).await, OwnerOutcome::Stale);
    let (new, next) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 30_000)).await.0);
    assert!(next > fence);
    // Counted once, by the claim that found it.
    assert!(matches!(
        h.client.claim(&claim_req(key, Mode::Lock, 30_000)).await.0,
        ClaimOutcome::Busy { .. }
    ));
    assert_eq!(
        h.client
            .metric("idemgate_sidecar_lease_expiries_total")
            .await,
        1.0
    );
    assert_eq!(h.client.abort(key, &old).await, OwnerOutcome::Stale);
    assert_eq!(h.client.abort(key, &new).await, OwnerOutcome::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_record_lives_the_fence_ttl_and_fences_still_rise_after_it() {
    // A fence TTL far above the lease-based floor (the lease plus a second), and both far
    // above how long a loaded machine takes between two commands: the bounds below cannot
    // be missed by slowness, only by a wrong TTL.
    const FENCE_TTL_MS: i64 = 120_000;
    const LEASE_MS: u64 = 30_000;
    let lease_floor = i64::try_from(LEASE_MS).unwrap() + 1000;
    let h = Harness::start_with(crate::util::Backend::Redis, |c| {
        c.fence_ttl = Duration::from_millis(FENCE_TTL_MS.unsigned_abs());
    })
    .await;
    let redis = h.redis.as_ref().unwrap();
    let key = "k-idle";
    let (owner, fence) = granted(
        &h.client
            .claim(&claim_req(key, Mode::Lock, LEASE_MS))
            .await
            .0,
    );
    // The grant set the record's expiry to the fence TTL (not the lease floor, not none).
    let ttl = int(redis, &["PTTL", &record(key)]);
    assert!((lease_floor + 1..=FENCE_TTL_MS).contains(&ttl), "{ttl}");
    assert_eq!(
        h.client.complete(key, &owner, 1000, None).await,
        OwnerOutcome::Released
    );
    // Idle now: the release keeps that expiry (it neither drops nor extends it).
    let idle = int(redis, &["PTTL", &record(key)]);
    assert!(
        (lease_floor + 1..=ttl).contains(&idle),
        "{idle} after {ttl}"
    );
    // Its expiry, brought forward: what the fence TTL passing does, without waiting for it.
    assert_eq!(int(redis, &["PEXPIRE", &record(key), "1"]), 1);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while int(redis, &["EXISTS", &record(key)]) == 1 {
        assert!(tokio::time::Instant::now() < deadline, "the record stays");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The record and its fence are gone; the clock floor still puts the next fence above.
    let (_, next) = granted(
        &h.client
            .claim(&claim_req(key, Mode::Lock, LEASE_MS))
            .await
            .0,
    );
    assert!(next > fence);
}

/// A fresh key's grant takes its fence from the sidecar's reading of Redis's clock (one
/// `SET NX GET`, no script). A key whose record is gone, here a stored response kept for
/// [`SHORT_RETENTION_MS`], still gets a fence above every earlier one, claim after claim.
/// Each cycle mixes the two ways a fence is made: the fresh `SET` and, for the busy claim,
/// the script's `TIME`.
///
/// The retention is above the most a kept clock reading may lead Redis's clock (`MAX_LEAD`,
/// 50 ms, `store/redis/clock.rs`): a record kept for less could expire before the clock
/// reaches a fence issued from such a reading, and the next fence could then be below it.
/// That case is allowed and documented there; with a 1 ms retention this test failed on a
/// loaded machine (a claim answered 5 ms late made a fence 5 ms ahead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_rise_across_fresh_grants_of_a_key_whose_record_expired() {
    let h = Harness::start(crate::util::Backend::Redis).await;
    let redis = h.redis.as_ref().unwrap();
    let key = "k-short-retention";
    let response = StoredResponse {
        status: 201,
        headers: vec![],
    };
    let mut fences = Vec::new();
    for _ in 0..30 {
        let req = claim_req(key, Mode::Idempotency, 30_000);
        let (owner, fence) = granted(&h.client.claim(&req).await.0);
        assert!(matches!(
            h.client.claim(&req).await.0,
            ClaimOutcome::Busy { .. }
        ));
        fences.push(fence);
        assert_eq!(
            h.client
                .complete(
                    key,
                    &owner,
                    SHORT_RETENTION_MS,
                    Some((response.clone(), &b"x"[..]))
                )
                .await,
            OwnerOutcome::Released
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while int(redis, &["EXISTS", &record(key)]) == 1 {
            assert!(tokio::time::Instant::now() < deadline, "the record stays");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences not increasing: {fences:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewing_keeps_the_record_beyond_its_ttl() {
    let h = Harness::start_with(crate::util::Backend::Redis, |c| {
        c.fence_ttl = Duration::from_millis(1000);
    })
    .await;
    let redis = h.redis.as_ref().unwrap();
    let key = "k-renew";
    let (owner, _) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 1000)).await.0);
    // At least the lease plus a second, even with a shorter fence TTL.
    assert!(int(redis, &["PTTL", &record(key)]) > 1000);
    assert_eq!(
        h.client.renew(key, &owner, 30_000).await,
        OwnerOutcome::Renewed { lease_ms: 30_000 }
    );
    assert!(int(redis, &["PTTL", &record(key)]) > 30_000);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(matches!(
        h.client.claim(&claim_req(key, Mode::Lock, 1000)).await.0,
        ClaimOutcome::Busy { .. }
    ));
    assert_eq!(
        h.client.complete(key, &owner, 1000, None).await,
        OwnerOutcome::Released
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_lives_in_the_record_for_its_retention() {
    let h = Harness::start(crate::util::Backend::Redis).await;
    let redis = h.redis.as_ref().unwrap();
    let key = "k-kept";
    let req = claim_req(key, Mode::Idempotency, 30_000);
    let (owner, _) = granted(&h.client.claim(&req).await.0);
    let response = StoredResponse {
        status: 201,
        headers: vec![("x-id".into(), "7".into())],
    };
    assert_eq!(
        h.client
            .complete(key, &owner, 60_000, Some((response.clone(), b"created")))
            .await,
        OwnerOutcome::Released
    );
    // The retention, not the (week-long) fence TTL, bounds how long the body is kept.
    let ttl = int(redis, &["PTTL", &record(key)]);
    assert!((1..=60_000).contains(&ttl), "{ttl}");
    assert_eq!(redis.cli(&["--scan"]).unwrap().trim(), record(key));
    match h.client.claim(&req).await {
        (ClaimOutcome::Completed { response: r, .. }, body) => {
            assert_eq!(r, response);
            assert_eq!(&body[..], b"created");
        }
        other => panic!("unexpected {other:?}"),
    }
    let info = h.client.inspect(key).await;
    assert_eq!(info.completed.map(|c| c.status), Some(201));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_mark_goes_with_the_last_waiter() {
    let h = Harness::start(crate::util::Backend::Redis).await;
    let redis = h.redis.as_ref().unwrap();
    let key = "k-mark";
    let (holder, _) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 30_000)).await.0);
    let waiter = h.client.queued_waiter(key).await;
    assert_eq!(
        redis.record_field(&record(key), "q").unwrap().as_deref(),
        Some("1")
    );
    assert_eq!(
        h.client.complete(key, &holder, 1000, None).await,
        OwnerOutcome::Released
    );
    let (next, _) = granted(&waiter.await.unwrap());
    assert_eq!(
        h.client.complete(key, &next, 1000, None).await,
        OwnerOutcome::Released
    );
    assert_eq!(redis.record_field(&record(key), "q").unwrap(), None);
    assert_eq!(redis.cli(&["--scan"]).unwrap().trim(), record(key));
}

/// Commands Redis ran since the last `CONFIG RESETSTAT`, by name, as `INFO commandstats`
/// counts them: a script's own `redis.call`s included, the test's `CONFIG` and `INFO` and
/// connections' setup not.
fn commands_run(redis: &RedisServer) -> std::collections::BTreeMap<String, u64> {
    let info = redis.cli(&["INFO", "commandstats"]).unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            let test_own = name == "info" || name.starts_with("config|");
            // A connection's own setup (redis-rs names itself with `CLIENT SETINFO`, which
            // Redis 7.2 and Valkey count): not a pair's, whenever a connection opens.
            let connecting = name.starts_with("client|") || name == "hello";
            (!test_own && !connecting).then(|| (name.to_owned(), calls))
        })
        .collect()
}

/// Commands per pair of `PAIRS` claim+complete pairs on fresh keys in `mode` (idempotency
/// mode: with a fingerprint, and the complete stores a response), the claim sent to `claims`
/// and the complete to `completes`.
///
/// A fresh key's claim writes its grant without a script while the sidecar's reading of
/// Redis's clock is young (`FRESH_FOR`, 500 ms): each attempt first has a claim read the
/// clock (a second claim of a released key runs the claim script), and an attempt whose
/// pairs took longer than that is made again, at most three times.
async fn commands_per_fresh_pair(
    redis: &RedisServer,
    claims: &crate::util::Client,
    completes: &crate::util::Client,
    mode: Mode,
    queued: bool,
    what: &str,
) -> std::collections::BTreeMap<String, u64> {
    const PAIRS: u64 = 20;
    const FRESH_FOR: Duration = Duration::from_millis(500);
    let response = StoredResponse {
        status: 201,
        headers: vec![("x-id".into(), "7".into())],
    };
    for attempt in 0..3 {
        let warm = format!("k-clock-{what}-{mode:?}-{attempt}");
        for _ in 0..2 {
            let (owner, _) = granted(&claims.claim(&claim_req(&warm, Mode::Lock, 30_000)).await.0);
            assert_eq!(claims.abort(&warm, &owner).await, OwnerOutcome::Released);
        }
        let read_at = std::time::Instant::now();
        redis.cli(&["CONFIG", "RESETSTAT"]).unwrap();
        for i in 0..PAIRS {
            let key = format!("k-fresh-{what}-{mode:?}-{attempt}-{i}");
            let mut req = claim_req(&key, mode, 30_000);
            if queued {
                // As a queueing rule's filter claims: willing to wait, its place named.
                req = crate::util::named_waiting(req, &format!("w-{key}"), 10_000, 16);
            }
            let stored = (mode == Mode::Idempotency).then(|| {
                req.fingerprint = Some(format!("{:064x}", i));
                (response.clone(), &b"created"[..])
            });
            let (owner, _) = granted(&claims.claim(&req).await.0);
            assert_eq!(
                completes.complete(&key, &owner, 60_000, stored).await,
                OwnerOutcome::Released
            );
        }
        if read_at.elapsed() >= FRESH_FOR {
            continue;
        }
        return commands_run(redis)
            .into_iter()
            .map(|(name, calls)| {
                assert_eq!(calls % PAIRS, 0, "{name}: {calls} calls in {PAIRS} pairs");
                (name, calls / PAIRS)
            })
            .collect();
    }
    panic!("{PAIRS} pairs took longer than {FRESH_FOR:?} three times");
}

fn breakdown(counts: &[(&str, u64)]) -> std::collections::BTreeMap<String, u64> {
    counts.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_key_claim_and_complete_cost_four_cheap_redis_commands() {
    // Redis 7 has no `SET … IFEQ`: the complete, on the sidecar that answered the claim, is
    // the small compare-and-set script (`COMPLETE_FRESH`: `EVALSHA`, `GET`, `SET`), which
    // finds the grant as the sidecar wrote it and writes the record released, or with its
    // stored response and expiry, packed by the sidecar. The first complete learnt that
    // (its `SET … IFEQ` was refused, in the warm-up); no later one sends the command again.
    fresh_pairs_cost(
        crate::util::Backend::Redis,
        &[("evalsha", 1), ("get", 1), ("set", 2)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_server_with_set_ifeq_a_fresh_key_claim_and_complete_cost_two_plain_sets() {
    // Valkey 8.1 has `SET … IFEQ`: the same compare-and-set, without a script.
    fresh_pairs_cost(crate::util::Backend::Valkey, &[("set", 2)]).await;
}

/// The commands per fresh claim+complete pair on `backend`: `same` with the complete on the
/// sidecar that answered the claim, whichever way the claim is made; and on another sidecar.
async fn fresh_pairs_cost(backend: crate::util::Backend, same: &[(&str, u64)]) {
    let h = Harness::start(backend).await;
    let redis = h.redis.as_ref().unwrap();
    // A second sidecar on the same Redis, which answers none of the claims.
    let other = Harness::on_store(redis.store_config(), None, |_| {}).await;
    // Loads the scripts (the first EVALSHA of each meets NOSCRIPT) before counting.
    for mode in [Mode::Lock, Mode::Idempotency] {
        let key = format!("k-warm-{mode:?}");
        let (owner, _) = granted(&h.client.claim(&claim_req(&key, mode, 30_000)).await.0);
        assert_eq!(
            h.client.complete(&key, &owner, 60_000, None).await,
            OwnerOutcome::Released
        );
    }
    let expected = breakdown(same);
    for mode in [Mode::Lock, Mode::Idempotency] {
        // The claim: one `SET NX GET PX`, no script (the grant, at the sidecar's reading of
        // Redis's clock). The same whether the claim would queue behind a holder (with its
        // place named, as the shipped payments rule claims) or not: a fresh key has no queue
        // to look at.
        for queued in [false, true] {
            let what = format!("same-{queued}");
            let counted =
                commands_per_fresh_pair(redis, &h.client, &h.client, mode, queued, &what).await;
            assert_eq!(counted, expected, "{mode:?}, queued: {queued}");
            assert!(counted.values().sum::<u64>() <= 4, "{mode:?}");
        }
        // A complete on a sidecar that did not answer the claim reads the record and Redis's
        // clock first: `EVALSHA`, `GET`, `TIME`, `SET`.
        let elsewhere =
            commands_per_fresh_pair(redis, &h.client, &other.client, mode, false, "elsewhere")
                .await;
        assert_eq!(
            elsewhere,
            breakdown(&[("evalsha", 1), ("get", 1), ("set", 2), ("time", 1)]),
            "{mode:?}"
        );
    }
}

/// A fresh key's grant time is the sidecar's reading of Redis's clock, which may be ahead of
/// it by up to the claim's round trip (`store/redis/clock.rs`, `MAX_LEAD`, 50 ms). Inspecting
/// such a key at once must not compute a negative age: it was a "permanent store error" (503)
/// on a loaded machine (`a_stale_complete_that_wrote_first_puts_the_record_back` failed on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_timed_ahead_of_redis_clock_inspects_as_just_granted() {
    let h = Harness::start(crate::util::Backend::Redis).await;
    let redis = h.redis.as_ref().unwrap();
    let key = "k-ahead";
    let (_, fence) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 30_000)).await.0);
    // The grant's time ahead of Redis's clock, as a reading that led it would write: a minute
    // rather than the 50 ms a reading may lead, so that however slowly this machine gets to
    // the inspect, the grant is still ahead of the clock then.
    let since: u64 = redis
        .record_field(&record(key), "since")
        .unwrap()
        .unwrap()
        .parse()
        .unwrap();
    let ahead = (since + 60_000_000).to_string();
    assert!(
        redis
            .set_record_field(&record(key), "since", &ahead)
            .unwrap()
    );
    let info = h.client.inspect(key).await;
    let holder = info.holder.expect("held");
    assert_eq!((holder.fence, holder.age_ms), (fence, 0));
}

/// A complete of a grant this sidecar answered writes the record before reading it; when the
/// record was not that grant's any more, it is put back as it was, with (at least) the expiry
/// it had: another holder keeps its claim, another's stored response keeps its retention,
/// and a lease that ran out stays a lease that ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_complete_that_wrote_first_puts_the_record_back() {
    const RETENTION_MS: u64 = 60_000;
    let h = Harness::start(crate::util::Backend::Redis).await;
    let redis = h.redis.as_ref().unwrap();
    let pttl = |key: &str| int(redis, &["PTTL", &record(key)]);
    let stored = |body: &'static [u8]| {
        let response = StoredResponse {
            status: 201,
            headers: vec![],
        };
        Some((response, body))
    };
    let expired_grant = |key: &'static str| {
        let client = &h.client;
        async move {
            let req = claim_req(key, Mode::Idempotency, 300);
            let (owner, fence) = granted(&client.claim(&req).await.0);
            client
                .wait_for_key(key, "the lease to run out", |info| info.holder.is_none())
                .await;
            (owner, fence)
        }
    };
    let req = |key| claim_req(key, Mode::Idempotency, 30_000);

    // Another holder: its claim stands, nothing is replayed, its record outlives its lease.
    let key = "k-stale-held";
    let (a, _) = expired_grant(key).await;
    let (b, b_fence) = granted(&h.client.claim(&req(key)).await.0);
    assert_eq!(
        h.client
            .complete(key, &a, RETENTION_MS, stored(b"from a"))
            .await,
        OwnerOutcome::Stale
    );
    let info = h.client.inspect(key).await;
    assert_eq!(info.holder.map(|holder| holder.fence), Some(b_fence));
    assert!(matches!(
        h.client.claim(&req(key)).await.0,
        ClaimOutcome::Busy { .. }
    ));
    assert!(pttl(key) > 30_000, "{}", pttl(key));
    assert_eq!(
        h.client
            .complete(key, &b, RETENTION_MS, stored(b"from b"))
            .await,
        OwnerOutcome::Released
    );

    // Another's stored response: replayed as it was, kept for its retention, not longer.
    let key = "k-stale-kept";
    let (a, _) = expired_grant(key).await;
    let (b, _) = granted(&h.client.claim(&req(key)).await.0);
    assert_eq!(
        h.client
            .complete(key, &b, RETENTION_MS, stored(b"from b"))
            .await,
        OwnerOutcome::Released
    );
    assert_eq!(
        h.client
            .complete(key, &a, 24 * 3600 * 1000, stored(b"from a"))
            .await,
        OwnerOutcome::Stale
    );
    match h.client.claim(&req(key)).await {
        (ClaimOutcome::Completed { .. }, body) => assert_eq!(&body[..], b"from b"),
        other => panic!("unexpected {other:?}"),
    }
    let ttl = pttl(key);
    assert!((1..=60_000).contains(&ttl), "{ttl}");

    // Nobody claimed since the lease ran out: refused, and the record is the expired grant
    // with the expiry its grant gave it (the fence TTL), so the next claim is granted.
    let key = "k-stale-expired";
    let (a, a_fence) = expired_grant(key).await;
    let granted_ttl = pttl(key);
    assert_eq!(
        h.client
            .complete(key, &a, RETENTION_MS, stored(b"from a"))
            .await,
        OwnerOutcome::Stale
    );
    let ttl = pttl(key);
    assert!(
        (granted_ttl - 60_000..=granted_ttl).contains(&ttl),
        "{ttl} after {granted_ttl}"
    );
    let (_, fence) = granted(&h.client.claim(&req(key)).await.0);
    assert!(fence > a_fence);

    // A live owner's token sent with another key: that key's holder keeps it, and the
    // owner still completes its own key (by reading first: its grant was taken).
    let (mine, theirs) = ("k-stale-mine", "k-stale-theirs");
    let (a, _) = granted(&h.client.claim(&req(mine)).await.0);
    let (b, b_fence) = granted(&h.client.claim(&req(theirs)).await.0);
    assert_eq!(
        h.client
            .complete(theirs, &a, RETENTION_MS, stored(b"from a"))
            .await,
        OwnerOutcome::Stale
    );
    let info = h.client.inspect(theirs).await;
    assert_eq!(info.holder.map(|holder| holder.fence), Some(b_fence));
    for (key, owner) in [(theirs, &b), (mine, &a)] {
        assert_eq!(
            h.client
                .complete(key, owner, RETENTION_MS, stored(b"own"))
                .await,
            OwnerOutcome::Released
        );
    }
}
