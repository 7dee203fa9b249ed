//! Listeners: the HTTP connection manager's options, its route table and its HTTP filters.

use super::walk::{Message, Node};
use super::{ListenerConfig, socket_address, wasm};
use crate::gateway::access_log::{ENVOY_DEFAULT_FORMAT, Format as AccessLogFormat};
use crate::plugin::Cluster;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

pub(super) const HCM_NAME: &str = "envoy.filters.network.http_connection_manager";
pub(super) const HCM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
pub(super) const ROUTER_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";

/// How a route matches `:path` (`envoy.config.route.v3.RouteMatch`).
#[derive(Debug, Clone)]
pub enum PathMatch {
    /// `prefix`: the start of `:path`, query included.
    Prefix(String),
    /// `path`: all of `:path` once the query string is removed.
    Path(String),
    /// `safe_regex`: RE2 full match of `:path` once the query string is removed.
    Regex(regex::Regex),
}

/// What a matched route does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteAction {
    Cluster {
        cluster: String,
        /// Envoy's default route timeout is 15 s; `0s` disables it (`None`).
        timeout: Option<Duration>,
    },
    /// `direct_response`: the router answers itself.
    Direct { status: u16, body: Vec<u8> },
}

/// `append_action` of a `HeaderValueOption` (or the deprecated `append` bool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendAction {
    AppendIfExistsOrAdd,
    AddIfAbsent,
    OverwriteIfExistsOrAdd,
    OverwriteIfExists,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderToAdd {
    pub name: String,
    pub value: String,
    pub action: AppendAction,
    /// `keep_empty_value`: add the header even when its value is empty.
    pub keep_empty_value: bool,
}

/// `request_headers_to_remove` then `request_headers_to_add` of one level (route, virtual
/// host or route configuration), applied by the router to the upstream request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMutation {
    pub remove: Vec<String>,
    pub add: Vec<HeaderToAdd>,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub path: PathMatch,
    /// `match.case_sensitive` (default true; regex matches ignore it, as Envoy).
    pub case_sensitive: bool,
    pub action: RouteAction,
    pub headers: HeaderMutation,
    /// `metadata.filter_metadata` as JSON (`xds.route_metadata`).
    pub metadata: Option<serde_json::Value>,
}

#[derive(Debug, Clone)]
pub struct VirtualHost {
    pub name: String,
    /// Lower-cased `domains`: exact, `*.suffix`/`*suffix`, `prefix*` or `*`.
    pub domains: Vec<String>,
    pub routes: Vec<Route>,
    pub headers: HeaderMutation,
}

/// `path_with_escaped_slashes_action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashesAction {
    /// Also `IMPLEMENTATION_SPECIFIC_DEFAULT`, which is KEEP_UNCHANGED in Envoy.
    #[default]
    KeepUnchanged,
    RejectRequest,
    UnescapeAndRedirect,
    UnescapeAndForward,
}

/// `server_header_transformation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServerHeaderTransformation {
    #[default]
    Overwrite,
    AppendIfAbsent,
    PassThrough,
}

/// HTTP connection manager options that change what filters and clients see.
#[derive(Debug, Clone)]
pub struct HcmOptions {
    pub normalize_path: bool,
    pub merge_slashes: bool,
    pub escaped_slashes: EscapedSlashesAction,
    /// `server_name` (default "envoy").
    pub server_name: String,
    pub server_header: ServerHeaderTransformation,
    /// `http_protocol_options.allow_chunked_length`: accept a request with both
    /// Content-Length and Transfer-Encoding: chunked (Content-Length is then dropped).
    pub allow_chunked_length: bool,
}

impl Default for HcmOptions {
    fn default() -> Self {
        Self {
            normalize_path: false,
            merge_slashes: false,
            escaped_slashes: EscapedSlashesAction::KeepUnchanged,
            server_name: "envoy".to_owned(),
            server_header: ServerHeaderTransformation::Overwrite,
            allow_chunked_length: false,
        }
    }
}

