//! The local tier: a fixed-size table in Envoy shared data that catches duplicates reaching
//! this gateway (on any worker) without a network hop, and serves recently completed
//! responses.
//!
//! Shared data has no delete, no TTL and no create-if-absent, and lives as long as the
//! process. So the table is `slots` keys (`idemgate.v1.slot.<n>`) that are never added to:
//! a stored key lives in slot `hash mod slots` or one of the next `probes - 1` slots, every
//! entry carries its owner and expiry, and slots are reused with CAS once free or expired.
//! Memory is bounded by `slots × (entry header + max_response_bytes + stored headers)`
//! whatever the traffic. The table is never authoritative across gateways: the sidecar is.

use alloc::string::String;
use alloc::vec::Vec;
use idemgate_wire::StoredResponse;

use crate::hash::{decimal, prefix_u32, same_key};
use crate::ports::{HostError, SharedStore};
use crate::spec::LocalConfig;

/// A CAS value no live entry has in practice: setting a *missing* key with any non-zero CAS
/// inserts it, while an existing key (written concurrently) has the CAS the host assigned on
/// its write — a global counter that would have to reach `u32::MAX` to collide.
pub(crate) const INSERT_CAS: u32 = u32::MAX;
const MAGIC: &[u8; 3] = b"IG1";
const ROUNDS: u32 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free = 0,
    InFlight = 1,
    Completed = 2,
}

/// A completed response kept for local replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LocalResponse {
    pub(crate) fingerprint: Option<String>,
    pub(crate) response: StoredResponse,
    pub(crate) body: Vec<u8>,
}

/// A slot's entry; its key borrowed from the bytes read (or from the caller): a scan reads
/// up to `probes` entries and keeps only what it returns.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry<'k> {
    state: State,
    key: &'k [u8],
    owner: u64,
    expires_ms: u64,
    /// An in-flight entry's: the holder's request fingerprint (idempotency mode), so a
    /// duplicate with another body is refused at once, as the sidecar refuses it.
    fingerprint: Option<&'k [u8]>,
    completed: Option<LocalResponse>,
}

/// Proof that this request wrote the in-flight entry of `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hold {
    pub(crate) slot: u32,
    pub(crate) owner: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LocalClaim {
    /// This request now holds the key on this gateway.
    Claimed(Hold),
    /// Another request on this gateway holds it.
    InFlight { retry_after_ms: u64 },
    /// Another request on this gateway holds it, and its fingerprint differs from the
    /// claimant's: the key is reused for another request.
    Mismatch,
    /// A request with this key completed recently.
    Completed(LocalResponse),
    /// No free slot among the probes, or CAS kept failing: decide without the local tier.
    Unavailable,
}

/// One read of a key's probed slots.
enum Scan {
    /// The key is live here: [`LocalClaim::InFlight`] or [`LocalClaim::Completed`].
    Live(LocalClaim),
    /// Not live here; this slot (read with this CAS) is the one to take.
    Take { slot: u32, cas: Option<u32> },
    /// Every probed slot holds another key's in-flight entry, or shared data failed.
    Unavailable,
}

pub(crate) struct Table<'a> {
    pub(crate) config: &'a LocalConfig,
    pub(crate) store: &'a dyn SharedStore,
}

pub(crate) fn slot_key(slot: u32) -> SlotName {
    slot_name("idemgate.v1.slot.", slot)
}

/// `prefix` and the slot's number: a shared-data key of one of the tables, spelled on the
/// stack (`format!` costs a slot read several hundred instructions more, a `String` an
/// allocation and its free).
pub(crate) fn slot_name(prefix: &'static str, slot: u32) -> SlotName {
    let mut name = SlotName {
        bytes: [0; SLOT_NAME_MAX],
        len: 0,
    };
    for part in [prefix, decimal(slot.into(), &mut [0; 20])] {
        let end = name.len + part.len();
        if let Some(at) = name.bytes.get_mut(name.len..end) {
            at.copy_from_slice(part.as_bytes());
            name.len = end;
        }
    }
    name
}

