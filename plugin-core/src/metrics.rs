//! Metric names: the stable, documented interface (plugin/README.md); Envoy shows them
//! without a prefix of its own. Decisions report them through [`crate::Telemetry`].

use alloc::string::String;

/// Counters, one per decision and per noteworthy event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Requests that matched no rule.
    Pass,
    Granted,
    Replayed,
    /// 409 in-progress and 429 queue-full.
    Rejected,
    /// 503: a queued request waited its whole budget.
    WaitExpired,
    Queued,
    Mismatch,
    MissingKey,
    InvalidKey,
    /// 400: the path or the caller's identity reads two ways (encoded separator, repeated scope header).
    Ambiguous,
    Bypassed,
    TooLarge,
    FailedOpen,
    FailedClosed,
    FailedLocal,
    ShadowWouldBlock,
    LocalHits,
    LocalUnavailable,
    SidecarErrors,
    BreakerOpen,
    LeaseRenewals,
    LeaseLost,
    ReleaseRetries,
    ReleaseFailures,
    Abandoned,
    /// Clients gone after their request was forwarded, the key held until its lease ends
    /// (`on_client_abort: hold`).
    AbandonedUpstream,
    /// Queued places given up at the sidecar (`/v1/leave` answered released) because their
    /// client went away.
    QueueLeft,
    /// Sidecar grants held back because a request on this gateway still ran the key.
    LocalVetoes,
    RateAllowedLocal,
    RateLimitedLocal,
    RateAllowedGlobal,
    RateLimitedGlobal,
}

impl Counter {
    /// Its place in [`Counter::ALL`] (declaration order, which `ALL` keeps: tested), for
    /// metric ids kept in that order without searching the list on every count.
    pub fn index(self) -> usize {
        self as usize
    }

    pub const ALL: [Counter; 32] = [
        Counter::Pass,
        Counter::Granted,
        Counter::Replayed,
        Counter::Rejected,
        Counter::WaitExpired,
        Counter::Queued,
        Counter::Mismatch,
        Counter::MissingKey,
        Counter::InvalidKey,
        Counter::Ambiguous,
        Counter::Bypassed,
        Counter::TooLarge,
        Counter::FailedOpen,
        Counter::FailedClosed,
        Counter::FailedLocal,
        Counter::ShadowWouldBlock,
        Counter::LocalHits,
        Counter::LocalUnavailable,
        Counter::SidecarErrors,
        Counter::BreakerOpen,
        Counter::LeaseRenewals,
        Counter::LeaseLost,
        Counter::ReleaseRetries,
        Counter::ReleaseFailures,
        Counter::Abandoned,
        Counter::AbandonedUpstream,
        Counter::QueueLeft,
        Counter::LocalVetoes,
        Counter::RateAllowedLocal,
        Counter::RateLimitedLocal,
        Counter::RateAllowedGlobal,
        Counter::RateLimitedGlobal,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Counter::Pass => "idemgate.requests.pass",
            Counter::Granted => "idemgate.requests.granted",
            Counter::Replayed => "idemgate.requests.replayed",
            Counter::Rejected => "idemgate.requests.rejected",
            Counter::WaitExpired => "idemgate.requests.wait_expired",
            Counter::Queued => "idemgate.requests.queued",
            Counter::Mismatch => "idemgate.requests.mismatch",
            Counter::MissingKey => "idemgate.requests.missing_key",
            Counter::InvalidKey => "idemgate.requests.invalid_key",
            Counter::Ambiguous => "idemgate.requests.ambiguous",
            Counter::Bypassed => "idemgate.requests.bypassed",
            Counter::TooLarge => "idemgate.requests.too_large",
            Counter::FailedOpen => "idemgate.requests.failed_open",
            Counter::FailedClosed => "idemgate.requests.failed_closed",
            Counter::FailedLocal => "idemgate.requests.failed_local",
            Counter::ShadowWouldBlock => "idemgate.shadow.would_block",
            Counter::LocalHits => "idemgate.local.hits",
            Counter::LocalUnavailable => "idemgate.local.unavailable",
            Counter::SidecarErrors => "idemgate.sidecar.errors",
            Counter::BreakerOpen => "idemgate.sidecar.breaker_open",
            Counter::LeaseRenewals => "idemgate.lease.renewals",
            Counter::LeaseLost => "idemgate.lease.lost",
            Counter::ReleaseRetries => "idemgate.release.retries",
            Counter::ReleaseFailures => "idemgate.release.failures",
            Counter::Abandoned => "idemgate.requests.abandoned",
            Counter::AbandonedUpstream => "idemgate.requests.abandoned_upstream",
            Counter::QueueLeft => "idemgate.queue.left",
            Counter::LocalVetoes => "idemgate.local.vetoes",
            Counter::RateAllowedLocal => "idemgate.rate.local.allowed",
            Counter::RateLimitedLocal => "idemgate.rate.local.limited",
            Counter::RateAllowedGlobal => "idemgate.rate.global.allowed",
            Counter::RateLimitedGlobal => "idemgate.rate.global.limited",
        }
    }
}

