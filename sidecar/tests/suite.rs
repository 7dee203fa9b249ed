//! One behavioural suite, expanded once per store (memory, and Redis on Redis 7 and on
//! Valkey 8.1): the store trait's contract, observed through the HTTP API.

use crate::util::{Backend, Harness, claim_req, granted, named_waiting, store_suite, waiting};
use idemgate_wire::{ClaimOutcome, Mode, OwnerOutcome, StoredResponse};
use std::sync::{Arc, Mutex};
use std::time::Duration;

store_suite!(
    one_of_a_thousand_concurrent_claims_is_granted,
    two_hundred_waiters_are_granted_once_in_fifo_order,
    wrong_owner_is_refused,
    lease_expiry_hands_over_with_a_higher_fence,
    a_complete_after_the_lease_ran_out_is_stale_though_nobody_took_the_key,
    stored_response_is_replayed_byte_for_byte_until_retention_ends,
    waiters_get_the_stored_response,
    abort_hands_over_and_renew_is_capped,
    wait_budget_runs_out_as_busy,
    queue_depth_is_bounded,
    a_waiter_whose_connection_closes_leaves_the_queue,
    a_named_waiter_that_leaves_frees_its_place_at_once,
    a_leave_after_the_hand_off_keeps_the_grant,
    fingerprint_mismatch_is_reported,
    busy_and_queue_full_hint_what_holdings_take_not_the_lease_left,
);

async fn one_of_a_thousand_concurrent_claims_is_granted(backend: Backend) {
    let h = Harness::start(backend).await;
    let mut tasks = Vec::new();
    for _ in 0..1000 {
        let client = h.client.clone();
        tasks.push(tokio::spawn(async move {
            client
                .claim(&claim_req("k-1000", Mode::Lock, 30_000))
                .await
                .0
        }));
    }
    let (mut grants, mut busy) = (0, 0);
    for task in tasks {
        match task.await.unwrap() {
            ClaimOutcome::Granted { .. } => grants += 1,
            ClaimOutcome::Busy { waited: false, .. } => busy += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((grants, busy), (1, 999));
}

async fn two_hundred_waiters_are_granted_once_in_fifo_order(backend: Backend) {
    const N: usize = 200;
    let h = Harness::start(backend).await;
    let key = "k-fifo";
    let (first, first_fence) =
        granted(&h.client.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..N {
        let client = h.client.clone();
        let order = Arc::clone(&order);
        tasks.push(tokio::spawn(async move {
            let req = waiting(claim_req(key, Mode::Lock, 30_000), 60_000, 1000);
            let (owner, fence) = granted(&client.claim(&req).await.0);
            order.lock().unwrap().push((i, fence));
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert_eq!(
                client.complete(key, &owner, 1000, None).await,
                OwnerOutcome::Released
            );
        }));
        // Enqueue one at a time so the expected FIFO order is known.
        h.client
            .wait_for_key(key, "the waiter to queue", |info| {
                info.queue_len as usize == i + 1
            })
            .await;
    }
    assert_eq!(
        h.client.complete(key, &first, 1000, None).await,
        OwnerOutcome::Released
    );
    for task in tasks {
        task.await.unwrap();
    }
    let order = order.lock().unwrap().clone();
    let indices: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
    assert_eq!(
        indices,
        (0..N).collect::<Vec<_>>(),
        "granted in FIFO order, once each"
    );
    let mut last = first_fence;
    for (_, fence) in &order {
        assert!(*fence > last, "fences strictly increase: {order:?}");
        last = *fence;
    }
    assert_eq!(h.client.inspect(key).await.queue_len, 0);
}

async fn wrong_owner_is_refused(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-owner";
    let (owner, _) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 30_000)).await.0);
    let thief = "0123456789abcdef0123456789abcdef";
    assert_eq!(h.client.renew(key, thief, 1000).await, OwnerOutcome::Stale);
    assert_eq!(h.client.abort(key, thief).await, OwnerOutcome::Stale);
    assert_eq!(
        h.client.complete(key, thief, 1000, None).await,
        OwnerOutcome::Stale
    );
    assert!(matches!(
        h.client.claim(&claim_req(key, Mode::Lock, 30_000)).await.0,
        ClaimOutcome::Busy { .. }
    ));
    assert_eq!(h.client.abort(key, &owner).await, OwnerOutcome::Released);
    assert_eq!(h.client.abort(key, &owner).await, OwnerOutcome::Stale);
    let stale = h
        .client
        .metric("idemgate_sidecar_stale_owners_total{op=\"abort\"}")
        .await;
    assert_eq!(stale, 2.0);
}

