//! The protocol's verbs over a [`Store`]: claim (including the FIFO long-poll), complete,
//! abort, renew. Owns owner tokens, caps (lease, wait, queue, retention), waiting and
//! wake-ups, and the metrics of each outcome. Knows nothing about HTTP.
//!
//! A waiting claim sits in the store's queue and sleeps until (a) its process is told the
//! key was handed to it or a response was stored, (b) the holder's lease is due to end (the
//! first waiter re-checks then, which hands an expired key on promptly without keyspace
//! notifications), or (c) the re-check interval passes, which bounds the damage of a lost
//! notification. Each wake-up is one atomic claim step that also reports "granted to you".

use crate::config::Config;
use crate::hints::Hints;
use crate::metrics::{Metrics, StoreVerb};
use crate::store::{
    ClaimArgs, ClaimReply, ClaimStep, Grant, LeaveStep, QueueArgs, Release, Store, StoreError,
    Stored, millis, now_us,
};
use crate::telemetry::{self, timed_store_call};
use bytes::Bytes;
use idemgate_wire::{
    AbortRequest, ClaimOutcome, ClaimRequest, CompleteRequest, LeaveRequest, OwnerOutcome,
    RenewRequest,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Span;

/// Why a verb produced no protocol answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the sidecar is shutting down")]
    ShuttingDown,
}

/// 128 bits from a CSPRNG seeded by the operating system, hex-encoded: owner tokens and
/// inbox ids.
pub(crate) fn random_token() -> String {
    use rand::Rng;
    let mut bytes = [0u8; 16];
    // rand's thread-local CSPRNG (ChaCha12, seeded from the OS and reseeded from it every
    // 64 KiB of output) rather than the OS generator itself: a `getrandom` system call per
    // claim was one of the ~14 a claim+complete pair makes (BENCHMARKS.md, sidecar notes).
    // It panics if the OS generator fails to seed it: a predictable token would be worse than
    // no service.
    rand::rng().fill_bytes(&mut bytes);
    // Into a buffer rather than `hex::encode`, which builds the string a char at a time
    // (~500 instructions a token against ~60).
    let mut digits = [0u8; 32];
    // It fails only on a buffer of the wrong length: 32 digits hold 16 bytes.
    let _ = hex::encode_to_slice(bytes, &mut digits);
    // Hex digits are ASCII: the check cannot fail, and unlike a lossy conversion it does not
    // walk the digits in chunks (~250 instructions a token).
    std::str::from_utf8(&digits)
        .map(str::to_owned)
        .unwrap_or_default()
}

pub(crate) struct Locks<S> {
    store: Arc<S>,
    config: Arc<Config>,
    metrics: Arc<Metrics>,
    shutdown: watch::Receiver<bool>,
    /// What holdings take, for the wait hints of busy and queue-full answers.
    hints: Hints,
}

/// Takes a waiter out of the queue if its claim ends without an answer (the connection
/// closed, a store error): a grant that arrived meanwhile is released to the next waiter.
struct QueueGuard<S: Store> {
    store: Arc<S>,
    key: String,
    owner: String,
    armed: bool,
    metrics: Arc<Metrics>,
}

impl<S: Store> QueueGuard<S> {
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl<S: Store> Drop for QueueGuard<S> {
    fn drop(&mut self) {
        self.store.waiters().unregister(&self.owner);
        self.metrics.waiters.dec();
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // runtime gone: the queue entry expires with its deadline
        };
        let store = Arc::clone(&self.store);
        let (key, owner) = (
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.owner),
        );
        // The request's span (entered while its future is dropped) keeps its ids on the log.
        let cleanup = async move {
            if let Err(err) = store.leave(&key, &owner, true).await {
                tracing::warn!(%err, "could not remove an abandoned waiter; it expires by itself");
            }
        };
        runtime.spawn(tracing::Instrument::instrument(cleanup, Span::current()));
    }
}

impl<S: Store> Locks<S> {
    pub(crate) fn new(
        store: Arc<S>,
        config: Arc<Config>,
        metrics: Arc<Metrics>,
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        Locks {
            store,
            config,
            metrics,
            shutdown,
            hints: Hints::default(),
        }
    }

