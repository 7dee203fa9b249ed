//! Rate protection: per-rule limits on matched requests, per caller (scope), per resource key,
//! or both, with GCRA (`idemgate_wire::gcra`: a burst, then a sustained rate, no window edges).
//!
//! Two tiers, like dedupe. The **local tier** is a second bounded table in Envoy shared data
//! (`idemgate.v1.rate.<n>`, `local.rate_slots` keys, CAS): it answers without a network hop
//! and holds the limit across the workers of one gateway. The **global tier** is the
//! sidecar's `/v1/rate` (one atomic Redis script per limit), which holds it across gateways.
//! `local_then_global` asks the sidecar only when this gateway alone is still under the
//! limit: a gateway that is over it on its own is over it globally too.
//!
//! Over the limit → 429 problem+json with `Retry-After` and the `RateLimit-Policy` /
//! `RateLimit` fields of draft-ietf-httpapi-ratelimit-headers; under it, optionally the same
//! fields on the forwarded response.

use alloc::string::{String, ToString};
use alloc::vec::Vec;
use idemgate_wire::{GcraStep, Rate, RateResult, gcra};

use crate::hash::{DigestMemo, PartBytes, Parts as _, decimal, prefix_u32, same_key};
use crate::local::{INSERT_CAS, slot_name};
use crate::ports::{HostError, RequestView, SharedStore};
use crate::spec::{Limit, LimitBy, RateSpec, Rule};

/// One limit of one request: the limit, and the hashed key its state lives under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Check {
    pub(crate) limit: Limit,
    pub(crate) key: String,
}

/// The checks of a request: one per limit it has the parts for (a limit by key is skipped
/// when the request carries no key). Keys are hashes of rule, limit and parts, like dedupe
/// keys: raw identities never leave the filter.
pub(crate) fn checks(
    rule: &Rule,
    spec: &RateSpec,
    req: &dyn RequestView,
    key: Option<&[u8]>,
    memo: &mut DigestMemo,
) -> Vec<Check> {
    let mut out = Vec::with_capacity(spec.limits.len());
    for (i, limit) in spec.limits.iter().enumerate() {
        let by_key = matches!(limit.by, LimitBy::Key | LimitBy::ScopeAndKey);
        if by_key && key.is_none() {
            continue;
        }
        let mut h = PartBytes::new("idemgate/rate/v1", memo);
        h.part(rule.name.as_bytes());
        h.part(&(i as u64).to_be_bytes());
        h.part(limit.by.name().as_bytes());
        if matches!(limit.by, LimitBy::Scope | LimitBy::ScopeAndKey) {
            for name in &rule.scope.headers {
                h.optional(req.header(name).as_deref());
            }
            for path in &rule.scope.properties {
                h.optional(req.property(path).as_deref());
            }
        }
        if by_key {
            h.optional(key);
        }
        out.push(Check {
            limit: *limit,
            key: h.finish_hex(),
        });
    }
    out
}

/// The combined result of a request's checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// `(limit, result)` per check made, in order; a limited one is last.
    pub(crate) results: Vec<(Limit, RateResult)>,
}

impl Verdict {
    /// The first limited check's wait, if any check was over its limit.
    pub(crate) fn limited(&self) -> Option<u64> {
        self.results
            .iter()
            .find(|(_, r)| !r.allowed)
            .map(|(_, r)| r.retry_after_ms)
    }

    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers): each limit
    /// as a policy of `q = burst` units per `w` seconds (the time the burst takes to come
    /// back, so `q/w` is the sustained rate), with what remains and when (`t`: the wait
    /// when over the limit, else until the full burst is back).
    pub(crate) fn headers(&self) -> Vec<(String, String)> {
        if self.results.is_empty() {
            return Vec::new();
        }
        // Sized once and pushed a piece at a time: `format!` per field, or growing the
        // strings as they fill, cost a 429 several thousand instructions.
        let mut policy = String::with_capacity(40 * self.results.len());
        let mut current = String::with_capacity(40 * self.results.len());
        for (limit, result) in &self.results {
            let name = limit.by.name();
            let window_s = limit.rate.window_us().div_ceil(1_000_000).max(1);
            let wait_ms = if result.allowed {
                result.reset_ms
            } else {
                result.retry_after_ms
            };
            let burst = u64::from(limit.rate.burst);
            push_item(&mut policy, name, [("\";q=", burst), (";w=", window_s)]);
            let remaining = u64::from(result.remaining);
            let wait_s = wait_ms.div_ceil(1_000);
            push_item(&mut current, name, [("\";r=", remaining), (";t=", wait_s)]);
        }
        alloc::vec![
            ("ratelimit-policy".to_string(), policy),
            ("ratelimit".to_string(), current),
        ]
    }
}

