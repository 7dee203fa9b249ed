//! The fault suite's rig: `idemgate_rig`'s stack with a [`FaultProxy`] on every hop — real
//! Redis, an in-process sidecar on its own runtime (so it can be killed like a process), the
//! demo backend (ground truth: what really executed) — and the live harness gateway running
//! `target/idemgate.wasm`, plus the load and checks the fault tests share:
//!
//! ```text
//! clients → gateway ─→ sidecar_proxy → sidecar ─→ redis_proxy → redis-server
//!                   └→ backend_proxy → demo backend
//! ```

use idemgate_e2e::client::{Reply, http};
use idemgate_e2e::harness::SIDECAR;
use idemgate_host::gateway::bootstrap::{Bootstrap, ClusterSpec, FilterSpec};
use idemgate_rig::backend::{Stats, Timings};
use idemgate_rig::fault_proxy::FaultProxy;
use idemgate_rig::gateway::LiveGateway;
use idemgate_rig::sidecar::InProcessSidecar;
use idemgate_sidecar::testing::RedisServer;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Every client must be answered within this (the "no hang" bound): far above the longest
/// configured wait (callout timeout, queue budget, route timeout) and the slowest CI run.
pub const ANSWER_BOUND: Duration = Duration::from_secs(30);

/// What a test varies.
pub struct Options {
    /// The plugin's `rules` (JSON array).
    pub rules: &'static str,
    /// Extra top-level plugin fields (`"failure_mode":"open"`), or empty.
    pub plugin_extra: &'static str,
    /// The gateway's route timeout to the backend.
    pub route_timeout: Duration,
    /// The sidecar cluster speaks HTTP/2 (as `envoy/envoy.yaml`); HTTP/1.1 otherwise.
    pub sidecar_http2: bool,
    /// The plugin's callout timeout (`sidecar.timeout`).
    pub sidecar_timeout: &'static str,
    /// The sidecar's Redis command timeout.
    pub store_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            rules: PAYMENTS,
            plugin_extra: "",
            route_timeout: Duration::from_secs(30),
            sidecar_http2: true,
            sidecar_timeout: "1s",
            store_timeout: Duration::from_millis(500),
        }
    }
}

/// Payments in idempotency mode, duplicates rejected; short lease so leak checks are quick.
pub const PAYMENTS: &str =
    r#"[{"name":"payments","match":{"path_prefix":"/payments"},"lease":"2s"}]"#;

/// The plugin configuration: a 100 ms tick, a breaker that opens after 3 failures for 1 s.
pub fn plugin_config(timeout: &str, extra: &str, rules: &str) -> String {
    let sep = if extra.is_empty() { "" } else { "," };
    format!(
        r#"{{"sidecar":{{"cluster":"{SIDECAR}","timeout":"{timeout}"}},"tick":"100ms","breaker":{{"failures":3,"cooldown":"1s"}}{sep}{extra},"rules":{rules}}}"#
    )
}

/// The rig with a fault proxy on every hop and one gateway, started by [`Rig::start`].
pub struct Rig {
    rig: idemgate_rig::Rig,
    gateway: LiveGateway,
    pub addr: SocketAddr,
}

impl Rig {
    pub fn start(options: Options) -> Rig {
        let store_timeout = options.store_timeout;
        let rig = idemgate_rig::Rig::builder()
            .redis()
            .fault_proxies()
            .sidecar(move |config| {
                config.store_timeout = store_timeout;
                config.recheck = Duration::from_millis(100);
            })
            .demo_backend(Timings {
                bot_spawn: Duration::from_millis(200),
                attach: Duration::from_millis(50),
                payment: Duration::from_millis(100),
            })
            .start()
            .expect("redis-server, the sidecar, the backend and the proxies start");
        let plugin = plugin_config(options.sidecar_timeout, options.plugin_extra, options.rules);
        let sidecar_cluster = if options.sidecar_http2 {
            ClusterSpec::sidecar(rig.sidecar_hop())
        } else {
            ClusterSpec::at(SIDECAR, rig.sidecar_hop())
        };
        let bootstrap = Bootstrap::new(rig.backend_hop().expect("the rig has a backend"))
            .route_timeout(options.route_timeout)
            .filter(FilterSpec::idemgate(&plugin))
            .cluster(sidecar_cluster);
        let gateway = LiveGateway::from_bootstrap(&bootstrap, 2)
            .expect("the gateway starts (build target/idemgate.wasm: cargo xtask wasm)");
        Rig {
            addr: gateway.addr(),
            rig,
            gateway,
        }
    }

