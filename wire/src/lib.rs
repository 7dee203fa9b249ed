//! The wire protocol between the idemgate filter (inside Envoy) and the lock sidecar.
//!
//! Both ends depend on this crate, so the message shapes, the framing, the paths and the
//! field limits cannot drift apart. It compiles for `wasm32-wasip1` as well as natively and
//! depends only on `serde`/`serde_json`, because it ends up inside the filter's `.wasm`.
//!
//! # Framing
//!
//! Every protocol message (request and answer) is one compact JSON document, optionally
//! followed by a single `\n` and a raw binary payload — the body of a stored response.
//! Compact JSON never contains a raw newline (newlines inside strings are escaped), so the
//! first `\n` unambiguously ends the head. Raw payloads avoid base64: a stored 1 MiB body
//! travels as 1 MiB, and the filter replays it without decoding anything. A message without
//! payload is plain JSON, so `curl` works for everything except replay bodies.
//!
//! # Status codes
//!
//! Every protocol *answer* (granted, busy, stale owner, ...) is HTTP 200 with an
//! `outcome` field. Any other status means the sidecar could not process the request
//! (400/413 bad input, 401 missing token, 503 store unavailable) and carries an
//! RFC 9457 [`Problem`] body.

#![no_std]
extern crate alloc;

use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize, de};

mod answer;
mod rate;
mod tree;
mod validate;
pub use rate::{
    GcraStep, MAX_CHECKS, MAX_WINDOW_US, Rate, RateCheck, RateOutcome, RateRequest, RateResult,
    gcra,
};
pub use tree::{Malformed, decode_answer};
pub use validate::{FieldError, Limits};

/// Request paths served by the sidecar.
pub mod paths {
    /// Claim a key: [`crate::ClaimRequest`] → [`crate::ClaimOutcome`].
    pub const CLAIM: &str = "/v1/claim";
    /// Store the response and release: [`crate::CompleteRequest`] → [`crate::OwnerOutcome`].
    pub const COMPLETE: &str = "/v1/complete";
    /// Release without storing: [`crate::AbortRequest`] → [`crate::OwnerOutcome`].
    pub const ABORT: &str = "/v1/abort";
    /// Extend the in-flight lease: [`crate::RenewRequest`] → [`crate::OwnerOutcome`].
    pub const RENEW: &str = "/v1/renew";
    /// Check rate limits: [`crate::RateRequest`] → [`crate::RateOutcome`].
    pub const RATE: &str = "/v1/rate";
    /// Give up a queued claim: [`crate::LeaveRequest`] → [`crate::OwnerOutcome`].
    pub const LEAVE: &str = "/v1/leave";
}

/// Content type of framed protocol messages (JSON head, optional `\n` + payload).
pub const CONTENT_TYPE: &str = "application/vnd.idemgate.v1";
/// Content type of RFC 9457 error bodies.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// What a claimed key protects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The first call's response is stored and replayed to later calls with the same key.
    Idempotency,
    /// Mutual exclusion only: nothing is stored, the next caller runs after the holder.
    Lock,
}

/// How long, and behind how many others, a claim may wait for its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitPolicy {
    /// Base wait budget.
    pub budget_ms: u64,
    /// Extra budget per waiter already queued ahead (a long queue needs longer to drain).
    #[serde(default)]
    pub per_waiter_ms: u64,
    /// Upper bound of the grown budget; never below `budget_ms`.
    #[serde(default)]
    pub max_budget_ms: u64,
    /// Queue depth beyond which the claim is refused with [`ClaimOutcome::QueueFull`].
    pub max_queue: u32,
}

impl WaitPolicy {
    /// The budget for a waiter that has `ahead` waiters in front of it.
    pub fn budget_for(&self, ahead: u32) -> u64 {
        let grown = self
            .budget_ms
            .saturating_add(self.per_waiter_ms.saturating_mul(u64::from(ahead)));
        grown.min(self.max_budget_ms.max(self.budget_ms))
    }

    /// The longest budget any waiter can get: what a caller's own timeout must exceed.
    pub fn longest_budget(&self) -> u64 {
        self.budget_for(self.max_queue)
    }
}

/// `POST /v1/claim`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    /// The scoped, hashed key (the filter never sends raw keys or caller identities).
    pub key: String,
    pub mode: Mode,
    /// In-flight lease: the key is released by itself this long after the grant.
    pub lease_ms: u64,
    /// Request fingerprint (idempotency mode): a different one for the same key is a mismatch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// Wait in FIFO order when the key is held; `None` answers [`ClaimOutcome::Busy`] at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<WaitPolicy>,
    /// A name the caller gives its place in the queue (unguessable, unique per claim), so it
    /// can give the place up with [`LeaveRequest`] when its own client goes away: the filter
    /// cannot cancel an HTTP callout in flight, so without it a place held by a gone client
    /// would block the queue until its wait budget ran out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiter: Option<String>,
}

