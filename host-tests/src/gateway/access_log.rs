//! Envoy's text access-log format (`log_format.text_format_source.inline_string`, or Envoy's
//! default format when none is given), for the HTTP connection manager's stdout access logs.
//! The command operators here are a subset of Envoy's
//! (docs: configuration/observability/access_log/usage, "Command Operators"); a format naming
//! any other is refused when the configuration loads, so a line never silently differs from
//! what Envoy would print.
//!
//! `%FILTER_STATE(KEY:F:Z)%` reads what a filter stored, as Envoy's formatter does
//! (`source/common/formatter/stream_info_formatter.cc`, `FilterStateFormatter`): a wasm filter's
//! `proxy_set_property(path, value)` is kept under `wasm.<path>` as a `CelState` of bytes
//! (`source/extensions/common/wasm/context.cc`, `Context::setProperty`); `PLAIN` prints the
//! value as it is (`CelState::serializeAsString`), `TYPED` (the default) the JSON of the
//! `google.protobuf.Any` holding a `BytesValue` (`CelState::serializeAsProto`). A missing key
//! prints `-`; `Z` truncates to that many bytes.

use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;

use crate::headers::HeaderMap;

/// Envoy's default access-log format (`source/common/formatter/substitution_format_string.cc`).
pub const ENVOY_DEFAULT_FORMAT: &str = "[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\"\n";

/// The command operators this formatter knows.
pub const SUPPORTED: &str = "START_TIME, REQ(X?Y):Z, RESP(X?Y):Z, RESPONSE_CODE, RESPONSE_FLAGS, \
RESPONSE_CODE_DETAILS, BYTES_RECEIVED, BYTES_SENT, DURATION, PROTOCOL, UPSTREAM_HOST, \
FILTER_STATE(KEY:PLAIN|TYPED:Z)";

#[derive(Debug, Clone, PartialEq, Eq)]
enum Operator {
    StartTime,
    /// A request (`false`) or response (`true`) header, with its fallback.
    Header {
        response: bool,
        name: String,
        fallback: Option<String>,
    },
    ResponseCode,
    ResponseFlags,
    ResponseCodeDetails,
    BytesReceived,
    BytesSent,
    Duration,
    Protocol,
    UpstreamHost,
    FilterState {
        key: String,
        plain: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Operator(Operator, Option<usize>),
}

/// A parsed text format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format(Vec<Piece>);

/// What one finished request offers its access-log line.
pub struct Entry<'a> {
    pub start: SystemTime,
    pub request: &'a HeaderMap,
    pub response: Option<&'a HeaderMap>,
    /// 0 when no response was sent (Envoy prints 0).
    pub status: u16,
    pub details: Option<&'a str>,
    pub bytes_received: usize,
    pub bytes_sent: usize,
    pub duration_ms: u128,
    pub protocol: &'a str,
    pub upstream: Option<SocketAddr>,
    /// The stream's filter state, by key as Envoy names it (`wasm.<path>` for wasm filters).
    pub filter_state: &'a dyn Fn(&str) -> Option<Vec<u8>>,
}

impl Format {
    /// Parses an Envoy text format; `Err` names the first operator it cannot print.
    pub fn parse(format: &str) -> Result<Format, String> {
        let mut pieces = Vec::new();
        let mut text = String::new();
        let mut rest = format;
        while let Some(at) = rest.find('%') {
            text.push_str(&rest[..at]);
            rest = &rest[at + 1..];
            if let Some(after) = rest.strip_prefix('%') {
                text.push('%');
                rest = after;
                continue;
            }
            let end = rest
                .find('%')
                .ok_or_else(|| format!("an unterminated command operator in {format:?}"))?;
            let command = &rest[..end];
            rest = &rest[end + 1..];
            if !text.is_empty() {
                pieces.push(Piece::Text(std::mem::take(&mut text)));
            }
            pieces.push(operator(command)?);
        }
        text.push_str(rest);
        if !text.is_empty() {
            pieces.push(Piece::Text(text));
        }
        Ok(Format(pieces))
    }

    pub fn render(&self, entry: &Entry<'_>) -> String {
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                Piece::Text(text) => out.push_str(text),
                Piece::Operator(op, max) => {
                    let mut value = value(op, entry).unwrap_or_else(|| "-".to_owned());
                    if let Some(max) = *max
                        && value.len() > max
                    {
                        let mut cut = max;
                        while !value.is_char_boundary(cut) {
                            cut -= 1;
                        }
                        value.truncate(cut);
                    }
                    out.push_str(&value);
                }
            }
        }
        out
    }
}

/// `NAME`, `NAME(ARG)` or `NAME(ARG):Z`.
fn operator(command: &str) -> Result<Piece, String> {
    let unsupported =
        || format!("command operator %{command}% is not supported here ({SUPPORTED})");
    let (name, arg, max) = match command.split_once('(') {
        None => (command, None, None),
        Some((name, tail)) => {
            let (arg, after) = tail.split_once(')').ok_or_else(unsupported)?;
            let max = match after {
                "" => None,
                _ => Some(
                    after
                        .strip_prefix(':')
                        .and_then(|z| z.parse::<usize>().ok())
                        .ok_or_else(unsupported)?,
                ),
            };
            (name, Some(arg), max)
        }
    };
    let op = match (name, arg) {
        ("START_TIME", None) => Operator::StartTime,
        ("REQ" | "RESP", Some(arg)) if !arg.is_empty() => {
            let (name, fallback) = match arg.split_once('?') {
                Some((a, b)) => (a, Some(b.to_ascii_lowercase())),
                None => (arg, None),
            };
            Operator::Header {
                response: command.starts_with("RESP"),
                name: name.to_ascii_lowercase(),
                fallback,
            }
        }
        ("RESPONSE_CODE", None) => Operator::ResponseCode,
        ("RESPONSE_FLAGS", None) => Operator::ResponseFlags,
        ("RESPONSE_CODE_DETAILS", None) => Operator::ResponseCodeDetails,
        ("BYTES_RECEIVED", None) => Operator::BytesReceived,
        ("BYTES_SENT", None) => Operator::BytesSent,
        ("DURATION", None) => Operator::Duration,
        ("PROTOCOL", None) => Operator::Protocol,
        ("UPSTREAM_HOST", None) => Operator::UpstreamHost,
        ("FILTER_STATE", Some(arg)) => {
            let (key, plain) = match arg.rsplit_once(':') {
                Some((key, "PLAIN")) => (key, true),
                Some((key, "TYPED")) => (key, false),
                _ => (arg, false),
            };
            if key.is_empty() {
                return Err(unsupported());
            }
            Operator::FilterState {
                key: key.to_owned(),
                plain,
            }
        }
        _ => return Err(unsupported()),
    };
    Ok(Piece::Operator(op, max))
}

