//! `idemgate-bench`: runs benchmark groups and writes `BENCHMARKS.md` with one SVG chart per
//! group. Started by `cargo xtask bench [group...]`, which builds everything it needs first.

mod callgrind;
mod chart;
mod client;
mod cpu;
mod gateway_load;
mod groups;
mod peer;
mod plugin_cost;
mod queue_handoff;
mod report;
mod sidecar_instructions;
mod sidecar_load;
mod stack;
mod stats;
mod storm;
mod vm_costs;
mod wrk;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// Envoy runs on tcmalloc, not glibc's malloc. glibc consolidates its fast bins whenever a
/// free merges into a top chunk over 64 KiB, which happens or not on every request depending
/// on the heap layout earlier work left behind: the same filter measured up to 5 % apart,
/// more than the per-request difference under test. mimalloc has no such path.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(about = "idemgate benchmarks against same-run baselines")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run groups (all when none is named) and write the report.
    Run {
        /// Groups to run: plugin, host, sidecar, queue, storm, e2e (all when none is named),
        /// and peer (idemgate beside idempotent-proxy-server; only when named).
        groups: Vec<String>,
        /// The workspace's target directory (modules and binaries).
        #[arg(long, default_value = "target")]
        target: PathBuf,
        /// Where the report goes; charts go to `benchmarks/` beside it.
        #[arg(long, default_value = "BENCHMARKS.md")]
        out: PathBuf,
    },
    /// Internal: the process `valgrind --tool=callgrind` runs for one plugin measurement.
    CallgrindChild {
        #[arg(long)]
        module: PathBuf,
        #[arg(long)]
        kind: String,
        #[arg(long)]
        requests: u64,
    },
    /// Internal: the sidecar process `valgrind --tool=callgrind` runs for one sidecar count.
    SidecarChild {
        /// `hop`, `memory` or a `redis://` URL.
        #[arg(long)]
        serve: String,
    },
    /// For profiling by hand: drives a `sidecar-child` (or any sidecar) at `addr` with the
    /// counted runs' load, `pairs` fresh claim+complete pairs, then exits. Run the child under
    /// `perf` or `valgrind` and this beside it (benchmarks/sidecar.notes.md, Session 27).
    DriveSidecar {
        #[arg(long)]
        addr: std::net::SocketAddr,
        #[arg(long)]
        pairs: u64,
        /// Client runtime threads.
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
}

/// mimalloc's setting for how long freed memory stays before it goes back to the OS.
const PURGE_DELAY: &str = "MIMALLOC_PURGE_DELAY";

/// Runs the benchmarks again in a process whose allocator keeps the memory it frees (unless
/// the caller set [`PURGE_DELAY`] itself). Every gateway group starts fresh stacks in this one
/// process, and by default mimalloc hands a stopped stack's memory back to the OS a second
/// later, so each storm zeroed its thousand connections' pages again: up to half of the
/// gateway workers' time in a storm's arrival burst went to the kernel's page clearing
/// (`perf`), which a gateway in service does not pay. Envoy's allocator keeps freed memory
/// too: Envoy asks it to release only beyond 100 MiB unused (`source/common/memory/utils.cc`).
/// The setting is read when the process starts, hence the second process.
fn with_freed_memory_kept() -> Result<()> {
    if std::env::var_os(PURGE_DELAY).is_some() {
        return Ok(());
    }
    use std::os::unix::process::CommandExt;
    let program = std::env::current_exe().context("finding the bench's own executable")?;
    let failed = std::process::Command::new(program)
        .args(std::env::args_os().skip(1))
        .env(PURGE_DELAY, "-1")
        .exec();
    Err(failed).context("running the bench with its allocator keeping freed memory")
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Run {
            groups,
            target,
            out,
        } => {
            with_freed_memory_kept()?;
            groups::run(&groups, &target, &out)
        }
        Command::CallgrindChild {
            module,
            kind,
            requests,
        } => {
            let kind = plugin_cost::Kind::parse(&kind)?;
            let mut driver = plugin_cost::Driver::boot(&module, kind)
                .with_context(|| format!("booting {}", module.display()))?;
            // Warm-up outside the counted function: first-touch page faults and lazy
            // initialisation are not per-request costs.
            for _ in 0..50 {
                driver.one()?;
            }
            plugin_cost::measured_requests(&mut driver, requests)
        }
        Command::SidecarChild { serve } => sidecar_instructions::child(&serve),
        Command::DriveSidecar {
            addr,
            pairs,
            threads,
        } => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .enable_all()
            .build()?
            // Keys of their own per process: a sidecar driven twice meets no key it has seen.
            .block_on(sidecar_instructions::drive(
                addr,
                pairs,
                u64::from(std::process::id()),
            )),
    }
}
