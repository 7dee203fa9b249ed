//! The `env.proxy_*` imports with Envoy's statuses and availability windows. Hostcalls only
//! record: anything that would run module code (continue, close, local reply, `proxy_done`)
//! is queued as a [`Deferred`] action for after the current export returns.

use crate::abi::{
    BufferType, Direction, LogLevel, MapType, MetricKind, Status, decode_pairs, encode_pairs,
};
use crate::headers::HeaderMap;
use crate::vm::memory::{check_writable, read, read_str, return_bytes, slice, span, write};
use crate::vm::{
    CalloutOutcome, CalloutRequest, Deferred, GrpcKind, LocalReply, Phase, Target, VmState,
};
use std::time::Duration;
use wasmtime::{Caller, Linker};

pub(crate) type Ctx<'a> = Caller<'a, VmState>;
pub(crate) type HostResult = wasmtime::Result<Status>;

/// Unwraps a `Result<T, Status>`, returning the status to the module on error.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(status) => return Ok(status),
        }
    };
}

/// During `_initialize`/`main` only logging and WASI are allowed (HOST's restricted
/// callbacks, enforced by Envoy's V8 runtime): anything else traps the start.
fn unrestricted(c: &Ctx<'_>, name: &str) -> wasmtime::Result<()> {
    if c.data().restricted {
        wasmtime::bail!("restricted_callback: {name} is not allowed during VM start");
    }
    Ok(())
}

// ---- header maps ----

/// A map the running context may touch, and whether it may be written.
enum MapAccess<'a> {
    Writable(&'a mut HeaderMap),
    ReadOnly(&'a HeaderMap),
    /// Not available now; `log_phase` turns value lookups into NotFound instead of BadArgument.
    Unavailable {
        log_phase: bool,
    },
}

fn callout_map(state: &VmState, trailers: bool) -> MapAccess<'_> {
    match &state.callout_response {
        Some(CalloutOutcome::Response {
            headers,
            trailers: t,
            ..
        }) => MapAccess::ReadOnly(if trailers { t } else { headers }),
        _ => MapAccess::Unavailable { log_phase: false },
    }
}

fn map_access(state: &mut VmState, ty: MapType) -> MapAccess<'_> {
    let (dir, trailers) = match ty {
        MapType::RequestHeaders => (Direction::Request, false),
        MapType::RequestTrailers => (Direction::Request, true),
        MapType::ResponseHeaders => (Direction::Response, false),
        MapType::ResponseTrailers => (Direction::Response, true),
        MapType::HttpCallResponseHeaders => return callout_map(state, false),
        MapType::HttpCallResponseTrailers => return callout_map(state, true),
        // Readable (and, as in Envoy, writable) only during the gRPC callback that
        // delivers them, through the root.
        MapType::GrpcInitialMetadata => {
            return state.grpc.delivery.initial_metadata.as_mut().map_or(
                MapAccess::Unavailable { log_phase: false },
                MapAccess::Writable,
            );
        }
        MapType::GrpcTrailingMetadata => {
            return state.grpc.delivery.trailing_metadata.as_mut().map_or(
                MapAccess::Unavailable { log_phase: false },
                MapAccess::Writable,
            );
        }
    };
    let Target::Stream(id) = state.target() else {
        return MapAccess::Unavailable { log_phase: false };
    };
    let Some(stream) = state.streams.get_mut(&id) else {
        return MapAccess::Unavailable { log_phase: false };
    };
    if stream.logging {
        // Access-log phase: request/response headers and response trailers, read-only.
        let map = match (dir, trailers) {
            (Direction::Request, true) => None,
            (d, false) => stream.half(d).headers.as_ref(),
            (d, true) => stream.half(d).trailers.as_ref(),
        };
        return map.map_or(
            MapAccess::Unavailable { log_phase: true },
            MapAccess::ReadOnly,
        );
    }
    let half = stream.half_mut(dir);
    let held = if trailers {
        half.trailers_held
    } else {
        half.headers_held
    };
    if !held || half.dropped {
        return MapAccess::Unavailable { log_phase: false };
    }
    let map = if trailers {
        half.trailers.as_mut()
    } else {
        half.headers.as_mut()
    };
    map.map_or(
        MapAccess::Unavailable { log_phase: false },
        MapAccess::Writable,
    )
}

