//! A header map as `proxy_get_header_map_pairs` serializes it, read in place: a little-endian
//! `u32` count, then a `(name length, value length)` `u32` pair per entry, then each name and
//! value followed by a NUL (proxy-wasm-cpp-host `PairsUtil::marshalPairs`). One read of the
//! whole map answers every header question of a matched request with no further host call
//! and no allocation per entry (the SDK's decoder copies each name and value out).

/// The entries of a serialized map, in order; stops at the first malformed length (a host
/// never produces one, and a short read must not be taken for a missing header).
pub struct Pairs<'a> {
    lengths: &'a [u8],
    data: &'a [u8],
    left: usize,
}

impl<'a> Pairs<'a> {
    pub fn new(buf: &'a [u8]) -> Pairs<'a> {
        let count = buf
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .map_or(0, |b: [u8; 4]| u32::from_le_bytes(b) as usize);
        let table_end = count.checked_mul(8).and_then(|n| n.checked_add(4));
        match table_end.and_then(|end| Some((buf.get(4..end)?, buf.get(end..)?))) {
            Some((lengths, data)) => Pairs {
                lengths,
                data,
                left: count,
            },
            None => Pairs {
                lengths: &[],
                data: &[],
                left: 0,
            },
        }
    }

    /// The first value of `name` (lower case, as Envoy keeps names).
    pub fn first(buf: &'a [u8], name: &str) -> Option<&'a [u8]> {
        Pairs::new(buf)
            .find(|(n, _)| *n == name.as_bytes())
            .map(|(_, v)| v)
    }

    /// Whether any of `names` appears more than once.
    pub fn any_repeated(buf: &[u8], names: &[alloc::string::String]) -> bool {
        names.iter().any(|name| {
            Pairs::new(buf)
                .filter(|(n, _)| *n == name.as_bytes())
                .nth(1)
                .is_some()
        })
    }
}

fn u32_at(bytes: &[u8], at: usize) -> Option<usize> {
    let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_le_bytes(b) as usize)
}

/// The entry whose lengths start `lengths`, at the start of `data`: `(name, value, rest)`.
fn split_entry<'a>(lengths: &[u8], data: &'a [u8]) -> Option<(&'a [u8], &'a [u8], &'a [u8])> {
    let name_len = u32_at(lengths, 0)?;
    let value_len = u32_at(lengths, 4)?;
    let name = data.get(..name_len)?;
    let value_start = name_len.checked_add(1)?;
    let value_end = value_start.checked_add(value_len)?;
    let value = data.get(value_start..value_end)?;
    let rest = data.get(value_end.checked_add(1)?..)?;
    Some((name, value, rest))
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let entry = split_entry(self.lengths, self.data);
        match entry {
            Some((name, value, rest)) => {
                self.lengths = self.lengths.get(8..).unwrap_or_default();
                self.data = rest;
                Some((name, value))
            }
            None => {
                self.left = 0;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::{String, ToString};
    use alloc::vec::Vec;

    /// The host's serialization (proxy-wasm-cpp-host `marshalPairs`).
    fn marshal(pairs: &[(&str, &str)]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (n, v) in pairs {
            out.extend((n.len() as u32).to_le_bytes());
            out.extend((v.len() as u32).to_le_bytes());
        }
        for (n, v) in pairs {
            out.extend(n.as_bytes());
            out.push(0);
            out.extend(v.as_bytes());
            out.push(0);
        }
        out
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn reads_every_entry_in_order() {
        let buf = marshal(&[(":method", "POST"), ("x-user-id", ""), ("k", "v")]);
        let read: Vec<_> = Pairs::new(&buf).collect();
        assert_eq!(
            read,
            [
                (&b":method"[..], &b"POST"[..]),
                (b"x-user-id", b""),
                (b"k", b"v")
            ]
        );
    }

    #[test]
    fn first_value_and_repeats() {
        let buf = marshal(&[("a", "1"), ("b", "2"), ("a", "3")]);
        assert_eq!(Pairs::first(&buf, "a"), Some(&b"1"[..]));
        assert_eq!(Pairs::first(&buf, "b"), Some(&b"2"[..]));
        assert_eq!(Pairs::first(&buf, "c"), None);
        assert!(Pairs::any_repeated(&buf, &names(&["c", "a"])));
        assert!(!Pairs::any_repeated(&buf, &names(&["b", "c"])));
    }

    #[test]
    fn empty_and_malformed_buffers_hold_nothing() {
        assert_eq!(Pairs::new(&[]).count(), 0);
        assert_eq!(Pairs::new(&marshal(&[])).count(), 0);
        // A count larger than the table, and a length past the end: no entry is invented.
        assert_eq!(Pairs::new(&[9, 0, 0, 0, 1, 0, 0, 0]).count(), 0);
        let mut buf = marshal(&[("a", "1"), ("b", "2")]);
        buf.truncate(buf.len() - 2);
        assert_eq!(
            Pairs::new(&buf).collect::<Vec<_>>(),
            [(&b"a"[..], &b"1"[..])]
        );
        let huge = [1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0];
        assert_eq!(Pairs::new(&huge).count(), 0);
    }
}
