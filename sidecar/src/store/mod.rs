//! The store: every atomic step on a key's state (holder, FIFO queue, fencing counter,
//! stored response) behind one trait, with two implementations that pass one behavioural
//! suite — [`memory::MemoryStore`] (one process) and [`redis::RedisStore`] (shared).
//!
//! A store only performs single atomic steps and hands a released key to the next queued
//! waiter itself (so the hand-off cannot be lost between two round trips). Waiting, budgets
//! and wake-ups live in [`crate::locks`]; a store tells a waiting process "your turn may
//! have come" through the [`Waiters`] registry it was built with.

pub(crate) mod memory;
pub(crate) mod redis;

use crate::waiters::Waiters;
use bytes::Bytes;
use idemgate_wire::{GcraStep, Mode, OwnerOutcome, Rate, StoredResponse};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A store error. Redis's own errors are kept whole (kind, code, source), and whether
/// retrying can help is decided in one place, [`StoreError::is_transient`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis refused the command or the connection failed.
    #[error("Redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// Redis did not answer within the store timeout.
    #[error("Redis did not answer within {0:?}")]
    Timeout(Duration),
    /// Redis answered something this sidecar does not understand (a script of another
    /// version, a key of the wrong type).
    #[error("unexpected reply from Redis: {0}")]
    UnexpectedReply(String),
    /// A stored response's headers could not be encoded.
    #[error("cannot encode a stored response: {0}")]
    Encoding(#[from] serde_json::Error),
    /// The store cannot be set up as configured.
    #[error("store configuration: {0}")]
    Config(&'static str),
}

impl StoreError {
    /// Worth retrying: connection lost, timeout, failover, cluster resharding, loading.
    /// Not: wrong credentials, a script error, an unexpected reply, a full Redis.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Redis(err) => {
                !matches!(err.retry_method(), ::redis::RetryMethod::NoRetry)
                    && err.kind() != ::redis::ErrorKind::AuthenticationFailed
            }
            StoreError::Timeout(_) => true,
            StoreError::UnexpectedReply(_) | StoreError::Encoding(_) | StoreError::Config(_) => {
                false
            }
        }
    }

    /// The kind of the Redis error behind this one, if Redis raised it.
    pub fn redis_kind(&self) -> Option<::redis::ErrorKind> {
        match self {
            StoreError::Redis(err) => Some(err.kind()),
            _ => None,
        }
    }

    /// Redis refused a write because it is at `maxmemory` (and evicts nothing).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, StoreError::Redis(err) if err.code() == Some("OOM"))
    }
}

pub(crate) type StoreResult<T> = Result<T, StoreError>;

/// One claim attempt.
#[derive(Debug, Clone)]
pub(crate) struct ClaimArgs<'a> {
    pub key: &'a str,
    pub mode: Mode,
    /// The owner token this claim is granted under (also its queue identity).
    pub owner: &'a str,
    pub fingerprint: Option<&'a str>,
    pub lease: Duration,
    /// `Some` when the caller waits in the queue instead of taking `Busy`.
    pub queue: Option<QueueArgs<'a>>,
    /// A queued claim's later step. Its key has a record (it queued behind a holder), so a
    /// store that first tries a fresh key's grant on its own (Redis) goes straight to the
    /// full step; trying would only cost a round trip, as the full step starts with the
    /// same write.
    pub recheck: bool,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct QueueArgs<'a> {
    /// How long the queue entry stays valid: an entry whose process died is skipped after it.
    pub wait: Duration,
    pub max_queue: u32,
    /// The name the caller gave its place ([`Store::leave_named`] gives it up), if any.
    pub waiter: Option<&'a str>,
    /// How long the place counts as waited for after this step: each step of a waiting
    /// claim renews it, and a key is never handed to a place (or kept for a hand-off) whose
    /// waiter has not been seen for this long — its process died (Redis only: a memory
    /// store's waiters die with it).
    pub alive: Duration,
}

/// A grant as the store recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub fence: u64,
    pub lease_ms: u64,
    /// When the grant happened (store clock, µs since the epoch): for hand-off latency.
    pub granted_at_us: u64,
}

/// The holding in progress, as a busy or queue-full answer saw it: what the wait hint
/// (`crate::hints`) starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holding {
    /// How long the holder has held the key (store clock).
    pub age_ms: u64,
    /// The lease it holds it under.
    pub lease_ms: u64,
}

/// What an owner-checked complete or abort did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Release {
    /// The holding ended, `held_ms` after its grant, under a lease of `lease_ms`.
    Released { held_ms: u64, lease_ms: u64 },
    /// The caller no longer owned the key.
    Stale,
}

impl Release {
    pub(crate) fn outcome(self) -> OwnerOutcome {
        match self {
            Release::Released { .. } => OwnerOutcome::Released,
            Release::Stale => OwnerOutcome::Stale,
        }
    }
}

/// A stored response with its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stored {
    pub response: StoredResponse,
    pub body: Bytes,
}

