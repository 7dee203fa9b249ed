//! `idemgate-sidecar`: parse flags, set up logging, bind, serve until SIGINT/SIGTERM.

use anyhow::Context;
use clap::Parser;
use idemgate_sidecar::{Cli, Config, Telemetry};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Name of the runtime's worker threads (at most 15 bytes on Linux).
const WORKER_THREADS: &str = "idemgate-worker";

fn main() -> anyhow::Result<()> {
    // `--check`: validate flags and store, exit 0/1 (sidecar/src/check.rs).
    let check = idemgate_sidecar::check::requested(std::env::args_os());
    let cli = match &check {
        Some(args) => Cli::parse_from(args),
        None => Cli::parse(),
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = cli.worker_threads {
        runtime.worker_threads(threads.get());
    }
    runtime
        .thread_name(WORKER_THREADS)
        .enable_all()
        .build()
        .context("the async runtime")?
        .block_on(run(cli, check.is_some()))
}

async fn run(cli: Cli, check: bool) -> anyhow::Result<()> {
    let telemetry = Telemetry::init(&cli.telemetry())?;
    if check {
        let ok = idemgate_sidecar::check::run(cli).await;
        flush(telemetry).await;
        std::process::exit(i32::from(!ok));
    }
    let served = serve(cli).await;
    flush(telemetry).await;
    served
}

/// Exports the spans still queued; the exporter blocks, so off the async workers.
async fn flush(telemetry: Telemetry) {
    let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
}

async fn serve(cli: Cli) -> anyhow::Result<()> {
    let otlp_endpoint = cli.otlp_endpoint.clone();
    let mut config = Config::from_cli(cli)?;
    fit_connections_to_open_files(&mut config);
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        commit = env!("IDEMGATE_GIT_COMMIT"),
        worker_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        ?config,
        otlp_endpoint = %otlp_endpoint.as_deref().map_or_else(|| "none".to_owned(), idemgate_sidecar::config::redact_url),
        "starting idemgate-sidecar"
    );
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    idemgate_sidecar::run(listener, config, shutdown_signal()).await?;
    tracing::info!("stopped");
    Ok(())
}

/// File descriptors kept for everything but client connections (Redis connections, the
/// listener, logs), out of the open-file limit.
const RESERVED_FILES: u64 = 32;

/// Raises the soft open-file limit to the hard one (the common default soft limit, 1,024, is
/// far below what a sidecar in front of many gateways needs), logs both, and lowers the
/// connection cap to what the limit leaves room for: at the cap, new connections wait in the
/// listen backlog instead of `accept` failing for want of a descriptor.
fn fit_connections_to_open_files(config: &mut Config) {
    let Some(soft) = raise_open_file_limit() else {
        return;
    };
    let room = usize::try_from(soft.saturating_sub(RESERVED_FILES).max(1)).unwrap_or(usize::MAX);
    if config.max_connections > room {
        tracing::warn!(
            max_connections = config.max_connections,
            lowered_to = room,
            open_file_limit = soft,
            "the connection cap does not fit the open-file limit; lowered"
        );
        config.max_connections = room;
    }
}

/// The soft RLIMIT_NOFILE after raising it to the hard one.
#[cfg(unix)]
#[allow(
    clippy::useless_conversion,
    reason = "rlim_t is u64 on Linux, not on every unix"
)]
fn raise_open_file_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid, exclusive pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        tracing::warn!(err = %std::io::Error::last_os_error(), "cannot read the open-file limit");
        return None;
    }
    let before = limit.rlim_cur;
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit through a valid pointer.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        } else {
            tracing::warn!(err = %std::io::Error::last_os_error(), "cannot raise the open-file limit");
        }
    }
    let (soft, hard) = (u64::from(limit.rlim_cur), u64::from(limit.rlim_max));
    tracing::info!(
        soft_before = u64::from(before),
        soft,
        hard,
        "open-file limit (RLIMIT_NOFILE)"
    );
    Some(soft)
}

#[cfg(not(unix))]
fn raise_open_file_limit() -> Option<u64> {
    None
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
