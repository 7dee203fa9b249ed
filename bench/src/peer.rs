//! Group `peer`: idemgate beside `idempotent-proxy-server` (crates.io), a Rust reverse proxy
//! that dedupes by `Idempotency-Key` on Redis — what a user might pick instead — through the
//! same scenarios in the same run: fresh keys, in-flight duplicates, a storm of identical
//! requests, and replays of completed keys. Run only when named (`cargo xtask bench peer`):
//! the first run installs the peer at a pinned version under `target/peer` (`cargo install`),
//! later runs find it there.
//!
//! Both products proxy to one counting backend in this process, which records how many times
//! each key was executed and the response it gave first: the correctness figures (executions
//! per key, answers carrying the first call's response) are read there, not from either
//! product. Each product has its own `redis-server`, so its CPU time (`/proc/<pid>/stat`) and
//! its commands (`INFO commandstats`) are that product's alone. idemgate runs as the stack
//! of the other gateway groups: `idemgate-gateway` (the harness's wasmtime host, not Envoy)
//! with the shipped `envoy/envoy.yaml` and its plugin configuration, and the sidecar on Redis
//! on its own runtime threads, so its CPU time is told apart from the gateway's.

use crate::client::Connection;
use crate::cpu::{cpu_of, pid_cpu, redis_commands, threads_cpu};
use crate::report::{Check, Figure, Goal, Group};
use crate::sidecar_load::SIDECAR_THREADS;
use crate::stack::{BackendSpec, GatewaySpec, SIDECAR_WORKERS, Stack};
use crate::stats::{Summary, percentile};
use crate::wrk::{self, Keys, WrkRun};
use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idemgate_host::gateway::config::EnvoyConfig;
use idemgate_sidecar::testing::RedisServer;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Barrier;

/// The peer, pinned: `cargo install --locked --version VERSION CRATE`.
pub const CRATE: &str = "idempotent-proxy-server";
pub const VERSION: &str = "1.2.2";
/// How long the installation may take (a cold build of the peer and its TLS stack).
const INSTALL_LIMIT: Duration = Duration::from_secs(40 * 60);
/// The peer built as its maintainers ship it: the `[profile.release]` of its workspace
/// (github.com/ldclabs/idempotent-proxy, `Cargo.toml`: `lto = true`, `opt-level = 's'`,
/// `strip = true`, `debug = false`), which its image's `cargo build --release` uses. A crate
/// published from a workspace leaves the workspace's profile behind, so a plain `cargo install`
/// would build it without; these set it again. idemgate's side is built the same way: the
/// runner with the `dist` profile its sidecar image uses.
const PEER_PROFILE: [(&str, &str); 4] = [
    ("CARGO_PROFILE_RELEASE_LTO", "true"),
    ("CARGO_PROFILE_RELEASE_OPT_LEVEL", "s"),
    ("CARGO_PROFILE_RELEASE_STRIP", "true"),
    ("CARGO_PROFILE_RELEASE_DEBUG", "false"),
];

/// Runs per product, alternating the two.
const RUNS: usize = 3;
/// Keys the replay load cycles over (each completed once before the load).
const REPLAY_KEYS: u64 = 64;
/// In-flight duplicates: rounds per run, duplicates per round, and when they follow the
/// first call: the first `DUPLICATES_AFTER` into it, then one every `DUPLICATE_STAGGER`, so
/// their arrivals spread over the call (a poller's wait depends on where in its interval
/// the answer lands).
const DUPLICATE_ROUNDS: usize = 20;
const DUPLICATES: usize = 4;
const DUPLICATES_AFTER: Duration = Duration::from_millis(10);
const DUPLICATE_STAGGER: Duration = Duration::from_millis(20);
/// Identical requests released at once in the storm.
const STORM_REQUESTS: usize = 200;
/// The backend's work on the calls of the duplicate and storm scenarios.
const WORK_MS: u64 = 100;
/// No call of the client scenarios waits longer than this.
const CALL_LIMIT: Duration = Duration::from_secs(40);
/// The peer's `REQUEST_TIMEOUT`: its lock's TTL and its responses' retention, set to
/// idemgate's lease (its default, 10 s, would expire replay keys during a run).
const PEER_REQUEST_TIMEOUT_MS: u64 = 30_000;

/// Thread names (at most 15 bytes) of this process's parties that are neither product.
const BACKEND_THREAD: &str = "bench-backend";
const CLIENT_THREADS: &str = "bench-client";

/// The backend header giving a call's work time.
const WORK_HEADER: &str = "x-work-ms";

