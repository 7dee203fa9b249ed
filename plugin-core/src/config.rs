//! The filter's JSON configuration, validated into the immutable [`Config`] that per-request
//! code reads (explicit defaults, durations as `"30s"`, unknown fields rejected). Nothing here
//! runs per request; the compiled types themselves live in [`crate::spec`].
//!
//! The document is read into one `serde_json::Value` tree and walked by hand through
//! `Section` (`config/section.rs`), which knows the path of every object (`rules[2].key`):
//! type errors and unknown fields name the exact field (`rules[2].key.required: expected a
//! boolean`), and semantic checks do too. Walking one generic tree instead of deriving a
//! deserializer per section is what keeps the filter small: ~15 derived deserializers cost
//! ~60 KiB of wasm.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::sync::Arc;
use alloc::vec::Vec;
use idemgate_wire::{Limits, Mode, WaitPolicy};
use serde_json::Value;

use crate::spec::{
    BreakerConfig, Charset, ClientAbort, Config, Conflict, FailureMode, FingerprintSpec, KeyRules,
    KeySource, Limit, LimitBy, LocalConfig, Matcher, PathMatch, RateSpec, ResponsePolicy, Rule,
    Scope, Segment, SidecarConfig, Tier, Unreplayable,
};

mod section;

pub use section::ConfigError;
use section::{Section, err, kind, parse_duration, strings};

