//! `cargo xtask demo`: plays the duplicate-call scenarios twice — straight to the backend,
//! then through idemgate — and prints what each run did to the backend. Fails if a run
//! through idemgate still damaged it. Every process it starts is stopped when it ends, on
//! SIGINT (Ctrl-C) and on SIGTERM.

use anyhow::{Context, Result, bail};
use clap::Parser;
use idemgate_demo::scenarios::{self, Run, Scenario};
use idemgate_rig::Rig;
use idemgate_rig::backend::Timings;
use idemgate_rig::gateway::Shipped;
use idemgate_sidecar::{RedisConfig, RedisTls, RedisTopology, StoreConfig};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(Parser)]
#[command(about = "Shows idemgate stopping duplicate and conflicting calls")]
struct Args {
    /// Directory with idemgate-sidecar, idemgate-gateway and idemgate-demo-backend.
    #[arg(long)]
    bin_dir: PathBuf,
    #[arg(long, default_value = "target/idemgate.wasm")]
    wasm: PathBuf,
    #[arg(long, default_value = "envoy/envoy.yaml")]
    envoy_config: PathBuf,
    /// Redis for the sidecar (memory store when unset).
    #[arg(long, env = "REDIS_URL")]
    redis_url: Option<String>,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    #[arg(long, default_value = "target/demo-logs")]
    log_dir: PathBuf,
}

/// The rig is started and stopped on the main thread on purpose: its children are tied to
/// the thread that spawned them (`PR_SET_PDEATHSIG`), and the main thread lives as long as
/// the demo. The runtime's one worker takes the signals meanwhile, so a start still waiting
/// for its processes can be cut short.
fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("idemgate-demo: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&args)) {
        Ok(Finished::Played) => ExitCode::SUCCESS,
        Ok(Finished::Interrupted(signal)) => {
            eprintln!("interrupted by {signal}: stopped everything the demo started");
            // The shell convention for "killed by signal N".
            ExitCode::from(128 + signal.number())
        }
        Err(err) => {
            eprintln!("idemgate-demo: {err:#}");
            ExitCode::FAILURE
        }
    }
}

enum Finished {
    Played,
    Interrupted(Signal),
}

#[derive(Clone, Copy)]
enum Signal {
    Interrupt,
    Terminate,
}

impl Signal {
    fn number(self) -> u8 {
        match self {
            Signal::Interrupt => 2,
            Signal::Terminate => 15,
        }
    }
}

impl std::fmt::Display for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Signal::Interrupt => "SIGINT",
            Signal::Terminate => "SIGTERM",
        })
    }
}

/// Resolves on the first SIGINT (Ctrl-C) or SIGTERM. Installed before any child starts, so
/// neither signal can take the demo down the default way (which runs no cleanup).
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.interrupt.recv() => Signal::Interrupt,
            _ = self.terminate.recv() => Signal::Terminate,
        }
    }
}

/// The rig the demo plays on: the demo backend, the sidecar and the gateway running
/// `envoy/envoy.yaml`, as child processes of the built binaries.
fn rig(args: &Args, cancelled: Arc<AtomicBool>) -> Result<Rig> {
    let rig = Rig::builder()
        .as_processes(&args.bin_dir, &args.log_dir)
        .demo_backend(Timings::default())
        .gateway(
            Shipped::default()
                .envoy_yaml(&args.envoy_config)
                .module(&args.wasm)
                .workers(args.workers),
        )
        .cancelled_by(cancelled);
    match &args.redis_url {
        Some(urls) => rig.store(StoreConfig::Redis(RedisConfig {
            urls: urls.split(',').map(|url| url.trim().to_owned()).collect(),
            topology: RedisTopology::Standalone,
            prefix: "idemgate".to_owned(),
            tls: RedisTls::default(),
        })),
        None => rig,
    }
    .start()
}

/// Where the demo sends its calls.
struct Urls {
    gateway: String,
    backend: String,
    gateway_admin: String,
}

async fn run(args: &Args) -> Result<Finished> {
    let mut signals = Signals::install()?;
    let cancelled = Arc::new(AtomicBool::new(false));
    let (signalled, mut signal) = tokio::sync::oneshot::channel();
    let flag = Arc::clone(&cancelled);
    tokio::spawn(async move {
        let signal = signals.recv().await;
        // Sent before the flag is set: a start that saw the flag finds the signal.
        let _ = signalled.send(signal);
        flag.store(true, Ordering::Release);
    });
    println!(
        "starting the demo backend, the sidecar ({}) and the gateway ({} workers)...",
        if args.redis_url.is_some() {
            "Redis store"
        } else {
            "memory store"
        },
        args.workers
    );
    // Blocks this thread (see `main`); a start cut short stops what it had started.
    let rig = match rig(args, cancelled) {
        Ok(rig) => rig,
        Err(err) => {
            return match signal.try_recv() {
                Ok(signal) => Ok(Finished::Interrupted(signal)),
                Err(_) => Err(err),
            };
        }
    };
    let http = |addr: Option<std::net::SocketAddr>, what| {
        addr.map(|a| format!("http://{a}")).context(what)
    };
    let urls = Urls {
        gateway: http(rig.gateway_addr(), "the rig's gateway")?,
        backend: http(rig.backend_addr(), "the rig's backend")?,
        gateway_admin: http(rig.gateway_admin(), "the gateway's admin")?,
    };
    println!(
        "  gateway {}  backend {}  sidecar http://{}  (logs in {})\n",
        urls.gateway,
        urls.backend,
        rig.sidecar_addr(),
        args.log_dir.display()
    );
    let outcome = tokio::select! {
        biased;
        signal = &mut signal => Ok(Finished::Interrupted(signal?)),
        played = play_all(&urls) => played.map(|()| Finished::Played),
    };
    let stopped = rig.stop();
    let outcome = outcome?;
    stopped?;
    Ok(outcome)
}

