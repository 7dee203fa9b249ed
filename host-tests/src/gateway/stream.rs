//! One downstream connection and the driver of each of its streams: request frames into the
//! filter chain, the chain's events out to the upstream (router) and the client, upstream
//! response frames back in, client aborts as stream resets, and the access-log line.

use super::ListenerWorker;
use super::config::{HcmOptions, ListenerConfig, RouteAction, ServerHeaderTransformation};
use super::path::PathOutcome;
use crate::abi::Direction;
use crate::client::{BoxError, Failure, LocalExec};
use crate::headers::HeaderMap;
use crate::properties::RouteProperties;
use crate::upstream::response_headers;
use crate::vm::{StreamEvent, StreamId, StreamInfo};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

type FrameResult = Result<Frame<Bytes>, BoxError>;

/// A body fed frame by frame from a channel (streams both directions without buffering), or
/// none at all: headers sent with `end_stream` must end the stream on the headers themselves
/// (HTTP/2: END_STREAM on the HEADERS frame, which is what makes a gRPC local reply
/// trailers-only; HTTP/1.1: `content-length: 0`), as Envoy's codecs encode them.
pub(crate) struct ChannelBody {
    rx: Option<mpsc::UnboundedReceiver<FrameResult>>,
}

impl ChannelBody {
    fn channel() -> (mpsc::UnboundedSender<FrameResult>, Self) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, Self { rx: Some(rx) })
    }

    /// A body that has ended before it began.
    fn ended() -> Self {
        Self { rx: None }
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<FrameResult>> {
        match &mut self.get_mut().rx {
            Some(rx) => rx.poll_recv(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rx.is_none()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self.rx {
            Some(_) => hyper::body::SizeHint::default(),
            None => hyper::body::SizeHint::with_exact(0),
        }
    }
}

/// Hop-by-hop headers a proxy must not forward.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "transfer-encoding",
    "upgrade",
    "proxy-connection",
    "te",
];

pub(crate) struct Connection {
    pub(crate) listener: Rc<ListenerWorker>,
    pub(crate) peer: SocketAddr,
    pub(crate) local: SocketAddr,
    pub(crate) id: u64,
    /// Raw HTTP/1 request heads, for what hyper's parser does not report.
    pub(crate) heads: Rc<std::cell::RefCell<super::heads::Heads>>,
}

impl Connection {
    pub(crate) async fn serve(self, io: TokioIo<super::heads::Recording<tokio::net::TcpStream>>) {
        let this = Rc::new(self);
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            let this = Rc::clone(&this);
            async move {
                let (tx, rx) = oneshot::channel();
                let protocol = format!("{:?}", request.version());
                tokio::task::spawn_local(drive(Rc::clone(&this), request, tx, protocol));
                rx.await.map_err(|_| -> BoxError { "stream reset".into() })
            }
        });
        let _ = hyper_util::server::conn::auto::Builder::new(LocalExec)
            .serve_connection(io, service)
            .await;
    }
}

/// The filter chain of one stream: the wasm filter's VM, or nothing but the router.
enum Chain {
    Wasm(StreamId),
    Direct {
        events: Vec<StreamEvent>,
        finished: bool,
    },
}

struct Driver {
    listener: Rc<ListenerWorker>,
    chain: Chain,
    /// A gRPC request: the router's replies are trailers-only gRPC responses.
    grpc: bool,
}

impl Driver {
    /// A value the wasm filter stored with `proxy_set_property` (its path as the filter gave it).
    fn filter_state(&self, path: &[u8]) -> Option<Vec<u8>> {
        match (&self.chain, &self.listener.vm) {
            (Chain::Wasm(id), Some(vm)) => vm.borrow().filter_state(*id, path),
            _ => None,
        }
    }

    /// The request headers as the wasm filter left them (`None` without one).
    fn request_headers(&self) -> Option<HeaderMap> {
        match (&self.chain, &self.listener.vm) {
            (Chain::Wasm(id), Some(vm)) => vm.borrow().request_headers(*id),
            _ => None,
        }
    }

