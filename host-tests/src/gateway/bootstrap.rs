//! Envoy bootstrap configs for the gateways that tests and benchmarks start: listener
//! [`LISTENER`] on a free loopback port routing everything to cluster [`BACKEND`], an optional
//! wasm filter before the router, and further clusters (the lock sidecar). The one template
//! every test crate renders its gateway from, instead of a hand-written YAML copy each.
//!
//! The config is built as a value tree and rendered with `serde_norway`, so a plugin
//! configuration (JSON with quotes, newlines) needs no escaping, and the result goes through
//! the same parser ([`EnvoyConfig::from_yaml`]) as any config file. Where the rules of the
//! shipped `envoy/envoy.yaml` suffice, run that file instead ([`EnvoyConfig::load`],
//! [`EnvoyConfig::set_port`], [`EnvoyConfig::set_wasm_path`]); this builder is for variants.

use super::config::{ConfigError, EnvoyConfig};
use super::{Gateway, GatewayError, GatewayOptions};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The listener every rendered config has.
pub const LISTENER: &str = "main";
/// The cluster the listener routes to.
pub const BACKEND: &str = "backend";
/// The sidecar cluster of [`ClusterSpec::sidecar`], as named in `envoy/envoy.yaml`.
pub const SIDECAR_CLUSTER: &str = "idemgate_sidecar";
/// The filter name, root id and vm id of [`FilterSpec::idemgate`], as in `envoy/envoy.yaml`.
pub const IDEMGATE: &str = "idemgate";

/// A gateway config: listener [`LISTENER`] → cluster [`BACKEND`] at a given address.
#[derive(Debug, Clone)]
pub struct Bootstrap {
    backend: SocketAddr,
    /// The backend speaks HTTP/2 (a gRPC service): its cluster's `max_concurrent_streams`.
    backend_http2: Option<u32>,
    admin: bool,
    route_timeout: Option<Duration>,
    filter: Option<FilterSpec>,
    clusters: Vec<ClusterSpec>,
}

/// The wasm filter in front of the router.
#[derive(Debug, Clone)]
pub struct FilterSpec {
    name: String,
    root_id: Option<String>,
    vm_id: String,
    code: PathBuf,
    configuration: Option<String>,
    fail_open: bool,
    allow_on_headers_stop_iteration: bool,
}

/// An upstream cluster with one endpoint.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    name: String,
    host: String,
    port: u16,
    strict_dns: bool,
    connect_timeout: Duration,
    http2_max_concurrent_streams: Option<u32>,
    max_requests: Option<u32>,
}

