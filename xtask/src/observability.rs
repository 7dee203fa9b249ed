//! The alerting rules under `envoy/observability/`: `promtool check rules` (syntax, PromQL,
//! templates) and `promtool test rules` (the unit tests beside them). Debian's `prometheus`
//! package provides promtool. Whether every metric they and the dashboard query exists is
//! the e2e test `observability`, which scrapes a live gateway and sidecar.

use crate::cmd;
use anyhow::Result;
use std::path::Path;
use std::process::Command;

const DIR: &str = "envoy/observability";

pub fn check(root: &Path) -> Result<()> {
    crate::toolchain::ensure_apt(&[("promtool", "prometheus")])?;
    let dir = root.join(DIR);
    cmd::step(
        "alerting rules (promtool check rules)",
        Command::new("promtool")
            .args(["check", "rules", "alerts.yaml"])
            .current_dir(&dir),
    )?;
    cmd::step(
        "alerting rule tests (promtool test rules)",
        Command::new("promtool")
            .args(["test", "rules", "alerts.test.yaml"])
            .current_dir(&dir),
    )
}
