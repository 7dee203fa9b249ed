//! The lock records the sidecar packs itself rather than in a script, exactly as the scripts'
//! `encode` packs them (see `scripts.rs` for the fields), so every script reads them as its
//! own: a fresh key's grant (`RedisStore::claim`) — `cmsgpack.pack({fence, owner, fp, since,
//! at, lease, pick})`, every field a string — and what the complete of such a grant leaves
//! behind (`RedisStore::release`, `scripts::COMPLETE_FRESH`): the fence alone, or the fence
//! and a stored response.

/// A fresh key's grant to `owner` at Redis's clock `now_us` (the fence, the grant and the
/// lease's start) for `lease_ms`, with fingerprint `fingerprint` ('' for none) and no
/// pick-up deadline.
pub(super) fn fresh_grant(now_us: u64, owner: &str, fingerprint: &str, lease_ms: u64) -> Vec<u8> {
    let (mut now, mut lease) = (itoa::Buffer::new(), itoa::Buffer::new());
    let (now, lease) = (now.format(now_us), lease.format(lease_ms));
    let fields: [&str; 7] = [now, owner, fingerprint, now, now, lease, "0"];
    let mut packed = Vec::with_capacity(16 + fields.iter().map(|f| f.len() + 3).sum::<usize>());
    // A fixarray of seven.
    packed.push(0x90 | 7);
    for field in fields {
        push_str(&mut packed, field.as_bytes());
    }
    packed
}

/// What a complete or abort leaves of a record nobody waits on: the fence, and with a stored
/// response its fields — `encode({fence = fence, status = .., headers = .., body = ..,
/// rfp = .., kept = ..})` in `scripts::COMPLETE`, the fields between packed as `false` and
/// trailing absent ones left out.
pub(super) fn released(fence: u64, response: Option<&StoredFields<'_>>) -> Vec<u8> {
    let mut fence_digits = itoa::Buffer::new();
    let fence = fence_digits.format(fence);
    let Some(stored) = response else {
        let mut packed = Vec::with_capacity(2 + fence.len());
        packed.push(0x90 | 1);
        push_str(&mut packed, fence.as_bytes());
        return packed;
    };
    let (mut status, mut kept) = (itoa::Buffer::new(), itoa::Buffer::new());
    let (status, kept) = (status.format(stored.status), kept.format(stored.kept_us));
    let fields: [&[u8]; 5] = [
        status.as_bytes(),
        stored.headers.as_bytes(),
        stored.body,
        stored.fingerprint.as_bytes(),
        kept.as_bytes(),
    ];
    let mut packed =
        Vec::with_capacity(32 + fence.len() + fields.iter().map(|f| f.len() + 5).sum::<usize>());
    // A fixarray of thirteen: the fence, seven absent holder and queue fields, the response.
    packed.push(0x90 | 13);
    push_str(&mut packed, fence.as_bytes());
    packed.extend_from_slice(&[FALSE; 7]);
    for field in fields {
        push_str(&mut packed, field);
    }
    packed
}

/// A stored response's fields as the record keeps them.
pub(super) struct StoredFields<'a> {
    pub(super) status: u16,
    /// The headers as JSON (`[[name, value], ...]`).
    pub(super) headers: &'a str,
    pub(super) body: &'a [u8],
    /// The fingerprint the response answers ('' for none).
    pub(super) fingerprint: &'a str,
    /// The end of its retention on Redis's clock (µs).
    pub(super) kept_us: u64,
}

/// msgpack's `false`: what `cmsgpack` packs for an absent field before a present one.
const FALSE: u8 = 0xc2;

/// One string as Redis's `cmsgpack` writes it: fixstr, str 8, str 16 or str 32 by length.
fn push_str(packed: &mut Vec<u8>, s: &[u8]) {
    let len = s.len();
    if len < 32 {
        packed.push(0xa0 | len as u8);
    } else if let Ok(len) = u8::try_from(len) {
        packed.extend_from_slice(&[0xd9, len]);
    } else if let Ok(len) = u16::try_from(len) {
        packed.push(0xda);
        packed.extend_from_slice(&len.to_be_bytes());
    } else {
        packed.push(0xdb);
        packed.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    }
    packed.extend_from_slice(s);
}

#[cfg(test)]
mod tests {
    use super::{StoredFields, fresh_grant, released};

    /// Byte for byte what the claim script's `cmsgpack.pack` makes of the same fields, on a
    /// real `redis-server`, for every string length class a field can take.
    #[tokio::test]
    async fn a_fresh_grant_is_packed_as_the_claim_script_packs_it() {
        let redis = crate::testing::RedisServer::start().unwrap();
        let client = redis::Client::open(redis.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let long = "f".repeat(300);
        for (owner, fp) in [
            ("0123456789abcdef0123456789abcdef", ""),
            ("o", &"a".repeat(64)[..]),
            ("0123456789abcdef0123456789abcdef", &long[..]),
        ] {
            let script = redis::Script::new(
                "return cmsgpack.pack({ARGV[1], ARGV[2], ARGV[3], ARGV[1], ARGV[1], ARGV[4], '0'})",
            );
            let lua: Vec<u8> = script
                .arg("1764921600123456")
                .arg(owner)
                .arg(fp)
                .arg("30000")
                .invoke_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(fresh_grant(1_764_921_600_123_456, owner, fp, 30_000), lua);
        }
    }

    /// Byte for byte what `COMPLETE`'s `encode` makes of a released record, with and without
    /// a stored response, on a real `redis-server`, for every string length class a field
    /// can take (a body of 70,000 bytes is a str 32).
    #[tokio::test]
    async fn a_released_record_is_packed_as_the_complete_script_packs_it() {
        let redis = crate::testing::RedisServer::start().unwrap();
        let client = redis::Client::open(redis.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let script = redis::Script::new(&format!(
            "{}{}",
            super::super::scripts::RECORD_CODEC,
            r#"
if ARGV[2] == '0' then return encode({fence = ARGV[1]}) end
return encode({fence = ARGV[1], status = ARGV[3], headers = ARGV[4], body = ARGV[5],
  rfp = ARGV[6], kept = int(tonumber(ARGV[7]))})
"#
        ));
        let fence = 1_764_921_600_123_456u64;
        let lua: Vec<u8> = script
            .arg(fence)
            .arg("0")
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(released(fence, None), lua);
        let binary: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        for (headers, body, fingerprint) in [
            ("[]", &b""[..], ""),
            (
                "[[\"x-id\",\"7\"]]",
                &b"{\"id\":7}\nline 2\n"[..],
                &"a".repeat(64)[..],
            ),
            (&"[[\"h\",\"v\"]]".repeat(20)[..], &binary[..300], "f"),
            ("[]", &binary[..], &"b".repeat(64)[..]),
        ] {
            let kept_us = fence + 86_400_000_000;
            let lua: Vec<u8> = script
                .arg(fence)
                .arg("1")
                .arg(201)
                .arg(headers)
                .arg(body)
                .arg(fingerprint)
                .arg(kept_us)
                .invoke_async(&mut conn)
                .await
                .unwrap();
            let stored = StoredFields {
                status: 201,
                headers,
                body,
                fingerprint,
                kept_us,
            };
            assert_eq!(released(fence, Some(&stored)), lua, "{headers}");
        }
    }
}
