//! Keys: extracting the client's key (an `Idempotency-Key` as an RFC 8941 sf-string or a bare
//! token, a lock-mode resource id, or a field of the JSON body), checking it against the rule,
//! and deriving the stored key — a hex SHA-256 over the length-prefixed scope and key. Raw keys and caller identities
//! never leave this module: nothing stores, sends or logs them.

use alloc::string::{String, ToString};
use alloc::vec::Vec;

use crate::canonical::decode;
use crate::hash::{DigestMemo, PartBytes, Parts as _};
use crate::ports::RequestView;
use crate::rule::RequestHead;
use crate::spec::{KeySource, Rule};
use serde_json::Value;

/// Why a request's key was not usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    Missing,
    Malformed,
    TooLong,
    BadCharacter,
    /// The key header was sent more than once (or a query key parameter repeated): which one
    /// is the key is a guess, and the other may be what the backend reads.
    Repeated,
    /// A scope header was sent more than once: the caller is ambiguous.
    RepeatedScope,
    /// The path carries an encoded `/` or `\` (see `RequestHead::encoded_separator`).
    EncodedSeparator,
    /// `key.body_pointer`: the body is not a JSON document.
    NotJson,
    /// `key.body_pointer`: the field is a number that is not an integer (or beyond 64 bits),
    /// whose text a parser may round: two ids could become one key.
    NotInteger,
}

impl KeyError {
    pub fn detail(self) -> &'static str {
        match self {
            KeyError::Missing => "this endpoint requires an idempotency key",
            KeyError::Malformed => "the key is not a valid RFC 8941 string or token",
            KeyError::TooLong => "the key is longer than this endpoint allows",
            KeyError::BadCharacter => "the key contains characters this endpoint does not allow",
            KeyError::Repeated => "the key is sent more than once",
            KeyError::RepeatedScope => "a header that identifies the caller is sent more than once",
            KeyError::EncodedSeparator => {
                "the path has an encoded / or \\ (%2F, %5C), which servers read differently"
            }
            KeyError::NotJson => {
                "this endpoint reads its key from a JSON body, and the body is not JSON"
            }
            KeyError::NotInteger => "the key field is a number but not an integer",
        }
    }
}

/// The raw key bytes of a request, validated against the rule; `Ok(None)` = absent and optional.
/// A body key is read from an empty body here: the flow reads a non-empty one with
/// [`from_body`] once it is buffered, after `check_request`.
pub fn extract(
    rule: &Rule,
    head: &RequestHead,
    req: &dyn RequestView,
) -> Result<Option<Vec<u8>>, KeyError> {
    check_request(rule, head, req)?;
    let raw: Option<Vec<u8>> = match &rule.key.source {
        KeySource::Header(h) => {
            if req.repeated(core::slice::from_ref(h)) {
                return Err(KeyError::Repeated);
            }
            req.header(h)
        }
        // The value the backend's router hands its handler: the segment, decoded.
        KeySource::PathParam(p) => match &head.key_segment {
            Some(span) => head.path.get(span.clone()),
            None => rule.matcher.path.variable(head.path_only(), Some(p)),
        }
        .map(|segment| decode(segment, false)),
        KeySource::QueryParam(q) => {
            let mut values = head.query_values(q);
            if values.len() > 1 {
                return Err(KeyError::Repeated);
            }
            values.pop()
        }
        KeySource::BodyPointer { .. } => return from_body(rule, &[]),
    };
    accept(rule, raw)
}

/// What makes a guarded request unusable whatever its key: the path or the caller reads two
/// ways.
pub(crate) fn check_request(
    rule: &Rule,
    head: &RequestHead,
    req: &dyn RequestView,
) -> Result<(), KeyError> {
    if head.encoded_separator {
        return Err(KeyError::EncodedSeparator);
    }
    // Envoy hands the filter only the first value of a header: identity and keys must not
    // be first-value-only when the backend may read another.
    if !rule.scope.headers.is_empty() && req.repeated(&rule.scope.headers) {
        return Err(KeyError::RepeatedScope);
    }
    Ok(())
}

