//! The per-request decision state machine. The glue feeds it the stream's events (request
//! headers, body, the sidecar's answers, response headers/body, the stream's end) and carries
//! out the [`Action`] it returns; every decision — the local tier, the sidecar claim, failure
//! modes, shadow mode, what to store and what to release — is made here, natively testable.
//!
//! Releases ([`Flow::take_release`]) and renewals ([`Flow::renewal_due`]) are callouts the root
//! context dispatches, because the SDK drops answers addressed to a stream that has ended.

use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;
use idemgate_wire::{
    AbortRequest, ClaimOutcome, ClaimRequest, CompleteRequest, LeaveRequest, Limits, Mode,
    OwnerOutcome, RateCheck, RateOutcome, RateRequest, RenewRequest, StoredResponse, paths,
};

use crate::breaker::Breaker;
use crate::capture::{Capture, Outcome};
use crate::config::{ClientAbort, Config, Conflict, FailureMode, Rule};
use crate::fingerprint::Fingerprint;
use crate::key::{self, KeyError};
use crate::local::{Hold, LocalClaim, LocalResponse, SharedStore, Table};
use crate::metrics::{Counter, Histogram, Telemetry};
use crate::problem::{self, Reply, types};
use crate::rate::{self, Check, RateSpec, RateTable, Verdict};
use crate::rule::{RequestHead, RequestView, match_rule};