/// One item of a `RateLimit` field, `"name";q=1;w=2`, after `, ` when it follows another.
fn push_item(field: &mut String, name: &str, params: [(&str, u64); 2]) {
    field.push_str(if field.is_empty() { "\"" } else { ", \"" });
    field.push_str(name);
    for (key, value) in params {
        field.push_str(key);
        field.push_str(decimal(value, &mut [0; 20]));
    }
}

/// The local tier: `slots` shared-data keys, each holding one limited key's GCRA state.
///
/// A key lives in slot `hash mod slots` or one of the next `probes - 1`. State whose TAT is
/// in the past equals no state, so such a slot is free; when every probed slot holds live
/// state of other keys, the one closest to expiring is taken over (that key then gets a
/// fresh burst: the table stays bounded and errs towards allowing). Every write is CAS: two
/// workers never both spend the same unit.
pub(crate) struct RateTable<'a> {
    pub(crate) slots: u32,
    pub(crate) probes: u32,
    pub(crate) store: &'a dyn SharedStore,
}

const MAGIC: &[u8; 3] = b"IR1";
/// CAS rounds before giving up; contention on one hot key is exactly what a limit sees.
const ROUNDS: u32 = 16;

pub(crate) fn slot_key(slot: u32) -> crate::local::SlotName {
    slot_name("idemgate.v1.rate.", slot)
}

impl RateTable<'_> {
    /// One GCRA step for `key` at `now_us`; `None` when shared data failed or CAS kept
    /// losing (the caller decides without the local tier).
    pub(crate) fn check(&self, key: &str, rate: Rate, now_us: u64) -> Option<GcraStep> {
        let slots = self.slots.max(1);
        let home = prefix_u32(key) % slots;
        for _ in 0..ROUNDS {
            // (slot, cas, state of this key, expiry of what it would evict)
            let mut mine: Option<(u32, Option<u32>, u64)> = None;
            let mut spare: Option<(u32, Option<u32>, u64)> = None;
            for p in 0..self.probes.clamp(1, slots) {
                let slot = ((u64::from(home) + u64::from(p)) % u64::from(slots)) as u32;
                let (bytes, cas) = match self.store.get(&slot_key(slot)) {
                    Err(HostError) => return None,
                    Ok(None) => (Vec::new(), None),
                    Ok(Some((bytes, cas))) => (bytes, Some(cas)),
                };
                let entry = decode(&bytes).filter(|(_, tat)| *tat > now_us);
                match entry {
                    Some((k, tat)) if same_key(k, key.as_bytes()) => {
                        mine = Some((slot, cas, tat));
                        break;
                    }
                    Some((_, tat)) => {
                        if spare.is_none_or(|(_, _, t)| t != 0 && tat < t) {
                            spare = Some((slot, cas, tat));
                        }
                    }
                    None => {
                        if spare.is_none_or(|(_, _, t)| t != 0) {
                            spare = Some((slot, cas, 0));
                        }
                    }
                }
            }
            let (slot, cas, tat) = match (mine, spare) {
                (Some(m), _) => m,
                (None, Some((slot, cas, _))) => (slot, cas, 0),
                (None, None) => return None,
            };
            let step = gcra(tat, now_us, rate);
            if !step.allowed {
                return Some(step);
            }
            match self.store.set(
                &slot_key(slot),
                &encode(key, step.tat_us),
                Some(cas.unwrap_or(INSERT_CAS)),
            ) {
                Ok(true) => return Some(step),
                Ok(false) => continue,
                Err(HostError) => return None,
            }
        }
        None
    }
}