async fn lease_expiry_hands_over_with_a_higher_fence(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-expiry";
    let (old, old_fence) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 200)).await.0);
    // A waiter takes over when the lease runs out, without anyone releasing.
    let req = waiting(claim_req(key, Mode::Lock, 30_000), 20_000, 10);
    let (new, new_fence) = granted(&h.client.claim(&req).await.0);
    assert!(new_fence > old_fence);
    for outcome in [
        h.client.renew(key, &old, 1000).await,
        h.client.complete(key, &old, 1000, None).await,
        h.client.abort(key, &old).await,
    ] {
        assert_eq!(outcome, OwnerOutcome::Stale);
    }
    assert!(
        h.client
            .metric("idemgate_sidecar_lease_expiries_total")
            .await
            >= 1.0
    );
    // Without waiters, a plain claim after expiry is granted with a higher fence again.
    assert_eq!(h.client.abort(key, &new).await, OwnerOutcome::Released);
    let (short, short_fence) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 100)).await.0);
    assert!(short_fence > new_fence);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let next_fence = loop {
        match h.client.claim(&claim_req(key, Mode::Lock, 30_000)).await.0 {
            ClaimOutcome::Granted { fence, .. } => break fence,
            ClaimOutcome::Busy { .. } if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("unexpected {other:?}"),
        }
    };
    assert!(next_fence > short_fence);
    assert_eq!(h.client.renew(key, &short, 1000).await, OwnerOutcome::Stale);
}

/// A lease that ran out ends the holding even when no other claim came: its complete, with
/// or without a response, and its abort are stale, nothing is stored, and the next claim is
/// granted with a higher fence.
async fn a_complete_after_the_lease_ran_out_is_stale_though_nobody_took_the_key(backend: Backend) {
    let h = Harness::start(backend).await;
    let (response, body) = sample_response();
    for (i, storing) in [false, true].into_iter().enumerate() {
        let key = format!("k-ran-out-{i}");
        let mode = if storing {
            Mode::Idempotency
        } else {
            Mode::Lock
        };
        let (owner, fence) = granted(&h.client.claim(&claim_req(&key, mode, 100)).await.0);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let stored = storing.then(|| (response.clone(), &body[..]));
        assert_eq!(
            h.client.complete(&key, &owner, 60_000, stored).await,
            OwnerOutcome::Stale
        );
        assert_eq!(h.client.abort(&key, &owner).await, OwnerOutcome::Stale);
        match h.client.claim(&claim_req(&key, mode, 30_000)).await.0 {
            ClaimOutcome::Granted { fence: next, .. } => assert!(next > fence),
            other => panic!("{other:?}: a response was stored by a stale complete"),
        }
    }
}

fn sample_response() -> (StoredResponse, Vec<u8>) {
    let response = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/octet-stream".into()),
            ("x-order-id".into(), "ord-42".into()),
        ],
    };
    // Every byte value, newlines and NULs included, and large enough to matter.
    let body: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 256) as u8).collect();
    (response, body)
}

