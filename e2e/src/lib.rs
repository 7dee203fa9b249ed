//! `idemgate-e2e` has no library code: its tests (`tests/e2e.rs`) load the built
//! `target/idemgate.wasm` into the proxy-wasm host harness (`idemgate-host`), with callouts
//! going over real sockets to an in-process `idemgate-sidecar` backed by a real `redis-server`.
//! Build the wasm first: `cargo xtask wasm` (or run everything with `cargo xtask test`).
