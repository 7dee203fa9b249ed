//! `cargo xtask <command>`: the project's one-command build, test, demo and benchmark entry
//! points. Each command installs or builds what it needs on a fresh machine by itself.

mod cmd;
mod envoy;
mod image;
mod observability;
mod testrun;
mod toolchain;
mod valkey;
mod wasm;

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  demo    build everything and play the duplicate-call scenarios, directly and through
          idemgate (sidecar on its memory store, or Redis when REDIS_URL is set)
  bench   [group...]  measure idemgate against same-run baselines and write BENCHMARKS.md
          (groups: plugin, host, sidecar, queue, storm, e2e; all when none is named; and
          peer, only when named: idemgate beside idempotent-proxy-server, installed once
          from crates.io at a pinned version under target/peer; builds Valkey 8.1 once
          under target/valkey for the sidecar and peer groups)
  wasm    build the filter to target/idemgate.wasm (and the host-test fixtures)
  test    the whole test suite: fmt, clippy (native and wasm32, as the code builds),
          docs (warnings denied), Envoy config schema checks, alerting rules (promtool),
          unit tests, wasm build (and Valkey 8.1, once), then every test that loads the
          built wasm or needs Valkey, then the images
  integration  only the last step of `test`: every integration test binary, two at a time
          (needs `cargo xtask wasm` first)
  bundle  render the Kubernetes overlays and validate them (schemas, token wiring, idemgate
          check); part of `test`
  image   [--dev | --tests-binary]  build the sidecar (release; the dev profile; or the binary
          the integration tests built) and filter images offline, test them (unpacked, no
          container runtime) and print their digests; part of `test` (--tests-binary)
  fuzz    [--time 60]  every cargo-fuzz target in fuzz/ for that many seconds each (nightly;
          installs cargo-fuzz when missing)
  soak    [--duration 10m]  mixed duplicate load through two gateways with Redis restarts,
          bounded in time; prints the summary and writes target/soak.md (see RELIABILITY.md)
";