pub(super) fn listener(
    index: usize,
    node: &Node<'_>,
    base: &Path,
    clusters: &BTreeMap<String, Cluster>,
) -> Option<ListenerConfig> {
    let raw = node.message(
        &[
            "name",
            "address",
            "filter_chains",
            "per_connection_buffer_limit_bytes",
            "enable_reuse_port",
        ],
        &["stat_prefix", "traffic_direction"],
    );
    let name = raw
        .str("name")
        .map_or_else(|| format!("listeners[{index}]"), str::to_owned);
    let address = raw.required("address").and_then(|a| socket_address(&a));
    let buffer_limit = raw.uint("per_connection_buffer_limit_bytes", u64::from(u32::MAX));
    let reuse_port = raw.bool("enable_reuse_port").unwrap_or(true);
    let chains = raw.list("filter_chains");
    let [chain] = chains.as_slice() else {
        raw.issue_at("filter_chains", "exactly one filter chain is supported");
        return None;
    };
    let chain = chain.message(&["filters"], &["name"]);
    let filters = chain.list("filters");
    let mut hcm = None;
    for (i, filter) in filters.iter().enumerate() {
        let f = filter.message(&["name", "typed_config"], &[]);
        let typed = f.get("typed_config").and_then(|t| t.any());
        match typed {
            Some((HCM_TYPE, config)) if i == 0 => hcm = Some(config),
            Some((type_url, _)) => f.issue(format!(
                "network filter `{}` ({type_url}) is not supported: a filter chain here is exactly one {HCM_NAME} ({HCM_TYPE})",
                f.str("name").unwrap_or_default()
            )),
            None => {
                if !f.has("typed_config") {
                    f.issue_at("typed_config", "missing");
                }
            }
        }
    }
    if filters.is_empty() {
        chain.issue_at("filters", format!("missing: one {HCM_NAME} is needed"));
    }
    let mut config = connection_manager(&hcm?, base, clusters)?;
    config.name = name;
    config.address = address?;
    config.reuse_port = reuse_port;
    if let (Some(limit), Some(w)) = (buffer_limit, config.wasm.as_mut()) {
        w.settings.buffer_limit = usize::try_from(limit).unwrap_or(usize::MAX);
    }
    Some(config)
}

fn connection_manager(
    node: &Node<'_>,
    base: &Path,
    clusters: &BTreeMap<String, Cluster>,
) -> Option<ListenerConfig> {
    let hcm = node.message(
        &[
            "stat_prefix",
            "codec_type",
            "route_config",
            "http_filters",
            "normalize_path",
            "merge_slashes",
            "path_with_escaped_slashes_action",
            "server_name",
            "server_header_transformation",
            "http_protocol_options",
            "access_log",
        ],
        &[],
    );
    let access_log = access_logs(&hcm);
    let stat_prefix = hcm.string("stat_prefix");
    if let Some(codec) = hcm.get("codec_type") {
        codec.choice(&["AUTO"]);
    }
    let mut options = HcmOptions {
        normalize_path: hcm.bool("normalize_path").unwrap_or(false),
        merge_slashes: hcm.bool("merge_slashes").unwrap_or(false),
        ..HcmOptions::default()
    };
    if let Some(action) = hcm.get("path_with_escaped_slashes_action") {
        options.escaped_slashes = match action.choice(&[
            "IMPLEMENTATION_SPECIFIC_DEFAULT",
            "KEEP_UNCHANGED",
            "REJECT_REQUEST",
            "UNESCAPE_AND_REDIRECT",
            "UNESCAPE_AND_FORWARD",
        ]) {
            Some("REJECT_REQUEST") => EscapedSlashesAction::RejectRequest,
            Some("UNESCAPE_AND_REDIRECT") => EscapedSlashesAction::UnescapeAndRedirect,
            Some("UNESCAPE_AND_FORWARD") => EscapedSlashesAction::UnescapeAndForward,
            _ => EscapedSlashesAction::KeepUnchanged,
        };
    }
    if let Some(name) = hcm.str("server_name") {
        options.server_name = name.to_owned();
    }
    if let Some(t) = hcm.get("server_header_transformation") {
        options.server_header = match t.choice(&["OVERWRITE", "APPEND_IF_ABSENT", "PASS_THROUGH"]) {
            Some("APPEND_IF_ABSENT") => ServerHeaderTransformation::AppendIfAbsent,
            Some("PASS_THROUGH") => ServerHeaderTransformation::PassThrough,
            _ => ServerHeaderTransformation::Overwrite,
        };
    }
    if let Some(http1) = hcm.message("http_protocol_options", &["allow_chunked_length"], &[]) {
        options.allow_chunked_length = http1.bool("allow_chunked_length").unwrap_or(false);
    }
    let (virtual_hosts, route_config_headers) = match hcm.required("route_config") {
        Some(rc) => route_config(&rc, clusters),
        None => (Vec::new(), HeaderMutation::default()),
    };
    let (wasm, suppress_envoy_headers) = http_filters(&hcm, base);
    Some(ListenerConfig {
        name: String::new(),
        address: std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
        reuse_port: true,
        stat_prefix,
        virtual_hosts,
        route_config_headers,
        hcm: options,
        suppress_envoy_headers,
        wasm,
        access_log,
    })
}

