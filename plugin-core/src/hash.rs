//! Hashing: every digest the filter makes (stored keys, fingerprints, rate keys, waiter names)
//! is a SHA-256 over length-prefixed parts under a domain name, spelled as lower-case hex; and
//! numbers spelled in decimal without the formatter (slot names, replies' numbers).

use alloc::string::String;
use sha2::{Digest, Sha256};

/// SHA-256 over length-prefixed parts: no two different part lists hash alike.
pub(crate) struct PartHasher(Sha256);

impl PartHasher {
    pub(crate) fn new(domain: &str) -> Self {
        let mut h = PartHasher(Sha256::new());
        h.part(domain.as_bytes());
        h
    }

    pub(crate) fn part(&mut self, bytes: &[u8]) {
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
    }

    /// An optional part: absent differs from empty.
    pub(crate) fn optional(&mut self, bytes: Option<&[u8]>) {
        match bytes {
            Some(b) => {
                self.0.update([1]);
                self.part(b);
            }
            None => self.0.update([0]),
        }
    }

    pub(crate) fn raw(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub(crate) fn finish_hex(self) -> String {
        hex(&self.0.finalize())
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let digit = |nibble: u8| *DIGITS.get(usize::from(nibble)).unwrap_or(&b'0');
    // Two digits at a time into a buffer on the stack, then one copy per 32 bytes (a
    // digest's): a `String::push` per digit costs a capacity check and a UTF-8 encode each.
    let mut out = String::with_capacity(bytes.len() * 2);
    let mut buf = [0; 64];
    for chunk in bytes.chunks(32) {
        for (pair, b) in buf.chunks_exact_mut(2).zip(chunk) {
            if let [hi, lo] = pair {
                *hi = digit(b >> 4);
                *lo = digit(b & 0xf);
            }
        }
        let digits = buf.get(..chunk.len() * 2).unwrap_or_default();
        out.push_str(core::str::from_utf8(digits).unwrap_or_default());
    }
    out
}

/// Whether two keys are the same bytes, compared eight at a time: `==` on slices is the
/// byte-at-a-time `memcmp` of a wasm build, ~700 instructions for two hex digests.
pub(crate) fn same_key(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (a_words, b_words) = (a.chunks_exact(8), b.chunks_exact(8));
    let tails_equal = a_words.remainder() == b_words.remainder();
    tails_equal && a_words.zip(b_words).all(|(x, y)| word(x) == word(y))
}

fn word(bytes: &[u8]) -> u64 {
    bytes.try_into().map_or(0, u64::from_ne_bytes)
}

/// `n` in decimal, written into `buf`: integers' `Display` goes through the formatter. Out
/// of line: inlined, each of its four callers carried a copy.
#[inline(never)]
pub(crate) fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &str {
    let mut at = buf.len();
    for slot in buf.iter_mut().rev() {
        *slot = b'0' + (n % 10) as u8;
        at -= 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    core::str::from_utf8(buf.get(at..).unwrap_or_default()).unwrap_or_default()
}

/// The first 32 bits of a hex digest (0 when it is not one): where a key's slots start in the
/// shared-data tables.
pub(crate) fn prefix_u32(hex_digest: &str) -> u32 {
    hex_digest
        .get(..8)
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_spells_every_byte_in_lower_case() {
        assert_eq!(super::hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(super::hex(&[]), "");
        let long: alloc::vec::Vec<u8> = (0..=255).collect();
        let spelled = super::hex(&long);
        assert_eq!(spelled.len(), 512);
        assert!(spelled.starts_with("000102") && spelled.ends_with("fdfeff"));
    }

    #[test]
    fn same_key_compares_every_byte() {
        let key = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let key = key.as_bytes();
        assert!(super::same_key(key, key));
        assert!(super::same_key(b"", b""));
        assert!(super::same_key(b"abc", b"abc"));
        // Shorter than a word, and past the last whole word.
        assert!(!super::same_key(b"abc", b"abd"));
        assert!(!super::same_key(b"0123456789", b"012345678x"));
        assert!(!super::same_key(key, &key[..63]));
        for at in 0..key.len() {
            let mut other = key.to_vec();
            other[at] = b'x';
            assert!(!super::same_key(key, &other), "{at}");
        }
    }

    #[test]
    fn decimal_spells_every_magnitude() {
        for n in [0, 9, 10, 99, 100, 1_500, u64::from(u32::MAX), u64::MAX] {
            assert_eq!(
                super::decimal(n, &mut [0; 20]),
                alloc::string::ToString::to_string(&n)
            );
        }
    }
}
