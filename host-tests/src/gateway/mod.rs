//! The gateway: a real HTTP/1.1 + h2c server with Envoy's threading model — N worker
//! threads, each with its own single-threaded event loop and its own VM per wasm listener —
//! running the filter chain (optional wasm filter, then the router) from a static Envoy
//! config, forwarding to upstream clusters with streamed bodies, and sending callouts over
//! real sockets. Embeddable: [`Gateway::start`] on pre-bound sockets, then
//! [`Gateway::shutdown`].

pub mod access_log;
pub mod bootstrap;
pub mod config;
mod heads;
mod path;
pub mod service;
mod stream;

use crate::abi::LogLevel;
use crate::plugin::{Clusters, LoadError, WasmModule};
use crate::shared::{Clock, SharedState, lock};
use crate::vm::{StreamId, Vm};
use bytes::Bytes;
use config::{EnvoyConfig, ListenerConfig};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("listener {name}: {source}")]
    Bind {
        name: String,
        source: std::io::Error,
    },
    #[error("listener {listener}: {source}")]
    Wasm { listener: String, source: LoadError },
    #[error("starting worker threads: {0}")]
    Runtime(std::io::Error),
}

/// How to run a configuration.
#[derive(Debug)]
pub struct GatewayOptions {
    /// Worker threads (Envoy `--concurrency`), at least 1.
    pub concurrency: usize,
    /// Already-bound sockets by listener name (tests bind port 0 first); others are bound
    /// from the config.
    pub listeners: HashMap<String, TcpListener>,
    /// An already-bound admin socket.
    pub admin: Option<TcpListener>,
    /// Print access-log lines on stdout: the configured access logs' (which are kept for
    /// [`SharedState::access_log`] either way), or the gateway's own line when none is
    /// configured.
    pub access_log: bool,
    /// Plugin log lines at or above this level go to stderr.
    pub log_level: Option<LogLevel>,
}

impl Default for GatewayOptions {
    fn default() -> Self {
        Self {
            concurrency: 1,
            listeners: HashMap::new(),
            admin: None,
            access_log: false,
            log_level: Some(LogLevel::Info),
        }
    }
}

/// Gateway-level counters (Envoy `http.<stat_prefix>.*`, `cluster.<name>.*`).
#[derive(Debug, Default)]
pub struct Stats {
    counters: Mutex<BTreeMap<String, u64>>,
}

impl Stats {
    pub(crate) fn add(&self, name: String, delta: u64) {
        *lock(&self.counters).entry(name).or_default() += delta;
    }

    pub fn get(&self, name: &str) -> u64 {
        lock(&self.counters).get(name).copied().unwrap_or(0)
    }

    pub fn all(&self) -> BTreeMap<String, u64> {
        lock(&self.counters).clone()
    }
}

/// A running gateway. Dropping it shuts it down.
pub struct Gateway {
    listeners: BTreeMap<String, SocketAddr>,
    /// Every worker VM as `(plugin name, worker)`, for [`Gateway::await_ticks`].
    vms: Vec<(String, usize)>,
    admin: Option<SocketAddr>,
    shared: Arc<SharedState>,
    stats: Arc<Stats>,
    shutdown: watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("listeners", &self.listeners)
            .field("admin", &self.admin)
            .finish()
    }
}

/// What every worker shares about one listener.
struct ListenerShared {
    config: ListenerConfig,
    module: Option<WasmModule>,
}

fn bind(
    name: &str,
    address: SocketAddr,
    given: Option<TcpListener>,
) -> Result<TcpListener, GatewayError> {
    let bind_error = |source| GatewayError::Bind {
        name: name.to_owned(),
        source,
    };
    let socket = match given {
        Some(s) => s,
        None => TcpListener::bind(address).map_err(bind_error)?,
    };
    socket.set_nonblocking(true).map_err(bind_error)?;
    Ok(socket)
}

/// Pending connections a listening socket holds (Envoy's `tcp_backlog_size` default is the
/// kernel's `somaxconn`, which clamps this).
const BACKLOG: i32 = 4096;

