//! The grants this sidecar answered that may still be held: what their complete or abort
//! needs to write the record without reading it first (`scripts.rs`, `COMPLETE`) — the
//! fence and fingerprint the record holds, and a reading of Redis's clock.
//!
//! A complete or abort usually comes back to the sidecar that answered the claim (one beside
//! each gateway); one that does not, or whose grant was dropped here, takes the script's
//! reading path, as every complete did before. Nothing here is trusted: the script checks
//! the record it replaced against the grant assumed, and an entry that does not match (a
//! token sent with another key, a forged one) costs a second write, never a wrong one.
//!
//! The clock: the claim's reply carries Redis's clock as its script read it, which happened
//! after the claim was sent. So that reading plus the time passed since sending (with 0.1 %
//! on top for the two clocks' drift) is never behind Redis's clock; it is ahead by at most
//! the claim's way to Redis. A lease that seems over by it is checked again on Redis's own
//! clock by the script, so the lease still ends exactly when it ends.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Shards of the table (each its own lock) and entries per shard: at most 16,384 grants in
/// flight are remembered (~2 MB); more only send the extra completes down the reading path.
const SHARDS: usize = 16;
const PER_SHARD: usize = 1024;

/// One remembered grant.
pub(super) struct HeldGrant {
    pub fence: u64,
    /// The claim's fingerprint ('' for none), as the record holds it.
    pub fingerprint: Box<str>,
    /// Redis's clock (µs) as the claim's script read it, and when the claim was sent.
    clock_us: u64,
    sent: Instant,
    /// Past this the lease (as granted) is over: the entry may be dropped to make room.
    forget_after: Instant,
}

impl HeldGrant {
    /// Redis's clock now, never behind it (module docs), in µs.
    pub(super) fn clock_now_us(&self) -> u64 {
        let passed = u64::try_from(self.sent.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.clock_us
            .saturating_add(passed)
            .saturating_add(passed / 1000)
            .saturating_add(1)
    }
}

/// A grant as a claim answered it.
pub(super) struct Answered<'a> {
    pub fence: u64,
    pub fingerprint: &'a str,
    pub lease: Duration,
    /// Redis's clock (µs) as the claim's script read it.
    pub clock_us: u64,
    /// When the claim was sent.
    pub sent: Instant,
}

/// Hashes a token id by its low bits. Only this sidecar's own random tokens are inserted, so
/// nobody can choose ids that collide; a lookup with a chosen id finds nothing or one entry.
#[derive(Default)]
struct TokenHasher(u64);

impl Hasher for TokenHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u128(&mut self, id: u128) {
        self.0 = id as u64;
    }
}

type Table = HashMap<u128, HeldGrant, BuildHasherDefault<TokenHasher>>;

#[derive(Default)]
struct Shard {
    grants: Table,
    /// While full of leases still running: the earliest of their ends, before which sweeping
    /// again would find nothing to drop (so a full shard costs one scan, not one per claim).
    full_until: Option<Instant>,
}

pub(super) struct HeldGrants {
    shards: Box<[Mutex<Shard>]>,
}

