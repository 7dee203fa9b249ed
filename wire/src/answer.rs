//! Flat decoding of the internally tagged answers ([`ClaimOutcome`], [`OwnerOutcome`]): one
//! struct holding every variant's fields, read in a single pass and then checked against its
//! `outcome`. The JSON accepted is the same as with serde's internally tagged decoding
//! (unknown fields ignored, defaults as declared on the variants), without its buffering.

use alloc::string::String;
use core::fmt;

use serde::Deserialize;

use crate::{ClaimOutcome, OwnerOutcome, StoredResponse};

/// A field the answer's `outcome` requires is absent.
#[derive(Debug)]
pub(crate) struct MissingField(&'static str);

impl fmt::Display for MissingField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "missing field `{}`", self.0)
    }
}

fn required<T>(value: Option<T>, field: &'static str) -> Result<T, MissingField> {
    value.ok_or(MissingField(field))
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum ClaimTag {
    Granted,
    Completed,
    Mismatch,
    Busy,
    QueueFull,
}

#[derive(Deserialize)]
pub(crate) struct ClaimAnswer {
    outcome: ClaimTag,
    owner: Option<String>,
    fence: Option<u64>,
    lease_ms: Option<u64>,
    #[serde(default)]
    waited_ms: u64,
    response: Option<StoredResponse>,
    retry_after_ms: Option<u64>,
    queue_len: Option<u32>,
    #[serde(default)]
    waited: bool,
}

impl TryFrom<ClaimAnswer> for ClaimOutcome {
    type Error = MissingField;

    fn try_from(a: ClaimAnswer) -> Result<Self, MissingField> {
        Ok(match a.outcome {
            ClaimTag::Granted => ClaimOutcome::Granted {
                owner: required(a.owner, "owner")?,
                fence: required(a.fence, "fence")?,
                lease_ms: required(a.lease_ms, "lease_ms")?,
                waited_ms: a.waited_ms,
            },
            ClaimTag::Completed => ClaimOutcome::Completed {
                response: required(a.response, "response")?,
                waited_ms: a.waited_ms,
            },
            ClaimTag::Mismatch => ClaimOutcome::Mismatch,
            ClaimTag::Busy => ClaimOutcome::Busy {
                retry_after_ms: required(a.retry_after_ms, "retry_after_ms")?,
                queue_len: required(a.queue_len, "queue_len")?,
                waited: a.waited,
            },
            ClaimTag::QueueFull => ClaimOutcome::QueueFull {
                retry_after_ms: required(a.retry_after_ms, "retry_after_ms")?,
                queue_len: required(a.queue_len, "queue_len")?,
            },
        })
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum OwnerTag {
    Released,
    Renewed,
    Stale,
}

#[derive(Deserialize)]
pub(crate) struct OwnerAnswer {
    outcome: OwnerTag,
    lease_ms: Option<u64>,
}

impl TryFrom<OwnerAnswer> for OwnerOutcome {
    type Error = MissingField;

    fn try_from(a: OwnerAnswer) -> Result<Self, MissingField> {
        Ok(match a.outcome {
            OwnerTag::Released => OwnerOutcome::Released,
            OwnerTag::Renewed => OwnerOutcome::Renewed {
                lease_ms: required(a.lease_ms, "lease_ms")?,
            },
            OwnerTag::Stale => OwnerOutcome::Stale,
        })
    }
}
