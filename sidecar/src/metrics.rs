//! Prometheus metrics of one sidecar instance (its own registry, so several in-process
//! sidecars in tests do not collide), rendered at `/metrics`.

use idemgate_wire::paths;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::time::Duration;

/// What a store call was made for: the protocol verbs, and the admin and readiness calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreVerb {
    Claim,
    Complete,
    Abort,
    Renew,
    Leave,
    Rate,
    Admin,
    Ready,
}

impl StoreVerb {
    const ALL: [StoreVerb; 8] = [
        StoreVerb::Claim,
        StoreVerb::Complete,
        StoreVerb::Abort,
        StoreVerb::Renew,
        StoreVerb::Leave,
        StoreVerb::Rate,
        StoreVerb::Admin,
        StoreVerb::Ready,
    ];

    fn label(self) -> &'static str {
        match self {
            StoreVerb::Claim => "claim",
            StoreVerb::Complete => "complete",
            StoreVerb::Abort => "abort",
            StoreVerb::Renew => "renew",
            StoreVerb::Leave => "leave",
            StoreVerb::Rate => "rate",
            StoreVerb::Admin => "admin",
            StoreVerb::Ready => "ready",
        }
    }
}

/// Label values known in advance, exported as zero from the start: a query or alert on a
/// counter that has not moved yet then finds a series instead of nothing.
const CLAIM_OUTCOMES: &[&str] = &[
    "granted",
    "completed",
    "mismatch",
    "busy",
    "queue_full",
    "left",
];
const STORE_ERROR_KINDS: &[&str] = &["transient", "permanent"];
const OWNER_OPS: &[&str] = &["complete", "abort", "renew"];
const LEAVE_OUTCOMES: &[&str] = &["released", "stale"];
const RATE_OUTCOMES: &[&str] = &["allowed", "limited"];
const CLOSE_REASONS: &[&str] = &["first_byte_timeout", "idle_timeout", "shutdown"];

pub(crate) struct Metrics {
    registry: Registry,
    /// Claim answers by outcome (granted, completed, mismatch, busy, queue_full).
    pub claims: IntCounterVec,
    /// Time claims spent queued, whatever the outcome.
    pub wait_seconds: Histogram,
    /// Waiters currently queued through this process.
    pub waiters: IntGauge,
    /// Position in the queue when a claim joined it (0 = next).
    pub queue_position: Histogram,
    /// From the store's grant (release of the previous holder) to the waiter's answer.
    pub handoff_seconds: Histogram,
    /// Leases that ran out without complete/abort (seen on the next claim of the key).
    pub lease_expiries: IntCounter,
    /// complete/abort/renew refused because the caller no longer owned the key.
    pub stale_owners: IntCounterVec,
    /// `/v1/leave` answers: `released` (the place was given up) or `stale` (no such place).
    pub leaves: IntCounterVec,
    /// Store errors by kind (transient, permanent).
    pub store_errors: IntCounterVec,
    /// Operator force-releases.
    pub force_releases: IntCounter,
    /// Client connections open now.
    pub connections: IntGauge,
    /// Connections the sidecar closed: `first_byte_timeout`, `idle_timeout`, `shutdown`.
    pub connections_closed: IntCounterVec,
    /// `/v1/rate` answers: `allowed` (under every limit) or `limited`.
    pub rate_decisions: IntCounterVec,
    /// Request latency by route and status.
    request_seconds: HistogramVec,
    /// `request_seconds` of the protocol routes answering 200 ([`PROTOCOL_ROUTES`] order),
    /// and `claims` by outcome ([`CLAIM_OUTCOMES`] order): the series every request touches,
    /// resolved once. A lookup by label values hashes them under a lock, ~600 instructions
    /// a time, three times per claim+complete pair (callgrind).
    request_ok: Vec<Histogram>,
    claim_outcomes: Vec<IntCounter>,
    /// One store call's latency, by the verb it served ([`StoreVerb`] order).
    store_seconds: Vec<Histogram>,
}

/// The protocol's routes: their 200 answers' latency is resolved in advance.
pub(crate) const PROTOCOL_ROUTES: [&str; 6] = [
    paths::CLAIM,
    paths::COMPLETE,
    paths::ABORT,
    paths::LEAVE,
    paths::RENEW,
    paths::RATE,
];

const NS: &str = "idemgate_sidecar";

/// Building a metric only fails for an invalid name or a duplicate registration: both are
/// programming errors caught by the unit test below, so this degrades to an unregistered
/// metric rather than a panic.
fn register<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, m: M) -> M {
    if let Err(err) = registry.register(Box::new(m.clone())) {
        tracing::error!(%err, "metric not registered");
    }
    m
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help).namespace(NS)
}

