//! The compiled configuration: what [`crate::config::parse`] produces and per-request code
//! reads. Plain data with the few questions each part answers about itself (does this status
//! get stored, does this path match); nothing here parses, and nothing here depends on another
//! module of the crate.

use alloc::string::String;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::ops::Range;
use idemgate_wire::{Mode, Rate, WaitPolicy};

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
    /// Request header marking a request forwarded by shadow mode that would have been
    /// blocked, with the decision (`None`: no mark). Removed from every request when set.
    pub would_block_header: Option<String>,
    pub tick_ms: u64,
    pub release_attempts: u32,
    /// Shared (`Arc`: a plain counter in the single-threaded wasm) so that a request's flow
    /// holds the rule it matched for its whole life.
    pub rules: Vec<Arc<Rule>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarConfig {
    pub cluster: String,
    pub authority: String,
    pub timeout_ms: u64,
    pub token: Option<String>,
    /// `sidecar.token_env`: the VM environment variable holding the token, so that a
    /// Kubernetes Secret reaches the filter without being written into a custom resource.
    /// Read once by the glue at configure time (`SidecarConfig::resolve_token`).
    pub token_env: Option<String>,
}

/// What to do when the sidecar is unreachable, slow, answers garbage or the breaker is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Answer 503 with `Retry-After`.
    Closed,
    /// Forward the request, marked with the degraded header.
    Open,
    /// Decide on this gateway's shared data alone.
    Local,
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
    /// Decide, log and count, never block (the rule's `shadow`, else the top-level one).
    pub shadow: bool,
}

impl Rule {
    /// The most request body the filter buffers before it claims (0: it reads no body): the
    /// body fingerprint's and the body key's cap, one `fingerprint.max_body_bytes`.
    pub(crate) fn body_cap(&self) -> usize {
        match &self.key.source {
            KeySource::BodyPointer { max_body, .. } => *max_body,
            _ => self.fingerprint.as_ref().map_or(0, |f| f.max_body),
        }
    }
}

// === which requests a rule takes ===

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    pub methods: Vec<String>,
    pub path: PathMatch,
    pub host: Option<String>,
    pub headers_present: Vec<String>,
    /// Only gRPC calls (the rule's `grpc` section): the request's content type is read after
    /// the path matched.
    pub grpc: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Any,
    Prefix(String),
    Template(Vec<Segment>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Literal(String),
    Variable(String),
}

impl PathMatch {
    pub(crate) fn has_variable(&self, name: &str) -> bool {
        matches!(self, PathMatch::Template(s) if s.iter().any(|seg| matches!(seg, Segment::Variable(v) if v == name)))
    }

    /// Whether a canonical path (query already stripped) falls under this match.
    pub(crate) fn matches(&self, path: &[u8]) -> bool {
        match self {
            PathMatch::Any => true,
            // `/payments/` also covers `/payments`, which is how a canonical path spells it.
            PathMatch::Prefix(p) => {
                path.starts_with(p.as_bytes())
                    || p.strip_suffix('/').is_some_and(|p| p.as_bytes() == path)
            }
            PathMatch::Template(_) => self.variable_span(path, None).is_some(),
        }
    }

    /// Matches `path` (query already stripped) against a template; returns the value of
    /// variable `name` (or an empty slice when `name` is `None` and the template matches).
    pub(crate) fn variable<'p>(&self, path: &'p [u8], name: Option<&str>) -> Option<&'p [u8]> {
        self.variable_span(path, name)
            .and_then(|span| path.get(span))
    }

    /// [`PathMatch::variable`] as where the value is in `path` (an empty range at 0 when
    /// `name` is `None`).
    pub(crate) fn variable_span(&self, path: &[u8], name: Option<&str>) -> Option<Range<usize>> {
        let PathMatch::Template(segments) = self else {
            return None;
        };
        let mut parts = path.strip_prefix(b"/")?.split(|b| *b == b'/');
        let mut start = 1;
        let mut found = 0..0;
        for seg in segments {
            let part = parts.next()?;
            let span = start..start + part.len();
            start = span.end + 1;
            match seg {
                Segment::Literal(l) if l.as_bytes() != part => return None,
                Segment::Literal(_) => {}
                Segment::Variable(_) if part.is_empty() => return None,
                Segment::Variable(v) => {
                    if name == Some(v.as_str()) {
                        found = span;
                    }
                }
            }
        }
        if parts.next().is_some() {
            return None;
        }
        Some(found)
    }
}

