//! One proxy-wasm VM (one worker's instance) and Envoy's HTTP filter semantics around it:
//! the root lifecycle, lazy stream contexts, return-code mapping, map and buffer availability
//! windows, body buffering, local replies through the encoder path, deferred actions (never
//! re-entering the module), callouts owned by the root, timers, and failure policies.
//!
//! The VM is sans-IO: drivers (the deterministic test API, the live gateway) feed it stream
//! events and callout outcomes, and read back [`StreamEvent`]s and new callout requests.

use crate::abi::{Direction, LogLevel};
use crate::headers::HeaderMap;
use crate::plugin::{Clusters, FailurePolicy, LoadError, PluginSettings, WasmModule};
use crate::shared::{LogRecord, Mailbox, SharedState};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use wasmtime::{Memory, Store, TypedFunc, WasmParams, WasmResults};

/// Host-side identity of a stream on one VM (distinct from its context id, which the module
/// sees and which restarts after a reload).
pub type StreamId = u64;

/// What the filter chain emitted for a stream, in order. `Upstream*` go to the router (the
/// upstream request), `Downstream*` to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    UpstreamHeaders {
        headers: HeaderMap,
        end_stream: bool,
    },
    UpstreamData {
        data: Vec<u8>,
        end_stream: bool,
    },
    UpstreamTrailers(HeaderMap),
    /// The upstream request must be abandoned (local reply, reset or client abort).
    UpstreamReset,
    DownstreamHeaders {
        headers: HeaderMap,
        end_stream: bool,
    },
    DownstreamData {
        data: Vec<u8>,
        end_stream: bool,
    },
    DownstreamTrailers(HeaderMap),
    /// The downstream stream is reset (no complete response).
    DownstreamReset {
        details: String,
    },
    /// A local reply started (plugin's `send_local_response`, buffer overflow, fail-closed).
    LocalReply(LocalReply),
}

/// A local reply as requested (before the encoder callbacks run on it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub body: Vec<u8>,
    /// Headers the plugin asked to add.
    pub headers: HeaderMap,
    /// Response code details (Envoy replaces whitespace by `_`).
    pub details: String,
    /// `grpc_status` argument (-1 = none).
    pub grpc_status: i32,
}

/// Connection-level facts about a stream (the `source.*`, `destination.*` properties).
#[derive(Debug, Clone)]
pub struct StreamInfo {
    pub source: SocketAddr,
    pub destination: SocketAddr,
    pub connection_id: u64,
    /// `request.protocol`, e.g. "HTTP/1.1".
    pub protocol: String,
    /// The route the connection manager matched (`xds.*` properties).
    pub route: Option<std::sync::Arc<crate::properties::RouteProperties>>,
}

impl Default for StreamInfo {
    fn default() -> Self {
        Self {
            source: SocketAddr::from(([127, 0, 0, 1], 50000)),
            destination: SocketAddr::from(([127, 0, 0, 1], 10000)),
            connection_id: 1,
            protocol: "HTTP/1.1".into(),
            route: None,
        }
    }
}

/// An HTTP callout the plugin dispatched, waiting for an outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalloutRequest {
    /// Token 4, 8, 12, ... (per VM).
    pub token: u32,
    pub cluster: String,
    /// Includes `:method`, `:path`, `:authority`.
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub trailers: HeaderMap,
    /// `None` = no timeout (`timeout_ms == 0`).
    pub timeout: Option<Duration>,
}

/// How a callout ended, as Envoy reports it to the plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutOutcome {
    /// A complete response (also Envoy-generated ones: 504 timeout, 503 connect failure).
    Response {
        /// Includes `:status`.
        headers: HeaderMap,
        body: Vec<u8>,
        trailers: HeaderMap,
    },
    /// Reset after a partial response: `(0, 0, 0)` and `get_status` = (11, "reset").
    Reset,
}

impl CalloutOutcome {
    /// A plain response with `:status` and a body.
    pub fn response(status: u16, headers: HeaderMap, body: impl Into<Vec<u8>>) -> Self {
        let mut all = HeaderMap::from([(":status", status.to_string())]);
        for (k, v) in headers.entries() {
            all.add(k, v);
        }
        Self::Response {
            headers: all,
            body: body.into(),
            trailers: HeaderMap::new(),
        }
    }

    /// Envoy's router answer when the callout's timeout expires.
    pub fn timeout() -> Self {
        Self::generated(504, "upstream request timeout")
    }

    /// Envoy's router answer when no connection could be made to the cluster.
    pub fn connect_failure() -> Self {
        Self::generated(
            503,
            "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
        )
    }

    /// Envoy's router answer when the connection closes before response headers.
    pub fn generated_reset_before_headers() -> Self {
        Self::generated(
            503,
            "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
        )
    }

    fn generated(status: u16, body: &str) -> Self {
        Self::response(
            status,
            HeaderMap::from([
                ("content-length", body.len().to_string()),
                ("content-type", "text/plain".to_owned()),
            ]),
            body,
        )
    }
}

/// One callback invocation on a stream, for assertions (`returned` is the raw value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallbackRecord {
    pub callback: &'static str,
    pub returned: Option<i32>,
}

/// `(root_context_id, token, num_headers, body_size, num_trailers)`.
type CalloutResponseArgs = (i32, i32, i32, i32, i32);

#[derive(Clone)]
pub(crate) struct Exports {
    initialize: Option<TypedFunc<(), ()>>,
    main_void: Option<TypedFunc<(), i32>>,
    main: Option<TypedFunc<(i32, i32), i32>>,
    start: Option<TypedFunc<(), ()>>,
    context_create: Option<TypedFunc<(i32, i32), ()>>,
    vm_start: Option<TypedFunc<(i32, i32), i32>>,
    configure: Option<TypedFunc<(i32, i32), i32>>,
    tick: Option<TypedFunc<i32, ()>>,
    queue_ready: Option<TypedFunc<(i32, i32), ()>>,
    request_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    request_body: Option<TypedFunc<(i32, i32, i32), i32>>,
    request_trailers: Option<TypedFunc<(i32, i32), i32>>,
    response_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    response_body: Option<TypedFunc<(i32, i32, i32), i32>>,
    response_trailers: Option<TypedFunc<(i32, i32), i32>>,
    http_call_response: Option<TypedFunc<CalloutResponseArgs, ()>>,
    log: Option<TypedFunc<i32, ()>>,
    done: Option<TypedFunc<i32, i32>>,
    delete: Option<TypedFunc<i32, ()>>,
}

