//! The benchmark groups and the report they write. Each group writes its own section
//! (`benchmarks/<group>.md`) and chart (`benchmarks/<group>.svg`); `BENCHMARKS.md` is
//! reassembled from every section present, so running one group keeps the others' figures.

use crate::callgrind;
use crate::chart;
use crate::gateway_load;
use crate::plugin_cost::{self, Kind};
use crate::queue_handoff::{self, HandoffRun};
use crate::report::{self, Check, Figure, Goal, Group, Machine};
use crate::sidecar_load::{self, Repeated, Server};
use crate::stack::{BackendSpec, Conflict, GatewaySpec, Stack, plugin_config};
use crate::stats::{Summary, percentile};
use crate::storm::{self, StormRun};
use crate::vm_costs;
use crate::wrk::{self, Mix, WrkRun};
use anyhow::{Context, Result, bail};
use idemgate_sidecar::StoreConfig;
use idemgate_sidecar::testing::RedisServer;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Group ids in report order.
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
            "plugin" => plugin(target)?,
            "host" => host(target)?,
            "sidecar" => sidecar()?,
            "queue" => queue(&modules)?,
            "storm" => duplicate_storm(&modules)?,
            "e2e" => end_to_end(&modules)?,
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
             path (pass; 409 from the local tier with no callout; claim, upstream, complete) \
             or the bench fails. Instructions: callgrind over \
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
            println!(
                "  concurrency {concurrency}: raw Redis, sidecar on Redis, sidecar on memory, \
                 HTTP hop alone"
            );
            let redis = &redis;
            let raw = sidecar_load::repeat(LOAD_RUNS, || {
                sidecar_load::raw_redis_round_trips(redis, concurrency, LOAD_SECONDS)
            })
            .await?;
            let through = |target: Server| {
                sidecar_load::repeat(LOAD_RUNS, move || {
                    let target = target.clone();
                    sidecar_load::sidecar_round_trips(server, target, redis, concurrency, LOAD_SECONDS)
                })
            };
            let on_redis = through(Server::Sidecar(redis.store_config())).await?;
            let on_memory = through(Server::Sidecar(StoreConfig::Memory)).await?;
            let hop = through(Server::HttpHop).await?;
            let goal = (concurrency == 64).then_some(Goal::RatioAtLeast(0.5));
            for (store, run, goal) in [("Redis", &on_redis, goal), ("memory", &on_memory, None)] {
                figures.extend(load_figures(store, concurrency, run, &raw, goal));
            }
            figures.extend(hop_figures(concurrency, &hop, &on_redis, &raw));
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
            ), "The HTTP hop alone is the sidecar's own HTTP stack (accept loop, connection \
                 settings, axum router, same runtime) answering every claim `granted` and \
                 every complete `released` with fixed bodies, without decoding, protocol \
                 work, metrics or a store, driven by the same client over the same h2c \
                 connections: no store can make the sidecar faster than that, so \
                 \"sidecar on Redis against the HTTP hop alone\" is the share of the \
                 reachable throughput the sidecar and its store achieve, and the hop's ratio \
                 to raw Redis is the ceiling of the goal's ratio on this machine. Redis \
                 commands per round trip come from `INFO commandstats` (every call inside a \
                 script counts, plus the `EVALSHA` itself) and do not depend on load."
                .to_owned()],
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
        if store == "Redis" {
            figures.push(Figure {
                name: name("Redis commands per round trip"),
                unit: "commands",
                value: run.redis_commands,
                baseline: Some(("raw Redis".into(), raw.redis_commands)),
                goal: None,
            });
        }
    }
    figures
}

