//! `proxy_get_property`: the Envoy attributes plugins commonly read, serialized as Envoy does
//! (strings raw, integers as 8-byte little-endian, maps as pairs). Anything else is NotFound.

use crate::abi::{Status, encode_pairs};
use crate::headers::HeaderMap;
use crate::vm::{Stream, Target, VmState};

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
        (name, None) => stream
            .filter_state
            .get(name)
            .cloned()
            .ok_or(Status::NotFound),
        _ => Err(Status::NotFound),
    }
}