/// Room for the longer prefix (`idemgate.v1.slot.`, 17 bytes) and a u32's ten digits.
const SLOT_NAME_MAX: usize = 32;

/// A slot's shared-data key (see [`slot_name`]).
pub(crate) struct SlotName {
    bytes: [u8; SLOT_NAME_MAX],
    len: usize,
}

impl core::ops::Deref for SlotName {
    type Target = str;
    fn deref(&self) -> &str {
        // Only whole ASCII strings were copied in.
        core::str::from_utf8(self.bytes.get(..self.len).unwrap_or_default()).unwrap_or_default()
    }
}

impl Table<'_> {
    fn home(&self, key: &str) -> u32 {
        prefix_u32(key) % self.config.slots
    }

    fn probe(&self, key: &str) -> impl Iterator<Item = u32> + '_ {
        let home = self.home(key);
        let slots = self.config.slots;
        (0..self.config.probes.min(slots))
            .map(move |p| ((u64::from(home) + u64::from(p)) % u64::from(slots)) as u32)
    }

    /// Reads `key`'s probed slots: its live entry, else the best slot to take for it.
    /// `fingerprint`: the claimant's, compared with an in-flight holder's.
    fn scan(&self, key: &str, fingerprint: Option<&str>, now_ms: u64) -> Scan {
        // Best slot to take: (slot, cas, evicts a completed entry, its expiry).
        let mut best: Option<(u32, Option<u32>, bool, u64)> = None;
        for slot in self.probe(key) {
            let Ok(current) = self.store.get(&slot_key(slot)) else {
                return Scan::Unavailable;
            };
            let (bytes, cas) = current.map_or((Vec::new(), None), |(b, cas)| (b, Some(cas)));
            let entry = decode(&bytes);
            let live = entry.filter(|e| e.state != State::Free && e.expires_ms > now_ms);
            let evicts = match live {
                Some(e) if same_key(e.key, key.as_bytes()) => {
                    return Scan::Live(match e.completed {
                        Some(done) if e.state == State::Completed => LocalClaim::Completed(done),
                        _ if differs(e.fingerprint, fingerprint) => LocalClaim::Mismatch,
                        _ => LocalClaim::InFlight {
                            retry_after_ms: e.expires_ms - now_ms,
                        },
                    });
                }
                Some(e) if e.state == State::InFlight => continue,
                Some(e) => Some(e.expires_ms),
                None => None,
            };
            best = match (best, evicts) {
                (None, _) => Some((slot, cas, evicts.is_some(), evicts.unwrap_or(0))),
                // A free slot beats evicting; among evictions the one expiring first goes.
                (Some((_, _, true, _)), None) => Some((slot, cas, false, 0)),
                (Some((_, _, true, exp)), Some(e)) if e < exp => Some((slot, cas, true, e)),
                (b, _) => b,
            };
        }
        match best {
            Some((slot, cas, _, _)) => Scan::Take { slot, cas },
            None => Scan::Unavailable,
        }
    }

    /// What this gateway knows of `key`, without claiming it: `Some` with
    /// [`LocalClaim::InFlight`] or [`LocalClaim::Completed`] when it is live here.
    pub(crate) fn lookup(&self, key: &str, now_ms: u64) -> Option<LocalClaim> {
        match self.scan(key, None, now_ms) {
            Scan::Live(found) => Some(found),
            Scan::Take { .. } | Scan::Unavailable => None,
        }
    }

    /// Looks `key` up among its slots and, when it is not live there, claims a slot for it.
    /// `fingerprint` (idempotency mode): the claimant's request fingerprint, kept in the
    /// entry and compared with an in-flight holder's.
    pub(crate) fn claim(
        &self,
        key: &str,
        owner: u64,
        fingerprint: Option<&str>,
        now_ms: u64,
        lease_ms: u64,
    ) -> LocalClaim {
        for _ in 0..ROUNDS {
            let (slot, cas) = match self.scan(key, fingerprint, now_ms) {
                Scan::Live(found) => return found,
                Scan::Unavailable => return LocalClaim::Unavailable,
                Scan::Take { slot, cas } => (slot, cas),
            };
            let entry = Entry {
                state: State::InFlight,
                key: key.as_bytes(),
                owner,
                expires_ms: now_ms.saturating_add(lease_ms),
                fingerprint: fingerprint.map(str::as_bytes),
                completed: None,
            };
            match self.store.set(
                &slot_key(slot),
                &encode(&entry),
                Some(cas.unwrap_or(INSERT_CAS)),
            ) {
                Ok(true) => return LocalClaim::Claimed(Hold { slot, owner }),
                Ok(false) => continue,
                Err(HostError) => return LocalClaim::Unavailable,
            }
        }
        LocalClaim::Unavailable
    }

    /// Gives the slot back: free, or holding `completed` until `expires_ms`. Does nothing when
    /// the slot is no longer ours (our entry expired and was reused). Returns whether it wrote.
    pub(crate) fn release(
        &self,
        hold: Hold,
        key: &str,
        completed: Option<(LocalResponse, u64)>,
    ) -> bool {
        if let Some((done, _)) = &completed
            && done.body.len() > self.config.max_response_bytes
        {
            return self.release(hold, key, None);
        }
        let entry = match completed {
            Some((done, expires_ms)) => Entry {
                state: State::Completed,
                key: key.as_bytes(),
                owner: hold.owner,
                expires_ms,
                fingerprint: None,
                completed: Some(done),
            },
            None => Entry {
                state: State::Free,
                key: b"",
                owner: 0,
                expires_ms: 0,
                fingerprint: None,
                completed: None,
            },
        };
        self.replace_held(hold, key, &encode(&entry))
    }

    /// Moves the expiry of our in-flight entry to `expires_ms` (the sidecar renewed the
    /// lease), so a call longer than one lease is not taken for abandoned on this gateway.
    /// Returns whether it wrote.
    pub(crate) fn extend(
        &self,
        hold: Hold,
        key: &str,
        fingerprint: Option<&str>,
        expires_ms: u64,
    ) -> bool {
        let entry = Entry {
            state: State::InFlight,
            key: key.as_bytes(),
            owner: hold.owner,
            expires_ms,
            fingerprint: fingerprint.map(str::as_bytes),
            completed: None,
        };
        self.replace_held(hold, key, &encode(&entry))
    }

    /// Writes `bytes` over the slot with CAS, only while it still holds our in-flight entry.
    fn replace_held(&self, hold: Hold, key: &str, bytes: &[u8]) -> bool {
        let slot = slot_key(hold.slot);
        for _ in 0..ROUNDS {
            let Ok(Some((current, cas))) = self.store.get(&slot) else {
                return false;
            };
            match decode(&current) {
                Some(e)
                    if same_key(e.key, key.as_bytes())
                        && e.owner == hold.owner
                        && e.state == State::InFlight => {}
                _ => return false,
            }
            match self.store.set(&slot, bytes, Some(cas)) {
                Ok(true) => return true,
                Ok(false) => continue,
                Err(HostError) => return false,
            }
        }
        false
    }
}

