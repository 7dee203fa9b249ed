//! Group `sidecar`: claim+complete round trips per second and latency at concurrency 1 and
//! 64, on the memory and Redis stores, beside raw Redis doing the minimal equivalent (`SET NX
//! PX` then a compare-and-delete script) against the same `redis-server` in the same run,
//! and beside the sidecar's HTTP stack answering fixed bodies (the HTTP hop alone, the
//! ceiling of any store); and the hand-off latency from a release to the next waiter's grant.
//!
//! The sidecar runs in-process on 127.0.0.1:0, on its own runtime (as if it were its own
//! process), and is driven over a few h2c connections, as Envoy multiplexes callouts (one
//! connection per worker thread). Client, sidecar and Redis share the machine's cores, so the
//! figures compare; they are not capacity numbers. Each run also splits the CPU time it cost
//! between the bench client, the sidecar and Redis, per round trip, and counts the commands
//! Redis ran per round trip: on a CPU-bound machine that split, not the wall clock, says
//! where a ratio comes from.

use crate::cpu::{UserSystem, cpu_of, redis_commands, threads_cpu_split};
use crate::stats::{Summary, percentile};
use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate_sidecar::testing::RedisServer;
use idemgate_sidecar::{Config, Sidecar, StoreConfig};
use idemgate_wire::{
    ClaimOutcome, ClaimRequest, CompleteRequest, Mode, OwnerOutcome, WaitPolicy, paths,
};
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

/// Name prefix of the sidecar runtime's threads, here and in the rig's in-process sidecar.
pub use idemgate_rig::sidecar::SIDECAR_THREADS;

/// h2c connections a run uses at most (Envoy: one per worker thread).
const CONNECTIONS: usize = 4;

/// A multiplexed h2c connection to the sidecar.
#[derive(Clone)]
pub struct H2 {
    send: SendRequest<Full<Bytes>>,
    authority: String,
}

impl H2 {
    pub async fn connect(addr: SocketAddr) -> Result<H2> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await?;
        tokio::spawn(conn);
        Ok(H2 {
            send,
            authority: addr.to_string(),
        })
    }

    /// The connections `concurrency` callers share: one each, up to [`CONNECTIONS`].
    pub(crate) async fn connect_for(addr: SocketAddr, concurrency: usize) -> Result<Vec<H2>> {
        let mut clients = Vec::with_capacity(concurrency.min(CONNECTIONS));
        for _ in 0..concurrency.min(CONNECTIONS) {
            clients.push(H2::connect(addr).await?);
        }
        Ok(clients)
    }

    /// One round trip of the figures: claims `key`, a key nobody holds (lock mode), and
    /// completes it.
    pub(crate) async fn fresh_pair(&self, key: &str) -> Result<()> {
        match self.claim(&lock_claim(key.to_owned(), false)).await? {
            ClaimOutcome::Granted { owner, .. } => self.complete(key, &owner).await,
            other => bail!("claim answered {other:?}"),
        }
    }

    async fn request(&self, request: hyper::Request<Full<Bytes>>) -> Result<Bytes> {
        let mut send = self.send.clone();
        send.ready().await?;
        let response = send.send_request(request).await?;
        if response.status() != hyper::StatusCode::OK {
            bail!("sidecar answered {}", response.status());
        }
        Ok(response.into_body().collect().await?.to_bytes())
    }

    async fn post<T: serde::Serialize>(&self, path: &str, head: &T) -> Result<Bytes> {
        let request = hyper::Request::post(format!("http://{}{path}", self.authority))
            .header("content-type", idemgate_wire::CONTENT_TYPE)
            .body(Full::new(Bytes::from(idemgate_wire::encode(head, &[]))))?;
        self.request(request).await
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
        match idemgate_wire::decode::<OwnerOutcome>(&self.post(paths::COMPLETE, &req).await?)?.0 {
            OwnerOutcome::Released => Ok(()),
            other => bail!("complete answered {other:?}"),
        }
    }

    async fn queue_len(&self, key: &str) -> Result<u32> {
        let request = hyper::Request::get(format!("http://{}/admin/v1/keys/{key}", self.authority))
            .body(Full::new(Bytes::new()))?;
        let info: idemgate_sidecar::KeyInfo =
            serde_json::from_slice(&self.request(request).await?)?;
        Ok(info.queue_len)
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
        waiter: None,
    }
}

/// One closed-loop run's throughput, latency percentiles (µs), CPU per round trip (µs) and
/// the commands Redis executed per round trip (scripts and the calls inside them).
pub struct Run {
    pub ops_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub cpu: CpuSplit,
    pub redis_commands: f64,
}

/// CPU time per round trip (µs) of each party.
#[derive(Clone, Copy)]
pub struct CpuSplit {
    /// This process's threads other than the sidecar's: the load-generating client.
    pub client: f64,
    /// The sidecar runtime's threads (HTTP server, protocol, Redis client).
    pub sidecar: f64,
    /// The kernel's part of `sidecar` (system calls, wake-ups, the sockets' work), as the
    /// kernel's sampling splits it.
    pub sidecar_kernel: f64,
    /// The `redis-server` process (its own `INFO cpu`).
    pub redis: f64,
}

