//! The HTTP filter chain around each stream, as Envoy's wasm filter runs it: lazy context
//! creation, CHECK_FAIL_HTTP around every callback, return-code mapping to stops, body
//! buffering, resume on `continue_stream`, local replies through the encoder path, resets and
//! the access-log teardown, and the after-VM-call actions.

use super::lifecycle::Called;
use super::state::{Deferred, Half, Phase, Stop, Stream};
use super::{StreamId, Vm};
use crate::abi::Direction;
use crate::headers::HeaderMap;
use crate::plugin::FailurePolicy;
use std::collections::BTreeMap;
use std::net::SocketAddr;

/// What the filter chain emitted for a stream, in order. `Upstream*` go to the router (the
/// upstream request), `Downstream*` to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    UpstreamHeaders {
        headers: HeaderMap,
        end_stream: bool,
    },
    UpstreamData {
        data: Vec<u8>,
        end_stream: bool,
    },
    UpstreamTrailers(HeaderMap),
    /// The upstream request must be abandoned (local reply, reset or client abort).
    UpstreamReset,
    DownstreamHeaders {
        headers: HeaderMap,
        end_stream: bool,
    },
    DownstreamData {
        data: Vec<u8>,
        end_stream: bool,
    },
    DownstreamTrailers(HeaderMap),
    /// The downstream stream is reset (no complete response).
    DownstreamReset {
        details: String,
    },
    /// A local reply started (plugin's `send_local_response`, buffer overflow, fail-closed).
    LocalReply(LocalReply),
}

/// A local reply as requested (before the encoder callbacks run on it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub body: Vec<u8>,
    /// Headers the plugin asked to add.
    pub headers: HeaderMap,
    /// Response code details (Envoy replaces whitespace by `_`).
    pub details: String,
    /// `grpc_status` argument (-1 = none).
    pub grpc_status: i32,
}

/// Connection-level facts about a stream (the `source.*`, `destination.*` properties).
#[derive(Debug, Clone)]
pub struct StreamInfo {
    pub source: SocketAddr,
    pub destination: SocketAddr,
    pub connection_id: u64,
    /// `request.protocol`, e.g. "HTTP/1.1".
    pub protocol: String,
    /// The route the connection manager matched (`xds.*` properties).
    pub route: Option<std::sync::Arc<crate::properties::RouteProperties>>,
}

impl Default for StreamInfo {
    fn default() -> Self {
        Self {
            source: SocketAddr::from(([127, 0, 0, 1], 50000)),
            destination: SocketAddr::from(([127, 0, 0, 1], 10000)),
            connection_id: 1,
            protocol: "HTTP/1.1".into(),
            route: None,
        }
    }
}

/// One callback invocation on a stream, for assertions (`returned` is the raw value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallbackRecord {
    pub callback: &'static str,
    pub returned: Option<i32>,
}

/// Verdict of one HTTP callback after Envoy's failure checks.
enum Verdict {
    Value(i32),
    /// A local reply was sent in the call, or the stream failed closed.
    Stop,
    /// Pass the data on without the VM (fail-open, or after the fail-closed reply).
    Pass,
}

impl Vm {
    // ---------------------------------------------------------------------------------
    // Streams

    /// Creates the filter for a new stream (Envoy `PluginConfig::createContext`): allocates
    /// its context id; the in-VM context is created lazily at request headers.
    pub fn new_stream(&mut self, info: StreamInfo) -> StreamId {
        let now = self.store.data().now_ns();
        let (failed, policy, backoff) = {
            let s = self.store.data();
            (s.failed, s.plugin.failure_policy, s.plugin.reload_backoff)
        };
        if failed && policy == FailurePolicy::FailReload {
            let due = self
                .store
                .data()
                .last_reload_ns
                .is_none_or(|last| now >= last.saturating_add(backoff.as_nanos() as u64));
            if due {
                self.store.data_mut().last_reload_ns = Some(now);
                self.reload();
            }
        }
        let bypass = self.is_failed() && policy == FailurePolicy::FailOpen;
        let context_id = if self.is_failed() {
            0
        } else {
            self.alloc_context_id()
        };
        let state = self.store.data_mut();
        state.next_stream += 1;
        let id = state.next_stream;
        state.streams.insert(
            id,
            Stream {
                context_id,
                generation: state.generation,
                created: false,
                bypass,
                finished: false,
                logging: false,
                request: Half::new(),
                response: Half::new(),
                info,
                events: Vec::new(),
                in_callback: None,
                local_reply_in_call: false,
                local_reply_sent: false,
                fail_reply_sent: false,
                grpc: false,
                filter_state: BTreeMap::new(),
                callbacks: Vec::new(),
                response_code: None,
                started_ns: state.shared.clock.realtime_ns(),
                started_mono_ns: now,
                finished_mono_ns: None,
            },
        );
        if context_id != 0 {
            state.context_streams.insert(context_id, id);
        }
        id
    }

