//! The in-process store: the default without a Redis URL, for trying idemgate on one
//! machine. It follows the Redis scripts step for step (same suite), under one mutex.
//!
//! Fences come from one process-wide counter seeded from the clock, so they are strictly
//! increasing per key (and across keys) and a key's state can be dropped when idle without
//! ever reissuing a fence. State does not survive a restart: that is what Redis is for.

use super::{
    ClaimArgs, ClaimReply, ClaimStep, CompletedInfo, Grant, HolderInfo, Holding, KeyInfo, KeyState,
    LeaveStep, RateStore, Release, Store, StoreResult, Stored, millis, now_us,
};
use crate::waiters::Waiters;
use idemgate_wire::{GcraStep, Mode, OwnerOutcome, Rate};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

/// Idle keys (and idle rate limits) are swept every this many operations (amortised, no
/// background task).
const SWEEP_EVERY: u64 = 4096;

pub(crate) struct MemoryStore {
    inner: Mutex<Inner>,
    /// Rate limits (`crate::rate`): separate state, never touched by lock steps.
    rates: Rates,
    waiters: Arc<Waiters>,
    fence_ttl: Duration,
}

#[derive(Default)]
struct Inner {
    keys: HashMap<String, Entry>,
    last_fence: u64,
    ops: u64,
}

#[derive(Default)]
struct Entry {
    holder: Option<Holder>,
    /// A grant is outstanding: finding no holder while this is set means the lease expired.
    held: bool,
    queue: VecDeque<Waiter>,
    last_fence: u64,
    fence_until: Option<Instant>,
    response: Option<StoredRecord>,
    /// Owner tokens of named places given up while their claim waited, until that claim
    /// sees it (or its wait would have ended).
    left: Vec<(String, Instant)>,
}

struct Holder {
    owner: String,
    fingerprint: Option<String>,
    grant: Grant,
    granted_at: Instant,
    until: Instant,
}

impl Holder {
    /// Its holding, ended `now`.
    fn released(&self, now: Instant) -> Release {
        Release::Released {
            held_ms: millis(now.saturating_duration_since(self.granted_at)),
            lease_ms: self.grant.lease_ms,
        }
    }
}

struct Waiter {
    owner: String,
    /// The caller's name for this place (`leave_named`).
    name: Option<String>,
    fingerprint: Option<String>,
    lease_ms: u64,
    deadline: Instant,
}

struct StoredRecord {
    stored: Stored,
    fingerprint: Option<String>,
    until: Instant,
}

fn differs(a: Option<&str>, b: Option<&str>) -> bool {
    matches!((a, b), (Some(x), Some(y)) if x != y)
}

fn remaining_ms(until: Instant, now: Instant) -> u64 {
    millis(until.saturating_duration_since(now))
}

impl Entry {
    /// Drops what has expired; returns whether a lease ran out.
    fn tidy(&mut self, now: Instant) -> bool {
        if self.holder.as_ref().is_some_and(|h| h.until <= now) {
            self.holder = None;
        }
        if self.response.as_ref().is_some_and(|r| r.until <= now) {
            self.response = None;
        }
        self.left.retain(|(_, until)| *until > now);
        let expired = self.held && self.holder.is_none();
        if expired {
            self.held = false;
        }
        expired
    }

    fn is_idle(&self, now: Instant) -> bool {
        self.holder.is_none()
            && self.queue.is_empty()
            && self.response.is_none()
            && self.left.is_empty()
            && self.fence_until.is_none_or(|t| t <= now)
    }

    fn holder_ttl(&self, now: Instant) -> u64 {
        self.holder
            .as_ref()
            .map_or(0, |h| remaining_ms(h.until, now))
    }

    fn position(&self, owner: &str) -> Option<usize> {
        self.queue.iter().position(|w| w.owner == owner)
    }

    fn remove_waiter(&mut self, owner: &str) {
        self.queue.retain(|w| w.owner != owner);
    }
}

