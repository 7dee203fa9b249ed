//! gRPC through the host as Envoy runs it: the fixture plugin's idiomatic Rust SDK calls and
//! streams to a real tonic server over HTTP/2 (envoy `source/extensions/common/wasm/context.cc`
//! `grpcCall`/`grpcStream`/`onGrpc*`, `source/common/grpc/async_client_impl.cc`), and local
//! replies to a real tonic client as Envoy's `sendLocalReply` makes them for gRPC requests
//! (`source/common/http/utility.cc`, `source/common/grpc/status.cc`).

use crate::util::{eventually, http};
use idemgate_host::gateway::bootstrap::{Bootstrap, ClusterSpec, FilterSpec, LISTENER};
use idemgate_host::gateway::{Gateway, GatewayOptions};
use idemgate_host::testing::{Request, TestHost};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::codec::ProstCodec;
use tonic::codegen::{BoxFuture, Context, Poll, Service, http as thttp};
use tonic::{Code, Status};

/// `echo.Text { string text = 1; }`, the one message of the test service.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Text {
    #[prost(string, tag = "1")]
    pub text: String,
}

/// The request heads the server saw (what the gateway put on the wire).
type Seen = Arc<Mutex<Vec<thttp::HeaderMap>>>;

/// `echo.Echo`, hand-written as tonic's generated code would be: `Unary` echoes the text and
/// the plugin's metadata, `Fail` answers NOT_FOUND, `Slow` answers after 3 s, `Chat` (bidi)
/// sends initial metadata, echoes each message, and ends with a trailer.
#[derive(Clone)]
struct Echo {
    seen: Seen,
}

impl tonic::server::NamedService for Echo {
    const NAME: &'static str = "echo.Echo";
}

struct Unary;

impl tonic::server::UnaryService<Text> for Unary {
    type Response = Text;
    type Future = BoxFuture<tonic::Response<Text>, Status>;

    fn call(&mut self, request: tonic::Request<Text>) -> Self::Future {
        Box::pin(async move {
            let meta = request.metadata();
            let value = |k: &str| {
                meta.get(k)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_owned()
            };
            let raw = meta
                .get_bin("x-raw-bin")
                .and_then(|v| v.to_bytes().ok())
                .map(|b| format!("{:?}", b.as_ref()))
                .unwrap_or_default();
            Ok(tonic::Response::new(Text {
                text: format!(
                    "{} meta={} raw={raw}",
                    request.get_ref().text,
                    value("x-meta")
                ),
            }))
        })
    }
}

struct Fail;

impl tonic::server::UnaryService<Text> for Fail {
    type Response = Text;
    type Future = BoxFuture<tonic::Response<Text>, Status>;

    fn call(&mut self, _: tonic::Request<Text>) -> Self::Future {
        Box::pin(async { Err(Status::not_found("no such thing: 100% gone")) })
    }
}

struct Slow;

impl tonic::server::UnaryService<Text> for Slow {
    type Response = Text;
    type Future = BoxFuture<tonic::Response<Text>, Status>;

    fn call(&mut self, request: tonic::Request<Text>) -> Self::Future {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            Ok(tonic::Response::new(request.into_inner()))
        })
    }
}

type TextStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<Text, Status>> + Send>>;

struct Chat;

impl tonic::server::StreamingService<Text> for Chat {
    type Response = Text;
    type ResponseStream = TextStream;
    type Future = BoxFuture<tonic::Response<TextStream>, Status>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Text>>) -> Self::Future {
        Box::pin(async move {
            let mut inbound = request.into_inner();
            let outbound = async_stream(move |tx| async move {
                // Bounded by the client's messages (the fixture sends a few, then closes).
                while let Ok(Some(text)) = inbound.message().await {
                    let reply = Text {
                        text: format!("echo:{}", text.text),
                    };
                    if tx.send(Ok(reply)).await.is_err() {
                        return;
                    }
                }
                let mut trailers = tonic::metadata::MetadataMap::new();
                trailers.insert("x-server-trailer", "bye".parse().unwrap());
                let _ = tx
                    .send(Err(Status::with_metadata(Code::Ok, "", trailers)))
                    .await;
            });
            let mut response = tonic::Response::new(outbound);
            response
                .metadata_mut()
                .insert("x-server-meta", "hello".parse().unwrap());
            Ok(response)
        })
    }
}

/// A stream fed by a task through a channel.
fn async_stream<F, Fut>(produce: F) -> TextStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Text, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(produce(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

impl<B> Service<thttp::Request<B>> for Echo
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = thttp::Response<tonic::body::BoxBody>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: thttp::Request<B>) -> Self::Future {
        self.seen.lock().unwrap().push(request.headers().clone());
        let mut seen_authority = request.headers().clone();
        if let Some(authority) = request.uri().authority() {
            seen_authority.insert("x-seen-authority", authority.as_str().parse().unwrap());
        }
        *self.seen.lock().unwrap().last_mut().unwrap() = seen_authority;
        let path = request.uri().path().to_owned();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Text, Text>::default());
            Ok(match path.as_str() {
                "/echo.Echo/Unary" => grpc.unary(Unary, request).await,
                "/echo.Echo/Fail" => grpc.unary(Fail, request).await,
                "/echo.Echo/Slow" => grpc.unary(Slow, request).await,
                "/echo.Echo/Chat" => grpc.streaming(Chat, request).await,
                _ => Status::unimplemented(path).into_http(),
            })
        })
    }
}