async fn stored_response_is_replayed_byte_for_byte_until_retention_ends(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-replay";
    let req = claim_req(key, Mode::Idempotency, 30_000);
    let (owner, _) = granted(&h.client.claim(&req).await.0);
    let (response, body) = sample_response();
    assert_eq!(
        h.client
            .complete(key, &owner, 400, Some((response.clone(), &body)))
            .await,
        OwnerOutcome::Released
    );
    for _ in 0..3 {
        match h.client.claim(&req).await {
            (ClaimOutcome::Completed { response: r, .. }, payload) => {
                assert_eq!(r, response);
                assert!(payload[..] == body[..], "body replayed byte for byte");
            }
            // Retention may already be over on a slow machine: then it is granted again.
            (ClaimOutcome::Granted { .. }, _) => return,
            other => panic!("unexpected {other:?}"),
        }
    }
    // After the retention the key runs again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match h.client.claim(&req).await.0 {
            ClaimOutcome::Granted { .. } => break,
            ClaimOutcome::Completed { .. } if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

async fn waiters_get_the_stored_response(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-wait-replay";
    let req = claim_req(key, Mode::Idempotency, 30_000);
    let (owner, _) = granted(&h.client.claim(&req).await.0);
    let mut waiters = Vec::new();
    for i in 0..5 {
        let client = h.client.clone();
        let req = waiting(req.clone(), 30_000, 100);
        waiters.push(tokio::spawn(async move { client.claim(&req).await }));
        h.client
            .wait_for_key(key, "waiters to queue", |info| info.queue_len == i + 1)
            .await;
    }
    let (response, body) = sample_response();
    h.client
        .complete(key, &owner, 60_000, Some((response.clone(), &body)))
        .await;
    for waiter in waiters {
        match waiter.await.unwrap() {
            (
                ClaimOutcome::Completed {
                    response: r,
                    waited_ms,
                },
                payload,
            ) => {
                assert_eq!(r, response);
                assert!(payload[..] == body[..]);
                let _ = waited_ms;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(h.client.inspect(key).await.queue_len, 0);
}

async fn abort_hands_over_and_renew_is_capped(backend: Backend) {
    let h = Harness::start_with(backend, |c| c.max_lease = Duration::from_secs(5)).await;
    let key = "k-abort";
    let (first, fence) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    match h
        .client
        .claim(&claim_req("k-cap", Mode::Lock, 60_000))
        .await
        .0
    {
        ClaimOutcome::Granted { lease_ms, .. } => assert_eq!(lease_ms, 5000),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        h.client.renew(key, &first, 60_000).await,
        OwnerOutcome::Renewed { lease_ms: 5000 }
    );
    let client = h.client.clone();
    let waiter = tokio::spawn(async move {
        client
            .claim(&waiting(claim_req(key, Mode::Lock, 1000), 30_000, 10))
            .await
            .0
    });
    h.client
        .wait_for_key(key, "the waiter to queue", |info| info.queue_len == 1)
        .await;
    assert_eq!(h.client.abort(key, &first).await, OwnerOutcome::Released);
    let (_, next) = granted(&waiter.await.unwrap());
    assert!(next > fence);
}

async fn wait_budget_runs_out_as_busy(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-budget";
    granted(&h.client.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let req = waiting(claim_req(key, Mode::Lock, 1000), 150, 10);
    match h.client.claim(&req).await.0 {
        ClaimOutcome::Busy {
            waited: true,
            queue_len,
            ..
        } => assert_eq!(queue_len, 0),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(h.client.inspect(key).await.queue_len, 0);
}

async fn queue_depth_is_bounded(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-full";
    let (holder, _) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let mut waiters = Vec::new();
    for i in 0..3 {
        let client = h.client.clone();
        waiters.push(tokio::spawn(async move {
            client
                .claim(&waiting(claim_req(key, Mode::Lock, 1000), 30_000, 3))
                .await
                .0
        }));
        h.client
            .wait_for_key(key, "waiters to queue", |info| info.queue_len == i + 1)
            .await;
    }
    match h
        .client
        .claim(&waiting(claim_req(key, Mode::Lock, 1000), 30_000, 3))
        .await
        .0
    {
        ClaimOutcome::QueueFull { queue_len, .. } => assert_eq!(queue_len, 3),
        other => panic!("unexpected {other:?}"),
    }
    h.client.complete(key, &holder, 1000, None).await;
    for waiter in waiters {
        let (owner, _) = granted(&waiter.await.unwrap());
        h.client.complete(key, &owner, 1000, None).await;
    }
}

async fn a_waiter_whose_connection_closes_leaves_the_queue(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-gone";
    let (holder, _) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    // Its own HTTP/1.1 connection, closed by dropping the request.
    let own = crate::util::Client::h1(&h.sidecar.url());
    let waiter = tokio::spawn(async move {
        own.claim(&waiting(claim_req(key, Mode::Lock, 1000), 30_000, 10))
            .await
    });
    h.client
        .wait_for_key(key, "the waiter to queue", |info| info.queue_len == 1)
        .await;
    waiter.abort();
    h.client
        .wait_for_key(key, "the gone waiter to leave", |info| info.queue_len == 0)
        .await;
    // The key is not handed to the departed waiter: the next claimant gets it at once.
    h.client.complete(key, &holder, 1000, None).await;
    granted(&h.client.claim(&claim_req(key, Mode::Lock, 1000)).await.0);
}

async fn fingerprint_mismatch_is_reported(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-fp";
    let mut req = claim_req(key, Mode::Idempotency, 30_000);
    req.fingerprint = Some("fp-a".into());
    let (owner, _) = granted(&h.client.claim(&req).await.0);
    let mut other = req.clone();
    other.fingerprint = Some("fp-b".into());
    assert_eq!(h.client.claim(&other).await.0, ClaimOutcome::Mismatch);
    let (response, body) = sample_response();
    h.client
        .complete(key, &owner, 60_000, Some((response, &body)))
        .await;
    assert_eq!(h.client.claim(&other).await.0, ClaimOutcome::Mismatch);
    assert!(matches!(
        h.client.claim(&req).await.0,
        ClaimOutcome::Completed { .. }
    ));
}

/// A caller that gives up names its place and leaves: the queue has room again at once, the
/// waiting claim ends without the key, and the key goes to whoever is queued next.
async fn a_named_waiter_that_leaves_frees_its_place_at_once(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-leave";
    let (holder, _) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let client = h.client.clone();
    let gone = tokio::spawn(async move {
        let req = named_waiting(claim_req(key, Mode::Lock, 10_000), "w-gone", 30_000, 1);
        client.claim(&req).await.0
    });
    h.client
        .wait_for_key(key, "the named waiter to queue", |info| info.queue_len == 1)
        .await;
    let full = waiting(claim_req(key, Mode::Lock, 10_000), 30_000, 1);
    assert!(matches!(
        h.client.claim(&full).await.0,
        ClaimOutcome::QueueFull { .. }
    ));
    assert_eq!(h.client.leave(key, "w-never").await, OwnerOutcome::Stale);
    assert_eq!(h.client.leave(key, "w-gone").await, OwnerOutcome::Released);
    assert_eq!(h.client.inspect(key).await.queue_len, 0);
    // Its long-poll ends promptly (woken, not at its 30 s budget), without the key.
    let answer = tokio::time::timeout(Duration::from_secs(5), gone)
        .await
        .expect("the left claim answers at once")
        .unwrap();
    assert!(
        matches!(answer, ClaimOutcome::Busy { waited: true, .. }),
        "{answer:?}"
    );
    assert_eq!(h.client.leave(key, "w-gone").await, OwnerOutcome::Stale);
    // The place is free for the next caller, who gets the key when the holder finishes.
    let next = h.client.queued_waiter(key).await;
    assert_eq!(
        h.client.complete(key, &holder, 1000, None).await,
        OwnerOutcome::Released
    );
    let (owner, _) = granted(&next.await.unwrap());
    assert_eq!(h.client.abort(key, &owner).await, OwnerOutcome::Released);
    assert_eq!(
        h.client
            .metric("idemgate_sidecar_leaves_total{outcome=\"released\"}")
            .await,
        1.0
    );
}

/// The key is handed to a named waiter just before its caller's leave arrives: the leave
/// is stale, the grant stands (its claim answers it; the caller aborts it).
async fn a_leave_after_the_hand_off_keeps_the_grant(backend: Backend) {
    let h = Harness::start(backend).await;
    let key = "k-leave-late";
    let (holder, _) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let client = h.client.clone();
    let waiter = tokio::spawn(async move {
        let req = named_waiting(claim_req(key, Mode::Lock, 10_000), "w-late", 30_000, 10);
        client.claim(&req).await.0
    });
    h.client
        .wait_for_key(key, "the named waiter to queue", |info| info.queue_len == 1)
        .await;
    assert_eq!(h.client.abort(key, &holder).await, OwnerOutcome::Released);
    let (owner, _) = granted(&waiter.await.unwrap());
    assert_eq!(h.client.leave(key, "w-late").await, OwnerOutcome::Stale);
    assert_eq!(
        h.client.inspect(key).await.state,
        idemgate_sidecar::KeyState::Held
    );
    assert_eq!(h.client.abort(key, &owner).await, OwnerOutcome::Released);
    granted(&h.client.claim(&claim_req(key, Mode::Lock, 1000)).await.0);
}

/// The `retry_after_ms` of a busy (409) or queue-full (429) answer is learnt from how long
/// holdings of the key — or, for a key not seen yet, of keys under the same lease — took,
/// not the holder's whole lease left (30 s here, for holdings of well under a second).
async fn busy_and_queue_full_hint_what_holdings_take_not_the_lease_left(backend: Backend) {
    const LEASE_MS: u64 = 30_000;
    // Far below the lease left (what the hint was before it learnt), far above a
    // 50 ms holding on a loaded machine.
    const HONEST_MS: u64 = 10_000;
    let h = Harness::start(backend).await;
    let hint = |outcome: &ClaimOutcome| match outcome {
        ClaimOutcome::Busy {
            retry_after_ms,
            waited: false,
            ..
        }
        | ClaimOutcome::QueueFull { retry_after_ms, .. } => *retry_after_ms,
        other => panic!("expected busy or queue full, got {other:?}"),
    };

    // Unknown so far: the lease left.
    let (owner, _) = granted(
        &h.client
            .claim(&claim_req("k-hint", Mode::Lock, LEASE_MS))
            .await
            .0,
    );
    let first = hint(
        &h.client
            .claim(&claim_req("k-hint", Mode::Lock, LEASE_MS))
            .await
            .0,
    );
    assert!(first > HONEST_MS, "nothing learnt yet: {first} ms");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        h.client.complete("k-hint", &owner, 1000, None).await,
        OwnerOutcome::Released
    );

    // The next holder of the key: busy and queue full hint what the last holding took.
    let (owner, _) = granted(
        &h.client
            .claim(&claim_req("k-hint", Mode::Lock, LEASE_MS))
            .await
            .0,
    );
    let busy = hint(
        &h.client
            .claim(&claim_req("k-hint", Mode::Lock, LEASE_MS))
            .await
            .0,
    );
    assert!((1..HONEST_MS).contains(&busy), "busy: {busy} ms");
    let full = waiting(claim_req("k-hint", Mode::Lock, LEASE_MS), 10_000, 0);
    let full = hint(&h.client.claim(&full).await.0);
    assert!((1..HONEST_MS).contains(&full), "queue full: {full} ms");
    assert_eq!(
        h.client.abort("k-hint", &owner).await,
        OwnerOutcome::Released
    );

    // A fresh idempotency key under the same lease: learnt from the others.
    let fresh = claim_req("k-hint-fresh", Mode::Idempotency, LEASE_MS);
    let (owner, _) = granted(&h.client.claim(&fresh).await.0);
    let duplicate = hint(&h.client.claim(&fresh).await.0);
    assert!(
        (1..HONEST_MS).contains(&duplicate),
        "fresh key: {duplicate} ms"
    );
    assert_eq!(
        h.client.complete("k-hint-fresh", &owner, 1000, None).await,
        OwnerOutcome::Released
    );
}