fn value(op: &Operator, entry: &Entry<'_>) -> Option<String> {
    match op {
        Operator::StartTime => Some(rfc3339_millis(entry.start)),
        Operator::Header {
            response,
            name,
            fallback,
        } => {
            let map = if *response {
                entry.response?
            } else {
                entry.request
            };
            map.get(name)
                .or_else(|| fallback.as_deref().and_then(|f| map.get(f)))
        }
        Operator::ResponseCode => Some(entry.status.to_string()),
        // The gateway sets none of Envoy's response flags.
        Operator::ResponseFlags => None,
        Operator::ResponseCodeDetails => entry.details.map(str::to_owned),
        Operator::BytesReceived => Some(entry.bytes_received.to_string()),
        Operator::BytesSent => Some(entry.bytes_sent.to_string()),
        Operator::Duration => Some(entry.duration_ms.to_string()),
        Operator::Protocol => Some(entry.protocol.to_owned()),
        Operator::UpstreamHost => entry.upstream.map(|a| a.to_string()),
        Operator::FilterState { key, plain } => {
            let bytes = (entry.filter_state)(key)?;
            Some(if *plain {
                String::from_utf8_lossy(&bytes).into_owned()
            } else {
                format!(
                    "{{\"@type\":\"type.googleapis.com/google.protobuf.BytesValue\",\"value\":\"{}\"}}",
                    base64::engine::general_purpose::STANDARD.encode(bytes)
                )
            })
        }
    }
}

/// Envoy's default `START_TIME` format, `%Y-%m-%dT%H:%M:%E3SZ` (UTC).
fn rfc3339_millis(at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, day_secs) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        day_secs / 3_600,
        day_secs % 3_600 / 60,
        day_secs % 60,
        since.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn entry<'a>(request: &'a HeaderMap, state: &'a dyn Fn(&str) -> Option<Vec<u8>>) -> Entry<'a> {
        Entry {
            start: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            request,
            response: None,
            status: 201,
            details: Some("via_upstream"),
            bytes_received: 12,
            bytes_sent: 34,
            duration_ms: 5,
            protocol: "HTTP/1.1",
            upstream: Some(SocketAddr::from(([127, 0, 0, 1], 8080))),
            filter_state: state,
        }
    }

    #[test]
    fn filter_state_prints_plain_typed_truncated_and_missing_as_envoy_does() {
        let request = HeaderMap::from([(":method", "POST"), (":path", "/payments")]);
        let state = |key: &str| (key == "wasm.idemgate.decision").then(|| b"granted".to_vec());
        let format = Format::parse(
            "%FILTER_STATE(wasm.idemgate.decision:PLAIN)% %FILTER_STATE(wasm.idemgate.decision)% \
             %FILTER_STATE(wasm.idemgate.decision:PLAIN):5% %FILTER_STATE(wasm.idemgate.fence:PLAIN)%",
        )
        .unwrap();
        assert_eq!(
            format.render(&entry(&request, &state)),
            "granted {\"@type\":\"type.googleapis.com/google.protobuf.BytesValue\",\"value\":\"Z3JhbnRlZA==\"} grant -"
        );
    }

    #[test]
    fn the_default_format_prints_like_envoys() {
        let request = HeaderMap::from([
            (":method", "POST"),
            (":path", "/payments"),
            (":authority", "gw"),
            ("x-request-id", "r-1"),
            ("user-agent", "curl/8"),
        ]);
        let none = |_: &str| None;
        let line = Format::parse(ENVOY_DEFAULT_FORMAT)
            .unwrap()
            .render(&entry(&request, &none));
        assert_eq!(
            line,
            "[2023-11-14T22:13:20.123Z] \"POST /payments HTTP/1.1\" 201 - 12 34 5 - \"-\" \"curl/8\" \"r-1\" \"gw\" \"127.0.0.1:8080\"\n"
        );
    }

    #[test]
    fn percent_escapes_and_header_fallbacks() {
        let request = HeaderMap::from([(":path", "/a"), ("x-envoy-original-path", "/orig")]);
        let none = |_: &str| None;
        let format =
            Format::parse("100%% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %REQ(:PATH):1%").unwrap();
        assert_eq!(format.render(&entry(&request, &none)), "100% /orig /");
    }

    #[test]
    fn operators_it_cannot_print_are_refused() {
        for bad in [
            "%DOWNSTREAM_REMOTE_ADDRESS%",
            "%START_TIME(%s)%",
            "%REQ()%",
            "%FILTER_STATE(:PLAIN)%",
            "%REQ(X):abc%",
            "%BYTES_SENT",
        ] {
            assert!(Format::parse(bad).is_err(), "{bad}");
        }
    }
}