/// A tonic server on a loopback port, on its own runtime thread.
fn grpc_server() -> (SocketAddr, Seen) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    let seen = Seen::default();
    let service = Echo {
        seen: Arc::clone(&seen),
    };
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
    });
    (address, seen)
}

fn grpc_filter() -> FilterSpec {
    FilterSpec::fixture("grpc").root_id("grpc_root")
}

/// A gateway with the gRPC fixture in front of `backend`, and `grpc_backend` (HTTP/2) at `grpc`.
fn gateway(backend: SocketAddr, grpc: SocketAddr, route_timeout: Duration) -> Gateway {
    Bootstrap::new(backend)
        .route_timeout(route_timeout)
        .filter(grpc_filter())
        .cluster(ClusterSpec::at("grpc_backend", grpc).http2(100))
        .start_with(GatewayOptions {
            concurrency: 1,
            ..GatewayOptions::default()
        })
        .unwrap()
}

fn ask(gateway: &Gateway, mode: &str, text: &str) -> String {
    let reply = http(
        gateway.listener_address(LISTENER).unwrap(),
        "GET",
        "/",
        &[("x-grpc", mode), ("x-text", text)],
        "",
    );
    assert_eq!(reply.status, 200, "{mode}: {reply:?}");
    reply.body
}

/// Every gRPC item against one live gateway and one tonic server (one worker, so the last
/// items also prove the worker still serves after the earlier ones).
#[test]
fn grpc_calls_and_streams_reach_a_real_server_and_come_back_as_envoy_delivers_them() {
    let (server, seen) = grpc_server();
    let (backend, _) = crate::util::upstream(Some("backend"));
    let gateway = gateway(backend, server, Duration::from_secs(10));

    // Unary success: only proxy_on_grpc_receive, the response message readable (buffer 5).
    let body = ask(&gateway, "unary", "hi");
    assert_eq!(body, "call=5\nreply=hi meta=m1 raw=[0, 1, 2]\n");
    let head = seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(head.get("content-type").unwrap(), "application/grpc");
    assert_eq!(head.get("te").unwrap(), "trailers");
    assert_eq!(head.get("grpc-timeout").unwrap(), "5000m");
    assert_eq!(head.get("x-seen-authority").unwrap(), "grpc_backend");

    // A serialized GrpcService as the upstream: its authority goes on the wire.
    let body = ask(&gateway, "unary-service", "svc");
    assert!(
        body.ends_with("reply=svc meta=m1 raw=[0, 1, 2]\n"),
        "{body}"
    );
    let head = seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(head.get("x-seen-authority").unwrap(), "echo.internal");

    // Unary failure: proxy_on_grpc_close with the status, the message via get_status,
    // percent-decoded.
    let body = ask(&gateway, "unary-error", "x");
    assert!(
        body.ends_with("close=5 status=5 message=no such thing: 100% gone\n"),
        "{body}"
    );

    // A stream: initial metadata, one callback per message, trailing metadata, close.
    let body = ask(&gateway, "stream", "one,two");
    assert_eq!(
        body,
        "stream=6\ninitial_metadata=hello\nmessage=echo:one\nmessage=echo:two\n\
         trailing_metadata=bye\nclose=0 message=\n"
    );

    // Cancel: Ok, no callback ever (the plugin answered at once; a late callback would log).
    let body = ask(&gateway, "cancel", "late");
    assert!(body.starts_with("cancelled="), "{body}");

    // A plain name that is no cluster: ParseFailure, which the SDK returns as an error.
    let body = ask(&gateway, "unknown-cluster", "");
    assert_eq!(body, "call_error=ParseFailure\n");

    // The worker still serves (before the fix, a gRPC call trapped the VM: 503 after).
    let body = ask(&gateway, "unary", "again");
    assert!(body.contains("reply=again"), "{body}");

    // Nothing arrived for the cancelled call, even after the server would have answered.
    std::thread::sleep(Duration::from_millis(3200));
    let late = gateway
        .shared()
        .logs()
        .into_iter()
        .filter(|l| l.message.contains("panicked") || l.message.contains("failed"))
        .count();
    assert_eq!(late, 0, "{:?}", gateway.shared().logs());
    gateway.shutdown();
}