/// Protobuf JSON duration text (`"0.25s"`, `"30s"`).
fn duration(d: Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

fn socket_address(host: &str, port: u16) -> Value {
    json!({ "socket_address": { "address": host, "port_value": port } })
}

impl Bootstrap {
    /// Routes everything to `backend`, with Envoy's default route timeout and no filter.
    pub fn new(backend: SocketAddr) -> Self {
        Self {
            backend,
            backend_http2: None,
            admin: false,
            route_timeout: None,
            filter: None,
            clusters: Vec::new(),
        }
    }

    /// The idemgate filter with `plugin` configuration (JSON) calling a sidecar at
    /// `sidecar`, its cluster sized as in `envoy/envoy.yaml`, and the shipped config's route
    /// timeout (above the longest queue wait).
    pub fn idemgate(backend: SocketAddr, sidecar: SocketAddr, plugin: &str) -> Self {
        Self::new(backend)
            .route_timeout(Duration::from_secs(90))
            .filter(FilterSpec::idemgate(plugin))
            .cluster(ClusterSpec::sidecar(sidecar))
    }

    /// Speak HTTP/2 (prior knowledge) to the backend, as to a gRPC service.
    pub fn backend_http2(mut self, max_concurrent_streams: u32) -> Self {
        self.backend_http2 = Some(max_concurrent_streams);
        self
    }

    /// Serves the admin endpoint (`/stats`) on a free loopback port.
    pub fn admin(mut self) -> Self {
        self.admin = true;
        self
    }

    pub fn route_timeout(mut self, timeout: Duration) -> Self {
        self.route_timeout = Some(timeout);
        self
    }

    pub fn filter(mut self, filter: FilterSpec) -> Self {
        self.filter = Some(filter);
        self
    }

    /// Replaces the filter's configuration (keeps everything else about it).
    pub fn plugin_configuration(mut self, configuration: &str) -> Self {
        if let Some(filter) = self.filter.as_mut() {
            filter.configuration = Some(configuration.to_owned());
        }
        self
    }

    pub fn cluster(mut self, cluster: ClusterSpec) -> Self {
        self.clusters.push(cluster);
        self
    }

    /// The bootstrap as a value tree (tests edit it to build invalid configs).
    pub fn to_value(&self) -> Value {
        let mut route = json!({ "cluster": BACKEND });
        if let (Some(timeout), Some(route)) = (self.route_timeout, route.as_object_mut()) {
            route.insert("timeout".into(), duration(timeout).into());
        }
        let mut http_filters: Vec<Value> = self.filter.iter().map(FilterSpec::to_value).collect();
        http_filters.push(json!({
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            }
        }));
        let mut backend = ClusterSpec::at(BACKEND, self.backend);
        if let Some(streams) = self.backend_http2 {
            backend = backend.http2(streams);
        }
        let clusters: Vec<Value> = std::iter::once(&backend)
            .chain(&self.clusters)
            .map(ClusterSpec::to_value)
            .collect();
        let mut bootstrap = json!({
            "static_resources": {
                "listeners": [{
                    "name": LISTENER,
                    "address": socket_address("127.0.0.1", 0),
                    "filter_chains": [{ "filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "ingress",
                            "route_config": { "virtual_hosts": [{
                                "name": "all",
                                "domains": ["*"],
                                "routes": [{ "match": { "prefix": "/" }, "route": route }]
                            }]},
                            "http_filters": http_filters
                        }
                    }]}]
                }],
                "clusters": clusters
            }
        });
        if let (true, Some(top)) = (self.admin, bootstrap.as_object_mut()) {
            top.insert(
                "admin".into(),
                json!({ "address": socket_address("127.0.0.1", 0) }),
            );
        }
        bootstrap
    }

    /// The bootstrap as Envoy YAML.
    pub fn to_yaml(&self) -> String {
        // A `serde_json::Value` always serializes (string keys, finite numbers).
        serde_norway::to_string(&self.to_value()).unwrap_or_default()
    }

    /// The parsed config (relative wasm paths resolve against the workspace root).
    pub fn config(&self) -> Result<EnvoyConfig, ConfigError> {
        EnvoyConfig::from_yaml(&self.to_yaml(), &crate::target_dir().join(".."))
    }

    /// Starts a gateway with `concurrency` workers (plugin logs at info and above).
    pub fn start(&self, concurrency: usize) -> Result<Gateway, GatewayError> {
        self.start_with(GatewayOptions {
            concurrency,
            ..GatewayOptions::default()
        })
    }

    pub fn start_with(&self, options: GatewayOptions) -> Result<Gateway, GatewayError> {
        Gateway::start(self.config()?, options)
    }
}

impl FilterSpec {
    /// A filter running `code` in VM `vm_id`, failing closed, with no configuration.
    pub fn new(name: &str, vm_id: &str, code: impl Into<PathBuf>) -> Self {
        Self {
            name: name.to_owned(),
            root_id: None,
            vm_id: vm_id.to_owned(),
            code: code.into(),
            configuration: None,
            fail_open: false,
            allow_on_headers_stop_iteration: false,
        }
    }

    /// `target/idemgate.wasm` with `configuration`, named as in `envoy/envoy.yaml`. Envoy's
    /// `allow_on_headers_stop_iteration` follows the configuration's declaration of it (the
    /// plugin cannot read Envoy's flag, and a filter declaring it without Envoy's would wait
    /// for bodies Envoy holds back); [`FilterSpec::allow_on_headers_stop_iteration`] overrides.
    pub fn idemgate(configuration: &str) -> Self {
        let declared = serde_json::from_str::<Value>(configuration)
            .is_ok_and(|c| c.get("allow_on_headers_stop_iteration") == Some(&Value::Bool(true)));
        Self::new(
            IDEMGATE,
            IDEMGATE,
            crate::target_dir().join("idemgate.wasm"),
        )
        .root_id(IDEMGATE)
        .configuration(configuration)
        .allow_on_headers_stop_iteration(declared)
    }

