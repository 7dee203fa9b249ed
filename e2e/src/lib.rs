//! `idemgate-e2e`: end-to-end tests and the helpers their two test binaries share. The
//! stack itself — Redis, the sidecar, the demo backend, gateways, fault proxies — is
//! `idemgate-rig`'s; these are the tests' ways of driving and reading it.
//!
//! - [`client`]: a blocking one-request-per-connection HTTP/1.1 client.
//! - [`harness`]: the built filter in `TestHost` gateways whose callouts a test forwards.
//! - [`stack`]: Redis and a sidecar, with the readings tests wait on.
//! - [`live`]: the demo backend and live gateways for the README's scenarios.
//! - `tests/e2e.rs`: the scenarios in the harness and through live gateways, the demo binary,
//!   hostile input and rate limits.
//! - `tests/faults/`: the live gateway, sidecar, Redis and demo backend under injected faults,
//!   bad input and protocol property tests, and the soak run (see RELIABILITY.md).
//!
//! Build the wasm first: `cargo xtask wasm` (or run everything with `cargo xtask test`).

#![allow(
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    reason = "test helpers: a failure is the calling test failing, reported where it happened"
)]

pub mod client;
pub mod harness;
pub mod live;
pub mod stack;
