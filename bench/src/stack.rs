//! An in-process idemgate stack for the gateway groups: the sidecar (memory or Redis
//! store), a backend, and `idemgate-gateway` running the shipped `envoy/envoy.yaml` with its
//! ports, filter module and plugin configuration replaced. What ships is what is measured:
//! the listener, route timeout and the sidecar cluster (h2c, circuit breakers) are the file's.

use anyhow::{Context, Result};
use idemgate_demo::backend::{Backend, Timings};
use idemgate_host::gateway::config::EnvoyConfig;
use idemgate_host::gateway::{Gateway, GatewayOptions};
use idemgate_host::{LogLevel, Metric};
use idemgate_sidecar::{Config, Sidecar, StoreConfig};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The shipped bootstrap's listener, backend cluster and sidecar cluster.
const LISTENER: &str = "ingress";
const BACKEND: &str = "backend";
const SIDECAR: &str = "idemgate_sidecar";

/// How a lock rule treats a call for a resource another call holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    Queue,
    Reject,
}

/// The plugin configuration of the gateway groups: `POST /agents/{agent_id}/tools` is a
/// lock on the agent (queued or rejected per `conflict`; a queue deep enough for the
/// hand-off group's 100 callers), `POST /payments` is idempotent per (`x-user-id`,
/// `Idempotency-Key`) and rejects duplicates of a running call (409). Everything else
/// matches no rule.
pub fn plugin_config(conflict: Conflict) -> String {
    let attach = match conflict {
        Conflict::Queue => serde_json::json!({
            "name": "attach-tool",
            "match": {"methods": ["POST"], "path_template": "/agents/{agent_id}/tools"},
            "mode": "lock", "key": {"path_param": "agent_id"}, "lease": "30s",
            "on_conflict": "queue", "queue": {"max_wait": "50s", "max_queue": 500}
        }),
        Conflict::Reject => serde_json::json!({
            "name": "attach-tool",
            "match": {"methods": ["POST"], "path_template": "/agents/{agent_id}/tools"},
            "mode": "lock", "key": {"path_param": "agent_id"}, "lease": "30s",
            "on_conflict": "reject"
        }),
    };
    serde_json::json!({
        "sidecar": {"cluster": SIDECAR, "timeout": "1s"},
        "failure_mode": "closed",
        "rules": [
            attach,
            {"name": "payments", "match": {"methods": ["POST"], "path_prefix": "/payments"},
             "mode": "idempotency", "key": {"header": "idempotency-key"},
             "scope": {"headers": ["x-user-id"]}, "on_conflict": "reject", "lease": "30s"}
        ]
    })
    .to_string()
}

/// What the gateway runs.
pub struct GatewaySpec<'a> {
    /// The shipped Envoy bootstrap (`envoy/envoy.yaml`).
    pub envoy_yaml: &'a Path,
    /// The filter module: `idemgate.wasm`, or the no-op filter as a baseline.
    pub module: &'a Path,
    /// The plugin configuration (ignored by the no-op filter).
    pub plugin_config: String,
    /// Worker threads, each with its own VM.
    pub workers: usize,
}

/// A running stack; dropping the runtime stops the sidecar and the demo backend.
pub struct Stack {
    runtime: tokio::runtime::Runtime,
    sidecar: Option<Sidecar>,
    gateway: Option<Gateway>,
    /// The demo backend's ground truth, when the stack runs the demo backend.
    pub backend: Option<Arc<Backend>>,
    pub gateway_addr: SocketAddr,
    pub sidecar_addr: SocketAddr,
}

/// Where the stack's backend comes from.
pub enum BackendSpec {
    /// The demo backend (ground truth: executions, spans, overlap), started in the stack.
    Demo,
    /// An upstream already listening.
    At(SocketAddr),
}

