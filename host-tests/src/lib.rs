//! A proxy-wasm ABI 0.2.1 host on wasmtime that runs filters as Envoy does (see
//! `host-tests/README.md`), driven either by a deterministic test API ([`testing`]) or live, by
//! the `idemgate-gateway` ([`gateway`]).
//!
//! The live gateway is the one the demo, the benchmarks and the end-to-end tests run: Envoy
//! cannot run on the machines this project is built on, so this crate stands in for it,
//! configured by the same Envoy bootstrap files users deploy.
//!
//! Inside: [`vm`](crate::Vm) is one worker's VM and the filter chain around it, `hostcalls`
//! and `wasi` are the module's imports, `plugin` loads modules and holds plugin settings,
//! `shared` is the process-wide state (shared data, queues, metrics, logs; histograms binned
//! as Envoy bins them, `histogram`), `upstream` and
//! `client` carry callouts and routed requests over real sockets.

mod abi;
mod client;
pub mod gateway;
pub mod grpc;
mod grpc_upstream;
mod headers;
mod histogram;
mod hostcalls;
mod local_reply;
mod plugin;
mod properties;
mod shared;
pub mod testing;
mod upstream;
mod vm;
mod wasi;

pub use abi::{Direction, LogLevel, MetricKind, Status};
pub use headers::HeaderMap;
pub use histogram::Histogram;
pub use plugin::{Cluster, Clusters, FailurePolicy, LoadError, PluginSettings, WasmModule};
pub use shared::{CANARY_WORKER, Clock, LogRecord, MAIN_THREAD, Metric, SharedState};
pub use vm::{
    CallbackRecord, CalloutOutcome, CalloutRequest, GrpcAction, GrpcEvent, GrpcKind, GrpcRequest,
    LocalReply, StreamEvent, StreamId, StreamInfo, Vm,
};

use std::path::PathBuf;

/// The workspace's `target/` directory, where `cargo xtask wasm` writes its artifacts.
pub fn target_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target")
}

/// Path of a built wasm artifact, or an error naming the command that builds it.
pub fn artifact(relative: &str) -> anyhow::Result<PathBuf> {
    let path = target_dir().join(relative);
    if path.is_file() {
        Ok(path)
    } else {
        anyhow::bail!(
            "{} is missing: build it with `cargo xtask wasm` (from the workspace root)",
            path.display()
        )
    }
}
