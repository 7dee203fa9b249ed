//! Local replies: the filter's refusals, rendered as RFC 9457 problem documents with stable
//! `type` URIs, and replays of stored responses. The filter's own problem types live here; the
//! generic ones are shared with the sidecar through `idemgate_wire::problem_types`.

use alloc::borrow::Cow;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use idemgate_wire::{PROBLEM_CONTENT_TYPE, StoredResponse};

use crate::canonical::decode;
use crate::grpc::{self, code};
use crate::hash::decimal;
use crate::key::KeyError;

/// The filter's problem types (documented in plugin/README.md).
pub(crate) mod types {
    pub(crate) use idemgate_wire::problem_types::TOO_LARGE;
    pub(crate) const MISSING_KEY: &str = "urn:idemgate:problem:missing-key";
    pub(crate) const INVALID_KEY: &str = "urn:idemgate:problem:invalid-key";
    pub(crate) const AMBIGUOUS: &str = "urn:idemgate:problem:ambiguous-request";
    pub(crate) const NOT_JSON: &str = "urn:idemgate:problem:not-json";
    pub(crate) const IN_PROGRESS: &str = "urn:idemgate:problem:in-progress";
    pub(crate) const MISMATCH: &str = "urn:idemgate:problem:key-reused";
    pub(crate) const QUEUE_FULL: &str = "urn:idemgate:problem:queue-full";
    pub(crate) const WAIT_EXPIRED: &str = "urn:idemgate:problem:wait-expired";
    pub(crate) const UNAVAILABLE: &str = "urn:idemgate:problem:unavailable";
    pub(crate) const RATE_LIMITED: &str = "urn:idemgate:problem:rate-limited";
}

/// A reply's header: the filter's own names and values are constants, so a refusal's are
/// borrowed (each owned copy cost a local reply an allocation and its free, ~260
/// instructions in the filter); a replay's are the stored response's.
pub type Header = (Cow<'static, str>, Cow<'static, str>);

/// A response the filter sends instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<Header>,
    pub body: Vec<u8>,
    /// Envoy's response code details (`%RESPONSE_CODE_DETAILS%`).
    pub details: &'static str,
    /// For a gRPC request: the call's status, which the glue passes to
    /// `proxy_send_local_response`. Envoy then sends a trailers-only response (HTTP 200,
    /// `grpc-status`, `body` as the percent-encoded `grpc-message`, `headers` as metadata);
    /// it cannot carry a message body (`Utility::sendLocalReply`,
    /// source/common/http/utility.cc).
    pub grpc_status: Option<u8>,
}

/// Header marking a replayed response (as Stripe and the IETF draft's examples do).
const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Why the filter answers a request itself instead of forwarding it: one variant per problem
/// type, each a row of plugin/README.md's table ("Decisions, local replies and problem
/// types"), rendered by [`Refusal::reply`] alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// 400: the rule requires a key and the request has none.
    MissingKey,
    /// 400: the key is malformed, too long, has characters the rule does not allow, or is
    /// sent more than once.
    InvalidKey(KeyError),
    /// 400: the path or the caller's identity reads two ways (an encoded separator, a
    /// repeated scope header).
    Ambiguous(KeyError),
    /// 400: the rule reads its key from a JSON body (`key.body_pointer`) and the body is not
    /// JSON.
    NotJson,
    /// 409: an earlier request with the key still runs (`on_conflict: reject`).
    InProgress { retry_after_ms: u64 },
    /// 413: the body is larger than the rule fingerprints.
    TooLarge,
    /// 422: the key was used for a different request.
    Mismatch,
    /// 429: the key's queue is full.
    QueueFull { retry_after_ms: u64 },
    /// 429: over a rate limit; `fields` are its `RateLimit-Policy` / `RateLimit` headers.
    RateLimited {
        retry_after_ms: u64,
        fields: Vec<(String, String)>,
    },
    /// 503: the queued request waited its whole budget and the earlier one still runs.
    WaitExpired { retry_after_ms: u64 },
    /// 503: the decision could not be made (sidecar down and failing closed, no local slot
    /// under `failure_mode: local`, the body not handed over).
    Unavailable { retry_after_ms: u64 },
}