pub(super) const STDOUT_LOG_TYPE: &str =
    "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog";
pub(super) const FILE_LOG_TYPE: &str =
    "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog";

/// The HCM's `access_log`: stdout loggers (`StdoutAccessLog`, or `FileAccessLog` to
/// `/dev/stdout`) with a text format; each prints one line per request, as Envoy's do.
fn access_logs(hcm: &Message<'_>) -> Vec<AccessLogFormat> {
    let mut formats = Vec::new();
    for node in hcm.list("access_log") {
        let log = node.message(&["name", "typed_config"], &[]);
        let Some((type_url, config)) = log.required("typed_config").and_then(|t| t.any()) else {
            continue;
        };
        let config = match type_url {
            STDOUT_LOG_TYPE => config.message(&["log_format"], &[]),
            FILE_LOG_TYPE => {
                let file = config.message(&["path", "log_format"], &[]);
                if file.str("path") != Some("/dev/stdout") {
                    file.issue_at("path", "only /dev/stdout is supported here");
                }
                file
            }
            other => {
                log.issue(format!(
                    "access logger {other} is not supported: only {STDOUT_LOG_TYPE} and {FILE_LOG_TYPE} (path /dev/stdout)"
                ));
                continue;
            }
        };
        let text = match config.message("log_format", &["text_format_source"], &[]) {
            None => ENVOY_DEFAULT_FORMAT.to_owned(),
            Some(format) => {
                let source = format.message("text_format_source", &["inline_string"], &[]);
                match source.as_ref().and_then(|s| s.str("inline_string")) {
                    Some(text) => text.to_owned(),
                    None => {
                        format.issue("needs text_format_source.inline_string");
                        continue;
                    }
                }
            }
        };
        match AccessLogFormat::parse(&text) {
            Ok(format) => formats.push(format),
            Err(why) => config.issue(why),
        }
    }
    formats
}

const SUPPORTED_FILTERS: &str = "at most one envoy.filters.http.wasm \
(type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm) followed by \
envoy.filters.http.router (type.googleapis.com/envoy.extensions.filters.http.router.v3.Router)";

