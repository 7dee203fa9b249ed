//! The deterministic test API: a host with a virtual clock, VMs booted from a plugin config,
//! streams driven step by step, callouts answered (or failed, or forwarded over real HTTP) by
//! the test, and assertions on what went upstream/downstream, logs, metrics and shared data.
//!
//! ```no_run
//! use idemgate_host::testing::{Request, TestHost};
//! use idemgate_host::HeaderMap;
//! let host = TestHost::new().cluster("sidecar");
//! let vm = host.plugin("target/idemgate.wasm").vm_id("idem").config(r#"{"a":1}"#).boot().unwrap();
//! let stream = vm.stream();
//! stream.send_request(Request::post("/orders").header("idempotency-key", "k1").body("{}"));
//! let call = vm.pending_callouts().pop().unwrap();
//! vm.respond_callout(call.token, 200, HeaderMap::new(), "ok");
//! stream.respond(201, HeaderMap::new(), "created");
//! assert_eq!(stream.response_status(), Some(201));
//! ```
//!
//! Every driving call ends with the host "settled": each VM's posted events (queue
//! notifications) have run, as if all worker event loops went idle.

use crate::abi::Direction;
use crate::headers::HeaderMap;
use crate::plugin::{Cluster, FailurePolicy, LoadError, PluginSettings, WasmModule};
use crate::shared::{Clock, LogRecord, Metric, SharedState, lock};
use crate::vm::{
    CallbackRecord, CalloutOutcome, CalloutRequest, LocalReply, StreamEvent, StreamId, StreamInfo,
    Vm,
};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct HostInner {
    shared: Arc<SharedState>,
    clusters: Mutex<BTreeMap<String, Cluster>>,
    vms: Mutex<Vec<Arc<Mutex<Vm>>>>,
    next_connection: AtomicU64,
}

/// A host: the shared state (shared data, queues, metrics, log, virtual clock) of every VM
/// booted from it, as one Envoy process. Cheap to clone.
#[derive(Clone)]
pub struct TestHost {
    inner: Arc<HostInner>,
}

impl Default for TestHost {
    fn default() -> Self {
        Self::new()
    }
}