/// Installs the pinned peer, built with its maintainers' profile, under `target/peer` unless
/// that build is already there, and returns its binary.
fn install(target: &Path) -> Result<PathBuf> {
    let root = target.join("peer");
    let binary = root.join("bin").join(CRATE);
    // What was installed, and how: `cargo install` does not record the profile, so the root
    // keeps a line of its own saying both.
    let stamp_path = root.join("idemgate-bench.stamp");
    let stamp = format!("{CRATE} {VERSION} {PEER_PROFILE:?}\n");
    let installed = std::fs::read_to_string(&stamp_path).unwrap_or_default();
    if binary.is_file() && installed == stamp {
        return Ok(binary);
    }
    println!(
        "  installing {CRATE} {VERSION} into {} (once; later runs reuse it)",
        root.display()
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut child = Command::new(cargo)
        .args([
            "install",
            "--force",
            "--locked",
            "--version",
            VERSION,
            "--root",
        ])
        .arg(&root)
        .arg(CRATE)
        .envs(PEER_PROFILE)
        .spawn()
        .context("running cargo install")?;
    let deadline = Instant::now() + INSTALL_LIMIT;
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                bail!("cargo install {CRATE} {VERSION} failed ({status})");
            }
            std::fs::write(&stamp_path, stamp)?;
            return Ok(binary);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("cargo install {CRATE} {VERSION} took over {INSTALL_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// What the backend executed per key: how many times, and its first answer.
type Executions = Arc<Mutex<HashMap<String, (u64, String)>>>;

/// A keep-alive upstream on its own thread that executes every call it gets: it waits
/// `x-work-ms`, counts the call under its `Idempotency-Key` and answers `200` with a body
/// naming the execution, so an answer can be traced to the execution it came from.
struct Backend {
    addr: SocketAddr,
    executions: Executions,
}

impl Backend {
    fn start() -> Result<Backend> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let executions = Executions::default();
        let counted = Arc::clone(&executions);
        std::thread::Builder::new()
            .name(BACKEND_THREAD.into())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(serve(listener, counted));
            })?;
        Ok(Backend { addr, executions })
    }

    /// Keys starting with `prefix`, by how many times each was executed.
    fn counts(&self, prefix: &str) -> Vec<u64> {
        let executions = self.executions.lock().unwrap_or_else(|e| e.into_inner());
        executions
            .iter()
            .filter(|(key, _)| key.starts_with(prefix))
            .map(|(_, (n, _))| *n)
            .collect()
    }

    /// Executions of keys starting with `prefix` once they stop changing: the calls a load
    /// left in flight when its client stopped (up to one per connection) run to their end.
    /// Bounded: at most 50 reads, 20 ms apart.
    fn settled_executions(&self, prefix: &str) -> u64 {
        let total = || self.counts(prefix).iter().sum::<u64>();
        let mut last = total();
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(20));
            let now = total();
            if now == last {
                break;
            }
            last = now;
        }
        last
    }

    /// How many times `key` was executed, and the body of its first execution.
    fn of(&self, key: &str) -> (u64, Option<String>) {
        let executions = self.executions.lock().unwrap_or_else(|e| e.into_inner());
        executions
            .get(key)
            .map_or((0, None), |(n, body)| (*n, Some(body.clone())))
    }
}

async fn serve(listener: std::net::TcpListener, executions: Executions) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    let sequence = Arc::new(std::sync::atomic::AtomicU64::new(0));
    while let Ok((stream, _)) = listener.accept().await {
        let (executions, sequence) = (Arc::clone(&executions), Arc::clone(&sequence));
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let (executions, sequence) = (Arc::clone(&executions), Arc::clone(&sequence));
                    async move {
                        let header = |name: &str| {
                            req.headers()
                                .get(name)
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned)
                        };
                        let key = header("idempotency-key").unwrap_or_default();
                        let work = header(WORK_HEADER).and_then(|v| v.parse::<u64>().ok());
                        let _ = req.into_body().collect().await;
                        if let Some(ms) = work {
                            tokio::time::sleep(Duration::from_millis(ms.min(10_000))).await;
                        }
                        let n = sequence.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let body = format!("executed {key} #{n}");
                        {
                            let mut executions =
                                executions.lock().unwrap_or_else(|e| e.into_inner());
                            let entry = executions.entry(key).or_insert((0, body.clone()));
                            entry.0 += 1;
                        }
                        // A content type idemgate stores, so its granted calls complete.
                        http::Response::builder()
                            .header("content-type", "text/plain")
                            .body(Full::new(Bytes::from(body)))
                    }
                });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// A running `idempotent-proxy-server`, killed on drop.
struct PeerProcess {
    child: Child,
    addr: SocketAddr,
}

