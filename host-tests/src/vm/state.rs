//! The wasmtime `Store` data of one VM: its root and stream contexts, each stream's two
//! halves as the filter sees them, and the actions deferred until the running export returns.

use super::StreamId;
use super::callouts::{Callout, CalloutOutcome};
use super::filter::{CallbackRecord, LocalReply, StreamEvent, StreamInfo};
use super::lifecycle::Wasm;
use crate::abi::{Direction, LogLevel};
use crate::headers::HeaderMap;
use crate::plugin::{Clusters, PluginSettings, WasmModule};
use crate::shared::{LogRecord, Mailbox, SharedState};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

pub(crate) struct Root {
    pub(crate) id: u32,
    pub(super) tick_period: Option<Duration>,
    pub(super) next_tick_ns: Option<u64>,
    /// `proxy_get_status` (sticky, as Envoy's `status_code_`).
    pub(crate) status: (u32, Vec<u8>),
    /// `on_done` returned false: waiting for `proxy_done`.
    pub(crate) pending_done: bool,
}

/// Where a direction's filter iteration stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
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
    pub(super) headers_forwarded: bool,
    /// Received and not yet forwarded.
    pub(crate) body: Vec<u8>,
    /// Data arrived while stopped at headers (owed a body callback on resume).
    pub(super) data_pending: bool,
    pub(super) end_seen: bool,
    pub(crate) trailers: Option<HeaderMap>,
    pub(crate) trailers_held: bool,
    pub(super) stop: Stop,
    pub(super) complete: bool,
    /// `continue_stream` was called: Envoy dropped its map pointers at once.
    pub(crate) dropped: bool,
}

impl Half {
    /// Body data held by a body-phase stop (StopIterationAndBuffer and friends).
    pub(crate) fn body_held(&self) -> bool {
        self.stop == Stop::Body
    }

    pub(super) fn new() -> Self {
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
    pub(super) generation: u32,
    pub(super) created: bool,
    /// FAIL_OPEN on a failed VM: the filter is not in the chain.
    pub(super) bypass: bool,
    pub(super) finished: bool,
    pub(crate) logging: bool,
    pub(crate) request: Half,
    pub(crate) response: Half,
    pub(crate) info: StreamInfo,
    pub(super) events: Vec<StreamEvent>,
    pub(crate) in_callback: Option<(Direction, Phase)>,
    /// `send_local_response` was called during the running callback.
    pub(crate) local_reply_in_call: bool,
    /// The response path now carries a local reply; the upstream response is dropped.
    pub(super) local_reply_sent: bool,
    pub(super) fail_reply_sent: bool,
    /// The request is gRPC (judged once, on its headers as they arrived): local replies are
    /// trailers-only gRPC responses.
    pub(super) grpc: bool,
    /// `set_property` values (Envoy filter state `wasm.<name>`).
    pub(crate) filter_state: BTreeMap<Vec<u8>, Vec<u8>>,
    pub(super) callbacks: Vec<CallbackRecord>,
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

/// Actions Envoy runs "after the VM call" instead of re-entering the module.
pub(crate) enum Deferred {
    Continue(StreamId, Direction),
    Close(StreamId),
    LocalReply(StreamId, LocalReply),
    DeleteRoot,
}

/// The context a hostcall acts on (the effective context, else the running callback's).
#[derive(Clone, Copy)]
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
    pub(super) module: WasmModule,
    pub(crate) wasm: Option<Wasm>,
    pub(super) generation: u32,
    pub(super) failed: bool,
    pub(super) last_reload_ns: Option<u64>,
    /// Inside `_initialize`/`main`: only logging and WASI are allowed.
    pub(crate) restricted: bool,
    /// Inside the root's `on_context_create`/`on_configure`: plugin configuration readable.
    pub(crate) configuring: bool,
    pub(super) next_context_id: u32,
    pub(crate) root: Option<Root>,
    pub(crate) streams: BTreeMap<StreamId, Stream>,
    /// Streams looked up for change since the driver last asked (`Vm::streams_with_events`):
    /// the only ones that can have new events, so waking a worker's streams after a VM call
    /// costs what the call touched, not one lookup per stream in flight.
    pub(super) touched: Vec<StreamId>,
    pub(super) context_streams: HashMap<u32, StreamId>,
    pub(super) next_stream: StreamId,
    pub(crate) active: Option<u32>,
    /// What `active` is, set when its callback starts (by the stream that makes the call, or
    /// looked up for the root), as Envoy resolves a hostcall's context through the pointer it
    /// holds for the running call (proxy-wasm-cpp-host `current_context_` in src/exports.cc,
    /// which Envoy's source/extensions/common/wasm/wasm.cc and context.cc reach through
    /// `contextOrEffectiveContext()`): neither a callback nor a hostcall costs a context-map
    /// lookup unless the plugin set an effective context.
    pub(crate) current: Target,
    pub(crate) effective: Option<u32>,
    pub(crate) deferred: VecDeque<Deferred>,
    pub(super) next_callout_serial: u32,
    pub(super) callouts: BTreeMap<u32, Callout>,
    /// The outcome being delivered (readable only during `on_http_call_response`).
    pub(crate) callout_response: Option<CalloutOutcome>,
    pub(crate) metric_names: HashMap<u32, String>,
    /// gRPC calls and streams of the root, and what their running callback may read.
    pub(crate) grpc: super::GrpcState,
    /// Per metric kind, so counters get 4, 8, ..., gauges 5, 9, ..., histograms 6, 10, ...
    pub(super) next_metric_serial: [u32; 3],
}

impl VmState {
    /// The context hostcalls act on.
    pub(crate) fn target(&self) -> Target {
        match self.effective {
            Some(id) => self.resolve(id),
            None => self.current,
        }
    }

    /// What context `id` is now (the maps Envoy's `getContext` searches).
    pub(crate) fn resolve(&self, id: u32) -> Target {
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

    /// A message of the host about this VM (a trap, a reload).
    pub(crate) fn log(&self, level: LogLevel, message: String) {
        self.shared.log(LogRecord {
            level,
            worker: self.worker,
            message,
            prefix: None,
        });
    }

    /// A line the plugin logged (`proxy_log`, WASI stdout/stderr), with the log prefix of the
    /// context it acts on: proxy-wasm-cpp-host `PluginBase::makeLogPrefix` (name, root_id,
    /// vm_id) for a stream, `ContextBase::makeRootLogPrefix` (root_id, vm_id) for the root,
    /// none outside any context (`_initialize`).
    pub(crate) fn plugin_log(&self, level: LogLevel, message: String) {
        let p = &self.plugin;
        let parts: &[&str] = match self.target() {
            Target::Stream(_) => &[&p.name, &p.root_id, &p.vm_id],
            Target::Root => &[&p.root_id, &p.vm_id],
            Target::None => &[],
        };
        let prefix = parts
            .iter()
            .filter(|part| !part.is_empty())
            .fold(String::new(), |prefix, part| prefix + " " + part);
        self.shared.log(LogRecord {
            level,
            worker: self.worker,
            message,
            prefix: Some(prefix),
        });
    }

    pub(crate) fn now_ns(&self) -> u64 {
        self.shared.clock.monotonic_ns()
    }

    pub(crate) fn set_tick_period(&mut self, period: Duration) {
        let now = self.now_ns();
        if let Some(root) = self.root.as_mut() {
            root.tick_period = (!period.is_zero()).then_some(period);
            root.next_tick_ns = root
                .tick_period
                .map(|p| now.saturating_add(p.as_nanos() as u64));
            self.shared
                .note_tick_period(&self.plugin.name, self.worker, !period.is_zero());
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
