//! The per-request decision state machine. The glue feeds it the stream's events (request
//! headers, body, the sidecar's answers, response headers/body, the stream's end) and carries
//! out the [`Action`] it returns; every decision — the local tier, the sidecar claim, failure
//! modes, shadow mode, what to store and what to release — is made here, natively testable.
//!
//! A request moves through [`Phase`]s, each carrying what is valid while it lasts (the body
//! being hashed, the rate checks or claim out at the sidecar, the grant, the response being
//! copied). Across phases the flow keeps the rule it matched, its stored key and fingerprint,
//! and this gateway's slot for the key.
//!
//! Releases ([`Flow::take_release`]) and renewals ([`Flow::renewal_due`]) are callouts the root
//! context dispatches, because the SDK drops answers addressed to a stream that has ended.

use alloc::string::{String, ToString};
use alloc::sync::Arc;
use alloc::vec;
use alloc::vec::Vec;
use core::mem;
use idemgate_wire::{
    AbortRequest, ClaimOutcome, ClaimRequest, CompleteRequest, LeaveRequest, Limits, Mode,
    OwnerOutcome, RateCheck, RateOutcome, RateRequest, RenewRequest, StoredResponse, paths,
};

use crate::capture::{Capture, Outcome};
use crate::fingerprint::Fingerprint;
use crate::hash::{PartHasher, Parts as _};
use crate::key::{self, KeyError};
use crate::local::{Hold, LocalClaim, LocalResponse, Table};
use crate::metrics::{Counter, Histogram};
use crate::ports::{Env, RequestView, Telemetry};
use crate::problem::{self, Refusal, Reply};
use crate::rate::{self, Check, RateTable, Verdict};
use crate::rule::{Matched, RequestHead, match_rule};
use crate::spec::{ClientAbort, Config, Conflict, FailureMode, KeySource, RateSpec, Rule};
use crate::trace::TraceContext;

/// A sidecar request for the root context to dispatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout {
    pub path: &'static str,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

/// What the glue does with the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Let the request go upstream after adding these request headers.
    Continue(Vec<(String, String)>),
    /// Keep the request paused (body being hashed).
    Pause,
    /// Keep the request paused while it waits on this gateway's shared data for another
    /// request here to end ([`Flow::waits_locally`]): the glue polls it with
    /// [`Flow::on_local_wait_tick`] on a short tick until it ends.
    Wait,
    /// Keep the request paused while the sidecar decides on it — its rate limits, or its
    /// key's claim — and dispatch this callout; the answer goes to [`Flow::on_decision`].
    Decide(Callout),
    /// Answer locally instead.
    Respond(Reply),
}

impl Action {
    pub fn pass() -> Action {
        Action::Continue(Vec::new())
    }
}

/// A sidecar answer as the glue received it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer<'a> {
    /// A complete HTTP response (Envoy turns timeouts and connect failures into 504/503).
    Http { status: u16, body: &'a [u8] },
    /// No response: reset, dispatch refused, or headers without a usable `:status`.
    Failed,
}

/// Where a request is, with what is valid there.
#[derive(Debug)]
enum Phase {
    /// Waiting for the whole body to fingerprint it; the sidecar's rate checks come after.
    Body {
        fingerprint: Fingerprint,
        /// The most Envoy has buffered so far.
        seen: usize,
        rate_checks: Vec<Check>,
    },
    /// Waiting for the whole body to read the key from it (`key.body_pointer`); then as at
    /// request headers with the key: rate limits, fingerprint, claim.
    BodyKey {
        /// What the matcher read at request headers.
        head: RequestHead,
        /// The most Envoy has buffered so far.
        seen: usize,
    },
    /// The rate checks are with the sidecar; the request is paused.
    Rating { sent_ms: u64, checks: Vec<Check> },
    /// The claim is with the sidecar; the request is paused.
    Claiming(Claim),
    /// The client went away while the claim was out: a late grant is released at once.
    Abandoned { sent_ms: u64 },
    /// Granted by the sidecar while another request on this gateway still runs the key (the
    /// sidecar lost that request's claim, e.g. Redis restarted empty): the request stays
    /// paused, with its grant, until the local holder ends or the wait budget does.
    LocalWait { grant: Grant, until_ms: u64 },
    /// A duplicate of a call another request on this gateway runs (idempotency mode, queue
    /// policy): it waits here for that call's outcome instead of at the sidecar, so a storm
    /// of duplicates costs the sidecar one waiter per gateway. Answered from the local entry
    /// once it is completed; when it is freed (the call aborted, or its response too big to
    /// keep here) one waiter takes the claim over; at `until_ms` it gets wait-expired.
    Parked { since_ms: u64, until_ms: u64 },
    /// Forwarded: the response is watched, the key released when it completes. No grant when
    /// forwarded by the failure mode or in shadow mode.
    Upstream {
        grant: Option<Grant>,
        /// From the response headers on.
        capture: Option<Capture>,
    },
    /// Answered locally or released: nothing left to do.
    Finished,
}

impl Phase {
    fn upstream() -> Phase {
        Phase::Upstream {
            grant: None,
            capture: None,
        }
    }
}

/// A claim out at the sidecar.
#[derive(Debug)]
struct Claim {
    sent_ms: u64,
    /// The name the queued claim gave its place at the sidecar (for a leave).
    waiter: Option<String>,
    /// When a grant held back by this gateway ([`Phase::LocalWait`]) stops waiting: the
    /// claim's wait budget (0 when it does not queue).
    local_wait_until_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Grant {
    owner: String,
    fence: u64,
    renew_at_ms: u64,
    renewing: bool,
}

/// This gateway's slot for the key: taken at the claim, given back when the request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Local {
    /// Not held: the tier is off, or (queue policy) the slot is taken only when the request is
    /// let through — held while waiting, it would block the earlier waiter the sidecar grants.
    Off,
    /// Held until `expires_ms` (renewed with the lease).
    Held { hold: Hold, expires_ms: u64 },
    /// No slot could be taken (every probed one held by other keys): the sidecar decides.
    Unavailable,
}

/// A request that matched a rule, with the head the matcher read.
#[derive(Debug)]
pub struct Route {
    index: usize,
    rule: Arc<Rule>,
    head: RequestHead,
}

impl Route {
    /// Its rule's place in the configuration (per-rule metrics).
    pub fn rule_index(&self) -> usize {
        self.index
    }
}

/// One matched request's state, from request headers to release.
#[derive(Debug)]
pub struct Flow {
    /// The rule the request matched, held for the flow's whole life.
    rule: Arc<Rule>,
    /// Its place in the configuration (per-rule metrics).
    rule_index: usize,
    /// The stored key; empty until the key is read (from the body: [`Phase::BodyKey`]).
    key: String,
    /// Set once the fingerprint is complete (after [`Phase::Body`]).
    fingerprint: Option<String>,
    phase: Phase,
    local: Local,
    /// A release (complete/abort/leave) for the root to dispatch.
    release: Option<Callout>,
    /// `RateLimit` fields for the forwarded response (`rate.expose`).
    rate_headers: Vec<(String, String)>,
    /// A gRPC call: answered with gRPC statuses, its outcome its `grpc-status`.
    grpc: bool,
    /// What every callout of this request carries ([`Flow::trace`]).
    trace: TraceContext,
    /// Shadow mode already counted that it forwarded this request where a decision would
    /// have answered it ([`Flow::shadowed`]).
    would_block: bool,
}

