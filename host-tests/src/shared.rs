//! State shared by every VM of one host (Envoy: process-wide): shared data per vm_id with one
//! global CAS counter, shared queues with last-registrant notification, metrics, the clock and
//! the captured log.

use crate::abi::{LogLevel, MetricKind, Status};
use crate::histogram::Histogram;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

/// Locks ignoring poisoning: a panicking test thread must not cascade into unrelated ones.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Time source: the test's virtual clock or the wall clock.
#[derive(Debug, Clone)]
pub enum Clock {
    /// Nanoseconds since an arbitrary epoch, advanced only by the test.
    Virtual(Arc<AtomicU64>),
    Real(std::time::Instant),
}

/// Virtual realtime starts here (2026-01-01T00:00:00Z) so plugins see a plausible date.
const VIRTUAL_EPOCH_NS: u64 = 1_767_225_600 * 1_000_000_000;

impl Clock {
    pub fn virtual_clock() -> Self {
        Self::Virtual(Arc::new(AtomicU64::new(0)))
    }

    pub fn real() -> Self {
        Self::Real(std::time::Instant::now())
    }

    /// Monotonic nanoseconds (the timer and callout-deadline base).
    pub fn monotonic_ns(&self) -> u64 {
        match self {
            Self::Virtual(ns) => ns.load(Ordering::SeqCst),
            Self::Real(start) => start.elapsed().as_nanos() as u64,
        }
    }

    pub fn realtime_ns(&self) -> u64 {
        match self {
            Self::Virtual(ns) => VIRTUAL_EPOCH_NS + ns.load(Ordering::SeqCst),
            Self::Real(_) => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
        }
    }
}

/// One VM's timer, as [`SharedState::ticked_since`] sees it.
#[derive(Debug, Default, Clone, Copy)]
struct Timer {
    /// A tick period is set.
    armed: bool,
    /// When the root last returned from `proxy_on_tick` (monotonic ns).
    last_tick_ns: Option<u64>,
}

/// The worker index of a configuration canary VM (booted and discarded at startup).
pub const CANARY_WORKER: usize = usize::MAX;

/// The worker index of a VM on the main thread (a singleton `envoy.bootstrap.wasm` service).
pub const MAIN_THREAD: usize = usize::MAX - 1;

/// One captured `proxy_log` / WASI stdout-stderr line, or a message of the host about a VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub level: LogLevel,
    /// Worker index of the VM that logged.
    pub worker: usize,
    /// What the plugin (or the host) said.
    pub message: String,
    /// For plugin lines, Envoy's context log prefix: `" <name> <root_id> <vm_id>"` from a
    /// stream context, `" <root_id> <vm_id>"` from the root (empty parts left out); `None`
    /// for the host's own messages (traps, reloads).
    pub prefix: Option<String>,
}

impl LogRecord {
    /// The line as Envoy's `wasm` logger prints it: `wasm log<prefix>: <message>` for plugin
    /// lines (envoy `source/extensions/common/wasm/context.cc`, `Context::log`), the bare
    /// message for the host's own.
    pub fn envoy_line(&self) -> String {
        match &self.prefix {
            Some(prefix) => format!("wasm log{prefix}: {}", self.message),
            None => self.message.clone(),
        }
    }
}

/// spdlog's level names, as Envoy prints them.
fn level_name(level: LogLevel) -> &'static str {
    match level {
        LogLevel::Trace => "trace",
        LogLevel::Debug => "debug",
        LogLevel::Info => "info",
        LogLevel::Warn => "warning",
        LogLevel::Error => "error",
        LogLevel::Critical => "critical",
    }
}

/// `YYYY-MM-DD HH:MM:SS.mmm` (UTC) for a Unix time in milliseconds, as Envoy's default log
/// format `[%Y-%m-%d %T.%e]` prints it.
fn format_timestamp(unix_ms: u64) -> String {
    let (days, ms_of_day) = (unix_ms / 86_400_000, unix_ms % 86_400_000);
    // Howard Hinnant's days-to-civil algorithm.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let secs = ms_of_day / 1000;
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:03}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        ms_of_day % 1000
    )
}

/// A metric as Envoy aggregates it across workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    pub kind: MetricKind,
    /// Counter/gauge value.
    pub value: i64,
    /// A histogram's values, binned as Envoy bins them.
    pub histogram: Histogram,
}

/// A `proxy_on_queue_ready` posted to a VM's event loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueueReady {
    pub root_context_id: u32,
    pub token: u32,
}

/// Where a VM's posted events go; its worker drains it between exports.
#[derive(Debug, Default)]
pub(crate) struct Mailbox {
    posted: Mutex<VecDeque<QueueReady>>,
    /// Wakes a live worker whose event loop is idle.
    pub(crate) wake: tokio::sync::Notify,
}