    pub(crate) fn store(&self) -> &Arc<S> {
        &self.store
    }

    async fn step(&self, args: &ClaimArgs<'_>) -> Result<ClaimReply, StoreError> {
        let reply =
            timed_store_call(&self.metrics, StoreVerb::Claim, self.store.claim(args)).await?;
        if reply.lease_expired {
            self.metrics.lease_expiries.inc();
        }
        Ok(reply)
    }

    /// Claims `req.key`; waits in FIFO order when `req.wait` is set. Returns the answer and
    /// its payload (the stored body of a `completed` answer).
    pub(crate) async fn claim(
        &self,
        req: &ClaimRequest,
    ) -> Result<(ClaimOutcome, Bytes), LockError> {
        let owner = random_token();
        let mut args = ClaimArgs {
            key: &req.key,
            mode: req.mode,
            owner: &owner,
            fingerprint: req.fingerprint.as_deref(),
            lease: Duration::from_millis(req.lease_ms).min(self.config.max_lease),
            queue: None,
            recheck: false,
        };
        let Some(policy) = req.wait else {
            let reply = self.step(&args).await?;
            return Ok(self.answer(req, &owner, reply.step, None, None));
        };
        let longest = Duration::from_millis(policy.longest_budget()).min(self.config.max_wait);
        args.queue = Some(QueueArgs {
            wait: longest,
            max_queue: policy.max_queue.min(self.config.max_queue),
            waiter: req.waiter.as_deref(),
            alive: self.config.alive_window(),
        });
        let started = Instant::now();
        let notify = self.store.waiters().register(&owner);
        self.metrics.waiters.inc();
        let mut guard = QueueGuard {
            store: Arc::clone(&self.store),
            key: req.key.clone(),
            owner: owner.clone(),
            armed: true,
            metrics: Arc::clone(&self.metrics),
        };
        let mut shutdown = self.shutdown.clone();
        // Set once the claim is queued: when its wait budget ends, and the `wait` span that
        // lasts until the claim's answer.
        let mut queued: Option<(Instant, Span)> = None;
        loop {
            let reply = self.step(&args).await?;
            args.recheck = true;
            let (position, holder_ttl_ms) = match reply.step {
                ClaimStep::Queued {
                    position,
                    holder_ttl_ms,
                    ..
                } => (position, holder_ttl_ms),
                step => {
                    guard.disarm();
                    let wait = queued.map(|(_, span)| (started, span));
                    return Ok(self.answer(
                        req,
                        &owner,
                        step,
                        wait.as_ref().map(|w| w.0),
                        wait.map(|w| w.1),
                    ));
                }
            };
            let (deadline, _) = queued.get_or_insert_with(|| {
                self.metrics.queue_position.observe(f64::from(position));
                telemetry::current_attribute("idemgate.queue_position", i64::from(position));
                let span = telemetry::child_span(|| {
                    tracing::info_span!("wait", idemgate.queue_position = position)
                });
                let budget = Duration::from_millis(policy.budget_for(position)).min(longest);
                (started + budget, span)
            });
            let deadline = *deadline;
            let now = Instant::now();
            if now >= deadline {
                let step = timed_store_call(
                    &self.metrics,
                    StoreVerb::Claim,
                    self.store.leave(&req.key, &owner, false),
                )
                .await?;
                guard.disarm();
                return Ok(self.give_up(req, &owner, step, started, queued.map(|(_, span)| span)));
            }
            let mut nap = self.config.recheck;
            if position == 0 {
                // The holder's lease ends then: be there to take the key over.
                nap = nap.min(Duration::from_millis(holder_ttl_ms.saturating_add(1)));
            }
            let nap = nap.min(deadline - now);
            let stopping = tokio::select! {
                biased;
                // A dropped sender means the server is gone: stop as well.
                _ = shutdown.wait_for(|stop| *stop) => true,
                () = notify.notified() => false,
                () = tokio::time::sleep(nap) => false,
            };
            if stopping {
                timed_store_call(
                    &self.metrics,
                    StoreVerb::Claim,
                    self.store.leave(&req.key, &owner, true),
                )
                .await?;
                guard.disarm();
                self.observe_wait(started);
                return Err(LockError::ShuttingDown);
            }
        }
    }

