//! idemgate's filter logic without proxy-wasm: configuration, key derivation and the
//! per-request decision state machine. The `idemgate-plugin` cdylib is thin glue over this:
//! it implements the host ports ([`RequestView`], [`SharedStore`], [`Telemetry`]), feeds
//! stream events to a [`Flow`] and carries out the [`Action`]s it returns.
//!
//! | module | owns |
//! |---|---|
//! | [`spec`] | the compiled configuration: [`Config`], rules, matchers, key, scope, fingerprint, response and rate specs |
//! | [`config`] | parsing the JSON configuration into a [`Config`], errors that name the field |
//! | `ports` | the host ports: [`RequestView`], [`SharedStore`], [`Telemetry`], [`Env`] |
//! | [`canonical`] | canonical paths and decoded key values, as backends read them |
//! | [`rule`] | which rule a request falls under |
//! | [`key`] | key extraction, validation and the scoped, hashed stored key |
//! | `hash` | the length-prefixed SHA-256 every key, fingerprint and name is made with |
//! | `fingerprint` | request fingerprints for key-reuse detection |
//! | `local` | the bounded shared-data table (local tier) |
//! | `flow` | the per-request state machine ([`Flow`]) |
//! | `rate` | rate limits: GCRA keys, the shared-data rate table, `RateLimit` fields |
//! | `capture` | what of a response is stored for replay |
//! | `breaker` | the sidecar circuit breaker ([`Breaker`]) |
//! | `grpc` | gRPC calls: content types, status codes by name, the stored codes |
//! | `trace` | the trace context a request's callouts carry ([`TraceContext`]) |
//! | `problem` | local replies: refusals as RFC 9457 problems or gRPC statuses, replays ([`Reply`]) |
//! | [`metrics`] | metric names |
//! | [`pairs`] | a serialized header map read in place (one host read answers every header question) |
//! | `testing` | test doubles for the ports (feature `testing`, used by `fuzz/`) |

#![no_std]
extern crate alloc;

pub mod canonical;
pub mod config;
pub mod key;
pub mod metrics;
pub mod pairs;
pub mod rule;
pub mod spec;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

mod breaker;
mod capture;
mod fingerprint;
mod flow;
mod grpc;
mod hash;
mod local;
mod ports;
mod problem;
mod rate;
mod trace;

pub use breaker::Breaker;
pub use config::ConfigError;
pub use flow::{
    Action, Answer, Callout, Flow, Lookups, ReleaseResult, Route, on_leave_answer,
    on_release_answer,
};
pub use hash::DigestMemo;
pub use metrics::{Counter, Decision, Histogram, Noted};
pub use ports::{Env, HostError, RequestView, SharedStore, Telemetry};
pub use problem::{Header, Reply};
pub use spec::Config;
pub use trace::TraceContext;
