//! What a benchmark group found, and how it is written: `BENCHMARKS.md` tables (median,
//! spread, baseline from the same run, ratio, goal) plus one SVG chart per group.

use crate::stats::Summary;
use std::fmt::Write as _;

/// A target a figure is held to, on its ratio to the baseline or on its own value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Goal {
    RatioAtMost(f64),
    RatioAtLeast(f64),
    AtMost(f64),
    AtLeast(f64),
}

impl Goal {
    fn describe(&self, unit: &str) -> String {
        match self {
            Goal::RatioAtMost(r) => format!("≤ {r}×"),
            Goal::RatioAtLeast(r) => format!("≥ {r}×"),
            Goal::AtMost(v) => format!("≤ {} {unit}", number(*v)),
            Goal::AtLeast(v) => format!("≥ {} {unit}", number(*v)),
        }
    }

    fn met(&self, value: f64, ratio: Option<f64>) -> Option<bool> {
        match *self {
            Goal::RatioAtMost(r) => ratio.map(|x| x <= r),
            Goal::RatioAtLeast(r) => ratio.map(|x| x >= r),
            Goal::AtMost(v) => Some(value <= v),
            Goal::AtLeast(v) => Some(value >= v),
        }
    }
}

/// One measured figure, optionally against a baseline measured in the same run.
#[derive(Debug, Clone)]
pub struct Figure {
    pub name: String,
    pub unit: &'static str,
    pub value: Summary,
    pub baseline: Option<(String, Summary)>,
    pub goal: Option<Goal>,
}

impl Figure {
    pub fn ratio(&self) -> Option<f64> {
        let (_, base) = self.baseline.as_ref()?;
        (base.median != 0.0).then(|| self.value.median / base.median)
    }

    pub fn goal_met(&self) -> Option<bool> {
        self.goal?.met(self.value.median, self.ratio())
    }
}

/// A correctness condition checked while benchmarking (e.g. one backend execution);
/// the bench fails when one does not hold, unlike a missed performance goal.
#[derive(Debug, Clone)]
pub struct Check {
    pub what: String,
    pub held: bool,
}

/// One benchmark group's results.
#[derive(Debug, Clone)]
pub struct Group {
    pub title: &'static str,
    /// The command that reproduces this group alone.
    pub command: String,
    pub figures: Vec<Figure>,
    pub checks: Vec<Check>,
    pub notes: Vec<String>,
}

/// The machine the figures were measured on.
#[derive(Debug, Clone)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory: String,
    pub kernel: String,
    pub when: String,
    pub revision: String,
}

/// The report's opening: how to read every section.
pub const INTRO: &str = "# idemgate benchmarks

Written by `cargo xtask bench` (one group: `cargo xtask bench <group>`). Every ratio compares \
against a baseline measured in the same run on the same machine; figures are medians of \
repeated runs with their spread (half the min–max range, relative to the median). Instruction \
counts come from `valgrind --tool=callgrind` and repeat within a few percent (hash seeds vary \
between runs): they are the stable figures. Wall-clock figures on a shared 2-core VM drift by up \
to 1.5× between runs, and more while other builds run beside the bench (as they did when the \
committed figures were taken), so read them as ratios to their same-run baselines. The bench's \
process keeps the memory it frees (it runs itself with `MIMALLOC_PURGE_DELAY=-1`), as a gateway \
in service keeps its working set: every gateway group starts fresh stacks in that one process. \
The bench is built with the `dist` profile (fat LTO, one codegen unit), the one the sidecar's \
image is built with: the sidecar, the harness gateway and the bench's own clients all run in its \
process, so their figures are those of the shipped build.

Groups: `plugin` (cost per request in the VM, compile, VM start, memory, size), `host` (the \
gateway with and without a filter), `sidecar` (claim+complete against raw Redis), `queue` \
(hand-off between callers queued on one resource), `storm` (1,000 identical requests at once), \
`e2e` (wrk through the gateway), and, only when named, `peer` (idemgate beside \
`idempotent-proxy-server` from crates.io, which it installs first). A correctness check that fails (e.g. more than one backend \
execution in the storm) makes the command exit non-zero; a missed performance goal does not.
";

