//! The benchmark groups and the report they write. Each group writes its own section
//! (`benchmarks/<group>.md`) and chart (`benchmarks/<group>.svg`); `BENCHMARKS.md` is
//! reassembled from every section present, so running one group keeps the others' figures.

use crate::callgrind;
use crate::chart;
use crate::gateway_load;
use crate::plugin_cost::{self, Kind};
use crate::report::{self, Figure, Goal, Group, Machine};
use crate::sidecar_load::{self, Repeated};
use crate::stats::{Summary, percentile};
use anyhow::{Context, Result, bail};
use idemgate_sidecar::StoreConfig;
use idemgate_sidecar::testing::RedisServer;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Group ids in report order.
const GROUPS: [&str; 3] = ["plugin", "host", "sidecar"];

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
            "host" => host(target)?,
            "sidecar" => sidecar()?,
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

/// Seconds of closed-loop load per gateway run.
const GATEWAY_SECONDS: u64 = 5;

fn host(target: &Path) -> Result<Group> {
    let noop = target.join("fixtures/noop.wasm");
    let backend = gateway_load::upstream()?;
    let (mut bare, mut filtered) = (Vec::new(), Vec::new());
    for run in 0..LOAD_RUNS {
        println!(
            "  run {}: gateway without a filter, then with the no-op filter",
            run + 1
        );
        bare.push(gateway_load::throughput(backend, None, GATEWAY_SECONDS)?);
        filtered.push(gateway_load::throughput(
            backend,
            Some(&noop),
            GATEWAY_SECONDS,
        )?);
    }
    Ok(Group {
        title: "Host overhead: the gateway with and without a filter",
        command: "cargo xtask bench host".into(),
        figures: vec![Figure {
            name: "gateway with the no-op filter (1 worker)".into(),
            unit: "requests/s",
            value: Summary::of(&filtered).context("no runs")?,
            baseline: Some((
                "same gateway, no filter".into(),
                Summary::of(&bare).context("no runs")?,
            )),
            goal: None,
        }],
        checks: Vec::new(),
        notes: vec![format!(
            "`idemgate-gateway` (the harness's live mode: hyper, one worker thread with its own \
             event loop and VM) in front of a keep-alive upstream answering `200 ok`; \
             {} keep-alive HTTP/1.1 clients in a closed loop for {GATEWAY_SECONDS} s per run, \
             {LOAD_RUNS} runs alternating the two configurations. The no-op filter's cost inside \
             the VM per request (instructions and ns) is the baseline of the plugin group.",
            gateway_load::CONNECTIONS
        )],
    })
}

/// Seconds per closed-loop run, runs per configuration, hand-off samples per run.
const LOAD_SECONDS: f64 = 3.0;
const LOAD_RUNS: usize = 3;
const HANDOFF_SAMPLES: usize = 100;

