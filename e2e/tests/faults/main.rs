//! Faults under concurrent duplicate load, through the live harness gateway running
//! `target/idemgate.wasm`, a real sidecar, real Redis and the demo backend (whose `/stats` is
//! the ground truth of what executed). Each test asserts: no double execution in `closed`
//! mode, every client answered within a bound (no hang), no lock held past its lease, and
//! that the metrics count what happened. RELIABILITY.md maps every fault to its test.

// The whole crate is test code, helpers included: clippy's allow-*-in-tests settings
// (clippy.toml) see only `#[test]` functions and `cfg(test)` items as tests.
#![cfg(test)]

mod rig;

mod bad_input;
mod checks;
mod client_abort;
mod fencing;
mod local_veto;
mod properties;
mod queue_leave;
mod redis;
mod sidecar;
mod soak;
mod trap;
mod upstream;
