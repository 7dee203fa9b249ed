//! The sidecar group: claim+complete throughput and latency against raw Redis and the HTTP
//! hop alone, at concurrency 1 and 64.

use super::LOAD_RUNS;
use crate::report::{Figure, Goal, Group};
use crate::sidecar_instructions::{self, Served};
use crate::sidecar_load::{self, Repeated, Run, Server};
use crate::stack::SIDECAR_WORKERS;
use crate::stats::{Summary, percentile};
use anyhow::{Context, Result};
use idemgate_sidecar::StoreConfig;
use idemgate_sidecar::testing::{RedisCluster, RedisServer};

/// Seconds per closed-loop run, hand-off samples per run.
const LOAD_SECONDS: f64 = 3.0;
const HANDOFF_SAMPLES: usize = 100;
/// Callgrind counts per configuration (each two whole sidecar processes).
const COUNTED_RUNS: usize = 2;
/// Rounds of the HTTP hop alone then the sidecar on Valkey, for the goal's CPU ratio.
const PAIRED_ROUNDS: usize = 5;

pub fn group() -> Result<Group> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // The sidecar gets runtime threads of its own, as its own process would have: as many as
    // the shipped Deployment gives a pod.
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(SIDECAR_WORKERS)
        .thread_name(sidecar_load::SIDECAR_THREADS)
        .enable_all()
        .build()?;
    let server = server.handle();
    runtime.block_on(async {
        let redis = RedisServer::start().context("starting redis-server")?;
        let standalone = [&redis];
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
            let on_standalone = |target| through(server, target, &standalone, concurrency);
            let on_redis = on_standalone(Server::Sidecar(redis.store_config())).await?;
            let on_memory = on_standalone(Server::Sidecar(StoreConfig::Memory)).await?;
            let hop = on_standalone(Server::HttpHop).await?;
            let goal = (concurrency == 64).then_some(Goal::RatioAtLeast(0.5));
            for (store, run, goal) in [("Redis", &on_redis, goal), ("memory", &on_memory, None)] {
                figures.extend(load_figures(store, concurrency, run, &raw, goal));
            }
            figures.extend(hop_figures(concurrency, &hop, &on_redis, &raw));
            if concurrency == 64 {
                println!(
                    "  concurrency 64: sidecar on Valkey 8.1, alternating with the HTTP hop alone"
                );
                let valkey = RedisServer::start_valkey()
                    .context("starting valkey-server (cargo xtask bench builds it)")?;
                let run = |target: Server| {
                    let valkey = &valkey;
                    async move {
                        let accounted = [valkey];
                        sidecar_load::sidecar_round_trips(
                            server,
                            target,
                            &accounted,
                            concurrency,
                            LOAD_SECONDS,
                        )
                        .await
                    }
                };
                let (hop_beside, on_valkey) = sidecar_load::alternate(
                    PAIRED_ROUNDS,
                    || run(Server::HttpHop),
                    || run(Server::Sidecar(valkey.store_config())),
                )
                .await?;
                for (round, (hop, valkey)) in hop_beside.iter().zip(&on_valkey).enumerate() {
                    println!(
                        "    round {}: hop {:.1} µs ({:.1} in the kernel), sidecar on Valkey \
                         {:.1} µs ({:.1}) per round trip: {:.2}×",
                        round + 1,
                        hop.cpu.sidecar,
                        hop.cpu.sidecar_kernel,
                        valkey.cpu.sidecar,
                        valkey.cpu.sidecar_kernel,
                        valkey.cpu.sidecar / hop.cpu.sidecar
                    );
                }
                figures.extend(valkey_figures(&on_valkey, &hop_beside, &on_redis)?);
                println!(
                    "  instructions per pair (callgrind): HTTP hop alone, memory, Redis 7.0, \
                     Valkey 8.1"
                );
                figures.extend(instruction_figures(redis, &valkey).await?);
                println!("  concurrency 64: sidecar on a three-primary Cluster");
                let cluster = RedisCluster::start().context("starting a Redis Cluster")?;
                let primaries: Vec<&RedisServer> = cluster.nodes().iter().collect();
                let target = Server::Sidecar(cluster.store_config());
                let on_cluster = through(server, target, &primaries, concurrency).await?;
                figures.extend(cluster_figures(&on_cluster, &on_redis));
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
                "Closed loop: each client task claims a fresh key (lock mode), completes it, repeats, \
                 for {LOAD_SECONDS} s; {LOAD_RUNS} runs per configuration. The sidecar runs \
                 in-process on its own runtime (its worker threads as many as the shipped \
                 Deployment gives a pod: {SIDECAR_WORKERS}, its CPU request rounded up; built, as \
                 the whole runner is, with the `dist` profile its image uses) and is driven \
                 over up to 4 h2c connections, as Envoy multiplexes \
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
                .to_owned(), "The Cluster rows: three primaries (`redis-server \
                 --cluster-enabled yes`, no replicas) started by the bench on this machine, the \
                 sidecar's Cluster topology over them, concurrency 64; the primaries' CPU is \
                 their sum. The baseline is the sidecar on one Redis server in the same run. \
                 On a Cluster a fresh key's claim runs the claim script on its key's primary \
                 (the primaries have no one clock the sidecar could read for the script-less \
                 `SET`), so each round trip runs more commands there.".to_owned(),
                format!("The Valkey rows: the sidecar on Valkey 8.1.1 (built from Debian 13's \
                 source archive by `cargo xtask bench`), concurrency 64, in {PAIRED_ROUNDS} \
                 rounds of one run of the HTTP hop alone then one of the sidecar on Valkey. \
                 The goal's ratio is the sidecar's CPU over the hop's within each round, its \
                 median over the rounds: this VM's speed drifts by tens of percent between \
                 minutes, and a ratio of two series' medians taken a minute apart moved with \
                 it, where a round's own ratio does not. The user-space and kernel rows \
                 split the sidecar's CPU as the kernel's sampling of its threads does (an \
                 estimate; the total is exact). Its server's CPU is set against \
                 `redis-server` 7.0's in the sidecar-on-Redis rows. Valkey ≥ 8.1 (and Redis \
                 ≥ 8.4) has `SET … IFEQ`, so a fresh grant's complete is that one command \
                 instead of the compare-and-set script."),
                format!("The instruction rows: the sidecar alone in a child process under \
                 `valgrind --tool=callgrind` ({SIDECAR_WORKERS} worker thread), driven over \
                 real sockets by the same client, 64 tasks over 4 h2c connections, each \
                 claiming a fresh key (lock mode) and completing it; the process's total for \
                 6,000 pairs less its total for 1,000, over 5,000, so start-up and shutdown \
                 cancel; {COUNTED_RUNS} counts per configuration. They repeat within a few \
                 percent where the CPU rows move by 5–10 %, and they leave out the kernel \
                 (system calls, wake-ups), which the CPU rows include. Under callgrind one \
                 thread runs at a time, so commands gather into smaller batches than at full \
                 speed: compare these rows with each other, not with the CPU rows.")],
        })
    })
}