fn map_type(raw: i32) -> Result<MapType, Status> {
    MapType::from_raw(raw).ok_or(Status::BadArgument)
}

fn get_header_map_pairs(c: &mut Ctx<'_>, ty: i32, ptr_out: i32, len_out: i32) -> HostResult {
    let ty = tri!(map_type(ty));
    let bytes = match map_access(c.data_mut(), ty) {
        MapAccess::Writable(m) => encode_pairs(m.entries()),
        MapAccess::ReadOnly(m) => encode_pairs(m.entries()),
        MapAccess::Unavailable { .. } => Vec::new(),
    };
    return_bytes(c, &bytes, ptr_out, len_out)
}

fn set_header_map_pairs(c: &mut Ctx<'_>, ty: i32, ptr: i32, len: i32) -> HostResult {
    let ty = tri!(map_type(ty));
    let pairs = decode_pairs(&tri!(read(c, ptr, len)));
    match map_access(c.data_mut(), ty) {
        MapAccess::Writable(m) => {
            *m = HeaderMap::from_raw(pairs);
            Ok(Status::Ok)
        }
        _ => Ok(Status::BadArgument),
    }
}

fn get_header_map_value(
    c: &mut Ctx<'_>,
    ty: i32,
    kp: i32,
    kl: i32,
    ptr_out: i32,
    len_out: i32,
) -> HostResult {
    let ty = tri!(map_type(ty));
    let Some(memory) = c.data().wasm.as_ref().map(|w| w.memory) else {
        return Ok(Status::InvalidMemoryAccess);
    };
    // The name is looked up where it lies in guest memory, as Envoy does: no copy.
    let (guest, state) = memory.data_and_store_mut(&mut *c);
    let key = tri!(slice(guest, kp, kl));
    let value = match map_access(state, ty) {
        MapAccess::Writable(m) => m.get_raw(key).map(<[u8]>::to_vec),
        MapAccess::ReadOnly(m) => m.get_raw(key).map(<[u8]>::to_vec),
        MapAccess::Unavailable { log_phase: true } => return Ok(Status::NotFound),
        MapAccess::Unavailable { log_phase: false } => return Ok(Status::BadArgument),
    };
    match value {
        Some(v) => return_bytes(c, &v, ptr_out, len_out),
        None => Ok(Status::NotFound),
    }
}

fn mutate_header(
    c: &mut Ctx<'_>,
    ty: i32,
    kp: i32,
    kl: i32,
    value: Option<(i32, i32)>,
    op: fn(&mut HeaderMap, &[u8], &[u8]),
) -> HostResult {
    let ty = tri!(map_type(ty));
    let Some(memory) = c.data().wasm.as_ref().map(|w| w.memory) else {
        return Ok(Status::InvalidMemoryAccess);
    };
    // Name and value are read where they lie in guest memory: Envoy copies the name into a
    // `LowerCaseString` (a small string, no allocation for ordinary names) and copies a value
    // only into the map, which `op` does here too.
    let (guest, state) = memory.data_and_store_mut(&mut *c);
    let key = tri!(slice(guest, kp, kl));
    let value = match value {
        Some((vp, vl)) => tri!(slice(guest, vp, vl)),
        None => &[],
    };
    match map_access(state, ty) {
        MapAccess::Writable(m) => {
            op(m, key, value);
            Ok(Status::Ok)
        }
        _ => Ok(Status::BadArgument),
    }
}

fn replace_header_map_value(
    c: &mut Ctx<'_>,
    t: i32,
    kp: i32,
    kl: i32,
    vp: i32,
    vl: i32,
) -> HostResult {
    mutate_header(c, t, kp, kl, Some((vp, vl)), HeaderMap::replace)
}

fn add_header_map_value(c: &mut Ctx<'_>, t: i32, kp: i32, kl: i32, vp: i32, vl: i32) -> HostResult {
    mutate_header(c, t, kp, kl, Some((vp, vl)), HeaderMap::add)
}