impl Flow {
    /// The rule a request falls under; `None` = pass untouched. Kept apart from
    /// [`Flow::on_request_headers`] so the no-match path costs the `:method` read (and `:path`
    /// when a rule takes the method) and nothing else: no clock, no shared data, no metric.
    pub fn route(config: &Config, req: &dyn RequestView) -> Option<Route> {
        match_rule(config, req).map(|Matched { index, rule, head }| Route {
            index,
            rule: Arc::clone(rule),
            head,
        })
    }

    /// Request headers of a routed request. `None` = nothing to track (the action says what
    /// to do: pass an optional key's absence, or answer 400).
    pub fn on_request_headers(
        config: &Config,
        route: Route,
        req: &dyn RequestView,
        end_of_stream: bool,
        env: &mut Env<'_>,
    ) -> (Option<Flow>, Action) {
        let Route { index, rule, head } = route;
        let body_key = matches!(rule.key.source, KeySource::BodyPointer { .. }) && !end_of_stream;
        let mut flow = Flow {
            rule,
            rule_index: index,
            key: String::new(),
            fingerprint: None,
            phase: Phase::Finished,
            local: Local::Off,
            release: None,
            rate_headers: Vec::new(),
            grpc: head.grpc,
            trace: TraceContext::default(),
            would_block: false,
        };
        let action = if body_key {
            match key::check_request(&flow.rule, &head, req) {
                Ok(()) => {
                    flow.phase = Phase::BodyKey { head, seen: 0 };
                    Action::Pause
                }
                Err(e) => flow.keyed(config, &head, req, Err(e), None, env),
            }
        } else {
            let raw_key = key::extract(&flow.rule, &head, req);
            flow.keyed(
                config,
                &head,
                req,
                raw_key,
                end_of_stream.then_some(&[]),
                env,
            )
        };
        // Nothing to track without a key (passed, refused), unless it waits in the body.
        let tracked = !flow.key.is_empty() || flow.holds_request();
        // Only a flow that lives on makes callouts: one answered here (a local 409, 429 or
        // replay) does not read the four trace headers.
        if tracked && !flow.is_done() {
            flow.trace = TraceContext::read(req);
        }
        (tracked.then_some(flow), action)
    }

    /// Once the key is read (`raw_key`): the stored key, the local rate limits, the
    /// fingerprint (`body`: the whole body when it is already read), then the decision.
    fn keyed(
        &mut self,
        config: &Config,
        head: &RequestHead,
        req: &dyn RequestView,
        raw_key: Result<Option<Vec<u8>>, KeyError>,
        body: Option<&[u8]>,
        env: &mut Env<'_>,
    ) -> Action {
        let raw_key = match raw_key {
            Ok(Some(k)) => k,
            Ok(None) => {
                env.telemetry.count(Counter::Bypassed);
                return Action::pass();
            }
            Err(e) => {
                env.telemetry.count(match e {
                    KeyError::Missing => Counter::MissingKey,
                    KeyError::RepeatedScope | KeyError::EncodedSeparator => Counter::Ambiguous,
                    _ => Counter::InvalidKey,
                });
                return if self.rule.shadow {
                    self.shadowed(env);
                    Action::pass()
                } else {
                    Action::Respond(Refusal::of_key(e).reply(head.grpc))
                };
            }
        };
        let rule = Arc::clone(&self.rule);
        let rate_checks = rule
            .rate
            .as_ref()
            .map(|spec| rate::checks(&rule, spec, req, Some(&raw_key), env.digests))
            .unwrap_or_default();
        // The local tier's limits are checked before the key is hashed and the body buffered
        // or hashed: a limited request is answered at once and costs neither.
        let global_checks = match &rule.rate {
            Some(spec) if !rate_checks.is_empty() => {
                if spec.tier.local()
                    && let Some(limited) = self.rate_local(spec, &rate_checks, config, env)
                {
                    return limited;
                }
                if spec.tier.global() {
                    rate_checks
                } else {
                    Vec::new()
                }
            }
            _ => Vec::new(),
        };
        self.key = key::scoped(&rule, head, req, &raw_key, env.digests);
        if let Some(spec) = &rule.fingerprint {
            let fp = Fingerprint::start(spec, head, req);
            if spec.max_body == 0 {
                self.fingerprint = Some(fp.finish(None, env.digests));
            } else if let Some(body) = body {
                self.fingerprint = Some(fp.finish(Some(body), env.digests));
            } else {
                self.phase = Phase::Body {
                    fingerprint: fp,
                    seen: 0,
                    rate_checks: global_checks,
                };
                return Action::Pause;
            }
        }
        self.decide(config, global_checks, env)
    }

