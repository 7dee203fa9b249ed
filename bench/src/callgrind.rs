//! Counting instructions with `valgrind --tool=callgrind`: stable to a few percent on machines
//! where wall-clock times drift by 1.5×, so it is the primary per-request plugin figure.

use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Command;

/// Instructions executed inside functions matching `toggle` (a callgrind
/// `--toggle-collect` pattern) while running `program args`.
pub fn instructions(toggle: &str, program: &Path, args: &[String], scratch: &Path) -> Result<u64> {
    let out = scratch.join(format!("callgrind.{}.out", std::process::id()));
    let status = valgrind(&out)
        .arg(format!("--toggle-collect={toggle}"))
        .arg(program)
        .args(args)
        .status()
        .context("running valgrind (apt-get install valgrind)")?;
    if !status.success() {
        bail!(
            "valgrind {} {} failed: {status}",
            program.display(),
            args.join(" ")
        );
    }
    take_totals(&out)
}

/// `valgrind --tool=callgrind`, quiet, writing its counts to `out`: the program and its
/// arguments (and any further callgrind options) follow.
pub fn valgrind(out: &Path) -> Command {
    let mut valgrind = Command::new("valgrind");
    valgrind
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg("--quiet");
    valgrind
}

/// The total instructions in a finished run's output file `out`, which is then removed.
pub fn take_totals(out: &Path) -> Result<u64> {
    let text =
        std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?;
    let _ = std::fs::remove_file(out);
    totals(&text).with_context(|| format!("no totals in {}", out.display()))
}

/// The `totals:` (or older `summary:`) line of a callgrind output file.
fn totals(callgrind_out: &str) -> Option<u64> {
    callgrind_out
        .lines()
        .find_map(|l| {
            l.strip_prefix("totals:")
                .or_else(|| l.strip_prefix("summary:"))
        })
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_totals() {
        assert_eq!(
            super::totals("events: Ir\nfn=x\n1 2\ntotals: 12345\n"),
            Some(12345)
        );
        assert_eq!(super::totals("summary: 7 3\n"), Some(7));
        assert_eq!(super::totals("events: Ir\n"), None);
    }
}