    pub fn redis(&self) -> &RedisServer {
        self.rig.redis().expect("the fault rig runs Redis")
    }

    pub fn redis_mut(&mut self) -> &mut RedisServer {
        self.rig.redis_mut().expect("the fault rig runs Redis")
    }

    /// Between the sidecar and Redis.
    pub fn redis_proxy(&self) -> &FaultProxy {
        self.rig.redis_proxy().expect("the fault rig has proxies")
    }

    /// Between the gateway and the sidecar.
    pub fn sidecar_proxy(&self) -> &FaultProxy {
        self.rig.sidecar_proxy().expect("the fault rig has proxies")
    }

    /// Between the gateway and the demo backend.
    pub fn backend_proxy(&self) -> &FaultProxy {
        self.rig.backend_proxy().expect("the fault rig has proxies")
    }

    /// The sidecar dies as a process would: every task and socket dropped at once, waiting
    /// long-polls cut without an answer.
    pub fn kill_sidecar(&mut self) {
        self.rig.kill_sidecar().expect("the sidecar dies");
    }

    /// A new sidecar process on the same Redis and address, behind the same proxy.
    pub fn restart_sidecar(&mut self) {
        self.rig
            .restart_sidecar()
            .expect("the sidecar starts again");
    }

    /// Another gateway (another Envoy) with its own shared data, calling the sidecar
    /// directly (not through [`Rig::sidecar_proxy`]), in front of the same backend.
    pub fn second_gateway(&self, rules: &str) -> LiveGateway {
        self.gateway_to(self.sidecar_addr(), rules)
    }

    /// A gateway like [`Rig::second_gateway`] calling the sidecar at `sidecar`.
    pub fn gateway_to(&self, sidecar: SocketAddr, rules: &str) -> LiveGateway {
        let plugin = plugin_config("1s", "", rules);
        let backend = self.rig.backend_hop().expect("the rig has a backend");
        let bootstrap =
            Bootstrap::idemgate(backend, sidecar, &plugin).route_timeout(Duration::from_secs(30));
        LiveGateway::from_bootstrap(&bootstrap, 1).expect("the gateway starts")
    }

    /// Another sidecar process on the same Redis; [`InProcessSidecar::kill`] kills it.
    pub fn another_sidecar(&self) -> InProcessSidecar {
        self.rig.another_sidecar().expect("another sidecar starts")
    }

    /// Where the sidecar itself listens (behind [`Rig::sidecar_proxy`]).
    pub fn sidecar_addr(&self) -> SocketAddr {
        self.rig.sidecar_addr()
    }

    /// Ground truth: what the backend executed.
    pub fn stats(&self) -> Stats {
        self.rig
            .stats()
            .expect("the fault rig runs the demo backend")
    }

    /// A plugin counter, summed over the gateway's workers.
    pub fn counter(&self, name: &str) -> i64 {
        self.gateway.counter(name)
    }

    /// Every line the filter logged on this gateway.
    pub fn gateway_logs(&self) -> Vec<String> {
        self.gateway.logs()
    }

    /// Keys the sidecar reports as held (`GET /admin/v1/keys`). A sidecar that cannot answer
    /// fails the test: an empty list must mean "nothing held", never "could not ask".
    pub fn held_keys(&self) -> Vec<String> {
        let reply = http(self.sidecar_addr(), "GET", "/admin/v1/keys", &[], "");
        assert_eq!(reply.status, 200, "the sidecar lists held keys: {reply:?}");
        let list: serde_json::Value =
            serde_json::from_str(&reply.body).expect("the held-key listing is JSON");
        list["keys"]
            .as_array()
            .expect("the listing has `keys`")
            .iter()
            .map(|k| k.as_str().expect("keys are strings").to_owned())
            .collect()
    }

