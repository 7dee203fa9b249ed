//! The filter's JSON configuration: the raw serde shape (unknown fields rejected, explicit
//! defaults, durations as `"30s"`) and its validation into the immutable [`Config`] that
//! per-request code reads. Nothing here runs per request.
//!
//! Each section is kept as borrowed raw JSON and deserialized separately, so a type error or
//! an unknown field is reported with the path of the section it is in (`rules[2].key: unknown
//! field ...`); semantic checks name the exact field (`rules[2].key.header: ...`). Raw
//! sections rather than a `serde_json::Value` tree keep the filter small: every section is
//! decoded by the one byte-slice deserializer the wire protocol uses as well.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;
use idemgate_wire::{Limits, Mode, WaitPolicy};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::rate::{Limit, LimitBy, RateSpec, Tier};
use crate::rule::{Matcher, PathMatch};

/// An invalid configuration: `path` names the field (`rules[2].key.header`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl core::error::Error for ConfigError {}

fn err(path: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.to_string(),
        message: message.into(),
    }
}

/// What to do when the sidecar is unreachable, slow, answers garbage or the breaker is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Answer 503 with `Retry-After`.
    Closed,
    /// Forward the request, marked with the degraded header.
    Open,
    /// Decide on this gateway's shared data alone.
    Local,
}

/// What happens to a duplicate while the first call is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    Reject,
    Queue(WaitPolicy),
}

/// What a client abort does to a key whose request was already forwarded upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientAbort {
    /// Keep the key until its lease runs out (renewals stop): the backend may still be
    /// running the call, detached from the client, and a retry must not run beside it.
    #[default]
    Hold,
    /// Abort the claim at once, so a retry runs immediately — for backends that stop their
    /// work when the client goes away.
    Release,
}

/// Characters a client key may contain (checked after sf-string unquoting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Charset {
    /// Printable ASCII including space (what an RFC 8941 sf-string can carry).
    Printable,
    /// RFC 9110 `token` characters.
    Token,
    /// `A-Z a-z 0-9 - _ . :` (UUIDs, ULIDs, most generated ids).
    Alphanumeric,
}

impl Charset {
    pub(crate) fn allows(self, b: u8) -> bool {
        match self {
            Charset::Printable => (0x20..=0x7e).contains(&b),
            Charset::Token => b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b),
            Charset::Alphanumeric => b.is_ascii_alphanumeric() || b"-_.:".contains(&b),
        }
    }
}

