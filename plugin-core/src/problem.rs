//! Local replies: RFC 9457 problem documents with stable `type` URIs, and replays of stored
//! responses. The filter's own problem types live here; the generic ones are shared with the
//! sidecar through `idemgate_wire::problem_types`.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use idemgate_wire::{PROBLEM_CONTENT_TYPE, Problem, StoredResponse};

/// The filter's problem types (documented in plugin/README.md).
pub mod types {
    pub use idemgate_wire::problem_types::TOO_LARGE;
    pub const MISSING_KEY: &str = "urn:idemgate:problem:missing-key";
    pub const INVALID_KEY: &str = "urn:idemgate:problem:invalid-key";
    pub const AMBIGUOUS: &str = "urn:idemgate:problem:ambiguous-request";
    pub const IN_PROGRESS: &str = "urn:idemgate:problem:in-progress";
    pub const MISMATCH: &str = "urn:idemgate:problem:key-reused";
    pub const QUEUE_FULL: &str = "urn:idemgate:problem:queue-full";
    pub const WAIT_EXPIRED: &str = "urn:idemgate:problem:wait-expired";
    pub const UNAVAILABLE: &str = "urn:idemgate:problem:unavailable";
    pub const RATE_LIMITED: &str = "urn:idemgate:problem:rate-limited";
}

/// A response the filter sends instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Envoy's response code details (`%RESPONSE_CODE_DETAILS%`).
    pub details: &'static str,
}

/// Header marking a replayed response (as Stripe and the IETF draft's examples do).
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

pub(crate) fn problem(
    status: u16,
    type_uri: &str,
    title: &str,
    detail: &str,
    retry_after_ms: Option<u64>,
    details: &'static str,
) -> Reply {
    let doc = Problem {
        type_uri: type_uri.to_string(),
        title: title.to_string(),
        status,
        detail: Some(detail.to_string()),
        retry_after_ms,
    };
    let mut headers = alloc::vec![("content-type".to_string(), PROBLEM_CONTENT_TYPE.to_string())];
    if let Some(ms) = retry_after_ms {
        headers.push((
            "retry-after".to_string(),
            format!("{}", ms.div_ceil(1000).max(1)),
        ));
    }
    Reply {
        status,
        headers,
        body: serde_json::to_vec(&doc).unwrap_or_default(),
        details,
    }
}

pub(crate) fn replay(response: &StoredResponse, body: &[u8]) -> Reply {
    let mut headers = response.headers.clone();
    headers.push((REPLAYED_HEADER.to_string(), "true".to_string()));
    Reply {
        status: response.status,
        headers,
        body: body.to_vec(),
        details: "idemgate_replayed",
    }
}