/// The instantiated module: its memory and allocator (used by hostcalls) and its exports.
pub(crate) struct Wasm {
    pub(crate) memory: Memory,
    pub(crate) alloc: TypedFunc<i32, i32>,
    exports: Exports,
}

pub(crate) struct Root {
    pub(crate) id: u32,
    tick_period: Option<Duration>,
    next_tick_ns: Option<u64>,
    /// `proxy_get_status` (sticky, as Envoy's `status_code_`).
    pub(crate) status: (u32, Vec<u8>),
    /// `on_done` returned false: waiting for `proxy_done`.
    pub(crate) pending_done: bool,
}

/// Where a direction's filter iteration stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    None,
    /// Headers Pause without `allow_on_headers_stop_iteration`: headers and body held.
    All,
    /// Headers Pause with `allow_on_headers_stop_iteration`: body callbacks still fire.
    Headers,
    Body,
    Trailers,
}

/// One direction of a stream as seen by this filter.
pub(crate) struct Half {
    pub(crate) headers: Option<HeaderMap>,
    /// Received and not yet forwarded: the plugin may read and write them.
    pub(crate) headers_held: bool,
    headers_forwarded: bool,
    /// Received and not yet forwarded.
    pub(crate) body: Vec<u8>,
    /// Data arrived while stopped at headers (owed a body callback on resume).
    data_pending: bool,
    end_seen: bool,
    pub(crate) trailers: Option<HeaderMap>,
    pub(crate) trailers_held: bool,
    stop: Stop,
    complete: bool,
    /// `continue_stream` was called: Envoy dropped its map pointers at once.
    pub(crate) dropped: bool,
}

impl Half {
    /// Body data held by a body-phase stop (StopIterationAndBuffer and friends).
    pub(crate) fn body_held(&self) -> bool {
        self.stop == Stop::Body
    }

    fn new() -> Self {
        Self {
            headers: None,
            headers_held: false,
            headers_forwarded: false,
            body: Vec::new(),
            data_pending: false,
            end_seen: false,
            trailers: None,
            trailers_held: false,
            stop: Stop::None,
            complete: false,
            dropped: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Headers,
    Body,
    Trailers,
}

pub(crate) struct Stream {
    pub(crate) context_id: u32,
    generation: u32,
    created: bool,
    /// FAIL_OPEN on a failed VM: the filter is not in the chain.
    bypass: bool,
    finished: bool,
    pub(crate) logging: bool,
    pub(crate) request: Half,
    pub(crate) response: Half,
    pub(crate) info: StreamInfo,
    events: Vec<StreamEvent>,
    pub(crate) in_callback: Option<(Direction, Phase)>,
    /// `send_local_response` was called during the running callback.
    pub(crate) local_reply_in_call: bool,
    /// The response path now carries a local reply; the upstream response is dropped.
    local_reply_sent: bool,
    fail_reply_sent: bool,
    /// `set_property` values (Envoy filter state `wasm.<name>`).
    pub(crate) filter_state: BTreeMap<Vec<u8>, Vec<u8>>,
    callbacks: Vec<CallbackRecord>,
    pub(crate) response_code: Option<u32>,
    /// Realtime ns when the stream started (`request.time`).
    pub(crate) started_ns: u64,
    /// Monotonic ns at start and, once complete, at the end (`request.duration`).
    pub(crate) started_mono_ns: u64,
    pub(crate) finished_mono_ns: Option<u64>,
}

impl Stream {
    pub(crate) fn half(&self, dir: Direction) -> &Half {
        match dir {
            Direction::Request => &self.request,
            Direction::Response => &self.response,
        }
    }

    pub(crate) fn half_mut(&mut self, dir: Direction) -> &mut Half {
        match dir {
            Direction::Request => &mut self.request,
            Direction::Response => &mut self.response,
        }
    }
}

struct Callout {
    request: CalloutRequest,
    root: u32,
    generation: u32,
    deadline_ns: Option<u64>,
    handed_out: bool,
}

/// Actions Envoy runs "after the VM call" instead of re-entering the module.
pub(crate) enum Deferred {
    Continue(StreamId, Direction),
    Close(StreamId),
    LocalReply(StreamId, LocalReply),
    DeleteRoot,
}

/// The context a hostcall acts on (the effective context, else the running callback's).
pub(crate) enum Target {
    Root,
    Stream(StreamId),
    None,
}

/// The wasmtime `Store` data: everything one VM's hostcalls can see.
pub(crate) struct VmState {
    pub(crate) plugin: Arc<PluginSettings>,
    pub(crate) clusters: Clusters,
    pub(crate) shared: Arc<SharedState>,
    pub(crate) mailbox: Arc<Mailbox>,
    pub(crate) worker: usize,
    module: WasmModule,
    pub(crate) wasm: Option<Wasm>,
    generation: u32,
    failed: bool,
    last_reload_ns: Option<u64>,
    /// Inside `_initialize`/`main`: only logging and WASI are allowed.
    pub(crate) restricted: bool,
    /// Inside the root's `on_context_create`/`on_configure`: plugin configuration readable.
    pub(crate) configuring: bool,
    next_context_id: u32,
    pub(crate) root: Option<Root>,
    pub(crate) streams: BTreeMap<StreamId, Stream>,
    context_streams: HashMap<u32, StreamId>,
    next_stream: StreamId,
    pub(crate) active: Option<u32>,
    pub(crate) effective: Option<u32>,
    pub(crate) deferred: VecDeque<Deferred>,
    next_callout_serial: u32,
    callouts: BTreeMap<u32, Callout>,
    /// The outcome being delivered (readable only during `on_http_call_response`).
    pub(crate) callout_response: Option<CalloutOutcome>,
    pub(crate) metric_names: HashMap<u32, String>,
    /// Per metric kind, so counters get 4, 8, ..., gauges 5, 9, ..., histograms 6, 10, ...
    next_metric_serial: [u32; 3],
}

impl VmState {
    /// The context hostcalls act on.
    pub(crate) fn target(&self) -> Target {
        let Some(id) = self.effective.or(self.active) else {
            return Target::None;
        };
        if self.root.as_ref().is_some_and(|r| r.id == id) {
            return Target::Root;
        }
        match self.context_streams.get(&id) {
            Some(stream) => Target::Stream(*stream),
            None => Target::None,
        }
    }

    pub(crate) fn is_context(&self, id: u32) -> bool {
        self.root.as_ref().is_some_and(|r| r.id == id) || self.context_streams.contains_key(&id)
    }

    pub(crate) fn log(&self, level: LogLevel, message: String) {
        self.shared.log(LogRecord {
            level,
            worker: self.worker,
            message,
        });
    }

    pub(crate) fn now_ns(&self) -> u64 {
        self.shared.clock.monotonic_ns()
    }

    /// Validates and records a callout on behalf of the root (HOST `root_context()`).
    pub(crate) fn register_callout(&mut self, mut request: CalloutRequest) -> u32 {
        self.next_callout_serial += 1;
        let token = self.next_callout_serial * 4;
        request.token = token;
        let deadline_ns = request
            .timeout
            .map(|t| self.now_ns().saturating_add(t.as_nanos() as u64));
        let root = self.root.as_ref().map_or(0, |r| r.id);
        self.callouts.insert(
            token,
            Callout {
                request,
                root,
                generation: self.generation,
                deadline_ns,
                handed_out: false,
            },
        );
        token
    }

    pub(crate) fn set_tick_period(&mut self, period: Duration) {
        let now = self.now_ns();
        if let Some(root) = self.root.as_mut() {
            root.tick_period = (!period.is_zero()).then_some(period);
            root.next_tick_ns = root
                .tick_period
                .map(|p| now.saturating_add(p.as_nanos() as u64));
        }
    }

    pub(crate) fn next_metric_id(&mut self, kind: crate::abi::MetricKind) -> u32 {
        let serial = match kind {
            crate::abi::MetricKind::Counter => &mut self.next_metric_serial[0],
            crate::abi::MetricKind::Gauge => &mut self.next_metric_serial[1],
            crate::abi::MetricKind::Histogram => &mut self.next_metric_serial[2],
        };
        *serial += 1;
        *serial * 4 + kind as u32
    }
}

/// Verdict of one HTTP callback after Envoy's failure checks.
enum Verdict {
    Value(i32),
    /// A local reply was sent in the call, or the stream failed closed.
    Stop,
    /// Pass the data on without the VM (fail-open, or after the fail-closed reply).
    Pass,
}

enum Called<R> {
    Returned(R),
    Missing,
    Failed,
}

/// One worker's VM.
pub struct Vm {
    store: Store<VmState>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("worker", &self.store.data().worker)
            .finish()
    }
}

fn typed<P: WasmParams, R: WasmResults>(
    instance: &wasmtime::Instance,
    store: &mut Store<VmState>,
    name: &str,
) -> Result<Option<TypedFunc<P, R>>, LoadError> {
    match instance.get_func(&mut *store, name) {
        None => Ok(None),
        Some(f) => f
            .typed::<P, R>(&*store)
            .map(Some)
            .map_err(|e| LoadError::Instantiate(format!("export {name}: {e:#}"))),
    }
}

impl Vm {
    /// Instantiates the module and runs Envoy's start sequence: `_initialize` (+`main`),
    /// `on_context_create(R, 0)`, `on_vm_start(R, ..)`, `on_configure(R, ..)`.
    pub fn boot(
        module: &WasmModule,
        plugin: Arc<PluginSettings>,
        clusters: Clusters,
        shared: Arc<SharedState>,
        worker: usize,
    ) -> Result<Self, LoadError> {
        let state = VmState {
            plugin,
            clusters,
            shared,
            mailbox: Arc::new(Mailbox::default()),
            worker,
            module: module.clone(),
            wasm: None,
            generation: 0,
            failed: false,
            last_reload_ns: None,
            restricted: false,
            configuring: false,
            next_context_id: 0,
            root: None,
            streams: BTreeMap::new(),
            context_streams: HashMap::new(),
            next_stream: 0,
            active: None,
            effective: None,
            deferred: VecDeque::new(),
            next_callout_serial: 0,
            callouts: BTreeMap::new(),
            callout_response: None,
            metric_names: HashMap::new(),
            next_metric_serial: [0; 3],
        };
        let mut vm = Self {
            store: Store::new(module.pre.module().engine(), state),
        };
        vm.start()?;
        Ok(vm)
    }