/// The HTTP filter chain: `[wasm] router`. Returns the wasm filter and the router's
/// `suppress_envoy_headers`.
fn http_filters(hcm: &Message<'_>, base: &Path) -> (Option<super::WasmFilter>, bool) {
    let filters = hcm.list("http_filters");
    let mut wasm_filter = None;
    let mut suppress = false;
    let mut router_seen = false;
    for (i, node) in filters.iter().enumerate() {
        let filter = node.message(&["name", "typed_config"], &["disabled", "is_optional"]);
        let name = filter.str("name").unwrap_or_default();
        let Some(typed) = filter.get("typed_config") else {
            filter.issue_at("typed_config", "missing");
            continue;
        };
        let Some((type_url, config)) = typed.any() else {
            continue;
        };
        let last = i + 1 == filters.len();
        match type_url {
            wasm::WASM_TYPE if !router_seen && wasm_filter.is_none() => {
                wasm_filter = wasm::filter(&config, base);
            }
            ROUTER_TYPE if last => {
                router_seen = true;
                let router = config.message(&["suppress_envoy_headers"], &["dynamic_stats"]);
                suppress = router.bool("suppress_envoy_headers").unwrap_or(false);
            }
            wasm::WASM_TYPE | ROUTER_TYPE => filter.issue(format!(
                "HTTP filter `{name}` is not where it can run: the chain here is {SUPPORTED_FILTERS}"
            )),
            other => filter.issue(format!(
                "HTTP filter `{name}` ({other}) is not supported: the chain here is {SUPPORTED_FILTERS}"
            )),
        }
    }
    if !router_seen {
        hcm.issue_at(
            "http_filters",
            format!("the chain must end with the router: {SUPPORTED_FILTERS}"),
        );
    }
    (wasm_filter, suppress)
}

fn route_config(
    node: &Node<'_>,
    clusters: &BTreeMap<String, Cluster>,
) -> (Vec<VirtualHost>, HeaderMutation) {
    let rc = node.message(
        &[
            "virtual_hosts",
            "request_headers_to_add",
            "request_headers_to_remove",
        ],
        &["name"],
    );
    let headers = header_mutation(&rc);
    let hosts = rc
        .list("virtual_hosts")
        .iter()
        .filter_map(|h| virtual_host(h, clusters))
        .collect();
    (hosts, headers)
}

fn virtual_host(node: &Node<'_>, clusters: &BTreeMap<String, Cluster>) -> Option<VirtualHost> {
    let host = node.message(
        &[
            "name",
            "domains",
            "routes",
            "request_headers_to_add",
            "request_headers_to_remove",
        ],
        &[],
    );
    let domains: Vec<String> = host
        .list("domains")
        .iter()
        .filter_map(|d| d.str().map(str::to_ascii_lowercase))
        .collect();
    if domains.is_empty() {
        host.issue_at("domains", "at least one domain is needed (\"*\" for any)");
    }
    let routes = host
        .list("routes")
        .iter()
        .filter_map(|r| route(r, clusters))
        .collect();
    Some(VirtualHost {
        name: host.string("name"),
        domains,
        routes,
        headers: header_mutation(&host),
    })
}

fn route(node: &Node<'_>, clusters: &BTreeMap<String, Cluster>) -> Option<Route> {
    let route = node.message(
        &[
            "name",
            "match",
            "route",
            "direct_response",
            "metadata",
            "request_headers_to_add",
            "request_headers_to_remove",
        ],
        &["decorator"],
    );
    let matcher = route
        .required("match")?
        .message(&["prefix", "path", "safe_regex", "case_sensitive"], &[]);
    let path = match (
        matcher.get("prefix"),
        matcher.get("path"),
        matcher.get("safe_regex"),
    ) {
        (Some(p), None, None) => PathMatch::Prefix(p.str()?.to_owned()),
        (None, Some(p), None) => PathMatch::Path(p.str()?.to_owned()),
        (None, None, Some(r)) => {
            let regex = r.message(&["regex", "google_re2"], &[]);
            let text = regex.required("regex")?.str()?;
            // RE2 semantics: a full match of the path (anchored both ends).
            match regex::Regex::new(&format!("^(?:{text})$")) {
                Ok(re) => PathMatch::Regex(re),
                Err(e) => {
                    regex.issue_at("regex", format!("not a valid regular expression: {e}"));
                    return None;
                }
            }
        }
        _ => {
            matcher.issue("set exactly one of prefix, path, safe_regex");
            return None;
        }
    };
    let action = match (route.get("route"), route.get("direct_response")) {
        (Some(action), None) => {
            let action = action.message(&["cluster", "timeout"], &[]);
            let cluster = action.required("cluster")?.str()?.to_owned();
            if !clusters.contains_key(&cluster) {
                action.issue_at("cluster", format!("unknown cluster `{cluster}`"));
            }
            let timeout = action
                .duration("timeout")
                .unwrap_or(Duration::from_secs(15));
            RouteAction::Cluster {
                cluster,
                timeout: (!timeout.is_zero()).then_some(timeout),
            }
        }
        (None, Some(direct)) => direct_response(&direct)?,
        _ => {
            route.issue("set exactly one of route, direct_response");
            return None;
        }
    };
    let metadata = route
        .message("metadata", &["filter_metadata"], &[])
        .and_then(|m| {
            let node = m.get("filter_metadata")?;
            match serde_json::to_value(node.value) {
                Ok(json @ serde_json::Value::Object(_)) => Some(json),
                _ => {
                    node.issue("expected a map of filter names to structs");
                    None
                }
            }
        });
    Some(Route {
        name: route.string("name"),
        path,
        case_sensitive: matcher.bool("case_sensitive").unwrap_or(true),
        action,
        headers: header_mutation(&route),
        metadata,
    })
}

