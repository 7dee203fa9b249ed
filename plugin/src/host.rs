//! `idemgate-core`'s ports over the raw `proxy_wasm::hostcalls`, used only where Envoy
//! answers with statuses the SDK maps (anything else would make the SDK panic): request
//! headers are read only at request headers or while the request is paused, callout answers
//! only through the pairs getter (`:status` of a failed callout is BadArgument).

use std::cell::OnceCell;
use std::time::Duration;

use idemgate_core::metrics::{Counter, Decision, Histogram, Noted, stat_segment};
use idemgate_core::pairs::Pairs;
use idemgate_core::{
    Answer, Config, Header, HostError, Reply, RequestView, SharedStore, Telemetry,
};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};

/// The host's clock (ms since the Unix epoch; 0 if the host would not say). Read through the
/// ABI directly: the SDK's getter builds a `SystemTime` to be taken apart again (~250
/// instructions of every matched request), and panics on a status but Ok.
pub(crate) fn now_ms() -> u64 {
    let mut ns: u64 = 0;
    // SAFETY: the host writes one u64 into the local, which outlives the call.
    let status = unsafe { proxy_get_current_time_nanoseconds(&mut ns) };
    if status == 0 { ns / 1_000_000 } else { 0 }
}

pub(crate) fn set_tick_ms(ms: u64) {
    if hostcalls::set_tick_period(Duration::from_millis(ms)).is_err() {
        log::error!("idemgate: could not set the tick period");
    }
}

/// This VM's wake-up queue, named after its VM number: Envoy notifies only the last VM that
/// registered a name, so every worker needs its own.
pub(crate) fn register_wake_queue(vm_number: u32) -> Option<u32> {
    match hostcalls::register_shared_queue(&format!("idemgate.v1.wake.{vm_number}")) {
        Ok(queue) => Some(queue),
        Err(status) => {
            log::warn!("idemgate: no wake-up queue ({status:?}): callouts wait for a 1 ms tick");
            None
        }
    }
}

/// Asks Envoy to run the root's `on_queue_ready`; false if it refused.
pub(crate) fn wake(queue: u32) -> bool {
    hostcalls::enqueue_shared_queue(queue, Some(b"w")).is_ok()
}

/// Empties the wake-up queue: one item per wake-up, and kicks are batched, so a handful.
pub(crate) fn drain_wake_queue(queue: u32) {
    for _ in 0..64 {
        if !matches!(hostcalls::dequeue_shared_queue(queue), Ok(Some(_))) {
            return;
        }
    }
}

/// The request headers of the current (or effective) stream, for one callback. A single
/// value is one host read; once a question needs the whole map (a repeated key or scope
/// header), the map is read once and every later header is answered from that copy.
#[derive(Default)]
pub(crate) struct RequestHeaders {
    /// The serialized map (`proxy_get_header_map_pairs`), read at most once.
    all: OnceCell<Vec<u8>>,
}

impl RequestHeaders {
    /// The whole map, read now if it was not yet; `None` if the host would not give it (later
    /// headers are then read one by one, never taken for absent).
    fn all(&self) -> Option<&[u8]> {
        if self.all.get().is_none()
            && let Some(all) = header_map_pairs(MapType::HttpRequestHeaders)
        {
            let _ = self.all.set(all);
        }
        self.all.get().map(Vec::as_slice)
    }
}

impl RequestView for RequestHeaders {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        if let Some(all) = self.all.get() {
            return Pairs::first(all, name).map(<[u8]>::to_vec);
        }
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn repeated(&self, names: &[String]) -> bool {
        self.all()
            .is_some_and(|all| Pairs::any_repeated(all, names))
    }

    fn property(&self, path: &[String]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.iter().map(String::as_str).collect())
            .ok()
            .flatten()
    }
}

pub(crate) fn response_headers() -> Vec<(String, Vec<u8>)> {
    hostcalls::get_map_bytes(MapType::HttpResponseHeaders).unwrap_or_default()
}

pub(crate) fn response_trailers() -> Vec<(String, Vec<u8>)> {
    hostcalls::get_map_bytes(MapType::HttpResponseTrailers).unwrap_or_default()
}

