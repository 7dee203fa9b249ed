//! The per-VM circuit breaker in front of the sidecar: after `failures` consecutive failures
//! it opens for `cooldown`, so an outage does not cost every request a full timeout; then one
//! probe request is let through (half-open) and its outcome closes or re-opens it.

use crate::spec::BreakerConfig;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Breaker {
    consecutive: u32,
    /// 0 = closed; otherwise open until then, half-open after.
    open_until_ms: u64,
    probing: bool,
}

impl Breaker {
    /// Whether a callout may be made now.
    pub(crate) fn allow(&mut self, now_ms: u64) -> bool {
        if self.open_until_ms == 0 {
            return true;
        }
        if now_ms < self.open_until_ms || self.probing {
            return false;
        }
        self.probing = true;
        true
    }

    pub(crate) fn success(&mut self) {
        *self = Breaker::default();
    }

    pub(crate) fn failure(&mut self, config: &BreakerConfig, now_ms: u64) {
        self.consecutive = self.consecutive.saturating_add(1);
        if self.probing || self.consecutive >= config.failures {
            self.open_until_ms = now_ms.saturating_add(config.cooldown_ms).max(1);
            self.probing = false;
        }
    }

    pub fn is_open(&self, now_ms: u64) -> bool {
        self.open_until_ms != 0 && now_ms < self.open_until_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_and_probes_once() {
        let cfg = BreakerConfig {
            failures: 2,
            cooldown_ms: 100,
        };
        let mut b = Breaker::default();
        assert!(b.allow(0));
        b.failure(&cfg, 0);
        assert!(b.allow(1));
        b.success();
        b.failure(&cfg, 2);
        assert!(b.allow(3), "a success resets the count");
        b.failure(&cfg, 3);
        assert!(b.is_open(4));
        assert!(!b.allow(50));
        assert!(b.allow(103), "half-open: one probe");
        assert!(!b.allow(104), "only one probe at a time");
        b.failure(&cfg, 105);
        assert!(!b.allow(110), "a failed probe re-opens");
        assert!(b.allow(205));
        b.success();
        assert!(b.allow(206) && b.allow(207));
    }
}
