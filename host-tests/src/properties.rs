//! `proxy_get_property`: the Envoy attributes plugins commonly read, serialized as Envoy does
//! (strings raw, integers as 8-byte little-endian, maps as pairs). Anything else is NotFound.

use crate::abi::{Status, encode_pairs};
use crate::headers::HeaderMap;
use crate::vm::{Stream, Target, VmState};

/// The route a stream matched, as Envoy serves it through `xds.*` attributes
/// (`source/extensions/filters/common/expr/context.cc`, `XDSWrapper`).
#[derive(Debug, Clone, Default)]
pub struct RouteProperties {
    pub route_name: String,
    pub virtual_host_name: String,
    /// `None` for a `direct_response` route.
    pub cluster_name: Option<String>,
    /// The route's `metadata.filter_metadata` (filter name → struct).
    pub filter_metadata: Option<serde_json::Value>,
}

fn int(value: u64) -> Vec<u8> {
    value.to_le_bytes().to_vec()
}

fn header_value(headers: Option<&HeaderMap>, name: &str) -> Result<Vec<u8>, Status> {
    headers
        .and_then(|h| h.get_joined(name))
        .ok_or(Status::NotFound)
}

/// `request.headers` / `response.headers`: one header (comma-joined) or the whole map.
fn headers(map: Option<&HeaderMap>, rest: &[&[u8]]) -> Result<Vec<u8>, Status> {
    match rest.first() {
        Some(name) => header_value(map, &String::from_utf8_lossy(name)),
        None => Ok(encode_pairs(map.ok_or(Status::NotFound)?.entries())),
    }
}

fn request(stream: &Stream, field: &[u8], rest: &[&[u8]]) -> Result<Vec<u8>, Status> {
    let map = stream.request.headers.as_ref();
    let path = || header_value(map, ":path");
    match field {
        b"path" => path(),
        b"url_path" => {
            let p = path()?;
            Ok(p.split(|b| *b == b'?').next().unwrap_or_default().to_vec())
        }
        b"query" => {
            let p = path()?;
            Ok(p.iter()
                .position(|b| *b == b'?')
                .and_then(|at| p.get(at + 1..))
                .unwrap_or_default()
                .to_vec())
        }
        b"host" => header_value(map, ":authority"),
        b"scheme" => header_value(map, ":scheme"),
        b"method" => header_value(map, ":method"),
        b"id" => header_value(map, "x-request-id"),
        b"referer" => header_value(map, "referer"),
        b"useragent" => header_value(map, "user-agent"),
        b"protocol" => Ok(stream.info.protocol.as_bytes().to_vec()),
        b"time" => Ok(int(stream.started_ns)),
        b"duration" => stream
            .finished_mono_ns
            .map(|end| int(end.saturating_sub(stream.started_mono_ns)))
            .ok_or(Status::NotFound),
        b"headers" => headers(map, rest),
        _ => Err(Status::NotFound),
    }
}

fn address(addr: std::net::SocketAddr, field: &[u8]) -> Result<Vec<u8>, Status> {
    match field {
        b"address" => Ok(addr.to_string().into_bytes()),
        b"port" => Ok(int(u64::from(addr.port()))),
        _ => Err(Status::NotFound),
    }
}

/// Looks up one property path (segments already split on NUL).
pub(crate) fn get(state: &VmState, path: &[&[u8]]) -> Result<Vec<u8>, Status> {
    let first = path.first().copied().unwrap_or_default();
    let second = path.get(1).copied();
    let rest = path.get(2..).unwrap_or_default();
    match first {
        b"plugin_name" => return Ok(state.plugin.name.as_bytes().to_vec()),
        b"plugin_root_id" => return Ok(state.plugin.root_id.as_bytes().to_vec()),
        b"plugin_vm_id" => return Ok(state.plugin.vm_id.as_bytes().to_vec()),
        _ => {}
    }
    let Target::Stream(id) = state.target() else {
        return Err(Status::NotFound);
    };
    let stream = state.streams.get(&id).ok_or(Status::NotFound)?;
    match (first, second) {
        (b"request", Some(field)) => request(stream, field, rest),
        (b"response", Some(b"code")) => stream
            .response_code
            .map(|c| int(u64::from(c)))
            .ok_or(Status::NotFound),
        (b"response", Some(b"headers")) => headers(stream.response.headers.as_ref(), rest),
        (b"source", Some(field)) => address(stream.info.source, field),
        (b"destination", Some(field)) => address(stream.info.destination, field),
        (b"connection", Some(b"id")) | (b"connection_id", None) => {
            Ok(int(stream.info.connection_id))
        }
        (b"xds", Some(field)) => xds(stream.info.route.as_deref(), field, rest),
        // The stream's dynamic metadata: empty unless a filter wrote it, and the gateway
        // has no filter that does (a set `Metadata` message with no entries).
        (b"metadata", None) => Ok(Vec::new()),
        (b"metadata", Some(_)) => Err(Status::NotFound),
        (name, None) => stream
            .filter_state
            .get(name)
            .cloned()
            .ok_or(Status::NotFound),
        _ => Err(Status::NotFound),
    }
}

