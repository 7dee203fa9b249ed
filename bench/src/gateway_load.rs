//! Group `host`: requests per second through `idemgate-gateway` (the harness's live mode, one
//! worker) with the no-op filter against the same gateway with no filter, in the same run.
//! The per-request cost of the no-op filter inside the VM is the `plugin` group's baseline.

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::rt::TokioIo;
use idemgate_host::gateway::bootstrap::{Bootstrap, FilterSpec, LISTENER};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Keep-alive client connections of the closed-loop load.
pub const CONNECTIONS: usize = 16;

/// A keep-alive upstream answering 200 "ok" on its own thread.
pub fn upstream() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let address = listener.local_addr()?;
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|_req| async {
                        // A content type the filter can store, so granted calls complete.
                        http::Response::builder()
                            .header("content-type", "text/plain")
                            .body(Full::new(Bytes::from_static(b"ok")))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
    });
    Ok(address)
}

/// Closed-loop load: `connections` keep-alive clients for `seconds`.
fn load(address: SocketAddr, connections: usize, seconds: u64) -> Result<f64> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    rt.block_on(async {
        let mut tasks = Vec::new();
        for _ in 0..connections {
            let done = Arc::clone(&done);
            tasks.push(tokio::spawn(async move {
                let Ok(stream) = tokio::net::TcpStream::connect(address).await else {
                    return;
                };
                let Ok((mut sender, conn)) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
                else {
                    return;
                };
                tokio::spawn(conn);
                while Instant::now() < deadline {
                    let request = http::Request::builder()
                        .uri("/")
                        .header("host", "bench")
                        .body(Empty::<Bytes>::new());
                    let Ok(request) = request else { return };
                    let Ok(response) = sender.send_request(request).await else {
                        return;
                    };
                    if response.into_body().collect().await.is_err() {
                        return;
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        for task in tasks {
            let _ = task.await;
        }
    });
    Ok(done.load(Ordering::Relaxed) as f64 / seconds as f64)
}

/// Requests per second through a gateway with `wasm` as its only filter (`None`: no filter).
pub fn throughput(backend: SocketAddr, wasm: Option<&Path>, seconds: u64) -> Result<f64> {
    let bootstrap = Bootstrap::new(backend);
    let bootstrap = match wasm {
        Some(path) => bootstrap.filter(FilterSpec::new("noop", "bench", path)),
        None => bootstrap,
    };
    let gateway = bootstrap.start(1)?;
    let address = gateway.listener_address(LISTENER).context("no listener")?;
    let rps = load(address, CONNECTIONS, seconds);
    gateway.shutdown();
    rps
}