pub(crate) fn body(buffer: BufferType, size: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(buffer, 0, size).ok().flatten()
}

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    /// The ABI's clock (see [`now_ms`]).
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;

    /// Called directly for its `grpc_status` argument (and the response code details).
    fn proxy_send_local_response(
        status_code: u32,
        details_data: *const u8,
        details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;

    /// The ABI's read of a whole map, serialized (see `idemgate_core::pairs`): called
    /// directly because the SDK's wrapper decodes it into one allocation per name and value.
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;

    /// The ABI's remove: no value crosses into the VM, so nothing is allocated there. Called
    /// directly because the SDK's wrapper panics on any status but Ok.
    fn proxy_remove_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
    ) -> u32;
}

/// A whole header map, serialized; `None` when the map is not available now.
fn header_map_pairs(map: MapType) -> Option<Vec<u8>> {
    let mut data: *mut u8 = core::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a pointer and a length into the two locals. A non-null
    // pointer is a buffer of exactly `size` bytes that the host obtained from this module's
    // `proxy_on_memory_allocate` (the SDK's: a `Vec<u8>` of capacity `size`, forgotten), so
    // it is owned here and rebuilt as that `Vec` — what the SDK's own getters do.
    unsafe {
        if proxy_get_header_map_pairs(map, &mut data, &mut size) != 0 {
            return None;
        }
        if data.is_null() {
            return Some(Vec::new());
        }
        Some(Vec::from_raw_parts(data, size, size))
    }
}

/// Removes every value of request header `name` (lower case). A missing header is Ok; a
/// failure (the map is not available) leaves nothing to remove from.
pub(crate) fn remove_request_header(name: &str) {
    // SAFETY: the pointer and length describe `name`, which outlives the call; the host only
    // reads them.
    let _ = unsafe {
        proxy_remove_header_map_value(MapType::HttpRequestHeaders, name.as_ptr(), name.len())
    };
}

pub(crate) fn set_request_headers(headers: &[(String, String)]) {
    for (name, value) in headers {
        if hostcalls::set_map_value_bytes(MapType::HttpRequestHeaders, name, Some(value.as_bytes()))
            .is_err()
        {
            log::warn!("idemgate: could not set request header {name}");
        }
    }
}

pub(crate) fn add_response_headers(headers: &[(String, String)]) {
    for (name, value) in headers {
        if hostcalls::add_map_value_bytes(MapType::HttpResponseHeaders, name, value.as_bytes())
            .is_err()
        {
            log::warn!("idemgate: could not add response header {name}");
        }
    }
}

/// Sends a local reply; a gRPC status goes in `proxy_send_local_response`'s `grpc_status`
/// argument, which the SDK's `send_http_response` leaves at -1 (Envoy then derives the
/// status from the HTTP one: `Context::sendLocalResponse`,
/// source/extensions/common/wasm/context.cc).
pub(crate) fn send_reply(reply: &Reply) {
    let headers = serialize_pairs(&reply.headers);
    let grpc_status = reply.grpc_status.map_or(-1, i32::from);
    // SAFETY: every pointer and length describes a live buffer the host only reads.
    let status = unsafe {
        proxy_send_local_response(
            u32::from(reply.status),
            reply.details.as_ptr(),
            reply.details.len(),
            reply.body.as_ptr(),
            reply.body.len(),
            headers.as_ptr(),
            headers.len(),
            grpc_status,
        )
    };
    if status != 0 {
        log::error!("idemgate: could not send a local reply");
    }
}

/// The ABI's header map: the count, each name's and value's length, then each name and value
/// NUL-terminated (all lengths little-endian u32).
fn serialize_pairs(pairs: &[Header]) -> Vec<u8> {
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    // Sized once: grown byte by byte it reallocated five or six times per local reply.
    let text: usize = pairs.iter().map(|(n, v)| n.len() + v.len() + 10).sum();
    let mut out = Vec::with_capacity(4 + text);
    out.extend_from_slice(&len(pairs.len()));
    for (name, value) in pairs {
        out.extend_from_slice(&len(name.len()));
        out.extend_from_slice(&len(value.len()));
    }
    for (name, value) in pairs {
        for part in [name, value] {
            out.extend_from_slice(part.as_bytes());
            out.push(0);
        }
    }
    out
}

