//! Sends a callout over a real socket to its cluster's loopback endpoint (HTTP/1.1, or HTTP/2
//! with prior knowledge when the cluster says so) and turns the result into what Envoy would
//! report: the response, a synthesized 503 (connect failure) / 504 (timeout), or a reset.

use crate::headers::HeaderMap;
use crate::plugin::Cluster;
use crate::vm::{CalloutOutcome, CalloutRequest};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::time::Duration;

/// Builds the `http` request for a callout (pseudo-headers become the URI and `host`).
pub(crate) fn to_http_request(
    request: &CalloutRequest,
    http2: bool,
) -> Option<http::Request<Full<Bytes>>> {
    let h = &request.headers;
    let method = h.get(":method")?;
    let path = h.get(":path")?;
    let authority = h.get(":authority")?;
    let uri = if http2 {
        format!("http://{authority}{path}")
    } else {
        path
    };
    let mut builder = http::Request::builder().method(method.as_str()).uri(uri);
    if !http2 {
        builder = builder.header(http::header::HOST, authority);
    }
    for (k, v) in h.entries() {
        if k.first() != Some(&b':') {
            builder = builder.header(k.as_slice(), v.as_slice());
        }
    }
    builder
        .body(Full::new(Bytes::from(request.body.clone())))
        .ok()
}

/// Converts a response head into Envoy's header list (`:status` first).
pub(crate) fn response_headers(status: http::StatusCode, headers: &http::HeaderMap) -> HeaderMap {
    let mut map = HeaderMap::from([(":status", status.as_u16().to_string())]);
    for (k, v) in HeaderMap::from_http(headers).entries() {
        map.add(k, v);
    }
    map
}

async fn exchange(cluster: &Cluster, request: &CalloutRequest) -> CalloutOutcome {
    let Some(address) = cluster.address else {
        return CalloutOutcome::connect_failure();
    };
    let Some(http_request) = to_http_request(request, cluster.http2) else {
        return CalloutOutcome::connect_failure();
    };
    let connect = tokio::time::timeout(
        cluster.connect_timeout,
        tokio::net::TcpStream::connect(address),
    )
    .await;
    let Ok(Ok(stream)) = connect else {
        return CalloutOutcome::connect_failure();
    };
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(stream);
    let response = if cluster.http2 {
        let Ok((mut sender, conn)) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await
        else {
            return CalloutOutcome::connect_failure();
        };
        tokio::spawn(conn);
        sender.send_request(http_request).await
    } else {
        let Ok((mut sender, conn)) = hyper::client::conn::http1::handshake(io).await else {
            return CalloutOutcome::connect_failure();
        };
        tokio::spawn(conn);
        sender.send_request(http_request).await
    };
    let Ok(response) = response else {
        return CalloutOutcome::generated_reset_before_headers();
    };
    let (parts, body) = response.into_parts();
    match body.collect().await {
        Ok(collected) => {
            let trailers = collected
                .trailers()
                .map(HeaderMap::from_http)
                .unwrap_or_default();
            CalloutOutcome::Response {
                headers: response_headers(parts.status, &parts.headers),
                body: collected.to_bytes().to_vec(),
                trailers,
            }
        }
        // A reset after the response started: Envoy's onFailure → (0, 0, 0).
        Err(_) => CalloutOutcome::Reset,
    }
}

/// Performs the callout; its own `timeout` (if any) yields Envoy's 504.
pub async fn send_callout(cluster: &Cluster, request: &CalloutRequest) -> CalloutOutcome {
    match request.timeout {
        Some(limit) => tokio::time::timeout(limit, exchange(cluster, request))
            .await
            .unwrap_or_else(|_| CalloutOutcome::timeout()),
        None => exchange(cluster, request).await,
    }
}

/// Blocking form for the deterministic API: a private current-thread runtime per call.
pub(crate) fn send_callout_blocking(
    cluster: &Cluster,
    request: &CalloutRequest,
    cap: Duration,
) -> CalloutOutcome {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(_) => return CalloutOutcome::connect_failure(),
    };
    runtime.block_on(async {
        tokio::time::timeout(cap, send_callout(cluster, request))
            .await
            .unwrap_or_else(|_| CalloutOutcome::timeout())
    })
}
