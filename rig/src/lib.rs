//! `idemgate-rig`: idemgate's stack on loopback, assembled one way for everything that runs
//! it — the demo (`cargo xtask demo`), the benchmarks, the end-to-end tests and the fault
//! suite.
//!
//! ```text
//! clients → gateway ─→ [sidecar proxy] → sidecar ─→ [redis proxy] → redis-server
//!                   └→ [backend proxy] → demo backend
//! ```
//!
//! [`Rig::builder`] describes the stack once: the sidecar on its memory store, on a
//! `redis-server` of its own ([`idemgate_sidecar::testing::RedisServer`]) or on a Redis given;
//! the demo [`backend`] (whose counters are the ground truth of what executed) or an upstream
//! already listening; for the fault suite a [`fault_proxy::FaultProxy`] on every hop; and,
//! if asked, a gateway running the shipped `envoy/envoy.yaml` ([`RigBuilder::gateway`]).
//! [`RigBuilder::start`] chooses the ports, starts the parts, waits until each is ready and
//! hands back a [`Rig`] that stops them all (on [`Rig::stop`], on drop, on a failed start).
//!
//! The parts run in this process (tests and benchmarks: the sidecar and the backend on
//! runtimes of their own, so a test can kill the sidecar as a crash would), or — with
//! [`RigBuilder::as_processes`], for the demo — as child processes of the built binaries,
//! each logging to a file of its own and killed and reaped however the rig ends ([`child`]).
//! More gateways can be started in front of a rig, as many as a test needs: [`Rig::shipped`]
//! runs the shipped file with its ports pointed at the rig;
//! [`gateway::LiveGateway::from_bootstrap`] runs one rendered by
//! `idemgate_host::gateway::bootstrap` at [`Rig::sidecar_hop`] and [`Rig::backend_hop`].

pub mod backend;
pub mod child;
pub mod fault_proxy;
pub mod gateway;
pub mod sidecar;

use crate::backend::{Backend, Stats, Timings};
use crate::child::ChildProcess;
use crate::fault_proxy::FaultProxy;
use crate::gateway::{LiveGateway, Shipped};
use crate::sidecar::{InProcessSidecar, TEST_WORKERS};
use anyhow::{Context, Result, bail};
use idemgate_sidecar::testing::RedisServer;
use idemgate_sidecar::{Config as SidecarConfig, RedisTopology, StoreConfig};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a part started as a process may take to accept connections.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// Where the sidecar keeps its state.
#[derive(Debug, Clone)]
enum Store {
    Memory,
    /// A `redis-server` the rig starts (and stops).
    OwnRedis,
    /// A store configured elsewhere (a Redis the caller runs).
    Given(StoreConfig),
}

/// Where the gateways' backend cluster points.
#[derive(Debug, Clone, Copy)]
enum Upstream {
    None,
    Demo(Timings),
    At(SocketAddr),
}

/// How the rig runs the sidecar, the demo backend and its gateway.
#[derive(Debug, Clone)]
enum Launch {
    /// In this process, each on a runtime (or worker threads) of its own.
    InProcess,
    /// As child processes of the binaries in `bin_dir`, logging to `log_dir`.
    Processes { bin_dir: PathBuf, log_dir: PathBuf },
}

/// A change to the sidecar's configuration, made before it starts.
type TuneSidecar = Box<dyn FnOnce(&mut SidecarConfig)>;

/// What a [`Rig`] runs; [`RigBuilder::start`] starts it.
pub struct RigBuilder {
    launch: Launch,
    store: Store,
    upstream: Upstream,
    fault_proxies: bool,
    gateway: Option<Shipped>,
    tune_sidecar: Option<TuneSidecar>,
    sidecar_workers: usize,
    cancelled: Option<Arc<AtomicBool>>,
}

impl RigBuilder {
    /// The sidecar on a `redis-server` the rig starts on a free port (the memory store
    /// otherwise).
    pub fn redis(mut self) -> Self {
        self.store = Store::OwnRedis;
        self
    }

