//! The queue group: the hand-off between callers contending for one resource, queued against
//! rejected-and-retrying.

use super::{GATEWAY_RUNS, GATEWAY_WORKERS, Modules, summary_of};
use crate::queue_handoff::{self, HandoffRun};
use crate::report::{Check, Figure, Goal, Group};
use crate::stack::{BackendSpec, Conflict, Stack};
use crate::stats::percentile;
use anyhow::{Context, Result};
use idemgate_sidecar::StoreConfig;
use idemgate_sidecar::testing::RedisServer;

pub fn group(modules: &Modules) -> Result<Group> {
    let redis = RedisServer::start().context("starting redis-server")?;
    let stores = [
        ("memory", StoreConfig::Memory),
        ("Redis", redis.store_config()),
    ];
    let mut queued: Vec<Vec<HandoffRun>> = vec![Vec::new(); stores.len()];
    let mut retried = Vec::new();
    for run in 0..GATEWAY_RUNS {
        for ((store, config), runs) in stores.iter().zip(queued.iter_mut()) {
            println!("  run {}: queue mode, sidecar on {store}", run + 1);
            let stack = Stack::start(
                config.clone(),
                BackendSpec::Demo,
                &modules.gateway(&modules.idemgate, Conflict::Queue, GATEWAY_WORKERS),
            )?;
            runs.push(queue_handoff::run(
                &stack,
                &format!("queue-{store}-{run}"),
                None,
            )?);
            stack.stop()?;
        }
        println!(
            "  run {}: reject mode, clients retrying every 100 ms",
            run + 1
        );
        let stack = Stack::start(
            redis.store_config(),
            BackendSpec::Demo,
            &modules.gateway(&modules.idemgate, Conflict::Reject, GATEWAY_WORKERS),
        )?;
        retried.push(queue_handoff::run(
            &stack,
            &format!("retry-{run}"),
            Some(queue_handoff::RETRY_EVERY),
        )?);
        stack.stop()?;
    }
    let gap = |runs: &[HandoffRun], p: f64| {
        summary_of(
            runs.iter()
                .filter_map(|r| percentile(&mut r.gaps_us.clone(), p)),
        )
    };
    let total = |runs: &[HandoffRun]| summary_of(runs.iter().map(|r| r.total_s));
    let ideal = |runs: &[HandoffRun]| summary_of(runs.iter().map(|r| r.work_s));
    let retry = |what: &str| format!("100 ms retry loop: {what}");
    let mut figures = Vec::new();
    for ((store, _), runs) in stores.iter().zip(&queued) {
        figures.push(Figure {
            name: format!("queue on {store}: one holder's end → next holder at the backend, p50"),
            unit: "µs",
            value: gap(runs, 50.0)?,
            baseline: Some((retry("p50"), gap(&retried, 50.0)?)),
            goal: Some(Goal::AtMost(1000.0)),
        });
        figures.push(Figure {
            name: format!("queue on {store}: one holder's end → next holder at the backend, p99"),
            unit: "µs",
            value: gap(runs, 99.0)?,
            baseline: Some((retry("p99"), gap(&retried, 99.0)?)),
            goal: Some(Goal::AtMost(5000.0)),
        });
        figures.push(Figure {
            name: format!(
                "queue on {store}: of a hand-off, inside the sidecar (grant → answer), mean"
            ),
            unit: "µs",
            value: summary_of(runs.iter().map(|r| r.sidecar_handoff_us))?,
            baseline: None,
            goal: None,
        });
        figures.push(Figure {
            name: format!("queue on {store}: first call's start → last call's end"),
            unit: "s",
            value: total(runs)?,
            baseline: Some(("ideal: sum of the work".into(), ideal(runs)?)),
            goal: Some(Goal::RatioAtMost(1.02)),
        });
    }
    figures.push(Figure {
        name: retry("first call's start → last call's end"),
        unit: "s",
        value: total(&retried)?,
        baseline: Some(("ideal: sum of the work".into(), ideal(&retried)?)),
        goal: None,
    });
    figures.push(Figure {
        name: retry("requests sent per call"),
        unit: "requests",
        value: summary_of(
            retried
                .iter()
                .map(|r| r.attempts as f64 / queue_handoff::CALLERS as f64),
        )?,
        baseline: None,
        goal: None,
    });
    let runs: Vec<&HandoffRun> = queued.iter().flatten().chain(&retried).collect();
    let checks = vec![Check {
        what: format!(
            "every run: each of the {} calls executed exactly once, never two at a time on the \
             resource, no lost update",
            queue_handoff::CALLERS
        ),
        held: runs.iter().all(|r| {
            r.executions == queue_handoff::CALLERS as u64
                && r.max_overlap == 1
                && r.lost_updates == 0
        }),
    }];
    Ok(Group {
        title: "Queue hand-off: callers contending for one resource",
        command: "cargo xtask bench queue".into(),
        figures,
        checks,
        notes: vec![format!(
            "{callers} callers, each on its own keep-alive connection, release at once `POST \
             /agents/a/tools` (a lock on the agent) through `idemgate-gateway` running \
             `envoy/envoy.yaml` ({GATEWAY_WORKERS} workers) with a real in-process sidecar; the \
             demo backend works {work} ms per call and records when each call's work starts \
             and ends, which is where every figure is read. Queue mode: callers wait at the \
             sidecar and are let through in turn. Baseline (same run, sidecar on Redis): the \
             rule rejects (409) and each caller retries every 100 ms. The gap includes the \
             finished call's response through the filter, its release callout (sent when the \
             plugin's root is woken through its shared queue), the sidecar's grant to the next waiter, and that \
             request's way to the backend; the sidecar's own part of it is read from its \
             `handoff_seconds` metric, so the rest of the gap is the gateway's path (the \
             release callout leaving once the plugin's root is woken, the grant reaching the \
             waiting request's worker, the resumed request's trip to the backend), whose wake-ups are what a loaded 2-core VM delays most. \
             {GATEWAY_RUNS} runs per configuration; \
             p50/p99 are per run (99 gaps each), then the median over runs. Wall-clock figures \
             on a 2-core VM shared with other builds: compare within the run.",
            callers = queue_handoff::CALLERS,
            work = queue_handoff::WORK_MS,
        )],
    })
}
