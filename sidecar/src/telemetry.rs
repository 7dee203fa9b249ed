//! Logs and traces: the process-wide `tracing` subscriber (text or JSON lines, optionally an
//! OTLP span exporter), and the span of each protocol request, which continues the caller's
//! trace.
//!
//! Every `/v1` request runs inside one span named after its verb (`claim`, `complete`,
//! `abort`, `renew`, `rate`, `leave`; a claim that queues gets a child `wait` span). The span
//! carries the caller's request id (`x-request-id`) and trace id (W3C `traceparent`, or a
//! `b3` header), so every log line written while serving the request carries them too; with
//! `--otlp-endpoint` the spans are exported as children of the caller's span. Keys, tokens
//! and bodies are never span fields: a key appears only as `key_digest`.

use axum::http::HeaderName;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use sha2::{Digest, Sha256};
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// How log lines are written (to standard output).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (`tracing`'s default format).
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `fields` (with `message`), `target`,
    /// and `span` (the request's fields: `request_id`, `trace_id`, ...).
    Json,
}

/// What the process-wide subscriber writes and where spans go.
#[derive(Debug, Clone, Default)]
pub struct TelemetryConfig {
    pub log_format: LogFormat,
    /// Base URL of an OTLP/HTTP collector (`http://collector:4318`); spans are posted to
    /// `<base>/v1/traces` as protobuf. `None`: no export.
    pub otlp_endpoint: Option<String>,
}

/// Why telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot set up the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("a global subscriber is already installed: {0}")]
    Installed(#[from] tracing_subscriber::util::TryInitError),
}

/// Whether spans are exported (set once by [`Telemetry::init`]). Without export, a request's
/// span carries only what log lines need (verb, request id, trace id): every field recorded
/// on a span is formatted by the log layer at once (the JSON formatter re-parses the span's
/// fields on each record), which measured as more than the rest of a request's work.
static EXPORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn exporting() -> bool {
    EXPORTING.load(std::sync::atomic::Ordering::Relaxed)
}

/// The installed telemetry; [`Telemetry::shutdown`] flushes spans not exported yet.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Installs the process-wide subscriber: `RUST_LOG` (default `info`) filters log lines
    /// and spans alike; the OTLP layer is added only when an endpoint is configured.
    ///
    /// # Errors
    /// The endpoint is not a URL, or a subscriber is already installed.
    pub fn init(config: &TelemetryConfig) -> Result<Telemetry, TelemetryError> {
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
        let (text, json) = match config.log_format {
            // Colours only on a terminal: escape codes are noise in a log file, and styling
            // every span's fields measured as a tenth of a request's instructions.
            LogFormat::Text => (
                Some(tracing_subscriber::fmt::layer().with_ansi(stdout_is_terminal())),
                None,
            ),
            LogFormat::Json => (
                None,
                Some(
                    tracing_subscriber::fmt::layer()
                        .json()
                        .with_current_span(true)
                        .with_span_list(false),
                ),
            ),
        };
        let provider = config
            .otlp_endpoint
            .as_deref()
            .map(tracer_provider)
            .transpose()?;
        let otel = provider.as_ref().map(|p| {
            tracing_opentelemetry::layer()
                .with_tracer(p.tracer("idemgate-sidecar"))
                .with_location(false)
                .with_threads(false)
                .with_target(false)
                .with_level(false)
                .with_tracked_inactivity(false)
        });
        tracing_subscriber::registry()
            .with(otel)
            .with(text)
            .with(json)
            .with(filter)
            .try_init()?;
        EXPORTING.store(provider.is_some(), std::sync::atomic::Ordering::Relaxed);
        Ok(Telemetry { provider })
    }

    /// Exports what is still queued (bounded by the exporter's timeout) and stops exporting.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(err) = provider.shutdown()
        {
            tracing::warn!(%err, "flushing the last spans failed");
        }
    }
}

fn stdout_is_terminal() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stdout())
}

/// The OTLP/HTTP path of traces, appended to an endpoint that does not already name it.
const TRACES_PATH: &str = "/v1/traces";

fn traces_url(endpoint: &str) -> String {
    if endpoint.ends_with(TRACES_PATH) {
        endpoint.to_owned()
    } else {
        format!("{}{TRACES_PATH}", endpoint.trim_end_matches('/'))
    }
}

fn tracer_provider(endpoint: &str) -> Result<SdkTracerProvider, TelemetryError> {
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(traces_url(endpoint))
        .build()?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("idemgate-sidecar")
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    // The default sampler follows the caller's sampled flag (parent-based, always on for
    // requests without a caller trace); batches leave on the exporter's own thread.
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// The requests that get a span, by route: the protocol verbs, and `admin` for the admin
/// API (an operator's force release is logged with the operator's request id).
pub(crate) fn verb_of(route: &str) -> Option<&'static str> {
    use idemgate_wire::paths;
    Some(match route {
        paths::CLAIM => "claim",
        paths::COMPLETE => "complete",
        paths::ABORT => "abort",
        paths::LEAVE => "leave",
        paths::RENEW => "renew",
        paths::RATE => "rate",
        admin if admin.starts_with("/admin/") => "admin",
        _ => return None,
    })
}

