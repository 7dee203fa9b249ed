//! A sidecar process killed outright (kill -9) while its claims wait in a queue: the places
//! it leaves behind in Redis are nobody's, and the key must not be handed to them.

use crate::util::{Backend, Harness, SidecarProcess, claim_req, granted, waiting};
use idemgate_wire::{ClaimOutcome, Mode, OwnerOutcome};
use std::time::{Duration, Instant};

/// Twenty claims wait on one key through a sidecar that is then killed; a fresh claim
/// queues behind them on a live sidecar. When the holder finishes, the fresh claim gets
/// the key within about the dead places' liveness window (1 s here) — not after each dead
/// place was handed the key for its 5 s lease in turn (100 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn places_of_a_killed_sidecar_are_never_handed_the_key() {
    const DEAD: u32 = 20;
    let h = Harness::start_with(Backend::Redis, |c| {
        c.recheck = Duration::from_millis(100);
    })
    .await;
    let redis_url = h.redis.as_ref().unwrap().url();
    let mut doomed = SidecarProcess::spawn(&[
        "--redis-url",
        &redis_url,
        "--recheck-ms",
        "100",
        "--store-timeout-ms",
        "500",
    ]);
    let key = "k-crash";
    let (holder, _) = granted(&h.client.claim(&claim_req(key, Mode::Lock, 30_000)).await.0);
    let doomed_client = doomed.client();
    let dead: Vec<_> = (0..DEAD)
        .map(|_| {
            let client = doomed_client.clone();
            tokio::spawn(async move {
                let req = waiting(claim_req(key, Mode::Lock, 5_000), 30_000, 100);
                client.claim(&req).await
            })
        })
        .collect();
    h.client
        .wait_for_key(key, "the doomed waiters to queue", |i| i.queue_len == DEAD)
        .await;
    doomed.kill();
    for task in dead {
        // Their connections were cut: no answer (the client reports an error).
        assert!(task.await.is_err());
    }
    let client = h.client.clone();
    let fresh = tokio::spawn(async move {
        let req = waiting(claim_req(key, Mode::Lock, 5_000), 30_000, 100);
        client.claim(&req).await.0
    });
    h.client
        .wait_for_key(key, "the fresh waiter to queue", |i| {
            i.queue_len == DEAD + 1
        })
        .await;
    // Released at once: some dead places are still inside their liveness window, so the
    // first of them may be handed the key — and must lose it once it is not picked up.
    let released = Instant::now();
    assert_eq!(h.client.abort(key, &holder).await, OwnerOutcome::Released);
    let outcome = tokio::time::timeout(Duration::from_secs(10), fresh)
        .await
        .expect("the fresh claim is answered within 10 s")
        .unwrap();
    let took = released.elapsed();
    let (owner, _) = granted(&outcome);
    assert!(took < Duration::from_secs(3), "granted after {took:?}");
    assert_eq!(
        h.client.inspect(key).await.queue_len,
        0,
        "dead places skipped"
    );
    assert_eq!(h.client.abort(key, &owner).await, OwnerOutcome::Released);
    assert!(matches!(
        h.client.claim(&claim_req(key, Mode::Lock, 1000)).await.0,
        ClaimOutcome::Granted { .. }
    ));
}