impl PeerProcess {
    /// The peer on loopback in front of `backend`, on `redis`, logging warnings only (its
    /// default logs two JSON lines per request to stdout).
    fn start(
        binary: &Path,
        run_dir: &Path,
        redis: &RedisServer,
        backend: SocketAddr,
    ) -> Result<Self> {
        // It refuses to start without a `.env` file in its working directory; every setting
        // is passed in its environment instead.
        std::fs::create_dir_all(run_dir)?;
        std::fs::write(
            run_dir.join(".env"),
            "# written by idemgate-bench: the settings are in the environment\n",
        )?;
        let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        // Absolute: the working directory changes (and `--target` is relative by default).
        let binary = std::path::absolute(binary)?;
        let child = Command::new(&binary)
            .current_dir(run_dir)
            .env("SERVER_ADDR", addr.to_string())
            .env("REDIS_URL", redis.url())
            .env("URL_BACKEND", format!("http://{backend}/payments"))
            .env("REQUEST_TIMEOUT", PEER_REQUEST_TIMEOUT_MS.to_string())
            .env("LOG_LEVEL", "warn")
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut peer = PeerProcess { child, addr };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(addr).is_err() {
            if let Some(status) = peer.child.try_wait()? {
                bail!("{CRATE} exited at start ({status})");
            }
            if Instant::now() > deadline {
                bail!("{CRATE} did not listen on {addr} within 20 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(peer)
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn redis_pid(redis: &RedisServer) -> Result<u32> {
    redis
        .cli(&["INFO", "server"])?
        .lines()
        .find_map(|l| l.strip_prefix("process_id:")?.trim().parse().ok())
        .context("INFO server names no process_id")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Product {
    Idemgate,
    Peer,
}

impl Product {
    fn name(self) -> &'static str {
        match self {
            Product::Idemgate => "idemgate",
            Product::Peer => "peer",
        }
    }
}

/// One product, running, as the scenarios reach it.
struct Target<'a> {
    product: Product,
    addr: SocketAddr,
    /// Where its requests go: idemgate's payments route, the peer's backend variable.
    path: &'static str,
    redis: &'a RedisServer,
    redis_pid: u32,
    /// The peer's process.
    pid: Option<u32>,
}

/// CPU seconds and Redis commands so far.
#[derive(Debug, Clone, Copy)]
struct Snapshot {
    /// idemgate: the sidecar's threads; the peer: its whole process.
    proxy: f64,
    /// idemgate: the gateway and the sidecar (this process less the backend and client
    /// threads); the peer: its whole process.
    whole: f64,
    redis: f64,
    commands: f64,
}

/// CPU µs per request and Redis commands per request between two snapshots.
#[derive(Debug, Clone, Copy, Default)]
struct Costs {
    proxy_us: f64,
    whole_us: f64,
    redis_us: f64,
    commands: f64,
}

impl Target<'_> {
    fn snapshot(&self) -> Result<Snapshot> {
        let (proxy, whole) = match self.pid {
            Some(pid) => {
                let cpu = pid_cpu(pid)?;
                (cpu, cpu)
            }
            None => {
                let process = cpu_of(Path::new("/proc/self"))
                    .context("/proc/self/stat")?
                    .1;
                let others = threads_cpu(BACKEND_THREAD) + threads_cpu(CLIENT_THREADS);
                (threads_cpu(SIDECAR_THREADS), process - others)
            }
        };
        Ok(Snapshot {
            proxy,
            whole,
            redis: pid_cpu(self.redis_pid)?,
            commands: redis_commands(self.redis)?,
        })
    }

    fn costs(&self, before: Snapshot, requests: u64) -> Result<Costs> {
        let after = self.snapshot()?;
        let n = requests.max(1) as f64;
        let per = |b: f64, a: f64| (a - b) * 1e6 / n;
        Ok(Costs {
            proxy_us: per(before.proxy, after.proxy),
            whole_us: per(before.whole, after.whole),
            redis_us: per(before.redis, after.redis),
            // The snapshot's own INFO calls are not counted.
            commands: (after.commands - before.commands) / n,
        })
    }

    fn headers<'k>(key: &'k str, work: &'k str) -> [(&'static str, &'k str); 3] {
        [
            ("idempotency-key", key),
            ("x-user-id", "wrk"),
            (WORK_HEADER, work),
        ]
    }
}

/// A wrk load (fresh keys or replays) and what it cost.
#[derive(Debug, Clone, Copy)]
struct Load {
    wrk: WrkRun,
    costs: Costs,
    /// Keys of the load the backend executed more than once, or (replays) not exactly once.
    misexecuted: usize,
}

fn fresh_keys(target: &Target<'_>, backend: &Backend, nonce: &str) -> Result<Load> {
    let before = target.snapshot()?;
    let run = wrk::mutating(
        target.addr,
        target.path,
        Keys::Fresh,
        nonce,
        &std::env::temp_dir(),
    )?;
    // Per request the backend executed, not per request wrk counted: the calls still in
    // flight when wrk stopped were claimed and stored too, and every fresh key executes once
    // (calls wrk cut off before they reached the backend stay uncounted either way).
    let executed = backend.settled_executions(&format!("{nonce}-"));
    let costs = target.costs(before, executed.max(run.requests))?;
    let misexecuted = backend
        .counts(&format!("{nonce}-"))
        .iter()
        .filter(|n| **n > 1)
        .count();
    Ok(Load {
        wrk: run,
        costs,
        misexecuted,
    })
}

fn replays(
    target: &Target<'_>,
    backend: &Backend,
    client: &tokio::runtime::Runtime,
    nonce: &str,
) -> Result<Load> {
    client.block_on(async {
        let mut connection = Connection::open(target.addr).await?;
        for i in 0..REPLAY_KEYS {
            let key = Keys::cycled(nonce, i);
            let answer = connection
                .call(
                    "POST",
                    target.path,
                    &Target::headers(&key, "0"),
                    r#"{"amount":1}"#,
                )
                .await?;
            if !(200..300).contains(&answer.status) {
                bail!(
                    "{}: completing {key} answered {}",
                    target.product.name(),
                    answer.status
                );
            }
        }
        Ok(())
    })?;
    let before = target.snapshot()?;
    let run = wrk::mutating(
        target.addr,
        target.path,
        Keys::Cycle(REPLAY_KEYS),
        nonce,
        &std::env::temp_dir(),
    )?;
    let costs = target.costs(before, run.requests)?;
    let counts = backend.counts(&format!("{nonce}-"));
    let misexecuted = counts.iter().filter(|n| **n != 1).count()
        + (REPLAY_KEYS as usize).saturating_sub(counts.len());
    Ok(Load {
        wrk: run,
        costs,
        misexecuted,
    })
}

/// What a group of calls for one key got back, checked against the backend.
#[derive(Debug, Clone, Default)]
struct Answers {
    /// Answers by status (`error`: no HTTP answer).
    statuses: BTreeMap<String, u64>,
    /// Answers that are 2xx and carry the body of the key's one execution.
    with_first_response: u64,
    answers: u64,
}

impl Answers {
    fn add(&mut self, answer: &Result<crate::client::Answer>, first: Option<&str>) {
        self.answers += 1;
        let label = match answer {
            Ok(a) => {
                let ok = (200..300).contains(&a.status);
                if ok && first.is_some_and(|f| a.body.as_ref() == f.as_bytes()) {
                    self.with_first_response += 1;
                }
                a.status.to_string()
            }
            Err(_) => "error".to_owned(),
        };
        *self.statuses.entry(label).or_default() += 1;
    }

    fn share_pct(&self) -> f64 {
        self.with_first_response as f64 * 100.0 / self.answers.max(1) as f64
    }
}

/// In-flight duplicates: per round a call that works `WORK_MS`, then `DUPLICATES` copies on
/// their own connections while it runs; how long after the first call's answer each copy's
/// answer comes.
#[derive(Debug, Clone, Default)]
struct InFlight {
    after_first_us: Vec<f64>,
    answers: Answers,
    commands: f64,
    misexecuted: usize,
}

async fn timed_call(
    mut connection: Connection,
    path: &'static str,
    key: String,
) -> (Result<crate::client::Answer>, Instant) {
    let work = WORK_MS.to_string();
    let headers = Target::headers(&key, &work);
    let call = connection.call("POST", path, &headers, r#"{"amount":1}"#);
    let answer = match tokio::time::timeout(CALL_LIMIT, call).await {
        Ok(answer) => answer,
        Err(_) => Err(anyhow::anyhow!("no answer within {CALL_LIMIT:?}")),
    };
    (answer, Instant::now())
}

fn in_flight_duplicates(
    target: &Target<'_>,
    backend: &Backend,
    client: &tokio::runtime::Runtime,
    nonce: &str,
) -> Result<InFlight> {
    let before = target.snapshot()?;
    let mut out = InFlight::default();
    for round in 0..DUPLICATE_ROUNDS {
        let key = format!("{nonce}-{round}");
        let answers = client.block_on(async {
            let mut connections = Vec::new();
            for _ in 0..=DUPLICATES {
                connections.push(Connection::open(target.addr).await?);
            }
            let mut connections = connections.into_iter();
            let first = connections.next().context("no connection")?;
            let first = tokio::spawn(timed_call(first, target.path, key.clone()));
            tokio::time::sleep(DUPLICATES_AFTER).await;
            let mut copies = Vec::new();
            for (i, connection) in connections.enumerate() {
                if i > 0 {
                    tokio::time::sleep(DUPLICATE_STAGGER).await;
                }
                copies.push(tokio::spawn(timed_call(
                    connection,
                    target.path,
                    key.clone(),
                )));
            }
            let first = first.await?;
            let mut answers = Vec::new();
            for copy in copies {
                answers.push(copy.await?);
            }
            Ok::<_, anyhow::Error>((first, answers))
        })?;
        let (count, body) = backend.of(&key);
        if count != 1 {
            out.misexecuted += 1;
        }
        let ((first, first_at), copies) = answers;
        out.answers.add(&first, body.as_deref());
        for (answer, at) in &copies {
            out.answers.add(answer, body.as_deref());
            // Signed: the peer may answer a copy from Redis before the first call's answer.
            let gap = if *at >= first_at {
                at.duration_since(first_at).as_secs_f64()
            } else {
                -first_at.duration_since(*at).as_secs_f64()
            };
            out.after_first_us.push(gap * 1e6);
        }
    }
    let requests = (DUPLICATE_ROUNDS * (DUPLICATES + 1)) as u64;
    out.commands = target.costs(before, requests)?.commands;
    Ok(out)
}

/// `STORM_REQUESTS` identical calls released at once, each on its own connection.
#[derive(Debug, Clone, Default)]
struct Storm {
    latencies_us: Vec<f64>,
    answers: Answers,
    executions: u64,
    commands: f64,
}

fn storm(
    target: &Target<'_>,
    backend: &Backend,
    client: &tokio::runtime::Runtime,
    nonce: &str,
) -> Result<Storm> {
    let key = format!("{nonce}-storm");
    let before = target.snapshot()?;
    let answers = client.block_on(async {
        let barrier = Arc::new(Barrier::new(STORM_REQUESTS));
        let mut calls = Vec::new();
        for _ in 0..STORM_REQUESTS {
            let connection = Connection::open(target.addr).await?;
            let (barrier, key, path) = (Arc::clone(&barrier), key.clone(), target.path);
            calls.push(tokio::spawn(async move {
                barrier.wait().await;
                let started = Instant::now();
                let (answer, at) = timed_call(connection, path, key).await;
                (answer, at.duration_since(started))
            }));
        }
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await?);
        }
        Ok::<_, anyhow::Error>(answers)
    })?;
    let commands = target.costs(before, STORM_REQUESTS as u64)?.commands;
    let (executions, body) = backend.of(&key);
    let mut out = Storm {
        executions,
        commands,
        ..Storm::default()
    };
    for (answer, latency) in &answers {
        out.answers.add(answer, body.as_deref());
        out.latencies_us.push(latency.as_secs_f64() * 1e6);
    }
    Ok(out)
}

/// Every scenario's result for one product on Redis 7.0.
struct Scenarios {
    fresh: Load,
    replay: Load,
    in_flight: InFlight,
    storm: Storm,
}

/// One product's run: every scenario on Redis 7.0, and fresh keys again on Valkey 8.1.
struct Run {
    on_redis: Scenarios,
    fresh_on_valkey: Load,
}

/// Keys of this process, product, run and scenario only.
fn nonce(target: &Target<'_>, run: usize, what: &str) -> String {
    format!(
        "{}-{}-{run}-{what}",
        std::process::id(),
        target.product.name()
    )
}

fn scenarios(
    target: &Target<'_>,
    backend: &Backend,
    client: &tokio::runtime::Runtime,
    run: usize,
) -> Result<Scenarios> {
    let nonce = |what: &str| nonce(target, run, what);
    println!("  run {}: {}: fresh keys", run + 1, target.product.name());
    let fresh = fresh_keys(target, backend, &nonce("fresh"))?;
    println!(
        "  run {}: {}: in-flight duplicates",
        run + 1,
        target.product.name()
    );
    let in_flight = in_flight_duplicates(target, backend, client, &nonce("dup"))?;
    println!("  run {}: {}: storm", run + 1, target.product.name());
    let storm = storm(target, backend, client, &nonce("storm"))?;
    println!("  run {}: {}: replays", run + 1, target.product.name());
    let replay = replays(target, backend, client, &nonce("replay"))?;
    Ok(Scenarios {
        fresh,
        replay,
        in_flight,
        storm,
    })
}

/// What a product is started from, for each measurement.
struct Products<'a> {
    peer_binary: &'a Path,
    peer_dir: PathBuf,
    backend: &'a Backend,
    gateway: &'a GatewaySpec<'a>,
}

