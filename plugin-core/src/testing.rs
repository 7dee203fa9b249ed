//! Test doubles for the ports: a request, Envoy-like shared data and a metrics recorder. The
//! crate's unit tests use them, and so does `fuzz/` (through the `testing` feature).

#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "test doubles (built for fuzz/ too, outside cfg(test)): a broken double should fail loudly"
)]

use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::cell::{Cell, RefCell};

use crate::metrics::{Counter, Histogram};
use crate::ports::{HostError, RequestView, SharedStore, Telemetry};

/// A request's headers and properties, counting header reads.
#[derive(Debug, Clone, Default)]
pub struct Req {
    headers: Vec<(String, Vec<u8>)>,
    properties: Vec<(Vec<String>, Vec<u8>)>,
    reads: Cell<usize>,
}

impl Req {
    pub fn new(method: &str, path: &str) -> Req {
        Req::default().with(":method", method).with(":path", path)
    }
    pub fn with(self, name: &str, value: &str) -> Req {
        self.with_bytes(name, value.as_bytes())
    }
    pub fn with_bytes(mut self, name: &str, value: &[u8]) -> Req {
        self.headers.push((name.to_string(), value.to_vec()));
        self
    }
    pub fn with_property(mut self, path: &[&str], value: &str) -> Req {
        self.properties.push((
            path.iter().map(|s| s.to_string()).collect(),
            value.as_bytes().to_vec(),
        ));
        self
    }
    pub fn reads(&self) -> usize {
        self.reads.get()
    }
}

impl RequestView for Req {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.reads.set(self.reads.get() + 1);
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
    fn repeated(&self, names: &[String]) -> bool {
        names
            .iter()
            .any(|name| self.headers.iter().filter(|(n, _)| n == name).count() > 1)
    }
    fn property(&self, path: &[String]) -> Option<Vec<u8>> {
        self.properties
            .iter()
            .find(|(p, _)| p.as_slice() == path)
            .map(|(_, v)| v.clone())
    }
}

/// Shared data with Envoy's semantics: a global CAS counter, `None` = unconditional, a
/// missing key is inserted whatever the CAS. `interfere_once` simulates another worker
/// writing an in-flight entry just before our next conditional write.
#[derive(Default)]
pub struct MemStore {
    map: RefCell<Vec<(String, Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    interference: RefCell<Option<(String, u64)>>,
    raw_interference: RefCell<Option<(String, Vec<u8>)>>,
    pub fail: Cell<bool>,
    /// Reads so far.
    pub gets: Cell<usize>,
}

impl MemStore {
    /// Keys written so far.
    pub fn len(&self) -> usize {
        self.map.borrow().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn interfere_once(&self, key: String, expires_ms: u64) {
        *self.interference.borrow_mut() = Some((key, expires_ms));
    }
    /// Another worker writes `value` under `key` just before our next conditional write.
    pub fn interfere_raw_once(&self, key: String, value: Vec<u8>) {
        *self.raw_interference.borrow_mut() = Some((key, value));
    }
    fn write(&self, key: &str, value: &[u8]) {
        let cas = self.next_cas.get() + 1;
        self.next_cas.set(cas);
        let mut map = self.map.borrow_mut();
        match map.iter_mut().find(|(k, _, _)| k == key) {
            Some(e) => {
                e.1 = value.to_vec();
                e.2 = cas;
            }
            None => map.push((key.to_string(), value.to_vec(), cas)),
        }
    }
}

impl SharedStore for MemStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.gets.set(self.gets.get() + 1);
        if self.fail.get() {
            return Err(HostError);
        }
        Ok(self
            .map
            .borrow()
            .iter()
            .find(|(k, _, _)| k == key)
            .map(|(_, v, c)| (v.clone(), *c)))
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, HostError> {
        if self.fail.get() {
            return Err(HostError);
        }
        if let Some((stored_key, expires)) = self.interference.borrow_mut().take() {
            self.write(
                key,
                &crate::local::in_flight_bytes(&stored_key, 424_242, expires),
            );
        }
        if let Some((other, value)) = self.raw_interference.borrow_mut().take() {
            self.write(&other, &value);
        }
        let current = self
            .map
            .borrow()
            .iter()
            .find(|(k, _, _)| k == key)
            .map(|(_, _, c)| *c);
        if let (Some(want), Some(have)) = (cas, current)
            && want != have
        {
            return Ok(false);
        }
        self.write(key, value);
        Ok(true)
    }
}

/// Every count, sample and rate decision reported, in order.
#[derive(Default, Debug)]
pub struct Recorder {
    pub counts: Vec<Counter>,
    pub samples: Vec<(Histogram, u64)>,
    /// `(rule, limited)` per final rate decision.
    pub rate: Vec<(usize, bool)>,
}

impl Recorder {
    pub fn count_of(&self, c: Counter) -> usize {
        self.counts.iter().filter(|x| **x == c).count()
    }
}

impl Telemetry for Recorder {
    fn count(&mut self, counter: Counter) {
        self.counts.push(counter);
    }
    fn record(&mut self, histogram: Histogram, value: u64) {
        self.samples.push((histogram, value));
    }
    fn count_rate(&mut self, rule: usize, limited: bool) {
        self.rate.push((rule, limited));
    }
}