/// Callgrind's count of the sidecar's instructions per pair on each store beside the HTTP hop
/// alone's (`sidecar_instructions`): the goal's ratio as a figure that repeats within a few
/// percent, where the CPU rows add the kernel's share and the machine's drift.
async fn instruction_figures(redis: &RedisServer, valkey: &RedisServer) -> Result<Vec<Figure>> {
    async fn counted(served: Served<'_>) -> Result<Summary> {
        let mut samples = Vec::with_capacity(COUNTED_RUNS);
        for _ in 0..COUNTED_RUNS {
            samples.push(sidecar_instructions::per_pair(served).await?);
        }
        Summary::of(&samples).context("no counts")
    }
    let hop = counted(Served::HttpHop).await?;
    let mut figures = vec![Figure {
        name: "HTTP hop alone: instructions per round trip, server (callgrind)".into(),
        unit: "instr/round trip",
        value: hop,
        baseline: None,
        goal: None,
    }];
    let (redis_url, valkey_url) = (redis.url(), valkey.url());
    for (name, served) in [
        ("sidecar on memory", Served::Memory),
        ("sidecar on Redis 7.0", Served::Redis(&redis_url)),
        ("sidecar on Valkey 8.1", Served::Redis(&valkey_url)),
    ] {
        figures.push(Figure {
            name: format!("{name}: instructions per round trip, sidecar (callgrind)"),
            unit: "instr/round trip",
            value: counted(served).await?,
            baseline: Some(("HTTP hop alone, server".into(), hop)),
            goal: None,
        });
    }
    Ok(figures)
}

