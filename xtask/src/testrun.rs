//! Running the integration test binaries a few at a time.
//!
//! `cargo test --test '*'` runs one test binary after another. Ours spend most of their time
//! waiting on sockets, child processes and timers (live gateways, a real Redis, the demo
//! driver), so on a 2-core machine running a few binaries side by side cuts the wall time of this
//! step without oversubscribing the CPU much. One cargo invocation builds the test binaries
//! and every binary of the workspace they start (cargo lists them as JSON); no cargo runs while
//! the tests do, since a cargo build relinks the binaries, and a test starting one mid-relink
//! finds it missing. The test binaries run as cargo would run them: from their package's
//! directory, with `CARGO` and `CARGO_MANIFEST_DIR` set, with `IDEMGATE_BIN_DIR` naming
//! the directory of the built binaries (the rig's tests look them up there instead of building
//! them), and `IDEMGATE_VALKEY_SERVER` the Valkey server built for them (`valkey.rs`). Each
//! binary's output is kept in a file and printed whole when it ends, so two binaries never
//! interleave lines.

use crate::cmd;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Instant;

/// How many test binaries run at once. Three, tried once no test ran cargo any more, started
/// e2e, faults and host-tests together (each compiling filters and starting gateways) on a
/// machine other builds shared, and two demo tests' gateway processes did not listen within
/// the rig's 30 s.
const LANES: usize = 2;
/// The variable the rig's tests find the built binaries by (`idemgate_rig::child::BIN_DIR_ENV`).
const BIN_DIR_ENV: &str = "IDEMGATE_BIN_DIR";
/// Binaries known to run longest, longest first: each goes to the lane that frees first, and
/// the short ones fill in after them. Measured on a clean clone (two lanes): e2e 58 s, the
/// sidecar's 54 s, faults 39 s, host-tests 23 s, the rest 4 s together; e2e and faults first
/// left the sidecar's tests to start last (115 s in all, where this order gives about 95 s).
const LONGEST_FIRST: &[&str] = &[
    "e2e::e2e",
    "sidecar::tests",
    "e2e::faults",
    "host-tests::tests",
];
/// Test threads of binaries whose tests mostly wait (live gateways' timers, queue hand-offs,
/// the demo's child processes) rather than compute: the e2e binary took 170 s at the default
/// of one thread per core beside the other lane, and 57 s alone at four.
const TEST_THREADS: &[(&str, usize)] = &[("e2e::e2e", 4)];

/// One integration test binary as cargo built it.
struct TestBinary {
    /// `<package>::<test target>`, for messages.
    name: String,
    executable: PathBuf,
    package_dir: PathBuf,
}

/// The integration test binaries and the directory of the binaries they start.
struct Built {
    tests: Vec<TestBinary>,
    bin_dir: PathBuf,
}