impl Counter {
    /// The decision this counter records for one request (the per-rule counters and the access
    /// log name it); `None` for events that are not a request's decision. A request's decision
    /// is the last one counted: a queued claim counts `queued`, then `granted` or `replayed`.
    pub fn decision(self) -> Option<Decision> {
        Some(match self {
            Counter::Granted => Decision::Granted,
            Counter::Replayed => Decision::Replayed,
            Counter::Rejected => Decision::Rejected,
            Counter::WaitExpired => Decision::WaitExpired,
            Counter::Mismatch => Decision::Mismatch,
            Counter::MissingKey => Decision::MissingKey,
            Counter::InvalidKey => Decision::InvalidKey,
            Counter::Ambiguous => Decision::Ambiguous,
            Counter::Bypassed => Decision::Bypassed,
            Counter::TooLarge => Decision::TooLarge,
            Counter::FailedOpen => Decision::FailedOpen,
            Counter::FailedClosed => Decision::FailedClosed,
            Counter::FailedLocal => Decision::FailedLocal,
            Counter::RateLimitedLocal | Counter::RateLimitedGlobal => Decision::RateLimited,
            _ => return None,
        })
    }
}

/// What the filter decided for a request that matched a rule: counted per rule
/// (`idemgate.rule.<rule>.<decision>`) and shown in the access log (filter state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Granted,
    Replayed,
    /// 409 in-progress, 429 queue-full.
    Rejected,
    /// 503 after waiting the whole budget (at the sidecar, or here after a local veto).
    WaitExpired,
    Mismatch,
    MissingKey,
    InvalidKey,
    Ambiguous,
    Bypassed,
    TooLarge,
    FailedOpen,
    FailedClosed,
    FailedLocal,
    RateLimited,
}

impl Decision {
    /// Its place in [`Decision::ALL`] (declaration order, as for [`Counter::index`]).
    pub fn index(self) -> usize {
        self as usize
    }

    pub const ALL: [Decision; 14] = [
        Decision::Granted,
        Decision::Replayed,
        Decision::Rejected,
        Decision::WaitExpired,
        Decision::Mismatch,
        Decision::MissingKey,
        Decision::InvalidKey,
        Decision::Ambiguous,
        Decision::Bypassed,
        Decision::TooLarge,
        Decision::FailedOpen,
        Decision::FailedClosed,
        Decision::FailedLocal,
        Decision::RateLimited,
    ];

    /// Whether the request was answered locally (a shadow rule forwards it instead).
    pub fn blocks(self) -> bool {
        !matches!(
            self,
            Decision::Granted | Decision::Bypassed | Decision::FailedOpen | Decision::FailedLocal
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Decision::Granted => "granted",
            Decision::Replayed => "replayed",
            Decision::Rejected => "rejected",
            Decision::WaitExpired => "wait_expired",
            Decision::Mismatch => "mismatch",
            Decision::MissingKey => "missing_key",
            Decision::InvalidKey => "invalid_key",
            Decision::Ambiguous => "ambiguous",
            Decision::Bypassed => "bypassed",
            Decision::TooLarge => "too_large",
            Decision::FailedOpen => "failed_open",
            Decision::FailedClosed => "failed_closed",
            Decision::FailedLocal => "failed_local",
            Decision::RateLimited => "rate_limited",
        }
    }
}

