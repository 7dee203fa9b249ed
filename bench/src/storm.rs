//! Group `storm`: a thousand identical payment requests (same caller, same
//! `Idempotency-Key`) released at once through a gateway with several workers. The demo
//! backend counts what it executed (must be 1); the sidecar's own `/metrics` count the
//! claims that reached it, so the share of duplicates the local tier (shared data) answered
//! without a network hop is read off the distributed tier, not the filter's own counters.

use crate::client::{self, RawConnection};
use crate::stack::{Stack, prometheus_sum};
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Barrier;

/// Identical requests per storm.
pub const REQUESTS: usize = 1_000;
/// Gateway worker threads.
pub const WORKERS: usize = 4;
/// The payment's backend work (`x-demo-work-ms`).
pub const WORK_MS: u64 = 100;

/// What one storm measured.
#[derive(Debug, Clone)]
pub struct StormRun {
    pub executions: u64,
    /// Latencies of every request but the one the backend executed (µs).
    pub duplicate_latencies_us: Vec<f64>,
    /// Latency of the one the backend executed (µs), when one was.
    pub executed_latency_us: Option<f64>,
    /// Answers by status (`replayed` counted apart).
    pub statuses: BTreeMap<String, u64>,
    /// Claims the sidecar answered.
    pub sidecar_claims: f64,
    /// Every request the sidecar served (claims, completes, renewals, aborts).
    pub sidecar_calls: f64,
}

impl StormRun {
    pub fn duplicates(&self) -> f64 {
        self.duplicate_latencies_us.len() as f64
    }

    /// Duplicates that made no claim at the sidecar, over all duplicates (%).
    pub fn local_share_pct(&self) -> f64 {
        let claimed_duplicates = (self.sidecar_claims - 1.0).max(0.0);
        if self.duplicates() == 0.0 {
            return 0.0;
        }
        (self.duplicates() - claimed_duplicates) / self.duplicates() * 100.0
    }
}

pub fn run(stack: &Stack, key: &str) -> Result<StormRun> {
    let backend = stack
        .backend
        .as_ref()
        .context("the stack runs no demo backend")?;
    backend.reset();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let address = stack.gateway_addr;
    let work = WORK_MS.to_string();
    let answers = runtime.block_on(async {
        let barrier = Arc::new(Barrier::new(REQUESTS));
        let mut requests = Vec::new();
        let request = Arc::new(RawConnection::request(
            address,
            "POST",
            "/payments",
            &[
                ("idempotency-key", key),
                ("x-user-id", "storm"),
                ("x-demo-work-ms", &work),
            ],
            r#"{"amount":1}"#,
        ));
        for _ in 0..REQUESTS {
            let mut connection = RawConnection::open(address).await?;
            let barrier = Arc::clone(&barrier);
            let request = Arc::clone(&request);
            requests.push(tokio::spawn(async move {
                barrier.wait().await;
                let started = Instant::now();
                let answer = connection.call(&request).await?;
                let latency = started.elapsed();
                // The connection is handed back, not dropped: a thousand connections closing
                // while the rest are still being answered would put their teardown (both
                // ends' FIN, epoll and socket bookkeeping) into the storm's latency.
                Ok::<_, anyhow::Error>((answer, latency, connection))
            }));
        }
        let mut answers = Vec::new();
        let mut connections = Vec::new();
        for request in requests {
            let (answer, latency, connection) = request.await??;
            answers.push((answer, latency));
            connections.push(connection);
        }
        drop(connections);
        // Let the holder's release reach the sidecar before its counters are read.
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok::<_, anyhow::Error>(answers)
    })?;
    let metrics = runtime.block_on(client::get(stack.sidecar_addr, "/metrics"))?;
    let mut statuses = BTreeMap::new();
    let mut duplicate_latencies_us = Vec::new();
    let mut executed_latency_us = None;
    for (answer, latency) in &answers {
        let label = if answer.replayed {
            format!("{} replayed", answer.status)
        } else {
            answer.status.to_string()
        };
        *statuses.entry(label).or_default() += 1;
        // The executed call is the one 2xx answer that is not a replay.
        let executed = (200..300).contains(&answer.status) && !answer.replayed;
        if executed && executed_latency_us.is_none() {
            executed_latency_us = Some(latency.as_secs_f64() * 1e6);
        } else {
            duplicate_latencies_us.push(latency.as_secs_f64() * 1e6);
        }
    }
    let mut sorted = duplicate_latencies_us.clone();
    let (p50, p99) = (
        crate::stats::percentile(&mut sorted, 50.0).unwrap_or(0.0),
        crate::stats::percentile(&mut sorted, 99.0).unwrap_or(0.0),
    );
    // Each storm's own figures, so a slow one stands out beside the medians the table takes.
    println!(
        "    the executed call {:.1} ms; the duplicates from the release: p50 {:.1} ms, p99 {:.1} ms",
        executed_latency_us.unwrap_or(0.0) / 1e3,
        p50 / 1e3,
        p99 / 1e3
    );
    Ok(StormRun {
        executions: backend.stats().executions,
        duplicate_latencies_us,
        executed_latency_us,
        statuses,
        sidecar_claims: prometheus_sum(&metrics, "idemgate_sidecar_claims_total"),
        sidecar_calls: prometheus_sum(&metrics, "idemgate_sidecar_request_seconds_count"),
    })
}

/// Answers by status, as the reports print them: `183× 429, 17× 200`.
pub fn status_counts(statuses: &BTreeMap<String, u64>) -> String {
    statuses
        .iter()
        .map(|(status, n)| format!("{n}× {status}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_share_counts_duplicates_without_a_claim() {
        let run = StormRun {
            executions: 1,
            duplicate_latencies_us: vec![1.0; 999],
            executed_latency_us: Some(1.0),
            statuses: BTreeMap::new(),
            sidecar_claims: 11.0,
            sidecar_calls: 12.0,
        };
        assert!((run.local_share_pct() - 989.0 / 999.0 * 100.0).abs() < 1e-9);
    }
}