fn direct_response(node: &Node<'_>) -> Option<RouteAction> {
    let direct = node.message(&["status", "body"], &[]);
    let status = u16::try_from(direct.required("status")?.uint(599)?).ok()?;
    if status < 200 {
        direct.issue_at("status", "must be from 200 to 599");
    }
    let body = match direct.message("body", &["inline_string", "filename"], &[]) {
        None => Vec::new(),
        Some(body) => match (body.get("inline_string"), body.get("filename")) {
            (Some(s), None) => s.str()?.as_bytes().to_vec(),
            (None, Some(f)) => {
                let file = f.str()?;
                match std::fs::read(file) {
                    Ok(bytes) => bytes,
                    Err(e) => {
                        f.issue(format!("cannot read `{file}`: {e}"));
                        return None;
                    }
                }
            }
            _ => {
                body.issue("set exactly one of inline_string, filename");
                return None;
            }
        },
    };
    Some(RouteAction::Direct { status, body })
}

/// Headers Envoy does not let a route add or remove (`HeaderParser`): pseudo-headers and host.
fn forbidden_header(name: &str) -> bool {
    name.starts_with(':') || name == "host"
}

fn header_mutation(level: &Message<'_>) -> HeaderMutation {
    let mut mutation = HeaderMutation::default();
    for node in level.list("request_headers_to_remove") {
        if let Some(name) = node.str() {
            let name = name.to_ascii_lowercase();
            if forbidden_header(&name) {
                node.issue(format!("`{name}` cannot be removed"));
            }
            mutation.remove.push(name);
        }
    }
    for node in level.list("request_headers_to_add") {
        let option = node.message(
            &["header", "append", "append_action", "keep_empty_value"],
            &[],
        );
        let Some(header) = option.required("header") else {
            continue;
        };
        let header = header.message(&["key", "value"], &[]);
        let (Some(key), value) = (header.str("key"), header.string("value")) else {
            header.issue_at("key", "missing");
            continue;
        };
        let name = key.to_ascii_lowercase();
        if forbidden_header(&name) {
            header.issue_at("key", format!("`{name}` cannot be added"));
        }
        if value.replace("%%", "").contains('%') {
            header.issue_at(
                "value",
                "command operators (%...%) are not supported here; use a literal value",
            );
        }
        let action = match (option.get("append"), option.get("append_action")) {
            (Some(_), Some(_)) => {
                option.issue("set either append or append_action, not both");
                AppendAction::AppendIfExistsOrAdd
            }
            (Some(append), None) => {
                if append.bool() == Some(false) {
                    AppendAction::OverwriteIfExistsOrAdd
                } else {
                    AppendAction::AppendIfExistsOrAdd
                }
            }
            (None, Some(action)) => match action.choice(&[
                "APPEND_IF_EXISTS_OR_ADD",
                "ADD_IF_ABSENT",
                "OVERWRITE_IF_EXISTS_OR_ADD",
                "OVERWRITE_IF_EXISTS",
            ]) {
                Some("ADD_IF_ABSENT") => AppendAction::AddIfAbsent,
                Some("OVERWRITE_IF_EXISTS_OR_ADD") => AppendAction::OverwriteIfExistsOrAdd,
                Some("OVERWRITE_IF_EXISTS") => AppendAction::OverwriteIfExists,
                _ => AppendAction::AppendIfExistsOrAdd,
            },
            (None, None) => AppendAction::AppendIfExistsOrAdd,
        };
        mutation.add.push(HeaderToAdd {
            name,
            value: value.replace("%%", "%"),
            action,
            keep_empty_value: option.bool("keep_empty_value").unwrap_or(false),
        });
    }
    mutation
}