    fn with_vm(&mut self, f: impl FnOnce(&mut crate::vm::Vm, StreamId)) {
        if let (Chain::Wasm(id), Some(vm)) = (&self.chain, &self.listener.vm) {
            f(&mut vm.borrow_mut(), *id);
            self.listener.after_vm_call();
        }
    }

    fn direct(&mut self, event: StreamEvent, finishes: bool) {
        if let Chain::Direct { events, finished } = &mut self.chain {
            events.push(event);
            *finished |= finishes;
        }
    }

    fn headers(&mut self, dir: Direction, headers: HeaderMap, end_stream: bool) {
        if matches!(self.chain, Chain::Wasm(_)) {
            return self.with_vm(|vm, id| vm.headers(id, dir, headers, end_stream));
        }
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
        self.direct(event, dir == Direction::Response && end_stream);
    }

    fn data(&mut self, dir: Direction, data: Bytes, end_stream: bool) {
        if matches!(self.chain, Chain::Wasm(_)) {
            return self.with_vm(|vm, id| vm.data(id, dir, &data, end_stream));
        }
        let data = data.to_vec();
        let event = match dir {
            Direction::Request => StreamEvent::UpstreamData { data, end_stream },
            Direction::Response => StreamEvent::DownstreamData { data, end_stream },
        };
        self.direct(event, dir == Direction::Response && end_stream);
    }

    fn trailers(&mut self, dir: Direction, trailers: HeaderMap) {
        if matches!(self.chain, Chain::Wasm(_)) {
            return self.with_vm(|vm, id| vm.trailers(id, dir, trailers));
        }
        let event = match dir {
            Direction::Request => StreamEvent::UpstreamTrailers(trailers),
            Direction::Response => StreamEvent::DownstreamTrailers(trailers),
        };
        self.direct(event, dir == Direction::Response);
    }

    /// Feeds one frame read from a body (`None` = the body ended); `Err` if the peer failed.
    fn feed(
        &mut self,
        dir: Direction,
        frame: Option<Result<Frame<Bytes>, hyper::Error>>,
        body: &mut Option<Incoming>,
    ) -> Result<usize, hyper::Error> {
        match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    let end = body.as_ref().is_some_and(Body::is_end_stream);
                    if end {
                        *body = None;
                    }
                    let len = data.len();
                    self.data(dir, data, end);
                    Ok(len)
                }
                Err(frame) => {
                    *body = None;
                    if let Ok(trailers) = frame.into_trailers() {
                        self.trailers(dir, HeaderMap::from_http(&trailers));
                    }
                    Ok(0)
                }
            },
            None => {
                *body = None;
                self.data(dir, Bytes::new(), true);
                Ok(0)
            }
            Some(Err(e)) => Err(e),
        }
    }

    /// A response Envoy's router generates itself (no route, connect failure, timeout).
    fn router_reply(&mut self, status: u16, body: &str) {
        self.local_reply(status, body.as_bytes(), &[]);
    }

    /// Envoy's `sendLocalReply`: content-length, `content-type: text/plain` with a body (or a
    /// trailers-only gRPC status to a gRPC request), and `extra` headers.
    fn local_reply(&mut self, status: u16, body: &[u8], extra: &[(&str, &str)]) {
        let mut extra_headers = HeaderMap::new();
        for (k, v) in extra {
            extra_headers.add(k.as_bytes(), v.as_bytes());
        }
        let (headers, body) =
            crate::local_reply::render(self.grpc, u32::from(status), body, &extra_headers, None);
        self.headers(Direction::Response, headers, body.is_empty());
        if !body.is_empty() {
            self.data(Direction::Response, Bytes::from(body), true);
        }
    }

    fn reset(&mut self) {
        self.with_vm(|vm, id| vm.reset_stream(id));
        if let Chain::Direct { finished, .. } = &mut self.chain {
            *finished = true;
        }
    }

    fn take_events(&mut self) -> Vec<StreamEvent> {
        match &mut self.chain {
            Chain::Direct { events, .. } => std::mem::take(events),
            Chain::Wasm(id) => self
                .listener
                .vm
                .as_ref()
                .map(|vm| vm.borrow_mut().take_events(*id))
                .unwrap_or_default(),
        }
    }

    fn is_finished(&self) -> bool {
        match &self.chain {
            Chain::Direct { finished, .. } => *finished,
            Chain::Wasm(id) => self
                .listener
                .vm
                .as_ref()
                .is_none_or(|vm| vm.borrow().is_finished(*id)),
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let (Chain::Wasm(id), Some(vm)) = (&self.chain, &self.listener.vm) {
            let mut vm = vm.borrow_mut();
            vm.reset_stream(*id);
            vm.remove_stream(*id);
        }
    }
}