impl Refusal {
    /// The refusal of a request whose key could not be used.
    pub(crate) fn of_key(e: KeyError) -> Refusal {
        match e {
            KeyError::Missing => Refusal::MissingKey,
            KeyError::RepeatedScope | KeyError::EncodedSeparator => Refusal::Ambiguous(e),
            KeyError::NotJson => Refusal::NotJson,
            _ => Refusal::InvalidKey(e),
        }
    }

    /// The gRPC status a gRPC call is refused with, chosen as gRPC services choose it
    /// (grpc/doc/statuscodes.md), one per row of plugin/README.md's "gRPC" table.
    fn grpc_code(&self) -> u8 {
        match self {
            Refusal::MissingKey
            | Refusal::InvalidKey(_)
            | Refusal::Ambiguous(_)
            | Refusal::NotJson => code::INVALID_ARGUMENT,
            // Concurrency conflict: retry at a higher level (after the pushback).
            Refusal::InProgress { .. } => code::ABORTED,
            // The request is well-formed, the key's state forbids it: retrying the same call
            // cannot succeed until the client uses a new key.
            Refusal::Mismatch => code::FAILED_PRECONDITION,
            Refusal::TooLarge | Refusal::QueueFull { .. } | Refusal::RateLimited { .. } => {
                code::RESOURCE_EXHAUSTED
            }
            Refusal::WaitExpired { .. } | Refusal::Unavailable { .. } => code::UNAVAILABLE,
        }
    }

    /// The reply: for HTTP the problem+json document — status, `type`, `title`, `detail`,
    /// `Retry-After` (seconds, rounded up, mirrored in `retry_after_ms`) and Envoy's response
    /// code details; for a gRPC call (`grpc`) its status, `title: detail` as the message and
    /// the wait as `grpc-retry-pushback-ms` (gRFC A6).
    pub(crate) fn reply(self, grpc: bool) -> Reply {
        let (status, type_uri, title, detail, retry_after_ms, details) = match &self {
            Refusal::MissingKey => (
                400,
                types::MISSING_KEY,
                "Idempotency key required",
                KeyError::Missing.detail(),
                None,
                "idemgate_bad_key",
            ),
            Refusal::InvalidKey(e) => (
                400,
                types::INVALID_KEY,
                "Invalid idempotency key",
                e.detail(),
                None,
                "idemgate_bad_key",
            ),
            Refusal::Ambiguous(e) => (
                400,
                types::AMBIGUOUS,
                "Ambiguous request",
                e.detail(),
                None,
                "idemgate_bad_key",
            ),
            Refusal::NotJson => (
                400,
                types::NOT_JSON,
                "Request body is not JSON",
                KeyError::NotJson.detail(),
                None,
                "idemgate_bad_key",
            ),
            Refusal::InProgress { retry_after_ms } => (
                409,
                types::IN_PROGRESS,
                "A request with this key is in progress",
                "an earlier request with the same key has not finished; retry later",
                Some(*retry_after_ms),
                "idemgate_in_progress",
            ),
            Refusal::TooLarge => (
                413,
                types::TOO_LARGE,
                "Request body too large",
                "the body is larger than this endpoint fingerprints",
                None,
                "idemgate_body_too_large",
            ),
            Refusal::Mismatch => (
                422,
                types::MISMATCH,
                "Idempotency key reused with a different request",
                "this key was used for a request with a different method, path, headers or body",
                None,
                "idemgate_key_reused",
            ),
            Refusal::QueueFull { retry_after_ms } => (
                429,
                types::QUEUE_FULL,
                "Too many requests waiting for this key",
                "too many requests with this key are already waiting",
                Some(*retry_after_ms),
                "idemgate_queue_full",
            ),
            Refusal::RateLimited { retry_after_ms, .. } => (
                429,
                types::RATE_LIMITED,
                "Too many requests",
                "over the rate limit for this caller or resource; retry after the indicated time",
                Some(*retry_after_ms),
                "idemgate_rate_limited",
            ),
            Refusal::WaitExpired { retry_after_ms } => (
                503,
                types::WAIT_EXPIRED,
                "Waited too long for an earlier request",
                "an earlier request with this key is still running; retry later",
                Some(*retry_after_ms),
                "idemgate_wait_expired",
            ),
            Refusal::Unavailable { retry_after_ms } => (
                503,
                types::UNAVAILABLE,
                "Duplicate protection unavailable",
                "the coordination service did not answer; retry later",
                Some(*retry_after_ms),
                "idemgate_unavailable",
            ),
        };
        if grpc {
            let mut headers = Vec::new();
            if let Some(ms) = retry_after_ms {
                headers.push(("grpc-retry-pushback-ms".into(), ms.to_string().into()));
            }
            let grpc_status = Some(self.grpc_code());
            if let Refusal::RateLimited { fields, .. } = self {
                headers.extend(owned(fields));
            }
            // Pushed, not `concat`/`format!`: either costs the filter ~1 KiB here.
            let mut message = String::from(title);
            message.push_str(": ");
            message.push_str(detail);
            return Reply {
                status,
                headers,
                body: message.into_bytes(),
                details,
                grpc_status,
            };
        }
        // The one text with a character JSON escapes; every other is JSON as written (the
        // test `problem_bodies_are_what_serde_json_writes` holds them to that).
        let json_detail = match &self {
            Refusal::InvalidKey(KeyError::EncodedSeparator)
            | Refusal::Ambiguous(KeyError::EncodedSeparator) => {
                r"the path has an encoded / or \\ (%2F, %5C), which servers read differently"
            }
            _ => detail,
        };
        let mut headers: Vec<Header> = Vec::with_capacity(4);
        headers.push(("content-type".into(), PROBLEM_CONTENT_TYPE.into()));
        if let Some(ms) = retry_after_ms {
            headers.push((
                "retry-after".into(),
                decimal(ms.div_ceil(1000).max(1), &mut [0; 20])
                    .to_string()
                    .into(),
            ));
        }
        if let Refusal::RateLimited { fields, .. } = self {
            headers.extend(owned(fields));
        }
        Reply {
            status,
            headers,
            body: problem_json(type_uri, title, status, json_detail, retry_after_ms),
            details,
            grpc_status: None,
        }
    }
}