fn sidecar() -> Result<Group> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // The sidecar gets runtime threads of its own, as its own process would have.
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(sidecar_load::SIDECAR_THREADS)
        .enable_all()
        .build()?;
    let server = server.handle();
    runtime.block_on(async {
        let redis = RedisServer::start().context("starting redis-server")?;
        let mut figures = Vec::new();
        for concurrency in [1usize, 64] {
            println!("  concurrency {concurrency}: raw Redis, sidecar on Redis, sidecar on memory");
            let raw = sidecar_load::repeat(LOAD_RUNS, || {
                sidecar_load::raw_redis_round_trips(&redis, concurrency, LOAD_SECONDS)
            })
            .await?;
            let on_redis = sidecar_load::repeat(LOAD_RUNS, || {
                let store = redis.store_config();
                sidecar_load::sidecar_round_trips(server, store, &redis, concurrency, LOAD_SECONDS)
            })
            .await?;
            let on_memory = sidecar_load::repeat(LOAD_RUNS, || {
                let store = StoreConfig::Memory;
                sidecar_load::sidecar_round_trips(server, store, &redis, concurrency, LOAD_SECONDS)
            })
            .await?;
            let goal = (concurrency == 64).then_some(Goal::RatioAtLeast(0.5));
            for (store, run, goal) in [("Redis", &on_redis, goal), ("memory", &on_memory, None)] {
                figures.extend(load_figures(store, concurrency, run, &raw, goal));
            }
        }
        for (store, config) in [
            ("memory", StoreConfig::Memory),
            ("Redis", redis.store_config()),
        ] {
            println!("  hand-off on {store}");
            let (mut p50, mut p99) = (Vec::new(), Vec::new());
            for _ in 0..LOAD_RUNS {
                let mut gaps = sidecar_load::handoff_us(config.clone(), HANDOFF_SAMPLES).await?;
                p50.extend(percentile(&mut gaps, 50.0));
                p99.extend(percentile(&mut gaps, 99.0));
            }
            figures.push(Figure {
                name: format!("hand-off on {store}: release → next grant, p50"),
                unit: "µs",
                value: Summary::of(&p50).context("no samples")?,
                baseline: None,
                goal: Some(Goal::AtMost(1000.0)),
            });
            figures.push(Figure {
                name: format!("hand-off on {store}: release → next grant, p99"),
                unit: "µs",
                value: Summary::of(&p99).context("no samples")?,
                baseline: None,
                goal: None,
            });
        }
        Ok(Group {
            title: "Sidecar claim+complete against raw Redis",
            command: "cargo xtask bench sidecar".into(),
            figures,
            checks: Vec::new(),
            notes: vec![format!(
                "Closed loop: each worker claims a fresh key (lock mode), completes it, repeats, \
                 for {LOAD_SECONDS} s; {LOAD_RUNS} runs per configuration. The sidecar runs \
                 in-process on its own runtime (two worker threads, as its own process would \
                 have) and is driven over up to 4 h2c connections, as Envoy multiplexes \
                 callouts per worker thread. The baseline is the minimal equivalent in raw \
                 Redis — `SET key owner NX PX` then a compare-and-delete script — over one \
                 multiplexed (auto-pipelining) connection against the same `redis-server` in \
                 the same run; the sidecar's own Redis connection is multiplexed the same way. \
                 Client, sidecar and Redis share the machine's cores, so throughput follows \
                 the CPU time all three spend per round trip: the CPU rows split it (thread \
                 times from /proc for the bench client and the sidecar, `INFO cpu` for \
                 Redis). Hand-off: a waiter long-polls while the holder completes; \
                 {HANDOFF_SAMPLES} samples per run, measured from just before the complete is \
                 sent to the waiter's grant arriving."
            )],
        })
    })
}

fn load_figures(
    store: &str,
    concurrency: usize,
    run: &Repeated,
    raw: &Repeated,
    goal: Option<Goal>,
) -> Vec<Figure> {
    let name = |what: &str| format!("sidecar on {store}, concurrency {concurrency}: {what}");
    let mut figures = vec![
        Figure {
            name: name("throughput"),
            unit: "round trips/s",
            value: run.ops,
            baseline: Some(("raw Redis".into(), raw.ops)),
            goal,
        },
        Figure {
            name: name("p50 latency"),
            unit: "µs",
            value: run.p50,
            baseline: Some(("raw Redis".into(), raw.p50)),
            goal: None,
        },
        Figure {
            name: name("p99 latency"),
            unit: "µs",
            value: run.p99,
            baseline: Some(("raw Redis".into(), raw.p99)),
            goal: None,
        },
    ];
    if concurrency > 1 {
        // Where the CPU went: on a saturated machine throughput is the inverse of the total.
        let cpu = |what: &str, value, baseline: Option<(&str, Summary)>| Figure {
            name: name(&format!("CPU per round trip, {what}")),
            unit: "µs",
            value,
            baseline: baseline.map(|(n, b)| (n.to_owned(), b)),
            goal: None,
        };
        figures.extend([
            cpu(
                "all processes",
                run.cpu_total,
                Some(("raw Redis, client + server", raw.cpu_total)),
            ),
            cpu(
                "bench client",
                run.cpu_client,
                Some(("raw Redis client", raw.cpu_client)),
            ),
            cpu("sidecar", run.cpu_sidecar, None),
            cpu(
                "redis-server",
                run.cpu_redis,
                Some(("raw Redis server", raw.cpu_redis)),
            ),
        ]);
    }
    figures
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