/// The headers read on every protocol request, as names: a lookup by `&str` parses and
/// lower-cases the name first (~500 instructions each, three per request; callgrind).
static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
static B3: HeaderName = HeaderName::from_static("b3");

/// The longest request id carried into logs and spans; longer ones are dropped.
const MAX_REQUEST_ID: usize = 128;

/// `x-request-id` when it is a plausible id (visible ASCII without quotes or backslashes,
/// at most [`MAX_REQUEST_ID`] bytes), so a hostile value cannot forge log lines.
fn request_id(headers: &axum::http::HeaderMap) -> Option<&str> {
    let value = headers.get(&X_REQUEST_ID)?.to_str().ok()?;
    let plausible = !value.is_empty()
        && value.len() <= MAX_REQUEST_ID
        && value
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\');
    plausible.then_some(value)
}

/// The caller's span: W3C trace context (`traceparent`, `tracestate`) when it is valid, else
/// a single `b3` header.
fn caller_context(headers: &axum::http::HeaderMap) -> Option<opentelemetry::Context> {
    if headers.contains_key(&TRACEPARENT) {
        let cx =
            TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers));
        if cx.span().span_context().is_valid() {
            return Some(cx);
        }
    }
    let b3 = b3_span_context(headers.get(&B3)?.to_str().ok()?)?;
    Some(opentelemetry::Context::new().with_remote_span_context(b3))
}

