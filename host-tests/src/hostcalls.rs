//! The `env.proxy_*` imports with Envoy's statuses and availability windows. Hostcalls only
//! record: anything that would run module code (continue, close, local reply, `proxy_done`)
//! is queued as a [`Deferred`] action for after the current export returns.

use crate::abi::{
    BufferType, Direction, LogLevel, MapType, MetricKind, Status, decode_pairs, encode_pairs,
};
use crate::headers::HeaderMap;
use crate::vm::{CalloutOutcome, CalloutRequest, Deferred, LocalReply, Phase, Target, VmState};
use std::time::Duration;
use wasmtime::{Caller, Linker};

pub(crate) type Ctx<'a> = Caller<'a, VmState>;
type HostResult = wasmtime::Result<Status>;

/// Unwraps a `Result<T, Status>`, returning the status to the module on error.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(status) => return Ok(status),
        }
    };
}

// ---- guest memory ----

fn span(ptr: i32, len: i32) -> (usize, usize) {
    (ptr as u32 as usize, len as u32 as usize)
}

pub(crate) fn read(c: &Ctx<'_>, ptr: i32, len: i32) -> Result<Vec<u8>, Status> {
    let memory = c
        .data()
        .wasm
        .as_ref()
        .ok_or(Status::InvalidMemoryAccess)?
        .memory;
    let (p, l) = span(ptr, len);
    memory
        .data(c)
        .get(p..p.checked_add(l).ok_or(Status::InvalidMemoryAccess)?)
        .map(<[u8]>::to_vec)
        .ok_or(Status::InvalidMemoryAccess)
}

pub(crate) fn write(c: &mut Ctx<'_>, ptr: i32, bytes: &[u8]) -> Result<(), Status> {
    let memory = c
        .data()
        .wasm
        .as_ref()
        .ok_or(Status::InvalidMemoryAccess)?
        .memory;
    let p = ptr as u32 as usize;
    memory
        .data_mut(c)
        .get_mut(
            p..p.checked_add(bytes.len())
                .ok_or(Status::InvalidMemoryAccess)?,
        )
        .ok_or(Status::InvalidMemoryAccess)?
        .copy_from_slice(bytes);
    Ok(())
}

fn check_writable(c: &Ctx<'_>, ptr: i32, len: usize) -> Result<(), Status> {
    let memory = c
        .data()
        .wasm
        .as_ref()
        .ok_or(Status::InvalidMemoryAccess)?
        .memory;
    let end = (ptr as u32 as usize)
        .checked_add(len)
        .ok_or(Status::InvalidMemoryAccess)?;
    if end > memory.data_size(c) {
        return Err(Status::InvalidMemoryAccess);
    }
    Ok(())
}

/// HOST `copyToPointerSize`: empty → ptr 0/len 0 without allocating; otherwise the module's
/// allocator is called with exactly the length (a trap there propagates as a trap).
pub(crate) fn return_bytes(c: &mut Ctx<'_>, data: &[u8], ptr_out: i32, len_out: i32) -> HostResult {
    tri!(check_writable(c, ptr_out, 4));
    tri!(check_writable(c, len_out, 4));
    let ptr = if data.is_empty() {
        0
    } else {
        let Some(alloc) = c.data().wasm.as_ref().map(|w| w.alloc.clone()) else {
            return Ok(Status::InvalidMemoryAccess);
        };
        let ptr = alloc.call(&mut *c, data.len() as i32)?;
        tri!(write(c, ptr, data));
        ptr
    };
    tri!(write(c, ptr_out, &ptr.to_le_bytes()));
    tri!(write(c, len_out, &(data.len() as u32).to_le_bytes()));
    Ok(Status::Ok)
}