    /// The sidecar on `store` (a Redis the caller runs).
    pub fn store(mut self, store: StoreConfig) -> Self {
        self.store = Store::Given(store);
        self
    }

    /// The demo backend, working for `timings`.
    pub fn demo_backend(mut self, timings: Timings) -> Self {
        self.upstream = Upstream::Demo(timings);
        self
    }

    /// Gateways send upstream calls to `addr` (an upstream already listening).
    pub fn backend_at(mut self, addr: SocketAddr) -> Self {
        self.upstream = Upstream::At(addr);
        self
    }

    /// A fault proxy on every hop: sidecar → Redis (when the rig runs its own Redis),
    /// gateway → sidecar, gateway → backend.
    pub fn fault_proxies(mut self) -> Self {
        self.fault_proxies = true;
        self
    }

    /// Changes the sidecar's configuration (timeouts, token) before it starts; in this
    /// process only (a sidecar process is configured by its store and address).
    pub fn sidecar(mut self, tune: impl FnOnce(&mut SidecarConfig) + 'static) -> Self {
        self.tune_sidecar = Some(Box::new(tune));
        self
    }

    /// The in-process sidecar's runtime worker threads ([`TEST_WORKERS`] unless told).
    pub fn sidecar_workers(mut self, workers: usize) -> Self {
        self.sidecar_workers = workers;
        self
    }

    /// The rig's own gateway, running `shipped` with its ports pointed at the rig (the
    /// listener and admin on free ports); started last, in the rig's launch mode.
    pub fn gateway(mut self, shipped: Shipped) -> Self {
        self.gateway = Some(shipped);
        self
    }

    /// Runs the sidecar, the demo backend and the gateway as child processes of
    /// `idemgate-sidecar`, `idemgate-demo-backend` and `idemgate-gateway` in `bin_dir`, each
    /// logging to `<log_dir>/<part>.log`. Each child dies with the thread that started it
    /// (`PR_SET_PDEATHSIG` on Linux): start the rig on a thread that outlives it.
    pub fn as_processes(
        mut self,
        bin_dir: impl Into<PathBuf>,
        log_dir: impl Into<PathBuf>,
    ) -> Self {
        self.launch = Launch::Processes {
            bin_dir: bin_dir.into(),
            log_dir: log_dir.into(),
        };
        self
    }

    /// A start still waiting for its processes gives up once `flag` is set (the demo sets
    /// it on SIGINT and SIGTERM), stopping what it started.
    pub fn cancelled_by(mut self, flag: Arc<AtomicBool>) -> Self {
        self.cancelled = Some(flag);
        self
    }