/// What the host offers a step: the clock, shared data, the VM's breaker and metrics.
pub struct Env<'a> {
    pub now_ms: u64,
    pub shared: &'a dyn SharedStore,
    pub breaker: &'a mut Breaker,
    pub telemetry: &'a mut dyn Telemetry,
    /// Unique per request on this gateway (VM nonce and sequence): the local-tier owner.
    pub owner: u64,
    /// This VM's random secret (read once from the host's randomness) that waiter names are
    /// derived from; `None` when the host had none: queued claims then go unnamed (no leave).
    pub waiter_secret: Option<&'a [u8; 32]>,
}

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
    /// Keep the request paused and dispatch this claim; its answer goes to [`Flow::on_claim_answer`].
    Claim(Callout),
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the whole body to fingerprint it.
    Body,
    /// The rate check is with the sidecar; the request is paused.
    Rating,
    /// The claim is with the sidecar; the request is paused.
    Claiming,
    /// The client went away while the claim was out: a late grant is released at once.
    Abandoned,
    /// Granted by the sidecar while another request on this gateway still runs the key (the
    /// sidecar lost that request's claim, e.g. Redis restarted empty): the request stays
    /// paused, with its grant, until the local holder ends or the wait budget does.
    LocalWait,
    /// Forwarded: the response is watched, the key released when it completes.
    Upstream,
    /// Answered locally or released: nothing left to do.
    Finished,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Grant {
    owner: String,
    fence: u64,
    renew_at_ms: u64,
    renewing: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Local {
    /// Not held: the tier is off, or (queue policy) the slot is taken only when the request is
    /// let through — held while waiting, it would block the earlier waiter the sidecar grants.
    Off,
    Held(Hold),
    /// No slot could be taken (every probed one held by other keys): the sidecar decides.
    Unavailable,
}

/// A request that matched a rule, with the head the matcher read.
#[derive(Debug)]
pub struct Route {
    rule: usize,
    head: RequestHead,
}

/// One matched request's state, from request headers to release.
#[derive(Debug)]
pub struct Flow {
    rule: usize,
    key: String,
    fingerprint: Option<String>,
    pending_body: Option<Fingerprint>,
    body_seen: usize,
    phase: Phase,
    local: Local,
    grant: Option<Grant>,
    /// When this gateway's in-flight entry expires (while `local` is `Held`).
    local_expires_ms: u64,
    /// The name the queued claim gave its place at the sidecar (for a leave).
    waiter: Option<String>,
    /// End of a [`Phase::LocalWait`]: when the wait budget from the claim ends.
    local_wait_until_ms: u64,
    capture: Option<Capture>,
    claim_sent_ms: u64,
    release: Option<Callout>,
    /// Rate checks still to make (cleared once decided).
    rate_checks: Vec<Check>,
    /// The local tier's rate check is done (at request headers): never spend twice.
    local_rated: bool,
    /// `RateLimit` fields for the forwarded response (`rate.expose`).
    rate_headers: Vec<(String, String)>,
}

impl Flow {
    /// The rule a request falls under; `None` = pass untouched. Kept apart from
    /// [`Flow::on_request_headers`] so the no-match path costs the `:method` read (and `:path`
    /// when a rule takes the method) and nothing else: no clock, no shared data, no metric.
    pub fn route(config: &Config, req: &dyn RequestView) -> Option<Route> {
        match_rule(config, req).map(|(rule, head)| Route { rule, head })
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
        let Route {
            rule: rule_index,
            head,
        } = route;
        let Some(rule) = config.rules.get(rule_index) else {
            return (None, Action::pass());
        };
        let raw_key = match key::extract(rule, &head, req) {
            Ok(Some(k)) => k,
            Ok(None) => {
                env.telemetry.count(Counter::Bypassed);
                return (None, Action::pass());
            }
            Err(e) => {
                let (counter, type_uri, title) = match e {
                    KeyError::Missing => (
                        Counter::MissingKey,
                        types::MISSING_KEY,
                        "Idempotency key required",
                    ),
                    KeyError::RepeatedScope | KeyError::EncodedSeparator => {
                        (Counter::Ambiguous, types::AMBIGUOUS, "Ambiguous request")
                    }
                    _ => (
                        Counter::InvalidKey,
                        types::INVALID_KEY,
                        "Invalid idempotency key",
                    ),
                };
                env.telemetry.count(counter);
                let reply =
                    problem::problem(400, type_uri, title, e.detail(), None, "idemgate_bad_key");
                return (None, shadowed(config, env, reply));
            }
        };
        let mut flow = Flow {
            rule: rule_index,
            key: key::scoped(rule, &head, req, &raw_key),
            fingerprint: None,
            pending_body: None,
            body_seen: 0,
            phase: Phase::Claiming,
            local: Local::Off,
            grant: None,
            local_expires_ms: 0,
            waiter: None,
            local_wait_until_ms: 0,
            capture: None,
            claim_sent_ms: env.now_ms,
            release: None,
            rate_checks: rule
                .rate
                .as_ref()
                .map(|spec| rate::checks(rule, spec, req, Some(&raw_key)))
                .unwrap_or_default(),
            rate_headers: Vec::new(),
            local_rated: false,
        };
        // The local tier's limits are checked before the body is buffered or hashed: a
        // limited request is answered at once and costs no fingerprint.
        if let Some(spec) = rule.rate.as_ref().filter(|s| s.tier.local())
            && !flow.rate_checks.is_empty()
        {
            flow.local_rated = true;
            if let Some(limited) = flow.rate_local(config, spec, env) {
                return (Some(flow), limited);
            }
        }
        if let Some(spec) = &rule.fingerprint {
            let fp = Fingerprint::start(spec, &head, req);
            if spec.max_body == 0 {
                flow.fingerprint = Some(fp.finish());
            } else if end_of_stream {
                flow.fingerprint = Some(fp.body(&[]).finish());
            } else {
                flow.pending_body = Some(fp);
                flow.phase = Phase::Body;
                return (Some(flow), Action::Pause);
            }
        }
        let action = flow.claim(config, rule, env);
        (Some(flow), action)
    }

    /// A request body callback while the fingerprint waits for the body. `buffered` is what
    /// Envoy has buffered so far; `read` returns the whole buffer (called at end of stream).
    pub fn on_request_body(
        &mut self,
        config: &Config,
        buffered: usize,
        end_of_stream: bool,
        read: &mut dyn FnMut(usize) -> Option<Vec<u8>>,
        env: &mut Env<'_>,
    ) -> Action {
        match self.phase {
            Phase::Body => {}
            // Body callbacks while the claim is out happen only with
            // allow_on_headers_stop_iteration; Continue here would release the held headers.
            Phase::Rating | Phase::Claiming | Phase::Abandoned | Phase::LocalWait => {
                return Action::Pause;
            }
            Phase::Upstream | Phase::Finished => return Action::pass(),
        }
        let Some(rule) = config.rules.get(self.rule) else {
            return Action::pass();
        };
        let cap = rule.fingerprint.as_ref().map_or(0, |f| f.max_body);
        self.body_seen = self.body_seen.max(buffered);
        if self.body_seen > cap {
            env.telemetry.count(Counter::TooLarge);
            self.phase = Phase::Finished;
            let reply = problem::problem(
                413,
                types::TOO_LARGE,
                "Request body too large",
                "the body is larger than this endpoint fingerprints",
                None,
                "idemgate_body_too_large",
            );
            return self.block(config, env, reply);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = if self.body_seen == 0 {
            Some(Vec::new())
        } else {
            read(self.body_seen)
        };
        let (Some(fp), Some(body)) = (self.pending_body.take(), body) else {
            // Envoy did not hand the buffered body over: fingerprinting it is impossible, and
            // guessing would let a different body replay this one. Fail like a sidecar outage.
            self.phase = Phase::Finished;
            let reply = unavailable(config);
            return self.block(config, env, reply);
        };
        self.fingerprint = Some(fp.body(&body).finish());
        self.claim(config, rule, env)
    }

    /// Whether the request is still held (body being hashed or claim out): the glue then
    /// passes request body and trailer callbacks to [`Flow::on_request_body`].
    pub fn holds_request(&self) -> bool {
        matches!(
            self.phase,
            Phase::Body | Phase::Rating | Phase::Claiming | Phase::Abandoned | Phase::LocalWait
        )
    }

    /// Rate limits first (a limited request claims nothing), then the key.
    fn claim(&mut self, config: &Config, rule: &Rule, env: &mut Env<'_>) -> Action {
        if let Some(spec) = rule.rate.as_ref().filter(|_| !self.rate_checks.is_empty())
            && let Some(action) = self.rate(config, spec, env)
        {
            return action;
        }
        let wait = match rule.conflict {
            Conflict::Queue(policy) if !config.shadow => Some(policy),
            _ => None,
        };
        if config.local.enabled {
            let found = if wait.is_some() {
                // Queued requests take the slot when they are let through (`Local::Off`).
                Table {
                    config: &config.local,
                    store: env.shared,
                }
                .lookup(&self.key, env.now_ms)
            } else {
                Some(self.take_local(config, rule.lease_ms, env))
            };
            match found {
                None | Some(LocalClaim::Claimed(_)) => {}
                Some(LocalClaim::InFlight { retry_after_ms }) => {
                    env.telemetry.count(Counter::LocalHits);
                    if rule.conflict == Conflict::Reject {
                        env.telemetry.count(Counter::Rejected);
                        return self.block(config, env, in_progress(retry_after_ms));
                    }
                }
                Some(LocalClaim::Completed(done)) => return self.replay_local(config, done, env),
                Some(LocalClaim::Unavailable) => {
                    env.telemetry.count(Counter::LocalUnavailable);
                    if config.failure_mode == FailureMode::Local {
                        // `local` promises that this gateway catches a duplicate while the
                        // sidecar is down; unrecorded here, this request could not be caught.
                        return self.block(config, env, unavailable(config));
                    }
                    self.local = Local::Unavailable;
                }
            }
        }
        if !env.breaker.allow(env.now_ms) {
            env.telemetry.count(Counter::BreakerOpen);
            return self.sidecar_failed(config, env);
        }
        if let Some(policy) = wait {
            self.waiter = env.waiter_secret.map(|s| waiter_name(s, env.owner));
            self.local_wait_until_ms = env.now_ms.saturating_add(policy.longest_budget());
        }
        let request = ClaimRequest {
            key: self.key.clone(),
            mode: rule.mode,
            lease_ms: rule.lease_ms,
            fingerprint: self.fingerprint.clone(),
            wait,
            waiter: self.waiter.clone(),
        };
        self.phase = Phase::Claiming;
        self.claim_sent_ms = env.now_ms;
        Action::Claim(Callout {
            path: paths::CLAIM,
            body: idemgate_wire::encode(&request, &[]),
            timeout_ms: config
                .sidecar
                .timeout_ms
                .saturating_add(wait.map_or(0, |w| w.longest_budget())),
        })
    }

    /// The local tier's rate check (unless made at request headers), then the sidecar's.
    /// `None`: under every limit (or not blocking: shadow, failure mode), the checks are done
    /// and the claim goes on; otherwise a 429, or the `/v1/rate` callout whose answer goes to
    /// [`Flow::on_claim_answer`].
    fn rate(&mut self, config: &Config, spec: &RateSpec, env: &mut Env<'_>) -> Option<Action> {
        if spec.tier.local()
            && !self.local_rated
            && let Some(limited) = self.rate_local(config, spec, env)
        {
            return Some(limited);
        }
        if !spec.tier.global() {
            self.rate_checks.clear();
            return None;
        }
        if !env.breaker.allow(env.now_ms) {
            env.telemetry.count(Counter::BreakerOpen);
            return self.rate_failed(config, spec, env);
        }
        let checks = self
            .rate_checks
            .iter()
            .filter_map(|c| {
                let rate = spec.limits.get(c.limit)?.rate;
                Some(RateCheck {
                    key: c.key.clone(),
                    interval_us: rate.interval_us,
                    burst: rate.burst,
                })
            })
            .collect();
        self.phase = Phase::Rating;
        self.claim_sent_ms = env.now_ms;
        Some(Action::Claim(Callout {
            path: paths::RATE,
            body: idemgate_wire::encode(&RateRequest { checks }, &[]),
            timeout_ms: config.sidecar.timeout_ms,
        }))
    }

    /// The shared-data check: `Some` (429) when over a limit. Shared data failing leaves the
    /// decision to the sidecar (or, local tier only, lets the request through, counted).
    fn rate_local(
        &mut self,
        config: &Config,
        spec: &RateSpec,
        env: &mut Env<'_>,
    ) -> Option<Action> {
        let table = RateTable {
            slots: config.local.rate_slots,
            probes: config.local.probes,
            store: env.shared,
        };
        let now_us = env.now_ms.saturating_mul(1_000);
        let Some(verdict) = rate::check_local(&table, spec, &self.rate_checks, now_us) else {
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
            env.telemetry.count_rate(self.rule, limited.is_some());
        }
        let Some(retry_after_ms) = limited else {
            if spec.expose {
                self.rate_headers = verdict.headers(spec);
            }
            return None;
        };
        if spec.shadow {
            env.telemetry.count(Counter::ShadowWouldBlock);
            return None;
        }
        self.rate_checks.clear();
        self.phase = Phase::Finished;
        let mut reply = problem::problem(
            429,
            types::RATE_LIMITED,
            "Too many requests",
            "over the rate limit for this caller or resource; retry after the indicated time",
            Some(retry_after_ms),
            "idemgate_rate_limited",
        );
        reply.headers.extend(verdict.headers(spec));
        Some(Action::Respond(reply))
    }

    /// The sidecar could not check the limits: the rule's failure mode decides, as for claims.
    fn rate_failed(
        &mut self,
        config: &Config,
        spec: &RateSpec,
        env: &mut Env<'_>,
    ) -> Option<Action> {
        let decided = match config.failure_mode {
            FailureMode::Closed => {
                env.telemetry.count(Counter::FailedClosed);
                if spec.shadow {
                    env.telemetry.count(Counter::ShadowWouldBlock);
                    None
                } else {
                    self.phase = Phase::Finished;
                    Some(Action::Respond(unavailable(config)))
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
                self.rate_local(config, spec, env)
            }
        };
        self.rate_checks.clear();
        decided
    }

    fn on_rate_answer(&mut self, config: &Config, answer: Answer<'_>, env: &mut Env<'_>) -> Action {
        let Some(rule) = config.rules.get(self.rule) else {
            return Action::pass();
        };
        let Some(spec) = rule.rate.as_ref() else {
            return Action::pass();
        };
        env.telemetry.record(
            Histogram::SidecarLatencyMs,
            env.now_ms.saturating_sub(self.claim_sent_ms),
        );
        self.phase = Phase::Claiming;
        let verdict = parse_rate(answer)
            .and_then(|outcome| rate::global_verdict(&self.rate_checks, &outcome.results));
        let blocked = match verdict {
            Some(verdict) => {
                env.breaker.success();
                self.rate_checks.clear();
                self.rate_verdict(spec, &verdict, true, env)
            }
            None => {
                env.telemetry.count(Counter::SidecarErrors);
                env.breaker.failure(&config.breaker, env.now_ms);
                self.rate_failed(config, spec, env)
            }
        };
        match blocked {
            Some(action) => action,
            None => self.claim(config, rule, env),
        }
    }

    /// `RateLimit` fields for the forwarded response, once (`rate.expose`).
    pub fn take_response_headers(&mut self) -> Vec<(String, String)> {
        core::mem::take(&mut self.rate_headers)
    }

    /// The claim's answer (delivered to the root, which applies the action to the stream if
    /// it is still there). While rating, it is the `/v1/rate` answer.
    pub fn on_claim_answer(
        &mut self,
        config: &Config,
        answer: Answer<'_>,
        env: &mut Env<'_>,
    ) -> Action {
        if self.phase == Phase::Rating {
            return self.on_rate_answer(config, answer, env);
        }
        if !matches!(self.phase, Phase::Claiming | Phase::Abandoned) {
            return Action::pass();
        }
        env.telemetry.record(
            Histogram::SidecarLatencyMs,
            env.now_ms.saturating_sub(self.claim_sent_ms),
        );
        let Some((outcome, payload)) = parse_claim(answer, &self.key) else {
            env.telemetry.count(Counter::SidecarErrors);
            env.breaker.failure(&config.breaker, env.now_ms);
            if self.phase == Phase::Abandoned {
                self.phase = Phase::Finished;
                return Action::pass();
            }
            return self.sidecar_failed(config, env);
        };
        env.breaker.success();
        let waited_ms = match &outcome {
            ClaimOutcome::Granted { waited_ms, .. } | ClaimOutcome::Completed { waited_ms, .. } => {
                *waited_ms
            }
            _ => 0,
        };
        if waited_ms > 0 {
            env.telemetry.count(Counter::Queued);
            env.telemetry.record(Histogram::QueueWaitMs, waited_ms);
        }
        if self.phase == Phase::Abandoned {
            self.phase = Phase::Finished;
            if let ClaimOutcome::Granted { owner, .. } = outcome {
                self.release = Some(abort_callout(config, &self.key, owner));
            }
            return Action::pass();
        }
        match outcome {
            ClaimOutcome::Granted {
                owner,
                fence,
                lease_ms,
                ..
            } => {
                env.telemetry.count(Counter::Granted);
                self.grant = Some(Grant {
                    owner,
                    fence,
                    renew_at_ms: env.now_ms.saturating_add(lease_ms / 2),
                    renewing: false,
                });
                self.go_upstream_granted(config, env)
                    .unwrap_or(Action::Pause)
            }
            ClaimOutcome::Completed { response, .. } => {
                env.telemetry.count(Counter::Replayed);
                let reply = problem::replay(&response, payload);
                if !config.shadow {
                    self.keep_locally(config, response, payload, env);
                }
                self.block(config, env, reply)
            }
            ClaimOutcome::Mismatch => {
                env.telemetry.count(Counter::Mismatch);
                self.block(config, env, mismatch())
            }
            ClaimOutcome::Busy {
                retry_after_ms,
                waited: true,
                ..
            } => {
                env.telemetry.count(Counter::Rejected);
                self.block(config, env, wait_expired(retry_after_ms))
            }
            ClaimOutcome::Busy { retry_after_ms, .. } => {
                env.telemetry.count(Counter::Rejected);
                self.block(config, env, in_progress(retry_after_ms))
            }
            ClaimOutcome::QueueFull { retry_after_ms, .. } => {
                env.telemetry.count(Counter::Rejected);
                let reply = problem::problem(
                    429,
                    types::QUEUE_FULL,
                    "Too many requests waiting for this key",
                    "too many requests with this key are already waiting",
                    Some(retry_after_ms),
                    "idemgate_queue_full",
                );
                self.block(config, env, reply)
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
                self.block(config, env, unavailable(config))
            }
            FailureMode::Open => {
                env.telemetry.count(Counter::FailedOpen);
                self.phase = Phase::Upstream;
                degraded(&config.degraded_header, "open")
            }
            FailureMode::Local => {
                env.telemetry.count(Counter::FailedLocal);
                // Forwarded only while holding this gateway's slot: the only claim there is.
                match self.take_local_late(config, env) {
                    None => {
                        self.phase = Phase::Upstream;
                        degraded(&config.degraded_header, "local")
                    }
                    Some(LocalClaim::InFlight { retry_after_ms }) => {
                        env.telemetry.count(Counter::Rejected);
                        self.block(config, env, in_progress(retry_after_ms))
                    }
                    Some(LocalClaim::Completed(done)) => self.replay_local(config, done, env),
                    Some(LocalClaim::Claimed(_) | LocalClaim::Unavailable) => {
                        env.telemetry.count(Counter::LocalUnavailable);
                        self.block(config, env, unavailable(config))
                    }
                }
            }
        }
    }

    /// Answers locally — or, in shadow mode, only counts that it would have and forwards.
    fn block(&mut self, config: &Config, env: &mut Env<'_>, reply: Reply) -> Action {
        if config.shadow {
            env.telemetry.count(Counter::ShadowWouldBlock);
            // Keep what this request holds: it goes upstream like any other.
            self.phase = Phase::Upstream;
            return Action::pass();
        }
        self.release_local(config, env, None);
        self.phase = Phase::Finished;
        Action::Respond(reply)
    }

    /// Claims this gateway's slot; on success the request holds it (`Local::Held`).
    fn take_local(&mut self, config: &Config, lease_ms: u64, env: &mut Env<'_>) -> LocalClaim {
        let found = Table {
            config: &config.local,
            store: env.shared,
        }
        .claim(&self.key, env.owner, env.now_ms, lease_ms);
        if let LocalClaim::Claimed(hold) = found {
            self.local = Local::Held(hold);
            self.local_expires_ms = env.now_ms.saturating_add(lease_ms);
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
        let lease_ms = config.rules.get(self.rule)?.lease_ms;
        match self.take_local(config, lease_ms, env) {
            LocalClaim::Claimed(_) => None,
            found => Some(found),
        }
    }

    /// A completed local entry answers the request: its replay, or 422 for another request.
    fn replay_local(&mut self, config: &Config, done: LocalResponse, env: &mut Env<'_>) -> Action {
        env.telemetry.count(Counter::LocalHits);
        if done.fingerprint != self.fingerprint {
            env.telemetry.count(Counter::Mismatch);
            return self.block(config, env, mismatch());
        }
        env.telemetry.count(Counter::Replayed);
        self.block(config, env, problem::replay(&done.response, &done.body))
    }

    /// The sidecar granted the key: forward with the fence once this gateway's slot is held.
    /// The local tier vetoes a grant for a key that another request here still runs (the
    /// sidecar lost that claim: Redis restarted empty): `None` = wait for it
    /// ([`Phase::LocalWait`], retried by [`Flow::on_local_wait_tick`]).
    fn go_upstream_granted(&mut self, config: &Config, env: &mut Env<'_>) -> Option<Action> {
        let reply = match self.take_local_late(config, env) {
            None | Some(LocalClaim::Claimed(_)) => return Some(self.forward_granted(config)),
            Some(LocalClaim::Completed(done)) => {
                // The call ran here and the sidecar forgot it: replay, never run it again.
                let action = self.replay_local(config, done, env);
                self.abort_grant(config);
                return Some(action);
            }
            Some(LocalClaim::Unavailable) => {
                env.telemetry.count(Counter::LocalUnavailable);
                if config.failure_mode != FailureMode::Local {
                    self.local = Local::Unavailable;
                    return Some(self.forward_granted(config));
                }
                unavailable(config)
            }
            Some(LocalClaim::InFlight { retry_after_ms }) => {
                if self.phase != Phase::LocalWait {
                    env.telemetry.count(Counter::LocalVetoes);
                }
                if config.shadow {
                    env.telemetry.count(Counter::ShadowWouldBlock);
                    return Some(self.forward_granted(config));
                }
                // Only queued claims get here (`reject` holds the slot from the claim on).
                if env.now_ms < self.local_wait_until_ms {
                    self.phase = Phase::LocalWait;
                    return None;
                }
                env.telemetry.count(Counter::Rejected);
                wait_expired(retry_after_ms)
            }
        };
        let action = self.block(config, env, reply);
        self.abort_grant(config);
        Some(action)
    }

    fn forward_granted(&mut self, config: &Config) -> Action {
        self.phase = Phase::Upstream;
        let fence = self.grant.as_ref().map_or(0, |g| g.fence);
        Action::Continue(vec![(config.fencing_header.clone(), fence.to_string())])
    }

    /// A request answered locally after its grant gives the key back at the sidecar.
    fn abort_grant(&mut self, config: &Config) {
        if self.phase == Phase::Finished
            && let Some(grant) = self.grant.take()
        {
            self.release = Some(abort_callout(config, &self.key, grant.owner));
        }
    }

    /// Whether this request waits for a holder on this gateway ([`Phase::LocalWait`]).
    pub fn waits_locally(&self) -> bool {
        self.phase == Phase::LocalWait
    }

    /// The tick's retry of a [`Phase::LocalWait`]: `Some` once the wait ends (forward, or
    /// answer locally with the grant aborted: [`Flow::take_release`]).
    pub fn on_local_wait_tick(&mut self, config: &Config, env: &mut Env<'_>) -> Option<Action> {
        if self.phase != Phase::LocalWait {
            return None;
        }
        self.go_upstream_granted(config, env)
    }

    fn release_local(
        &mut self,
        config: &Config,
        env: &mut Env<'_>,
        completed: Option<(LocalResponse, u64)>,
    ) {
        if let Local::Held(hold) = self.local {
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
        let Some(rule) = config.rules.get(self.rule) else {
            return;
        };
        let done = LocalResponse {
            fingerprint: self.fingerprint.clone(),
            response,
            body: body.to_vec(),
        };
        self.release_local(
            config,
            env,
            Some((done, env.now_ms.saturating_add(rule.retention_ms))),
        );
    }

    /// Whether the glue should read the response headers for [`Flow::on_response_headers`].
    pub fn watches_response(&self) -> bool {
        self.phase == Phase::Upstream
    }

    /// Response headers of a forwarded request (pseudo-headers included).
    pub fn on_response_headers(
        &mut self,
        config: &Config,
        headers: &[(String, Vec<u8>)],
        end_of_stream: bool,
        env: &mut Env<'_>,
    ) {
        if self.phase != Phase::Upstream {
            return;
        }
        if let Some(rule) = config.rules.get(self.rule) {
            self.capture = Some(Capture::begin(&rule.response, headers));
        }
        if end_of_stream {
            self.finish(config, env);
        }
    }

    /// Whether the glue should read response body chunks.
    pub fn wants_response_body(&self) -> bool {
        self.phase == Phase::Upstream && self.capture.as_ref().is_some_and(Capture::wants_body)
    }

    /// A response body chunk as it passes (`chunk` is empty when not wanted).
    pub fn on_response_body(
        &mut self,
        config: &Config,
        chunk: &[u8],
        end_of_stream: bool,
        env: &mut Env<'_>,
    ) {
        if self.phase != Phase::Upstream {
            return;
        }
        if let (Some(capture), Some(rule)) = (self.capture.as_mut(), config.rules.get(self.rule)) {
            capture.chunk(&rule.response, chunk);
        }
        if end_of_stream {
            self.finish(config, env);
        }
    }

    /// Response trailers: the response is complete.
    pub fn on_response_trailers(&mut self, config: &Config, env: &mut Env<'_>) {
        if self.phase == Phase::Upstream {
            self.finish(config, env);
        }
    }

    /// The response went through completely: store it or abort, per policy.
    fn finish(&mut self, config: &Config, env: &mut Env<'_>) {
        self.phase = Phase::Finished;
        let Some(rule) = config.rules.get(self.rule) else {
            return;
        };
        let capture = self.capture.take();
        // Lock mode stores nothing: any end of the response releases the lock.
        let outcome = match rule.mode {
            Mode::Lock => None,
            Mode::Idempotency => Some(capture.map_or(Outcome::Abort, |c| c.finish(&rule.response))),
        };
        let stored = match &outcome {
            Some(Outcome::Store(response, body)) => Some((response.clone(), body.clone())),
            _ => None,
        };
        let local_copy = stored.clone().map(|(response, body)| {
            let done = LocalResponse {
                fingerprint: self.fingerprint.clone(),
                response,
                body,
            };
            (done, env.now_ms.saturating_add(rule.retention_ms))
        });
        self.release_local(config, env, local_copy);
        let Some(grant) = self.grant.take() else {
            return;
        };
        if outcome == Some(Outcome::Abort) {
            self.release = Some(abort_callout(config, &self.key, grant.owner));
            return;
        }
        let (response, body) = stored.map_or((None, Vec::new()), |(r, b)| (Some(r), b));
        let request = CompleteRequest {
            key: self.key.clone(),
            owner: grant.owner,
            retention_ms: rule.retention_ms,
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
        match self.phase {
            Phase::Claiming => {
                env.telemetry.count(Counter::Abandoned);
                self.release_local(config, env, None);
                self.phase = Phase::Abandoned;
                // The filter cannot cancel the claim's callout: a queued claim's place is given
                // up by name, or it would block the queue until its budget ran out. Best
                // effort (a late grant is still aborted), and not into an open breaker.
                if let Some(waiter) = self.waiter.take()
                    && !env.breaker.is_open(env.now_ms)
                {
                    self.release = Some(leave_callout(config, &self.key, waiter));
                }
                true
            }
            Phase::Abandoned => true,
            Phase::LocalWait => {
                // Granted but never forwarded: nothing ran, the key goes back at once.
                env.telemetry.count(Counter::Abandoned);
                self.phase = Phase::Finished;
                self.abort_grant(config);
                false
            }
            // Nothing is held yet: the rate answer, when it comes, finds no flow.
            Phase::Rating => {
                self.phase = Phase::Finished;
                false
            }
            Phase::Upstream => {
                // Client abort or reset before the response completed: nothing to store.
                self.capture = None;
                self.phase = Phase::Finished;
                let policy = config
                    .rules
                    .get(self.rule)
                    .map_or(ClientAbort::Hold, |r| r.client_abort);
                match policy {
                    ClientAbort::Release => {
                        self.release_local(config, env, None);
                        if let Some(grant) = self.grant.take() {
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
                        self.grant = None;
                    }
                }
                false
            }
            Phase::Body | Phase::Finished => false,
        }
    }

    /// The client went away while the claim was out: the claim's answer only releases.
    pub fn is_abandoned(&self) -> bool {
        self.phase == Phase::Abandoned
    }

    /// A release (complete/abort) this flow produced, for the root to dispatch.
    pub fn take_release(&mut self) -> Option<Callout> {
        self.release.take()
    }

    /// The tick's lease work for a forwarded request, once half its lease has passed: a
    /// renewal callout for a sidecar grant; without one (forwarded by `failure_mode` `local`
    /// or `open`, or in shadow mode) this gateway's in-flight entry is the only protection
    /// left, so it is extended here directly, or a duplicate would pass after one lease.
    pub fn renewal_due(&mut self, config: &Config, env: &mut Env<'_>) -> Option<Callout> {
        if !matches!(self.phase, Phase::Upstream | Phase::LocalWait) {
            return None;
        }
        let lease_ms = config.rules.get(self.rule)?.lease_ms;
        let Some(grant) = self.grant.as_mut() else {
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
        let Local::Held(hold) = self.local else {
            return;
        };
        if env.now_ms.saturating_add(lease_ms / 2) < self.local_expires_ms {
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
        .extend(hold, &self.key, expires_ms);
        if extended {
            self.local_expires_ms = expires_ms;
        }
        extended
    }

    pub fn on_renew_answer(&mut self, config: &Config, answer: Answer<'_>, env: &mut Env<'_>) {
        let Some(grant) = self.grant.as_mut() else {
            return;
        };
        grant.renewing = false;
        match parse_owner(answer) {
            Some(OwnerOutcome::Renewed { lease_ms }) => {
                env.telemetry.count(Counter::LeaseRenewals);
                grant.renew_at_ms = env.now_ms.saturating_add(lease_ms / 2);
                // The local entry must outlive the call too, or a duplicate reaching this
                // gateway after one lease would pass the local tier (and, with the sidecar
                // down and `failure_mode: local`, go upstream).
                if let Local::Held(hold) = self.local {
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

    /// The fencing token granted to this request, if any.
    pub fn fence(&self) -> Option<u64> {
        self.grant.as_ref().map(|g| g.fence)
    }
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

fn shadowed(config: &Config, env: &mut Env<'_>, reply: Reply) -> Action {
    if config.shadow {
        env.telemetry.count(Counter::ShadowWouldBlock);
        return Action::pass();
    }
    Action::Respond(reply)
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
    let mut h = key::PartHasher::new("idemgate.waiter.v1");
    h.part(secret);
    h.part(&owner.to_le_bytes());
    let mut name = h.finish_hex();
    name.truncate(32);
    name
}

fn in_progress(retry_after_ms: u64) -> Reply {
    problem::problem(
        409,
        types::IN_PROGRESS,
        "A request with this key is in progress",
        "an earlier request with the same key has not finished; retry later",
        Some(retry_after_ms),
        "idemgate_in_progress",
    )
}

fn wait_expired(retry_after_ms: u64) -> Reply {
    problem::problem(
        503,
        types::WAIT_EXPIRED,
        "Waited too long for an earlier request",
        "an earlier request with this key is still running; retry later",
        Some(retry_after_ms),
        "idemgate_wait_expired",
    )
}

fn mismatch() -> Reply {
    problem::problem(
        422,
        types::MISMATCH,
        "Idempotency key reused with a different request",
        "this key was used for a request with a different method, path, headers or body",
        None,
        "idemgate_key_reused",
    )
}

fn unavailable(config: &Config) -> Reply {
    problem::problem(
        503,
        types::UNAVAILABLE,
        "Duplicate protection unavailable",
        "the coordination service did not answer; retry later",
        Some(config.breaker.cooldown_ms),
        "idemgate_unavailable",
    )
}

/// A claim answer, validated: anything else is a sidecar failure, never a crash.
fn parse_claim<'a>(answer: Answer<'a>, key: &str) -> Option<(ClaimOutcome, &'a [u8])> {
    let Answer::Http { status: 200, body } = answer else {
        return None;
    };
    let (outcome, payload): (ClaimOutcome, &[u8]) = idemgate_wire::decode(body).ok()?;
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
    let (outcome, payload): (RateOutcome, &[u8]) = idemgate_wire::decode(body).ok()?;
    payload.is_empty().then_some(outcome)
}

fn parse_owner(answer: Answer<'_>) -> Option<OwnerOutcome> {
    let Answer::Http { status: 200, body } = answer else {
        return None;
    };
    let (outcome, payload): (OwnerOutcome, &[u8]) = idemgate_wire::decode(body).ok()?;
    payload.is_empty().then_some(outcome)
}

#[cfg(test)]
mod input_tests;
#[cfg(test)]
mod tests;
