//! The subset of Envoy's bootstrap v3 YAML the gateway runs. The file is read as Envoy's
//! loader reads it (the `walk` module) and every field is checked: a field the gateway does not
//! implement, or implements differently, is reported with its path — all of them in one
//! error — rather than silently ignored. Fields that cannot change what a filter or client
//! sees here are accepted and listed in `host-tests/README.md`.

mod cluster;
mod listener;
mod walk;
mod wasm;

use crate::plugin::{Cluster, PluginSettings};
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use walk::{Issues, Message, Node};

pub use listener::{
    AppendAction, EscapedSlashesAction, HcmOptions, HeaderMutation, HeaderToAdd, PathMatch, Route,
    RouteAction, ServerHeaderTransformation, VirtualHost,
};

/// A configuration the gateway cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The text is not YAML.
    #[error("invalid envoy config: {0}")]
    Yaml(String),
    /// Every field of the file the gateway cannot run, each `path: message`.
    #[error(
        "envoy config not supported by idemgate-gateway ({} problem{}):\n{}\n{SUPPORTED}",
        .0.len(),
        if .0.len() == 1 { "" } else { "s" },
        .0.iter().map(|i| format!("  - {i}")).collect::<Vec<_>>().join("\n")
    )]
    Unsupported(Vec<String>),
    #[error("invalid envoy config: {path}: {message}")]
    Invalid { path: String, message: String },
}

/// What the gateway runs, said once after every refusal.
const SUPPORTED: &str = "idemgate-gateway runs: static_resources listeners (TCP socket_address) \
with one filter chain holding one envoy.filters.network.http_connection_manager, whose \
http_filters are at most one envoy.filters.http.wasm followed by envoy.filters.http.router; \
routes matching prefix/path/safe_regex to a cluster or a direct_response; STATIC, STRICT_DNS \
and LOGICAL_DNS clusters with one endpoint over HTTP/1.1 or HTTP/2; an admin address. \
The full list is the \"Supported Envoy config subset\" of the idemgate-host README.";

fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

/// Type URLs the gateway reads (a `TypedStruct` names its type without the host part).
const KNOWN_TYPES: &[&str] = &[
    listener::HCM_TYPE,
    wasm::WASM_TYPE,
    listener::ROUTER_TYPE,
    wasm::STRING_VALUE_TYPE,
    wasm::STRUCT_TYPE,
    cluster::HTTP_OPTIONS_TYPE,
    wasm::WASM_SERVICE_TYPE,
    listener::STDOUT_LOG_TYPE,
    listener::FILE_LOG_TYPE,
];

/// The wasm filter of a listener's chain.
#[derive(Debug, Clone)]
pub struct WasmFilter {
    pub settings: PluginSettings,
    pub code: PathBuf,
}

