//! The rig's stack as child processes, for the demo: the sidecar, the demo backend and the
//! harness gateway running `envoy/envoy.yaml` (its ports passed as `--set-port`, the names
//! in [`crate::gateway::shipped`]) on free loopback ports — and stopping every one of them,
//! so nothing is left running: [`Stack::stop`] kills and reaps them; dropping the [`Stack`]
//! (an error, a cancelled start) kills them; and on Linux each child is started with
//! `PR_SET_PDEATHSIG`, so the kernel kills it even if the demo itself is killed outright.

use crate::gateway::shipped;
use anyhow::{Context, Result, bail};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// Where the binaries and files come from.
#[derive(Debug, Clone)]
pub struct StackConfig {
    /// Directory holding `idemgate-sidecar`, `idemgate-gateway`, `idemgate-demo-backend`.
    pub bin_dir: PathBuf,
    /// The filter module the gateway loads.
    pub wasm: PathBuf,
    /// The Envoy bootstrap the gateway runs.
    pub envoy_config: PathBuf,
    /// Redis for the sidecar; `None` uses its in-memory store.
    pub redis_url: Option<String>,
    /// Gateway worker threads (each with its own VM, as Envoy's workers).
    pub workers: usize,
    /// Directory for the processes' logs.
    pub log_dir: PathBuf,
}

/// The running processes; dropping it kills them.
pub struct Stack {
    pub gateway: String,
    pub backend: String,
    pub sidecar: String,
    pub gateway_admin: String,
    children: Vec<(&'static str, Child)>,
}

impl Stack {
    pub async fn start(config: &StackConfig) -> Result<Stack> {
        std::fs::create_dir_all(&config.log_dir)?;
        let backend = free_port()?;
        let sidecar = free_port()?;
        let gateway = free_port()?;
        let admin = free_port()?;
        let mut stack = Stack {
            gateway: format!("http://{gateway}"),
            backend: format!("http://{backend}"),
            sidecar: format!("http://{sidecar}"),
            gateway_admin: format!("http://{admin}"),
            children: Vec::new(),
        };

        let mut backend_cmd = Command::new(config.bin_dir.join("idemgate-demo-backend"));
        backend_cmd.args(["--listen", &backend.to_string()]);
        stack.spawn("demo backend", backend_cmd, config)?;

        let mut sidecar_cmd = Command::new(config.bin_dir.join("idemgate-sidecar"));
        sidecar_cmd.args(["--listen", &sidecar.to_string()]);
        match &config.redis_url {
            Some(url) => sidecar_cmd.env("REDIS_URL", url),
            None => sidecar_cmd.env_remove("REDIS_URL"),
        };
        stack.spawn("sidecar", sidecar_cmd, config)?;

        let mut gateway_cmd = Command::new(config.bin_dir.join("idemgate-gateway"));
        gateway_cmd
            .arg("--config")
            .arg(&config.envoy_config)
            .arg("--wasm-path")
            .arg(&config.wasm)
            .args(["--concurrency", &config.workers.to_string()])
            .args([
                "--set-port",
                &format!("{}={}", shipped::LISTENER, gateway.port()),
            ])
            .args([
                "--set-port",
                &format!("{}={}", shipped::ADMIN, admin.port()),
            ])
            .args([
                "--set-port",
                &format!("{}={}", shipped::BACKEND, backend.port()),
            ])
            .args([
                "--set-port",
                &format!("{}={}", shipped::SIDECAR, sidecar.port()),
            ]);
        stack.spawn("gateway", gateway_cmd, config)?;

        for (name, addr) in [
            ("demo backend", backend),
            ("sidecar", sidecar),
            ("gateway", gateway),
        ] {
            stack.wait_listening(name, addr).await?;
        }
        Ok(stack)
    }

    fn spawn(
        &mut self,
        name: &'static str,
        mut command: Command,
        config: &StackConfig,
    ) -> Result<()> {
        let log_path = config
            .log_dir
            .join(format!("{}.log", name.replace(' ', "-")));
        let log = std::fs::File::create(&log_path)?;
        die_with_parent(&mut command);
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| {
                format!("starting the {name} ({:?})", command.as_std().get_program())
            })?;
        self.children.push((name, child));
        Ok(())
    }

    /// Kills every process and waits (bounded) until each has exited, so their ports are
    /// free when this returns.
    pub async fn stop(mut self) {
        for (_, child) in &mut self.children {
            let _ = child.start_kill();
        }
        for (name, child) in &mut self.children {
            if tokio::time::timeout(Duration::from_secs(10), child.wait())
                .await
                .is_err()
            {
                eprintln!("the {name} did not exit within 10 s of being killed");
            }
        }
    }

    /// Waits (bounded) until `addr` accepts connections, failing early if the process died.
    async fn wait_listening(&mut self, name: &str, addr: SocketAddr) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(());
            }
            for (child_name, child) in &mut self.children {
                if let Some(status) = child.try_wait()? {
                    bail!("the {child_name} exited early ({status}); see its log");
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("the {name} did not listen on {addr} within 30 s")
    }
}

/// A loopback port nobody listens on right now. Another process could take it before ours
/// binds; on a loopback-only test machine that race is rare and fails loudly (bind error).
fn free_port() -> Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// Asks the kernel to SIGKILL the child when the thread that spawned it exits — with the
/// demo's single-threaded runtime, when the demo exits by any means, SIGKILL included.
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    let parent = std::process::id();
    // SAFETY: between fork and exec the closure only makes async-signal-safe calls
    // (prctl, getppid) and allocates nothing on its success path.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // The demo may have died before prctl took effect: then nobody will stop us.
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                return Err(std::io::Error::other("the demo exited"));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}
