//! Rate checks (`POST /v1/rate`) and the one GCRA step both ends compute with: the filter on
//! its shared-data tier, the sidecar's memory store; the Redis script is the same arithmetic
//! in Lua (and the sidecar's behavioural suite holds both stores to it).
//!
//! GCRA (the generic cell rate algorithm) keeps one number per limited key, the theoretical
//! arrival time (TAT) of the next request at the sustained rate. A request at `now` is let
//! through when `TAT + interval - interval × burst <= now`, and then moves the TAT one
//! interval on. Unlike fixed windows it never lets two bursts through at a window edge, and
//! its state expires by itself once the TAT is in the past.

use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

use crate::FieldError;

/// At most this many limits are checked per request (per scope, per key, both, ...).
pub const MAX_CHECKS: usize = 4;
/// The longest state a limit may keep (`interval × burst`): one day.
pub const MAX_WINDOW_US: u64 = 24 * 3_600 * 1_000_000;

/// One limit: `burst` requests at once, then one per `interval_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    pub interval_us: u64,
    pub burst: u32,
}

impl Rate {
    /// How long the full burst takes to come back: the longest a key's state lives.
    pub fn window_us(&self) -> u64 {
        self.interval_us.saturating_mul(u64::from(self.burst))
    }

    /// Whether the limit can be computed without overflow and keeps bounded state.
    pub fn check(&self) -> Result<(), FieldError> {
        if self.interval_us == 0 {
            return Err(FieldError {
                field: "interval_us",
                reason: "must be greater than zero",
                too_large: false,
            });
        }
        if self.burst == 0 {
            return Err(FieldError {
                field: "burst",
                reason: "must be greater than zero",
                too_large: false,
            });
        }
        if self.window_us() > MAX_WINDOW_US {
            return Err(FieldError {
                field: "burst",
                reason: "interval_us × burst must not exceed one day",
                too_large: false,
            });
        }
        Ok(())
    }
}

/// The result of one GCRA step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcraStep {
    pub allowed: bool,
    /// The state to keep (unchanged when limited).
    pub tat_us: u64,
    /// Requests still allowed right now after this one.
    pub remaining: u32,
    /// Limited: when this request would have been allowed.
    pub retry_after_us: u64,
    /// When the full burst is available again.
    pub reset_us: u64,
}

/// One GCRA step for a request at `now_us` against the state `tat_us` (0 = no state).
pub fn gcra(tat_us: u64, now_us: u64, rate: Rate) -> GcraStep {
    let interval = rate.interval_us.max(1);
    let tat = tat_us.max(now_us);
    let next = tat.saturating_add(interval);
    let allow_at = next.saturating_sub(rate.window_us());
    if now_us < allow_at {
        return GcraStep {
            allowed: false,
            tat_us: tat_us.max(now_us),
            remaining: 0,
            retry_after_us: allow_at - now_us,
            reset_us: tat - now_us,
        };
    }
    let room = now_us.saturating_add(rate.window_us()).saturating_sub(next);
    GcraStep {
        allowed: true,
        tat_us: next,
        remaining: u32::try_from(room / interval).unwrap_or(u32::MAX),
        retry_after_us: 0,
        reset_us: next - now_us,
    }
}

/// One limited key of a request: a hex SHA-256 the filter derived (never a raw identity).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateCheck {
    pub key: String,
    pub interval_us: u64,
    pub burst: u32,
}

impl RateCheck {
    pub fn rate(&self) -> Rate {
        Rate {
            interval_us: self.interval_us,
            burst: self.burst,
        }
    }
}

/// `POST /v1/rate`: the request's limits, checked in order; the first one over its limit
/// stops the check (those before it have counted the request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateRequest {
    pub checks: Vec<RateCheck>,
}