    fn observe_wait(&self, started: Instant) {
        self.metrics
            .wait_seconds
            .observe(started.elapsed().as_secs_f64());
    }

    fn give_up(
        &self,
        req: &ClaimRequest,
        owner: &str,
        step: LeaveStep,
        started: Instant,
        wait: Option<Span>,
    ) -> (ClaimOutcome, Bytes) {
        match step {
            LeaveStep::Granted(grant) => {
                self.answer(req, owner, ClaimStep::Granted(grant), Some(started), wait)
            }
            LeaveStep::Left {
                retry_after_ms,
                queue_len,
            } => {
                self.observe_wait(started);
                record_claim_answer("busy", Some(started), wait.as_ref());
                self.metrics.count_claim("busy");
                let outcome = ClaimOutcome::Busy {
                    retry_after_ms: retry_after_ms.max(1),
                    queue_len,
                    waited: true,
                };
                (outcome, Bytes::new())
            }
        }
    }

    /// The protocol answer for a final claim step of `req`; `queued_since` (and the `wait`
    /// span) are set when it waited.
    fn answer(
        &self,
        req: &ClaimRequest,
        owner: &str,
        step: ClaimStep,
        queued_since: Option<Instant>,
        wait: Option<Span>,
    ) -> (ClaimOutcome, Bytes) {
        let waited_ms = queued_since.map_or(0, |t| millis(t.elapsed()));
        if let Some(started) = queued_since {
            self.observe_wait(started);
        }
        // What a busy or full key's caller is told to wait: what its holdings take.
        let hint = |holder, retry_after_ms, queue_len| {
            self.hints
                .wait_ms(&req.key, req.mode, holder, retry_after_ms, queue_len)
        };
        let (label, outcome, payload) = match step {
            ClaimStep::Granted(Grant {
                fence,
                lease_ms,
                granted_at_us,
            }) => {
                if queued_since.is_some() {
                    let handoff_us = now_us().saturating_sub(granted_at_us);
                    self.metrics
                        .handoff_seconds
                        .observe(handoff_us as f64 / 1e6);
                }
                let outcome = ClaimOutcome::Granted {
                    owner: owner.to_owned(),
                    fence,
                    lease_ms,
                    waited_ms,
                };
                ("granted", outcome, Bytes::new())
            }
            ClaimStep::Completed(Stored { response, body }) => (
                "completed",
                ClaimOutcome::Completed {
                    response,
                    waited_ms,
                },
                body,
            ),
            ClaimStep::Mismatch => ("mismatch", ClaimOutcome::Mismatch, Bytes::new()),
            ClaimStep::Busy {
                retry_after_ms,
                queue_len,
                holder,
            } => (
                "busy",
                ClaimOutcome::Busy {
                    retry_after_ms: hint(holder, retry_after_ms, queue_len),
                    queue_len,
                    waited: false,
                },
                Bytes::new(),
            ),
            ClaimStep::QueueFull {
                retry_after_ms,
                queue_len,
                holder,
            } => (
                "queue_full",
                ClaimOutcome::QueueFull {
                    retry_after_ms: hint(holder, retry_after_ms, queue_len),
                    queue_len,
                },
                Bytes::new(),
            ),
            // Nobody waits for this answer any more (the caller gave the place up): what a
            // wait that ends without the key answers.
            ClaimStep::Left => (
                "left",
                ClaimOutcome::Busy {
                    retry_after_ms: 1,
                    queue_len: 0,
                    waited: true,
                },
                Bytes::new(),
            ),
            // A final step is never `Queued`: the wait loop handles it. Answer busy rather
            // than panic should a store ever return it for a non-waiting claim.
            ClaimStep::Queued {
                queue_len,
                holder_ttl_ms,
                ..
            } => (
                "busy",
                ClaimOutcome::Busy {
                    retry_after_ms: holder_ttl_ms.max(1),
                    queue_len,
                    waited: false,
                },
                Bytes::new(),
            ),
        };
        record_claim_answer(label, queued_since, wait.as_ref());
        self.metrics.count_claim(label);
        (outcome, payload)
    }

