//! The benchmark groups and the report they write. Each group writes its own section
//! (`benchmarks/<group>.md`) and chart (`benchmarks/<group>.svg`); `BENCHMARKS.md` is
//! reassembled from every section present, so running one group keeps the others' figures.

use crate::callgrind;
use crate::chart;
use crate::plugin_cost::{self, Kind};
use crate::report::{self, Figure, Goal, Group, Machine};
use crate::stats::Summary;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Group ids in report order.
const GROUPS: [&str; 1] = ["plugin"];

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
    let mut failed = Vec::new();
    for id in GROUPS {
        if !wanted.is_empty() && !wanted.iter().any(|w| w == id) {
            continue;
        }
        println!("== group {id}");
        let group = match id {
            "plugin" => plugin(target)?,
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
        }
    }
    std::fs::write(out, document)?;
    println!("wrote {}", out.display());
    if !failed.is_empty() {
        bail!("correctness checks failed: {}", failed.join("; "));
    }
    Ok(())
}

/// Requests per callgrind run and per wall-clock run, and repetitions of each.
const CALLGRIND_REQUESTS: u64 = 2_000;
const CALLGRIND_RUNS: usize = 3;
const WALL_REQUESTS: u64 = 20_000;
const WALL_RUNS: usize = 5;

fn plugin(target: &Path) -> Result<Group> {
    let noop = target.join("fixtures/noop.wasm");
    let idemgate = target.join("idemgate.wasm");
    let exe = std::env::current_exe()?;
    let scratch = std::env::temp_dir();
    let instructions = |module: &Path, kind: Kind| -> Result<Summary> {
        let mut samples = Vec::new();
        for _ in 0..CALLGRIND_RUNS {
            let args = [
                "callgrind-child".to_owned(),
                "--module".to_owned(),
                module.display().to_string(),
                "--kind".to_owned(),
                kind.name().to_owned(),
                "--requests".to_owned(),
                CALLGRIND_REQUESTS.to_string(),
            ];
            let total = callgrind::instructions("*measured_requests*", &exe, &args, &scratch)?;
            samples.push(total as f64 / CALLGRIND_REQUESTS as f64);
        }
        Summary::of(&samples).context("no samples")
    };
    let nanos = |module: &Path, kind: Kind| -> Result<Summary> {
        let mut samples = Vec::new();
        for _ in 0..WALL_RUNS {
            let per_request = plugin_cost::wall_time(module, kind, WALL_REQUESTS)?;
            samples.push(per_request.as_nanos() as f64);
        }
        Summary::of(&samples).context("no samples")
    };

    println!("  no-op filter baseline (callgrind, then wall time)");
    let base_instr = instructions(&noop, Kind::NoRule)?;
    let base_ns = nanos(&noop, Kind::NoRule)?;
    let baseline = |s: Summary| Some(("no-op filter".to_owned(), s));
    let mut figures = Vec::new();
    for kind in Kind::ALL {
        println!("  idemgate: {}", kind.describe());
        let goal = (kind == Kind::NoRule).then_some(Goal::RatioAtMost(1.2));
        figures.push(Figure {
            name: format!("{} — instructions", kind.describe()),
            unit: "instr/request",
            value: instructions(&idemgate, kind)?,
            baseline: baseline(base_instr),
            goal,
        });
        figures.push(Figure {
            name: format!("{} — wall time", kind.describe()),
            unit: "ns/request",
            value: nanos(&idemgate, kind)?,
            baseline: baseline(base_ns),
            goal: None,
        });
    }
    let size = std::fs::metadata(&idemgate)
        .with_context(|| format!("{} (run cargo xtask wasm)", idemgate.display()))?
        .len() as f64
        / 1024.0;
    figures.push(Figure {
        name: "`idemgate.wasm` size".into(),
        unit: "KiB",
        value: Summary::of(&[size]).context("size")?,
        baseline: None,
        goal: Some(Goal::AtMost(256.0)),
    });
    Ok(Group {
        id: "plugin",
        title: "Plugin cost per request",
        command: "cargo xtask bench plugin".into(),
        figures,
        checks: Vec::new(),
        notes: vec![format!(
            "The filter runs in `idemgate-host` (wasmtime, the project's Envoy-faithful host) with \
             a virtual clock; each request is a whole stream lifecycle (context create, request \
             headers, response headers, log/done/delete). The sidecar's answers are canned, so \
             these figures are the filter's and the host's own cost; the network and the \
             sidecar are measured in the sidecar group. Every request is checked to take its \
             path (pass; 409 from the local tier with no callout; claim, upstream, complete) \
             or the bench fails. Instructions: callgrind over \
             {CALLGRIND_REQUESTS} requests after a warm-up, {CALLGRIND_RUNS} runs; wall time: \
             {WALL_REQUESTS} requests, {WALL_RUNS} runs."
        )],
    })
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
