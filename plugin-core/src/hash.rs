//! Hashing: every digest the filter makes (stored keys, fingerprints, rate keys, waiter names)
//! is a SHA-256 over length-prefixed parts under a domain name, spelled as lower-case hex; and
//! numbers spelled in decimal without the formatter (slot names, replies' numbers).

use alloc::string::String;
use alloc::vec::Vec;
use sha2::{Digest, Sha256};

/// Length-prefixed parts under a domain name: no two different part lists encode alike.
/// One encoding whether the parts are hashed as they come ([`PartHasher`]) or collected
/// first ([`PartBytes`]), so a memoized digest is the digest.
pub(crate) trait Parts {
    fn raw(&mut self, bytes: &[u8]);

    // Out of line, like `raw` below: inlined, every call site of the stored and rate keys'
    // parts carried a copy of the buffer's growth (~4 KiB of the module).
    #[inline(never)]
    fn part(&mut self, bytes: &[u8]) {
        self.raw(&(bytes.len() as u64).to_be_bytes());
        self.raw(bytes);
    }

    /// An optional part: absent differs from empty.
    #[inline(never)]
    fn optional(&mut self, bytes: Option<&[u8]>) {
        match bytes {
            Some(b) => {
                self.raw(&[1]);
                self.part(b);
            }
            None => self.raw(&[0]),
        }
    }
}

/// SHA-256 of the parts as they come: for digests over a body (fingerprints) and those
/// made once per request (waiter names).
pub(crate) struct PartHasher(Sha256);

impl PartHasher {
    pub(crate) fn new(domain: &str) -> Self {
        let mut h = PartHasher(Sha256::new());
        h.part(domain.as_bytes());
        h
    }

    /// Goes on from parts already encoded (`encoded` starts with its domain's part).
    pub(crate) fn continuing(encoded: &[u8]) -> Self {
        PartHasher(Sha256::new_with_prefix(encoded))
    }

    pub(crate) fn finish_hex(self) -> String {
        hex(&self.0.finalize())
    }
}

impl Parts for PartHasher {
    fn raw(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

/// The parts collected into the worker's [`DigestMemo`], hashed at
/// [`PartBytes::finish_hex`] unless the memo holds their digest: stored keys and rate keys,
/// which duplicates repeat. The memo's own buffer takes them, so collecting allocates nothing
/// once it has grown.
pub(crate) struct PartBytes<'m>(&'m mut DigestMemo);

impl<'m> PartBytes<'m> {
    pub(crate) fn new(domain: &str, memo: &'m mut DigestMemo) -> Self {
        memo.input.clear();
        let mut p = PartBytes(memo);
        p.part(domain.as_bytes());
        p
    }

    pub(crate) fn finish_hex(self) -> String {
        let memo = self.0;
        let input = core::mem::take(&mut memo.input);
        let digest = memo.digest_hex(&input);
        memo.input = input;
        digest
    }
}

/// Parts encoded into a buffer of their own: a digest that is kept across callbacks
/// (a fingerprint waiting for its body) and hashed through the memo at the end.
impl Parts for Vec<u8> {
    fn raw(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Parts for PartBytes<'_> {
    #[inline(never)]
    fn raw(&mut self, bytes: &[u8]) {
        self.0.input.extend_from_slice(bytes);
    }
}

/// Slots of a [`DigestMemo`]: a duplicate storm repeats one key, a busy worker's in-flight
/// keys are a few dozen at a time.
const MEMO_SLOTS: usize = 64;
/// Longer inputs (long keys or scope headers) are hashed every time, so the memo stays
/// within `MEMO_SLOTS × MEMO_MAX_INPUT` bytes (32 KiB) per worker whatever the traffic.
pub(crate) const MEMO_MAX_INPUT: usize = 512;

/// The SHA-256 digests this worker made last, by their input, kept spelled in hex. A blocked
/// duplicate (a local 409's stored key, a limited caller's rate key, a parked duplicate's
/// fingerprint) is mostly an input the same worker hashed moments ago, and SHA-256 of a
/// typical key's parts (two 64-byte blocks: every part carries an 8-byte length) and its hex
/// cost ~8,000 instructions in the filter, where finding it here costs a few hundred.
/// Direct-mapped by a cheap hash of the input and checked against the input itself, so a
/// collision, crafted or not, costs only a recomputation.
#[derive(Debug, Default)]
pub struct DigestMemo {
    /// `(input, its digest in hex)`; a slot's buffers are reused by the next input it takes.
    slots: Vec<Option<(Vec<u8>, String)>>,
    /// The input being collected ([`PartBytes`]).
    input: Vec<u8>,
}

impl DigestMemo {
    pub fn new() -> Self {
        DigestMemo::default()
    }

