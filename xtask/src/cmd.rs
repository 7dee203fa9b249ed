//! Running child processes loudly: every step prints what it runs, and a failing step
//! stops the command with the step's name. Steps run inside [`logged`] write all of that to
//! a file instead, so a lane of steps running beside others never interleaves its lines
//! with theirs.

use anyhow::{Context, Result, bail};
use std::cell::RefCell;
use std::fs::File;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

thread_local! {
    /// Where this thread's steps write, when inside [`logged`].
    static LOG: RefCell<Option<File>> = const { RefCell::new(None) };
}

/// Runs `lane` with every step's output (its `==>` lines, [`say`] and the commands' stdout
/// and stderr) going to `path`; the caller prints the file when the lane ends.
pub fn logged<T>(path: &Path, lane: impl FnOnce() -> Result<T>) -> Result<T> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    LOG.with(|log| *log.borrow_mut() = Some(file));
    let result = lane();
    LOG.with(|log| *log.borrow_mut() = None);
    result
}

/// Prints a line to the terminal, or to the log inside [`logged`].
pub fn say(line: impl std::fmt::Display) {
    LOG.with(|log| match log.borrow_mut().as_mut() {
        Some(file) => {
            let _ = writeln!(file, "{line}");
        }
        None => println!("{line}"),
    });
}

/// Inside [`logged`], points `command`'s stdout and stderr at the log.
fn capture(command: &mut Command) -> Result<()> {
    LOG.with(|log| {
        if let Some(file) = log.borrow().as_ref() {
            command
                .stdout(Stdio::from(file.try_clone()?))
                .stderr(Stdio::from(file.try_clone()?));
        }
        Ok(())
    })
}

/// The cargo that runs this xtask (rustup's), for native builds.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// [`cargo`] for a `cargo build` or `cargo test` that lints the workspace's own crates as it
/// compiles them, with warnings denied: what `cargo clippy -- -D warnings` does, clippy's
/// driver as the workspace's compiler wrapper, but inside the build that compiles the code
/// anyway. A separate `cargo clippy` checks every dependency a second time, in check mode,
/// which a build cannot reuse: on a cold 2-core machine that pass cost about 440 s of the
/// test run's native lane.
///
/// Only for builds nobody ships: clippy's driver compiles with MIR optimizations off
/// (`mir_opt_level` 0, so its lints see the MIR as written), which changes the code. The
/// wasm filter built through it was 931 bytes larger.
///
/// The driver is the one beside that cargo, so it matches the compiler that cargo
/// runs (a clippy driver only drives its own toolchain's compiler). Every build that should
/// reuse the artifacts must lint the same way: the wrapper is part of each workspace crate's
/// fingerprint, so a build without it compiles them again.
pub fn linted_cargo() -> Result<Command> {
    let mut command = cargo();
    let cargo = Path::new(command.get_program());
    let driver = match cargo.parent() {
        Some(dir) if cargo.is_absolute() => dir.join("clippy-driver"),
        _ => "clippy-driver".into(),
    };
    if driver.is_absolute() && !driver.exists() {
        bail!(
            "{} is missing: clippy lints the workspace while it builds (`rustup component add clippy`)",
            driver.display()
        );
    }
    // cargo-clippy's way of passing lint flags to its driver: each argument followed by
    // this separator, in CLIPPY_ARGS (clippy's `src/main.rs`; the driver tracks the variable,
    // so changing it recompiles).
    command.env("RUSTC_WORKSPACE_WRAPPER", driver).env(
        "CLIPPY_ARGS",
        "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
    );
    Ok(command)
}

/// Runs `command` to completion, echoing it first; fails with `name` if it fails.
pub fn step(name: &str, command: &mut Command) -> Result<()> {
    say(format_args!("==> {name}: {}", render(command)));
    capture(command)?;
    let started = Instant::now();
    let status = command
        .status()
        .with_context(|| format!("{name}: could not start {:?}", command.get_program()))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    say(format_args!("==> {name}: ok in {:.1?}", started.elapsed()));
    Ok(())
}

/// Runs `command` quietly and returns whether it succeeded (false when it cannot start).
pub fn succeeds(command: &mut Command) -> bool {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Runs `command` and returns its standard output, or `None` when it cannot run or fails.
pub fn output(command: &mut Command) -> Option<String> {
    let out = command.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn render(command: &Command) -> String {
    let mut parts = vec![command.get_program().to_string_lossy().into_owned()];
    parts.extend(command.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
}
