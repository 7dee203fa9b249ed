//! `sidecar-bench`: claim+complete round trips per second and latency percentiles at
//! concurrency 1 and 64, for the memory and Redis stores, side by side with raw Redis doing
//! the minimal equivalent (`SET NX PX`, then a compare-and-delete script) in the same run;
//! plus the hand-off latency from a release to the next waiter's grant.
//!
//! Everything runs on this machine: the sidecar in-process on 127.0.0.1:0 over up to four
//! h2c connections (as Envoy multiplexes callouts per worker thread), a throw-away `redis-server` on a free port.
//! Numbers are comparative, not absolute: client, sidecar and Redis share the CPUs.
//!
//! Usage: `cargo run --release -p idemgate-sidecar --features testing --bin sidecar-bench
//! [-- --seconds N] [--connections N] [--http1] [--only raw|memory|redis]`. `--connections`
//! sets the h2c connections the bench client opens to the sidecar (default 4); `--http1`
//! uses HTTP/1.1 keep-alive instead, one connection per worker, to show what HTTP/2 costs;
//! `--only` runs one target (for profiling), without hand-offs.

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate_sidecar::testing::RedisServer;
use idemgate_sidecar::{Config, Sidecar, StoreConfig};
use idemgate_wire::{
    ClaimOutcome, ClaimRequest, CompleteRequest, Mode, OwnerOutcome, WaitPolicy, paths,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CONCURRENCY: [usize; 2] = [1, 64];
const HANDOFFS: usize = 300;
/// h2c connections the sidecar runs use by default (at most one per worker).
const CONNECTIONS: usize = 4;

/// How the bench client reaches the sidecar.
#[derive(Clone, Copy, PartialEq)]
enum Protocol {
    /// h2c, a few connections shared by all workers (Envoy's HTTP/2 cluster).
    H2,
    /// HTTP/1.1 keep-alive, one connection per worker (Envoy's HTTP/1.1 pool).
    H1,
}

#[derive(Clone)]
enum Sender {
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
    /// One worker owns each connection, so the lock is never contended.
    H1(Arc<tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Full<Bytes>>>>),
}

#[derive(Clone)]
struct Client {
    sender: Sender,
    authority: String,
}

impl Client {
    async fn connect(addr: std::net::SocketAddr, protocol: Protocol) -> Result<Client> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let io = TokioIo::new(stream);
        let sender = match protocol {
            Protocol::H2 => {
                let (send, conn) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
                tokio::spawn(conn);
                Sender::H2(send)
            }
            Protocol::H1 => {
                let (send, conn) = hyper::client::conn::http1::handshake(io).await?;
                tokio::spawn(conn);
                Sender::H1(Arc::new(tokio::sync::Mutex::new(send)))
            }
        };
        Ok(Client {
            sender,
            authority: addr.to_string(),
        })
    }

    async fn send(&self, req: hyper::Request<Full<Bytes>>) -> Result<Bytes> {
        let response = match &self.sender {
            Sender::H2(send) => {
                let mut send = send.clone();
                send.ready().await?;
                send.send_request(req).await?
            }
            Sender::H1(send) => {
                let mut send = send.lock().await;
                send.ready().await?;
                send.send_request(req).await?
            }
        };
        if response.status() != hyper::StatusCode::OK {
            bail!("sidecar answered {}", response.status());
        }
        Ok(response.into_body().collect().await?.to_bytes())
    }

    async fn post<T: serde::Serialize>(&self, path: &str, head: &T) -> Result<Bytes> {
        let mut req = hyper::Request::post(format!("http://{}{path}", self.authority))
            .header("content-type", idemgate_wire::CONTENT_TYPE);
        if let Sender::H1(_) = self.sender {
            // HTTP/1.1 requires it; h2 carries the authority in `:authority`.
            req = req.header(hyper::header::HOST, &self.authority);
        }
        let req = req.body(Full::new(Bytes::from(idemgate_wire::encode(head, &[]))))?;
        self.send(req).await
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome> {
        let body = self.post(paths::CLAIM, req).await?;
        Ok(idemgate_wire::decode::<ClaimOutcome>(&body)?.0)
    }

    async fn complete(&self, key: &str, owner: &str) -> Result<()> {
        let req = CompleteRequest {
            key: key.to_owned(),
            owner: owner.to_owned(),
            retention_ms: 1000,
            response: None,
        };
        let body = self.post(paths::COMPLETE, &req).await?;
        match idemgate_wire::decode::<OwnerOutcome>(&body)?.0 {
            OwnerOutcome::Released => Ok(()),
            other => bail!("complete answered {other:?}"),
        }
    }
}

fn lock_claim(key: String, wait: bool) -> ClaimRequest {
    ClaimRequest {
        key,
        mode: Mode::Lock,
        lease_ms: 30_000,
        fingerprint: None,
        wait: wait.then_some(WaitPolicy {
            budget_ms: 30_000,
            per_waiter_ms: 0,
            max_budget_ms: 0,
            max_queue: 10,
        }),
    }
}

struct Run {
    ops_per_sec: f64,
    p50: Duration,
    p99: Duration,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

/// Runs `op(worker, i)` from `concurrency` workers for `seconds`.
async fn measure<F, Fut>(concurrency: usize, seconds: f64, op: F) -> Result<Run>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    let op = Arc::new(op);
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let op = Arc::clone(&op);
        let done = Arc::clone(&done);
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut i = 0u64;
            while Instant::now() < until {
                let t = Instant::now();
                op(w, i).await?;
                latencies.push(t.elapsed());
                i += 1;
            }
            done.fetch_add(i, Ordering::Relaxed);
            Ok::<_, anyhow::Error>(latencies)
        }));
    }
    let mut all = Vec::new();
    for worker in workers {
        all.extend(worker.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort();
    Ok(Run {
        ops_per_sec: done.load(Ordering::Relaxed) as f64 / elapsed,
        p50: percentile(&all, 0.5),
        p99: percentile(&all, 0.99),
    })
}

async fn sidecar_round_trips(
    store: StoreConfig,
    concurrency: usize,
    protocol: Protocol,
    connections: usize,
    seconds: f64,
) -> Result<Run> {
    let sidecar = Sidecar::spawn(Config::loopback(store)).await?;
    // Like Envoy: a few multiplexed h2c connections (one per worker thread), or an
    // HTTP/1.1 pool with one connection per request in flight.
    let connections = match protocol {
        Protocol::H2 => concurrency.min(connections),
        Protocol::H1 => concurrency,
    };
    let mut clients = Vec::new();
    for _ in 0..connections {
        clients.push(Client::connect(sidecar.addr(), protocol).await?);
    }
    let run = measure(concurrency, seconds, move |w, i| {
        let client = clients.get(w % clients.len().max(1)).cloned();
        async move {
            let client = client.context("no connection")?;
            let key = format!("bench-{w}-{i}");
            match client.claim(&lock_claim(key.clone(), false)).await? {
                ClaimOutcome::Granted { owner, .. } => client.complete(&key, &owner).await,
                other => bail!("claim answered {other:?}"),
            }
        }
    })
    .await;
    sidecar.shutdown().await?;
    run
}

async fn raw_redis_round_trips(url: &str, concurrency: usize, seconds: f64) -> Result<Run> {
    let client = redis::Client::open(url)?;
    let conn = client.get_multiplexed_async_connection().await?;
    let release = Arc::new(redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end",
    ));
    measure(concurrency, seconds, move |w, i| {
        let mut conn = conn.clone();
        let release = Arc::clone(&release);
        async move {
            let key = format!("raw-{w}-{i}");
            let owner = format!("{w:016x}{i:016x}");
            let set: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&owner)
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(&mut conn)
                .await?;
            if set.is_none() {
                bail!("SET NX refused a fresh key");
            }
            let deleted: i64 = release
                .key(&key)
                .arg(&owner)
                .invoke_async(&mut conn)
                .await?;
            if deleted != 1 {
                bail!("compare-and-delete did not delete");
            }
            Ok(())
        }
    })
    .await
}