/// Headers made at run time (a limit's fields, a stored response's), as a reply's.
fn owned(headers: impl IntoIterator<Item = (String, String)>) -> impl Iterator<Item = Header> {
    headers
        .into_iter()
        .map(|(name, value)| (name.into(), value.into()))
}

/// The problem document, the bytes serde_json writes for [`Problem`] (the test
/// `problem_bodies_are_what_serde_json_writes` holds them equal), written out from texts
/// already JSON: every part but the wait is one of the constants above, so serializing a
/// `Problem` of owned copies cost a local reply ~10 allocations and ~4,000 instructions, and
/// scanning the texts for characters to escape ~16 instructions a byte.
fn problem_json(
    type_uri: &str,
    title: &str,
    status: u16,
    detail: &str,
    retry_after_ms: Option<u64>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    let mut digits = [0; 20];
    for (part, text) in [
        (&b"{\"type\":\""[..], type_uri),
        (b"\",\"title\":\"", title),
        (b"\",\"status\":", decimal(status.into(), &mut digits)),
        (b",\"detail\":\"", detail),
    ] {
        out.extend_from_slice(part);
        out.extend_from_slice(text.as_bytes());
    }
    out.push(b'"');
    if let Some(ms) = retry_after_ms {
        out.extend_from_slice(b",\"retry_after_ms\":");
        out.extend_from_slice(decimal(ms, &mut digits).as_bytes());
    }
    out.push(b'}');
    out
}

/// What a gRPC call replayed with when its first run ended OK: the response message cannot
/// be sent again (a local reply to a gRPC request is trailers-only), and a bare OK without
/// one is a broken unary call; ALREADY_EXISTS says the call ran, and did not run again.
const GRPC_DONE_MESSAGE: &str = "a call with this idempotency key already completed (OK)";