/// One group's section: what it measured, on which machine, with which command.
pub fn section(machine: &Machine, group: &Group, chart: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## {}\n", group.title);
    let _ = writeln!(
        out,
        "Reproduce: `{}` — measured {} at `{}` on {} ({} cores, {} memory, kernel {}).\n",
        group.command,
        machine.when,
        machine.revision,
        machine.cpu,
        machine.cores,
        machine.memory,
        machine.kernel
    );
    let _ = writeln!(
        out,
        "| measurement | median | spread | runs | baseline (same run) | ratio | goal |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---|---:|---|");
    for f in &group.figures {
        let baseline = f
            .baseline
            .as_ref()
            .map(|(name, b)| format!("{name}: {} {}", number(b.median), f.unit))
            .unwrap_or_else(|| "—".into());
        let ratio = f
            .ratio()
            .map(|r| format!("{r:.2}×"))
            .unwrap_or_else(|| "—".into());
        let goal = match (f.goal, f.goal_met()) {
            (Some(goal), Some(true)) => format!("{} ✔", goal.describe(f.unit)),
            (Some(goal), Some(false)) => format!("{} ✘ missed", goal.describe(f.unit)),
            (Some(goal), None) => goal.describe(f.unit),
            (None, _) => "—".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {} {} | ±{:.1} % | {} | {} | {} | {} |",
            f.name,
            number(f.value.median),
            f.unit,
            f.value.spread_pct(),
            f.value.runs,
            baseline,
            ratio,
            goal
        );
    }
    if !group.checks.is_empty() {
        let _ = writeln!(out, "\nCorrectness checks:\n");
        for check in &group.checks {
            let mark = if check.held { "held" } else { "**FAILED**" };
            let _ = writeln!(out, "- {}: {mark}", check.what);
        }
    }
    for note in &group.notes {
        let _ = writeln!(out, "\n{note}");
    }
    if group.figures.iter().any(|f| f.ratio().is_some()) {
        let _ = writeln!(out, "\n![{}]({chart})", group.title);
    }
    out
}

/// Numbers as people read them: thousands separated, at most 3 significant decimals.
pub fn number(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1000.0 {
        let whole = v.round() as i64;
        let digits = whole.abs().to_string();
        let mut grouped = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                grouped.push(',');
            }
            grouped.push(c);
        }
        if whole < 0 {
            format!("-{grouped}")
        } else {
            grouped
        }
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(v: f64) -> Summary {
        Summary::of(&[v]).unwrap()
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(number(1970.4), "1,970");
        assert_eq!(number(1_234_567.0), "1,234,567");
        assert_eq!(number(123.4), "123");
        assert_eq!(number(12.34), "12.3");
        assert_eq!(number(0.1234), "0.123");
        assert_eq!(number(0.0), "0");
        assert_eq!(number(7.0), "7");
    }

    #[test]
    fn ratio_goals_and_failed_checks_are_reported() {
        let figure = Figure {
            name: "no-rule request".into(),
            unit: "instructions",
            value: summary(2200.0),
            baseline: Some(("no-op filter".into(), summary(2000.0))),
            goal: Some(Goal::RatioAtMost(1.2)),
        };
        assert!((figure.ratio().unwrap() - 1.1).abs() < 1e-9);
        assert_eq!(figure.goal_met(), Some(true));
        let group = Group {
            title: "Plugin cost per request",
            command: "cargo xtask bench plugin".into(),
            figures: vec![figure],
            checks: vec![Check {
                what: "one backend execution".into(),
                held: false,
            }],
            notes: vec![],
        };
        let machine = Machine {
            cpu: "cpu".into(),
            cores: 2,
            memory: "24 GiB".into(),
            kernel: "6".into(),
            when: "now".into(),
            revision: "abc".into(),
        };
        let md = section(&machine, &group, "benchmarks/plugin.svg");
        assert!(md.contains("| no-rule request | 2,200 instructions | ±0.0 % | 1 | no-op filter: 2,000 instructions | 1.10× | ≤ 1.2× ✔ |"), "{md}");
        assert!(md.contains("one backend execution: **FAILED**"));
        assert!(md.contains("![Plugin cost per request](benchmarks/plugin.svg)"));
    }
}
