//! Finding (or installing) a toolchain that can build `wasm32-wasip1`.
//!
//! Two routes, chosen per machine:
//! - **rustup**: the active toolchain has the wasm targets — an ordinary online machine;
//! - **debian**: Debian's `rustc-web` with its matching std source builds std for wasm32
//!   itself (`-Zbuild-std`), linked by `lld` against `wasi-libc` — offline machines whose
//!   rustup cannot download targets. Installed through apt when missing and we are root.

use crate::cmd;
use anyhow::{Result, bail};
use std::path::Path;
use std::process::Command;

/// Debian packages of the offline route; clippy is included because `xtask test` lints the
/// filter for wasm32 with the same compiler that builds it, binaryen because its `wasm-opt`
/// shrinks the filter (optional: the build skips it where it is absent).
const DEBIAN_PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "rust-web-src",
    "rust-web-clippy",
    "lld-22",
    "wasi-libc",
    "binaryen",
];

const DEBIAN_FILES: &[&str] = &[
    "/usr/bin/cargo",
    "/usr/bin/cargo-clippy",
    "/usr/bin/rust-lld",
    "/usr/lib/rustlib/src/rust/library/std/Cargo.toml",
    "/usr/lib/wasm32-wasi/libc.a",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Rustup,
    Debian,
}

/// The route this machine supports, installing the Debian one if that is what it takes.
pub fn wasm_route() -> Result<Route> {
    if rustup_has_targets() {
        return Ok(Route::Rustup);
    }
    if debian_ready() {
        return Ok(Route::Debian);
    }
    if is_root() && has_apt() {
        apt_install(DEBIAN_PACKAGES)?;
        if debian_ready() {
            return Ok(Route::Debian);
        }
    }
    bail!(
        "no toolchain can build wasm32-wasip1 here: run `rustup target add wasm32-wasip1 \
         wasm32-unknown-unknown`, or as root on Debian `apt-get install {}`",
        DEBIAN_PACKAGES.join(" ")
    )
}

/// Installs the Debian packages providing what is missing: `(need, package)` pairs, where a
/// need is a binary on PATH or, when it starts with `/`, a file.
pub fn ensure_apt(needs: &[(&str, &str)]) -> Result<()> {
    let present = |need: &str| {
        if need.starts_with('/') {
            Path::new(need).exists()
        } else {
            cmd::succeeds(Command::new("which").arg(need))
        }
    };
    let missing: Vec<&str> = needs
        .iter()
        .filter(|(need, _)| !present(need))
        .map(|&(_, package)| package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !(is_root() && has_apt()) {
        bail!(
            "missing {}: install it with `apt-get install {}`",
            missing.join(", "),
            missing.join(" ")
        );
    }
    apt_install(&missing)
}

fn rustup_has_targets() -> bool {
    let Some(installed) =
        cmd::output(Command::new("rustup").args(["target", "list", "--installed"]))
    else {
        return false;
    };
    ["wasm32-wasip1", "wasm32-unknown-unknown"]
        .iter()
        .all(|t| installed.lines().any(|l| l.trim() == *t))
}

fn debian_ready() -> bool {
    DEBIAN_FILES.iter().all(|f| Path::new(f).exists())
}

fn is_root() -> bool {
    cmd::output(Command::new("id").arg("-u")).is_some_and(|uid| uid.trim() == "0")
}

fn has_apt() -> bool {
    Path::new("/usr/bin/apt-get").exists()
}

fn apt_install(packages: &[&str]) -> Result<()> {
    cmd::step(
        "apt-get update",
        Command::new("apt-get").args(["update", "-qq"]),
    )?;
    cmd::step(
        "apt-get install",
        Command::new("apt-get")
            .args(["install", "-y", "-qq"])
            .args(packages)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}
