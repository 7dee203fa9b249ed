//! Carries a VM's gRPC actions to clusters over HTTP/2 (prior knowledge, as Envoy's gRPC
//! async client uses the cluster's HTTP/2 codec) and turns what comes back into
//! [`GrpcEvent`]s, as envoy `source/common/grpc/async_client_impl.cc` (`AsyncStreamImpl`)
//! reports them: initial metadata, one event per length-prefixed message, trailing metadata,
//! then the close with `grpc-status`/`grpc-message`. Runs on a worker's `LocalSet`.

use crate::client::{BoxError, Failure, Pool};
use crate::grpc::{Deframer, frame, percent_decode};
use crate::headers::HeaderMap;
use crate::local_reply::http_to_grpc_status;
use crate::plugin::{Cluster, Clusters};
use crate::vm::{GrpcAction, GrpcEvent, GrpcRequest};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use std::cell::RefCell;
use std::collections::HashMap;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

type FrameResult = Result<Frame<Bytes>, BoxError>;

/// The request body of one exchange: messages as the plugin sends them.
struct Outbound {
    rx: mpsc::UnboundedReceiver<FrameResult>,
}

impl Body for Outbound {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<FrameResult>> {
        self.get_mut().rx.poll_recv(cx)
    }
}

/// One exchange in flight: its request-body sender (until the request side ends) and task.
struct Exchange {
    outbound: Option<mpsc::UnboundedSender<FrameResult>>,
    task: tokio::task::JoinHandle<()>,
}

/// A worker's gRPC exchanges, by token, with their own HTTP/2 connection pool.
#[derive(Default)]
pub(crate) struct GrpcUpstream {
    pool: Rc<Pool>,
    exchanges: Rc<RefCell<HashMap<u32, Exchange>>>,
}

/// Where events for a token go (into the VM, then the worker's after-VM-call work).
pub(crate) type Deliver = Rc<dyn Fn(u32, GrpcEvent)>;

impl GrpcUpstream {
    /// Carries out actions in order: starts exchanges, sends messages, half-closes, cancels.
    pub(crate) fn carry_out(
        &self,
        actions: Vec<GrpcAction>,
        clusters: &Clusters,
        deliver: &Deliver,
    ) {
        for action in actions {
            match action {
                GrpcAction::Start(request) => self.start(request, clusters, deliver),
                GrpcAction::Send {
                    token,
                    message,
                    end_stream,
                } => {
                    let mut exchanges = self.exchanges.borrow_mut();
                    if let Some(exchange) = exchanges.get_mut(&token) {
                        if let Some(tx) = &exchange.outbound {
                            let _ = tx.send(Ok(Frame::data(Bytes::from(frame(&message)))));
                        }
                        if end_stream {
                            exchange.outbound = None;
                        }
                    }
                }
                GrpcAction::HalfClose { token } => {
                    if let Some(exchange) = self.exchanges.borrow_mut().get_mut(&token) {
                        exchange.outbound = None;
                    }
                }
                GrpcAction::Cancel { token } => {
                    if let Some(exchange) = self.exchanges.borrow_mut().remove(&token) {
                        // Dropping the request resets the HTTP/2 stream.
                        exchange.task.abort();
                    }
                }
            }
        }
    }

    fn start(&self, request: GrpcRequest, clusters: &Clusters, deliver: &Deliver) {
        let token = request.token;
        let mut cluster = clusters
            .get(&request.cluster)
            .cloned()
            .unwrap_or_else(|| Cluster::named(&request.cluster));
        cluster.http2 = true;
        let (tx, rx) = mpsc::unbounded_channel();
        if let Some(message) = &request.message {
            let _ = tx.send(Ok(Frame::data(Bytes::from(frame(message)))));
        }
        // A unary call's request side ends with its one message.
        let outbound = request.message.is_none().then_some(tx);
        let pool = Rc::clone(&self.pool);
        let exchanges = Rc::clone(&self.exchanges);
        let deliver = Rc::clone(deliver);
        let task = tokio::task::spawn_local(async move {
            let emit = |event: GrpcEvent| {
                if matches!(event, GrpcEvent::Close { .. }) {
                    exchanges.borrow_mut().remove(&token);
                }
                deliver(token, event);
            };
            exchange(&pool, &cluster, &request, Outbound { rx }, &emit).await;
        });
        self.exchanges
            .borrow_mut()
            .insert(token, Exchange { outbound, task });
    }
}

