//! Instructions the sidecar executes per fresh claim+complete pair, counted by callgrind: the
//! stable figure beside the sidecar group's CPU times, which move by ±5–10 % between runs on
//! these shared two-core machines.
//!
//! The sidecar runs alone in a child process (`idemgate-bench sidecar-child`, the shipped
//! Deployment's worker threads) under `valgrind --tool=callgrind`, and this process drives it
//! over real sockets with the sidecar group's client: 64 tasks over 4 h2c connections, each
//! claiming a fresh key (lock mode) and completing it. Two runs of [`COUNTED_PAIRS`] pairs;
//! the difference of their totals over the difference of their pairs is one pair's cost, so
//! start-up, the first connections and shutdown cancel. Under callgrind the process runs one
//! thread at a time, so commands gather into smaller batches than at full speed: the counts
//! compare configurations with each other, not with the CPU rows.

use crate::callgrind;
use crate::sidecar_load::{self, H2, Server};
use crate::stack::SIDECAR_WORKERS;
use anyhow::{Context, Result, bail};
use idemgate_sidecar::StoreConfig;
use idemgate_sidecar::testing::standalone_store;
use std::io::Read;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::AsyncBufReadExt;

/// Pairs of the short and the long run.
const COUNTED_PAIRS: (u64, u64) = (1_000, 6_000);
/// Concurrent client tasks (as the sidecar group's load at 64).
const CONCURRENCY: usize = 64;
/// Bounds on one run under valgrind (about 50 times slower than native).
const START_LIMIT: Duration = Duration::from_secs(120);
const RUN_LIMIT: Duration = Duration::from_secs(600);

/// What a counted sidecar serves: its HTTP stack's fixed answers, or a store.
#[derive(Clone, Copy)]
pub enum Served<'a> {
    HttpHop,
    Memory,
    /// A standalone Redis (or Valkey) server at this `redis://` URL.
    Redis(&'a str),
}

impl Served<'_> {
    /// The child's `--serve` argument.
    fn arg(&self) -> &str {
        match self {
            Served::HttpHop => "hop",
            Served::Memory => "memory",
            Served::Redis(url) => url,
        }
    }

    /// What the child serves for its `--serve` argument.
    fn server(arg: &str) -> Server {
        match arg {
            "hop" => Server::HttpHop,
            "memory" => Server::Sidecar(StoreConfig::Memory),
            url => Server::Sidecar(standalone_store(url.to_owned(), "idemgate")),
        }
    }
}

/// Instructions the sidecar's process executes per fresh claim+complete pair, serving `served`.
pub async fn per_pair(served: Served<'_>) -> Result<f64> {
    let (short, long) = COUNTED_PAIRS;
    let a = counted_run(served, short).await?;
    let b = counted_run(served, long).await?;
    if b <= a {
        bail!("callgrind counted {b} instructions for {long} pairs against {a} for {short}");
    }
    Ok((b - a) as f64 / (long - short) as f64)
}

/// Total instructions of one sidecar process under callgrind that answered `pairs` pairs.
async fn counted_run(served: Served<'_>, pairs: u64) -> Result<u64> {
    let run = sidecar_load::next_run();
    let out = std::env::temp_dir().join(format!(
        "callgrind.sidecar.{}.{run}.out",
        std::process::id()
    ));
    let mut child = tokio::process::Command::from(callgrind::valgrind(&out))
        .arg(std::env::current_exe().context("finding the bench's own executable")?)
        .args(["sidecar-child", "--serve", served.arg()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("running valgrind (apt-get install valgrind)")?;
    let stdout = child.stdout.take().context("the child's standard output")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let addr: SocketAddr = tokio::time::timeout(START_LIMIT, lines.next_line())
        .await
        .context("the sidecar under valgrind did not listen in time")??
        .context("the sidecar under valgrind exited before listening")?
        .trim()
        .parse()
        .context("the sidecar child's address")?;
    tokio::time::timeout(RUN_LIMIT, drive(addr, pairs, run))
        .await
        .context("the counted pairs did not finish in time")??;
    // Closing its standard input stops the child; callgrind writes its totals at exit.
    drop(child.stdin.take());
    let status = tokio::time::timeout(START_LIMIT, child.wait())
        .await
        .context("the sidecar under valgrind did not stop in time")??;
    if !status.success() {
        bail!("the sidecar under valgrind exited with {status}");
    }
    callgrind::take_totals(&out)
}

/// `pairs` fresh claim+complete pairs from [`CONCURRENCY`] tasks over the connections they
/// share to `addr`.
pub async fn drive(addr: SocketAddr, pairs: u64, run: u64) -> Result<()> {
    let clients = H2::connect_for(addr, CONCURRENCY).await?;
    let next = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|task| {
            let client = clients.get(task % clients.len().max(1)).cloned();
            let next = Arc::clone(&next);
            tokio::spawn(async move {
                let client = client.context("no connection")?;
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= pairs {
                        return Ok::<_, anyhow::Error>(());
                    }
                    client.fresh_pair(&format!("counted-{run}-{i}")).await?;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(())
}

/// The `sidecar-child` process: a sidecar serving `serve` (`hop`, `memory` or a `redis://`
/// URL) on 127.0.0.1, its address printed on a line of its own; it stops, gracefully, when
/// its standard input closes.
pub fn child(serve: &str) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(SIDECAR_WORKERS)
        .enable_all()
        .build()?;
    let sidecar = runtime.block_on(Served::server(serve).spawn())?;
    println!("{}", sidecar.addr());
    // Blocks this thread only: the sidecar runs on the runtime's worker meanwhile.
    let mut ignored = Vec::new();
    std::io::stdin().read_to_end(&mut ignored)?;
    runtime.block_on(sidecar.shutdown())?;
    Ok(())
}