/// The key of a `key.body_pointer` rule from the whole body: a string field's value (escapes
/// decoded), an integer's decimal digits, `true` or `false`. No body, no such field, or a
/// `null`, object or array there is a missing key; a member named twice is read as its last
/// occurrence (as serde_json, Go's encoding/json, Python's json and JavaScript read it).
pub fn from_body(rule: &Rule, body: &[u8]) -> Result<Option<Vec<u8>>, KeyError> {
    let KeySource::BodyPointer { pointer, .. } = &rule.key.source else {
        return accept(rule, None);
    };
    let doc = match body {
        [] => Value::Null,
        _ => serde_json::from_slice(body).map_err(|_| KeyError::NotJson)?,
    };
    let raw = match field(&doc, pointer) {
        Some(Value::String(s)) => Some(s.as_bytes().to_vec()),
        // Only integers: other numbers have no one spelling (`1e2`, `100.0`), and numbers
        // past 64 bits are rounded, so distinct ids would share a key.
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Some(u.to_string().into_bytes()),
            // Spelled through `u64`'s formatting, which the filter has anyway.
            (None, Some(i)) => Some(alloc::format!("-{}", i.unsigned_abs()).into_bytes()),
            (None, None) => return Err(KeyError::NotInteger),
        },
        Some(Value::Bool(b)) => Some(if *b {
            b"true".to_vec()
        } else {
            b"false".to_vec()
        }),
        _ => None,
    };
    accept(rule, raw)
}

/// The value an RFC 6901 pointer (validated by the configuration) refers to. Written out
/// rather than `Value::pointer`, whose unescaping by `str::replace` costs the filter more.
fn field<'v>(doc: &'v Value, pointer: &str) -> Option<&'v Value> {
    let mut at = doc;
    for escaped in pointer.split('/').skip(1) {
        let mut token = String::with_capacity(escaped.len());
        let mut chars = escaped.chars();
        while let Some(c) = chars.next() {
            token.push(match c {
                // The escape's second character is consumed by the guard: `~1` or `~0`.
                '~' if chars.next() == Some('1') => '/',
                '~' => '~',
                c => c,
            });
        }
        at = match at {
            Value::Object(members) => members.get(token.as_str())?,
            // An index is digits without a leading zero; `-` (past the end) is nothing.
            Value::Array(items)
                if token.bytes().all(|b| b.is_ascii_digit())
                    && (token == "0" || !token.starts_with('0')) =>
            {
                items.get(token.parse::<usize>().ok()?)?
            }
            _ => return None,
        };
    }
    Some(at)
}

/// A raw key as the rule takes it: absent or empty is missing (an error when required),
/// header keys unquoted, then length and characters checked. The CLI gives it a body key
/// as the filter read it from the body.
pub fn accept(rule: &Rule, raw: Option<Vec<u8>>) -> Result<Option<Vec<u8>>, KeyError> {
    let raw = match raw {
        Some(r) if !r.is_empty() => r,
        _ if rule.key.required => return Err(KeyError::Missing),
        _ => return Ok(None),
    };
    let key = match rule.key.source {
        KeySource::Header(_) => unquote(&raw)?,
        _ => raw,
    };
    if key.is_empty() {
        return Err(KeyError::Malformed);
    }
    if key.len() > rule.key.max_length {
        return Err(KeyError::TooLong);
    }
    if !key.iter().all(|b| rule.key.charset.allows(*b)) {
        return Err(KeyError::BadCharacter);
    }
    Ok(Some(key))
}

/// RFC 8941 sf-string (`"abc"`, escapes `\"` and `\\`) or a bare value, surrounding spaces trimmed.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let trimmed = raw.trim_ascii();
    let Some(inner) = trimmed.strip_prefix(b"\"") else {
        // A bare `,` is what joining two header lines produces (RFC 9110 §5.3): which one was
        // meant is a guess. Inside an sf-string it is an ordinary character.
        if trimmed.contains(&b'"') || trimmed.contains(&b',') {
            return Err(KeyError::Malformed);
        }
        return Ok(trimmed.to_vec());
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::Malformed),
            },
            // Closing quote: nothing may follow (no parameters are defined for this field).
            b'"' if bytes.as_slice().is_empty() => return Ok(out),
            b'"' => return Err(KeyError::Malformed),
            0x20..=0x7e => out.push(b),
            _ => return Err(KeyError::Malformed),
        }
    }
    Err(KeyError::Malformed)
}