/// Where the key of a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    Header(String),
    PathParam(String),
    QueryParam(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRules {
    pub source: KeySource,
    pub required: bool,
    pub max_length: usize,
    pub charset: Charset,
}

/// The caller identity a key is bound to, besides the rule (route) and, optionally, method.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    pub headers: Vec<String>,
    pub properties: Vec<Vec<String>>,
    pub method: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintSpec {
    pub headers: Vec<String>,
    /// Body bytes hashed (0 = the body is not part of the fingerprint).
    pub max_body: usize,
}

/// What happens to a response that cannot be replayed (over the cap, streamed, or a content
/// type outside the allow-list).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unreplayable {
    /// Release without storing: a retry runs again.
    Abort,
    /// Store status and headers with an empty body.
    StoreStatus,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponsePolicy {
    /// Status classes stored (2 = 2xx ...), bit per class 1..=5.
    pub store_classes: u8,
    pub except: Vec<u16>,
    pub max_body: usize,
    pub content_types: Vec<String>,
    pub headers: Vec<String>,
    pub unreplayable: Unreplayable,
}

impl ResponsePolicy {
    /// Whether a response with this status is stored (others abort, so a retry runs again).
    pub fn stores(&self, status: u16) -> bool {
        let class = status / 100;
        (1..=5).contains(&class)
            && self.store_classes & (1u8 << class) != 0
            && !self.except.contains(&status)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    pub matcher: Matcher,
    pub mode: Mode,
    pub key: KeyRules,
    pub scope: Scope,
    /// `None` in lock mode.
    pub fingerprint: Option<FingerprintSpec>,
    pub conflict: Conflict,
    pub client_abort: ClientAbort,
    pub lease_ms: u64,
    pub retention_ms: u64,
    pub response: ResponsePolicy,
    /// Rate limits on the rule's requests (`None`: unlimited).
    pub rate: Option<RateSpec>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarConfig {
    pub cluster: String,
    pub authority: String,
    pub timeout_ms: u64,
    pub token: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    pub failures: u32,
    pub cooldown_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalConfig {
    pub enabled: bool,
    pub slots: u32,
    pub probes: u32,
    pub max_response_bytes: usize,
    /// Slots of the rate-limit table (a separate table: limits never evict dedupe entries).
    pub rate_slots: u32,
}

/// The validated, immutable configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub sidecar: SidecarConfig,
    pub failure_mode: FailureMode,
    pub shadow: bool,
    pub breaker: BreakerConfig,
    pub local: LocalConfig,
    pub allow_on_headers_stop_iteration: bool,
    pub fencing_header: String,
    pub degraded_header: String,
    pub tick_ms: u64,
    pub release_attempts: u32,
    pub rules: Vec<Rule>,
}

// === raw shapes ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTop<'a> {
    #[serde(borrow)]
    sidecar: &'a RawValue,
    #[serde(default, borrow)]
    failure_mode: Option<&'a RawValue>,
    #[serde(default)]
    shadow: Option<bool>,
    #[serde(default, borrow)]
    breaker: Option<&'a RawValue>,
    #[serde(default, borrow)]
    local: Option<&'a RawValue>,
    #[serde(default)]
    allow_on_headers_stop_iteration: Option<bool>,
    #[serde(default)]
    fencing_header: Option<String>,
    #[serde(default)]
    degraded_header: Option<String>,
    #[serde(default)]
    tick: Option<String>,
    #[serde(default)]
    release_attempts: Option<u32>,
    #[serde(borrow)]
    rules: Vec<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSidecar {
    cluster: String,
    #[serde(default)]
    authority: Option<String>,
    #[serde(default)]
    timeout: Option<String>,
    #[serde(default)]
    token: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawBreaker {
    #[serde(default)]
    failures: Option<u32>,
    #[serde(default)]
    cooldown: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLocal {
    #[serde(default)]
    enabled: Option<bool>,
    #[serde(default)]
    slots: Option<u32>,
    #[serde(default)]
    probes: Option<u32>,
    #[serde(default)]
    max_response_bytes: Option<usize>,
    #[serde(default)]
    rate_slots: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule<'a> {
    #[serde(default)]
    name: Option<String>,
    #[serde(rename = "match", default, borrow)]
    matcher: Option<&'a RawValue>,
    #[serde(default, borrow)]
    mode: Option<&'a RawValue>,
    #[serde(default, borrow)]
    key: Option<&'a RawValue>,
    #[serde(default, borrow)]
    scope: Option<&'a RawValue>,
    #[serde(default, borrow)]
    fingerprint: Option<&'a RawValue>,
    #[serde(default, borrow)]
    on_conflict: Option<&'a RawValue>,
    #[serde(default, borrow)]
    queue: Option<&'a RawValue>,
    #[serde(default, borrow)]
    on_client_abort: Option<&'a RawValue>,
    #[serde(default)]
    lease: Option<String>,
    #[serde(default)]
    retention: Option<String>,
    #[serde(default, borrow)]
    response: Option<&'a RawValue>,
    #[serde(default, borrow)]
    rate: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRate<'a> {
    #[serde(borrow)]
    limits: Vec<&'a RawValue>,
    #[serde(default)]
    tier: Option<RawTier>,
    #[serde(default)]
    expose: Option<bool>,
    #[serde(default)]
    shadow: Option<bool>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawTier {
    Local,
    Global,
    LocalThenGlobal,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawLimitBy {
    Scope,
    Key,
    ScopeAndKey,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    by: RawLimitBy,
    requests: u32,
    per: String,
    #[serde(default)]
    burst: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    #[serde(default)]
    methods: Option<Vec<String>>,
    #[serde(default)]
    path_prefix: Option<String>,
    #[serde(default)]
    path_template: Option<String>,
    #[serde(default)]
    host: Option<String>,
    #[serde(default)]
    headers_present: Vec<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawKey {
    #[serde(default)]
    header: Option<String>,
    #[serde(default)]
    path_param: Option<String>,
    #[serde(default)]
    query_param: Option<String>,
    #[serde(default)]
    required: Option<bool>,
    #[serde(default)]
    max_length: Option<usize>,
    #[serde(default)]
    charset: Option<Charset>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawScope {
    #[serde(default)]
    headers: Vec<String>,
    #[serde(default)]
    properties: Vec<Vec<String>>,
    #[serde(default)]
    method: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawFingerprint {
    #[serde(default)]
    headers: Vec<String>,
    #[serde(default)]
    body: Option<bool>,
    #[serde(default)]
    max_body_bytes: Option<usize>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum RawConflict {
    Reject,
    Queue,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawQueue {
    #[serde(default)]
    max_wait: Option<String>,
    #[serde(default)]
    max_queue: Option<u32>,
    #[serde(default)]
    per_waiter: Option<String>,
    #[serde(default)]
    max_wait_cap: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawResponse {
    #[serde(default)]
    store: Option<Vec<String>>,
    #[serde(default)]
    except: Option<Vec<u16>>,
    #[serde(default)]
    max_body_bytes: Option<usize>,
    #[serde(default)]
    content_types: Option<Vec<String>>,
    #[serde(default)]
    headers: Option<Vec<String>>,
    #[serde(default)]
    unreplayable: Option<Unreplayable>,
}

// === defaults ===

const DEFAULT_METHODS: [&str; 4] = ["POST", "PUT", "PATCH", "DELETE"];
const DEFAULT_TIMEOUT_MS: u64 = 1_000;
const DEFAULT_LEASE_MS: u64 = 30_000;
const DEFAULT_RETENTION_MS: u64 = 24 * 3_600_000;
const DEFAULT_MAX_WAIT_MS: u64 = 30_000;
const DEFAULT_MAX_QUEUE: u32 = 16;
const DEFAULT_FINGERPRINT_BODY: usize = 64 * 1024;
const DEFAULT_RESPONSE_BODY: usize = 256 * 1024;
const DEFAULT_CONTENT_TYPES: [&str; 3] =
    ["application/json", "application/problem+json", "text/plain"];
const DEFAULT_REPLAYED_HEADERS: [&str; 6] = [
    "content-type",
    "content-language",
    "location",
    "etag",
    "last-modified",
    "link",
];
/// Never replayed: they describe the original exchange, not the resource.
const FORBIDDEN_REPLAYED: [&str; 4] = ["set-cookie", "date", "retry-after", "content-length"];
const MAX_KEY_LENGTH: usize = 255;

/// Parses and validates the plugin configuration bytes.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    let top: RawTop = section(bytes, "configuration")?;
    let sidecar = compile_sidecar(raw_section(top.sidecar, "sidecar")?)?;
    let failure_mode = match top.failure_mode {
        Some(raw) => raw_section(raw, "failure_mode")?,
        None => FailureMode::Closed,
    };
    let breaker: RawBreaker = optional(top.breaker, "breaker")?;
    let breaker = BreakerConfig {
        failures: positive_u32(breaker.failures.unwrap_or(5), "breaker.failures")?,
        cooldown_ms: duration_or(breaker.cooldown.as_deref(), "breaker.cooldown", 5_000)?,
    };
    let local: RawLocal = optional(top.local, "local")?;
    let local = LocalConfig {
        enabled: local.enabled.unwrap_or(true),
        slots: positive_u32(local.slots.unwrap_or(4096), "local.slots")?,
        probes: bounded(local.probes.unwrap_or(4), 1, 16, "local.probes")?,
        max_response_bytes: local.max_response_bytes.unwrap_or(16 * 1024),
        rate_slots: positive_u32(local.rate_slots.unwrap_or(4096), "local.rate_slots")?,
    };
    if local.max_response_bytes > Limits::default().max_body {
        return Err(err("local.max_response_bytes", "must not exceed 1048576"));
    }
    if failure_mode == FailureMode::Local && !local.enabled {
        return Err(err(
            "failure_mode",
            "\"local\" needs the local tier (local.enabled)",
        ));
    }
    let allow_stop = top.allow_on_headers_stop_iteration.unwrap_or(false);
    let fencing_header = header_name(
        top.fencing_header.as_deref().unwrap_or("x-fencing-token"),
        "fencing_header",
    )?;
    let degraded_header = header_name(
        top.degraded_header
            .as_deref()
            .unwrap_or("x-idemgate-degraded"),
        "degraded_header",
    )?;
    let tick_ms = duration_or(top.tick.as_deref(), "tick", 1_000)?;
    let release_attempts = bounded(top.release_attempts.unwrap_or(3), 1, 10, "release_attempts")?;
    if top.rules.is_empty() {
        return Err(err("rules", "at least one rule is required"));
    }
    let mut rules = Vec::with_capacity(top.rules.len());
    for (i, raw) in top.rules.into_iter().enumerate() {
        let rule = compile_rule(raw, i, allow_stop, top.shadow.unwrap_or(false))?;
        if rules.iter().any(|r: &Rule| r.name == rule.name) {
            return Err(err(&format!("rules[{i}].name"), "duplicate rule name"));
        }
        rules.push(rule);
    }
    let shortest_lease = rules
        .iter()
        .map(|r| r.lease_ms)
        .min()
        .unwrap_or(DEFAULT_LEASE_MS);
    if tick_ms >= shortest_lease / 2 {
        return Err(err(
            "tick",
            "must be shorter than half of every rule's lease (renewals run on the tick)",
        ));
    }
    Ok(Config {
        sidecar,
        failure_mode,
        shadow: top.shadow.unwrap_or(false),
        breaker,
        local,
        allow_on_headers_stop_iteration: allow_stop,
        fencing_header,
        degraded_header,
        tick_ms,
        release_attempts,
        rules,
    })
}

/// Deserializes one section (the whole configuration, or a raw part of it); errors name `path`.
fn section<'a, T: Deserialize<'a>>(json: &'a [u8], path: &str) -> Result<T, ConfigError> {
    serde_json::from_slice(json).map_err(|e| {
        // The position is relative to the section, not to the configuration: misleading, so
        // only the path locates the error.
        let message = e.to_string();
        let position = format!(" at line {} column {}", e.line(), e.column());
        let message = message.strip_suffix(&position).unwrap_or(&message);
        err(path, message)
    })
}

fn raw_section<'a, T: Deserialize<'a>>(raw: &'a RawValue, path: &str) -> Result<T, ConfigError> {
    section(raw.get().as_bytes(), path)
}

fn optional<'a, T: Deserialize<'a> + Default>(
    raw: Option<&'a RawValue>,
    path: &str,
) -> Result<T, ConfigError> {
    raw.map_or_else(|| Ok(T::default()), |raw| raw_section(raw, path))
}

fn positive_u32(v: u32, path: &str) -> Result<u32, ConfigError> {
    bounded(v, 1, u32::MAX, path)
}

fn bounded(v: u32, min: u32, max: u32, path: &str) -> Result<u32, ConfigError> {
    if v < min || v > max {
        return Err(err(path, format!("must be in {min}..={max}")));
    }
    Ok(v)
}

fn duration_or(raw: Option<&str>, path: &str, default_ms: u64) -> Result<u64, ConfigError> {
    let ms = match raw {
        Some(s) => parse_duration(s).map_err(|m| err(path, m))?,
        None => default_ms,
    };
    if ms == 0 {
        return Err(err(path, "must be greater than zero"));
    }
    Ok(ms)
}

/// `"250ms"`, `"30s"`, `"5m"`, `"24h"` → milliseconds.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let n: u64 = number.parse().map_err(|_| {
        format!("`{s}` is not a duration like \"250ms\", \"30s\", \"5m\" or \"24h\"")
    })?;
    let factor = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(format!("`{s}` has no unit (ms, s, m or h)")),
    };
    n.checked_mul(factor)
        .ok_or_else(|| format!("`{s}` is too large"))
}

fn header_name(name: &str, path: &str) -> Result<String, ConfigError> {
    let lower = name.to_ascii_lowercase();
    if lower.is_empty()
        || !lower
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    {
        return Err(err(path, format!("`{name}` is not a valid header name")));
    }
    Ok(lower)
}

fn header_names(names: &[String], path: &str) -> Result<Vec<String>, ConfigError> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| header_name(n, &format!("{path}[{i}]")))
        .collect()
}

fn compile_sidecar(raw: RawSidecar) -> Result<SidecarConfig, ConfigError> {
    if raw.cluster.is_empty() {
        return Err(err("sidecar.cluster", "must not be empty"));
    }
    if let Some(token) = &raw.token
        && (token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err(err("sidecar.token", "must be non-empty visible ASCII"));
    }
    Ok(SidecarConfig {
        authority: raw.authority.unwrap_or_else(|| raw.cluster.clone()),
        cluster: raw.cluster,
        timeout_ms: duration_or(
            raw.timeout.as_deref(),
            "sidecar.timeout",
            DEFAULT_TIMEOUT_MS,
        )?,
        token: raw.token,
    })
}

fn compile_rule(
    raw: &RawValue,
    i: usize,
    allow_stop: bool,
    shadow: bool,
) -> Result<Rule, ConfigError> {
    let at = |field: &str| format!("rules[{i}].{field}");
    let raw: RawRule = raw_section(raw, &format!("rules[{i}]"))?;
    let name = raw.name.unwrap_or_else(|| format!("rules[{i}]"));
    let mode: Mode = match raw.mode {
        Some(mode) => raw_section(mode, &at("mode"))?,
        None => Mode::Idempotency,
    };
    let matcher = compile_match(optional(raw.matcher, &at("match"))?, &at("match"))?;
    let key = compile_key(optional(raw.key, &at("key"))?, mode, &matcher, &at("key"))?;
    let scope: RawScope = optional(raw.scope, &at("scope"))?;
    for (j, p) in scope.properties.iter().enumerate() {
        if p.is_empty() {
            return Err(err(
                &format!("{}[{j}]", at("scope.properties")),
                "empty property path",
            ));
        }
    }
    let scope = Scope {
        headers: header_names(&scope.headers, &at("scope.headers"))?,
        properties: scope.properties,
        // A lock protects the resource whatever the method; an idempotency key is per call.
        method: scope.method.unwrap_or(mode == Mode::Idempotency),
    };
    let fingerprint = compile_fingerprint(raw.fingerprint, mode, allow_stop, &at("fingerprint"))?;
    let conflict: RawConflict = match raw.on_conflict {
        Some(conflict) => raw_section(conflict, &at("on_conflict"))?,
        None => RawConflict::Reject,
    };
    let conflict = match conflict {
        RawConflict::Reject if raw.queue.is_some() => {
            return Err(err(
                &at("queue"),
                "only valid with \"on_conflict\": \"queue\"",
            ));
        }
        RawConflict::Reject => Conflict::Reject,
        RawConflict::Queue => Conflict::Queue(compile_queue(
            optional(raw.queue, &at("queue"))?,
            &at("queue"),
        )?),
    };
    let client_abort = match raw.on_client_abort {
        Some(abort) => raw_section(abort, &at("on_client_abort"))?,
        None => ClientAbort::default(),
    };
    let response = compile_response(optional(raw.response, &at("response"))?, &at("response"))?;
    let rate = match raw.rate {
        Some(r) => Some(compile_rate(
            raw_section(r, &at("rate"))?,
            shadow,
            &at("rate"),
        )?),
        None => None,
    };
    Ok(Rule {
        name,
        matcher,
        mode,
        key,
        scope,
        fingerprint,
        conflict,
        client_abort,
        lease_ms: duration_or(raw.lease.as_deref(), &at("lease"), DEFAULT_LEASE_MS)?,
        retention_ms: duration_or(
            raw.retention.as_deref(),
            &at("retention"),
            DEFAULT_RETENTION_MS,
        )?,
        response,
        rate,
    })
}

fn compile_rate(raw: RawRate<'_>, shadow: bool, path: &str) -> Result<RateSpec, ConfigError> {
    if raw.limits.is_empty() || raw.limits.len() > idemgate_wire::MAX_CHECKS {
        return Err(err(&format!("{path}.limits"), "must hold 1 to 4 limits"));
    }
    let mut limits = Vec::with_capacity(raw.limits.len());
    for (j, limit) in raw.limits.into_iter().enumerate() {
        let at = format!("{path}.limits[{j}]");
        let limit: RawLimit = raw_section(limit, &at)?;
        if limit.requests == 0 {
            return Err(err(&format!("{at}.requests"), "must be greater than zero"));
        }
        let per_ms = duration_or(Some(&limit.per), &format!("{at}.per"), 1)?;
        let interval_us = per_ms.saturating_mul(1_000) / u64::from(limit.requests);
        if interval_us == 0 {
            return Err(err(
                &format!("{at}.requests"),
                "more than one request per microsecond cannot be limited",
            ));
        }
        let rate = idemgate_wire::Rate {
            interval_us,
            burst: limit.burst.unwrap_or(limit.requests),
        };
        if let Err(e) = rate.check() {
            return Err(err(&format!("{at}.burst"), e.reason));
        }
        let by = match limit.by {
            RawLimitBy::Scope => LimitBy::Scope,
            RawLimitBy::Key => LimitBy::Key,
            RawLimitBy::ScopeAndKey => LimitBy::ScopeAndKey,
        };
        limits.push(Limit { by, rate });
    }
    Ok(RateSpec {
        limits,
        tier: match raw.tier.unwrap_or(RawTier::LocalThenGlobal) {
            RawTier::Local => Tier::Local,
            RawTier::Global => Tier::Global,
            RawTier::LocalThenGlobal => Tier::LocalThenGlobal,
        },
        expose: raw.expose.unwrap_or(false),
        shadow: raw.shadow.unwrap_or(shadow),
    })
}

fn compile_match(raw: RawMatch, path: &str) -> Result<Matcher, ConfigError> {
    let methods: Vec<String> = match raw.methods {
        Some(m) if m.is_empty() => {
            return Err(err(&format!("{path}.methods"), "must not be empty"));
        }
        Some(m) => m,
        None => DEFAULT_METHODS.iter().map(|m| (*m).to_string()).collect(),
    };
    for (j, m) in methods.iter().enumerate() {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(err(
                &format!("{path}.methods[{j}]"),
                format!("`{m}` is not an upper-case method"),
            ));
        }
    }
    let path_match = match (raw.path_prefix, raw.path_template) {
        (Some(_), Some(_)) => {
            return Err(err(
                &format!("{path}.path_template"),
                "set either path_prefix or path_template, not both",
            ));
        }
        (Some(p), None) if !p.starts_with('/') => {
            return Err(err(&format!("{path}.path_prefix"), "must start with `/`"));
        }
        (Some(p), None) => PathMatch::Prefix(p),
        (None, Some(t)) => {
            PathMatch::template(&t).map_err(|m| err(&format!("{path}.path_template"), m))?
        }
        (None, None) => PathMatch::Any,
    };
    Ok(Matcher {
        methods,
        path: path_match,
        host: raw.host.map(|h| h.to_ascii_lowercase()),
        headers_present: header_names(&raw.headers_present, &format!("{path}.headers_present"))?,
    })
}

fn compile_key(
    raw: RawKey,
    mode: Mode,
    matcher: &Matcher,
    path: &str,
) -> Result<KeyRules, ConfigError> {
    let sources = [
        raw.header.is_some(),
        raw.path_param.is_some(),
        raw.query_param.is_some(),
    ];
    if sources.iter().filter(|s| **s).count() > 1 {
        return Err(err(
            path,
            "set only one of header, path_param and query_param",
        ));
    }
    let source = if let Some(h) = raw.header {
        KeySource::Header(header_name(&h, &format!("{path}.header"))?)
    } else if let Some(p) = raw.path_param {
        if !matcher.path.has_variable(&p) {
            return Err(err(
                &format!("{path}.path_param"),
                format!("`{p}` is not a variable of match.path_template"),
            ));
        }
        KeySource::PathParam(p)
    } else if let Some(q) = raw.query_param {
        if q.is_empty() {
            return Err(err(&format!("{path}.query_param"), "must not be empty"));
        }
        KeySource::QueryParam(q)
    } else if mode == Mode::Idempotency {
        KeySource::Header("idempotency-key".to_string())
    } else {
        return Err(err(
            path,
            "lock mode needs a resource id: header, path_param or query_param",
        ));
    };
    let max_length = raw.max_length.unwrap_or(MAX_KEY_LENGTH);
    if max_length == 0 || max_length > MAX_KEY_LENGTH {
        return Err(err(&format!("{path}.max_length"), "must be in 1..=255"));
    }
    Ok(KeyRules {
        source,
        required: raw.required.unwrap_or(true),
        max_length,
        charset: raw.charset.unwrap_or(Charset::Printable),
    })
}

fn compile_fingerprint(
    raw: Option<&RawValue>,
    mode: Mode,
    allow_stop: bool,
    path: &str,
) -> Result<Option<FingerprintSpec>, ConfigError> {
    if mode == Mode::Lock {
        if raw.is_some() {
            return Err(err(
                path,
                "only valid in idempotency mode (lock mode stores nothing to compare)",
            ));
        }
        return Ok(None);
    }
    let raw: RawFingerprint = optional(raw, path)?;
    let body = raw.body.unwrap_or(allow_stop);
    if body && !allow_stop {
        return Err(err(
            &format!("{path}.body"),
            "needs \"allow_on_headers_stop_iteration\": true here and in Envoy's filter config \
             (Envoy >= 1.35); without it Envoy holds the body while the filter waits, so the \
             fingerprint covers method, path and the chosen headers only",
        ));
    }
    let max_body = if body {
        let cap = raw.max_body_bytes.unwrap_or(DEFAULT_FINGERPRINT_BODY);
        if cap == 0 {
            return Err(err(
                &format!("{path}.max_body_bytes"),
                "must be greater than zero",
            ));
        }
        cap
    } else {
        if raw.max_body_bytes.is_some() {
            return Err(err(
                &format!("{path}.max_body_bytes"),
                "only valid when body is fingerprinted",
            ));
        }
        0
    };
    Ok(Some(FingerprintSpec {
        headers: header_names(&raw.headers, &format!("{path}.headers"))?,
        max_body,
    }))
}

fn compile_queue(raw: RawQueue, path: &str) -> Result<WaitPolicy, ConfigError> {
    let budget_ms = duration_or(
        raw.max_wait.as_deref(),
        &format!("{path}.max_wait"),
        DEFAULT_MAX_WAIT_MS,
    )?;
    let per_waiter_ms = match raw.per_waiter.as_deref() {
        Some(s) => parse_duration(s).map_err(|m| err(&format!("{path}.per_waiter"), m))?,
        None => 0,
    };
    let max_budget_ms = match raw.max_wait_cap.as_deref() {
        Some(s) => {
            let cap = parse_duration(s).map_err(|m| err(&format!("{path}.max_wait_cap"), m))?;
            if cap < budget_ms {
                return Err(err(
                    &format!("{path}.max_wait_cap"),
                    "must not be below max_wait",
                ));
            }
            cap
        }
        None => budget_ms,
    };
    Ok(WaitPolicy {
        budget_ms,
        per_waiter_ms,
        max_budget_ms,
        max_queue: positive_u32(
            raw.max_queue.unwrap_or(DEFAULT_MAX_QUEUE),
            &format!("{path}.max_queue"),
        )?,
    })
}

fn compile_response(raw: RawResponse, path: &str) -> Result<ResponsePolicy, ConfigError> {
    let store = raw
        .store
        .unwrap_or_else(|| ["2xx".to_string(), "4xx".to_string()].into());
    let mut store_classes = 0u8;
    for (j, class) in store.iter().enumerate() {
        let bit = match class.as_str() {
            "1xx" => 1,
            "2xx" => 2,
            "3xx" => 3,
            "4xx" => 4,
            "5xx" => 5,
            other => {
                return Err(err(
                    &format!("{path}.store[{j}]"),
                    format!("`{other}` is not one of 1xx..5xx"),
                ));
            }
        };
        store_classes |= 1 << bit;
    }
    let except = raw.except.unwrap_or_else(|| [408, 429].into());
    let max_body = raw.max_body_bytes.unwrap_or(DEFAULT_RESPONSE_BODY);
    if max_body > Limits::default().max_body {
        return Err(err(
            &format!("{path}.max_body_bytes"),
            "must not exceed 1048576 (the sidecar's limit)",
        ));
    }
    let content_types = raw
        .content_types
        .unwrap_or_else(|| {
            DEFAULT_CONTENT_TYPES
                .iter()
                .map(|c| (*c).to_string())
                .collect()
        })
        .into_iter()
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let headers = match raw.headers {
        Some(h) => header_names(&h, &format!("{path}.headers"))?,
        None => DEFAULT_REPLAYED_HEADERS
            .iter()
            .map(|h| (*h).to_string())
            .collect(),
    };
    for (j, h) in headers.iter().enumerate() {
        if FORBIDDEN_REPLAYED.contains(&h.as_str()) || h.contains("ratelimit") || h.starts_with(':')
        {
            return Err(err(
                &format!("{path}.headers[{j}]"),
                format!("`{h}` is never replayed (it describes the original exchange)"),
            ));
        }
    }
    if headers.len() > Limits::default().max_headers {
        return Err(err(&format!("{path}.headers"), "too many headers"));
    }
    Ok(ResponsePolicy {
        store_classes,
        except,
        max_body,
        content_types,
        headers,
        unreplayable: raw.unreplayable.unwrap_or(Unreplayable::Abort),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    pub(crate) const MINIMAL: &str = r#"{"sidecar":{"cluster":"idemgate"},"rules":[{}]}"#;

    fn error_of(json: &str) -> String {
        parse(json.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = parse(MINIMAL.as_bytes()).unwrap();
        assert_eq!(c.failure_mode, FailureMode::Closed);
        assert_eq!(c.fencing_header, "x-fencing-token");
        let r = &c.rules[0];
        assert_eq!(r.name, "rules[0]");
        assert_eq!(r.mode, Mode::Idempotency);
        assert_eq!(r.key.source, KeySource::Header("idempotency-key".into()));
        assert_eq!(r.key.max_length, 255);
        assert_eq!(r.client_abort, ClientAbort::Hold);
        assert_eq!(r.lease_ms, 30_000);
        assert_eq!(r.retention_ms, 86_400_000);
        assert_eq!(r.conflict, Conflict::Reject);
        assert_eq!(r.fingerprint.as_ref().unwrap().max_body, 0);
        assert!(r.response.stores(201) && r.response.stores(404));
        assert!(!r.response.stores(408) && !r.response.stores(429) && !r.response.stores(500));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(250));
        assert_eq!(parse_duration("30s"), Ok(30_000));
        assert_eq!(parse_duration("5m"), Ok(300_000));
        assert_eq!(parse_duration("24h"), Ok(86_400_000));
        assert!(parse_duration("30").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("1.5s").is_err());
        assert!(parse_duration("99999999999999999999h").is_err());
    }

    #[test]
    fn errors_name_the_field() {
        assert!(error_of(r#"{"sidecar":{"cluster":"x"},"rules":[]}"#).starts_with("rules:"));
        assert!(
            error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{}],"bogus":1}"#)
                .starts_with("configuration: unknown field `bogus`")
        );
        assert!(
            error_of(
                r#"{"sidecar":{"cluster":"x"},"rules":[{},{},{"key":{"header":"bad header"}}]}"#
            )
            .starts_with("rules[2].key.header: ")
        );
        assert!(
            error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"key":{"nope":1}}]}"#)
                .starts_with("rules[0].key: unknown field `nope`")
        );
        assert!(
            error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"lease":"10"}]}"#)
                .starts_with("rules[0].lease: ")
        );
        assert!(
            error_of(r#"{"sidecar":{"cluster":""},"rules":[{}]}"#).starts_with("sidecar.cluster: ")
        );
        assert!(
            error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"match":{"methods":["post"]}}]}"#)
                .starts_with("rules[0].match.methods[0]: ")
        );
        assert!(
            error_of(
                r#"{"sidecar":{"cluster":"x"},"rules":[{"response":{"headers":["Set-Cookie"]}}]}"#
            )
            .starts_with("rules[0].response.headers[0]: ")
        );
        assert!(
            error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"queue":{}}]}"#)
                .starts_with("rules[0].queue: ")
        );
        assert!(
            error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"name":"a"},{"name":"a"}]}"#)
                .starts_with("rules[1].name: ")
        );
        assert!(error_of("not json").starts_with("configuration: "));
        // A section's own line/column would mislead (it is relative to the section).
        let e = error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"key":{"required":"yes"}}]}"#);
        assert_eq!(
            e,
            "rules[0].key: invalid type: string \"yes\", expected a boolean"
        );
    }

    #[test]
    fn body_fingerprint_needs_allow_on_headers_stop_iteration() {
        let e = error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"fingerprint":{"body":true}}]}"#);
        assert!(e.starts_with("rules[0].fingerprint.body: "), "{e}");
        assert!(e.contains("method, path and the chosen headers only"));
        let c = parse(
            br#"{"sidecar":{"cluster":"x"},"allow_on_headers_stop_iteration":true,"rules":[{}]}"#,
        )
        .unwrap();
        assert_eq!(c.rules[0].fingerprint.as_ref().unwrap().max_body, 64 * 1024);
    }

    #[test]
    fn lock_mode_needs_a_resource_id_from_the_template() {
        let e = error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"mode":"lock"}]}"#);
        assert!(e.starts_with("rules[0].key: "), "{e}");
        let e = error_of(
            r#"{"sidecar":{"cluster":"x"},"rules":[{"mode":"lock","match":{"path_template":"/agents/{id}/mcp"},"key":{"path_param":"agent_id"}}]}"#,
        );
        assert!(e.starts_with("rules[0].key.path_param: "), "{e}");
        let c = parse(
            br#"{"sidecar":{"cluster":"x"},"rules":[{"mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp"},"key":{"path_param":"agent_id"},"on_conflict":"queue","queue":{"max_wait":"10s","max_queue":4}}]}"#,
        )
        .unwrap();
        let r = &c.rules[0];
        assert!(r.fingerprint.is_none());
        assert_eq!(
            r.conflict,
            Conflict::Queue(WaitPolicy {
                budget_ms: 10_000,
                per_waiter_ms: 0,
                max_budget_ms: 10_000,
                max_queue: 4
            })
        );
    }

    #[test]
    fn tick_must_allow_renewals() {
        let e = error_of(r#"{"sidecar":{"cluster":"x"},"tick":"20s","rules":[{}]}"#);
        assert!(e.starts_with("tick: "), "{e}");
    }

    #[test]
    fn on_client_abort_is_hold_or_release() {
        let c = parse(
            br#"{"sidecar":{"cluster":"x"},"rules":[{"on_client_abort":"release"},{"on_client_abort":"hold"}]}"#,
        )
        .unwrap();
        assert_eq!(c.rules[0].client_abort, ClientAbort::Release);
        assert_eq!(c.rules[1].client_abort, ClientAbort::Hold);
        let e = error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"on_client_abort":"later"}]}"#);
        assert!(e.starts_with("rules[0].on_client_abort: "), "{e}");
    }
}
