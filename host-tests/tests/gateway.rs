//! The gateway serving real HTTP through the probe fixture.

use crate::util::{eventually, http, upstream};
use idemgate_host::gateway::bootstrap::{Bootstrap, ClusterSpec, FilterSpec, LISTENER};
use idemgate_host::gateway::config::{ConfigError, EnvoyConfig};
use idemgate_host::gateway::{Gateway, GatewayOptions};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::Ordering;

/// The probe fixture, as the tests below configure it.
fn probe_filter() -> FilterSpec {
    FilterSpec::fixture("probe")
        .root_id("probe_root")
        .configuration("gateway")
}

/// A gateway config with `filter` (none: the router alone) and a `sidecar` cluster.
fn bootstrap(backend: SocketAddr, sidecar: SocketAddr, filter: Option<FilterSpec>) -> Bootstrap {
    let bootstrap = Bootstrap::new(backend)
        .admin()
        .route_timeout(std::time::Duration::from_secs(10))
        .cluster(ClusterSpec::dns("sidecar", "localhost", sidecar.port()).max_requests(10_000));
    match filter {
        Some(filter) => bootstrap.filter(filter),
        None => bootstrap,
    }
}

/// Parses the probe config after `edit` changed its value tree.
fn parse_edited(edit: impl FnOnce(&mut serde_json::Value)) -> Result<EnvoyConfig, ConfigError> {
    let unused: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let mut value = bootstrap(unused, unused, Some(probe_filter())).to_value();
    edit(&mut value);
    EnvoyConfig::from_yaml(&serde_norway::to_string(&value).unwrap(), Path::new("."))
}