    /// Chooses the ports, starts every part, and returns once each accepts connections. A
    /// start that fails (or is cancelled) stops what it had started.
    pub fn start(self) -> Result<Rig> {
        let redis = match self.store {
            Store::OwnRedis => Some(
                RedisServer::start().context("starting redis-server (apt install redis-server)")?,
            ),
            Store::Memory | Store::Given(_) => None,
        };
        let mut store = match (&self.store, &redis) {
            (Store::Given(store), _) => store.clone(),
            (_, Some(redis)) => redis.store_config(),
            (_, None) => StoreConfig::Memory,
        };
        let redis_proxy = match (&redis, self.fault_proxies) {
            (Some(redis), true) => {
                let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port())))
                    .context("the Redis proxy")?;
                if let StoreConfig::Redis(r) = &mut store {
                    r.urls = vec![format!("redis://{}", proxy.addr())];
                }
                Some(proxy)
            }
            _ => None,
        };
        let mut sidecar_config = SidecarConfig::loopback(store);
        if let Some(tune) = self.tune_sidecar {
            if matches!(self.launch, Launch::Processes { .. }) {
                bail!("a sidecar process takes no tuned configuration");
            }
            tune(&mut sidecar_config);
        }
        let mut rig = Rig {
            launch: self.launch,
            gateway: None,
            gateway_addr: None,
            gateway_admin: None,
            sidecar: None,
            sidecar_config,
            sidecar_workers: self.sidecar_workers,
            sidecar_proxy: None,
            demo: None,
            upstream: None,
            backend_proxy: None,
            redis_proxy,
            redis,
        };
        // From here on a failure drops `rig`, which stops what it holds.
        rig.start_sidecar(false)?;
        rig.sidecar_proxy = self
            .fault_proxies
            .then(|| FaultProxy::start(rig.sidecar_addr()))
            .transpose()
            .context("the sidecar proxy")?;
        rig.upstream = match self.upstream {
            Upstream::None => None,
            Upstream::At(addr) => Some(addr),
            Upstream::Demo(timings) => {
                let (part, addr) = rig.start_demo_backend(timings)?;
                rig.demo = Some(part);
                Some(addr)
            }
        };
        rig.backend_proxy = match (rig.upstream, self.fault_proxies) {
            (Some(addr), true) => Some(FaultProxy::start(addr).context("the backend proxy")?),
            _ => None,
        };
        if let Some(shipped) = &self.gateway {
            rig.start_gateway(shipped)?;
        }
        rig.wait_ready(self.cancelled.as_deref())?;
        Ok(rig)
    }
}

/// The sidecar, in this process or as a child.
enum SidecarPart {
    InProcess(InProcessSidecar),
    Process(ChildProcess),
}

/// The demo backend, in this process or as a child.
enum BackendPart {
    InProcess(DemoBackend),
    Process(ChildProcess),
}

/// The rig's own gateway, in this process or as a child.
enum GatewayPart {
    InProcess(LiveGateway),
    Process(ChildProcess),
}

/// The running parts; stopping or dropping the rig stops them (the rig's gateway first,
/// Redis last: fields drop in this order). Gateways started with [`Rig::shipped`] are
/// stopped by their owners.
pub struct Rig {
    launch: Launch,
    gateway: Option<GatewayPart>,
    gateway_addr: Option<SocketAddr>,
    gateway_admin: Option<SocketAddr>,
    sidecar: Option<SidecarPart>,
    sidecar_config: SidecarConfig,
    sidecar_workers: usize,
    sidecar_proxy: Option<FaultProxy>,
    demo: Option<BackendPart>,
    upstream: Option<SocketAddr>,
    backend_proxy: Option<FaultProxy>,
    redis_proxy: Option<FaultProxy>,
    redis: Option<RedisServer>,
}

impl Rig {
    /// A rig in this process with the sidecar on its memory store and no backend, until
    /// told otherwise.
    pub fn builder() -> RigBuilder {
        RigBuilder {
            launch: Launch::InProcess,
            store: Store::Memory,
            upstream: Upstream::None,
            fault_proxies: false,
            gateway: None,
            tune_sidecar: None,
            sidecar_workers: TEST_WORKERS,
            cancelled: None,
        }
    }

    /// Starts the sidecar on `sidecar_config`: in this process on a port of its own (the
    /// same port again once it has one), or as a process on a free port (`restart`: the
    /// same port, its log appended to).
    fn start_sidecar(&mut self, restart: bool) -> Result<()> {
        let part = match &self.launch {
            Launch::InProcess if restart => SidecarPart::InProcess(InProcessSidecar::start_on(
                &self.sidecar_config,
                self.sidecar_workers,
            )?),
            Launch::InProcess => {
                let sidecar = InProcessSidecar::start_with_workers(
                    self.sidecar_config.clone(),
                    self.sidecar_workers,
                )?;
                // Restarts bind the same address.
                self.sidecar_config.listen = sidecar.addr();
                SidecarPart::InProcess(sidecar)
            }
            Launch::Processes { bin_dir, log_dir } => {
                if !restart {
                    self.sidecar_config.listen = free_port()?;
                }
                let command = sidecar_command(bin_dir, &self.sidecar_config)?;
                SidecarPart::Process(ChildProcess::spawn("sidecar", command, log_dir, restart)?)
            }
        };
        self.sidecar = Some(part);
        Ok(())
    }

