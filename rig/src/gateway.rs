//! Live gateways (`idemgate_host::gateway`, serving real HTTP) in front of a rig: the shipped
//! `envoy/envoy.yaml` with its ports pointed at the rig, or a bootstrap rendered by
//! `idemgate_host::gateway::bootstrap` where a test needs what the shipped file lacks.

use anyhow::{Context, Result};
use idemgate_host::gateway::bootstrap::{self, Bootstrap};
use idemgate_host::gateway::config::EnvoyConfig;
use idemgate_host::gateway::{Gateway, GatewayOptions};
use idemgate_host::{LogLevel, Metric};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The names `envoy/envoy.yaml` gives its listener, its admin endpoint and its clusters:
/// what the rig points at free ports (in process) or passes as `--set-port` (as a process).
pub mod shipped {
    pub const LISTENER: &str = "ingress";
    pub const ADMIN: &str = "admin";
    pub const BACKEND: &str = "backend";
    /// The backend's gRPC service over HTTP/2: the backend's own port.
    pub const BACKEND_GRPC: &str = "backend_grpc";
    pub const SIDECAR: &str = "idemgate_sidecar";
}

/// The workspace's root directory (where `envoy/` and `target/` are).
pub fn workspace_root() -> PathBuf {
    idemgate_host::target_dir().join("..")
}

/// The shipped Envoy bootstrap, `envoy/envoy.yaml`.
pub fn shipped_envoy_yaml() -> PathBuf {
    workspace_root().join("envoy/envoy.yaml")
}

/// The filter `cargo xtask wasm` builds, `target/idemgate.wasm`.
pub fn built_filter() -> PathBuf {
    idemgate_host::target_dir().join("idemgate.wasm")
}

/// The plugin configuration of `envoy/envoy.yaml` (its first listener's filter), as JSON to
/// edit.
pub fn shipped_plugin() -> Result<serde_json::Value> {
    let path = shipped_envoy_yaml();
    let config = EnvoyConfig::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let wasm = config
        .listeners
        .first()
        .and_then(|l| l.wasm.as_ref())
        .context("envoy/envoy.yaml's first listener runs no wasm filter")?;
    serde_json::from_slice(&wasm.settings.configuration)
        .context("the shipped plugin configuration is not JSON")
}

/// A gateway serving HTTP; dropping it shuts it down.
pub struct LiveGateway {
    gateway: Gateway,
    addr: SocketAddr,
}

impl LiveGateway {
    /// Runs `config` and serves on its listener `listener`.
    pub fn start(
        config: EnvoyConfig,
        options: GatewayOptions,
        listener: &str,
    ) -> Result<LiveGateway> {
        let gateway = Gateway::start(config, options)
            .context("the gateway starts (build target/idemgate.wasm: cargo xtask wasm)")?;
        let addr = gateway
            .listener_address(listener)
            .with_context(|| format!("the gateway has no listener {listener}"))?;
        Ok(LiveGateway { gateway, addr })
    }

    /// Runs a rendered bootstrap with `workers` worker threads.
    pub fn from_bootstrap(bootstrap: &Bootstrap, workers: usize) -> Result<LiveGateway> {
        let config = bootstrap.config().context("rendering the bootstrap")?;
        LiveGateway::start(
            config,
            GatewayOptions {
                concurrency: workers,
                ..GatewayOptions::default()
            },
            bootstrap::LISTENER,
        )
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The gateway itself (shared state, stats, admin address).
    pub fn gateway(&self) -> &Gateway {
        &self.gateway
    }

    /// The filter's metrics (`idemgate.*`), summed over workers as Envoy's admin shows them,
    /// read once every worker has run its tick since this call: the filter hands its
    /// counters to the host there, so they count every request answered before the call.
    /// A worker whose tick does not come within 10 s is reported, and the counters read as
    /// they are (a test then fails on the count).
    pub fn metrics(&self) -> BTreeMap<String, Metric> {
        if !self.gateway.await_ticks(Duration::from_secs(10)) {
            eprintln!("a gateway worker ran no tick within 10 s: its counters may lag");
        }
        self.gateway.shared().metrics()
    }

    /// A counter of the filter's metrics (0 when never incremented).
    pub fn counter(&self, name: &str) -> i64 {
        self.metrics().get(name).map_or(0, |m| m.value)
    }

    /// Every line the filter logged on this gateway.
    pub fn logs(&self) -> Vec<String> {
        self.gateway
            .shared()
            .logs()
            .into_iter()
            .map(|l| l.message)
            .collect()
    }

    /// Stops the gateway's workers and waits for them.
    pub fn shutdown(self) {
        self.gateway.shutdown();
    }
}

/// What a gateway running `envoy/envoy.yaml` changes in it, besides its ports.
#[derive(Debug, Clone)]
pub struct Shipped {
    envoy_yaml: PathBuf,
    module: PathBuf,
    plugin: Option<String>,
    workers: usize,
    admin: bool,
    log_level: Option<LogLevel>,
}

impl Default for Shipped {
    fn default() -> Self {
        Shipped {
            envoy_yaml: shipped_envoy_yaml(),
            module: built_filter(),
            plugin: None,
            workers: 1,
            admin: true,
            log_level: GatewayOptions::default().log_level,
        }
    }
}

impl Shipped {
    /// Another bootstrap of the same shape (listener, admin and cluster names).
    pub fn envoy_yaml(mut self, path: &Path) -> Self {
        self.envoy_yaml = path.to_owned();
        self
    }

