//! Response capture for replay: the first caller's response is copied chunk by chunk as it
//! passes (the filter returns Continue, so the caller is never held back), up to the stored-body
//! cap. What cannot be replayed faithfully — over the cap, streamed (SSE), a content type
//! outside the allow-list — aborts or stores status and headers only, as configured.
//!
//! A gRPC call's outcome is its `grpc-status` (the trailers, or the headers of a trailers-only
//! response), not the HTTP status: what is stored is that status and its message, never the
//! response message (a replay to a gRPC call cannot carry one).

use alloc::string::{String, ToString};
use alloc::vec::Vec;
use idemgate_wire::{Limits, StoredResponse};

use crate::grpc;

use crate::spec::{ResponsePolicy, Unreplayable};

/// What happens to the key once the response is complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Store this response (the body may be empty for `store_status`).
    Store(StoredResponse, Vec<u8>),
    /// Release without storing, so the client's retry runs again.
    Abort,
}

#[derive(Debug)]
pub(crate) struct Capture {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// The status is one the policy stores.
    stored: bool,
    replayable: bool,
    /// A gRPC call: `Some` from the start, holding its `grpc-status` and raw `grpc-message`
    /// once they came.
    grpc: Option<Option<(u8, Vec<u8>)>>,
}

impl Capture {
    /// Starts from the response headers (pseudo-headers included, as Envoy lists them) of
    /// an HTTP request, or of a gRPC call (`grpc`).
    pub(crate) fn begin(
        policy: &ResponsePolicy,
        headers: &[(String, Vec<u8>)],
        grpc: bool,
    ) -> Capture {
        let status = value(headers, ":status")
            .and_then(|s| core::str::from_utf8(s).ok())
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        if grpc {
            // A gRPC response other than HTTP 200 is no answer from the service: abort.
            let mut capture = Capture {
                status,
                headers: Vec::new(),
                body: Vec::new(),
                stored: status == 200,
                replayable: true,
                grpc: Some(None),
            };
            capture.trailers(headers);
            return capture;
        }
        let value = |name: &str| value(headers, name);
        let stored = (100..=599).contains(&status) && policy.stores(status);
        let mut replayable = match value("content-type") {
            Some(ct) => content_type_allowed(policy, ct),
            None => true,
        };
        if let Some(len) = value("content-length").and_then(|v| core::str::from_utf8(v).ok()) {
            replayable &= len
                .trim()
                .parse::<usize>()
                .is_ok_and(|n| n <= policy.max_body);
        }
        let kept = headers
            .iter()
            .filter(|(n, _)| policy.headers.iter().any(|h| h == n))
            .filter_map(|(n, v)| Some((n.clone(), String::from(core::str::from_utf8(v).ok()?))))
            .collect();
        Capture {
            status,
            headers: kept,
            body: Vec::new(),
            stored,
            replayable,
            grpc: None,
        }
    }

    /// Response trailers (or a trailers-only response's headers): a gRPC call's status.
    pub(crate) fn trailers(&mut self, trailers: &[(String, Vec<u8>)]) {
        if let Some(end) = &mut self.grpc
            && let Some(code) = value(trailers, "grpc-status").and_then(grpc::parse_code)
        {
            let message = value(trailers, "grpc-message").unwrap_or_default();
            *end = Some((code, message.to_vec()));
        }
    }

    /// Whether response body chunks should be handed to [`Capture::chunk`].
    pub(crate) fn wants_body(&self) -> bool {
        self.stored && self.replayable && self.grpc.is_none()
    }

    pub(crate) fn chunk(&mut self, policy: &ResponsePolicy, data: &[u8]) {
        if !self.wants_body() {
            return;
        }
        if self.body.len().saturating_add(data.len()) > policy.max_body {
            self.replayable = false;
            self.body = Vec::new();
            return;
        }
        self.body.extend_from_slice(data);
    }