fn xds(route: Option<&RouteProperties>, field: &[u8], rest: &[&[u8]]) -> Result<Vec<u8>, Status> {
    let route = route.ok_or(Status::NotFound)?;
    let text = |s: &str| Ok(s.as_bytes().to_vec());
    match (field, rest) {
        (b"route_name", []) => text(&route.route_name),
        (b"virtual_host_name", []) => text(&route.virtual_host_name),
        (b"cluster_name", []) => route
            .cluster_name
            .as_deref()
            .map_or(Err(Status::NotFound), text),
        (b"route_metadata", []) => Ok(metadata::encode(route.filter_metadata.as_ref())),
        (b"route_metadata", [b"filter_metadata", path @ ..]) => {
            let empty = serde_json::Value::Object(serde_json::Map::new());
            let mut value = route.filter_metadata.as_ref().unwrap_or(&empty);
            for segment in path {
                value = value
                    .get(String::from_utf8_lossy(segment).as_ref())
                    .ok_or(Status::NotFound)?;
            }
            metadata::serialize(value)
        }
        _ => Err(Status::NotFound),
    }
}

/// `envoy.config.core.v3.Metadata` values as Envoy's `serializeValue` returns them
/// (`source/extensions/common/wasm/context.cc`).
mod metadata {
    use crate::abi::{Status, encode_pairs};
    use serde_json::Value;

    /// A leaf or map reached by a path: strings raw, numbers as 8-byte little-endian
    /// doubles (protobuf `Struct` numbers), booleans as one byte, a map of strings as
    /// pairs; other maps and lists cannot be serialized.
    pub(super) fn serialize(value: &Value) -> Result<Vec<u8>, Status> {
        match value {
            Value::String(s) => Ok(s.as_bytes().to_vec()),
            Value::Number(n) => Ok(n.as_f64().unwrap_or_default().to_le_bytes().to_vec()),
            Value::Bool(b) => Ok(vec![u8::from(*b)]),
            Value::Null => Ok(Vec::new()),
            Value::Object(map) => {
                let pairs: Option<Vec<(Vec<u8>, Vec<u8>)>> = map
                    .iter()
                    .map(|(k, v)| Some((k.as_bytes().to_vec(), v.as_str()?.as_bytes().to_vec())))
                    .collect();
                pairs
                    .map(|p| encode_pairs(&p))
                    .ok_or(Status::SerializationFailure)
            }
            Value::Array(_) => Err(Status::SerializationFailure),
        }
    }

    fn varint(mut n: u64, out: &mut Vec<u8>) {
        while n >= 0x80 {
            out.push(u8::try_from(n & 0x7f).unwrap_or_default() | 0x80);
            n >>= 7;
        }
        out.push(u8::try_from(n).unwrap_or_default());
    }

    fn field(tag: u8, bytes: &[u8], out: &mut Vec<u8>) {
        out.push(tag);
        varint(bytes.len() as u64, out);
        out.extend_from_slice(bytes);
    }

    /// `google.protobuf.Value`.
    fn value(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        match v {
            Value::Null => out.extend_from_slice(&[0x08, 0]),
            Value::Number(n) => {
                out.push(0x11);
                out.extend_from_slice(&n.as_f64().unwrap_or_default().to_le_bytes());
            }
            Value::String(s) => field(0x1a, s.as_bytes(), &mut out),
            Value::Bool(b) => out.extend_from_slice(&[0x20, u8::from(*b)]),
            Value::Object(_) => field(0x2a, &structure(v), &mut out),
            Value::Array(items) => {
                let mut list = Vec::new();
                for item in items {
                    field(0x0a, &value(item), &mut list);
                }
                field(0x32, &list, &mut out);
            }
        }
        out
    }

    /// `google.protobuf.Struct` (map entries: key = 1, value = 2).
    fn structure(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, v) in v.as_object().into_iter().flatten() {
            let mut entry = Vec::new();
            field(0x0a, k.as_bytes(), &mut entry);
            field(0x12, &value(v), &mut entry);
            field(0x0a, &entry, &mut out);
        }
        out
    }

    /// The whole `Metadata` message in protobuf binary, as Envoy returns a message value.
    pub(super) fn encode(filter_metadata: Option<&Value>) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, fields) in filter_metadata
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            let mut entry = Vec::new();
            field(0x0a, name.as_bytes(), &mut entry);
            field(0x12, &structure(fields), &mut entry);
            field(0x0a, &entry, &mut out);
        }
        out
    }
}
