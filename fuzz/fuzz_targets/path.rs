//! The path canonicaliser: canonical forms are fixed points (canon(canon(p)) == canon(p)), an
//! encoded separator is never gained by canonicalising again, and any equivalent spelling of a
//! canonical path (escaped unreserved characters, lower-case escapes, repeated slashes, `.`
//! and `x/..` segments, a trailing slash) has the same canonical form, matches the same rule
//! and gives the same stored key.

#![no_main]

use idemgate_core::{Config, DigestMemo};
use idemgate_core::canonical::canonical_path;
use idemgate_core::key::{self, KeyError};
use idemgate_core::rule::{Matched, match_rule};
use idemgate_core::testing::Req;
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

/// Path keys at every depth up to four segments, and a prefix rule keyed by a query value.
const CONFIG: &str = r#"{"sidecar":{"cluster":"s"},"rules":[
 {"name":"one","mode":"lock","match":{"path_template":"/{a}"},"key":{"path_param":"a"}},
 {"name":"two","mode":"lock","match":{"path_template":"/{a}/{b}"},"key":{"path_param":"b"}},
 {"name":"three","mode":"lock","match":{"path_template":"/x/{a}/{b}"},"key":{"path_param":"a"}},
 {"name":"four","mode":"lock","match":{"path_prefix":"/"},"key":{"query_param":"id","required":false}}]}"#;

fn config() -> &'static Config {
    static CONFIG_ONCE: OnceLock<Config> = OnceLock::new();
    CONFIG_ONCE.get_or_init(|| match idemgate_core::config::parse(CONFIG.as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("the fuzz configuration is valid: {e}"),
    })
}

#[derive(Debug, Arbitrary)]
struct Input {
    raw: Vec<u8>,
    /// One choice per byte of the canonical path: how to respell it.
    respell: Vec<u8>,
    trailing_slash: bool,
}

/// An equivalent spelling of a canonical path.
fn respell(canonical: &[u8], choices: &[u8], trailing_slash: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let mut choice = choices.iter().copied().cycle();
    let mut i = 0;
    while let Some(&b) = canonical.get(i) {
        let c = if choices.is_empty() {
            0
        } else {
            choice.next().unwrap_or(0) % 6
        };
        i += 1;
        match (b, c) {
            (b'%', _) => {
                // An escape the canonical form upper-cased: as is, or in lower case.
                out.push(b'%');
                for _ in 0..2 {
                    if let Some(h) = canonical.get(i) {
                        out.push(if c == 1 { h.to_ascii_lowercase() } else { *h });
                        i += 1;
                    }
                }
            }
            (b'/', 1) => out.extend_from_slice(b"//"),
            (b'/', 2) => out.extend_from_slice(b"/./"),
            (b'/', 3) => out.extend_from_slice(b"/x/../"),
            (b'/', 4) => out.extend_from_slice(b"/%2e/"),
            (_, 1 | 2) if b.is_ascii_alphanumeric() || b"-._~".contains(&b) => {
                let escaped = if c == 1 {
                    format!("%{b:02x}")
                } else {
                    format!("%{b:02X}")
                };
                out.extend_from_slice(escaped.as_bytes());
            }
            _ => out.push(b),
        }
    }
    if trailing_slash {
        out.push(b'/');
    }
    out
}

type Keyed = Option<(usize, Result<Option<String>, KeyError>)>;

fn keyed(path: &[u8]) -> Keyed {
    let req = Req::default()
        .with(":method", "POST")
        .with_bytes(":path", path);
    let Matched { index, rule, head } = match_rule(config(), &req)?;
    let mut memo = DigestMemo::new();
    let key = key::extract(rule, &head, &req)
        .map(|k| k.map(|k| key::scoped(rule, &head, &req, &k, &mut memo)));
    Some((index, key))
}

fuzz_target!(|input: Input| {
    for split in [false, true] {
        let once = canonical_path(&input.raw, split);
        assert!(once.path.starts_with(b"/"));
        let twice = canonical_path(&once.path, split);
        assert_eq!(once.path, twice.path, "not idempotent");
        assert!(once.encoded_separator || !twice.encoded_separator);
        let other = respell(&once.path, &input.respell, input.trailing_slash);
        assert_eq!(
            canonical_path(&other, split).path,
            once.path,
            "{:?} respelled as {:?}",
            String::from_utf8_lossy(&once.path),
            String::from_utf8_lossy(&other)
        );
        if !split && !once.encoded_separator && !input.raw.contains(&b'?') {
            let mut raw = input.raw.clone();
            if !raw.starts_with(b"/") {
                raw.insert(0, b'/');
            }
            assert_eq!(keyed(&raw), keyed(&other), "one key for every spelling");
        }
    }
});