impl Mailbox {
    pub(crate) fn take(&self) -> Vec<QueueReady> {
        lock(&self.posted).drain(..).collect()
    }

    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.posted).is_empty()
    }
}

struct Queue {
    items: VecDeque<Vec<u8>>,
    registrant: Option<(Arc<Mailbox>, u32)>,
}

#[derive(Default)]
struct Queues {
    tokens: HashMap<(String, Vec<u8>), u32>,
    queues: HashMap<u32, Queue>,
    next_token: u32,
}

/// key → (value, cas) for one vm_id.
type Entries = HashMap<Vec<u8>, (Vec<u8>, u32)>;

#[derive(Default)]
struct SharedData {
    by_vm_id: HashMap<String, Entries>,
    next_cas: u32,
}

/// Everything the VMs of one host share. Cheap to clone behind an `Arc`.
pub struct SharedState {
    data: Mutex<SharedData>,
    queues: Mutex<Queues>,
    metrics: Mutex<BTreeMap<String, Metric>>,
    /// Requests in flight per cluster (the circuit breakers' `max_requests`).
    cluster_requests: Mutex<HashMap<String, u32>>,
    logs: Mutex<VecDeque<LogRecord>>,
    /// Each VM's timer, by plugin name and worker: what a test waits on to read what a plugin
    /// hands over on its tick (batched counters).
    timers: Mutex<BTreeMap<(String, usize), Timer>>,
    /// The newest access-log lines of configured access logs (as many as plugin log lines).
    access_log: Mutex<VecDeque<String>>,
    /// Only the newest lines are kept (a long-running gateway must not grow without bound).
    log_capacity: usize,
    /// Lines at or above this level are also printed to stderr (Envoy's default: info).
    print_level: Option<LogLevel>,
    pub(crate) clock: Clock,
}

