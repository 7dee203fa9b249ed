//! Finding idemgate filter configurations inside the files operators deploy: the raw JSON
//! configuration, an Envoy bootstrap (or any document holding Envoy's wasm filter config, such
//! as an Envoy Gateway `EnvoyPatchPolicy`), an Istio `WasmPlugin` or `TrafficExtension`, an
//! Envoy Gateway `EnvoyExtensionPolicy`, or rendered multi-document YAML with any of these.

use serde_json::Value;

/// Envoy's wasm HTTP filter (`typed_config` of `envoy.filters.http.wasm`).
const WASM_FILTER: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";

/// One filter configuration found in a file.
#[derive(Debug, Clone)]
pub struct Found {
    /// Which document of the file and which resource (`document 2 (WasmPlugin/idemgate)`).
    pub document: String,
    /// Where in the document the configuration sits (`spec.pluginConfig`).
    pub path: String,
    /// The configuration as the filter receives it (JSON bytes), or why it cannot be read.
    pub json: Result<Vec<u8>, String>,
    /// The VM environment variables the platform passes in, when the document says
    /// (`None`: a raw configuration, where nobody knows).
    pub environment: Option<Vec<String>>,
}

/// Every idemgate configuration in `text` (JSON or YAML, one or more documents).
pub fn configurations(text: &str) -> Result<Vec<Found>, String> {
    let documents: Vec<Value> = match serde_json::from_str::<Value>(text) {
        Ok(doc) => vec![doc],
        Err(_) => {
            let mut docs = Vec::new();
            for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
                let value = <Value as serde::Deserialize>::deserialize(doc)
                    .map_err(|e| format!("document {}: not YAML: {e}", i + 1))?;
                docs.push(value);
            }
            docs
        }
    };
    let many = documents.len() > 1;
    let mut found = Vec::new();
    for (i, doc) in documents.iter().enumerate() {
        if doc.is_null() {
            continue;
        }
        let label = document_label(i, doc, many);
        in_document(doc, &label, &mut found);
    }
    Ok(found)
}

fn document_label(index: usize, doc: &Value, many: bool) -> String {
    let resource = match (doc.get("kind"), doc.pointer("/metadata/name")) {
        (Some(Value::String(kind)), Some(Value::String(name))) => Some(format!("{kind}/{name}")),
        _ => None,
    };
    match (many, resource) {
        (true, Some(r)) => format!("document {} ({r})", index + 1),
        (true, None) => format!("document {}", index + 1),
        (false, Some(r)) => r,
        (false, None) => String::new(),
    }
}

fn in_document(doc: &Value, label: &str, found: &mut Vec<Found>) {
    let kind = doc.get("kind").and_then(Value::as_str);
    let spec = doc.get("spec");
    match (kind, spec) {
        (Some("WasmPlugin"), Some(spec)) => {
            plugin_resource(spec, "spec", "pluginConfig", label, found)
        }
        (Some("TrafficExtension"), Some(spec)) => {
            if let Some(wasm) = spec.get("wasm") {
                plugin_resource(wasm, "spec.wasm", "pluginConfig", label, found);
            }
        }
        (Some("EnvoyExtensionPolicy"), Some(spec)) => {
            for (i, wasm) in array(spec.get("wasm")).iter().enumerate() {
                plugin_resource(wasm, &format!("spec.wasm[{i}]"), "config", label, found);
            }
        }
        _ if is_raw_configuration(doc) => found.push(Found {
            document: label.to_owned(),
            path: String::new(),
            json: Ok(doc.to_string().into_bytes()),
            environment: None,
        }),
        _ => envoy_filters(doc, String::new(), label, found),
    }
}

