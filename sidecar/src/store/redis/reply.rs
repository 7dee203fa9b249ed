//! Decoding script replies into the store's types. Anything that does not decode is an
//! [`StoreError::UnexpectedReply`], never a guess.

use crate::store::{
    ClaimReply, ClaimStep, Grant, Holding, Release, StoreError, StoreResult, Stored,
};
use bytes::Bytes;
use idemgate_wire::{OwnerOutcome, StoredResponse};
use redis::Value;

pub(super) fn unexpected(what: &str) -> StoreError {
    StoreError::UnexpectedReply(what.to_owned())
}

pub(super) fn text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

pub(super) fn number(v: Option<&Value>) -> StoreResult<u64> {
    match v {
        Some(Value::Int(i)) => u64::try_from(*i).map_err(|_| unexpected("negative number")),
        // Parsed in place: every claim reply carries a few (fence, lease, grant time).
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected("number expected")),
        other => text(other)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected("number expected")),
    }
}

pub(super) fn count(v: Option<&Value>) -> StoreResult<u32> {
    number(v).map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

pub(super) fn grant_at(items: &[Value], at: usize) -> StoreResult<Grant> {
    Ok(Grant {
        fence: number(items.get(at))?,
        lease_ms: number(items.get(at + 1))?,
        granted_at_us: number(items.get(at + 2))?,
    })
}

pub(super) fn decode_claim(items: &[Value]) -> StoreResult<ClaimReply> {
    let tag = text(items.first()).ok_or_else(|| unexpected("claim outcome"))?;
    let lease_expired = number(items.get(1))? == 1;
    let step = match tag.as_str() {
        "granted" => ClaimStep::Granted(grant_at(items, 2)?),
        "completed" => {
            let status =
                u16::try_from(number(items.get(2))?).map_err(|_| unexpected("stored status"))?;
            let headers: Vec<(String, String)> = text(items.get(3))
                .and_then(|h| serde_json::from_str(&h).ok())
                .ok_or_else(|| unexpected("stored headers"))?;
            let body = match items.get(4) {
                Some(Value::BulkString(b)) => Bytes::from(b.clone()),
                _ => return Err(unexpected("stored body")),
            };
            ClaimStep::Completed(Stored {
                response: StoredResponse { status, headers },
                body,
            })
        }
        "mismatch" => ClaimStep::Mismatch,
        "busy" => ClaimStep::Busy {
            retry_after_ms: number(items.get(2))?,
            queue_len: count(items.get(3))?,
            holder: holding_at(items, 4)?,
        },
        "queue_full" => ClaimStep::QueueFull {
            retry_after_ms: number(items.get(2))?,
            queue_len: count(items.get(3))?,
            holder: holding_at(items, 4)?,
        },
        "queued" => ClaimStep::Queued {
            position: count(items.get(2))?,
            queue_len: count(items.get(3))?,
            holder_ttl_ms: number(items.get(4))?,
        },
        "left" => ClaimStep::Left,
        other => return Err(unexpected(other)),
    };
    Ok(ClaimReply {
        step,
        lease_expired,
    })
}

fn holding_at(items: &[Value], at: usize) -> StoreResult<Holding> {
    Ok(Holding {
        age_ms: number(items.get(at))?,
        lease_ms: number(items.get(at + 1))?,
    })
}

/// Complete's and abort's reply: `{'released', held_ms, lease_ms}` or `'stale'`.
pub(super) fn release(reply: &Value) -> StoreResult<Release> {
    match reply {
        Value::Array(items) if text(items.first()).as_deref() == Some("released") => {
            Ok(Release::Released {
                held_ms: number(items.get(1))?,
                lease_ms: number(items.get(2))?,
            })
        }
        other if text(Some(other)).as_deref() == Some("stale") => Ok(Release::Stale),
        _ => Err(unexpected("release outcome")),
    }
}

pub(super) fn owner_outcome(reply: &str) -> StoreResult<OwnerOutcome> {
    match reply {
        "released" => Ok(OwnerOutcome::Released),
        "stale" => Ok(OwnerOutcome::Stale),
        other => Err(unexpected(other)),
    }
}