impl Products<'_> {
    /// `measure` on `product`, started afresh on `redis` and stopped after it.
    fn on<T>(
        &self,
        product: Product,
        redis: &RedisServer,
        measure: impl FnOnce(&Target<'_>) -> Result<T>,
    ) -> Result<T> {
        let redis_pid = redis_pid(redis)?;
        match product {
            Product::Peer => {
                let peer =
                    PeerProcess::start(self.peer_binary, &self.peer_dir, redis, self.backend.addr)?;
                measure(&Target {
                    product,
                    addr: peer.addr,
                    path: "/URL_BACKEND",
                    redis,
                    redis_pid,
                    pid: Some(peer.child.id()),
                })
            }
            Product::Idemgate => {
                let stack = Stack::start(
                    redis.store_config(),
                    BackendSpec::At(self.backend.addr),
                    self.gateway,
                )?;
                let measured = measure(&Target {
                    product,
                    addr: stack.gateway_addr,
                    path: "/payments",
                    redis,
                    redis_pid,
                    pid: None,
                })?;
                stack.stop()?;
                Ok(measured)
            }
        }
    }
}

/// The plugin configuration `envoy/envoy.yaml` ships (what a user gets).
fn shipped_plugin_config(envoy_yaml: &Path) -> Result<String> {
    let config = EnvoyConfig::load(envoy_yaml)
        .with_context(|| format!("loading {}", envoy_yaml.display()))?;
    let wasm = config
        .listeners
        .iter()
        .find_map(|l| l.wasm.as_ref())
        .context("envoy.yaml has no wasm filter")?;
    Ok(String::from_utf8(wasm.settings.configuration.clone())?)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

pub fn group(target: &Path, envoy_yaml: &Path, module: &Path) -> Result<Group> {
    let binary = install(target)?;
    let load_before = load_average();
    let backend = Backend::start()?;
    // Each product on Redis as Debian 12 has it (7.0), and, for fresh keys, on Valkey 8.1,
    // where idemgate's complete is one `SET … IFEQ` instead of a script.
    let servers = |start: fn() -> std::io::Result<RedisServer>, what: &str| -> Result<_> {
        Ok((
            start().with_context(|| format!("starting {what}"))?,
            start().with_context(|| format!("starting {what}"))?,
        ))
    };
    let (peer_redis, our_redis) = servers(RedisServer::start, "redis-server")?;
    let (peer_valkey, our_valkey) = servers(
        RedisServer::start_valkey,
        "valkey-server (cargo xtask bench builds it)",
    )?;
    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(CLIENT_THREADS)
        .enable_all()
        .build()?;
    let spec = GatewaySpec {
        envoy_yaml,
        module,
        plugin_config: shipped_plugin_config(envoy_yaml)?,
        workers: GATEWAY_WORKERS,
    };
    let products = Products {
        peer_binary: &binary,
        peer_dir: target.join("peer/run"),
        backend: &backend,
        gateway: &spec,
    };
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for run in 0..RUNS {
        for (product, redis, valkey, runs) in [
            (Product::Peer, &peer_redis, &peer_valkey, &mut theirs),
            (Product::Idemgate, &our_redis, &our_valkey, &mut ours),
        ] {
            let on_redis = products.on(product, redis, |target| {
                scenarios(target, &backend, &client, run)
            })?;
            let fresh_on_valkey = products.on(product, valkey, |target| {
                println!(
                    "  run {}: {}: fresh keys on Valkey",
                    run + 1,
                    product.name()
                );
                fresh_keys(target, &backend, &nonce(target, run, "fresh-valkey"))
            })?;
            runs.push(Run {
                on_redis,
                fresh_on_valkey,
            });
        }
    }
    let load_after = load_average();
    report(&ours, &theirs, &load_before, &load_after)
}

/// Gateway workers for idemgate (the peer's runtime takes every core, 2 here).
const GATEWAY_WORKERS: usize = 2;

fn summary(samples: impl IntoIterator<Item = f64>) -> Result<Summary> {
    Summary::of(&samples.into_iter().collect::<Vec<_>>()).context("no runs")
}

/// One figure: idemgate's median over runs against the peer's.
fn pair(
    name: String,
    unit: &'static str,
    ours: &[Run],
    theirs: &[Run],
    of: impl Fn(&Run) -> f64,
    goal: Option<Goal>,
) -> Result<Figure> {
    Ok(Figure {
        name,
        unit,
        value: summary(ours.iter().map(&of))?,
        baseline: Some((
            format!("{CRATE} {VERSION}"),
            summary(theirs.iter().map(&of))?,
        )),
        goal,
    })
}

fn pct(samples: &[f64], p: f64) -> f64 {
    percentile(&mut samples.to_vec(), p).unwrap_or(f64::NAN)
}

/// A row of a wrk load's figures: what, unit, how it is read, goal.
type LoadRow = (&'static str, &'static str, fn(&Load) -> f64, Option<Goal>);

fn report(ours: &[Run], theirs: &[Run], load_before: &str, load_after: &str) -> Result<Group> {
    let mut figures = Vec::new();
    for (what, load) in [
        (
            "fresh keys",
            (|r: &Run| r.on_redis.fresh) as fn(&Run) -> Load,
        ),
        ("fresh keys on Valkey 8.1", |r: &Run| r.fresh_on_valkey),
        ("replays of completed keys", |r: &Run| r.on_redis.replay),
    ] {
        let name = |f: &str| format!("{what} (wrk c{}): {f}", wrk::CONNECTIONS);
        let rows: [LoadRow; 9] = [
            ("throughput", "requests/s", |l| l.wrk.requests_per_sec, None),
            ("p50 latency", "µs", |l| l.wrk.p50_us, None),
            ("p99 latency", "µs", |l| l.wrk.p99_us, None),
            (
                "CPU per request, idemgate's sidecar alone vs the peer's whole process",
                "µs",
                |l| l.costs.proxy_us,
                None,
            ),
            (
                "CPU per request, idemgate's harness gateway + sidecar vs the peer's whole process",
                "µs",
                |l| l.costs.whole_us,
                None,
            ),
            (
                "CPU per request, each product's redis-server",
                "µs",
                |l| l.costs.redis_us,
                None,
            ),
            (
                "CPU per request, idemgate's sidecar + its redis-server vs the peer's whole \
                 process + its redis-server",
                "µs",
                |l| l.costs.proxy_us + l.costs.redis_us,
                Some(Goal::RatioAtMost(0.5)),
            ),
            (
                "Redis commands per request",
                "commands",
                |l| l.costs.commands,
                Some(Goal::AtMost(5.0)),
            ),
            (
                "keys executed other than once (backend's count)",
                "keys",
                |l| l.misexecuted as f64,
                Some(Goal::AtMost(0.0)),
            ),
        ];
        // The goals are set on the common path, a fresh key's claim and complete; a replay
        // makes no sidecar call at all.
        let fresh = what.starts_with("fresh keys");
        for (row, unit, of, goal) in rows {
            let goal = goal.filter(|_| fresh);
            figures.push(pair(name(row), unit, ours, theirs, |r| of(&load(r)), goal)?);
        }
        figures.push(pair(
            name("answers other than 2xx"),
            "answers",
            ours,
            theirs,
            |r| load(r).wrk.non_2xx as f64,
            None,
        )?);
    }
    let dup = |f: &str| {
        format!("in-flight duplicates ({DUPLICATES} copies during a {WORK_MS} ms call): {f}")
    };
    figures.extend([
        pair(
            dup("copy's answer after the first call's answer, p50"),
            "µs",
            ours,
            theirs,
            |r| pct(&r.on_redis.in_flight.after_first_us, 50.0),
            None,
        )?,
        pair(
            dup("copy's answer after the first call's answer, p99"),
            "µs",
            ours,
            theirs,
            |r| pct(&r.on_redis.in_flight.after_first_us, 99.0),
            None,
        )?,
        pair(
            dup("answers carrying the first call's response"),
            "%",
            ours,
            theirs,
            |r| r.on_redis.in_flight.answers.share_pct(),
            Some(Goal::AtLeast(100.0)),
        )?,
        pair(
            dup("Redis commands per request"),
            "commands",
            ours,
            theirs,
            |r| r.on_redis.in_flight.commands,
            None,
        )?,
        pair(
            dup("keys executed other than once (backend's count)"),
            "keys",
            ours,
            theirs,
            |r| r.on_redis.in_flight.misexecuted as f64,
            Some(Goal::AtMost(0.0)),
        )?,
    ]);
    let storm_name = |f: &str| format!("storm ({STORM_REQUESTS} identical requests at once): {f}");
    figures.extend([
        pair(
            storm_name("answers carrying the first call's response"),
            "answers",
            ours,
            theirs,
            |r| r.on_redis.storm.answers.with_first_response as f64,
            None,
        )?,
        pair(
            storm_name("latency from the release, p50"),
            "µs",
            ours,
            theirs,
            |r| pct(&r.on_redis.storm.latencies_us, 50.0),
            None,
        )?,
        pair(
            storm_name("latency from the release, p99"),
            "µs",
            ours,
            theirs,
            |r| pct(&r.on_redis.storm.latencies_us, 99.0),
            None,
        )?,
        pair(
            storm_name("Redis commands per request"),
            "commands",
            ours,
            theirs,
            |r| r.on_redis.storm.commands,
            None,
        )?,
        pair(
            storm_name("backend executions"),
            "executions",
            ours,
            theirs,
            |r| r.on_redis.storm.executions as f64,
            Some(Goal::AtMost(1.0)),
        )?,
    ]);
    let executed_once = |runs: &[Run]| {
        runs.iter().all(|r| {
            r.on_redis.fresh.misexecuted == 0
                && r.fresh_on_valkey.misexecuted == 0
                && r.on_redis.replay.misexecuted == 0
                && r.on_redis.in_flight.misexecuted == 0
                && r.on_redis.storm.executions == 1
        })
    };
    let statuses = |runs: &[Run], of: fn(&Run) -> &Answers| {
        runs.iter()
            .map(|r| crate::storm::status_counts(&of(r).statuses))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let peer_once = executed_once(theirs);
    Ok(Group {
        title: "idemgate beside idempotent-proxy-server",
        command: "cargo xtask bench peer".into(),
        figures,
        checks: vec![Check {
            what: format!(
                "idemgate: every key of every scenario executed exactly once by the backend \
                 ({RUNS} runs)"
            ),
            held: executed_once(ours),
        }],
        notes: vec![
            format!(
                "**idemgate's figures run in the harness gateway, not Envoy.** The baseline \
                 column is `{CRATE}` {VERSION} from crates.io (installed once under \
                 `target/peer` by `cargo install --locked`, with the release profile of its \
                 own workspace set again: fat LTO, `opt-level = 's'`, as its image is built), \
                 a Rust reverse proxy that dedupes \
                 by `Idempotency-Key` on Redis: the first call takes a `SET NX PX` lock and \
                 stores the response, duplicates poll Redis for it. idemgate runs as the other \
                 gateway groups run it: `idemgate-gateway` (the project's wasmtime proxy-wasm \
                 host, {GATEWAY_WORKERS} workers) with `envoy/envoy.yaml` and its shipped \
                 plugin configuration (`POST /payments`: idempotency, `on_conflict: queue`, \
                 `max_wait` 10 s, the default `max_queue` 16), and the sidecar in-process on \
                 its own runtime on Redis, with as many worker threads as the shipped \
                 Deployment gives a pod ({SIDECAR_WORKERS}: its CPU request rounded up), built as \
                 its image is (this runner is built with the `dist` profile: fat LTO, one \
                 codegen unit; so is the harness gateway in it). Both products run on loopback in front of \
                 one counting backend and each has its own `redis-server`; {RUNS} runs, \
                 alternating the two, each product restarted per run."
            ),
            "Two servers: every scenario runs on Debian 12's `redis-server` (7.0.15), and \
             the fresh keys again on Valkey 8.1.1 (built from Debian 13's source archive by \
             `cargo xtask bench`), each product on a server of its own and restarted for it. \
             On Valkey, idemgate's sidecar sends a fresh grant's complete as one \
             `SET … IFEQ` (Valkey ≥ 8.1, Redis ≥ 8.4) where Redis 7.0 needs the \
             compare-and-set script; the peer sends the same commands to both servers."
                .to_owned(),
            "Which CPU figures compare: \"the sidecar alone vs the peer's whole process\" is \
             the comparison the performance goals are set on, but it is not like for like: the \
             peer's process also accepts the client's request and proxies it, which in idemgate \
             is the gateway's work. \"Harness gateway + sidecar\" is like for like in function, \
             but the harness gateway's own per-request cost is not Envoy's (a hyper server \
             running the filter in wasmtime, not Envoy's C++ and V8), so it says nothing about \
             idemgate under Envoy. Each product's `redis-server` CPU and its Redis commands per \
             request compare directly (same server build, same machine, same run). CPU \
             seconds are read from `/proc/<pid>/stat` before and after each load (idemgate: \
             the sidecar's threads, and this process less the backend's and the client's \
             threads); Redis commands from `INFO commandstats`."
                .to_owned(),
            format!(
                "Scenarios. Fresh keys: `wrk -t{t} -c{c} -d{s}s` with a new `Idempotency-Key` \
                 per request, so every request is claimed, executed and stored. In-flight \
                 duplicates: {DUPLICATE_ROUNDS} rounds per run, each a call the backend works \
                 {WORK_MS} ms on, and {DUPLICATES} copies on their own connections, \
                 the first {DUPLICATES_AFTER:?} into it and one every {DUPLICATE_STAGGER:?} \
                 after, so they land at different points of a poll interval; the gap is each copy's answer after the first \
                 call's answer. Storm: {STORM_REQUESTS} identical calls ({WORK_MS} ms of work) \
                 released at once, each on its own connection. Replays: {REPLAY_KEYS} keys \
                 completed once, then wrk cycling over them for {s} s. The backend counts \
                 executions per key and remembers its answer, so \"carrying the first call's \
                 response\" means a 2xx whose body is that execution's. Every call is bounded \
                 at {limit} s. Answers, in-flight duplicates, idemgate: {od}; peer: {pd}. \
                 Storm, idemgate: {os}; peer: {ps}. The peer executed every key exactly once: \
                 {peer_once}.",
                t = wrk::THREADS,
                c = wrk::CONNECTIONS,
                s = wrk::SECONDS,
                limit = CALL_LIMIT.as_secs(),
                od = statuses(ours, |r| &r.on_redis.in_flight.answers),
                pd = statuses(theirs, |r| &r.on_redis.in_flight.answers),
                os = statuses(ours, |r| &r.on_redis.storm.answers),
                ps = statuses(theirs, |r| &r.on_redis.storm.answers),
            ),
            format!(
                "The peer's settings: `REQUEST_TIMEOUT={PEER_REQUEST_TIMEOUT_MS}` (its lock's \
                 TTL and how long it keeps a response; its default 10 s would expire replay keys \
                 mid-run), the default `POLL_INTERVAL` (100 ms: how often a duplicate reads \
                 Redis), `LOG_LEVEL=warn` (its default logs every request as JSON to stdout; \
                 the harness gateway logs errors only), its fixed Redis pool of 10 connections, \
                 HTTP/1.1 to the backend through its `URL_BACKEND` variable. Load average \
                 (1, 5, 15 min) before the group: {load_before}; after: {load_after} — the \
                 machine was shared with other builds, so the wall-clock figures are noisy: \
                 read them within the run."
            ),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cpu_seconds_and_names_from_proc() {
        let (name, seconds) = cpu_of(Path::new("/proc/self")).unwrap();
        assert!(!name.is_empty());
        assert!(seconds >= 0.0);
        assert!(cpu_of(Path::new("/proc/no-such-pid")).is_none());
    }

    #[test]
    fn answers_count_only_2xx_with_the_first_body() {
        let answer = |status, body: &'static str| {
            Ok(crate::client::Answer {
                status,
                replayed: false,
                body: Bytes::from_static(body.as_bytes()),
            })
        };
        let mut answers = Answers::default();
        answers.add(&answer(200, "executed k #1"), Some("executed k #1"));
        answers.add(&answer(200, "executed k #2"), Some("executed k #1"));
        answers.add(&answer(409, "executed k #1"), Some("executed k #1"));
        answers.add(&Err(anyhow::anyhow!("reset")), Some("executed k #1"));
        assert_eq!(answers.with_first_response, 1);
        assert_eq!(answers.answers, 4);
        assert_eq!(answers.share_pct(), 25.0);
        let statuses: Vec<_> = answers
            .statuses
            .iter()
            .map(|(s, n)| (s.as_str(), *n))
            .collect();
        assert_eq!(statuses, [("200", 2), ("409", 1), ("error", 1)]);
    }

    #[test]
    fn the_shipped_configuration_is_read_from_envoy_yaml() {
        let yaml = Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy/envoy.yaml");
        let config: serde_json::Value =
            serde_json::from_str(&shipped_plugin_config(&yaml).unwrap()).unwrap();
        let payments = config["rules"]
            .as_array()
            .and_then(|rules| rules.iter().find(|r| r["name"] == "payments"))
            .unwrap();
        assert_eq!(payments["mode"], "idempotency");
    }
}