    pub(crate) fn finish(self, policy: &ResponsePolicy) -> Outcome {
        if !self.stored {
            return Outcome::Abort;
        }
        if let Some(end) = self.grpc {
            // No `grpc-status` (the stream ended without trailers, or with unusable ones):
            // the call's outcome is unknown, so a retry must run.
            let Some((code, message)) = end.filter(|(code, _)| policy.stores_grpc(*code)) else {
                return Outcome::Abort;
            };
            let mut response = StoredResponse {
                status: self.status,
                headers: alloc::vec![
                    ("grpc-status".to_string(), u64::from(code).to_string()),
                    (
                        "grpc-message".to_string(),
                        String::from_utf8(message).unwrap_or_default()
                    ),
                ],
            };
            // A message over the sidecar's limits is dropped; the status is what matters.
            if Limits::default().stored_response(&response, &[]).is_err() {
                response.headers.truncate(1);
            }
            return Outcome::Store(response, Vec::new());
        }
        let response = StoredResponse {
            status: self.status,
            headers: self.headers,
        };
        let fits = Limits::default()
            .stored_response(&response, &self.body)
            .is_ok();
        match (self.replayable && fits, policy.unreplayable) {
            (true, _) => Outcome::Store(response, self.body),
            (false, Unreplayable::StoreStatus) => {
                let bare = StoredResponse {
                    status: response.status,
                    headers: Vec::new(),
                };
                Outcome::Store(if fits { response } else { bare }, Vec::new())
            }
            (false, Unreplayable::Abort) => Outcome::Abort,
        }
    }
}

fn value<'h>(headers: &'h [(String, Vec<u8>)], name: &str) -> Option<&'h [u8]> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_slice())
}