    /// A request body callback while the flow waits for the body (to fingerprint it, or to
    /// read the key from it). `buffered` is what Envoy has buffered so far; `read` returns
    /// the whole buffer (called at end of stream); `req` is the request's headers.
    pub fn on_request_body(
        &mut self,
        config: &Config,
        req: &dyn RequestView,
        buffered: usize,
        end_of_stream: bool,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
        env: &mut Env<'_>,
    ) -> Action {
        let held = self.holds_request();
        let seen = match &mut self.phase {
            Phase::Body { seen, .. } | Phase::BodyKey { seen, .. } => {
                *seen = buffered.max(*seen);
                *seen
            }
            // Body callbacks while a decision is out happen only with
            // allow_on_headers_stop_iteration; Continue here would release the held headers.
            _ if held => return Action::Pause,
            _ => return Action::pass(),
        };
        if seen > self.rule.body_cap() {
            env.telemetry.count(Counter::TooLarge);
            return self.refuse(config, env, Refusal::TooLarge);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = if seen == 0 {
            Some(Vec::new())
        } else {
            read(seen)
        };
        let Some(body) = body else {
            // Envoy did not hand the buffered body over: fingerprinting it is impossible, and
            // guessing would let a different body replay this one. Fail like a sidecar outage.
            return self.refuse(config, env, unavailable(config));
        };
        match mem::replace(&mut self.phase, Phase::Finished) {
            Phase::Body {
                fingerprint,
                rate_checks,
                ..
            } => {
                self.fingerprint = Some(fingerprint.finish(Some(&body), env.digests));
                self.decide(config, rate_checks, env)
            }
            Phase::BodyKey { head, .. } => {
                let raw_key = key::from_body(&self.rule, &body);
                self.keyed(config, &head, req, raw_key, Some(&body), env)
            }
            _ => Action::pass(),
        }
    }

    /// Whether the request is still held (body being hashed or a decision out): the glue
    /// then passes request body and trailer callbacks to [`Flow::on_request_body`].
    pub fn holds_request(&self) -> bool {
        matches!(
            self.phase,
            Phase::Body { .. }
                | Phase::BodyKey { .. }
                | Phase::Rating { .. }
                | Phase::Claiming(_)
                | Phase::Abandoned { .. }
                | Phase::LocalWait { .. }
                | Phase::Parked { .. }
        )
    }

    /// The sidecar's rate checks first (a limited request claims nothing), then the key.
    fn decide(&mut self, config: &Config, rate_checks: Vec<Check>, env: &mut Env<'_>) -> Action {
        if !rate_checks.is_empty() {
            let rule = Arc::clone(&self.rule);
            if let Some(spec) = &rule.rate
                && let Some(action) = self.rate_global(spec, rate_checks, config, env)
            {
                return action;
            }
        }
        self.claim(config, env)
    }

    /// The local tier, then the claim at the sidecar.
    fn claim(&mut self, config: &Config, env: &mut Env<'_>) -> Action {
        self.claim_within(config, None, env)
    }

    /// [`Flow::claim`]; `until_ms`: the wait deadline of a parked request taking the claim
    /// over ([`Phase::Parked`]), whose sidecar wait is what is left of its budget.
    fn claim_within(
        &mut self,
        config: &Config,
        until_ms: Option<u64>,
        env: &mut Env<'_>,
    ) -> Action {
        let Rule {
            mode,
            conflict,
            lease_ms,
            ..
        } = *self.rule;
        let wait = match conflict {
            Conflict::Queue(mut policy) if !self.rule.shadow => {
                let spent = until_ms.map_or(0, |until| {
                    env.now_ms
                        .saturating_add(policy.budget_ms)
                        .saturating_sub(until)
                });
                policy.budget_ms = policy.budget_ms.saturating_sub(spent);
                policy.max_budget_ms = policy.max_budget_ms.saturating_sub(spent);
                Some(policy)
            }
            _ => None,
        };
        // Idempotency mode: every duplicate of a call gets its outcome, so duplicates here
        // wait for the request holding this gateway's slot (`Phase::Parked`) rather than
        // at the sidecar; the holder takes the slot at the claim, for one lease (a holder
        // still queued there after it lets the next duplicate here claim too, no more).
        // Lock mode takes the slot when let through: a queued lock holding it while it
        // waited would block the earlier waiter the sidecar grants.
        let coalesce = wait.filter(|_| mode == Mode::Idempotency);
        if config.local.enabled {
            let found = if wait.is_some() && coalesce.is_none() {
                Table {
                    config: &config.local,
                    store: env.shared,
                }
                .lookup(&self.key, env.now_ms)
            } else {
                Some(self.take_local(config, lease_ms, env))
            };
            match found {
                None | Some(LocalClaim::Claimed(_)) => {}
                Some(LocalClaim::InFlight { retry_after_ms }) => {
                    env.telemetry.count(Counter::LocalHits);
                    if conflict == Conflict::Reject {
                        env.telemetry.count(Counter::Rejected);
                        return self.refuse(config, env, Refusal::InProgress { retry_after_ms });
                    }
                    if let Some(policy) = coalesce {
                        self.phase = Phase::Parked {
                            since_ms: env.now_ms,
                            until_ms: until_ms
                                .unwrap_or(env.now_ms.saturating_add(policy.budget_ms)),
                        };
                        return Action::Wait;
                    }
                }
                Some(found @ (LocalClaim::Completed(_) | LocalClaim::Mismatch)) => {
                    return self.answer_known(config, found, env);
                }
                Some(LocalClaim::Unavailable) => {
                    env.telemetry.count(Counter::LocalUnavailable);
                    if config.failure_mode == FailureMode::Local {
                        // `local` promises that this gateway catches a duplicate while the
                        // sidecar is down; unrecorded here, this request could not be caught.
                        return self.refuse(config, env, unavailable(config));
                    }
                    self.local = Local::Unavailable;
                }
            }
        }
        if !env.breaker.allow(env.now_ms) {
            env.telemetry.count(Counter::BreakerOpen);
            return self.sidecar_failed(config, env);
        }
        let (waiter, local_wait_until_ms) = match wait {
            Some(policy) => (
                env.waiter_secret.map(|s| waiter_name(s, env.owner)),
                env.now_ms.saturating_add(policy.longest_budget()),
            ),
            None => (None, 0),
        };
        let request = ClaimRequest {
            key: self.key.clone(),
            mode,
            lease_ms,
            fingerprint: self.fingerprint.clone(),
            wait,
            waiter: waiter.clone(),
        };
        self.phase = Phase::Claiming(Claim {
            sent_ms: env.now_ms,
            waiter,
            local_wait_until_ms,
        });
        Action::Decide(Callout {
            path: paths::CLAIM,
            body: idemgate_wire::encode(&request, &[]),
            timeout_ms: config
                .sidecar
                .timeout_ms
                .saturating_add(wait.map_or(0, |w| w.longest_budget())),
        })
    }

    /// The sidecar's rate checks. `None`: not blocking (failure mode, shadow), the claim goes
    /// on; otherwise a 503, or the `/v1/rate` callout whose answer goes to
    /// [`Flow::on_decision`].
    fn rate_global(
        &mut self,
        spec: &RateSpec,
        checks: Vec<Check>,
        config: &Config,
        env: &mut Env<'_>,
    ) -> Option<Action> {
        if !env.breaker.allow(env.now_ms) {
            env.telemetry.count(Counter::BreakerOpen);
            return self.rate_failed(spec, &checks, config, env);
        }
        let request = RateRequest {
            checks: checks
                .iter()
                .map(|c| RateCheck {
                    key: c.key.clone(),
                    interval_us: c.limit.rate.interval_us,
                    burst: c.limit.rate.burst,
                })
                .collect(),
        };
        self.phase = Phase::Rating {
            sent_ms: env.now_ms,
            checks,
        };
        Some(Action::Decide(Callout {
            path: paths::RATE,
            body: idemgate_wire::encode(&request, &[]),
            timeout_ms: config.sidecar.timeout_ms,
        }))
    }

    /// The shared-data check: `Some` (429) when over a limit. Shared data failing leaves the
    /// decision to the sidecar (or, local tier only, lets the request through, counted).
    fn rate_local(
        &mut self,
        spec: &RateSpec,
        checks: &[Check],
        config: &Config,
        env: &mut Env<'_>,
    ) -> Option<Action> {
        let table = RateTable {
            slots: config.local.rate_slots,
            probes: config.local.probes,
            store: env.shared,
        };
        let now_us = env.now_ms.saturating_mul(1_000);
        let Some(verdict) = rate::check_local(&table, checks, now_us) else {
            env.telemetry.count(Counter::LocalUnavailable);
            return None;
        };
        self.rate_verdict(spec, &verdict, false, env)
    }

    /// Counts a verdict; `Some` (429) when it limits and the limit is enforced.
    fn rate_verdict(
        &mut self,
        spec: &RateSpec,
        verdict: &Verdict,
        global: bool,
        env: &mut Env<'_>,
    ) -> Option<Action> {
        let limited = verdict.limited();
        env.telemetry.count(match (limited.is_some(), global) {
            (false, false) => Counter::RateAllowedLocal,
            (false, true) => Counter::RateAllowedGlobal,
            (true, false) => Counter::RateLimitedLocal,
            (true, true) => Counter::RateLimitedGlobal,
        });
        // Per-rule figures count final decisions: a local allow is not final before the
        // sidecar's answer.
        if limited.is_some() || global || !spec.tier.global() {
            env.telemetry.count_rate(self.rule_index, limited.is_some());
        }
        let Some(retry_after_ms) = limited else {
            if spec.expose {
                self.rate_headers = verdict.headers();
            }
            return None;
        };
        if spec.shadow {
            self.shadowed(env);
            return None;
        }
        self.phase = Phase::Finished;
        let fields = verdict.headers();
        Some(Action::Respond(
            Refusal::RateLimited {
                retry_after_ms,
                fields,
            }
            .reply(self.grpc),
        ))
    }

    /// The sidecar could not check the limits: the rule's failure mode decides, as for claims.
    fn rate_failed(
        &mut self,
        spec: &RateSpec,
        checks: &[Check],
        config: &Config,
        env: &mut Env<'_>,
    ) -> Option<Action> {
        match config.failure_mode {
            FailureMode::Closed => {
                env.telemetry.count(Counter::FailedClosed);
                if spec.shadow {
                    self.shadowed(env);
                    None
                } else {
                    self.phase = Phase::Finished;
                    Some(Action::Respond(unavailable(config).reply(self.grpc)))
                }
            }
            FailureMode::Open => {
                env.telemetry.count(Counter::FailedOpen);
                None
            }
            // The local tier already spoke when it is part of the rule's tiers.
            FailureMode::Local if spec.tier.local() => {
                env.telemetry.count(Counter::FailedLocal);
                None
            }
            FailureMode::Local => {
                env.telemetry.count(Counter::FailedLocal);
                self.rate_local(spec, checks, config, env)
            }
        }
    }

    fn on_rate_answer(
        &mut self,
        config: &Config,
        sent_ms: u64,
        checks: Vec<Check>,
        answer: Answer<'_>,
        env: &mut Env<'_>,
    ) -> Action {
        env.telemetry.record(
            Histogram::SidecarLatencyMs,
            env.now_ms.saturating_sub(sent_ms),
        );
        let rule = Arc::clone(&self.rule);
        // Rating starts only under a rule with limits.
        let Some(spec) = &rule.rate else {
            return self.claim(config, env);
        };
        let verdict =
            parse_rate(answer).and_then(|outcome| rate::global_verdict(&checks, &outcome.results));
        let blocked = match verdict {
            Some(verdict) => {
                env.breaker.success();
                self.rate_verdict(spec, &verdict, true, env)
            }
            None => {
                env.telemetry.count(Counter::SidecarErrors);
                env.breaker.failure(&config.breaker, env.now_ms);
                self.rate_failed(spec, &checks, config, env)
            }
        };
        match blocked {
            Some(action) => action,
            None => self.claim(config, env),
        }
    }

    /// `RateLimit` fields for the forwarded response, once (`rate.expose`).
    pub fn take_response_headers(&mut self) -> Vec<(String, String)> {
        mem::take(&mut self.rate_headers)
    }

    /// The answer to an [`Action::Decide`] callout (delivered to the root, which applies the
    /// action to the stream if it is still there): the rate checks' or the claim's.
    pub fn on_decision(
        &mut self,
        config: &Config,
        answer: Answer<'_>,
        env: &mut Env<'_>,
    ) -> Action {
        let (sent_ms, claim) = match mem::replace(&mut self.phase, Phase::Finished) {
            Phase::Rating { sent_ms, checks } => {
                return self.on_rate_answer(config, sent_ms, checks, answer, env);
            }
            Phase::Claiming(claim) => (claim.sent_ms, Some(claim)),
            Phase::Abandoned { sent_ms } => (sent_ms, None),
            other => {
                self.phase = other;
                return Action::pass();
            }
        };
        env.telemetry.record(
            Histogram::SidecarLatencyMs,
            env.now_ms.saturating_sub(sent_ms),
        );
        let Some((outcome, payload)) = parse_claim(answer, &self.key) else {
            env.telemetry.count(Counter::SidecarErrors);
            env.breaker.failure(&config.breaker, env.now_ms);
            return match claim {
                Some(_) => self.sidecar_failed(config, env),
                // Abandoned: nothing to answer.
                None => Action::pass(),
            };
        };
        env.breaker.success();
        let waited_ms = match &outcome {
            ClaimOutcome::Granted { waited_ms, .. } | ClaimOutcome::Completed { waited_ms, .. } => {
                *waited_ms
            }
            _ => 0,
        };
        if waited_ms > 0 {
            note_queued(env, waited_ms);
        }
        let Some(claim) = claim else {
            // Abandoned: a grant goes back at once.
            if let ClaimOutcome::Granted { owner, .. } = outcome {
                self.release = Some(abort_callout(config, &self.key, owner));
            }
            return Action::pass();
        };
        match outcome {
            ClaimOutcome::Granted {
                owner,
                fence,
                lease_ms,
                ..
            } => {
                env.telemetry.count(Counter::Granted);
                let grant = Grant {
                    owner,
                    fence,
                    renew_at_ms: env.now_ms.saturating_add(lease_ms / 2),
                    renewing: false,
                };
                self.go_upstream_granted(config, grant, claim.local_wait_until_ms, false, env)
                    .unwrap_or(Action::Wait)
            }
            ClaimOutcome::Completed { response, .. } => {
                env.telemetry.count(Counter::Replayed);
                let reply = problem::replay(&response, payload, self.grpc);
                if !self.rule.shadow {
                    self.keep_locally(config, response, payload, env);
                }
                self.block(config, env, reply)
            }
            ClaimOutcome::Mismatch => self.refuse_mismatch(config, env),
            ClaimOutcome::Busy {
                retry_after_ms,
                waited: true,
                ..
            } => {
                // It waited from the claim on (the sidecar says no more than that it did).
                note_queued(env, env.now_ms.saturating_sub(sent_ms));
                env.telemetry.count(Counter::WaitExpired);
                self.refuse(config, env, Refusal::WaitExpired { retry_after_ms })
            }
            ClaimOutcome::Busy { retry_after_ms, .. } => {
                env.telemetry.count(Counter::Rejected);
                self.refuse(config, env, Refusal::InProgress { retry_after_ms })
            }
            ClaimOutcome::QueueFull { retry_after_ms, .. } => {
                env.telemetry.count(Counter::Rejected);
                self.refuse(config, env, Refusal::QueueFull { retry_after_ms })
            }
        }
    }

    /// The sidecar could not decide (unreachable, slow, garbage, breaker open).
    fn sidecar_failed(&mut self, config: &Config, env: &mut Env<'_>) -> Action {
        let degraded =
            |name: &str, value: &str| Action::Continue(vec![(name.to_string(), value.to_string())]);
        match config.failure_mode {
            FailureMode::Closed => {
                env.telemetry.count(Counter::FailedClosed);
                self.refuse(config, env, unavailable(config))
            }
            FailureMode::Open => {
                env.telemetry.count(Counter::FailedOpen);
                self.phase = Phase::upstream();
                degraded(&config.degraded_header, "open")
            }
            FailureMode::Local => {
                env.telemetry.count(Counter::FailedLocal);
                // Forwarded only while holding this gateway's slot: the only claim there is.
                match self.take_local_late(config, env) {
                    None => {
                        self.phase = Phase::upstream();
                        degraded(&config.degraded_header, "local")
                    }
                    Some(LocalClaim::InFlight { retry_after_ms }) => {
                        env.telemetry.count(Counter::Rejected);
                        self.refuse(config, env, Refusal::InProgress { retry_after_ms })
                    }
                    Some(found @ (LocalClaim::Completed(_) | LocalClaim::Mismatch)) => {
                        self.answer_known(config, found, env)
                    }
                    Some(LocalClaim::Claimed(_) | LocalClaim::Unavailable) => {
                        env.telemetry.count(Counter::LocalUnavailable);
                        self.refuse(config, env, unavailable(config))
                    }
                }
            }
        }
    }

    /// Shadow mode forwards a request the decision just counted would have answered: counted
    /// (`idemgate.shadow.would_block`, and logged by the glue) once per request, for the
    /// first such decision — the one an enforcing rule answers with; the later steps run only
    /// because shadow mode let the request go on (a shadow rate limit, then a duplicate).
    fn shadowed(&mut self, env: &mut Env<'_>) {
        if !mem::replace(&mut self.would_block, true) {
            env.telemetry.count(Counter::ShadowWouldBlock);
        }
    }

    /// Refuses the request — or, in shadow mode, only counts that it would have and forwards.
    fn refuse(&mut self, config: &Config, env: &mut Env<'_>, refusal: Refusal) -> Action {
        self.block(config, env, refusal.reply(self.grpc))
    }

    /// The key is reused for another request (its fingerprint differs): 422.
    fn refuse_mismatch(&mut self, config: &Config, env: &mut Env<'_>) -> Action {
        env.telemetry.count(Counter::Mismatch);
        self.refuse(config, env, Refusal::Mismatch)
    }

    /// Answers locally — or, in shadow mode, only counts that it would have and forwards.
    fn block(&mut self, config: &Config, env: &mut Env<'_>, reply: Reply) -> Action {
        if self.rule.shadow {
            self.shadowed(env);
            // Keep what this request holds: it goes upstream like any other.
            self.phase = Phase::upstream();
            return Action::pass();
        }
        self.release_local(config, env, None);
        self.phase = Phase::Finished;
        Action::Respond(reply)
    }

    /// The fingerprint this request's local entry carries while it runs: idempotency mode
    /// only, as the sidecar compares fingerprints only there.
    fn held_fingerprint(&self) -> Option<&str> {
        match self.rule.mode {
            Mode::Idempotency => self.fingerprint.as_deref(),
            Mode::Lock => None,
        }
    }

    /// Claims this gateway's slot; on success the request holds it (`Local::Held`).
    fn take_local(&mut self, config: &Config, lease_ms: u64, env: &mut Env<'_>) -> LocalClaim {
        let found = Table {
            config: &config.local,
            store: env.shared,
        }
        .claim(
            &self.key,
            env.owner,
            self.held_fingerprint(),
            env.now_ms,
            lease_ms,
        );
        if let LocalClaim::Claimed(hold) = found {
            self.local = Local::Held {
                hold,
                expires_ms: env.now_ms.saturating_add(lease_ms),
            };
        }
        found
    }

    /// Takes the local slot of a queued request about to be let through (held while it
    /// waited, it would have blocked the earlier waiters). `None`: it holds the slot now, or
    /// there is none to take (tier off, or no slot free and the sidecar decides); otherwise
    /// what stands in the way.
    fn take_local_late(&mut self, config: &Config, env: &mut Env<'_>) -> Option<LocalClaim> {
        if !config.local.enabled || self.local != Local::Off {
            return None;
        }
        match self.take_local(config, self.rule.lease_ms, env) {
            LocalClaim::Claimed(_) => None,
            found => Some(found),
        }
    }

    /// A completed local entry answers the request: its replay, or 422 for another request.
    /// What this gateway's slot says of the key, answered: a completed call's replay, or a
    /// 422 when the key's request (in flight or completed) differs from this one.
    fn answer_known(&mut self, config: &Config, found: LocalClaim, env: &mut Env<'_>) -> Action {
        match found {
            LocalClaim::Completed(done) => self.replay_local(config, &done, env),
            _ => {
                env.telemetry.count(Counter::LocalHits);
                self.refuse_mismatch(config, env)
            }
        }
    }

    fn replay_local(&mut self, config: &Config, done: &LocalResponse, env: &mut Env<'_>) -> Action {
        env.telemetry.count(Counter::LocalHits);
        if done.fingerprint != self.fingerprint {
            return self.refuse_mismatch(config, env);
        }
        env.telemetry.count(Counter::Replayed);
        self.block(
            config,
            env,
            problem::replay(&done.response, &done.body, self.grpc),
        )
    }

    /// The sidecar granted the key: forward with the fence once this gateway's slot is held.
    /// The local tier vetoes a grant for a key that another request here still runs (the
    /// sidecar lost that claim: Redis restarted empty): `None` = wait for it until `until_ms`
    /// ([`Phase::LocalWait`], retried by [`Flow::on_local_wait_tick`]; `retry` is such a
    /// retry, whose veto was counted when the wait began).
    fn go_upstream_granted(
        &mut self,
        config: &Config,
        grant: Grant,
        until_ms: u64,
        retry: bool,
        env: &mut Env<'_>,
    ) -> Option<Action> {
        let refusal = match self.take_local_late(config, env) {
            None | Some(LocalClaim::Claimed(_)) => {
                return Some(self.forward_granted(config, grant));
            }
            Some(found @ (LocalClaim::Completed(_) | LocalClaim::Mismatch)) => {
                // The call ran here (or another request under the key runs here) and the
                // sidecar forgot it: answer as this gateway knows, never run it again.
                let action = self.answer_known(config, found, env);
                self.settle_grant(config, grant);
                return Some(action);
            }
            Some(LocalClaim::Unavailable) => {
                env.telemetry.count(Counter::LocalUnavailable);
                if config.failure_mode != FailureMode::Local {
                    self.local = Local::Unavailable;
                    return Some(self.forward_granted(config, grant));
                }
                unavailable(config)
            }
            Some(LocalClaim::InFlight { retry_after_ms }) => {
                if !retry {
                    env.telemetry.count(Counter::LocalVetoes);
                }
                if self.rule.shadow {
                    // Granted at the sidecar, but in progress here: an enforcing rule holds
                    // the grant back (and a `reject` one refuses it), so that is the decision.
                    env.telemetry.count(Counter::Rejected);
                    self.shadowed(env);
                    return Some(self.forward_granted(config, grant));
                }
                // Only queued claims get here (`reject` holds the slot from the claim on).
                if env.now_ms < until_ms {
                    self.phase = Phase::LocalWait { grant, until_ms };
                    return None;
                }
                // Its wait here is not recorded (133 bytes of the module for a path that needs
                // the sidecar to have lost a claim): the sidecar's wait before the grant is.
                env.telemetry.count(Counter::WaitExpired);
                Refusal::WaitExpired { retry_after_ms }
            }
        };
        let action = self.refuse(config, env, refusal);
        self.settle_grant(config, grant);
        Some(action)
    }

    fn forward_granted(&mut self, config: &Config, grant: Grant) -> Action {
        let fence = grant.fence;
        self.phase = Phase::Upstream {
            grant: Some(grant),
            capture: None,
        };
        Action::Continue(vec![(config.fencing_header.clone(), fence.to_string())])
    }

    /// The grant of a request just answered locally is given back at the sidecar; in shadow
    /// mode the request went upstream instead, and keeps it.
    fn settle_grant(&mut self, config: &Config, grant: Grant) {
        match &mut self.phase {
            Phase::Upstream { grant: kept, .. } => *kept = Some(grant),
            _ => self.release = Some(abort_callout(config, &self.key, grant.owner)),
        }
    }

    /// Whether this request waits for another request on this gateway to end: granted and
    /// held back by a local veto (`Phase::LocalWait`), or a duplicate parked on the local
    /// tier (`Phase::Parked`). The glue polls it with [`Flow::on_local_wait_tick`].
    pub fn waits_locally(&self) -> bool {
        matches!(self.phase, Phase::LocalWait { .. } | Phase::Parked { .. })
    }

    /// The tick's retry of a local wait ([`Flow::waits_locally`]): `Some` once the wait ends —
    /// forward, answer locally (a vetoed grant is then aborted: [`Flow::take_release`]), or,
    /// a parked request taking the claim over, its claim. `seen` keeps what this tick read of
    /// each key, so a thousand parked duplicates of one call cost one shared-data read.
    pub fn on_local_wait_tick(
        &mut self,
        config: &Config,
        env: &mut Env<'_>,
        seen: &mut Lookups,
    ) -> Option<Action> {
        match mem::replace(&mut self.phase, Phase::Finished) {
            Phase::LocalWait { grant, until_ms } => {
                self.go_upstream_granted(config, grant, until_ms, true, env)
            }
            Phase::Parked { since_ms, until_ms } => {
                let found = seen.lookup(
                    &Table {
                        config: &config.local,
                        store: env.shared,
                    },
                    &self.key,
                    env.now_ms,
                );
                let retry_after_ms = match found {
                    Seen::Completed(done) => {
                        note_queued(env, env.now_ms.saturating_sub(since_ms));
                        return Some(self.replay_local(config, done, env));
                    }
                    Seen::InFlight { retry_after_ms } => retry_after_ms,
                    // Freed: the call aborted, or its response was not kept here.
                    Seen::Free if env.now_ms < until_ms => {
                        return match self.claim_within(config, Some(until_ms), env) {
                            // Another waiter took it first.
                            Action::Wait => None,
                            action => Some(action),
                        };
                    }
                    Seen::Free => 0,
                };
                if env.now_ms < until_ms {
                    self.phase = Phase::Parked { since_ms, until_ms };
                    return None;
                }
                // Decided as a sidecar wait that runs out is: queued, for this long.
                note_queued(env, env.now_ms.saturating_sub(since_ms));
                env.telemetry.count(Counter::WaitExpired);
                Some(self.refuse(config, env, Refusal::WaitExpired { retry_after_ms }))
            }
            other => {
                self.phase = other;
                None
            }
        }
    }

    fn release_local(
        &mut self,
        config: &Config,
        env: &mut Env<'_>,
        completed: Option<(LocalResponse, u64)>,
    ) {
        if let Local::Held { hold, .. } = self.local {
            self.local = Local::Off;
            Table {
                config: &config.local,
                store: env.shared,
            }
            .release(hold, &self.key, completed);
        }
    }

    /// A replay from the sidecar also fills this gateway's slot, so the next duplicate here
    /// is answered without a callout.
    fn keep_locally(
        &mut self,
        config: &Config,
        response: StoredResponse,
        body: &[u8],
        env: &mut Env<'_>,
    ) {
        let done = LocalResponse {
            fingerprint: self.fingerprint.clone(),
            response,
            body: body.to_vec(),
        };
        let expires_ms = env.now_ms.saturating_add(self.rule.retention_ms);
        self.release_local(config, env, Some((done, expires_ms)));
    }

    /// Whether the glue should read the response headers for [`Flow::on_response_headers`].
    pub fn watches_response(&self) -> bool {
        matches!(self.phase, Phase::Upstream { .. })
    }

    /// Response headers of a forwarded request (pseudo-headers included).
    pub fn on_response_headers(
        &mut self,
        config: &Config,
        headers: &[(String, Vec<u8>)],
        end_of_stream: bool,
        env: &mut Env<'_>,
    ) {
        let Phase::Upstream { capture, .. } = &mut self.phase else {
            return;
        };
        *capture = Some(Capture::begin(&self.rule.response, headers, self.grpc));
        if end_of_stream {
            self.finish(config, env);
        }
    }

    /// Whether the glue should read response body chunks.
    pub fn wants_response_body(&self) -> bool {
        matches!(&self.phase, Phase::Upstream { capture: Some(c), .. } if c.wants_body())
    }

    /// A response body chunk as it passes (`chunk` is empty when not wanted).
    pub fn on_response_body(
        &mut self,
        config: &Config,
        chunk: &[u8],
        end_of_stream: bool,
        env: &mut Env<'_>,
    ) {
        let Phase::Upstream { capture, .. } = &mut self.phase else {
            return;
        };
        if let Some(capture) = capture {
            capture.chunk(&self.rule.response, chunk);
        }
        if end_of_stream {
            self.finish(config, env);
        }
    }

    /// Whether this is a gRPC call, whose response trailers the glue reads for
    /// [`Flow::on_response_trailers`] (an HTTP response's trailers are not needed).
    pub fn is_grpc(&self) -> bool {
        self.grpc
    }

    /// Response trailers (read only for a gRPC call): the response is complete.
    pub fn on_response_trailers(
        &mut self,
        config: &Config,
        trailers: &[(String, Vec<u8>)],
        env: &mut Env<'_>,
    ) {
        if let Phase::Upstream {
            capture: Some(capture),
            ..
        } = &mut self.phase
        {
            capture.trailers(trailers);
        }
        self.finish(config, env);
    }

    /// The forwarded response went through completely: store it or abort, per policy.
    fn finish(&mut self, config: &Config, env: &mut Env<'_>) {
        let (grant, capture) = match mem::replace(&mut self.phase, Phase::Finished) {
            Phase::Upstream { grant, capture } => (grant, capture),
            other => {
                self.phase = other;
                return;
            }
        };
        let rule = &*self.rule;
        // Lock mode stores nothing: any end of the response releases the lock.
        let (stored, aborted) = match rule.mode {
            Mode::Lock => (None, false),
            Mode::Idempotency => match capture.map_or(Outcome::Abort, |c| c.finish(&rule.response))
            {
                Outcome::Store(response, body) => (Some((response, body)), false),
                Outcome::Abort => (None, true),
            },
        };
        let retention_ms = rule.retention_ms;
        let local_copy = stored.clone().map(|(response, body)| {
            let done = LocalResponse {
                fingerprint: self.fingerprint.clone(),
                response,
                body,
            };
            (done, env.now_ms.saturating_add(retention_ms))
        });
        self.release_local(config, env, local_copy);
        let Some(grant) = grant else {
            return;
        };
        if aborted {
            self.release = Some(abort_callout(config, &self.key, grant.owner));
            return;
        }
        let (response, body) = stored.map_or((None, Vec::new()), |(r, b)| (Some(r), b));
        let request = CompleteRequest {
            key: self.key.clone(),
            owner: grant.owner,
            retention_ms,
            response,
        };
        self.release = Some(Callout {
            path: paths::COMPLETE,
            body: idemgate_wire::encode(&request, &body),
            timeout_ms: config.sidecar.timeout_ms,
        });
    }

    /// The stream ended (`on_done`): whatever was not released is, now. Returns whether the
    /// flow must be kept for a claim answer still on its way.
    pub fn on_stream_end(&mut self, config: &Config, env: &mut Env<'_>) -> bool {
        match mem::replace(&mut self.phase, Phase::Finished) {
            Phase::Claiming(claim) => {
                env.telemetry.count(Counter::Abandoned);
                self.release_local(config, env, None);
                self.phase = Phase::Abandoned {
                    sent_ms: claim.sent_ms,
                };
                // The filter cannot cancel the claim's callout: a queued claim's place is given
                // up by name, or it would block the queue until its budget ran out. Best
                // effort (a late grant is still aborted), and not into an open breaker.
                if let Some(waiter) = claim.waiter
                    && !env.breaker.is_open(env.now_ms)
                {
                    self.release = Some(leave_callout(config, &self.key, waiter));
                }
                true
            }
            abandoned @ Phase::Abandoned { .. } => {
                self.phase = abandoned;
                true
            }
            Phase::LocalWait { grant, .. } => {
                // Granted but never forwarded: nothing ran, the key goes back at once.
                env.telemetry.count(Counter::Abandoned);
                self.release = Some(abort_callout(config, &self.key, grant.owner));
                false
            }
            // Nothing is held yet: the rate answer, when it comes, finds no flow.
            Phase::Rating { .. } => false,
            // Client abort or reset before the response completed: nothing to store.
            Phase::Upstream { grant, .. } => {
                match self.rule.client_abort {
                    ClientAbort::Release => {
                        self.release_local(config, env, None);
                        if let Some(grant) = grant {
                            self.release = Some(abort_callout(config, &self.key, grant.owner));
                        }
                    }
                    ClientAbort::Hold => {
                        // The backend may still be running the call (work it does not stop
                        // when the client goes away): releasing now would let a retry run
                        // beside it. Keep both tiers' claims and stop renewing (the flow is
                        // dropped): they end when their lease runs out.
                        env.telemetry.count(Counter::AbandonedUpstream);
                        self.local = Local::Off;
                    }
                }
                false
            }
            // Parked: nothing held here or at the sidecar.
            other @ (Phase::Body { .. }
            | Phase::BodyKey { .. }
            | Phase::Parked { .. }
            | Phase::Finished) => {
                self.phase = other;
                false
            }
        }
    }

    /// Nothing left to do on any later event: finished, holding no local slot and owing no
    /// release (a request answered locally, or forwarded untracked). The glue need not keep it.
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Finished)
            && !matches!(self.local, Local::Held { .. })
            && self.release.is_none()
    }

    /// The client went away while the claim was out: the claim's answer only releases.
    pub fn is_abandoned(&self) -> bool {
        matches!(self.phase, Phase::Abandoned { .. })
    }

    /// A release (complete/abort/leave) this flow produced, for the root to dispatch.
    pub fn take_release(&mut self) -> Option<Callout> {
        self.release.take()
    }

    /// The tick's lease work for a forwarded request, once half its lease has passed: a
    /// renewal callout for a sidecar grant; without one (forwarded by `failure_mode` `local`
    /// or `open`, or in shadow mode) this gateway's in-flight entry is the only protection
    /// left, so it is extended here directly, or a duplicate would pass after one lease.
    pub fn renewal_due(&mut self, config: &Config, env: &mut Env<'_>) -> Option<Callout> {
        let lease_ms = self.rule.lease_ms;
        let grant = match &mut self.phase {
            Phase::Upstream { grant, .. } => grant.as_mut(),
            Phase::LocalWait { grant, .. } => Some(grant),
            _ => return None,
        };
        let Some(grant) = grant else {
            self.renew_local(config, lease_ms, env);
            return None;
        };
        if grant.renewing || env.now_ms < grant.renew_at_ms {
            return None;
        }
        grant.renewing = true;
        let request = RenewRequest {
            key: self.key.clone(),
            owner: grant.owner.clone(),
            lease_ms,
        };
        Some(Callout {
            path: paths::RENEW,
            body: idemgate_wire::encode(&request, &[]),
            timeout_ms: config.sidecar.timeout_ms,
        })
    }

    fn renew_local(&mut self, config: &Config, lease_ms: u64, env: &mut Env<'_>) {
        let Local::Held { hold, expires_ms } = self.local else {
            return;
        };
        if env.now_ms.saturating_add(lease_ms / 2) < expires_ms {
            return;
        }
        if self.extend_local(config, hold, env.now_ms.saturating_add(lease_ms), env) {
            env.telemetry.count(Counter::LeaseRenewals);
        } else {
            // The entry expired and was reused (a tick came too late): nothing to keep.
            self.local = Local::Off;
            env.telemetry.count(Counter::LeaseLost);
        }
    }

    // Out of line: inlined into its two callers it cost the module ~250 bytes.
    #[inline(never)]
    fn extend_local(
        &mut self,
        config: &Config,
        hold: Hold,
        expires_ms: u64,
        env: &Env<'_>,
    ) -> bool {
        let extended = Table {
            config: &config.local,
            store: env.shared,
        }
        .extend(hold, &self.key, self.held_fingerprint(), expires_ms);
        if extended {
            self.local = Local::Held { hold, expires_ms };
        }
        extended
    }

    pub fn on_renew_answer(&mut self, config: &Config, answer: Answer<'_>, env: &mut Env<'_>) {
        let grant = match &mut self.phase {
            Phase::Upstream {
                grant: Some(grant), ..
            }
            | Phase::LocalWait { grant, .. } => grant,
            _ => return,
        };
        grant.renewing = false;
        match parse_owner(answer) {
            Some(OwnerOutcome::Renewed { lease_ms }) => {
                env.telemetry.count(Counter::LeaseRenewals);
                grant.renew_at_ms = env.now_ms.saturating_add(lease_ms / 2);
                // The local entry must outlive the call too, or a duplicate reaching this
                // gateway after one lease would pass the local tier (and, with the sidecar
                // down and `failure_mode: local`, go upstream).
                if let Local::Held { hold, .. } = self.local {
                    self.extend_local(config, hold, env.now_ms.saturating_add(lease_ms), env);
                }
            }
            Some(OwnerOutcome::Stale | OwnerOutcome::Released) => {
                // Someone else may hold the key now: stop renewing, the release will be stale.
                env.telemetry.count(Counter::LeaseLost);
                grant.renew_at_ms = u64::MAX;
            }
            // Retried on the next tick while the lease lasts.
            None => env.telemetry.count(Counter::SidecarErrors),
        }
    }

    /// Its rule's place in the configuration (per-rule metrics).
    pub fn rule_index(&self) -> usize {
        self.rule_index
    }

    /// The first 12 hex digits of the stored key (a SHA-256: nothing of the raw key), for logs.
    pub fn key_digest(&self) -> &str {
        self.key.get(..12).unwrap_or(&self.key)
    }

    /// The request's trace context, for the glue to add to each of its callouts.
    pub fn trace(&self) -> &TraceContext {
        &self.trace
    }

    /// The fencing token granted to this request, if any.
    pub fn fence(&self) -> Option<u64> {
        match &self.phase {
            Phase::Upstream {
                grant: Some(grant), ..
            }
            | Phase::LocalWait { grant, .. } => Some(grant.fence),
            _ => None,
        }
    }
}

