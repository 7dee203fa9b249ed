//! Every atomic step on Redis, as Lua scripts. Each script's KEYS are the keys of ONE lock
//! (same hash tag, see `keys.rs`), so it runs on one Cluster slot.
//!
//! Why scripts and not MULTI/EXEC: every step *reads then decides* (is the key held, by
//! whom, is someone queued ahead, is the fingerprint the same, has the lease run out) and
//! then writes. MULTI cannot branch on what it read, and WATCH-retry loops would let a
//! thousand concurrent claimers livelock. A script runs with nothing interleaved, so a
//! decision is never made on stale state; that is what makes "exactly one grant" hold.
//!
//! Shared conventions:
//! - Time is Redis's own clock (`TIME`), never the sidecars', so skewed sidecars agree.
//!   (Redis ≥ 5 replicates script effects, which makes `TIME` in a script safe.)
//! - Fence = max(last fence + 1, now in µs): strictly increasing per key; if the fence hash
//!   expired (idle longer than the fence TTL) or was lost in a failover, the clock still
//!   puts the next fence above every earlier one (one script takes well over 1 µs).
//! - The fence hash's `held` flag says a grant is outstanding: a missing lock with
//!   `held == 1` means the lease ran out by itself (reported for the expiry metric).
//! - A queued waiter is its owner token in the queue list plus
//!   `inbox|deadline_ms|lease_ms|fingerprint` in the waiters hash; handing it the key
//!   PUBLISHes its owner token to its process's inbox channel.
//! - Numbers leave Lua through `string.format('%.0f')`: Lua's own number formatting would
//!   print large fences in exponent notation.

use redis::Script;
use std::sync::LazyLock;

/// Helpers prepended to every script that changes a lock.
macro_rules! prelude {
    () => {
        r#"
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function int(n)
  return string.format('%.0f', n)
end

local function parse_waiter(v)
  if not v then return nil end
  local inbox, deadline, lease, fp = string.match(v, '^([^|]*)|(%d+)|(%d+)|(.*)$')
  return inbox, tonumber(deadline), tonumber(lease), fp
end

-- Only ever called while the lock key is absent (free, released or expired). `last` is the
-- fence hash's `fence` field when the caller has already read it (nil: read it here).
local function grant(lock, fence, owner, fp, lease, now, fence_ttl, last)
  if last == nil then last = redis.call('HGET', fence, 'fence') end
  local f = math.max(tonumber(last or '0') + 1, now)
  redis.call('HSET', fence, 'fence', int(f), 'held', '1')
  redis.call('PEXPIRE', fence, fence_ttl)
  redis.call('HSET', lock, 'owner', owner, 'fence', int(f), 'fp', fp, 'since', int(now), 'lease', int(lease))
  redis.call('PEXPIRE', lock, lease)
  return f
end

-- Hands a free key to the first queued waiter whose wait has not ended, and tells its process.
-- `now` may be nil: the clock is read only when somebody is queued.
local function promote(lock, queue, waiters, fence, now, fence_ttl, inbox_prefix)
  while true do
    local owner = redis.call('LPOP', queue)
    if not owner then return end
    now = now or now_us()
    local inbox, deadline, lease, fp = parse_waiter(redis.call('HGET', waiters, owner))
    redis.call('HDEL', waiters, owner)
    if inbox and deadline * 1000 > now then
      grant(lock, fence, owner, fp, lease, now, fence_ttl)
      redis.call('PUBLISH', inbox_prefix .. inbox, owner)
      return
    end
  end
end

-- One call on the usual path: HSET answers 1 only when it created the field, i.e. the fence
-- record had expired (a lease renewed past the fence TTL); do not resurrect it without expiry.
local function mark_free(fence)
  if redis.call('HSET', fence, 'held', '0') == 1 then
    redis.call('DEL', fence)
  end
end

local function release(lock, queue, waiters, fence, now, fence_ttl, inbox_prefix)
  redis.call('DEL', lock)
  mark_free(fence)
  promote(lock, queue, waiters, fence, now, fence_ttl, inbox_prefix)
end
"#
    };
}

/// Claim (and re-check while queued).
///
/// KEYS: lock, queue, waiters, fence, resp.
/// ARGV: owner, fingerprint ('' = none), mode ('idempotency'|'lock'), lease_ms,
///       wait_ms ('0' = do not queue), max_queue, fence_ttl_ms, inbox_prefix, inbox.
/// Returns `{outcome, lease_expired(0|1), ...}`:
///   `completed, status, headers_json, body` | `mismatch` | `granted, fence, lease_ms, since_us`
///   | `busy, ttl_ms, queue_len` | `queue_full, ttl_ms, queue_len`
///   | `queued, position, queue_len, holder_ttl_ms`.
///
/// Atomic because the stored-response check, the holder check, the queue order and the
/// grant must see one state: otherwise two claimers both see "free" and both get a grant.
pub(crate) static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prelude!(),
        r#"