/// Release → next grant: a waiter long-polls, the holder completes; measured from just
/// before the complete is sent to the waiter's grant arriving.
async fn handoff_latency(store: StoreConfig) -> Result<(Duration, Duration)> {
    let sidecar = Sidecar::spawn(Config::loopback(store)).await?;
    let client = Client::connect(sidecar.addr(), Protocol::H2).await?;
    let key = "bench-handoff".to_owned();
    let mut holder = match client.claim(&lock_claim(key.clone(), false)).await? {
        ClaimOutcome::Granted { owner, .. } => owner,
        other => bail!("claim answered {other:?}"),
    };
    let mut samples = Vec::with_capacity(HANDOFFS);
    for _ in 0..HANDOFFS {
        let waiter = {
            let client = client.clone();
            let req = lock_claim(key.clone(), true);
            tokio::spawn(async move {
                let outcome = client.claim(&req).await;
                (outcome, Instant::now())
            })
        };
        // Let the waiter queue before releasing (bounded: 5 s).
        let url = format!("{}/admin/v1/keys/{key}", sidecar.url());
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let info = admin_get(&client, &url).await?;
            if info.queue_len == 1 {
                break;
            }
            if Instant::now() > deadline {
                bail!("the waiter did not queue");
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let released = Instant::now();
        client.complete(&key, &holder).await?;
        let (outcome, granted_at) = waiter.await?;
        holder = match outcome? {
            ClaimOutcome::Granted { owner, .. } => owner,
            other => bail!("waiter got {other:?}"),
        };
        samples.push(granted_at.saturating_duration_since(released));
    }
    sidecar.shutdown().await?;
    samples.sort();
    Ok((percentile(&samples, 0.5), percentile(&samples, 0.99)))
}

async fn admin_get(client: &Client, url: &str) -> Result<idemgate_sidecar::KeyInfo> {
    let req = hyper::Request::get(url).body(Full::new(Bytes::new()))?;
    let body = client.send(req).await?;
    serde_json::from_slice(&body).context("admin answer")
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

/// The value after `--name`, parsed; `default` when the flag is absent.
fn flag<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args
            .get(i + 1)
            .with_context(|| format!("{name} needs a value"))?
            .parse::<T>()
            .with_context(|| name.to_owned())?),
        None => Ok(default),
    }
}

