//! Runs the demo backend on its own, e.g. behind a real Envoy.

use clap::Parser;
use idemgate_rig::backend::{self, Backend, Timings};
use std::time::Duration;

#[derive(Parser)]
#[command(
    version,
    about = "The idemgate demo backend: services that break under duplicate calls"
)]
struct Args {
    /// Address to listen on (loopback by default).
    #[arg(long, env = "DEMO_BACKEND_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// How long starting a bot's engine takes.
    #[arg(long, default_value_t = 1000)]
    bot_spawn_ms: u64,
    /// How long attaching a tool works between its read and its write.
    #[arg(long, default_value_t = 50)]
    attach_ms: u64,
    /// How long a payment takes.
    #[arg(long, default_value_t = 100)]
    payment_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let timings = Timings {
        bot_spawn: Duration::from_millis(args.bot_spawn_ms),
        attach: Duration::from_millis(args.attach_ms),
        payment: Duration::from_millis(args.payment_ms),
    };
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "demo backend listening");
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    backend::serve(listener, Backend::new(timings), shutdown).await?;
    Ok(())
}
