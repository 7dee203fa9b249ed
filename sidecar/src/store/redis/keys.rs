//! Every Redis key and channel name the sidecar uses, built in one place.
//!
//! All keys of one lock share the hash tag `{<key>}`, so each script touches one slot in a
//! Redis Cluster. The protocol allows `{`/`}` in keys; they would move the tag, so the tag
//! escapes them (and `%`) percent-style — an injective mapping that [`tag_to_key`] reverses.

/// The keys of one lock, in the order the scripts take them as KEYS.
///
/// Built on every store call, so only the record's key is spelled out: the fresh-key path
/// (`SET … NX`, `SET … IFEQ`) touches nothing else, and the queue's and waiters' keys are
/// spelled from it when a script needs them.
pub(crate) struct LockKeys {
    /// String, the lock's record: last fence, holder and lease deadline, stored response,
    /// whether waiters may be queued (packed fields, see `scripts.rs`). All the common path
    /// touches.
    pub record: String,
    /// Where the lock's own suffix starts in `record` (what the three keys share ends).
    base: usize,
}

const RECORD: &str = ":record";

impl LockKeys {
    /// One escape pass and one exact-size allocation (no formatting machinery on the hot
    /// path).
    pub(crate) fn new(prefix: &str, key: &str) -> Self {
        let mut record = String::with_capacity(prefix.len() + key.len() + 3 + RECORD.len());
        record.push_str(prefix);
        record.push_str(":{");
        push_tag(&mut record, key);
        record.push('}');
        let base = record.len();
        record.push_str(RECORD);
        LockKeys { record, base }
    }

    fn with(&self, suffix: &str) -> String {
        let base = self.record.get(..self.base).unwrap_or_default();
        let mut key = String::with_capacity(base.len() + suffix.len());
        key.push_str(base);
        key.push_str(suffix);
        key
    }

    /// List of queued owner tokens, FIFO (only while there are waiters).
    pub(crate) fn queue(&self) -> String {
        self.with(":queue")
    }

    /// Hash: owner token → `inbox|deadline_ms|lease_ms|fingerprint` of each queued waiter.
    pub(crate) fn waiters(&self) -> String {
        self.with(":waiters")
    }

    /// All three, as KEYS.
    pub(crate) fn all(&self) -> [String; 3] {
        [self.record.clone(), self.queue(), self.waiters()]
    }
}

/// SCAN pattern matching every lock record (held or not).
pub(crate) fn record_pattern(prefix: &str) -> String {
    format!("{prefix}:{{*}}:record")
}

/// The protocol key of a record found by [`record_pattern`].
pub(crate) fn key_of_record(prefix: &str, record_key: &str) -> Option<String> {
    let tag = record_key
        .strip_prefix(prefix)?
        .strip_prefix(":{")?
        .strip_suffix("}:record")?;
    tag_to_key(tag)
}

/// The GCRA state of one rate-limited key: its own hash tag, so one limit is one slot.
pub(crate) fn rate_key(prefix: &str, key: &str) -> String {
    let mut k = String::with_capacity(prefix.len() + key.len() + 8);
    k.push_str(prefix);
    k.push_str(":rate:{");
    push_tag(&mut k, key);
    k.push('}');
    k
}

/// Channel prefix of the per-process inboxes (pub/sub channels are not keys: no tag).
pub(crate) fn inbox_prefix(prefix: &str) -> String {
    format!("{prefix}:inbox:")
}

/// Appends `key` with `%`, `{` and `}` escaped (reversed by [`tag_to_key`]).
fn push_tag(out: &mut String, key: &str) {
    let mut rest = key;
    // A vectorized byte scan: `str::find` with a set of chars decodes every char first (~17
    // instructions a byte, on every store call's key); the three are ASCII, so a byte match
    // is a char match.
    while let Some(i) = memchr::memchr3(b'%', b'{', b'}', rest.as_bytes()) {
        let (plain, tail) = rest.split_at(i);
        out.push_str(plain);
        out.push_str(match tail.as_bytes().first() {
            Some(b'%') => "%25",
            Some(b'{') => "%7B",
            _ => "%7D",
        });
        rest = tail.get(1..).unwrap_or_default();
    }
    out.push_str(rest);
}

fn tag_to_key(tag: &str) -> Option<String> {
    let mut key = String::with_capacity(tag.len());
    let mut rest = tag;
    while let Some(i) = rest.find('%') {
        key.push_str(rest.get(..i)?);
        let esc = rest.get(i..i + 3)?;
        key.push(match esc {
            "%25" => '%',
            "%7B" => '{',
            "%7D" => '}',
            _ => return None,
        });
        rest = rest.get(i + 3..)?;
    }
    key.push_str(rest);
    Some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_keys_of_a_lock_share_one_hash_tag() {
        for key in ["abc", "}x{", "{", "a%7Bb", "%", "é{ü}%ß"] {
            let keys = LockKeys::new("p", key).all();
            let tags: Vec<&str> = keys
                .iter()
                .map(|k| {
                    let open = k.find('{').unwrap_or(0);
                    let close = k[open..].find('}').unwrap_or(0) + open;
                    &k[open + 1..close]
                })
                .collect();
            assert!(tags.iter().all(|t| *t == tags[0] && !t.is_empty()), "{key}");
            assert_eq!(key_of_record("p", &keys[0]).as_deref(), Some(key));
        }
    }

    #[test]
    fn keys_follow_the_documented_layout() {
        let keys = LockKeys::new("idemgate", "a%b{c}d");
        assert_eq!(keys.record, "idemgate:{a%25b%7Bc%7Dd}:record");
        assert_eq!(keys.waiters(), "idemgate:{a%25b%7Bc%7Dd}:waiters");
        assert_eq!(LockKeys::new("p", "").queue(), "p:{}:queue");
    }
}