fn remove_header_map_value(c: &mut Ctx<'_>, t: i32, kp: i32, kl: i32) -> HostResult {
    mutate_header(c, t, kp, kl, None, |m, k, _| m.remove(k))
}

fn get_header_map_size(c: &mut Ctx<'_>, ty: i32, out: i32) -> HostResult {
    let ty = tri!(map_type(ty));
    let size = match map_access(c.data_mut(), ty) {
        MapAccess::Writable(m) => m.byte_size(),
        MapAccess::ReadOnly(m) => m.byte_size(),
        MapAccess::Unavailable { .. } => return Ok(Status::BadArgument),
    };
    tri!(write(c, out, &(size as u32).to_le_bytes()));
    Ok(Status::Ok)
}

// ---- buffers ----

/// Body of the target stream in `dir`, if the plugin may see it now (inside the body callback
/// or while the body is held by a stop).
fn body_access(state: &mut VmState, dir: Direction) -> Result<Option<&mut Vec<u8>>, Status> {
    let Target::Stream(id) = state.target() else {
        return Err(Status::NotFound);
    };
    let stream = state.streams.get_mut(&id).ok_or(Status::NotFound)?;
    let in_body = stream.in_callback == Some((dir, Phase::Body));
    let half = stream.half_mut(dir);
    let held = half.body_held() && !half.dropped;
    Ok((in_body || held).then_some(&mut half.body))
}

fn get_buffer_bytes(
    c: &mut Ctx<'_>,
    ty: i32,
    start: i32,
    max: i32,
    ptr_out: i32,
    len_out: i32,
) -> HostResult {
    let ty = tri!(BufferType::from_raw(ty).ok_or(Status::BadArgument));
    let state = c.data_mut();
    let whole: Vec<u8> = match ty {
        BufferType::VmConfiguration => state.plugin.vm_configuration.clone(),
        BufferType::PluginConfiguration if state.configuring => state.plugin.configuration.clone(),
        BufferType::HttpRequestBody | BufferType::HttpResponseBody => {
            let dir = if ty == BufferType::HttpRequestBody {
                Direction::Request
            } else {
                Direction::Response
            };
            tri!(body_access(state, dir))
                .map(|b| b.clone())
                .unwrap_or_default()
        }
        BufferType::HttpCallResponseBody => match &state.callout_response {
            Some(CalloutOutcome::Response { body, .. }) => body.clone(),
            _ => return Ok(Status::NotFound),
        },
        BufferType::GrpcReceiveBuffer => match &state.grpc.delivery.message {
            Some(message) => message.clone(),
            None => return Ok(Status::NotFound),
        },
        _ => return Ok(Status::NotFound),
    };
    let (start, max) = span(start, max);
    let slice = whole
        .get(start..)
        .map(|rest| rest.get(..rest.len().min(max)).unwrap_or_default())
        .unwrap_or_default();
    return_bytes(c, slice, ptr_out, len_out)
}

fn set_buffer_bytes(
    c: &mut Ctx<'_>,
    ty: i32,
    start: i32,
    size: i32,
    ptr: i32,
    len: i32,
) -> HostResult {
    let ty = tri!(BufferType::from_raw(ty).ok_or(Status::BadArgument));
    let data = tri!(read(c, ptr, len));
    let dir = match ty {
        BufferType::HttpRequestBody => Direction::Request,
        BufferType::HttpResponseBody => Direction::Response,
        _ => return Ok(Status::BadArgument),
    };
    let (start, size) = span(start, size);
    let Some(body) = tri!(body_access(c.data_mut(), dir).map_err(|_| Status::BadArgument)) else {
        return Ok(Status::BadArgument);
    };
    // Envoy's live buffer: start 0 drains `size` then prepends; start >= len appends.
    if start == 0 {
        body.drain(..size.min(body.len()));
        body.splice(0..0, data);
    } else if start >= body.len() {
        body.extend_from_slice(&data);
    } else {
        return Ok(Status::BadArgument);
    }
    Ok(Status::Ok)
}

// ---- stream control ----

fn target_stream(state: &VmState) -> Option<u64> {
    match state.target() {
        Target::Stream(id) => Some(id),
        _ => None,
    }
}

