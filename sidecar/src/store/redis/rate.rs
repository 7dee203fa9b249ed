//! The global rate tier on Redis: one GCRA step per limited key, as one script.

use super::scripts::{GCRA, evalsha};
use super::{Op, RedisStore, keys, unexpected};
use crate::store::{RateStore, StoreResult};
use idemgate_wire::{GcraStep, Rate};

impl RateStore for RedisStore {
    async fn gcra(&self, key: &str, rate: Rate) -> StoreResult<GcraStep> {
        let rate_key = keys::rate_key(&self.prefix, key);
        let mut cmd = evalsha(&GCRA, &[&rate_key]);
        cmd.arg(rate.interval_us).arg(rate.burst);
        let (allowed, tat, remaining, retry_after, reset): (u8, u64, u64, u64, u64) =
            self.run(Op::Script(&GCRA, &cmd)).await?;
        if allowed > 1 {
            return Err(unexpected("GCRA step"));
        }
        Ok(GcraStep {
            allowed: allowed == 1,
            tat_us: tat,
            remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
            retry_after_us: retry_after,
            reset_us: reset,
        })
    }
}