/// The stored key: scope (rule, mode, optionally method, caller identity) ‖ key, hashed
/// (`memo`: the worker's last digests, which a duplicate's key is mostly among).
pub fn scoped(
    rule: &Rule,
    head: &RequestHead,
    req: &dyn RequestView,
    key: &[u8],
    memo: &mut DigestMemo,
) -> String {
    let mut h = PartBytes::new("idemgate/key/v1", memo);
    h.part(rule.name.as_bytes());
    h.part(match rule.mode {
        idemgate_wire::Mode::Idempotency => b"idempotency",
        idemgate_wire::Mode::Lock => b"lock",
    });
    h.optional(rule.scope.method.then_some(head.method.as_slice()));
    for name in &rule.scope.headers {
        h.optional(req.header(name).as_deref());
    }
    for path in &rule.scope.properties {
        h.optional(req.property(path).as_deref());
    }
    h.part(key);
    h.finish_hex()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Req;

    fn rule(extra: &str) -> Rule {
        let rule: alloc::sync::Arc<Rule> = crate::config::parse(
            alloc::format!(r#"{{"sidecar":{{"cluster":"s"}},"rules":[{{{extra}}}]}}"#).as_bytes(),
        )
        .unwrap()
        .rules
        .remove(0);
        alloc::sync::Arc::unwrap_or_clone(rule)
    }

    fn head(req: &Req) -> RequestHead {
        RequestHead::new(
            req.header(":method").unwrap(),
            &req.header(":path").unwrap(),
            false,
        )
    }

    fn key_of(rule: &Rule, value: &str) -> Result<Option<Vec<u8>>, KeyError> {
        let req = Req::new("POST", "/x").with("idempotency-key", value);
        extract(rule, &head(&req), &req)
    }

    #[test]
    fn sf_strings_and_tokens() {
        let r = rule("");
        assert_eq!(key_of(&r, "\"abc-1\"").unwrap().unwrap(), b"abc-1");
        assert_eq!(key_of(&r, " abc-1 ").unwrap().unwrap(), b"abc-1");
        assert_eq!(key_of(&r, r#""a\"b\\c""#).unwrap().unwrap(), br#"a"b\c"#);
        assert_eq!(key_of(&r, "\"a b\"").unwrap().unwrap(), b"a b");
        for bad in ["\"abc", "\"a\"b", "a\"b", r#""a\nb""#, "\"\""] {
            assert_eq!(key_of(&r, bad), Err(KeyError::Malformed), "{bad}");
        }
        assert_eq!(key_of(&r, &"k".repeat(255)).unwrap().unwrap().len(), 255);
        assert_eq!(key_of(&r, &"k".repeat(256)), Err(KeyError::TooLong));
    }

    #[test]
    fn non_ascii_is_rejected_not_trapped() {
        let r = rule("");
        let req = Req::new("POST", "/x").with_bytes("idempotency-key", b"\xff\xfe");
        assert_eq!(extract(&r, &head(&req), &req), Err(KeyError::BadCharacter));
    }

    #[test]
    fn missing_required_and_optional() {
        let req = Req::new("POST", "/x");
        assert_eq!(
            extract(&rule(""), &head(&req), &req),
            Err(KeyError::Missing)
        );
        assert_eq!(
            extract(&rule(r#""key":{"required":false}"#), &head(&req), &req),
            Ok(None)
        );
        let empty = Req::new("POST", "/x").with("idempotency-key", "");
        assert_eq!(
            extract(&rule(""), &head(&empty), &empty),
            Err(KeyError::Missing)
        );
    }

    #[test]
    fn charsets() {
        let r = rule(r#""key":{"charset":"alphanumeric","max_length":8}"#);
        assert!(key_of(&r, "ab-1_2.3").unwrap().is_some());
        assert_eq!(key_of(&r, "a b"), Err(KeyError::BadCharacter));
        assert_eq!(key_of(&r, "123456789"), Err(KeyError::TooLong));
    }

    #[test]
    fn lock_ids_from_path_and_query() {
        let r = rule(
            r#""mode":"lock","match":{"path_template":"/agents/{agent_id}/mcp"},"key":{"path_param":"agent_id"}"#,
        );
        let req = Req::new("PUT", "/agents/a7/mcp");
        assert_eq!(extract(&r, &head(&req), &req).unwrap().unwrap(), b"a7");
        let r = rule(r#""mode":"lock","key":{"query_param":"doc"}"#);
        let req = Req::new("PUT", "/edit?doc=d1");
        assert_eq!(extract(&r, &head(&req), &req).unwrap().unwrap(), b"d1");
    }

    #[test]
    fn a_lock_covers_every_method_on_the_resource() {
        let mut memo = DigestMemo::new();
        let r =
            rule(r#""mode":"lock","match":{"path_template":"/a/{id}"},"key":{"path_param":"id"}"#);
        let put = Req::new("PUT", "/a/1");
        let delete = Req::new("DELETE", "/a/1");
        assert_eq!(
            scoped(&r, &head(&put), &put, b"1", &mut memo),
            scoped(&r, &head(&delete), &delete, b"1", &mut memo)
        );
    }

    #[test]
    fn scope_separates_callers_methods_and_rules() {
        // One memo for every digest, as a worker's: a memoized digest is the input's own.
        let mut memo = DigestMemo::new();
        let r = rule(r#""scope":{"headers":["x-user-id"]}"#);
        let alice = Req::new("POST", "/x").with("x-user-id", "alice");
        let bob = Req::new("POST", "/x").with("x-user-id", "bob");
        let anon = Req::new("POST", "/x");
        let empty = Req::new("POST", "/x").with("x-user-id", "");
        let put = Req::new("PUT", "/x").with("x-user-id", "alice");
        let a = scoped(&r, &head(&alice), &alice, b"k", &mut memo);
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(a, scoped(&r, &head(&alice), &alice, b"k", &mut memo));
        for other in [&bob, &anon, &empty, &put] {
            assert_ne!(a, scoped(&r, &head(other), other, b"k", &mut memo));
        }
        assert_ne!(a, scoped(&r, &head(&alice), &alice, b"k2", &mut memo));
        let mut r2 = r.clone();
        r2.name = "other".into();
        assert_ne!(a, scoped(&r2, &head(&alice), &alice, b"k", &mut memo));
    }

    /// A body-key rule (`allow_on_headers_stop_iteration` set, as the key requires).
    fn body_rule(key: &str) -> Rule {
        let rule: alloc::sync::Arc<Rule> = crate::config::parse(
            alloc::format!(
                r#"{{"sidecar":{{"cluster":"s"}},"allow_on_headers_stop_iteration":true,"rules":[{{"key":{{{key}}}}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
        .rules
        .remove(0);
        alloc::sync::Arc::unwrap_or_clone(rule)
    }

    fn body_key(rule: &Rule, body: &str) -> Result<Option<Vec<u8>>, KeyError> {
        from_body(rule, body.as_bytes())
    }

    #[test]
    fn body_keys_are_strings_integers_and_booleans_as_text() {
        let r = body_rule(r#""body_pointer":"/data/object/id""#);
        let key = |body: &str| body_key(&r, body).map(|k| k.map(|k| String::from_utf8(k).unwrap()));
        let some = |k: &str| Ok(Some(k.to_string()));
        assert_eq!(key(r#"{"data":{"object":{"id":"evt_1"}}}"#), some("evt_1"));
        // Escapes decoded: the value a backend reads.
        assert_eq!(
            key(r#"{"data":{"object":{"id":"ev\u0074_1"}}}"#),
            some("evt_1")
        );
        assert_eq!(key(r#"{"data":{"object":{"id":42}}}"#), some("42"));
        assert_eq!(key(r#"{"data":{"object":{"id":-7}}}"#), some("-7"));
        assert_eq!(
            key(r#"{"data":{"object":{"id":18446744073709551615}}}"#),
            some("18446744073709551615")
        );
        assert_eq!(key(r#"{"data":{"object":{"id":true}}}"#), some("true"));
        // A member named twice: its last occurrence.
        assert_eq!(key(r#"{"data":{"object":{"id":"a","id":"b"}}}"#), some("b"));
        for inexact in [
            "1.5",
            "1e2",
            "100.0",
            "18446744073709551616",
            "-9223372036854775809",
        ] {
            let body = alloc::format!(r#"{{"data":{{"object":{{"id":{inexact}}}}}}}"#);
            assert_eq!(key(&body), Err(KeyError::NotInteger), "{inexact}");
        }
    }

    #[test]
    fn pointers_follow_rfc_6901() {
        let r = body_rule(r#""body_pointer":"/a~1b/m~0n/1""#);
        assert_eq!(
            body_key(&r, r#"{"a/b":{"m~n":["x","y"]}}"#)
                .unwrap()
                .unwrap(),
            b"y"
        );
        assert_eq!(
            body_key(&r, r#"{"a/b":{"m~n":{"1":"z"}}}"#)
                .unwrap()
                .unwrap(),
            b"z"
        );
        // `01`, `+1` and `-` are no array indices.
        for index in ["01", "+1", "-", "1x"] {
            let r = body_rule(&alloc::format!(r#""body_pointer":"/a/{index}""#));
            assert_eq!(body_key(&r, r#"{"a":["x","y"]}"#), Err(KeyError::Missing));
        }
    }

    #[test]
    fn absent_or_non_scalar_body_keys_follow_required() {
        let required = body_rule(r#""body_pointer":"/id""#);
        let optional = body_rule(r#""body_pointer":"/id","required":false"#);
        for body in [
            "",
            "{}",
            r#"{"id":null}"#,
            r#"{"id":{"x":1}}"#,
            r#"{"id":["x"]}"#,
            r#"{"id":""}"#,
            r#"["id"]"#,
            r#""id""#,
        ] {
            assert_eq!(body_key(&required, body), Err(KeyError::Missing), "{body}");
            assert_eq!(body_key(&optional, body), Ok(None), "{body}");
        }
        // Not JSON is refused whether or not the key is required.
        for body in [
            "id=1",
            "{\"id\":\"a\"",
            "{\"id\":\"a\"} x",
            " ",
            "\u{feff}{}",
        ] {
            assert_eq!(body_key(&required, body), Err(KeyError::NotJson), "{body}");
            assert_eq!(body_key(&optional, body), Err(KeyError::NotJson), "{body}");
        }
        assert_eq!(
            from_body(&required, b"{\"id\":\"\xff\"}"),
            Err(KeyError::NotJson)
        );
    }

    #[test]
    fn body_keys_are_checked_like_other_keys() {
        let r = body_rule(r#""body_pointer":"/id","max_length":4,"charset":"alphanumeric""#);
        assert_eq!(body_key(&r, r#"{"id":"abcd"}"#).unwrap().unwrap(), b"abcd");
        assert_eq!(body_key(&r, r#"{"id":"abcde"}"#), Err(KeyError::TooLong));
        assert_eq!(body_key(&r, r#"{"id":"a b"}"#), Err(KeyError::BadCharacter));
        assert_eq!(
            body_key(&r, r#"{"id":"\u00e9"}"#),
            Err(KeyError::BadCharacter)
        );
        // A quoted string is not unquoted as a header's sf-string would be.
        let r = body_rule(r#""body_pointer":"/id""#);
        assert_eq!(
            body_key(&r, r#"{"id":"\"k\""}"#).unwrap().unwrap(),
            b"\"k\""
        );
        // A request with no body is read as an empty one at request headers.
        let req = Req::new("POST", "/x");
        assert_eq!(extract(&r, &head(&req), &req), Err(KeyError::Missing));
    }
}