    /// The host-test fixture `target/fixtures/<fixture>.wasm`, in a VM of the same name.
    pub fn fixture(fixture: &str) -> Self {
        Self::new(
            fixture,
            fixture,
            crate::target_dir()
                .join("fixtures")
                .join(format!("{fixture}.wasm")),
        )
    }

    pub fn root_id(mut self, root_id: &str) -> Self {
        self.root_id = Some(root_id.to_owned());
        self
    }

    pub fn configuration(mut self, configuration: &str) -> Self {
        self.configuration = Some(configuration.to_owned());
        self
    }

    /// Envoy's `fail_open`: what happens to requests when the VM has failed.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.fail_open = fail_open;
        self
    }

    /// Envoy's `allow_on_headers_stop_iteration` (needed to fingerprint bodies).
    pub fn allow_on_headers_stop_iteration(mut self, allow: bool) -> Self {
        self.allow_on_headers_stop_iteration = allow;
        self
    }

    fn to_value(&self) -> Value {
        let mut config = json!({
            "name": self.name,
            "fail_open": self.fail_open,
            "vm_config": {
                "vm_id": self.vm_id,
                "runtime": "envoy.wasm.runtime.v8",
                "code": { "local": { "filename": self.code.to_string_lossy() } }
            }
        });
        if let Some(config) = config.as_object_mut() {
            if let Some(root_id) = &self.root_id {
                config.insert("root_id".into(), root_id.as_str().into());
            }
            if let Some(configuration) = &self.configuration {
                config.insert(
                    "configuration".into(),
                    json!({
                        "@type": "type.googleapis.com/google.protobuf.StringValue",
                        "value": configuration
                    }),
                );
            }
            if self.allow_on_headers_stop_iteration {
                config.insert("allow_on_headers_stop_iteration".into(), true.into());
            }
        }
        json!({
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": config
            }
        })
    }
}

impl ClusterSpec {
    /// A `STATIC` cluster at `address` (HTTP/1.1, Envoy's default circuit breakers).
    pub fn at(name: &str, address: SocketAddr) -> Self {
        Self {
            name: name.to_owned(),
            host: address.ip().to_string(),
            port: address.port(),
            strict_dns: false,
            connect_timeout: Duration::from_secs(1),
            http2_max_concurrent_streams: None,
            max_requests: None,
        }
    }

    /// A `STRICT_DNS` cluster resolving `host`.
    pub fn dns(name: &str, host: &str, port: u16) -> Self {
        Self {
            host: host.to_owned(),
            strict_dns: true,
            ..Self::at(name, SocketAddr::from(([127, 0, 0, 1], port)))
        }
    }

    /// The lock sidecar as `envoy/envoy.yaml` declares it: HTTP/2 for long-polls, circuit
    /// breakers far above the expected number of waiting requests, a short connect timeout.
    pub fn sidecar(address: SocketAddr) -> Self {
        Self::at(SIDECAR_CLUSTER, address)
            .connect_timeout(Duration::from_millis(250))
            .http2(10_000)
            .max_requests(10_000)
    }

    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Speak HTTP/2 (prior knowledge) to the endpoint.
    pub fn http2(mut self, max_concurrent_streams: u32) -> Self {
        self.http2_max_concurrent_streams = Some(max_concurrent_streams);
        self
    }

    /// The circuit breaker's `max_requests` (DEFAULT priority).
    pub fn max_requests(mut self, max_requests: u32) -> Self {
        self.max_requests = Some(max_requests);
        self
    }