    pub(crate) fn digest_hex(&mut self, input: &[u8]) -> String {
        if input.len() > MEMO_MAX_INPUT {
            return hex(&sha256(input));
        }
        if self.slots.is_empty() {
            self.slots.resize_with(MEMO_SLOTS, || None);
        }
        let Some(slot) = self.slots.get_mut(slot_of(input)) else {
            return hex(&sha256(input));
        };
        match slot {
            Some((seen, digest)) if same_key(seen, input) => digest.clone(),
            Some((seen, digest)) => {
                seen.clear();
                seen.extend_from_slice(input);
                *digest = hex(&sha256(input));
                digest.clone()
            }
            None => {
                let digest = hex(&sha256(input));
                *slot = Some((input.to_vec(), digest.clone()));
                digest
            }
        }
    }
}

/// One copy of the hashing code for every memo path (the module's size budget).
#[inline(never)]
fn sha256(input: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(input);
    h.finalize().into()
}

/// Which slot `input` takes: a multiply-rotate over its 8-byte words (the word-wise
/// comparison's reading), where a byte-wise hash costs ~5 instructions a byte.
fn slot_of(input: &[u8]) -> usize {
    let words = input.chunks_exact(8);
    let mut tail = [0; 8];
    if let Some(part) = tail.get_mut(..words.remainder().len()) {
        part.copy_from_slice(words.remainder());
    }
    let h = words
        .map(word)
        .chain([u64::from_ne_bytes(tail), input.len() as u64])
        .fold(0u64, |h, w| {
            (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95)
        });
    (h >> 58) as usize % MEMO_SLOTS
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

    use super::{DigestMemo, MEMO_MAX_INPUT, MEMO_SLOTS, PartBytes, PartHasher, Parts as _};
    use sha2::{Digest as _, Sha256};

    fn streamed(parts: &[&[u8]]) -> alloc::string::String {
        let mut h = PartHasher::new("test/v1");
        parts.iter().for_each(|p| h.part(p));
        h.optional(None);
        h.finish_hex()
    }

    fn collected(parts: &[&[u8]], memo: &mut DigestMemo) -> alloc::string::String {
        let mut h = PartBytes::new("test/v1", memo);
        parts.iter().for_each(|p| h.part(p));
        h.optional(None);
        h.finish_hex()
    }

    #[test]
    fn collected_parts_digest_as_streamed_ones_memoized_or_not() {
        let mut memo = DigestMemo::new();
        let long = [b'x'; MEMO_MAX_INPUT];
        for parts in [&[b"a" as &[u8], b"bc"][..], &[b"", b"abc"], &[&long]] {
            let expected = streamed(parts);
            assert_eq!(collected(parts, &mut memo), expected, "computed");
            assert_eq!(collected(parts, &mut memo), expected, "memoized");
        }
        // The encoding itself, spelled out: so the memo cannot have changed stored keys.
        let mut direct = sha2::Sha256::new();
        sha2::Digest::update(&mut direct, 7u64.to_be_bytes());
        sha2::Digest::update(&mut direct, b"test/v1");
        sha2::Digest::update(&mut direct, 1u64.to_be_bytes());
        sha2::Digest::update(&mut direct, b"a");
        sha2::Digest::update(&mut direct, 2u64.to_be_bytes());
        sha2::Digest::update(&mut direct, b"bc");
        sha2::Digest::update(&mut direct, [0]);
        assert_eq!(
            streamed(&[b"a", b"bc"]),
            super::hex(&sha2::Digest::finalize(direct))
        );
    }

    #[test]
    fn inputs_sharing_a_slot_each_keep_their_own_digest() {
        let mut memo = DigestMemo::new();
        let first = b"key-0".to_vec();
        let slot = super::slot_of(&first);
        let rival = (1..10_000)
            .map(|i| alloc::format!("key-{i}").into_bytes())
            .find(|k| super::slot_of(k) == slot)
            .unwrap();
        for _ in 0..3 {
            for input in [&first, &rival] {
                assert_eq!(memo.digest_hex(input), super::hex(&Sha256::digest(input)));
            }
        }
        // More inputs than slots, and inputs too long to keep: the memo stays bounded.
        for i in 0..(4 * MEMO_SLOTS) {
            memo.digest_hex(alloc::format!("other-{i}").as_bytes());
            memo.digest_hex(&alloc::vec![b'y'; MEMO_MAX_INPUT + 1 + i]);
        }
        assert_eq!(memo.slots.len(), MEMO_SLOTS);
        assert!(
            memo.slots
                .iter()
                .flatten()
                .all(|(input, _)| input.len() <= MEMO_MAX_INPUT)
        );
    }
}
