//! Validating the Envoy configs we ship against Envoy's API schema. Envoy itself cannot run
//! on the build machines, so `envoy/check_config.py` parses each bootstrap with the
//! generated data-plane API (PyPI `xds-protos`) in a virtualenv under `target/`.

use crate::cmd;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Pinned so a schema change upstream cannot turn CI red overnight.
const PACKAGES: &[&str] = &["xds-protos==1.85.0", "protobuf==7.36.2", "PyYAML==6.0.4"];

/// Validates every bootstrap under `envoy/` (top-level `*.yaml`) and proves the validator
/// rejects broken variants of each.
pub fn check(root: &Path) -> Result<()> {
    let python = venv(root)?;
    let mut configs: Vec<PathBuf> = std::fs::read_dir(root.join("envoy"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    configs.sort();
    cmd::step(
        "envoy configs against Envoy's API schema",
        Command::new(python)
            .arg(root.join("envoy/check_config.py"))
            .arg("--self-test")
            .args(&configs),
    )
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
