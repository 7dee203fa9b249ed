//! The global tier of rate protection (`POST /v1/rate`): GCRA limits that hold across every
//! gateway, because every gateway asks the same store.
//!
//! Each check is one atomic step in the store — in Redis one Lua script on one key whose hash
//! tag is the limited key, so a Cluster spreads limits over slots and no script crosses one.
//! A request's checks (per caller, per resource, ...) run in order and stop at the first one
//! over its limit: the checks before it have counted the request, which errs towards
//! limiting, never towards letting more through.
//!
//! The arithmetic is `idemgate_wire::gcra`, shared with the filter's local tier; each store
//! takes one step of it atomically ([`RateStore`]): the memory store under its lock, the
//! Redis store as the same steps in Lua on Redis's own clock (`TIME`), so skewed sidecars agree.

use crate::store::{RateStore, StoreResult};
use idemgate_wire::{RateOutcome, RateRequest, RateResult};

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
