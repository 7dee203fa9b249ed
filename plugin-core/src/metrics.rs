//! Metric names: the stable, documented interface (plugin/README.md); Envoy shows them
//! without a prefix of its own. Decisions report them through [`crate::Telemetry`].

/// Counters, one per decision and per noteworthy event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Requests that matched no rule (flushed from a per-VM tally on the tick).
    Pass,
    Granted,
    Replayed,
    Rejected,
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
    pub const ALL: [Counter; 31] = [
        Counter::Pass,
        Counter::Granted,
        Counter::Replayed,
        Counter::Rejected,
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
}