/// CPU seconds used so far: (this process, its sidecar threads, the Redis servers).
fn cpu_seconds(redis: &[&RedisServer]) -> Result<(f64, UserSystem, f64)> {
    let process = cpu_of(Path::new("/proc/self"))
        .context("cannot parse /proc/self/stat")?
        .1;
    let sidecar = threads_cpu_split(SIDECAR_THREADS);
    let mut redis_seconds = 0.0;
    for server in redis {
        let info = server.cli(&["INFO", "cpu"])?;
        redis_seconds += info
            .lines()
            .filter_map(|l| {
                l.strip_prefix("used_cpu_sys:")
                    .or_else(|| l.strip_prefix("used_cpu_user:"))
            })
            .filter_map(|v| v.trim().parse::<f64>().ok())
            .sum::<f64>();
    }
    Ok((process, sidecar, redis_seconds))
}

/// Commands the Redis servers ran so far.
fn commands_of(redis: &[&RedisServer]) -> Result<f64> {
    redis.iter().map(|server| redis_commands(server)).sum()
}

/// Runs `op(worker, i)` from `concurrency` workers for `seconds`, accounting CPU time and
/// Redis commands.
async fn closed_loop<F, Fut>(
    redis: &[&RedisServer],
    concurrency: usize,
    seconds: f64,
    op: F,
) -> Result<Run>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<()>> + Send,
{
    let cpu_before = cpu_seconds(redis)?;
    let commands_before = commands_of(redis)?;
    let op = Arc::new(op);
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let workers: Vec<_> = (0..concurrency)
        .map(|w| {
            let op = Arc::clone(&op);
            tokio::spawn(async move {
                let mut latencies_us = Vec::new();
                let mut i = 0u64;
                while Instant::now() < until {
                    let t = Instant::now();
                    op(w, i).await?;
                    latencies_us.push(t.elapsed().as_secs_f64() * 1e6);
                    i += 1;
                }
                Ok::<_, anyhow::Error>(latencies_us)
            })
        })
        .collect();
    let mut all = Vec::new();
    for worker in workers {
        all.extend(worker.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_after = cpu_seconds(redis)?;
    let commands = commands_of(redis)? - commands_before;
    let per_op = |before: f64, after: f64| (after - before) * 1e6 / all.len().max(1) as f64;
    let sidecar = per_op(cpu_before.1.total(), cpu_after.1.total());
    let cpu = CpuSplit {
        client: per_op(cpu_before.0, cpu_after.0) - sidecar,
        sidecar,
        sidecar_kernel: per_op(cpu_before.1.system, cpu_after.1.system),
        redis: per_op(cpu_before.2, cpu_after.2),
    };
    Ok(Run {
        cpu,
        redis_commands: commands / all.len().max(1) as f64,
        ops_per_sec: all.len() as f64 / elapsed,
        p50_us: percentile(&mut all, 50.0).unwrap_or_default(),
        p99_us: percentile(&mut all, 99.0).unwrap_or_default(),
    })
}

/// Sidecar runs so far in this process: each claims keys no earlier run used.
static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A number no earlier sidecar run of this process had. Keys of one run only: a key claimed
/// by an earlier run still has its record (its fence, for `--fence-ttl-secs`), and claiming
/// it is not the fresh-key path.
pub(crate) fn next_run() -> u64 {
    RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// What answers the bench client's claims and completes.
#[derive(Clone)]
pub enum Server {
    /// The sidecar on this store.
    Sidecar(StoreConfig),
    /// The sidecar's HTTP stack answering fixed bodies without a store
    /// ([`Sidecar::spawn_canned`]): the HTTP hop alone, which no store change can remove.
    HttpHop,
}

impl Server {
    /// A sidecar serving this on 127.0.0.1, on the current runtime.
    pub async fn spawn(self) -> Result<Sidecar> {
        Ok(match self {
            Server::Sidecar(store) => Sidecar::spawn(Config::loopback(store)).await?,
            Server::HttpHop => Sidecar::spawn_canned(Config::loopback(StoreConfig::Memory)).await?,
        })
    }
}

/// claim (granted) + complete (released) round trips through `target`, served by the
/// runtime `server` (whose threads are named [`SIDECAR_THREADS`]); `redis` are the servers
/// whose CPU time and commands are accounted (a Cluster's primaries).
pub async fn sidecar_round_trips(
    server: &Handle,
    target: Server,
    redis: &[&RedisServer],
    concurrency: usize,
    seconds: f64,
) -> Result<Run> {
    let sidecar = server.spawn(target.spawn()).await??;
    let clients = H2::connect_for(sidecar.addr(), concurrency).await?;
    let run_id = next_run();
    let run = closed_loop(redis, concurrency, seconds, move |w, i| {
        let client = clients.get(w % clients.len().max(1)).cloned();
        async move {
            let client = client.context("no connection")?;
            client.fresh_pair(&format!("bench-{run_id}-{w}-{i}")).await
        }
    })
    .await;
    server.spawn(sidecar.shutdown()).await??;
    run
}

/// The baseline: `SET key owner NX PX` then compare-and-delete, on one multiplexed
/// connection (the redis crate's, as the sidecar uses).
pub async fn raw_redis_round_trips(
    redis: &RedisServer,
    concurrency: usize,
    seconds: f64,
) -> Result<Run> {
    let client = redis::Client::open(redis.url())?;
    let conn = client.get_multiplexed_async_connection().await?;
    let release = Arc::new(redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end",
    ));
    closed_loop(&[redis], concurrency, seconds, move |w, i| {
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

/// Release → next grant, `samples` times: a waiter long-polls, the holder completes; the
/// gap runs from just before the complete is sent to the waiter's grant arriving (µs).
pub async fn handoff_us(store: StoreConfig, samples: usize) -> Result<Vec<f64>> {
    let sidecar = Sidecar::spawn(Config::loopback(store)).await?;
    let client = H2::connect(sidecar.addr()).await?;
    let key = "bench-handoff".to_owned();
    let mut holder = match client.claim(&lock_claim(key.clone(), false)).await? {
        ClaimOutcome::Granted { owner, .. } => owner,
        other => bail!("claim answered {other:?}"),
    };
    let mut gaps = Vec::with_capacity(samples);
    for _ in 0..samples {
        let waiter = {
            let client = client.clone();
            let req = lock_claim(key.clone(), true);
            tokio::spawn(async move { (client.claim(&req).await, Instant::now()) })
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while client.queue_len(&key).await? != 1 {
            if Instant::now() > deadline {
                bail!("the waiter did not queue within 5 s");
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let released = Instant::now();
        client.complete(&key, &holder).await?;
        let (outcome, granted_at) = waiter.await?;
        holder = match outcome? {
            ClaimOutcome::Granted { owner, .. } => owner,
            other => bail!("the waiter got {other:?}"),
        };
        gaps.push(granted_at.saturating_duration_since(released).as_secs_f64() * 1e6);
    }
    // A Redis store outlives this sidecar: leave the key free for the next run.
    client.complete(&key, &holder).await?;
    sidecar.shutdown().await?;
    Ok(gaps)
}

/// Medians and spreads of repeated runs of one configuration.
pub struct Repeated {
    pub ops: Summary,
    pub p50: Summary,
    pub p99: Summary,
    /// CPU µs per round trip: bench client, sidecar, Redis.
    pub cpu_client: Summary,
    pub cpu_sidecar: Summary,
    pub cpu_redis: Summary,
    pub cpu_total: Summary,
    /// Redis commands per round trip (scripts and the calls inside them).
    pub redis_commands: Summary,
}

pub async fn repeat<F, Fut>(runs: usize, mut one: F) -> Result<Repeated>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Run>>,
{
    let mut all = Vec::new();
    for _ in 0..runs {
        all.push(one().await?);
    }
    Repeated::of(&all)
}

/// `rounds` rounds of one run of `a` then one of `b`: two configurations measured side by
/// side, so that each run of `b` has a run of `a` beside it, minutes or seconds apart rather
/// than a whole series apart. On a VM whose speed drifts by tens of percent between minutes,
/// the ratio within a round repeats where the ratio of two series' medians does not.
pub async fn alternate<A, FutA, B, FutB>(
    rounds: usize,
    mut a: A,
    mut b: B,
) -> Result<(Vec<Run>, Vec<Run>)>
where
    A: FnMut() -> FutA,
    FutA: Future<Output = Result<Run>>,
    B: FnMut() -> FutB,
    FutB: Future<Output = Result<Run>>,
{
    let (mut runs_a, mut runs_b) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for _ in 0..rounds {
        runs_a.push(a().await?);
        runs_b.push(b().await?);
    }
    Ok((runs_a, runs_b))
}

impl Repeated {
    pub fn of(runs: &[Run]) -> Result<Repeated> {
        let summary = |value: fn(&Run) -> f64| {
            Summary::of(&runs.iter().map(value).collect::<Vec<_>>()).context("no runs")
        };
        Ok(Repeated {
            ops: summary(|r| r.ops_per_sec)?,
            p50: summary(|r| r.p50_us)?,
            p99: summary(|r| r.p99_us)?,
            cpu_client: summary(|r| r.cpu.client)?,
            cpu_sidecar: summary(|r| r.cpu.sidecar)?,
            cpu_redis: summary(|r| r.cpu.redis)?,
            cpu_total: summary(|r| r.cpu.client + r.cpu.sidecar + r.cpu.redis)?,
            redis_commands: summary(|r| r.redis_commands)?,
        })
    }
}
