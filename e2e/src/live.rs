//! The live stack of the README's duplicate-call scenarios: the demo backend (its counters
//! are the ground truth) in process, and gateways serving real HTTP — the shipped
//! `envoy/envoy.yaml` with its ports overridden, or a variant rendered by the bootstrap
//! builder where a scenario needs rules the shipped file lacks. All of it is the rig's
//! ([`idemgate_rig`]); this module gives it the shape the scenarios read best in.

use idemgate_demo::scenarios::{self, Run, Scenario};
use idemgate_host::gateway::bootstrap::Bootstrap;
use idemgate_rig::DemoBackend;
use idemgate_rig::backend::{Stats, Timings};
use idemgate_rig::gateway::{self, LiveGateway, Shipped};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The demo backend on its own runtime, which also drives the scenario clients.
pub struct Demo {
    backend: DemoBackend,
    pub addr: SocketAddr,
    client: reqwest::Client,
}

impl Demo {
    pub fn start() -> Demo {
        let backend = DemoBackend::start(Timings::default()).expect("the demo backend starts");
        Demo {
            addr: backend.addr(),
            backend,
            client: reqwest::Client::new(),
        }
    }

    pub fn url(&self) -> String {
        self.backend.url()
    }

    /// What the backend executed so far.
    pub fn stats(&self) -> Stats {
        self.backend.backend().stats()
    }

    /// Plays `scenario` through `gateway` (every call bounded) and reads the ground truth.
    pub fn play(&self, gateway: &LiveGateway, scenario: &Scenario) -> Run {
        self.play_at(&gateway.url(), scenario)
    }

    /// Plays `scenario` straight to the backend, as the demo's "direct" rows do.
    pub fn play_direct(&self, scenario: &Scenario) -> Run {
        self.play_at(&self.url(), scenario)
    }

    fn play_at(&self, base: &str, scenario: &Scenario) -> Run {
        self.backend
            .runtime()
            .block_on(scenarios::play(
                &self.client,
                base,
                &self.url(),
                scenario,
                Duration::from_secs(90),
            ))
            .expect("the scenario plays")
    }

    /// Forgets what the backend executed (its counters start from zero).
    pub fn reset(&self) {
        self.backend.backend().reset();
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

/// `envoy/envoy.yaml` as shipped, its ports pointed at `backend` and `sidecar` (the
/// listener and admin on free ports) and its module at the built `target/idemgate.wasm`.
pub fn shipped(backend: SocketAddr, sidecar: SocketAddr, workers: usize) -> LiveGateway {
    Shipped::default()
        .workers(workers)
        .start(backend, sidecar)
        .expect("the gateway runs envoy/envoy.yaml (build target/idemgate.wasm: cargo xtask wasm)")
}

/// The plugin configuration of the shipped `envoy/envoy.yaml`, as JSON to edit.
pub fn shipped_plugin() -> serde_json::Value {
    gateway::shipped_plugin().expect("envoy/envoy.yaml's plugin configuration")
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
    LiveGateway::from_bootstrap(&bootstrap, workers)
        .expect("the gateway starts (build target/idemgate.wasm: cargo xtask wasm)")
}

/// Polls `done` every 20 ms for up to 60 s.
pub fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
