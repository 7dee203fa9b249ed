//! The host-tests integration suite: one binary, one module per area.
// The whole crate is test code, helpers included: clippy's allow-*-in-tests settings
// (clippy.toml) see only `#[test]` functions and `cfg(test)` items as tests.
#![cfg(test)]

mod artifact;
mod callouts;
mod fidelity;
mod gateway;
mod grpc;
mod http;
mod lifecycle;
mod service;
mod shared_state;
mod util;
