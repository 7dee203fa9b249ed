//! `host-bench`: per-request host overhead of the no-op filter through the deterministic API
//! (ns/request; run under `valgrind --tool=callgrind` and divide by the printed request count
//! for instructions/request), and gateway requests/s with vs without the filter.
//!
//! `cargo run --release -p idemgate-host --bin host-bench -- [--mode host|gateway|all]
//!  [--requests N] [--seconds S] [--connections C] [--wasm PATH]`

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::rt::TokioIo;
use idemgate_host::gateway::config::EnvoyConfig;
use idemgate_host::gateway::{Gateway, GatewayOptions};
use idemgate_host::{
    Clock, Direction, HeaderMap, PluginSettings, SharedState, StreamInfo, Vm, WasmModule,
};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

struct Options {
    mode: String,
    requests: u64,
    seconds: u64,
    connections: usize,
    wasm: PathBuf,
}

fn options() -> Result<Options> {
    let mut o = Options {
        mode: "all".into(),
        requests: 20_000,
        seconds: 5,
        connections: 16,
        wasm: idemgate_host::artifact("fixtures/noop.wasm")?,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--mode" => o.mode = value,
            "--requests" => o.requests = value.parse()?,
            "--seconds" => o.seconds = value.parse()?,
            "--connections" => o.connections = value.parse()?,
            "--wasm" => o.wasm = value.into(),
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(o)
}

/// One request through the VM: headers (end of stream), response headers, teardown.
fn host_overhead(o: &Options) -> Result<()> {
    let module = WasmModule::load(&o.wasm)?;
    let shared = Arc::new(SharedState::new(Clock::real(), None, 0));
    let mut vm = Vm::boot(
        &module,
        Arc::new(PluginSettings::default()),
        Arc::default(),
        shared,
        0,
    )?;
    let request = HeaderMap::from([
        (":authority", "bench"),
        (":path", "/"),
        (":method", "GET"),
        (":scheme", "http"),
        ("x-request-id", "00000000-0000-4000-8000-000000000000"),
    ]);
    let response = HeaderMap::from([(":status", "200"), ("content-length", "0")]);
    let run = |vm: &mut Vm, n: u64| {
        for _ in 0..n {
            let id = vm.new_stream(StreamInfo::default());
            vm.headers(id, Direction::Request, request.clone(), true);
            vm.headers(id, Direction::Response, response.clone(), true);
            let _ = vm.take_events(id);
            vm.remove_stream(id);
        }
    };
    run(&mut vm, o.requests / 10 + 1);
    let started = Instant::now();
    run(&mut vm, o.requests);
    let elapsed = started.elapsed();
    println!(
        "host: {} requests through {} in {:.3} s: {:.0} ns/request",
        o.requests,
        o.wasm.display(),
        elapsed.as_secs_f64(),
        elapsed.as_nanos() as f64 / o.requests as f64
    );
    Ok(())
}

/// A keep-alive upstream answering 200 "ok" on its own thread.
fn upstream() -> Result<SocketAddr> {
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
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from_static(b"ok"),
                        )))
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

fn gateway_yaml(backend: SocketAddr, wasm: Option<&PathBuf>) -> String {
    let filter = wasm.map_or_else(String::new, |path| {
        format!(
            r#"- name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: noop
                vm_config: {{ vm_id: bench, code: {{ local: {{ filename: "{}" }} }} }}
          "#,
            path.display()
        )
    });
    format!(
        r#"
static_resources:
  listeners:
  - name: main
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bench
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes: [{{ match: {{ prefix: "/" }}, route: {{ cluster: backend }} }}]
          http_filters:
          {filter}- name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: backend
    connect_timeout: 1s
    load_assignment:
      endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }} }}] }}]
"#,
        backend.port()
    )
}

/// Closed-loop load: `connections` keep-alive clients for `seconds`.
fn load(address: SocketAddr, o: &Options) -> Result<f64> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(o.seconds);
    rt.block_on(async {
        let mut tasks = Vec::new();
        for _ in 0..o.connections {
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
    Ok(done.load(Ordering::Relaxed) as f64 / o.seconds as f64)
}

fn gateway_throughput(o: &Options) -> Result<()> {
    let backend = upstream()?;
    for (label, wasm) in [
        ("without filter", None),
        ("with no-op filter", Some(&o.wasm)),
    ] {
        let config =
            EnvoyConfig::from_yaml(&gateway_yaml(backend, wasm), std::path::Path::new("."))?;
        let gateway = Gateway::start(config, GatewayOptions::default())?;
        let address = gateway.listener_address("main").context("no listener")?;
        let rps = load(address, o)?;
        println!(
            "gateway ({label}, 1 worker, {} connections, {} s): {rps:.0} requests/s",
            o.connections, o.seconds
        );
        gateway.shutdown();
    }
    Ok(())
}

fn main() -> Result<()> {
    let o = options()?;
    match o.mode.as_str() {
        "host" => host_overhead(&o),
        "gateway" => gateway_throughput(&o),
        "all" => {
            host_overhead(&o)?;
            gateway_throughput(&o)
        }
        other => bail!("--mode {other}: expected host, gateway or all"),
    }
}