/// What one tick read of the keys its parked requests wait on (see
/// [`Flow::on_local_wait_tick`]): a key still in flight reads the same for every request
/// parked on it after one another (the tick goes through them in stream order, so a storm's
/// are read once), and so does a completed one, which answers them all; a freed one is read
/// again by each (the first to see it takes it over).
#[derive(Debug, Default)]
pub struct Lookups {
    /// The last key read in flight, with its `retry_after_ms`.
    in_flight: Option<(String, u64)>,
    /// The last key read completed, with its response: every other duplicate parked on it
    /// replays that copy. Reading the slot again for each one copied the whole stored
    /// response out of the host and decoded it, per duplicate: most of the filter's part of
    /// a storm's fan-out (`benchmarks/storm.notes.md`).
    completed: Option<(String, LocalResponse)>,
}

impl Lookups {
    /// Whether `flow` is parked on the key this tick last read in flight, its budget not yet
    /// spent: retrying it would change nothing, so the glue skips it (no clock read, no
    /// environment) — a thousand parked duplicates cost one read and a comparison each.
    pub fn unchanged(&self, flow: &Flow, now_ms: u64) -> bool {
        matches!(flow.phase, Phase::Parked { until_ms, .. } if now_ms < until_ms)
            && self.in_flight.as_ref().is_some_and(|(k, _)| *k == flow.key)
    }

