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
/// Profile of the fixtures (the no-op baseline keeps the ordinary speed-optimized build).
const PROFILE: &str = "wasm";
/// Profile of the filter: size-optimized, see `[profile.wasm-filter]` in Cargo.toml.
const FILTER_PROFILE: &str = "wasm-filter";
/// The filter's size ceiling (256 KiB, a product goal), enforced where
/// `-Cpanic=immediate-abort` is available (the Debian route builds std itself; the rustup
/// route's prebuilt std keeps the panic machinery and lands ~45 KiB above): see
/// plugin/README.md, "Size and speed of the build".
const FILTER_MAX_BYTES: u64 = 256 * 1024;
/// A panic in the filter is a VM failure whatever it prints, so the Debian route drops the
/// panic machinery (formatting, messages, unwinding tables) altogether: ~45 KiB.
const IMMEDIATE_ABORT: &str = "-Zunstable-options -Cpanic=immediate-abort";
const WASI: &str = "wasm32-wasip1";
const UNKNOWN: &str = "wasm32-unknown-unknown";
/// Fixture also built for wasm32-unknown-unknown, so the host is tested on both targets.
const UNKNOWN_FIXTURE: &str = "noop";
/// Binaryen's optimizer (Debian `binaryen`), run on the filter when present: it removes
/// ~50 KB that LLVM leaves (duplicate functions, dead data). `-Oz`: measured as fast as `-O3`
/// per request on the size-optimized build and 6 KiB smaller (BENCHMARKS.md, plugin/README).
/// The profile strips the `target_features` section, so the features rustc enables for
/// wasm32 by default are named here.
const WASM_OPT: &str = "wasm-opt";
const WASM_OPT_ARGS: &[&str] = &[
    "-Oz",
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
    let mut filter_build = cargo(root, route, WASI, &["build", "--profile", FILTER_PROFILE]);
    filter_build.args(["-p", FILTER_PACKAGE]);
    if route == Route::Debian {
        filter_build.env(
            "RUSTFLAGS",
            format!("{DEBIAN_WASI_RUSTFLAGS} {IMMEDIATE_ABORT}"),
        );
    }
    cmd::step("wasm build (the filter)", &mut filter_build)?;
    let mut build = cargo(root, route, WASI, &["build", "--profile", PROFILE]);
    for (_, package) in &fixtures {
        build.args(["-p", package]);
    }
    cmd::step("wasm build (wasm32-wasip1 fixtures)", &mut build)?;
    let mut unknown = cargo(root, route, UNKNOWN, &["build", "--profile", PROFILE]);
    unknown.args(["-p", &format!("fixture-{UNKNOWN_FIXTURE}")]);
    cmd::step("wasm build (wasm32-unknown-unknown)", &mut unknown)?;

    let target = root.join("target");
    let filter = target.join("idemgate.wasm");
    let optimized = optimize(&built(root, WASI, FILTER_PROFILE, FILTER_PACKAGE), &filter)?;
    std::fs::create_dir_all(target.join("fixtures"))?;
    for (dir, package) in &fixtures {
        copy(
            &built(root, WASI, PROFILE, package),
            &target.join(format!("fixtures/{dir}.wasm")),
        )?;
    }
    copy(
        &built(
            root,
            UNKNOWN,
            PROFILE,
            &format!("fixture-{UNKNOWN_FIXTURE}"),
        ),
        &target.join(format!("fixtures/{UNKNOWN_FIXTURE}-unknown.wasm")),
    )?;
    let size = std::fs::metadata(&filter)?.len();
    println!(
        "{} ({size} bytes, {:.1} KiB)",
        filter.display(),
        size as f64 / 1024.0
    );
    if route == Route::Debian && optimized && size > FILTER_MAX_BYTES {
        anyhow::bail!(
            "{} is {size} bytes, above its ceiling of {FILTER_MAX_BYTES} (256 KiB): see \
             plugin/README.md (\"Size and speed of the build\") and `twiggy top`",
            filter.display()
        );
    }
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

/// Links against Debian's wasi-libc instead of a self-contained copy the Debian compiler
/// does not ship.
const DEBIAN_WASI_RUSTFLAGS: &str = "-C link-self-contained=no -L native=/usr/lib/wasm32-wasi";

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
                c.env("RUSTFLAGS", DEBIAN_WASI_RUSTFLAGS);
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
/// unoptimized module works the same, it is only larger). Returns whether it optimized.
fn optimize(from: &Path, to: &Path) -> Result<bool> {
    if !cmd::succeeds(Command::new("which").arg(WASM_OPT)) {
        println!(
            "{WASM_OPT} not found (apt-get install binaryen): the filter is not post-optimized"
        );
        copy(from, to)?;
        return Ok(false);
    }
    let mut wasm_opt = Command::new(WASM_OPT);
    wasm_opt.args(WASM_OPT_ARGS).arg(from).arg("-o").arg(to);
    cmd::step("wasm-opt (filter)", &mut wasm_opt)?;
    Ok(true)
}

fn built(root: &Path, target: &str, profile: &str, package: &str) -> PathBuf {
    root.join("target/wasm-build")
        .join(target)
        .join(profile)
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
