//! Envoy fidelity of the gateway's config loader and connection manager, written from
//! Envoy's documented and coded behaviour (each test names the source it mirrors), with
//! configs in the shapes third-party plugins ship: a `TypedStruct`-wrapped filter, a
//! repeated field written as one map, unnamed listeners and clusters, deprecated
//! cluster-level HTTP/2 options, and Wasm fields that have no effect here.

use crate::util::eventually;
use idemgate_host::gateway::config::{ConfigError, EnvoyConfig};
use idemgate_host::gateway::{Gateway, GatewayOptions};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

fn probe_wasm() -> String {
    idemgate_host::target_dir()
        .join("fixtures/probe.wasm")
        .to_string_lossy()
        .into_owned()
}

/// A loopback upstream that answers 200 with `server: backend-server` and the request it
/// received (head lines, blank line, body; chunked bodies are passed through raw).
fn upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&hits);
    std::thread::spawn(move || {
        for mut socket in listener.incoming().flatten() {
            let counter = Arc::clone(&counter);
            std::thread::spawn(move || {
                socket.set_read_timeout(Some(Duration::from_secs(10))).ok();
                while let Some(request) = read_request(&mut socket) {
                    counter.fetch_add(1, Ordering::SeqCst);
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\nserver: backend-server\r\ncontent-length: {}\r\n\r\n{request}",
                        request.len()
                    );
                    if socket.write_all(reply.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (address, hits)
}

fn read_request(socket: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match socket.read(&mut byte) {
            Ok(1) => buf.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    if head.contains("transfer-encoding: chunked") {
        while !buf.ends_with(b"0\r\n\r\n") {
            match socket.read(&mut byte) {
                Ok(1) => buf.push(byte[0]),
                _ => return None,
            }
        }
    } else if let Some(length) = head.lines().find_map(|l| {
        l.strip_prefix("content-length:")
            .and_then(|v| v.trim().parse::<usize>().ok())
    }) {
        let mut body = vec![0u8; length];
        socket.read_exact(&mut body).ok()?;
        buf.extend_from_slice(&body);
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// Writes `raw` and reads the whole response (the request must close the connection).
fn exchange(address: SocketAddr, raw: &str) -> (u16, String, String) {
    let mut socket = TcpStream::connect(address).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    socket.write_all(raw.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = socket.read_to_end(&mut out);
    let out = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {out:?}"));
    (status, head.to_ascii_lowercase(), body.to_owned())
}

fn get(address: SocketAddr, path: &str, headers: &str) -> (u16, String, String) {
    exchange(
        address,
        &format!(
            "GET {path} HTTP/1.1\r\nhost: fidelity.test\r\n{headers}connection: close\r\n\r\n"
        ),
    )
}

/// A wasm filter in the `TypedStruct` form (`udpa.type.v1.TypedStruct`, as Istio
/// `EnvoyFilter`s and most proxy-wasm examples write it), with Wasm fields that change
/// nothing here.
fn typed_struct_probe(root: &str) -> String {
    format!(
        r#"
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/udpa.type.v1.TypedStruct
              type_url: type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              value:
                config:
                  name: probe
                  root_id: {root}
                  configuration:
                    "@type": type.googleapis.com/google.protobuf.StringValue
                    value: fidelity
                  vm_config:
                    vm_id: {root}
                    runtime: envoy.wasm.runtime.v8
                    allow_precompiled: true
                    code:
                      local:
                        filename: {wasm}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"#,
        wasm = probe_wasm()
    )
}

/// Envoy's YAML loader takes a single map where a list is expected
/// (`source/common/protobuf/yaml_utility.cc` → proto-JSON repeated fields), generates
/// names for unnamed listeners (`ListenerManagerImpl::addOrUpdateListener`), keeps the
/// deprecated cluster-level `http2_protocol_options`
/// (`api/envoy/config/cluster/v3/cluster.proto`), and unwraps `TypedStruct`
/// (`source/common/config/utility.cc`, `translateOpaqueConfig`).
#[test]
fn config_shapes_envoy_accepts_load_and_run() {
    let (backend, hits) = upstream();
    let yaml = format!(
        r#"
static_resources:
  listeners:
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
      filters:
        name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: shapes
          route_config:
            virtual_hosts:
              name: all
              domains: ["*"]
              routes:
                match: {{prefix: "/"}}
                route: {{cluster: backend, timeout: 5s}}
          http_filters:{filters}
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: backend
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}}}]}}]
  - connect_timeout: 0.25s
    http2_protocol_options: {{max_concurrent_streams: 100}}
    load_assignment:
      endpoints: {{lb_endpoints: {{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: 9}}}}}}}}}}
