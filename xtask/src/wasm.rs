//! Building the proxy-wasm modules: the filter (`target/idemgate.wasm`) and the host-test
//! fixtures (`target/fixtures/<dir>.wasm`, every crate under `host-tests/fixtures/`).

use crate::cmd;
use crate::toolchain::{self, Route};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

const FILTER_PACKAGE: &str = "idemgate-plugin";
/// Crates linted for wasm32: the filter and everything it compiles in.
const FILTER_CRATES: &[&str] = &["idemgate-plugin", "idemgate-core", "idemgate-wire"];
const PROFILE: &str = "wasm";
const WASI: &str = "wasm32-wasip1";
const UNKNOWN: &str = "wasm32-unknown-unknown";
/// Fixture also built for wasm32-unknown-unknown, so the host is tested on both targets.
const UNKNOWN_FIXTURE: &str = "noop";
/// Binaryen's optimizer (Debian `binaryen`), run on the filter when present: it removes
/// ~55 KB that LLVM leaves (duplicate functions, dead data). `-O3` rather than `-Oz`, so the
/// per-request code is never traded for size. The profile strips the `target_features`
/// section, so the features rustc enables for wasm32 by default are named here.
const WASM_OPT: &str = "wasm-opt";
const WASM_OPT_ARGS: &[&str] = &[
    "-O3",
    "--enable-bulk-memory",
    "--enable-multivalue",
    "--enable-mutable-globals",
    "--enable-nontrapping-float-to-int",
    "--enable-reference-types",
    "--enable-sign-ext",
];

/// Builds every module; returns the filter's path.
pub fn build_all(root: &Path) -> Result<PathBuf> {
    build_with(root, toolchain::wasm_route()?)
}

pub fn build_with(root: &Path, route: Route) -> Result<PathBuf> {
    let fixtures = fixtures(root)?;
    let mut build = cargo(root, route, WASI, &["build", "--profile", PROFILE]);
    build.args(["-p", FILTER_PACKAGE]);
    for (_, package) in &fixtures {
        build.args(["-p", package]);
    }
    cmd::step("wasm build (wasm32-wasip1)", &mut build)?;
    let mut unknown = cargo(root, route, UNKNOWN, &["build", "--profile", PROFILE]);
    unknown.args(["-p", &format!("fixture-{UNKNOWN_FIXTURE}")]);
    cmd::step("wasm build (wasm32-unknown-unknown)", &mut unknown)?;

    let target = root.join("target");
    let filter = target.join("idemgate.wasm");
    optimize(&built(root, WASI, FILTER_PACKAGE), &filter)?;
    std::fs::create_dir_all(target.join("fixtures"))?;
    for (dir, package) in &fixtures {
        copy(
            &built(root, WASI, package),
            &target.join(format!("fixtures/{dir}.wasm")),
        )?;
    }
    copy(
        &built(root, UNKNOWN, &format!("fixture-{UNKNOWN_FIXTURE}")),
        &target.join(format!("fixtures/{UNKNOWN_FIXTURE}-unknown.wasm")),
    )?;
    let size = std::fs::metadata(&filter)?.len();
    println!(
        "{} ({size} bytes, {:.1} KiB)",
        filter.display(),
        size as f64 / 1024.0
    );
    Ok(filter)
}

/// `cargo clippy -D warnings` for the filter crates, compiled for wasm32-wasip1.
pub fn clippy(root: &Path, route: Route) -> Command {
    let mut clippy = cargo(root, route, WASI, &["clippy"]);
    for package in FILTER_CRATES {
        clippy.args(["-p", package]);
    }
    clippy.args(["--", "-D", "warnings"]);
    clippy
}

/// `cargo <subcommand>` for `target` on `route`; the caller adds packages and the rest.
fn cargo(root: &Path, route: Route, target: &str, subcommand: &[&str]) -> Command {
    let mut command = match route {
        Route::Rustup => cmd::cargo(),
        Route::Debian => {
            let mut c = Command::new("/usr/bin/cargo");
            let path = std::env::var("PATH").unwrap_or_default();
            c.env("PATH", format!("/usr/bin:{path}"))
                // Unlocks -Z flags on Debian's stable compiler: its std source matches it
                // exactly, which is what -Zbuild-std needs.
                .env("RUSTC_BOOTSTRAP", "1")
                .env_remove("RUSTC")
                .env_remove("RUSTDOC")
                .env_remove("CARGO");
            if target == WASI {
                // Link against Debian's wasi-libc instead of a self-contained copy the
                // Debian compiler does not ship.
                c.env(
                    "RUSTFLAGS",
                    "-C link-self-contained=no -L native=/usr/lib/wasm32-wasi",
                );
            } else {
                c.env_remove("RUSTFLAGS");
            }
            c
        }
    };
    command.current_dir(root).args(subcommand).args([
        "--target",
        target,
        "--target-dir",
        "target/wasm-build",
    ]);
    if route == Route::Debian {
        command.arg("-Zbuild-std=std,panic_abort");
    }
    command
}

/// Copies the filter to `to`, through `wasm-opt` when it is installed (optional: the
/// unoptimized module works the same, it is only larger).
fn optimize(from: &Path, to: &Path) -> Result<()> {
    if !cmd::succeeds(Command::new("which").arg(WASM_OPT)) {
        println!(
            "{WASM_OPT} not found (apt-get install binaryen): the filter is not post-optimized"
        );
        return copy(from, to);
    }
    let mut wasm_opt = Command::new(WASM_OPT);
    wasm_opt.args(WASM_OPT_ARGS).arg(from).arg("-o").arg(to);
    cmd::step("wasm-opt (filter)", &mut wasm_opt)
}

fn built(root: &Path, target: &str, package: &str) -> PathBuf {
    root.join("target/wasm-build")
        .join(target)
        .join(PROFILE)
        .join(format!("{}.wasm", package.replace('-', "_")))
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

/// `(directory name, package name)` of every fixture crate.
fn fixtures(root: &Path) -> Result<Vec<(String, String)>> {
    let mut found = Vec::new();
    let dir = root.join("host-tests/fixtures");
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let manifest = path.join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&manifest) else {
            continue;
        };
        let package = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("name = "))
            .map(|n| n.trim_matches('"').to_string())
            .with_context(|| format!("{} has no package name", manifest.display()))?;
        let dir_name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        found.push((dir_name, package));
    }
    found.sort();
    Ok(found)
}