    fn start(&mut self) -> Result<(), LoadError> {
        let plugin_name = self.store.data().plugin.name.clone();
        let start_error = |message: String| LoadError::Start {
            plugin: plugin_name.clone(),
            message,
        };
        let pre = self.store.data().module.pre.clone();
        let instance = pre
            .instantiate(&mut self.store)
            .map_err(|e| LoadError::Instantiate(format!("{e:#}")))?;
        let store = &mut self.store;
        let memory = instance
            .get_memory(&mut *store, "memory")
            .ok_or_else(|| LoadError::Instantiate("no exported memory".into()))?;
        let alloc = match typed::<i32, i32>(&instance, store, "malloc")? {
            Some(f) => f,
            None => typed::<i32, i32>(&instance, store, "proxy_on_memory_allocate")?
                .ok_or_else(|| LoadError::Instantiate("no allocator export".into()))?,
        };
        let exports = Exports {
            initialize: typed(&instance, store, "_initialize")?,
            main_void: typed(&instance, store, "__main_void")?,
            main: typed(&instance, store, "main")?,
            start: typed(&instance, store, "_start")?,
            context_create: typed(&instance, store, "proxy_on_context_create")?,
            vm_start: typed(&instance, store, "proxy_on_vm_start")?,
            configure: typed(&instance, store, "proxy_on_configure")?,
            tick: typed(&instance, store, "proxy_on_tick")?,
            queue_ready: typed(&instance, store, "proxy_on_queue_ready")?,
            request_headers: typed(&instance, store, "proxy_on_request_headers")?,
            request_body: typed(&instance, store, "proxy_on_request_body")?,
            request_trailers: typed(&instance, store, "proxy_on_request_trailers")?,
            response_headers: typed(&instance, store, "proxy_on_response_headers")?,
            response_body: typed(&instance, store, "proxy_on_response_body")?,
            response_trailers: typed(&instance, store, "proxy_on_response_trailers")?,
            http_call_response: typed(&instance, store, "proxy_on_http_call_response")?,
            log: typed(&instance, store, "proxy_on_log")?,
            done: typed(&instance, store, "proxy_on_done")?,
            delete: typed(&instance, store, "proxy_on_delete")?,
        };
        let state = store.data_mut();
        state.wasm = Some(Wasm {
            memory,
            alloc,
            exports,
        });
        state.failed = false;
        state.root = None;
        state.next_context_id = 0;
        state.next_callout_serial = 0;
        state.next_metric_serial = [0; 3];
        state.metric_names.clear();
        // A new VM (reload) means the old root died: its callouts are cancelled.
        for callout in std::mem::take(&mut state.callouts).into_values() {
            state.shared.end_request(&callout.request.cluster);
        }
        state.context_streams.clear();

        state.restricted = true;
        let init = self.call_start_functions();
        self.store.data_mut().restricted = false;
        init.map_err(|e| start_error(format!("_initialize: {e}")))?;

        let root = self.alloc_context_id();
        self.store.data_mut().root = Some(Root {
            id: root,
            tick_period: None,
            next_tick_ns: None,
            status: (0, Vec::new()),
            pending_done: false,
        });
        let (vm_config_len, config_len) = {
            let p = &self.store.data().plugin;
            (
                p.vm_configuration.len() as i32,
                p.configuration.len() as i32,
            )
        };
        let ctx = root as i32;
        self.store.data_mut().configuring = true;
        let created = self.call(
            root,
            "proxy_on_context_create",
            |e| e.context_create.clone(),
            (ctx, 0),
        );
        self.store.data_mut().configuring = false;
        if matches!(created, Called::Failed) {
            return Err(start_error("proxy_on_context_create trapped".into()));
        }
        match self.call(
            root,
            "proxy_on_vm_start",
            |e| e.vm_start.clone(),
            (ctx, vm_config_len),
        ) {
            Called::Failed => return Err(start_error("proxy_on_vm_start trapped".into())),
            Called::Returned(0) => {
                return Err(start_error("proxy_on_vm_start returned false".into()));
            }
            _ => {}
        }
        self.store.data_mut().configuring = true;
        let configured = self.call(
            root,
            "proxy_on_configure",
            |e| e.configure.clone(),
            (ctx, config_len),
        );
        self.store.data_mut().configuring = false;
        match configured {
            Called::Failed => return Err(start_error("proxy_on_configure trapped".into())),
            Called::Returned(0) => {
                return Err(start_error("proxy_on_configure returned false".into()));
            }
            _ => {}
        }
        self.drain();
        Ok(())
    }

