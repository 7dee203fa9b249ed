//! The global tier of rate protection (`POST /v1/rate`): GCRA limits that hold across every
//! gateway, because every gateway asks the same store.
//!
//! Each check is one atomic step in the store — in Redis one Lua script on one key whose hash
//! tag is the limited key, so a Cluster spreads limits over slots and no script crosses one.
//! A request's checks (per caller, per resource, ...) run in order and stop at the first one
//! over its limit: the checks before it have counted the request, which errs towards
//! limiting, never towards letting more through.
//!
//! The arithmetic is `idemgate_wire::gcra`, shared with the filter's local tier; the Redis
//! script is the same steps in Lua on Redis's own clock (`TIME`), so skewed sidecars agree.

use crate::store::StoreResult;
use idemgate_wire::{GcraStep, Rate, RateOutcome, RateRequest, RateResult};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Mutex, PoisonError};

/// A store that can take one GCRA step atomically.
pub(crate) trait RateStore: Send + Sync + 'static {
    fn gcra(&self, key: &str, rate: Rate) -> impl Future<Output = StoreResult<GcraStep>> + Send;
}

/// Runs a request's checks in order, stopping at the first limited one.
pub(crate) async fn check<S: RateStore>(store: &S, req: &RateRequest) -> StoreResult<RateOutcome> {
    let mut results = Vec::with_capacity(req.checks.len());
    for check in &req.checks {
        let step = store.gcra(&check.key, check.rate()).await?;
        results.push(RateResult::of(&step));
        if !step.allowed {
            break;
        }
    }
    Ok(RateOutcome { results })
}

impl RateStore for crate::store::memory::MemoryStore {
    async fn gcra(&self, key: &str, rate: Rate) -> StoreResult<GcraStep> {
        Ok(self.rates.step(key, rate, crate::store::now_us()))
    }
}

/// Idle states are swept every this many steps (amortised, no background task).
const SWEEP_EVERY: u64 = 4096;

/// The memory store's limits: each key's TAT, dropped once in the past (then it equals no
/// state), so memory follows the keys active within their windows.
#[derive(Default)]
pub(crate) struct MemoryRates {
    inner: Mutex<(HashMap<String, u64>, u64)>,
}

impl MemoryRates {
    pub(crate) fn step(&self, key: &str, rate: Rate, now_us: u64) -> GcraStep {
        let mut guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let (tats, ops) = &mut *guard;
        *ops += 1;
        if *ops % SWEEP_EVERY == 0 {
            tats.retain(|_, tat| *tat > now_us);
        }
        let tat = tats.get(key).copied().unwrap_or(0);
        let step = idemgate_wire::gcra(tat, now_us, rate);
        if step.allowed {
            tats.insert(key.to_owned(), step.tat_us);
        }
        step
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_rates_forget_idle_keys() {
        let rates = MemoryRates::default();
        let rate = Rate {
            interval_us: 10,
            burst: 1,
        };
        for n in 0..SWEEP_EVERY {
            assert!(rates.step(&n.to_string(), rate, 1_000 + n).allowed);
        }
        assert!(rates.len() < 100, "{}", rates.len());
    }
}
