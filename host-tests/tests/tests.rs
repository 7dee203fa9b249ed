//! The host-tests integration suite: one binary, one module per area.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

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
