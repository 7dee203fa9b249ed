//! An `idemgate-sidecar` in this process, on a runtime of its own, so a test can kill it as a
//! crash would and start it again on the same address.

use anyhow::{Context, Result, bail};
use idemgate_sidecar::{Config, Sidecar};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// How long a killed sidecar's listener may take to close, and a restarted one to bind.
const SETTLE: Duration = Duration::from_secs(20);

/// Name prefix of the sidecar runtime's threads (a thread name is at most 15 bytes on Linux):
/// the benchmarks tell the sidecar's CPU time apart from the gateway's and the client's by it.
pub const SIDECAR_THREADS: &str = "idemgate-sc";

/// Worker threads of a sidecar the tests start: two, so that what one request does can run
/// beside another's on a second thread, as it may on any sidecar with more than one CPU.
pub const TEST_WORKERS: usize = 2;

/// A running sidecar and the runtime it runs on. Dropping it stops it without waiting for
/// what is in flight (the sidecar first, then its runtime: fields drop in this order).
pub struct InProcessSidecar {
    sidecar: Sidecar,
    runtime: tokio::runtime::Runtime,
}

impl InProcessSidecar {
    /// Starts a sidecar with `config` on a two-thread runtime of its own.
    pub fn start(config: Config) -> Result<InProcessSidecar> {
        InProcessSidecar::start_with_workers(config, TEST_WORKERS)
    }

    /// Starts a sidecar with `config` on a runtime of its own with `workers` worker threads
    /// (what `--worker-threads` sets for the binary).
    pub fn start_with_workers(config: Config, workers: usize) -> Result<InProcessSidecar> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name(SIDECAR_THREADS)
            .enable_all()
            .build()
            .context("the sidecar's runtime")?;
        let sidecar = runtime
            .block_on(Sidecar::spawn(config))
            .context("starting the sidecar")?;
        Ok(InProcessSidecar { runtime, sidecar })
    }

    /// Starts a sidecar on `config.listen` with `workers` worker threads, retrying (bounded)
    /// while a killed one's listener still holds the address.
    pub fn start_on(config: &Config, workers: usize) -> Result<InProcessSidecar> {
        let deadline = Instant::now() + SETTLE;
        loop {
            match InProcessSidecar::start_with_workers(config.clone(), workers) {
                Ok(sidecar) => return Ok(sidecar),
                Err(err) if Instant::now() < deadline => {
                    drop(err);
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(err) => {
                    return Err(err.context(format!("binding {} again", config.listen)));
                }
            }
        }
    }

    /// Where the sidecar listens.
    pub fn addr(&self) -> SocketAddr {
        self.sidecar.addr()
    }

    /// Kills the sidecar as a crash would: its runtime is dropped with every connection and
    /// long-poll in flight, nothing is released, Redis keeps what it holds. Returns once the
    /// address refuses connections (bounded).
    pub fn kill(self) -> Result<()> {
        let addr = self.addr();
        drop(self.sidecar);
        self.runtime.shutdown_background();
        let deadline = Instant::now() + SETTLE;
        while TcpStream::connect(addr).is_ok() {
            if Instant::now() > deadline {
                bail!("the killed sidecar still accepts on {addr}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Stops the sidecar gracefully, reporting how it ended.
    pub fn shutdown(self) -> Result<()> {
        let InProcessSidecar { sidecar, runtime } = self;
        runtime
            .block_on(sidecar.shutdown())
            .context("shutting the sidecar down")
    }
}
