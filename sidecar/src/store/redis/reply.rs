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

/// The fields of a packed reply: the claim and complete scripts, which run on every request,
/// answer one bulk string of `\n`-separated fields rather than an array, because redis-rs
/// parses a reply element by element (a five-element array cost ~2.2 µs to parse, its fields
/// as one string ~0.75 µs). Only a last field may contain `\n` (a stored body); headers are
/// compact JSON, which has none.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    /// The packed reply in `reply`, a bulk string (a simple string is accepted as well).
    fn of(reply: &'a Value) -> StoreResult<Self> {
        match reply {
            Value::BulkString(b) => Ok(Fields(b)),
            Value::SimpleString(s) => Ok(Fields(s.as_bytes())),
            _ => Err(unexpected("a packed reply")),
        }
    }

    fn next_field(&mut self) -> Option<&'a [u8]> {
        if self.0.is_empty() {
            return None;
        }
        let (field, rest) = match memchr::memchr(b'\n', self.0) {
            Some(at) => (self.0.get(..at)?, self.0.get(at + 1..)?),
            None => (self.0, &b""[..]),
        };
        self.0 = rest;
        Some(field)
    }

    fn text(&mut self) -> Option<&'a str> {
        self.next_field().and_then(|f| std::str::from_utf8(f).ok())
    }

    fn number(&mut self) -> StoreResult<u64> {
        self.text()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected("number expected"))
    }

    fn count(&mut self) -> StoreResult<u32> {
        self.number().map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// A trailing number that may be absent.
    fn optional_number(&mut self) -> StoreResult<Option<u64>> {
        if self.0.is_empty() {
            return Ok(None);
        }
        self.number().map(Some)
    }

    /// Everything after the fields read so far, `\n` included: the last field.
    fn rest(self) -> &'a [u8] {
        self.0
    }

    fn holding(&mut self) -> StoreResult<Holding> {
        Ok(Holding {
            age_ms: self.number()?,
            lease_ms: self.number()?,
        })
    }
}

/// The claim script's reply (`scripts::CLAIM`) and, for a grant, the script's clock when it
/// is not the grant's own time (a hand-off picked up by this claim).
pub(super) fn decode_claim(reply: &Value) -> StoreResult<(ClaimReply, Option<u64>)> {
    let mut f = Fields::of(reply)?;
    let tag = f.text().ok_or_else(|| unexpected("claim outcome"))?;
    let lease_expired = f.number()? == 1;
    let step = match tag {
        "granted" => {
            let grant = Grant {
                fence: f.number()?,
                lease_ms: f.number()?,
                granted_at_us: f.number()?,
            };
            let clock_us = f.optional_number()?;
            let reply = ClaimReply {
                step: ClaimStep::Granted(grant),
                lease_expired,
            };
            return Ok((reply, clock_us));
        }
        "completed" => {
            let status = u16::try_from(f.number()?).map_err(|_| unexpected("stored status"))?;
            let headers: Vec<(String, String)> = f
                .next_field()
                .and_then(|h| serde_json::from_slice(h).ok())
                .ok_or_else(|| unexpected("stored headers"))?;
            ClaimStep::Completed(Stored {
                response: StoredResponse { status, headers },
                body: Bytes::copy_from_slice(f.rest()),
            })
        }
        "mismatch" => ClaimStep::Mismatch,
        "busy" => ClaimStep::Busy {
            retry_after_ms: f.number()?,
            queue_len: f.count()?,
            holder: f.holding()?,
        },
        "queue_full" => ClaimStep::QueueFull {
            retry_after_ms: f.number()?,
            queue_len: f.count()?,
            holder: f.holding()?,
        },
        "queued" => ClaimStep::Queued {
            position: f.count()?,
            queue_len: f.count()?,
            holder_ttl_ms: f.number()?,
        },
        "left" => ClaimStep::Left,
        other => return Err(unexpected(other)),
    };
    Ok((
        ClaimReply {
            step,
            lease_expired,
        },
        None,
    ))
}

/// Complete's and abort's reply (`scripts::COMPLETE`, packed): `released`, held_ms,
/// lease_ms, or `stale`.
pub(super) fn release(reply: &Value) -> StoreResult<Release> {
    let mut f = Fields::of(reply)?;
    match f.text() {
        Some("released") => Ok(Release::Released {
            held_ms: f.number()?,
            lease_ms: f.number()?,
        }),
        Some("stale") => Ok(Release::Stale),
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

#[cfg(test)]
mod tests {
    use super::{decode_claim, release};
    use crate::store::{ClaimStep, Release};
    use redis::Value;

    fn packed(s: &[u8]) -> Value {
        Value::BulkString(s.to_vec())
    }

    #[test]
    fn a_stored_body_keeps_its_newlines_and_a_grant_its_optional_clock() {
        let (reply, clock) = decode_claim(&packed(
            b"completed\n1\n201\n[[\"x-id\",\"7\"]]\nline 1\nline 2\n",
        ))
        .unwrap();
        assert!(reply.lease_expired);
        assert_eq!(clock, None);
        let ClaimStep::Completed(stored) = reply.step else {
            panic!("completed expected, got {:?}", reply.step);
        };
        assert_eq!(stored.response.status, 201);
        assert_eq!(
            stored.response.headers,
            [("x-id".to_owned(), "7".to_owned())]
        );
        assert_eq!(&stored.body[..], b"line 1\nline 2\n");

        let fresh = b"granted\n0\n1764690000123456\n30000\n1764690000123456";
        let (reply, clock) = decode_claim(&packed(fresh)).unwrap();
        assert!(
            matches!(reply.step, ClaimStep::Granted(g) if g.fence == 1_764_690_000_123_456
            && g.lease_ms == 30_000 && g.granted_at_us == 1_764_690_000_123_456)
        );
        assert_eq!(clock, None);
        let (_, clock) = decode_claim(&packed(b"granted\n0\n7\n30000\n5\n9")).unwrap();
        assert_eq!(clock, Some(9));
    }

    #[test]
    fn a_short_or_unknown_reply_is_an_error_not_a_guess() {
        for reply in [
            packed(b"granted\n0\n7\n30000"),
            packed(b"busy\n0\n10"),
            packed(b"granted\n0\n1.7e+15\n30000\n5"),
            packed(b"something\n0"),
            Value::Array(vec![packed(b"granted")]),
        ] {
            assert!(decode_claim(&reply).is_err(), "{reply:?}");
        }
        assert!(matches!(
            release(&packed(b"released\n12\n30000")),
            Ok(Release::Released {
                held_ms: 12,
                lease_ms: 30_000
            })
        ));
        assert!(matches!(release(&packed(b"stale")), Ok(Release::Stale)));
        assert!(release(&packed(b"released\n12")).is_err());
        assert!(release(&packed(b"released")).is_err());
    }
}
