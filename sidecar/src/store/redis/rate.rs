//! The global rate tier on Redis: one GCRA step per limited key, as one script.

use super::{Op, RedisStore, evalsha, keys, unexpected};
use crate::rate::RateStore;
use crate::store::StoreResult;
use idemgate_wire::{GcraStep, Rate};
use redis::Script;
use std::sync::LazyLock;

/// One GCRA step (`idemgate_wire::gcra` in Lua) on Redis's clock.
///
/// KEYS: the limit's state (the TAT in µs, as a string). ARGV: interval_us, burst.
/// Returns {allowed (1|0), tat_us, remaining, retry_after_us, reset_us}.
///
/// Atomic so concurrent checks from every gateway spend distinct units: a read-then-write
/// from the sidecar would let two requests both take the last one. The state expires by
/// itself once its TAT is past (PEXPIRE), when it would read as a fresh burst anyway.
/// Lua numbers are doubles: µs since the epoch (~2^51) and day-long windows stay exact.
static GCRA: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local window = interval * tonumber(ARGV[2])
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), now)
local next = tat + interval
local allow_at = next - window
if now < allow_at then
  return {0, string.format('%.0f', tat), 0, string.format('%.0f', allow_at - now), string.format('%.0f', tat - now)}
end
redis.call('SET', KEYS[1], string.format('%.0f', next), 'PX', math.ceil((next - now) / 1000) + 1)
local remaining = math.floor((now + window - next) / interval)
return {1, string.format('%.0f', next), remaining, 0, string.format('%.0f', next - now)}
"#,
    )
});

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