fn continue_stream(c: &mut Ctx<'_>, ty: i32) -> HostResult {
    let dir = match ty {
        0 => Direction::Request,
        1 => Direction::Response,
        2 => return Ok(Status::Ok),
        3 => return Ok(Status::Unimplemented),
        _ => return Ok(Status::BadArgument),
    };
    let state = c.data_mut();
    if let Some(id) = target_stream(state) {
        if let Some(stream) = state.streams.get_mut(&id) {
            // Envoy drops its header/body pointers at once, before the deferred continue.
            stream.half_mut(dir).dropped = true;
        }
        state.deferred.push_back(Deferred::Continue(id, dir));
    }
    Ok(Status::Ok)
}

fn close_stream(c: &mut Ctx<'_>, ty: i32) -> HostResult {
    if !(0..=3).contains(&ty) {
        return Ok(Status::BadArgument);
    }
    let state = c.data_mut();
    if let Some(id) = target_stream(state) {
        state.deferred.push_back(Deferred::Close(id));
    }
    Ok(Status::Ok)
}

#[allow(
    clippy::too_many_arguments,
    reason = "the hostcall's arguments, as the ABI passes them"
)]
fn send_local_response(
    c: &mut Ctx<'_>,
    status: i32,
    dp: i32,
    dl: i32,
    bp: i32,
    bl: i32,
    hp: i32,
    hl: i32,
    grpc: i32,
) -> HostResult {
    let details = tri!(read_str(c, dp, dl));
    let body = tri!(read(c, bp, bl));
    let headers = HeaderMap::from_raw(decode_pairs(&tri!(read(c, hp, hl))));
    let state = c.data_mut();
    if let Some(id) = target_stream(state) {
        if let Some(stream) = state.streams.get_mut(&id) {
            stream.local_reply_in_call = true;
        }
        let details = details
            .chars()
            .map(|ch| if ch.is_whitespace() { '_' } else { ch })
            .collect();
        state.deferred.push_back(Deferred::LocalReply(
            id,
            LocalReply {
                status: status as u32,
                body,
                headers,
                details,
                grpc_status: grpc,
            },
        ));
    }
    Ok(Status::Ok)
}

fn set_effective_context(c: &mut Ctx<'_>, id: i32) -> HostResult {
    let state = c.data_mut();
    if !state.is_context(id as u32) {
        return Ok(Status::BadArgument);
    }
    state.effective = Some(id as u32);
    Ok(Status::Ok)
}

fn done(c: &mut Ctx<'_>) -> HostResult {
    let state = c.data_mut();
    match (state.target(), state.root.as_mut()) {
        (Target::Root, Some(root)) if root.pending_done => {
            root.pending_done = false;
            state.deferred.push_back(Deferred::DeleteRoot);
            Ok(Status::Ok)
        }
        _ => Ok(Status::NotFound),
    }
}

// ---- callouts ----

#[allow(
    clippy::too_many_arguments,
    reason = "the hostcall's arguments, as the ABI passes them"
)]
fn http_call(
    c: &mut Ctx<'_>,
    up: i32,
    ul: i32,
    hp: i32,
    hl: i32,
    bp: i32,
    bl: i32,
    tp: i32,
    tl: i32,
    timeout: i32,
    token_out: i32,
) -> HostResult {
    let cluster = tri!(read_str(c, up, ul));
    let headers = tri!(read(c, hp, hl));
    let body = tri!(read(c, bp, bl));
    let trailers = tri!(read(c, tp, tl));
    tri!(check_writable(c, token_out, 4));
    if timeout < 0 {
        return Ok(Status::BadArgument);
    }
    let Some(max_requests) = c.data().clusters.get(&cluster).map(|k| k.max_requests) else {
        return Ok(Status::BadArgument);
    };
    let mut headers = HeaderMap::from_raw(decode_pairs(&headers));
    if [":method", ":path", ":authority"]
        .iter()
        .any(|k| headers.get_bytes(k).is_none())
    {
        return Ok(Status::BadArgument);
    }
    if !body.is_empty() {
        headers.replace(b"content-length", body.len().to_string().as_bytes());
    }
    let state = c.data_mut();
    // Envoy's async client completes inline (no callback ever comes) when the cluster's
    // circuit breaker overflows; the host then answers InternalFailure.
    if state.root.is_none() || !state.shared.try_start_request(&cluster, max_requests) {
        return Ok(Status::InternalFailure);
    }
    let token = state.register_callout(CalloutRequest {
        token: 0,
        cluster,
        headers,
        body,
        trailers: HeaderMap::from_raw(decode_pairs(&trailers)),
        timeout: (timeout > 0).then(|| Duration::from_millis(timeout as u64)),
    });
    tri!(write(c, token_out, &token.to_le_bytes()));
    Ok(Status::Ok)
}