struct Running {
    gateway: Gateway,
    backend_hits: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Running {
    fn main(&self) -> SocketAddr {
        self.gateway.listener_address(LISTENER).unwrap()
    }
}

fn start(filter: Option<FilterSpec>, concurrency: usize) -> Running {
    let (backend, backend_hits) = upstream(None);
    let (sidecar, _) = upstream(Some("lock-9"));
    let gateway = bootstrap(backend, sidecar, filter)
        .start_with(GatewayOptions {
            concurrency,
            access_log: true,
            ..GatewayOptions::default()
        })
        .unwrap();
    Running {
        gateway,
        backend_hits,
    }
}

#[test]
fn header_mutations_reach_the_upstream_and_the_client() {
    let running = start(Some(probe_filter()), 2);
    let reply = http(
        running.main(),
        "POST",
        "/orders",
        &[("x-probe", "add-header")],
        "hello",
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(
        reply.body.starts_with("POST /orders HTTP/1.1"),
        "{}",
        reply.body
    );
    assert!(reply.body.contains("x-probe-added: 1"), "{}", reply.body);
    assert!(
        reply.body.contains("x-request-id: "),
        "HCM adds it: {}",
        reply.body
    );
    assert!(reply.body.ends_with("hello"), "{}", reply.body);
    assert_eq!(reply.header("x-probe-response").as_deref(), Some("1"));
    assert_eq!(reply.header("x-upstream").as_deref(), Some("yes"));

    let admin = running.gateway.admin_address().unwrap();
    let stats = http(admin, "GET", "/stats", &[], "");
    assert!(
        stats.body.contains("http.ingress.downstream_rq_total: 1"),
        "{}",
        stats.body
    );
    assert!(
        stats.body.contains("http.ingress.downstream_rq_2xx: 1"),
        "{}",
        stats.body
    );
}

#[test]
fn a_local_reply_never_reaches_the_upstream() {
    let running = start(Some(probe_filter()), 1);
    let reply = http(
        running.main(),
        "GET",
        "/",
        &[("x-probe", "local-reply")],
        "",
    );
    assert_eq!(reply.status, 403);
    assert_eq!(reply.body, "denied by probe");
    assert_eq!(reply.header("x-probe").as_deref(), Some("denied"));
    assert_eq!(running.backend_hits.load(Ordering::SeqCst), 0);
}

#[test]
fn a_callout_goes_to_the_loopback_sidecar_over_a_real_socket() {
    let running = start(Some(probe_filter()), 1);
    let reply = http(running.main(), "GET", "/pay", &[("x-probe", "callout")], "");
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(reply.body.contains("x-lock: lock-9"), "{}", reply.body);
}

#[test]
fn a_client_abort_releases_the_stream() {
    let running = start(Some(probe_filter()), 1);
    let mut socket = TcpStream::connect(running.main()).unwrap();
    socket
        .write_all(b"GET /held HTTP/1.1\r\nhost: x\r\nx-probe: pause\r\n\r\n")
        .unwrap();
    let shared = std::sync::Arc::clone(running.gateway.shared());
    eventually("the paused request to reach the plugin", || {
        shared
            .logs()
            .iter()
            .any(|r| r.message.starts_with("on_request_headers"))
    });
    drop(socket);
    eventually("on_delete after the client went away", || {
        shared
            .logs()
            .iter()
            .any(|r| r.message.starts_with("on_delete"))
    });
    let order: Vec<String> = shared
        .logs()
        .into_iter()
        .map(|r| r.message)
        .filter(|m| {
            m.starts_with("on_log") || m.starts_with("on_done") || m.starts_with("on_delete")
        })
        .collect();
    assert_eq!(order.len(), 3, "{order:?}");
    assert!(
        order[0].starts_with("on_log") && order[1].starts_with("on_done"),
        "{order:?}"
    );
    assert_eq!(running.backend_hits.load(Ordering::SeqCst), 0);
}

#[test]
fn without_a_wasm_filter_the_router_just_proxies() {
    let running = start(None, 1);
    let reply = http(running.main(), "PUT", "/x", &[], "body");
    assert_eq!(reply.status, 200);
    assert!(reply.body.ends_with("body"));
}

#[test]
fn unsupported_fields_are_rejected_with_their_path() {
    let err = parse_edited(|v| {
        v["static_resources"]["clusters"][0]["outlier_detection"] = serde_json::json!({});
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("static_resources.clusters[0].outlier_detection: unsupported field"),
        "{err}"
    );
}

#[test]
fn access_logs_print_only_what_they_can_print_as_envoy_would() {
    let with_log = |log: serde_json::Value| {
        parse_edited(move |v| {
            v["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
                ["access_log"] = serde_json::json!([log]);
        })
    };
    let stdout = |format: &str| {
        serde_json::json!({"name": "envoy.access_loggers.stdout", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
            "log_format": {"text_format_source": {"inline_string": format}}}})
    };
    let config = with_log(stdout("%FILTER_STATE(wasm.idemgate.decision:PLAIN)%\n")).unwrap();
    assert_eq!(config.listeners[0].access_log.len(), 1);
    // No format: Envoy's default one.
    let default = with_log(serde_json::json!({"name": "stdout", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"}}));
    assert_eq!(default.unwrap().listeners[0].access_log.len(), 1);

    let err = with_log(stdout("%DOWNSTREAM_REMOTE_ADDRESS%"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("typed_config.access_log[0].typed_config: command operator %DOWNSTREAM_REMOTE_ADDRESS% is not supported"),
        "{err}"
    );
    let err = with_log(serde_json::json!({"name": "file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": "/var/log/envoy.log"}}))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("access_log[0].typed_config.path: only /dev/stdout"),
        "{err}"
    );
}

#[test]
fn the_access_log_sees_the_request_headers_as_the_filter_and_the_router_left_them() {
    let (backend, _) = upstream(None);
    let (sidecar, _) = upstream(Some("lock-9"));
    let mut value = bootstrap(backend, sidecar, Some(probe_filter())).to_value();
    value["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["access_log"] = serde_json::json!([{"name": "envoy.access_loggers.stdout", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
            "log_format": {"text_format_source": {"inline_string":
                "%REQ(:METHOD)% added=%REQ(X-PROBE-ADDED)% timeout=%REQ(X-ENVOY-EXPECTED-RQ-TIMEOUT-MS)%\n"}}}}]);
    let config = EnvoyConfig::from_yaml(
        &serde_norway::to_string(&value).unwrap(),
        &idemgate_host::target_dir().join(".."),
    )
    .unwrap();
    let gateway = Gateway::start(
        config,
        GatewayOptions {
            concurrency: 1,
            ..GatewayOptions::default()
        },
    )
    .unwrap();
    let main = gateway.listener_address(LISTENER).unwrap();
    // The filter replaces the client's header (as idemgate replaces a forged fencing token);
    // the router adds its timeout header to the request it forwards.
    let forged = ("x-probe-added", "forged");
    let forwarded = http(
        main,
        "POST",
        "/orders",
        &[("x-probe", "add-header"), forged],
        "hi",
    );
    assert!(forwarded.body.contains("x-probe-added: 1"), "{forwarded:?}");
    // Answered by the filter: its edits before the reply, and nothing of the router's.
    let refused = http(
        main,
        "GET",
        "/",
        &[("x-probe", "add-header,local-reply"), forged],
        "",
    );
    assert_eq!(refused.status, 403);
    let shared = std::sync::Arc::clone(gateway.shared());
    eventually("both access-log lines", || shared.access_log().len() == 2);
    assert_eq!(
        shared.access_log(),
        ["POST added=1 timeout=10000\n", "GET added=1 timeout=-\n"]
    );
}

#[test]
fn the_wasm_chain_must_end_with_the_router() {
    let err =
        parse_edited(|v| {
            v["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
                ["http_filters"][1]["typed_config"]["@type"] =
                "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua".into();
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("http_filters[1]: HTTP filter"), "{err}");
    assert!(
        err.contains("http_filters: the chain must end with the router"),
        "{err}"
    );
}

#[test]
fn h2c_prior_knowledge_clients_are_served() {
    use http_body_util::{BodyExt, Full};
    let running = start(Some(probe_filter()), 1);
    let address = running.main();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (status, probe_header) = runtime.block_on(async move {
        let stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        let request = http::Request::builder()
            .uri(format!("http://{address}/h2"))
            .header("x-probe", "add-header")
            .body(Full::new(bytes::Bytes::new()))
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        let status = response.status().as_u16();
        let header = response.headers().get("x-probe-response").cloned();
        let _ = response.into_body().collect().await.unwrap();
        (status, header)
    });
    assert_eq!(status, 200);
    assert_eq!(probe_header.unwrap(), "1");
    let logs = running.gateway.shared().logs();
    assert!(
        logs.iter()
            .any(|r| r.message.contains("on_request_headers")),
        "filter ran"
    );
}

#[test]
fn live_workers_tick_and_publish_plugin_metrics_on_the_admin_endpoint() {
    let running = start(
        Some(FilterSpec::fixture("shared").configuration("tick_ms=20")),
        2,
    );
    let shared = std::sync::Arc::clone(running.gateway.shared());
    eventually("every worker ticking twice", || {
        let ticks = shared
            .logs()
            .iter()
            .filter(|r| r.message.starts_with("tick n=2"))
            .count();
        ticks >= 2
    });
    let reply = http(running.main(), "GET", "/", &[("x-op", "enqueue:job-7")], "");
    assert_eq!(reply.status, 200);
    eventually("the queue notification", || {
        shared
            .logs()
            .iter()
            .any(|r| r.message.starts_with("dequeued job-7"))
    });
    let admin = running.gateway.admin_address().unwrap();
    let stats = http(admin, "GET", "/stats", &[], "");
    assert!(stats.body.contains("shared_requests: 1"), "{}", stats.body);
    assert!(
        stats.body.contains("shared_sizes: P50(42)"),
        "{}",
        stats.body
    );
    let prometheus = http(admin, "GET", "/stats/prometheus", &[], "");
    assert!(
        prometheus
            .body
            .contains("# TYPE shared_requests counter\nshared_requests 1"),
        "{}",
        prometheus.body
    );
    // Histograms as Envoy prints them: its default buckets, cumulative, then sum and count.
    assert!(
        prometheus.body.contains(
            "# TYPE shared_sizes histogram\nshared_sizes_bucket{le=\"0.5\"} 0\n\
             shared_sizes_bucket{le=\"1\"} 0\nshared_sizes_bucket{le=\"5\"} 0\n\
             shared_sizes_bucket{le=\"10\"} 0\nshared_sizes_bucket{le=\"25\"} 0\n\
             shared_sizes_bucket{le=\"50\"} 1\n"
        ),
        "{}",
        prometheus.body
    );
    assert!(
        prometheus.body.contains(
            "shared_sizes_bucket{le=\"3600000\"} 1\nshared_sizes_bucket{le=\"+Inf\"} 1\n\
             shared_sizes_sum 42\nshared_sizes_count 1\n"
        ),
        "{}",
        prometheus.body
    );
}

#[test]
fn stats_tags_cut_a_label_out_of_a_metric_name_as_envoy_does() {
    let config = parse_edited(|v| {
        v["stats_config"] = serde_json::json!({"stats_tags": [{
            "tag_name": "rule",
            "regex": "^(?:wasmcustom\\.)?idemgate\\.(?:rate\\.)?rule\\.(([^.]+)\\.)"}]});
    })
    .unwrap();
    let tag = &config.stats_tags[0];
    assert_eq!(tag.name, "rule");
    let extract = |name: &str| tag.extract(name);
    assert_eq!(
        extract("idemgate.rule.payments.granted"),
        Some(("idemgate.rule.granted".into(), "payments".into()))
    );
    assert_eq!(
        extract("wasmcustom.idemgate.rate.rule.rules_0_.limited"),
        Some((
            "wasmcustom.idemgate.rate.rule.limited".into(),
            "rules_0_".into()
        ))
    );
    assert_eq!(extract("idemgate.requests.granted"), None);
    let err = parse_edited(|v| {
        v["stats_config"] = serde_json::json!({"stats_tags": [{"tag_name": "x", "regex": "(a"}]});
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("stats_config.stats_tags[0].regex: not a regex"),
        "{err}"
    );
}

#[test]
fn http2_cluster_options_and_circuit_breakers_are_understood() {
    let unused: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let config = Bootstrap::new(unused)
        .cluster(
            ClusterSpec::dns("sidecar", "localhost", 2)
                .http2(100)
                .max_requests(10_000),
        )
        .config()
        .unwrap();
    let sidecar = &config.clusters["sidecar"];
    assert!(sidecar.http2);
    assert_eq!(sidecar.max_concurrent_streams, Some(100));
    assert_eq!(sidecar.max_requests, 10000);
    assert_eq!(
        config.clusters["backend"].max_requests, 1024,
        "Envoy's default"
    );
    let err = parse_edited(|v| {
        v["static_resources"]["clusters"][1]["circuit_breakers"]["thresholds"][0]["priority"] =
            "HIGH".into();
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("circuit_breakers.thresholds[0].priority"),
        "{err}"
    );
}

/// `enable_reuse_port` (a `BoolValue`, true by default as in Envoy on Linux) is accepted.
#[test]
fn enable_reuse_port_is_read_and_defaults_to_true() {
    let config = parse_edited(|_| {}).unwrap();
    assert!(config.listeners[0].reuse_port);
    let config =
        parse_edited(|v| v["static_resources"]["listeners"][0]["enable_reuse_port"] = false.into())
            .unwrap();
    assert!(!config.listeners[0].reuse_port);
    let rejected = parse_edited(|v| {
        v["static_resources"]["listeners"][0]["enable_reuse_port"] = "sometimes".into();
    });
    assert!(rejected.is_err());
}
