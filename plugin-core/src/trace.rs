//! The request's trace context, carried on its sidecar callouts so the sidecar's spans and log
//! lines join the request's trace: W3C `traceparent`/`tracestate`, Zipkin's single `b3`, and
//! Envoy's `x-request-id`. Read once per request that matched a rule and was not answered at
//! its request headers (never on the no-rule path, nor for a local 409, 429 or replay); the
//! sidecar decides which of them it continues (`traceparent`, else `b3`).

use alloc::string::String;
use alloc::vec::Vec;

use crate::ports::RequestView;

/// The request headers a callout copies, in the order they are sent.
pub const PROPAGATED: [&str; 4] = ["traceparent", "tracestate", "b3", "x-request-id"];

/// Longest value copied: W3C asks vendors to propagate `tracestate` up to at least 512
/// characters; a longer value (or any other header over it) is not copied at all, so a client
/// cannot make every callout carry a large header.
pub const MAX_VALUE: usize = 512;

/// The propagated headers a request carried, each at most `MAX_VALUE` (512) bytes of visible
/// ASCII (and spaces: `tracestate` lists may have them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceContext(Vec<(&'static str, String)>);

impl TraceContext {
    /// Reads `PROPAGATED` from the request; a value that is too long or not printable ASCII
    /// is left out (it would only be refused or logged as garbage at the sidecar).
    pub fn read(req: &dyn RequestView) -> TraceContext {
        TraceContext(
            PROPAGATED
                .iter()
                .filter_map(|&name| {
                    let value = req.header(name)?;
                    let printable =
                        value.len() <= MAX_VALUE && value.iter().all(|b| matches!(b, b' '..=b'~'));
                    // Printable ASCII is UTF-8.
                    let value = String::from_utf8(value).ok().filter(|_| printable)?;
                    Some((name, value))
                })
                .collect(),
        )
    }

    /// The headers to add to a callout.
    pub fn headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.0.iter().map(|(name, value)| (*name, value.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Req;
    use alloc::vec;

    #[test]
    fn every_propagated_header_present_is_copied_in_order() {
        let req = Req::new("POST", "/p")
            .with("x-request-id", "9f2c")
            .with("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1")
            .with(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
            .with("tracestate", "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7")
            .with("authorization", "Bearer secret");
        let trace = TraceContext::read(&req);
        let headers: Vec<_> = trace.headers().collect();
        assert_eq!(
            headers,
            vec![
                (
                    "traceparent",
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                ),
                ("tracestate", "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7"),
                ("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1"),
                ("x-request-id", "9f2c"),
            ]
        );
    }

    #[test]
    fn absent_headers_add_nothing() {
        let trace = TraceContext::read(&Req::new("POST", "/p"));
        assert_eq!(trace.headers().count(), 0);
        assert_eq!(trace, TraceContext::default());
    }

    #[test]
    fn oversized_or_unprintable_values_are_left_out() {
        let long = "a".repeat(MAX_VALUE + 1);
        let req = Req::new("POST", "/p")
            .with("traceparent", &long)
            .with_bytes("tracestate", b"a=\x01")
            .with_bytes("b3", b"caf\xc3\xa9")
            .with("x-request-id", &"r".repeat(MAX_VALUE));
        let trace = TraceContext::read(&req);
        let names: Vec<_> = trace.headers().map(|(n, _)| n).collect();
        assert_eq!(names, vec!["x-request-id"]);
    }
}