impl MemoryStore {
    pub(crate) fn new(waiters: Arc<Waiters>, fence_ttl: Duration) -> Self {
        MemoryStore {
            inner: Mutex::new(Inner::default()),
            rates: Rates::default(),
            waiters,
            fence_ttl,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every mutation below leaves a key in a valid state before anything can panic.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the key's (tidied) state, then forgets the key if nothing is left of it.
    fn with_key<T>(&self, key: &str, f: impl FnOnce(&mut Ctx<'_>, &mut Entry, bool) -> T) -> T {
        let now = Instant::now();
        let mut inner = self.lock();
        let Inner {
            keys,
            last_fence,
            ops,
        } = &mut *inner;
        *ops += 1;
        if (*ops).is_multiple_of(SWEEP_EVERY) {
            keys.retain(|_, st| {
                st.tidy(now);
                !st.is_idle(now)
            });
        }
        let st = keys.entry(key.to_owned()).or_default();
        let expired = st.tidy(now);
        let mut ctx = Ctx {
            now,
            last_fence,
            fence_ttl: self.fence_ttl,
            waiters: &self.waiters,
        };
        let out = f(&mut ctx, st, expired);
        if st.is_idle(now) {
            keys.remove(key);
        }
        out
    }
}

/// What a step needs besides the key's state.
struct Ctx<'a> {
    now: Instant,
    last_fence: &'a mut u64,
    fence_ttl: Duration,
    waiters: &'a Waiters,
}

impl Ctx<'_> {
    fn grant(
        &mut self,
        st: &mut Entry,
        owner: &str,
        fingerprint: Option<String>,
        lease_ms: u64,
    ) -> Grant {
        let granted_at_us = now_us();
        let fence = (*self.last_fence + 1).max(granted_at_us);
        *self.last_fence = fence;
        st.last_fence = fence;
        st.fence_until = Some(self.now + self.fence_ttl);
        st.held = true;
        let grant = Grant {
            fence,
            lease_ms,
            granted_at_us,
        };
        st.holder = Some(Holder {
            owner: owner.to_owned(),
            fingerprint,
            grant,
            granted_at: self.now,
            until: self.now + Duration::from_millis(lease_ms),
        });
        grant
    }

    /// Hands a free key to the first live waiter and wakes it.
    fn promote(&mut self, st: &mut Entry) {
        while let Some(next) = st.queue.pop_front() {
            if next.deadline > self.now {
                self.grant(st, &next.owner, next.fingerprint, next.lease_ms);
                self.waiters.wake(&next.owner);
                return;
            }
        }
    }

    fn release(&mut self, st: &mut Entry) {
        st.holder = None;
        st.held = false;
        self.promote(st);
    }

    fn busy_or_queue(&self, st: &mut Entry, args: &ClaimArgs<'_>) -> ClaimStep {
        let ttl = st.holder_ttl(self.now);
        let len = u32::try_from(st.queue.len()).unwrap_or(u32::MAX);
        let holder = st.holder.as_ref().map_or(
            Holding {
                age_ms: 0,
                lease_ms: ttl,
            },
            |h| Holding {
                age_ms: millis(self.now.saturating_duration_since(h.granted_at)),
                lease_ms: h.grant.lease_ms,
            },
        );
        let Some(queue) = args.queue else {
            return ClaimStep::Busy {
                retry_after_ms: ttl,
                queue_len: len,
                holder,
            };
        };
        let position = match st.position(args.owner) {
            Some(p) => p,
            None if len >= queue.max_queue => {
                return ClaimStep::QueueFull {
                    retry_after_ms: ttl,
                    queue_len: len,
                    holder,
                };
            }
            None => {
                st.queue.push_back(Waiter {
                    owner: args.owner.to_owned(),
                    name: queue.waiter.map(str::to_owned),
                    fingerprint: args.fingerprint.map(str::to_owned),
                    lease_ms: millis(args.lease),
                    deadline: self.now + queue.wait,
                });
                st.queue.len() - 1
            }
        };
        ClaimStep::Queued {
            position: u32::try_from(position).unwrap_or(u32::MAX),
            queue_len: u32::try_from(st.queue.len()).unwrap_or(u32::MAX),
            holder_ttl_ms: st.holder_ttl(self.now),
        }
    }
}

impl Store for MemoryStore {
    fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    async fn claim(&self, args: &ClaimArgs<'_>) -> StoreResult<ClaimReply> {
        let step = self.with_key(args.key, |ctx, st, lease_expired| {
            let step = 'step: {
                if let Some(i) = st.left.iter().position(|(o, _)| o == args.owner) {
                    st.left.swap_remove(i);
                    break 'step ClaimStep::Left;
                }
                if args.mode == Mode::Idempotency
                    && let Some(rec) = &st.response
                {
                    let step = if differs(rec.fingerprint.as_deref(), args.fingerprint) {
                        ClaimStep::Mismatch
                    } else {
                        ClaimStep::Completed(rec.stored.clone())
                    };
                    st.remove_waiter(args.owner);
                    break 'step step;
                }
                if let Some(holder) = &st.holder {
                    if holder.owner == args.owner {
                        break 'step ClaimStep::Granted(holder.grant);
                    }
                    if args.mode == Mode::Idempotency
                        && differs(holder.fingerprint.as_deref(), args.fingerprint)
                    {
                        st.remove_waiter(args.owner);
                        break 'step ClaimStep::Mismatch;
                    }
                    break 'step ctx.busy_or_queue(st, args);
                }
                while st.queue.front().is_some_and(|w| w.deadline <= ctx.now) {
                    st.queue.pop_front();
                }
                match st.queue.front() {
                    Some(head) if head.owner != args.owner => {
                        ctx.promote(st);
                        ctx.busy_or_queue(st, args)
                    }
                    head => {
                        if head.is_some() {
                            st.queue.pop_front();
                        }
                        let fp = args.fingerprint.map(str::to_owned);
                        ClaimStep::Granted(ctx.grant(st, args.owner, fp, millis(args.lease)))
                    }
                }
            };
            ClaimReply {
                step,
                lease_expired,
            }
        });
        Ok(step)
    }