/// The HTTP hop alone (the ceiling of any store) against raw Redis, and the sidecar on
/// Redis against it.
fn hop_figures(
    concurrency: usize,
    hop: &Repeated,
    on_redis: &Repeated,
    raw: &Repeated,
) -> Vec<Figure> {
    let name = |what: &str| format!("HTTP hop alone, concurrency {concurrency}: {what}");
    let mut figures = vec![
        Figure {
            name: name("throughput"),
            unit: "round trips/s",
            value: hop.ops,
            baseline: Some(("raw Redis".into(), raw.ops)),
            goal: None,
        },
        Figure {
            name: format!(
                "sidecar on Redis, concurrency {concurrency}: throughput against the HTTP hop alone"
            ),
            unit: "round trips/s",
            value: on_redis.ops,
            baseline: Some(("HTTP hop alone".into(), hop.ops)),
            goal: None,
        },
    ];
    if concurrency > 1 {
        figures.extend([
            Figure {
                name: name("CPU per round trip, bench client"),
                unit: "µs",
                value: hop.cpu_client,
                baseline: Some(("raw Redis client".into(), raw.cpu_client)),
                goal: None,
            },
            Figure {
                name: name("CPU per round trip, server"),
                unit: "µs",
                value: hop.cpu_sidecar,
                baseline: Some(("sidecar on Redis, sidecar".into(), on_redis.cpu_sidecar)),
                goal: None,
            },
        ]);
    }
    figures
}

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