    fn call_start_functions(&mut self) -> Result<(), String> {
        let Some(exports) = self.store.data().wasm.as_ref().map(|w| w.exports.clone()) else {
            return Err("not instantiated".into());
        };
        let result = if let Some(init) = exports.initialize {
            init.call(&mut self.store, ()).and_then(|()| {
                if let Some(main) = exports.main_void {
                    main.call(&mut self.store, ()).map(|_| ())
                } else if let Some(main) = exports.main {
                    main.call(&mut self.store, (0, 0)).map(|_| ())
                } else {
                    Ok(())
                }
            })
        } else if let Some(start) = exports.start {
            start.call(&mut self.store, ())
        } else {
            Ok(())
        };
        result.map_err(|e| format!("{e:#}"))
    }

    fn alloc_context_id(&mut self) -> u32 {
        let state = self.store.data_mut();
        loop {
            state.next_context_id = state.next_context_id.wrapping_add(1);
            let id = state.next_context_id;
            if id != 0 && !state.is_context(id) {
                return id;
            }
        }
    }

    /// Calls one export with `context` as the running context. A trap marks the VM failed.
    fn call<P: WasmParams, R: WasmResults>(
        &mut self,
        context: u32,
        name: &str,
        pick: impl Fn(&Exports) -> Option<TypedFunc<P, R>>,
        params: P,
    ) -> Called<R> {
        let state = self.store.data_mut();
        if state.failed {
            return Called::Failed;
        }
        let Some(func) = state.wasm.as_ref().and_then(|w| pick(&w.exports)) else {
            return Called::Missing;
        };
        let saved = (state.active, state.effective);
        state.active = Some(context);
        state.effective = None;
        let result = func.call(&mut self.store, params);
        let state = self.store.data_mut();
        (state.active, state.effective) = saved;
        match result {
            Ok(r) => Called::Returned(r),
            Err(e) => {
                state.failed = true;
                state.log(
                    LogLevel::Critical,
                    format!("Function: {name} failed: Uncaught RuntimeError: {e:#}"),
                );
                Called::Failed
            }
        }
    }

    /// Fault injection for tests: makes the module trap, as a bug in a plugin would, by
    /// calling `proxy_on_request_headers` for a context it never created (the proxy-wasm
    /// SDKs panic on an unknown context). The VM fails as by any trap ([`Vm::is_failed`]);
    /// a module that survives the call is left as it was.
    pub fn inject_trap(&mut self) {
        let ghost = i32::MAX;
        let _ = self.call(
            ghost as u32,
            "proxy_on_request_headers",
            |e| e.request_headers.clone(),
            (ghost, 0, 0),
        );
    }

    /// Whether a trap has failed this VM (until a FAIL_RELOAD re-creates it).
    pub fn is_failed(&self) -> bool {
        self.store.data().failed
    }

    pub fn worker(&self) -> usize {
        self.store.data().worker
    }

    pub fn shared(&self) -> &Arc<SharedState> {
        &self.store.data().shared
    }

    pub fn plugin(&self) -> &PluginSettings {
        &self.store.data().plugin
    }

    /// Size of the module's linear memory in bytes (0 while no instance runs): what Envoy
    /// reports as the VM's memory, watched by the benchmarks to stay flat under load.
    pub fn memory_bytes(&self) -> usize {
        let store = &self.store;
        store
            .data()
            .wasm
            .as_ref()
            .map_or(0, |wasm| wasm.memory.data_size(store))
    }

    /// The root context id (1 for a freshly booted VM).
    pub fn root_context_id(&self) -> Option<u32> {
        self.store.data().root.as_ref().map(|r| r.id)
    }

    // ---------------------------------------------------------------------------------
    // Streams