/// A listener's sockets, one per worker: with `reuse_port` (Envoy's `enable_reuse_port`,
/// true by default on Linux) each its own `SO_REUSEPORT` socket on the one address, so the
/// kernel spreads connections across workers by their addresses' hash (Envoy's
/// source/common/network/listen_socket_impl.cc sets the option, and the listener manager
/// creates a socket per worker); otherwise, or for a socket handed in without the option,
/// one socket every worker accepts on. With the address they are bound to.
fn bind_workers(
    listener: &ListenerConfig,
    given: Option<TcpListener>,
    workers: usize,
) -> Result<(SocketAddr, Vec<TcpListener>), GatewayError> {
    worker_sockets(listener.address, listener.reuse_port, given, workers).map_err(|source| {
        GatewayError::Bind {
            name: listener.name.clone(),
            source,
        }
    })
}

fn worker_sockets(
    address: SocketAddr,
    reuse_port: bool,
    given: Option<TcpListener>,
    workers: usize,
) -> std::io::Result<(SocketAddr, Vec<TcpListener>)> {
    let reusable =
        |socket: &TcpListener| socket2::SockRef::from(socket).reuse_port().unwrap_or(false);
    let first = match given {
        Some(socket) => socket,
        None if reuse_port && workers > 1 => reuse_port_socket(address)?,
        None => TcpListener::bind(address)?,
    };
    first.set_nonblocking(true)?;
    let address = first.local_addr()?;
    let separate = reuse_port && reusable(&first);
    let others = (1..workers).map(|_| {
        if separate {
            let socket = reuse_port_socket(address)?;
            socket.set_nonblocking(true)?;
            Ok(socket)
        } else {
            first.try_clone()
        }
    });
    let others = others.collect::<std::io::Result<Vec<_>>>()?;
    Ok((address, std::iter::once(first).chain(others).collect()))
}