fn get_status(c: &mut Ctx<'_>, code_out: i32, ptr_out: i32, len_out: i32) -> HostResult {
    let (code, message) = c
        .data()
        .root
        .as_ref()
        .map(|r| r.status.clone())
        .unwrap_or_default();
    tri!(write(c, code_out, &code.to_le_bytes()));
    return_bytes(c, &message, ptr_out, len_out)
}

// ---- shared data and queues ----

fn get_shared_data(
    c: &mut Ctx<'_>,
    kp: i32,
    kl: i32,
    ptr_out: i32,
    len_out: i32,
    cas_out: i32,
) -> HostResult {
    let key = tri!(read(c, kp, kl));
    let state = c.data();
    let Some((value, cas)) = state.shared.get_shared_data(&state.plugin.vm_id, &key) else {
        return Ok(Status::NotFound);
    };
    tri!(check_writable(c, cas_out, 4));
    let status = return_bytes(c, &value, ptr_out, len_out)?;
    if status == Status::Ok {
        tri!(write(c, cas_out, &cas.to_le_bytes()));
    }
    Ok(status)
}

fn set_shared_data(c: &mut Ctx<'_>, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32) -> HostResult {
    let key = tri!(read(c, kp, kl));
    let value = tri!(read(c, vp, vl));
    let state = c.data();
    Ok(state
        .shared
        .set_shared_data(&state.plugin.vm_id, &key, &value, cas as u32))
}

fn register_shared_queue(c: &mut Ctx<'_>, np: i32, nl: i32, out: i32) -> HostResult {
    let name = tri!(read(c, np, nl));
    let state = c.data();
    let root = state.root.as_ref().map_or(0, |r| r.id);
    let token = state
        .shared
        .register_queue(&state.plugin.vm_id, &name, &state.mailbox, root);
    tri!(write(c, out, &token.to_le_bytes()));
    Ok(Status::Ok)
}

fn resolve_shared_queue(
    c: &mut Ctx<'_>,
    vp: i32,
    vl: i32,
    np: i32,
    nl: i32,
    out: i32,
) -> HostResult {
    let vm_id = tri!(read_str(c, vp, vl));
    let name = tri!(read(c, np, nl));
    let state = c.data();
    let vm_id = if vm_id.is_empty() {
        state.plugin.vm_id.clone()
    } else {
        vm_id
    };
    match state.shared.resolve_queue(&vm_id, &name) {
        Some(token) => {
            tri!(write(c, out, &token.to_le_bytes()));
            Ok(Status::Ok)
        }
        None => Ok(Status::NotFound),
    }
}

fn dequeue_shared_queue(c: &mut Ctx<'_>, token: i32, ptr_out: i32, len_out: i32) -> HostResult {
    match c.data().shared.dequeue(token as u32) {
        Ok(item) => return_bytes(c, &item, ptr_out, len_out),
        Err(status) => Ok(status),
    }
}

fn enqueue_shared_queue(c: &mut Ctx<'_>, token: i32, vp: i32, vl: i32) -> HostResult {
    let value = tri!(read(c, vp, vl));
    Ok(c.data().shared.enqueue(token as u32, &value))
}

// ---- metrics ----

fn define_metric(c: &mut Ctx<'_>, ty: i32, np: i32, nl: i32, out: i32) -> HostResult {
    let kind = tri!(MetricKind::from_raw(ty).ok_or(Status::BadArgument));
    let name = tri!(read_str(c, np, nl));
    tri!(check_writable(c, out, 4));
    let state = c.data_mut();
    state.shared.define_metric(kind, &name);
    let id = state.next_metric_id(kind);
    state.metric_names.insert(id, name);
    tri!(write(c, out, &id.to_le_bytes()));
    Ok(Status::Ok)
}