impl TestHost {
    /// A host with a virtual clock at 0 and no clusters.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(HostInner {
                shared: Arc::new(SharedState::new(Clock::virtual_clock(), None, usize::MAX)),
                clusters: Mutex::default(),
                vms: Mutex::default(),
                next_connection: AtomicU64::new(0),
            }),
        }
    }

    /// Declares a cluster callouts may name (no endpoint: the test answers its callouts).
    pub fn cluster(self, name: &str) -> Self {
        self.with_cluster(Cluster::named(name))
    }

    /// Declares a cluster with a loopback endpoint (for [`TestVm::forward_callout`]).
    pub fn cluster_at(self, name: &str, address: SocketAddr) -> Self {
        self.with_cluster(Cluster::at(name, address))
    }

    pub fn with_cluster(self, cluster: Cluster) -> Self {
        lock(&self.inner.clusters).insert(cluster.name.clone(), cluster);
        self
    }

    /// Starts configuring a plugin from a `.wasm` path (relative paths resolve against the
    /// workspace root, e.g. `target/idemgate.wasm`).
    pub fn plugin(&self, wasm: impl AsRef<Path>) -> PluginBuilder {
        let path = wasm.as_ref();
        let path = if path.is_relative() {
            crate::target_dir().join("..").join(path)
        } else {
            path.to_owned()
        };
        PluginBuilder {
            host: self.clone(),
            path,
            settings: PluginSettings {
                name: "test_plugin".into(),
                ..PluginSettings::default()
            },
        }
    }

    /// A built fixture plugin: `target/fixtures/<name>.wasm`.
    pub fn fixture(&self, name: &str) -> PluginBuilder {
        self.plugin(crate::target_dir().join(format!("fixtures/{name}.wasm")))
    }

    pub fn shared(&self) -> &Arc<SharedState> {
        &self.inner.shared
    }

    /// Moves the virtual clock forward, firing every tick and callout timeout that falls due,
    /// in time order across VMs. Events already posted run first: an event loop runs them
    /// before it sleeps.
    pub fn advance(&self, by: Duration) {
        self.settle();
        let clock = &self.inner.shared.clock;
        let Clock::Virtual(now) = clock else {
            return;
        };
        let target = now
            .load(Ordering::SeqCst)
            .saturating_add(by.as_nanos() as u64);
        for _ in 0..1_000_000 {
            let vms = lock(&self.inner.vms).clone();
            let next = vms
                .iter()
                .filter_map(|vm| lock(vm).next_deadline_ns())
                .filter(|d| *d <= target)
                .min();
            let Some(deadline) = next else {
                break;
            };
            now.fetch_max(deadline, Ordering::SeqCst);
            for vm in &vms {
                lock(vm).fire_due();
            }
            self.settle();
        }
        now.fetch_max(target, Ordering::SeqCst);
    }

    /// Moves the virtual clock on until the root of every VM with a tick period set has run a
    /// tick (firing whatever else falls due on the way, as [`TestHost::advance`]): what a
    /// plugin hands over on its tick, such as batched counters, is then with the host. False
    /// if they never came (the clock is not virtual, or a million steps did not do it).
    pub fn advance_through_ticks(&self) -> bool {
        if !matches!(self.inner.shared.clock, Clock::Virtual(_)) {
            return false;
        }
        let since = self.inner.shared.clock.monotonic_ns();
        for _ in 0..1_000_000 {
            let vms = lock(&self.inner.vms).clone();
            let next = vms
                .iter()
                .filter_map(|vm| {
                    let vm = lock(vm);
                    if vm.awaits_tick_since(since) {
                        vm.next_deadline_ns()
                    } else {
                        None
                    }
                })
                .min();
            let Some(next) = next else {
                return true;
            };
            let now = self.inner.shared.clock.monotonic_ns();
            self.advance(Duration::from_nanos(next.saturating_sub(now).max(1)));
        }
        false
    }

    /// Runs posted events (queue notifications) on every VM until none is left.
    pub fn settle(&self) {
        for _ in 0..10_000 {
            let vms = lock(&self.inner.vms).clone();
            let ran: usize = vms.iter().map(|vm| lock(vm).run_posted()).sum();
            if ran == 0 {
                return;
            }
        }
    }

    /// Current virtual time since the host started.
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.inner.shared.clock.monotonic_ns())
    }

    /// A shared-data entry `(value, cas)` under `vm_id`.
    pub fn shared_data(&self, vm_id: &str, key: &str) -> Option<(Vec<u8>, u32)> {
        self.inner.shared.get_shared_data(vm_id, key.as_bytes())
    }

    /// Writes shared data as another plugin would (`cas` 0 = unconditional).
    pub fn set_shared_data(&self, vm_id: &str, key: &str, value: &[u8], cas: u32) -> crate::Status {
        self.inner
            .shared
            .set_shared_data(vm_id, key.as_bytes(), value, cas)
    }

    pub fn metric(&self, name: &str) -> Option<Metric> {
        self.inner.shared.metrics().remove(name)
    }

    pub fn metrics(&self) -> BTreeMap<String, Metric> {
        self.inner.shared.metrics()
    }

    pub fn logs(&self) -> Vec<LogRecord> {
        self.inner.shared.logs()
    }

    /// Log messages containing `needle`.
    pub fn logs_containing(&self, needle: &str) -> Vec<String> {
        self.logs()
            .into_iter()
            .filter(|r| r.message.contains(needle))
            .map(|r| r.message)
            .collect()
    }
}

/// "A booted plugin with config X": the `envoy.filters.http.wasm` settings, then `boot`.
pub struct PluginBuilder {
    host: TestHost,
    path: PathBuf,
    settings: PluginSettings,
}

impl PluginBuilder {
    pub fn name(mut self, name: &str) -> Self {
        self.settings.name = name.into();
        self
    }

    pub fn root_id(mut self, root_id: &str) -> Self {
        self.settings.root_id = root_id.into();
        self
    }

    pub fn vm_id(mut self, vm_id: &str) -> Self {
        self.settings.vm_id = vm_id.into();
        self
    }

    /// The plugin configuration (`configuration` StringValue).
    pub fn config(mut self, configuration: impl Into<Vec<u8>>) -> Self {
        self.settings.configuration = configuration.into();
        self
    }