fn queue(modules: &Modules) -> Result<Group> {
    let redis = RedisServer::start().context("starting redis-server")?;
    let stores = [
        ("memory", StoreConfig::Memory),
        ("Redis", redis.store_config()),
    ];
    let mut queued: Vec<Vec<HandoffRun>> = vec![Vec::new(); stores.len()];
    let mut retried = Vec::new();
    for run in 0..GATEWAY_RUNS {
        for ((store, config), runs) in stores.iter().zip(queued.iter_mut()) {
            println!("  run {}: queue mode, sidecar on {store}", run + 1);
            let stack = Stack::start(
                config.clone(),
                BackendSpec::Demo,
                &modules.gateway(&modules.idemgate, Conflict::Queue, GATEWAY_WORKERS),
            )?;
            runs.push(queue_handoff::run(
                &stack,
                &format!("queue-{store}-{run}"),
                None,
            )?);
            stack.stop()?;
        }
        println!(
            "  run {}: reject mode, clients retrying every 100 ms",
            run + 1
        );
        let stack = Stack::start(
            redis.store_config(),
            BackendSpec::Demo,
            &modules.gateway(&modules.idemgate, Conflict::Reject, GATEWAY_WORKERS),
        )?;
        retried.push(queue_handoff::run(
            &stack,
            &format!("retry-{run}"),
            Some(queue_handoff::RETRY_EVERY),
        )?);
        stack.stop()?;
    }
    let gap = |runs: &[HandoffRun], p: f64| {
        summary_of(
            runs.iter()
                .filter_map(|r| percentile(&mut r.gaps_us.clone(), p)),
        )
    };
    let total = |runs: &[HandoffRun]| summary_of(runs.iter().map(|r| r.total_s));
    let ideal = |runs: &[HandoffRun]| summary_of(runs.iter().map(|r| r.work_s));
    let retry = |what: &str| format!("100 ms retry loop: {what}");
    let mut figures = Vec::new();
    for ((store, _), runs) in stores.iter().zip(&queued) {
        figures.push(Figure {
            name: format!("queue on {store}: one holder's end → next holder at the backend, p50"),
            unit: "µs",
            value: gap(runs, 50.0)?,
            baseline: Some((retry("p50"), gap(&retried, 50.0)?)),
            goal: Some(Goal::AtMost(1000.0)),
        });
        figures.push(Figure {
            name: format!("queue on {store}: one holder's end → next holder at the backend, p99"),
            unit: "µs",
            value: gap(runs, 99.0)?,
            baseline: Some((retry("p99"), gap(&retried, 99.0)?)),
            goal: Some(Goal::AtMost(5000.0)),
        });
        figures.push(Figure {
            name: format!(
                "queue on {store}: of a hand-off, inside the sidecar (grant → answer), mean"
            ),
            unit: "µs",
            value: summary_of(runs.iter().map(|r| r.sidecar_handoff_us))?,
            baseline: None,
            goal: None,
        });
        figures.push(Figure {
            name: format!("queue on {store}: first call's start → last call's end"),
            unit: "s",
            value: total(runs)?,
            baseline: Some(("ideal: sum of the work".into(), ideal(runs)?)),
            goal: Some(Goal::RatioAtMost(1.02)),
        });
    }
    figures.push(Figure {
        name: retry("first call's start → last call's end"),
        unit: "s",
        value: total(&retried)?,
        baseline: Some(("ideal: sum of the work".into(), ideal(&retried)?)),
        goal: None,
    });
    figures.push(Figure {
        name: retry("requests sent per call"),
        unit: "requests",
        value: summary_of(
            retried
                .iter()
                .map(|r| r.attempts as f64 / queue_handoff::CALLERS as f64),
        )?,
        baseline: None,
        goal: None,
    });
    let runs: Vec<&HandoffRun> = queued.iter().flatten().chain(&retried).collect();
    let checks = vec![Check {
        what: format!(
            "every run: each of the {} calls executed exactly once, never two at a time on the \
             resource, no lost update",
            queue_handoff::CALLERS
        ),
        held: runs.iter().all(|r| {
            r.executions == queue_handoff::CALLERS as u64
                && r.max_overlap == 1
                && r.lost_updates == 0
        }),
    }];
    Ok(Group {
        title: "Queue hand-off: callers contending for one resource",
        command: "cargo xtask bench queue".into(),
        figures,
        checks,
        notes: vec![format!(
            "{callers} callers, each on its own keep-alive connection, release at once `POST \
             /agents/a/tools` (a lock on the agent) through `idemgate-gateway` running \
             `envoy/envoy.yaml` ({GATEWAY_WORKERS} workers) with a real in-process sidecar; the \
             demo backend works {work} ms per call and records when each call's work starts \
             and ends, which is where every figure is read. Queue mode: callers wait at the \
             sidecar and are let through in turn. Baseline (same run, sidecar on Redis): the \
             rule rejects (409) and each caller retries every 100 ms. The gap includes the \
             finished call's response through the filter, its release callout (sent when the \
             plugin's root is woken through its shared queue), the sidecar's grant to the next waiter, and that \
             request's way to the backend; the sidecar's own part of it is read from its \
             `handoff_seconds` metric, so the rest of the gap is the gateway's path (the \
             release callout leaving once the plugin's root is woken, the grant reaching the \
             waiting request's worker, the resumed request's trip to the backend), whose wake-ups are what a loaded 2-core VM delays most. \
             {GATEWAY_RUNS} runs per configuration; \
             p50/p99 are per run (99 gaps each), then the median over runs. Wall-clock figures \
             on a 2-core VM shared with other builds: compare within the run.",
            callers = queue_handoff::CALLERS,
            work = queue_handoff::WORK_MS,
        )],
    })
}

