//! The built filter in the proxy-wasm host harness (`idemgate_host::testing`): gateways as
//! `TestHost`s (one Envoy process each, with N worker VMs running `target/idemgate.wasm`)
//! whose callouts a test forwards to a real sidecar itself, and the requests and readings
//! the scenarios share.

use idemgate_host::testing::{Request, TestHost, TestStream, TestVm};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Cluster name the filter's callouts use in every scenario.
pub const SIDECAR: &str = "idemgate_sidecar";
pub const VM_ID: &str = "idemgate";

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

    /// A counter summed over the workers, read after every worker has run its tick (the
    /// virtual clock moves on to the last of them): the filter hands its counters to the host
    /// there, so they count every request answered before the call.
    pub fn counter(&self, name: &str) -> i64 {
        assert!(
            self.host.advance_through_ticks(),
            "the workers' ticks never came"
        );
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
