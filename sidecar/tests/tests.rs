//! The sidecar's integration tests: black-box over real sockets against in-process
//! sidecars; Redis-backed ones start their own `redis-server` on a free loopback port.
// The whole crate is test code, helpers included: clippy's allow-*-in-tests settings
// (clippy.toml) see only `#[test]` functions and `cfg(test)` items as tests.
#![cfg(test)]

mod util;

mod cluster;
mod connections;
mod crash;
mod http_api;
mod observability;
mod rate;
mod redis_faults;
mod redis_layout;
mod redis_tls;
mod suite;
