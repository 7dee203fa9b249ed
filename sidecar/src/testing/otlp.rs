//! An OTLP/HTTP trace receiver on loopback (feature `testing`): what an exporter sends,
//! decoded, for tests that follow a trace into the sidecar — its own, and the end-to-end
//! tests that follow a request through a gateway.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test helper: a receiver that cannot bind or a poisoned lock fails the test loudly"
)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
pub use opentelemetry_proto::tonic::trace::v1::Span as OtlpSpan;
pub use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An OTLP/HTTP receiver on loopback: decodes every `POST /v1/traces` (protobuf) and keeps
/// the spans with their resource's `service.name`.
pub struct OtlpReceiver {
    addr: std::net::SocketAddr,
    spans: Arc<Mutex<Vec<(String, OtlpSpan)>>>,
    /// Requests it could not take (wrong path, content type or body).
    refused: Arc<Mutex<Vec<String>>>,
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the receiver");
        let addr = listener.local_addr().expect("addr");
        let spans = Arc::new(Mutex::new(Vec::new()));
        let refused = Arc::new(Mutex::new(Vec::new()));
        let (kept, bad) = (Arc::clone(&spans), Arc::clone(&refused));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (kept, bad) = (Arc::clone(&kept), Arc::clone(&bad));
                let service =
                    hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let (kept, bad) = (Arc::clone(&kept), Arc::clone(&bad));
                        async move {
                            let status = Self::take(req, &kept).await.map_or_else(
                                |why| {
                                    bad.lock().unwrap().push(why);
                                    StatusCode::BAD_REQUEST
                                },
                                |()| StatusCode::OK,
                            );
                            let mut response = Response::new(Full::new(Bytes::new()));
                            *response.status_mut() = status;
                            response.headers_mut().insert(
                                "content-type",
                                hyper::header::HeaderValue::from_static("application/x-protobuf"),
                            );
                            Ok::<_, std::convert::Infallible>(response)
                        }
                    });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        OtlpReceiver {
            addr,
            spans,
            refused,
        }
    }

    async fn take(
        req: Request<hyper::body::Incoming>,
        kept: &Mutex<Vec<(String, OtlpSpan)>>,
    ) -> Result<(), String> {
        let content_type = req
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        if req.uri().path() != "/v1/traces" || content_type != "application/x-protobuf" {
            return Err(format!("{} {} ({content_type})", req.method(), req.uri()));
        }
        let body = req.into_body().collect().await.map_err(|e| e.to_string())?;
        let export =
            ExportTraceServiceRequest::decode(body.to_bytes()).map_err(|e| e.to_string())?;
        let mut kept = kept.lock().unwrap();
        for resource in export.resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref())
                .map(|v| text(v.value.as_ref()))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    kept.push((service.clone(), span));
                }
            }
        }
        Ok(())
    }

    /// What it could not take (wrong path, content type or body): a test expects none.
    pub fn refused(&self) -> Vec<String> {
        self.refused.lock().unwrap().clone()
    }

    /// The base URL an exporter is given (`--otlp-endpoint`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The spans received but those of the admin API (the test's own polling), once there
    /// are at least `n` (bounded: fails after 20 s).
    pub async fn wait_for(&self, n: usize) -> Vec<(String, OtlpSpan)> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let spans: Vec<_> = self
                .spans
                .lock()
                .unwrap()
                .iter()
                .filter(|(_, s)| s.name != "admin")
                .cloned()
                .collect();
            if spans.len() >= n {
                return spans;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} of {n} spans arrived: {:#?}; refused: {:?}",
                spans.len(),
                spans.iter().map(|(_, s)| &s.name).collect::<Vec<_>>(),
                self.refused.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// An attribute value as text (numbers and booleans in their usual spelling).
pub fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

pub fn attributes(span: &OtlpSpan) -> HashMap<String, String> {
    span.attributes
        .iter()
        .map(|a| {
            (
                a.key.clone(),
                text(a.value.as_ref().and_then(|v| v.value.as_ref())),
            )
        })
        .collect()
}

/// Bytes as lower-case hex (OTLP ids are bytes, trace headers spell them in hex).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
