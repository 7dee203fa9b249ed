//! Wait hints: the `retry_after_ms` of a busy (409 in progress) or queue-full (429) answer,
//! estimated from how long the key's holders — or, for a key not seen yet, the holders of
//! keys granted under the same lease — actually took, instead of the whole lease left.
//!
//! Every complete and abort reports how long its holding lasted (the store measures it on
//! its own clock, so a holding granted by another sidecar counts too). Each sidecar keeps a
//! moving average of those durations in two small fixed tables of atomics — one slot per
//! key hash, one per lease length — so learning costs no Redis command, no lock and no
//! allocation, and memory never grows with traffic. A slot shared by two keys (or two
//! leases) belongs to the last one that ended a holding there: the estimate is a hint, and
//! the clamps below keep a wrong one harmless.
//!
//! The hint for a holder that has held the key `age` ms, with `typical` ms the average:
//! - the holder's rest: `typical - age` while it is younger than typical, else `age` (a
//!   holding that outlives the average is assumed to last as long again), clamped to
//!   `[1, lease left]` — never 0, never past the moment the lease frees the key;
//! - in lock mode, plus `typical` (at most the lease) for each waiter already queued: they
//!   go first. In idempotency mode the holder's stored response answers the queue at once;
//! - no history for the key nor its lease: the lease left, as before the sidecar learnt.

use crate::store::Holding;
use idemgate_wire::Mode;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

/// Slots of the per-key table (8 bytes each).
const KEY_SLOTS: usize = 4096;
/// Slots of the per-lease table.
const LEASE_SLOTS: usize = 64;
/// Weight of a new duration in the moving average: 1/2^`SHIFT`.
const SHIFT: u32 = 2;

/// The learnt hold durations.
pub(crate) struct Hints {
    keys: Box<[AtomicU64]>,
    leases: Box<[AtomicU64]>,
    hasher: RandomState,
}

impl Default for Hints {
    fn default() -> Self {
        let table = |n| (0..n).map(|_| AtomicU64::new(0)).collect();
        Hints {
            keys: table(KEY_SLOTS),
            leases: table(LEASE_SLOTS),
            hasher: RandomState::new(),
        }
    }
}

/// A slot holds `tag << 32 | average_ms`; 0 is empty (tags are never 0).
fn pack(tag: u32, ms: u64) -> u64 {
    (u64::from(tag) << 32) | ms.min(u64::from(u32::MAX))
}

fn tag_of(slot: u64) -> u32 {
    (slot >> 32) as u32
}

fn average_of(slot: u64) -> u64 {
    slot & u64::from(u32::MAX)
}

/// Folds `held_ms` into the slot's average if the slot is `tag`'s; takes the slot otherwise.
fn learn(slot: &AtomicU64, tag: u32, held_ms: u64) {
    // A lost race only loses one sample of a hint.
    let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
        let average = if tag_of(old) == tag {
            let old = average_of(old);
            // Integer moving average, both ways without underflow.
            if held_ms >= old {
                old + ((held_ms - old) >> SHIFT)
            } else {
                old - ((old - held_ms) >> SHIFT)
            }
        } else {
            held_ms
        };
        Some(pack(tag, average))
    });
}

fn recall(slot: &AtomicU64, tag: u32) -> Option<u64> {
    let value = slot.load(Ordering::Relaxed);
    (tag_of(value) == tag).then(|| average_of(value))
}

impl Hints {
    /// The key's slot and tag (never 0); always `Some` (the index is taken modulo the size).
    fn key_slot(&self, key: &str) -> Option<(&AtomicU64, u32)> {
        let hash = self.hasher.hash_one(key);
        let slot = self.keys.get((hash as usize) % KEY_SLOTS)?;
        Some((slot, ((hash >> 32) as u32) | 1))
    }

    /// The lease's slot and tag (never 0); always `Some`.
    fn lease_slot(&self, lease_ms: u64) -> Option<(&AtomicU64, u32)> {
        let tag = (lease_ms.min(u64::from(u32::MAX - 1)) as u32) + 1;
        Some((self.leases.get((tag as usize) % LEASE_SLOTS)?, tag))
    }