    /// Lock records in Redis itself whose lease has not ended (Redis's clock), read
    /// straight from the store's layout — `<prefix>:{key}:record` strings, decoded with the
    /// sidecar's own record codec, held while `owner` is set and `at` (µs) plus `lease` (ms)
    /// is in the future — independently of the sidecar's own listing. A Redis that cannot
    /// answer fails the test.
    pub fn redis_locks(&self) -> Vec<String> {
        const HELD: &str = r"
local now = clock()
local held, cursor = {}, '0'
repeat
  local page = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000)
  cursor = page[1]
  for _, record in ipairs(page[2]) do
    local r = decode(redis.call('GET', record))
    if r.owner and lease_end(r.at, r.lease) > now then
      table.insert(held, record)
    end
  end
until cursor == '0'
return held
";
        let script = format!("{}{HELD}", idemgate_sidecar::testing::RECORD_CODEC);
        self.redis()
            .cli(&["--raw", "EVAL", &script, "0", "idemgate:{*}:record"])
            .expect("redis-cli lists the held records")
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// No lock outlives its lease: within `lease` plus slack, nothing is held, in the
    /// sidecar's view or in Redis.
    pub fn assert_no_lock_held_after(&self, lease: Duration) {
        let deadline = Instant::now() + lease + Duration::from_secs(5);
        loop {
            let held = self.held_keys();
            let in_redis = self.redis_locks();
            if held.is_empty() && in_redis.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "locks outlived their lease: sidecar {held:?}, redis {in_redis:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// One request through the gateway, timed.
    pub fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Call {
        send(self.addr, method, path, headers, body)
    }
}

/// `per_key` concurrent duplicates of a payment for each key, all released at once.
pub fn duplicate_payments(
    addr: SocketAddr,
    keys: &[String],
    per_key: usize,
    work_ms: u64,
) -> Vec<Call> {
    let barrier = Arc::new(std::sync::Barrier::new(keys.len() * per_key));
    let threads: Vec<_> = keys
        .iter()
        .flat_map(|key| std::iter::repeat_n(key.clone(), per_key))
        .map(|key| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                pay(addr, &key, work_ms)
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("client thread"))
        .collect()
}

/// One payment with idempotency key `key`, the backend working `work_ms`.
pub fn pay(addr: SocketAddr, key: &str, work_ms: u64) -> Call {
    let work = work_ms.to_string();
    send(
        addr,
        "POST",
        "/payments",
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
            ("x-demo-work-ms", work.as_str()),
        ],
        r#"{"amount":5}"#,
    )
}

/// Retries `call` (bounded) until it returns `status`; the last call otherwise.
pub fn until_status(status: u16, within: Duration, mut call: impl FnMut() -> Call) -> Call {
    let deadline = Instant::now() + within;
    loop {
        let last = call();
        if last.status() == status || Instant::now() > deadline {
            return last;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A client that sends `head` and `body` and goes away after `after` without reading.
pub fn send_and_abort(addr: SocketAddr, request: &str, after: Duration) {
    use std::io::Write;
    let mut conn = std::net::TcpStream::connect(addr).expect("connect");
    conn.write_all(request.as_bytes()).expect("send");
    std::thread::sleep(after);
    // Linger 0 is not reachable from std; shutting both halves is what a client close is.
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

/// Sends `request` as is (for what the HTTP helpers cannot express: chunked bodies, bare CR
/// or LF) and returns the response's status code (0 when none came).
pub fn raw_status(addr: SocketAddr, request: &[u8]) -> u16 {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(ANSWER_BOUND)).expect("timeout");
    conn.write_all(request).expect("send");
    let mut raw = Vec::new();
    let _ = conn.read_to_end(&mut raw);
    String::from_utf8_lossy(&raw)
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A client's view of one call.
#[derive(Debug)]
pub struct Call {
    pub reply: Reply,
    pub took: Duration,
}

impl Call {
    pub fn status(&self) -> u16 {
        self.reply.status
    }

    pub fn problem_type(&self) -> String {
        let body: serde_json::Value = serde_json::from_str(&self.reply.body).unwrap_or_default();
        body["type"].as_str().unwrap_or_default().to_owned()
    }
}

pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Call {
    let started = Instant::now();
    let reply = http(addr, method, path, headers, body);
    Call {
        reply,
        took: started.elapsed(),
    }
}

/// Every client got an answer (a status line) within [`ANSWER_BOUND`], and only statuses a
/// client can act on: the backend's own, a replay, or one of idemgate's problems.
pub fn assert_all_answered<'a>(calls: impl IntoIterator<Item = &'a Call>, allowed: &[u16]) {
    for call in calls {
        assert!(
            call.took < ANSWER_BOUND,
            "answered after {:?}: {call:?}",
            call.took
        );
        assert!(
            allowed.contains(&call.status()),
            "unexpected answer {call:?}"
        );
    }
}

pub fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// `POST /agents/<agent>/tools` attaching `tool`, the demo backend working `work_ms` on it.
pub fn attach_tool(addr: SocketAddr, agent: &str, tool: &str, work_ms: &str) -> Call {
    send(
        addr,
        "POST",
        &format!("/agents/{agent}/tools"),
        &[
            ("content-type", "application/json"),
            ("x-demo-work-ms", work_ms),
        ],
        &format!(r#"{{"tool":"{tool}"}}"#),
    )
}