    /// Learns how long `key`'s holding took, if `release` ended one.
    fn released(&self, key: &str, release: Release) -> OwnerOutcome {
        if let Release::Released { held_ms, lease_ms } = release {
            self.hints.learn(key, held_ms, lease_ms);
        }
        release.outcome()
    }

    fn owner_answer(&self, op: &str, outcome: OwnerOutcome) -> OwnerOutcome {
        telemetry::outcome(match outcome {
            OwnerOutcome::Released => "released",
            OwnerOutcome::Renewed { .. } => "renewed",
            OwnerOutcome::Stale => "stale",
        });
        if outcome == OwnerOutcome::Stale {
            self.metrics.stale_owners.with_label_values(&[op]).inc();
            tracing::info!(op, "refused a stale owner");
        }
        outcome
    }

    pub(crate) async fn complete(
        &self,
        req: CompleteRequest,
        body: Bytes,
    ) -> Result<OwnerOutcome, LockError> {
        let retention = Duration::from_millis(req.retention_ms).min(self.config.max_retention);
        let stored = req.response.map(|response| Stored { response, body });
        let outcome = timed_store_call(
            &self.metrics,
            StoreVerb::Complete,
            self.store.complete(&req.key, &req.owner, retention, stored),
        )
        .await?;
        Ok(self.owner_answer("complete", self.released(&req.key, outcome)))
    }

    /// Gives up a named queued place (`/v1/leave`).
    pub(crate) async fn leave(&self, req: &LeaveRequest) -> Result<OwnerOutcome, LockError> {
        let outcome = timed_store_call(
            &self.metrics,
            StoreVerb::Leave,
            self.store.leave_named(&req.key, &req.waiter),
        )
        .await?;
        let label = if outcome == OwnerOutcome::Released {
            "released"
        } else {
            "stale"
        };
        telemetry::outcome(label);
        self.metrics.leaves.with_label_values(&[label]).inc();
        Ok(outcome)
    }

    pub(crate) async fn abort(&self, req: &AbortRequest) -> Result<OwnerOutcome, LockError> {
        let outcome = timed_store_call(
            &self.metrics,
            StoreVerb::Abort,
            self.store.abort(&req.key, &req.owner),
        )
        .await?;
        Ok(self.owner_answer("abort", self.released(&req.key, outcome)))
    }

    pub(crate) async fn renew(&self, req: &RenewRequest) -> Result<OwnerOutcome, LockError> {
        let lease = Duration::from_millis(req.lease_ms).min(self.config.max_lease);
        let outcome = timed_store_call(
            &self.metrics,
            StoreVerb::Renew,
            self.store.renew(&req.key, &req.owner, lease),
        )
        .await?;
        Ok(self.owner_answer("renew", outcome))
    }
}

/// Records a claim's answer on its request span and, when it waited, on its `wait` span
/// (which ends when dropped here).
fn record_claim_answer(label: &'static str, queued_since: Option<Instant>, wait: Option<&Span>) {
    telemetry::outcome(label);
    if let Some(since) = queued_since {
        let waited_ms = since.elapsed().as_secs_f64() * 1e3;
        telemetry::current_attribute("idemgate.wait_ms", waited_ms);
        if let Some(wait) = wait {
            telemetry::attribute(wait, "idemgate.wait_ms", waited_ms);
            telemetry::attribute(wait, "idemgate.outcome", label);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::random_token;
    use std::collections::HashSet;

    /// Owner tokens are 128 random bits as 32 lowercase hex digits (what `held.rs` parses),
    /// different on every call and on every thread.
    #[test]
    fn owner_tokens_are_32_hex_digits_and_never_repeat() {
        let tokens: Vec<String> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| (0..5_000).map(|_| random_token()).collect::<Vec<_>>()))
                .collect();
            threads
                .into_iter()
                .flat_map(|t| t.join().unwrap())
                .collect()
        });
        for token in &tokens {
            assert_eq!(token.len(), 32, "{token}");
            assert!(
                token
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "{token}"
            );
        }
        let distinct: HashSet<&String> = tokens.iter().collect();
        assert_eq!(distinct.len(), tokens.len());
    }
}
