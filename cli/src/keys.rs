//! `idemgate key`: the key a request is stored under at the sidecar, derived by the filter's
//! own code (`idemgate_core::key`), so an operator can find a customer's call.

use anyhow::{Context, Result, bail};
use idemgate_core::rule::RequestHead;
use idemgate_core::spec::KeySource;
use idemgate_core::{Config, RequestView};
use std::collections::BTreeMap;

/// What the operator knows about the call.
#[derive(Debug, Clone, Default)]
pub struct Call {
    pub rule: String,
    pub method: String,
    /// `:path` with query; needed for `path_param` / `query_param` keys.
    pub path: Option<String>,
    /// Scope headers (`x-user-id` = `u1`), names lower-cased.
    pub headers: BTreeMap<String, String>,
    /// Scope properties by dotted path (`connection.uri_san_peer_certificate`).
    pub properties: BTreeMap<String, String>,
    /// The key as the client sent it (an RFC 8941 sf-string or a bare token for headers; for
    /// `body_pointer` keys the field's value as the filter reads it: a string's value, an
    /// integer's digits).
    pub key: String,
}

struct View<'a>(&'a Call, Option<(&'a str, &'a str)>);

impl RequestView for View<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        match self.1 {
            Some((header, key)) if header == name => Some(key.as_bytes().to_vec()),
            _ => self.0.headers.get(name).map(|v| v.as_bytes().to_vec()),
        }
    }

    fn property(&self, path: &[String]) -> Option<Vec<u8>> {
        self.0
            .properties
            .get(&path.join("."))
            .map(|v| v.as_bytes().to_vec())
    }

    fn repeated(&self, _names: &[String]) -> bool {
        // One value per name on the command line (a repeated header is refused by the filter).
        false
    }
}

/// The stored key of `call` under `config`, exactly as the filter derives it.
pub fn stored_key(config: &Config, call: &Call) -> Result<String> {
    let Some(rule) = config.rules.iter().find(|r| r.name == call.rule) else {
        let names: Vec<&str> = config.rules.iter().map(|r| r.name.as_str()).collect();
        bail!("no rule named {:?} (rules: {names:?})", call.rule);
    };
    for name in &rule.scope.headers {
        if !call.headers.contains_key(name) {
            eprintln!(
                "idemgate: note: scope header {name} not given; the key is that of a call without it"
            );
        }
    }
    let path = match (&rule.key.source, &call.path) {
        (_, Some(path)) => path.clone(),
        (KeySource::QueryParam(q), None) => format!("/?{q}={}", call.key),
        (KeySource::PathParam(p), None) => {
            bail!(
                "rule {:?} keys on path parameter {p}: give the call's --path",
                rule.name
            )
        }
        (KeySource::Header(_) | KeySource::BodyPointer { .. }, None) => "/".to_owned(),
    };
    // Canonicalised as the filter does, so every spelling of the path gives the stored key.
    let head = RequestHead::new(
        call.method.to_ascii_uppercase().into_bytes(),
        path.as_bytes(),
        false,
    );
    let key_header = match &rule.key.source {
        KeySource::Header(h) => Some((h.as_str(), call.key.as_str())),
        _ => None,
    };
    let view = View(call, key_header);
    let raw = match &rule.key.source {
        // The field's value as the filter read it from the body.
        KeySource::BodyPointer { .. } => {
            idemgate_core::key::accept(rule, Some(call.key.as_bytes().to_vec()))
        }
        _ => idemgate_core::key::extract(rule, &head, &view),
    }
    .map_err(|e| anyhow::anyhow!("the filter would refuse this key: {}", e.detail()))?
    .context("the call carries no key for this rule")?;
    Ok(idemgate_core::key::scoped(
        rule,
        &head,
        &view,
        &raw,
        &mut idemgate_core::DigestMemo::new(),
    ))
}

/// `name=value` pairs from the command line.
pub fn pairs(items: &[String], what: &str) -> Result<BTreeMap<String, String>> {
    items
        .iter()
        .map(|item| match item.split_once('=') {
            Some((name, value)) => Ok((name.to_ascii_lowercase(), value.to_owned())),
            None => bail!("{what} {item:?}: expected NAME=VALUE"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_key_is_the_field_value_the_filter_reads() {
        let config = idemgate_core::config::parse(
            br#"{"sidecar":{"cluster":"c"},"allow_on_headers_stop_iteration":true,
                "rules":[{"name":"hooks","key":{"body_pointer":"/id"}}]}"#,
        )
        .unwrap();
        let call = Call {
            rule: "hooks".into(),
            method: "POST".into(),
            key: "evt_1".into(),
            ..Call::default()
        };
        let rule = &config.rules[0];
        let head = RequestHead::new(b"POST".to_vec(), b"/webhooks/orders", false);
        let raw = idemgate_core::key::from_body(rule, br#"{"id":"evt_1","n":2}"#)
            .unwrap()
            .unwrap();
        let filter = idemgate_core::key::scoped(
            rule,
            &head,
            &View(&call, None),
            &raw,
            &mut idemgate_core::DigestMemo::new(),
        );
        assert_eq!(stored_key(&config, &call).unwrap(), filter);
        let other = Call {
            key: "evt_2".into(),
            ..call.clone()
        };
        assert_ne!(stored_key(&config, &other).unwrap(), filter);
    }
}