    fn start_demo_backend(&self, timings: Timings) -> Result<(BackendPart, SocketAddr)> {
        Ok(match &self.launch {
            Launch::InProcess => {
                let demo = DemoBackend::start(timings)?;
                let addr = demo.addr();
                (BackendPart::InProcess(demo), addr)
            }
            Launch::Processes { bin_dir, log_dir } => {
                let addr = free_port()?;
                let ms = |d: Duration| d.as_millis().to_string();
                let mut command = Command::new(bin_dir.join("idemgate-demo-backend"));
                command
                    .args(["--listen", &addr.to_string()])
                    .args(["--bot-spawn-ms", &ms(timings.bot_spawn)])
                    .args(["--attach-ms", &ms(timings.attach)])
                    .args(["--payment-ms", &ms(timings.payment)]);
                let child = ChildProcess::spawn("demo backend", command, log_dir, false)?;
                (BackendPart::Process(child), addr)
            }
        })
    }

    fn start_gateway(&mut self, shipped: &Shipped) -> Result<()> {
        let backend = self
            .backend_hop()
            .context("the rig's gateway needs a backend")?;
        let sidecar = self.sidecar_hop();
        let part = match &self.launch {
            Launch::InProcess => {
                let gateway = self.shipped(shipped)?;
                self.gateway_addr = Some(gateway.addr());
                self.gateway_admin = gateway.gateway().admin_address();
                GatewayPart::InProcess(gateway)
            }
            Launch::Processes { bin_dir, log_dir } => {
                let (listener, admin) = (free_port()?, free_port()?);
                let command =
                    shipped.command(bin_dir, backend, sidecar, listener.port(), admin.port())?;
                self.gateway_addr = Some(listener);
                self.gateway_admin = Some(admin);
                GatewayPart::Process(ChildProcess::spawn("gateway", command, log_dir, false)?)
            }
        };
        self.gateway = Some(part);
        Ok(())
    }

    /// The rig's child processes, with the address each serves on.
    fn processes(&mut self) -> Vec<(&mut ChildProcess, SocketAddr)> {
        let mut processes = Vec::new();
        if let (Some(BackendPart::Process(child)), Some(addr)) = (&mut self.demo, self.upstream) {
            processes.push((child, addr));
        }
        if let Some(SidecarPart::Process(child)) = &mut self.sidecar {
            processes.push((child, self.sidecar_config.listen));
        }
        if let (Some(GatewayPart::Process(child)), Some(addr)) =
            (&mut self.gateway, self.gateway_addr)
        {
            processes.push((child, addr));
        }
        processes
    }

    /// The process ids of the rig's child processes (none in this process's launch mode).
    pub fn process_ids(&mut self) -> Vec<u32> {
        self.processes()
            .into_iter()
            .filter_map(|(child, _)| child.id())
            .collect()
    }

