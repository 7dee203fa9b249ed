//! The host ports: everything the decisions read from or report to Envoy, as traits the glue
//! (`idemgate-plugin`) implements over the proxy-wasm ABI and tests implement in memory
//! (`testing`). Nothing in the crate calls the host any other way.

use alloc::string::String;
use alloc::vec::Vec;

use crate::breaker::Breaker;
use crate::metrics::{Counter, Histogram};

/// The request as the filter sees it at request headers. The glue implements it over
/// `proxy_get_header_map_value` (bytes, never the panicking `String` getters), and over one
/// `proxy_get_header_map_pairs` read (see [`crate::pairs`]) once a question needs the whole map.
pub trait RequestView {
    /// The first value of a request header (lower-case name, pseudo-headers included).
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// An Envoy property (`["connection", "uri_san_peer_certificate"]`).
    fn property(&self, path: &[String]) -> Option<Vec<u8>>;
    /// Whether any of these request headers (lower-case names) has more than one value.
    /// [`RequestView::header`] sees only the first, as Envoy's getter returns it.
    fn repeated(&self, names: &[String]) -> bool;
}

/// A host call on shared data failed in a way Envoy should never produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostError;

/// Envoy shared data as the ABI offers it (the glue maps `proxy_*_shared_data`).
pub trait SharedStore {
    /// `None` when the key was never written; an empty value reads as `Some((vec![], cas))`.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError>;
    /// `cas == None` writes unconditionally; `Ok(false)` is a CAS mismatch.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, HostError>;
}

/// Where decisions are counted; the glue maps it onto the proxy-wasm metrics ABI.
pub trait Telemetry {
    fn count(&mut self, counter: Counter);
    fn record(&mut self, histogram: Histogram, value: u64);
    /// A final rate decision for rule `rule` (`idemgate.rate.<rule>.allowed|limited`).
    fn count_rate(&mut self, rule: usize, limited: bool);
}

/// What the host offers a step: the clock, shared data, the VM's breaker and metrics.
pub struct Env<'a> {
    pub now_ms: u64,
    pub shared: &'a dyn SharedStore,
    pub breaker: &'a mut Breaker,
    pub telemetry: &'a mut dyn Telemetry,
    /// Unique per request on this gateway (VM nonce and sequence): the local-tier owner.
    pub owner: u64,
    /// This VM's random secret (read once from the host's randomness) that waiter names are
    /// derived from; `None` when the host had none: queued claims then go unnamed (no leave).
    pub waiter_secret: Option<&'a [u8; 32]>,
    /// This worker's last digests of stored and rate keys (duplicates repeat them).
    pub digests: &'a mut crate::hash::DigestMemo,
}
