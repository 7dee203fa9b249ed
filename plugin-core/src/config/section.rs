//! The walker over the configuration's JSON tree: each [`Section`] is one object with its path
//! in the document, so that every error names the field it is about. Also the value formats
//! the document uses (durations).

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;
use serde_json::{Map, Value};

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

pub(super) fn err(path: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.to_string(),
        message: message.into(),
    }
}

/// One JSON object of the configuration and its path. Built only after its field names were
/// checked, so every getter reads a known field; a field set to `null` counts as absent.
pub(super) struct Section<'a> {
    /// Where this object is in the document (`rules[2].key`; empty for the document).
    pub(super) path: String,
    fields: Option<&'a Map<String, Value>>,
}

impl<'a> Section<'a> {
    /// `value` as an object whose fields are all in `known`.
    /// The document itself has the empty path (its fields are named bare: `rules`), and is
    /// called `configuration` in its own errors.
    pub(super) fn of(
        value: &'a Value,
        path: String,
        known: &[&str],
    ) -> Result<Section<'a>, ConfigError> {
        let (section, unknown) = Section::with_unknown(value, path, known)?;
        unknown.map_or(Ok(section), Err)
    }

    /// `value` as an object, and the error for its first field not in `known` if it has one.
    /// The section reads its known fields either way (getters never see the unknown one), so
    /// a caller collecting every error goes on with the other fields.
    pub(super) fn with_unknown(
        value: &'a Value,
        path: String,
        known: &[&str],
    ) -> Result<(Section<'a>, Option<ConfigError>), ConfigError> {
        let name = if path.is_empty() {
            "configuration"
        } else {
            &path
        };
        let Value::Object(fields) = value else {
            return Err(err(
                name,
                format!("expected an object, got {}", kind(value)),
            ));
        };
        let unknown = fields
            .keys()
            .find(|k| !known.contains(&k.as_str()))
            .map(|unknown| {
                err(
                    name,
                    format!(
                        "unknown field `{unknown}`, expected one of {}",
                        quoted(known)
                    ),
                )
            });
        Ok((
            Section {
                path,
                fields: Some(fields),
            },
            unknown,
        ))
    }

    /// A section that is not in the document: every field reads as absent (defaults apply).
    pub(super) fn absent(path: String) -> Section<'a> {
        Section { path, fields: None }
    }

    pub(super) fn at(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    pub(super) fn get(&self, name: &str) -> Option<&'a Value> {
        self.fields
            .and_then(|f| f.get(name))
            .filter(|v| !v.is_null())
    }

    pub(super) fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    pub(super) fn wrong(&self, name: &str, expected: &str, got: &Value) -> ConfigError {
        err(
            &self.at(name),
            format!("expected {expected}, got {}", kind(got)),
        )
    }

    pub(super) fn section(
        &self,
        name: &str,
        known: &[&str],
    ) -> Result<Option<Section<'a>>, ConfigError> {
        self.get(name)
            .map(|v| Section::of(v, self.at(name), known))
            .transpose()
    }

    pub(super) fn optional_section(
        &self,
        name: &str,
        known: &[&str],
    ) -> Result<Section<'a>, ConfigError> {
        Ok(self
            .section(name, known)?
            .unwrap_or_else(|| Section::absent(self.at(name))))
    }

    pub(super) fn str(&self, name: &str) -> Result<Option<&'a str>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong(name, "a string", other)),
        }
    }

    pub(super) fn string(&self, name: &str) -> Result<Option<String>, ConfigError> {
        Ok(self.str(name)?.map(String::from))
    }

    pub(super) fn bool(&self, name: &str) -> Result<Option<bool>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.wrong(name, "a boolean", other)),
        }
    }

    pub(super) fn integer(&self, name: &str, max: u64) -> Result<Option<u64>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= max => Ok(Some(n)),
                _ => Err(self.wrong(name, &format!("an integer in 0..={max}"), v)),
            },
        }
    }

    pub(super) fn u32(&self, name: &str) -> Result<Option<u32>, ConfigError> {
        Ok(self
            .integer(name, u64::from(u32::MAX))?
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)))
    }

    pub(super) fn usize(&self, name: &str) -> Result<Option<usize>, ConfigError> {
        Ok(self
            .integer(name, u64::from(u32::MAX))?
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)))
    }

    pub(super) fn array(&self, name: &str) -> Result<Option<&'a [Value]>, ConfigError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(other) => Err(self.wrong(name, "an array", other)),
        }
    }

    /// An array of strings (`path[i]` names a wrong element).
    pub(super) fn strings(&self, name: &str) -> Result<Option<Vec<String>>, ConfigError> {
        let Some(items) = self.array(name)? else {
            return Ok(None);
        };
        strings(items, &self.at(name)).map(Some)
    }

    /// The index in `variants` of the string field `name`.
    pub(super) fn choice(
        &self,
        name: &str,
        variants: &[&str],
    ) -> Result<Option<usize>, ConfigError> {
        let Some(s) = self.str(name)? else {
            return Ok(None);
        };
        match variants.iter().position(|v| *v == s) {
            Some(i) => Ok(Some(i)),
            None => Err(err(
                &self.at(name),
                format!("`{s}` is not one of {}", quoted(variants)),
            )),
        }
    }

    /// A duration field (`"30s"`), `default_ms` when absent; never zero.
    pub(super) fn duration(&self, name: &str, default_ms: u64) -> Result<u64, ConfigError> {
        duration_or(self.str(name)?, &self.at(name), default_ms)
    }
}

pub(super) fn strings(items: &[Value], path: &str) -> Result<Vec<String>, ConfigError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(err(
                &format!("{path}[{i}]"),
                format!("expected a string, got {}", kind(other)),
            )),
        })
        .collect()
}

/// `` `a`, `b`, `c` `` for error messages.
fn quoted(names: &[&str]) -> String {
    let mut list = String::new();
    for (i, n) in names.iter().enumerate() {
        list.push_str(if i == 0 { "`" } else { ", `" });
        list.push_str(n);
        list.push('`');
    }
    list
}

/// What a JSON value is, for error messages (strings are quoted, so `"yes"` reads as text).
pub(super) fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => "a boolean".into(),
        Value::Number(_) => "a number".into(),
        Value::String(s) => format!("string \"{s}\""),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
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
pub(super) fn parse_duration(s: &str) -> Result<u64, String> {
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