fn hist(name: &str, help: &str, buckets: Vec<f64>) -> HistogramOpts {
    HistogramOpts::new(name, help)
        .namespace(NS)
        .buckets(buckets)
}

const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

impl Metrics {
    pub(crate) fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let r = &registry;
        let claims = register(
            r,
            IntCounterVec::new(
                opts("claims_total", "Claim answers by outcome."),
                &["outcome"],
            )?,
        );
        let request_seconds = register(
            r,
            HistogramVec::new(
                hist(
                    "request_seconds",
                    "HTTP request latency.",
                    LATENCY_BUCKETS.to_vec(),
                ),
                &["route", "status"],
            )?,
        );
        Ok(Metrics {
            claim_outcomes: CLAIM_OUTCOMES
                .iter()
                .map(|outcome| claims.with_label_values(&[outcome]))
                .collect(),
            claims,
            request_ok: PROTOCOL_ROUTES
                .iter()
                .map(|route| request_seconds.with_label_values(&[route, "200"]))
                .collect(),
            request_seconds,
            wait_seconds: register(
                r,
                Histogram::with_opts(hist(
                    "wait_seconds",
                    "Time claims spent queued.",
                    LATENCY_BUCKETS.to_vec(),
                ))?,
            ),
            waiters: register(
                r,
                IntGauge::with_opts(opts("waiters", "Claims queued through this process."))?,
            ),
            queue_position: register(
                r,
                Histogram::with_opts(hist(
                    "queue_position",
                    "Queue position when a claim joined (0 = next).",
                    vec![
                        0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0,
                    ],
                ))?,
            ),
            handoff_seconds: register(
                r,
                Histogram::with_opts(hist(
                    "handoff_seconds",
                    "From the grant to a queued claim (at release) to its answer.",
                    LATENCY_BUCKETS.to_vec(),
                ))?,
            ),
            lease_expiries: register(
                r,
                IntCounter::with_opts(opts(
                    "lease_expiries_total",
                    "Leases that ran out without complete or abort.",
                ))?,
            ),
            stale_owners: register(
                r,
                IntCounterVec::new(
                    opts(
                        "stale_owners_total",
                        "Refused complete/abort/renew from non-owners.",
                    ),
                    &["op"],
                )?,
            ),
            leaves: register(
                r,
                IntCounterVec::new(
                    opts(
                        "leaves_total",
                        "Named queue places given up: released, or stale (no such place).",
                    ),
                    &["outcome"],
                )?,
            ),
            store_errors: register(
                r,
                IntCounterVec::new(
                    opts("store_errors_total", "Store errors by kind."),
                    &["kind"],
                )?,
            ),
            force_releases: register(
                r,
                IntCounter::with_opts(opts("force_releases_total", "Operator force-releases."))?,
            ),
            connections: register(
                r,
                IntGauge::with_opts(opts("connections", "Client connections open now."))?,
            ),
            connections_closed: register(
                r,
                IntCounterVec::new(
                    opts(
                        "connections_closed_total",
                        "Connections the sidecar closed, by reason.",
                    ),
                    &["reason"],
                )?,
            ),
            rate_decisions: register(
                r,
                IntCounterVec::new(
                    opts(
                        "rate_decisions_total",
                        "Rate checks answered: allowed (under every limit) or limited.",
                    ),
                    &["outcome"],
                )?,
            ),
            store_seconds: {
                let by_verb = register(
                    r,
                    HistogramVec::new(
                        hist(
                            "store_seconds",
                            "Latency of one store call (a Redis script or command), by the verb it served.",
                            LATENCY_BUCKETS.to_vec(),
                        ),
                        &["verb"],
                    )?,
                );
                StoreVerb::ALL
                    .iter()
                    .map(|verb| by_verb.with_label_values(&[verb.label()]))
                    .collect()
            },
            registry,
        })
        .map(|metrics| metrics.with_build_and_process_info())
    }

    /// Adds `idemgate_sidecar_build_info{version,git_sha} 1` and the standard `process_*`
    /// metrics (Linux), and exports every known label value of the counters as zero.
    fn with_build_and_process_info(self) -> Self {
        let r = &self.registry;
        if let Ok(info) = IntGaugeVec::new(
            opts(
                "build_info",
                "The running build: version and git commit (always 1).",
            ),
            &["version", "git_sha"],
        ) {
            register(r, info.clone())
                .with_label_values(&[env!("CARGO_PKG_VERSION"), env!("IDEMGATE_GIT_COMMIT")])
                .set(1);
        }
        #[cfg(target_os = "linux")]
        {
            let process = prometheus::process_collector::ProcessCollector::for_self();
            if let Err(err) = r.register(Box::new(process)) {
                tracing::error!(%err, "process metrics not registered");
            }
        }
        let known: [(&IntCounterVec, &[&str]); 6] = [
            (&self.claims, CLAIM_OUTCOMES),
            (&self.store_errors, STORE_ERROR_KINDS),
            (&self.stale_owners, OWNER_OPS),
            (&self.leaves, LEAVE_OUTCOMES),
            (&self.rate_decisions, RATE_OUTCOMES),
            (&self.connections_closed, CLOSE_REASONS),
        ];
        for (counter, labels) in known {
            for label in labels {
                counter.with_label_values(&[label]);
            }
        }
        self
    }

    /// Observes one request to `route` answered with `status` after `seconds`.
    pub(crate) fn observe_request(&self, route: &str, status: &str, seconds: f64) {
        let resolved = (status == "200")
            .then(|| PROTOCOL_ROUTES.iter().position(|r| *r == route))
            .flatten()
            .and_then(|i| self.request_ok.get(i));
        match resolved {
            Some(histogram) => histogram.observe(seconds),
            None => self
                .request_seconds
                .with_label_values(&[route, status])
                .observe(seconds),
        }
    }

    /// Counts one claim answered with `outcome` (one of [`CLAIM_OUTCOMES`]).
    pub(crate) fn count_claim(&self, outcome: &str) {
        let resolved = CLAIM_OUTCOMES
            .iter()
            .position(|o| *o == outcome)
            .and_then(|i| self.claim_outcomes.get(i));
        match resolved {
            Some(counter) => counter.inc(),
            None => self.claims.with_label_values(&[outcome]).inc(),
        }
    }

    /// Observes one store call made for `verb`.
    pub(crate) fn observe_store(&self, verb: StoreVerb, took: Duration) {
        let index = StoreVerb::ALL.iter().position(|v| *v == verb);
        if let Some(histogram) = index.and_then(|i| self.store_seconds.get(i)) {
            histogram.observe(took.as_secs_f64());
        }
    }

    /// The Prometheus text exposition.
    pub(crate) fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(err) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!(%err, "cannot encode metrics");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn build_process_and_store_metrics_are_exported() {
        let text = super::Metrics::new()
            .map(|m| {
                m.observe_store(super::StoreVerb::Rate, std::time::Duration::from_millis(3));
                m.render()
            })
            .unwrap_or_default();
        let build = format!(
            "idemgate_sidecar_build_info{{git_sha=\"{}\",version=\"{}\"}} 1",
            env!("IDEMGATE_GIT_COMMIT"),
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.contains(&build), "{text}");
        assert!(
            text.contains("idemgate_sidecar_store_seconds_count{verb=\"rate\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("idemgate_sidecar_store_errors_total{kind=\"permanent\"} 0"),
            "{text}"
        );
        #[cfg(target_os = "linux")]
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
        ] {
            assert!(text.contains(&format!("\n{name} ")), "{name}: {text}");
        }
    }

    /// The series resolved at start are the ones a lookup by label values finds: what the
    /// resolved handles count shows under their labels, beside the series looked up then.
    #[test]
    fn resolved_series_count_under_their_labels() {
        let text = super::Metrics::new()
            .map(|m| {
                m.observe_request(idemgate_wire::paths::COMPLETE, "200", 0.001);
                m.observe_request(idemgate_wire::paths::COMPLETE, "200", 0.002);
                m.observe_request(idemgate_wire::paths::COMPLETE, "409", 0.001);
                m.observe_request("/healthz", "200", 0.001);
                m.count_claim("granted");
                m.count_claim("busy");
                m.count_claim("busy");
                m.render()
            })
            .unwrap_or_default();
        for line in [
            "idemgate_sidecar_request_seconds_count{route=\"/v1/complete\",status=\"200\"} 2",
            "idemgate_sidecar_request_seconds_count{route=\"/v1/complete\",status=\"409\"} 1",
            "idemgate_sidecar_request_seconds_count{route=\"/healthz\",status=\"200\"} 1",
            "idemgate_sidecar_request_seconds_count{route=\"/v1/claim\",status=\"200\"} 0",
            "idemgate_sidecar_claims_total{outcome=\"granted\"} 1",
            "idemgate_sidecar_claims_total{outcome=\"busy\"} 2",
            "idemgate_sidecar_claims_total{outcome=\"mismatch\"} 0",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
    }

    #[test]
    fn every_metric_registers() {
        let metrics = super::Metrics::new().map_err(|e| e.to_string());
        let text = metrics.map(|m| {
            m.claims.with_label_values(&["granted"]).inc();
            m.render()
        });
        assert!(
            text.as_ref()
                .is_ok_and(|t| t.contains("idemgate_sidecar_claims_total")),
            "{text:?}"
        );
    }
}
