#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]
//! The host-tests integration suite: one binary, one module per area.

mod artifact;