/// The replay of a stored response. A gRPC call (`grpc`) gets the stored call's status and
/// message exactly, an OK as ALREADY_EXISTS (see [`GRPC_DONE_MESSAGE`]); both carry
/// `idempotent-replayed: true` as metadata.
pub(crate) fn replay(response: &StoredResponse, body: &[u8], grpc: bool) -> Reply {
    let replayed: Header = (REPLAYED_HEADER.into(), "true".into());
    if grpc {
        let stored = |name: &str| {
            response
                .headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_bytes())
        };
        let ran = (200..300).contains(&response.status);
        let (grpc_status, message) = match stored("grpc-status").and_then(grpc::parse_code) {
            // Stored percent-encoded as it came; Envoy encodes the reply's message again.
            Some(status) if status != code::OK => (
                Some(status),
                decode(stored("grpc-message").unwrap_or_default(), false),
            ),
            Some(_) => (Some(code::ALREADY_EXISTS), GRPC_DONE_MESSAGE.into()),
            // Stored by an HTTP call under the same key: a success ran; other statuses are
            // mapped by Envoy from the HTTP status.
            None if ran => (Some(code::ALREADY_EXISTS), GRPC_DONE_MESSAGE.into()),
            None => (None, Vec::new()),
        };
        return Reply {
            status: response.status,
            headers: alloc::vec![replayed],
            body: message,
            details: "idemgate_replayed",
            grpc_status,
        };
    }
    let mut headers = Vec::with_capacity(response.headers.len() + 1);
    headers.extend(owned(response.headers.iter().cloned()));
    headers.push(replayed);
    Reply {
        status: response.status,
        headers,
        body: body.to_vec(),
        details: "idemgate_replayed",
        grpc_status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::format;
    use idemgate_wire::Problem;

    /// One refusal of each kind, in the README's order.
    fn every_refusal() -> Vec<Refusal> {
        let every = alloc::vec![
            Refusal::MissingKey,
            Refusal::InvalidKey(KeyError::Malformed),
            Refusal::Ambiguous(KeyError::EncodedSeparator),
            Refusal::NotJson,
            Refusal::InProgress {
                retry_after_ms: 1_500
            },
            Refusal::TooLarge,
            Refusal::Mismatch,
            Refusal::QueueFull {
                retry_after_ms: 1_500
            },
            Refusal::RateLimited {
                retry_after_ms: 1_500,
                fields: alloc::vec![("ratelimit".into(), "\"scope\";r=0;t=2".into())],
            },
            Refusal::WaitExpired {
                retry_after_ms: 1_500
            },
            Refusal::Unavailable {
                retry_after_ms: 1_500
            },
        ];
        // A variant added to `Refusal` must get a place here, and then be in the list.
        let places: Vec<usize> = every
            .iter()
            .map(|r| match r {
                Refusal::MissingKey => 0,
                Refusal::InvalidKey(_) => 1,
                Refusal::Ambiguous(_) => 2,
                Refusal::NotJson => 3,
                Refusal::InProgress { .. } => 4,
                Refusal::TooLarge => 5,
                Refusal::Mismatch => 6,
                Refusal::QueueFull { .. } => 7,
                Refusal::RateLimited { .. } => 8,
                Refusal::WaitExpired { .. } => 9,
                Refusal::Unavailable { .. } => 10,
            })
            .collect();
        assert_eq!(places, (0..every.len()).collect::<Vec<_>>());
        every
    }

    /// `(status, type, whether Retry-After is sent)` per row of plugin/README.md's table of
    /// problem types.
    fn readme_rows() -> Vec<(u16, String, bool)> {
        let readme = include_str!("../../plugin/README.md");
        let section = readme
            .split("\n## Decisions, local replies and problem types\n")
            .nth(1)
            .expect("plugin/README.md has the problem types section");
        let section = section.split("\n## ").next().unwrap_or_default();
        section
            .lines()
            .filter_map(|line| {
                let cells: Vec<&str> = line.split('|').map(str::trim).collect();
                let status = cells.get(1)?.parse::<u16>().ok()?;
                assert_eq!(cells.len(), 6, "a row of four columns: {line}");
                let type_uri = cells[2].trim_matches('`').to_string();
                Some((status, type_uri, cells[4] != "—"))
            })
            .collect()
    }

    #[test]
    fn the_plugin_readme_documents_every_refusal_as_sent() {
        let rows = readme_rows();
        let every = every_refusal();
        for refusal in &every {
            let reply = refusal.clone().reply(false);
            let doc: Problem = serde_json::from_slice(&reply.body).unwrap();
            assert_eq!(doc.status, reply.status);
            let retry_after = reply.headers.iter().any(|(n, _)| n == "retry-after");
            let row = (reply.status, doc.type_uri, retry_after);
            assert!(
                rows.contains(&row),
                "plugin/README.md has no row {row:?} for {refusal:?}: {rows:?}"
            );
        }
        assert_eq!(
            rows.len(),
            every.len(),
            "plugin/README.md documents a problem the filter does not send: {rows:?}"
        );
    }

    #[test]
    fn the_plugin_readme_documents_every_refusal_s_grpc_status() {
        let readme = include_str!("../../plugin/README.md");
        let section = readme
            .split("\n## gRPC\n")
            .nth(1)
            .expect("plugin/README.md has the gRPC section");
        let section = section.split("\n## ").next().unwrap_or_default();
        let rows: Vec<(String, String)> = section
            .lines()
            .filter_map(|line| {
                let cells: Vec<&str> = line.split('|').map(str::trim).collect();
                let type_uri = cells.get(1)?.strip_prefix("`urn:")?;
                let code = cells.get(2)?.trim_matches('`');
                Some((
                    format!("urn:{}", type_uri.trim_matches('`')),
                    code.to_string(),
                ))
            })
            .collect();
        let every = every_refusal();
        for refusal in &every {
            let http: Problem = serde_json::from_slice(&refusal.clone().reply(false).body).unwrap();
            let reply = refusal.clone().reply(true);
            let code = grpc::CODE_NAMES[usize::from(reply.grpc_status.unwrap())].to_string();
            let row = (http.type_uri, code);
            assert!(
                rows.contains(&row),
                "plugin/README.md has no gRPC row {row:?}: {rows:?}"
            );
            // The message is the problem's title and detail; the wait is pushback in ms.
            let message = String::from_utf8(reply.body).unwrap();
            assert_eq!(
                message,
                alloc::format!("{}: {}", http.title, http.detail.unwrap())
            );
            let pushback = reply
                .headers
                .iter()
                .find(|(n, _)| n == "grpc-retry-pushback-ms")
                .map(|(_, v)| &**v);
            assert_eq!(
                pushback,
                http.retry_after_ms.map(|ms| ms.to_string()).as_deref()
            );
            assert!(
                !reply
                    .headers
                    .iter()
                    .any(|(n, _)| n == "retry-after" || n == "content-type")
            );
        }
        assert_eq!(rows.len(), every.len(), "{rows:?}");
    }

    /// The bytes clients and dashboards see: a change here is a change of the interface.
    #[test]
    fn every_refusal_renders_exactly_so() {
        let expected = [
            (
                400,
                "",
                "idemgate_bad_key",
                r#"{"type":"urn:idemgate:problem:missing-key","title":"Idempotency key required","status":400,"detail":"this endpoint requires an idempotency key"}"#,
            ),
            (
                400,
                "",
                "idemgate_bad_key",
                r#"{"type":"urn:idemgate:problem:invalid-key","title":"Invalid idempotency key","status":400,"detail":"the key is not a valid RFC 8941 string or token"}"#,
            ),
            (
                400,
                "",
                "idemgate_bad_key",
                r#"{"type":"urn:idemgate:problem:ambiguous-request","title":"Ambiguous request","status":400,"detail":"the path has an encoded / or \\ (%2F, %5C), which servers read differently"}"#,
            ),
            (
                400,
                "",
                "idemgate_bad_key",
                r#"{"type":"urn:idemgate:problem:not-json","title":"Request body is not JSON","status":400,"detail":"this endpoint reads its key from a JSON body, and the body is not JSON"}"#,
            ),
            (
                409,
                "2",
                "idemgate_in_progress",
                r#"{"type":"urn:idemgate:problem:in-progress","title":"A request with this key is in progress","status":409,"detail":"an earlier request with the same key has not finished; retry later","retry_after_ms":1500}"#,
            ),
            (
                413,
                "",
                "idemgate_body_too_large",
                r#"{"type":"urn:idemgate:problem:too-large","title":"Request body too large","status":413,"detail":"the body is larger than this endpoint fingerprints"}"#,
            ),
            (
                422,
                "",
                "idemgate_key_reused",
                r#"{"type":"urn:idemgate:problem:key-reused","title":"Idempotency key reused with a different request","status":422,"detail":"this key was used for a request with a different method, path, headers or body"}"#,
            ),
            (
                429,
                "2",
                "idemgate_queue_full",
                r#"{"type":"urn:idemgate:problem:queue-full","title":"Too many requests waiting for this key","status":429,"detail":"too many requests with this key are already waiting","retry_after_ms":1500}"#,
            ),
            (
                429,
                "2",
                "idemgate_rate_limited",
                r#"{"type":"urn:idemgate:problem:rate-limited","title":"Too many requests","status":429,"detail":"over the rate limit for this caller or resource; retry after the indicated time","retry_after_ms":1500}"#,
            ),
            (
                503,
                "2",
                "idemgate_wait_expired",
                r#"{"type":"urn:idemgate:problem:wait-expired","title":"Waited too long for an earlier request","status":503,"detail":"an earlier request with this key is still running; retry later","retry_after_ms":1500}"#,
            ),
            (
                503,
                "2",
                "idemgate_unavailable",
                r#"{"type":"urn:idemgate:problem:unavailable","title":"Duplicate protection unavailable","status":503,"detail":"the coordination service did not answer; retry later","retry_after_ms":1500}"#,
            ),
        ];
        let every = every_refusal();
        assert_eq!(every.len(), expected.len());
        for (refusal, (status, retry_after, details, body)) in every.into_iter().zip(expected) {
            let rate_limited = matches!(refusal, Refusal::RateLimited { .. });
            let reply = refusal.reply(false);
            let mut headers: Vec<Header> =
                alloc::vec![("content-type".into(), "application/problem+json".into())];
            if !retry_after.is_empty() {
                headers.push(("retry-after".into(), retry_after.into()));
            }
            if rate_limited {
                headers.push(("ratelimit".into(), "\"scope\";r=0;t=2".into()));
            }
            assert_eq!(
                (reply.status, reply.headers, reply.details),
                (status, headers, details)
            );
            assert_eq!(core::str::from_utf8(&reply.body).unwrap(), body);
        }
    }

    /// The written-out document is the one serde_json makes of the same [`Problem`], for
    /// every refusal and for waits of every length.
    #[test]
    fn problem_bodies_are_what_serde_json_writes() {
        let every_key_error = [
            KeyError::Missing,
            KeyError::Malformed,
            KeyError::TooLong,
            KeyError::BadCharacter,
            KeyError::Repeated,
            KeyError::RepeatedScope,
            KeyError::EncodedSeparator,
            KeyError::NotJson,
            KeyError::NotInteger,
        ];
        let mut refusals = every_refusal();
        for e in every_key_error {
            refusals.extend([Refusal::InvalidKey(e), Refusal::Ambiguous(e)]);
        }
        for refusal in refusals {
            for retry_after_ms in [0, 7, 1_500, 86_400_000, u64::MAX] {
                let refusal = match refusal.clone() {
                    Refusal::InProgress { .. } => Refusal::InProgress { retry_after_ms },
                    Refusal::RateLimited { fields, .. } => Refusal::RateLimited {
                        retry_after_ms,
                        fields,
                    },
                    other => other,
                };
                let reply = refusal.reply(false);
                let doc: Problem = serde_json::from_slice(&reply.body).unwrap();
                assert_eq!(serde_json::to_vec(&doc).unwrap(), reply.body);
            }
        }
    }
}