    /// Creates the filter for a new stream (Envoy `PluginConfig::createContext`): allocates
    /// its context id; the in-VM context is created lazily at request headers.
    pub fn new_stream(&mut self, info: StreamInfo) -> StreamId {
        let now = self.store.data().now_ns();
        let (failed, policy, backoff) = {
            let s = self.store.data();
            (s.failed, s.plugin.failure_policy, s.plugin.reload_backoff)
        };
        if failed && policy == FailurePolicy::FailReload {
            let due = self
                .store
                .data()
                .last_reload_ns
                .is_none_or(|last| now >= last.saturating_add(backoff.as_nanos() as u64));
            if due {
                self.store.data_mut().last_reload_ns = Some(now);
                self.reload();
            }
        }
        let bypass = self.is_failed() && policy == FailurePolicy::FailOpen;
        let context_id = if self.is_failed() {
            0
        } else {
            self.alloc_context_id()
        };
        let state = self.store.data_mut();
        state.next_stream += 1;
        let id = state.next_stream;
        state.streams.insert(
            id,
            Stream {
                context_id,
                generation: state.generation,
                created: false,
                bypass,
                finished: false,
                logging: false,
                request: Half::new(),
                response: Half::new(),
                info,
                events: Vec::new(),
                in_callback: None,
                local_reply_in_call: false,
                local_reply_sent: false,
                fail_reply_sent: false,
                filter_state: BTreeMap::new(),
                callbacks: Vec::new(),
                response_code: None,
                started_ns: state.shared.clock.realtime_ns(),
                started_mono_ns: now,
                finished_mono_ns: None,
            },
        );
        if context_id != 0 {
            state.context_streams.insert(context_id, id);
        }
        id
    }

    fn reload(&mut self) {
        let generation = self.store.data().generation + 1;
        self.store.data_mut().generation = generation;
        let name = self.store.data().plugin.name.clone();
        match self.start() {
            Ok(()) => self.store.data().log(
                LogLevel::Info,
                format!("wasm vm reloaded for plugin {name}"),
            ),
            Err(e) => {
                let state = self.store.data_mut();
                state.failed = true;
                state.log(LogLevel::Error, format!("wasm vm reload failed: {e}"));
            }
        }
    }

    /// Headers from the client (`Request`, Envoy `decodeHeaders`) or the upstream
    /// (`Response`, `encodeHeaders`).
    pub fn headers(&mut self, id: StreamId, dir: Direction, headers: HeaderMap, end_stream: bool) {
        self.on_headers(id, dir, headers, end_stream, false);
        self.drain();
    }

    /// A data frame (`decodeData` / `encodeData`).
    pub fn data(&mut self, id: StreamId, dir: Direction, data: &[u8], end_stream: bool) {
        self.on_data(id, dir, data, end_stream, false);
        self.drain();
    }

    /// Trailers, which end the direction (`decodeTrailers` / `encodeTrailers`).
    pub fn trailers(&mut self, id: StreamId, dir: Direction, trailers: HeaderMap) {
        self.on_trailers(id, dir, trailers);
        self.drain();
    }

    /// The downstream went away (client abort) or the upstream failed: the stream is destroyed;
    /// `on_log`, `on_done`, `on_delete` still run.
    pub fn reset_stream(&mut self, id: StreamId) {
        self.reset(id, None);
        self.drain();
    }

    /// Takes the events emitted for a stream since the last call.
    pub fn take_events(&mut self, id: StreamId) -> Vec<StreamEvent> {
        self.store
            .data_mut()
            .streams
            .get_mut(&id)
            .map(|s| std::mem::take(&mut s.events))
            .unwrap_or_default()
    }

    /// Whether a stream has events its driver has not taken yet.
    pub fn has_events(&self, id: StreamId) -> bool {
        self.store
            .data()
            .streams
            .get(&id)
            .is_some_and(|s| !s.events.is_empty())
    }

    /// Whether the stream is complete (its log/done/delete ran).
    pub fn is_finished(&self, id: StreamId) -> bool {
        self.store
            .data()
            .streams
            .get(&id)
            .is_none_or(|s| s.finished)
    }

    /// Forgets a finished stream's host-side record.
    pub fn remove_stream(&mut self, id: StreamId) {
        let state = self.store.data_mut();
        if state.streams.get(&id).is_some_and(|s| s.finished) {
            state.streams.remove(&id);
        }
    }

    /// Callbacks invoked on a stream so far, with their raw return values.
    pub fn stream_callbacks(&self, id: StreamId) -> Vec<CallbackRecord> {
        self.store
            .data()
            .streams
            .get(&id)
            .map(|s| s.callbacks.clone())
            .unwrap_or_default()
    }

    /// The stream's context id as the module sees it (0 if the filter is not in the chain).
    pub fn stream_context_id(&self, id: StreamId) -> Option<u32> {
        self.store.data().streams.get(&id).map(|s| s.context_id)
    }

    fn stream_mut(&mut self, id: StreamId) -> Option<&mut Stream> {
        self.store.data_mut().streams.get_mut(&id)
    }

    fn vm_alive_for(&self, id: StreamId) -> bool {
        let state = self.store.data();
        !state.failed
            && state
                .streams
                .get(&id)
                .is_some_and(|s| s.generation == state.generation && s.context_id != 0)
    }

    /// Sends `proxy_on_context_create(S, R)` if not done yet; false if the VM cannot take it.
    fn ensure_created(&mut self, id: StreamId) -> bool {
        let Some(stream) = self.store.data().streams.get(&id) else {
            return false;
        };
        if stream.created {
            return true;
        }
        if !self.vm_alive_for(id) {
            return false;
        }
        let ctx = stream.context_id;
        let root = self.root_context_id().unwrap_or(0);
        if let Some(s) = self.stream_mut(id) {
            s.created = true;
        }
        !matches!(
            self.call(
                ctx,
                "proxy_on_context_create",
                |e| e.context_create.clone(),
                (ctx as i32, root as i32)
            ),
            Called::Failed
        )
    }

