//! A fault-injecting TCP proxy for tests: put it between two processes (gateway ↔ sidecar,
//! sidecar ↔ Redis, gateway ↔ backend) and switch faults on and off while traffic flows.
//!
//! It runs on its own small tokio runtime, so synchronous tests (threads + blocking sockets)
//! and async tests use it the same way. Faults apply to connections already open as well as
//! to new ones, as a network fault would:
//!
//! - [`Fault::Latency`]: every chunk is delivered that much later, in each direction, without
//!   lowering throughput (chunks are timestamped on arrival and written when due);
//! - [`Fault::Blackhole`]: nothing gets through either way and connections stay open (a
//!   partition: peers only notice through their own timeouts). As TCP would, bytes sent
//!   meanwhile are held, not lost: they arrive when the partition heals, if the connection is
//!   still there;
//! - [`Fault::Reset`]: open connections are reset (RST) and new ones are reset on accept (a
//!   crashed host);
//! - [`Fault::Close`]: open connections are closed (FIN) and new ones closed on accept (a
//!   process that exits cleanly).
//!
//! [`FaultProxy::retarget`] points new connections at another upstream (a restarted server on
//! a new port); [`FaultProxy::schedule`] plays a list of faults over time.
//!
//! ```no_run
//! # fn demo(redis: std::net::SocketAddr) -> std::io::Result<()> {
//! use idemgate_rig::fault_proxy::{Fault, FaultProxy};
//! use std::time::Duration;
//! let proxy = FaultProxy::start(redis)?;          // clients connect to proxy.addr()
//! proxy.set(Fault::Latency(Duration::from_millis(200)));
//! proxy.schedule(vec![(Duration::from_secs(1), Fault::Blackhole), (Duration::from_secs(2), Fault::None)]);
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

/// What the proxy does to the bytes and connections passing through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    /// Forward as is.
    #[default]
    None,
    /// Deliver every chunk this much later (each direction).
    Latency(Duration),
    /// Let nothing through either way (held until healed); keep connections open.
    Blackhole,
    /// Reset (RST) open and new connections.
    Reset,
    /// Close (FIN) open and new connections.
    Close,
}

/// Counters a test can assert on.
#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    forwarded_bytes: AtomicU64,
    held_bytes: AtomicU64,
}

struct Shared {
    fault: watch::Sender<Fault>,
    upstream: Mutex<SocketAddr>,
    counters: Counters,
}

/// A running proxy; dropping it stops it and drops every connection.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    ///
    /// # Errors
    /// The runtime cannot be built or the port cannot be bound.
    pub fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fault-proxy")
            .enable_all()
            .build()?;
        let listener = runtime.block_on(TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let (fault, _) = watch::channel(Fault::None);
        let shared = Arc::new(Shared {
            fault,
            upstream: Mutex::new(upstream),
            counters: Counters::default(),
        });
        runtime.spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(FaultProxy {
            addr,
            shared,
            runtime: Some(runtime),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Switches the fault now, for open and new connections.
    pub fn set(&self, fault: Fault) {
        self.shared.fault.send_replace(fault);
    }

    pub fn fault(&self) -> Fault {
        *self.shared.fault.borrow()
    }

    /// New connections go to `upstream` from now on (open ones keep theirs).
    pub fn retarget(&self, upstream: SocketAddr) {
        *lock(&self.shared.upstream) = upstream;
    }

    /// Plays `steps` in order: each `(after, fault)` is set `after` the previous step.
    pub fn schedule(&self, steps: Vec<(Duration, Fault)>) {
        let shared = Arc::clone(&self.shared);
        if let Some(runtime) = &self.runtime {
            runtime.spawn(async move {
                for (after, fault) in steps {
                    tokio::time::sleep(after).await;
                    shared.fault.send_replace(fault);
                }
            });
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.counters.accepted.load(Ordering::Relaxed)
    }

    /// Bytes delivered to either side so far.
    pub fn forwarded_bytes(&self) -> u64 {
        self.shared.counters.forwarded_bytes.load(Ordering::Relaxed)
    }

    /// Bytes that arrived while [`Fault::Blackhole`] was on, so far.
    pub fn held_bytes(&self) -> u64 {
        self.shared.counters.held_bytes.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Not `drop(runtime)`: that blocks, and panics inside an async test.
            runtime.shutdown_background();
        }
    }
}

/// A poisoned lock only means a test thread panicked; the address is still valid.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        shared.counters.accepted.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(connection(client, Arc::clone(&shared)));
    }
}

/// Bytes read from one side, waiting to be written to the other.
#[derive(Default)]
struct Queue {
    chunks: VecDeque<(Instant, Vec<u8>)>,
}

impl Queue {
    fn due(&self) -> Option<Instant> {
        self.chunks.front().map(|(at, _)| *at)
    }