    async fn leave(
        &self,
        key: &str,
        owner: &str,
        release_if_granted: bool,
    ) -> StoreResult<LeaveStep> {
        Ok(self.with_key(key, |ctx, st, _| {
            if let Some(holder) = st.holder.as_ref().filter(|h| h.owner == owner) {
                if !release_if_granted {
                    return LeaveStep::Granted(holder.grant);
                }
                ctx.release(st);
            } else {
                st.remove_waiter(owner);
                if st.holder.is_none() {
                    ctx.promote(st);
                }
            }
            LeaveStep::Left {
                retry_after_ms: st.holder_ttl(ctx.now),
                queue_len: u32::try_from(st.queue.len()).unwrap_or(u32::MAX),
            }
        }))
    }

    async fn leave_named(&self, key: &str, waiter: &str) -> StoreResult<OwnerOutcome> {
        Ok(self.with_key(key, |ctx, st, _| {
            let Some(i) = st
                .queue
                .iter()
                .position(|w| w.name.as_deref() == Some(waiter))
            else {
                return OwnerOutcome::Stale;
            };
            let Some(gone) = st.queue.remove(i) else {
                return OwnerOutcome::Stale;
            };
            ctx.waiters.wake(&gone.owner);
            st.left.push((gone.owner, gone.deadline));
            if st.holder.is_none() {
                ctx.promote(st);
            }
            OwnerOutcome::Released
        }))
    }

    async fn complete(
        &self,
        key: &str,
        owner: &str,
        retention: Duration,
        response: Option<Stored>,
    ) -> StoreResult<Release> {
        Ok(self.with_key(key, |ctx, st, _| {
            let Some(holder) = st.holder.take_if(|h| h.owner == owner) else {
                return Release::Stale;
            };
            let released = holder.released(ctx.now);
            match response {
                Some(stored) => {
                    st.held = false;
                    st.response = Some(StoredRecord {
                        stored,
                        fingerprint: holder.fingerprint,
                        until: ctx.now + retention,
                    });
                    // Everyone queued gets the stored response instead of a turn.
                    for waiter in &st.queue {
                        ctx.waiters.wake(&waiter.owner);
                    }
                }
                None => ctx.release(st),
            }
            released
        }))
    }

