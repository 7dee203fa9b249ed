//! Group `queue`: callers contending for one resource through the gateway, read off the
//! demo backend's ground truth (when each call's work started and finished).
//!
//! With the plugin in queue mode every caller sends once and waits at the sidecar; the
//! figure is the gap between one holder finishing its work and the next holder starting
//! its own — the response's trip back through the filter, the release callout, the
//! sidecar's grant to the next waiter, that waiter's resume and its trip to the backend.
//! The classic baseline, run against the same stack kind in the same run: the plugin
//! rejects (409) and each caller retries every 100 ms until it gets through.

use crate::client::{self, Connection};
use crate::stack::{Stack, prometheus_sum};
use anyhow::{Context, Result, bail};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Barrier;

/// Backend work of every call (`x-demo-work-ms`).
pub const WORK_MS: u64 = 50;
/// Callers per run, all for the same agent.
pub const CALLERS: usize = 100;
/// The classic client's pause between a 409 and its retry.
pub const RETRY_EVERY: Duration = Duration::from_millis(100);
/// Bound on one run.
const RUN_DEADLINE: Duration = Duration::from_secs(60);

/// What one run measured.
#[derive(Debug, Clone)]
pub struct HandoffRun {
    /// Start of each call's work minus the end of the previous call's (µs), in order.
    pub gaps_us: Vec<f64>,
    /// From the first call's work starting to the last one's ending (s).
    pub total_s: f64,
    /// The sum of the calls' work (s): the ideal total.
    pub work_s: f64,
    /// Requests sent, retries included.
    pub attempts: u64,
    pub executions: u64,
    /// Most calls the backend saw working at once on one resource (must stay 1).
    pub max_overlap: u32,
    pub lost_updates: u64,
    /// The sidecar's own share of a hand-off: from its store's grant to the waiter's
    /// answer leaving, mean (µs; `handoff_seconds` in its `/metrics`).
    pub sidecar_handoff_us: f64,
}

/// Runs `CALLERS` calls for `agent`, each retrying on 409 every `retry` when given.
pub fn run(stack: &Stack, agent: &str, retry: Option<Duration>) -> Result<HandoffRun> {
    let backend = stack
        .backend
        .as_ref()
        .context("the stack runs no demo backend")?;
    backend.reset();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let path = format!("/agents/{agent}/tools");
    let work = WORK_MS.to_string();
    let address = stack.gateway_addr;
    let attempts = runtime.block_on(async {
        let barrier = Arc::new(Barrier::new(CALLERS));
        let mut callers = Vec::new();
        for _ in 0..CALLERS {
            let mut connection = Connection::open(address).await?;
            let barrier = Arc::clone(&barrier);
            let (path, work) = (path.clone(), work.clone());
            callers.push(tokio::spawn(async move {
                barrier.wait().await;
                let deadline = Instant::now() + RUN_DEADLINE;
                let mut attempts = 0u64;
                loop {
                    attempts += 1;
                    let answer = connection
                        .call(
                            "POST",
                            &path,
                            &[("x-demo-work-ms", &work)],
                            r#"{"tool":"bench"}"#,
                        )
                        .await?;
                    match (answer.status, retry) {
                        (200, _) => return Ok::<_, anyhow::Error>(attempts),
                        (409, Some(pause)) if Instant::now() < deadline => {
                            tokio::time::sleep(pause).await;
                        }
                        (status, _) => bail!(
                            "a caller got {status}: {}",
                            String::from_utf8_lossy(&answer.body)
                        ),
                    }
                }
            }));
        }
        let mut total = 0;
        for caller in callers {
            total += caller.await??;
        }
        Ok::<_, anyhow::Error>(total)
    })?;
    let metrics = runtime.block_on(client::get(stack.sidecar_addr, "/metrics"))?;
    let handoffs = prometheus_sum(&metrics, "idemgate_sidecar_handoff_seconds_count");
    let sidecar_handoff_us = if handoffs > 0.0 {
        prometheus_sum(&metrics, "idemgate_sidecar_handoff_seconds_sum") / handoffs * 1e6
    } else {
        f64::NAN
    };
    let stats = backend.stats();
    let spans = stats
        .spans
        .get(&format!("agent:{agent}"))
        .cloned()
        .unwrap_or_default();
    let shape = spans_shape(&spans);
    Ok(HandoffRun {
        gaps_us: shape.gaps_us,
        total_s: shape.total_us / 1e6,
        work_s: shape.work_us / 1e6,
        attempts,
        executions: stats.executions,
        max_overlap: stats.max_overlap,
        lost_updates: stats.lost_updates,
        sidecar_handoff_us,
    })
}

/// Gaps, span and summed work of (start, end) spans in µs.
struct Shape {
    gaps_us: Vec<f64>,
    total_us: f64,
    work_us: f64,
}

fn spans_shape(spans: &[(u64, u64)]) -> Shape {
    let mut spans = spans.to_vec();
    spans.sort_unstable();
    let gaps_us = spans
        .windows(2)
        .filter_map(|w| match w {
            [(_, end), (start, _)] => Some(*start as f64 - *end as f64),
            _ => None,
        })
        .collect();
    let total_us = match (spans.first(), spans.last()) {
        (Some((first, _)), Some((_, last))) => last.saturating_sub(*first) as f64,
        _ => 0.0,
    };
    let work_us = spans.iter().map(|(s, e)| e.saturating_sub(*s) as f64).sum();
    Shape {
        gaps_us,
        total_us,
        work_us,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn gaps_total_and_work_of_spans() {
        let shape = super::spans_shape(&[(300, 400), (0, 100), (100, 250)]);
        assert_eq!(shape.gaps_us, vec![0.0, 50.0]);
        assert_eq!(shape.total_us, 400.0);
        assert_eq!(shape.work_us, 350.0);
        assert!(super::spans_shape(&[]).gaps_us.is_empty());
    }
}
