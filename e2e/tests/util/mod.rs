//! Scenario fixtures: a Redis + sidecar stack, gateways (a `TestHost` each, i.e. one Envoy
//! process, with N worker VMs running `target/idemgate.wasm`) and callout pumping; [`live`]
//! runs the same stack behind live gateways with the demo backend as upstream.

pub mod live;

use idemgate_host::testing::{Request, TestHost, TestStream, TestVm};
use idemgate_sidecar::testing::RedisServer;
use idemgate_sidecar::{Config as SidecarConfig, Sidecar};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Cluster name the filter's callouts use in every scenario.
pub const SIDECAR: &str = "idemgate_sidecar";
pub const VM_ID: &str = "idemgate";

/// A real `redis-server` and an in-process sidecar in front of it.
pub struct Stack {
    /// Runs as long as the stack (stopped on drop).
    redis: RedisServer,
    /// The sidecar's own runtime: shutting it down kills the sidecar outright.
    runtime: Option<tokio::runtime::Runtime>,
    sidecar: Option<Sidecar>,
    pub addr: SocketAddr,
}

fn sidecar_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

impl Stack {
    pub fn start() -> Stack {
        let redis = RedisServer::start().expect("redis-server starts (apt install redis-server)");
        let runtime = sidecar_runtime();
        let sidecar = runtime
            .block_on(Sidecar::spawn(SidecarConfig::loopback(
                redis.store_config(),
            )))
            .expect("sidecar starts");
        let addr = sidecar.addr();
        Stack {
            redis,
            runtime: Some(runtime),
            sidecar: Some(sidecar),
            addr,
        }
    }

    /// Kills the sidecar as a crash would: its runtime is dropped with every connection and
    /// long-poll in flight, nothing is released, Redis keeps what it holds.
    pub fn kill_sidecar(&mut self) {
        drop(self.sidecar.take());
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        // Bounded: the listener closes as the runtime's workers wind down.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(self.addr).is_ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "the killed sidecar still accepts"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts a new sidecar on the killed one's address, over the same Redis.
    pub fn restart_sidecar(&mut self) {
        let runtime = sidecar_runtime();
        let config = SidecarConfig {
            listen: self.addr,
            ..SidecarConfig::loopback(self.redis.store_config())
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let sidecar = loop {
            match runtime.block_on(Sidecar::spawn(config.clone())) {
                Ok(sidecar) => break sidecar,
                Err(e) => assert!(
                    std::time::Instant::now() < deadline,
                    "the sidecar cannot bind {} again: {e}",
                    self.addr
                ),
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        self.sidecar = Some(sidecar);
        self.runtime = Some(runtime);
    }

    /// Redis loses everything it held, as a restart without persistence would.
    pub fn empty_redis(&self) {
        self.redis.cli(&["FLUSHALL"]).expect("FLUSHALL");
    }

    /// The sidecar's `idemgate_sidecar_waiters` gauge: claims waiting in its queues.
    pub fn waiters(&self) -> u64 {
        let metrics = http(self.addr, "GET", "/metrics", &[], "");
        metrics
            .body
            .lines()
            .find_map(|l| l.strip_prefix("idemgate_sidecar_waiters "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Stack {
    /// Waits (bounded) until `n` claims wait in the sidecar's queue for the stored `key`.
    pub fn wait_for_queue(&self, key: &str, n: u64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let reply = http(self.addr, "GET", &format!("/admin/v1/keys/{key}"), &[], "");
            let info: serde_json::Value = serde_json::from_str(&reply.body).unwrap_or_default();
            if info["queue_len"].as_u64() == Some(n) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "queue of {key} never reached {n}: {reply:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The stored key a pending claim callout carries.
pub fn claim_key(vm: &TestVm, token: u32) -> String {
    let call = vm
        .pending_callouts()
        .into_iter()
        .find(|c| c.token == token)
        .expect("pending claim");
    let (claim, _): (idemgate_wire::ClaimRequest, &[u8]) =
        idemgate_wire::decode(&call.body).expect("a claim");
    claim.key
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let (Some(sidecar), Some(runtime)) = (self.sidecar.take(), self.runtime.as_ref()) {
            let _ = runtime.block_on(sidecar.shutdown());
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

    /// Runs posted wake-ups and due ticks (the root dispatches queued callouts then) and forwards
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

/// A backend that answers every request `201` with `body` after `delay`, counting requests.
pub fn backend(delay: Duration, body: &'static str) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind backend");
    let addr = listener.local_addr().expect("addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let counted = Arc::clone(&counted);
            std::thread::spawn(move || {
                if read_request(&mut conn).is_some() {
                    counted.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(delay);
                    let reply = format!(
                        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(reply.as_bytes());
                }
            });
        }
    });
    (addr, hits)
}

/// Reads one HTTP/1.1 request (headers + content-length body).
fn read_request(conn: &mut TcpStream) -> Option<Vec<u8>> {
    conn.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = conn.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = conn.read(&mut chunk).ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return Some(buf);
        }
    }
}

/// A response as a client saw it.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request on its own connection (`connection: close`), read to the end.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: api.test\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    conn.write_all(req.as_bytes()).expect("send");
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_string(),
    }
}