/// The answer of the callout being delivered (valid only inside `on_http_call_response`).
pub(crate) fn callout_answer(num_headers: usize, body_size: usize) -> (u16, Vec<u8>) {
    if num_headers == 0 {
        return (0, Vec::new());
    }
    let status = hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders)
        .unwrap_or_default()
        .into_iter()
        .find(|(name, _)| name == ":status")
        .and_then(|(_, v)| {
            std::str::from_utf8(&v)
                .ok()
                .and_then(|s| s.parse::<u16>().ok())
        })
        .unwrap_or(0);
    let body = if body_size == 0 {
        Vec::new()
    } else {
        body(BufferType::HttpCallResponseBody, body_size).unwrap_or_default()
    };
    (status, body)
}

pub(crate) fn as_answer(status: u16, body: &[u8]) -> Answer<'_> {
    if status == 0 {
        Answer::Failed
    } else {
        Answer::Http { status, body }
    }
}

/// Envoy shared data (`vm_id` namespace).
pub(crate) struct SharedData;

impl SharedStore for SharedData {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        match hostcalls::get_shared_data(key) {
            Ok((value, Some(cas))) => Ok(Some((value.unwrap_or_default(), cas))),
            Ok((_, None)) => Ok(None),
            Err(_) => Err(HostError),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, HostError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(true),
            Err(Status::CasMismatch) => Ok(false),
            Err(_) => Err(HostError),
        }
    }
}

/// A counter's metric id (0 = its definition failed) and the increments this worker has not
/// handed to the host yet.
#[derive(Clone, Copy)]
struct Tally {
    id: u32,
    pending: u64,
}

/// Where one rule's counters are in [`Metrics::counters`], and its histograms' ids.
struct RuleMetrics {
    /// `idemgate.rule.<rule>.<decision>` in `Decision::ALL` order, then
    /// `idemgate.rule.<rule>.would_block` (shadow decisions that would have blocked).
    first: usize,
    /// `idemgate.rate.rule.<rule>.allowed`, then `.limited`, if the rule has rate limits.
    rate: Option<usize>,
    /// `idemgate.rule.<rule>.wait_ms|sidecar_latency_ms`, in `Histogram::ALL` order.
    histograms: Vec<u32>,
}

/// This VM's metrics (defined in `on_configure`; Envoy aggregates them by name over workers).
///
/// Counters are batched: an increment adds to this worker's tally, and the root hands every
/// tally that moved to the host on its tick ([`Metrics::flush`]) and when the plugin is done.
/// A host call per increment was ~800 instructions, three of them on a blocked duplicate; the
/// price is that Envoy's counters lag by up to one tick (`tick`, 1 s by default). Histograms
/// keep one host call per sample: only requests that waited or went to the sidecar record
/// them, and those cost far more than the call.
#[derive(Default)]
pub(crate) struct Metrics {
    /// `Counter::ALL` in order, then every rule's (see [`RuleMetrics`]).
    counters: Vec<Tally>,
    histograms: Vec<u32>,
    rules: Vec<RuleMetrics>,
    /// The rule of the request a step is deciding on (set before the step).
    pub(crate) rule: usize,
    /// What that step reported, for the request's filter state.
    pub(crate) noted: Noted,
}

impl Metrics {
    pub(crate) fn define(config: &Config) -> Metrics {
        let define = |kind, name: &str| hostcalls::define_metric(kind, name).unwrap_or(0);
        let mut counters: Vec<Tally> = Counter::ALL
            .iter()
            .map(|c| Tally {
                id: define(MetricType::Counter, c.name()),
                pending: 0,
            })
            .collect();
        // Defines a counter at the end of `counters`; returns its place there.
        let counter = |counters: &mut Vec<Tally>, name: String| {
            counters.push(Tally {
                id: define(MetricType::Counter, &name),
                pending: 0,
            });
            counters.len() - 1
        };
        let mut rules = Vec::with_capacity(config.rules.len());
        for rule in &config.rules {
            let name = stat_segment(&rule.name);
            let first = counters.len();
            for decision in Decision::ALL {
                let what = decision.name();
                counter(&mut counters, format!("idemgate.rule.{name}.{what}"));
            }
            counter(&mut counters, format!("idemgate.rule.{name}.would_block"));
            let rate = rule.rate.is_some().then(|| {
                let allowed = counter(&mut counters, format!("idemgate.rate.rule.{name}.allowed"));
                counter(&mut counters, format!("idemgate.rate.rule.{name}.limited"));
                allowed
            });
            let histograms = Histogram::ALL
                .iter()
                .map(|h| {
                    let what = h.per_rule();
                    define(
                        MetricType::Histogram,
                        &format!("idemgate.rule.{name}.{what}"),
                    )
                })
                .collect();
            rules.push(RuleMetrics {
                first,
                rate,
                histograms,
            });
        }
        Metrics {
            counters,
            histograms: Histogram::ALL
                .iter()
                .map(|h| define(MetricType::Histogram, h.name()))
                .collect(),
            rules,
            rule: 0,
            noted: Noted::default(),
        }
    }

