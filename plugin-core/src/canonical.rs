//! Canonical request paths and decoded key values. A backend that decodes and normalises its
//! path before routing (axum, most frameworks) runs `/agents/%61%32/tools`, `//agents/a2/tools`
//! and `/agents/a2/./tools/` as the call on agent `a2`; rules are matched and keys extracted on
//! the same reading, so that no spelling of a guarded call bypasses its rule or gets a key of
//! its own. The canonical form is RFC 3986 §6.2.2: percent-encoded unreserved characters
//! decoded, every other escape upper-case, dot segments removed; beyond it, repeated slashes
//! are merged, a trailing slash is dropped and bytes a path may not carry are escaped.
//!
//! Hand-written rather than a URL crate: the filter's size budget (plugin/README.md, "Size and
//! speed of the build") leaves no room for one, and this is all the filter needs.

use alloc::vec::Vec;

/// A path in canonical form: starts with `/`, no empty, `.` or `..` segment, no trailing
/// slash (except the root), only unreserved characters, sub-delimiters, `:`, `@`, `/` and
/// upper-case escapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalPath {
    pub path: Vec<u8>,
    /// The path carries an encoded `/` or `\` (`%2F`, `%5C`, any case, or a bare `\`).
    /// Backends disagree on whether it separates segments, so no single reading is safe.
    pub encoded_separator: bool,
}

/// The canonical form of `raw` (a path without its query string). With `split`, an encoded
/// separator separates segments (the reading of a backend that decodes before routing);
/// without, it stays an escape inside its segment (`%2F`, `%5C`).
pub fn canonical_path(raw: &[u8], split: bool) -> CanonicalPath {
    // Most paths arrive canonical: copied as they are, without the two passes below, which
    // cost the filter ~30 instructions a byte.
    if already_canonical(raw) {
        return CanonicalPath {
            path: raw.to_vec(),
            encoded_separator: false,
        };
    }
    rewrite(raw, split)
}

/// Whether [`rewrite`] would give `raw` back unchanged: a `/`, then segments that are not
/// empty, `.` or `..`, of characters kept as they are (no escape at all).
pub(crate) fn already_canonical(raw: &[u8]) -> bool {
    let Some(rest) = raw.strip_prefix(b"/") else {
        return false;
    };
    // The segment being read: its length, and whether it is dots only.
    let (mut len, mut dots) = (0usize, true);
    let dot_segment = |len: usize, dots: bool| len == 0 || (dots && len <= 2);
    for &b in rest {
        if b == b'/' {
            if dot_segment(len, dots) {
                return false;
            }
            (len, dots) = (0, true);
        } else if unreserved(b) || sub_delim_or_colon_at(b) {
            len += 1;
            dots &= b == b'.';
        } else {
            return false;
        }
    }
    rest.is_empty() || !dot_segment(len, dots)
}

/// The canonical form of a path that is not canonical yet.
fn rewrite(raw: &[u8], split: bool) -> CanonicalPath {
    // Pass 1: one spelling per byte. Escapes are normalised before dot segments are removed
    // (`%2E%2E` is `..`), as RFC 3986 §6.2.2 orders it.
    let mut flat = Vec::with_capacity(raw.len());
    let mut encoded_separator = false;
    let mut rest = raw;
    while let Some((&b, tail)) = rest.split_first() {
        rest = tail;
        let byte = if b == b'%' {
            match tail.get(..2).and_then(hex_pair) {
                Some(decoded) => {
                    rest = tail.get(2..).unwrap_or_default();
                    decoded
                }
                // A `%` that starts no escape is the character `%`: spelled `%25`, as the
                // backend's decoder leaves it.
                None => {
                    push_escape(&mut flat, b'%');
                    continue;
                }
            }
        } else {
            b
        };
        if b == b'/' {
            flat.push(b'/');
        } else if byte == b'/' || byte == b'\\' {
            encoded_separator = true;
            if split {
                flat.push(b'/');
            } else {
                push_escape(&mut flat, byte);
            }
        } else if unreserved(byte) || (b != b'%' && sub_delim_or_colon_at(byte)) {
            flat.push(byte);
        } else {
            push_escape(&mut flat, byte);
        }
    }
    // Pass 2: segments. Empty ones (repeated or trailing slashes) and `.` go, `..` removes
    // the segment before it (never above the root).
    let mut path = Vec::with_capacity(flat.len() + 1);
    for segment in flat.split(|b| *b == b'/') {
        match segment {
            b"" | b"." => {}
            b".." => {
                let parent = path.iter().rposition(|b| *b == b'/').unwrap_or(0);
                path.truncate(parent);
            }
            _ => {
                path.push(b'/');
                path.extend_from_slice(segment);
            }
        }
    }
    if path.is_empty() {
        path.push(b'/');
    }
    CanonicalPath {
        path,
        encoded_separator,
    }
}

/// Every escape decoded (and, with `plus_is_space`, `+` as a space, for form-encoded query
/// strings): the value a backend's router or query parser hands to its handler. A `%` that
/// starts no escape stays as it is.
pub(crate) fn decode(raw: &[u8], plus_is_space: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    let mut rest = raw;
    while let Some((&b, tail)) = rest.split_first() {
        rest = tail;
        match b {
            b'%' => match tail.get(..2).and_then(hex_pair) {
                Some(decoded) => {
                    rest = tail.get(2..).unwrap_or_default();
                    out.push(decoded);
                }
                None => out.push(b'%'),
            },
            b'+' if plus_is_space => out.push(b' '),
            _ => out.push(b),
        }
    }
    out
}