    /// Runs one HTTP callback with Envoy's CHECK_FAIL_HTTP around it.
    fn http_callback(
        &mut self,
        id: StreamId,
        dir: Direction,
        phase: Phase,
        a: i32,
        b: i32,
    ) -> Verdict {
        let Some(stream) = self.store.data().streams.get(&id) else {
            return Verdict::Pass;
        };
        if stream.fail_reply_sent {
            return match dir {
                Direction::Response => Verdict::Pass,
                Direction::Request => Verdict::Stop,
            };
        }
        if !self.ensure_created(id) {
            return self.fail_stream(id);
        }
        let ctx = self.stream_context_id(id).unwrap_or(0) as i32;
        if let Some(s) = self.stream_mut(id) {
            s.in_callback = Some((dir, phase));
            s.local_reply_in_call = false;
        }
        let request = dir == Direction::Request;
        let name = match (dir, phase) {
            (Direction::Request, Phase::Headers) => "proxy_on_request_headers",
            (Direction::Request, Phase::Body) => "proxy_on_request_body",
            (Direction::Request, Phase::Trailers) => "proxy_on_request_trailers",
            (Direction::Response, Phase::Headers) => "proxy_on_response_headers",
            (Direction::Response, Phase::Body) => "proxy_on_response_body",
            (Direction::Response, Phase::Trailers) => "proxy_on_response_trailers",
        };
        let context = ctx as u32;
        let called = match phase {
            Phase::Headers => self.call(
                context,
                name,
                |e| {
                    if request {
                        e.request_headers.clone()
                    } else {
                        e.response_headers.clone()
                    }
                },
                (ctx, a, b),
            ),
            Phase::Body => self.call(
                context,
                name,
                |e| {
                    if request {
                        e.request_body.clone()
                    } else {
                        e.response_body.clone()
                    }
                },
                (ctx, a, b),
            ),
            Phase::Trailers => self.call(
                context,
                name,
                |e| {
                    if request {
                        e.request_trailers.clone()
                    } else {
                        e.response_trailers.clone()
                    }
                },
                (ctx, a),
            ),
        };
        let local_reply = self.stream_mut(id).is_some_and(|s| {
            s.in_callback = None;
            std::mem::take(&mut s.local_reply_in_call)
        });
        let returned = match called {
            Called::Returned(v) => Some(v),
            _ => None,
        };
        if let Some(s) = self.stream_mut(id) {
            s.callbacks.push(CallbackRecord {
                callback: name,
                returned,
            });
        }
        match called {
            Called::Failed => self.fail_stream(id),
            _ if local_reply => Verdict::Stop,
            Called::Returned(v) => Verdict::Value(v),
            Called::Missing => Verdict::Value(0),
        }
    }

    /// Envoy's `failStream`: fail-open continues; fail-closed answers 503 once per stream.
    fn fail_stream(&mut self, id: StreamId) -> Verdict {
        if self.store.data().plugin.failure_policy == FailurePolicy::FailOpen {
            return Verdict::Pass;
        }
        let Some(stream) = self.stream_mut(id) else {
            return Verdict::Stop;
        };
        if !stream.fail_reply_sent {
            stream.fail_reply_sent = true;
            self.store
                .data_mut()
                .deferred
                .push_back(Deferred::LocalReply(
                    id,
                    LocalReply {
                        status: 503,
                        body: Vec::new(),
                        headers: HeaderMap::new(),
                        details: "wasm_fail_stream".into(),
                        grpc_status: -1,
                    },
                ));
        }
        Verdict::Stop
    }

    fn on_headers(
        &mut self,
        id: StreamId,
        dir: Direction,
        headers: HeaderMap,
        end_stream: bool,
        local: bool,
    ) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished || (stream.local_reply_sent && !local) {
            return;
        }
        if dir == Direction::Response {
            stream.response_code = headers.get(":status").and_then(|s| s.parse().ok());
        }
        let n = headers.len() as i32;
        let half = stream.half_mut(dir);
        half.headers = Some(headers);
        half.headers_held = true;
        half.end_seen = end_stream;
        let skip_vm = stream.bypass || (dir == Direction::Response && !stream.created);
        if skip_vm {
            self.forward_headers(id, dir);
            return;
        }
        let verdict = self.http_callback(id, dir, Phase::Headers, n, i32::from(end_stream));
        let allow_stop_iteration = self.store.data().plugin.allow_on_headers_stop_iteration;
        let stop = match verdict {
            Verdict::Pass | Verdict::Value(0) | Verdict::Value(2) => Stop::None,
            Verdict::Value(1) if allow_stop_iteration => Stop::Headers,
            Verdict::Value(_) | Verdict::Stop => Stop::All,
        };
        if stop == Stop::None {
            self.forward_headers(id, dir);
        } else if let Some(s) = self.stream_mut(id) {
            s.half_mut(dir).stop = stop;
        }
    }

