//! The benchmark groups and the report they write. Each group writes its own section
//! (`benchmarks/<group>.md`) and chart (`benchmarks/<group>.svg`); `BENCHMARKS.md` is
//! reassembled from every section present, so running one group keeps the others' figures.
//! What people measured by hand beside a group lives in `benchmarks/<group>.notes.md`, which
//! the bench only reads: rerunning the group rewrites its section, never those notes.

use crate::chart;
use crate::report::{self, Machine};
use crate::stack::{Conflict, GatewaySpec, plugin_config};
use crate::stats::Summary;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

mod e2e;
mod host;
mod plugin;
mod queue;
mod sidecar;
mod storm;

/// Group ids in report order (each is the module of that name, `peer` aside).
const GROUPS: [&str; 7] = ["plugin", "host", "sidecar", "queue", "storm", "e2e", "peer"];
/// Groups run only when named: `peer` installs its baseline product first.
const ON_REQUEST: [&str; 1] = ["peer"];

pub fn run(wanted: &[String], target: &Path, out: &Path) -> Result<()> {
    for name in wanted {
        if !GROUPS.contains(&name.as_str()) {
            bail!("unknown group {name} (groups: {})", GROUPS.join(", "));
        }
    }
    let dir = out
        .parent()
        .map(|p| p.join("benchmarks"))
        .unwrap_or_else(|| PathBuf::from("benchmarks"));
    std::fs::create_dir_all(&dir)?;
    let machine = machine();
    let envoy_yaml = out
        .parent()
        .unwrap_or(Path::new("."))
        .join("envoy/envoy.yaml");
    let modules = Modules {
        idemgate: target.join("idemgate.wasm"),
        noop: target.join("fixtures/noop.wasm"),
        envoy_yaml,
    };
    let mut failed = Vec::new();
    for id in GROUPS {
        let named = wanted.iter().any(|w| w == id);
        if (!wanted.is_empty() || ON_REQUEST.contains(&id)) && !named {
            continue;
        }
        println!("== group {id}");
        let group = match id {
            "plugin" => plugin::group(target)?,
            "host" => host::group(target)?,
            "sidecar" => sidecar::group()?,
            "queue" => queue::group(&modules)?,
            "storm" => storm::group(&modules)?,
            "e2e" => e2e::group(&modules)?,
            "peer" => crate::peer::group(target, &modules.envoy_yaml, &modules.idemgate)?,
            _ => unreachable!("GROUPS lists every group"),
        };
        chart::ratios(&group, &dir.join(format!("{id}.svg")))?;
        let section = report::section(&machine, &group, &format!("benchmarks/{id}.svg"));
        print!("{section}");
        std::fs::write(dir.join(format!("{id}.md")), &section)?;
        failed.extend(
            group
                .checks
                .iter()
                .filter(|c| !c.held)
                .map(|c| c.what.clone()),
        );
    }
    let mut document = String::from(report::INTRO);
    for id in GROUPS {
        if let Ok(section) = std::fs::read_to_string(dir.join(format!("{id}.md"))) {
            document.push('\n');
            document.push_str(&section);
            if let Ok(notes) = std::fs::read_to_string(dir.join(format!("{id}.notes.md"))) {
                document.push_str(&notes);
            }
        }
    }
    std::fs::write(out, document)?;
    println!("wrote {}", out.display());
    if !failed.is_empty() {
        bail!("correctness checks failed: {}", failed.join("; "));
    }
    Ok(())
}

/// Runs per configuration of the host and sidecar groups.
const LOAD_RUNS: usize = 3;

/// The modules and the Envoy bootstrap the gateway groups run.
struct Modules {
    idemgate: PathBuf,
    noop: PathBuf,
    envoy_yaml: PathBuf,
}

impl Modules {
    fn gateway<'a>(
        &'a self,
        module: &'a Path,
        conflict: Conflict,
        workers: usize,
    ) -> GatewaySpec<'a> {
        GatewaySpec {
            envoy_yaml: &self.envoy_yaml,
            module,
            plugin_config: plugin_config(conflict),
            workers,
        }
    }
}

/// Runs per configuration of the gateway groups; gateway workers of the queue and e2e groups.
const GATEWAY_RUNS: usize = 3;
const GATEWAY_WORKERS: usize = 2;

fn summary_of(samples: impl IntoIterator<Item = f64>) -> Result<Summary> {
    Summary::of(&samples.into_iter().collect::<Vec<_>>()).context("no runs")
}

fn machine() -> Machine {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    let memory = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map(|kib| format!("{:.0} GiB", kib / 1024.0 / 1024.0))
        .unwrap_or_else(|| "unknown".into());
    let output = |cmd: &mut Command| {
        cmd.output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    Machine {
        cpu,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory,
        kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
        when: output(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"])),
        revision: output(Command::new("git").args(["rev-parse", "--short", "HEAD"])),
    }
}
