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
/// panic machinery (formatting, messages, unwinding tables) altogether: ~45 KiB. With it
/// gone nothing prints a source location either, so `-Zlocation-detail=none` drops the file
/// names, lines and columns `#[track_caller]` code still embeds: 1,954 bytes.
const IMMEDIATE_ABORT: &str = "-Zunstable-options -Cpanic=immediate-abort -Zlocation-detail=none";
const WASI: &str = "wasm32-wasip1";
const UNKNOWN: &str = "wasm32-unknown-unknown";
/// Fixture also built for wasm32-unknown-unknown, so the host is tested on both targets.
const UNKNOWN_FIXTURE: &str = "noop";
/// Binaryen's optimizer (Debian `binaryen`), run on the filter when present: it removes
/// ~50 KB that LLVM leaves (duplicate functions, dead data). `-Oz`: measured as fast as `-O3`
/// per request on the size-optimized build and 6 KiB smaller (BENCHMARKS.md, plugin/README).
const WASM_OPT: &str = "wasm-opt";
/// `--converge` reruns the passes while the module still shrinks: 397 bytes.
const WASM_OPT_ARGS: &[&str] = &["-Oz", "--converge"];
/// The module's features, for `wasm-opt` and `wasm-metadce` alike: the profile strips the
/// `target_features` section, so the features rustc enables for wasm32 by default are named.
const WASM_FEATURES: &[&str] = &[
    "--enable-bulk-memory",
    "--enable-multivalue",
    "--enable-mutable-globals",
    "--enable-nontrapping-float-to-int",
    "--enable-reference-types",
    "--enable-sign-ext",
];

/// Binaryen's whole-module dead-code eliminator: given the exports to keep, it drops the
/// others and every function only they reach (`wasm-metadce`, in Debian's `binaryen` too).
const WASM_METADCE: &str = "wasm-metadce";
/// Callbacks the proxy-wasm SDK exports that Envoy never calls on idemgate, dropped before
/// `wasm-opt`. proxy-wasm-cpp-host looks every `proxy_on_*` callback up as optional and skips
/// a missing one (`src/context.cc`: e.g. `onGrpcClose` returns when `on_grpc_close_` is
/// null), and so does the host harness. With the SDK at opt-level 3 each of them inlines the
/// dispatcher's lookups: ~14 KiB of the module, which is what lets the SDK stay at 3.
const UNUSED_CALLBACKS: &[(&str, &str)] = &[
    // gRPC callouts (the SDK's `dispatch_grpc_call`, `open_grpc_stream`); the filter guards
    // gRPC requests, which come through the HTTP callbacks.
    ("proxy_on_grpc_receive_initial_metadata", "open_grpc_stream"),
    ("proxy_on_grpc_receive", "dispatch_grpc_call"),
    (
        "proxy_on_grpc_receive_trailing_metadata",
        "open_grpc_stream",
    ),
    ("proxy_on_grpc_close", "dispatch_grpc_call"),
    ("proxy_on_foreign_function", "foreign_function"),
    ("proxy_on_new_connection", "on_new_connection"),
    ("proxy_on_downstream_data", "on_downstream"),
    ("proxy_on_downstream_connection_close", "on_downstream"),
    ("proxy_on_upstream_data", "on_upstream"),
    ("proxy_on_upstream_connection_close", "on_upstream"),
    // The access-log callback: idemgate logs nothing there (what an access log prints of it
    // is filter state, set while the request runs). Envoy calls `proxy_on_log` on every
    // stream of a module that exports it (`ContextBase::onLog` checks `on_log_`), so an
    // exported no-op costs every request, matched or not, one more entry into the VM and
    // the SDK's lookup of the context: ~800 instructions of a request matching no rule.
    ("proxy_on_log", "fn on_log"),
];
/// Where the filter's code lives: a mention of a dropped callback's feature here (a gRPC
/// call, a foreign function, a network-filter callback) fails the build instead of shipping
/// a filter whose callback is missing.
const FILTER_SOURCES: &[&str] = &["plugin/src", "plugin-core/src", "wire/src"];

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
    let optimized = optimize(
        root,
        &built(root, WASI, FILTER_PROFILE, FILTER_PACKAGE),
        &filter,
    )?;
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
    cmd::say(format_args!(
        "{} ({size} bytes, {:.1} KiB)",
        filter.display(),
        size as f64 / 1024.0
    ));
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

