//! Rule matching: which rule (first match wins) a request falls under, reading as few request
//! headers as possible, so a request that matches nothing costs one header read.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::ops::Range;

use crate::canonical::{already_canonical, canonical_path, decode};
use crate::grpc::is_grpc_content_type;
use crate::ports::RequestView;
use crate::spec::{Config, KeySource, PathMatch, Rule};

/// What the matcher read: reused by key extraction and fingerprinting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub(crate) method: Vec<u8>,
    /// The canonical path ([`canonical_path`]), then the query string as sent, if any.
    pub(crate) path: Vec<u8>,
    /// The path carries an encoded `/` or `\`: a guarded request is refused, not guessed at.
    pub(crate) encoded_separator: bool,
    /// A gRPC call (its content type, read once a rule matched): answered with gRPC statuses,
    /// its outcome read from `grpc-status`.
    pub(crate) grpc: bool,
    /// Where the matched rule's path-variable key is in `path`, found as its template matched
    /// (`None`: the key is elsewhere, or the head was not matched).
    pub(crate) key_segment: Option<Range<usize>>,
}

impl RequestHead {
    /// The head of a request with this method and raw `:path` (see [`canonical_path`] for
    /// `split`).
    pub fn new(method: Vec<u8>, raw_path: &[u8], split: bool) -> RequestHead {
        let mut parts = raw_path.splitn(2, |b| *b == b'?');
        let canonical = canonical_path(parts.next().unwrap_or_default(), split);
        let mut path = canonical.path;
        if let Some(query) = parts.next() {
            path.push(b'?');
            path.extend_from_slice(query);
        }
        RequestHead {
            method,
            path,
            encoded_separator: canonical.encoded_separator,
            grpc: false,
            key_segment: None,
        }
    }

    /// [`RequestHead::new`] (not split) of a `:path` read for it: one already canonical, as
    /// most are, becomes the head's path as it is, without a copy.
    pub(crate) fn of_owned(method: Vec<u8>, raw_path: Vec<u8>) -> RequestHead {
        let path_only = raw_path.split(|b| *b == b'?').next().unwrap_or_default();
        if !already_canonical(path_only) {
            return RequestHead::new(method, &raw_path, false);
        }
        RequestHead {
            method,
            path: raw_path,
            encoded_separator: false,
            grpc: false,
            key_segment: None,
        }
    }

    /// The canonical path without the query string.
    pub(crate) fn path_only(&self) -> &[u8] {
        self.path.split(|b| *b == b'?').next().unwrap_or_default()
    }

    /// Every value of query parameter `name`, decoded as a form-encoded query string is
    /// (`%XX`, `+` as a space; names too).
    pub(crate) fn query_values(&self, name: &str) -> Vec<Vec<u8>> {
        let Some(query) = self.path.splitn(2, |b| *b == b'?').nth(1) else {
            return Vec::new();
        };
        query
            .split(|b| *b == b'&')
            .filter_map(|pair| {
                let mut kv = pair.splitn(2, |b| *b == b'=');
                (decode(kv.next()?, true) == name.as_bytes())
                    .then(|| decode(kv.next().unwrap_or_default(), true))
            })
            .collect()
    }
}

/// A request's rule: the first that matches it, with what was read to decide it.
#[derive(Debug, PartialEq, Eq)]
pub struct Matched<'c> {
    /// The rule's place in the configuration (per-rule metrics).
    pub index: usize,
    pub rule: &'c Arc<Rule>,
    pub head: RequestHead,
}

/// The first rule matching the request; `None` = pass.
pub fn match_rule<'c>(config: &'c Config, req: &dyn RequestView) -> Option<Matched<'c>> {
    let method = req.header(":method")?;
    // Cheap pre-check before reading anything else: most traffic (GET) stops here.
    if !config.rules.iter().any(|r| {
        r.matcher
            .methods
            .iter()
            .any(|m| m.as_bytes() == method.as_slice())
    }) {
        return None;
    }
    let head = RequestHead::of_owned(method, req.header(":path").unwrap_or_default());
    let mut lazy = Lazy::default();
    let mut found = first_match(config, req, &head, &mut lazy);
    // An encoded separator read as a separator may reach a guarded path: that request is
    // routed too, so the flow refuses it (`encoded_separator`) instead of letting it through.
    // (Rare enough to read `:path` again for.)
    if found.is_none() && head.encoded_separator {
        let raw_path = req.header(":path").unwrap_or_default();
        let split = RequestHead::new(head.method.clone(), &raw_path, true);
        // The key's place is in the split path, not in the head kept (the flow refuses it).
        found = first_match(config, req, &split, &mut lazy).map(|found| Found {
            key_segment: None,
            ..found
        });
    }
    let Found {
        index,
        rule,
        key_segment,
    } = found?;
    let grpc = lazy.grpc(req);
    Some(Matched {
        index,
        rule,
        head: RequestHead {
            grpc,
            key_segment,
            ..head
        },
    })
}

/// Request headers the matcher reads only when a rule asks, at most once each.
#[derive(Default)]
struct Lazy {
    authority: Option<Option<Vec<u8>>>,
    grpc: Option<bool>,
}

