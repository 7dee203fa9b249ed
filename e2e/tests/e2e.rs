//! End-to-end scenarios: the built filter in the host harness, a real sidecar, real Redis;
//! `live` plays the README's duplicate-call scenarios through live gateways to the demo
//! backend; `demo` runs the demo driver's binary; `hostile` plays hostile spellings and forged
//! headers through live gateways; `grpc` guards gRPC methods between a real tonic client and
//! service; `trace` follows one request's trace into the sidecar.

// The whole crate is test code, helpers included: clippy's allow-*-in-tests settings
// (clippy.toml) see only `#[test]` functions and `cfg(test)` items as tests.
#![cfg(test)]

mod demo;
mod grpc;
mod hostile;
mod live;
mod observability;
mod rate;
mod scenarios;
mod trace;
mod webhooks;