/// The bytes of an in-flight entry, for test doubles that play another worker.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn in_flight_bytes(key: &str, owner: u64, expires_ms: u64) -> Vec<u8> {
    encode(&Entry {
        state: State::InFlight,
        key: key.as_bytes(),
        owner,
        expires_ms,
        fingerprint: None,
        completed: None,
    })
}

/// Whether two requests' fingerprints show another request under the same key: only when
/// both are known (the sidecar's rule too).
fn differs(holder: Option<&[u8]>, claimant: Option<&str>) -> bool {
    matches!((holder, claimant), (Some(a), Some(b)) if !a.is_empty() && !same_key(a, b.as_bytes()))
}

// === entry codec: fixed header, then (completed only) the response ===

fn encode(e: &Entry<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(96 + e.completed.as_ref().map_or(0, |c| c.body.len()));
    out.extend_from_slice(MAGIC);
    out.push(e.state as u8);
    put_bytes(&mut out, e.key);
    out.extend_from_slice(&e.owner.to_le_bytes());
    out.extend_from_slice(&e.expires_ms.to_le_bytes());
    if let Some(fingerprint) = e.fingerprint {
        // Trailing, so an in-flight entry without it (an earlier version's) still decodes.
        put_bytes(&mut out, fingerprint);
    }
    if let Some(c) = &e.completed {
        put_bytes(
            &mut out,
            c.fingerprint.as_deref().unwrap_or_default().as_bytes(),
        );
        out.extend_from_slice(&c.response.status.to_le_bytes());
        out.extend_from_slice(&(c.response.headers.len() as u32).to_le_bytes());
        for (name, value) in &c.response.headers {
            put_bytes(&mut out, name.as_bytes());
            put_bytes(&mut out, value.as_bytes());
        }
        put_bytes(&mut out, &c.body);
    }
    out
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }
    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn string(&mut self) -> Option<String> {
        core::str::from_utf8(self.bytes()?).ok().map(String::from)
    }
}