fn read_str(c: &Ctx<'_>, ptr: i32, len: i32) -> Result<String, Status> {
    Ok(String::from_utf8_lossy(&read(c, ptr, len)?).into_owned())
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
        MapType::GrpcInitialMetadata | MapType::GrpcTrailingMetadata => {
            return MapAccess::Unavailable { log_phase: false };
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
    let (p, l) = span(kp, kl);
    let Some(key) = p.checked_add(l).and_then(|end| guest.get(p..end)) else {
        return Ok(Status::InvalidMemoryAccess);
    };
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
    let key = tri!(read(c, kp, kl));
    let value = match value {
        Some((vp, vl)) => tri!(read(c, vp, vl)),
        None => Vec::new(),
    };
    match map_access(c.data_mut(), ty) {
        MapAccess::Writable(m) => {
            op(m, &key, &value);
            Ok(Status::Ok)
        }
        _ => Ok(Status::BadArgument),
    }
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

#[allow(clippy::too_many_arguments)]
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

#[allow(clippy::too_many_arguments)]
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
    c.data().log(level, message);
    Ok(Status::Ok)
}

fn write_status(r: Result<(), Status>) -> i32 {
    r.err().unwrap_or(Status::Ok) as i32
}

fn status(r: HostResult) -> wasmtime::Result<i32> {
    r.map(|s| s as i32)
}

/// Links one `env` hostcall: `link!(linker, "name", |c, a: i32, ..| body)`, where `c` is
/// `&mut Ctx` and `body` yields `wasmtime::Result<i32>`; calls during VM start trap first.
macro_rules! link {
    ($l:expr, $name:literal, |$c:ident $(, $arg:tt : $ty:ty)*| $body:expr) => {
        $l.func_wrap("env", $name, |mut caller: Ctx<'_> $(, $arg: $ty)*| -> wasmtime::Result<i32> {
            unrestricted(&caller, $name)?;
            let $c: &mut Ctx<'_> = &mut caller;
            let _ = &$c;
            $body
        })?
    };
}

