//! `idemgate-sidecar`: parse flags, set up logging, bind, serve until SIGINT/SIGTERM.

use anyhow::Context;
use clap::Parser;
use idemgate_sidecar::{Cli, Config};
use tracing_subscriber::EnvFilter;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    // `--check`: validate flags and store, exit 0/1 (sidecar/src/check.rs).
    if let Some(args) = idemgate_sidecar::check::requested(std::env::args_os()) {
        std::process::exit(i32::from(
            !idemgate_sidecar::check::run(Cli::parse_from(args)).await,
        ));
    }
    let config = Config::from_cli(Cli::parse())?;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        ?config,
        "starting idemgate-sidecar"
    );
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    idemgate_sidecar::run(listener, config, shutdown_signal()).await?;
    tracing::info!("stopped");
    Ok(())
}

/// Completes on SIGINT or SIGTERM (what orchestrators send before killing).
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(err) => {
                    tracing::warn!(%err, "cannot watch SIGTERM; only Ctrl-C stops the sidecar");
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