impl Default for HeldGrants {
    fn default() -> Self {
        HeldGrants {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }
}

/// An owner token (32 hex digits, from `random_token`) as a number; anything else is not one
/// of this sidecar's.
fn token_id(owner: &str) -> Option<u128> {
    let mut bytes = [0u8; 16];
    hex::decode_to_slice(owner, &mut bytes).ok()?;
    Some(u128::from_be_bytes(bytes))
}

impl HeldGrants {
    fn shard(&self, id: u128) -> Option<std::sync::MutexGuard<'_, Shard>> {
        // The token is random: its high bits spread the shards, its low bits a shard's table.
        let shard = self.shards.get(((id >> 96) as usize) % SHARDS)?;
        Some(shard.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Remembers the grant to `owner`.
    pub(super) fn insert(&self, owner: &str, grant: &Answered<'_>) {
        let Some(id) = token_id(owner) else { return };
        let Some(mut shard) = self.shard(id) else {
            return;
        };
        if shard.grants.len() >= PER_SHARD {
            let now = Instant::now();
            if shard.full_until.is_some_and(|until| until > now) {
                return;
            }
            let mut earliest: Option<Instant> = None;
            shard.grants.retain(|_, grant| {
                let running = grant.forget_after > now;
                if running {
                    earliest =
                        Some(earliest.map_or(grant.forget_after, |e| e.min(grant.forget_after)));
                }
                running
            });
            if shard.grants.len() >= PER_SHARD {
                shard.full_until = earliest;
                return;
            }
        }
        shard.grants.insert(
            id,
            HeldGrant {
                fence: grant.fence,
                fingerprint: grant.fingerprint.into(),
                clock_us: grant.clock_us,
                sent: grant.sent,
                forget_after: grant.sent.checked_add(grant.lease).unwrap_or(grant.sent),
            },
        );
    }

    /// Takes out the grant to `owner`, if this sidecar answered it (for whichever key: the
    /// script checks the record).
    pub(super) fn take(&self, owner: &str) -> Option<HeldGrant> {
        let id = token_id(owner)?;
        self.shard(id)?.grants.remove(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWNER: &str = "0123456789abcdef0123456789abcdef";

    fn insert(grants: &HeldGrants, owner: &str, lease_ms: u64) {
        let grant = Answered {
            fence: 7,
            fingerprint: "fp",
            lease: Duration::from_millis(lease_ms),
            clock_us: 1_000_000,
            sent: Instant::now(),
        };
        grants.insert(owner, &grant);
    }

    #[test]
    fn a_grant_is_taken_once() {
        let grants = HeldGrants::default();
        insert(&grants, OWNER, 30_000);
        let grant = grants.take(OWNER).unwrap();
        assert_eq!((grant.fence, &*grant.fingerprint), (7, "fp"));
        assert!(grants.take(OWNER).is_none());
        // Not one of this sidecar's tokens: never remembered, never found.
        insert(&grants, "not-hex", 30_000);
        assert!(grants.take("not-hex").is_none());
    }

    #[test]
    fn the_clock_is_never_behind_the_reading_plus_the_time_since_sending() {
        let grants = HeldGrants::default();
        let sent = Instant::now();
        let grant = Answered {
            fence: 7,
            fingerprint: "",
            lease: Duration::from_secs(30),
            clock_us: 5_000_000,
            sent,
        };
        grants.insert(OWNER, &grant);
        std::thread::sleep(Duration::from_millis(20));
        let grant = grants.take(OWNER).unwrap();
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap();
        let before = micros(sent.elapsed());
        let clock = grant.clock_now_us();
        let after = micros(sent.elapsed());
        assert!(clock > 5_000_000 + before);
        // With the drift allowance, and not more than that.
        assert!(clock <= 5_000_000 + after + after / 1000 + 1);
    }

    #[test]
    fn a_full_table_makes_room_from_leases_over_and_else_remembers_nothing_more() {
        let grants = HeldGrants::default();
        // One shard (same high bits), filled with grants whose lease is over.
        let token = |i: usize| format!("{:032x}", i);
        for i in 0..PER_SHARD {
            insert(&grants, &token(i), 0);
        }
        insert(&grants, &token(PER_SHARD), 30_000);
        assert!(grants.take(&token(PER_SHARD)).is_some());
        assert!(grants.take(&token(0)).is_none());
        // Full of leases still running: the newest is not remembered, the others stay.
        for i in 0..PER_SHARD {
            insert(&grants, &token(i), 30_000);
        }
        insert(&grants, &token(PER_SHARD), 30_000);
        insert(&grants, &token(PER_SHARD + 1), 30_000);
        assert!(grants.take(&token(PER_SHARD)).is_none());
        assert!(grants.take(&token(PER_SHARD + 1)).is_none());
        // A complete makes room again at once.
        assert!(grants.take(&token(1)).is_some());
        insert(&grants, &token(PER_SHARD), 30_000);
        assert!(grants.take(&token(PER_SHARD)).is_some());
    }
}
