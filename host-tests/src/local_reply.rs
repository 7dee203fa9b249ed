//! Local replies as Envoy's `sendLocalReply` makes them: for a gRPC request a trailers-only
//! response (HTTP 200, `content-type: application/grpc`, `grpc-status`, a percent-encoded
//! `grpc-message`, no body), otherwise the status with a `text/plain` body. Used for the
//! plugin's `proxy_send_local_response`, the filter's own replies (fail-closed 503, buffer
//! overflow) and the router's (404, 503, 504).
//!
//! Mirrors envoy `source/common/http/utility.cc` (`Utility::prepareLocalReply`,
//! `Utility::encodeLocalReply`, `PercentEncoding::encode`), `source/common/grpc/common.cc`
//! (`Common::isGrpcRequestHeaders`) and `source/common/grpc/status.cc`
//! (`Utility::httpToGrpcStatus`).

use crate::headers::HeaderMap;

/// Whether Envoy treats a request as gRPC (`Common::isGrpcRequestHeaders`): it has a `:path`
/// and its content-type is exactly `application/grpc` or starts with `application/grpc+` or
/// `application/grpc;` (gRPC-Web is not gRPC). Judged once, on the headers as they arrived.
pub(crate) fn is_grpc_request(headers: &HeaderMap) -> bool {
    if headers.get_bytes(":path").is_none() {
        return false;
    }
    let Some(content_type) = headers.get_bytes("content-type") else {
        return false;
    };
    let grpc = b"application/grpc";
    content_type == grpc
        || (content_type.starts_with(grpc)
            && matches!(content_type.get(grpc.len()), Some(b'+' | b';')))
}

/// Envoy's HTTP → gRPC status mapping (`Grpc::Utility::httpToGrpcStatus`).
pub(crate) fn http_to_grpc_status(http_status: u32) -> u32 {
    match http_status {
        400 => 13,                   // Internal
        401 => 16,                   // Unauthenticated
        403 => 7,                    // PermissionDenied
        404 => 12,                   // Unimplemented
        429 | 502 | 503 | 504 => 14, // Unavailable
        _ => 2,                      // Unknown
    }
}

/// `PercentEncoding::encode(value, "%")`: bytes below 0x20, from 0x7E up, and `%` become
/// `%XX` (uppercase hex), as the gRPC spec asks for `grpc-message`.
pub(crate) fn percent_encode(value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len());
    for &byte in value {
        if !(b' '..b'~').contains(&byte) || byte == b'%' {
            out.extend_from_slice(format!("%{byte:02X}").as_bytes());
        } else {
            out.push(byte);
        }
    }
    out
}

/// The response a local reply sends: headers, and the body (empty for gRPC, whose reply is
/// trailers-only and ends with its headers).
///
/// `added` are the headers the caller adds (the plugin's `proxy_send_local_response` headers,
/// appended with `addCopy`); `grpc_status` is the plugin's argument when it is a known code
/// (0..=16), else Envoy maps the HTTP status.
pub(crate) fn render(
    grpc_request: bool,
    status: u32,
    body: &[u8],
    added: &HeaderMap,
    grpc_status: Option<u32>,
) -> (HeaderMap, Vec<u8>) {
    let mut headers = HeaderMap::from([(":status", status.to_string())]);
    for (k, v) in added.entries() {
        headers.add(k, v);
    }
    if grpc_request {
        headers.replace(b":status", b"200");
        headers.replace(b"content-type", b"application/grpc");
        if headers
            .get_bytes("grpc-status")
            .is_none_or(<[u8]>::is_empty)
        {
            let code = grpc_status.unwrap_or_else(|| http_to_grpc_status(status));
            headers.replace(b"grpc-status", code.to_string().as_bytes());
        }
        if !body.is_empty() {
            headers.replace(b"grpc-message", &percent_encode(body));
        }
        headers.remove(b"content-length");
        return (headers, Vec::new());
    }
    // Envoy removes content-length from a bodiless reply and its HTTP/1 codec writes
    // `content-length: 0`; the filter is shown the length either way here.
    headers.replace(b"content-length", body.len().to_string().as_bytes());
    if !body.is_empty() && headers.get_bytes("content-type").is_none() {
        headers.add(b"content-type", b"text/plain");
    }
    (headers, body.to_vec())
}

/// The plugin's `grpc_status` argument as Envoy takes it: a known code (0..=16) or none
/// (the SDKs pass -1 for none).
pub(crate) fn plugin_grpc_status(raw: i32) -> Option<u32> {
    u32::try_from(raw).ok().filter(|code| *code <= 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_requests_are_judged_by_content_type_as_envoy_does() {
        let request = |ct: &str| HeaderMap::from([(":path", "/s/m"), ("content-type", ct)]);
        assert!(is_grpc_request(&request("application/grpc")));
        assert!(is_grpc_request(&request("application/grpc+proto")));
        assert!(!is_grpc_request(&request("application/grpc-web")));
        assert!(!is_grpc_request(&request("application/json")));
        assert!(!is_grpc_request(&HeaderMap::from([(
            "content-type",
            "application/grpc"
        )])));
    }

    #[test]
    fn grpc_message_escapes_controls_tilde_non_ascii_and_percent_only() {
        assert_eq!(
            percent_encode("a b%c~\n\u{e9}".as_bytes()),
            b"a b%25c%7E%0A%C3%A9".to_vec()
        );
    }

    #[test]
    fn http_statuses_map_to_grpc_codes_as_envoy_maps_them() {
        let table = [
            (400, 13),
            (401, 16),
            (403, 7),
            (404, 12),
            (429, 14),
            (502, 14),
            (503, 14),
            (504, 14),
            (500, 2),
            (200, 2),
        ];
        for (http, grpc) in table {
            assert_eq!(http_to_grpc_status(http), grpc, "{http}");
        }
    }

    #[test]
    fn a_grpc_local_reply_is_trailers_only_and_a_plugin_grpc_status_header_wins() {
        let (headers, body) = render(true, 503, b"no", &HeaderMap::new(), None);
        assert_eq!(headers.get(":status").as_deref(), Some("200"));
        assert_eq!(headers.get("grpc-status").as_deref(), Some("14"));
        assert_eq!(headers.get("grpc-message").as_deref(), Some("no"));
        assert!(headers.get("content-length").is_none() && body.is_empty());
        let (headers, _) = render(true, 403, b"", &HeaderMap::new(), Some(9));
        assert_eq!(headers.get("grpc-status").as_deref(), Some("9"));
        assert!(headers.get("grpc-message").is_none());
        let added = HeaderMap::from([("grpc-status", "5")]);
        let (headers, _) = render(true, 403, b"", &added, Some(9));
        assert_eq!(headers.get("grpc-status").as_deref(), Some("5"));
        assert_eq!(plugin_grpc_status(-1), None);
        assert_eq!(plugin_grpc_status(17), None);
        assert_eq!(plugin_grpc_status(16), Some(16));
    }
}