    /// Headers from the client (`Request`, Envoy `decodeHeaders`) or the upstream
    /// (`Response`, `encodeHeaders`).
    pub fn headers(&mut self, id: StreamId, dir: Direction, headers: HeaderMap, end_stream: bool) {
        self.on_headers(id, dir, headers, end_stream, false);
        self.drain();
    }

    /// A data frame (`decodeData` / `encodeData`).
    pub fn data(&mut self, id: StreamId, dir: Direction, data: &[u8], end_stream: bool) {
        self.on_data(id, dir, data, end_stream, false);
        self.drain();
    }

    /// Trailers, which end the direction (`decodeTrailers` / `encodeTrailers`).
    pub fn trailers(&mut self, id: StreamId, dir: Direction, trailers: HeaderMap) {
        self.on_trailers(id, dir, trailers);
        self.drain();
    }

    /// The downstream went away (client abort) or the upstream failed: the stream is destroyed;
    /// `on_log`, `on_done`, `on_delete` still run.
    pub fn reset_stream(&mut self, id: StreamId) {
        self.reset(id, None);
        self.drain();
    }

    /// Takes the events emitted for a stream since the last call.
    pub fn take_events(&mut self, id: StreamId) -> Vec<StreamEvent> {
        self.store
            .data_mut()
            .streams
            .get_mut(&id)
            .map(|s| std::mem::take(&mut s.events))
            .unwrap_or_default()
    }

    /// The streams given events since the last call that their drivers have not taken yet.
    pub fn streams_with_events(&mut self) -> Vec<StreamId> {
        let mut touched = std::mem::take(&mut self.store.data_mut().touched);
        touched.sort_unstable();
        touched.dedup();
        touched.retain(|&id| self.has_events(id));
        touched
    }

    /// Whether a stream has events its driver has not taken yet.
    pub fn has_events(&self, id: StreamId) -> bool {
        self.store
            .data()
            .streams
            .get(&id)
            .is_some_and(|s| !s.events.is_empty())
    }

    /// Whether the stream is complete (its log/done/delete ran).
    pub fn is_finished(&self, id: StreamId) -> bool {
        self.store
            .data()
            .streams
            .get(&id)
            .is_none_or(|s| s.finished)
    }

    /// A value the filter stored on a stream with `proxy_set_property` (Envoy's filter state
    /// `wasm.<path>`), readable until the stream's record is forgotten.
    pub fn filter_state(&self, id: StreamId, path: &[u8]) -> Option<Vec<u8>> {
        self.store
            .data()
            .streams
            .get(&id)
            .and_then(|s| s.filter_state.get(path).cloned())
    }

    /// The stream's request headers as its filter left them (edits included), readable until
    /// the stream's record is forgotten: what Envoy's access log reads for a request that
    /// went no further.
    pub fn request_headers(&self, id: StreamId) -> Option<HeaderMap> {
        self.store
            .data()
            .streams
            .get(&id)
            .and_then(|s| s.request.headers.clone())
    }

    /// Forgets a finished stream's host-side record.
    pub fn remove_stream(&mut self, id: StreamId) {
        let state = self.store.data_mut();
        if state.streams.get(&id).is_some_and(|s| s.finished) {
            state.streams.remove(&id);
            // A VM driven without `streams_with_events` (tests) keeps no note of the dead.
            state.touched.retain(|&touched| touched != id);
        }
    }

    /// Callbacks invoked on a stream so far, with their raw return values.
    pub fn stream_callbacks(&self, id: StreamId) -> Vec<CallbackRecord> {
        self.store
            .data()
            .streams
            .get(&id)
            .map(|s| s.callbacks.clone())
            .unwrap_or_default()
    }