    pub fn vm_config(mut self, configuration: impl Into<Vec<u8>>) -> Self {
        self.settings.vm_configuration = configuration.into();
        self
    }

    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.settings.failure_policy = policy;
        self
    }

    pub fn allow_on_headers_stop_iteration(mut self, allow: bool) -> Self {
        self.settings.allow_on_headers_stop_iteration = allow;
        self
    }

    pub fn buffer_limit(mut self, bytes: usize) -> Self {
        self.settings.buffer_limit = bytes;
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.settings.environment.push((key.into(), value.into()));
        self
    }

    /// Replaces all settings at once.
    pub fn settings(mut self, settings: PluginSettings) -> Self {
        self.settings = settings;
        self
    }

    /// Boots one VM (worker 0).
    pub fn boot(self) -> Result<TestVm, LoadError> {
        Ok(self.boot_workers(1)?.remove(0))
    }

    /// Boots `n` VMs (workers 0..n) sharing this host's shared data, queues and metrics.
    pub fn boot_workers(self, n: usize) -> Result<Vec<TestVm>, LoadError> {
        let module = WasmModule::load(&self.path)?;
        let settings = Arc::new(self.settings);
        let clusters = Arc::new(lock(&self.host.inner.clusters).clone());
        let mut vms = Vec::with_capacity(n);
        for worker in 0..n {
            let vm = Vm::boot(
                &module,
                Arc::clone(&settings),
                Arc::clone(&clusters),
                Arc::clone(&self.host.inner.shared),
                worker,
            )?;
            let vm = Arc::new(Mutex::new(vm));
            lock(&self.host.inner.vms).push(Arc::clone(&vm));
            vms.push(TestVm {
                host: self.host.clone(),
                vm,
            });
        }
        self.host.settle();
        Ok(vms)
    }
}

/// One worker's VM. Clone it freely; it is `Send`, so workers can be driven from threads.
#[derive(Clone)]
pub struct TestVm {
    host: TestHost,
    vm: Arc<Mutex<Vm>>,
}

impl TestVm {
    /// Runs `f` on the VM, then settles the host.
    pub fn with<R>(&self, f: impl FnOnce(&mut Vm) -> R) -> R {
        let result = f(&mut lock(&self.vm));
        self.host.settle();
        result
    }

    pub fn host(&self) -> &TestHost {
        &self.host
    }

    /// A new stream ("an HTTP context") from a fresh loopback connection.
    pub fn stream(&self) -> TestStream {
        let n = self
            .host
            .inner
            .next_connection
            .fetch_add(1, Ordering::SeqCst)
            + 1;
        let info = StreamInfo {
            source: SocketAddr::from(([127, 0, 0, 1], 40000 + (n % 20000) as u16)),
            connection_id: n,
            ..StreamInfo::default()
        };
        self.stream_with(info)
    }

    pub fn stream_with(&self, info: StreamInfo) -> TestStream {
        let id = lock(&self.vm).new_stream(info);
        TestStream {
            vm: self.clone(),
            id,
            events: Arc::new(Mutex::new(Vec::new())),
        }
    }

    pub fn is_failed(&self) -> bool {
        lock(&self.vm).is_failed()
    }

    pub fn root_context_id(&self) -> Option<u32> {
        lock(&self.vm).root_context_id()
    }

    pub fn worker(&self) -> usize {
        lock(&self.vm).worker()
    }

    /// Callouts waiting for an outcome, in token order.
    pub fn pending_callouts(&self) -> Vec<CalloutRequest> {
        lock(&self.vm).pending_callouts()
    }

    /// Delivers an outcome to the root context; false if the token is not pending.
    pub fn answer_callout(&self, token: u32, outcome: CalloutOutcome) -> bool {
        self.with(|vm| vm.deliver_callout(token, outcome))
    }

    /// Answers with a complete response.
    pub fn respond_callout(
        &self,
        token: u32,
        status: u16,
        headers: HeaderMap,
        body: impl Into<Vec<u8>>,
    ) -> bool {
        self.answer_callout(token, CalloutOutcome::response(status, headers, body))
    }

    /// Resets the callout after a partial response: `(0,0,0)` and status (11, "reset").
    pub fn reset_callout(&self, token: u32) -> bool {
        self.answer_callout(token, CalloutOutcome::Reset)
    }

    /// Sends the callout over real HTTP to its cluster's loopback endpoint and delivers what
    /// comes back (503 if the cluster has no endpoint or refuses the connection).
    pub fn forward_callout(&self, token: u32) -> bool {
        let Some(request) = self
            .pending_callouts()
            .into_iter()
            .find(|c| c.token == token)
        else {
            return false;
        };
        let cluster = lock(&self.host.inner.clusters)
            .get(&request.cluster)
            .cloned()
            .unwrap_or_else(|| Cluster::named(&request.cluster));
        let outcome =
            crate::upstream::send_callout_blocking(&cluster, &request, Duration::from_secs(30));
        self.answer_callout(token, outcome)
    }

    /// Forwards every pending callout over real HTTP (see [`forward_callout`](Self::forward_callout)).
    pub fn forward_all_callouts(&self) -> usize {
        self.pending_callouts()
            .into_iter()
            .filter(|c| self.forward_callout(c.token))
            .count()
    }

