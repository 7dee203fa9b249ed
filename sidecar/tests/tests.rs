//! The sidecar's integration tests: black-box over real sockets against in-process
//! sidecars; Redis-backed ones start their own `redis-server` on a free loopback port.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

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
