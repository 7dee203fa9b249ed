//! Running child processes loudly: every step prints what it runs, and a failing step
//! stops the command with the step's name.

use anyhow::{Context, Result, bail};
use std::process::Command;
use std::time::Instant;

/// The cargo that runs this xtask (rustup's), for native builds.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs `command` to completion, echoing it first; fails with `name` if it fails.
pub fn step(name: &str, command: &mut Command) -> Result<()> {
    println!("==> {name}: {}", render(command));
    let started = Instant::now();
    let status = command
        .status()
        .with_context(|| format!("{name}: could not start {:?}", command.get_program()))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    println!("==> {name}: ok in {:.1?}", started.elapsed());
    Ok(())
}

/// Runs `command` quietly and returns whether it succeeded (false when it cannot start).
pub fn succeeds(command: &mut Command) -> bool {
    command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Runs `command` and returns its standard output, or `None` when it cannot run or fails.
pub fn output(command: &mut Command) -> Option<String> {
    let out = command.stderr(std::process::Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn render(command: &Command) -> String {
    let mut parts = vec![command.get_program().to_string_lossy().into_owned()];
    parts.extend(command.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
}
