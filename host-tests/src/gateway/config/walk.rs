//! A walker over a parsed YAML tree that reads Envoy's proto-JSON forms and *collects* every
//! problem (with its path) instead of stopping at the first, so one run names every field of
//! a file the gateway cannot run.
//!
//! It reads the tree as Envoy's loader does (`source/common/protobuf/yaml_utility.cc` then
//! proto-JSON parsing): a repeated field may be written as one map, integers and booleans may
//! be strings, `google.protobuf.Any` carries `@type` beside its fields or is wrapped in a
//! `udpa.type.v1.TypedStruct` / `xds.type.v3.TypedStruct` (`type_url` + `value`).

use serde_norway::Value;
use std::cell::RefCell;
use std::time::Duration;

/// The problems found so far, each `path: message`.
#[derive(Debug, Default)]
pub(super) struct Issues(RefCell<Vec<String>>);

impl Issues {
    pub(super) fn add(&self, path: &str, message: impl std::fmt::Display) {
        self.0.borrow_mut().push(format!("{path}: {message}"));
    }

    pub(super) fn into_vec(self) -> Vec<String> {
        self.0.into_inner()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.borrow().is_empty()
    }
}

const TYPED_STRUCTS: &[&str] = &[
    "type.googleapis.com/udpa.type.v1.TypedStruct",
    "type.googleapis.com/xds.type.v3.TypedStruct",
];

/// One value of the tree and where it is.
#[derive(Clone)]
pub(super) struct Node<'a> {
    pub(super) value: &'a Value,
    pub(super) path: String,
    pub(super) issues: &'a Issues,
}

/// A message (YAML map) whose fields were checked against the known ones.
pub(super) struct Message<'a> {
    node: Node<'a>,
    mapping: Option<&'a serde_norway::Mapping>,
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a map",
        Value::Tagged(_) => "a tagged value",
    }
}

impl<'a> Node<'a> {
    pub(super) fn root(value: &'a Value, issues: &'a Issues) -> Self {
        Self {
            value,
            path: String::new(),
            issues,
        }
    }

    fn child(&self, value: &'a Value, segment: &str) -> Self {
        let path = if self.path.is_empty() {
            segment.to_owned()
        } else if segment.starts_with('[') {
            format!("{}{segment}", self.path)
        } else {
            format!("{}.{segment}", self.path)
        };
        Self {
            value,
            path,
            issues: self.issues,
        }
    }

    pub(super) fn issue(&self, message: impl std::fmt::Display) {
        self.issues.add(&self.path, message);
    }

    fn wrong(&self, expected: &str) {
        self.issue(format!("expected {expected}, found {}", kind(self.value)));
    }

