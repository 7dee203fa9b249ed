//! The live stack of the README's duplicate-call scenarios: the demo backend (its `/stats`
//! is the ground truth) in process, gateways serving real HTTP — the shipped `envoy/envoy.yaml` with its
//! ports overridden, or a variant rendered by the bootstrap builder where a scenario needs
//! rules the shipped file lacks — and a relay that can cut one gateway off the sidecar.

use super::http;
use idemgate_demo::backend::{self, Backend, Stats, Timings};
use idemgate_demo::scenarios::{self, Run, Scenario};
use idemgate_host::gateway::bootstrap::{Bootstrap, LISTENER};
use idemgate_host::gateway::config::EnvoyConfig;
use idemgate_host::gateway::{Gateway, GatewayOptions};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The listener of `envoy/envoy.yaml`.
const SHIPPED_LISTENER: &str = "ingress";

/// The demo backend on its own runtime, which also drives the scenario clients.
pub struct Demo {
    runtime: tokio::runtime::Runtime,
    pub addr: SocketAddr,
    client: reqwest::Client,
}

impl Demo {
    pub fn start() -> Demo {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind the demo backend");
        let addr = listener.local_addr().expect("addr");
        runtime.spawn(backend::serve(
            listener,
            Backend::new(Timings::default()),
            std::future::pending(),
        ));
        Demo {
            runtime,
            addr,
            client: reqwest::Client::new(),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What the backend executed so far.
    pub fn stats(&self) -> Stats {
        let reply = http(self.addr, "GET", "/stats", &[], "");
        serde_json::from_str(&reply.body).expect("backend stats")
    }

    /// Plays `scenario` through `gateway` (every call bounded) and reads the ground truth.
    pub fn play(&self, gateway: &LiveGateway, scenario: &Scenario) -> Run {
        self.runtime
            .block_on(scenarios::play(
                &self.client,
                &gateway.url(),
                &self.url(),
                scenario,
                Duration::from_secs(90),
            ))
            .expect("the scenario plays")
    }

    /// Waits (bounded) until the backend started the call labelled `seq` on `resource`.
    pub fn wait_started(&self, resource: &str, seq: &str) {
        eventually(&format!("{resource} call {seq} at the backend"), || {
            self.stats()
                .order
                .get(resource)
                .is_some_and(|o| o.iter().any(|s| s == seq))
        });
    }
}

/// A gateway serving HTTP, dropped (and shut down) with the test.
pub struct LiveGateway {
    pub gateway: Gateway,
    pub addr: SocketAddr,
}

impl LiveGateway {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A plugin counter as the admin endpoint would publish it.
    pub fn counter(&self, name: &str) -> i64 {
        self.gateway
            .shared()
            .metrics()
            .get(name)
            .map_or(0, |m| m.value)
    }
}

fn workspace_root() -> std::path::PathBuf {
    idemgate_host::target_dir().join("..")
}

/// `envoy/envoy.yaml` as shipped, its ports pointed at `backend` and `sidecar` (the
/// listener and admin on free ports) and its module at the built `target/idemgate.wasm`.
pub fn shipped(backend: SocketAddr, sidecar: SocketAddr, workers: usize) -> LiveGateway {
    let mut config =
        EnvoyConfig::load(&workspace_root().join("envoy/envoy.yaml")).expect("envoy/envoy.yaml");
    config.set_wasm_path(&idemgate_host::target_dir().join("idemgate.wasm"));
    for (name, port) in [
        (SHIPPED_LISTENER, 0),
        ("admin", 0),
        ("backend", backend.port()),
        ("idemgate_sidecar", sidecar.port()),
    ] {
        config.set_port(name, port).expect("envoy.yaml names it");
    }
    let gateway = Gateway::start(
        config,
        GatewayOptions {
            concurrency: workers,
            ..GatewayOptions::default()
        },
    )
    .expect("the gateway runs envoy/envoy.yaml (build target/idemgate.wasm: cargo xtask wasm)");
    let addr = gateway
        .listener_address(SHIPPED_LISTENER)
        .expect("listener");
    LiveGateway { gateway, addr }
}

/// The plugin configuration of the shipped `envoy/envoy.yaml`, as JSON to edit.
pub fn shipped_plugin() -> serde_json::Value {
    let config =
        EnvoyConfig::load(&workspace_root().join("envoy/envoy.yaml")).expect("envoy/envoy.yaml");
    let wasm = config.listeners[0]
        .wasm
        .as_ref()
        .expect("the idemgate filter");
    serde_json::from_slice(&wasm.settings.configuration).expect("JSON plugin configuration")
}

/// The rule named `name` in a plugin configuration.
pub fn rule<'a>(plugin: &'a mut serde_json::Value, name: &str) -> &'a mut serde_json::Value {
    plugin["rules"]
        .as_array_mut()
        .expect("rules")
        .iter_mut()
        .find(|r| r["name"] == name)
        .expect("the shipped config has this rule")
}

/// A gateway with `plugin` (edited from [`shipped_plugin`]), rendered by the builder with the
/// shipped config's listener route, sidecar cluster and filter names.
pub fn variant(
    backend: SocketAddr,
    sidecar: SocketAddr,
    plugin: &serde_json::Value,
    workers: usize,
) -> LiveGateway {
    variant_of(
        Bootstrap::idemgate(backend, sidecar, &plugin.to_string()),
        workers,
    )
}

pub fn variant_of(bootstrap: Bootstrap, workers: usize) -> LiveGateway {
    let gateway = bootstrap
        .start(workers)
        .expect("the gateway starts (build target/idemgate.wasm: cargo xtask wasm)");
    let addr = gateway.listener_address(LISTENER).expect("listener");
    LiveGateway { gateway, addr }
}

/// Polls `done` every 20 ms for up to 60 s.
pub fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A TCP relay to `target` that can be cut: every relayed connection is closed and new ones
/// are closed on accept — a partition between one gateway and the sidecar.
pub struct Relay {
    pub addr: SocketAddr,
    cut: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    pub fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        let addr = listener.local_addr().expect("addr");
        let cut = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(Mutex::new(Vec::new()));
        let (is_cut, open) = (Arc::clone(&cut), Arc::clone(&connections));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                if is_cut.load(Ordering::SeqCst) {
                    continue; // dropped: closed at once
                }
                let Ok(server) = TcpStream::connect(target) else {
                    continue;
                };
                let mut open = open.lock().unwrap();
                for (from, to) in [(&client, &server), (&server, &client)] {
                    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
                        continue;
                    };
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Write);
                    });
                }
                open.extend([client, server]);
            }
        });
        Relay {
            addr,
            cut,
            connections,
        }
    }

    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for conn in self.connections.lock().unwrap().drain(..) {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}