    /// The stream's context id as the module sees it (0 if the filter is not in the chain).
    pub fn stream_context_id(&self, id: StreamId) -> Option<u32> {
        self.store.data().streams.get(&id).map(|s| s.context_id)
    }

    /// Every event is pushed through here: the stream is noted as touched.
    fn stream_mut(&mut self, id: StreamId) -> Option<&mut Stream> {
        let state = self.store.data_mut();
        if state.touched.last() != Some(&id) {
            state.touched.push(id);
        }
        state.streams.get_mut(&id)
    }

    fn vm_alive_for(&self, id: StreamId) -> bool {
        let state = self.store.data();
        !state.failed
            && state
                .streams
                .get(&id)
                .is_some_and(|s| s.generation == state.generation && s.context_id != 0)
    }

    /// Sends `proxy_on_context_create(S, R)` if not done yet; false if the VM cannot take it.
    fn ensure_created(&mut self, id: StreamId) -> bool {
        let Some(stream) = self.store.data().streams.get(&id) else {
            return false;
        };
        if stream.created {
            return true;
        }
        if !self.vm_alive_for(id) {
            return false;
        }
        let ctx = stream.context_id;
        let root = self.root_context_id().unwrap_or(0);
        if let Some(s) = self.stream_mut(id) {
            s.created = true;
        }
        !matches!(
            self.call_stream(
                id,
                ctx,
                "proxy_on_context_create",
                |e| e.context_create.clone(),
                (ctx as i32, root as i32)
            ),
            Called::Failed
        )
    }

    /// Runs one HTTP callback with Envoy's CHECK_FAIL_HTTP around it.
    fn http_callback(
        &mut self,
        id: StreamId,
        dir: Direction,
        phase: Phase,
        a: i32,
        b: i32,
    ) -> Verdict {
        let Some(stream) = self.store.data().streams.get(&id) else {
            return Verdict::Pass;
        };
        if stream.fail_reply_sent {
            return match dir {
                Direction::Response => Verdict::Pass,
                Direction::Request => Verdict::Stop,
            };
        }
        if !self.ensure_created(id) {
            return self.fail_stream(id);
        }
        let ctx = self.stream_context_id(id).unwrap_or(0) as i32;
        if let Some(s) = self.stream_mut(id) {
            s.in_callback = Some((dir, phase));
            s.local_reply_in_call = false;
        }
        let request = dir == Direction::Request;
        let name = match (dir, phase) {
            (Direction::Request, Phase::Headers) => "proxy_on_request_headers",
            (Direction::Request, Phase::Body) => "proxy_on_request_body",
            (Direction::Request, Phase::Trailers) => "proxy_on_request_trailers",
            (Direction::Response, Phase::Headers) => "proxy_on_response_headers",
            (Direction::Response, Phase::Body) => "proxy_on_response_body",
            (Direction::Response, Phase::Trailers) => "proxy_on_response_trailers",
        };
        let context = ctx as u32;
        let called = match phase {
            Phase::Headers => self.call_stream(
                id,
                context,
                name,
                |e| {
                    if request {
                        e.request_headers.clone()
                    } else {
                        e.response_headers.clone()
                    }
                },
                (ctx, a, b),
            ),
            Phase::Body => self.call_stream(
                id,
                context,
                name,
                |e| {
                    if request {
                        e.request_body.clone()
                    } else {
                        e.response_body.clone()
                    }
                },
                (ctx, a, b),
            ),
            Phase::Trailers => self.call_stream(
                id,
                context,
                name,
                |e| {
                    if request {
                        e.request_trailers.clone()
                    } else {
                        e.response_trailers.clone()
                    }
                },
                (ctx, a),
            ),
        };
        let local_reply = self.stream_mut(id).is_some_and(|s| {
            s.in_callback = None;
            std::mem::take(&mut s.local_reply_in_call)
        });
        let returned = match called {
            Called::Returned(v) => Some(v),
            _ => None,
        };
        if let Some(s) = self.stream_mut(id) {
            s.callbacks.push(CallbackRecord {
                callback: name,
                returned,
            });
        }
        match called {
            Called::Failed => self.fail_stream(id),
            _ if local_reply => Verdict::Stop,
            Called::Returned(v) => Verdict::Value(v),
            Called::Missing => Verdict::Value(0),
        }
    }

