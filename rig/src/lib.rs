//! `idemgate-rig`: idemgate's stack on loopback, assembled one way for everything that runs
//! it — the demo (`cargo xtask demo`), the benchmarks, the end-to-end tests and the fault
//! suite.
//!
//! ```text
//! clients → gateway ─→ [sidecar proxy] → sidecar ─→ [redis proxy] → redis-server
//!                   └→ [backend proxy] → demo backend
//! ```
//!
//! [`Rig::builder`] starts the parts in this process: the sidecar on its memory store or on a
//! `redis-server` of its own ([`idemgate_sidecar::testing::RedisServer`]), the demo
//! [`backend`] (whose counters are the ground truth of what executed) or an upstream already
//! listening, and — for the fault suite — a [`fault_proxy::FaultProxy`] on every hop.
//! Gateways are started in front of the rig, as many as a test needs: [`Rig::shipped`] runs
//! the shipped `envoy/envoy.yaml` with its ports pointed at the rig;
//! [`gateway::LiveGateway::from_bootstrap`] runs one rendered by
//! `idemgate_host::gateway::bootstrap` at [`Rig::sidecar_hop`] and [`Rig::backend_hop`]. [`processes`] runs the same stack as child
//! processes, for the demo.

pub mod backend;
pub mod fault_proxy;
pub mod gateway;
pub mod processes;
pub mod sidecar;

use crate::backend::{Backend, Stats, Timings};
use crate::fault_proxy::FaultProxy;
use crate::gateway::{LiveGateway, Shipped};
use crate::sidecar::InProcessSidecar;
use anyhow::{Context, Result};
use idemgate_sidecar::testing::RedisServer;
use idemgate_sidecar::{Config as SidecarConfig, StoreConfig};
use std::net::SocketAddr;
use std::sync::Arc;

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

/// What a [`Rig`] runs; [`RigBuilder::start`] starts it.
pub struct RigBuilder {
    store: Store,
    upstream: Upstream,
    fault_proxies: bool,
    tune_sidecar: Box<dyn FnOnce(&mut SidecarConfig)>,
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

    /// The demo backend in this process, working for `timings`.
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

    /// Changes the sidecar's configuration (timeouts, token) before it starts.
    pub fn sidecar(mut self, tune: impl FnOnce(&mut SidecarConfig) + 'static) -> Self {
        self.tune_sidecar = Box::new(tune);
        self
    }

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
        (self.tune_sidecar)(&mut sidecar_config);
        let sidecar = InProcessSidecar::start(sidecar_config.clone())?;
        // Restarts bind the same address.
        sidecar_config.listen = sidecar.addr();
        let sidecar_proxy = self
            .fault_proxies
            .then(|| FaultProxy::start(sidecar.addr()))
            .transpose()
            .context("the sidecar proxy")?;
        let demo = match self.upstream {
            Upstream::Demo(timings) => Some(DemoBackend::start(timings)?),
            Upstream::None | Upstream::At(_) => None,
        };
        let upstream = match (&demo, self.upstream) {
            (Some(demo), _) => Some(demo.addr()),
            (None, Upstream::At(addr)) => Some(addr),
            (None, _) => None,
        };
        let backend_proxy = match (upstream, self.fault_proxies) {
            (Some(addr), true) => Some(FaultProxy::start(addr).context("the backend proxy")?),
            _ => None,
        };
        Ok(Rig {
            redis,
            redis_proxy,
            sidecar_config,
            sidecar: Some(sidecar),
            sidecar_proxy,
            demo,
            upstream,
            backend_proxy,
        })
    }
}

/// The running parts; dropping the rig stops them (gateways are dropped by their owners).
pub struct Rig {
    redis: Option<RedisServer>,
    redis_proxy: Option<FaultProxy>,
    sidecar_config: SidecarConfig,
    sidecar: Option<InProcessSidecar>,
    sidecar_proxy: Option<FaultProxy>,
    demo: Option<DemoBackend>,
    upstream: Option<SocketAddr>,
    backend_proxy: Option<FaultProxy>,
}

impl Rig {
    /// A rig with the sidecar on its memory store and no backend, until told otherwise.
    pub fn builder() -> RigBuilder {
        RigBuilder {
            store: Store::Memory,
            upstream: Upstream::None,
            fault_proxies: false,
            tune_sidecar: Box::new(|_| {}),
        }
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

    /// Where gateways send upstream calls: the backend's proxy, when the rig has fault
    /// proxies. `None` for a rig without a backend.
    pub fn backend_hop(&self) -> Option<SocketAddr> {
        match &self.backend_proxy {
            Some(proxy) => Some(proxy.addr()),
            None => self.upstream,
        }
    }

    /// The demo backend's ground truth, when the rig runs it.
    pub fn backend(&self) -> Option<&Arc<Backend>> {
        self.demo.as_ref().map(DemoBackend::backend)
    }

    /// What the demo backend executed so far; `None` when the rig does not run it (never
    /// an empty record a test could mistake for "nothing ran").
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

    /// Kills the sidecar as a crash would (see [`InProcessSidecar::kill`]).
    pub fn kill_sidecar(&mut self) -> Result<()> {
        match self.sidecar.take() {
            Some(sidecar) => sidecar.kill(),
            None => Ok(()),
        }
    }

    /// A new sidecar on the killed one's address, over the same store (killing the running
    /// one first, if any).
    pub fn restart_sidecar(&mut self) -> Result<()> {
        self.kill_sidecar()?;
        self.sidecar = Some(InProcessSidecar::start_on(&self.sidecar_config)?);
        Ok(())
    }

    /// Another sidecar on the same store, on a port of its own.
    pub fn another_sidecar(&self) -> Result<InProcessSidecar> {
        InProcessSidecar::start(SidecarConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            ..self.sidecar_config.clone()
        })
    }

    /// Redis loses everything it held, as a restart without persistence would.
    pub fn empty_redis(&self) -> Result<()> {
        let redis = self.redis.as_ref().context("the rig runs no Redis")?;
        redis.cli(&["FLUSHALL"]).context("FLUSHALL")?;
        Ok(())
    }

    /// A gateway running `envoy/envoy.yaml`, as `shipped` changes it, pointed at the rig.
    pub fn shipped(&self, shipped: &Shipped) -> Result<LiveGateway> {
        let backend = self.backend_hop().context("the rig has no backend")?;
        shipped.start(backend, self.sidecar_hop())
    }

    /// Stops the sidecar gracefully, reporting how it ended; the rest stops on drop.
    pub fn stop(mut self) -> Result<()> {
        match self.sidecar.take() {
            Some(sidecar) => sidecar.shutdown(),
            None => Ok(()),
        }
    }
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
