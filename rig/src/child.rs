//! One part of a rig running as a child process (the demo's way, [`crate::RigBuilder::as_processes`]):
//! started with its output in a log file of its own, and never left running — stopping or
//! dropping it kills and reaps it, and on Linux it is started with `PR_SET_PDEATHSIG`, so the
//! kernel kills it even when this process is killed outright.

use anyhow::{Context, Result, bail};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a killed child may take to be reaped before the rig reports it and moves on.
const REAP_WITHIN: Duration = Duration::from_secs(10);

/// A running child process; dropping it kills and reaps it.
pub struct ChildProcess {
    name: &'static str,
    log: PathBuf,
    child: Option<Child>,
}

impl ChildProcess {
    /// Starts `command` as the part called `name`, its stdout and stderr in
    /// `<log_dir>/<name>.log` (created, or appended to when `append`: a restarted part keeps
    /// its earlier life's lines).
    pub fn spawn(
        name: &'static str,
        mut command: Command,
        log_dir: &Path,
        append: bool,
    ) -> Result<ChildProcess> {
        std::fs::create_dir_all(log_dir)
            .with_context(|| format!("creating {}", log_dir.display()))?;
        let log_path = log_dir.join(format!("{}.log", name.replace(' ', "-")));
        let log = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        die_with_parent(&mut command);
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting the {name} ({:?})", command.get_program()))?;
        Ok(ChildProcess {
            name,
            log: log_path,
            child: Some(child),
        })
    }

    /// Its process id, while it runs.
    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The part's name ("sidecar", "gateway", …).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Where its output goes.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Fails, naming the part and its log, if it has exited.
    pub fn check_running(&mut self) -> Result<()> {
        let Some(child) = self.child.as_mut() else {
            bail!("the {} was stopped", self.name);
        };
        if let Some(status) = child.try_wait()? {
            bail!(
                "the {} exited early ({status}); see {}",
                self.name,
                self.log.display()
            );
        }
        Ok(())
    }

    /// Kills it (SIGKILL) and waits, bounded, until it is reaped; its ports are free once
    /// this returns `Ok`. Stopping a stopped child does nothing.
    pub fn stop(&mut self) -> Result<Option<ExitStatus>> {
        let Some(mut child) = self.child.take() else {
            return Ok(None);
        };
        // Fails only when it has already exited: the wait below reaps it either way.
        let _ = child.kill();
        let deadline = Instant::now() + REAP_WITHIN;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                bail!(
                    "the {} (pid {}) did not exit within {REAP_WITHIN:?} of SIGKILL",
                    self.name,
                    child.id()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if let Err(err) = self.stop() {
            eprintln!("{err:#}");
        }
    }
}

/// The binaries the tests start: a rig of processes runs the first three, the demo's tests
/// the demo driver.
pub const RIG_BINARIES: &[&str] = &[
    "idemgate-sidecar",
    "idemgate-gateway",
    "idemgate-demo-backend",
    "idemgate-demo",
];

/// Set by `cargo xtask test` (and `cargo xtask integration`) to the directory where it built
/// every binary of the workspace, in one cargo invocation, before the first integration test
/// binary started. Tests then only look the binaries up: a `cargo build` from inside a test
/// relinks `target/<profile>/<binary>` (cargo removes and re-links each binary it lists, even
/// a fresh one), and another test binary running beside it finds it missing.
pub const BIN_DIR_ENV: &str = "IDEMGATE_BIN_DIR";

/// The directory holding [`RIG_BINARIES`] for the profile of the test calling this
/// (`target/<profile>`, where tests run from `target/<profile>/deps/`).
///
/// Under `cargo xtask` ([`BIN_DIR_ENV`] set) it only checks that they are there. Run by hand
/// (`cargo test -p idemgate-e2e`) it builds them first with `cargo build --workspace --bins
/// --examples`: the feature set of a `cargo test --workspace` build, so after one of those (or
/// `cargo xtask test`) nothing is recompiled. That build relinks the binaries, which is safe
/// because `cargo test` runs one test binary at a time; do not run test binaries of this
/// workspace side by side by hand (`cargo xtask integration` does that, building first).
pub fn built_binaries() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV) {
        return prebuilt(Path::new(&dir));
    }
    let exe = std::env::current_exe().context("the test binary's path")?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .context("the test binary is not in target/<profile>/deps")?
        .to_path_buf();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    // `--examples` (the workspace has none) makes cargo resolve features as for a test
    // build, dev-dependencies included, as `cargo test --workspace` and xtask do.
    build
        .args(["build", "--workspace", "--bins", "--examples"])
        .current_dir(crate::gateway::workspace_root());
    if dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build.status().context("running cargo")?;
    anyhow::ensure!(status.success(), "building the rig's binaries: {status}");
    prebuilt(&dir)
}

/// `dir`, if every one of [`RIG_BINARIES`] is a file in it.
pub fn prebuilt(dir: &Path) -> Result<PathBuf> {
    let missing: Vec<&str> = RIG_BINARIES
        .iter()
        .copied()
        .filter(|name| !dir.join(name).is_file())
        .collect();
    if !missing.is_empty() {
        bail!(
            "{} has no {}: `cargo build --workspace --bins` builds them (`cargo xtask \
             integration` does before it runs the tests; {BIN_DIR_ENV} unset, a test builds \
             them itself)",
            dir.display(),
            missing.join(", ")
        );
    }
    Ok(dir.to_path_buf())
}

/// Asks the kernel to SIGKILL the child when the thread that spawned it exits — when this
/// process exits by any means, SIGKILL included, if that thread lives as long as the rig (the
/// demo starts its rig on its main thread).
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: between fork and exec the closure only makes async-signal-safe calls
    // (prctl, getppid) and allocates nothing on its success path.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect: then nobody will stop us.
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                return Err(std::io::Error::other("the parent exited"));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// What xtask's prebuilt directory is checked for: every binary, each one missing named.
    #[test]
    fn a_bin_dir_missing_a_binary_is_refused_naming_it() {
        let dir = std::env::temp_dir().join(format!("idemgate-rig-bins-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in &RIG_BINARIES[1..] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let err = prebuilt(&dir).unwrap_err().to_string();
        assert!(err.contains("has no idemgate-sidecar:"), "{err}");
        assert!(err.contains("cargo build --workspace --bins"), "{err}");
        std::fs::write(dir.join(RIG_BINARIES[0]), b"").unwrap();
        assert_eq!(prebuilt(&dir).unwrap(), dir);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
