//! The `idemgate` operator tool's parts, shared by the binary and its tests.
//!
//! | module | owns |
//! |---|---|
//! | [`extract`] | finding filter configurations in raw JSON, Envoy, Istio, Envoy Gateway and multi-document YAML files, and checking them with the filter's parser |
//! | [`keys`] | the stored key of a call (the filter's own derivation) |
//! | [`admin`] | the sidecar's admin API |

pub mod admin;
pub mod extract;
pub mod keys;

/// The JSON Schema of the filter configuration, for editors (`idemgate schema`).
pub const CONFIG_SCHEMA: &str = include_str!("../config.schema.json");
