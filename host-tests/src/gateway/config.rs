//! The subset of Envoy's bootstrap v3 YAML the gateway understands. Every struct denies
//! unknown fields, so a field the gateway does not implement is an error naming its path
//! rather than something silently ignored.

use crate::plugin::{Cluster, FailurePolicy, PluginSettings};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A configuration the gateway cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Includes the YAML path of the offending field (e.g. an unsupported one).
    #[error("invalid envoy config: {0}")]
    Yaml(String),
    #[error("invalid envoy config: {path}: {message}")]
    Invalid { path: String, message: String },
}

pub(super) fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Bootstrap {
    #[serde(default)]
    admin: Option<Admin>,
    static_resources: StaticResources,
    /// Singleton Wasm services ([`super::service`]).
    #[serde(default)]
    bootstrap_extensions: Vec<super::service::RawExtension>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Admin {
    address: Address,
    #[serde(default)]
    access_log_path: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StaticResources {
    #[serde(default)]
    listeners: Vec<Listener>,
    #[serde(default)]
    clusters: Vec<RawCluster>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Address {
    socket_address: SocketAddress,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SocketAddress {
    address: String,
    port_value: u16,
    #[serde(default)]
    protocol: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Listener {
    name: String,
    address: Address,
    #[serde(default)]
    per_connection_buffer_limit_bytes: Option<usize>,
    filter_chains: Vec<FilterChain>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterChain {
    filters: Vec<NetworkFilter>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NetworkFilter {
    name: String,
    typed_config: HttpConnectionManager,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpConnectionManager {
    #[serde(rename = "@type")]
    type_url: String,
    stat_prefix: String,
    #[serde(default)]
    codec_type: Option<String>,
    route_config: RouteConfig,
    http_filters: Vec<HttpFilter>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteConfig {
    /// Identifiers only: accepted, no behaviour here.
    #[serde(default, rename = "name")]
    _name: Option<String>,
    virtual_hosts: Vec<VirtualHost>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VirtualHost {
    #[serde(rename = "name")]
    _name: String,
    domains: Vec<String>,
    routes: Vec<RawRoute>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    #[serde(rename = "match")]
    matcher: RouteMatch,
    route: RouteAction,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteMatch {
    prefix: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteAction {
    cluster: String,
    #[serde(default)]
    timeout: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpFilter {
    name: String,
    typed_config: HttpFilterConfig,
}

/// The wasm filter's `Wasm` message, or the router's empty `Router` message.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpFilterConfig {
    #[serde(rename = "@type")]
    type_url: String,
    #[serde(default)]
    config: Option<PluginConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PluginConfig {
    #[serde(default)]
    name: String,
    #[serde(default)]
    root_id: String,
    vm_config: VmConfig,
    #[serde(default)]
    configuration: Option<StringValue>,
    #[serde(default)]
    fail_open: Option<bool>,
    #[serde(default)]
    failure_policy: Option<String>,
    #[serde(default)]
    allow_on_headers_stop_iteration: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VmConfig {
    #[serde(default)]
    vm_id: String,
    #[serde(default)]
    runtime: Option<String>,
    code: Code,
    #[serde(default)]
    configuration: Option<StringValue>,
    #[serde(default)]
    environment_variables: Option<EnvironmentVariables>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvironmentVariables {
    #[serde(default)]
    key_values: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Code {
    local: LocalCode,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LocalCode {
    filename: String,
}

/// `google.protobuf.StringValue` in an `Any`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StringValue {
    #[serde(rename = "@type")]
    type_url: String,
    value: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    name: String,
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    connect_timeout: Option<String>,
    #[serde(default)]
    lb_policy: Option<String>,
    #[serde(default)]
    dns_lookup_family: Option<String>,
    load_assignment: LoadAssignment,
    #[serde(default)]
    typed_extension_protocol_options: Option<BTreeMap<String, ProtocolOptions>>,
    #[serde(default)]
    circuit_breakers: Option<CircuitBreakers>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CircuitBreakers {
    thresholds: Vec<Thresholds>,
}

/// Only `max_requests` changes behaviour here: the gateway never retries (so `max_retries`
/// always holds) and opens connections instead of queueing for them (so `max_connections` /
/// `max_pending_requests` are validated but have nothing to bound).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Thresholds {
    #[serde(default)]
    priority: Option<String>,
    #[serde(default, rename = "max_connections")]
    _max_connections: Option<u32>,
    #[serde(default, rename = "max_pending_requests")]
    _max_pending_requests: Option<u32>,
    #[serde(default)]
    max_requests: Option<u32>,
    #[serde(default, rename = "max_retries")]
    _max_retries: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadAssignment {
    #[serde(default, rename = "cluster_name")]
    _cluster_name: Option<String>,
    endpoints: Vec<LocalityEndpoints>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LocalityEndpoints {
    lb_endpoints: Vec<LbEndpoint>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LbEndpoint {
    endpoint: Endpoint,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Endpoint {
    address: Address,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProtocolOptions {
    #[serde(rename = "@type")]
    type_url: String,
    explicit_http_config: ExplicitHttpConfig,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExplicitHttpConfig {
    #[serde(default)]
    http_protocol_options: Option<EmptyMessage>,
    #[serde(default)]
    http2_protocol_options: Option<Http2Options>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Http2Options {
    #[serde(default)]
    max_concurrent_streams: Option<u32>,
}

/// Options messages the gateway accepts only empty (defaults).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EmptyMessage {}

const HCM_NAME: &str = "envoy.filters.network.http_connection_manager";
const HCM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const WASM_NAME: &str = "envoy.filters.http.wasm";
const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const ROUTER_NAME: &str = "envoy.filters.http.router";
const ROUTER_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";
const STRING_VALUE_TYPE: &str = "type.googleapis.com/google.protobuf.StringValue";
const HTTP_OPTIONS_KEY: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";
const HTTP_OPTIONS_TYPE: &str =
    "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// One prefix route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub prefix: String,
    pub cluster: String,
    /// Envoy's default route timeout is 15 s; `0s` disables it.
    pub timeout: Option<Duration>,
}

/// The wasm filter of a listener's chain.
#[derive(Debug, Clone)]
pub struct WasmFilter {
    pub settings: PluginSettings,
    pub code: PathBuf,
}

/// A listener with its HTTP connection manager.
#[derive(Debug, Clone)]
pub struct ListenerConfig {
    pub name: String,
    pub address: SocketAddr,
    pub stat_prefix: String,
    pub routes: Vec<Route>,
    /// `None`: the chain is only the router.
    pub wasm: Option<WasmFilter>,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct EnvoyConfig {
    pub listeners: Vec<ListenerConfig>,
    pub clusters: BTreeMap<String, Cluster>,
    pub admin: Option<SocketAddr>,
    /// Singleton Wasm services (`bootstrap_extensions`), run on the main thread.
    pub services: Vec<super::service::WasmService>,
}

/// Protobuf JSON durations: `"1s"`, `"0.25s"` (Envoy configs also use them for timeouts).
fn duration(path: &str, text: &str) -> Result<Duration, ConfigError> {
    text.strip_suffix('s')
        .and_then(|n| n.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            invalid(
                path,
                format!("`{text}` is not a duration like \"1s\" or \"0.25s\""),
            )
        })
}

fn socket_address(path: &str, address: &SocketAddress) -> Result<SocketAddr, ConfigError> {
    if let Some(protocol) = address.protocol.as_deref().filter(|p| *p != "TCP") {
        return Err(invalid(
            format!("{path}.protocol"),
            format!("only TCP is supported, not {protocol}"),
        ));
    }
    (address.address.as_str(), address.port_value)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            invalid(
                format!("{path}.address"),
                format!("cannot resolve `{}`", address.address),
            )
        })
}

fn string_value(path: &str, value: Option<StringValue>) -> Result<Vec<u8>, ConfigError> {
    match value {
        None => Ok(Vec::new()),
        Some(v) if v.type_url == STRING_VALUE_TYPE => Ok(v.value.into_bytes()),
        Some(v) => Err(invalid(
            format!("{path}.@type"),
            format!("only {STRING_VALUE_TYPE} is supported, not {}", v.type_url),
        )),
    }
}

pub(super) fn wasm_filter(
    path: &str,
    config: PluginConfig,
    base: &Path,
) -> Result<WasmFilter, ConfigError> {
    let failure_policy = match (config.fail_open, config.failure_policy.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                path,
                "set either fail_open or failure_policy, not both",
            ));
        }
        (Some(true), None) => FailurePolicy::FailOpen,
        (Some(false), None) | (None, None | Some("UNSPECIFIED" | "FAIL_CLOSED")) => {
            FailurePolicy::FailClosed
        }
        (None, Some("FAIL_OPEN")) => FailurePolicy::FailOpen,
        (None, Some("FAIL_RELOAD")) => FailurePolicy::FailReload,
        (None, Some(other)) => {
            return Err(invalid(
                format!("{path}.failure_policy"),
                format!("unknown policy {other}"),
            ));
        }
    };
    let vm = config.vm_config;
    if let Some(runtime) = vm.runtime.as_deref()
        && !matches!(
            runtime,
            "envoy.wasm.runtime.v8" | "envoy.wasm.runtime.wasmtime" | ""
        )
    {
        return Err(invalid(
            format!("{path}.vm_config.runtime"),
            format!("{runtime} is not supported (v8/wasmtime modules run on wasmtime here)"),
        ));
    }
    let code = PathBuf::from(&vm.code.local.filename);
    let code = if code.is_relative() {
        base.join(code)
    } else {
        code
    };
    Ok(WasmFilter {
        settings: PluginSettings {
            name: config.name,
            root_id: config.root_id,
            vm_id: vm.vm_id,
            vm_configuration: string_value(
                &format!("{path}.vm_config.configuration"),
                vm.configuration,
            )?,
            configuration: string_value(&format!("{path}.configuration"), config.configuration)?,
            failure_policy,
            allow_on_headers_stop_iteration: config
                .allow_on_headers_stop_iteration
                .unwrap_or(false),
            environment: vm
                .environment_variables
                .map(|e| e.key_values.into_iter().collect())
                .unwrap_or_default(),
            ..PluginSettings::default()
        },
        code,
    })
}

fn listener(index: usize, raw: Listener, base: &Path) -> Result<ListenerConfig, ConfigError> {
    let path = format!("static_resources.listeners[{index}]");
    let address = socket_address(
        &format!("{path}.address.socket_address"),
        &raw.address.socket_address,
    )?;
    let [chain] = <[FilterChain; 1]>::try_from(raw.filter_chains).map_err(|_| {
        invalid(
            format!("{path}.filter_chains"),
            "exactly one filter chain is supported",
        )
    })?;
    let [hcm] = <[NetworkFilter; 1]>::try_from(chain.filters).map_err(|_| {
        invalid(
            format!("{path}.filter_chains[0].filters"),
            "exactly one filter (the HTTP connection manager) is supported",
        )
    })?;
    let hcm_path = format!("{path}.filter_chains[0].filters[0]");
    if hcm.name != HCM_NAME || hcm.typed_config.type_url != HCM_TYPE {
        return Err(invalid(
            hcm_path,
            format!("only {HCM_NAME} ({HCM_TYPE}) is supported"),
        ));
    }
    let hcm = hcm.typed_config;
    if let Some(codec) = hcm.codec_type.as_deref().filter(|c| *c != "AUTO") {
        return Err(invalid(
            format!("{hcm_path}.typed_config.codec_type"),
            format!("only AUTO is supported, not {codec}"),
        ));
    }
    let mut routes = Vec::new();
    for (v, host) in hcm.route_config.virtual_hosts.into_iter().enumerate() {
        let host_path = format!("{hcm_path}.typed_config.route_config.virtual_hosts[{v}]");
        if host.domains != ["*"] {
            return Err(invalid(
                format!("{host_path}.domains"),
                "only [\"*\"] is supported",
            ));
        }
        for (r, route) in host.routes.into_iter().enumerate() {
            let timeout = match route.route.timeout {
                Some(t) => duration(&format!("{host_path}.routes[{r}].route.timeout"), &t)?,
                None => Duration::from_secs(15),
            };
            routes.push(Route {
                prefix: route.matcher.prefix,
                cluster: route.route.cluster,
                timeout: (!timeout.is_zero()).then_some(timeout),
            });
        }
    }
    let filters_path = format!("{hcm_path}.typed_config.http_filters");
    let mut filters = hcm.http_filters.into_iter().enumerate().peekable();
    let mut wasm = None;
    if let Some((i, filter)) = filters.next_if(|(_, f)| f.name == WASM_NAME) {
        let fpath = format!("{filters_path}[{i}].typed_config");
        if filter.typed_config.type_url != WASM_TYPE {
            return Err(invalid(
                format!("{fpath}.@type"),
                format!("expected {WASM_TYPE}"),
            ));
        }
        let config = filter
            .typed_config
            .config
            .ok_or_else(|| invalid(format!("{fpath}.config"), "missing"))?;
        wasm = Some(wasm_filter(&format!("{fpath}.config"), config, base)?);
    }
    match (filters.next(), filters.next()) {
        (Some((_, router)), None)
            if router.name == ROUTER_NAME
                && router.typed_config.type_url == ROUTER_TYPE
                && router.typed_config.config.is_none() => {}
        _ => {
            return Err(invalid(
                filters_path,
                format!(
                    "the chain must be [{WASM_NAME}] followed by {ROUTER_NAME} ({ROUTER_TYPE}) and nothing else"
                ),
            ));
        }
    }
    if let (Some(limit), Some(w)) = (raw.per_connection_buffer_limit_bytes, wasm.as_mut()) {
        w.settings.buffer_limit = limit;
    }
    Ok(ListenerConfig {
        name: raw.name,
        address,
        stat_prefix: hcm.stat_prefix,
        routes,
        wasm,
    })
}

fn cluster(index: usize, raw: RawCluster) -> Result<Cluster, ConfigError> {
    let path = format!("static_resources.clusters[{index}]");
    match raw.kind.as_deref() {
        None | Some("STATIC" | "STRICT_DNS" | "LOGICAL_DNS") => {}
        Some(other) => {
            return Err(invalid(
                format!("{path}.type"),
                format!("{other} is not supported (STATIC, STRICT_DNS, LOGICAL_DNS)"),
            ));
        }
    }
    if let Some(lb) = raw.lb_policy.as_deref().filter(|p| *p != "ROUND_ROBIN") {
        return Err(invalid(
            format!("{path}.lb_policy"),
            format!("only ROUND_ROBIN is supported, not {lb}"),
        ));
    }
    if let Some(family) = raw
        .dns_lookup_family
        .as_deref()
        .filter(|f| !matches!(*f, "V4_ONLY" | "AUTO" | "V4_PREFERRED"))
    {
        return Err(invalid(
            format!("{path}.dns_lookup_family"),
            format!("{family} is not supported"),
        ));
    }
    let endpoints: Vec<&LbEndpoint> = raw
        .load_assignment
        .endpoints
        .iter()
        .flat_map(|e| &e.lb_endpoints)
        .collect();
    let [endpoint] = endpoints.as_slice() else {
        return Err(invalid(
            format!("{path}.load_assignment.endpoints"),
            "exactly one endpoint is supported",
        ));
    };
    let address = socket_address(
        &format!(
            "{path}.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address"
        ),
        &endpoint.endpoint.address.socket_address,
    )?;
    let mut http2 = false;
    let mut max_concurrent_streams = None;
    for (key, options) in raw.typed_extension_protocol_options.unwrap_or_default() {
        let opath = format!("{path}.typed_extension_protocol_options.{key}");
        if key != HTTP_OPTIONS_KEY || options.type_url != HTTP_OPTIONS_TYPE {
            return Err(invalid(
                opath,
                format!("only {HTTP_OPTIONS_KEY} is supported"),
            ));
        }
        let explicit = options.explicit_http_config;
        http2 = match (
            explicit.http_protocol_options,
            explicit.http2_protocol_options,
        ) {
            (None, Some(options)) => {
                max_concurrent_streams = options.max_concurrent_streams;
                true
            }
            (Some(_), None) => false,
            _ => {
                return Err(invalid(
                    format!("{opath}.explicit_http_config"),
                    "set exactly one of http_protocol_options, http2_protocol_options",
                ));
            }
        };
    }
    let mut max_requests = 1024;
    for (t, thresholds) in raw
        .circuit_breakers
        .map(|c| c.thresholds)
        .unwrap_or_default()
        .into_iter()
        .enumerate()
    {
        match thresholds.priority.as_deref() {
            None | Some("DEFAULT") => {}
            Some(other) => {
                return Err(invalid(
                    format!("{path}.circuit_breakers.thresholds[{t}].priority"),
                    format!(
                        "only DEFAULT is supported (routes have no priority here), not {other}"
                    ),
                ));
            }
        }
        max_requests = thresholds.max_requests.unwrap_or(1024);
    }
    let connect_timeout = match raw.connect_timeout {
        Some(t) => duration(&format!("{path}.connect_timeout"), &t)?,
        None => Duration::from_secs(5),
    };
    Ok(Cluster {
        name: raw.name,
        address: Some(address),
        http2,
        connect_timeout,
        max_concurrent_streams,
        max_requests,
    })
}

impl EnvoyConfig {
    /// Reads a file; relative wasm paths resolve against the current directory, as Envoy's.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_yaml(&text, Path::new("."))
    }

    /// Parses YAML; relative wasm paths resolve against `base`.
    pub fn from_yaml(text: &str, base: &Path) -> Result<Self, ConfigError> {
        let raw: Bootstrap =
            serde_yaml::from_str(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
        let mut clusters = BTreeMap::new();
        for (i, c) in raw.static_resources.clusters.into_iter().enumerate() {
            let c = cluster(i, c)?;
            if clusters.insert(c.name.clone(), c).is_some() {
                return Err(invalid(
                    format!("static_resources.clusters[{i}].name"),
                    "duplicate cluster name",
                ));
            }
        }
        let mut listeners = Vec::new();
        for (i, l) in raw.static_resources.listeners.into_iter().enumerate() {
            let l = listener(i, l, base)?;
            for (r, route) in l.routes.iter().enumerate() {
                if !clusters.contains_key(&route.cluster) {
                    return Err(invalid(
                        format!("static_resources.listeners[{i}] route {r}"),
                        format!("unknown cluster `{}`", route.cluster),
                    ));
                }
            }
            listeners.push(l);
        }
        let admin = match raw.admin {
            Some(admin) => {
                if admin.access_log_path.is_some() {
                    return Err(invalid("admin.access_log_path", "not supported"));
                }
                Some(socket_address(
                    "admin.address.socket_address",
                    &admin.address.socket_address,
                )?)
            }
            None => None,
        };
        Ok(Self {
            listeners,
            clusters,
            admin,
            services: super::service::parse(raw.bootstrap_extensions, base)?,
        })
    }

    /// Runs `code` in every wasm filter instead of its `vm_config.code.local.filename`
    /// (`--wasm-path`; the shipped config names where a deployment installs the module).
    pub fn set_wasm_path(&mut self, code: &Path) {
        for wasm in self.listeners.iter_mut().filter_map(|l| l.wasm.as_mut()) {
            wasm.code = code.to_owned();
        }
    }

    /// Applies a `--set-port name=PORT` override to the listener or cluster called `name`
    /// (or `admin`).
    pub fn set_port(&mut self, name: &str, port: u16) -> Result<(), ConfigError> {
        if name == "admin"
            && let Some(admin) = self.admin.as_mut()
        {
            admin.set_port(port);
            return Ok(());
        }
        if let Some(l) = self.listeners.iter_mut().find(|l| l.name == name) {
            l.address.set_port(port);
            return Ok(());
        }
        if let Some(address) = self.clusters.get_mut(name).and_then(|c| c.address.as_mut()) {
            address.set_port(port);
            return Ok(());
        }
        Err(invalid(
            format!("--set-port {name}"),
            "no listener, cluster or admin of that name",
        ))
    }
}
