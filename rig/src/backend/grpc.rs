//! The demo backend's gRPC service, `pay.Payments`, and a client for it. Hand-written (a
//! `prost` message and tonic's server and client plumbing, no protoc), served by the backend
//! on its HTTP port over h2c, and counted in the same [`Stats`](super::Stats) as the HTTP
//! services.
//!
//! Every method takes and answers one [`Text`]. `Charge` (and `Hold`, the same charge under a
//! rule of its own) charges per caller (`x-user-id` metadata) and `idempotency-key` as `POST
//! /payments` does; `Attach` attaches the tool named by the text to the agent named in
//! `x-agent-id`, as `POST /agents/{agent}/tools` does. The HTTP services' knobs are metadata
//! here: `x-demo-work-ms`, `x-demo-seq`, `x-fencing-token`. `Installments` is `Charge` as a
//! server stream: a receipt message for each of [`INSTALLMENTS`] parts of its work, then the
//! charge booked and the stream ended `OK`. A text of `fail` ends the call `INTERNAL` and
//! `missing` ends it `NOT_FOUND`, both after the work (and a stream's receipts) and without
//! booking it; any other method is `UNIMPLEMENTED`.

use super::{Backend, Charge, ToolAttach, work_time};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tonic::Status;
use tonic::codec::ProstCodec;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::{BoxFuture, Context, Poll, Service, http};
use tonic::metadata::{MetadataKey, MetadataValue};
use tonic::transport::Channel;

/// The service's name: its methods are `/pay.Payments/<Method>`.
pub const SERVICE: &str = "pay.Payments";

/// `message Text { string text = 1; }`, the service's one message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Text {
    #[prost(string, tag = "1")]
    pub text: String,
}

/// Receipts an `Installments` stream sends before it ends.
pub const INSTALLMENTS: usize = 4;

/// The service, on the backend's ledger.
#[derive(Clone)]
pub struct Payments {
    backend: Arc<Backend>,
}

impl Payments {
    pub fn new(backend: Arc<Backend>) -> Self {
        Payments { backend }
    }
}

impl tonic::server::NamedService for Payments {
    const NAME: &'static str = SERVICE;
}

/// What a method does.
#[derive(Clone, Copy)]
enum Work {
    Charge,
    Attach,
}

/// One unary method on the backend.
struct Method {
    backend: Arc<Backend>,
    work: Work,
}

/// The text a call asked to fail with, as its status.
fn failure(text: &str) -> Option<Status> {
    match text {
        "fail" => Some(Status::internal("boom")),
        "missing" => Some(Status::not_found("no such account: 100% gone")),
        _ => None,
    }
}

fn refused(stale: super::StaleFence) -> Status {
    Status::aborted(format!(
        "stale fencing token: {} is older than {} already written",
        stale.fence, stale.highest
    ))
}

impl tonic::server::UnaryService<Text> for Method {
    type Response = Text;
    type Future = BoxFuture<tonic::Response<Text>, Status>;

    fn call(&mut self, request: tonic::Request<Text>) -> Self::Future {
        let backend = Arc::clone(&self.backend);
        let work = self.work;
        Box::pin(async move {
            let headers = request.metadata().clone().into_headers();
            let text = request.into_inner().text;
            let answer = match work {
                Work::Charge => {
                    let charging = Charge::begin(&backend, &headers);
                    tokio::time::sleep(work_time(&headers, backend.timings.payment)).await;
                    if let Some(status) = failure(&text) {
                        return Err(status);
                    }
                    let key = charging.key.clone();
                    let id = charging.book().map_err(refused)?;
                    format!("charged {text} for {key}: payment {id}")
                }
                Work::Attach => {
                    let agent = super::header(&headers, "x-agent-id").unwrap_or_default();
                    let attaching = ToolAttach::begin(&backend, agent.clone(), &headers);
                    tokio::time::sleep(work_time(&headers, backend.timings.attach)).await;
                    if let Some(status) = failure(&text) {
                        return Err(status);
                    }
                    let tools = attaching.write(text).map_err(refused)?;
                    format!("{agent} has {}", tools.join(","))
                }
            };
            Ok(tonic::Response::new(Text { text: answer }))
        })
    }
}

/// `Installments`: receipts streamed while the work runs, the status in the trailers.
struct Installments {
    backend: Arc<Backend>,
}

impl tonic::server::ServerStreamingService<Text> for Installments {
    type Response = Text;
    type ResponseStream = ReceiverStream<Result<Text, Status>>;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<Text>) -> Self::Future {
        let backend = Arc::clone(&self.backend);
        Box::pin(async move {
            let headers = request.metadata().clone().into_headers();
            let text = request.into_inner().text;
            let (send, receipts) = tokio::sync::mpsc::channel(INSTALLMENTS + 1);
            // The work outlives this future (it answers with the stream): a task of its own,
            // dropped with the stream when the client goes away (its sends fail).
            tokio::spawn(async move {
                let charging = Charge::begin(&backend, &headers);
                let part = work_time(&headers, backend.timings.payment) / INSTALLMENTS as u32;
                for n in 1..=INSTALLMENTS {
                    tokio::time::sleep(part).await;
                    let receipt = Text {
                        text: format!("installment {n} of {text}"),
                    };
                    if send.send(Ok(receipt)).await.is_err() {
                        return;
                    }
                }
                let end = match failure(&text) {
                    Some(status) => Err(status),
                    None => charging.book().map_err(refused).map(|id| Text {
                        text: format!("payment {id}"),
                    }),
                };
                let _ = send.send(end).await;
            });
            Ok(tonic::Response::new(ReceiverStream::new(receipts)))
        })
    }
}

