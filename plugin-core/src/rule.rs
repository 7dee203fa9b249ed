//! Rule matching: which rule (first match wins) a request falls under, reading as few request
//! headers as possible, so a request that matches nothing costs one header read.

use alloc::string::{String, ToString};
use alloc::vec::Vec;

use crate::canonical::{canonical_path, decode};
use crate::config::Config;

/// The request as the filter sees it at request headers. The glue implements it over
/// `proxy_get_header_map_value` (bytes, never the panicking `String` getters).
pub trait RequestView {
    /// The first value of a request header (lower-case name, pseudo-headers included).
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// An Envoy property (`["connection", "uri_san_peer_certificate"]`).
    fn property(&self, path: &[String]) -> Option<Vec<u8>>;
    /// Whether any of these request headers (lower-case names) has more than one value.
    /// [`RequestView::header`] sees only the first, as Envoy's getter returns it.
    fn repeated(&self, names: &[String]) -> bool;
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
    /// Parses `/agents/{agent_id}/mcp`: literal segments and whole-segment `{name}` variables.
    pub(crate) fn template(t: &str) -> Result<PathMatch, String> {
        let Some(rest) = t.strip_prefix('/') else {
            return Err("must start with `/`".to_string());
        };
        // Canonical paths have no trailing slash (crate::canonical): `/a/{id}/` means `/a/{id}`.
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let mut segments = Vec::new();
        for seg in rest.split('/') {
            if let Some(name) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                {
                    return Err(alloc::format!(
                        "`{seg}` is not a variable like {{agent_id}}"
                    ));
                }
                if segments.contains(&Segment::Variable(name.to_string())) {
                    return Err(alloc::format!("variable `{name}` appears twice"));
                }
                segments.push(Segment::Variable(name.to_string()));
            } else if seg.contains(['{', '}']) {
                return Err(alloc::format!(
                    "`{seg}`: a variable must be a whole segment"
                ));
            } else {
                segments.push(Segment::Literal(seg.to_string()));
            }
        }
        Ok(PathMatch::Template(segments))
    }

    pub(crate) fn has_variable(&self, name: &str) -> bool {
        matches!(self, PathMatch::Template(s) if s.iter().any(|seg| matches!(seg, Segment::Variable(v) if v == name)))
    }

    fn matches(&self, path: &[u8]) -> bool {
        match self {
            PathMatch::Any => true,
            // `/payments/` also covers `/payments`, which is how a canonical path spells it.
            PathMatch::Prefix(p) => {
                path.starts_with(p.as_bytes())
                    || p.strip_suffix('/').is_some_and(|p| p.as_bytes() == path)
            }
            PathMatch::Template(_) => self.variable(path, None).is_some(),
        }
    }

    /// Matches `path` (query already stripped) against a template; returns the value of
    /// variable `name` (or an empty slice when `name` is `None` and the template matches).
    pub(crate) fn variable<'p>(&self, path: &'p [u8], name: Option<&str>) -> Option<&'p [u8]> {
        let PathMatch::Template(segments) = self else {
            return None;
        };
        let mut parts = path.strip_prefix(b"/")?.split(|b| *b == b'/');
        let mut found: &[u8] = &[];
        for seg in segments {
            let part = parts.next()?;
            match seg {
                Segment::Literal(l) if l.as_bytes() != part => return None,
                Segment::Literal(_) => {}
                Segment::Variable(_) if part.is_empty() => return None,
                Segment::Variable(v) => {
                    if name == Some(v.as_str()) {
                        found = part;
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    pub methods: Vec<String>,
    pub path: PathMatch,
    pub host: Option<String>,
    pub headers_present: Vec<String>,
}

/// What the matcher read: reused by key extraction and fingerprinting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: Vec<u8>,
    /// The canonical path ([`canonical_path`]), then the query string as sent, if any.
    pub path: Vec<u8>,
    /// The path carries an encoded `/` or `\`: a guarded request is refused, not guessed at.
    pub encoded_separator: bool,
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
        }
    }

    /// The canonical path without the query string.
    pub fn path_only(&self) -> &[u8] {
        self.path.split(|b| *b == b'?').next().unwrap_or_default()
    }

    /// Every value of query parameter `name`, decoded as a form-encoded query string is
    /// (`%XX`, `+` as a space; names too).
    pub fn query_values(&self, name: &str) -> Vec<Vec<u8>> {
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

/// The first rule matching the request, with what was read to decide it; `None` = pass.
pub fn match_rule(config: &Config, req: &dyn RequestView) -> Option<(usize, RequestHead)> {
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
    let raw_path = req.header(":path").unwrap_or_default();
    let head = RequestHead::new(method, &raw_path, false);
    let mut authority: Option<Option<Vec<u8>>> = None;
    if let Some(rule) = first_match(config, req, &head, &mut authority) {
        return Some((rule, head));
    }
    // An encoded separator read as a separator may reach a guarded path: that request is
    // routed too, so the flow refuses it (`encoded_separator`) instead of letting it through.
    if head.encoded_separator {
        let split = RequestHead::new(head.method.clone(), &raw_path, true);
        return first_match(config, req, &split, &mut authority).map(|rule| (rule, head));
    }
    None
}

fn first_match(
    config: &Config,
    req: &dyn RequestView,
    head: &RequestHead,
    authority: &mut Option<Option<Vec<u8>>>,
) -> Option<usize> {
    for (i, rule) in config.rules.iter().enumerate() {
        let m = &rule.matcher;
        if !m
            .methods
            .iter()
            .any(|x| x.as_bytes() == head.method.as_slice())
            || !m.path.matches(head.path_only())
        {
            continue;
        }
        if let Some(host) = &m.host {
            let auth = authority.get_or_insert_with(|| req.header(":authority"));
            if !auth.as_deref().is_some_and(|a| host_matches(host, a)) {
                continue;
            }
        }
        if m.headers_present.iter().all(|h| req.header(h).is_some()) {
            return Some(i);
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
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
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
        assert_eq!(match_rule(&c, &Req::new("POST", "/pay/1")).unwrap().0, 0);
        assert_eq!(match_rule(&c, &Req::new("POST", "/other")).unwrap().0, 1);
    }

    #[test]
    fn templates_hosts_and_header_presence() {
        let c = config(
            r#"[{"mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp","host":"api.example.com","headers_present":["x-tenant"]},"key":{"path_param":"agent_id"}}]"#,
        );
        let ok = Req::new("PUT", "/agents/42/mcp?x=1")
            .with(":authority", "API.example.com:8443")
            .with("x-tenant", "t");
        let (i, head) = match_rule(&c, &ok).unwrap();
        assert_eq!(i, 0);
        assert_eq!(
            c.rules[0]
                .matcher
                .path
                .variable(head.path_only(), Some("agent_id")),
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

    #[test]
    fn bad_templates() {
        assert!(PathMatch::template("agents").is_err());
        assert!(PathMatch::template("/a/{}").is_err());
        assert!(PathMatch::template("/a/x{y}").is_err());
        assert!(PathMatch::template("/{a}/{a}").is_err());
    }
}
