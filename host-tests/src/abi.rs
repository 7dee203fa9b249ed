//! Proxy-wasm ABI 0.2.1 wire values (statuses, enums) and the pairs encoding, with the exact
//! leniency of proxy-wasm-cpp-host: malformed or oversized pairs decode to an empty list.

/// `proxy_status_t` values Envoy returns from hostcalls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    InvalidMemoryAccess = 6,
    Empty = 7,
    CasMismatch = 8,
    InternalFailure = 10,
    BrokenConnection = 11,
    Unimplemented = 12,
}

/// Which stream direction a hostcall or callback concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    Request,
    Response,
}

/// Buffer types of `proxy_get_buffer_bytes` / `proxy_set_buffer_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BufferType {
    HttpRequestBody,
    HttpResponseBody,
    DownstreamData,
    UpstreamData,
    HttpCallResponseBody,
    GrpcReceiveBuffer,
    VmConfiguration,
    PluginConfiguration,
    CallData,
}

impl BufferType {
    pub(crate) fn from_raw(raw: i32) -> Option<Self> {
        Some(match raw {
            0 => Self::HttpRequestBody,
            1 => Self::HttpResponseBody,
            2 => Self::DownstreamData,
            3 => Self::UpstreamData,
            4 => Self::HttpCallResponseBody,
            5 => Self::GrpcReceiveBuffer,
            6 => Self::VmConfiguration,
            7 => Self::PluginConfiguration,
            8 => Self::CallData,
            _ => return None,
        })
    }
}

/// Map types of the header-map hostcalls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MapType {
    RequestHeaders,
    RequestTrailers,
    ResponseHeaders,
    ResponseTrailers,
    GrpcInitialMetadata,
    GrpcTrailingMetadata,
    HttpCallResponseHeaders,
    HttpCallResponseTrailers,
}

impl MapType {
    pub(crate) fn from_raw(raw: i32) -> Option<Self> {
        Some(match raw {
            0 => Self::RequestHeaders,
            1 => Self::RequestTrailers,
            2 => Self::ResponseHeaders,
            3 => Self::ResponseTrailers,
            4 => Self::GrpcInitialMetadata,
            5 => Self::GrpcTrailingMetadata,
            6 => Self::HttpCallResponseHeaders,
            7 => Self::HttpCallResponseTrailers,
            _ => return None,
        })
    }
}

/// Metric kinds; a metric id's low two bits encode its kind (Envoy: counters 4, 8, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter = 0,
    Gauge = 1,
    Histogram = 2,
}

impl MetricKind {
    pub(crate) fn from_raw(raw: i32) -> Option<Self> {
        Some(match raw {
            0 => Self::Counter,
            1 => Self::Gauge,
            2 => Self::Histogram,
            _ => return None,
        })
    }
}

/// Log levels 0..=5 (trace..critical).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

impl LogLevel {
    pub(crate) fn from_raw(raw: i32) -> Option<Self> {
        Some(match raw {
            0 => Self::Trace,
            1 => Self::Debug,
            2 => Self::Info,
            3 => Self::Warn,
            4 => Self::Error,
            5 => Self::Critical,
            _ => return None,
        })
    }
}

/// HOST's `PROXY_WASM_HOST_PAIRS_MAX_BYTES` and `..._MAX_COUNT`.
const PAIRS_MAX_BYTES: usize = 1 << 20;
const PAIRS_MAX_COUNT: usize = 1024;

/// Serializes pairs as HOST does: u32 count, (u32 key_len, u32 value_len)*, then each key and
/// value followed by a NUL. An empty list is the empty buffer (HOST returns ptr 0 / len 0).
pub(crate) fn encode_pairs(pairs: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    if pairs.is_empty() {
        return Vec::new();
    }
    let data: usize = pairs.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    let mut out = Vec::with_capacity(4 + pairs.len() * 8 + data);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// Parses pairs as HOST's `pairs_util.cc` does: any malformation, more than 1 MiB or more than
/// 1024 pairs silently yields an empty list.
pub(crate) fn decode_pairs(buf: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    decode_pairs_strict(buf).unwrap_or_default()
}

fn decode_pairs_strict(buf: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    if buf.is_empty() || buf.len() > PAIRS_MAX_BYTES {
        return None;
    }
    let u32_at = |at: usize| -> Option<usize> {
        let bytes: [u8; 4] = buf.get(at..at + 4)?.try_into().ok()?;
        Some(u32::from_le_bytes(bytes) as usize)
    };
    let count = u32_at(0)?;
    if count > PAIRS_MAX_COUNT {
        return None;
    }
    let mut sizes = Vec::with_capacity(count);
    for i in 0..count {
        sizes.push((u32_at(4 + i * 8)?, u32_at(8 + i * 8)?));
    }
    let mut at = 4 + count * 8;
    let mut take = |len: usize| -> Option<Vec<u8>> {
        let value = buf.get(at..at + len)?.to_vec();
        if *buf.get(at + len)? != 0 {
            return None;
        }
        at += len + 1;
        Some(value)
    };
    let mut pairs = Vec::with_capacity(count);
    for (klen, vlen) in sizes {
        let key = take(klen)?;
        let value = take(vlen)?;
        pairs.push((key, value));
    }
    (at == buf.len()).then_some(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(Vec<u8>, Vec<u8>)> {
        list.iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn pairs_round_trip() {
        let list = pairs(&[(":path", "/a"), ("x", ""), ("k", "v")]);
        assert_eq!(decode_pairs(&encode_pairs(&list)), list);
    }

    #[test]
    fn empty_list_is_the_empty_buffer() {
        assert!(encode_pairs(&[]).is_empty());
        assert!(decode_pairs(&[]).is_empty());
    }

    #[test]
    fn malformed_pairs_decode_to_nothing() {
        let mut buf = encode_pairs(&pairs(&[("a", "b")]));
        buf.push(0);
        assert!(decode_pairs(&buf).is_empty(), "trailing byte");
        let mut buf = encode_pairs(&pairs(&[("a", "b")]));
        let last = buf.len() - 1;
        if let Some(b) = buf.get_mut(last) {
            *b = b'x';
        }
        assert!(decode_pairs(&buf).is_empty(), "missing NUL");
        assert!(decode_pairs(&[5, 0, 0]).is_empty(), "short count");
    }
}