/// The answer to a claim (always HTTP 200). [`ClaimOutcome::Completed`] carries the stored
/// body as the frame's payload. Answers tolerate unknown fields (a newer sidecar may add
/// some) while requests reject them (a typo must not silently change a claim).
///
/// On the wire it is internally tagged (`{"outcome":"granted",...}`); it is decoded through
/// the flat `answer::ClaimAnswer` because serde's internally tagged decoding buffers the
/// document first, which costs the filter's `.wasm` ~20 KB.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
#[serde(try_from = "answer::ClaimAnswer")]
pub enum ClaimOutcome {
    /// The caller holds the key until it completes, aborts or the lease ends.
    Granted {
        /// Unguessable proof of ownership for complete/abort/renew.
        owner: String,
        /// Strictly increasing per key, never reused; stamped on what goes upstream.
        fence: u64,
        /// The lease actually granted (the sidecar may cap the requested one).
        lease_ms: u64,
        /// Time spent queued before the grant.
        #[serde(default)]
        waited_ms: u64,
    },
    /// A previous call with this key finished; replay its response.
    Completed {
        response: StoredResponse,
        #[serde(default)]
        waited_ms: u64,
    },
    /// The key was used with a different fingerprint.
    Mismatch,
    /// Held by someone else and the caller did not wait (or the wait budget ran out).
    Busy {
        retry_after_ms: u64,
        queue_len: u32,
        /// True when the caller waited its whole budget before this answer.
        #[serde(default)]
        waited: bool,
    },
    /// Too many waiters already queued on this key.
    QueueFull { retry_after_ms: u64, queue_len: u32 },
}

/// Status and allow-listed headers of a stored response; its body is the frame payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredResponse {
    pub status: u16,
    #[serde(default)]
    pub headers: Vec<(String, String)>,
}

/// `POST /v1/complete`: store the response (idempotency mode) and release the key.
/// In lock mode, or when the response is not replayable, `response` is `None` and the key is
/// only released. The body of a stored response is the frame payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteRequest {
    pub key: String,
    pub owner: String,
    /// How long the stored response is replayed (separate from the in-flight lease).
    pub retention_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<StoredResponse>,
}

/// `POST /v1/abort`: release without storing, so a retry runs again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbortRequest {
    pub key: String,
    pub owner: String,
}

/// `POST /v1/leave`: the waiter named `waiter` in a queued claim for `key` no longer waits.
/// [`OwnerOutcome::Released`] when its place was removed; [`OwnerOutcome::Stale`] when it
/// holds no place (never queued, already granted or answered, or its budget ended). A waiter
/// that was granted the key meanwhile gets the grant as the claim's answer and must abort it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaveRequest {
    pub key: String,
    pub waiter: String,
}

/// `POST /v1/renew`: extend the in-flight lease (the sidecar caps it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    pub key: String,
    pub owner: String,
    pub lease_ms: u64,
}

/// The answer to complete/abort/renew (always HTTP 200); decoded like [`ClaimOutcome`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
#[serde(try_from = "answer::OwnerAnswer")]
pub enum OwnerOutcome {
    /// The key was released (and, for complete, the response stored).
    Released,
    /// The lease now ends `lease_ms` from now.
    Renewed { lease_ms: u64 },
    /// The caller no longer owns the key (its lease ended and maybe someone else holds it).
    Stale,
}

/// An RFC 9457 problem document, used by the sidecar for every non-200 answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub type_uri: String,
    pub title: String,
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Milliseconds after which a retry makes sense (mirrors the `Retry-After` header).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

/// Stable `type` URIs of the problems idemgate answers with (sidecar and filter alike).
pub mod problem_types {
    pub const BAD_REQUEST: &str = "urn:idemgate:problem:bad-request";
    pub const TOO_LARGE: &str = "urn:idemgate:problem:too-large";
    pub const UNAUTHORIZED: &str = "urn:idemgate:problem:unauthorized";
    pub const NOT_FOUND: &str = "urn:idemgate:problem:not-found";
    pub const STORE_UNAVAILABLE: &str = "urn:idemgate:problem:store-unavailable";
    pub const SHUTTING_DOWN: &str = "urn:idemgate:problem:shutting-down";
    pub const INTERNAL: &str = "urn:idemgate:problem:internal";
}

/// A framed message could not be decoded.
#[derive(Debug)]
pub struct DecodeError(serde_json::Error);

impl core::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "malformed idemgate message: {}", self.0)
    }
}

impl core::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// Frames `head` (compact JSON) and, when non-empty, `\n` + `payload`.
pub fn encode<T: Serialize>(head: &T, payload: &[u8]) -> Vec<u8> {
    // Serializing these plain data types into a Vec cannot fail (no maps with non-string
    // keys, no custom Serialize impls); an empty head would be rejected by `decode`.
    let mut out = serde_json::to_vec(head).unwrap_or_default();
    if !payload.is_empty() {
        out.reserve(payload.len() + 1);
        out.push(b'\n');
        out.extend_from_slice(payload);
    }
    out
}

/// Splits a frame into its decoded head and its raw payload (empty when absent).
pub fn decode<'a, T: Deserialize<'a>>(frame: &'a [u8]) -> Result<(T, &'a [u8]), DecodeError> {
    let (head, payload) = split(frame);
    // The head is checked for UTF-8 once, whole: read from bytes, serde_json checks each
    // string again on its own, field names included (ten in a sidecar's claim and complete,
    // ~1,000 instructions per pair; a check of the whole head costs a tenth of that). A head
    // that is not UTF-8 is not JSON either way.
    let head = core::str::from_utf8(head).map_err(|e| DecodeError(de::Error::custom(e)))?;
    let head = serde_json::from_str(head).map_err(DecodeError)?;
    Ok((head, payload))
}

/// A frame's head and payload (empty when absent).
fn split(frame: &[u8]) -> (&[u8], &[u8]) {
    match memchr::memchr(b'\n', frame) {
        Some(at) => {
            let (head, rest) = frame.split_at(at);
            (head, rest.get(1..).unwrap_or_default())
        }
        None => (frame, &[]),
    }
}

#[cfg(test)]
mod tests;