/// What one step of a request reported, kept by the glue for the request's filter state: the
/// last decision counted and the time it waited in a queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Noted {
    pub decision: Option<Decision>,
    pub wait_ms: Option<u64>,
    /// Shadow mode forwarded the request although this decision would have answered it: the
    /// decision counted last before `ShadowWouldBlock` (which a flow counts once per request).
    pub would_block: Option<Decision>,
}

impl Noted {
    pub fn count(&mut self, counter: Counter) {
        if let Some(decision) = counter.decision() {
            self.decision = Some(decision);
        }
        if counter == Counter::ShadowWouldBlock && self.would_block.is_none() {
            self.would_block = self.decision;
        }
    }

    pub fn record(&mut self, histogram: Histogram, value: u64) {
        if histogram == Histogram::QueueWaitMs {
            self.wait_ms = Some(value);
        }
    }
}

/// A rule name as one segment of a stat name: `[A-Za-z0-9_-]` kept, anything else (the dots
/// and brackets of `rules[0]`, spaces) as `_`, so a stats tag regex can cut it out whole.
pub fn stat_segment(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '_' | '-' => c,
            _ => '_',
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Histogram {
    QueueWaitMs,
    SidecarLatencyMs,
}

impl Histogram {
    pub const ALL: [Histogram; 2] = [Histogram::QueueWaitMs, Histogram::SidecarLatencyMs];

    pub fn name(self) -> &'static str {
        match self {
            Histogram::QueueWaitMs => "idemgate.queue.wait_ms",
            Histogram::SidecarLatencyMs => "idemgate.sidecar.latency_ms",
        }
    }

    /// The last segment of its per-rule twin, `idemgate.rule.<rule>.<this>`.
    pub fn per_rule(self) -> &'static str {
        match self {
            Histogram::QueueWaitMs => "wait_ms",
            Histogram::SidecarLatencyMs => "sidecar_latency_ms",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_decisions_are_listed_in_declaration_order() {
        for (at, counter) in Counter::ALL.into_iter().enumerate() {
            assert_eq!(counter.index(), at, "{counter:?}");
        }
        for (at, decision) in Decision::ALL.into_iter().enumerate() {
            assert_eq!(decision.index(), at, "{decision:?}");
        }
    }

    #[test]
    fn every_decision_is_some_counters_and_the_last_one_counted_is_kept() {
        for decision in Decision::ALL {
            assert!(
                Counter::ALL.iter().any(|c| c.decision() == Some(decision)),
                "{decision:?}"
            );
        }
        let mut noted = Noted::default();
        noted.count(Counter::Queued);
        noted.record(Histogram::SidecarLatencyMs, 40);
        assert_eq!(noted, Noted::default());
        noted.count(Counter::LocalHits);
        noted.count(Counter::Rejected);
        noted.record(Histogram::QueueWaitMs, 12);
        noted.count(Counter::ShadowWouldBlock);
        // The reason stays the first one's, whatever is decided after it.
        noted.count(Counter::Granted);
        noted.count(Counter::ShadowWouldBlock);
        assert_eq!(
            noted,
            Noted {
                decision: Some(Decision::Granted),
                wait_ms: Some(12),
                would_block: Some(Decision::Rejected),
            }
        );
        assert_eq!(
            Counter::RateLimitedGlobal.decision(),
            Some(Decision::RateLimited)
        );
        assert_eq!(Counter::RateAllowedLocal.decision(), None);
    }

    #[test]
    fn rule_names_become_one_stat_segment() {
        assert_eq!(stat_segment("payments"), "payments");
        assert_eq!(stat_segment("rules[0]"), "rules_0_");
        assert_eq!(stat_segment("a.b c-d_e"), "a_b_c-d_e");
    }
}