impl SidecarConfig {
    /// Fills `token` from `token_env` through `lookup` (the VM's environment). A named
    /// variable that is missing or unusable fails the configuration: a filter that sends no
    /// token to a sidecar that wants one would answer every protected request 401 -> 503.
    pub fn resolve_token(
        &mut self,
        lookup: impl FnOnce(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        let Some(name) = &self.token_env else {
            return Ok(());
        };
        match lookup(name) {
            Some(token) if valid_token(&token) => {
                self.token = Some(token);
                Ok(())
            }
            // Static messages: the variable's name is in the configuration, and each
            // formatted message costs the filter's size budget.
            Some(_) => Err(err(
                "sidecar.token_env",
                "the VM environment variable is not non-empty visible ASCII",
            )),
            None => Err(err(
                "sidecar.token_env",
                "the VM environment has no such variable (vm_config.environment_variables)",
            )),
        }
    }
}

fn valid_token(token: &str) -> bool {
    !token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod token_env_tests {
    use super::*;

    fn sidecar(fields: &str) -> Result<Config, ConfigError> {
        parse(format!(r#"{{"sidecar":{{"cluster":"c"{fields}}},"rules":[{{}}]}}"#).as_bytes())
    }

    #[test]
    fn the_token_comes_from_the_named_variable() {
        let mut config = sidecar(r#","token_env":"IDEMGATE_SIDECAR_TOKEN""#).unwrap();
        assert_eq!(config.sidecar.token, None);
        config
            .sidecar
            .resolve_token(|name| (name == "IDEMGATE_SIDECAR_TOKEN").then(|| "s3cret".into()))
            .unwrap();
        assert_eq!(config.sidecar.token.as_deref(), Some("s3cret"));
    }

    #[test]
    fn a_missing_or_unusable_variable_fails_the_configuration() {
        let mut config = sidecar(r#","token_env":"T""#).unwrap();
        let e = config.sidecar.clone().resolve_token(|_| None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "sidecar.token_env: the VM environment has no such variable (vm_config.environment_variables)"
        );
        let e = config
            .sidecar
            .resolve_token(|_| Some("a b".into()))
            .unwrap_err();
        assert_eq!(e.path, "sidecar.token_env");
    }

    #[test]
    fn token_and_token_env_exclude_each_other_and_names_are_checked() {
        let e = sidecar(r#","token":"x","token_env":"T""#).unwrap_err();
        assert_eq!(e.path, "sidecar.token_env");
        assert_eq!(
            sidecar(r#","token_env":"A=B""#).unwrap_err().path,
            "sidecar.token_env"
        );
        assert_eq!(
            sidecar(r#","token_env":"""#).unwrap_err().path,
            "sidecar.token_env"
        );
        let mut plain = sidecar(r#","token":"x""#).unwrap();
        plain.sidecar.resolve_token(|_| unreachable!()).unwrap();
        assert_eq!(plain.sidecar.token.as_deref(), Some("x"));
    }
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
/// `application/*+json`: every RFC 6839 `+json` type (`problem+json`, `vnd.api+json`,
/// `hal+json`), replayable as JSON is.
const DEFAULT_CONTENT_TYPES: [&str; 3] = ["application/json", "application/*+json", "text/plain"];
/// Never stored unless configured: a retry of these is a different situation (fresh
/// credentials, after a timeout, after a rate limit), which a replay would deny.
const DEFAULT_EXCEPT: [u16; 5] = [401, 403, 407, 408, 429];
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

/// Parses and validates the plugin configuration bytes; the first error found (what
/// [`parse_all`] lists first), which is what the filter reports on configure.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    parse_all(bytes).map_err(|errors| {
        errors
            .into_iter()
            .next()
            .unwrap_or_else(|| err("configuration", "invalid"))
    })
}

/// Parses and validates the plugin configuration bytes, collecting every error it can find
/// in document order: each top-level field, each rule and each rate limit is checked on its
/// own, and an object's first unknown field is reported alongside its other fields' errors.
/// Within one part (a rule's `key`, the `sidecar`), checking stops at the part's first error.
/// Checks across parts run only when the parts they read were valid: `tick` against the
/// rules' leases needs every rule, `failure_mode: "local"` needs a valid `local`, and
/// duplicate rule names are compared among the valid rules.
pub fn parse_all(bytes: &[u8]) -> Result<Config, Vec<ConfigError>> {
    let mut errors = Errors(Vec::new());
    match compile(bytes, &mut errors) {
        Some(config) if errors.0.is_empty() => Ok(config),
        _ => Err(errors.0),
    }
}

/// The errors found so far, for the parts that are checked independently.
struct Errors(Vec<ConfigError>);

impl Errors {
    /// The value of a part, or `None` with its error recorded.
    fn take<T>(&mut self, part: Result<T, ConfigError>) -> Option<T> {
        part.map_err(|e| self.0.push(e)).ok()
    }
}

/// The document's parts, each with its errors in `errors`; `None` when a part is missing.
fn compile(bytes: &[u8], errors: &mut Errors) -> Option<Config> {
    let doc: Value = errors
        .take(serde_json::from_slice(bytes).map_err(|e| err("configuration", e.to_string())))?;
    let (top, unknown) = errors.take(Section::with_unknown(
        &doc,
        String::new(),
        &[
            "sidecar",
            "failure_mode",
            "shadow",
            "breaker",
            "local",
            "allow_on_headers_stop_iteration",
            "fencing_header",
            "degraded_header",
            "would_block_header",
            "tick",
            "release_attempts",
            "rules",
        ],
    ))?;
    errors.0.extend(unknown);
    let sidecar = errors.take(
        top.section(
            "sidecar",
            &["cluster", "authority", "timeout", "token", "token_env"],
        )
        .and_then(|s| match s {
            Some(s) => compile_sidecar(&s),
            None => Err(err("sidecar", "missing field")),
        }),
    );
    let failure_mode = errors.take(
        top.choice("failure_mode", &["closed", "open", "local"])
            .map(|choice| match choice {
                Some(1) => FailureMode::Open,
                Some(2) => FailureMode::Local,
                _ => FailureMode::Closed,
            }),
    );
    let breaker = errors.take(compile_breaker(&top));
    let local = errors.take(compile_local(&top));
    if let (Some(FailureMode::Local), Some(local)) = (failure_mode, &local)
        && !local.enabled
    {
        errors.0.push(err(
            "failure_mode",
            "\"local\" needs the local tier (local.enabled)",
        ));
    }
    // A wrong flag reads as unset for the rules, which are still checked.
    let allow_stop = errors
        .take(top.bool("allow_on_headers_stop_iteration"))
        .flatten()
        .unwrap_or(false);
    let shadow = errors.take(top.bool("shadow")).flatten().unwrap_or(false);
    let fencing_header = errors.take(
        top.str("fencing_header")
            .and_then(|name| header_name(name.unwrap_or("x-fencing-token"), "fencing_header")),
    );
    let degraded_header = errors
        .take(top.str("degraded_header").and_then(|name| {
            header_name(name.unwrap_or("x-idemgate-degraded"), "degraded_header")
        }));
    // Off unless named: marking shadow forwards is for backends that log it.
    let would_block_header = errors.take(top.str("would_block_header").and_then(|name| {
        name.map(|name| header_name(name, "would_block_header"))
            .transpose()
    }));
    let tick_ms = errors.take(top.duration("tick", 1_000));
    let release_attempts = errors.take(
        top.u32("release_attempts")
            .and_then(|n| bounded(n.unwrap_or(3), 1, 10, "release_attempts")),
    );
    let raw_rules = errors.take(top.array("rules").and_then(|rules| match rules {
        Some(rules) if !rules.is_empty() => Ok(rules),
        _ => Err(err("rules", "at least one rule is required")),
    }))?;
    // The headers the filter sets itself, which no rule may read.
    let own = [
        ("fencing_header", fencing_header.as_deref()),
        ("degraded_header", degraded_header.as_deref()),
        (
            "would_block_header",
            would_block_header.as_ref().and_then(Option::as_deref),
        ),
    ];
    let mut rules = Vec::with_capacity(raw_rules.len());
    for (i, raw) in raw_rules.iter().enumerate() {
        let rule = compile_rule(raw, i, allow_stop, shadow, errors);
        let Some(rule) = errors.take(rule) else {
            continue;
        };
        for (field, name) in request_headers_read(&rule) {
            if let Some((setting, _)) = own.iter().find(|(_, own)| *own == Some(name)) {
                errors.0.push(err(
                    &format!("rules[{i}].{field}"),
                    format!(
                        "`{name}` is the filter's own `{setting}`: it sets that header on what it \
                         forwards and drops a client's copy, so a rule must not read it"
                    ),
                ));
            }
        }
        if rules.iter().any(|r: &Arc<Rule>| r.name == rule.name) {
            errors
                .0
                .push(err(&format!("rules[{i}].name"), "duplicate rule name"));
        }
        rules.push(Arc::new(rule));
    }
    let shortest_lease = rules
        .iter()
        .map(|r| r.lease_ms)
        .min()
        .unwrap_or(DEFAULT_LEASE_MS);
    if let Some(tick_ms) = tick_ms
        && rules.len() == raw_rules.len()
        && tick_ms >= shortest_lease / 2
    {
        errors.0.push(err(
            "tick",
            "must be shorter than half of every rule's lease (renewals run on the tick)",
        ));
    }
    Some(Config {
        sidecar: sidecar?,
        failure_mode: failure_mode?,
        shadow,
        breaker: breaker?,
        local: local?,
        allow_on_headers_stop_iteration: allow_stop,
        fencing_header: fencing_header?,
        degraded_header: degraded_header?,
        would_block_header: would_block_header?,
        tick_ms: tick_ms?,
        release_attempts: release_attempts?,
        rules,
    })
}

fn compile_breaker(top: &Section<'_>) -> Result<BreakerConfig, ConfigError> {
    let breaker = top.optional_section("breaker", &["failures", "cooldown"])?;
    Ok(BreakerConfig {
        failures: positive_u32(breaker.u32("failures")?.unwrap_or(5), "breaker.failures")?,
        cooldown_ms: breaker.duration("cooldown", 5_000)?,
    })
}

fn compile_local(top: &Section<'_>) -> Result<LocalConfig, ConfigError> {
    let local = top.optional_section(
        "local",
        &[
            "enabled",
            "slots",
            "probes",
            "max_response_bytes",
            "rate_slots",
        ],
    )?;
    let local = LocalConfig {
        enabled: local.bool("enabled")?.unwrap_or(true),
        slots: positive_u32(local.u32("slots")?.unwrap_or(4096), "local.slots")?,
        probes: bounded(local.u32("probes")?.unwrap_or(4), 1, 16, "local.probes")?,
        max_response_bytes: local.usize("max_response_bytes")?.unwrap_or(16 * 1024),
        rate_slots: positive_u32(local.u32("rate_slots")?.unwrap_or(4096), "local.rate_slots")?,
    };
    if local.max_response_bytes > Limits::default().max_body {
        return Err(err("local.max_response_bytes", "must not exceed 1048576"));
    }
    Ok(local)
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

/// Every request header a rule reads (to match, key, scope or fingerprint a request), with
/// the setting that names it.
fn request_headers_read(rule: &Rule) -> impl Iterator<Item = (&'static str, &str)> {
    fn named<'r>(
        field: &'static str,
        names: &'r [String],
    ) -> impl Iterator<Item = (&'static str, &'r str)> {
        names.iter().map(move |n| (field, n.as_str()))
    }
    let key = match &rule.key.source {
        KeySource::Header(name) => Some(("key.header", name.as_str())),
        _ => None,
    };
    key.into_iter()
        .chain(named(
            "match.headers_present",
            &rule.matcher.headers_present,
        ))
        .chain(named("scope.headers", &rule.scope.headers))
        .chain(
            rule.fingerprint
                .iter()
                .flat_map(|f| named("fingerprint.headers", &f.headers)),
        )
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

fn compile_sidecar(s: &Section<'_>) -> Result<SidecarConfig, ConfigError> {
    let Some(cluster) = s.string("cluster")? else {
        return Err(err(&s.at("cluster"), "missing field"));
    };
    if cluster.is_empty() {
        return Err(err(&s.at("cluster"), "must not be empty"));
    }
    let token = s.string("token")?;
    if let Some(token) = &token
        && !valid_token(token)
    {
        return Err(err(&s.at("token"), "must be non-empty visible ASCII"));
    }
    let token_env = s.string("token_env")?;
    if let Some(name) = &token_env {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic() && b != b'=') {
            return Err(err(
                &s.at("token_env"),
                "must be an environment variable name (visible ASCII, no `=`)",
            ));
        }
        if token.is_some() {
            return Err(err(
                &s.at("token_env"),
                "set either `token` or `token_env`, not both",
            ));
        }
    }
    Ok(SidecarConfig {
        authority: s.string("authority")?.unwrap_or_else(|| cluster.clone()),
        cluster,
        timeout_ms: s.duration("timeout", DEFAULT_TIMEOUT_MS)?,
        token,
        token_env,
    })
}

fn compile_rule(
    raw: &Value,
    i: usize,
    allow_stop: bool,
    shadow: bool,
    errors: &mut Errors,
) -> Result<Rule, ConfigError> {
    let (r, unknown) = Section::with_unknown(
        raw,
        format!("rules[{i}]"),
        &[
            "name",
            "match",
            "mode",
            "key",
            "scope",
            "fingerprint",
            "on_conflict",
            "queue",
            "on_client_abort",
            "lease",
            "retention",
            "response",
            "rate",
            "grpc",
            "shadow",
        ],
    )?;
    errors.0.extend(unknown);
    let name = r.string("name")?.unwrap_or_else(|| r.path.clone());
    let mode = match r.choice("mode", &["idempotency", "lock"])? {
        Some(1) => Mode::Lock,
        _ => Mode::Idempotency,
    };
    let mut matcher = compile_match(&r.optional_section(
        "match",
        &[
            "methods",
            "path_prefix",
            "path_template",
            "host",
            "headers_present",
        ],
    )?)?;
    if let Some(grpc) = r.section("grpc", &["service", "method"])? {
        compile_grpc(&grpc, &mut matcher)?;
    }
    let mut key = compile_key(
        &r.optional_section(
            "key",
            &[
                "header",
                "path_param",
                "query_param",
                "body_pointer",
                "required",
                "max_length",
                "charset",
            ],
        )?,
        mode,
        &matcher,
        allow_stop,
    )?;
    let scope = r.optional_section("scope", &["headers", "properties", "method"])?;
    let mut properties = Vec::new();
    let properties_at = scope.at("properties");
    for (j, p) in scope
        .array("properties")?
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let at = format!("{properties_at}[{j}]");
        let path = match p {
            Value::Array(parts) => strings(parts, &at)?,
            other => return Err(err(&at, format!("expected an array, got {}", kind(other)))),
        };
        if path.is_empty() {
            return Err(err(&at, "empty property path"));
        }
        properties.push(path);
    }
    let scope = Scope {
        headers: header_names(
            &scope.strings("headers")?.unwrap_or_default(),
            &scope.at("headers"),
        )?,
        properties,
        // A lock protects the resource whatever the method; an idempotency key is per call.
        method: scope.bool("method")?.unwrap_or(mode == Mode::Idempotency),
    };
    let body_key = match &mut key.source {
        KeySource::BodyPointer { max_body, .. } => Some(max_body),
        _ => None,
    };
    let (fingerprint, body_cap) = compile_fingerprint(&r, mode, allow_stop, body_key.is_some())?;
    if let Some(max_body) = body_key {
        *max_body = body_cap;
    }
    let conflict = match r.choice("on_conflict", &["reject", "queue"])? {
        Some(1) => Conflict::Queue(compile_queue(&r.optional_section(
            "queue",
            &["max_wait", "max_queue", "per_waiter", "max_wait_cap"],
        )?)?),
        _ if r.has("queue") => {
            return Err(err(
                &r.at("queue"),
                "only valid with \"on_conflict\": \"queue\"",
            ));
        }
        _ => Conflict::Reject,
    };
    let client_abort = match r.choice("on_client_abort", &["hold", "release"])? {
        Some(1) => ClientAbort::Release,
        _ => ClientAbort::Hold,
    };
    let response = compile_response(&r.optional_section(
        "response",
        &[
            "store",
            "except",
            "max_body_bytes",
            "content_types",
            "headers",
            "unreplayable",
            "grpc_store",
        ],
    )?)?;
    // The rule's own `shadow` overrides the top-level one, and is its limits' default.
    let shadow = r.bool("shadow")?.unwrap_or(shadow);
    let rate = match r.section("rate", &["limits", "tier", "expose", "shadow"])? {
        Some(rate) => Some(compile_rate(&rate, shadow, errors)?),
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
        lease_ms: r.duration("lease", DEFAULT_LEASE_MS)?,
        retention_ms: r.duration("retention", DEFAULT_RETENTION_MS)?,
        response,
        rate,
        shadow,
    })
}

/// A rule's rate limits; each limit's error goes to `errors` and the limit is left out.
fn compile_rate(
    r: &Section<'_>,
    shadow: bool,
    errors: &mut Errors,
) -> Result<RateSpec, ConfigError> {
    let raw_limits = r.array("limits")?.unwrap_or_default();
    if raw_limits.is_empty() || raw_limits.len() > idemgate_wire::MAX_CHECKS {
        return Err(err(&r.at("limits"), "must hold 1 to 4 limits"));
    }
    let limits_at = r.at("limits");
    let mut limits = Vec::with_capacity(raw_limits.len());
    for (j, raw) in raw_limits.iter().enumerate() {
        let limit = compile_limit(raw, format!("{limits_at}[{j}]"));
        limits.extend(errors.take(limit));
    }
    Ok(RateSpec {
        limits,
        tier: match r.choice("tier", &["local", "global", "local_then_global"])? {
            Some(0) => Tier::Local,
            Some(1) => Tier::Global,
            _ => Tier::LocalThenGlobal,
        },
        expose: r.bool("expose")?.unwrap_or(false),
        shadow: r.bool("shadow")?.unwrap_or(shadow),
    })
}

fn compile_limit(raw: &Value, at: String) -> Result<Limit, ConfigError> {
    let limit = Section::of(raw, at, &["by", "requests", "per", "burst"])?;
    let by = match limit.choice("by", &["scope", "key", "scope_and_key"])? {
        Some(0) => LimitBy::Scope,
        Some(1) => LimitBy::Key,
        Some(_) => LimitBy::ScopeAndKey,
        None => return Err(err(&limit.at("by"), "missing field")),
    };
    let requests = match limit.u32("requests")? {
        None => return Err(err(&limit.at("requests"), "missing field")),
        Some(0) => return Err(err(&limit.at("requests"), "must be greater than zero")),
        Some(n) => n,
    };
    if !limit.has("per") {
        return Err(err(&limit.at("per"), "missing field"));
    }
    let per_ms = limit.duration("per", 1)?;
    let interval_us = per_ms.saturating_mul(1_000) / u64::from(requests);
    if interval_us == 0 {
        return Err(err(
            &limit.at("requests"),
            "more than one request per microsecond cannot be limited",
        ));
    }
    let rate = idemgate_wire::Rate {
        interval_us,
        burst: limit.u32("burst")?.unwrap_or(requests),
    };
    if let Err(e) = rate.check() {
        return Err(err(&limit.at("burst"), e.reason));
    }
    Ok(Limit { by, rate })
}

fn compile_match(m: &Section<'_>) -> Result<Matcher, ConfigError> {
    let methods: Vec<String> = match m.strings("methods")? {
        Some(list) if list.is_empty() => {
            return Err(err(&m.at("methods"), "must not be empty"));
        }
        Some(list) => list,
        None => DEFAULT_METHODS.iter().map(|m| (*m).to_string()).collect(),
    };
    for (j, method) in methods.iter().enumerate() {
        if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(err(
                &format!("{}[{j}]", m.at("methods")),
                format!("`{method}` is not an upper-case method"),
            ));
        }
    }
    let path_match = match (m.string("path_prefix")?, m.str("path_template")?) {
        (Some(_), Some(_)) => {
            return Err(err(
                &m.at("path_template"),
                "set either path_prefix or path_template, not both",
            ));
        }
        (Some(p), None) if !p.starts_with('/') => {
            return Err(err(&m.at("path_prefix"), "must start with `/`"));
        }
        (Some(p), None) => PathMatch::Prefix(p),
        (None, Some(t)) => path_template(t).map_err(|e| err(&m.at("path_template"), e))?,
        (None, None) => PathMatch::Any,
    };
    Ok(Matcher {
        methods,
        path: path_match,
        host: m.str("host")?.map(str::to_ascii_lowercase),
        headers_present: header_names(
            &m.strings("headers_present")?.unwrap_or_default(),
            &m.at("headers_present"),
        )?,
        grpc: false,
    })
}

/// A rule's `grpc` section: the rule takes gRPC calls (`POST /package.Service/Method` with a
/// gRPC content type) of one service, or one method; an unnamed part is the path variable
/// `service` or `method` (for `key.path_param`).
fn compile_grpc(g: &Section<'_>, matcher: &mut Matcher) -> Result<(), ConfigError> {
    if !matches!(matcher.path, PathMatch::Any) {
        return Err(err(
            &g.path,
            "a gRPC rule matches by service and method: drop match.path_prefix and match.path_template",
        ));
    }
    let part = |field: &str, variable: &str, allowed: &[u8]| {
        Ok(match g.string(field)? {
            None => Segment::Variable(variable.to_string()),
            Some(name)
                if !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || allowed.contains(&b)) =>
            {
                Segment::Literal(name)
            }
            Some(_) => {
                return Err(err(
                    &g.at(field),
                    "not a gRPC name (letters, digits, `_`; `.` between a service's parts)",
                ));
            }
        })
    };
    let service = part("service", "service", b"._")?;
    let method = part("method", "method", b"_")?;
    matcher.path = PathMatch::Template(alloc::vec![service, method]);
    matcher.grpc = true;
    Ok(())
}

/// Parses `/agents/{agent_id}/mcp`: literal segments and whole-segment `{name}` variables.
fn path_template(t: &str) -> Result<PathMatch, String> {
    let Some(rest) = t.strip_prefix('/') else {
        return Err("must start with `/`".to_string());
    };
    // Canonical paths have no trailing slash (crate::canonical): `/a/{id}/` means `/a/{id}`.
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let mut segments = Vec::new();
    for seg in rest.split('/') {
        if let Some(name) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(format!("`{seg}` is not a variable like {{agent_id}}"));
            }
            if segments.contains(&Segment::Variable(name.to_string())) {
                return Err(format!("variable `{name}` appears twice"));
            }
            segments.push(Segment::Variable(name.to_string()));
        } else if seg.contains(['{', '}']) {
            return Err(format!("`{seg}`: a variable must be a whole segment"));
        } else {
            segments.push(Segment::Literal(seg.to_string()));
        }
    }
    Ok(PathMatch::Template(segments))
}

fn compile_key(
    k: &Section<'_>,
    mode: Mode,
    matcher: &Matcher,
    allow_stop: bool,
) -> Result<KeyRules, ConfigError> {
    let header = k.str("header")?;
    let path_param = k.string("path_param")?;
    let query_param = k.string("query_param")?;
    let body_pointer = k.string("body_pointer")?;
    let sources = [
        header.is_some(),
        path_param.is_some(),
        query_param.is_some(),
        body_pointer.is_some(),
    ];
    if sources.iter().filter(|s| **s).count() > 1 {
        return Err(err(
            &k.path,
            "set only one of header, path_param, query_param and body_pointer",
        ));
    }
    let source = if let Some(h) = header {
        KeySource::Header(header_name(h, &k.at("header"))?)
    } else if let Some(p) = path_param {
        if !matcher.path.has_variable(&p) {
            return Err(err(
                &k.at("path_param"),
                format!("`{p}` is not a variable of match.path_template"),
            ));
        }
        KeySource::PathParam(p)
    } else if let Some(q) = query_param {
        if q.is_empty() {
            return Err(err(&k.at("query_param"), "must not be empty"));
        }
        KeySource::QueryParam(q)
    } else if let Some(pointer) = body_pointer {
        if !allow_stop {
            return Err(err(
                &k.at("body_pointer"),
                "needs \"allow_on_headers_stop_iteration\": true here and in Envoy's filter \
                 config (Envoy >= 1.35), or Envoy holds the body back",
            ));
        }
        // RFC 6901: `/`-prefixed reference tokens, `~` only in the escapes `~0` and `~1`.
        if !pointer.starts_with('/')
            || !pointer
                .split('~')
                .skip(1)
                .all(|rest| rest.starts_with(['0', '1']))
        {
            return Err(err(
                &k.at("body_pointer"),
                "must be an RFC 6901 JSON pointer such as /data/object/id (~0 for ~, ~1 for /)",
            ));
        }
        // The cap is `fingerprint.max_body_bytes`, set by `compile_rule`.
        KeySource::BodyPointer {
            pointer,
            max_body: 0,
        }
    } else if mode == Mode::Idempotency {
        KeySource::Header("idempotency-key".to_string())
    } else {
        return Err(err(
            &k.path,
            "lock mode needs a resource id: header, path_param, query_param or body_pointer",
        ));
    };
    let max_length = k.usize("max_length")?.unwrap_or(MAX_KEY_LENGTH);
    if max_length == 0 || max_length > MAX_KEY_LENGTH {
        return Err(err(&k.at("max_length"), "must be in 1..=255"));
    }
    Ok(KeyRules {
        source,
        required: k.bool("required")?.unwrap_or(true),
        max_length,
        charset: match k.choice("charset", &["printable", "token", "alphanumeric"])? {
            Some(1) => Charset::Token,
            Some(2) => Charset::Alphanumeric,
            _ => Charset::Printable,
        },
    })
}

/// The rule's fingerprint, and the cap on the body it reads before the claim when the key
/// comes from the body (`fingerprint.max_body_bytes` caps both; lock mode, which compares
/// nothing, accepts only that field, and only with a body key).
fn compile_fingerprint(
    rule: &Section<'_>,
    mode: Mode,
    allow_stop: bool,
    body_key: bool,
) -> Result<(Option<FingerprintSpec>, usize), ConfigError> {
    let lock = mode == Mode::Lock;
    if lock && !body_key {
        if rule.has("fingerprint") {
            return Err(err(
                &rule.at("fingerprint"),
                "only valid in idempotency mode (lock mode stores nothing to compare)",
            ));
        }
        return Ok((None, 0));
    }
    let f = rule.optional_section(
        "fingerprint",
        if lock {
            &["max_body_bytes"]
        } else {
            &["headers", "body", "max_body_bytes"]
        },
    )?;
    let body = f.bool("body")?.unwrap_or(allow_stop);
    if body && !allow_stop {
        return Err(err(
            &f.at("body"),
            "needs \"allow_on_headers_stop_iteration\": true here and in Envoy's filter config \
             (Envoy >= 1.35); without it Envoy holds the body while the filter waits, so the \
             fingerprint covers method, path and the chosen headers only",
        ));
    }
    let cap = match f.usize("max_body_bytes")? {
        Some(0) => {
            return Err(err(&f.at("max_body_bytes"), "must be greater than zero"));
        }
        Some(_) if !body && !body_key => {
            return Err(err(
                &f.at("max_body_bytes"),
                "only valid when body is fingerprinted or holds the key",
            ));
        }
        cap => cap.unwrap_or(DEFAULT_FINGERPRINT_BODY),
    };
    let body_cap = if body_key { cap } else { 0 };
    if lock {
        return Ok((None, body_cap));
    }
    Ok((
        Some(FingerprintSpec {
            headers: header_names(&f.strings("headers")?.unwrap_or_default(), &f.at("headers"))?,
            max_body: if body { cap } else { 0 },
        }),
        body_cap,
    ))
}

fn compile_queue(q: &Section<'_>) -> Result<WaitPolicy, ConfigError> {
    let budget_ms = q.duration("max_wait", DEFAULT_MAX_WAIT_MS)?;
    let per_waiter_ms = match q.str("per_waiter")? {
        Some(s) => parse_duration(s).map_err(|m| err(&q.at("per_waiter"), m))?,
        None => 0,
    };
    let max_budget_ms = match q.str("max_wait_cap")? {
        Some(s) => {
            let cap = parse_duration(s).map_err(|m| err(&q.at("max_wait_cap"), m))?;
            if cap < budget_ms {
                return Err(err(&q.at("max_wait_cap"), "must not be below max_wait"));
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
            q.u32("max_queue")?.unwrap_or(DEFAULT_MAX_QUEUE),
            &q.at("max_queue"),
        )?,
    })
}

fn compile_response(r: &Section<'_>) -> Result<ResponsePolicy, ConfigError> {
    let store = r
        .strings("store")?
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
                    &format!("{}[{j}]", r.at("store")),
                    format!("`{other}` is not one of 1xx..5xx"),
                ));
            }
        };
        store_classes |= 1 << bit;
    }
    let except = match r.array("except")? {
        None => DEFAULT_EXCEPT.into(),
        Some(items) => {
            let at = r.at("except");
            let mut codes = Vec::with_capacity(items.len());
            for (j, v) in items.iter().enumerate() {
                match v.as_u64().and_then(|n| u16::try_from(n).ok()) {
                    Some(code) => codes.push(code),
                    None => {
                        return Err(err(
                            &format!("{at}[{j}]"),
                            format!("expected a status code, got {}", kind(v)),
                        ));
                    }
                }
            }
            codes
        }
    };
    let max_body = r.usize("max_body_bytes")?.unwrap_or(DEFAULT_RESPONSE_BODY);
    if max_body > Limits::default().max_body {
        return Err(err(
            &r.at("max_body_bytes"),
            "must not exceed 1048576 (the sidecar's limit)",
        ));
    }
    let content_types = r
        .strings("content_types")?
        .unwrap_or_else(|| {
            DEFAULT_CONTENT_TYPES
                .iter()
                .map(|c| (*c).to_string())
                .collect()
        })
        .into_iter()
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let headers = match r.strings("headers")? {
        Some(h) => header_names(&h, &r.at("headers"))?,
        None => DEFAULT_REPLAYED_HEADERS
            .iter()
            .map(|h| (*h).to_string())
            .collect(),
    };
    for (j, h) in headers.iter().enumerate() {
        if FORBIDDEN_REPLAYED.contains(&h.as_str()) || h.contains("ratelimit") || h.starts_with(':')
        {
            return Err(err(
                &format!("{}[{j}]", r.at("headers")),
                format!("`{h}` is never replayed (it describes the original exchange)"),
            ));
        }
    }
    if headers.len() > Limits::default().max_headers {
        return Err(err(&r.at("headers"), "too many headers"));
    }
    let grpc_store = match r.strings("grpc_store")? {
        None => crate::grpc::DEFAULT_STORED,
        Some(names) => {
            let mut bits = 0u32;
            for name in &names {
                let Some(code) = crate::grpc::CODE_NAMES.iter().position(|n| n == name) else {
                    // Static, unindexed: a formatted message costs the filter's size budget.
                    return Err(err(
                        &r.at("grpc_store"),
                        "a name is not a gRPC status code name (OK, NOT_FOUND, ...)",
                    ));
                };
                bits |= 1 << code;
            }
            bits
        }
    };
    Ok(ResponsePolicy {
        grpc_store,
        store_classes,
        except,
        max_body,
        content_types,
        headers,
        unreplayable: match r.choice("unreplayable", &["abort", "store_status"])? {
            Some(1) => Unreplayable::StoreStatus,
            _ => Unreplayable::Abort,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const MINIMAL: &str = r#"{"sidecar":{"cluster":"idemgate"},"rules":[{}]}"#;

    fn error_of(json: &str) -> String {
        parse(json.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn every_independent_error_is_reported_with_its_path() {
        let json = r#"{
            "sidecar": {"cluster": "c", "timeout": "soon"},
            "colour": "blue",
            "local": {"probes": 99},
            "rules": [
                {"name": "a", "mode": "sometimes", "lease": "10x"},
                {"name": "b"},
                {"name": "c", "key": {"max_length": 300}, "extra": 1},
                {"name": "d", "rate": {"limits": [
                    {"by": "key", "requests": 1, "per": "1s"},
                    {"by": "nobody", "requests": 1, "per": "1s"},
                    {"by": "key", "requests": 0, "per": "1s"}
                ]}}
            ]
        }"#;
        let errors: Vec<String> = parse_all(json.as_bytes())
            .unwrap_err()
            .iter()
            .map(|e| e.path.clone())
            .collect();
        assert_eq!(
            errors,
            [
                "configuration",
                "sidecar.timeout",
                "local.probes",
                "rules[0].mode",
                "rules[2]",
                "rules[2].key.max_length",
                "rules[3].rate.limits[1].by",
                "rules[3].rate.limits[2].requests",
            ]
        );
        // The filter reports the first of them, as before.
        assert_eq!(
            error_of(json),
            "configuration: unknown field `colour`, expected one of `sidecar`, `failure_mode`, \
             `shadow`, `breaker`, `local`, `allow_on_headers_stop_iteration`, `fencing_header`, \
             `degraded_header`, `would_block_header`, `tick`, `release_attempts`, `rules`"
        );
        // Valid parts of a broken document stay quiet; a valid document has no errors.
        assert!(parse_all(MINIMAL.as_bytes()).is_ok());
    }

    #[test]
    fn cross_part_checks_run_on_valid_parts() {
        // A tick too long for a valid rule's lease is reported next to another rule's error
        // only when every rule is valid (the shortest lease is unknown otherwise).
        let tick = r#"{"sidecar":{"cluster":"c"},"tick":"10s","rules":[{"lease":"4s"}]}"#;
        assert_eq!(parse_all(tick.as_bytes()).unwrap_err()[0].path, "tick");
        let broken =
            r#"{"sidecar":{"cluster":"c"},"tick":"10s","rules":[{"lease":"4s"},{"mode":1}]}"#;
        let paths: Vec<String> = parse_all(broken.as_bytes())
            .unwrap_err()
            .into_iter()
            .map(|e| e.path)
            .collect();
        assert_eq!(paths, ["rules[1].mode"]);
        // Duplicate names among valid rules, next to a missing sidecar.
        let duplicate = r#"{"rules":[{"name":"x"},{"name":"x"}]}"#;
        let paths: Vec<String> = parse_all(duplicate.as_bytes())
            .unwrap_err()
            .into_iter()
            .map(|e| e.path)
            .collect();
        assert_eq!(paths, ["sidecar", "rules[1].name"]);
    }

    /// The fencing, degraded and would-block headers are the filter's own: it removes a
    /// client's copies only after the rule has read the request, so a rule reading one would
    /// read what the client chose.
    #[test]
    fn a_rule_must_not_read_the_filters_own_headers() {
        let json = r#"{"sidecar":{"cluster":"c"},"would_block_header":"X-Would-Block","rules":[
            {"name":"a","key":{"header":"X-Fencing-Token"}},
            {"name":"b","scope":{"headers":["x-user-id","x-idemgate-degraded"]}},
            {"name":"c","match":{"headers_present":["x-would-block"]},
             "fingerprint":{"headers":["x-fencing-token"]}},
            {"name":"d","scope":{"headers":["x-user-id"]},"fingerprint":{"headers":["content-type"]}}
        ]}"#;
        let errors = parse_all(json.as_bytes()).unwrap_err();
        let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "rules[0].key.header",
                "rules[1].scope.headers",
                "rules[2].match.headers_present",
                "rules[2].fingerprint.headers",
            ]
        );
        assert!(
            errors[0]
                .to_string()
                .contains("the filter's own `fencing_header`"),
            "{}",
            errors[0]
        );
        // Renamed, the filter's header is free for a rule to read under its old name.
        let renamed = r#"{"sidecar":{"cluster":"c"},"fencing_header":"x-fence",
            "rules":[{"key":{"header":"x-fencing-token"}}]}"#;
        assert!(parse_all(renamed.as_bytes()).is_ok());
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
        let e = error_of(r#"{"sidecar":{"cluster":"x"},"rules":[{"key":{"required":"yes"}}]}"#);
        assert_eq!(
            e,
            "rules[0].key.required: expected a boolean, got string \"yes\""
        );
    }

    #[test]
    fn type_errors_name_the_field_and_what_was_found() {
        for (json, expected) in [
            (r#"[1]"#, "configuration: expected an object, got an array"),
            (r#"{"rules":[{}]}"#, "sidecar: missing field"),
            (
                r#"{"sidecar":{},"rules":[{}]}"#,
                "sidecar.cluster: missing field",
            ),
            (
                r#"{"sidecar":{"cluster":"x"},"rules":{}}"#,
                "rules: expected an array, got an object",
            ),
            (
                r#"{"sidecar":{"cluster":"x"},"rules":[{"match":{"methods":["POST",7]}}]}"#,
                "rules[0].match.methods[1]: expected a string, got a number",
            ),
            (
                r#"{"sidecar":{"cluster":"x"},"local":{"slots":-1},"rules":[{}]}"#,
                "local.slots: expected an integer in 0..=4294967295, got a number",
            ),
            (
                r#"{"sidecar":{"cluster":"x"},"local":{"slots":1.5},"rules":[{}]}"#,
                "local.slots: expected an integer in 0..=4294967295, got a number",
            ),
            (
                r#"{"sidecar":{"cluster":"x"},"rules":[{"response":{"except":[408,70000]}}]}"#,
                "rules[0].response.except[1]: expected a status code, got a number",
            ),
            (
                r#"{"sidecar":{"cluster":"x"},"rules":[{"scope":{"properties":["source"]}}]}"#,
                "rules[0].scope.properties[0]: expected an array, got string \"source\"",
            ),
            (
                r#"{"sidecar":{"cluster":"x"},"failure_mode":"half","rules":[{}]}"#,
                "failure_mode: `half` is not one of `closed`, `open`, `local`",
            ),
        ] {
            assert_eq!(error_of(json), expected, "{json}");
        }
        // The whole document is parsed at once, so a syntax error's position is exact.
        assert_eq!(
            error_of("{\"sidecar\":\n  {\"cluster\" \"x\"}}"),
            "configuration: expected `:` at line 2 column 14"
        );
    }

    #[test]
    fn null_reads_as_absent() {
        let c = parse(
            br#"{"sidecar":{"cluster":"x","timeout":null},"tick":null,"rules":[{"lease":null}]}"#,
        )
        .unwrap();
        assert_eq!(c.sidecar.timeout_ms, DEFAULT_TIMEOUT_MS);
        assert_eq!(c.rules[0].lease_ms, DEFAULT_LEASE_MS);
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
    fn body_pointer_keys() {
        let rules = |top: &str, rule: &str| {
            parse(
                format!(r#"{{"sidecar":{{"cluster":"x"}}{top},"rules":[{{{rule}}}]}}"#).as_bytes(),
            )
        };
        const STOP: &str = r#","allow_on_headers_stop_iteration":true"#;
        let e = rules("", r#""key":{"body_pointer":"/id"}"#).unwrap_err();
        assert_eq!(e.path, "rules[0].key.body_pointer");
        assert!(e.to_string().contains("Envoy >= 1.35"), "{e}");
        for bad in ["id", "", "/a~2", "/a~", "~0"] {
            let e = rules(STOP, &format!(r#""key":{{"body_pointer":"{bad}"}}"#)).unwrap_err();
            assert_eq!(e.path, "rules[0].key.body_pointer", "{bad}");
        }
        let e = rules(STOP, r#""key":{"body_pointer":"/id","header":"x-id"}"#).unwrap_err();
        assert_eq!(e.path, "rules[0].key");
        // Idempotency mode: the body is fingerprinted too, both capped by max_body_bytes.
        let c = rules(
            STOP,
            r#""key":{"body_pointer":"/data/object/id"},"fingerprint":{"max_body_bytes":100}"#,
        )
        .unwrap();
        let r = &c.rules[0];
        assert_eq!(
            r.key.source,
            KeySource::BodyPointer {
                pointer: "/data/object/id".into(),
                max_body: 100
            }
        );
        assert_eq!(
            (r.fingerprint.as_ref().unwrap().max_body, r.body_cap()),
            (100, 100)
        );
        // Without body fingerprints the cap still applies to the key.
        let c = rules(
            STOP,
            r#""key":{"body_pointer":"/id"},"fingerprint":{"body":false,"max_body_bytes":10}"#,
        )
        .unwrap();
        assert_eq!(
            (
                c.rules[0].fingerprint.as_ref().unwrap().max_body,
                c.rules[0].body_cap()
            ),
            (0, 10)
        );
        // Lock mode takes the cap (and only the cap) from `fingerprint`, with a body key.
        let c = rules(STOP, r#""mode":"lock","key":{"body_pointer":"/id"}"#).unwrap();
        assert_eq!(
            (c.rules[0].fingerprint.is_none(), c.rules[0].body_cap()),
            (true, 64 * 1024)
        );
        let c = rules(
            STOP,
            r#""mode":"lock","key":{"body_pointer":"/id"},"fingerprint":{"max_body_bytes":5}"#,
        )
        .unwrap();
        assert_eq!(c.rules[0].body_cap(), 5);
        let e = rules(
            STOP,
            r#""mode":"lock","key":{"body_pointer":"/id"},"fingerprint":{"headers":[]}"#,
        )
        .unwrap_err();
        assert_eq!(e.path, "rules[0].fingerprint");
        let e = rules(
            STOP,
            r#""mode":"lock","key":{"header":"x-id"},"fingerprint":{"max_body_bytes":5}"#,
        )
        .unwrap_err();
        assert_eq!(e.path, "rules[0].fingerprint");
        // A header key's rule reads no body it does not fingerprint.
        let e = rules(STOP, r#""fingerprint":{"body":false,"max_body_bytes":5}"#).unwrap_err();
        assert_eq!(e.path, "rules[0].fingerprint.max_body_bytes");
        assert_eq!(
            rules(STOP, r#""fingerprint":{"body":false}"#)
                .unwrap()
                .rules[0]
                .body_cap(),
            0
        );
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

    #[test]
    fn bad_templates() {
        assert!(path_template("agents").is_err());
        assert!(path_template("/a/{}").is_err());
        assert!(path_template("/a/x{y}").is_err());
        assert!(path_template("/{a}/{a}").is_err());
    }
}

#[cfg(test)]
mod grpc_tests {
    use super::*;

    fn rule(fields: &str) -> Result<Config, Vec<ConfigError>> {
        parse_all(format!(r#"{{"sidecar":{{"cluster":"c"}},"rules":[{{{fields}}}]}}"#).as_bytes())
    }

    fn error_paths(fields: &str) -> Vec<String> {
        rule(fields)
            .unwrap_err()
            .into_iter()
            .map(|e| e.path)
            .collect()
    }

    #[test]
    fn a_grpc_rule_matches_by_service_and_method() {
        let config = rule(r#""grpc":{"service":"pay.v1.Payments","method":"Charge"}"#).unwrap();
        let matcher = &config.rules[0].matcher;
        assert!(matcher.grpc);
        assert!(matcher.path.matches(b"/pay.v1.Payments/Charge"));
        assert!(!matcher.path.matches(b"/pay.v1.Payments/ChargeX"));
        assert!(!matcher.path.matches(b"/pay.v1.Payments"));
        // The service alone: any method, which a lock can be keyed by.
        let config = rule(
            r#""mode":"lock","grpc":{"service":"pay.Payments"},"key":{"path_param":"method"}"#,
        )
        .unwrap();
        assert!(
            config.rules[0]
                .matcher
                .path
                .matches(b"/pay.Payments/Refund")
        );
        assert_eq!(
            config.rules[0].key.source,
            KeySource::PathParam("method".into())
        );
        assert!(rule(r#""grpc":{}"#).unwrap().rules[0].matcher.grpc);
        assert!(!rule("").unwrap().rules[0].matcher.grpc);
    }

    #[test]
    fn grpc_errors_name_the_field() {
        assert_eq!(
            error_paths(r#""grpc":{"service":"pay/Payments"}"#),
            ["rules[0].grpc.service"]
        );
        assert_eq!(
            error_paths(r#""grpc":{"service":"p","method":"a.b"}"#),
            ["rules[0].grpc.method"]
        );
        let unknown = rule(r#""grpc":{"servce":"p"}"#).unwrap_err();
        assert_eq!(unknown[0].path, "rules[0].grpc");
        assert!(unknown[0].to_string().contains("`servce`"), "{unknown:?}");
        assert_eq!(
            error_paths(r#""grpc":{},"match":{"path_prefix":"/x"}"#),
            ["rules[0].grpc"]
        );
        // Both parts named: `method` is no variable to key by.
        assert_eq!(
            error_paths(
                r#""mode":"lock","grpc":{"service":"p","method":"m"},"key":{"path_param":"method"}"#
            ),
            ["rules[0].key.path_param"]
        );
        assert_eq!(
            error_paths(r#""response":{"grpc_store":["OK","NOTFOUND"]}"#),
            ["rules[0].response.grpc_store"]
        );
    }

    #[test]
    fn grpc_store_by_name() {
        let config = rule(r#""response":{"grpc_store":["OK","INTERNAL"]}"#).unwrap();
        let response = &config.rules[0].response;
        assert!(response.stores_grpc(0) && response.stores_grpc(13));
        assert!(!response.stores_grpc(5));
        let default = &rule("").unwrap().rules[0].response;
        assert!(default.stores_grpc(0) && default.stores_grpc(5));
        assert!(!default.stores_grpc(13) && !default.stores_grpc(14) && !default.stores_grpc(4));
    }
}