    /// Adds `n` to `counter`'s tally (handed to the host on the next [`Metrics::flush`]).
    pub(crate) fn add(&mut self, counter: Counter, n: u64) {
        self.tally(counter.index(), n);
    }

    fn tally(&mut self, at: usize, n: u64) {
        if let Some(tally) = self.counters.get_mut(at) {
            tally.pending = tally.pending.wrapping_add(n);
        }
    }

    /// Hands every counter's pending increments to the host, one call per counter that moved.
    pub(crate) fn flush(&mut self) {
        for tally in &mut self.counters {
            if tally.pending == 0 {
                continue;
            }
            if tally.id != 0 {
                let n = i64::try_from(tally.pending).unwrap_or(i64::MAX);
                let _ = hostcalls::increment_metric(tally.id, n);
            }
            tally.pending = 0;
        }
    }
}

/// Records a value in a defined histogram (0 = its definition failed).
fn record(id: Option<&u32>, value: u64) {
    if let Some(&id) = id
        && id != 0
    {
        let _ = hostcalls::record_metric(id, value);
    }
}

impl Telemetry for Metrics {
    fn count(&mut self, counter: Counter) {
        self.add(counter, 1);
        self.noted.count(counter);
        let Some(first) = self.rules.get(self.rule).map(|r| r.first) else {
            return;
        };
        if let Some(decision) = counter.decision() {
            self.tally(first + decision.index(), 1);
        }
        if counter == Counter::ShadowWouldBlock {
            self.tally(first + Decision::ALL.len(), 1);
        }
    }

    fn count_rate(&mut self, rule: usize, limited: bool) {
        if let Some(allowed) = self.rules.get(rule).and_then(|r| r.rate) {
            self.tally(allowed + usize::from(limited), 1);
        }
    }

    fn record(&mut self, histogram: Histogram, value: u64) {
        self.noted.record(histogram, value);
        let at = Histogram::ALL.iter().position(|h| *h == histogram);
        record(at.and_then(|at| self.histograms.get(at)), value);
        record(
            at.and_then(|at| self.rules.get(self.rule).and_then(|r| r.histograms.get(at))),
            value,
        );
    }
}

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    /// The ABI's set_property, called directly: the SDK's wrapper panics on any status but Ok
    /// (Envoy answers NotFound where a context has no stream).
    fn proxy_set_property(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
}

/// Puts a request's decision into its filter state, where Envoy keeps it as
/// `wasm.<name>` (`source/extensions/common/wasm/context.cc`, `Context::setProperty`) and the
/// access log prints it: `%FILTER_STATE(wasm.idemgate.decision:PLAIN)%`. Only a step that
/// decided writes; the stream must be the current (or effective) context.
pub(crate) fn set_filter_state(noted: Noted, rule: &str, fence: Option<u64>) {
    let Some(decision) = noted.decision else {
        return;
    };
    let set = |name: &str, value: &str| {
        // SAFETY: both pointers and lengths describe live strings; the host only reads them.
        let _ =
            unsafe { proxy_set_property(name.as_ptr(), name.len(), value.as_ptr(), value.len()) };
    };
    set("idemgate.rule", rule);
    set("idemgate.decision", decision.name());
    if let Some(reason) = noted.would_block {
        set("idemgate.would_block", reason.name());
    }
    if let Some(fence) = fence {
        set("idemgate.fence", &fence.to_string());
    }
    if let Some(wait_ms) = noted.wait_ms {
        set("idemgate.wait_ms", &wait_ms.to_string());
    }
}
