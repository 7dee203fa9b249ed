//! The idemgate lock sidecar: the shared authority that every gateway asks "may this
//! mutating call run?". It is stateless itself and keeps all state in a store.
//!
//! Components:
//! - `batched`: a connection's writes gathered per scheduler turn.
//! - [`check`]: `--check`, the flags and the store proven for init containers.
//! - [`config`]: flags ([`Cli`]) → validated [`Config`].
//! - `http`: the versioned HTTP API (`/v1/claim|complete|abort|renew`), admin, health,
//!   metrics; RFC 9457 problems for everything that is not a protocol answer.
//! - `locks`: the protocol verbs, owner tokens, FIFO long-polls and their wake-ups.
//! - `rate`: the global tier of rate limits (`/v1/rate`, GCRA, one store step per limit).
//! - `store`: the lock and rate-limit store traits, two implementations (memory, Redis
//!   with Lua scripts).
//! - [`telemetry`]: log format, the OTLP span exporter, the span of each protocol request.
//! - `waiters`: the per-process registry that stores wake waiting claims through.
//! - [`server`]: the HTTP/1.1 + h2c accept loop, [`run`] and [`Sidecar`].
//! - `testing` (feature `testing`): real `redis-server` processes for tests.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemgate_sidecar::ServerError> {
//! use idemgate_sidecar::{Config, Sidecar, StoreConfig};
//! let sidecar = Sidecar::spawn(Config::loopback(StoreConfig::Memory)).await?;
//! // POST framed idemgate_wire messages to sidecar.url() + idemgate_wire::paths::CLAIM ...
//! sidecar.shutdown().await
//! # }
//! ```

mod batched;
pub mod check;
pub mod config;
mod heads;
mod hints;
mod http;
mod locks;
mod metrics;
mod rate;
pub mod server;
mod store;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
mod waiters;

pub use config::{Cli, Config, ConfigError, RedisConfig, RedisTls, RedisTopology, StoreConfig};
pub use server::{ServerError, Sidecar, run};
pub use store::{CompletedInfo, HolderInfo, KeyInfo, KeyState, StoreError};
pub use telemetry::{LogFormat, Telemetry, TelemetryConfig};