    fn on_data(
        &mut self,
        id: StreamId,
        dir: Direction,
        data: &[u8],
        end_stream: bool,
        local: bool,
    ) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished || (stream.local_reply_sent && !local) {
            return;
        }
        let skip_vm = stream.bypass || !stream.created;
        let half = stream.half_mut(dir);
        half.body.extend_from_slice(data);
        half.end_seen |= end_stream;
        if skip_vm {
            self.forward_body(id, dir);
            return;
        }
        if half.stop == Stop::All {
            // Stop-all: Envoy buffers with watermarks (no 413) and calls the plugin on resume.
            half.data_pending = true;
            return;
        }
        self.run_body(id, dir);
    }

    fn run_body(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half(dir);
        let size = half.body.len() as i32;
        let eos = half.end_seen && half.trailers.is_none();
        let verdict = self.http_callback(id, dir, Phase::Body, size, i32::from(eos));
        let limit = self.store.data().plugin.buffer_limit;
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half_mut(dir);
        half.data_pending = false;
        match verdict {
            Verdict::Pass | Verdict::Value(0) => {
                half.stop = Stop::None;
                self.forward_headers(id, dir);
                self.forward_body(id, dir);
                self.continue_to_trailers(id, dir);
            }
            Verdict::Value(1) => {
                half.stop = Stop::Body;
                if half.body.len() > limit {
                    self.buffer_overflow(id, dir);
                }
            }
            Verdict::Value(2) => half.stop = Stop::Body,
            Verdict::Value(_) | Verdict::Stop => {
                // StopIterationNoBuffer: the filter owns the data; it is not kept.
                half.stop = Stop::Body;
                half.body.clear();
            }
        }
    }

    /// Trailers that arrived while the body was stopped get their callback after it continues.
    fn continue_to_trailers(&mut self, id: StreamId, dir: Direction) {
        let pending = self
            .store
            .data()
            .streams
            .get(&id)
            .is_some_and(|s| s.half(dir).trailers_held);
        if pending {
            self.run_trailers(id, dir);
        }
    }

    fn on_trailers(&mut self, id: StreamId, dir: Direction, trailers: HeaderMap) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished || stream.local_reply_sent {
            return;
        }
        let skip_vm = stream.bypass || !stream.created;
        let half = stream.half_mut(dir);
        half.trailers = Some(trailers);
        half.trailers_held = true;
        half.end_seen = true;
        if skip_vm {
            self.forward_trailers(id, dir);
            return;
        }
        if matches!(half.stop, Stop::All | Stop::Body) {
            return;
        }
        self.run_trailers(id, dir);
    }

    fn run_trailers(&mut self, id: StreamId, dir: Direction) {
        let n = self
            .store
            .data()
            .streams
            .get(&id)
            .and_then(|s| s.half(dir).trailers.as_ref().map(HeaderMap::len))
            .unwrap_or(0) as i32;
        match self.http_callback(id, dir, Phase::Trailers, n, 0) {
            Verdict::Pass | Verdict::Value(0) => {
                self.forward_headers(id, dir);
                self.forward_body(id, dir);
                self.forward_trailers(id, dir);
            }
            _ => {
                if let Some(s) = self.stream_mut(id) {
                    s.half_mut(dir).stop = Stop::Trailers;
                }
            }
        }
    }

    /// `proxy_continue_stream`, run after the VM call returned.
    fn resume(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished {
            return;
        }
        let half = stream.half_mut(dir);
        let stop = std::mem::replace(&mut half.stop, Stop::None);
        let data_pending = half.data_pending;
        match stop {
            Stop::None => {}
            Stop::All => {
                self.forward_headers(id, dir);
                if data_pending {
                    self.run_body(id, dir);
                } else {
                    self.continue_to_trailers(id, dir);
                }
            }
            Stop::Headers | Stop::Body | Stop::Trailers => {
                self.forward_headers(id, dir);
                self.forward_body(id, dir);
                self.forward_trailers(id, dir);
            }
        }
    }

    fn forward_headers(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half_mut(dir);
        if !half.headers_held {
            return;
        }
        half.headers_held = false;
        half.headers_forwarded = true;
        let end_stream = half.end_seen && half.body.is_empty() && half.trailers.is_none();
        let headers = half.headers.clone().unwrap_or_default();
        half.complete |= end_stream;
        let event = match dir {
            Direction::Request => StreamEvent::UpstreamHeaders {
                headers,
                end_stream,
            },
            Direction::Response => StreamEvent::DownstreamHeaders {
                headers,
                end_stream,
            },
        };
        stream.events.push(event);
        if end_stream {
            self.completed(id, dir);
        }
    }

    fn forward_body(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half_mut(dir);
        if !half.headers_forwarded || half.complete {
            return;
        }
        let end_stream = half.end_seen && half.trailers.is_none();
        if half.body.is_empty() && !end_stream {
            return;
        }
        let data = std::mem::take(&mut half.body);
        half.complete |= end_stream;
        let event = match dir {
            Direction::Request => StreamEvent::UpstreamData { data, end_stream },
            Direction::Response => StreamEvent::DownstreamData { data, end_stream },
        };
        stream.events.push(event);
        if end_stream {
            self.completed(id, dir);
        }
    }

    fn forward_trailers(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half_mut(dir);
        if !half.trailers_held || !half.headers_forwarded || half.complete {
            return;
        }
        half.trailers_held = false;
        half.complete = true;
        let trailers = half.trailers.clone().unwrap_or_default();
        stream.events.push(match dir {
            Direction::Request => StreamEvent::UpstreamTrailers(trailers),
            Direction::Response => StreamEvent::DownstreamTrailers(trailers),
        });
        self.completed(id, dir);
    }

    fn completed(&mut self, id: StreamId, dir: Direction) {
        if dir == Direction::Response {
            self.finish(id);
        }
    }

    fn buffer_overflow(&mut self, id: StreamId, dir: Direction) {
        let (status, body, details) = match dir {
            Direction::Request => (413, "Payload Too Large", "request_payload_too_large"),
            Direction::Response => (500, "Internal Server Error", "response_payload_too_large"),
        };
        self.store
            .data_mut()
            .deferred
            .push_back(Deferred::LocalReply(
                id,
                LocalReply {
                    status,
                    body: body.as_bytes().to_vec(),
                    headers: HeaderMap::new(),
                    details: details.into(),
                    grpc_status: -1,
                },
            ));
    }

    fn send_local_reply(&mut self, id: StreamId, reply: LocalReply) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished {
            return;
        }
        if stream.response.headers_forwarded {
            // Headers already went downstream: all Envoy can do is reset.
            self.reset(id, Some("wasm_local_reply_after_response_headers".into()));
            return;
        }
        let mut headers = HeaderMap::from([(":status", reply.status.to_string())]);
        for (k, v) in reply.headers.entries() {
            headers.add(k, v);
        }
        headers.replace(b"content-length", reply.body.len().to_string().as_bytes());
        if !reply.body.is_empty() && headers.get_bytes("content-type").is_none() {
            headers.add(b"content-type", b"text/plain");
        }
        let upstream_started = stream.request.headers_forwarded;
        stream.events.push(StreamEvent::LocalReply(reply.clone()));
        if upstream_started {
            stream.events.push(StreamEvent::UpstreamReset);
        }
        stream.request.complete = true;
        stream.response_code = Some(reply.status);
        if stream.response.headers_held {
            // From on_response_headers: Envoy sends the reply straight to the encoder, dropping
            // the upstream response, without running filter callbacks on it.
            stream.local_reply_sent = true;
            let end_stream = reply.body.is_empty();
            stream.response.headers = Some(headers.clone());
            stream.response.headers_held = false;
            stream.response.headers_forwarded = true;
            stream.response.complete = true;
            stream.events.push(StreamEvent::DownstreamHeaders {
                headers,
                end_stream,
            });
            if !end_stream {
                stream.events.push(StreamEvent::DownstreamData {
                    data: reply.body,
                    end_stream: true,
                });
            }
            self.finish(id);
            return;
        }
        stream.local_reply_sent = true;
        stream.response = Half::new();
        let end_stream = reply.body.is_empty();
        self.on_headers(id, Direction::Response, headers, end_stream, true);
        if !end_stream {
            self.on_data(id, Direction::Response, &reply.body, true, true);
        }
    }

    fn reset(&mut self, id: StreamId, details: Option<String>) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished {
            return;
        }
        if stream.request.headers_forwarded
            && !(stream.request.complete && stream.response.complete)
        {
            stream.events.push(StreamEvent::UpstreamReset);
        }
        if let Some(details) = details {
            stream.events.push(StreamEvent::DownstreamReset { details });
        }
        self.finish(id);
    }

    /// Envoy's stream teardown: access log (`on_log`), then `on_done`, then `on_delete`.
    fn finish(&mut self, id: StreamId) {
        let now = self.store.data().now_ns();
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished {
            return;
        }
        stream.finished = true;
        stream.finished_mono_ns = Some(now);
        let ctx = stream.context_id;
        if !stream.bypass && self.vm_alive_for(id) && self.ensure_created(id) {
            if let Some(s) = self.stream_mut(id) {
                s.logging = true;
            }
            self.call(ctx, "proxy_on_log", |e| e.log.clone(), ctx as i32);
            if let Some(s) = self.stream_mut(id) {
                s.logging = false;
            }
            self.call(ctx, "proxy_on_done", |e| e.done.clone(), ctx as i32);
            self.call(ctx, "proxy_on_delete", |e| e.delete.clone(), ctx as i32);
        }
        let state = self.store.data_mut();
        if state.context_streams.get(&ctx) == Some(&id) {
            state.context_streams.remove(&ctx);
        }
    }

    /// Runs queued after-VM-call actions until none is left.
    fn drain(&mut self) {
        while let Some(action) = self.store.data_mut().deferred.pop_front() {
            match action {
                Deferred::Continue(id, dir) => self.resume(id, dir),
                Deferred::Close(id) => self.reset(id, Some("wasm_close_stream".into())),
                Deferred::LocalReply(id, reply) => self.send_local_reply(id, reply),
                Deferred::DeleteRoot => {
                    if let Some(root) = self.root_context_id() {
                        self.call(root, "proxy_on_delete", |e| e.delete.clone(), root as i32);
                        self.store.data_mut().root = None;
                    }
                }
            }
        }
    }

    // ---------------------------------------------------------------------------------
    // Callouts, timers, posted events

    /// Callouts not yet delivered, in token order.
    pub fn pending_callouts(&self) -> Vec<CalloutRequest> {
        self.store
            .data()
            .callouts
            .values()
            .map(|c| c.request.clone())
            .collect()
    }

    /// Callouts dispatched since the last call (for a live driver to send over the network).
    pub fn take_new_callouts(&mut self) -> Vec<CalloutRequest> {
        self.store
            .data_mut()
            .callouts
            .values_mut()
            .filter(|c| !c.handed_out)
            .map(|c| {
                c.handed_out = true;
                c.request.clone()
            })
            .collect()
    }

    /// Delivers a callout's outcome to the root context; false if the token is not pending
    /// (already answered, timed out, or cancelled with its root).
    pub fn deliver_callout(&mut self, token: u32, outcome: CalloutOutcome) -> bool {
        let state = self.store.data_mut();
        let Some(callout) = state.callouts.remove(&token) else {
            return false;
        };
        state.shared.end_request(&callout.request.cluster);
        if callout.generation != state.generation || state.failed {
            return true;
        }
        let (nh, nb, nt) = match &outcome {
            CalloutOutcome::Response {
                headers,
                body,
                trailers,
            } => (headers.len(), body.len(), trailers.len()),
            CalloutOutcome::Reset => {
                if let Some(root) = state.root.as_mut() {
                    root.status = (11, b"reset".to_vec());
                }
                (0, 0, 0)
            }
        };
        state.callout_response = Some(outcome);
        let root = callout.root;
        self.call(
            root,
            "proxy_on_http_call_response",
            |e| e.http_call_response.clone(),
            (root as i32, token as i32, nh as i32, nb as i32, nt as i32),
        );
        self.store.data_mut().callout_response = None;
        self.drain();
        true
    }

    /// The earliest timer or callout deadline (monotonic ns).
    pub fn next_deadline_ns(&self) -> Option<u64> {
        let state = self.store.data();
        let tick = state.root.as_ref().and_then(|r| r.next_tick_ns);
        let callout = state.callouts.values().filter_map(|c| c.deadline_ns).min();
        [tick, callout].into_iter().flatten().min()
    }

    /// Fires every due callout timeout (504) and tick, in deadline order.
    pub fn fire_due(&mut self) {
        for _ in 0..10_000 {
            let now = self.store.data().now_ns();
            let state = self.store.data();
            let timed_out = state
                .callouts
                .iter()
                .filter_map(|(t, c)| c.deadline_ns.map(|d| (d, *t)))
                .filter(|(d, _)| *d <= now)
                .min();
            let tick = state
                .root
                .as_ref()
                .and_then(|r| r.next_tick_ns)
                .filter(|d| *d <= now);
            match (timed_out, tick) {
                (Some((deadline, token)), t) if t.is_none_or(|t| deadline <= t) => {
                    self.deliver_callout(token, CalloutOutcome::timeout());
                }
                (_, Some(_)) => self.tick(),
                _ => return,
            }
        }
    }

    fn tick(&mut self) {
        let Some(root) = self.root_context_id() else {
            return;
        };
        if let Some(r) = self.store.data_mut().root.as_mut() {
            r.next_tick_ns = None;
        }
        let called = self.call(root, "proxy_on_tick", |e| e.tick.clone(), root as i32);
        let now = self.store.data().now_ns();
        if let Some(r) = self.store.data_mut().root.as_mut()
            && r.next_tick_ns.is_none()
            && !matches!(called, Called::Missing | Called::Failed)
        {
            // Re-armed after the callback returns (periods drift by its run time).
            r.next_tick_ns = r
                .tick_period
                .map(|p| now.saturating_add(p.as_nanos() as u64));
        }
        self.drain();
    }

    /// Delivers posted `on_queue_ready` notifications; returns how many ran.
    pub fn run_posted(&mut self) -> usize {
        let posted = self.store.data().mailbox.take();
        let mut ran = 0;
        for ready in posted {
            if self.root_context_id() == Some(ready.root_context_id) && !self.is_failed() {
                let root = ready.root_context_id as i32;
                self.call(
                    ready.root_context_id,
                    "proxy_on_queue_ready",
                    |e| e.queue_ready.clone(),
                    (root, ready.token as i32),
                );
                ran += 1;
                self.drain();
            }
        }
        ran
    }

    /// Whether events are posted to this VM and not yet run.
    pub fn has_posted(&self) -> bool {
        !self.store.data().mailbox.is_empty()
    }

    pub(crate) fn mailbox(&self) -> Arc<Mailbox> {
        Arc::clone(&self.store.data().mailbox)
    }

    /// Shuts the root down: `on_done(R)`, then `on_delete(R)` now or after `proxy_done`.
    pub fn shutdown(&mut self) {
        let Some(root) = self.root_context_id() else {
            return;
        };
        match self.call(root, "proxy_on_done", |e| e.done.clone(), root as i32) {
            Called::Returned(0) => {
                if let Some(r) = self.store.data_mut().root.as_mut() {
                    r.pending_done = true;
                }
            }
            _ => {
                self.store
                    .data_mut()
                    .deferred
                    .push_back(Deferred::DeleteRoot);
                self.drain();
            }
        }
    }
}
