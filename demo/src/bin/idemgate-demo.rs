//! `cargo xtask demo`: plays the duplicate-call scenarios twice — straight to the backend,
//! then through idemgate — and prints what each run did to the backend.

use anyhow::Result;
use clap::Parser;
use idemgate_demo::scenarios::{self, Run, Scenario};
use idemgate_demo::stack::{Stack, StackConfig};
use std::path::PathBuf;
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

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let config = StackConfig {
        bin_dir: args.bin_dir,
        wasm: args.wasm,
        envoy_config: args.envoy_config,
        redis_url: args.redis_url,
        workers: args.workers,
        log_dir: args.log_dir,
    };
    // The stack lives in this frame: whichever branch finishes, dropping it kills every
    // process it started.
    tokio::select! {
        result = demo(&config) => result,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("\ninterrupted: stopping everything the demo started");
            std::process::exit(130);
        }
    }
}

async fn demo(config: &StackConfig) -> Result<()> {
    println!(
        "starting the demo backend, the sidecar ({}) and the gateway ({} workers)...",
        if config.redis_url.is_some() {
            "Redis store"
        } else {
            "memory store"
        },
        config.workers
    );
    let stack = Stack::start(config).await?;
    println!(
        "  gateway {}  backend {}  sidecar {}  (logs in {})\n",
        stack.gateway,
        stack.backend,
        stack.sidecar,
        config.log_dir.display()
    );
    let client = reqwest::Client::new();
    let max_call = Duration::from_secs(30);
    let run_id = std::process::id();
    let scenarios: Vec<Scenario> = vec![
        scenarios::attach_tools(&format!("agent-{run_id}")),
        scenarios::double_click(&format!("bot-{run_id}")),
        scenarios::payment_retry(&format!("pay-{run_id}")),
        scenarios::burst(&format!("burst-{run_id}"), 20, 50),
    ];
    let mut rows = Vec::new();
    for scenario in &scenarios {
        println!("▶ {}: {}", scenario.name, scenario.what);
        for (label, base) in [("direct", &stack.backend), ("idemgate", &stack.gateway)] {
            client
                .post(format!("{}/reset", stack.backend))
                .send()
                .await?;
            let run = scenarios::play(&client, base, &stack.backend, scenario, max_call).await?;
            println!("    {label:<9} {}", summary(&run));
            rows.push((scenario.name, label, run));
        }
    }
    print_table(&rows);
    Ok(())
}

fn damage(run: &Run) -> u64 {
    let b = &run.backend;
    b.lost_updates + b.duplicate_engines + b.double_charges
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

fn print_table(rows: &[(&str, &str, Run)]) {
    println!(
        "\n{:<20} {:<9} {:>5} {:>5} {:>6} {:>5} {:>5} {:>8} {:>4} {:>4} {:>9} {:>9}",
        "scenario",
        "path",
        "sent",
        "runs",
        "lost",
        "dup",
        "2x$",
        "replays",
        "409",
        "2xx",
        "p50",
        "p99"
    );
    for (name, label, run) in rows {
        let b = &run.backend;
        println!(
            "{:<20} {:<9} {:>5} {:>5} {:>6} {:>5} {:>5} {:>8} {:>4} {:>4} {:>9.1?} {:>9.1?}",
            name,
            label,
            run.outcomes.len(),
            b.executions,
            b.lost_updates,
            b.duplicate_engines,
            b.double_charges,
            run.replays(),
            run.count(409),
            run.succeeded(),
            run.latency(50),
            run.latency(99),
        );
    }
    println!(
        "\nruns = backend executions; lost = lost updates; dup = duplicate engines; \
         2x$ = double charges"
    );
}