    async fn abort(&self, key: &str, owner: &str) -> StoreResult<Release> {
        Ok(self.with_key(key, |ctx, st, _| {
            match st.holder.as_ref().filter(|h| h.owner == owner) {
                Some(holder) => {
                    let released = holder.released(ctx.now);
                    ctx.release(st);
                    released
                }
                None => Release::Stale,
            }
        }))
    }

    async fn renew(&self, key: &str, owner: &str, lease: Duration) -> StoreResult<OwnerOutcome> {
        Ok(self.with_key(key, |ctx, st, _| {
            match st.holder.as_mut().filter(|h| h.owner == owner) {
                Some(holder) => {
                    holder.until = ctx.now + lease;
                    OwnerOutcome::Renewed {
                        lease_ms: millis(lease),
                    }
                }
                None => OwnerOutcome::Stale,
            }
        }))
    }

    async fn inspect(&self, key: &str) -> StoreResult<KeyInfo> {
        Ok(self.with_key(key, |ctx, st, _| KeyInfo {
            key: key.to_owned(),
            state: match (&st.holder, &st.response) {
                (Some(_), _) => KeyState::Held,
                (None, Some(_)) => KeyState::Completed,
                (None, None) => KeyState::Free,
            },
            last_fence: st.last_fence,
            holder: st.holder.as_ref().map(|h| HolderInfo {
                fence: h.grant.fence,
                age_ms: millis(ctx.now.saturating_duration_since(h.granted_at)),
                lease_remaining_ms: remaining_ms(h.until, ctx.now),
            }),
            queue_len: u32::try_from(st.queue.len()).unwrap_or(u32::MAX),
            completed: st.response.as_ref().map(|r| CompletedInfo {
                status: r.stored.response.status,
                retention_remaining_ms: remaining_ms(r.until, ctx.now),
            }),
        }))
    }

    async fn list_held(&self, limit: usize) -> StoreResult<(Vec<String>, bool)> {
        let now = Instant::now();
        let inner = self.lock();
        let mut held = inner
            .keys
            .iter()
            .filter(|(_, st)| st.holder.as_ref().is_some_and(|h| h.until > now))
            .map(|(k, _)| k.clone());
        let keys: Vec<String> = held.by_ref().take(limit).collect();
        Ok((keys, held.next().is_some()))
    }

    async fn force_release(&self, key: &str) -> StoreResult<Option<u64>> {
        Ok(self.with_key(key, |ctx, st, _| {
            let fence = st.holder.as_ref().map(|h| h.grant.fence);
            if fence.is_some() {
                ctx.release(st);
            }
            fence
        }))
    }

    async fn ping(&self) -> StoreResult<()> {
        Ok(())
    }
}

impl RateStore for MemoryStore {
    async fn gcra(&self, key: &str, rate: Rate) -> StoreResult<GcraStep> {
        Ok(self.rates.step(key, rate, now_us()))
    }
}

/// The memory store's limits: each key's TAT, dropped once in the past (then it equals no
/// state), so memory follows the keys active within their windows.
#[derive(Default)]
struct Rates {
    inner: Mutex<(HashMap<String, u64>, u64)>,
}

impl Rates {
    fn step(&self, key: &str, rate: Rate, now_us: u64) -> GcraStep {
        let mut guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let (tats, ops) = &mut *guard;
        *ops += 1;
        if *ops % SWEEP_EVERY == 0 {
            tats.retain(|_, tat| *tat > now_us);
        }
        let tat = tats.get(key).copied().unwrap_or(0);
        let step = idemgate_wire::gcra(tat, now_us, rate);
        if step.allowed {
            tats.insert(key.to_owned(), step.tat_us);
        }
        step
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_forget_idle_keys() {
        let rates = Rates::default();
        let rate = Rate {
            interval_us: 10,
            burst: 1,
        };
        for n in 0..SWEEP_EVERY {
            assert!(rates.step(&n.to_string(), rate, 1_000 + n).allowed);
        }
        assert!(rates.len() < 100, "{}", rates.len());
    }
}