/// Scripts' cost inside Redis (`INFO commandstats`), to tell Redis time from sidecar time.
fn print_script_cost(redis: &RedisServer) {
    match redis.cli(&["INFO", "commandstats"]) {
        Ok(stats) => {
            for line in stats
                .lines()
                .filter(|l| l.starts_with("cmdstat_evalsha") || l.starts_with("cmdstat_set:"))
            {
                println!("  {}", line.trim());
            }
        }
        Err(err) => println!("  (no commandstats: {err})"),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let seconds: f64 = flag(&args, "--seconds", 3.0)?;
    let connections: usize = flag(&args, "--connections", CONNECTIONS)?;
    let only: String = flag(&args, "--only", String::new())?;
    let protocol = if args.iter().any(|a| a == "--http1") {
        Protocol::H1
    } else {
        Protocol::H2
    };
    if connections == 0 || !["", "raw", "memory", "redis"].contains(&only.as_str()) {
        bail!("--connections must be positive; --only takes raw, memory or redis");
    }
    let wanted = |target: &str| only.is_empty() || only == target;
    let redis = RedisServer::start().context("starting redis-server")?;
    println!(
        "sidecar-bench: claim+complete round trips ({seconds} s per run, loopback, {})",
        match protocol {
            Protocol::H2 => format!("h2c, {connections} connections"),
            Protocol::H1 => "HTTP/1.1, one connection per worker".to_owned(),
        }
    );
    println!(
        "{:<14} {:>5} {:>12} {:>11} {:>11} {:>9}",
        "target", "conc", "ops/s", "p50", "p99", "vs raw"
    );
    for concurrency in CONCURRENCY {
        let mut runs = Vec::new();
        if wanted("raw") {
            let run = raw_redis_round_trips(&redis.url(), concurrency, seconds).await?;
            runs.push(("raw redis", run));
        }
        if wanted("redis") {
            let run = sidecar_round_trips(
                redis.store_config(),
                concurrency,
                protocol,
                connections,
                seconds,
            )
            .await?;
            runs.push(("sidecar/redis", run));
        }
        if wanted("memory") {
            let run = sidecar_round_trips(
                StoreConfig::Memory,
                concurrency,
                protocol,
                connections,
                seconds,
            )
            .await?;
            runs.push(("sidecar/memory", run));
        }
        let raw_ops = runs
            .iter()
            .find(|(name, _)| *name == "raw redis")
            .map(|(_, run)| run.ops_per_sec);
        for (name, run) in &runs {
            let ratio = raw_ops.map_or_else(
                || "-".to_owned(),
                |raw| format!("{:.2}x", run.ops_per_sec / raw),
            );
            println!(
                "{:<14} {:>5} {:>12.0} {:>11} {:>11} {:>9}",
                name,
                concurrency,
                run.ops_per_sec,
                ms(run.p50),
                ms(run.p99),
                ratio
            );
        }
    }
    print_script_cost(&redis);
    if !only.is_empty() {
        return Ok(());
    }
    println!("hand-off: release (complete sent) -> next waiter granted, {HANDOFFS} samples");
    for (name, store) in [
        ("memory", StoreConfig::Memory),
        ("redis", redis.store_config()),
    ] {
        let (p50, p99) = handoff_latency(store).await?;
        println!("{name:<14} p50 {:>11} p99 {:>11}", ms(p50), ms(p99));
    }
    Ok(())
}
