//! `cargo xtask demo`: plays the duplicate-call scenarios twice — straight to the backend,
//! then through idemgate — and prints what each run did to the backend. Fails if a run
//! through idemgate still damaged it. Every process it starts is stopped when it ends, on
//! SIGINT (Ctrl-C) and on SIGTERM.

use anyhow::{Result, bail};
use clap::Parser;
use idemgate_demo::scenarios::{self, Run, Scenario};
use idemgate_rig::processes::{Stack, StackConfig};
use std::path::PathBuf;
use std::process::ExitCode;
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

/// The runtime is single-threaded on purpose: children are spawned on the main thread, and
/// `PR_SET_PDEATHSIG` ties them to the thread that spawned them (see `stack`).
fn main() -> ExitCode {
    let args = Args::parse();
    let config = StackConfig {
        bin_dir: args.bin_dir,
        wasm: args.wasm,
        envoy_config: args.envoy_config,
        redis_url: args.redis_url,
        workers: args.workers,
        log_dir: args.log_dir,
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("idemgate-demo: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&config)) {
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

async fn run(config: &StackConfig) -> Result<Finished> {
    let mut signals = Signals::install()?;
    println!(
        "starting the demo backend, the sidecar ({}) and the gateway ({} workers)...",
        if config.redis_url.is_some() {
            "Redis store"
        } else {
            "memory store"
        },
        config.workers
    );
    // A start cut short drops the half-built stack, which kills what it had started.
    let stack = tokio::select! {
        stack = Stack::start(config) => stack?,
        signal = signals.recv() => return Ok(Finished::Interrupted(signal)),
    };
    println!(
        "  gateway {}  backend {}  sidecar {}  (logs in {})\n",
        stack.gateway,
        stack.backend,
        stack.sidecar,
        config.log_dir.display()
    );
    let outcome = tokio::select! {
        played = play_all(&stack) => played.map(|()| Finished::Played),
        signal = signals.recv() => Ok(Finished::Interrupted(signal)),
    };
    stack.stop().await;
    outcome
}

async fn play_all(stack: &Stack) -> Result<()> {
    let client = reqwest::Client::new();
    let max_call = Duration::from_secs(30);
    let run_id = std::process::id();
    let scenarios: Vec<Scenario> = vec![
        scenarios::attach_tools(&format!("agent-{run_id}")),
        scenarios::double_click(&format!("bot-{run_id}")),
        scenarios::payment_retry(&format!("pay-{run_id}")),
        scenarios::webhook_redelivery(&format!("evt_{run_id}")),
        scenarios::burst(&format!("burst-{run_id}"), 20, 50),
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

/// The gateway's count of queued requests (its admin `/stats`), on the idemgate path.
async fn queued(client: &reqwest::Client, stack: &Stack, label: &str) -> Result<Option<u64>> {
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
        .map(|o| match (o.status, o.replayed) {
            (Some(s), true) => format!("{s}(replayed)"),
            (Some(s), false) => s.to_string(),
            (None, _) => "gave up".to_string(),
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
        "409",
        "queued",
        "2xx",
        "p50",
        "p99"
    );
    for row in rows {
        let (run, b) = (&row.run, &row.run.backend);
        println!(
            "{:<20} {:<9} {:>5} {:>5} {:>6} {:>5} {:>5} {:>8} {:>4} {:>7} {:>4} {:>9.1?} {:>9.1?}",
            row.scenario,
            row.label,
            run.outcomes.len(),
            b.executions,
            b.lost_updates,
            b.duplicate_engines + b.duplicate_events,
            b.double_charges,
            run.replays(),
            run.count(409),
            row.queued.map_or("-".to_string(), |q| q.to_string()),
            run.succeeded(),
            run.latency(50),
            run.latency(99),
        );
    }
    println!(
        "\nruns = backend executions; lost = lost updates; dup = duplicate engines or events; \
         2x$ = double charges; queued = calls held until their turn"
    );
}
