//! The gateway groups' stack: the rig (`idemgate_rig`) with the sidecar on the memory store
//! or Redis, a backend, and `idemgate-gateway` running the shipped `envoy/envoy.yaml` with its
//! ports, filter module and plugin configuration replaced. What ships is what is measured:
//! the listener, route timeout and the sidecar cluster (h2c, circuit breakers) are the file's.

use anyhow::{Context, Result};
use idemgate_rig::Rig;
use idemgate_rig::backend::{Backend, Timings};
use idemgate_rig::gateway::{Shipped, shipped};
use idemgate_sidecar::StoreConfig;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

/// The shipped bootstrap's sidecar cluster, which the plugin configuration names.
const SIDECAR: &str = shipped::SIDECAR;

/// Runtime worker threads of the benchmarks' sidecar: what the shipped Deployment gives a pod
/// (`envoy/kubernetes/base/sidecar.yaml`: `IDEMGATE_WORKER_THREADS` is the container's CPU
/// request in whole CPUs, rounded up, and the request is 100m). A test below holds the two
/// together.
pub const SIDECAR_WORKERS: usize = 1;

/// How a lock rule treats a call for a resource another call holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    Queue,
    Reject,
}

/// The plugin configuration of the gateway groups: `POST /agents/{agent_id}/tools` is a
/// lock on the agent (queued or rejected per `conflict`; a queue deep enough for the
/// hand-off group's 100 callers), `POST /payments` is idempotent per (`x-user-id`,
/// `Idempotency-Key`) and rejects duplicates of a running call (409) or queues them as the
/// shipped rule does (`max_wait` 10 s, `max_queue` 16). Everything else matches no rule.
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
    let mut payments = serde_json::json!({
        "name": "payments", "match": {"methods": ["POST"], "path_prefix": "/payments"},
        "mode": "idempotency", "key": {"header": "idempotency-key"},
        "scope": {"headers": ["x-user-id"]}, "on_conflict": "reject", "lease": "30s"
    });
    if conflict == Conflict::Queue {
        payments["on_conflict"] = "queue".into();
        payments["queue"] = serde_json::json!({"max_wait": "10s"});
    }
    serde_json::json!({
        "sidecar": {"cluster": SIDECAR, "timeout": "1s"},
        "failure_mode": "closed",
        "rules": [attach, payments]
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

/// A running stack; dropping it stops the gateway, the sidecar and the demo backend.
pub struct Stack {
    rig: Rig,
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
        let rig = Rig::builder()
            .store(store)
            .sidecar_workers(SIDECAR_WORKERS)
            .gateway(
                Shipped::default()
                    .envoy_yaml(spec.envoy_yaml)
                    .module(spec.module)
                    .plugin(spec.plugin_config.clone())
                    .workers(spec.workers)
                    .quiet(),
            );
        let rig = match backend {
            BackendSpec::Demo => rig.demo_backend(Timings::default()),
            BackendSpec::At(addr) => rig.backend_at(addr),
        }
        .start()?;
        Ok(Stack {
            backend: rig.backend().cloned(),
            gateway_addr: rig.gateway_addr().context("the rig runs a gateway")?,
            sidecar_addr: rig.sidecar_addr(),
            rig,
        })
    }

    /// A counter of the filter's metrics (0 when never incremented).
    pub fn plugin_counter(&self, name: &str) -> i64 {
        self.rig.live_gateway().map_or(0, |g| g.counter(name))
    }

    /// Stops the gateway, then the sidecar, reporting how the sidecar ended.
    pub fn stop(self) -> Result<()> {
        self.rig.stop()
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
    use serde::Deserialize;

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

    /// The shipped Deployment sizes the sidecar's runtime by its CPU request, and that
    /// request rounds up to the workers the benchmarks run.
    #[test]
    fn the_benchmarks_run_the_sidecar_with_the_shipped_workers() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../envoy/kubernetes/base/sidecar.yaml"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let deployment = serde_norway::Deserializer::from_str(&text)
            .map(|doc| serde_norway::Value::deserialize(doc).unwrap())
            .find(|doc| doc["kind"] == "Deployment")
            .expect("a Deployment");
        let container = deployment["spec"]["template"]["spec"]["containers"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "sidecar")
            .expect("the sidecar container");
        let workers = container["env"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "IDEMGATE_WORKER_THREADS")
            .expect("IDEMGATE_WORKER_THREADS");
        let from = &workers["valueFrom"]["resourceFieldRef"];
        assert_eq!(from["containerName"], "sidecar");
        assert_eq!(from["resource"], "requests.cpu");
        assert_eq!(from["divisor"], "1");
        let request = container["resources"]["requests"]["cpu"].as_str().unwrap();
        let millicpus: usize = match request.strip_suffix('m') {
            Some(m) => m.parse().unwrap(),
            None => request.parse::<usize>().unwrap() * 1000,
        };
        assert_eq!(
            millicpus.div_ceil(1000),
            SIDECAR_WORKERS,
            "cpu request {request}"
        );
    }

    #[test]
    fn configurations_parse_as_json() {
        for conflict in [Conflict::Queue, Conflict::Reject] {
            let config: serde_json::Value = serde_json::from_str(&plugin_config(conflict)).unwrap();
            assert_eq!(config["rules"].as_array().map(Vec::len), Some(2));
        }
    }
}
