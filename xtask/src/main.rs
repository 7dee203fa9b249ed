//! `cargo xtask <command>`: the project's one-command build, test, demo and benchmark entry
//! points. Each command installs or builds what it needs on a fresh machine by itself.

mod cmd;
mod envoy;
mod toolchain;
mod wasm;

use anyhow::{Result, bail};
use std::path::{Path, PathBuf};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  wasm    build the filter to target/idemgate.wasm (and the host-test fixtures)
  test    the whole test suite: fmt, clippy (native and wasm32), Envoy config schema checks,
          unit tests, wasm build, then every test that loads the built wasm
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

/// The README's test command. Order matters: cheap static checks first, then unit tests,
/// then the wasm build that the integration tests load.
fn test(root: &Path) -> Result<()> {
    toolchain::ensure_apt_binaries(&[
        ("redis-server", "redis-server"),
        ("redis-cli", "redis-tools"),
    ])?;
    cmd::step(
        "format",
        cmd::cargo()
            .args(["fmt", "--all", "--check"])
            .current_dir(root),
    )?;
    cmd::step(
        "clippy (native)",
        cmd::cargo()
            .args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ])
            .current_dir(root),
    )?;
    envoy::check(root)?;
    let route = toolchain::wasm_route()?;
    cmd::step("clippy (wasm32-wasip1)", &mut wasm::clippy(root, route))?;
    cmd::step(
        "unit tests",
        cmd::cargo()
            .args(["test", "--workspace", "--lib", "--bins"])
            .current_dir(root),
    )?;
    wasm::build_with(root, route)?;
    cmd::step(
        "integration tests (load target/idemgate.wasm)",
        cmd::cargo()
            .args(["test", "--workspace", "--test", "*"])
            .current_dir(root),
    )?;
    println!("xtask test: all steps passed");
    Ok(())
}