/// `LOAD_RUNS` runs of claim+complete pairs through `target` at `concurrency`, the CPU and
/// commands of the `accounted` Redis servers counted.
async fn through(
    server: &tokio::runtime::Handle,
    target: Server,
    accounted: &[&RedisServer],
    concurrency: usize,
) -> Result<Repeated> {
    sidecar_load::repeat(LOAD_RUNS, || {
        sidecar_load::sidecar_round_trips(
            server,
            target.clone(),
            accounted,
            concurrency,
            LOAD_SECONDS,
        )
    })
    .await
}

/// The sidecar on a Cluster against the sidecar on one server, same run: what the Cluster's
/// gathering per primary leaves of the topology's cost.
fn cluster_figures(on_cluster: &Repeated, on_redis: &Repeated) -> Vec<Figure> {
    let name = |what: &str| format!("sidecar on a three-primary Cluster, concurrency 64: {what}");
    let against = |value: Summary, baseline: Summary, unit| Figure {
        name: String::new(),
        unit,
        value,
        baseline: Some(("sidecar on one Redis server".into(), baseline)),
        goal: None,
    };
    vec![
        Figure {
            name: name("throughput"),
            ..against(on_cluster.ops, on_redis.ops, "round trips/s")
        },
        Figure {
            name: name("CPU per round trip, sidecar"),
            ..against(on_cluster.cpu_sidecar, on_redis.cpu_sidecar, "µs")
        },
        Figure {
            name: name("CPU per round trip, the primaries (redis-server)"),
            ..against(on_cluster.cpu_redis, on_redis.cpu_redis, "µs")
        },
        Figure {
            name: name("Redis commands per round trip"),
            ..against(
                on_cluster.redis_commands,
                on_redis.redis_commands,
                "commands",
            )
        },
    ]
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

/// The sidecar on Valkey 8.1, where a fresh grant's complete is one `SET … IFEQ` instead of
/// the compare-and-set script, against the HTTP hop alone run beside it (the goal's ratio)
/// and against itself on Redis 7.0.
fn valkey_figures(
    on_valkey: &[Run],
    hop_beside: &[Run],
    on_redis: &Repeated,
) -> Result<Vec<Figure>> {
    let name = |what: &str| format!("sidecar on Valkey 8.1, concurrency 64: {what}");
    // Each round's own ratio: the drift between rounds cancels within one.
    let per_round = |cpu: fn(&Run) -> f64| {
        let ratios: Vec<f64> = on_valkey
            .iter()
            .zip(hop_beside)
            .map(|(valkey, hop)| cpu(valkey) / cpu(hop))
            .collect();
        Summary::of(&ratios).context("no rounds")
    };
    let kernel = |runs: &[Run]| {
        let values: Vec<f64> = runs.iter().map(|run| run.cpu.sidecar_kernel).collect();
        Summary::of(&values).context("no rounds")
    };
    let (valkey, hop) = (Repeated::of(on_valkey)?, Repeated::of(hop_beside)?);
    Ok(vec![
        Figure {
            name: name("CPU per round trip, sidecar"),
            unit: "µs",
            value: valkey.cpu_sidecar,
            baseline: Some((
                "HTTP hop alone, server, the runs beside it".into(),
                hop.cpu_sidecar,
            )),
            goal: None,
        },
        Figure {
            name: name("CPU per round trip, sidecar over the HTTP hop alone's, per round"),
            unit: "×",
            value: per_round(|run| run.cpu.sidecar)?,
            baseline: None,
            goal: Some(Goal::AtMost(1.5)),
        },
        Figure {
            name: name("user-space CPU per round trip, sidecar over the hop's, per round"),
            unit: "×",
            value: per_round(|run| run.cpu.sidecar - run.cpu.sidecar_kernel)?,
            baseline: None,
            goal: None,
        },
        Figure {
            name: name("kernel CPU per round trip, sidecar"),
            unit: "µs",
            value: kernel(on_valkey)?,
            baseline: Some((
                "HTTP hop alone, server, the runs beside it".into(),
                kernel(hop_beside)?,
            )),
            goal: None,
        },
        Figure {
            name: name("CPU per round trip, its server"),
            unit: "µs",
            value: valkey.cpu_redis,
            baseline: Some((
                "sidecar on Redis 7.0, redis-server".into(),
                on_redis.cpu_redis,
            )),
            goal: None,
        },
        Figure {
            name: name("Redis commands per round trip"),
            unit: "commands",
            value: valkey.redis_commands,
            baseline: Some(("sidecar on Redis 7.0".into(), on_redis.redis_commands)),
            goal: None,
        },
    ])
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
