//! `idemgate-gateway --config envoy.yaml`: serves HTTP through the configured proxy-wasm
//! filter as Envoy would (see host-tests/README.md for the supported config subset).

use anyhow::{Context, Result, bail};
use clap::Parser;
use idemgate_host::LogLevel;
use idemgate_host::gateway::config::EnvoyConfig;
use idemgate_host::gateway::{Gateway, GatewayOptions};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "idemgate-gateway",
    about = "An Envoy-like HTTP gateway running proxy-wasm filters on wasmtime"
)]
struct Args {
    /// Envoy bootstrap YAML (static_resources subset).
    #[arg(long)]
    config: PathBuf,
    /// Worker threads, each with its own event loop and VM.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Override a port: TARGET=PORT (repeatable). TARGET is a listener or cluster name,
    /// `admin`, `listeners[<i>]` / `clusters[<i>]` (file order, for unnamed ones), or a
    /// listener's address as written in the config (`0.0.0.0:10000`).
    #[arg(long = "set-port", value_name = "TARGET=PORT")]
    set_port: Vec<String>,
    /// Use this .wasm for every wasm filter instead of vm_config.code.local.filename.
    #[arg(long)]
    wasm_path: Option<PathBuf>,
    /// Plugin log level printed to stderr: trace, debug, info, warn, error, critical, off.
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Do not print an access-log line per request.
    #[arg(long)]
    no_access_log: bool,
}

fn log_level(name: &str) -> Result<Option<LogLevel>> {
    Ok(Some(match name {
        "trace" => LogLevel::Trace,
        "debug" => LogLevel::Debug,
        "info" => LogLevel::Info,
        "warn" => LogLevel::Warn,
        "error" => LogLevel::Error,
        "critical" => LogLevel::Critical,
        "off" => return Ok(None),
        other => bail!("--log-level: unknown level `{other}`"),
    }))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut config = EnvoyConfig::load(&args.config)?;
    for item in &args.set_port {
        let (name, port) = item
            .split_once('=')
            .with_context(|| format!("--set-port {item}: expected TARGET=PORT"))?;
        let port: u16 = port
            .parse()
            .with_context(|| format!("--set-port {item}: `{port}` is not a port"))?;
        config.set_port(name, port)?;
    }
    if let Some(path) = &args.wasm_path {
        config.set_wasm_path(path);
    }
    let gateway = Gateway::start(
        config.clone(),
        GatewayOptions {
            concurrency: args.concurrency,
            access_log: !args.no_access_log,
            log_level: log_level(&args.log_level)?,
            ..GatewayOptions::default()
        },
    )?;
    for listener in &config.listeners {
        if let Some(address) = gateway.listener_address(&listener.name) {
            eprintln!("listener {} on http://{address}", listener.name);
        }
    }
    if let Some(admin) = gateway.admin_address() {
        eprintln!("admin on http://{admin}");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(tokio::signal::ctrl_c())?;
    eprintln!("shutting down");
    gateway.shutdown();
    Ok(())
}