    /// Root shutdown: `on_done(R)` then `on_delete(R)` (or after `proxy_done`).
    pub fn shutdown(&self) {
        self.with(Vm::shutdown);
    }
}

/// A request a client sends: pseudo-headers, headers, optional body.
#[derive(Debug, Clone)]
pub struct Request {
    headers: HeaderMap,
    body: Option<Vec<u8>>,
    trailers: Option<HeaderMap>,
}

impl Request {
    /// A request as Envoy's connection manager hands it to filters: `:authority`, `:path`,
    /// `:method`, `:scheme`, then the client's headers, then `x-request-id` and
    /// `x-forwarded-proto` (added by the HCM).
    pub fn new(method: &str, path: &str) -> Self {
        Self {
            headers: HeaderMap::from([
                (":authority", "example.com"),
                (":path", path),
                (":method", method),
                (":scheme", "http"),
            ]),
            body: None,
            trailers: None,
        }
    }

    pub fn get(path: &str) -> Self {
        Self::new("GET", path)
    }

    pub fn post(path: &str) -> Self {
        Self::new("POST", path)
    }

    pub fn put(path: &str) -> Self {
        Self::new("PUT", path)
    }

    pub fn header(mut self, key: &str, value: &str) -> Self {
        if key.starts_with(':') {
            self.headers.replace(key.as_bytes(), value.as_bytes());
        } else {
            self.headers.add(key.as_bytes(), value.as_bytes());
        }
        self
    }

    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = Some(body.into());
        self
    }

    pub fn trailer(mut self, key: &str, value: &str) -> Self {
        self.trailers
            .get_or_insert_with(HeaderMap::new)
            .add(key.as_bytes(), value.as_bytes());
        self
    }

    /// The headers as filters see them (with HCM-added headers for stream `id`).
    pub fn headers_for(&self, connection: u64) -> HeaderMap {
        let mut headers = self.headers.clone();
        if headers.get_bytes("x-request-id").is_none() {
            headers.add(
                b"x-request-id",
                format!("00000000-0000-4000-8000-{connection:012}").as_bytes(),
            );
        }
        headers.add(b"x-forwarded-proto", b"http");
        headers
    }
}

/// One stream on a VM ("an HTTP context with headers Y"). Steps drive Envoy's callbacks;
/// accessors report everything the filter chain emitted so far.
#[derive(Clone)]
pub struct TestStream {
    vm: TestVm,
    id: StreamId,
    events: Arc<Mutex<Vec<StreamEvent>>>,
}

impl TestStream {
    fn step(&self, f: impl FnOnce(&mut Vm, StreamId)) {
        let id = self.id;
        let mut vm = lock(&self.vm.vm);
        f(&mut vm, id);
        drop(vm);
        self.vm.host.settle();
    }

    fn collect(&self) -> Vec<StreamEvent> {
        let new = lock(&self.vm.vm).take_events(self.id);
        let mut events = lock(&self.events);
        events.extend(new);
        events.clone()
    }

    pub fn id(&self) -> StreamId {
        self.id
    }

    /// The context id the module sees (0 if the filter is not in the chain).
    pub fn context_id(&self) -> u32 {
        lock(&self.vm.vm).stream_context_id(self.id).unwrap_or(0)
    }

    /// Sends a whole request: headers (end of stream if there is no body), body, trailers.
    pub fn send_request(&self, request: Request) -> &Self {
        let connection = self.id;
        let headers = request.headers_for(connection);
        let body_follows = request.body.is_some() || request.trailers.is_some();
        self.send_request_headers(headers, !body_follows);
        if let Some(body) = &request.body {
            self.send_request_body(body, request.trailers.is_none());
        }
        if let Some(trailers) = request.trailers {
            self.send_request_trailers(trailers);
        }
        self
    }

    /// `decodeHeaders`: exactly these headers (no HCM additions).
    pub fn send_request_headers(&self, headers: impl Into<HeaderMap>, end_stream: bool) -> &Self {
        let headers = headers.into();
        self.step(|vm, id| vm.headers(id, Direction::Request, headers, end_stream));
        self
    }

    pub fn send_request_body(&self, data: impl AsRef<[u8]>, end_stream: bool) -> &Self {
        self.step(|vm, id| vm.data(id, Direction::Request, data.as_ref(), end_stream));
        self
    }

    pub fn send_request_trailers(&self, trailers: impl Into<HeaderMap>) -> &Self {
        let trailers = trailers.into();
        self.step(|vm, id| vm.trailers(id, Direction::Request, trailers));
        self
    }

