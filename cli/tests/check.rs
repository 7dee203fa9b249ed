//! `idemgate check` as an operator runs it: every configuration of every document is
//! checked, each error is printed with its full path, and the exit code says whether any
//! failed.

// The whole crate is test code, helpers included: clippy's allow-*-in-tests settings
// (clippy.toml) see only `#[test]` functions and `cfg(test)` items as tests.
#![cfg(test)]

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

fn check(name: &str, text: &str) -> (bool, String) {
    // One directory per call: the tests run in parallel, and two of them check a file of the
    // same name (with a shared directory one read the other's text now and then).
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "idemgate-check-{}-{call}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(name);
    std::fs::write(&file, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("check")
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).replace(&file.display().to_string(), name),
    )
}

const MULTI: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata: { name: unrelated }
data: { a: b }
---
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: { name: idemgate }
spec:
  url: oci://registry/idemgate-filter:1
  vmConfig: { env: [{ name: T, valueFrom: HOST }] }
  pluginConfig:
    sidecar: { cluster: c, token_env: T }
    rules: [{ name: a, key: { max_length: 300 } }]
---
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyExtensionPolicy
metadata: { name: eg }
spec:
  wasm:
  - name: idemgate
    code: { type: Image, image: { url: registry/idemgate-filter:1 } }
    env: { hostKeys: [OTHER] }
    config: { sidecar: { cluster: c, token_env: T }, rules: [{}] }
---
static_resources:
  listeners:
  - filter_chains:
    - filters:
      - typed_config:
          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                root_id: idemgate
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{"sidecar": {"cluster": "c"}, "rules": [{"mode": "lock"}]}'
"#;

#[test]
fn every_configuration_in_every_document_is_checked_with_its_path() {
    let (ok, out) = check("rendered.yaml", MULTI);
    assert!(!ok, "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "rendered.yaml: document 2 (WasmPlugin/idemgate): spec.pluginConfig.rules[0].key.max_length: must be in 1..=255",
            "rendered.yaml: document 3 (EnvoyExtensionPolicy/eg): spec.wasm[0].config.sidecar.token_env: the VM environment variable T is not passed into the filter's VM (passed: [\"OTHER\"]); the filter would refuse this configuration",
            "rendered.yaml: document 4: static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[0].typed_config.config.configuration.value.rules[0].key: lock mode needs a resource id: header, path_param, query_param or body_pointer",
        ],
        "{out}"
    );
}

#[test]
fn every_error_of_a_configuration_is_reported() {
    let (ok, out) = check(
        "broken.yaml",
        r#"
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: { name: idemgate }
spec:
  url: oci://registry/idemgate-filter:1
  pluginConfig:
    sidecar: { cluster: c, timeout: soon }
    colour: blue
    rules:
    - { name: a, mode: sometimes }
    - { name: b }
    - { name: c, key: { max_length: 300 } }
"#,
    );
    assert!(!ok, "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "broken.yaml: WasmPlugin/idemgate: spec.pluginConfig: unknown field `colour`, expected one of `sidecar`, `failure_mode`, `shadow`, `breaker`, `local`, `allow_on_headers_stop_iteration`, `fencing_header`, `degraded_header`, `would_block_header`, `tick`, `release_attempts`, `rules`",
            "broken.yaml: WasmPlugin/idemgate: spec.pluginConfig.sidecar.timeout: `soon` is not a duration like \"250ms\", \"30s\", \"5m\" or \"24h\"",
            "broken.yaml: WasmPlugin/idemgate: spec.pluginConfig.rules[0].mode: `sometimes` is not one of `idempotency`, `lock`",
            "broken.yaml: WasmPlugin/idemgate: spec.pluginConfig.rules[2].key.max_length: must be in 1..=255",
        ],
        "{out}"
    );
}

#[test]
fn raw_json_passes_and_files_without_a_configuration_fail() {
    let (ok, out) = check(
        "raw.json",
        r#"{"sidecar": {"cluster": "c"}, "rules": [{"name": "payments"}]}"#,
    );
    assert!(ok, "{out}");
    assert_eq!(out.trim(), "raw.json: valid (1 rule(s))");
    let (ok, out) = check(
        "other.yaml",
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n",
    );
    assert!(!ok);
    assert_eq!(out.trim(), "other.yaml: no idemgate configuration found");
    let (ok, out) = check("broken.yaml", "a: [");
    assert!(!ok);
    assert!(
        out.starts_with("broken.yaml: document 1: not YAML"),
        "{out}"
    );
}