fn encode(key: &str, tat_us: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAGIC.len() + 8 + key.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&tat_us.to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out
}

/// `None` for anything that is not a rate entry (such a slot is free and overwritten).
fn decode(bytes: &[u8]) -> Option<(&[u8], u64)> {
    let rest = bytes.strip_prefix(MAGIC)?;
    let (tat, key) = rest.split_at_checked(8)?;
    let tat = u64::from_le_bytes(tat.try_into().ok()?);
    Some((key, tat))
}

/// Runs `checks` against the local table; stops at the first limited one. `None` when the
/// table could not decide (shared data failing).
pub(crate) fn check_local(table: &RateTable<'_>, checks: &[Check], now_us: u64) -> Option<Verdict> {
    let mut results = Vec::with_capacity(checks.len());
    for check in checks {
        let step = table.check(&check.key, check.limit.rate, now_us)?;
        results.push((check.limit, RateResult::of(&step)));
        if !step.allowed {
            break;
        }
    }
    Some(Verdict { results })
}

/// Pairs the sidecar's results with the checks sent; `None` if the answer cannot be theirs
/// (more results than checks, or results after a limited one).
pub(crate) fn global_verdict(checks: &[Check], results: &[RateResult]) -> Option<Verdict> {
    if results.is_empty() || results.len() > checks.len() {
        return None;
    }
    let (last, before) = results.split_last()?;
    if before.iter().any(|r| !r.allowed) || (results.len() < checks.len() && last.allowed) {
        return None;
    }
    Some(Verdict {
        results: checks
            .iter()
            .zip(results)
            .map(|(c, r)| (c.limit, *r))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Tier;
    use crate::testing::{MemStore, Req};

    const RATE: Rate = Rate {
        interval_us: 100_000,
        burst: 3,
    };

    fn spec(limits: &[LimitBy]) -> RateSpec {
        RateSpec {
            limits: limits.iter().map(|&by| Limit { by, rate: RATE }).collect(),
            tier: Tier::Local,
            expose: true,
            shadow: false,
        }
    }

    fn key(n: u32) -> String {
        crate::hash::hex(&n.to_be_bytes()).repeat(8)
    }

    #[test]
    fn local_table_holds_the_burst_and_refills() {
        let store = MemStore::default();
        let table = RateTable {
            slots: 16,
            probes: 4,
            store: &store,
        };
        let now = 1_000_000_000;
        for remaining in [2, 1, 0] {
            let step = table.check(&key(1), RATE, now).unwrap();
            assert!(step.allowed);
            assert_eq!(step.remaining, remaining);
        }
        let limited = table.check(&key(1), RATE, now).unwrap();
        assert!(!limited.allowed);
        assert_eq!(limited.retry_after_us, 100_000);
        assert!(table.check(&key(2), RATE, now).unwrap().allowed, "per key");
        assert!(table.check(&key(1), RATE, now + 100_000).unwrap().allowed);
        assert!(!table.check(&key(1), RATE, now + 100_000).unwrap().allowed);
    }

    #[test]
    fn table_stays_bounded_expired_slots_are_reused_and_live_ones_taken_over() {
        let store = MemStore::default();
        let table = RateTable {
            slots: 8,
            probes: 2,
            store: &store,
        };
        for n in 0..1_000 {
            table
                .check(&key(n), RATE, 1_000_000 + u64::from(n))
                .unwrap();
        }
        assert!(store.len() <= 8);
        // Garbage in a slot is overwritten, never trusted.
        store.set(&slot_key(0), b"junk", None).unwrap();
        assert!(table.check(&key(0), RATE, 5_000_000).unwrap().allowed);
    }

    #[test]
    fn cas_lost_to_another_worker_is_retried_on_fresh_state() {
        let store = MemStore::default();
        let table = RateTable {
            slots: 4,
            probes: 1,
            store: &store,
        };
        let now = 10_000_000;
        // Another worker spent two units between our read and our write.
        store.interfere_raw_once(
            slot_key(table_home(&key(7), 4)).to_string(),
            encode(&key(7), now + 200_000),
        );
        let step = table.check(&key(7), RATE, now).unwrap();
        assert!(step.allowed);
        assert_eq!(
            step.remaining, 0,
            "our unit came after the other worker's two"
        );
    }

    fn table_home(key: &str, slots: u32) -> u32 {
        u32::from_str_radix(&key[..8], 16).unwrap() % slots
    }

    #[test]
    fn host_errors_leave_the_decision_to_the_caller() {
        let store = MemStore::default();
        store.fail.set(true);
        let table = RateTable {
            slots: 4,
            probes: 1,
            store: &store,
        };
        assert_eq!(table.check(&key(1), RATE, 0), None);
    }

    #[test]
    fn checks_hash_the_parts_each_limit_counts_by() {
        let rule = crate::config::parse(
            br#"{"sidecar":{"cluster":"s"},"rules":[{"scope":{"headers":["x-user"]}}]}"#,
        )
        .unwrap()
        .rules
        .remove(0);
        let s = spec(&[LimitBy::Scope, LimitBy::Key, LimitBy::ScopeAndKey]);
        let mut memo = DigestMemo::new();
        let alice = Req::new("POST", "/").with("x-user", "alice");
        let bob = Req::new("POST", "/").with("x-user", "bob");
        let a1 = checks(&rule, &s, &alice, Some(b"k1"), &mut memo);
        let a2 = checks(&rule, &s, &alice, Some(b"k2"), &mut memo);
        let b1 = checks(&rule, &s, &bob, Some(b"k1"), &mut memo);
        assert_eq!(a1.len(), 3);
        assert_eq!(a1[0].key, a2[0].key, "per scope: same caller, any key");
        assert_ne!(a1[0].key, b1[0].key);
        assert_eq!(a1[1].key, b1[1].key, "per key: any caller");
        assert_ne!(a1[1].key, a2[1].key);
        assert_ne!(a1[2].key, b1[2].key);
        assert_ne!(a1[2].key, a2[2].key);
        let keyless = checks(&rule, &s, &alice, None, &mut memo);
        assert_eq!(keyless.len(), 1, "limits by key need a key");
        assert_eq!(keyless[0], a1[0]);
    }

    #[test]
    fn verdicts_and_headers() {
        let s = spec(&[LimitBy::Scope, LimitBy::Key]);
        let ok = RateResult {
            allowed: true,
            remaining: 2,
            retry_after_ms: 0,
            reset_ms: 100,
        };
        let over = RateResult {
            allowed: false,
            remaining: 0,
            retry_after_ms: 1_500,
            reset_ms: 300,
        };
        let checks = [
            Check {
                limit: s.limits[0],
                key: "a".into(),
            },
            Check {
                limit: s.limits[1],
                key: "b".into(),
            },
        ];
        let v = global_verdict(&checks, &[ok, over]).unwrap();
        assert_eq!(v.limited(), Some(1_500));
        assert_eq!(
            v.headers(),
            alloc::vec![
                (
                    "ratelimit-policy".to_string(),
                    "\"scope\";q=3;w=1, \"key\";q=3;w=1".to_string()
                ),
                (
                    "ratelimit".to_string(),
                    "\"scope\";r=2;t=1, \"key\";r=0;t=2".to_string()
                ),
            ]
        );
        assert_eq!(global_verdict(&checks, &[ok, ok]).unwrap().limited(), None);
        assert_eq!(
            global_verdict(&checks, &[ok]),
            None,
            "an allowed answer covers all"
        );
        assert_eq!(global_verdict(&checks, &[over, ok]), None);
        assert_eq!(global_verdict(&checks, &[]), None);
        assert_eq!(global_verdict(&checks, &[ok, ok, ok]), None);
    }
}
