//! Clusters: one endpoint, HTTP/1.1 or HTTP/2, circuit breakers.

use super::socket_address;
use super::walk::{Message, Node};
use crate::plugin::Cluster;
use std::time::Duration;

const HTTP_OPTIONS_KEY: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";
pub(super) const HTTP_OPTIONS_TYPE: &str =
    "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// HTTP/2 options: `max_concurrent_streams` caps streams per connection until the server's
/// SETTINGS arrive; the rest tune flow control and keep-alive, which the gateway leaves to
/// its HTTP/2 client (accepted, no effect).
fn http2_options(options: &Node<'_>) -> Option<u32> {
    let h2 = options.message(
        &["max_concurrent_streams"],
        &[
            "initial_stream_window_size",
            "initial_connection_window_size",
            "connection_keepalive",
            "hpack_table_size",
        ],
    );
    h2.uint("max_concurrent_streams", u64::from(u32::MAX))
        .and_then(|n| u32::try_from(n).ok())
}

/// `typed_extension_protocol_options`: `(http2, max_concurrent_streams)` when set.
fn protocol_options(cluster: &Message<'_>) -> Option<(bool, Option<u32>)> {
    let options = cluster.get("typed_extension_protocol_options")?;
    let map = options.message(&[HTTP_OPTIONS_KEY], &[]);
    let (type_url, config) = map.get(HTTP_OPTIONS_KEY)?.any()?;
    if type_url != HTTP_OPTIONS_TYPE {
        config.issue(format!("expected {HTTP_OPTIONS_TYPE}, found {type_url}"));
        return None;
    }
    let explicit = config
        .message(&["explicit_http_config"], &[])
        .required("explicit_http_config")?
        .message(&["http_protocol_options", "http2_protocol_options"], &[]);
    match (
        explicit.get("http_protocol_options"),
        explicit.get("http2_protocol_options"),
    ) {
        (None, Some(h2)) => Some((true, http2_options(&h2))),
        (Some(h1), None) => {
            h1.message(&[], &[]);
            Some((false, None))
        }
        _ => {
            explicit.issue("set exactly one of http_protocol_options, http2_protocol_options");
            None
        }
    }
}

pub(super) fn cluster(index: usize, node: &Node<'_>) -> Option<Cluster> {
    let raw = node.message(
        &[
            "name",
            "type",
            "connect_timeout",
            "lb_policy",
            "dns_lookup_family",
            "load_assignment",
            "typed_extension_protocol_options",
            "circuit_breakers",
            "http2_protocol_options",
            "http_protocol_options",
        ],
        &["alt_stat_name"],
    );
    let name = raw
        .str("name")
        .map_or_else(|| format!("clusters[{index}]"), str::to_owned);
    if let Some(kind) = raw.get("type") {
        kind.choice(&["STATIC", "STRICT_DNS", "LOGICAL_DNS"]);
    }
    if let Some(lb) = raw.get("lb_policy") {
        lb.choice(&["ROUND_ROBIN"]);
    }
    if let Some(family) = raw.get("dns_lookup_family") {
        family.choice(&["V4_ONLY", "AUTO", "V4_PREFERRED"]);
    }
    let assignment = raw
        .required("load_assignment")?
        .message(&["endpoints"], &["cluster_name"]);
    let endpoints: Vec<Node<'_>> = assignment
        .list("endpoints")
        .iter()
        .flat_map(|e| e.message(&["lb_endpoints"], &[]).list("lb_endpoints"))
        .collect();
    let [endpoint] = endpoints.as_slice() else {
        assignment.issue_at("endpoints", "exactly one endpoint is supported");
        return None;
    };
    let address = endpoint
        .message(&["endpoint"], &[])
        .required("endpoint")?
        .message(&["address"], &[])
        .required("address")
        .and_then(|a| socket_address(&a));
    // Cluster-level protocol options are deprecated in Envoy but still accepted; they mean
    // what `explicit_http_config` means.
    let legacy_h2 = raw.get("http2_protocol_options");
    if let Some(h1) = raw.get("http_protocol_options") {
        h1.message(&[], &[]);
    }
    let typed = protocol_options(&raw);
    let (http2, max_concurrent_streams) = match (typed, legacy_h2) {
        (Some(_), Some(h2)) => {
            h2.issue(
                "set either http2_protocol_options or typed_extension_protocol_options, not both",
            );
            (true, None)
        }
        (Some(typed), None) => typed,
        (None, Some(h2)) => (true, http2_options(&h2)),
        (None, None) => (false, None),
    };
    let mut max_requests = 1024;
    if let Some(breakers) = raw.message("circuit_breakers", &["thresholds"], &[]) {
        for t in breakers.list("thresholds") {
            // The gateway never retries and opens connections instead of queueing for
            // them: those limits are validated but have nothing to bound.
            let thresholds = t.message(
                &[
                    "priority",
                    "max_requests",
                    "max_connections",
                    "max_pending_requests",
                    "max_retries",
                ],
                &["track_remaining"],
            );
            if let Some(p) = thresholds.get("priority") {
                p.choice(&["DEFAULT"]);
            }
            for limit in ["max_connections", "max_pending_requests", "max_retries"] {
                thresholds.uint(limit, u64::from(u32::MAX));
            }
            max_requests = thresholds
                .uint("max_requests", u64::from(u32::MAX))
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(1024);
        }
    }
    let connect_timeout = raw
        .duration("connect_timeout")
        .unwrap_or(Duration::from_secs(5));
    Some(Cluster {
        name,
        address: Some(address?),
        http2,
        connect_timeout,
        max_concurrent_streams,
        max_requests,
    })
}
