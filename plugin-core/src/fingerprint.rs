//! Request fingerprints (idempotency mode): SHA-256 over method, canonical path (with query), the rule's
//! chosen headers and — only when Envoy lets the filter see the body before forwarding
//! (`allow_on_headers_stop_iteration`) — the body up to the rule's cap. Reusing a key with a
//! different fingerprint is answered 422.

use alloc::string::String;

use crate::hash::{PartHasher, Parts as _};
use crate::ports::RequestView;
use crate::rule::RequestHead;
use crate::spec::FingerprintSpec;

pub(crate) struct Fingerprint(PartHasher);

impl core::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Fingerprint(..)")
    }
}

impl Fingerprint {
    /// Starts a fingerprint over what the request headers carry.
    pub(crate) fn start(spec: &FingerprintSpec, head: &RequestHead, req: &dyn RequestView) -> Self {
        let mut h = PartHasher::new("idemgate/fingerprint/v1");
        h.part(&head.method);
        h.part(&head.path);
        for name in &spec.headers {
            h.part(name.as_bytes());
            h.optional(req.header(name).as_deref());
        }
        Fingerprint(h)
    }

    /// Adds the whole request body (the caller enforces the cap and delivers it at once).
    pub(crate) fn body(mut self, body: &[u8]) -> Self {
        self.0.part(b"body");
        self.0.part(body);
        self
    }

    pub(crate) fn finish(mut self) -> String {
        self.0.raw(b"end");
        self.0.finish_hex()
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
        let f = Fingerprint::start(&spec, &head, req);
        match body {
            Some(b) => f.body(b).finish(),
            None => f.finish(),
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
