//! Request fingerprints (idempotency mode): SHA-256 over method, canonical path (with query), the rule's
//! chosen headers and — only when Envoy lets the filter see the body before forwarding
//! (`allow_on_headers_stop_iteration`) — the body up to the rule's cap. Reusing a key with a
//! different fingerprint is answered 422.

use alloc::string::String;
use alloc::vec::Vec;

use crate::hash::{DigestMemo, MEMO_MAX_INPUT, PartHasher, Parts as _};
use crate::ports::RequestView;
use crate::rule::RequestHead;
use crate::spec::FingerprintSpec;

/// The fingerprint's parts so far, encoded (domain first): kept as bytes rather than a
/// running hash so that the digest can come from the worker's [`DigestMemo`]. A storm's
/// duplicates are the same request, and SHA-256 of their parts (two blocks) cost ~10,000
/// instructions per duplicate in the filter, the largest single cost of parking one.
pub(crate) struct Fingerprint(Vec<u8>);

impl core::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Fingerprint(..)")
    }
}

impl Fingerprint {
    /// Starts a fingerprint over what the request headers carry.
    pub(crate) fn start(spec: &FingerprintSpec, head: &RequestHead, req: &dyn RequestView) -> Self {
        let mut parts = Vec::new();
        parts.part(b"idemgate/fingerprint/v1");
        parts.part(&head.method);
        parts.part(&head.path);
        for name in &spec.headers {
            parts.part(name.as_bytes());
            parts.optional(req.header(name).as_deref());
        }
        Fingerprint(parts)
    }

    /// The digest, over the whole request body too when the rule fingerprints it (the
    /// caller enforces the cap and delivers it at once). A body that would take the input
    /// past what the memo keeps is hashed as it lies, never copied.
    pub(crate) fn finish(self, body: Option<&[u8]>, memo: &mut DigestMemo) -> String {
        let mut parts = self.0;
        if let Some(body) = body {
            // The body's two length prefixes, its name and the closing `end`: 8 + 4 + 8 + 3.
            if parts.len() + body.len() + 23 > MEMO_MAX_INPUT {
                let mut h = PartHasher::continuing(&parts);
                h.part(b"body");
                h.part(body);
                h.raw(b"end");
                return h.finish_hex();
            }
            parts.part(b"body");
            parts.part(body);
        }
        parts.raw(b"end");
        memo.digest_hex(&parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Req;
    use alloc::vec;

    fn fp(req: &Req, body: Option<&[u8]>) -> String {
        let spec = FingerprintSpec {
            headers: vec!["content-type".into()],
            max_body: 10,
        };
        let head = RequestHead::new(
            req.header(":method").unwrap(),
            &req.header(":path").unwrap(),
            false,
        );
        Fingerprint::start(&spec, &head, req).finish(body, &mut DigestMemo::new())
    }

    /// The digest as the fingerprint was first made, hashed part by part as they came:
    /// fingerprints are kept in the sidecar's records, so the memo must not change one.
    fn streamed(req: &Req, body: Option<&[u8]>) -> String {
        let mut h = PartHasher::new("idemgate/fingerprint/v1");
        h.part(&req.header(":method").unwrap());
        h.part(b"/a");
        h.part(b"content-type");
        h.optional(req.header("content-type").as_deref());
        if let Some(body) = body {
            h.part(b"body");
            h.part(body);
        }
        h.raw(b"end");
        h.finish_hex()
    }

    #[test]
    fn the_memo_gives_the_digest_hashing_part_by_part_gave() {
        let spec = FingerprintSpec {
            headers: vec!["content-type".into()],
            max_body: 4096,
        };
        let req = Req::new("POST", "/a").with("content-type", "application/json");
        let head = RequestHead::new(b"POST".to_vec(), b"/a", false);
        let mut memo = DigestMemo::new();
        let long = [7u8; 1000];
        for body in [None, Some(&b""[..]), Some(&b"{}"[..]), Some(&long[..])] {
            for _ in 0..2 {
                // Twice: the second is the memo's answer (or, past its input cap, hashed again).
                let fp = Fingerprint::start(&spec, &head, &req).finish(body, &mut memo);
                assert_eq!(fp, streamed(&req, body), "{:?}", body.map(<[u8]>::len));
            }
        }
    }

    #[test]
    fn covers_method_path_headers_and_body() {
        let base = Req::new("POST", "/a").with("content-type", "application/json");
        let a = fp(&base, None);
        assert_eq!(a, fp(&base, None));
        assert_ne!(
            a,
            fp(
                &Req::new("PUT", "/a").with("content-type", "application/json"),
                None
            )
        );
        assert_ne!(
            a,
            fp(
                &Req::new("POST", "/a?x").with("content-type", "application/json"),
                None
            )
        );
        assert_ne!(
            a,
            fp(
                &Req::new("POST", "/a").with("content-type", "text/plain"),
                None
            )
        );
        assert_ne!(a, fp(&Req::new("POST", "/a"), None));
        assert_ne!(a, fp(&base, Some(b"")));
        assert_ne!(fp(&base, Some(b"1")), fp(&base, Some(b"2")));
        // Spellings of one path are one request.
        assert_eq!(
            a,
            fp(
                &Req::new("POST", "//%61/./").with("content-type", "application/json"),
                None
            )
        );
        // Unlisted headers do not count.
        assert_eq!(a, fp(&base.clone().with("x-other", "1"), None));
    }
}
