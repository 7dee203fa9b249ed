//! The one lock record the sidecar writes itself rather than through a script: a fresh key's
//! grant (`RedisStore::claim`), packed exactly as the claim script packs it —
//! `cmsgpack.pack({fence, owner, fp, since, at, lease, pick})`, every field a string (see
//! `scripts.rs` for the fields), so every script reads it as one of its own.

/// A fresh key's grant to `owner` at Redis's clock `now_us` (the fence, the grant and the
/// lease's start) for `lease_ms`, with fingerprint `fingerprint` ('' for none) and no
/// pick-up deadline.
pub(super) fn fresh_grant(now_us: u64, owner: &str, fingerprint: &str, lease_ms: u64) -> Vec<u8> {
    let now = now_us.to_string();
    let lease = lease_ms.to_string();
    let fields: [&str; 7] = [&now, owner, fingerprint, &now, &now, &lease, "0"];
    let mut packed = Vec::with_capacity(16 + fields.iter().map(|f| f.len() + 3).sum::<usize>());
    // A fixarray of seven.
    packed.push(0x90 | 7);
    for field in fields {
        push_str(&mut packed, field.as_bytes());
    }
    packed
}

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
    use super::fresh_grant;

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
}
