//! The demo driver (`cargo xtask demo`) as a user runs it: its binary starting the sidecar,
//! the demo backend and the gateway as processes on real ports. The binaries are those
//! `cargo xtask test` built before the tests ran, or, run by hand, built on first use
//! (`idemgate_rig::child::built_binaries`).

use idemgate_e2e::live::eventually;
use idemgate_sidecar::testing::RedisServer;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// The directory with the demo's binaries, for this test's profile.
pub(crate) fn bin_dir() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| idemgate_rig::child::built_binaries().expect("the demo's binaries build"))
}

/// The demo binary running with its output collected line by line.
struct Demo {
    child: Child,
    stdout: Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
    seen: Vec<String>,
}

impl Demo {
    fn start(redis_url: Option<&str>, log_dir: &str) -> Demo {
        let bins = bin_dir();
        let mut command = Command::new(bins.join("idemgate-demo"));
        command
            .arg("--bin-dir")
            .arg(bins)
            .arg("--wasm")
            .arg(idemgate_host::target_dir().join("idemgate.wasm"))
            .arg("--envoy-config")
            .arg(idemgate_rig::gateway::shipped_envoy_yaml())
            .arg("--log-dir")
            .arg(idemgate_host::target_dir().join("tmp").join(log_dir))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match redis_url {
            Some(url) => command.env("REDIS_URL", url),
            None => command.env_remove("REDIS_URL"),
        };
        let mut child = command.spawn().expect("the demo starts");
        let (lines, stdout) = std::sync::mpsc::channel();
        let out = BufReader::new(child.stdout.take().expect("piped"));
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        let mut err = child.stderr.take().expect("piped");
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut err, &mut text);
            text
        });
        Demo {
            child,
            stdout,
            stderr,
            seen: Vec::new(),
        }
    }

    /// Reads output (bounded) until a line starts with `prefix`; returns it.
    fn wait_for_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.trim_start().starts_with(prefix) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                    let _ = self.child.kill();
                    panic!("no line starting with {prefix:?}; output: {:#?}", self.seen);
                }
            }
        }
    }

    /// Waits (bounded) for the demo to exit; returns its status, stdout and stderr.
    fn finish(mut self) -> (ExitStatus, String, String) {
        let deadline = Instant::now() + Duration::from_secs(300);
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the demo did not finish: {:#?}", self.seen);
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        self.seen.extend(self.stdout.try_iter());
        let stderr = self.stderr.join().unwrap_or_default();
        (status, self.seen.join("\n"), stderr)
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid");
        // SAFETY: kill(2) on our own child's pid, which it cannot have reused: it is not
        // reaped until `finish` waits for it.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// The processes the demo started (Linux: children by parent pid).
    fn children(&self) -> Vec<u32> {
        let parent = self.child.id();
        let mut children = Vec::new();
        for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
                continue;
            };
            if stat(pid).is_some_and(|(ppid, _)| ppid == parent) {
                children.push(pid);
            }
        }
        children
    }
}

/// `(parent pid, state)` of a process from `/proc/<pid>/stat`, if it exists.
fn stat(pid: u32) -> Option<(u32, char)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: the fields follow the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((ppid, state))
}

/// Gone, or a zombie nobody reaped yet (a container's init may never): not running.
fn is_dead(pid: u32) -> bool {
    stat(pid).is_none_or(|(_, state)| matches!(state, 'Z' | 'X'))
}

/// The gateway, backend and sidecar addresses from the demo's "  gateway http://..." line.
fn addresses(line: &str) -> Vec<SocketAddr> {
    line.split_whitespace()
        .filter_map(|w| w.strip_prefix("http://"))
        .filter_map(|a| a.parse().ok())
        .collect()
}

/// Stops the demo with `signal` while its first scenario plays, then checks that every
/// process it started is gone and every port it used is free.
fn stop_mid_run(signal: libc::c_int, log_dir: &str) -> (ExitStatus, String) {
    let mut demo = Demo::start(None, log_dir);
    let ports = addresses(&demo.wait_for_line("gateway http://"));
    assert_eq!(ports.len(), 3, "gateway, backend, sidecar");
    demo.wait_for_line("▶");
    let children = demo.children();
    assert_eq!(children.len(), 3, "sidecar, backend, gateway: {children:?}");
    demo.signal(signal);
    let (status, _, stderr) = demo.finish();
    eventually("every process the demo started to exit", || {
        children.iter().all(|&pid| is_dead(pid))
    });
    for port in ports {
        eventually(&format!("{port} to be free"), || {
            TcpStream::connect(port).is_err()
        });
    }
    (status, stderr)
}

/// With `REDIS_URL` set the demo's sidecar keeps its state in Redis, and the demo
/// runs to the end with no damage through idemgate (it fails otherwise).
#[test]
fn the_demo_with_redis_url_uses_redis_and_prevents_the_damage() {
    let redis = RedisServer::start().expect("redis-server starts");
    let demo = Demo::start(Some(&redis.url()), "demo-redis");
    let (status, stdout, stderr) = demo.finish();
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    assert!(stdout.contains("(Redis store)"), "{stdout}");
    assert!(stdout.contains("p99"), "the table: {stdout}");
    let keys = redis
        .cli(&["--scan", "--pattern", "idemgate:{*}:record"])
        .expect("redis-cli");
    assert!(
        keys.lines().count() > 0,
        "the sidecar stored lock records in Redis"
    );
}

/// Ctrl-C (SIGINT to the demo alone) mid-run stops every process it started.
#[test]
fn sigint_mid_run_stops_every_process_the_demo_started() {
    let (status, stderr) = stop_mid_run(libc::SIGINT, "demo-sigint");
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted by SIGINT"), "{stderr}");
}

/// SIGTERM is handled like Ctrl-C.
#[test]
fn sigterm_mid_run_stops_every_process_the_demo_started() {
    let (status, stderr) = stop_mid_run(libc::SIGTERM, "demo-sigterm");
    assert_eq!(status.code(), Some(143), "{stderr}");
}

/// Even a demo killed outright (no handler runs) takes its processes down with it: the
/// kernel kills each on its parent's death.
#[test]
fn sigkill_of_the_demo_takes_its_processes_down() {
    let (status, _) = stop_mid_run(libc::SIGKILL, "demo-sigkill");
    assert!(!status.success());
}