    /// Writes every chunk that is due.
    async fn flush(&mut self, to: &mut TcpStream, counters: &Counters) -> io::Result<()> {
        let now = Instant::now();
        while let Some((at, _)) = self.chunks.front() {
            if *at > now {
                break;
            }
            if let Some((_, chunk)) = self.chunks.pop_front() {
                to.write_all(&chunk).await?;
                counters
                    .forwarded_bytes
                    .fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

/// What one side's read produced.
enum Read {
    Data(Vec<u8>),
    Eof,
}

async fn read_some(from: &mut TcpStream, buf: &mut [u8]) -> io::Result<Read> {
    let n = from.read(buf).await?;
    Ok(match buf.get(..n) {
        Some(data) if n > 0 => Read::Data(data.to_vec()),
        _ => Read::Eof,
    })
}

/// Ends a connection the way `fault` says (RST or FIN).
fn end(stream: &TcpStream, fault: Fault) {
    if fault == Fault::Reset {
        // Linger 0: close() sends RST instead of FIN.
        let _ = stream.set_zero_linger();
    }
}

/// Proxies one client connection until either side closes or a fault ends it.
async fn connection(mut client: TcpStream, shared: Arc<Shared>) {
    let mut faults = shared.fault.subscribe();
    let mut upstream: Option<TcpStream> = None;
    let mut to_upstream = Queue::default();
    let mut to_client = Queue::default();
    let mut client_buf = vec![0u8; 16 * 1024];
    let mut upstream_buf = vec![0u8; 16 * 1024];
    loop {
        let fault = *faults.borrow_and_update();
        if matches!(fault, Fault::Reset | Fault::Close) {
            end(&client, fault);
            if let Some(up) = &upstream {
                end(up, fault);
            }
            return;
        }
        // Connect lazily: a blackholed connection never reaches the upstream.
        if upstream.is_none() && fault != Fault::Blackhole {
            let target = *lock(&shared.upstream);
            match TcpStream::connect(target).await {
                Ok(up) => {
                    let _ = up.set_nodelay(true);
                    upstream = Some(up);
                }
                Err(_) => {
                    // The upstream is down: the client sees what it would see, a reset.
                    end(&client, Fault::Reset);
                    return;
                }
            }
        }
        let delay = match fault {
            Fault::Latency(d) => d,
            _ => Duration::ZERO,
        };
        let next_due = match (to_upstream.due(), to_client.due()) {
            _ if fault == Fault::Blackhole => None,
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let step = tokio::select! {
            changed = faults.changed() => {
                if changed.is_err() {
                    return;
                }
                Step::FaultChanged
            }
            read = read_some(&mut client, &mut client_buf) => Step::FromClient(read),
            read = async {
                match upstream.as_mut() {
                    Some(up) => read_some(up, &mut upstream_buf).await,
                    None => std::future::pending().await,
                }
            } => Step::FromUpstream(read),
            () = async {
                match next_due {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => Step::Due,
        };
        let blackholed = fault == Fault::Blackhole;
        match step {
            Step::FaultChanged | Step::Due => {}
            Step::FromClient(Ok(Read::Data(data))) => {
                count_held(&shared, blackholed, &data);
                to_upstream.chunks.push_back((Instant::now() + delay, data));
            }
            Step::FromUpstream(Ok(Read::Data(data))) => {
                count_held(&shared, blackholed, &data);
                to_client.chunks.push_back((Instant::now() + delay, data));
            }
            // Either side gone: close the other (after what is already due).
            Step::FromClient(_) | Step::FromUpstream(_) => {
                if !blackholed {
                    if let Some(up) = upstream.as_mut() {
                        let _ = to_upstream.flush(up, &shared.counters).await;
                    }
                    let _ = to_client.flush(&mut client, &shared.counters).await;
                }
                return;
            }
        }
        if blackholed {
            continue;
        }
        if let Some(up) = upstream.as_mut()
            && to_upstream.flush(up, &shared.counters).await.is_err()
        {
            end(&client, Fault::Reset);
            return;
        }
        if to_client
            .flush(&mut client, &shared.counters)
            .await
            .is_err()
        {
            if let Some(up) = &upstream {
                end(up, Fault::Reset);
            }
            return;
        }
    }
}

enum Step {
    FaultChanged,
    FromClient(io::Result<Read>),
    FromUpstream(io::Result<Read>),
    Due,
}

fn count_held(shared: &Shared, blackholed: bool, data: &[u8]) {
    if blackholed {
        shared
            .counters
            .held_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{ErrorKind, Read as _, Write as _};
    use std::net::{TcpListener as StdListener, TcpStream as StdStream};

    /// An echo server on its own thread: every connection echoes until EOF.
    fn echo_server() -> SocketAddr {
        let listener = StdListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = conn.read(&mut buf) {
                        if n == 0 || conn.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    fn connect(proxy: &FaultProxy) -> StdStream {
        let conn = StdStream::connect(proxy.addr()).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        conn
    }

    fn echo(conn: &mut StdStream, msg: &[u8]) -> io::Result<Vec<u8>> {
        conn.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        conn.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn forwards_both_ways_unchanged() {
        let proxy = FaultProxy::start(echo_server()).unwrap();
        let mut conn = connect(&proxy);
        for i in 0..20 {
            let msg = format!("message {i}");
            assert_eq!(echo(&mut conn, msg.as_bytes()).unwrap(), msg.as_bytes());
        }
        assert_eq!(proxy.accepted(), 1);
        assert!(proxy.forwarded_bytes() > 0);
    }

    #[test]
    fn latency_delays_each_direction() {
        let proxy = FaultProxy::start(echo_server()).unwrap();
        let mut conn = connect(&proxy);
        proxy.set(Fault::Latency(Duration::from_millis(150)));
        let started = std::time::Instant::now();
        assert_eq!(echo(&mut conn, b"slow").unwrap(), b"slow");
        // A lower bound only: one chunk each way, each held back 150 ms.
        assert!(started.elapsed() >= Duration::from_millis(300));
        proxy.set(Fault::None);
        assert_eq!(echo(&mut conn, b"fast").unwrap(), b"fast");
    }

    #[test]
    fn blackhole_holds_bytes_until_it_heals() {
        let proxy = FaultProxy::start(echo_server()).unwrap();
        let mut conn = connect(&proxy);
        assert_eq!(echo(&mut conn, b"before").unwrap(), b"before");
        proxy.set(Fault::Blackhole);
        conn.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let held = echo(&mut conn, b"held");
        assert!(
            matches!(&held, Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
            "no answer through a blackhole: {held:?}"
        );
        // A new connection is accepted but goes nowhere either.
        let mut other = connect(&proxy);
        other
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        assert!(echo(&mut other, b"nowhere").is_err());
        assert!(proxy.held_bytes() >= 11);
        proxy.set(Fault::None);
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut late = [0u8; 4];
        conn.read_exact(&mut late).unwrap();
        assert_eq!(&late, b"held", "delivered once healed, in order");
        assert_eq!(echo(&mut conn, b"after").unwrap(), b"after");
    }

    #[test]
    fn reset_resets_open_and_new_connections() {
        let proxy = FaultProxy::start(echo_server()).unwrap();
        let mut conn = connect(&proxy);
        assert_eq!(echo(&mut conn, b"hi").unwrap(), b"hi");
        proxy.set(Fault::Reset);
        let mut buf = [0u8; 8];
        let open = conn.read(&mut buf);
        assert!(
            matches!(&open, Err(e) if e.kind() == ErrorKind::ConnectionReset),
            "{open:?}"
        );
        let mut new = connect(&proxy);
        let fresh = new.read(&mut buf);
        assert!(
            matches!(&fresh, Err(e) if e.kind() == ErrorKind::ConnectionReset),
            "{fresh:?}"
        );
    }

    #[test]
    fn close_ends_connections_with_eof() {
        let proxy = FaultProxy::start(echo_server()).unwrap();
        let mut conn = connect(&proxy);
        assert_eq!(echo(&mut conn, b"hi").unwrap(), b"hi");
        proxy.set(Fault::Close);
        let mut buf = [0u8; 8];
        assert_eq!(conn.read(&mut buf).unwrap(), 0, "EOF");
    }

    #[test]
    fn a_dead_upstream_resets_the_client_and_retarget_revives_it() {
        let dead = StdListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let proxy = FaultProxy::start(dead).unwrap();
        let mut conn = connect(&proxy);
        let mut buf = [0u8; 8];
        assert!(conn.read(&mut buf).is_err() || buf == [0u8; 8]);
        proxy.retarget(echo_server());
        let mut conn = connect(&proxy);
        assert_eq!(echo(&mut conn, b"back").unwrap(), b"back");
    }

    #[test]
    fn schedule_switches_faults_over_time() {
        let proxy = FaultProxy::start(echo_server()).unwrap();
        proxy.schedule(vec![
            (Duration::from_millis(50), Fault::Blackhole),
            (Duration::from_millis(50), Fault::None),
        ]);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while proxy.fault() != Fault::Blackhole {
            assert!(std::time::Instant::now() < deadline, "never blackholed");
            std::thread::sleep(Duration::from_millis(5));
        }
        while proxy.fault() != Fault::None {
            assert!(std::time::Instant::now() < deadline, "never healed");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut conn = connect(&proxy);
        assert_eq!(echo(&mut conn, b"ok").unwrap(), b"ok");
    }
}