impl Lazy {
    fn grpc(&mut self, req: &dyn RequestView) -> bool {
        *self.grpc.get_or_insert_with(|| {
            req.header("content-type")
                .is_some_and(|ct| is_grpc_content_type(&ct))
        })
    }
}

/// The rule [`first_match`] found for a head.
struct Found<'c> {
    index: usize,
    rule: &'c Arc<Rule>,
    /// Where the rule's path-variable key is in the head's path ([`RequestHead::key_segment`]).
    key_segment: Option<Range<usize>>,
}

fn first_match<'c>(
    config: &'c Config,
    req: &dyn RequestView,
    head: &RequestHead,
    lazy: &mut Lazy,
) -> Option<Found<'c>> {
    for (i, rule) in config.rules.iter().enumerate() {
        let m = &rule.matcher;
        if !m
            .methods
            .iter()
            .any(|x| x.as_bytes() == head.method.as_slice())
        {
            continue;
        }
        // A template is walked once: a key taken from one of its variables is found on the way.
        let key_segment = match (&m.path, &rule.key.source) {
            (PathMatch::Template(_), KeySource::PathParam(name)) => {
                match m.path.variable_span(head.path_only(), Some(name)) {
                    Some(span) => Some(span),
                    None => continue,
                }
            }
            _ if m.path.matches(head.path_only()) => None,
            _ => continue,
        };
        if let Some(host) = &m.host {
            let auth = lazy
                .authority
                .get_or_insert_with(|| req.header(":authority"));
            if !auth.as_deref().is_some_and(|a| host_matches(host, a)) {
                continue;
            }
        }
        if m.grpc && !lazy.grpc(req) {
            continue;
        }
        if m.headers_present.iter().all(|h| req.header(h).is_some()) {
            return Some(Found {
                index: i,
                rule,
                key_segment,
            });
        }
    }
    None
}

/// A configured host without a port matches the authority with any port.
fn host_matches(host: &str, authority: &[u8]) -> bool {
    let eq = |a: &[u8]| a.eq_ignore_ascii_case(host.as_bytes());
    if eq(authority) {
        return true;
    }
    !host.contains(':')
        && authority
            .iter()
            .rposition(|b| *b == b':')
            .and_then(|i| authority.get(..i))
            .is_some_and(eq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Req;

    fn config(rules: &str) -> Config {
        crate::config::parse(
            alloc::format!(r#"{{"sidecar":{{"cluster":"s"}},"rules":{rules}}}"#).as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn first_match_wins_and_gets_are_not_read_further() {
        let c = config(r#"[{"name":"a","match":{"path_prefix":"/pay"}},{"name":"b"}]"#);
        let get = Req::new("GET", "/pay");
        assert_eq!(match_rule(&c, &get), None);
        assert_eq!(
            get.reads(),
            1,
            "only :method is read for a method no rule takes"
        );
        assert_eq!(
            match_rule(&c, &Req::new("POST", "/pay/1")).unwrap().index,
            0
        );
        assert_eq!(
            match_rule(&c, &Req::new("POST", "/other")).unwrap().index,
            1
        );
    }

    #[test]
    fn templates_hosts_and_header_presence() {
        let c = config(
            r#"[{"mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp","host":"api.example.com","headers_present":["x-tenant"]},"key":{"path_param":"agent_id"}}]"#,
        );
        let ok = Req::new("PUT", "/agents/42/mcp?x=1")
            .with(":authority", "API.example.com:8443")
            .with("x-tenant", "t");
        let Matched { index: i, head, .. } = match_rule(&c, &ok).unwrap();
        assert_eq!(i, 0);
        assert_eq!(
            c.rules[0]
                .matcher
                .path
                .variable(head.path_only(), Some("agent_id")),
            Some(&b"42"[..])
        );
        // The matcher found the key's segment as it walked the template.
        assert_eq!(
            head.key_segment
                .clone()
                .and_then(|span| head.path.get(span)),
            Some(&b"42"[..])
        );
        assert!(
            match_rule(
                &c,
                &Req::new("PUT", "/agents/42/mcp").with(":authority", "api.example.com")
            )
            .is_none()
        );
        assert!(
            match_rule(
                &c,
                &Req::new("PUT", "/agents//mcp")
                    .with(":authority", "api.example.com")
                    .with("x-tenant", "t")
            )
            .is_none()
        );
        assert!(
            match_rule(
                &c,
                &Req::new("PUT", "/agents/1/mcp/x")
                    .with(":authority", "api.example.com")
                    .with("x-tenant", "t")
            )
            .is_none()
        );
        assert!(
            match_rule(
                &c,
                &Req::new("PUT", "/agents/1/mcp")
                    .with(":authority", "evil.com")
                    .with("x-tenant", "t")
            )
            .is_none()
        );
    }

    #[test]
    fn query_params() {
        let head = RequestHead::new(
            b"POST".to_vec(),
            b"/a/?x=1&lock=abc&y&l%6Fck=a+b%2B&d=1&d=2",
            false,
        );
        assert_eq!(head.query_values("lock"), [&b"abc"[..], b"a b+"]);
        assert_eq!(head.query_values("y"), [b""]);
        assert!(head.query_values("z").is_empty());
        assert_eq!(head.query_values("d").len(), 2);
        assert_eq!(head.path_only(), b"/a");
    }
}