    /// The filter module: `target/idemgate.wasm` unless set (the no-op filter is the
    /// benchmarks' baseline).
    pub fn module(mut self, path: &Path) -> Self {
        self.module = path.to_owned();
        self
    }

    /// The plugin configuration, instead of the file's.
    pub fn plugin(mut self, configuration: impl Into<String>) -> Self {
        self.plugin = Some(configuration.into());
        self
    }

    /// Worker threads, each with its own VM (1 unless set).
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// No admin endpoint, and only the plugin's errors logged: what the benchmarks measure.
    pub fn quiet(mut self) -> Self {
        self.admin = false;
        self.log_level = Some(LogLevel::Error);
        self
    }

    /// Starts it with the backend clusters (HTTP/1.1 and gRPC) at `backend` and the sidecar
    /// cluster at `sidecar`;
    /// the listener (and admin) on free ports.
    pub fn start(&self, backend: SocketAddr, sidecar: SocketAddr) -> Result<LiveGateway> {
        let mut config = EnvoyConfig::load(&self.envoy_yaml)
            .with_context(|| format!("loading {}", self.envoy_yaml.display()))?;
        if self.admin {
            config.set_port(shipped::ADMIN, 0)?;
        } else {
            config.admin = None;
        }
        config.set_port(shipped::LISTENER, 0)?;
        config.set_port(shipped::BACKEND, backend.port())?;
        config.set_port(shipped::BACKEND_GRPC, backend.port())?;
        config.set_port(shipped::SIDECAR, sidecar.port())?;
        config.set_wasm_path(&self.module);
        if let Some(plugin) = &self.plugin {
            for wasm in config.listeners.iter_mut().filter_map(|l| l.wasm.as_mut()) {
                wasm.settings.configuration = plugin.clone().into_bytes();
            }
        }
        LiveGateway::start(
            config,
            GatewayOptions {
                concurrency: self.workers,
                log_level: self.log_level,
                ..GatewayOptions::default()
            },
            shipped::LISTENER,
        )
    }

    /// The `idemgate-gateway` process (in `bin_dir`) that runs it, as [`Shipped::start`]
    /// would in this process: the backend cluster at `backend`, the sidecar cluster at
    /// `sidecar`, the listener on port `listener` and the admin endpoint on `admin`. The
    /// binary takes no plugin configuration and always serves its admin endpoint: a
    /// replaced plugin configuration or [`Shipped::quiet`] is an error here, not ignored.
    pub fn command(
        &self,
        bin_dir: &Path,
        backend: SocketAddr,
        sidecar: SocketAddr,
        listener: u16,
        admin: u16,
    ) -> Result<Command> {
        anyhow::ensure!(
            self.plugin.is_none(),
            "a gateway process runs the plugin configuration of its envoy.yaml"
        );
        anyhow::ensure!(
            self.admin,
            "a gateway process always serves its admin endpoint"
        );
        let mut command = Command::new(bin_dir.join("idemgate-gateway"));
        command
            .arg("--config")
            .arg(&self.envoy_yaml)
            .arg("--wasm-path")
            .arg(&self.module)
            .args(["--concurrency", &self.workers.to_string()])
            .args(["--log-level", log_level_flag(self.log_level)]);
        for (target, port) in [
            (shipped::LISTENER, listener),
            (shipped::ADMIN, admin),
            (shipped::BACKEND, backend.port()),
            (shipped::BACKEND_GRPC, backend.port()),
            (shipped::SIDECAR, sidecar.port()),
        ] {
            command.args(["--set-port", &format!("{target}={port}")]);
        }
        Ok(command)
    }
}

/// `idemgate-gateway --log-level`'s name for `level` (`None`: nothing logged).
fn log_level_flag(level: Option<LogLevel>) -> &'static str {
    match level {
        Some(LogLevel::Trace) => "trace",
        Some(LogLevel::Debug) => "debug",
        Some(LogLevel::Info) => "info",
        Some(LogLevel::Warn) => "warn",
        Some(LogLevel::Error) => "error",
        Some(LogLevel::Critical) => "critical",
        None => "off",
    }
}
