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
    let (mut ours, mut queued, mut base): (Vec<StormRun>, Vec<StormRun>, Vec<StormRun>) =
        (Vec::new(), Vec::new(), Vec::new());
    // One storm first, not measured: this process's first storm pays the kernel for every
    // page its thousand connections' buffers touch for the first time (tens of ms of both
    // cores zeroing pages, storm notes, Session 17/19), which a gateway in service has long
    // paid. The bench keeps freed memory (`with_freed_memory_kept`), so the measured storms
    // that follow reuse what this one faulted in, baseline and idemgate alike.
    println!(
        "  warm-up: {} identical requests, not measured",
        storm::REQUESTS
    );
    let stack = Stack::start(
        redis.store_config(),
        BackendSpec::Demo,
        &modules.gateway(&modules.idemgate, Conflict::Queue, storm::WORKERS),
    )?;
    storm::run(&stack, "storm-warm-up")?;
    stack.stop()?;
    for run in 0..GATEWAY_RUNS {
        for (module, conflict, runs) in [
            (&modules.idemgate, Conflict::Reject, &mut ours),
            (&modules.idemgate, Conflict::Queue, &mut queued),
            (&modules.noop, Conflict::Reject, &mut base),
        ] {
            println!(
                "  run {}: {} identical requests, {} ({conflict:?})",
                run + 1,
                storm::REQUESTS,
                module.display()
            );
            let stack = Stack::start(
                redis.store_config(),
                BackendSpec::Demo,
                &modules.gateway(module, conflict, storm::WORKERS),
            )?;
            runs.push(storm::run(&stack, &format!("storm-{run}-{conflict:?}"))?);
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
    // Queue mode: every duplicate is answered with the first call's response.
    let first_response_pct = |r: &StormRun| {
        let replayed = r
            .statuses
            .iter()
            .filter(|(s, _)| s.as_str() == "201 replayed");
        replayed.map(|(_, n)| *n as f64).sum::<f64>() / r.duplicates().max(1.0) * 100.0
    };
    let figures = vec![
        Figure {
            name: "backend executions".into(),
            unit: "executions",
            value: summary_of(ours.iter().chain(&queued).map(|r| r.executions as f64))?,
            baseline: noop(summary_of(base.iter().map(|r| r.executions as f64))?),
            goal: Some(Goal::AtMost(1.0)),
        },
        Figure {
            name: "reject mode: duplicates p50 latency".into(),
            unit: "µs",
            value: latency(&ours, 50.0)?,
            baseline: noop(latency(&base, 50.0)?),
            goal: None,
        },
        Figure {
            name: "reject mode: duplicates p99 latency".into(),
            unit: "µs",
            value: latency(&ours, 99.0)?,
            baseline: noop(latency(&base, 99.0)?),
            goal: None,
        },
        Figure {
            name: "reject mode: claims that reached the sidecar".into(),
            unit: "claims",
            value: summary_of(ours.iter().map(|r| r.sidecar_claims))?,
            baseline: None,
            goal: None,
        },
        Figure {
            name: "reject mode: sidecar requests (claims, completes, renewals)".into(),
            unit: "requests",
            value: summary_of(ours.iter().map(|r| r.sidecar_calls))?,
            baseline: None,
            goal: None,
        },
        Figure {
            name: "reject mode: duplicates answered by the local tier (no sidecar call)".into(),
            unit: "%",
            value: summary_of(ours.iter().map(StormRun::local_share_pct))?,
            baseline: None,
            goal: Some(Goal::AtLeast(90.0)),
        },
        Figure {
            name: "queue mode: duplicates answered with the first response".into(),
            unit: "%",
            value: summary_of(queued.iter().map(first_response_pct))?,
            baseline: None,
            goal: Some(Goal::AtLeast(100.0)),
        },
        Figure {
            name: "queue mode: duplicates p50 latency (the call takes 100 ms)".into(),
            unit: "µs",
            value: latency(&queued, 50.0)?,
            baseline: noop(latency(&base, 50.0)?),
            goal: None,
        },
        Figure {
            name: "queue mode: duplicates p99 latency".into(),
            unit: "µs",
            value: latency(&queued, 99.0)?,
            baseline: noop(latency(&base, 99.0)?),
            goal: Some(Goal::AtMost((storm::WORK_MS * 1_000 + 10_000) as f64)),
        },
        Figure {
            name: "queue mode: the first call's own latency".into(),
            unit: "µs",
            value: summary_of(queued.iter().filter_map(|r| r.executed_latency_us))?,
            baseline: None,
            goal: None,
        },
        Figure {
            name: "queue mode: duplicates p99 after the first call's answer".into(),
            unit: "µs",
            value: summary_of(queued.iter().filter_map(|r| {
                let p99 = percentile(&mut r.duplicate_latencies_us.clone(), 99.0)?;
                Some(p99 - r.executed_latency_us?)
            }))?,
            // What answering a thousand requests at once costs this gateway and client here,
            // with nothing waiting: the floor under delivering the first response to 999.
            baseline: Some((
                "reject mode (answered on arrival): duplicates p99 from the release".into(),
                latency(&ours, 99.0)?,
            )),
            goal: Some(Goal::AtMost(10_000.0)),
        },
        Figure {
            name: "queue mode: claims that reached the sidecar (one gateway)".into(),
            unit: "claims",
            value: summary_of(queued.iter().map(|r| r.sidecar_claims))?,
            baseline: None,
            goal: Some(Goal::AtMost(2.0)),
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
        checks: vec![
            Check {
                what: format!(
                    "every storm through idemgate executed the payment exactly once ({} runs \
                     per mode)",
                    ours.len()
                ),
                held: ours.iter().chain(&queued).all(|r| r.executions == 1),
            },
            Check {
                what: "queue mode: every duplicate got the first response".into(),
                held: queued.iter().all(|r| first_response_pct(r) >= 100.0),
            },
        ],
        notes: vec![format!(
            "{requests} keep-alive connections to `idemgate-gateway` (`envoy/envoy.yaml`, \
             {workers} workers) each send the same `POST /payments` (same `x-user-id`, same \
             `Idempotency-Key`) the moment all are connected, the rule rejecting duplicates of \
             a running call (reject mode) or queueing them as the shipped rule does (queue \
             mode: `max_wait` 10 s, `max_queue` 16; duplicates on one gateway wait on its \
             shared data for the call's outcome, not at the sidecar); the demo backend works {work} ms on a call and counts executions. \
             The sidecar (Redis store) counts the claims it answered: every claim beyond the \
             first is a duplicate the local tier did not catch. Latency runs from the release \
             to the answer; the client sending all of them shares the 2 cores with the \
             gateway, so it is the storm's whole turnaround, not the filter's decision time \
             (that is the plugin group's local-duplicate figure). The client is kept light for \
             that reason: one task per connection, the request written from bytes prepared \
             once, the answer parsed in place, and every connection held open until all \
             answers are in. One storm runs first and is not measured: the process's first \
             storm pays the kernel for zeroing every page its connections touch for the first \
             time, which a gateway in service has long paid (the bench keeps the memory it \
             frees, so the storms after it reuse those pages). The wait after the first call's \
             answer is set beside reject mode's p99, where the local tier answers every \
             duplicate on arrival: what a thousand answers cost this gateway and client with \
             nothing waiting, the floor under handing one response to 999 waiters. Baseline: the same storm \
             through the same gateway with the no-op filter, where every request reaches the \
             backend. Answers per run, idemgate reject mode: {ours}; queue mode: {queued}; \
             no-op filter: {base}. {GATEWAY_RUNS} runs.",
            requests = storm::REQUESTS,
            workers = storm::WORKERS,
            work = storm::WORK_MS,
            ours = answers(&ours),
            queued = answers(&queued),
            base = answers(&base),
        )],
    })
}
