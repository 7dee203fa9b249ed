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
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Run {
            groups,
            target,
            out,
        } => groups::run(&groups, &target, &out),
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
    }
}