    fn to_value(&self) -> Value {
        let mut cluster = json!({
            "name": self.name,
            "type": if self.strict_dns { "STRICT_DNS" } else { "STATIC" },
            "connect_timeout": duration(self.connect_timeout),
            "load_assignment": {
                "cluster_name": self.name,
                "endpoints": [{ "lb_endpoints": [{
                    "endpoint": { "address": socket_address(&self.host, self.port) }
                }]}]
            }
        });
        let Some(fields) = cluster.as_object_mut() else {
            return cluster;
        };
        if let Some(streams) = self.http2_max_concurrent_streams {
            fields.insert(
                "typed_extension_protocol_options".into(),
                json!({ "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {
                        "http2_protocol_options": { "max_concurrent_streams": streams }
                    }
                }}),
            );
        }
        if let Some(max_requests) = self.max_requests {
            fields.insert(
                "circuit_breakers".into(),
                json!({ "thresholds": [{
                    "priority": "DEFAULT",
                    "max_connections": 64,
                    "max_pending_requests": max_requests,
                    "max_requests": max_requests,
                    "max_retries": 3
                }]}),
            );
        }
        cluster
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::config::RouteAction;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn an_idemgate_gateway_parses_as_declared() {
        let plugin = "{\"rules\": [\n  {\"name\": \"it's \\\"quoted\\\"\"}]}";
        let config = Bootstrap::idemgate(addr(8080), addr(9470), plugin)
            .admin()
            .config()
            .unwrap();
        let [listener] = config.listeners.as_slice() else {
            panic!("one listener");
        };
        assert_eq!(listener.name, LISTENER);
        assert_eq!(listener.address.port(), 0);
        assert_eq!(
            listener.virtual_hosts[0].routes[0].action,
            RouteAction::Cluster {
                cluster: BACKEND.to_owned(),
                timeout: Some(Duration::from_secs(90))
            }
        );
        let wasm = listener.wasm.as_ref().unwrap();
        assert_eq!(wasm.settings.configuration, plugin.as_bytes());
        assert_eq!(wasm.settings.vm_id, IDEMGATE);
        assert_eq!(wasm.settings.root_id, IDEMGATE);
        assert!(wasm.code.ends_with("idemgate.wasm"));
        assert!(!wasm.settings.allow_on_headers_stop_iteration);
        let sidecar = &config.clusters[SIDECAR_CLUSTER];
        assert_eq!(sidecar.address, Some(addr(9470)));
        assert!(sidecar.http2);
        assert_eq!(sidecar.max_concurrent_streams, Some(10_000));
        assert_eq!(sidecar.max_requests, 10_000);
        assert_eq!(sidecar.connect_timeout, Duration::from_millis(250));
        assert_eq!(config.clusters[BACKEND].address, Some(addr(8080)));
        assert!(!config.clusters[BACKEND].http2);
        assert_eq!(config.admin.map(|a| a.port()), Some(0));
    }

    #[test]
    fn without_a_filter_the_chain_is_the_router() {
        let config = Bootstrap::new(addr(1))
            .cluster(ClusterSpec::dns("sidecar", "localhost", 2))
            .config()
            .unwrap();
        assert!(config.listeners[0].wasm.is_none());
        assert_eq!(
            config.listeners[0].virtual_hosts[0].routes[0].action,
            RouteAction::Cluster {
                cluster: BACKEND.to_owned(),
                timeout: Some(Duration::from_secs(15))
            },
            "Envoy's default"
        );
        assert_eq!(
            config.clusters["sidecar"].address.map(|a| a.port()),
            Some(2)
        );
        assert!(config.admin.is_none());
    }

    #[test]
    fn filter_flags_reach_the_plugin_settings() {
        let config = Bootstrap::new(addr(1))
            .filter(
                FilterSpec::fixture("probe")
                    .allow_on_headers_stop_iteration(true)
                    .fail_open(true),
            )
            .config()
            .unwrap();
        let wasm = config.listeners[0].wasm.as_ref().unwrap();
        assert!(wasm.settings.allow_on_headers_stop_iteration);
        assert_eq!(wasm.settings.failure_policy, crate::FailurePolicy::FailOpen);
        assert!(wasm.code.ends_with("fixtures/probe.wasm"));
        assert_eq!(wasm.settings.vm_id, "probe");
        assert!(wasm.settings.configuration.is_empty());
    }

    #[test]
    fn envoys_flag_follows_the_plugins_declaration_unless_overridden() {
        let flag = |filter: FilterSpec| {
            let config = Bootstrap::new(addr(1)).filter(filter).config().unwrap();
            config.listeners[0]
                .wasm
                .as_ref()
                .unwrap()
                .settings
                .allow_on_headers_stop_iteration
        };
        let declared = r#"{"allow_on_headers_stop_iteration":true,"rules":[]}"#;
        assert!(flag(FilterSpec::idemgate(declared)));
        assert!(!flag(FilterSpec::idemgate(r#"{"rules":[]}"#)));
        assert!(!flag(FilterSpec::idemgate("not json")));
        assert!(!flag(
            FilterSpec::idemgate(declared).allow_on_headers_stop_iteration(false)
        ));
    }
}
