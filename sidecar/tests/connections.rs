//! Connections cost a file descriptor each: idle ones must not exhaust the sidecar. The
//! binary runs under a lowered open-file limit (`prlimit --nofile=64:64`).

use crate::util::SidecarProcess;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Reads until the peer closes (EOF or reset) or `within` passes; true when it closed.
fn closed_within(conn: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        conn.set_read_timeout(Some(left)).unwrap();
        match conn.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false;
            }
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// `GET /healthz` on a new connection; the status line (empty when none came in `within`).
fn healthz(addr: std::net::SocketAddr, within: Duration) -> String {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(within)).unwrap();
    conn.write_all(b"GET /healthz HTTP/1.1\r\nhost: s\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut raw = Vec::new();
    let _ = conn.read_to_end(&mut raw);
    String::from_utf8_lossy(&raw)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// 100 connections that send nothing, against 64 open files: the limit is logged, the cap
/// fits under it, silent connections are closed after the first-byte timeout, `/healthz` is
/// answered meanwhile, and a keep-alive connection is closed once idle.
#[test]
fn idle_connections_cannot_exhaust_the_sidecar() {
    let sidecar = SidecarProcess::spawn_limited(
        Some(64),
        &[
            "--first-byte-timeout-ms",
            "500",
            "--idle-timeout-ms",
            "1000",
        ],
    );
    let log = sidecar.log();
    assert!(log.contains("open-file limit"), "{log}");
    // Version and commit, logged at start.
    assert!(log.contains("version=\"0.1.0\" commit=\""), "{log}");
    assert!(log.contains("soft=64") && log.contains("hard=64"), "{log}");
    assert!(log.contains("lowered_to=32"), "{log}");

    let mut silent: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(sidecar.addr).unwrap())
        .collect();
    let asked = Instant::now();
    let status = healthz(sidecar.addr, Duration::from_secs(10));
    assert_eq!(status, "HTTP/1.1 200 OK", "after {:?}", asked.elapsed());
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    for (i, conn) in silent.iter_mut().enumerate() {
        assert!(
            closed_within(conn, Duration::from_secs(5)),
            "silent connection {i} still open"
        );
    }

    // One request, then nothing: closed (HTTP/1.1: the next head must start within the
    // first-byte timeout too; HTTP/2 connections close on the idle timeout).
    let mut kept = TcpStream::connect(sidecar.addr).unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nhost: s\r\n\r\n")
        .unwrap();
    let mut head = [0u8; 12];
    kept.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    kept.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    assert!(closed_within(&mut kept, Duration::from_secs(5)));

    let metrics = healthz_metrics(sidecar.addr);
    assert!(
        metrics
            .contains("idemgate_sidecar_connections_closed_total{reason=\"first_byte_timeout\"}"),
        "{metrics}"
    );
}

fn healthz_metrics(addr: std::net::SocketAddr) -> String {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: s\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut raw = String::new();
    let _ = conn.read_to_string(&mut raw);
    raw
}

/// `--worker-threads` sizes the runtime: the start line says how many workers run, and the
/// process has that many worker threads (by name, from /proc), not one per CPU.
#[test]
fn the_runtime_runs_the_worker_threads_it_is_given() {
    for threads in [1usize, 3] {
        let sidecar = SidecarProcess::spawn(&["--worker-threads", &threads.to_string()]);
        let log = sidecar.log();
        assert!(log.contains(&format!("worker_threads={threads}")), "{log}");
        let workers = || {
            std::fs::read_dir(format!("/proc/{}/task", sidecar.pid()))
                .unwrap()
                .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
                .filter(|name| name.trim() == "idemgate-worker")
                .count()
        };
        // A new thread takes its name once it first runs, which on a loaded machine may be
        // after the sidecar accepts: wait for it, bounded.
        let deadline = Instant::now() + Duration::from_secs(10);
        while workers() < threads && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(workers(), threads);
    }
    // Zero is refused at start, not taken as "one per CPU".
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate-sidecar"))
        .args(["--worker-threads", "0"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--worker-threads"),
        "{refused:?}"
    );
}