impl Stack {
    pub fn start(
        store: StoreConfig,
        backend: BackendSpec,
        spec: &GatewaySpec<'_>,
    ) -> Result<Stack> {
        // Named so a group can tell the sidecar's CPU time (and the demo backend's, when the
        // stack runs it) apart from the gateway's.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(crate::sidecar_load::SIDECAR_THREADS)
            .enable_all()
            .build()?;
        let sidecar = runtime.block_on(Sidecar::spawn(Config::loopback(store)))?;
        let sidecar_addr = sidecar.addr();
        let (backend_addr, demo) = match backend {
            BackendSpec::At(addr) => (addr, None),
            BackendSpec::Demo => {
                let demo = Backend::new(Timings::default());
                let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
                let addr = listener.local_addr()?;
                let served = Arc::clone(&demo);
                runtime.spawn(async move {
                    let _ = idemgate_demo::backend::serve(
                        listener,
                        served,
                        std::future::pending::<()>(),
                    )
                    .await;
                });
                (addr, Some(demo))
            }
        };
        let mut config = EnvoyConfig::load(spec.envoy_yaml)
            .with_context(|| format!("loading {}", spec.envoy_yaml.display()))?;
        config.admin = None;
        config.set_port(LISTENER, 0)?;
        config.set_port(BACKEND, backend_addr.port())?;
        config.set_port(SIDECAR, sidecar_addr.port())?;
        for listener in &mut config.listeners {
            if let Some(wasm) = listener.wasm.as_mut() {
                wasm.code = PathBuf::from(spec.module);
                wasm.settings.configuration = spec.plugin_config.clone().into_bytes();
            }
        }
        let gateway = Gateway::start(
            config,
            GatewayOptions {
                concurrency: spec.workers,
                log_level: Some(LogLevel::Error),
                ..GatewayOptions::default()
            },
        )?;
        let gateway_addr = gateway
            .listener_address(LISTENER)
            .context("the gateway has no ingress listener")?;
        Ok(Stack {
            runtime,
            sidecar: Some(sidecar),
            gateway: Some(gateway),
            backend: demo,
            gateway_addr,
            sidecar_addr,
        })
    }

    /// The filter's metrics (`idemgate.*`), summed over workers as Envoy shows them.
    pub fn plugin_metrics(&self) -> BTreeMap<String, Metric> {
        self.gateway
            .as_ref()
            .map(|g| g.shared().metrics())
            .unwrap_or_default()
    }

    /// A counter of the filter's metrics (0 when never incremented).
    pub fn plugin_counter(&self, name: &str) -> i64 {
        self.plugin_metrics().get(name).map_or(0, |m| m.value)
    }

    /// Stops the gateway, then the sidecar, reporting how the sidecar ended.
    pub fn stop(mut self) -> Result<()> {
        self.halt()
    }

    fn halt(&mut self) -> Result<()> {
        if let Some(gateway) = self.gateway.take() {
            gateway.shutdown();
        }
        if let Some(sidecar) = self.sidecar.take() {
            self.runtime.block_on(sidecar.shutdown())?;
        }
        Ok(())
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // Dropped on an error path: the error being returned matters more than this one.
        let _ = self.halt();
    }
}

/// Sum of the samples of `metric` (a Prometheus counter family, every label set) in a
/// text exposition.
pub fn prometheus_sum(exposition: &str, metric: &str) -> f64 {
    exposition
        .lines()
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_a_counter_family() {
        let text = "# HELP idemgate_sidecar_claims_total x\n\
                    idemgate_sidecar_claims_total{outcome=\"granted\"} 3\n\
                    idemgate_sidecar_claims_total{outcome=\"busy\"} 2\n\
                    idemgate_sidecar_claims_total_other 9\n\
                    idemgate_sidecar_waiters 4\n";
        assert_eq!(prometheus_sum(text, "idemgate_sidecar_claims_total"), 5.0);
        assert_eq!(prometheus_sum(text, "idemgate_sidecar_waiters"), 4.0);
        assert_eq!(prometheus_sum(text, "missing"), 0.0);
    }

    #[test]
    fn configurations_parse_as_json() {
        for conflict in [Conflict::Queue, Conflict::Reject] {
            let config: serde_json::Value = serde_json::from_str(&plugin_config(conflict)).unwrap();
            assert_eq!(config["rules"].as_array().map(Vec::len), Some(2));
        }
    }
}
