//! End-to-end scenarios: the built filter in the host harness, a real sidecar, real Redis.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod util;

mod rate;
mod scenarios;
