//! The build script of the sidecar and the filter: records the git commit they are built from
//! (`IDEMGATE_GIT_COMMIT`), which each logs at start beside its version. Outside a git checkout
//! (a source tarball, a container build without `.git`) the commit comes from the
//! `IDEMGATE_GIT_COMMIT` environment variable, or is `unknown`.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (!text.is_empty()).then_some(text)
}

fn main() {
    println!("cargo:rerun-if-env-changed=IDEMGATE_GIT_COMMIT");
    let commit = std::env::var("IDEMGATE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| {
            // Rebuild when HEAD moves: a new commit on the branch or another branch.
            for path in ["HEAD", "packed-refs"] {
                if let Some(p) = git(&["rev-parse", "--git-path", path]) {
                    println!("cargo:rerun-if-changed={p}");
                }
            }
            if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
                && let Some(p) = git(&["rev-parse", "--git-path", &branch])
            {
                println!("cargo:rerun-if-changed={p}");
            }
            git(&["rev-parse", "--short=12", "HEAD"])
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=IDEMGATE_GIT_COMMIT={commit}");
}
