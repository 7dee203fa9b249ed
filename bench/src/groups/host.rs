//! The host group: the gateway's throughput with and without a (no-op) filter.

use super::LOAD_RUNS;
use crate::gateway_load;
use crate::report::{Figure, Group};
use crate::stats::Summary;
use anyhow::{Context, Result};
use std::path::Path;

/// Seconds of closed-loop load per gateway run.
const GATEWAY_SECONDS: u64 = 5;

pub fn group(target: &Path) -> Result<Group> {
    let noop = target.join("fixtures/noop.wasm");
    let backend = gateway_load::upstream()?;
    let (mut bare, mut filtered) = (Vec::new(), Vec::new());
    for run in 0..LOAD_RUNS {
        println!(
            "  run {}: gateway without a filter, then with the no-op filter",
            run + 1
        );
        bare.push(gateway_load::throughput(backend, None, GATEWAY_SECONDS)?);
        filtered.push(gateway_load::throughput(
            backend,
            Some(&noop),
            GATEWAY_SECONDS,
        )?);
    }
    Ok(Group {
        title: "Host overhead: the gateway with and without a filter",
        command: "cargo xtask bench host".into(),
        figures: vec![Figure {
            name: "gateway with the no-op filter (1 worker)".into(),
            unit: "requests/s",
            value: Summary::of(&filtered).context("no runs")?,
            baseline: Some((
                "same gateway, no filter".into(),
                Summary::of(&bare).context("no runs")?,
            )),
            goal: None,
        }],
        checks: Vec::new(),
        notes: vec![format!(
            "`idemgate-gateway` (the harness's live mode: hyper, one worker thread with its own \
             event loop and VM) in front of a keep-alive upstream answering `200 ok`; \
             {} keep-alive HTTP/1.1 clients in a closed loop for {GATEWAY_SECONDS} s per run, \
             {LOAD_RUNS} runs alternating the two configurations. The no-op filter's cost inside \
             the VM per request (instructions and ns) is the baseline of the plugin group.",
            gateway_load::CONNECTIONS
        )],
    })
}
