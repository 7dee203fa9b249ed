//! The wasm HTTP filter (`envoy.extensions.filters.http.wasm.v3.Wasm`).

use super::WasmFilter;
use super::walk::{Message, Node};
use crate::plugin::{FailurePolicy, PluginSettings};
use std::path::{Path, PathBuf};

pub(super) const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
pub(super) const STRING_VALUE_TYPE: &str = "type.googleapis.com/google.protobuf.StringValue";
pub(super) const WASM_SERVICE_TYPE: &str =
    "type.googleapis.com/envoy.extensions.wasm.v3.WasmService";
const WASM_SERVICE_NAME: &str = "envoy.bootstrap.wasm";
pub(super) const STRUCT_TYPE: &str = "type.googleapis.com/google.protobuf.Struct";

/// A `configuration` `Any` as the bytes a plugin reads (`MessageUtil::anyToBytes`):
/// StringValue → its value, Struct → JSON text, absent → empty.
fn configuration(message: &Message<'_>, field: &str) -> Vec<u8> {
    let Some((type_url, value)) = message.get(field).and_then(|n| n.any()) else {
        return Vec::new();
    };
    let fields = value.message(&["value"], &[]);
    match type_url {
        STRING_VALUE_TYPE => fields.string("value").into_bytes(),
        STRUCT_TYPE => fields
            .get("value")
            .and_then(|v| serde_json::to_vec(v.value).ok())
            .unwrap_or_else(|| b"{}".to_vec()),
        other => {
            value.issue(format!(
                "configuration of type {other} is not supported ({STRING_VALUE_TYPE} or {STRUCT_TYPE})"
            ));
            Vec::new()
        }
    }
}

fn failure_policy(config: &Message<'_>) -> FailurePolicy {
    match (config.get("fail_open"), config.get("failure_policy")) {
        (Some(_), Some(_)) => {
            config.issue("set either fail_open or failure_policy, not both");
            FailurePolicy::FailClosed
        }
        (Some(open), None) if open.bool() == Some(true) => FailurePolicy::FailOpen,
        (Some(_), None) | (None, None) => FailurePolicy::FailClosed,
        (None, Some(policy)) => {
            match policy.choice(&["UNSPECIFIED", "FAIL_CLOSED", "FAIL_OPEN", "FAIL_RELOAD"]) {
                Some("FAIL_OPEN") => FailurePolicy::FailOpen,
                Some("FAIL_RELOAD") => FailurePolicy::FailReload,
                _ => FailurePolicy::FailClosed,
            }
        }
    }
}

/// Fields of `PluginConfig` and `VmConfig` that cannot change anything here (listed in the
/// README): precompiled-code and code-cache switches (the gateway always compiles with
/// wasmtime), the capability allow-list (every hostcall is provided) and reload backoff
/// (FAIL_RELOAD retries after a fixed second).
const IGNORED_PLUGIN_FIELDS: &[&str] = &["capability_restriction_config", "reload_config"];
const IGNORED_VM_FIELDS: &[&str] = &["allow_precompiled", "nack_on_code_cache_miss"];

pub(super) fn filter(node: &Node<'_>, base: &Path) -> Option<WasmFilter> {
    let wasm = node.message(&["config"], &[]);
    plugin(&wasm.required("config")?, base)
}

/// An `envoy.extensions.wasm.v3.PluginConfig` (a filter's or a singleton service's).
pub(super) fn plugin(node: &Node<'_>, base: &Path) -> Option<WasmFilter> {
    let config = node.message(
        &[
            "name",
            "root_id",
            "vm_config",
            "configuration",
            "fail_open",
            "failure_policy",
            "allow_on_headers_stop_iteration",
        ],
        IGNORED_PLUGIN_FIELDS,
    );
    let failure_policy = failure_policy(&config);
    let vm = config.required("vm_config")?.message(
        &[
            "vm_id",
            "runtime",
            "code",
            "configuration",
            "environment_variables",
        ],
        IGNORED_VM_FIELDS,
    );
    if let Some(runtime) = vm.get("runtime") {
        runtime.choice(&["envoy.wasm.runtime.v8", "envoy.wasm.runtime.wasmtime", ""]);
    }
    let code = vm
        .required("code")?
        .message(&["local"], &[])
        .required("local")?
        .message(&["filename"], &[])
        .required("filename")?
        .str()?;
    let code = PathBuf::from(code);
    let code = if code.is_relative() {
        base.join(code)
    } else {
        code
    };
    let mut environment = Vec::new();
    if let Some(env) = vm.message(
        "environment_variables",
        &["key_values", "host_env_keys"],
        &[],
    ) {
        environment.extend(env.string_map("key_values"));
        for key in env.list("host_env_keys") {
            // Envoy passes a host variable only when it is set.
            if let Some(name) = key.str()
                && let Ok(value) = std::env::var(name)
            {
                environment.push((name.to_owned(), value));
            }
        }
    }
    Some(WasmFilter {
        settings: PluginSettings {
            name: config.string("name"),
            root_id: config.string("root_id"),
            vm_id: vm.string("vm_id"),
            vm_configuration: configuration(&vm, "configuration"),
            configuration: configuration(&config, "configuration"),
            failure_policy,
            allow_on_headers_stop_iteration: config
                .bool("allow_on_headers_stop_iteration")
                .unwrap_or(false),
            environment,
            ..PluginSettings::default()
        },
        code,
    })
}

/// One `bootstrap_extensions` entry (a singleton service's plugin, run by
/// [`crate::gateway::service`]); anything but a singleton `envoy.bootstrap.wasm` is refused,
/// naming the entry, with the file's other problems.
pub(super) fn service(node: &Node<'_>, base: &Path) -> Option<WasmFilter> {
    let entry = node.message(&["name", "typed_config"], &[]);
    let name = entry.string("name");
    let (type_url, typed) = entry.required("typed_config")?.any()?;
    if name != WASM_SERVICE_NAME || type_url != WASM_SERVICE_TYPE {
        entry.issue(format!(
            "{name} ({type_url}) is not supported; the only bootstrap extension is \
             {WASM_SERVICE_NAME} ({WASM_SERVICE_TYPE}) with singleton: true"
        ));
        return None;
    }
    let service = typed.message(&["singleton", "config"], &[]);
    if service.bool("singleton") != Some(true) {
        service.issue_at(
            "singleton",
            "only singleton: true services are supported (one VM on the main thread)",
        );
        return None;
    }
    plugin(&service.required("config")?, base)
}