async fn play_all(stack: &Urls) -> Result<()> {
    let client = reqwest::Client::new();
    let max_call = Duration::from_secs(30);
    let run_id = std::process::id();
    let scenarios: Vec<Scenario> = vec![
        scenarios::attach_tools(&format!("agent-{run_id}")),
        scenarios::double_click(&format!("bot-{run_id}")),
        scenarios::payment_retry(&format!("pay-{run_id}")),
        scenarios::webhook_redelivery(&format!("evt_{run_id}")),
        scenarios::burst(&format!("burst-{run_id}"), 20, 50),
        scenarios::grpc_hedged_charge(&format!("grpc-{run_id}")),
    ];
    let mut rows = Vec::new();
    for scenario in &scenarios {
        println!("▶ {}: {}", scenario.name, scenario.what);
        for (label, base) in [(DIRECT, &stack.backend), (GUARDED, &stack.gateway)] {
            client
                .post(format!("{}/reset", stack.backend))
                .send()
                .await?;
            let queued_before = queued(&client, stack, label).await?;
            let run = scenarios::play(&client, base, &stack.backend, scenario, max_call).await?;
            if label == GUARDED {
                tokio::time::sleep(COUNTERS_LAG).await;
            }
            let queued = match (queued_before, queued(&client, stack, label).await?) {
                (Some(before), Some(after)) => Some(after.saturating_sub(before)),
                _ => None,
            };
            println!("    {label:<9} {}", summary(&run));
            rows.push(Row {
                scenario: scenario.name,
                label,
                run,
                queued,
            });
        }
    }
    print_table(&rows);
    let damaged: Vec<&str> = rows
        .iter()
        .filter(|row| row.label == GUARDED && damage(&row.run) > 0)
        .map(|row| row.scenario)
        .collect();
    if !damaged.is_empty() {
        bail!(
            "through idemgate the backend still took damage in: {}",
            damaged.join(", ")
        );
    }
    Ok(())
}

const DIRECT: &str = "direct";
const GUARDED: &str = "idemgate";

/// One line of the before/after table.
struct Row {
    scenario: &'static str,
    label: &'static str,
    run: Run,
    /// Calls the gateway held in a queue until their turn (through idemgate only).
    queued: Option<u64>,
}

/// How long after a scenario the gateway's counters are read: the filter hands its counters
/// to Envoy on its tick, every `tick` (the default 1 s in `envoy/envoy.yaml`), on each worker.
const COUNTERS_LAG: Duration = Duration::from_millis(1_500);

/// The gateway's count of queued requests (its admin `/stats`), on the idemgate path.
async fn queued(client: &reqwest::Client, stack: &Urls, label: &str) -> Result<Option<u64>> {
    if label != GUARDED {
        return Ok(None);
    }
    let stats = client
        .get(format!("{}/stats", stack.gateway_admin))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    Ok(Some(
        stats
            .lines()
            .find_map(|l| l.strip_prefix("idemgate.requests.queued: "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0),
    ))
}

fn damage(run: &Run) -> u64 {
    let b = &run.backend;
    b.lost_updates + b.duplicate_engines + b.duplicate_events + b.double_charges
}

fn summary(run: &Run) -> String {
    let statuses: Vec<String> = run
        .outcomes
        .iter()
        .map(|o| {
            let answer = match (o.status, o.grpc) {
                (_, Some(code)) => format!("{code:?}"),
                (Some(s), None) => s.to_string(),
                (None, None) => "gave up".to_string(),
            };
            match o.replayed {
                true => format!("{answer}(replayed)"),
                false => answer,
            }
        })
        .collect();
    format!(
        "statuses [{}]; backend ran {} time(s); damage {}",
        statuses.join(", "),
        run.backend.executions,
        damage(run)
    )
}

fn print_table(rows: &[Row]) {
    println!(
        "\n{:<20} {:<9} {:>5} {:>5} {:>6} {:>5} {:>5} {:>8} {:>4} {:>7} {:>4} {:>9} {:>9}",
        "scenario",
        "path",
        "sent",
        "runs",
        "lost",
        "dup",
        "2x$",
        "replays",
        "refused",
        "queued",
        "ok",
        "p50",
        "p99"
    );
    for row in rows {
        let (run, b) = (&row.run, &row.run.backend);
        println!(
            "{:<20} {:<9} {:>5} {:>5} {:>6} {:>5} {:>5} {:>8} {:>7} {:>7} {:>4} {:>9.1?} {:>9.1?}",
            row.scenario,
            row.label,
            run.outcomes.len(),
            b.executions,
            b.lost_updates,
            b.duplicate_engines + b.duplicate_events,
            b.double_charges,
            run.replays(),
            run.refused(),
            row.queued.map_or("-".to_string(), |q| q.to_string()),
            run.succeeded(),
            run.latency(50),
            run.latency(99),
        );
    }
    println!(
        "\nruns = backend executions; lost = lost updates; dup = duplicate engines or events; \
         2x$ = double charges; refused = 409 or gRPC ABORTED (another call held the key); \
         queued = calls held until their turn; ok = 2xx or gRPC OK"
    );
}