impl RateRequest {
    /// The shape both ends enforce: 1..=[`MAX_CHECKS`] checks, keys like every other key.
    pub fn validate(&self, max_key_len: usize) -> Result<(), FieldError> {
        if self.checks.is_empty() || self.checks.len() > MAX_CHECKS {
            return Err(FieldError {
                field: "checks",
                reason: "must hold 1 to 4 checks",
                too_large: self.checks.len() > MAX_CHECKS,
            });
        }
        for check in &self.checks {
            if check.key.is_empty() || check.key.len() > max_key_len {
                return Err(FieldError {
                    field: "key",
                    reason: "must be 1 to max_key_len bytes",
                    too_large: !check.key.is_empty(),
                });
            }
            check.rate().check()?;
        }
        Ok(())
    }
}

/// The result of one check, in request order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateResult {
    pub allowed: bool,
    pub remaining: u32,
    #[serde(default)]
    pub retry_after_ms: u64,
    #[serde(default)]
    pub reset_ms: u64,
}

impl RateResult {
    /// A GCRA step as the wire carries it (milliseconds, rounded up: never too early).
    pub fn of(step: &GcraStep) -> RateResult {
        RateResult {
            allowed: step.allowed,
            remaining: step.remaining,
            retry_after_ms: step.retry_after_us.div_ceil(1_000),
            reset_ms: step.reset_us.div_ceil(1_000),
        }
    }
}

/// The answer to a rate check (always HTTP 200): one result per check up to and including
/// the first limited one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateOutcome {
    pub results: Vec<RateResult>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEN_PER_SECOND_BURST_20: Rate = Rate {
        interval_us: 100_000,
        burst: 20,
    };

    #[test]
    fn a_full_burst_then_one_per_interval() {
        let rate = TEN_PER_SECOND_BURST_20;
        let now = 1_000_000_000;
        let mut tat = 0;
        for i in 0..20 {
            let step = gcra(tat, now, rate);
            assert!(step.allowed, "request {i} of the burst");
            assert_eq!(step.remaining, 19 - i);
            tat = step.tat_us;
        }
        let limited = gcra(tat, now, rate);
        assert!(!limited.allowed);
        assert_eq!(limited.tat_us, tat, "a limited request changes nothing");
        assert_eq!(limited.retry_after_us, 100_000);
        assert_eq!(limited.reset_us, 2_000_000);
        // Waiting exactly the retry-after lets one through, and only one.
        let later = now + limited.retry_after_us;
        let step = gcra(tat, later, rate);
        assert!(step.allowed);
        assert_eq!(step.remaining, 0);
        assert!(!gcra(step.tat_us, later, rate).allowed);
    }

    #[test]
    fn sustained_rate_never_exceeds_burst_plus_elapsed_intervals() {
        let rate = Rate {
            interval_us: 1_000,
            burst: 5,
        };
        let mut tat = 0;
        let mut allowed = 0u64;
        // One attempt every 100 µs for one second.
        for t in 0..10_000u64 {
            let step = gcra(tat, 5_000_000 + t * 100, rate);
            if step.allowed {
                allowed += 1;
                tat = step.tat_us;
            }
        }
        assert!((1_000..=1_005).contains(&allowed), "{allowed}");
    }

    #[test]
    fn idle_state_is_a_fresh_burst_and_limits_are_validated() {
        let rate = TEN_PER_SECOND_BURST_20;
        assert_eq!(gcra(5, 1_000_000, rate), gcra(0, 1_000_000, rate));
        assert!(
            Rate {
                interval_us: 0,
                burst: 1
            }
            .check()
            .is_err()
        );
        assert!(
            Rate {
                interval_us: MAX_WINDOW_US,
                burst: 2
            }
            .check()
            .is_err()
        );
        let request = RateRequest {
            checks: alloc::vec![RateCheck {
                key: "k".into(),
                interval_us: rate.interval_us,
                burst: rate.burst,
            }],
        };
        assert!(request.validate(128).is_ok());
        assert!(RateRequest { checks: Vec::new() }.validate(128).is_err());
        let frame = crate::encode(&request, &[]);
        let (back, _): (RateRequest, &[u8]) = crate::decode(&frame).unwrap();
        assert_eq!(back, request);
    }
}