/// Plugin log lines carry Envoy's prefix (envoy `source/extensions/common/wasm/context.cc`
/// `Context::log`, proxy-wasm-cpp-host `PluginBase::makeLogPrefix` /
/// `ContextBase::makeRootLogPrefix`): plugin name, root id and vm id from a stream context,
/// root id and vm id from the root.
#[test]
fn plugin_log_lines_carry_envoys_context_prefix() {
    let host = TestHost::new().cluster("grpc_backend");
    let vm = host
        .fixture("grpc")
        .name("grpc_plugin")
        .root_id("grpc_root")
        .vm_id("grpc_vm")
        .boot()
        .unwrap();
    vm.stream()
        .send_request(Request::get("/").header("x-grpc", "pass"));
    let lines: Vec<String> = host
        .logs()
        .iter()
        .filter(|l| l.message.starts_with("grpc fixture"))
        .map(|l| l.envoy_line())
        .collect();
    assert_eq!(
        lines,
        [
            "wasm log grpc_root grpc_vm: grpc fixture configured",
            "wasm log grpc_plugin grpc_root grpc_vm: grpc fixture request",
        ]
    );
}

/// A call's timeout as Envoy enforces it (its router's 504 reaches the plugin as close 14
/// "upstream request timeout"), on the virtual clock; the transport is told to cancel.
#[test]
fn a_grpc_call_past_its_timeout_closes_with_unavailable() {
    let host = TestHost::new().cluster("grpc_backend");
    let vm = host.fixture("grpc").root_id("grpc_root").boot().unwrap();
    let stream = vm.stream();
    stream.send_request(
        Request::get("/")
            .header("x-grpc", "timeout")
            .header("x-text", "t"),
    );
    assert!(stream.local_reply().is_none());
    host.advance(Duration::from_millis(99));
    assert!(stream.local_reply().is_none());
    host.advance(Duration::from_millis(1));
    let reply = stream.local_reply().expect("the plugin answered on close");
    assert_eq!(
        String::from_utf8_lossy(&reply.body),
        "call=5\nclose=14 status=14 message=upstream request timeout\n"
    );
    let actions = vm.with(|vm| vm.take_grpc_actions());
    assert!(
        matches!(
            actions.as_slice(),
            [
                idemgate_host::GrpcAction::Start(_),
                idemgate_host::GrpcAction::Cancel { token: 5 }
            ]
        ),
        "{actions:?}"
    );
}

/// A real tonic client against the gateway: the plugin's gRPC replies, its HTTP replies to a
/// gRPC request, and the router's own 503/504 come back trailers-only with `grpc-status`.
#[test]
fn local_replies_to_grpc_clients_are_trailers_only_grpc_statuses() {
    // A backend that accepts and never answers (route timeout → 504).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_address = silent.local_addr().unwrap();
    let (server, _) = grpc_server();
    let gateway = gateway(silent_address, server, Duration::from_millis(300));
    let address = gateway.listener_address(LISTENER).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let call = |mode: &'static str| {
        runtime.block_on(async move {
            let channel = tonic::transport::Channel::from_shared(format!("http://{address}"))
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut client = tonic::client::Grpc::new(channel);
            client.ready().await.unwrap();
            let mut request = tonic::Request::new(Text { text: "x".into() });
            request
                .metadata_mut()
                .insert("x-grpc", mode.parse().unwrap());
            client
                .unary::<Text, Text, _>(
                    request,
                    thttp::uri::PathAndQuery::from_static("/echo.Echo/Unary"),
                    ProstCodec::default(),
                )
                .await
                .map(tonic::Response::into_inner)
                .map_err(Box::new)
        })
    };

    // send_grpc_response: the plugin's status and message (percent-encoded on the wire,
    // decoded by the client), and its metadata.
    let status = call("grpc-reply").unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert_eq!(status.message(), "denied: 100% ~sure");
    assert_eq!(status.metadata().get("x-reason").unwrap(), "policy");

    // send_http_response(403) to a gRPC request: 403 maps to PERMISSION_DENIED.
    let status = call("http-reply").unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert_eq!(status.message(), "forbidden\n");

    // The router's 504 (route timeout) to a gRPC client: UNAVAILABLE.
    let status = call("pass").unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "upstream request timeout");
    drop(silent);

    // The router's 503 (connect failure) to a gRPC client: UNAVAILABLE.
    let status = call("pass").unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().starts_with("upstream connect error"),
        "{status:?}"
    );

    // Over HTTP/1.1 with curl-like headers the same reply is visible on the wire.
    let reply = http(
        address,
        "POST",
        "/echo.Echo/Unary",
        &[
            ("content-type", "application/grpc"),
            ("x-grpc", "grpc-reply"),
        ],
        "",
    );
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("content-type").as_deref(),
        Some("application/grpc")
    );
    assert_eq!(reply.header("grpc-status").as_deref(), Some("7"));
    assert_eq!(
        reply.header("grpc-message").as_deref(),
        Some("denied: 100%25 %7Esure")
    );
    // No body: the reply's headers end the stream (Envoy's `encodeHeaders(..., end_stream =
    // true)`), which HTTP/2 encodes as END_STREAM on the HEADERS frame (trailers-only) and
    // Envoy's HTTP/1.1 codec (`source/common/http/http1/codec_impl.cc`, `encodeHeadersBase`)
    // as `content-length: 0`, not as an empty chunked body.
    assert_eq!(reply.header("content-length").as_deref(), Some("0"));
    assert_eq!(reply.header("transfer-encoding"), None);
    assert_eq!(reply.body, "");
    eventually("the gateway is idle", || true);
    gateway.shutdown();
}