impl SharedState {
    /// `print_level`: also print lines at or above it to stderr; `log_capacity`: how many of
    /// the newest lines to keep for [`logs`](Self::logs) (0 keeps none).
    pub fn new(clock: Clock, print_level: Option<LogLevel>, log_capacity: usize) -> Self {
        Self {
            data: Mutex::default(),
            queues: Mutex::default(),
            metrics: Mutex::default(),
            cluster_requests: Mutex::default(),
            logs: Mutex::default(),
            timers: Mutex::default(),
            access_log: Mutex::default(),
            log_capacity,
            print_level,
            clock,
        }
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    // ---- shared data (HOST shared_data.cc) ----

    pub fn get_shared_data(&self, vm_id: &str, key: &[u8]) -> Option<(Vec<u8>, u32)> {
        lock(&self.data)
            .by_vm_id
            .get(vm_id)
            .and_then(|m| m.get(key))
            .cloned()
    }

    /// `cas == 0` writes unconditionally; a missing key is inserted whatever `cas` says.
    pub fn set_shared_data(&self, vm_id: &str, key: &[u8], value: &[u8], cas: u32) -> Status {
        let mut data = lock(&self.data);
        let current = data
            .by_vm_id
            .get(vm_id)
            .and_then(|m| m.get(key))
            .map(|e| e.1);
        if current.is_some_and(|current| cas != 0 && current != cas) {
            return Status::CasMismatch;
        }
        // The counter moves only on successful writes, skipping 0 on wrap.
        data.next_cas = match data.next_cas.wrapping_add(1) {
            0 => 1,
            next => next,
        };
        let fresh = data.next_cas;
        data.by_vm_id
            .entry(vm_id.to_owned())
            .or_default()
            .insert(key.to_vec(), (value.to_vec(), fresh));
        Status::Ok
    }

    /// Every key of one vm_id (for test assertions and the demo).
    pub fn shared_data_keys(&self, vm_id: &str) -> Vec<Vec<u8>> {
        let data = lock(&self.data);
        let mut keys: Vec<Vec<u8>> = data
            .by_vm_id
            .get(vm_id)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    }

    // ---- shared queues (HOST shared_queue.cc) ----

    pub(crate) fn register_queue(
        &self,
        vm_id: &str,
        name: &[u8],
        mailbox: &Arc<Mailbox>,
        root: u32,
    ) -> u32 {
        let mut queues = lock(&self.queues);
        let key = (vm_id.to_owned(), name.to_vec());
        let token = match queues.tokens.get(&key) {
            Some(token) => *token,
            None => {
                queues.next_token += 1;
                let token = queues.next_token;
                queues.tokens.insert(key, token);
                queues.queues.insert(
                    token,
                    Queue {
                        items: VecDeque::new(),
                        registrant: None,
                    },
                );
                token
            }
        };
        if let Some(queue) = queues.queues.get_mut(&token) {
            queue.registrant = Some((Arc::clone(mailbox), root));
        }
        token
    }

    pub(crate) fn resolve_queue(&self, vm_id: &str, name: &[u8]) -> Option<u32> {
        lock(&self.queues)
            .tokens
            .get(&(vm_id.to_owned(), name.to_vec()))
            .copied()
    }

    /// Appends and posts one `on_queue_ready` to the registrant (never inline).
    pub(crate) fn enqueue(&self, token: u32, data: &[u8]) -> Status {
        let mut queues = lock(&self.queues);
        let Some(queue) = queues.queues.get_mut(&token) else {
            return Status::NotFound;
        };
        queue.items.push_back(data.to_vec());
        if let Some((mailbox, root)) = &queue.registrant {
            lock(&mailbox.posted).push_back(QueueReady {
                root_context_id: *root,
                token,
            });
            mailbox.wake.notify_one();
        }
        Status::Ok
    }

    pub(crate) fn dequeue(&self, token: u32) -> Result<Vec<u8>, Status> {
        let mut queues = lock(&self.queues);
        let queue = queues.queues.get_mut(&token).ok_or(Status::NotFound)?;
        queue.items.pop_front().ok_or(Status::Empty)
    }

    // ---- metrics (ENVOY defineMetric & co; values aggregate across VMs) ----

    pub(crate) fn define_metric(&self, kind: MetricKind, name: &str) {
        lock(&self.metrics)
            .entry(name.to_owned())
            .or_insert(Metric {
                kind,
                value: 0,
                histogram: Histogram::default(),
            });
    }

    pub(crate) fn increment_metric(&self, name: &str, delta: i64) -> Status {
        let mut metrics = lock(&self.metrics);
        let Some(metric) = metrics.get_mut(name) else {
            return Status::NotFound;
        };
        match metric.kind {
            MetricKind::Counter if delta > 0 => metric.value = metric.value.saturating_add(delta),
            MetricKind::Gauge => metric.value = metric.value.saturating_add(delta),
            MetricKind::Counter | MetricKind::Histogram => return Status::BadArgument,
        }
        Status::Ok
    }

    pub(crate) fn record_metric(&self, name: &str, value: u64) -> Status {
        let mut metrics = lock(&self.metrics);
        let Some(metric) = metrics.get_mut(name) else {
            return Status::NotFound;
        };
        let as_i64 = i64::try_from(value).unwrap_or(i64::MAX);
        match metric.kind {
            MetricKind::Counter => metric.value = metric.value.saturating_add(as_i64),
            MetricKind::Gauge => metric.value = as_i64,
            MetricKind::Histogram => metric.histogram.record(value),
        }
        Status::Ok
    }

    pub(crate) fn metric_value(&self, name: &str) -> Result<i64, Status> {
        let metrics = lock(&self.metrics);
        let metric = metrics.get(name).ok_or(Status::NotFound)?;
        match metric.kind {
            MetricKind::Histogram => Err(Status::BadArgument),
            _ => Ok(metric.value),
        }
    }

    /// A snapshot of every metric, by name (without Envoy's internal `wasmcustom.` prefix).
    pub fn metrics(&self) -> BTreeMap<String, Metric> {
        lock(&self.metrics).clone()
    }

    // ---- timers ----

    /// Notes whether the root of plugin `plugin` on `worker` has a tick period set.
    pub(crate) fn note_tick_period(&self, plugin: &str, worker: usize, armed: bool) {
        let mut timers = lock(&self.timers);
        timers.entry((plugin.to_owned(), worker)).or_default().armed = armed;
    }

    /// Notes that the root of plugin `plugin` on `worker` returned from `proxy_on_tick` now.
    pub(crate) fn note_tick(&self, plugin: &str, worker: usize) {
        let now = self.clock.monotonic_ns();
        let mut timers = lock(&self.timers);
        timers
            .entry((plugin.to_owned(), worker))
            .or_default()
            .last_tick_ns = Some(now);
    }

    /// Whether the root of plugin `plugin` on `worker` has run a tick that ended at or after
    /// `since_ns` (monotonic), or has no tick to run.
    pub fn ticked_since(&self, plugin: &str, worker: usize, since_ns: u64) -> bool {
        lock(&self.timers)
            .get(&(plugin.to_owned(), worker))
            .is_none_or(|t| !t.armed || t.last_tick_ns.is_some_and(|at| at >= since_ns))
    }

    // ---- circuit breakers ----

    /// Counts one more request to `cluster` unless `max` are already in flight.
    pub(crate) fn try_start_request(&self, cluster: &str, max: u32) -> bool {
        let mut active = lock(&self.cluster_requests);
        let count = active.entry(cluster.to_owned()).or_default();
        if *count >= max {
            return false;
        }
        *count += 1;
        true
    }

    pub(crate) fn end_request(&self, cluster: &str) {
        if let Some(count) = lock(&self.cluster_requests).get_mut(cluster) {
            *count = count.saturating_sub(1);
        }
    }

    /// Requests in flight to `cluster` (routed requests and callouts).
    pub fn cluster_requests(&self, cluster: &str) -> u32 {
        lock(&self.cluster_requests)
            .get(cluster)
            .copied()
            .unwrap_or(0)
    }

    // ---- logs ----

    pub(crate) fn log(&self, record: LogRecord) {
        if self.print_level.is_some_and(|min| record.level >= min) {
            // Envoy's default format `[%Y-%m-%d %T.%e][%t][%l][%n] %v`, with the worker in the
            // thread slot.
            let worker = match record.worker {
                CANARY_WORKER => "canary".to_owned(),
                MAIN_THREAD => "main".to_owned(),
                n => format!("worker {n}"),
            };
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            eprintln!(
                "[{}][{worker}][{}][wasm] {}",
                format_timestamp(now_ms),
                level_name(record.level),
                record.envoy_line()
            );
        }
        if self.log_capacity == 0 {
            return;
        }
        let mut logs = lock(&self.logs);
        if logs.len() >= self.log_capacity {
            logs.pop_front();
        }
        logs.push_back(record);
    }

    /// Every line logged so far by any VM of this host.
    pub fn logs(&self) -> Vec<LogRecord> {
        lock(&self.logs).iter().cloned().collect()
    }

    /// Keeps a configured access log's line (the gateway also prints it on stdout).
    pub(crate) fn access_log_line(&self, line: &str) {
        if self.log_capacity == 0 {
            return;
        }
        let mut lines = lock(&self.access_log);
        if lines.len() >= self.log_capacity {
            lines.pop_front();
        }
        lines.push_back(line.to_owned());
    }

    /// The newest lines the configured access logs printed, oldest first.
    pub fn access_log(&self) -> Vec<String> {
        lock(&self.access_log).iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_print_as_envoys_default_log_format() {
        assert_eq!(format_timestamp(0), "1970-01-01 00:00:00.000");
        assert_eq!(format_timestamp(951_782_400_123), "2000-02-29 00:00:00.123");
        assert_eq!(
            format_timestamp(1_764_575_264_007),
            "2025-12-01 07:47:44.007"
        );
    }

    fn state() -> SharedState {
        SharedState::new(Clock::virtual_clock(), None, 16)
    }

    #[test]
    fn cas_zero_is_unconditional_and_missing_keys_insert_whatever_the_cas() {
        let s = state();
        assert_eq!(s.set_shared_data("vm", b"k", b"a", 77), Status::Ok);
        let (_, cas) = s.get_shared_data("vm", b"k").unwrap_or_default();
        assert_eq!(
            s.set_shared_data("vm", b"k", b"b", cas + 1),
            Status::CasMismatch
        );
        assert_eq!(s.set_shared_data("vm", b"k", b"c", 0), Status::Ok);
        assert_eq!(
            s.set_shared_data("vm", b"k", b"d", cas),
            Status::CasMismatch
        );
        assert_eq!(s.get_shared_data("other", b"k"), None);
    }

    #[test]
    fn counters_reject_non_positive_increments_and_histograms_have_no_value() {
        let s = state();
        s.define_metric(MetricKind::Counter, "c");
        s.define_metric(MetricKind::Histogram, "h");
        assert_eq!(s.increment_metric("c", 0), Status::BadArgument);
        assert_eq!(s.increment_metric("c", 2), Status::Ok);
        assert_eq!(s.record_metric("c", 3), Status::Ok);
        assert_eq!(s.metric_value("c"), Ok(5));
        assert_eq!(s.metric_value("h"), Err(Status::BadArgument));
        assert_eq!(s.increment_metric("nope", 1), Status::NotFound);
    }

    /// A live gateway records a histogram value per request for as long as it runs: what it
    /// keeps must not grow with them. The metric's printed form stands for what it holds.
    #[test]
    fn a_histogram_holds_as_much_after_a_hundred_thousand_values_as_after_a_thousand() {
        let s = state();
        s.define_metric(MetricKind::Histogram, "h");
        let record_a_thousand = || {
            for value in 0..1_000 {
                assert_eq!(s.record_metric("h", value * 37), Status::Ok);
            }
        };
        record_a_thousand();
        let held = |s: &SharedState| format!("{:?}", s.metrics()["h"]).len();
        let after_a_thousand = held(&s);
        for _ in 0..99 {
            record_a_thousand();
        }
        // The counts' digits may grow; the values themselves are not kept.
        assert!(
            held(&s) < after_a_thousand + 1_000,
            "{} bytes printed after 100,000 values against {after_a_thousand} after 1,000",
            held(&s)
        );
    }
}
