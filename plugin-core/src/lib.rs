//! idemgate's filter logic without proxy-wasm: configuration, key derivation and the
//! per-request decision state machine. The `idemgate-plugin` cdylib is thin glue over this:
//! it implements the ports ([`RequestView`], [`SharedStore`], [`Telemetry`]), feeds stream
//! events to a [`Flow`] and carries out the [`Action`]s it returns.
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | the JSON configuration and its validation into [`Config`] |
//! | [`canonical`] | canonical paths and decoded key values, as backends read them |
//! | [`rule`] | which rule a request falls under |
//! | [`key`] | key extraction, validation and the scoped, hashed stored key |
//! | [`fingerprint`] | request fingerprints for key-reuse detection |
//! | [`local`] | the bounded shared-data table (local tier) |
//! | [`flow`] | the per-request state machine |
//! | [`rate`] | rate limits: GCRA keys, the shared-data rate table, `RateLimit` fields |
//! | [`capture`] | what of a response is stored for replay |
//! | [`breaker`] | the sidecar circuit breaker |
//! | [`problem`] | local replies (RFC 9457 problems, replays) |
//! | [`metrics`] | metric names |

#![no_std]
extern crate alloc;

pub mod breaker;
pub mod canonical;
pub mod capture;
pub mod config;
pub mod fingerprint;
pub mod flow;
pub mod key;
pub mod local;
pub mod metrics;
pub mod problem;
pub mod rate;
pub mod rule;

#[cfg(test)]
mod testing;

pub use breaker::Breaker;
pub use config::{Config, ConfigError};
pub use flow::{
    Action, Answer, Callout, Env, Flow, ReleaseResult, Route, on_leave_answer, on_release_answer,
};
pub use local::{HostError, SharedStore};
pub use metrics::{Counter, Histogram, Telemetry};
pub use problem::Reply;
pub use rule::RequestView;
