//! `idemgate-e2e`: end-to-end tests and the tools they share.
//!
//! - [`fault_proxy`]: a fault-injecting TCP proxy (latency, blackhole, reset, close) that
//!   tests put between the gateway, the sidecar, Redis and the backend.
//! - `tests/e2e.rs`: the built `target/idemgate.wasm` in the proxy-wasm host harness
//!   (`idemgate-host`), callouts over real sockets to an in-process `idemgate-sidecar` backed
//!   by a real `redis-server`.
//! - `tests/faults/`: the live gateway, sidecar, Redis and demo backend under injected faults,
//!   bad input and protocol property tests, and the soak run (see RELIABILITY.md).
//!
//! Build the wasm first: `cargo xtask wasm` (or run everything with `cargo xtask test`).

pub mod fault_proxy;
