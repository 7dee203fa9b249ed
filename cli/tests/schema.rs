//! The JSON Schema for editors (`idemgate schema`, cli/config.schema.json) against the
//! filter's own parser: on every fixture and every configuration the repository ships, both
//! accept or both reject. `fixtures/semantic/` holds what the parser rejects and a JSON Schema
//! cannot express (cross-field rules); the schema accepts those, and the test says so.

// The whole crate is test code, helpers included: clippy's allow-*-in-tests settings
// (clippy.toml) see only `#[test]` functions and `cfg(test)` items as tests.
#![cfg(test)]

use idemgate_cli::{CONFIG_SCHEMA, extract};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixtures(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "fixtures in {}", dir.display());
    files
}

fn schema() -> jsonschema::Validator {
    jsonschema::validator_for(&serde_json::from_str(CONFIG_SCHEMA).unwrap()).unwrap()
}

fn verdicts(file: &Path) -> (bool, bool, String) {
    let text = std::fs::read_to_string(file).unwrap();
    let value: Value = serde_json::from_str(&text).unwrap();
    let parser = idemgate_core::config::parse(text.as_bytes());
    let errors: Vec<String> = schema()
        .iter_errors(&value)
        .map(|e| format!("{}: {e}", e.instance_path))
        .collect();
    let why = format!(
        "{}: parser {:?}, schema {errors:?}",
        file.display(),
        parser.as_ref().err()
    );
    (parser.is_ok(), errors.is_empty(), why)
}

#[test]
fn schema_and_parser_agree_on_the_fixtures() {
    for file in fixtures("valid") {
        let (parser, schema, why) = verdicts(&file);
        assert!(parser && schema, "both accept: {why}");
    }
    for file in fixtures("invalid") {
        let (parser, schema, why) = verdicts(&file);
        assert!(!parser && !schema, "both reject: {why}");
    }
    for file in fixtures("semantic") {
        let (parser, schema, why) = verdicts(&file);
        assert!(!parser && schema, "the parser alone rejects: {why}");
    }
}

#[test]
fn schema_accepts_every_shipped_configuration() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let shipped = [
        "envoy/envoy.yaml",
        "envoy/compose/envoy.yaml",
        "envoy/kubernetes/overlays/istio/wasmplugin.yaml",
        "envoy/kubernetes/overlays/envoy-gateway/extension-policy.yaml",
    ];
    for file in shipped {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let found = extract::configurations(&text).unwrap();
        assert!(!found.is_empty(), "{file}: an idemgate configuration");
        for f in found {
            let json = f.json.clone().unwrap();
            assert!(extract::check(&f).is_ok(), "{file}: the parser accepts it");
            let value: Value = serde_json::from_slice(&json).unwrap();
            let errors: Vec<String> = schema()
                .iter_errors(&value)
                .map(|e| e.to_string())
                .collect();
            assert!(errors.is_empty(), "{file}: {errors:?}");
        }
    }
}