impl<B> Service<http::Request<B>> for Payments
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::BoxBody>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let backend = Arc::clone(&self.backend);
        let path = request.uri().path().to_owned();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Text, Text>::default());
            let name = path
                .strip_prefix('/')
                .and_then(|p| p.strip_prefix(SERVICE))
                .and_then(|p| p.strip_prefix('/'));
            Ok(match name {
                Some("Charge" | "Hold") => {
                    let work = Work::Charge;
                    grpc.unary(Method { backend, work }, request).await
                }
                Some("Attach") => {
                    let work = Work::Attach;
                    grpc.unary(Method { backend, work }, request).await
                }
                Some("Installments") => {
                    grpc.server_streaming(Installments { backend }, request)
                        .await
                }
                _ => Status::unimplemented(path).into_http(),
            })
        })
    }
}

/// A client connection (h2c) to `url` (`http://host:port`), bounded by `within`.
pub async fn connect(url: String, within: Duration) -> anyhow::Result<Channel> {
    Ok(Channel::from_shared(url)?
        .connect_timeout(within)
        .connect()
        .await?)
}

/// A request carrying `text` and `metadata`, its deadline sent as `grpc-timeout`.
fn request(
    text: &str,
    metadata: &[(String, String)],
    deadline: Duration,
) -> Result<tonic::Request<Text>, Box<Status>> {
    let mut request = tonic::Request::new(Text { text: text.into() });
    for (name, value) in metadata {
        let (Ok(name), Ok(value)) = (
            MetadataKey::from_bytes(name.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) else {
            return Err(Box::new(Status::invalid_argument(format!(
                "metadata {name}: {value}"
            ))));
        };
        request.metadata_mut().insert(name, value);
    }
    request.set_timeout(deadline);
    Ok(request)
}

/// One unary call of `method` with `text` and `metadata`, bounded by `deadline` (sent as
/// `grpc-timeout` and enforced here): the answer's text, or the status it ended with.
pub async fn call(
    channel: Channel,
    method: &str,
    text: &str,
    metadata: &[(String, String)],
    deadline: Duration,
) -> Result<String, Box<Status>> {
    let (mut client, request, path) = prepare(channel, method, text, metadata, deadline)?;
    let response = within(deadline, async {
        ready(&mut client).await?;
        client
            .unary::<Text, Text, _>(request, path, ProstCodec::default())
            .await
    })
    .await?;
    Ok(response.into_inner().text)
}

/// Opens a server stream of `method` with `text` and `metadata`, bounded by `deadline` (sent
/// as `grpc-timeout`): the stream to read messages and the final status from.
pub async fn open_stream(
    channel: Channel,
    method: &str,
    text: &str,
    metadata: &[(String, String)],
    deadline: Duration,
) -> Result<tonic::Streaming<Text>, Box<Status>> {
    let (mut client, request, path) = prepare(channel, method, text, metadata, deadline)?;
    let response = within(deadline, async {
        ready(&mut client).await?;
        client
            .server_streaming::<Text, Text, _>(request, path, ProstCodec::default())
            .await
    })
    .await?;
    Ok(response.into_inner())
}

/// A call's client, request and method path.
fn prepare(
    channel: Channel,
    method: &str,
    text: &str,
    metadata: &[(String, String)],
    deadline: Duration,
) -> Result<
    (
        tonic::client::Grpc<Channel>,
        tonic::Request<Text>,
        http::uri::PathAndQuery,
    ),
    Box<Status>,
> {
    let request = request(text, metadata, deadline)?;
    let path = http::uri::PathAndQuery::try_from(format!("/{SERVICE}/{method}"))
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok((tonic::client::Grpc::new(channel), request, path))
}

async fn ready(client: &mut tonic::client::Grpc<Channel>) -> Result<(), Status> {
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))
}

/// `call` bounded by `deadline`: the status it ended with, or the client's own give-up.
async fn within<T>(
    deadline: Duration,
    call: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, Box<Status>> {
    match tokio::time::timeout(deadline, call).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(status)) => Err(Box::new(status)),
        Err(_) => Err(Box::new(Status::deadline_exceeded("the client gave up"))),
    }
}

/// A metadata value of a status (a refusal's pushback, `idempotent-replayed`).
pub fn metadata_of<'s>(status: &'s Status, name: &str) -> Option<&'s str> {
    status.metadata().get(name).and_then(|v| v.to_str().ok())
}

/// The wait hint of a refusal: gRPC retry pushback, in milliseconds (gRFC A6).
pub fn pushback_ms(status: &Status) -> Option<u64> {
    metadata_of(status, "grpc-retry-pushback-ms").and_then(|v| v.parse().ok())
}

/// Whether a status is the gateway's answer from a stored outcome (`idempotent-replayed`).
pub fn replayed(status: &Status) -> bool {
    metadata_of(status, "idempotent-replayed") == Some("true")
}