/// What one claim attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClaimStep {
    Granted(Grant),
    Completed(Stored),
    Mismatch,
    /// Held by `holder` (whose lease ends in `retry_after_ms`), and the caller does not wait.
    Busy {
        retry_after_ms: u64,
        queue_len: u32,
        holder: Holding,
    },
    /// Held by `holder` (as `Busy`), and `queue_len` already wait.
    QueueFull {
        retry_after_ms: u64,
        queue_len: u32,
        holder: Holding,
    },
    /// In the queue at `position` (0 = next); the holder's lease ends in `holder_ttl_ms`.
    Queued {
        position: u32,
        queue_len: u32,
        holder_ttl_ms: u64,
    },
    /// The named place was given up ([`Store::leave_named`]) while this claim waited.
    Left,
}

/// A claim step plus what the store noticed on the way (for metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClaimReply {
    pub step: ClaimStep,
    /// The previous holder's lease ran out without complete/abort.
    pub lease_expired: bool,
}

/// The result of leaving a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaveStep {
    /// The key had already been handed to this waiter (and was kept).
    Granted(Grant),
    /// Out of the queue (or the grant released again, when asked to).
    Left { retry_after_ms: u64, queue_len: u32 },
}

/// Whether a key is held, has a stored response, or neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyState {
    Free,
    Held,
    Completed,
}

/// What an operator sees of one key (`GET /admin/v1/keys/{key}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyInfo {
    pub key: String,
    pub state: KeyState,
    /// The last fencing token issued for this key (0: none known).
    pub last_fence: u64,
    pub holder: Option<HolderInfo>,
    pub queue_len: u32,
    /// Status of the stored response and how long it is still replayed.
    pub completed: Option<CompletedInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderInfo {
    pub fence: u64,
    pub age_ms: u64,
    pub lease_remaining_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletedInfo {
    pub status: u16,
    pub retention_remaining_ms: u64,
}

/// One GCRA step (`idemgate_wire::gcra`) on a rate-limited key, atomically: the global
/// tier of rate limits (`crate::rate`). Its state is separate from every lock's.
pub(crate) trait RateStore: Send + Sync + 'static {
    fn gcra(&self, key: &str, rate: Rate) -> impl Future<Output = StoreResult<GcraStep>> + Send;
}

/// Atomic steps on key state. Every method is one atomic step in the backing store.
pub(crate) trait Store: RateStore + Send + Sync + 'static {
    /// The registry this store wakes when it hands a key to one of this process's waiters.
    fn waiters(&self) -> &Arc<Waiters>;

    /// Stored response (idempotency mode) → fingerprint check → grant if free (and nobody is
    /// queued ahead) → otherwise busy, queue-full, or queued.
    fn claim(&self, args: &ClaimArgs<'_>) -> impl Future<Output = StoreResult<ClaimReply>> + Send;

    /// Leaves the queue. If the key was already handed to `owner`, keeps it
    /// ([`LeaveStep::Granted`]) or, with `release_if_granted`, releases it to the next waiter.
    fn leave(
        &self,
        key: &str,
        owner: &str,
        release_if_granted: bool,
    ) -> impl Future<Output = StoreResult<LeaveStep>> + Send;

    /// Gives up the queued place named `waiter` on `key` (the caller's client went away):
    /// `Released` when it was removed (its waiting claim then answers [`ClaimStep::Left`]),
    /// `Stale` when no such place is queued — never queued, already answered, or already
    /// handed the key (that grant stands: its claim answers it and the caller aborts).
    fn leave_named(
        &self,
        key: &str,
        waiter: &str,
    ) -> impl Future<Output = StoreResult<OwnerOutcome>> + Send;

    /// Owner-checked: stores `response` (if any) for `retention`, releases, wakes waiters.
    fn complete(
        &self,
        key: &str,
        owner: &str,
        retention: Duration,
        response: Option<Stored>,
    ) -> impl Future<Output = StoreResult<Release>> + Send;

    /// Owner-checked release without storing; hands the key to the next waiter.
    fn abort(&self, key: &str, owner: &str) -> impl Future<Output = StoreResult<Release>> + Send;

    /// Owner-checked lease extension to `lease` from now.
    fn renew(
        &self,
        key: &str,
        owner: &str,
        lease: Duration,
    ) -> impl Future<Output = StoreResult<OwnerOutcome>> + Send;

    fn inspect(&self, key: &str) -> impl Future<Output = StoreResult<KeyInfo>> + Send;

    /// Keys currently held, at most `limit` (and whether there were more).
    fn list_held(
        &self,
        limit: usize,
    ) -> impl Future<Output = StoreResult<(Vec<String>, bool)>> + Send;

    /// Releases whoever holds `key` (an operator action); returns the released fence.
    fn force_release(&self, key: &str) -> impl Future<Output = StoreResult<Option<u64>>> + Send;

    /// Whether the store takes writes now, for `/readyz` (Redis: one small write).
    fn ping(&self) -> impl Future<Output = StoreResult<()>> + Send;
}

/// Microseconds since the epoch on this machine's clock.
pub(crate) fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