fn metric_name(c: &Ctx<'_>, id: i32) -> Result<String, Status> {
    c.data()
        .metric_names
        .get(&(id as u32))
        .cloned()
        .ok_or(Status::NotFound)
}

// ---- properties, logging, time ----

fn get_property(c: &mut Ctx<'_>, pp: i32, pl: i32, ptr_out: i32, len_out: i32) -> HostResult {
    let path = tri!(read(c, pp, pl));
    let segments: Vec<&[u8]> = path.split(|b| *b == 0).collect();
    let value = tri!(crate::properties::get(c.data(), &segments));
    return_bytes(c, &value, ptr_out, len_out)
}

fn set_property(c: &mut Ctx<'_>, pp: i32, pl: i32, vp: i32, vl: i32) -> HostResult {
    let path = tri!(read(c, pp, pl));
    let value = tri!(read(c, vp, vl));
    let state = c.data_mut();
    let Some(id) = target_stream(state) else {
        return Ok(Status::NotFound);
    };
    if let Some(stream) = state.streams.get_mut(&id) {
        stream.filter_state.insert(path, value);
    }
    Ok(Status::Ok)
}

fn log(c: &mut Ctx<'_>, level: i32, ptr: i32, len: i32) -> HostResult {
    let level = tri!(LogLevel::from_raw(level).ok_or(Status::BadArgument));
    let message = tri!(read_str(c, ptr, len));
    c.data().plugin_log(level, message);
    Ok(Status::Ok)
}

fn get_log_level(c: &mut Ctx<'_>, out: i32) -> HostResult {
    let level = c.data().plugin.log_level as u32;
    tri!(write(c, out, &level.to_le_bytes()));
    Ok(Status::Ok)
}

fn get_current_time_nanoseconds(c: &mut Ctx<'_>, out: i32) -> HostResult {
    let now = c.data().shared.clock.realtime_ns();
    tri!(write(c, out, &now.to_le_bytes()));
    Ok(Status::Ok)
}

fn set_tick_period_milliseconds(c: &mut Ctx<'_>, ms: i32) -> HostResult {
    c.data_mut()
        .set_tick_period(Duration::from_millis(u64::from(ms as u32)));
    Ok(Status::Ok)
}

fn increment_metric(c: &mut Ctx<'_>, id: i32, delta: i64) -> HostResult {
    let name = tri!(metric_name(c, id));
    Ok(c.data().shared.increment_metric(&name, delta))
}

fn record_metric(c: &mut Ctx<'_>, id: i32, value: i64) -> HostResult {
    let name = tri!(metric_name(c, id));
    Ok(c.data().shared.record_metric(&name, value as u64))
}

fn get_metric(c: &mut Ctx<'_>, id: i32, out: i32) -> HostResult {
    let value = tri!(metric_name(c, id).and_then(|name| c.data().shared.metric_value(&name)));
    tri!(write(c, out, &(value as u64).to_le_bytes()));
    Ok(Status::Ok)
}

// ---- gRPC ----

/// Starts a call or stream on behalf of the root (proxy-wasm-cpp-host runs every gRPC hostcall
/// on `root_context()`), once the upstream is named as Envoy names it.
#[allow(
    clippy::too_many_arguments,
    reason = "the hostcalls' arguments, passed on"
)]
fn grpc_start(
    c: &mut Ctx<'_>,
    kind: GrpcKind,
    upstream: &[u8],
    path: (&str, &str),
    metadata: &HeaderMap,
    message: Option<Vec<u8>>,
    timeout: Option<Duration>,
    token_out: i32,
) -> HostResult {
    tri!(check_writable(c, token_out, 4));
    let state = c.data_mut();
    let target = tri!(crate::grpc::resolve(upstream, &state.clusters));
    if state.root.is_none() {
        return Ok(Status::InternalFailure);
    }
    let token = state.start_grpc(kind, target, path, metadata, message, timeout);
    tri!(write(c, token_out, &token.to_le_bytes()));
    Ok(Status::Ok)
}

