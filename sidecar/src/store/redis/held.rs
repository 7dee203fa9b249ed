//! The grants this sidecar answered that may still be held: what their complete or abort
//! needs to release the record by a compare-and-set (`scripts.rs`, `COMPLETE_FRESH`, for a
//! grant the sidecar wrote itself) or to write it without reading it first (`COMPLETE`) — the
//! fence and fingerprint the record holds, and a reading of Redis's clock.
//!
//! A complete or abort usually comes back to the sidecar that answered the claim (one beside
//! each gateway); one that does not, or whose grant was dropped here, takes the script's
//! reading path, as every complete did before. Nothing here is trusted: the script checks
//! the record against the grant assumed, and an entry that does not match (a token sent with
//! another key, a forged one) costs another script call, never a wrong write.
//!
//! The clock: a reading of Redis's clock taken with the grant (`clock.rs`), never behind
//! Redis's clock. A lease that seems over by it is checked again on Redis's own clock by the
//! script, so the lease still ends exactly when it ends.

use super::clock::Reading;
use super::record::fresh_grant;
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
    /// Redis's clock as the grant read it.
    pub clock: Reading,
    /// The lease granted, in ms.
    pub lease_ms: u64,
    /// The grant was written by the sidecar's own `SET` (`record::fresh_grant`), not a script.
    pub fresh: bool,
    /// Past this the lease (as granted) is over: the entry may be dropped to make room.
    forget_after: Instant,
}

/// A grant as a claim answered it.
pub(super) struct Answered<'a> {
    pub fence: u64,
    pub fingerprint: &'a str,
    pub lease: Duration,
    /// Redis's clock as the grant read it.
    pub clock: Reading,
    /// When the claim was sent: the lease, as the holder counts it, runs from here.
    pub sent: Instant,
    /// Written by the sidecar's own `SET`.
    pub fresh: bool,
}

impl HeldGrant {
    /// The record this grant's own `SET` wrote, byte for byte, while its lease is not over by
    /// `now_us` (a reading never behind Redis's clock): what `COMPLETE_FRESH` compares the
    /// record with. `None` for a grant a script made (its record may hold more: a
    /// queue mark, an old response's retention), or a lease that seems over.
    pub(super) fn fresh_record(&self, owner: &str, now_us: u64) -> Option<Vec<u8>> {
        // A fresh grant's lease starts at its fence (both the reading).
        let lease_end = self
            .fence
            .saturating_add(self.lease_ms.saturating_mul(1000));
        (self.fresh && now_us < lease_end)
            .then(|| fresh_grant(self.fence, owner, &self.fingerprint, self.lease_ms))
    }
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
///
/// Decoded without a branch per digit, unlike `hex::decode_to_slice`, whose "digit or
/// letter?" branch the random digits of a token mispredict about every other time: that
/// decoding, done at each claim and each complete, was 2 % of the sidecar's CPU on a fresh
/// key's claim and complete (`perf`, benchmarks/sidecar.notes.md, Session 27).
fn token_id(owner: &str) -> Option<u128> {
    let digits: &[u8; 32] = owner.as_bytes().try_into().ok()?;
    // In two 64-bit halves: shifting one 128-bit number costs two instructions a digit.
    let (mut halves, mut valid) = ([0u64; 2], true);
    for (half, digits) in halves.iter_mut().zip(digits.chunks_exact(16)) {
        for &byte in digits {
            let digit = byte.wrapping_sub(b'0');
            // Either case: the two differ only in 0x20.
            let letter = (byte | 0x20).wrapping_sub(b'a');
            valid &= (digit < 10) | (letter < 6);
            let value = if digit < 10 {
                digit
            } else {
                letter.wrapping_add(10)
            };
            *half = *half << 4 | u64::from(value & 0xF);
        }
    }
    let [high, low] = halves;
    valid.then_some(u128::from(high) << 64 | u128::from(low))
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
                clock: grant.clock,
                lease_ms: u64::try_from(grant.lease.as_millis()).unwrap_or(u64::MAX),
                fresh: grant.fresh,
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
            clock: Reading::new(1_000_000, Instant::now()),
            sent: Instant::now(),
            fresh: false,
        };
        grants.insert(owner, &grant);
    }

    #[test]
    fn a_token_reads_as_hex_decoding_reads_it_and_nothing_else_is_a_token() {
        let decoded = |owner: &str| {
            let mut bytes = [0u8; 16];
            hex::decode_to_slice(owner, &mut bytes)
                .ok()
                .map(|()| u128::from_be_bytes(bytes))
        };
        let mut owners = vec![
            OWNER.to_owned(),
            OWNER.to_uppercase(),
            "f".repeat(32),
            "0".repeat(32),
            "0123456789ABCDEFabcdef0123456789".to_owned(),
        ];
        for i in 0..4096u128 {
            owners.push(format!(
                "{:032x}",
                i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
            ));
        }
        for owner in &owners {
            assert_eq!(token_id(owner), decoded(owner), "{owner}");
            assert!(token_id(owner).is_some());
        }
        // Every byte that is not a hex digit, at every place, and the wrong lengths.
        for place in 0..32 {
            for byte in 0..=255u8 {
                let mut bytes = OWNER.as_bytes().to_vec();
                bytes[place] = byte;
                let Ok(owner) = String::from_utf8(bytes) else {
                    continue;
                };
                assert_eq!(token_id(&owner), decoded(&owner), "{owner:?}");
            }
        }
        for owner in [
            "",
            &OWNER[..31],
            &format!("{OWNER}0"),
            &format!("{OWNER}{OWNER}"),
        ] {
            assert_eq!(token_id(owner), None, "{owner:?}");
        }
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