local lock, queue, waiters, fence, resp = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, fp, mode = ARGV[1], ARGV[2], ARGV[3]
local lease, wait_ms, max_queue = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local fence_ttl, inbox_prefix, inbox = tonumber(ARGV[7]), ARGV[8], ARGV[9]

-- Redis's clock, read at most once and only on the paths that need it.
local now
local function clock()
  now = now or now_us()
  return now
end

local holder = redis.call('HMGET', lock, 'owner', 'fence', 'fp', 'since', 'lease')
-- Only a free key can have had its lease run out; its fence record is read once, here, and
-- reused by the grant below.
local expired, last = 0, false
if not holder[1] then
  local record = redis.call('HMGET', fence, 'fence', 'held')
  last = record[1]
  if record[2] == '1' then
    redis.call('HSET', fence, 'held', '0')
    expired = 1
  end
end

local function differs(a, b)
  return a and b and a ~= '' and b ~= '' and a ~= b
end

local function leave_queue()
  redis.call('LREM', queue, 0, owner)
  redis.call('HDEL', waiters, owner)
end

local function busy_or_queue()
  local ttl = math.max(redis.call('PTTL', lock), 0)
  local len = redis.call('LLEN', queue)
  if wait_ms == 0 then return {'busy', expired, ttl, len} end
  local pos = redis.call('LPOS', queue, owner)
  if not pos then
    if len >= max_queue then return {'queue_full', expired, ttl, len} end
    redis.call('RPUSH', queue, owner)
    local deadline = math.floor(clock() / 1000) + wait_ms
    redis.call('HSET', waiters, owner, inbox .. '|' .. int(deadline) .. '|' .. int(lease) .. '|' .. fp)
    -- The queue outlives its longest waiter by a second, then disappears by itself.
    local keep = wait_ms + 1000
    if redis.call('PTTL', queue) < keep then
      redis.call('PEXPIRE', queue, keep)
      redis.call('PEXPIRE', waiters, keep)
    end
    pos = len
    len = len + 1
  end
  return {'queued', expired, pos, len, ttl}
end

if mode == 'idempotency' then
  local stored = redis.call('HMGET', resp, 'status', 'headers', 'body', 'fp')
  if stored[1] then
    leave_queue()
    if differs(stored[4], fp) then return {'mismatch', expired} end
    return {'completed', expired, stored[1], stored[2], stored[3]}
  end
end

if holder[1] then
  if holder[1] == owner then
    return {'granted', expired, holder[2], holder[5], holder[4]}
  end
  if mode == 'idempotency' and differs(holder[3], fp) then
    leave_queue()
    return {'mismatch', expired}
  end
  return busy_or_queue()
end

-- Free. Whoever is first in line goes first (waiters whose wait ended are skipped).
local head = redis.call('LINDEX', queue, 0)
if head and head ~= owner then
  promote(lock, queue, waiters, fence, clock(), fence_ttl, inbox_prefix)
  local h = redis.call('HMGET', lock, 'owner', 'fence', 'since', 'lease')
  if h[1] == owner then return {'granted', expired, h[2], h[4], h[3]} end
  if h[1] then return busy_or_queue() end
end
if head == owner then leave_queue() end
local f = grant(lock, fence, owner, fp, lease, clock(), fence_ttl, last)
return {'granted', expired, int(f), int(lease), int(now)}
"#
    ))
});

/// Leave the queue (wait budget over, caller gone, shutdown).
///
/// KEYS: lock, queue, waiters, fence.
/// ARGV: owner, release_if_granted ('1'|'0'), fence_ttl_ms, inbox_prefix.
/// Returns `{'granted', fence, lease_ms, since_us}` | `{'left', holder_ttl_ms, queue_len}`.
///
/// Atomic because the key may be handed to this waiter at any moment: checking "am I the
/// holder" and removing the entry in two steps could leave a grant nobody will release.
pub(crate) static LEAVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prelude!(),
        r#"
local lock, queue, waiters, fence = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, release_if_granted = ARGV[1], ARGV[2]
local fence_ttl, inbox_prefix = tonumber(ARGV[3]), ARGV[4]
local h = redis.call('HMGET', lock, 'owner', 'fence', 'since', 'lease')
if h[1] == owner then
  if release_if_granted ~= '1' then return {'granted', h[2], h[4], h[3]} end
  release(lock, queue, waiters, fence, nil, fence_ttl, inbox_prefix)
