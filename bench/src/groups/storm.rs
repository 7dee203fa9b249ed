//! The storm group: 1,000 identical requests at once, through idemgate and the no-op filter.

use super::{GATEWAY_RUNS, Modules, summary_of};
use crate::report::{Check, Figure, Goal, Group};
use crate::stack::{BackendSpec, Conflict, Stack};
use crate::stats::{Summary, percentile};
use crate::storm::{self, StormRun};
use anyhow::{Context, Result};
use idemgate_sidecar::testing::RedisServer;

pub fn group(modules: &Modules) -> Result<Group> {
    let redis = RedisServer::start().context("starting redis-server")?;
    let (mut ours, mut base): (Vec<StormRun>, Vec<StormRun>) = (Vec::new(), Vec::new());
    for run in 0..GATEWAY_RUNS {
        for (module, runs) in [(&modules.idemgate, &mut ours), (&modules.noop, &mut base)] {
            println!(
                "  run {}: {} identical requests, {}",
                run + 1,
                storm::REQUESTS,
                module.display()
            );
            let stack = Stack::start(
                redis.store_config(),
                BackendSpec::Demo,
                &modules.gateway(module, Conflict::Reject, storm::WORKERS),
            )?;
            runs.push(storm::run(&stack, &format!("storm-{run}"))?);
            stack.stop()?;
        }
    }
    let latency = |runs: &[StormRun], p: f64| {
        summary_of(
            runs.iter()
                .filter_map(|r| percentile(&mut r.duplicate_latencies_us.clone(), p)),
        )
    };
    let noop = |s: Summary| Some(("no-op filter (all executed)".to_owned(), s));
    let figures = vec![
        Figure {
            name: "backend executions".into(),
            unit: "executions",
            value: summary_of(ours.iter().map(|r| r.executions as f64))?,
            baseline: noop(summary_of(base.iter().map(|r| r.executions as f64))?),
            goal: Some(Goal::AtMost(1.0)),
        },
        Figure {
            name: "duplicates: p50 latency".into(),
            unit: "µs",
            value: latency(&ours, 50.0)?,
            baseline: noop(latency(&base, 50.0)?),
            goal: None,
        },
        Figure {
            name: "duplicates: p99 latency".into(),
            unit: "µs",
            value: latency(&ours, 99.0)?,
            baseline: noop(latency(&base, 99.0)?),
            goal: None,
        },
        Figure {
            name: "claims that reached the sidecar".into(),
            unit: "claims",
            value: summary_of(ours.iter().map(|r| r.sidecar_claims))?,
            baseline: None,
            goal: None,
        },
        Figure {
            name: "sidecar requests (claims, completes, renewals)".into(),
            unit: "requests",
            value: summary_of(ours.iter().map(|r| r.sidecar_calls))?,
            baseline: None,
            goal: None,
        },
        Figure {
            name: "duplicates answered by the local tier (no sidecar call)".into(),
            unit: "%",
            value: summary_of(ours.iter().map(StormRun::local_share_pct))?,
            baseline: None,
            goal: Some(Goal::AtLeast(90.0)),
        },
    ];
    let answers = |runs: &[StormRun]| {
        runs.iter()
            .map(|r| crate::storm::status_counts(&r.statuses))
            .collect::<Vec<_>>()
            .join("; ")
    };
    Ok(Group {
        title: "Duplicate storm: 1,000 identical requests at once",
        command: "cargo xtask bench storm".into(),
        figures,
        checks: vec![Check {
            what: format!(
                "every storm through idemgate executed the payment exactly once ({} runs)",
                ours.len()
            ),
            held: ours.iter().all(|r| r.executions == 1),
        }],
        notes: vec![format!(
            "{requests} keep-alive connections to `idemgate-gateway` (`envoy/envoy.yaml`, \
             {workers} workers) each send the same `POST /payments` (same `x-user-id`, same \
             `Idempotency-Key`; the rule rejects duplicates of a running call) the moment all \
             are connected; the demo backend works {work} ms on a call and counts executions. \
             The sidecar (Redis store) counts the claims it answered: every claim beyond the \
             first is a duplicate the local tier did not catch. Latency runs from the release \
             to the answer; the client sending all of them shares the 2 cores with the \
             gateway, so it is the storm's whole turnaround, not the filter's decision time \
             (that is the plugin group's local-duplicate figure). Baseline: the same storm \
             through the same gateway with the no-op filter, where every request reaches the \
             backend. Answers per run, idemgate: {ours}; no-op filter: {base}. {GATEWAY_RUNS} \
             runs.",
            requests = storm::REQUESTS,
            workers = storm::WORKERS,
            work = storm::WORK_MS,
            ours = answers(&ours),
            base = answers(&base),
        )],
    })
}