/// `None` for anything that is not an entry (another plugin's data, a torn format): such a
/// slot is treated as free and overwritten.
fn decode(bytes: &[u8]) -> Option<Entry<'_>> {
    let mut r = Reader(bytes);
    if r.take(3)? != MAGIC {
        return None;
    }
    let state = match r.array::<1>()? {
        [0] => State::Free,
        [1] => State::InFlight,
        [2] => State::Completed,
        _ => return None,
    };
    let key = r.bytes()?;
    let owner = r.u64()?;
    let expires_ms = r.u64()?;
    let completed = if state == State::Completed {
        let fingerprint = Some(r.string()?).filter(|f| !f.is_empty());
        let status = u16::from_le_bytes(r.array()?);
        let count = r.u32()?;
        let mut headers = Vec::new();
        for _ in 0..count {
            headers.push((r.string()?, r.string()?));
        }
        let body = r.bytes()?.to_vec();
        Some(LocalResponse {
            fingerprint,
            response: StoredResponse { status, headers },
            body,
        })
    } else {
        None
    };
    let fingerprint = match state {
        State::InFlight if !r.0.is_empty() => Some(r.bytes()?),
        _ => None,
    };
    Some(Entry {
        state,
        key,
        owner,
        expires_ms,
        fingerprint,
        completed,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::testing::MemStore;
    use alloc::vec;

    fn cfg(slots: u32, probes: u32) -> LocalConfig {
        LocalConfig {
            enabled: true,
            slots,
            probes,
            max_response_bytes: 1024,
            rate_slots: 1,
        }
    }

    fn key(n: u32) -> String {
        crate::hash::hex(&n.to_be_bytes()).repeat(8)
    }

    fn done(body: &[u8]) -> LocalResponse {
        LocalResponse {
            fingerprint: Some("f".into()),
            response: StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
            },
            body: body.to_vec(),
        }
    }

    /// The shared-data keys of both tables, as every version of the filter names them.
    #[test]
    fn slot_names_are_the_prefix_and_the_number() {
        assert_eq!(&*slot_key(0), "idemgate.v1.slot.0");
        assert_eq!(&*slot_key(u32::MAX), "idemgate.v1.slot.4294967295");
        assert_eq!(&*crate::rate::slot_key(17), "idemgate.v1.rate.17");
    }

    #[test]
    fn claim_duplicate_release_replay() {
        let store = MemStore::default();
        let c = cfg(64, 4);
        let t = Table {
            config: &c,
            store: &store,
        };
        let LocalClaim::Claimed(hold) = t.claim(&key(1), 7, None, 1_000, 500) else {
            panic!()
        };
        assert_eq!(
            t.claim(&key(1), 8, None, 1_100, 500),
            LocalClaim::InFlight {
                retry_after_ms: 400
            }
        );
        assert!(t.release(hold, &key(1), Some((done(b"{}"), 10_000))));
        assert_eq!(
            t.claim(&key(1), 9, None, 1_200, 500),
            LocalClaim::Completed(done(b"{}"))
        );
        // Expired completed entry: claimable again.
        assert!(matches!(
            t.claim(&key(1), 9, None, 10_000, 500),
            LocalClaim::Claimed(_)
        ));
    }

    #[test]
    fn expired_in_flight_is_reclaimed_and_stale_release_is_refused() {
        let store = MemStore::default();
        let c = cfg(64, 4);
        let t = Table {
            config: &c,
            store: &store,
        };
        let LocalClaim::Claimed(old) = t.claim(&key(1), 1, None, 0, 100) else {
            panic!()
        };
        let LocalClaim::Claimed(new) = t.claim(&key(1), 2, None, 200, 100) else {
            panic!()
        };
        assert_eq!(old.slot, new.slot);
        assert!(
            !t.release(old, &key(1), None),
            "the old owner must not free the new owner's slot"
        );
        assert_eq!(
            t.claim(&key(1), 3, None, 250, 100),
            LocalClaim::InFlight { retry_after_ms: 50 }
        );
        assert!(t.release(new, &key(1), None));
        assert!(matches!(
            t.claim(&key(1), 3, None, 250, 100),
            LocalClaim::Claimed(_)
        ));
    }

    #[test]
    fn renewal_extends_only_our_in_flight_entry() {
        let store = MemStore::default();
        let c = cfg(64, 4);
        let t = Table {
            config: &c,
            store: &store,
        };
        let LocalClaim::Claimed(hold) = t.claim(&key(1), 1, None, 0, 100) else {
            panic!()
        };
        assert!(t.extend(hold, &key(1), None, 250));
        assert_eq!(
            t.claim(&key(1), 2, None, 200, 100),
            LocalClaim::InFlight { retry_after_ms: 50 },
            "past the first lease the entry is still in flight"
        );
        assert!(
            !t.extend(Hold { owner: 9, ..hold }, &key(1), None, 1_000),
            "another owner cannot extend it"
        );
        assert!(t.release(hold, &key(1), None));
        assert!(
            !t.extend(hold, &key(1), None, 1_000),
            "a released entry stays free"
        );
        assert!(matches!(
            t.claim(&key(1), 3, None, 10, 100),
            LocalClaim::Claimed(_)
        ));
    }

    #[test]
    fn cas_lost_to_another_worker_sees_its_claim() {
        let store = MemStore::default();
        let c = cfg(64, 4);
        let t = Table {
            config: &c,
            store: &store,
        };
        // Another worker writes the same key right after our read of the first slot.
        store.interfere_once(key(1), 100);
        assert_eq!(
            t.claim(&key(1), 1, None, 0, 100),
            LocalClaim::InFlight {
                retry_after_ms: 100
            }
        );
    }

    #[test]
    fn full_of_in_flight_means_unavailable_and_completed_entries_are_evicted() {
        let store = MemStore::default();
        let c = cfg(2, 2);
        let t = Table {
            config: &c,
            store: &store,
        };
        let LocalClaim::Claimed(a) = t.claim(&key(1), 1, None, 0, 1_000) else {
            panic!()
        };
        let LocalClaim::Claimed(_) = t.claim(&key(2), 1, None, 0, 1_000) else {
            panic!()
        };
        assert_eq!(t.claim(&key(3), 1, None, 0, 1_000), LocalClaim::Unavailable);
        assert!(t.release(a, &key(1), Some((done(b"x"), 5_000))));
        assert!(matches!(
            t.claim(&key(3), 1, None, 0, 1_000),
            LocalClaim::Claimed(_)
        ));
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn table_stays_bounded_and_garbage_is_overwritten() {
        let store = MemStore::default();
        let c = cfg(128, 4);
        let t = Table {
            config: &c,
            store: &store,
        };
        store.set(&slot_key(0), b"not ours", None).unwrap();
        for n in 0..20_000u32 {
            if let LocalClaim::Claimed(h) = t.claim(&key(n), u64::from(n), None, u64::from(n), 10) {
                t.release(h, &key(n), Some((done(b"b"), u64::from(n) + 5)));
            }
        }
        assert!(store.len() <= 128);
    }

    #[test]
    fn oversized_bodies_are_not_kept() {
        let store = MemStore::default();
        let c = cfg(8, 2);
        let t = Table {
            config: &c,
            store: &store,
        };
        let LocalClaim::Claimed(h) = t.claim(&key(1), 1, None, 0, 100) else {
            panic!()
        };
        assert!(t.release(h, &key(1), Some((done(&[0; 2048]), 1_000))));
        assert!(matches!(
            t.claim(&key(1), 1, None, 1, 100),
            LocalClaim::Claimed(_)
        ));
    }

    #[test]
    fn codec_round_trips_and_rejects_truncation() {
        let key = key(5);
        let e = Entry {
            state: State::Completed,
            key: key.as_bytes(),
            owner: 3,
            expires_ms: 9,
            fingerprint: None,
            completed: Some(done(b"hi")),
        };
        let bytes = encode(&e);
        assert_eq!(decode(&bytes), Some(e));
        for n in 0..bytes.len() {
            assert_eq!(decode(&bytes[..n]), None);
        }
    }

    #[test]
    fn an_in_flight_entry_carries_its_holders_fingerprint() {
        let k = key(5);
        let e = Entry {
            state: State::InFlight,
            key: k.as_bytes(),
            owner: 3,
            expires_ms: 9,
            fingerprint: Some(b"fp-a"),
            completed: None,
        };
        let bytes = encode(&e);
        assert_eq!(decode(&bytes), Some(e.clone()));
        // An earlier version's in-flight entry ends at the expiry: read without one.
        let earlier = in_flight_bytes(&k, 3, 9);
        assert_eq!(
            decode(&earlier),
            Some(Entry {
                fingerprint: None,
                ..e
            })
        );
        for n in earlier.len() + 1..bytes.len() {
            assert_eq!(decode(&bytes[..n]), None);
        }
    }

    #[test]
    fn a_holder_with_another_fingerprint_is_a_mismatch() {
        let store = MemStore::default();
        let c = cfg(64, 4);
        let t = Table {
            config: &c,
            store: &store,
        };
        let LocalClaim::Claimed(hold) = t.claim(&key(1), 7, Some("fp-a"), 1_000, 500) else {
            panic!()
        };
        let in_flight = LocalClaim::InFlight {
            retry_after_ms: 400,
        };
        assert_eq!(
            t.claim(&key(1), 8, Some("fp-b"), 1_100, 500),
            LocalClaim::Mismatch
        );
        assert_eq!(t.claim(&key(1), 8, Some("fp-a"), 1_100, 500), in_flight);
        // No fingerprint on either side (lock mode): nothing to compare.
        assert_eq!(t.claim(&key(1), 8, None, 1_100, 500), in_flight);
        // A renewal keeps the holder's fingerprint.
        assert!(t.extend(hold, &key(1), Some("fp-a"), 2_000));
        assert_eq!(
            t.claim(&key(1), 8, Some("fp-b"), 1_100, 500),
            LocalClaim::Mismatch
        );
        // A lookup (no claimant) sees the key in flight.
        assert_eq!(
            t.lookup(&key(1), 1_100),
            Some(LocalClaim::InFlight {
                retry_after_ms: 900
            })
        );
        let b = t.claim(&key(2), 9, None, 1_000, 500);
        assert!(matches!(b, LocalClaim::Claimed(_)));
        assert_eq!(
            t.claim(&key(2), 8, Some("fp-b"), 1_100, 500),
            LocalClaim::InFlight {
                retry_after_ms: 400
            }
        );
    }
}