fn array(value: Option<&Value>) -> &[Value] {
    value.and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

/// A raw filter configuration: the filter's own top-level fields, no Kubernetes or Envoy
/// envelope.
fn is_raw_configuration(doc: &Value) -> bool {
    doc.get("apiVersion").is_none()
        && doc.get("static_resources").is_none()
        && (doc.get("sidecar").is_some() || doc.get("rules").is_some())
}

/// Whether a platform resource is idemgate's: named so, or configured like it.
fn names_idemgate(names: &[Option<&Value>], config: Option<&Value>) -> bool {
    names
        .iter()
        .flatten()
        .any(|v| v.as_str().is_some_and(|s| s.contains("idemgate")))
        || config.is_some_and(|c| c.get("sidecar").is_some())
}

/// Istio `WasmPlugin` / `TrafficExtension.wasm` and Envoy Gateway `wasm[i]`: the
/// configuration is a YAML object the platform serialises to JSON for the filter.
fn plugin_resource(wasm: &Value, at: &str, field: &str, label: &str, found: &mut Vec<Found>) {
    let config = wasm.get(field);
    let names = [
        wasm.get("pluginName"),
        wasm.get("rootID"),
        wasm.get("name"),
        wasm.get("url"),
        wasm.pointer("/code/image/url"),
        wasm.pointer("/code/http/url"),
    ];
    if !names_idemgate(&names, config) {
        return;
    }
    // Istio: vmConfig.env (HOST or INLINE values); Envoy Gateway: env.hostKeys.
    let istio = array(wasm.pointer("/vmConfig/env"))
        .iter()
        .filter_map(|e| e.get("name").and_then(Value::as_str));
    let envoy_gateway = array(wasm.pointer("/env/hostKeys"))
        .iter()
        .filter_map(Value::as_str);
    let environment = istio.chain(envoy_gateway).map(str::to_owned).collect();
    found.push(Found {
        document: label.to_owned(),
        path: format!("{at}.{field}"),
        json: match config {
            Some(c) => Ok(c.to_string().into_bytes()),
            None => Err("no configuration".to_owned()),
        },
        environment: Some(environment),
    });
}

/// Every Envoy wasm filter config anywhere in `node` (bootstraps, patch policies).
fn envoy_filters(node: &Value, at: String, label: &str, found: &mut Vec<Found>) {
    match node {
        Value::Object(fields) => {
            if fields.get("@type").and_then(Value::as_str) == Some(WASM_FILTER) {
                envoy_filter(node, &at, label, found);
                return;
            }
            for (name, value) in fields {
                let child = if at.is_empty() {
                    name.clone()
                } else {
                    format!("{at}.{name}")
                };
                envoy_filters(value, child, label, found);
            }
        }
        Value::Array(items) => {
            for (i, value) in items.iter().enumerate() {
                envoy_filters(value, format!("{at}[{i}]"), label, found);
            }
        }
        _ => {}
    }
}

fn envoy_filter(typed: &Value, at: &str, label: &str, found: &mut Vec<Found>) {
    let Some(config) = typed.get("config") else {
        return;
    };
    // `configuration` is an Any: a StringValue holding the JSON text.
    let text = config
        .pointer("/configuration/value")
        .and_then(Value::as_str);
    let parsed = text.and_then(|t| serde_json::from_str::<Value>(t).ok());
    let names = [
        config.get("name"),
        config.get("root_id"),
        config.pointer("/vm_config/vm_id"),
        config.pointer("/vm_config/code/local/filename"),
    ];
    if !names_idemgate(&names, parsed.as_ref()) {
        return;
    }
    let env = config.pointer("/vm_config/environment_variables");
    let key_values = env
        .and_then(|e| e.get("key_values"))
        .and_then(Value::as_object)
        .into_iter()
        .flat_map(|m| m.keys().cloned());
    let host = array(env.and_then(|e| e.get("host_env_keys")))
        .iter()
        .filter_map(Value::as_str)
        .map(str::to_owned);
    found.push(Found {
        document: label.to_owned(),
        path: format!("{at}.config.configuration.value"),
        json: match text {
            Some(t) => Ok(t.as_bytes().to_vec()),
            None => Err("no configuration (a google.protobuf.StringValue)".to_owned()),
        },
        environment: Some(key_values.chain(host).collect()),
    });
}

/// The filter's verdict on one configuration: every error its own parser (the one that runs
/// inside Envoy, natively) finds, then the token variable's wiring where the document shows
/// it. The wiring is checked only on a configuration the parser accepts: it reads the parsed
/// `sidecar.token_env`.
pub fn check(found: &Found) -> Result<idemgate_core::Config, Vec<idemgate_core::ConfigError>> {
    let bytes = found.json.as_ref().map_err(|message| {
        vec![idemgate_core::ConfigError {
            path: "configuration".to_owned(),
            message: message.clone(),
        }]
    })?;
    let config = idemgate_core::config::parse_all(bytes)?;
    if let (Some(variable), Some(passed)) = (&config.sidecar.token_env, &found.environment)
        && !passed.contains(variable)
    {
        return Err(vec![idemgate_core::ConfigError {
            path: "sidecar.token_env".to_owned(),
            message: format!(
                "the VM environment variable {variable} is not passed into the filter's VM \
                 (passed: {passed:?}); the filter would refuse this configuration"
            ),
        }]);
    }
    Ok(config)
}

/// One [`describe`] line per error.
pub fn describe_all(found: &Found, errors: &[idemgate_core::ConfigError]) -> String {
    errors
        .iter()
        .map(|e| describe(found, e))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `document: path.field: message`, the path joined from where the configuration sits and
/// the parser's field path.
pub fn describe(found: &Found, error: &idemgate_core::ConfigError) -> String {
    let field = match (found.path.as_str(), error.path.as_str()) {
        ("", field) => field.to_owned(),
        (at, "configuration") => at.to_owned(),
        (at, field) => format!("{at}.{field}"),
    };
    if found.document.is_empty() {
        format!("{field}: {}", error.message)
    } else {
        format!("{}: {field}: {}", found.document, error.message)
    }
}
