//! Validating the Envoy configs we ship against Envoy's API schema. Envoy itself cannot run
//! on the build machines, so `envoy/check_config.py` parses each bootstrap with the
//! generated data-plane API (PyPI `xds-protos`) in a virtualenv under `target/`.

use crate::cmd;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Pinned so a schema change upstream cannot turn CI red overnight.
const PACKAGES: &[&str] = &[
    "xds-protos==1.85.0",
    "protobuf==7.36.2",
    "PyYAML==6.0.4",
    "kubernetes-validate==1.37.0",
];

/// The `docker compose` quick start's bootstrap: checked like the top-level ones, though no
/// test runs it (it carries jwt_authn, which the test gateway does not implement).
const COMPOSE_BOOTSTRAP: &str = "envoy/compose/envoy.yaml";

/// The Kustomize overlays under `envoy/kubernetes/overlays/`, each rendered and validated.
const OVERLAYS: &[&str] = &["istio", "envoy-gateway"];

/// Validates every bootstrap under `envoy/` (top-level `*.yaml`, and the compose quick
/// start's) and proves the validator rejects broken variants of each.
pub fn check(root: &Path) -> Result<()> {
    let python = venv(root)?;
    let mut configs: Vec<PathBuf> = std::fs::read_dir(root.join("envoy"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    configs.sort();
    configs.push(root.join(COMPOSE_BOOTSTRAP));
    cmd::step(
        "envoy configs against Envoy's API schema",
        Command::new(python)
            .arg(root.join("envoy/check_config.py"))
            .arg("--self-test")
            .args(&configs),
    )
}

/// Renders every Kubernetes overlay with `kubectl kustomize`, validates the output against
/// the Kubernetes schemas, the vendored CRD schemas and the token wiring
/// (`envoy/kubernetes/validate.py`, which also proves it rejects broken variants), and checks
/// every embedded filter configuration with the filter's own parser (`idemgate check`, run
/// by `idemgate`: [`cli_by_cargo_run`] or a built binary).
pub fn check_bundle(root: &Path, mut idemgate: Command) -> Result<()> {
    crate::toolchain::ensure_apt(&[("kubectl", "kubectl")])?;
    let python = venv(root)?;
    let out = root.join("target/rendered");
    std::fs::create_dir_all(&out).context("creating target/rendered")?;
    let mut rendered = Vec::new();
    for overlay in OVERLAYS {
        let file = out.join(format!("{overlay}.yaml"));
        let text = cmd::output(
            Command::new("kubectl")
                .arg("kustomize")
                .arg(root.join("envoy/kubernetes/overlays").join(overlay)),
        )
        .with_context(|| format!("kubectl kustomize overlays/{overlay} failed"))?;
        std::fs::write(&file, text).context("writing the rendered overlay")?;
        rendered.push(file);
    }
    cmd::step(
        "Kubernetes bundle against Kubernetes and CRD schemas, token wiring",
        Command::new(&python)
            .arg(root.join("envoy/kubernetes/validate.py"))
            .arg("--self-test")
            .args(&rendered),
    )?;
    cmd::step(
        "embedded filter configurations (idemgate check)",
        idemgate
            .arg("check")
            .args(&rendered)
            .arg(root.join("envoy/envoy.yaml"))
            .arg(root.join(COMPOSE_BOOTSTRAP))
            .current_dir(root),
    )
}

/// `idemgate` as `cargo run -p idemgate-cli` builds it. `cargo xtask test` runs the binary
/// its build of every test and binary made instead: a build of this package alone resolves
/// other features for its dependencies (reqwest, tokio, rustls) and compiles them again.
pub fn cli_by_cargo_run(root: &Path) -> Command {
    let mut cargo = cmd::cargo();
    cargo
        .args(["run", "--quiet", "-p", "idemgate-cli", "--"])
        .current_dir(root);
    cargo
}

fn venv(root: &Path) -> Result<PathBuf> {
    let dir = root.join("target/xds-venv");
    let python = dir.join("bin/python");
    let stamp = dir.join("packages.txt");
    let wanted = PACKAGES.join("\n");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(python);
    }
    crate::toolchain::ensure_apt(&[("python3", "python3-venv")])?;
    cmd::step(
        "python venv for schema validation",
        Command::new("python3")
            .args(["-m", "venv", "--clear"])
            .arg(&dir),
    )?;
    cmd::step(
        "pip install xds-protos",
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(PACKAGES),
    )?;
    std::fs::write(&stamp, wanted).context("writing the venv stamp")?;
    Ok(python)
}