/// Prefix match on the media type, or `type/*suffix` (`application/*+json`): any subtype of
/// `type` ending in `suffix`. Event streams are never replayable.
fn content_type_allowed(policy: &ResponsePolicy, raw: &[u8]) -> bool {
    let Ok(raw) = core::str::from_utf8(raw) else {
        return false;
    };
    let media = raw
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    media != "text/event-stream"
        && policy
            .content_types
            .iter()
            .any(|allowed| match allowed.split_once("/*") {
                Some((kind, suffix)) => media
                    .strip_prefix(kind)
                    .and_then(|m| m.strip_prefix('/'))
                    .is_some_and(|subtype| subtype.ends_with(suffix)),
                None => media.starts_with(allowed.as_str()),
            })
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    impl Capture {
        fn begin_http(policy: &ResponsePolicy, headers: &[(String, Vec<u8>)]) -> Capture {
            Capture::begin(policy, headers, false)
        }
    }

    fn grpc_end(p: &ResponsePolicy, head: &[(&str, &str)], trailers: &[(&str, &str)]) -> Outcome {
        let pairs = |list: &[(&str, &str)]| -> Vec<(String, Vec<u8>)> {
            list.iter()
                .map(|(n, v)| ((*n).into(), v.as_bytes().to_vec()))
                .collect()
        };
        let mut c = Capture::begin(p, &pairs(head), true);
        assert!(!c.wants_body(), "a gRPC call's messages are never stored");
        c.trailers(&pairs(trailers));
        c.finish(p)
    }

    #[test]
    fn a_grpc_call_is_judged_by_its_grpc_status() {
        let p = policy("");
        let ok = [(":status", "200"), ("content-type", "application/grpc")];
        let stored = |code: &str, message: &str| {
            Outcome::Store(
                StoredResponse {
                    status: 200,
                    headers: vec![
                        ("grpc-status".into(), code.into()),
                        ("grpc-message".into(), message.into()),
                    ],
                },
                Vec::new(),
            )
        };
        // OK and NOT_FOUND in the trailers are stored, with the message as it came.
        assert_eq!(grpc_end(&p, &ok, &[("grpc-status", "0")]), stored("0", ""));
        assert_eq!(
            grpc_end(
                &p,
                &ok,
                &[("grpc-status", "5"), ("grpc-message", "gone%25")]
            ),
            stored("5", "gone%25")
        );
        // HTTP 200 with INTERNAL is a failed call: a retry must run.
        for code in ["13", "14", "2", "4", "16", "10"] {
            assert_eq!(
                grpc_end(&p, &ok, &[("grpc-status", code)]),
                Outcome::Abort,
                "{code}"
            );
        }
        // A trailers-only response carries the status in its headers.
        let trailers_only = [(":status", "200"), ("grpc-status", "3")];
        assert_eq!(grpc_end(&p, &trailers_only, &[]), stored("3", ""));
        // No grpc-status, an unknown one, or no HTTP 200: the outcome is unknown.
        assert_eq!(grpc_end(&p, &ok, &[]), Outcome::Abort);
        assert_eq!(grpc_end(&p, &ok, &[("grpc-status", "99")]), Outcome::Abort);
        let refused = [(":status", "503"), ("grpc-status", "0")];
        assert_eq!(grpc_end(&p, &refused, &[]), Outcome::Abort);
        // The rule's list decides.
        let only_ok = policy(r#","grpc_store":["OK","INTERNAL"]"#);
        assert_eq!(
            grpc_end(&only_ok, &ok, &[("grpc-status", "5")]),
            Outcome::Abort
        );
        assert!(matches!(
            grpc_end(&only_ok, &ok, &[("grpc-status", "13")]),
            Outcome::Store(..)
        ));
    }

    fn policy(extra: &str) -> ResponsePolicy {
        crate::config::parse(
            alloc::format!(r#"{{"sidecar":{{"cluster":"s"}},"rules":[{{"response":{{"max_body_bytes":8{extra}}}}}]}}"#)
                .as_bytes(),
        )
        .unwrap()
        .rules
        .remove(0)
        .response
        .clone()
    }

    fn headers(status: &str, ct: &str) -> Vec<(String, Vec<u8>)> {
        vec![
            (":status".into(), status.as_bytes().to_vec()),
            ("content-type".into(), ct.as_bytes().to_vec()),
            ("set-cookie".into(), b"s=1".to_vec()),
            ("date".into(), b"today".to_vec()),
            ("etag".into(), b"\"v1\"".to_vec()),
        ]
    }

    #[test]
    fn stores_allow_listed_headers_and_body() {
        let p = policy("");
        let mut c = Capture::begin_http(&p, &headers("201", "application/json; charset=utf-8"));
        c.chunk(&p, b"{\"a\"");
        c.chunk(&p, b":1}");
        let Outcome::Store(r, body) = c.finish(&p) else {
            panic!()
        };
        assert_eq!(r.status, 201);
        assert_eq!(
            r.headers,
            vec![
                (
                    "content-type".into(),
                    "application/json; charset=utf-8".into()
                ),
                ("etag".into(), "\"v1\"".into())
            ]
        );
        assert_eq!(body, b"{\"a\":1}");
    }

    #[test]
    fn json_suffix_types_are_replayable_by_default() {
        let p = policy("");
        for ct in [
            "application/vnd.api+json",
            "application/hal+json; charset=utf-8",
            "application/problem+json",
            "Application/JSON",
        ] {
            let mut c = Capture::begin_http(&p, &headers("201", ct));
            c.chunk(&p, b"{}");
            assert!(matches!(c.finish(&p), Outcome::Store(..)), "{ct}");
        }
    }

    #[test]
    fn statuses_that_abort() {
        let p = policy("");
        // 401/403/407: a retry with fresh credentials must run, not replay the refusal.
        for s in ["500", "503", "401", "403", "407", "408", "429", "garbage"] {
            assert_eq!(
                Capture::begin_http(&p, &headers(s, "application/json")).finish(&p),
                Outcome::Abort,
                "{s}"
            );
        }
        assert!(matches!(
            Capture::begin_http(&p, &headers("404", "application/json")).finish(&p),
            Outcome::Store(..)
        ));
    }

    #[test]
    fn unreplayable_aborts_or_stores_status() {
        let p = policy("");
        let mut big = Capture::begin_http(&p, &headers("200", "application/json"));
        big.chunk(&p, b"123456789");
        assert_eq!(big.finish(&p), Outcome::Abort);
        assert_eq!(
            Capture::begin_http(&p, &headers("200", "text/event-stream")).finish(&p),
            Outcome::Abort
        );
        assert_eq!(
            Capture::begin_http(&p, &headers("200", "image/png")).finish(&p),
            Outcome::Abort
        );
        for not_json in [
            "application/xml+jsonx",
            "text/x+json",
            "application/vnd.x+xml",
        ] {
            assert!(
                !Capture::begin_http(&p, &headers("200", not_json)).wants_body(),
                "{not_json}"
            );
        }
        let p = policy(r#","unreplayable":"store_status""#);
        let mut big = Capture::begin_http(&p, &headers("200", "application/json"));
        big.chunk(&p, b"123456789");
        let Outcome::Store(r, body) = big.finish(&p) else {
            panic!()
        };
        assert_eq!((r.status, body.len()), (200, 0));
        let mut declared = headers("200", "application/json");
        declared.push(("content-length".into(), b"100".to_vec()));
        assert!(!Capture::begin_http(&p, &declared).wants_body());
    }
}
