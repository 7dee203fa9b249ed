//! Scenario fixtures: a Redis + sidecar stack, gateways (a `TestHost` each, i.e. one Envoy
//! process, with N worker VMs running `target/idemgate.wasm`) and callout pumping.

use idemgate_host::testing::{Request, TestHost, TestStream, TestVm};
use idemgate_sidecar::testing::RedisServer;
use idemgate_sidecar::{Config as SidecarConfig, Sidecar};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

/// Cluster name the filter's callouts use in every scenario.
pub const SIDECAR: &str = "idemgate_sidecar";
pub const VM_ID: &str = "idemgate";

/// A real `redis-server` and an in-process sidecar in front of it.
pub struct Stack {
    pub redis: RedisServer,
    runtime: tokio::runtime::Runtime,
    sidecar: Option<Sidecar>,
    pub addr: SocketAddr,
}

impl Stack {
    pub fn start() -> Stack {
        let redis = RedisServer::start().expect("redis-server starts (apt install redis-server)");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let sidecar = runtime
            .block_on(Sidecar::spawn(SidecarConfig::loopback(
                redis.store_config(),
            )))
            .expect("sidecar starts");
        let addr = sidecar.addr();
        Stack {
            redis,
            runtime,
            sidecar: Some(sidecar),
            addr,
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(sidecar) = self.sidecar.take() {
            let _ = self.runtime.block_on(sidecar.shutdown());
        }
    }
}

/// A loopback address nothing listens on (connects are refused).
pub fn dead_address() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    addr
}

/// The plugin configuration with `rules` (a JSON array) and extra top-level fields.
pub fn config(extra: &str, rules: &str) -> String {
    let sep = if extra.is_empty() { "" } else { "," };
    format!(
        r#"{{"sidecar":{{"cluster":"{SIDECAR}","timeout":"5s"}},"tick":"100ms"{sep}{extra},"rules":{rules}}}"#
    )
}

/// One Envoy process: its host (shared data, metrics, clock) and worker VMs.
pub struct Gateway {
    pub host: TestHost,
    pub workers: Vec<TestVm>,
}

impl Gateway {
    pub fn boot(sidecar: SocketAddr, config: &str, workers: usize) -> Gateway {
        Gateway::boot_with(sidecar, config, workers, false)
    }

    pub fn boot_with(
        sidecar: SocketAddr,
        config: &str,
        workers: usize,
        allow_stop: bool,
    ) -> Gateway {
        let host = TestHost::new().cluster_at(SIDECAR, sidecar);
        let workers = host
            .plugin("target/idemgate.wasm")
            .name("idemgate")
            .vm_id(VM_ID)
            .config(config)
            .allow_on_headers_stop_iteration(allow_stop)
            .boot_workers(workers)
            .expect("target/idemgate.wasm boots (build it with `cargo xtask wasm`)");
        Gateway { host, workers }
    }

    pub fn worker(&self, i: usize) -> &TestVm {
        &self.workers[i % self.workers.len()]
    }

    /// Fires due ticks (the root dispatches queued callouts on a 1 ms tick) and forwards
    /// every callout to the sidecar, until none is left. Blocks on each answer.
    pub fn pump(&self) {
        self.pump_except(&[]);
    }

    /// [`Gateway::pump`], leaving alone the callouts `(worker, token)` a test forwards itself
    /// (long-polls running on their own threads).
    pub fn pump_except(&self, busy: &[(usize, u32)]) {
        for _ in 0..50 {
            self.host.advance(Duration::from_millis(2));
            let mut forwarded = 0;
            for (i, worker) in self.workers.iter().enumerate() {
                for call in worker.pending_callouts() {
                    if !busy.contains(&(i, call.token)) && worker.forward_callout(call.token) {
                        forwarded += 1;
                    }
                }
            }
            if forwarded == 0 {
                return;
            }
        }
        panic!("callouts kept coming");
    }

    /// Callouts waiting on every worker: `(worker, token, path)`.
    pub fn pending(&self) -> Vec<(usize, u32, String)> {
        self.workers
            .iter()
            .enumerate()
            .flat_map(|(i, w)| {
                w.pending_callouts().into_iter().map(move |c| {
                    (
                        i,
                        c.token,
                        c.headers.get(":path").unwrap_or_default().to_string(),
                    )
                })
            })
            .collect()
    }

    pub fn counter(&self, name: &str) -> i64 {
        self.host.metric(name).map_or(0, |m| m.value)
    }

    pub fn shared_keys(&self) -> usize {
        self.host.shared().shared_data_keys(VM_ID).len()
    }
}

pub fn post(path: &str, key: &str, body: &str) -> Request {
    Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body)
}

/// The upstream's `x-fencing-token`, if the request went upstream.
pub fn fence(stream: &TestStream) -> Option<u64> {
    stream
        .upstream_headers()?
        .get("x-fencing-token")?
        .parse()
        .ok()
}

pub fn problem_type(stream: &TestStream) -> String {
    let body: serde_json::Value =
        serde_json::from_slice(&stream.response_body()).expect("a JSON problem");
    body["type"].as_str().unwrap_or_default().to_string()
}
