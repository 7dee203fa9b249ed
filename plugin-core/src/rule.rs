//! Rule matching: which rule (first match wins) a request falls under, reading as few request
//! headers as possible, so a request that matches nothing costs one header read.

use alloc::string::{String, ToString};
use alloc::vec::Vec;

use crate::config::Config;

/// The request as the filter sees it at request headers. The glue implements it over
/// `proxy_get_header_map_value` (bytes, never the panicking `String` getters).
pub trait RequestView {
    /// The first value of a request header (lower-case name, pseudo-headers included).
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// An Envoy property (`["connection", "uri_san_peer_certificate"]`).
    fn property(&self, path: &[String]) -> Option<Vec<u8>>;
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
            PathMatch::Prefix(p) => path.starts_with(p.as_bytes()),
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
    /// `:path` including the query string.
    pub path: Vec<u8>,
}

impl RequestHead {
    /// The path without its query string.
    pub fn path_only(&self) -> &[u8] {
        self.path.split(|b| *b == b'?').next().unwrap_or_default()
    }

    pub fn query_param(&self, name: &str) -> Option<&[u8]> {
        let query = self.path.splitn(2, |b| *b == b'?').nth(1)?;
        query.split(|b| *b == b'&').find_map(|pair| {
            let mut kv = pair.splitn(2, |b| *b == b'=');
            (kv.next()? == name.as_bytes()).then(|| kv.next().unwrap_or_default())
        })
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
    let path = req.header(":path").unwrap_or_default();
    let head = RequestHead { method, path };
    let mut authority: Option<Option<Vec<u8>>> = None;
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
            return Some((i, head));
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
        let head = RequestHead {
            method: b"POST".to_vec(),
            path: b"/a?x=1&lock=abc&y".to_vec(),
        };
        assert_eq!(head.query_param("lock"), Some(&b"abc"[..]));
        assert_eq!(head.query_param("y"), Some(&b""[..]));
        assert_eq!(head.query_param("z"), None);
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