    /// Waits (bounded) until every child process accepts connections, failing early if one
    /// exits or `cancelled` is set. Parts in this process are ready once started.
    fn wait_ready(&mut self, cancelled: Option<&AtomicBool>) -> Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        let mut processes = self.processes();
        let waits: Vec<(&'static str, SocketAddr)> = processes
            .iter()
            .map(|(child, addr)| (child.name(), *addr))
            .collect();
        for (name, addr) in waits {
            while TcpStream::connect(addr).is_err() {
                if cancelled.is_some_and(|flag| flag.load(Ordering::Acquire)) {
                    bail!("the start was cancelled");
                }
                for (child, _) in &mut processes {
                    child.check_running()?;
                }
                if Instant::now() > deadline {
                    bail!("the {name} did not listen on {addr} within {READY_WITHIN:?}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// Where the sidecar itself listens (the same address across restarts).
    pub fn sidecar_addr(&self) -> SocketAddr {
        self.sidecar_config.listen
    }

    /// Where gateways call the sidecar: its proxy, when the rig has fault proxies.
    pub fn sidecar_hop(&self) -> SocketAddr {
        self.sidecar_proxy
            .as_ref()
            .map_or(self.sidecar_addr(), FaultProxy::addr)
    }

    /// Where the backend itself listens; `None` for a rig without a backend.
    pub fn backend_addr(&self) -> Option<SocketAddr> {
        self.upstream
    }

    /// Where gateways send upstream calls: the backend's proxy, when the rig has fault
    /// proxies. `None` for a rig without a backend.
    pub fn backend_hop(&self) -> Option<SocketAddr> {
        match &self.backend_proxy {
            Some(proxy) => Some(proxy.addr()),
            None => self.upstream,
        }
    }

    /// Where clients reach the rig's own gateway ([`RigBuilder::gateway`]).
    pub fn gateway_addr(&self) -> Option<SocketAddr> {
        self.gateway_addr
    }

    /// The rig's own gateway's admin endpoint (`/stats`).
    pub fn gateway_admin(&self) -> Option<SocketAddr> {
        self.gateway_admin
    }

    /// The rig's own gateway, when it runs in this process (its metrics and logs).
    pub fn live_gateway(&self) -> Option<&LiveGateway> {
        match &self.gateway {
            Some(GatewayPart::InProcess(gateway)) => Some(gateway),
            Some(GatewayPart::Process(_)) | None => None,
        }
    }

    /// The demo backend's ground truth, when it runs in this process (a backend process
    /// serves it on `GET /stats`).
    pub fn backend(&self) -> Option<&Arc<Backend>> {
        match &self.demo {
            Some(BackendPart::InProcess(demo)) => Some(demo.backend()),
            Some(BackendPart::Process(_)) | None => None,
        }
    }

    /// What the demo backend executed so far; `None` when it does not run in this process
    /// (never an empty record a test could mistake for "nothing ran").
    pub fn stats(&self) -> Option<Stats> {
        self.backend().map(|b| b.stats())
    }

    /// The rig's own `redis-server`, when it runs one.
    pub fn redis(&self) -> Option<&RedisServer> {
        self.redis.as_ref()
    }

    pub fn redis_mut(&mut self) -> Option<&mut RedisServer> {
        self.redis.as_mut()
    }

    pub fn redis_proxy(&self) -> Option<&FaultProxy> {
        self.redis_proxy.as_ref()
    }

    pub fn sidecar_proxy(&self) -> Option<&FaultProxy> {
        self.sidecar_proxy.as_ref()
    }

    pub fn backend_proxy(&self) -> Option<&FaultProxy> {
        self.backend_proxy.as_ref()
    }

    /// The sidecar's configuration (its store, its address).
    pub fn sidecar_config(&self) -> &SidecarConfig {
        &self.sidecar_config
    }

    /// Kills the sidecar as a crash would (see [`InProcessSidecar::kill`]; a process is
    /// sent SIGKILL and reaped).
    pub fn kill_sidecar(&mut self) -> Result<()> {
        match self.sidecar.take() {
            Some(SidecarPart::InProcess(sidecar)) => sidecar.kill(),
            Some(SidecarPart::Process(mut child)) => child.stop().map(drop),
            None => Ok(()),
        }
    }

    /// A new sidecar on the killed one's address, over the same store (killing the running
    /// one first, if any).
    pub fn restart_sidecar(&mut self) -> Result<()> {
        self.kill_sidecar()?;
        self.start_sidecar(true)?;
        self.wait_ready(None)
    }

    /// Another sidecar in this process on the same store, on a port of its own, with as many
    /// workers as the first.
    pub fn another_sidecar(&self) -> Result<InProcessSidecar> {
        InProcessSidecar::start_with_workers(
            SidecarConfig {
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                ..self.sidecar_config.clone()
            },
            self.sidecar_workers,
        )
    }

    /// Redis loses everything it held, as a restart without persistence would.
    pub fn empty_redis(&self) -> Result<()> {
        let redis = self.redis.as_ref().context("the rig runs no Redis")?;
        redis.cli(&["FLUSHALL"]).context("FLUSHALL")?;
        Ok(())
    }

    /// A gateway in this process running `envoy/envoy.yaml`, as `shipped` changes it,
    /// pointed at the rig.
    pub fn shipped(&self, shipped: &Shipped) -> Result<LiveGateway> {
        let backend = self.backend_hop().context("the rig has no backend")?;
        shipped.start(backend, self.sidecar_hop())
    }

    /// Stops every part — the gateway, then the sidecar (gracefully in this process,
    /// reporting how it ended), then the backend — and reaps every child process; the
    /// first failure is returned once all are stopped.
    pub fn stop(mut self) -> Result<()> {
        let gateway = match self.gateway.take() {
            Some(GatewayPart::InProcess(gateway)) => {
                gateway.shutdown();
                Ok(())
            }
            Some(GatewayPart::Process(mut child)) => child.stop().map(drop),
            None => Ok(()),
        };
        let sidecar = match self.sidecar.take() {
            Some(SidecarPart::InProcess(sidecar)) => sidecar.shutdown(),
            Some(SidecarPart::Process(mut child)) => child.stop().map(drop),
            None => Ok(()),
        };
        let backend = match self.demo.take() {
            Some(BackendPart::Process(mut child)) => child.stop().map(drop),
            Some(BackendPart::InProcess(_)) | None => Ok(()),
        };
        gateway.and(sidecar).and(backend)
    }
}

/// A loopback port nobody listens on right now, for a process to bind. Another process could
/// take it before ours binds; on a loopback-only test machine that race is rare and fails
/// loudly (the child exits on its bind error, and the start reports it).
fn free_port() -> Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// The `idemgate-sidecar` process (in `bin_dir`) for `config`: its address and store, the
/// rest at the binary's defaults.
fn sidecar_command(bin_dir: &Path, config: &SidecarConfig) -> Result<Command> {
    let mut command = Command::new(bin_dir.join("idemgate-sidecar"));
    command
        .args(["--listen", &config.listen.to_string()])
        // The flags below say which store; an inherited variable must not.
        .env_remove("REDIS_URL");
    if let StoreConfig::Redis(redis) = &config.store {
        if redis.tls != Default::default() {
            bail!("a sidecar process reads its Redis TLS material from files: not supported");
        }
        command
            .args(["--redis-url", &redis.urls.join(",")])
            .args(["--redis-prefix", &redis.prefix]);
        match &redis.topology {
            RedisTopology::Standalone => {}
            RedisTopology::Cluster => {
                command.arg("--redis-cluster");
            }
            RedisTopology::Sentinel { master } => {
                command.args(["--redis-sentinel-master", master]);
            }
        }
    }
    Ok(command)
}

/// The demo backend serving on a free loopback port, on a runtime of its own.
pub struct DemoBackend {
    backend: Arc<Backend>,
    addr: SocketAddr,
    runtime: tokio::runtime::Runtime,
}

impl DemoBackend {
    pub fn start(timings: Timings) -> Result<DemoBackend> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("the backend's runtime")?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .context("binding the demo backend")?;
        let addr = listener.local_addr()?;
        let backend = Backend::new(timings);
        runtime.spawn(backend::serve(
            listener,
            Arc::clone(&backend),
            std::future::pending(),
        ));
        Ok(DemoBackend {
            backend,
            addr,
            runtime,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its ground truth.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    /// The runtime it serves on, for clients that want one (the scenario player).
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.runtime
    }
}
