//! gRPC as the filter needs it: which requests are gRPC calls, status codes by name, and the
//! status a call ended with. The mapping of refusals to statuses lives with the refusals
//! (`problem`), the capture of a call's outcome with the other captures (`capture`).

/// The gRPC status codes the filter sends or reads by name (grpc/doc/statuscodes.md).
pub(crate) mod code {
    pub(crate) const OK: u8 = 0;
    pub(crate) const INVALID_ARGUMENT: u8 = 3;
    pub(crate) const NOT_FOUND: u8 = 5;
    pub(crate) const ALREADY_EXISTS: u8 = 6;
    pub(crate) const RESOURCE_EXHAUSTED: u8 = 8;
    pub(crate) const FAILED_PRECONDITION: u8 = 9;
    pub(crate) const ABORTED: u8 = 10;
    pub(crate) const OUT_OF_RANGE: u8 = 11;
    pub(crate) const UNAVAILABLE: u8 = 14;
}

/// Every code's name, by number (`response.grpc_store` takes these).
pub(crate) const CODE_NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// The codes stored by default, as bits: the call's answer about the request itself (OK, and
/// what HTTP would say with a stored 4xx). Not stored, so a retry runs again: cancellation,
/// deadlines, credentials, overload, conflicts and server faults — a different situation on
/// retry, as the HTTP policy's `except` list and 5xx are.
pub(crate) const DEFAULT_STORED: u32 = 1 << code::OK
    | 1 << code::INVALID_ARGUMENT
    | 1 << code::NOT_FOUND
    | 1 << code::ALREADY_EXISTS
    | 1 << code::FAILED_PRECONDITION
    | 1 << code::OUT_OF_RANGE;

/// Whether a request's content type makes it a gRPC call, as Envoy judges it
/// (`Grpc::Common::isGrpcRequestHeaders`, source/common/grpc/common.cc): exactly
/// `application/grpc`, or `application/grpc+…` / `application/grpc;…` (gRPC-Web is not).
pub(crate) fn is_grpc_content_type(value: &[u8]) -> bool {
    let grpc = b"application/grpc";
    value
        .strip_prefix(grpc)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(b"+") || rest.starts_with(b";"))
}

/// A `grpc-status` value: a known code (0..=16), else `None` (the call's outcome is unknown).
pub(crate) fn parse_code(value: &[u8]) -> Option<u8> {
    // By hand: one or two digits (a generic integer parser costs the filter's size budget).
    let digit = |b: &u8| b.is_ascii_digit().then(|| b - b'0');
    let code = match value {
        [d] => digit(d)?,
        [t, d] if *t != b'0' => digit(t)? * 10 + digit(d)?,
        _ => return None,
    };
    (usize::from(code) < CODE_NAMES.len()).then_some(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_content_types_as_envoy_reads_them() {
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;x=1",
        ] {
            assert!(is_grpc_content_type(yes.as_bytes()), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpcx",
            "application/json",
            "",
        ] {
            assert!(!is_grpc_content_type(no.as_bytes()), "{no}");
        }
    }

    #[test]
    fn status_values() {
        assert_eq!(parse_code(b"0"), Some(code::OK));
        assert_eq!(parse_code(b"16"), Some(16));
        assert_eq!(CODE_NAMES[usize::from(code::UNAVAILABLE)], "UNAVAILABLE");
        for bad in [&b"17"[..], b"", b"-1", b" 3", b"x"] {
            assert_eq!(parse_code(bad), None);
        }
    }
}