/// Domain match kinds in Envoy's order of precedence (`RouteMatcher::findVirtualHost`).
fn domain_rank(domain: &str, host: &str) -> Option<(u8, usize)> {
    if domain == "*" {
        return Some((3, 0));
    }
    if domain == host {
        return Some((0, domain.len()));
    }
    if let Some(suffix) = domain.strip_prefix('*') {
        return (host.len() > suffix.len() && host.ends_with(suffix)).then_some((1, domain.len()));
    }
    if let Some(prefix) = domain.strip_suffix('*') {
        return (host.len() > prefix.len() && host.starts_with(prefix))
            .then_some((2, domain.len()));
    }
    None
}

impl ListenerConfig {
    /// The virtual host for `authority`: exact domains first, then the longest suffix
    /// wildcard, then the longest prefix wildcard, then `*`.
    pub fn virtual_host(&self, authority: &str) -> Option<&VirtualHost> {
        let host = authority.to_ascii_lowercase();
        self.virtual_hosts
            .iter()
            .flat_map(|v| v.domains.iter().map(move |d| (v, d)))
            .filter_map(|(v, d)| domain_rank(d, &host).map(|(kind, len)| (kind, len, v)))
            .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
            .map(|(_, _, v)| v)
    }

    /// The first route of the virtual host for `authority` that matches `path`.
    pub fn route(&self, authority: &str, path: &str) -> Option<(&VirtualHost, &Route)> {
        let host = self.virtual_host(authority)?;
        host.routes
            .iter()
            .find(|r| r.matches(path))
            .map(|r| (host, r))
    }
}

impl Route {
    /// `RouteMatch` semantics (`source/common/router/config_impl.cc`): prefix on the whole
    /// `:path`, exact path and regex on the path without its query string.
    pub fn matches(&self, path: &str) -> bool {
        let without_query = path.split(['?', '#']).next().unwrap_or_default();
        match &self.path {
            PathMatch::Prefix(p) if self.case_sensitive => path.starts_with(p.as_str()),
            PathMatch::Prefix(p) => path
                .get(..p.len())
                .is_some_and(|start| start.eq_ignore_ascii_case(p)),
            PathMatch::Path(p) if self.case_sensitive => without_query == p,
            PathMatch::Path(p) => without_query.eq_ignore_ascii_case(p),
            PathMatch::Regex(re) => re.is_match(without_query),
        }
    }
}

/// Remove-then-add of one level, as Envoy's `HeaderParser::evaluateHeaders`.
impl HeaderMutation {
    pub fn apply(&self, headers: &mut crate::headers::HeaderMap) {
        for name in &self.remove {
            headers.remove(name.as_bytes());
        }
        for h in &self.add {
            if h.value.is_empty() && !h.keep_empty_value {
                continue;
            }
            let present = headers.get_bytes(&h.name).is_some();
            match h.action {
                AppendAction::AppendIfExistsOrAdd => {
                    headers.add(h.name.as_bytes(), h.value.as_bytes());
                }
                AppendAction::AddIfAbsent if !present => {
                    headers.add(h.name.as_bytes(), h.value.as_bytes());
                }
                AppendAction::OverwriteIfExistsOrAdd => {
                    headers.replace(h.name.as_bytes(), h.value.as_bytes());
                }
                AppendAction::OverwriteIfExists if present => {
                    headers.replace(h.name.as_bytes(), h.value.as_bytes());
                }
                AppendAction::AddIfAbsent | AppendAction::OverwriteIfExists => {}
            }
        }
    }
}