    /// What the local tier holds for `key`, read once per tick for a key in flight or
    /// completed.
    fn lookup(&mut self, table: &Table<'_>, key: &str, now_ms: u64) -> Seen<'_> {
        if let Some((k, retry_after_ms)) = &self.in_flight
            && k == key
        {
            return Seen::InFlight {
                retry_after_ms: *retry_after_ms,
            };
        }
        if self.completed.as_ref().is_some_and(|(k, _)| k == key) {
            return self
                .completed
                .as_ref()
                .map_or(Seen::Free, |(_, done)| Seen::Completed(done));
        }
        match table.lookup(key, now_ms) {
            Some(LocalClaim::InFlight { retry_after_ms }) => {
                self.in_flight = Some((key.to_string(), retry_after_ms));
                Seen::InFlight { retry_after_ms }
            }
            Some(LocalClaim::Completed(done)) => {
                let (_, done) = self.completed.insert((key.to_string(), done));
                Seen::Completed(done)
            }
            _ => Seen::Free,
        }
    }
}

/// What [`Lookups::lookup`] found of a key.
enum Seen<'a> {
    InFlight {
        retry_after_ms: u64,
    },
    /// Its response, which every request parked on the key replays.
    Completed(&'a LocalResponse),
    /// Neither: the call aborted, or its response was not kept here.
    Free,
}

/// What became of a complete/abort/leave callout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseResult {
    Done,
    /// Not the owner any more: the lease had ended (a leave: no place left to give up).
    Stale,
    /// No usable answer: dispatch again (bounded by `release_attempts`).
    Retry,
}