fn duplicate_storm(modules: &Modules) -> Result<Group> {
    let redis = RedisServer::start().context("starting redis-server")?;
    let (mut ours, mut base): (Vec<StormRun>, Vec<StormRun>) = (Vec::new(), Vec::new());
    for run in 0..GATEWAY_RUNS {
        for (module, runs) in [(&modules.idemgate, &mut ours), (&modules.noop, &mut base)] {
            println!(
                "  run {}: {} identical requests, {}",
                run + 1,
                storm::REQUESTS,
                module.display()
            );
            let stack = Stack::start(
                redis.store_config(),
                BackendSpec::Demo,
                &modules.gateway(module, Conflict::Reject, storm::WORKERS),
            )?;
            runs.push(storm::run(&stack, &format!("storm-{run}"))?);
            stack.stop()?;
        }
    }
    let latency = |runs: &[StormRun], p: f64| {
        summary_of(
            runs.iter()
                .filter_map(|r| percentile(&mut r.duplicate_latencies_us.clone(), p)),
        )
    };
    let noop = |s: Summary| Some(("no-op filter (all executed)".to_owned(), s));
    let figures = vec![
        Figure {
            name: "backend executions".into(),
            unit: "executions",
            value: summary_of(ours.iter().map(|r| r.executions as f64))?,
            baseline: noop(summary_of(base.iter().map(|r| r.executions as f64))?),
            goal: Some(Goal::AtMost(1.0)),
        },
        Figure {
            name: "duplicates: p50 latency".into(),
            unit: "µs",
            value: latency(&ours, 50.0)?,
            baseline: noop(latency(&base, 50.0)?),
            goal: None,
        },
        Figure {
            name: "duplicates: p99 latency".into(),
            unit: "µs",
            value: latency(&ours, 99.0)?,
            baseline: noop(latency(&base, 99.0)?),
            goal: None,
        },
        Figure {
            name: "claims that reached the sidecar".into(),
            unit: "claims",
            value: summary_of(ours.iter().map(|r| r.sidecar_claims))?,
            baseline: None,
            goal: None,
        },
        Figure {
            name: "sidecar requests (claims, completes, renewals)".into(),
            unit: "requests",
            value: summary_of(ours.iter().map(|r| r.sidecar_calls))?,
            baseline: None,
            goal: None,
        },
        Figure {
            name: "duplicates answered by the local tier (no sidecar call)".into(),
            unit: "%",
            value: summary_of(ours.iter().map(StormRun::local_share_pct))?,
            baseline: None,
            goal: Some(Goal::AtLeast(90.0)),
        },
    ];
    let answers = |runs: &[StormRun]| {
        runs.iter()
            .map(|r| {
                r.statuses
                    .iter()
                    .map(|(status, n)| format!("{n}× {status}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    Ok(Group {
        title: "Duplicate storm: 1,000 identical requests at once",
        command: "cargo xtask bench storm".into(),
        figures,
        checks: vec![Check {
            what: format!(
                "every storm through idemgate executed the payment exactly once ({} runs)",
                ours.len()
            ),
            held: ours.iter().all(|r| r.executions == 1),
        }],
        notes: vec![format!(
            "{requests} keep-alive connections to `idemgate-gateway` (`envoy/envoy.yaml`, \
             {workers} workers) each send the same `POST /payments` (same `x-user-id`, same \
             `Idempotency-Key`; the rule rejects duplicates of a running call) the moment all \
             are connected; the demo backend works {work} ms on a call and counts executions. \
             The sidecar (Redis store) counts the claims it answered: every claim beyond the \
             first is a duplicate the local tier did not catch. Latency runs from the release \
             to the answer; the client sending all of them shares the 2 cores with the \
             gateway, so it is the storm's whole turnaround, not the filter's decision time \
             (that is the plugin group's local-duplicate figure). Baseline: the same storm \
             through the same gateway with the no-op filter, where every request reaches the \
             backend. Answers per run, idemgate: {ours}; no-op filter: {base}. {GATEWAY_RUNS} \
             runs.",
            requests = storm::REQUESTS,
            workers = storm::WORKERS,
            work = storm::WORK_MS,
            ours = answers(&ours),
            base = answers(&base),
        )],
    })
}

fn end_to_end(modules: &Modules) -> Result<Group> {
    let redis = RedisServer::start().context("starting redis-server")?;
    let upstream = gateway_load::upstream()?;
    let scratch = std::env::temp_dir();
    let mixes = [Mix::Get, Mix::Mutating];
    let mut ours: Vec<Vec<WrkRun>> = vec![Vec::new(); mixes.len()];
    let mut base: Vec<Vec<WrkRun>> = vec![Vec::new(); mixes.len()];
    let mut misjudged = 0;
    for run in 0..GATEWAY_RUNS {
        for (i, mix) in mixes.iter().enumerate() {
            for (module, runs) in [(&modules.idemgate, &mut ours), (&modules.noop, &mut base)] {
                println!(
                    "  run {}: {}, {}",
                    run + 1,
                    mix.describe(),
                    module.display()
                );
                let stack = Stack::start(
                    redis.store_config(),
                    BackendSpec::At(upstream),
                    &modules.gateway(module, Conflict::Reject, GATEWAY_WORKERS),
                )?;
                let nonce = format!("{}-{run}-{i}", std::process::id());
                let result = wrk::run(stack.gateway_addr, *mix, &nonce, &scratch)?;
                misjudged += ["idemgate.requests.rejected", "idemgate.requests.replayed"]
                    .iter()
                    .map(|name| stack.plugin_counter(name))
                    .sum::<i64>();
                stack.stop()?;
                if let Some(runs) = runs.get_mut(i) {
                    runs.push(result);
                }
            }
        }
    }
    let mut figures = Vec::new();
    let mut non_2xx = Vec::new();
    for ((mix, ours), base) in mixes.iter().zip(&ours).zip(&base) {
        let noop = |f: fn(&WrkRun) -> f64| -> Result<Option<(String, Summary)>> {
            Ok(Some((
                "no-op filter".to_owned(),
                summary_of(base.iter().map(f))?,
            )))
        };
        figures.push(Figure {
            name: format!("{}: throughput", mix.describe()),
            unit: "requests/s",
            value: summary_of(ours.iter().map(|r| r.requests_per_sec))?,
            baseline: noop(|r| r.requests_per_sec)?,
            goal: None,
        });
        figures.push(Figure {
            name: format!("{}: p50 latency", mix.describe()),
            unit: "µs",
            value: summary_of(ours.iter().map(|r| r.p50_us))?,
            baseline: noop(|r| r.p50_us)?,
            goal: None,
        });
        figures.push(Figure {
            name: format!("{}: p99 latency", mix.describe()),
            unit: "µs",
            value: summary_of(ours.iter().map(|r| r.p99_us))?,
            baseline: noop(|r| r.p99_us)?,
            goal: None,
        });
        let total = |runs: &[WrkRun], f: fn(&WrkRun) -> u64| {
            report::number(runs.iter().map(f).sum::<u64>() as f64)
        };
        non_2xx.push(format!(
            "{}: {} of {} (idemgate), {} of {} (no-op)",
            mix.describe(),
            total(ours, |r| r.non_2xx),
            total(ours, |r| r.requests),
            total(base, |r| r.non_2xx),
            total(base, |r| r.requests),
        ));
    }
    Ok(Group {
        title: "End-to-end overhead: wrk through the gateway",
        command: "cargo xtask bench e2e".into(),
        figures,
        checks: vec![Check {
            what: "no request with a unique key was answered as a duplicate (409 or replay)".into(),
            held: misjudged == 0,
        }],
        notes: vec![format!(
            "`wrk -t{threads} -c{connections} -d{seconds}s --latency` against \
             `idemgate-gateway` running `envoy/envoy.yaml` ({GATEWAY_WORKERS} workers) in \
             front of a keep-alive upstream answering `200 ok`; idemgate's sidecar runs \
             in-process on Redis. GET mix: `GET /items/1`, matched by no rule. Mutating mix: \
             `POST /payments` with a fresh `Idempotency-Key` per request (a Lua script), so \
             each one is claimed at the sidecar, forwarded and completed. The baseline is the \
             same gateway with the no-op filter; {GATEWAY_RUNS} runs alternating the two. wrk, \
             the gateway, the sidecar, Redis and the upstream share 2 cores with other \
             builds: read the ratios. Non-2xx answers: {}.",
            non_2xx.join("; "),
            threads = wrk::THREADS,
            connections = wrk::CONNECTIONS,
            seconds = wrk::SECONDS,
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
