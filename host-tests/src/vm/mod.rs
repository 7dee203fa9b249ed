//! One proxy-wasm VM (one worker's instance) and Envoy's HTTP filter semantics around it:
//! the root lifecycle, lazy stream contexts, return-code mapping, map and buffer availability
//! windows, body buffering, local replies through the encoder path, deferred actions (never
//! re-entering the module), callouts owned by the root, timers, and failure policies.
//!
//! The VM is sans-IO: drivers (the deterministic test API, the live gateway) feed it stream
//! events and callout outcomes, and read back [`StreamEvent`]s and new callout requests.
//!
//! Layout: [`state`] is the store data hostcalls see (contexts, streams, deferred actions);
//! [`memory`] reads and writes guest memory; [`lifecycle`] instantiates the module and runs
//! its start and shutdown; [`filter`] is the HTTP filter chain around each stream; [`callouts`]
//! holds HTTP callouts, timers and posted queue notifications; [`grpc`] the gRPC calls and
//! streams.

mod callouts;
mod filter;
mod grpc;
mod lifecycle;
pub(crate) mod memory;
mod state;

pub use callouts::{CalloutOutcome, CalloutRequest};
pub use filter::{CallbackRecord, LocalReply, StreamEvent, StreamInfo};
pub(crate) use grpc::GrpcState;
pub use grpc::{GrpcAction, GrpcEvent, GrpcKind, GrpcRequest};
pub(crate) use state::{Deferred, Phase, Stream, Target, VmState};

use crate::plugin::PluginSettings;
use crate::shared::SharedState;
use std::sync::Arc;
use wasmtime::Store;

/// Host-side identity of a stream on one VM (distinct from its context id, which the module
/// sees and which restarts after a reload).
pub type StreamId = u64;

/// One worker's VM.
pub struct Vm {
    store: Store<VmState>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("worker", &self.store.data().worker)
            .finish()
    }
}

impl Vm {
    /// Whether a trap has failed this VM (until a FAIL_RELOAD re-creates it).
    pub fn is_failed(&self) -> bool {
        self.store.data().failed
    }

    pub fn worker(&self) -> usize {
        self.store.data().worker
    }

    pub fn shared(&self) -> &Arc<SharedState> {
        &self.store.data().shared
    }

    pub fn plugin(&self) -> &PluginSettings {
        &self.store.data().plugin
    }

    /// Size of the module's linear memory in bytes (0 while no instance runs): what Envoy
    /// reports as the VM's memory, watched by the benchmarks to stay flat under load.
    pub fn memory_bytes(&self) -> usize {
        let store = &self.store;
        store
            .data()
            .wasm
            .as_ref()
            .map_or(0, |wasm| wasm.memory.data_size(store))
    }

    /// The root context id (1 for a freshly booted VM).
    pub fn root_context_id(&self) -> Option<u32> {
        self.store.data().root.as_ref().map(|r| r.id)
    }
}