/// A listening socket on `address` with `SO_REUSEADDR` and `SO_REUSEPORT`.
fn reuse_port_socket(address: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(address), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&address.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

impl Gateway {
    /// Loads the modules, boots one VM per worker per wasm listener (after a configuration
    /// canary, as Envoy), binds, and starts serving.
    pub fn start(config: EnvoyConfig, mut options: GatewayOptions) -> Result<Self, GatewayError> {
        let concurrency = options.concurrency.max(1);
        let shared = Arc::new(SharedState::new(Clock::real(), options.log_level, 10_000));
        let clusters: Clusters = Arc::new(config.clusters.clone());
        let stats = Arc::new(Stats::default());
        let mut listeners = Vec::new();
        let mut addresses = BTreeMap::new();
        for l in &config.listeners {
            let module = match &l.wasm {
                Some(w) => {
                    let wasm_error = |source| GatewayError::Wasm {
                        listener: l.name.clone(),
                        source,
                    };
                    let module = WasmModule::load(&w.code).map_err(wasm_error)?;
                    // The canary: configured once and discarded; a rejection fails startup.
                    Vm::boot(
                        &module,
                        Arc::new(w.settings.clone()),
                        Arc::clone(&clusters),
                        Arc::clone(&shared),
                        crate::shared::CANARY_WORKER,
                    )
                    .map_err(wasm_error)?;
                    Some(module)
                }
                None => None,
            };
            let (local, sockets) = bind_workers(l, options.listeners.remove(&l.name), concurrency)?;
            addresses.insert(l.name.clone(), local);
            listeners.push((
                Arc::new(ListenerShared {
                    config: l.clone(),
                    module,
                }),
                sockets,
            ));
        }
        let (shutdown, _) = watch::channel(false);
        let mut threads = Vec::new();
        let vms = (0..concurrency)
            .flat_map(|worker| {
                listeners.iter().filter_map(move |(l, _)| {
                    let wasm = l.config.wasm.as_ref().filter(|_| l.module.is_some())?;
                    Some((wasm.settings.name.clone(), worker))
                })
            })
            .collect();
        for worker in 0..concurrency {
            let mut assigned = Vec::new();
            for (listener, sockets) in &mut listeners {
                let socket = sockets.pop().ok_or_else(|| GatewayError::Bind {
                    name: listener.config.name.clone(),
                    source: std::io::Error::other("a socket per worker"),
                })?;
                let vm = match (&listener.module, &listener.config.wasm) {
                    (Some(module), Some(w)) => Some(
                        Vm::boot(
                            module,
                            Arc::new(w.settings.clone()),
                            Arc::clone(&clusters),
                            Arc::clone(&shared),
                            worker,
                        )
                        .map_err(|source| GatewayError::Wasm {
                            listener: listener.config.name.clone(),
                            source,
                        })?,
                    ),
                    _ => None,
                };
                assigned.push((Arc::clone(listener), socket, vm));
            }
            let context = WorkerContext {
                index: worker,
                shared: Arc::clone(&shared),
                clusters: Arc::clone(&clusters),
                stats: Arc::clone(&stats),
                access_log: options.access_log,
                shutdown: shutdown.subscribe(),
            };
            let thread = std::thread::Builder::new()
                .name(format!("worker-{worker}"))
                .spawn(move || run_worker(context, assigned))
                .map_err(GatewayError::Runtime)?;
            threads.push(thread);
        }
        threads.extend(service::start(
            &config.services,
            &shared,
            &clusters,
            &shutdown,
        )?);
        let admin = match (config.admin, options.admin.take()) {
            (None, None) => None,
            (address, given) => {
                let address = address.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
                let socket = bind("admin", address, given)?;
                let local = socket.local_addr().map_err(|source| GatewayError::Bind {
                    name: "admin".into(),
                    source,
                })?;
                let admin = Admin {
                    shared: Arc::clone(&shared),
                    stats: Arc::clone(&stats),
                    tags: config.stats_tags.clone(),
                };
                let rx = shutdown.subscribe();
                threads.push(
                    std::thread::Builder::new()
                        .name("admin".into())
                        .spawn(move || admin.run(socket, rx))
                        .map_err(GatewayError::Runtime)?,
                );
                Some(local)
            }
        };
        Ok(Self {
            listeners: addresses,
            vms,
            admin,
            shared,
            stats,
            shutdown,
            threads,
        })
    }

    /// The bound address of a listener.
    pub fn listener_address(&self, name: &str) -> Option<SocketAddr> {
        self.listeners.get(name).copied()
    }

    pub fn admin_address(&self) -> Option<SocketAddr> {
        self.admin
    }

    /// Shared data, metrics and logs of every VM.
    pub fn shared(&self) -> &Arc<SharedState> {
        &self.shared
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Waits until every worker VM with a tick period set has run a tick that ended after
    /// this call (what a plugin hands over on its tick, such as batched counters, is then
    /// with the host); false if one did not within `timeout`.
    pub fn await_ticks(&self, timeout: Duration) -> bool {
        let since = self.shared.clock().monotonic_ns();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let ticked = self
                .vms
                .iter()
                .all(|(plugin, worker)| self.shared.ticked_since(plugin, *worker, since));
            if ticked {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Stops accepting, drops in-flight streams, and joins the worker threads.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.shutdown.send(true);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What a worker thread is given.
struct WorkerContext {
    index: usize,
    shared: Arc<SharedState>,
    clusters: Clusters,
    stats: Arc<Stats>,
    access_log: bool,
    shutdown: watch::Receiver<bool>,
}

/// One listener on one worker: its VM (if the chain has the wasm filter) and the wakers of
/// the streams in flight, which a callout, timer or queue event may have given work.
pub(crate) struct ListenerWorker {
    pub(crate) config: ListenerConfig,
    pub(crate) vm: Option<RefCell<Vm>>,
    pub(crate) worker: usize,
    pub(crate) clusters: Clusters,
    /// Process-wide state (circuit-breaker counts live there too).
    pub(crate) shared: Arc<SharedState>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) access_log: bool,
    /// The wakers of the in-flight streams that have a VM stream (the chain has the wasm
    /// filter), by its id: after a VM call only the streams it gave events are looked up
    /// (`Vm::streams_with_events`), not every stream in flight, which made each call of a
    /// burst cost time in proportion to the requests parked before it.
    wakers: RefCell<HashMap<StreamId, Rc<Notify>>>,
    timers: Notify,
    /// Keep-alive connections to clusters (upstream requests and callouts).
    pub(crate) pool: crate::client::Pool,
    /// The VM's gRPC calls and streams in flight.
    grpc: crate::grpc_upstream::GrpcUpstream,
    /// The deadline the timer task is sleeping towards.
    planned_deadline: std::cell::Cell<Option<u64>>,
}

impl ListenerWorker {
    /// Registers a stream's waker; the guard unregisters it.
    pub(crate) fn register(self: &Rc<Self>, stream: Option<StreamId>) -> (Rc<Notify>, StreamSlot) {
        let notify = Rc::new(Notify::new());
        if let Some(id) = stream {
            self.wakers.borrow_mut().insert(id, Rc::clone(&notify));
        }
        (
            notify,
            StreamSlot {
                listener: Rc::clone(self),
                stream,
            },
        )
    }

    /// After any VM call: send new callouts, re-plan timers, wake the streams that got work.
    pub(crate) fn after_vm_call(self: &Rc<Self>) {
        let Some(vm) = &self.vm else {
            return;
        };
        let callouts = vm.borrow_mut().take_new_callouts();
        for request in callouts {
            let this = Rc::clone(self);
            let cluster = self
                .clusters
                .get(&request.cluster)
                .cloned()
                .unwrap_or_else(|| crate::plugin::Cluster::named(&request.cluster));
            tokio::task::spawn_local(async move {
                let outcome = crate::upstream::send_callout(&this.pool, &cluster, &request).await;
                if let Some(vm) = &this.vm {
                    vm.borrow_mut().deliver_callout(request.token, outcome);
                }
                this.after_vm_call();
            });
        }
        let grpc = vm.borrow_mut().take_grpc_actions();
        if !grpc.is_empty() {
            let this = Rc::clone(self);
            let deliver: crate::grpc_upstream::Deliver = Rc::new(move |token, event| {
                if let Some(vm) = &this.vm {
                    vm.borrow_mut().deliver_grpc(token, event);
                }
                this.after_vm_call();
            });
            self.grpc.carry_out(grpc, &self.clusters, &deliver);
        }
        let mut vm = vm.borrow_mut();
        if vm.next_deadline_ns() != self.planned_deadline.get() {
            self.timers.notify_one();
        }
        let wakers = self.wakers.borrow();
        for id in vm.streams_with_events() {
            if let Some(notify) = wakers.get(&id) {
                notify.notify_one();
            }
        }
    }

    /// Fires due ticks and callout timeouts, and runs posted queue events, forever.
    async fn run_timers(self: Rc<Self>) {
        let Some(vm) = &self.vm else {
            return;
        };
        let mailbox = vm.borrow().mailbox();
        loop {
            let wait = {
                let vm = vm.borrow();
                let now = vm.shared().clock().monotonic_ns();
                let deadline = vm.next_deadline_ns();
                self.planned_deadline.set(deadline);
                deadline
                    .map(|d| Duration::from_nanos(d.saturating_sub(now)))
                    .unwrap_or(Duration::from_secs(3600))
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.timers.notified() => {}
                _ = mailbox.wake.notified() => {}
            }
            let worked = {
                let mut vm = vm.borrow_mut();
                let before = vm.next_deadline_ns();
                vm.fire_due();
                vm.run_posted() > 0 || before != vm.next_deadline_ns()
            };
            if worked {
                self.after_vm_call();
            }
        }
    }
}

/// Unregisters a stream's waker when its driver ends.
pub(crate) struct StreamSlot {
    listener: Rc<ListenerWorker>,
    stream: Option<StreamId>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        if let Some(id) = self.stream {
            self.listener.wakers.borrow_mut().remove(&id);
        }
    }
}

fn run_worker(
    context: WorkerContext,
    listeners: Vec<(Arc<ListenerShared>, TcpListener, Option<Vm>)>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("worker {}: cannot start its event loop: {e}", context.index);
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    let mut shutdown = context.shutdown.clone();
    local.block_on(&runtime, async move {
        let mut workers = Vec::new();
        for (listener, socket, vm) in listeners {
            let lw = Rc::new(ListenerWorker {
                config: listener.config.clone(),
                vm: vm.map(RefCell::new),
                worker: context.index,
                clusters: Arc::clone(&context.clusters),
                shared: Arc::clone(&context.shared),
                stats: Arc::clone(&context.stats),
                access_log: context.access_log,
                wakers: RefCell::new(HashMap::new()),
                timers: Notify::new(),
                planned_deadline: std::cell::Cell::new(None),
                pool: crate::client::Pool::default(),
                grpc: Default::default(),
            });
            let socket = match tokio::net::TcpListener::from_std(socket) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("worker {}: listener {}: {e}", context.index, lw.config.name);
                    continue;
                }
            };
            tokio::task::spawn_local(Rc::clone(&lw).run_timers());
            tokio::task::spawn_local(accept_loop(Rc::clone(&lw), socket));
            workers.push(lw);
        }
        let _ = shutdown.wait_for(|stop| *stop).await;
        for lw in &workers {
            if let Some(vm) = &lw.vm {
                vm.borrow_mut().shutdown();
            }
        }
    });
}

async fn accept_loop(listener: Rc<ListenerWorker>, socket: tokio::net::TcpListener) {
    let mut connection_id = (listener.worker as u64) << 48;
    loop {
        let Ok((stream, peer)) = socket.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        connection_id += 1;
        let local = stream.local_addr().unwrap_or(peer);
        let heads = Rc::new(RefCell::new(heads::Heads::default()));
        let connection = stream::Connection {
            listener: Rc::clone(&listener),
            peer,
            local,
            id: connection_id,
            heads: Rc::clone(&heads),
        };
        let io = TokioIo::new(heads::Recording::new(stream, heads));
        tokio::task::spawn_local(connection.serve(io));
    }
}

/// The admin endpoint: `/stats` (Envoy-like `name: value`), `/stats/prometheus`, `/ready`.
struct Admin {
    shared: Arc<SharedState>,
    stats: Arc<Stats>,
    /// `stats_config.stats_tags`, applied to the plugin metrics on `/stats/prometheus`.
    tags: Vec<config::StatsTag>,
}

impl Admin {
    fn stats_text(&self) -> String {
        let mut out = String::new();
        for (name, value) in self.stats.all() {
            let _ = writeln!(out, "{name}: {value}");
        }
        for (name, metric) in self.shared.metrics() {
            match metric.kind {
                crate::abi::MetricKind::Histogram => {
                    let histogram = &metric.histogram;
                    let quantile = |q: f64| -> String {
                        histogram
                            .quantile(q)
                            .map_or_else(|| "nan".into(), |v| v.to_string())
                    };
                    let _ = writeln!(
                        out,
                        "{name}: P50({}) P90({}) P99({}) count={}",
                        quantile(0.5),
                        quantile(0.9),
                        quantile(0.99),
                        histogram.count()
                    );
                }
                _ => {
                    let _ = writeln!(out, "{name}: {}", metric.value);
                }
            }
        }
        out
    }

    fn prometheus_text(&self) -> String {
        let sanitize = |name: &str| -> String {
            name.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        };
        let mut out = String::new();
        for (name, value) in self.stats.all() {
            let name = format!("envoy_{}", sanitize(&name));
            let _ = writeln!(out, "# TYPE {name} counter\n{name} {value}");
        }
        // Plugin metrics grouped by their name once the tags are cut out (one `# TYPE` line
        // per name, as Envoy prints them), each sample with its tags as labels.
        let mut grouped: BTreeMap<String, Vec<(String, crate::shared::Metric)>> = BTreeMap::new();
        for (name, metric) in self.shared.metrics() {
            let (name, labels) = self.tagged(&name);
            grouped
                .entry(sanitize(&name))
                .or_default()
                .push((labels, metric));
        }
        for (name, samples) in grouped {
            let kind = match samples.first().map(|(_, m)| m.kind) {
                Some(crate::abi::MetricKind::Counter) => "counter",
                Some(crate::abi::MetricKind::Gauge) => "gauge",
                _ => "histogram",
            };
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, metric) in samples {
                let braced = |extra: &str| -> String {
                    match (labels.is_empty(), extra.is_empty()) {
                        (true, true) => String::new(),
                        (false, true) => format!("{{{labels}}}"),
                        (true, false) => format!("{{{extra}}}"),
                        (false, false) => format!("{{{labels},{extra}}}"),
                    }
                };
                if metric.kind != crate::abi::MetricKind::Histogram {
                    let _ = writeln!(out, "{name}{} {}", braced(""), metric.value);
                    continue;
                }
                for (le, count) in metric.histogram.buckets() {
                    let _ = writeln!(
                        out,
                        "{name}_bucket{} {count}",
                        braced(&format!("le=\"{le}\""))
                    );
                }
                let total = metric.histogram.count();
                let sum = metric.histogram.sum();
                let _ = writeln!(out, "{name}_bucket{} {total}", braced("le=\"+Inf\""));
                let _ = writeln!(out, "{name}_sum{} {sum}", braced(""));
                let _ = writeln!(out, "{name}_count{} {total}", braced(""));
            }
        }
        out
    }

    /// A plugin metric's name with every configured tag cut out, and the tags as Prometheus
    /// labels (`rule="payments"`), in the order the extractors are configured.
    fn tagged(&self, name: &str) -> (String, String) {
        let mut name = name.to_owned();
        let mut labels = Vec::new();
        for tag in &self.tags {
            if let Some((rest, value)) = tag.extract(&name) {
                name = rest;
                labels.push(format!(
                    "{}=\"{}\"",
                    tag.name,
                    value.replace('\\', "\\\\").replace('"', "\\\"")
                ));
            }
        }
        (name, labels.join(","))
    }

    fn answer(&self, path: &str) -> http::Response<Full<Bytes>> {
        let (status, body) = match path {
            "/stats" => (200, self.stats_text()),
            "/stats/prometheus" => (200, self.prometheus_text()),
            "/ready" => (200, "LIVE\n".to_owned()),
            _ => (
                404,
                "admin endpoints: /stats /stats/prometheus /ready\n".to_owned(),
            ),
        };
        let mut response = http::Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
        response
    }

    fn run(self, socket: TcpListener, mut shutdown: watch::Receiver<bool>) {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        let admin = Arc::new(self);
        runtime.block_on(async move {
            let Ok(socket) = tokio::net::TcpListener::from_std(socket) else {
                return;
            };
            loop {
                tokio::select! {
                    _ = shutdown.wait_for(|stop| *stop) => return,
                    accepted = socket.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        let admin = Arc::clone(&admin);
                        tokio::spawn(async move {
                            let service = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                                let response = admin.answer(req.uri().path());
                                async move { Ok::<_, std::convert::Infallible>(response) }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::worker_sockets;
    use std::net::{SocketAddr, TcpListener, TcpStream};

    /// Connections accepted on each socket (all pending ones; the sockets are nonblocking).
    fn accepted(sockets: &[TcpListener]) -> Vec<usize> {
        sockets
            .iter()
            .map(|s| std::iter::from_fn(|| s.accept().ok()).take(1_000).count())
            .collect()
    }

    fn connect(address: SocketAddr, n: usize) -> Vec<TcpStream> {
        (0..n)
            .map(|_| TcpStream::connect(address).unwrap())
            .collect()
    }

    fn settle() {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }

    #[test]
    fn with_reuse_port_each_worker_has_its_own_socket_and_the_kernel_spreads_connections() {
        let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let (address, sockets) = worker_sockets(loopback, true, None, 4).unwrap();
        for socket in &sockets {
            assert_eq!(socket.local_addr().unwrap(), address);
            assert!(socket2::SockRef::from(socket).reuse_port().unwrap());
        }
        let _clients = connect(address, 64);
        settle();
        let counts = accepted(&sockets);
        assert_eq!(counts.iter().sum::<usize>(), 64, "{counts:?}");
        // 64 connections hashed over 4 sockets: all on one has odds of 4^-63.
        assert!(counts.iter().filter(|&&n| n > 0).count() > 1, "{counts:?}");
    }

    #[test]
    fn without_reuse_port_or_for_a_socket_handed_in_without_it_the_workers_share_one() {
        let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let handed_in = TcpListener::bind(loopback).unwrap();
        for (reuse_port, given) in [(false, None), (true, Some(handed_in))] {
            let (address, sockets) = worker_sockets(loopback, reuse_port, given, 4).unwrap();
            let _clients = connect(address, 8);
            settle();
            // One accept queue: the first socket takes every connection.
            assert_eq!(accepted(&sockets), vec![8, 0, 0, 0]);
        }
    }
}