/// Router-control headers Envoy strips from requests that are not internal.
const CLIENT_CONTROL_HEADERS: &[&str] = &[
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-max-retries",
    "x-envoy-upstream-alt-stat-name",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-upstream-rq-timeout-alt-response",
    "x-envoy-expected-rq-timeout-ms",
    "x-envoy-force-trace",
    "x-envoy-ip-tags",
    "x-envoy-original-url",
    "x-envoy-hedge-on-per-try-timeout",
];

/// The request as Envoy's HCM hands it to filters: pseudo-headers first in the order the
/// HTTP/1 codec sets them (`host` folded into `:authority`), the client's headers in their
/// order without hop-by-hop ones, then what `ConnectionManagerUtility::mutateRequestHeaders`
/// adds, in its order (`x-forwarded-proto`, then a generated `x-request-id`).
fn downstream_headers(parts: &http::request::Parts) -> HeaderMap {
    let authority = parts
        .uri
        .authority()
        .map(|a| a.to_string())
        .or_else(|| {
            parts
                .headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned)
        })
        .unwrap_or_default();
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| "/".to_owned(), |p| p.to_string());
    let mut headers = HeaderMap::from([
        (":authority", authority.as_str()),
        (":path", path.as_str()),
        (":method", parts.method.as_str()),
        (":scheme", "http"),
    ]);
    for (k, v) in &parts.headers {
        if k != http::header::HOST && !HOP_BY_HOP.contains(&k.as_str()) {
            headers.add(k.as_str().as_bytes(), v.as_bytes());
        }
    }
    // A request that is not internal (no trusted XFF here) loses the router-control headers
    // a client could forge (`ConnectionManagerUtility::cleanInternalHeaders`).
    for name in CLIENT_CONTROL_HEADERS {
        headers.remove(name.as_bytes());
    }
    if headers.get_bytes("x-forwarded-proto").is_none() {
        headers.add(b"x-forwarded-proto", b"http");
    }
    if headers.get_bytes("x-request-id").is_none() {
        let mut random = [0u8; 16];
        let _ = getrandom::fill(&mut random);
        let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let id = format!(
            "{}-{}-4{}-8{}-{}",
            hex.get(0..8).unwrap_or_default(),
            hex.get(8..12).unwrap_or_default(),
            hex.get(13..16).unwrap_or_default(),
            hex.get(17..20).unwrap_or_default(),
            hex.get(20..32).unwrap_or_default()
        );
        headers.add(b"x-request-id", id.as_bytes());
    }
    headers
}