/// Links every `env.proxy_*` function the Rust SDK 0.2.x imports (and `proxy_get_header_map_size`).
pub(crate) fn add_to_linker(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    // proxy_log is allowed during VM start (the only one, with WASI).
    l.func_wrap(
        "env",
        "proxy_log",
        |mut c: Ctx<'_>, level: i32, p: i32, n: i32| status(log(&mut c, level, p, n)),
    )?;
    l.func_wrap("env", "proxy_get_log_level", |mut c: Ctx<'_>, out: i32| {
        let level = c.data().plugin.log_level as u32;
        Ok(write_status(write(&mut c, out, &level.to_le_bytes())))
    })?;
    link!(l, "proxy_get_current_time_nanoseconds", |c, out: i32| {
        let now = c.data().shared.clock.realtime_ns();
        Ok(write_status(write(c, out, &now.to_le_bytes())))
    });
    link!(l, "proxy_set_tick_period_milliseconds", |c, ms: i32| {
        c.data_mut()
            .set_tick_period(Duration::from_millis(u64::from(ms as u32)));
        Ok(Status::Ok as i32)
    });
    link!(
        l,
        "proxy_get_buffer_bytes",
        |c, t: i32, s: i32, m: i32, po: i32, lo: i32| {
            status(get_buffer_bytes(c, t, s, m, po, lo))
        }
    );
    link!(
        l,
        "proxy_set_buffer_bytes",
        |c, t: i32, s: i32, n: i32, p: i32, len: i32| {
            status(set_buffer_bytes(c, t, s, n, p, len))
        }
    );
    link!(
        l,
        "proxy_get_header_map_pairs",
        |c, t: i32, po: i32, lo: i32| status(get_header_map_pairs(c, t, po, lo))
    );
    link!(
        l,
        "proxy_set_header_map_pairs",
        |c, t: i32, p: i32, n: i32| status(set_header_map_pairs(c, t, p, n))
    );
    link!(
        l,
        "proxy_get_header_map_value",
        |c, t: i32, kp: i32, kl: i32, po: i32, lo: i32| {
            status(get_header_map_value(c, t, kp, kl, po, lo))
        }
    );
    link!(
        l,
        "proxy_replace_header_map_value",
        |c, t: i32, kp: i32, kl: i32, vp: i32, vl: i32| {
            status(mutate_header(c, t, kp, kl, Some((vp, vl)), |m, k, v| {
                m.replace(k, v)
            }))
        }
    );
    link!(
        l,
        "proxy_add_header_map_value",
        |c, t: i32, kp: i32, kl: i32, vp: i32, vl: i32| {
            status(mutate_header(c, t, kp, kl, Some((vp, vl)), |m, k, v| {
                m.add(k, v)
            }))
        }
    );
    link!(
        l,
        "proxy_remove_header_map_value",
        |c, t: i32, kp: i32, kl: i32| {
            status(mutate_header(c, t, kp, kl, None, |m, k, _| m.remove(k)))
        }
    );
    link!(l, "proxy_get_header_map_size", |c, t: i32, out: i32| {
        status(get_header_map_size(c, t, out))
    });
    link!(
        l,
        "proxy_get_property",
        |c, p: i32, n: i32, po: i32, lo: i32| status(get_property(c, p, n, po, lo))
    );
    link!(
        l,
        "proxy_set_property",
        |c, p: i32, n: i32, vp: i32, vl: i32| status(set_property(c, p, n, vp, vl))
    );
    link!(
        l,
        "proxy_get_shared_data",
        |c, kp: i32, kl: i32, po: i32, lo: i32, co: i32| {
            status(get_shared_data(c, kp, kl, po, lo, co))
        }
    );
    link!(
        l,
        "proxy_set_shared_data",
        |c, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| {
            status(set_shared_data(c, kp, kl, vp, vl, cas))
        }
    );
    link!(
        l,
        "proxy_register_shared_queue",
        |c, p: i32, n: i32, out: i32| status(register_shared_queue(c, p, n, out))
    );
    link!(
        l,
        "proxy_resolve_shared_queue",
        |c, vp: i32, vl: i32, np: i32, nl: i32, out: i32| {
            status(resolve_shared_queue(c, vp, vl, np, nl, out))
        }
    );
    link!(
        l,
        "proxy_dequeue_shared_queue",
        |c, t: i32, po: i32, lo: i32| status(dequeue_shared_queue(c, t, po, lo))
    );
    link!(
        l,
        "proxy_enqueue_shared_queue",
        |c, t: i32, p: i32, n: i32| status(enqueue_shared_queue(c, t, p, n))
    );
    link!(l, "proxy_continue_stream", |c, t: i32| status(
        continue_stream(c, t)
    ));
    link!(l, "proxy_close_stream", |c, t: i32| status(close_stream(
        c, t
    )));
    link!(
        l,
        "proxy_send_local_response",
        |c, code: i32, dp: i32, dl: i32, bp: i32, bl: i32, hp: i32, hl: i32, grpc: i32| {
            status(send_local_response(c, code, dp, dl, bp, bl, hp, hl, grpc))
        }
    );
    link!(
        l,
        "proxy_http_call",
        |c,
         up: i32,
         ul: i32,
         hp: i32,
         hl: i32,
         bp: i32,
         bl: i32,
         tp: i32,
         tl: i32,
         timeout: i32,
         out: i32| status(http_call(c, up, ul, hp, hl, bp, bl, tp, tl, timeout, out))
    );
    // gRPC: no gRPC clusters are modelled, so every call fails as Envoy does for an unknown
    // cluster (ParseFailure, which the Rust SDK maps to Err); stream operations see no token.
    link!(
        l,
        "proxy_grpc_call",
        |c,
         _a: i32,
         _b: i32,
         _d: i32,
         _e: i32,
         _f: i32,
         _g: i32,
         _h: i32,
         _i: i32,
         _j: i32,
         _k: i32,
         _m: i32,
         _n: i32| Ok(Status::ParseFailure as i32)
    );
    link!(
        l,
        "proxy_grpc_stream",
        |c, _a: i32, _b: i32, _d: i32, _e: i32, _f: i32, _g: i32, _h: i32, _i: i32, _j: i32| {
            Ok(Status::ParseFailure as i32)
        }
    );
    link!(
        l,
        "proxy_grpc_send",
        |c, _t: i32, _p: i32, _n: i32, _e: i32| Ok(Status::NotFound as i32)
    );
    link!(l, "proxy_grpc_cancel", |c, _t: i32| Ok(
        Status::NotFound as i32
    ));
    link!(l, "proxy_grpc_close", |c, _t: i32| Ok(
        Status::NotFound as i32
    ));
    link!(l, "proxy_get_status", |c, co: i32, po: i32, lo: i32| {
        status(get_status(c, co, po, lo))
    });
    link!(l, "proxy_set_effective_context", |c, id: i32| {
        status(set_effective_context(c, id))
    });
    link!(
        l,
        "proxy_call_foreign_function",
        |c, _a: i32, _b: i32, _d: i32, _e: i32, _f: i32, _g: i32| Ok(Status::NotFound as i32)
    );
    link!(l, "proxy_done", |c| status(done(c)));
    link!(
        l,
        "proxy_define_metric",
        |c, t: i32, p: i32, n: i32, out: i32| status(define_metric(c, t, p, n, out))
    );
    link!(l, "proxy_increment_metric", |c, id: i32, delta: i64| {
        Ok(match metric_name(c, id) {
            Ok(name) => c.data().shared.increment_metric(&name, delta),
            Err(s) => s,
        } as i32)
    });
    link!(l, "proxy_record_metric", |c, id: i32, value: i64| {
        Ok(match metric_name(c, id) {
            Ok(name) => c.data().shared.record_metric(&name, value as u64),
            Err(s) => s,
        } as i32)
    });
    link!(l, "proxy_get_metric", |c, id: i32, out: i32| {
        match metric_name(c, id).and_then(|name| c.data().shared.metric_value(&name)) {
            Ok(value) => Ok(write_status(write(c, out, &(value as u64).to_le_bytes()))),
            Err(s) => Ok(s as i32),
        }
    });
    Ok(())
}
