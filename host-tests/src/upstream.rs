//! Sends a callout over a real socket to its cluster's loopback endpoint (HTTP/1.1, or HTTP/2
//! with prior knowledge when the cluster says so) and turns the result into what Envoy would
//! report: the response, a synthesized 503 (connect failure) / 504 (timeout), or a reset.

use crate::client::{ClientBody, Failure, Pool};
use crate::headers::HeaderMap;
use crate::plugin::Cluster;
use crate::vm::{CalloutOutcome, CalloutRequest};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use std::time::Duration;

/// Builds the `http` request for a callout (pseudo-headers become the URI and `host`).
pub(crate) fn to_http_request(
    request: &CalloutRequest,
    http2: bool,
) -> Option<http::Request<ClientBody>> {
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
    let body = Full::new(Bytes::from(request.body.clone()))
        .map_err(|never| match never {})
        .boxed_unsync();
    builder.body(body).ok()
}

/// Converts a response head into Envoy's header list (`:status` first).
pub(crate) fn response_headers(status: http::StatusCode, headers: &http::HeaderMap) -> HeaderMap {
    let mut map = HeaderMap::from([(":status", status.as_u16().to_string())]);
    for (k, v) in HeaderMap::from_http(headers).entries() {
        map.add(k, v);
    }
    map
}

async fn exchange(pool: &Pool, cluster: &Cluster, request: &CalloutRequest) -> CalloutOutcome {
    let Some(http_request) = to_http_request(request, cluster.http2) else {
        return CalloutOutcome::connect_failure();
    };
    let response = match pool.send(cluster, http_request).await {
        Ok(response) => response,
        Err(Failure::Connect) => return CalloutOutcome::connect_failure(),
        Err(Failure::ResetBeforeHeaders) => {
            return CalloutOutcome::generated_reset_before_headers();
        }
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

/// Performs the callout (on a `LocalSet`); its own `timeout` (if any) yields Envoy's 504.
pub(crate) async fn send_callout(
    pool: &Pool,
    cluster: &Cluster,
    request: &CalloutRequest,
) -> CalloutOutcome {
    match request.timeout {
        Some(limit) => tokio::time::timeout(limit, exchange(pool, cluster, request))
            .await
            .unwrap_or_else(|_| CalloutOutcome::timeout()),
        None => exchange(pool, cluster, request).await,
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
    let pool = Pool::default();
    tokio::task::LocalSet::new().block_on(&runtime, async {
        tokio::time::timeout(cap, send_callout(&pool, cluster, request))
            .await
            .unwrap_or_else(|_| CalloutOutcome::timeout())
    })
}