/// A request the connection manager answers itself, before any filter runs.
struct Refusal {
    status: u16,
    body: &'static [u8],
    details: &'static str,
    headers: Vec<(&'static str, String)>,
}

/// What Envoy's HTTP/1 codec and connection manager check and rewrite before the filter
/// chain exists: Content-Length with Transfer-Encoding (`http1/codec_impl.cc`, refused
/// unless `allow_chunked_length`, which drops Content-Length instead), then the path
/// (`ConnectionManagerUtility::maybeNormalizePath`).
fn connection_manager_checks(
    parts: &http::request::Parts,
    raw_head: Option<&[u8]>,
    headers: &mut HeaderMap,
    config: &ListenerConfig,
) -> Option<Refusal> {
    // hyper keeps Transfer-Encoding but drops the Content-Length beside it: read the raw head.
    let content_length_with_chunked = parts.headers.contains_key(http::header::TRANSFER_ENCODING)
        && raw_head.is_some_and(|head| super::heads::has_header(head, "content-length"));
    if content_length_with_chunked {
        if !config.hcm.allow_chunked_length {
            return Some(Refusal {
                status: 400,
                body: b"Bad Request",
                details: "http1.content_length_and_chunked_not_allowed",
                headers: vec![("connection", "close".to_owned())],
            });
        }
        headers.remove(b"content-length");
    }
    let path = headers.get(":path").unwrap_or_default();
    match super::path::normalize(&path, &config.hcm) {
        PathOutcome::Continue(normalized) => {
            if normalized != path {
                headers.replace(b":path", normalized.as_bytes());
            }
            None
        }
        PathOutcome::Reject => Some(Refusal {
            status: 400,
            body: b"",
            details: "path_normalization_failed",
            headers: Vec::new(),
        }),
        PathOutcome::Redirect(location) => Some(Refusal {
            status: 307,
            body: b"",
            details: "path_normalization_failed",
            headers: vec![("location", location)],
        }),
    }
}

/// The connection manager's `server` header on every response it encodes, local replies
/// included (`ConnectionManagerImpl::ActiveStream::encodeHeaders`).
fn server_header(headers: &mut HeaderMap, hcm: &HcmOptions) {
    match hcm.server_header {
        ServerHeaderTransformation::Overwrite => {
            headers.replace(b"server", hcm.server_name.as_bytes());
        }
        ServerHeaderTransformation::AppendIfAbsent if headers.get_bytes("server").is_none() => {
            headers.add(b"server", hcm.server_name.as_bytes());
        }
        ServerHeaderTransformation::AppendIfAbsent | ServerHeaderTransformation::PassThrough => {}
    }
}

fn http_headers(map: &HeaderMap, into: &mut http::HeaderMap) {
    for (k, v) in map.entries() {
        if k.first() == Some(&b':') || HOP_BY_HOP.contains(&String::from_utf8_lossy(k).as_ref()) {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(k),
            http::HeaderValue::from_bytes(v),
        ) {
            into.append(name, value);
        }
    }
}

/// Sends the request upstream through the worker's pool; the response (head + streaming
/// body) comes back through `done`.
async fn upstream_exchange(
    listener: Rc<ListenerWorker>,
    cluster: crate::plugin::Cluster,
    request: http::Request<ChannelBody>,
    done: oneshot::Sender<Result<http::Response<Incoming>, Failure>>,
) {
    let result = listener
        .pool
        .send(&cluster, request.map(BodyExt::boxed_unsync))
        .await;
    let _ = done.send(result);
}

async fn next_frame(body: &mut Option<Incoming>) -> Option<Result<Frame<Bytes>, hyper::Error>> {
    match body {
        Some(b) => b.frame().await,
        None => std::future::pending().await,
    }
}

async fn closed(tx: &Option<mpsc::UnboundedSender<FrameResult>>) {
    match tx {
        Some(tx) => tx.closed().await,
        None => std::future::pending().await,
    }
}

async fn response_closed(tx: &mut Option<oneshot::Sender<http::Response<ChannelBody>>>) {
    match tx {
        Some(tx) => tx.closed().await,
        None => std::future::pending().await,
    }
}

async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// One routed request counted against its cluster's `max_requests` until dropped.
struct RequestGuard {
    shared: Arc<crate::shared::SharedState>,
    cluster: String,
}

impl RequestGuard {
    fn start(
        shared: Arc<crate::shared::SharedState>,
        cluster: &crate::plugin::Cluster,
    ) -> Option<Self> {
        shared
            .try_start_request(&cluster.name, cluster.max_requests)
            .then(|| Self {
                shared,
                cluster: cluster.name.clone(),
            })
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.shared.end_request(&self.cluster);
    }
}

/// What the access log and stats record about a stream.
#[derive(Default)]
struct Outcome {
    status: Option<u16>,
    details: Option<String>,
    bytes_received: usize,
    bytes_sent: usize,
    upstream: Option<SocketAddr>,
    cluster: Option<String>,
    /// What went to the client (for `%RESP(...)%`).
    response_headers: Option<HeaderMap>,
}

async fn drive(
    connection: Rc<Connection>,
    request: http::Request<Incoming>,
    respond: oneshot::Sender<http::Response<ChannelBody>>,
    protocol: String,
) {
    let started = Instant::now();
    let started_at = std::time::SystemTime::now();
    let listener = Rc::clone(&connection.listener);
    let (parts, body) = request.into_parts();
    let mut headers = downstream_headers(&parts);
    let raw_head = (parts.version <= http::Version::HTTP_11)
        .then(|| connection.heads.borrow_mut().next())
        .flatten();
    let refusal =
        connection_manager_checks(&parts, raw_head.as_deref(), &mut headers, &listener.config);
    let route = listener
        .config
        .route(
            &headers.get(":authority").unwrap_or_default(),
            &headers.get(":path").unwrap_or_default(),
        )
        .map(|(host, route)| {
            Arc::new(RouteProperties {
                route_name: route.name.clone(),
                virtual_host_name: host.name.clone(),
                cluster_name: match &route.action {
                    RouteAction::Cluster { cluster, .. } => Some(cluster.clone()),
                    RouteAction::Direct { .. } => None,
                },
                filter_metadata: route.metadata.clone(),
            })
        });
    let chain = match (&listener.vm, &refusal) {
        (Some(vm), None) => Chain::Wasm(vm.borrow_mut().new_stream(StreamInfo {
            source: connection.peer,
            destination: connection.local,
            connection_id: connection.id,
            protocol: protocol.replace("HTTP/2.0", "HTTP/2"),
            route,
        })),
        _ => Chain::Direct {
            events: Vec::new(),
            finished: false,
        },
    };
    let (wake, _slot) = listener.register(match &chain {
        Chain::Wasm(id) => Some(*id),
        Chain::Direct { .. } => None,
    });
    let mut driver = Driver {
        listener: Rc::clone(&listener),
        chain,
        grpc: crate::local_reply::is_grpc_request(&headers),
    };
    let mut outcome = Outcome::default();
    let end_stream = body.is_end_stream();
    let mut request_body = (!end_stream).then_some(body);
    let mut respond = Some(respond);
    let mut downstream: Option<mpsc::UnboundedSender<FrameResult>> = None;
    let mut upstream_body: Option<mpsc::UnboundedSender<FrameResult>> = None;
    let mut upstream_pending: Option<oneshot::Receiver<Result<http::Response<Incoming>, Failure>>> =
        None;
    let mut upstream_task: Option<tokio::task::JoinHandle<()>> = None;
    let mut upstream_deadline: Option<tokio::time::Instant> = None;
    let mut upstream_response: Option<Incoming> = None;
    let mut in_flight: Option<RequestGuard> = None;
    let mut upstream_started: Option<Instant> = None;
    // The request headers as forwarded, for the access log (below).
    let mut forwarded: Option<HeaderMap> = None;
    let suppress_envoy_headers = listener.config.suppress_envoy_headers;
    match refusal {
        // Envoy answers these before it creates the filter chain: no filter sees them.
        Some(refusal) => {
            request_body = None;
            outcome.details = Some(refusal.details.to_owned());
            let extra: Vec<(&str, &str)> = refusal
                .headers
                .iter()
                .map(|(k, v)| (*k, v.as_str()))
                .collect();
            driver.local_reply(refusal.status, refusal.body, &extra);
        }
        None => driver.headers(Direction::Request, headers.clone(), end_stream),
    }

    for _ in 0..u32::MAX {
        // Handling an event can produce more (a router reply runs the filter's response
        // callbacks): drain them all before checking whether the stream is over.
        let mut events = driver.take_events();
        while !events.is_empty() {
            for event in std::mem::take(&mut events) {
                match event {
                    StreamEvent::UpstreamHeaders {
                        headers,
                        end_stream,
                    } => {
                        let mut headers = headers;
                        let path = headers.get(":path").unwrap_or_default();
                        let authority = headers.get(":authority").unwrap_or_default();
                        // The router matches again: the filter may have changed the headers
                        // (Envoy's wasm filter clears the route cache when it does).
                        let Some((host, route)) = listener.config.route(&authority, &path) else {
                            driver.router_reply(404, "");
                            outcome.details = Some("route_not_found".into());
                            continue;
                        };
                        let (cluster_name, timeout) = match &route.action {
                            RouteAction::Direct { status, body } => {
                                outcome.details = Some("direct_response".into());
                                driver.local_reply(*status, body, &[]);
                                continue;
                            }
                            RouteAction::Cluster { cluster, timeout } => (cluster, *timeout),
                        };
                        // Most specific first, so the route configuration's own headers win
                        // (`most_specific_header_mutations_wins: false`, Envoy's default).
                        route.headers.apply(&mut headers);
                        host.headers.apply(&mut headers);
                        listener.config.route_config_headers.apply(&mut headers);
                        if let (false, Some(timeout)) = (suppress_envoy_headers, timeout) {
                            headers.replace(
                                b"x-envoy-expected-rq-timeout-ms",
                                timeout.as_millis().to_string().as_bytes(),
                            );
                        }
                        let Some(cluster) = listener.clusters.get(cluster_name).cloned() else {
                            driver.router_reply(503, "no healthy upstream");
                            continue;
                        };
                        let Some(guard) =
                            RequestGuard::start(Arc::clone(&listener.shared), &cluster)
                        else {
                            listener.stats.add(
                                format!("cluster.{}.upstream_rq_pending_overflow", cluster.name),
                                1,
                            );
                            outcome.details =
                                Some("upstream_reset_before_response_started{overflow}".into());
                            driver.router_reply(503, "upstream connect error or disconnect/reset before headers. reset reason: overflow");
                            continue;
                        };
                        // Held until the stream ends or the upstream request is abandoned.
                        in_flight.replace(guard);
                        listener
                            .stats
                            .add(format!("cluster.{}.upstream_rq_total", cluster.name), 1);
                        outcome.upstream = cluster.address;
                        outcome.cluster = Some(cluster.name.clone());
                        let (tx, body) = ChannelBody::channel();
                        upstream_body = (!end_stream).then_some(tx);
                        let uri = if cluster.http2 {
                            format!(
                                "http://{}{}",
                                headers.get(":authority").unwrap_or_default(),
                                path
                            )
                        } else {
                            path.clone()
                        };
                        let mut request = http::Request::new(body);
                        *request.method_mut() = http::Method::from_bytes(
                            headers.get(":method").unwrap_or_default().as_bytes(),
                        )
                        .unwrap_or(http::Method::GET);
                        if let Ok(uri) = uri.parse() {
                            *request.uri_mut() = uri;
                        }
                        if cluster.http2 {
                            *request.version_mut() = http::Version::HTTP_2;
                        } else if let Some(Ok(host)) = headers
                            .get(":authority")
                            .map(|a| http::HeaderValue::from_str(&a))
                        {
                            request.headers_mut().insert(http::header::HOST, host);
                        }
                        http_headers(&headers, request.headers_mut());
                        forwarded = Some(headers);
                        let (done, pending) = oneshot::channel();
                        upstream_pending = Some(pending);
                        upstream_deadline = timeout.map(|t| tokio::time::Instant::now() + t);
                        upstream_started = Some(Instant::now());
                        upstream_task = Some(tokio::task::spawn_local(upstream_exchange(
                            Rc::clone(&listener),
                            cluster,
                            request,
                            done,
                        )));
                    }
                    StreamEvent::UpstreamData { data, end_stream } => {
                        if let Some(tx) = &upstream_body {
                            let _ = tx.send(Ok(Frame::data(Bytes::from(data))));
                        }
                        if end_stream {
                            upstream_body = None;
                        }
                    }
                    StreamEvent::UpstreamTrailers(trailers) => {
                        let mut map = http::HeaderMap::new();
                        http_headers(&trailers, &mut map);
                        if let Some(tx) = upstream_body.take() {
                            let _ = tx.send(Ok(Frame::trailers(map)));
                        }
                    }
                    StreamEvent::UpstreamReset => {
                        drop(in_flight.take());
                        upstream_body = None;
                        upstream_pending = None;
                        upstream_response = None;
                        upstream_deadline = None;
                        if let Some(task) = upstream_task.take() {
                            task.abort();
                        }
                    }
                    StreamEvent::DownstreamHeaders {
                        headers,
                        end_stream,
                    } => {
                        let mut headers = headers;
                        server_header(&mut headers, &listener.config.hcm);
                        let (tx, body) = if end_stream {
                            let (tx, _) = ChannelBody::channel();
                            (tx, ChannelBody::ended())
                        } else {
                            ChannelBody::channel()
                        };
                        let mut response = http::Response::new(body);
                        let status = headers
                            .get(":status")
                            .and_then(|s| s.parse().ok())
                            .unwrap_or(502);
                        outcome.status = Some(status);
                        outcome.response_headers = Some(headers.clone());
                        *response.status_mut() = http::StatusCode::from_u16(status)
                            .unwrap_or(http::StatusCode::BAD_GATEWAY);
                        http_headers(&headers, response.headers_mut());
                        downstream = (!end_stream).then_some(tx);
                        if let Some(respond) = respond.take() {
                            let _ = respond.send(response);
                        }
                    }
                    StreamEvent::DownstreamData { data, end_stream } => {
                        outcome.bytes_sent += data.len();
                        if let Some(tx) = &downstream {
                            let _ = tx.send(Ok(Frame::data(Bytes::from(data))));
                        }
                        if end_stream {
                            downstream = None;
                        }
                    }
                    StreamEvent::DownstreamTrailers(trailers) => {
                        let mut map = http::HeaderMap::new();
                        http_headers(&trailers, &mut map);
                        if let Some(tx) = downstream.take() {
                            let _ = tx.send(Ok(Frame::trailers(map)));
                        }
                    }
                    StreamEvent::DownstreamReset { details } => {
                        outcome.details = Some(details);
                        respond = None;
                        if let Some(tx) = downstream.take() {
                            let _ = tx.send(Err("stream reset".into()));
                        }
                    }
                    StreamEvent::LocalReply(reply) => outcome.details = Some(reply.details),
                }
            }
            events = driver.take_events();
        }
        if driver.is_finished() {
            break;
        }
        tokio::select! {
            _ = wake.notified() => {}
            frame = next_frame(&mut request_body) => match driver.feed(Direction::Request, frame, &mut request_body) {
                Ok(n) => outcome.bytes_received += n,
                Err(_) => {
                    outcome.details = Some("downstream_remote_disconnect".into());
                    driver.reset();
                }
            },
            response = async { match upstream_pending.as_mut() { Some(p) => p.await, None => std::future::pending().await } } => {
                upstream_pending = None;
                upstream_deadline = None;
                match response {
                    Ok(Ok(response)) => {
                        let (parts, body) = response.into_parts();
                        let end = body.is_end_stream();
                        let mut headers = response_headers(parts.status, &parts.headers);
                        for hop in HOP_BY_HOP {
                            headers.remove(hop.as_bytes());
                        }
                        upstream_response = (!end).then_some(body);
                        if let (false, Some(started)) = (suppress_envoy_headers, upstream_started) {
                            headers.replace(
                                b"x-envoy-upstream-service-time",
                                started.elapsed().as_millis().to_string().as_bytes(),
                            );
                        }
                        driver.headers(Direction::Response, headers, end);
                    }
                    Ok(Err(Failure::Connect)) | Err(_) => {
                        let cluster = outcome.cluster.as_deref().unwrap_or_default();
                        listener.stats.add(format!("cluster.{cluster}.upstream_cx_connect_fail"), 1);
                        outcome.details = Some("upstream_reset_before_response_started{connection_failure}".into());
                        driver.router_reply(503, "upstream connect error or disconnect/reset before headers. reset reason: connection failure");
                    }
                    Ok(Err(Failure::ResetBeforeHeaders)) => {
                        outcome.details = Some("upstream_reset_before_response_started{connection_termination}".into());
                        driver.router_reply(503, "upstream connect error or disconnect/reset before headers. reset reason: connection termination");
                    }
                }
            }
            _ = until(upstream_deadline) => {
                upstream_deadline = None;
                upstream_pending = None;
                upstream_body = None;
                if let Some(task) = upstream_task.take() {
                    task.abort();
                }
                outcome.details = Some("upstream_response_timeout".into());
                driver.router_reply(504, "upstream request timeout");
            }
            frame = next_frame(&mut upstream_response) => {
                if driver.feed(Direction::Response, frame, &mut upstream_response).is_err() {
                    outcome.details = Some("upstream_reset_after_response_started".into());
                    driver.reset();
                    if let Some(tx) = downstream.take() {
                        let _ = tx.send(Err("upstream reset".into()));
                    }
                }
            }
            _ = response_closed(&mut respond) => {
                outcome.details = Some("downstream_remote_disconnect".into());
                driver.reset();
            }
            _ = closed(&downstream) => {
                outcome.details = Some("downstream_remote_disconnect".into());
                driver.reset();
            }
        }
    }
    if let Some(task) = upstream_task {
        task.abort();
    }
    let status = outcome
        .status
        .map_or_else(|| "0".to_owned(), |s| s.to_string());
    let prefix = &listener.config.stat_prefix;
    listener
        .stats
        .add(format!("http.{prefix}.downstream_rq_total"), 1);
    if let Some(s) = outcome.status {
        listener
            .stats
            .add(format!("http.{prefix}.downstream_rq_{}xx", s / 100), 1);
    }
    if listener.config.access_log.is_empty() {
        if !listener.access_log {
            return;
        }
        // No access log configured: the gateway's own line.
        println!(
            "[{}] \"{} {} {}\" {} {} {} {} {} \"{}\" \"{}\" \"{}\" worker={}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis()),
            headers.get(":method").unwrap_or_default(),
            headers.get(":path").unwrap_or_default(),
            protocol,
            status,
            outcome.details.as_deref().unwrap_or("-"),
            outcome.bytes_received,
            outcome.bytes_sent,
            started.elapsed().as_millis(),
            headers.get("x-request-id").unwrap_or_default(),
            headers.get(":authority").unwrap_or_default(),
            outcome
                .upstream
                .map_or_else(|| "-".to_owned(), |a| a.to_string()),
            listener.worker,
        );
        return;
    }
    // Envoy keeps a wasm filter's properties under `wasm.<path>`.
    let filter_state = |key: &str| -> Option<Vec<u8>> {
        let path = key.strip_prefix("wasm.")?;
        driver.filter_state(path.as_bytes())
    };
    // Envoy's access log reads the connection manager's own request header map
    // (`FilterManager::log`, source/common/http/filter_manager.cc, hands the loggers
    // `requestHeaders()`), which the filters and then the router (`finalizeRequestHeaders`,
    // source/common/router/router.cc) edit in place: `%REQ()%` shows the request as
    // forwarded, or as the filters left it when it went no further, never as it arrived.
    let request = forwarded
        .or_else(|| driver.request_headers())
        .unwrap_or(headers);
    let entry = super::access_log::Entry {
        start: started_at,
        request: &request,
        response: outcome.response_headers.as_ref(),
        status: outcome.status.unwrap_or(0),
        details: outcome.details.as_deref(),
        bytes_received: outcome.bytes_received,
        bytes_sent: outcome.bytes_sent,
        duration_ms: started.elapsed().as_millis(),
        protocol: &protocol,
        upstream: outcome.upstream,
        filter_state: &filter_state,
    };
    for format in &listener.config.access_log {
        // Printed unless the gateway was told not to (`--no-access-log`), kept either way.
        let line = format.render(&entry);
        if listener.access_log {
            print!("{line}");
        }
        listener.shared.access_log_line(&line);
    }
}