/// A listener with its HTTP connection manager.
#[derive(Debug, Clone)]
pub struct ListenerConfig {
    /// The listener's `name`, or `listeners[<index>]` when it has none (Envoy generates one).
    pub name: String,
    pub address: SocketAddr,
    /// `enable_reuse_port` (default true, as Envoy's on Linux): each worker accepts on its own
    /// `SO_REUSEPORT` socket and the kernel spreads connections among them; false: the
    /// workers share one socket and whichever wakes first accepts.
    pub reuse_port: bool,
    pub stat_prefix: String,
    pub virtual_hosts: Vec<VirtualHost>,
    /// `route_config.request_headers_to_{add,remove}` (applied after the virtual host's).
    pub route_config_headers: HeaderMutation,
    pub hcm: HcmOptions,
    /// The router's `suppress_envoy_headers`: no `x-envoy-*` headers added.
    pub suppress_envoy_headers: bool,
    /// `None`: the chain is only the router.
    pub wasm: Option<WasmFilter>,
    /// The HCM's stdout access logs, one line each per request; none configured: the
    /// gateway's own line (unless `GatewayOptions::access_log` is off).
    pub access_log: Vec<crate::gateway::access_log::Format>,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct EnvoyConfig {
    pub listeners: Vec<ListenerConfig>,
    /// By name; a cluster without `name` is called `clusters[<index>]`.
    pub clusters: BTreeMap<String, Cluster>,
    pub admin: Option<SocketAddr>,
    /// Singleton Wasm services (`bootstrap_extensions`), run on the main thread.
    pub services: Vec<super::service::WasmService>,
    /// Cluster names in file order (for `--set-port clusters[<index>]=PORT`).
    cluster_order: Vec<String>,
    /// `stats_config.stats_tags`: labels cut out of plugin metric names on `/stats/prometheus`.
    pub stats_tags: Vec<StatsTag>,
}

/// One `stats_config.stats_tags` extractor (`envoy.config.metrics.v3.TagSpecifier` with a
/// `regex`): where it matches a stat name, the first capture group is cut out of the name and
/// the second (or, without one, the first) is the tag's value, as Envoy's
/// `TagExtractorImplBase` does (`source/common/stats/tag_extractor_impl.cc`).
#[derive(Debug, Clone)]
pub struct StatsTag {
    pub name: String,
    pub regex: regex::Regex,
}

impl StatsTag {
    /// `name` without the tagged part, and the tag's value; `None` where it does not match.
    pub fn extract(&self, name: &str) -> Option<(String, String)> {
        let captures = self.regex.captures(name)?;
        let cut = captures.get(1)?;
        let value = captures.get(2).unwrap_or(cut).as_str().to_owned();
        let mut rest = String::with_capacity(name.len());
        rest.push_str(&name[..cut.start()]);
        rest.push_str(&name[cut.end()..]);
        Some((rest, value))
    }
}

fn stats_tags(top: &Message<'_>) -> Vec<StatsTag> {
    let Some(stats) = top.message("stats_config", &["stats_tags"], &["use_all_default_tags"])
    else {
        return Vec::new();
    };
    let mut tags = Vec::new();
    for node in stats.list("stats_tags") {
        let tag = node.message(&["tag_name", "regex"], &[]);
        let (Some(name), Some(regex)) = (tag.str("tag_name"), tag.required("regex")) else {
            continue;
        };
        match regex.str().map(regex::Regex::new) {
            Some(Ok(regex)) => tags.push(StatsTag {
                name: name.to_owned(),
                regex,
            }),
            Some(Err(e)) => regex.issue(format!("not a regex this gateway runs: {e}")),
            None => {}
        }
    }
    tags
}

/// An `envoy.config.core.v3.Address` with a TCP `socket_address`.
fn socket_address(node: &Node<'_>) -> Option<SocketAddr> {
    let address = node.message(&["socket_address"], &[]);
    let socket = address
        .required("socket_address")?
        .message(&["address", "port_value", "protocol"], &["ipv4_compat"]);
    if let Some(protocol) = socket.get("protocol") {
        protocol.choice(&["TCP"]);
    }
    let host = socket.required("address")?.str()?;
    let port = u16::try_from(socket.uint("port_value", u64::from(u16::MAX)).unwrap_or(0)).ok()?;
    let resolved = (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next());
    if resolved.is_none() {
        socket.issue_at("address", format!("cannot resolve `{host}`"));
    }
    resolved
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
        let value: serde_norway::Value =
            serde_norway::from_str(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
        let issues = Issues::default();
        let config = Self::walk(&Node::root(&value, &issues), base);
        if !issues.is_empty() {
            return Err(ConfigError::Unsupported(issues.into_vec()));
        }
        Ok(config)
    }

    fn walk(root: &Node<'_>, base: &Path) -> Self {
        let top = root.message(
            &[
                "static_resources",
                "admin",
                "bootstrap_extensions",
                "stats_config",
            ],
            &["node"],
        );
        let stats_tags = stats_tags(&top);
        let resources = top
            .required("static_resources")
            .map(|n| n.message(&["listeners", "clusters"], &[]));
        let mut clusters = BTreeMap::new();
        let mut cluster_order = Vec::new();
        for (i, node) in resources
            .iter()
            .flat_map(|r| r.list("clusters"))
            .enumerate()
        {
            if let Some(c) = cluster::cluster(i, &node) {
                if clusters.contains_key(&c.name) {
                    node.issue(format!("duplicate cluster name `{}`", c.name));
                }
                cluster_order.push(c.name.clone());
                clusters.insert(c.name.clone(), c);
            }
        }
        let mut listeners = Vec::new();
        for (i, node) in resources
            .iter()
            .flat_map(|r| r.list("listeners"))
            .enumerate()
        {
            if let Some(l) = listener::listener(i, &node, base, &clusters) {
                listeners.push(l);
            }
        }
        let admin = top.get("admin").and_then(|admin| {
            let admin = admin.message(&["address"], &["access_log_path", "access_log"]);
            socket_address(&admin.required("address")?)
        });
        let services = top
            .list("bootstrap_extensions")
            .iter()
            .filter_map(|node| wasm::service(node, base))
            .map(|plugin| super::service::WasmService { plugin })
            .collect();
        Self {
            listeners,
            clusters,
            admin,
            services,
            cluster_order,
            stats_tags,
        }
    }

    /// Runs `code` in every wasm filter instead of its `vm_config.code.local.filename`
    /// (`--wasm-path`; the shipped config names where a deployment installs the module).
    pub fn set_wasm_path(&mut self, code: &Path) {
        for wasm in self.listeners.iter_mut().filter_map(|l| l.wasm.as_mut()) {
            wasm.code = code.to_owned();
        }
    }

    /// Applies a `--set-port TARGET=PORT` override. TARGET is `admin`, a listener or cluster
    /// name, `listeners[<index>]` / `clusters[<index>]` (file order, for unnamed ones), or a
    /// listener's address as written in the file (`0.0.0.0:10000`).
    pub fn set_port(&mut self, target: &str, port: u16) -> Result<(), ConfigError> {
        if target == "admin"
            && let Some(admin) = self.admin.as_mut()
        {
            admin.set_port(port);
            return Ok(());
        }
        let index = |prefix: &str| {
            target
                .strip_prefix(prefix)
                .and_then(|rest| rest.strip_suffix(']'))
                .and_then(|i| i.parse::<usize>().ok())
        };
        let address: Option<SocketAddr> = target.parse().ok();
        let listener = match index("listeners[") {
            Some(i) => self.listeners.get_mut(i),
            None => self
                .listeners
                .iter_mut()
                .find(|l| l.name == target || Some(l.address) == address),
        };
        if let Some(l) = listener {
            l.address.set_port(port);
            return Ok(());
        }
        let cluster = match index("clusters[") {
            Some(i) => self.cluster_order.get(i).cloned(),
            None => Some(target.to_owned()),
        };
        if let Some(address) = cluster
            .and_then(|name| self.clusters.get_mut(&name))
            .and_then(|c| c.address.as_mut())
        {
            address.set_port(port);
            return Ok(());
        }
        Err(invalid(
            format!("--set-port {target}"),
            "no listener, cluster or admin of that name, index or address",
        ))
    }
}