    /// The message's fields; every field not in `known` is reported as unsupported, every
    /// field in `ignored` is accepted and has no effect here (documented in the README).
    pub(super) fn message(&self, known: &[&str], ignored: &[&str]) -> Message<'a> {
        let mapping = match self.value {
            Value::Mapping(m) => Some(m),
            Value::Null => None,
            _ => {
                self.wrong("a map");
                None
            }
        };
        for key in mapping.iter().flat_map(|m| m.keys()) {
            let name = key.as_str().unwrap_or_default();
            if name != "@type" && !known.contains(&name) && !ignored.contains(&name) {
                self.child(key, name).issue(format!(
                    "unsupported field (supported here: {})",
                    list(known)
                ));
            }
        }
        Message {
            node: self.clone(),
            mapping,
        }
    }

    pub(super) fn str(&self) -> Option<&'a str> {
        match self.value {
            Value::String(s) => Some(s),
            _ => {
                self.wrong("a string");
                None
            }
        }
    }

    /// Proto-JSON integers: a number or a decimal string.
    pub(super) fn uint(&self, max: u64) -> Option<u64> {
        let n = match self.value {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.parse().ok(),
            _ => None,
        };
        match n {
            Some(n) if n <= max => Some(n),
            _ => {
                self.issue(format!(
                    "expected an integer from 0 to {max}, found {}",
                    text(self.value)
                ));
                None
            }
        }
    }

    /// Proto-JSON booleans (`true`/`false`, also as strings).
    pub(super) fn bool(&self) -> Option<bool> {
        match self.value {
            Value::Bool(b) => Some(*b),
            Value::String(s) if s == "true" => Some(true),
            Value::String(s) if s == "false" => Some(false),
            _ => {
                self.wrong("true or false");
                None
            }
        }
    }

    /// One of an enum's names.
    pub(super) fn choice(&self, variants: &[&str]) -> Option<&'a str> {
        let s = self.str()?;
        if variants.contains(&s) {
            Some(s)
        } else {
            self.issue(format!(
                "`{s}` is not supported (supported: {})",
                list(variants)
            ));
            None
        }
    }

    /// `google.protobuf.Duration` in proto-JSON: `"1s"`, `"0.25s"`.
    pub(super) fn duration(&self) -> Option<Duration> {
        let text = self.str()?;
        let parsed = text
            .strip_suffix('s')
            .and_then(|n| n.parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64);
        if parsed.is_none() {
            self.issue(format!(
                "`{text}` is not a duration like \"1s\" or \"0.25s\""
            ));
        }
        parsed
    }

    /// A repeated field: a list, or (as Envoy's YAML loader accepts) a single map.
    pub(super) fn list(&self) -> Vec<Node<'a>> {
        match self.value {
            Value::Sequence(items) => items
                .iter()
                .enumerate()
                .map(|(i, v)| self.child(v, &format!("[{i}]")))
                .collect(),
            Value::Null => Vec::new(),
            Value::Mapping(_) => vec![self.child(self.value, "[0]")],
            _ => {
                self.wrong("a list");
                Vec::new()
            }
        }
    }

    /// A `google.protobuf.Any`: its type URL and the node holding the message's fields
    /// (unwrapping a `TypedStruct`).
    pub(super) fn any(&self) -> Option<(&'a str, Node<'a>)> {
        let Value::Mapping(m) = self.value else {
            self.wrong("a map with `@type`");
            return None;
        };
        let Some(type_url) = m.get("@type") else {
            self.issue("missing `@type`");
            return None;
        };
        let type_url = self.child(type_url, "@type").str()?;
        if !TYPED_STRUCTS.contains(&type_url) {
            return Some((type_url, self.clone()));
        }
        let wrapper = self.message(&["type_url", "value"], &[]);
        let inner = wrapper.required("type_url")?.str()?;
        let value = wrapper
            .get("value")
            .unwrap_or_else(|| self.child(&Value::Null, "value"));
        // A TypedStruct's `type_url` may name any host; compare what follows the last '/'.
        let name = inner.rsplit('/').next().unwrap_or(inner);
        let known = super::KNOWN_TYPES
            .iter()
            .find(|t| t.rsplit('/').next() == Some(name))
            .copied();
        Some((known.unwrap_or(inner), value))
    }
}

fn text(value: &Value) -> String {
    match value {
        Value::String(s) => format!("\"{s}\""),
        Value::Number(n) => n.to_string(),
        other => kind(other).to_owned(),
    }
}

pub(super) fn list(names: &[&str]) -> String {
    if names.is_empty() {
        return "none".to_owned();
    }
    names.join(", ")
}

impl<'a> Message<'a> {
    pub(super) fn issue(&self, message: impl std::fmt::Display) {
        self.node.issue(message);
    }

    pub(super) fn issue_at(&self, field: &str, message: impl std::fmt::Display) {
        self.node
            .issues
            .add(&format!("{}.{field}", self.node.path), message);
    }

    /// A field that is present and not null.
    pub(super) fn get(&self, name: &str) -> Option<Node<'a>> {
        let value = self.mapping?.get(name)?;
        (!value.is_null()).then(|| self.node.child(value, name))
    }

    pub(super) fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    pub(super) fn required(&self, name: &str) -> Option<Node<'a>> {
        let node = self.get(name);
        if node.is_none() {
            self.issue_at(name, "missing");
        }
        node
    }

    pub(super) fn str(&self, name: &str) -> Option<&'a str> {
        self.get(name)?.str()
    }

    pub(super) fn string(&self, name: &str) -> String {
        self.str(name).unwrap_or_default().to_owned()
    }

    pub(super) fn bool(&self, name: &str) -> Option<bool> {
        self.get(name)?.bool()
    }

    pub(super) fn uint(&self, name: &str, max: u64) -> Option<u64> {
        self.get(name)?.uint(max)
    }

    pub(super) fn duration(&self, name: &str) -> Option<Duration> {
        self.get(name)?.duration()
    }

    pub(super) fn list(&self, name: &str) -> Vec<Node<'a>> {
        self.get(name).map(|n| n.list()).unwrap_or_default()
    }

    pub(super) fn message(
        &self,
        name: &str,
        known: &[&str],
        ignored: &[&str],
    ) -> Option<Message<'a>> {
        Some(self.get(name)?.message(known, ignored))
    }

    /// A `map<string, string>` field.
    pub(super) fn string_map(&self, name: &str) -> Vec<(String, String)> {
        let Some(node) = self.get(name) else {
            return Vec::new();
        };
        let serde_norway::Value::Mapping(map) = node.value else {
            node.issue("expected a map of strings");
            return Vec::new();
        };
        map.iter()
            .filter_map(|(k, v)| {
                let key = k.as_str()?;
                let value = node.child(v, key).str()?;
                Some((key.to_owned(), value.to_owned()))
            })
            .collect()
    }
}
