//! The plugin group: the filter's own cost per request inside the VM (callgrind instructions
//! and wall-clock ns beside the no-op filter), its size, compile time, VM start and memory.

use crate::callgrind;
use crate::plugin_cost::{self, Kind};
use crate::report::{self, Figure, Goal, Group};
use crate::stats::Summary;
use crate::vm_costs;
use anyhow::{Context, Result};
use std::path::Path;

/// Requests per callgrind run and per wall-clock run, and repetitions of each.
const CALLGRIND_REQUESTS: u64 = 2_000;
const CALLGRIND_RUNS: usize = 3;
const WALL_REQUESTS: u64 = 20_000;
const WALL_RUNS: usize = 5;

pub fn group(target: &Path) -> Result<Group> {
    let noop = target.join("fixtures/noop.wasm");
    let idemgate = target.join("idemgate.wasm");
    let exe = std::env::current_exe()?;
    let scratch = std::env::temp_dir();
    let instructions = |module: &Path, kind: Kind| -> Result<Summary> {
        let calls = CALLGRIND_REQUESTS / kind.requests_per_call();
        let mut samples = Vec::new();
        for _ in 0..CALLGRIND_RUNS {
            let args = [
                "callgrind-child".to_owned(),
                "--module".to_owned(),
                module.display().to_string(),
                "--kind".to_owned(),
                kind.name().to_owned(),
                "--requests".to_owned(),
                calls.to_string(),
            ];
            let total = callgrind::instructions("*measured_requests*", &exe, &args, &scratch)?;
            samples.push(total as f64 / (calls * kind.requests_per_call()) as f64);
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
    figures.extend(vm_figures(&idemgate, &noop)?);
    Ok(Group {
        title: "Plugin cost per request",
        command: "cargo xtask bench plugin".into(),
        figures,
        checks: Vec::new(),
        notes: vec![
            vm_note(),
            format!(
                "The filter runs in `idemgate-host` (wasmtime, the project's Envoy-faithful host) with \
             a virtual clock; each request is a whole stream lifecycle (context create, request \
             headers, response headers, log/done/delete). The sidecar's answers are canned, so \
             these figures are the filter's and the host's own cost; the network and the \
             sidecar are measured in the sidecar group. Every request is checked to take its \
             path (pass; 409 from the local tier with no callout; claim, upstream, complete; \
             429; in a storm, the first claims and goes upstream, the other 63 park without a \
             callout and each gets the first one's 201) or the bench fails. A storm's figure is \
             its whole cost (one claim through the sidecar, 63 duplicates parked on this VM's \
             shared data and answered when it completes) per request: the filter's part of the \
             storm group's burst and fan-out. Instructions: callgrind over \
             {CALLGRIND_REQUESTS} requests after a warm-up, {CALLGRIND_RUNS} runs; wall time: \
             {WALL_REQUESTS} requests, {WALL_RUNS} runs."
            ),
        ],
    })
}

/// Compile runs, VM-start runs (of `START_BOOTS` starts each), and the memory checkpoints.
const COMPILE_RUNS: usize = 5;
const START_RUNS: usize = 5;
const START_BOOTS: u32 = 50;
const MEMORY_CHECKPOINTS: [u64; 4] = [0, 10_000, 100_000, 1_000_000];

/// Compile time, VM start and linear memory of idemgate beside the no-op filter.
fn vm_figures(idemgate: &Path, noop: &Path) -> Result<Vec<Figure>> {
    let summary = |samples: Vec<f64>| Summary::of(&samples).context("no samples");
    let noop_name = || "no-op filter".to_owned();
    println!("  module compile (cold), then VM start");
    let mut figures = vec![
        Figure {
            name: "module compile (wasmtime, cold, no code cache)".into(),
            unit: "ms",
            value: summary(vm_costs::compile_ms(idemgate, COMPILE_RUNS)?)?,
            baseline: Some((
                noop_name(),
                summary(vm_costs::compile_ms(noop, COMPILE_RUNS)?)?,
            )),
            goal: None,
        },
        Figure {
            name: "VM start (instantiate, `_initialize`, `on_vm_start`, `on_configure`)".into(),
            unit: "µs",
            value: summary(vm_costs::start_us(idemgate, START_RUNS, START_BOOTS)?)?,
            baseline: Some((
                noop_name(),
                summary(vm_costs::start_us(noop, START_RUNS, START_BOOTS)?)?,
            )),
            goal: None,
        },
    ];
    println!("  linear memory over 1M requests (idemgate: mixed traffic; no-op: pass-through)");
    let ours = vm_costs::memory_kib(idemgate, Kind::Mixed, &MEMORY_CHECKPOINTS)?;
    let base = vm_costs::memory_kib(noop, Kind::NoRule, &MEMORY_CHECKPOINTS)?;
    for ((at, ours), base) in MEMORY_CHECKPOINTS.iter().zip(&ours).zip(&base) {
        let when = match at {
            0 => "after start".to_owned(),
            n => format!("after {} requests", report::number(*n as f64)),
        };
        figures.push(Figure {
            name: format!("VM linear memory {when}"),
            unit: "KiB",
            value: summary(vec![*ours])?,
            baseline: Some((noop_name(), summary(vec![*base])?)),
            goal: None,
        });
    }
    let growth = |sizes: &[f64]| match (sizes.get(1), sizes.last()) {
        (Some(warm), Some(last)) => last - warm,
        _ => f64::NAN,
    };
    figures.push(Figure {
        name: "VM linear memory growth, 10,000 → 1,000,000 requests".into(),
        unit: "KiB",
        value: summary(vec![growth(&ours)])?,
        baseline: Some((noop_name(), summary(vec![growth(&base)])?)),
        goal: Some(Goal::AtMost(0.0)),
    });
    Ok(figures)
}

fn vm_note() -> String {
    format!(
        "Compile: `wasmtime::Module::new` on a fresh engine with the host's configuration \
         (Cranelift, parallel compilation) and no code cache, {COMPILE_RUNS} runs; wall time on \
         a shared machine. VM start: instantiation plus Envoy's start sequence with the \
         plugin's configuration, mean of {START_BOOTS} starts, {START_RUNS} runs. Memory: one \
         VM driven through {} requests (idemgate: a request matching no rule, a sidecar \
         claim with a fresh key, and a duplicate of that completed call replayed by the local \
         tier, in turn; the no-op filter: requests \
         it passes), its linear memory read at each checkpoint; linear memory never shrinks, \
         so flat means no request leaves anything behind.",
        report::number(MEMORY_CHECKPOINTS.last().copied().unwrap_or_default() as f64)
    )
}