"#,
        filters = typed_struct_probe("shapes"),
        port = backend.port()
    );
    let mut config =
        EnvoyConfig::from_yaml(&yaml, Path::new(".")).unwrap_or_else(|e| panic!("{e}"));
    let listener = &config.listeners[0];
    assert_eq!(listener.name, "listeners[0]");
    let wasm = listener.wasm.as_ref().unwrap();
    assert_eq!(wasm.settings.root_id, "shapes");
    assert_eq!(wasm.settings.configuration, b"fidelity");
    let unnamed = &config.clusters["clusters[1]"];
    assert!(
        unnamed.http2,
        "cluster-level http2_protocol_options means HTTP/2"
    );
    assert_eq!(unnamed.max_concurrent_streams, Some(100));
    // --set-port addresses unnamed listeners and clusters by index or address.
    config.set_port("clusters[1]", 19).unwrap();
    assert_eq!(config.clusters["clusters[1]"].address.unwrap().port(), 19);
    config.set_port("127.0.0.1:0", 0).unwrap();
    config.set_port("listeners[0]", 0).unwrap();
    assert!(config.set_port("listeners[1]", 1).is_err());

    let gateway = Gateway::start(config, GatewayOptions::default()).unwrap();
    let address = gateway.listener_address("listeners[0]").unwrap();
    let (status, _, body) = get(address, "/shapes", "x-probe: report\r\n");
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("GET /shapes HTTP/1.1"), "{body}");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

/// Every unsupported field of a file in one error, each with its path; other filters are
/// refused by name with the supported chain listed, not with a parser message about an
/// unrelated field.
#[test]
fn every_unsupported_field_is_reported_at_once() {
    let yaml = r#"
static_resources:
  listeners:
  - name: edge
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    listener_filters: [{name: envoy.filters.listener.tls_inspector}]
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: edge
          use_remote_address: true
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/", headers: [{name: x-a, present_match: true}]}
                route: {cluster: backend, retry_policy: {num_retries: 2}}
          http_filters:
          - name: envoy.filters.http.lua
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code: {inline_string: "function envoy_on_request(h) end"}
          - name: envoy.filters.http.ext_authz
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  - name: tcp
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          cluster: backend
  clusters:
  - name: backend
    load_assignment:
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 1}}}}]}]
    health_checks: [{timeout: 1s}]
bootstrap_extensions:
- name: envoy.bootstrap.internal_listener
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener
"#;
    let err = EnvoyConfig::from_yaml(yaml, Path::new(".")).unwrap_err();
    let ConfigError::Unsupported(issues) = &err else {
        panic!("{err}");
    };
    let text = err.to_string();
    for expected in [
        "static_resources.listeners[0].listener_filters: unsupported field",
        "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.use_remote_address: unsupported field",
        "routes[0].match.headers: unsupported field",
        "routes[0].route.retry_policy: unsupported field",
        "http_filters[0]: HTTP filter `envoy.filters.http.lua` (type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua) is not supported",
        "http_filters[1]: HTTP filter `envoy.filters.http.ext_authz`",
        "static_resources.listeners[1].filter_chains[0].filters[0]: network filter `envoy.filters.network.tcp_proxy`",
        "static_resources.clusters[0].health_checks: unsupported field",
        "bootstrap_extensions[0]: envoy.bootstrap.internal_listener",
    ] {
        assert!(text.contains(expected), "missing `{expected}` in:\n{text}");
    }
    assert_eq!(issues.len(), 9, "{text}");
    assert!(
        text.contains("at most one envoy.filters.http.wasm"),
        "the supported chain is named: {text}"
    );
    assert!(
        !text.contains("default_source_code"),
        "no noise from inside a refused filter: {text}"
    );
}