#[allow(clippy::too_many_arguments, reason = "the ABI's signature")]
fn grpc_call(
    c: &mut Ctx<'_>,
    up: i32,
    ul: i32,
    sp: i32,
    sl: i32,
    mp: i32,
    ml: i32,
    hp: i32,
    hl: i32,
    bp: i32,
    bl: i32,
    timeout_ms: i32,
    token_out: i32,
) -> HostResult {
    let upstream = tri!(read(c, up, ul));
    let service = tri!(read_str(c, sp, sl));
    let method = tri!(read_str(c, mp, ml));
    let metadata = HeaderMap::from_raw(decode_pairs(&tri!(read(c, hp, hl))));
    let message = tri!(read(c, bp, bl));
    let timeout = Duration::from_millis(u64::from(timeout_ms as u32));
    grpc_start(
        c,
        GrpcKind::Call,
        &upstream,
        (&service, &method),
        &metadata,
        Some(message),
        Some(timeout),
        token_out,
    )
}

#[allow(clippy::too_many_arguments, reason = "the ABI's signature")]
fn grpc_stream(
    c: &mut Ctx<'_>,
    up: i32,
    ul: i32,
    sp: i32,
    sl: i32,
    mp: i32,
    ml: i32,
    hp: i32,
    hl: i32,
    token_out: i32,
) -> HostResult {
    let upstream = tri!(read(c, up, ul));
    let service = tri!(read_str(c, sp, sl));
    let method = tri!(read_str(c, mp, ml));
    let metadata = HeaderMap::from_raw(decode_pairs(&tri!(read(c, hp, hl))));
    grpc_start(
        c,
        GrpcKind::Stream,
        &upstream,
        (&service, &method),
        &metadata,
        None,
        None,
        token_out,
    )
}

fn grpc_send(c: &mut Ctx<'_>, token: i32, ptr: i32, len: i32, end_stream: i32) -> HostResult {
    let message = tri!(read(c, ptr, len));
    Ok(c.data_mut()
        .grpc_send(token as u32, message, end_stream != 0))
}

fn grpc_cancel(c: &mut Ctx<'_>, token: i32) -> HostResult {
    Ok(c.data_mut().grpc_end(token as u32, true))
}

fn grpc_close(c: &mut Ctx<'_>, token: i32) -> HostResult {
    Ok(c.data_mut().grpc_end(token as u32, false))
}

/// No foreign functions are registered.
fn call_foreign_function(
    _c: &mut Ctx<'_>,
    _np: i32,
    _nl: i32,
    _ap: i32,
    _al: i32,
    _rp: i32,
    _rl: i32,
) -> HostResult {
    Ok(Status::NotFound)
}

/// Hostcalls the module may make while `_initialize`/`main` runs (HOST's restricted callbacks
/// allow `proxy_log`; `proxy_get_log_level` is logging's companion).
const ALLOWED_DURING_START: [&str; 2] = ["proxy_log", "proxy_get_log_level"];

