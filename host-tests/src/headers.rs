//! An ordered header map as Envoy keeps it: lower-case keys, pseudo-headers first, several
//! values per key allowed, values as raw bytes.

use std::fmt;

/// Ordered (key, value) header list. Keys are stored lower-cased, as Envoy's `LowerCaseString`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    entries: Vec<(Vec<u8>, Vec<u8>)>,
}

impl HeaderMap {
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds a map from string pairs (keys are lower-cased).
    pub fn from_pairs<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        let mut map = Self::new();
        for (k, v) in pairs {
            map.add(k.as_ref(), v.as_ref());
        }
        map
    }

    pub(crate) fn from_raw(entries: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        Self::from_pairs(entries)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn entries(&self) -> &[(Vec<u8>, Vec<u8>)] {
        &self.entries
    }

    /// First value of `key` as bytes (Envoy's `get_header_map_value` returns only the first).
    pub fn get_bytes(&self, key: &str) -> Option<&[u8]> {
        self.get_raw(key.as_bytes())
    }

    /// [`HeaderMap::get_bytes`] for a name in any case and encoding, without allocating: Envoy
    /// looks names up in place (a `LowerCaseString` on the stack), so a header read must not
    /// cost the filter an allocation here either.
    pub fn get_raw(&self, key: &[u8]) -> Option<&[u8]> {
        self.entries
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_slice())
    }

    /// First value of `key` as text (lossy for non-UTF-8 values).
    pub fn get(&self, key: &str) -> Option<String> {
        self.get_bytes(key)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    /// All values of `key` joined with commas (the `request.headers` property form).
    pub fn get_joined(&self, key: &str) -> Option<Vec<u8>> {
        let key = key.to_ascii_lowercase();
        let values: Vec<&[u8]> = self
            .entries
            .iter()
            .filter(|(k, _)| k == key.as_bytes())
            .map(|(_, v)| v.as_slice())
            .collect();
        (!values.is_empty()).then(|| values.join(&b","[..]))
    }

    /// Appends a value; pseudo-headers go before regular headers.
    pub fn add(&mut self, key: &[u8], value: &[u8]) {
        let key = key.to_ascii_lowercase();
        let entry = (key, value.to_vec());
        if entry.0.first() == Some(&b':') {
            let at = self
                .entries
                .iter()
                .position(|(k, _)| k.first() != Some(&b':'))
                .unwrap_or(self.entries.len());
            self.entries.insert(at, entry);
        } else {
            self.entries.push(entry);
        }
    }

    /// Replaces every value of `key` by one value (Envoy `setCopy`), keeping the position.
    pub fn replace(&mut self, key: &[u8], value: &[u8]) {
        let key = key.to_ascii_lowercase();
        match self.entries.iter().position(|(k, _)| *k == key) {
            Some(at) => {
                if let Some(slot) = self.entries.get_mut(at) {
                    slot.1 = value.to_vec();
                }
                let mut index = 0;
                self.entries.retain(|(k, _)| {
                    let keep = index <= at || *k != key;
                    index += 1;
                    keep
                });
            }
            None => self.add(&key, value),
        }
    }

    /// Removes every value of `key`, a name in any case (Envoy `remove`). Stored keys are
    /// lower case, so comparing each one without regard to case is Envoy's comparison of its
    /// lower-cased copy of the name, without the copy.
    pub fn remove(&mut self, key: &[u8]) {
        self.entries.retain(|(k, _)| !k.eq_ignore_ascii_case(key));
    }

    /// Converts an `http` crate map (names are already lower-case there).
    pub(crate) fn from_http(headers: &http::HeaderMap) -> Self {
        let mut map = Self::new();
        for (k, v) in headers {
            map.add(k.as_str().as_bytes(), v.as_bytes());
        }
        map
    }

    /// Envoy's `byteSize()`: the sum of key and value lengths.
    pub(crate) fn byte_size(&self) -> usize {
        self.entries.iter().map(|(k, v)| k.len() + v.len()).sum()
    }
}

impl fmt::Debug for HeaderMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|(k, v)| {
                (
                    String::from_utf8_lossy(k).into_owned(),
                    String::from_utf8_lossy(v).into_owned(),
                )
            }))
            .finish()
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>, const N: usize> From<[(K, V); N]> for HeaderMap {
    fn from(pairs: [(K, V); N]) -> Self {
        Self::from_pairs(pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pseudo_headers_stay_first_and_keys_are_lower_cased() {
        let mut map = HeaderMap::from([("X-A", "1"), (":path", "/")]);
        map.add(b":method", b"GET");
        let keys: Vec<&[u8]> = map.entries().iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(keys, vec![&b":path"[..], b":method", b"x-a"]);
    }

    #[test]
    fn replace_keeps_one_value_in_place() {
        let mut map = HeaderMap::from([("a", "1"), ("b", "2"), ("a", "3")]);
        map.replace(b"A", b"9");
        assert_eq!(map, HeaderMap::from([("a", "9"), ("b", "2")]));
        assert_eq!(map.get_joined("a"), Some(b"9".to_vec()));
    }

    #[test]
    fn remove_takes_every_value_of_a_name_given_in_any_case() {
        let mut map = HeaderMap::from([("x-a", "1"), ("b", "2"), ("X-A", "3")]);
        map.remove(b"X-a");
        assert_eq!(map, HeaderMap::from([("b", "2")]));
        map.remove(b"absent");
        assert_eq!(map, HeaderMap::from([("b", "2")]));
    }
}