pub fn on_release_answer(answer: Answer<'_>, telemetry: &mut dyn Telemetry) -> ReleaseResult {
    match parse_owner(answer) {
        Some(OwnerOutcome::Released | OwnerOutcome::Renewed { .. }) => ReleaseResult::Done,
        Some(OwnerOutcome::Stale) => {
            telemetry.count(Counter::LeaseLost);
            ReleaseResult::Stale
        }
        None => {
            telemetry.count(Counter::SidecarErrors);
            ReleaseResult::Retry
        }
    }
}

/// The answer to a leave: `Stale` when the place was gone (the claim was answered meanwhile,
/// a grant is then aborted), which loses no lease.
pub fn on_leave_answer(answer: Answer<'_>, telemetry: &mut dyn Telemetry) -> ReleaseResult {
    match parse_owner(answer) {
        Some(OwnerOutcome::Released | OwnerOutcome::Renewed { .. }) => {
            telemetry.count(Counter::QueueLeft);
            ReleaseResult::Done
        }
        Some(OwnerOutcome::Stale) => ReleaseResult::Stale,
        None => {
            telemetry.count(Counter::SidecarErrors);
            ReleaseResult::Retry
        }
    }
}

fn abort_callout(config: &Config, key: &str, owner: String) -> Callout {
    let request = AbortRequest {
        key: key.to_string(),
        owner,
    };
    Callout {
        path: paths::ABORT,
        body: idemgate_wire::encode(&request, &[]),
        timeout_ms: config.sidecar.timeout_ms,
    }
}