/// A hostcall implementation, `fn(&mut Ctx, args..) -> HostResult`, that can be linked as an
/// `env` import returning the status as `i32`.
trait Hostcall<Params> {
    fn link(self, linker: &mut Linker<VmState>, name: &'static str) -> wasmtime::Result<()>;
}

macro_rules! impl_hostcall {
    ($($arg:ident : $ty:ident),*) => {
        impl<F, $($ty: wasmtime::WasmTy),*> Hostcall<($($ty,)*)> for F
        where
            F: Fn(&mut Ctx<'_>, $($ty),*) -> HostResult + Send + Sync + 'static,
        {
            fn link(self, linker: &mut Linker<VmState>, name: &'static str) -> wasmtime::Result<()> {
                let restricted = !ALLOWED_DURING_START.contains(&name);
                linker.func_wrap(
                    "env",
                    name,
                    move |mut caller: Ctx<'_>, $($arg: $ty),*| -> wasmtime::Result<i32> {
                        if restricted {
                            unrestricted(&caller, name)?;
                        }
                        self(&mut caller, $($arg),*).map(|status| status as i32)
                    },
                )?;
                Ok(())
            }
        }
    };
}

impl_hostcall!();
impl_hostcall!(a: A);
impl_hostcall!(a: A, b: B);
impl_hostcall!(a: A, b: B, d: D);
impl_hostcall!(a: A, b: B, d: D, e: E);
impl_hostcall!(a: A, b: B, d: D, e: E, f: G);
impl_hostcall!(a: A, b: B, d: D, e: E, f: G, g: H);
impl_hostcall!(a: A, b: B, d: D, e: E, f: G, g: H, h: I);
impl_hostcall!(a: A, b: B, d: D, e: E, f: G, g: H, h: I, i: J);
impl_hostcall!(a: A, b: B, d: D, e: E, f: G, g: H, h: I, i: J, j: K);
impl_hostcall!(a: A, b: B, d: D, e: E, f: G, g: H, h: I, i: J, j: K, k: M);
impl_hostcall!(a: A, b: B, d: D, e: E, f: G, g: H, h: I, i: J, j: K, k: M, m: N);
impl_hostcall!(a: A, b: B, d: D, e: E, f: G, g: H, h: I, i: J, j: K, k: M, m: N, n: O);

fn link<P>(
    linker: &mut Linker<VmState>,
    name: &'static str,
    hostcall: impl Hostcall<P>,
) -> wasmtime::Result<()> {
    hostcall.link(linker, name)
}

/// Links every `env.proxy_*` function the Rust SDK 0.2.x imports (and `proxy_get_header_map_size`).
pub(crate) fn add_to_linker(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    link(l, "proxy_log", log)?;
    link(l, "proxy_get_log_level", get_log_level)?;
    link(
        l,
        "proxy_get_current_time_nanoseconds",
        get_current_time_nanoseconds,
    )?;
    link(
        l,
        "proxy_set_tick_period_milliseconds",
        set_tick_period_milliseconds,
    )?;
    link(l, "proxy_get_buffer_bytes", get_buffer_bytes)?;
    link(l, "proxy_set_buffer_bytes", set_buffer_bytes)?;
    link(l, "proxy_get_header_map_pairs", get_header_map_pairs)?;
    link(l, "proxy_set_header_map_pairs", set_header_map_pairs)?;
    link(l, "proxy_get_header_map_value", get_header_map_value)?;
    link(
        l,
        "proxy_replace_header_map_value",
        replace_header_map_value,
    )?;
    link(l, "proxy_add_header_map_value", add_header_map_value)?;
    link(l, "proxy_remove_header_map_value", remove_header_map_value)?;
    link(l, "proxy_get_header_map_size", get_header_map_size)?;
    link(l, "proxy_get_property", get_property)?;
    link(l, "proxy_set_property", set_property)?;
    link(l, "proxy_get_shared_data", get_shared_data)?;
    link(l, "proxy_set_shared_data", set_shared_data)?;
    link(l, "proxy_register_shared_queue", register_shared_queue)?;
    link(l, "proxy_resolve_shared_queue", resolve_shared_queue)?;
    link(l, "proxy_dequeue_shared_queue", dequeue_shared_queue)?;
    link(l, "proxy_enqueue_shared_queue", enqueue_shared_queue)?;
    link(l, "proxy_continue_stream", continue_stream)?;
    link(l, "proxy_close_stream", close_stream)?;
    link(l, "proxy_send_local_response", send_local_response)?;
    link(l, "proxy_http_call", http_call)?;
    link(l, "proxy_grpc_call", grpc_call)?;
    link(l, "proxy_grpc_stream", grpc_stream)?;
    link(l, "proxy_grpc_send", grpc_send)?;
    link(l, "proxy_grpc_cancel", grpc_cancel)?;
    link(l, "proxy_grpc_close", grpc_close)?;
    link(l, "proxy_get_status", get_status)?;
    link(l, "proxy_set_effective_context", set_effective_context)?;
    link(l, "proxy_call_foreign_function", call_foreign_function)?;
    link(l, "proxy_done", done)?;
    link(l, "proxy_define_metric", define_metric)?;
    link(l, "proxy_increment_metric", increment_metric)?;
    link(l, "proxy_record_metric", record_metric)?;
    link(l, "proxy_get_metric", get_metric)?;
    Ok(())
}