    /// The upstream answers: `:status` + headers, then the body (if any) with end of stream.
    pub fn respond(&self, status: u16, headers: HeaderMap, body: impl AsRef<[u8]>) -> &Self {
        let mut all = HeaderMap::from([(":status", status.to_string())]);
        for (k, v) in headers.entries() {
            all.add(k, v);
        }
        let body = body.as_ref();
        self.send_response_headers(all, body.is_empty());
        if !body.is_empty() {
            self.send_response_body(body, true);
        }
        self
    }

    pub fn send_response_headers(&self, headers: impl Into<HeaderMap>, end_stream: bool) -> &Self {
        let headers = headers.into();
        self.step(|vm, id| vm.headers(id, Direction::Response, headers, end_stream));
        self
    }

    pub fn send_response_body(&self, data: impl AsRef<[u8]>, end_stream: bool) -> &Self {
        self.step(|vm, id| vm.data(id, Direction::Response, data.as_ref(), end_stream));
        self
    }

    pub fn send_response_trailers(&self, trailers: impl Into<HeaderMap>) -> &Self {
        let trailers = trailers.into();
        self.step(|vm, id| vm.trailers(id, Direction::Response, trailers));
        self
    }

    /// The client goes away: the stream is destroyed (on_log, on_done, on_delete run).
    pub fn abort(&self) -> &Self {
        self.step(Vm::reset_stream);
        self
    }

    /// Every event emitted so far, in order.
    pub fn events(&self) -> Vec<StreamEvent> {
        self.collect()
    }

    /// Request headers as forwarded upstream (None while the filter holds them).
    pub fn upstream_headers(&self) -> Option<HeaderMap> {
        self.collect().into_iter().find_map(|e| match e {
            StreamEvent::UpstreamHeaders { headers, .. } => Some(headers),
            _ => None,
        })
    }

    /// Request body bytes forwarded upstream so far.
    pub fn upstream_body(&self) -> Vec<u8> {
        self.collect()
            .into_iter()
            .filter_map(|e| match e {
                StreamEvent::UpstreamData { data, .. } => Some(data),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// Whether the whole request (end of stream) went upstream.
    pub fn upstream_complete(&self) -> bool {
        self.collect().iter().any(|e| {
            matches!(
                e,
                StreamEvent::UpstreamHeaders {
                    end_stream: true,
                    ..
                } | StreamEvent::UpstreamData {
                    end_stream: true,
                    ..
                } | StreamEvent::UpstreamTrailers(_)
            )
        })
    }

    /// Response headers as sent to the client.
    pub fn response_headers(&self) -> Option<HeaderMap> {
        self.collect().into_iter().find_map(|e| match e {
            StreamEvent::DownstreamHeaders { headers, .. } => Some(headers),
            _ => None,
        })
    }

    pub fn response_status(&self) -> Option<u16> {
        self.response_headers()?.get(":status")?.parse().ok()
    }

    /// Response body bytes sent to the client so far.
    pub fn response_body(&self) -> Vec<u8> {
        self.collect()
            .into_iter()
            .filter_map(|e| match e {
                StreamEvent::DownstreamData { data, .. } => Some(data),
                _ => None,
            })
            .flatten()
            .collect()
    }

    pub fn response_body_text(&self) -> String {
        String::from_utf8_lossy(&self.response_body()).into_owned()
    }

    /// The local reply started on this stream, if any.
    pub fn local_reply(&self) -> Option<LocalReply> {
        self.collect().into_iter().find_map(|e| match e {
            StreamEvent::LocalReply(reply) => Some(reply),
            _ => None,
        })
    }

    /// Whether the downstream stream was reset (rather than answered).
    pub fn was_reset(&self) -> bool {
        self.collect()
            .iter()
            .any(|e| matches!(e, StreamEvent::DownstreamReset { .. }))
    }

    /// Whether the stream is complete (on_log/on_done/on_delete ran).
    pub fn is_finished(&self) -> bool {
        lock(&self.vm.vm).is_finished(self.id)
    }

    /// Callbacks the module received for this stream, with raw return values
    /// (0 = Continue, 1 = Pause).
    pub fn callbacks(&self) -> Vec<CallbackRecord> {
        lock(&self.vm.vm).stream_callbacks(self.id)
    }

    /// The raw return value of the last callback named `callback` (e.g.
    /// `"proxy_on_request_headers"`).
    pub fn returned(&self, callback: &str) -> Option<i32> {
        self.callbacks()
            .into_iter()
            .rev()
            .find(|c| c.callback == callback)
            .and_then(|c| c.returned)
    }
}