/// The caller's trace id for logs alone (no span to parent): the trace-id part of a valid
/// `traceparent`, as the W3C propagator would accept it, else a `b3` header's. Cheaper than
/// building a context (a unit test holds it to the propagator's verdicts).
fn caller_trace_id(headers: &axum::http::HeaderMap) -> Option<String> {
    if let Some(id) = headers
        .get(&TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(w3c_trace_id)
    {
        return Some(id.to_owned());
    }
    let b3 = b3_span_context(headers.get(&B3)?.to_str().ok()?)?;
    Some(b3.trace_id().to_string())
}

/// `version-traceid-parentid-flags` (W3C Trace Context §3.2): lowercase hex of 2, 32, 16 and 2
/// digits, version not `ff`, ids not all zeros; a version above 00 may append fields.
fn w3c_trace_id(value: &str) -> Option<&str> {
    let value = value.trim();
    let mut parts = value.split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let zero = |s: &str| s.bytes().all(|b| b == b'0');
    let valid = hex(version, 2)
        && version != "ff"
        && (version != "00" || parts.next().is_none())
        && hex(trace, 32)
        && !zero(trace)
        && hex(parent, 16)
        && !zero(parent)
        && hex(flags, 2);
    valid.then_some(trace)
}

/// The single `b3` header: `{trace id}-{span id}[-{sampling}[-{parent span id}]]`, the trace
/// id 16 or 32 hex digits (B3 propagation, openzipkin/b3-propagation). A sampling-only value
/// (`0`, `1`, `d`) names no span and gives `None`. Parsed here because the only well-kept B3
/// propagator for `opentelemetry` ships inside the Zipkin exporter crate.
fn b3_span_context(value: &str) -> Option<SpanContext> {
    let mut parts = value.trim().split('-');
    let (trace, span) = (parts.next()?, parts.next()?);
    let sampling = parts.next();
    let is_hex = |s: &str, lens: &[usize]| {
        lens.contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
    };
    if !is_hex(trace, &[16, 32]) || !is_hex(span, &[16]) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    let flags = match sampling {
        Some("0") => TraceFlags::default(),
        Some("1" | "d") | None => TraceFlags::SAMPLED,
        Some(_) => return None,
    };
    let context = SpanContext::new(trace_id, span_id, flags, true, TraceState::default());
    context.is_valid().then_some(context)
}

/// The span of one protocol request: named after its verb, with the caller's request id and
/// trace id; when spans are exported, a child of the caller's span. The attributes of
/// [`finish`], [`outcome`] and [`attribute`] are set only on exported spans.
pub(crate) fn request_span(verb: &'static str, headers: &axum::http::HeaderMap) -> Span {
    let request_id = request_id(headers);
    if !exporting() {
        let trace_id = caller_trace_id(headers);
        if request_id.is_none() && trace_id.is_none() {
            // Nothing for log lines to carry: a span would only cost (about a fifth of a
            // request's instructions, measured with callgrind).
            return Span::none();
        }
        return tracing::info_span!(
            "request",
            otel.name = verb,
            request_id,
            trace_id = trace_id.as_deref(),
        );
    }
    let caller = caller_context(headers);
    let trace_id = caller
        .as_ref()
        .map(|cx| cx.span().span_context().trace_id().to_string());
    let span = tracing::info_span!(
        "request",
        otel.name = verb,
        otel.kind = "server",
        otel.status_code = Empty,
        request_id,
        trace_id = Empty,
    );
    let trace_id = match caller {
        Some(cx) => {
            let _ = span.set_parent(cx);
            trace_id
        }
        // A request without a caller trace starts one.
        None => Some(span.context().span().span_context().trace_id())
            .filter(|id| *id != TraceId::INVALID)
            .map(|id| id.to_string()),
    };
    if let Some(trace_id) = trace_id {
        span.record("trace_id", trace_id);
    }
    span
}

/// Records the end of a request on its span: the HTTP status, the store time, and for a
/// problem answer its outcome (`problem`) and, on a server error, the span's error status.
pub(crate) fn finish(span: &Span, status: axum::http::StatusCode, store: std::time::Duration) {
    tracing::debug!(parent: span, status = status.as_u16(), "answered");
    if !exporting() {
        return;
    }
    span.set_attribute("idemgate.store_ms", store.as_secs_f64() * 1e3);
    span.set_attribute("http.response.status_code", i64::from(status.as_u16()));
    if status != axum::http::StatusCode::OK {
        span.set_attribute("idemgate.outcome", "problem");
    }
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
}

/// The answer of a request, on the current request span (exported spans only).
pub(crate) fn outcome(label: &'static str) {
    current_attribute("idemgate.outcome", label);
}

/// Sets an attribute on the current span when spans are exported (looking the current span
/// up only then: that alone is a dispatcher call and a reference count).
pub(crate) fn current_attribute(key: &'static str, value: impl Into<opentelemetry::Value>) {
    if exporting() {
        Span::current().set_attribute(key, value);
    }
}

/// Sets an attribute on an exported span (nothing without export).
pub(crate) fn attribute(span: &Span, key: &'static str, value: impl Into<opentelemetry::Value>) {
    if exporting() {
        span.set_attribute(key, value);
    }
}

/// A child span of the current one, or a disabled span when spans are not exported.
pub(crate) fn child_span(make: impl FnOnce() -> Span) -> Span {
    if exporting() { make() } else { Span::none() }
}

tokio::task_local! {
    /// Time the current request spent in store calls so far (see [`store_clock`]).
    static STORE_TIME: std::cell::Cell<std::time::Duration>;
}

/// Runs `request` with a store clock: the time of every [`timed_store_call`] it makes adds up,
/// and is returned beside its output. (Futures rather than `async fn`s, for the reason
/// [`timed_store_call`] gives: this one wraps every traced request.)
pub(crate) fn store_clock<F: std::future::Future>(
    request: F,
) -> impl std::future::Future<Output = (F::Output, std::time::Duration)> {
    STORE_TIME.scope(
        std::cell::Cell::new(std::time::Duration::ZERO),
        WithStoreTime { request },
    )
}

pin_project_lite::pin_project! {
    /// A request's future whose output comes with the store clock's reading when it ends
    /// (polled inside the clock's scope, see [`store_clock`]).
    struct WithStoreTime<F> {
        #[pin]
        request: F,
    }
}

impl<F: std::future::Future> std::future::Future for WithStoreTime<F> {
    type Output = (F::Output, std::time::Duration);

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let out = std::task::ready!(self.project().request.poll(cx));
        let store_time = STORE_TIME
            .try_with(std::cell::Cell::get)
            .unwrap_or_default();
        std::task::Poll::Ready((out, store_time))
    }
}

/// Awaits one store call, observes its latency by `verb` and adds it to the request's store
/// clock (calls outside a request, such as an abandoned waiter's cleanup, only count).
///
/// A future of its own rather than an `async fn`: an `async fn` keeps a future passed as its
/// argument and the copy it awaits side by side, so every store call's state machine (a few
/// KiB on Redis) was twice its size in every request's future above it, and copied whole
/// each time that future moved.
pub(crate) fn timed_store_call<'m, F: std::future::Future>(
    metrics: &'m crate::metrics::Metrics,
    verb: crate::metrics::StoreVerb,
    call: F,
) -> TimedStoreCall<'m, F> {
    TimedStoreCall {
        call,
        metrics,
        verb,
        started: None,
    }
}

pin_project_lite::pin_project! {
    /// [`timed_store_call`]'s future.
    pub(crate) struct TimedStoreCall<'m, F> {
        #[pin]
        call: F,
        metrics: &'m crate::metrics::Metrics,
        verb: crate::metrics::StoreVerb,
        // Set on the first poll: the call's time runs from when it is first awaited.
        started: Option<std::time::Instant>,
    }
}