fn hex_pair(pair: &[u8]) -> Option<u8> {
    let [hi, lo] = pair else { return None };
    let digit = |b: u8| char::from(b).to_digit(16);
    Some(u8::try_from(digit(*hi)? << 4 | digit(*lo)?).unwrap_or_default())
}

fn push_escape(out: &mut Vec<u8>, byte: u8) {
    let hex = |n: u8| if n < 10 { b'0' + n } else { b'A' + n - 10 };
    out.extend_from_slice(&[b'%', hex(byte >> 4), hex(byte & 0xf)]);
}

/// RFC 3986 `unreserved`: an escape of one of these is the character itself.
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// The rest of `pchar`, kept as sent: RFC 3986 does not make `;` and `%3B` equivalent.
fn sub_delim_or_colon_at(b: u8) -> bool {
    matches!(
        b,
        b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b';' | b'=' | b':' | b'@'
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::String;
    use alloc::vec::Vec;

    fn canon(raw: &str) -> String {
        let c = canonical_path(raw.as_bytes(), false);
        String::from_utf8(c.path).unwrap()
    }

    #[test]
    fn unreserved_escapes_are_decoded_and_others_upper_cased() {
        assert_eq!(canon("/agents/%61%32/tools"), "/agents/a2/tools");
        assert_eq!(canon("/%7e%2d%2E%5F"), "/~-._");
        assert_eq!(canon("/a%3bb/%c3%a9"), "/a%3Bb/%C3%A9");
        assert_eq!(canon("/a;b:c@d"), "/a;b:c@d");
        assert_eq!(canon("/a b/\u{e9}\"<>"), "/a%20b/%C3%A9%22%3C%3E");
    }

    #[test]
    fn a_percent_that_starts_no_escape_is_spelled_as_one() {
        assert_eq!(canon("/a%zz/%4"), "/a%25zz/%254");
        assert_eq!(canon("/%%41"), "/%25A");
        assert_eq!(canon(&canon("/%%3441")), canon("/%%3441"));
    }

    #[test]
    fn dot_segments_slashes_and_trailing_slash() {
        for raw in [
            "/agents/a/tools",
            "//agents/a/tools",
            "/agents//a///tools",
            "/agents/a/./tools",
            "/agents/a/tools/",
            "/agents/a/tools/.",
            "/agents/b/../a/tools",
            "/agents/a/%2e/tools",
            "/agents/b/%2E%2e/a/tools",
            "/../../agents/a/tools",
            "agents/a/tools",
        ] {
            assert_eq!(canon(raw), "/agents/a/tools", "{raw}");
        }
        for raw in ["", "/", "//", "/.", "/..", "/a/.."] {
            assert_eq!(canon(raw), "/", "{raw}");
        }
        assert_eq!(canon("/a/..."), "/a/...");
    }

    #[test]
    fn encoded_separators_are_flagged_and_kept_or_split() {
        for raw in ["/a%2Fb", "/a%2fb", "/a%5Cb", "/a%5cb", "/a\\b"] {
            let kept = canonical_path(raw.as_bytes(), false);
            assert!(kept.encoded_separator, "{raw}");
            assert_eq!(kept.path.len(), 6, "{raw}: one segment, escape kept");
            let split = canonical_path(raw.as_bytes(), true);
            assert_eq!(split.path, b"/a/b", "{raw}");
        }
        assert_eq!(canon("/a%2fb"), "/a%2Fb");
        assert!(!canonical_path(b"/a/b%41", false).encoded_separator);
        // Dot segments made of separators are still separators, not a way around them.
        assert_eq!(canonical_path(b"/x/..%2Fadmin", true).path, b"/admin");
    }

    #[test]
    fn idempotent() {
        for raw in [
            "/a%2fb/../%%34%31/./x//",
            "/%2e%2e/%7E%zz",
            "/a\\..\\b",
            "/\u{ff}%ff%2",
        ] {
            for split in [false, true] {
                let once = canonical_path(raw.as_bytes(), split);
                let twice = canonical_path(&once.path, split);
                assert_eq!(once.path, twice.path, "{raw}");
                // Never gained: a `..` may remove the segment that carried it.
                assert!(once.encoded_separator || !twice.encoded_separator, "{raw}");
            }
        }
    }

    /// Every path of up to five characters from an alphabet of separators, dots, escapes and
    /// characters kept or escaped: what the shortcut takes as canonical, the rewrite leaves
    /// as it is (it may leave others too: an upper-case escape of a reserved character).
    #[test]
    fn canonical_paths_are_recognised_exactly() {
        let alphabet = b"/a.%2F;\\ ";
        let mut paths: Vec<Vec<u8>> = alloc::vec![Vec::new()];
        let mut at = 0;
        while at < paths.len() {
            if paths[at].len() < 5 {
                for &c in alphabet {
                    let mut longer = paths[at].clone();
                    longer.push(c);
                    paths.push(longer);
                }
            }
            at += 1;
        }
        let mut recognised = 0;
        for raw in &paths {
            for split in [false, true] {
                let rewritten = rewrite(raw, split);
                let unchanged = rewritten.path == *raw && !rewritten.encoded_separator;
                let shortcut = already_canonical(raw);
                assert!(unchanged || !shortcut, "{raw:?}");
                assert_eq!(canonical_path(raw, split), rewritten, "{raw:?}");
                recognised += usize::from(shortcut);
            }
        }
        assert!(recognised > 100, "{recognised}");
    }

    #[test]
    fn decoding_values() {
        assert_eq!(decode(b"a%3Bb%2fc%zz%4", false), b"a;b/c%zz%4");
        assert_eq!(decode(b"a+b%2B", true), b"a b+");
        assert_eq!(decode(b"a+b", false), b"a+b");
    }
}