fn main() {
    if let Err(err) = run() {
        eprintln!("xtask: {err:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    match args.first().map(String::as_str) {
        Some("wasm") => wasm::build_all(&root).map(|_| ()),
        Some("test") => test(&root),
        Some("integration") => testrun::integration_tests(&root, &valkey::ensure(&root)?),
        Some("bundle") => envoy::check_bundle(&root, envoy::cli_by_cargo_run(&root)),
        Some("image") => image::command(&root, &args[1..]),
        Some("demo") => demo(&root, &args[1..]),
        Some("bench") => bench(&root, &args[1..]),
        Some("soak") => soak(&root, &args[1..]),
        Some("fuzz") => fuzz(&root, &args[1..]),
        Some("-h" | "--help" | "help") | None => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => bail!("unknown command `{other}`\n{USAGE}"),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The README's test command. Order matters: the format check first, then the builds
/// (linted as they compile) and unit tests, then the integration tests, which load the wasm
/// modules.
///
/// Two lanes run side by side until the integration tests: the native one (the build with
/// clippy, docs, the config checks, unit tests, in `target/`) and the wasm one (clippy for
/// wasm32 and the modules, in `target/wasm-build/`). They share no build directory, and much
/// of the wasm lane is single-threaded (std rebuilt crate after crate, the filter's one-unit LTO), so on
/// a 2-core machine it fills the core the native lane leaves idle. The wasm lane's output is
/// kept in `target/test-logs/wasm-lane.log` and printed whole when both lanes are done.
fn test(root: &Path) -> Result<()> {
    // One apt run for everything, the image step's tools included.
    let needs = [
        ("redis-server", "redis-server"),
        ("redis-cli", "redis-tools"),
        ("kubectl", "kubectl"),
        ("promtool", "prometheus"),
    ];
    toolchain::ensure_apt(&[&needs, image::APT_NEEDS, valkey::APT_NEEDS].concat())?;
    cmd::step(
        "format",
        cmd::cargo()
            .args(["fmt", "--all", "--check"])
            .current_dir(root),
    )?;
    let route = toolchain::wasm_route()?;
    let wasm_log = root.join("target/test-logs/wasm-lane.log");
    println!(
        "==> wasm lane (clippy for wasm32, the modules, the fuzz targets, Valkey): beside the native steps, output in {}",
        wasm_log.display()
    );
    let (native, wasm) = std::thread::scope(|scope| {
        let wasm_lane = scope.spawn(|| {
            cmd::logged(&wasm_log, || {
                let started = std::time::Instant::now();
                // Its own pass, not the build's wrapper: `cmd::linted_cargo` builds are
                // never shipped, and this one is the shipped filter.
                cmd::step("clippy (wasm32-wasip1)", &mut wasm::clippy(root, route))?;
                let wasm = wasm::build_with(root, route)?;
                // Its own target directory, so it runs beside the native lane's cargo
                // instead of waiting for its lock; this lane ends well before that one.
                cmd::step("fuzz targets compile", &mut fuzz_check(root))?;
                // The Redis store's tests on a server with `SET … IFEQ` (built once).
                let valkey = valkey::ensure(root)?;
                cmd::say(format_args!(
                    "==> wasm lane: ok in {:.1?}",
                    started.elapsed()
                ));
                Ok((wasm, valkey))
            })
        });
        let native = native_checks(root);
        let wasm = wasm_lane
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the wasm lane panicked")));
        (native, wasm)
    });
    println!(
        "--- wasm lane\n{}",
        std::fs::read_to_string(&wasm_log).unwrap_or_default()
    );
    native?;
    let (wasm, valkey) = wasm.context("wasm lane")?;
    // The integration tests load target/idemgate.wasm and the fixtures built above.
    testrun::integration_tests(root, &valkey)?;
    // The images, from the module above and the sidecar the integration tests built.
    image::build_and_check(root, &image::built_by_the_tests(root)?, &wasm)?;
    println!("xtask test: all steps passed");
    Ok(())
}

/// The native lane of `test`: one build of every test and binary, linted by clippy as it
/// compiles (`cmd::linted_cargo`), the docs, the config and rule checks, the unit
/// tests.
fn native_checks(root: &Path) -> Result<()> {
    // Every test binary and binary in one invocation (the integration tests' build, with the
    // same features, then finds them fresh): cargo overlaps the two sets' compiling and
    // linking instead of ending each with a core idle on the last big link. The libraries,
    // binaries and tests (the libraries' unit tests among them) are every target
    // `cargo clippy --all-targets` would lint: the workspace has no benches or examples.
    cmd::step(
        "build the tests and binaries, clippy linting",
        cmd::linted_cargo()?
            .args(["build", "--workspace", "--lib", "--bins", "--tests"])
            .current_dir(root),
    )?;
    // After the build, so build scripts and proc macros are compiled already; the
    // dependencies it documents against are checked (metadata only), which no build reuses.
    cmd::step("docs", &mut docs(root)?)?;
    envoy::check(root)?;
    let mut idemgate = std::process::Command::new(root.join("target/debug/idemgate"));
    idemgate.current_dir(root);
    envoy::check_bundle(root, idemgate)?;
    observability::check(root)?;
    cmd::step(
        "unit tests",
        cmd::linted_cargo()?
            .args(["test", "--workspace", "--lib", "--bins"])
            .current_dir(root),
    )
}

/// `cargo doc --workspace --no-deps` of the targets it documents by default (every library,
/// and every binary not named as its package's library), warnings denied. The targets are
/// named because a target selection with `--examples` (the workspace has none) makes cargo
/// resolve features with the dev-dependencies, as the build's `--tests` does: the build
/// scripts and proc macros the docs need are then the build's, where the default selection
/// would resolve features without the dev-dependencies and compile every one whose
/// features differ again (tonic, reqwest, redis, regex, the OpenTelemetry crates and the
/// workspace's own).
fn docs(root: &Path) -> Result<std::process::Command> {
    let metadata = cmd::output(
        cmd::cargo()
            .args(["metadata", "--no-deps", "--format-version", "1"])
            .current_dir(root),
    )
    .context("cargo metadata failed")?;
    let metadata: serde_json::Value = serde_json::from_str(&metadata)?;
    let mut doc = cmd::cargo();
    doc.args(["doc", "--workspace", "--no-deps", "--lib", "--examples"])
        .env("RUSTDOCFLAGS", "-D warnings")
        .current_dir(root);
    let crate_name =
        |target: &serde_json::Value| target["name"].as_str().map(|name| name.replace('-', "_"));
    let is = |target: &serde_json::Value, kind: &str| {
        target["kind"]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|k| k == kind))
    };
    let packages = metadata["packages"]
        .as_array()
        .context("cargo metadata lists no packages")?;
    for package in packages {
        let targets = package["targets"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        let lib = targets
            .iter()
            .find(|t| {
                !["bin", "test", "bench", "example", "custom-build"]
                    .iter()
                    .any(|k| is(t, k))
            })
            .and_then(crate_name);
        for bin in targets.iter().filter(|t| is(t, "bin") && t["doc"] != false) {
            if let Some(name) = bin["name"].as_str()
                && crate_name(bin) != lib
            {
                doc.args(["--bin", name]);
            }
        }
    }
    Ok(doc)
}

/// The soak run: the ignored `soak` test of the fault suite, with its duration passed on.
fn soak(root: &Path, args: &[String]) -> Result<()> {
    let secs = match args {
        [] => 600,
        [flag, value] if flag == "--duration" => seconds_arg(value)?,
        _ => bail!("usage: cargo xtask soak [--duration <seconds>s|<minutes>m]"),
    };
    toolchain::ensure_apt(&[
        ("redis-server", "redis-server"),
        ("redis-cli", "redis-tools"),
    ])?;
    wasm::build_all(root)?;
    cmd::step(
        &format!("soak ({secs} s)"),
        cmd::cargo()
            .args(["test", "-p", "idemgate-e2e", "--test", "faults"])
            .args(["--", "--ignored", "--exact", "soak::soak", "--nocapture"])
            .env("IDEMGATE_SOAK_SECS", secs.to_string())
            .current_dir(root),
    )
}

/// Runs every fuzz target for a bounded time. `fuzz/` is a workspace of its own on the
/// nightly toolchain (rustup's `cargo +nightly`); findings land in `fuzz/artifacts/`.
fn fuzz(root: &Path, args: &[String]) -> Result<()> {
    let secs = match args {
        [] => 60,
        [flag, value] if flag == "--time" => seconds_arg(value)?,
        _ => bail!("usage: cargo xtask fuzz [--time <seconds>s|<minutes>m]"),
    };
    let dir = root.join("fuzz");
    let nightly = || {
        let mut cargo = std::process::Command::new("cargo");
        cargo.arg("+nightly").current_dir(&dir);
        cargo
    };
    if !cmd::succeeds(nightly().args(["fuzz", "--version"])) {
        cmd::step(
            "install cargo-fuzz",
            cmd::cargo().args(["install", "cargo-fuzz", "--locked"]),
        )?;
    }
    let targets = cmd::output(nightly().args(["fuzz", "list"]))
        .context("`cargo +nightly fuzz list` failed: is the nightly toolchain installed?")?;
    for target in targets.lines().map(str::trim).filter(|t| !t.is_empty()) {
        cmd::step(
            &format!("fuzz {target} ({secs} s)"),
            nightly().args(["fuzz", "run", target, "--"]).args([
                format!("-max_total_time={secs}"),
                "-print_final_stats=1".to_owned(),
            ]),
        )?;
    }
    Ok(())
}

/// Type-checks every fuzz target on the stable toolchain, so that a change to the APIs they
/// drive cannot leave one uncompilable until someone next fuzzes. `check` never links, so
/// libfuzzer-sys is pointed at a library path instead of compiling libFuzzer's C++ sources
/// (its build script only emits link flags then).
fn fuzz_check(root: &Path) -> std::process::Command {
    let mut check = cmd::cargo();
    check
        .args(["check", "--manifest-path", "fuzz/Cargo.toml", "--bins"])
        .args(["--target-dir", "target/fuzz-check"])
        .env(
            "CUSTOM_LIBFUZZER_PATH",
            root.join("target/fuzz-check/libfuzzer-unlinked.a"),
        )
        .current_dir(root);
    check
}

/// `90s`, `10m` or plain seconds.
fn seconds_arg(value: &str) -> Result<u64> {
    let (number, unit) = match value.strip_suffix('m') {
        Some(minutes) => (minutes, 60),
        None => (value.strip_suffix('s').unwrap_or(value), 1),
    };
    match number.parse::<u64>() {
        Ok(n) if n > 0 => Ok(n * unit),
        _ => bail!("--duration: expected e.g. 90s or 10m, got `{value}`"),
    }
}

/// Builds the filter and the release binaries, then runs the demo driver, which starts
/// (and always stops) the sidecar, the demo backend and the gateway.
fn demo(root: &Path, extra: &[String]) -> Result<()> {
    let wasm = wasm::build_all(root)?;
    cmd::step(
        "build the demo's binaries (release)",
        cmd::cargo()
            .args(["build", "--release", "--bins"])
            .args([
                "-p",
                "idemgate-demo",
                "-p",
                "idemgate-sidecar",
                "-p",
                "idemgate-host",
            ])
            .current_dir(root),
    )?;
    let bin_dir = root.join("target/release");
    cmd::step(
        "demo",
        std::process::Command::new(bin_dir.join("idemgate-demo"))
            .arg("--bin-dir")
            .arg(&bin_dir)
            .arg("--wasm")
            .arg(wasm)
            .arg("--envoy-config")
            .arg(root.join("envoy/envoy.yaml"))
            .arg("--log-dir")
            .arg(root.join("target/demo-logs"))
            .args(extra)
            .current_dir(root),
    )
}

/// The profile the benchmark runner is built with ([`bench()`] says why).
const BENCH_PROFILE: &str = "dist";

/// Builds the filter and the benchmark runner, installs the measuring tools, then runs the
/// groups; the runner writes `BENCHMARKS.md` and `benchmarks/`. The runner is built with the
/// `dist` profile, the one the sidecar's image is built with: the sidecar runs inside the
/// runner, so its figures are those of the build users run (`Cargo.toml` says what `dist` is).
fn bench(root: &Path, groups: &[String]) -> Result<()> {
    let needs = [
        ("valgrind", "valgrind"),
        ("redis-server", "redis-server"),
        ("wrk", "wrk"),
        (
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "fonts-dejavu-core",
        ),
    ];
    toolchain::ensure_apt(&[&needs, valkey::APT_NEEDS].concat())?;
    // The sidecar and peer groups run the sidecar on Valkey 8.1 too, where a fresh key's
    // complete is one `SET … IFEQ` (`bench/src/groups/sidecar.rs`, `bench/src/peer.rs`).
    let valkey = valkey::ensure(root)?;
    wasm::build_all(root)?;
    cmd::step(
        "build the benchmark runner (dist: whole-program optimization, several minutes)",
        cmd::cargo()
            .args(["build", "--profile", BENCH_PROFILE, "-p", "idemgate-bench"])
            .current_dir(root),
    )?;
    cmd::step(
        "benchmarks",
        std::process::Command::new(
            root.join("target")
                .join(BENCH_PROFILE)
                .join("idemgate-bench"),
        )
        .arg("run")
        .args(groups)
        .arg("--target")
        .arg(root.join("target"))
        .arg("--out")
        .arg(root.join("BENCHMARKS.md"))
        .env(valkey::ENV, valkey)
        .current_dir(root),
    )
}