/// Copies the filter to `to`, through `wasm-metadce` (the callbacks Envoy never calls on it)
/// and `wasm-opt` when binaryen is installed (optional: the unoptimized module works the same,
/// it is only larger). Returns whether it optimized.
fn optimize(root: &Path, from: &Path, to: &Path) -> Result<bool> {
    let installed = |tool| cmd::succeeds(Command::new("which").arg(tool));
    if !installed(WASM_OPT) || !installed(WASM_METADCE) {
        cmd::say(format_args!(
            "{WASM_OPT}/{WASM_METADCE} not found (apt-get install binaryen): the filter is not \
             post-optimized"
        ));
        copy(from, to)?;
        return Ok(false);
    }
    let trimmed = from.with_extension("trimmed.wasm");
    let graph = from.with_extension("metadce.json");
    std::fs::write(&graph, metadce_graph(root, &std::fs::read(from)?)?)?;
    let mut metadce = Command::new(WASM_METADCE);
    metadce
        .args(WASM_FEATURES)
        .arg(from)
        .arg("--graph-file")
        .arg(&graph)
        .arg("-o")
        .arg(&trimmed)
        // It lists every function it drops.
        .stdout(std::process::Stdio::null());
    cmd::step("wasm-metadce (filter: unused callbacks)", &mut metadce)?;
    let mut wasm_opt = Command::new(WASM_OPT);
    wasm_opt
        .args(WASM_OPT_ARGS)
        .args(WASM_FEATURES)
        .arg(&trimmed)
        .arg("-o")
        .arg(to);
    cmd::step("wasm-opt (filter)", &mut wasm_opt)?;
    Ok(true)
}

/// `wasm-metadce`'s reachability graph: every export of `module` but [`UNUSED_CALLBACKS`] is
/// reached from outside. Fails if the filter's sources use what a dropped callback serves.
fn metadce_graph(root: &Path, module: &[u8]) -> Result<String> {
    for (callback, feature) in UNUSED_CALLBACKS {
        if let Some(file) = mentions(root, FILTER_SOURCES, feature)? {
            anyhow::bail!(
                "{} mentions `{feature}`: if the filter now needs {callback}, take it out of \
                 UNUSED_CALLBACKS in xtask/src/wasm.rs",
                file.display()
            );
        }
    }
    let mut kept = Vec::new();
    for payload in wasmparser::Parser::new(0).parse_all(module) {
        if let wasmparser::Payload::ExportSection(exports) = payload? {
            for export in exports {
                let name = export?.name;
                if !UNUSED_CALLBACKS.iter().any(|(c, _)| *c == name) {
                    kept.push(name.to_owned());
                }
            }
        }
    }
    let node = |name: &str| format!("export:{name}");
    let mut graph = vec![serde_json::json!({
        "name": "outside",
        "root": true,
        "reaches": kept.iter().map(|e| node(e)).collect::<Vec<_>>(),
    })];
    graph.extend(
        kept.iter()
            .map(|e| serde_json::json!({"name": node(e), "export": e})),
    );
    Ok(serde_json::to_string(&graph)?)
}

/// The first `.rs` file under `dirs` (relative to `root`) whose text contains `word`.
fn mentions(root: &Path, dirs: &[&str], word: &str) -> Result<Option<PathBuf>> {
    let mut pending: Vec<PathBuf> = dirs.iter().map(|d| root.join(d)).collect();
    while let Some(dir) = pending.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && std::fs::read_to_string(&path)?.contains(word)
            {
                return Ok(Some(path));
            }
        }
    }
    Ok(None)
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