    /// Envoy's `failStream`: fail-open continues; fail-closed answers 503 once per stream.
    fn fail_stream(&mut self, id: StreamId) -> Verdict {
        if self.store.data().plugin.failure_policy == FailurePolicy::FailOpen {
            return Verdict::Pass;
        }
        let Some(stream) = self.stream_mut(id) else {
            return Verdict::Stop;
        };
        if !stream.fail_reply_sent {
            stream.fail_reply_sent = true;
            self.store
                .data_mut()
                .deferred
                .push_back(Deferred::LocalReply(
                    id,
                    LocalReply {
                        status: 503,
                        body: Vec::new(),
                        headers: HeaderMap::new(),
                        details: "wasm_fail_stream".into(),
                        grpc_status: -1,
                    },
                ));
        }
        Verdict::Stop
    }

    fn on_headers(
        &mut self,
        id: StreamId,
        dir: Direction,
        headers: HeaderMap,
        end_stream: bool,
        local: bool,
    ) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished || (stream.local_reply_sent && !local) {
            return;
        }
        if dir == Direction::Response {
            stream.response_code = headers.get(":status").and_then(|s| s.parse().ok());
        } else {
            stream.grpc = crate::local_reply::is_grpc_request(&headers);
        }
        let n = headers.len() as i32;
        let half = stream.half_mut(dir);
        half.headers = Some(headers);
        half.headers_held = true;
        half.end_seen = end_stream;
        let skip_vm = stream.bypass || (dir == Direction::Response && !stream.created);
        if skip_vm {
            self.forward_headers(id, dir);
            return;
        }
        let verdict = self.http_callback(id, dir, Phase::Headers, n, i32::from(end_stream));
        let allow_stop_iteration = self.store.data().plugin.allow_on_headers_stop_iteration;
        let stop = match verdict {
            Verdict::Pass | Verdict::Value(0) | Verdict::Value(2) => Stop::None,
            Verdict::Value(1) if allow_stop_iteration => Stop::Headers,
            Verdict::Value(_) | Verdict::Stop => Stop::All,
        };
        if stop == Stop::None {
            self.forward_headers(id, dir);
        } else if let Some(s) = self.stream_mut(id) {
            s.half_mut(dir).stop = stop;
        }
    }

    fn on_data(
        &mut self,
        id: StreamId,
        dir: Direction,
        data: &[u8],
        end_stream: bool,
        local: bool,
    ) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished || (stream.local_reply_sent && !local) {
            return;
        }
        let skip_vm = stream.bypass || !stream.created;
        let half = stream.half_mut(dir);
        half.body.extend_from_slice(data);
        half.end_seen |= end_stream;
        if skip_vm {
            self.forward_body(id, dir);
            return;
        }
        if half.stop == Stop::All {
            // Stop-all: Envoy buffers with watermarks (no 413) and calls the plugin on resume.
            half.data_pending = true;
            return;
        }
        self.run_body(id, dir);
    }

    fn run_body(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half(dir);
        let size = half.body.len() as i32;
        let eos = half.end_seen && half.trailers.is_none();
        let verdict = self.http_callback(id, dir, Phase::Body, size, i32::from(eos));
        let limit = self.store.data().plugin.buffer_limit;
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half_mut(dir);
        half.data_pending = false;
        match verdict {
            Verdict::Pass | Verdict::Value(0) => {
                half.stop = Stop::None;
                self.forward_headers(id, dir);
                self.forward_body(id, dir);
                self.continue_to_trailers(id, dir);
            }
            Verdict::Value(1) => {
                half.stop = Stop::Body;
                if half.body.len() > limit {
                    self.buffer_overflow(id, dir);
                }
            }
            Verdict::Value(2) => half.stop = Stop::Body,
            Verdict::Value(_) | Verdict::Stop => {
                // StopIterationNoBuffer: the filter owns the data; it is not kept.
                half.stop = Stop::Body;
                half.body.clear();
            }
        }
    }

    /// Trailers that arrived while the body was stopped get their callback after it continues.
    fn continue_to_trailers(&mut self, id: StreamId, dir: Direction) {
        let pending = self
            .store
            .data()
            .streams
            .get(&id)
            .is_some_and(|s| s.half(dir).trailers_held);
        if pending {
            self.run_trailers(id, dir);
        }
    }

    fn on_trailers(&mut self, id: StreamId, dir: Direction, trailers: HeaderMap) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished || stream.local_reply_sent {
            return;
        }
        let skip_vm = stream.bypass || !stream.created;
        let half = stream.half_mut(dir);
        half.trailers = Some(trailers);
        half.trailers_held = true;
        half.end_seen = true;
        if skip_vm {
            self.forward_trailers(id, dir);
            return;
        }
        if matches!(half.stop, Stop::All | Stop::Body) {
            return;
        }
        self.run_trailers(id, dir);
    }

    fn run_trailers(&mut self, id: StreamId, dir: Direction) {
        let n = self
            .store
            .data()
            .streams
            .get(&id)
            .and_then(|s| s.half(dir).trailers.as_ref().map(HeaderMap::len))
            .unwrap_or(0) as i32;
        match self.http_callback(id, dir, Phase::Trailers, n, 0) {
            Verdict::Pass | Verdict::Value(0) => {
                self.forward_headers(id, dir);
                self.forward_body(id, dir);
                self.forward_trailers(id, dir);
            }
            _ => {
                if let Some(s) = self.stream_mut(id) {
                    s.half_mut(dir).stop = Stop::Trailers;
                }
            }
        }
    }

    /// `proxy_continue_stream`, run after the VM call returned.
    fn resume(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished {
            return;
        }
        let half = stream.half_mut(dir);
        let stop = std::mem::replace(&mut half.stop, Stop::None);
        let data_pending = half.data_pending;
        match stop {
            Stop::None => {}
            Stop::All => {
                self.forward_headers(id, dir);
                if data_pending {
                    self.run_body(id, dir);
                } else {
                    self.continue_to_trailers(id, dir);
                }
            }
            Stop::Headers | Stop::Body | Stop::Trailers => {
                self.forward_headers(id, dir);
                self.forward_body(id, dir);
                self.forward_trailers(id, dir);
            }
        }
    }

    fn forward_headers(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half_mut(dir);
        if !half.headers_held {
            return;
        }
        half.headers_held = false;
        half.headers_forwarded = true;
        let end_stream = half.end_seen && half.body.is_empty() && half.trailers.is_none();
        let headers = half.headers.clone().unwrap_or_default();
        half.complete |= end_stream;
        let event = match dir {
            Direction::Request => StreamEvent::UpstreamHeaders {
                headers,
                end_stream,
            },
            Direction::Response => StreamEvent::DownstreamHeaders {
                headers,
                end_stream,
            },
        };
        stream.events.push(event);
        if end_stream {
            self.completed(id, dir);
        }
    }

    fn forward_body(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half_mut(dir);
        if !half.headers_forwarded || half.complete {
            return;
        }
        let end_stream = half.end_seen && half.trailers.is_none();
        if half.body.is_empty() && !end_stream {
            return;
        }
        let data = std::mem::take(&mut half.body);
        half.complete |= end_stream;
        let event = match dir {
            Direction::Request => StreamEvent::UpstreamData { data, end_stream },
            Direction::Response => StreamEvent::DownstreamData { data, end_stream },
        };
        stream.events.push(event);
        if end_stream {
            self.completed(id, dir);
        }
    }

    fn forward_trailers(&mut self, id: StreamId, dir: Direction) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        let half = stream.half_mut(dir);
        if !half.trailers_held || !half.headers_forwarded || half.complete {
            return;
        }
        half.trailers_held = false;
        half.complete = true;
        let trailers = half.trailers.clone().unwrap_or_default();
        stream.events.push(match dir {
            Direction::Request => StreamEvent::UpstreamTrailers(trailers),
            Direction::Response => StreamEvent::DownstreamTrailers(trailers),
        });
        self.completed(id, dir);
    }

    fn completed(&mut self, id: StreamId, dir: Direction) {
        if dir == Direction::Response {
            self.finish(id);
        }
    }

    fn buffer_overflow(&mut self, id: StreamId, dir: Direction) {
        let (status, body, details) = match dir {
            Direction::Request => (413, "Payload Too Large", "request_payload_too_large"),
            Direction::Response => (500, "Internal Server Error", "response_payload_too_large"),
        };
        self.store
            .data_mut()
            .deferred
            .push_back(Deferred::LocalReply(
                id,
                LocalReply {
                    status,
                    body: body.as_bytes().to_vec(),
                    headers: HeaderMap::new(),
                    details: details.into(),
                    grpc_status: -1,
                },
            ));
    }

    fn send_local_reply(&mut self, id: StreamId, reply: LocalReply) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished {
            return;
        }
        if stream.response.headers_forwarded {
            // Headers already went downstream: all Envoy can do is reset.
            self.reset(id, Some("wasm_local_reply_after_response_headers".into()));
            return;
        }
        let (headers, body) = crate::local_reply::render(
            stream.grpc,
            reply.status,
            &reply.body,
            &reply.headers,
            crate::local_reply::plugin_grpc_status(reply.grpc_status),
        );
        let upstream_started = stream.request.headers_forwarded;
        stream.events.push(StreamEvent::LocalReply(reply.clone()));
        if upstream_started {
            stream.events.push(StreamEvent::UpstreamReset);
        }
        stream.request.complete = true;
        stream.response_code = headers.get(":status").and_then(|s| s.parse().ok());
        if stream.response.headers_held {
            // From on_response_headers: Envoy sends the reply straight to the encoder, dropping
            // the upstream response, without running filter callbacks on it.
            stream.local_reply_sent = true;
            let end_stream = body.is_empty();
            stream.response.headers = Some(headers.clone());
            stream.response.headers_held = false;
            stream.response.headers_forwarded = true;
            stream.response.complete = true;
            stream.events.push(StreamEvent::DownstreamHeaders {
                headers,
                end_stream,
            });
            if !end_stream {
                stream.events.push(StreamEvent::DownstreamData {
                    data: body,
                    end_stream: true,
                });
            }
            self.finish(id);
            return;
        }
        stream.local_reply_sent = true;
        stream.response = Half::new();
        let end_stream = body.is_empty();
        self.on_headers(id, Direction::Response, headers, end_stream, true);
        if !end_stream {
            self.on_data(id, Direction::Response, &body, true, true);
        }
    }

    fn reset(&mut self, id: StreamId, details: Option<String>) {
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished {
            return;
        }
        if stream.request.headers_forwarded
            && !(stream.request.complete && stream.response.complete)
        {
            stream.events.push(StreamEvent::UpstreamReset);
        }
        if let Some(details) = details {
            stream.events.push(StreamEvent::DownstreamReset { details });
        }
        self.finish(id);
    }

    /// Envoy's stream teardown: access log (`on_log`), then `on_done`, then `on_delete`.
    fn finish(&mut self, id: StreamId) {
        let now = self.store.data().now_ns();
        let Some(stream) = self.stream_mut(id) else {
            return;
        };
        if stream.finished {
            return;
        }
        stream.finished = true;
        stream.finished_mono_ns = Some(now);
        let ctx = stream.context_id;
        if !stream.bypass && self.vm_alive_for(id) && self.ensure_created(id) {
            if let Some(s) = self.stream_mut(id) {
                s.logging = true;
            }
            self.call_stream(id, ctx, "proxy_on_log", |e| e.log.clone(), ctx as i32);
            if let Some(s) = self.stream_mut(id) {
                s.logging = false;
            }
            self.call_stream(id, ctx, "proxy_on_done", |e| e.done.clone(), ctx as i32);
            self.call_stream(id, ctx, "proxy_on_delete", |e| e.delete.clone(), ctx as i32);
        }
        let state = self.store.data_mut();
        if state.context_streams.get(&ctx) == Some(&id) {
            state.context_streams.remove(&ctx);
        }
    }

    /// Runs queued after-VM-call actions until none is left.
    pub(super) fn drain(&mut self) {
        while let Some(action) = self.store.data_mut().deferred.pop_front() {
            match action {
                Deferred::Continue(id, dir) => self.resume(id, dir),
                Deferred::Close(id) => self.reset(id, Some("wasm_close_stream".into())),
                Deferred::LocalReply(id, reply) => self.send_local_reply(id, reply),
                Deferred::DeleteRoot => {
                    if let Some(root) = self.root_context_id() {
                        self.call(root, "proxy_on_delete", |e| e.delete.clone(), root as i32);
                        self.store.data_mut().root = None;
                    }
                }
            }
        }
    }
}