fn leave_callout(config: &Config, key: &str, waiter: String) -> Callout {
    let request = LeaveRequest {
        key: key.to_string(),
        waiter,
    };
    Callout {
        path: paths::LEAVE,
        body: idemgate_wire::encode(&request, &[]),
        timeout_ms: config.sidecar.timeout_ms,
    }
}

/// The name a queued claim gives its place: unguessable without this VM's secret (so no
/// one else can give the place up), unique per claim (`owner` is), 32 hex characters.
fn waiter_name(secret: &[u8; 32], owner: u64) -> String {
    let mut h = PartHasher::new("idemgate.waiter.v1");
    h.part(secret);
    h.part(&owner.to_le_bytes());
    let mut name = h.finish_hex();
    name.truncate(32);
    name
}

/// The refusal when the decision cannot be made: retry once the breaker's cooldown is over.
fn unavailable(config: &Config) -> Refusal {
    Refusal::Unavailable {
        retry_after_ms: config.breaker.cooldown_ms,
    }
}

/// A claim answer, validated: anything else is a sidecar failure, never a crash.
fn parse_claim<'a>(answer: Answer<'a>, key: &str) -> Option<(ClaimOutcome, &'a [u8])> {
    let Answer::Http { status: 200, body } = answer else {
        return None;
    };
    let (outcome, payload): (ClaimOutcome, &[u8]) = idemgate_wire::decode_answer(body).ok()?;
    let limits = Limits::default();
    let valid = match &outcome {
        ClaimOutcome::Granted {
            owner, lease_ms, ..
        } => {
            *lease_ms > 0
                && limits
                    .abort(&AbortRequest {
                        key: key.to_string(),
                        owner: owner.clone(),
                    })
                    .is_ok()
        }
        ClaimOutcome::Completed { response, .. } => {
            limits.stored_response(response, payload).is_ok()
        }
        _ => payload.is_empty(),
    };
    valid.then_some((outcome, payload))
}

fn parse_rate(answer: Answer<'_>) -> Option<RateOutcome> {
    let Answer::Http { status: 200, body } = answer else {
        return None;
    };
    let (outcome, payload): (RateOutcome, &[u8]) = idemgate_wire::decode_answer(body).ok()?;
    payload.is_empty().then_some(outcome)
}

fn parse_owner(answer: Answer<'_>) -> Option<OwnerOutcome> {
    let Answer::Http { status: 200, body } = answer else {
        return None;
    };
    let (outcome, payload): (OwnerOutcome, &[u8]) = idemgate_wire::decode_answer(body).ok()?;
    payload.is_empty().then_some(outcome)
}

/// A request that waited for its turn (at the sidecar or on this gateway), for `waited_ms`.
fn note_queued(env: &mut Env<'_>, waited_ms: u64) {
    env.telemetry.count(Counter::Queued);
    env.telemetry.record(Histogram::QueueWaitMs, waited_ms);
}

#[cfg(test)]
mod input_tests;
#[cfg(test)]
mod tests;
