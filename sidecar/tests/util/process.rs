//! The `idemgate-sidecar` binary as a real child process: for what an in-process sidecar
//! cannot show (kill -9, a lowered open-file limit, what it logs at start).

use super::Client;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub struct SidecarProcess {
    child: Child,
    pub addr: SocketAddr,
    log: PathBuf,
}

impl SidecarProcess {
    /// Starts the binary on a free loopback port with `args`; returns once it accepts.
    pub fn spawn(args: &[&str]) -> SidecarProcess {
        Self::spawn_limited(None, args)
    }

    /// Like [`SidecarProcess::spawn`], with `env` set on top (`RUST_LOG`, `OTEL_*`).
    pub fn spawn_env(args: &[&str], env: &[(&str, &str)]) -> SidecarProcess {
        Self::spawn_with(None, args, env)
    }

    /// Like [`SidecarProcess::spawn`], under `prlimit --nofile=n:n` when `nofile` is set.
    pub fn spawn_limited(nofile: Option<u32>, args: &[&str]) -> SidecarProcess {
        Self::spawn_with(nofile, args, &[])
    }

    fn spawn_with(nofile: Option<u32>, args: &[&str], env: &[(&str, &str)]) -> SidecarProcess {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = std::env::temp_dir().join(format!(
            "idemgate-sidecar-{}-{port}.log",
            std::process::id()
        ));
        let out = std::fs::File::create(&log).expect("log file");
        let binary = env!("CARGO_BIN_EXE_idemgate-sidecar");
        let mut cmd = match nofile {
            Some(n) => {
                let mut cmd = Command::new("prlimit");
                cmd.arg(format!("--nofile={n}:{n}")).arg(binary);
                cmd
            }
            None => Command::new(binary),
        };
        let child = cmd
            .args(["--listen", &addr.to_string()])
            .args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("REDIS_URL")
            .envs(env.iter().copied())
            .stdout(out.try_clone().expect("log file"))
            .stderr(out)
            .spawn()
            .expect("the sidecar binary starts");
        let mut process = SidecarProcess { child, addr, log };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "the sidecar never listened: {}",
                process.log()
            );
            if let Ok(Some(status)) = process.child.try_wait() {
                panic!("the sidecar exited with {status}: {}", process.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        process
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn client(&self) -> Client {
        Client::h2c(&self.url())
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL: no handler runs, no queue place is given up, sockets close at once.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for SidecarProcess {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.log);
    }
}