impl<F: std::future::Future> std::future::Future for TimedStoreCall<'_, F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.project();
        let started = *this.started.get_or_insert_with(std::time::Instant::now);
        let out = std::task::ready!(this.call.poll(cx));
        let took = started.elapsed();
        this.metrics.observe_store(*this.verb, took);
        let _ = STORE_TIME.try_with(|total| total.set(total.get() + took));
        std::task::Poll::Ready(out)
    }
}

/// A key as logs may show it: the first 8 bytes of its SHA-256, hex. Keys from the filter are
/// digests already, but a key sent by hand may be a raw idempotency key or resource id.
pub(crate) fn key_digest(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    hex::encode(digest.get(..8).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn b3_single_headers_name_a_span() {
        let trace = "80f198ee56343ba864fe8b2a57d3eff7";
        let parsed = b3_span_context(&format!("{trace}-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90"));
        assert_eq!(
            parsed.map(|c| (
                c.trace_id().to_string(),
                c.span_id().to_string(),
                c.is_sampled()
            )),
            Some((trace.to_owned(), "e457b5a2e4d86bd1".to_owned(), true))
        );
        let short = b3_span_context("64fe8b2a57d3eff7-e457b5a2e4d86bd1-0");
        assert_eq!(
            short.map(|c| (c.trace_id().to_string(), c.is_sampled())),
            Some(("000000000000000064fe8b2a57d3eff7".to_owned(), false))
        );
        for bad in [
            "1",
            "d",
            "",
            "xyz-e457b5a2e4d86bd1",
            "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd",
            "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-7",
            "00000000000000000000000000000000-e457b5a2e4d86bd1",
        ] {
            assert!(b3_span_context(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn traceparent_wins_over_b3_and_garbage_falls_back() {
        let headers = |pairs: &[(&'static str, &str)]| {
            let mut h = axum::http::HeaderMap::new();
            for (name, value) in pairs {
                if let Ok(v) = axum::http::HeaderValue::from_str(value) {
                    h.insert(*name, v);
                }
            }
            h
        };
        let ids = |h: &axum::http::HeaderMap| {
            caller_context(h).map(|cx| {
                let span = cx.span().span_context().clone();
                (span.trace_id().to_string(), span.span_id().to_string())
            })
        };
        let w3c = (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
        let b3 = ("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1");
        let from_w3c = Some((
            "4bf92f3577b34da6a3ce929d0e0e4736".to_owned(),
            "00f067aa0ba902b7".to_owned(),
        ));
        let from_b3 = Some((
            "80f198ee56343ba864fe8b2a57d3eff7".to_owned(),
            "e457b5a2e4d86bd1".to_owned(),
        ));
        assert_eq!(ids(&headers(&[w3c, b3])), from_w3c);
        assert_eq!(
            ids(&headers(&[("traceparent", "00-zz-yy-01"), b3])),
            from_b3
        );
        let zero_trace = (
            "traceparent",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        );
        assert_eq!(ids(&headers(&[zero_trace])), None);
        assert_eq!(ids(&headers(&[])), None);
    }

    #[test]
    fn the_log_only_trace_id_agrees_with_the_propagator() {
        for value in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "xx-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "",
        ] {
            let mut headers = axum::http::HeaderMap::new();
            headers.insert("traceparent", axum::http::HeaderValue::from_static(value));
            let by_propagator =
                caller_context(&headers).map(|cx| cx.span().span_context().trace_id().to_string());
            assert_eq!(caller_trace_id(&headers), by_propagator, "{value}");
        }
        // Stricter than the propagator where it reads fields as numbers, as the specification
        // says: a 31-digit trace id or a 1-digit version is refused.
        for short in [
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(w3c_trace_id(short), None, "{short}");
        }
    }

    #[test]
    fn request_ids_that_could_forge_log_lines_are_dropped() {
        let with = |v: &str| {
            let mut h = axum::http::HeaderMap::new();
            if let Ok(v) = axum::http::HeaderValue::from_str(v) {
                h.insert("x-request-id", v);
            }
            request_id(&h).map(str::to_owned)
        };
        assert_eq!(with("9d3c-41"), Some("9d3c-41".to_owned()));
        for bad in ["", "a b", "a\"b", "a\\b", &"x".repeat(129)] {
            assert_eq!(with(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_traces_path_is_appended_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }

    #[test]
    fn key_digests_do_not_contain_the_key() {
        let digest = key_digest("orders/42");
        assert_eq!(digest.len(), 16);
        assert!(!digest.contains("orders"));
        assert_eq!(digest, key_digest("orders/42"));
    }
}
