//! The idemgate demo: a backend whose services break under duplicate calls
//! ([`backend`]), the scenarios that show it ([`scenarios`]) and the processes that run them
//! end to end ([`stack`]). Used by `cargo xtask demo`, the end-to-end tests and the benchmarks.

pub mod backend;
pub mod scenarios;
pub mod stack;
