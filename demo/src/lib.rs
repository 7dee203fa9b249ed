//! The idemgate demo: a backend whose services break under duplicate calls
//! ([`backend`]), used by the demo, the end-to-end tests and the benchmarks.

pub mod backend;