/// Builds every integration test of the workspace and every binary, then runs the test
/// binaries [`LANES`] at a time.
pub fn integration_tests(root: &Path, valkey: &Path) -> Result<()> {
    let Built {
        tests: binaries,
        bin_dir,
    } = build(root)?;
    let started = Instant::now();
    println!(
        "==> integration tests: {} binaries, {LANES} at a time",
        binaries.len()
    );
    let queue = Mutex::new(binaries);
    let failures = Mutex::new(Vec::new());
    let logs = root.join("target/test-logs");
    std::fs::create_dir_all(&logs)?;
    std::thread::scope(|scope| {
        for _ in 0..LANES {
            scope.spawn(|| {
                loop {
                    let next = queue.lock().map(|mut q| q.pop());
                    let Ok(Some(binary)) = next else { break };
                    if let Err(err) = run(&binary, &bin_dir, valkey, &logs)
                        && let Ok(mut f) = failures.lock()
                    {
                        f.push(format!("{}: {err:#}", binary.name));
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap_or_default();
    if !failures.is_empty() {
        bail!("integration tests failed:\n  {}", failures.join("\n  "));
    }
    println!("==> integration tests: ok in {:.1?}", started.elapsed());
    Ok(())
}

/// `cargo build --workspace --bins --test '*'`: the integration tests as `cargo test` builds
/// them, and every binary with the same features (a `--test` selection resolves features with
/// the dev-dependencies, as `cargo test --workspace` does, so the unit tests' step has built
/// the dependencies already). Returns the test binaries in the order they should be taken
/// from the end of the list (longest last = popped first).
fn build(root: &Path) -> Result<Built> {
    // Linted as the native lane's build was, so it finds that build's artifacts fresh.
    let mut command = cmd::linted_cargo()?;
    command
        .args(["build", "--workspace", "--bins", "--test", "*"])
        .args(["--message-format", "json-render-diagnostics"])
        .current_dir(root)
        .stderr(Stdio::inherit());
    println!("==> build integration tests and binaries: cargo build --workspace --bins --test '*'");
    let started = Instant::now();
    let out = command.output().context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the integration tests failed ({})", out.status);
    }
    println!(
        "==> build integration tests and binaries: ok in {:.1?}",
        started.elapsed()
    );
    let mut binaries = Vec::new();
    let mut bins = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let is_kind = |kind: &str| {
            message["target"]["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k == kind))
        };
        if is_kind("bin")
            && message["profile"]["test"] == false
            && let Some(executable) = message["executable"].as_str()
        {
            bins.push(PathBuf::from(executable));
            continue;
        }
        let is_test_target = message["profile"]["test"] == true && is_kind("test");
        let (Some(executable), Some(manifest), Some(target)) = (
            message["executable"].as_str(),
            message["manifest_path"].as_str(),
            message["target"]["name"].as_str(),
        ) else {
            continue;
        };
        if !is_test_target {
            continue;
        }
        let package_dir = Path::new(manifest)
            .parent()
            .context("manifest path has a directory")?
            .to_path_buf();
        let package = package_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        binaries.push(TestBinary {
            name: format!("{package}::{target}"),
            executable: executable.into(),
            package_dir,
        });
    }
    if binaries.is_empty() {
        bail!("cargo listed no integration test binaries");
    }
    let bin_dir = bin_dir(&bins)?;
    // Popped from the end: the longest-running ones go last in the vector.
    binaries.sort_by_key(|b| {
        LONGEST_FIRST
            .iter()
            .position(|name| *name == b.name)
            .map_or(0, |rank| LONGEST_FIRST.len() - rank)
    });
    Ok(Built {
        tests: binaries,
        bin_dir,
    })
}

/// The one directory cargo put every binary in, once each is there.
fn bin_dir(bins: &[PathBuf]) -> Result<PathBuf> {
    let Some(dir) = bins.first().and_then(|b| b.parent()) else {
        bail!("cargo listed no binaries");
    };
    for bin in bins {
        if bin.parent() != Some(dir) {
            bail!("{} is not in {}", bin.display(), dir.display());
        }
        if !bin.is_file() {
            bail!("cargo listed {}, which is not there", bin.display());
        }
    }
    Ok(dir.to_path_buf())
}

fn run(binary: &TestBinary, bin_dir: &Path, valkey: &Path, logs: &Path) -> Result<()> {
    let log_path = logs.join(format!("{}.log", binary.name.replace("::", "-")));
    let log = std::fs::File::create(&log_path)?;
    let started = Instant::now();
    let mut command = Command::new(&binary.executable);
    if let Some((_, threads)) = TEST_THREADS.iter().find(|(name, _)| *name == binary.name) {
        command.arg(format!("--test-threads={threads}"));
    }
    let status = command
        .current_dir(&binary.package_dir)
        .env(
            "CARGO",
            std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()),
        )
        .env("CARGO_MANIFEST_DIR", &binary.package_dir)
        .env(BIN_DIR_ENV, bin_dir)
        .env(crate::valkey::ENV, valkey)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .with_context(|| format!("starting {}", binary.executable.display()))?;
    let output = std::fs::read_to_string(&log_path).unwrap_or_default();
    // Printed whole, so the lanes' outputs never interleave.
    println!(
        "--- {} ({:.1?}, {status})\n{output}",
        binary.name,
        started.elapsed()
    );
    if !status.success() {
        bail!("{status}; output in {}", log_path.display());
    }
    Ok(())
}
