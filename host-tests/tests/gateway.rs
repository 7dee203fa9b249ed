//! The gateway serving real HTTP through the probe fixture.

use crate::util::{eventually, http, upstream};
use idemgate_host::gateway::config::EnvoyConfig;
use idemgate_host::gateway::{Gateway, GatewayOptions};
use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::Ordering;

fn envoy_yaml(backend: SocketAddr, sidecar: SocketAddr, wasm: &str) -> String {
    format!(
        r#"
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
static_resources:
  listeners:
  - name: main
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: backend, timeout: 10s }}
          http_filters:
          {wasm}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }}
  - name: sidecar
    type: STRICT_DNS
    connect_timeout: 1s
    circuit_breakers:
      thresholds:
      - priority: DEFAULT
        max_connections: 64
        max_pending_requests: 10000
        max_requests: 10000
        max_retries: 3
    load_assignment:
      cluster_name: sidecar
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: localhost, port_value: {} }} }} }}
"#,
        backend.port(),
        sidecar.port()
    )
}

const PROBE_FILTER: &str = r#"- name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: probe
                root_id: probe_root
                vm_config:
                  vm_id: probe_vm
                  runtime: envoy.wasm.runtime.v8
                  code: { local: { filename: target/fixtures/probe.wasm } }
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: "gateway"
                failure_policy: FAIL_CLOSED"#;

struct Running {
    gateway: Gateway,
    backend_hits: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Running {
    fn main(&self) -> SocketAddr {
        self.gateway.listener_address("main").unwrap()
    }
}

fn start(filter: &str, concurrency: usize) -> Running {
    let (backend, backend_hits) = upstream(None);
    let (sidecar, _) = upstream(Some("lock-9"));
    let root = idemgate_host::target_dir().join("..");
    let config = EnvoyConfig::from_yaml(&envoy_yaml(backend, sidecar, filter), &root).unwrap();
    let mut listeners = HashMap::new();
    listeners.insert("main".to_owned(), TcpListener::bind("127.0.0.1:0").unwrap());
    let gateway = Gateway::start(
        config,
        GatewayOptions {
            concurrency,
            listeners,
            access_log: true,
            ..GatewayOptions::default()
        },
    )
    .unwrap();
    Running {
        gateway,
        backend_hits,
    }
}

#[test]
fn header_mutations_reach_the_upstream_and_the_client() {
    let running = start(PROBE_FILTER, 2);
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
    let running = start(PROBE_FILTER, 1);
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
    let running = start(PROBE_FILTER, 1);
    let reply = http(running.main(), "GET", "/pay", &[("x-probe", "callout")], "");
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(reply.body.contains("x-lock: lock-9"), "{}", reply.body);
}

#[test]
fn a_client_abort_releases_the_stream() {
    let running = start(PROBE_FILTER, 1);
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
    let running = start("", 1);
    let reply = http(running.main(), "PUT", "/x", &[], "body");
    assert_eq!(reply.status, 200);
    assert!(reply.body.ends_with("body"));
}

#[test]
fn unsupported_fields_are_rejected_with_their_path() {
    let yaml = envoy_yaml("127.0.0.1:1".parse().unwrap(), "127.0.0.1:2".parse().unwrap(), PROBE_FILTER)
        .replace("connect_timeout: 1s\n    load_assignment:\n      cluster_name: backend", "connect_timeout: 1s\n    circuit_breakers: {}\n    load_assignment:\n      cluster_name: backend");
    let err = EnvoyConfig::from_yaml(&yaml, Path::new("."))
        .unwrap_err()
        .to_string();
    assert!(err.contains("circuit_breakers"), "{err}");
    assert!(err.contains("static_resources.clusters[0]"), "{err}");
}

#[test]
fn the_wasm_chain_must_end_with_the_router() {
    let yaml = envoy_yaml(
        "127.0.0.1:1".parse().unwrap(),
        "127.0.0.1:2".parse().unwrap(),
        PROBE_FILTER,
    )
    .replace("envoy.filters.http.router\n", "envoy.filters.http.lua\n");
    let err = EnvoyConfig::from_yaml(&yaml, Path::new("."))
        .unwrap_err()
        .to_string();
    assert!(err.contains("http_filters"), "{err}");
}

#[test]
fn h2c_prior_knowledge_clients_are_served() {
    use http_body_util::{BodyExt, Full};
    let running = start(PROBE_FILTER, 1);
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

const SHARED_FILTER: &str = r#"- name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: shared
                vm_config:
                  vm_id: shared_vm
                  code: { local: { filename: target/fixtures/shared.wasm } }
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: "tick_ms=20""#;

#[test]
fn live_workers_tick_and_publish_plugin_metrics_on_the_admin_endpoint() {
    let running = start(SHARED_FILTER, 2);
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
}

#[test]
fn http2_cluster_options_and_circuit_breakers_are_understood() {
    let yaml = envoy_yaml("127.0.0.1:1".parse().unwrap(), "127.0.0.1:2".parse().unwrap(), PROBE_FILTER)
        .replace(
            "  - name: sidecar\n    type: STRICT_DNS\n",
            "  - name: sidecar\n    type: STRICT_DNS\n    typed_extension_protocol_options:\n      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        explicit_http_config:\n          http2_protocol_options:\n            max_concurrent_streams: 100\n",
        );
    let config = EnvoyConfig::from_yaml(&yaml, Path::new(".")).unwrap();
    let sidecar = &config.clusters["sidecar"];
    assert!(sidecar.http2);
    assert_eq!(sidecar.max_concurrent_streams, Some(100));
    assert_eq!(sidecar.max_requests, 10000);
    assert_eq!(
        config.clusters["backend"].max_requests, 1024,
        "Envoy's default"
    );
    let high = yaml.replace("priority: DEFAULT", "priority: HIGH");
    let err = EnvoyConfig::from_yaml(&high, Path::new("."))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("circuit_breakers.thresholds[0].priority"),
        "{err}"
    );
}