// === the key and what it is bound to ===

/// Where the key of a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    Header(String),
    PathParam(String),
    QueryParam(String),
    /// `key.body_pointer`: a field of the JSON body (an RFC 6901 pointer, validated), read
    /// once the whole body is buffered, at most `max_body` bytes of it.
    BodyPointer {
        pointer: String,
        max_body: usize,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRules {
    pub source: KeySource,
    pub required: bool,
    pub max_length: usize,
    pub charset: Charset,
}

/// Characters a client key may contain (checked after sf-string unquoting).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

// === duplicates, aborts, responses ===

/// What happens to a duplicate while the first call is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    Reject,
    Queue(WaitPolicy),
}

/// What a client abort does to a key whose request was already forwarded upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClientAbort {
    /// Keep the key until its lease runs out (renewals stop): the backend may still be
    /// running the call, detached from the client, and a retry must not run beside it.
    #[default]
    Hold,
    /// Abort the claim at once, so a retry runs immediately — for backends that stop their
    /// work when the client goes away.
    Release,
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
    /// The gRPC status codes stored, bit per code 0..=16 (a gRPC call's outcome is its
    /// `grpc-status`, not the HTTP status).
    pub grpc_store: u32,
}

impl ResponsePolicy {
    /// Whether a response with this status is stored (others abort, so a retry runs again).
    pub(crate) fn stores(&self, status: u16) -> bool {
        let class = status / 100;
        (1..=5).contains(&class)
            && self.store_classes & (1u8 << class) != 0
            && !self.except.contains(&status)
    }

    /// Whether a gRPC call that ended with this status is stored (others abort).
    pub(crate) fn stores_grpc(&self, code: u8) -> bool {
        code < 32 && self.grpc_store & (1u32 << code) != 0
    }
}

/// What happens to a response that cannot be replayed (over the cap, streamed, or a content
/// type outside the allow-list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreplayable {
    /// Release without storing: a retry runs again.
    Abort,
    /// Store status and headers with an empty body.
    StoreStatus,
}

// === rate limits ===

/// A rule's compiled `rate` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateSpec {
    pub limits: Vec<Limit>,
    pub tier: Tier,
    /// Add `RateLimit-Policy` / `RateLimit` to forwarded responses too.
    pub expose: bool,
    /// Count what would be limited, never limit.
    pub shadow: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub by: LimitBy,
    pub rate: Rate,
}

/// What a limit counts requests by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitBy {
    /// The caller (the rule's `scope`: headers and properties).
    Scope,
    /// The resource key (the rule's `key`).
    Key,
    /// Each caller on each key.
    ScopeAndKey,
}

impl LimitBy {
    /// The configuration's name, also the item name in the `RateLimit` fields.
    pub(crate) fn name(self) -> &'static str {
        match self {
            LimitBy::Scope => "scope",
            LimitBy::Key => "key",
            LimitBy::ScopeAndKey => "scope_and_key",
        }
    }
}

/// Where limits are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// This gateway's shared data only: no callout, holds per gateway.
    Local,
    /// The sidecar only: one callout, holds across gateways.
    Global,
    /// Shared data first (over → 429 without a callout), then the sidecar.
    LocalThenGlobal,
}

impl Tier {
    pub(crate) fn local(self) -> bool {
        matches!(self, Tier::Local | Tier::LocalThenGlobal)
    }
    pub(crate) fn global(self) -> bool {
        matches!(self, Tier::Global | Tier::LocalThenGlobal)
    }
}
