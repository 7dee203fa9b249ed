//! The e2e group: wrk through the gateway, a GET mix and a mutating mix, against the no-op
//! filter.

use super::{GATEWAY_RUNS, GATEWAY_WORKERS, Modules, summary_of};
use crate::gateway_load;
use crate::report::{self, Check, Figure, Group};
use crate::stack::{BackendSpec, Conflict, Stack};
use crate::stats::Summary;
use crate::wrk::{self, Mix, WrkRun};
use anyhow::{Context, Result};
use idemgate_sidecar::testing::RedisServer;

pub fn group(modules: &Modules) -> Result<Group> {
    let redis = RedisServer::start().context("starting redis-server")?;
    let upstream = gateway_load::upstream()?;
    let scratch = std::env::temp_dir();
    let mixes = [Mix::Get, Mix::Mutating];
    let mut ours: Vec<Vec<WrkRun>> = vec![Vec::new(); mixes.len()];
    let mut base: Vec<Vec<WrkRun>> = vec![Vec::new(); mixes.len()];
    let mut misjudged = 0;
    for run in 0..GATEWAY_RUNS {
        for (i, mix) in mixes.iter().enumerate() {
            for (module, runs) in [(&modules.idemgate, &mut ours), (&modules.noop, &mut base)] {
                println!(
                    "  run {}: {}, {}",
                    run + 1,
                    mix.describe(),
                    module.display()
                );
                let stack = Stack::start(
                    redis.store_config(),
                    BackendSpec::At(upstream),
                    &modules.gateway(module, Conflict::Reject, GATEWAY_WORKERS),
                )?;
                let nonce = format!("{}-{run}-{i}", std::process::id());
                let result = wrk::run(stack.gateway_addr, *mix, &nonce, &scratch)?;
                misjudged += ["idemgate.requests.rejected", "idemgate.requests.replayed"]
                    .iter()
                    .map(|name| stack.plugin_counter(name))
                    .sum::<i64>();
                stack.stop()?;
                if let Some(runs) = runs.get_mut(i) {
                    runs.push(result);
                }
            }
        }
    }
    let mut figures = Vec::new();
    let mut non_2xx = Vec::new();
    for ((mix, ours), base) in mixes.iter().zip(&ours).zip(&base) {
        let noop = |f: fn(&WrkRun) -> f64| -> Result<Option<(String, Summary)>> {
            Ok(Some((
                "no-op filter".to_owned(),
                summary_of(base.iter().map(f))?,
            )))
        };
        figures.push(Figure {
            name: format!("{}: throughput", mix.describe()),
            unit: "requests/s",
            value: summary_of(ours.iter().map(|r| r.requests_per_sec))?,
            baseline: noop(|r| r.requests_per_sec)?,
            goal: None,
        });
        figures.push(Figure {
            name: format!("{}: p50 latency", mix.describe()),
            unit: "µs",
            value: summary_of(ours.iter().map(|r| r.p50_us))?,
            baseline: noop(|r| r.p50_us)?,
            goal: None,
        });
        figures.push(Figure {
            name: format!("{}: p99 latency", mix.describe()),
            unit: "µs",
            value: summary_of(ours.iter().map(|r| r.p99_us))?,
            baseline: noop(|r| r.p99_us)?,
            goal: None,
        });
        let total = |runs: &[WrkRun], f: fn(&WrkRun) -> u64| {
            report::number(runs.iter().map(f).sum::<u64>() as f64)
        };
        non_2xx.push(format!(
            "{}: {} of {} (idemgate), {} of {} (no-op)",
            mix.describe(),
            total(ours, |r| r.non_2xx),
            total(ours, |r| r.requests),
            total(base, |r| r.non_2xx),
            total(base, |r| r.requests),
        ));
    }
    Ok(Group {
        title: "End-to-end overhead: wrk through the gateway",
        command: "cargo xtask bench e2e".into(),
        figures,
        checks: vec![Check {
            what: "no request with a unique key was answered as a duplicate (409 or replay)".into(),
            held: misjudged == 0,
        }],
        notes: vec![format!(
            "`wrk -t{threads} -c{connections} -d{seconds}s --latency` against \
             `idemgate-gateway` running `envoy/envoy.yaml` ({GATEWAY_WORKERS} workers) in \
             front of a keep-alive upstream answering `200 ok`; idemgate's sidecar runs \
             in-process on Redis. GET mix: `GET /items/1`, matched by no rule. Mutating mix: \
             `POST /payments` with a fresh `Idempotency-Key` per request (a Lua script), so \
             each one is claimed at the sidecar, forwarded and completed. The baseline is the \
             same gateway with the no-op filter; {GATEWAY_RUNS} runs alternating the two. wrk, \
             the gateway, the sidecar, Redis and the upstream share 2 cores with other \
             builds: read the ratios. Non-2xx answers: {}.",
            non_2xx.join("; "),
            threads = wrk::THREADS,
            connections = wrk::CONNECTIONS,
            seconds = wrk::SECONDS,
        )],
    })
}
