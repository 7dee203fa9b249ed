//! End-to-end scenarios: the built filter in the host harness, a real sidecar, real Redis;
//! `live` plays the README's duplicate-call scenarios through live gateways to the demo
//! backend; `demo` runs the demo driver's binary; `hostile` plays hostile spellings and forged
//! headers through live gateways.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod util;

mod demo;
mod hostile;
mod live;
mod observability;
mod rate;
mod scenarios;