/// What the router of Envoy's async client answers when no response head arrives: a local
/// reply, which for a gRPC request is trailers-only with the mapped status.
fn local_reply_close(http_status: u32, message: &str) -> Vec<GrpcEvent> {
    let status = http_to_grpc_status(http_status);
    let trailers = HeaderMap::from([
        (":status", "200".to_owned()),
        ("content-type", "application/grpc".to_owned()),
        ("grpc-status", status.to_string()),
        ("grpc-message", message.to_owned()),
    ]);
    vec![
        GrpcEvent::InitialMetadata(HeaderMap::new()),
        GrpcEvent::TrailingMetadata(trailers),
        GrpcEvent::Close {
            status,
            message: message.to_owned(),
        },
    ]
}

/// The close an `AsyncStreamImpl` reports from trailers (or a trailers-only head).
fn close_from(trailers: &HeaderMap) -> GrpcEvent {
    GrpcEvent::Close {
        status: trailers
            .get("grpc-status")
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(2),
        message: String::from_utf8_lossy(&percent_decode(
            trailers.get_bytes("grpc-message").unwrap_or_default(),
        ))
        .into_owned(),
    }
}

/// Runs one exchange, emitting its events as they arrive; the last is always a close.
async fn exchange(
    pool: &Pool,
    cluster: &Cluster,
    request: &GrpcRequest,
    body: Outbound,
    emit: &dyn Fn(GrpcEvent),
) {
    let emit_all = |events: Vec<GrpcEvent>| events.into_iter().for_each(emit);
    let mut http = http::Request::new(body.boxed_unsync());
    *http.method_mut() = http::Method::POST;
    *http.version_mut() = http::Version::HTTP_2;
    let authority = request.headers.get(":authority").unwrap_or_default();
    let path = request.headers.get(":path").unwrap_or_default();
    if let Ok(uri) = format!("http://{authority}{path}").parse() {
        *http.uri_mut() = uri;
    }
    for (k, v) in request.headers.entries() {
        if k.first() == Some(&b':') {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(k),
            http::HeaderValue::from_bytes(v),
        ) {
            http.headers_mut().append(name, value);
        }
    }
    let response = match pool.send(cluster, http).await {
        Ok(response) => response,
        Err(Failure::Connect) => {
            return emit_all(local_reply_close(
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
            ));
        }
        Err(Failure::ResetBeforeHeaders) => {
            return emit_all(local_reply_close(
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
            ));
        }
    };
    let (parts, mut body) = response.into_parts();
    let head = crate::upstream::response_headers(parts.status, &parts.headers);
    let end_stream = body.is_end_stream();
    if parts.status != http::StatusCode::OK {
        // A trailers-only answer keeps its grpc-status; otherwise the HTTP status is mapped.
        if end_stream && head.get_bytes("grpc-status").is_some() {
            let close = close_from(&head);
            return emit_all(vec![
                GrpcEvent::InitialMetadata(HeaderMap::new()),
                GrpcEvent::TrailingMetadata(head),
                close,
            ]);
        }
        return emit_all(vec![
            GrpcEvent::InitialMetadata(HeaderMap::new()),
            GrpcEvent::TrailingMetadata(HeaderMap::new()),
            GrpcEvent::Close {
                status: http_to_grpc_status(u32::from(parts.status.as_u16())),
                message: String::new(),
            },
        ]);
    }
    if end_stream {
        let close = close_from(&head);
        return emit_all(vec![
            GrpcEvent::InitialMetadata(HeaderMap::new()),
            GrpcEvent::TrailingMetadata(head),
            close,
        ]);
    }
    emit(GrpcEvent::InitialMetadata(head));
    let internal = || GrpcEvent::Close {
        status: 13,
        message: String::new(),
    };
    let mut deframer = Deframer::default();
    // Bounded by the upstream's frames; each turn awaits one.
    loop {
        match body.frame().await {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => match deframer.push(&data) {
                    Ok(messages) => messages.into_iter().map(GrpcEvent::Message).for_each(emit),
                    Err(_) => return emit(internal()),
                },
                Err(frame) => {
                    let trailers = frame
                        .into_trailers()
                        .map(|t| HeaderMap::from_http(&t))
                        .unwrap_or_default();
                    let close = close_from(&trailers);
                    return emit_all(vec![GrpcEvent::TrailingMetadata(trailers), close]);
                }
            },
            // DATA with end_stream and no trailers: Unknown.
            None => {
                return emit_all(vec![
                    GrpcEvent::TrailingMetadata(HeaderMap::new()),
                    GrpcEvent::Close {
                        status: 2,
                        message: String::new(),
                    },
                ]);
            }
            // A reset: Internal.
            Some(Err(_)) => return emit(internal()),
        }
    }
}
