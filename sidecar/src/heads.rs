//! The heads of the two answers every fresh key's claim and complete get, written without
//! serde: `granted` (its fields between constant pieces) and `released` (a constant).
//!
//! Why: serde_json checks every string it writes for characters to escape, field names
//! included, and grows its output as it goes. For these two heads that was ~2,000
//! instructions of the sidecar's ~88,000 per claim+complete pair (callgrind,
//! `benchmarks/sidecar.notes.md`). Every other answer, and a grant whose owner token would
//! need escaping (never one of this sidecar's own), goes through serde; the tests hold both
//! heads to serde's bytes.

use bytes::Bytes;
use idemgate_wire::{ClaimOutcome, OwnerOutcome};
use std::sync::LazyLock;

/// `released` as serde writes it, written once.
static RELEASED: LazyLock<Bytes> =
    LazyLock::new(|| Bytes::from(idemgate_wire::encode(&OwnerOutcome::Released, &[])));

/// The head of `outcome` when it is `released`.
pub(crate) fn owner_head(outcome: &OwnerOutcome) -> Option<Bytes> {
    matches!(outcome, OwnerOutcome::Released).then(|| RELEASED.clone())
}

/// The head of `outcome` when it is a grant whose owner token needs no escaping.
pub(crate) fn claim_head(outcome: &ClaimOutcome) -> Option<Bytes> {
    let ClaimOutcome::Granted {
        owner,
        fence,
        lease_ms,
        waited_ms,
    } = outcome
    else {
        return None;
    };
    // Every byte looked at, without stopping at the first that fails: a token's random
    // digits and letters made the branch of a stopping loop mispredict about every other byte.
    if !owner
        .bytes()
        .fold(true, |plain, b| plain & b.is_ascii_alphanumeric())
    {
        return None;
    }
    let mut number = itoa::Buffer::new();
    let mut head = Vec::with_capacity(96 + owner.len());
    head.extend_from_slice(br#"{"outcome":"granted","owner":""#);
    head.extend_from_slice(owner.as_bytes());
    for (name, value) in [
        (&br#"","fence":"#[..], fence),
        (br#","lease_ms":"#, lease_ms),
        (br#","waited_ms":"#, waited_ms),
    ] {
        head.extend_from_slice(name);
        head.extend_from_slice(number.format(*value).as_bytes());
    }
    head.push(b'}');
    Some(Bytes::from(head))
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemgate_wire::{StoredResponse, encode};

    fn granted(owner: &str, fence: u64, lease_ms: u64, waited_ms: u64) -> ClaimOutcome {
        ClaimOutcome::Granted {
            owner: owner.to_owned(),
            fence,
            lease_ms,
            waited_ms,
        }
    }

    #[test]
    fn grants_are_written_as_serde_writes_them() {
        let owners = ["", "0", "0123456789abcdef0123456789abcdef", "ABCxyz"];
        let numbers = [0, 1, 9, 10, 30_000, 1_733_456_789_012_345, u64::MAX];
        for owner in owners {
            for &fence in &numbers {
                for &lease_ms in &numbers {
                    for &waited_ms in &[0, 7, u64::MAX] {
                        let outcome = granted(owner, fence, lease_ms, waited_ms);
                        let head = claim_head(&outcome).expect("a plain owner token");
                        assert_eq!(&head[..], &encode(&outcome, &[])[..]);
                    }
                }
            }
        }
    }

    #[test]
    fn released_is_written_as_serde_writes_it() {
        let head = owner_head(&OwnerOutcome::Released).expect("released");
        assert_eq!(&head[..], &encode(&OwnerOutcome::Released, &[])[..]);
        assert_eq!(&head[..], br#"{"outcome":"released"}"#);
    }

    /// What the hand-written heads do not cover is left to serde: tokens that need escaping
    /// (or are not ASCII), and every other answer.
    #[test]
    fn everything_else_is_left_to_serde() {
        for owner in ["a\"b", "a\\b", "a\nb", "é", "a-b", "a b"] {
            assert_eq!(claim_head(&granted(owner, 1, 2, 3)), None, "{owner:?}");
        }
        let others = [
            ClaimOutcome::Mismatch,
            ClaimOutcome::Busy {
                retry_after_ms: 1,
                queue_len: 2,
                waited: true,
            },
            ClaimOutcome::QueueFull {
                retry_after_ms: 1,
                queue_len: 2,
            },
            ClaimOutcome::Completed {
                response: StoredResponse {
                    status: 201,
                    headers: Vec::new(),
                },
                waited_ms: 0,
            },
        ];
        for outcome in others {
            assert_eq!(claim_head(&outcome), None, "{outcome:?}");
        }
        for outcome in [OwnerOutcome::Stale, OwnerOutcome::Renewed { lease_ms: 5 }] {
            assert_eq!(owner_head(&outcome), None, "{outcome:?}");
        }
    }
}