/// The connection manager's request-path behaviour, as `ConnectionManagerUtility::
/// maybeNormalizePath` (`source/common/http/conn_manager_utility.cc`) and the HTTP/1 codec
/// (`source/common/http/http1/codec_impl.cc`, Content-Length with chunked) run it before
/// any filter exists; the router's matching, `direct_response` and header mutations
/// (`source/common/router/config_impl.cc`, `header_parser.cc`); the headers Envoy adds
/// (`server` in `ConnectionManagerImpl::ActiveStream::encodeHeaders`,
/// `x-envoy-expected-rq-timeout-ms` and `x-envoy-upstream-service-time` in
/// `source/common/router/router.cc`); and `xds.*` attributes
/// (`docs/root/intro/arch_overview/advanced/attributes.rst`).
#[test]
fn the_connection_manager_and_router_behave_as_envoy() {
    let (backend, hits) = upstream();
    let listener = |name: &str, hcm: &str, routes: &str| {
        format!(
            r#"
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
{hcm}
          route_config:
            request_headers_to_add:
            - header: {{key: x-level, value: config}}
              append_action: OVERWRITE_IF_EXISTS_OR_ADD
            virtual_hosts:
            - name: {name}-host
              domains: ["*"]
              request_headers_to_add:
              - header: {{key: x-level, value: host}}
                append: false
              routes:
{routes}
          http_filters:{filters}"#,
            filters = typed_struct_probe(name)
        )
    };
    let strict_routes = r#"
              - name: exact-route
                match: {path: /exact}
                route: {cluster: backend}
                request_headers_to_remove: [x-remove-me]
                request_headers_to_add:
                - header: {key: x-added, value: route}
                - header: {key: x-level, value: route}
                metadata:
                  filter_metadata:
                    probe: {tier: gold, weight: 3}
              - name: regex-route
                match: {safe_regex: {google_re2: {}, regex: "/items/[0-9]+"}}
                route: {cluster: backend, timeout: 0s}
              - name: teapot
                match: {prefix: /direct}
                direct_response: {status: 418, body: {inline_string: teapot}}"#;
    let catch_all = r#"
              - match: {prefix: /}
                route: {cluster: backend}"#;
    let yaml = format!(
        "static_resources:\n  listeners:{}{}{}\n  clusters:\n  - name: backend\n    load_assignment:\n      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {}}}}}}}}}]}}]\n",
        listener(
            "strict",
            "          normalize_path: true\n          merge_slashes: true\n          path_with_escaped_slashes_action: REJECT_REQUEST\n          server_name: fidelity-gw\n          server_header_transformation: APPEND_IF_ABSENT",
            strict_routes
        ),
        listener(
            "redirect",
            "          path_with_escaped_slashes_action: UNESCAPE_AND_REDIRECT",
            catch_all
        ),
        listener(
            "lenient",
            "          path_with_escaped_slashes_action: UNESCAPE_AND_FORWARD\n          server_header_transformation: PASS_THROUGH\n          http_protocol_options: {allow_chunked_length: true}",
            catch_all
        ),
        backend.port()
    );
    let config = EnvoyConfig::from_yaml(&yaml, Path::new(".")).unwrap_or_else(|e| panic!("{e}"));
    let gateway = Gateway::start(config, GatewayOptions::default()).unwrap();
    let strict = gateway.listener_address("strict").unwrap();
    let redirect = gateway.listener_address("redirect").unwrap();
    let lenient = gateway.listener_address("lenient").unwrap();
    let shared = Arc::clone(gateway.shared());
    let logs = |needle: &str| -> Vec<String> {
        shared
            .logs()
            .into_iter()
            .map(|r| r.message)
            .filter(|m| m.contains(needle))
            .collect()
    };

    // normalize_path then merge_slashes; the route's header mutations, then the virtual
    // host's, then the route configuration's (which wins); Envoy's router headers.
    let (status, head, body) = get(
        strict,
        "/a/b/../..//exact?q=1",
        "x-probe: report\r\nx-probe-metadata: probe/tier\r\nx-remove-me: 1\r\nx-envoy-retry-on: 5xx\r\n",
    );
    assert_eq!(status, 200, "{head}\n{body}");
    assert!(body.starts_with("GET /exact?q=1 HTTP/1.1"), "{body}");
    let upstream_head = body.to_ascii_lowercase();
    assert!(upstream_head.contains("x-added: route"), "{body}");
    assert!(!upstream_head.contains("x-remove-me"), "{body}");
    assert!(upstream_head.contains("x-level: config"), "{body}");
    assert_eq!(upstream_head.matches("x-level").count(), 1, "{body}");
    assert!(
        upstream_head.contains("x-envoy-expected-rq-timeout-ms: 15000"),
        "{body}"
    );
    assert!(
        head.contains("server: backend-server"),
        "APPEND_IF_ABSENT keeps the upstream's: {head}"
    );
    assert!(head.contains("x-envoy-upstream-service-time: "), "{head}");
    let seen = logs("request-headers ");
    let seen = seen.last().unwrap();
    assert!(
        seen.starts_with(
            "request-headers :authority: fidelity.test | :path: /exact?q=1 | :method: GET | :scheme: http | x-probe: report"
        ),
        "{seen}"
    );
    assert!(
        seen.contains("| x-remove-me: 1 | x-forwarded-proto: http | x-request-id: "),
        "the HCM's additions come last, x-forwarded-proto first: {seen}"
    );
    assert!(
        !seen.contains("x-envoy-retry-on"),
        "cleanInternalHeaders drops a client's router-control headers: {seen}"
    );
    assert!(
        !seen.contains("x-added"),
        "route headers are the router's, after the filter: {seen}"
    );
    assert!(
        logs("property xds.route_name=Some(\"exact-route\")").len() == 1,
        "{:?}",
        logs("xds")
    );
    assert!(!logs("property xds.virtual_host_name=Some(\"strict-host\")").is_empty());
    assert!(!logs("property xds.cluster_name=Some(\"backend\")").is_empty());
    assert!(
        !logs("property xds.route_metadata.filter_metadata.probe.tier=Some(\"gold\")").is_empty(),
        "{:?}",
        logs("xds")
    );
    assert!(
        !logs("property xds.route_metadata bytes=Some(\"0a").is_empty(),
        "{:?}",
        logs("route_metadata bytes")
    );
    assert!(
        !logs("property metadata=None").is_empty(),
        "no dynamic metadata"
    );
    let served = logs("response-headers ");
    assert!(
        served
            .last()
            .unwrap()
            .contains("x-envoy-upstream-service-time"),
        "{served:?}"
    );

    // A regex route is an RE2 full match of the path without its query; a 0s timeout sends
    // no expected-timeout header.
    let (status, _, body) = get(strict, "/items/42?x=y", "");
    assert_eq!(status, 200, "{body}");
    assert!(
        !body
            .to_ascii_lowercase()
            .contains("x-envoy-expected-rq-timeout-ms"),
        "{body}"
    );
    let before = hits.load(Ordering::SeqCst);
    let (status, head, _) = get(strict, "/items/42/more", "");
    assert_eq!(status, 404, "no route: {head}");
    assert!(
        head.contains("server: fidelity-gw"),
        "local replies get server_name: {head}"
    );

    // direct_response: the router answers, the filter's response callbacks see it.
    let (status, head, body) = get(strict, "/direct/x", "x-probe: report\r\n");
    assert_eq!((status, body.as_str()), (418, "teapot"));
    assert!(head.contains("content-type: text/plain"), "{head}");
    assert!(
        logs("response-headers :status: 418").len() == 1,
        "{:?}",
        logs("response-headers")
    );

    // REJECT_REQUEST: 400 before any filter runs.
    let requests_seen = logs("on_request_headers").len();
    let (status, head, body) = get(strict, "/a%2Fb", "x-probe: report\r\n");
    assert_eq!((status, body.as_str()), (400, ""), "{head}");
    assert_eq!(
        logs("on_request_headers").len(),
        requests_seen,
        "the filter never saw it"
    );

    // UNESCAPE_AND_REDIRECT: 307 to the unescaped path; OVERWRITE (the default) sets
    // `server: envoy` over the upstream's.
    let (status, head, _) = get(redirect, "/a%2fb?c=%2F", "");
    assert_eq!(status, 307, "{head}");
    assert!(head.contains("location: /a/b?c=%2f"), "{head}");
    assert!(head.contains("server: envoy"), "{head}");
    let (_, head, _) = get(redirect, "/plain", "");
    assert!(
        head.contains("server: envoy") && !head.contains("backend-server"),
        "{head}"
    );

    // UNESCAPE_AND_FORWARD; PASS_THROUGH leaves the upstream's server header alone.
    let (status, head, body) = get(lenient, "/a%2Fb", "");
    assert_eq!(status, 200);
    assert!(body.starts_with("GET /a/b HTTP/1.1"), "{body}");
    assert!(head.contains("server: backend-server"), "{head}");
    assert_eq!(hits.load(Ordering::SeqCst), before + 2);

    // Content-Length with Transfer-Encoding: chunked: refused by the codec (400 "Bad
    // Request", connection closed, nothing upstream) unless allow_chunked_length, which
    // forwards the chunked body without Content-Length.
    let smuggle = "POST /exact HTTP/1.1\r\nhost: fidelity.test\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n";
    let (status, head, body) = exchange(strict, smuggle);
    assert_eq!((status, body.as_str()), (400, "Bad Request"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert!(head.contains("server: fidelity-gw"), "{head}");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        before + 2,
        "nothing reached the backend"
    );
    let (status, _, body) = exchange(lenient, &smuggle.replace("/exact", "/chunked"));
    assert_eq!(status, 200, "{body}");
    let forwarded = body.to_ascii_lowercase();
    assert!(!forwarded.contains("content-length: 4"), "{body}");
    assert!(forwarded.contains("hello"), "{body}");
    eventually("the access log stats", || {
        gateway.stats().get("http.strict.downstream_rq_4xx") >= 3
    });
}

/// What users deploy keeps loading.
#[test]
fn the_shipped_envoy_yaml_loads() {
    let path = idemgate_host::target_dir().join("../envoy/envoy.yaml");
    let config = EnvoyConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(config.listeners.iter().any(|l| l.wasm.is_some()));
}