    /// A holding of `key`, under a lease of `lease_ms`, ended after `held_ms`.
    pub(crate) fn learn(&self, key: &str, held_ms: u64, lease_ms: u64) {
        for (slot, tag) in [self.key_slot(key), self.lease_slot(lease_ms)]
            .into_iter()
            .flatten()
        {
            learn(slot, tag, held_ms);
        }
    }

    /// How long the key's holdings typically last: its own, else its lease's.
    fn typical(&self, key: &str, lease_ms: u64) -> Option<u64> {
        let recalled = |found: Option<(&AtomicU64, u32)>| found.and_then(|(s, t)| recall(s, t));
        recalled(self.key_slot(key)).or_else(|| recalled(self.lease_slot(lease_ms)))
    }

    /// The wait hint (ms, at least 1) for a claim of `key` in `mode` that found `holder`
    /// with `lease_left_ms` of its lease left and `queue_len` waiting (module docs).
    pub(crate) fn wait_ms(
        &self,
        key: &str,
        mode: Mode,
        holder: Holding,
        lease_left_ms: u64,
        queue_len: u32,
    ) -> u64 {
        let lease_left_ms = lease_left_ms.max(1);
        let Some(typical) = self.typical(key, holder.lease_ms) else {
            return lease_left_ms;
        };
        let rest = if holder.age_ms < typical {
            typical - holder.age_ms
        } else {
            holder.age_ms
        };
        let rest = rest.clamp(1, lease_left_ms);
        let ahead = match mode {
            Mode::Lock => u64::from(queue_len),
            Mode::Idempotency => 0,
        };
        rest.saturating_add(ahead.saturating_mul(typical.clamp(1, holder.lease_ms.max(1))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(age_ms: u64) -> Holding {
        Holding {
            age_ms,
            lease_ms: 30_000,
        }
    }

    #[test]
    fn without_history_the_hint_is_the_lease_left() {
        let hints = Hints::default();
        assert_eq!(
            hints.wait_ms("k", Mode::Lock, holder(100), 29_900, 3),
            29_900
        );
        assert_eq!(hints.wait_ms("k", Mode::Lock, holder(100), 0, 0), 1);
    }

    #[test]
    fn the_hint_is_what_the_typical_holding_has_left() {
        let hints = Hints::default();
        hints.learn("k", 300, 30_000);
        assert_eq!(
            hints.wait_ms("k", Mode::Idempotency, holder(100), 29_900, 5),
            200
        );
        // Lock mode: the queued waiters go first, a typical holding each.
        assert_eq!(
            hints.wait_ms("k", Mode::Lock, holder(100), 29_900, 2),
            200 + 2 * 300
        );
    }

    #[test]
    fn a_key_not_seen_yet_learns_from_its_lease() {
        let hints = Hints::default();
        hints.learn("other", 400, 30_000);
        assert_eq!(
            hints.wait_ms("new", Mode::Idempotency, holder(0), 30_000, 0),
            400
        );
        // Another lease is another class: nothing known.
        let short = Holding {
            age_ms: 0,
            lease_ms: 5_000,
        };
        assert_eq!(
            hints.wait_ms("new", Mode::Idempotency, short, 5_000, 0),
            5_000
        );
    }

    #[test]
    fn the_hint_is_never_zero_nor_past_the_lease_left() {
        let hints = Hints::default();
        hints.learn("k", 300, 30_000);
        // A millisecond short of the average: 1 ms, never 0; at it, as long again.
        assert_eq!(
            hints.wait_ms("k", Mode::Idempotency, holder(299), 1_000, 0),
            1
        );
        assert_eq!(
            hints.wait_ms("k", Mode::Idempotency, holder(300), 1_000, 0),
            300
        );
        // Outliving the average: as long again, but the lease frees the key first.
        assert_eq!(
            hints.wait_ms("k", Mode::Idempotency, holder(5_000), 2_000, 0),
            2_000
        );
    }

    #[test]
    fn the_average_moves_a_quarter_of_the_way_to_each_holding() {
        let hints = Hints::default();
        hints.learn("k", 1_000, 30_000);
        hints.learn("k", 200, 30_000);
        assert_eq!(hints.typical("k", 30_000), Some(800));
        hints.learn("k", 1_600, 30_000);
        assert_eq!(hints.typical("k", 30_000), Some(1_000));
    }
}