else
  redis.call('LREM', queue, 0, owner)
  redis.call('HDEL', waiters, owner)
  if not h[1] then promote(lock, queue, waiters, fence, nil, fence_ttl, inbox_prefix) end
end
return {'left', math.max(redis.call('PTTL', lock), 0), redis.call('LLEN', queue)}
"#
    ))
});

/// Complete: owner-checked store-and-release.
///
/// KEYS: lock, queue, waiters, fence, resp.
/// ARGV: owner, retention_ms, store ('1'|'0'), status, headers_json, body, fence_ttl_ms,
///       inbox_prefix.
/// Returns 'released' | 'stale'.
///
/// Atomic because the owner check, the stored response and the release must be one step:
/// a holder whose lease just ran out must not overwrite the next holder's state, and no
/// claim may see "free" before the response it should replay is stored.
pub(crate) static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prelude!(),
        r#"
local lock, queue, waiters, fence, resp = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local fence_ttl, inbox_prefix = tonumber(ARGV[7]), ARGV[8]
local h = redis.call('HMGET', lock, 'owner', 'fp')
if h[1] ~= ARGV[1] then return 'stale' end
if ARGV[3] == '1' then
  redis.call('DEL', lock)
  mark_free(fence)
  -- Every field is written, so an older stored response leaves nothing behind.
  redis.call('HSET', resp, 'status', ARGV[4], 'headers', ARGV[5], 'body', ARGV[6], 'fp', h[2] or '')
  redis.call('PEXPIRE', resp, ARGV[2])
  -- Every queued waiter now gets the stored response: tell each one's process.
  for _, o in ipairs(redis.call('LRANGE', queue, 0, -1)) do
    local inbox = parse_waiter(redis.call('HGET', waiters, o))
    if inbox then redis.call('PUBLISH', inbox_prefix .. inbox, o) end
  end
else
  release(lock, queue, waiters, fence, nil, fence_ttl, inbox_prefix)
end
return 'released'
"#
    ))
});

/// Abort: owner-checked release without storing; hands the key to the next waiter.
///
/// KEYS: lock, queue, waiters, fence. ARGV: owner, fence_ttl_ms, inbox_prefix.
/// Returns 'released' | 'stale'.
///
/// Atomic for the same reason as complete: check-then-delete in two steps could delete the
/// next holder's lock.
pub(crate) static ABORT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prelude!(),
        r#"
local lock, queue, waiters, fence = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if redis.call('HGET', lock, 'owner') ~= ARGV[1] then return 'stale' end
release(lock, queue, waiters, fence, nil, tonumber(ARGV[2]), ARGV[3])
return 'released'
"#
    ))
});

/// Renew: owner-checked lease extension (the sidecar caps `lease_ms` before calling).
///
/// KEYS: lock. ARGV: owner, lease_ms. Returns 1 (renewed) | 0 (stale).
///
/// Atomic because extending someone else's lease (the next holder's, after ours ran out)
/// would keep a key locked for a caller that no longer owns it.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"#,
    )
});

/// Force release by an operator: releases whoever holds the key, hands it on.
///
/// KEYS: lock, queue, waiters, fence. ARGV: fence_ttl_ms, inbox_prefix.
/// Returns the released holder's fence (as a string) or false when the key was free.
///
/// Atomic so the fence reported (and audited) is the one actually released.
pub(crate) static FORCE_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prelude!(),
        r#"
local lock, queue, waiters, fence = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local f = redis.call('HGET', lock, 'fence')
if not f then return false end
release(lock, queue, waiters, fence, nil, tonumber(ARGV[1]), ARGV[2])
return f
"#
    ))
});

/// Inspect: a consistent snapshot of one key for operators (reads only).
///
/// KEYS: lock, queue, fence, resp.
/// Returns `{held(0|1), holder_fence, since_us, lock_ttl_ms, queue_len, last_fence,
///           resp_status|false, resp_ttl_ms, now_us}`.
///
/// A script so that the holder, queue and response are read at one instant.
pub(crate) static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local h = redis.call('HMGET', KEYS[1], 'fence', 'since')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
return {
  h[1] and 1 or 0, h[1] or '0', h[2] or '0', math.max(redis.call('PTTL', KEYS[1]), 0),
  redis.call('LLEN', KEYS[2]), redis.call('HGET', KEYS[3], 'fence') or '0',
  redis.call('HGET', KEYS[4], 'status'), math.max(redis.call('PTTL', KEYS[4]), 0),
  string.format('%.0f', now)
}
"#,
    )
});
