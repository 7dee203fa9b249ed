//! A rig of child processes (the demo's launch mode) serves like one in process, and never
//! leaves a process behind: stopped, dropped, failed or cancelled, every child it started is
//! killed and reaped (gone from `/proc`, not a zombie) and its ports are free.

// The whole crate is test code, helpers included: clippy's allow-*-in-tests settings
// (clippy.toml) see only `#[test]` functions and `cfg(test)` items as tests.
#![cfg(test)]

use idemgate_rig::backend::Timings;
use idemgate_rig::gateway::Shipped;
use idemgate_rig::{Rig, RigBuilder};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// The tests count this process's children: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn bin_dir() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| idemgate_rig::child::built_binaries().unwrap())
}

fn processes(log_dir: &str) -> RigBuilder {
    Rig::builder()
        .as_processes(
            bin_dir(),
            idemgate_host::target_dir().join("tmp").join(log_dir),
        )
        .demo_backend(Timings::default())
        .gateway(Shipped::default())
}

/// Process ids of this process's children that run one of the rig's binaries (the kernel
/// truncates names to 15 bytes) and are not zombies.
fn running_rig_children() -> Vec<u32> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = &stat[open + 1..close];
        let mut fields = stat[close + 1..].split_whitespace();
        let state = fields.next().unwrap_or("");
        let ppid: u32 = fields.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        if ppid == me && name.starts_with("idemgate-") && state != "Z" {
            found.push(pid);
        }
    }
    found
}

/// Gone from `/proc`: killed and reaped (a child killed but not reaped stays a zombie).
fn reaped(pid: u32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn refuses(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err()
}

/// The status of `GET path` on `addr` (HTTP/1.1, bounded).
fn get(addr: SocketAddr, path: &str) -> u16 {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or_else(|| panic!("no status from {addr}{path}: {reply:?}"))
}

#[test]
fn a_rig_of_processes_serves_and_stop_reaps_every_child() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut rig = processes("rig-stop").start().unwrap();
    let pids = rig.process_ids();
    assert_eq!(pids.len(), 3, "backend, sidecar, gateway: {pids:?}");
    let gateway = rig.gateway_addr().unwrap();
    let admin = rig.gateway_admin().unwrap();
    let backend = rig.backend_addr().unwrap();
    let sidecar = rig.sidecar_addr();
    // The backend through the gateway (an unguarded route), the sidecar, the admin.
    assert_eq!(get(gateway, "/stats"), 200);
    assert_eq!(get(sidecar, "/healthz"), 200);
    assert_eq!(get(admin, "/stats"), 200);
    assert!(rig.backend().is_none(), "no ground truth in this process");

    rig.stop().unwrap();
    for pid in pids {
        assert!(reaped(pid), "{pid} still in /proc after stop");
    }
    for addr in [gateway, admin, backend, sidecar] {
        assert!(refuses(addr), "{addr} still accepts after stop");
    }
}

#[test]
fn a_dropped_rig_of_processes_reaps_every_child() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut rig = processes("rig-drop").start().unwrap();
    let pids = rig.process_ids();
    assert_eq!(pids.len(), 3);
    drop(rig);
    for pid in pids {
        assert!(reaped(pid), "{pid} still in /proc after drop");
    }
}

#[test]
fn a_sidecar_process_is_killed_and_restarted_on_its_port() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut rig = processes("rig-restart").start().unwrap();
    let sidecar = rig.sidecar_addr();
    rig.kill_sidecar().unwrap();
    assert!(refuses(sidecar), "a killed sidecar process still accepts");
    assert_eq!(rig.process_ids().len(), 2, "backend and gateway");
    rig.restart_sidecar().unwrap();
    assert_eq!(rig.sidecar_addr(), sidecar);
    assert_eq!(get(sidecar, "/healthz"), 200);
    rig.stop().unwrap();
}

/// A part that exits during the start (here the gateway, on a bootstrap that does not
/// exist) fails the start, naming it — and what had started is stopped.
#[test]
fn a_failed_start_reaps_what_it_started() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let missing = idemgate_host::target_dir().join("tmp/no-such-envoy.yaml");
    let err = Rig::builder()
        .as_processes(bin_dir(), idemgate_host::target_dir().join("tmp/rig-fail"))
        .demo_backend(Timings::default())
        .gateway(Shipped::default().envoy_yaml(&missing))
        .start()
        .err()
        .expect("a gateway without its bootstrap cannot start");
    assert!(
        format!("{err:#}").contains("gateway exited early"),
        "{err:#}"
    );
    assert_eq!(running_rig_children(), Vec::<u32>::new());
}

/// A start told to give up does so while it waits, stopping what it had started.
#[test]
fn a_cancelled_start_gives_up_and_reaps_what_it_started() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let err = processes("rig-cancel")
        .cancelled_by(Arc::new(AtomicBool::new(true)))
        .start()
        .err()
        .expect("a cancelled start fails");
    assert!(format!("{err:#}").contains("cancelled"), "{err:#}");
    assert_eq!(running_rig_children(), Vec::<u32>::new());
}
