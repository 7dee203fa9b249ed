//! Every atomic step on Redis, as Lua scripts: the lock steps, the rate limits' GCRA step
//! and the operators' inspection. Each script's KEYS are the keys of ONE lock or ONE limit
//! (same hash tag, see `keys.rs`), so it runs on one Cluster slot.
//!
//! Why scripts and not MULTI/EXEC: every step *reads then decides* (is the key held, by
//! whom, is someone queued ahead, is the fingerprint the same, has the lease run out) and
//! then writes. MULTI cannot branch on what it read, and WATCH-retry loops would let a
//! thousand concurrent claimers livelock. A script runs with nothing interleaved, so a
//! decision is never made on stale state; that is what makes "exactly one grant" hold.
//!
//! Layout: one string per lock, the *record*, is all the common path touches: its fields
//! packed with `cmsgpack` (which Redis's Lua has built in), so a step reads the record whole
//! with one `GET` and writes it back whole, expiry included, with one `SET` — however many
//! fields it changes (as a hash it took `HMGET`, `HSET`/`HDEL` and `PEXPIRE`). A claim of a
//! key with no record (a fresh key, the common case) is one `SET NX GET PX`: it writes the
//! grant and, when a record existed after all, writes nothing and hands back the record
//! instead. The sidecar sends that `SET` itself, without a script, while its reading of
//! Redis's clock is young (`clock.rs`, `record.rs`); `CLAIM` starts with the same write, for
//! a claim without such a reading and for one whose `SET` found a record. Its complete, on
//! the sidecar that answered it, is a compare-and-set (`COMPLETE_FRESH`): the record `GET`
//! and, if it is still that grant byte for byte, the released record `SET`, packed by the
//! sidecar (`record.rs`); on a server with `SET … IFEQ` that is one command, no script
//! (`compare_set.rs`). A record that changed meanwhile takes `COMPLETE`, which writes
//! the released record with `SET XX GET` and checks the one it replaced after. The fields,
//! in their packed order (`false` = absent):
//! - `fence`: the last fence issued for the key (kept while the key is free);
//! - while held: `owner`, `fp` (fingerprint, '' = none), `since` (grant, µs), `at` (start of
//!   the current lease: the grant or the last renewal, µs), `lease` (its length, ms) — the
//!   lease ends at `at + lease`;
//! - `pick`: for a key handed to a queued waiter, the time (ms) by which that waiter must
//!   have picked the grant up (its claim step sets it to '0'); past it, claims by others
//!   treat the grant as expired — the waiter's process died between queueing and the
//!   hand-off. '0' (or absent) for every other grant;
//! - `q` = '1' while the queue may hold waiters: without it the queue and waiters keys are
//!   known to be empty and are not touched;
//! - a stored response (idempotency): `status`, `headers` (JSON), `body`, `rfp` (the
//!   fingerprint it answers), `kept` (end of the retention, µs).
//!
//! Shared conventions:
//! - Time is Redis's own clock (`TIME`), never the sidecars', so skewed sidecars agree. The
//!   readings a sidecar carries (`clock.rs`) are Redis's clock as a claim script read it plus
//!   the time since, never behind it: the complete's (`held.rs`), only trusted to say a lease
//!   is not over, and a fresh key's grant time and fence, written by the sidecar's own `SET`
//!   (`clock.rs` says why that stays safe); every other grant, fence and hand-off reads
//!   `TIME`.
//!   (Redis ≥ 5 replicates script effects, which makes `TIME` in a script safe; `SET` with
//!   both `NX` and `GET` needs Redis ≥ 7.0.)
//! - A lease is valid while `at + lease` > now: its end is decided by comparing with the clock,
//!   not by a key expiring, so a lease that ran out is still seen (and counted once, by the
//!   claim that finds it) and the record's fence survives it.
//! - The record's own expiry only bounds how long an idle record lives: set at every grant
//!   and renewal to the fence TTL (at least the lease plus a second), to the retention when
//!   a response is stored, and never below the queue's while waiters may be queued (so a
//!   record cannot vanish under its queue and let a claim skip the line).
//! - Fence = max(last fence + 1, now in µs): strictly increasing per key; if the record
//!   expired or was lost in a failover, the clock still puts the next fence above every
//!   earlier one (one script takes well over 1 µs).
//! - A queued waiter is its owner token in the queue list plus
//!   `inbox|deadline_ms|lease_ms|alive_ms|window_ms|fingerprint` in the waiters hash; handing
//!   it the key PUBLISHes its owner token to its process's inbox channel. `alive_ms` is when
//!   the waiter stops counting as waited for unless its claim steps again (each step renews
//!   it by `window_ms`): a process that died leaves places nobody waits for, and a key is
//!   never handed to one of those.
//! - A waiter its caller named also has `w:<name>` → owner and `n:<owner>` → name in the
//!   waiters hash (owner tokens are hex, so the fields never collide); a named place given up
//!   leaves `owner` → `left` behind until its waiting claim sees it.
//! - Numbers are kept as strings: Lua's own number formatting would print µs timestamps in
//!   exponent notation, and `string.format('%.0f')` costs about as much as a Redis call, so
//!   the common path stores strings it already has (the clock's, the caller's) and only
//!   formats when it computes a new value (a fence above the clock, a retention end).

use redis::{Cmd, Script};
use std::sync::LazyLock;

/// Redis's clock: µs as a number, and the same as a string.
macro_rules! clock {
    () => {
        r#"
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]), t[1] .. string.sub('00000' .. t[2], -6)
end
"#
    };
}

/// The record's codec and clock, shared by every script that reads it (see the module doc
/// for the fields). `decode` of a missing record (`false`) is a record with every field
/// absent.
macro_rules! record_codec {
    () => {
        concat!(clock!(), codec!())
    };
}

/// The record's codec without the clock (`record_codec`).
macro_rules! codec {
    () => {
        r#"
local function decode(v)
  local t = v and cmsgpack.unpack(v) or {}
  return {fence = t[1] or false, owner = t[2] or false, fp = t[3] or false,
    since = t[4] or false, at = t[5] or false, lease = t[6] or false, pick = t[7] or false,
    q = t[8] or false, status = t[9] or false, headers = t[10] or false, body = t[11] or false,
    rfp = t[12] or false, kept = t[13] or false}
end

-- Trailing absent fields are left out (`decode` reads them as absent): a released lock
-- keeps its fence in a few bytes.
local function encode(r)
  local t = {r.fence or false, r.owner or false, r.fp or false, r.since or false,
    r.at or false, r.lease or false, r.pick or false, r.q or false, r.status or false,
    r.headers or false, r.body or false, r.rfp or false, r.kept or false}
  local n = 13
  while n > 0 and not t[n] do
    t[n] = nil
    n = n - 1
  end
  return cmsgpack.pack(t)
end

-- When the lease that started at `at` (µs) and lasts `lease` (ms) ends.
local function lease_end(at, lease)
  return tonumber(at) + tonumber(lease) * 1000
end

-- How long (ms, an integer reply) the holding granted at `since` (µs) has lasted by `now`.
local function held_ms(since, now)
  local t = tonumber(since)
  if not t or t > now then return 0 end
  return math.floor((now - t) / 1000)
end

local function int(n)
  return string.format('%.0f', n)
end

-- Takes the holder's fields out of record `r`.
local function drop_holder(r)
  r.owner, r.fp, r.since, r.at, r.lease, r.pick = false, false, false, false, false, false
end
"#
    };
}

/// The record codec alone, for tools that read records from outside the sidecar (the
/// `testing` helpers).
#[cfg(feature = "testing")]
pub(crate) const RECORD_CODEC: &str = record_codec!();

/// The helpers of every step that changes a lock beyond its record alone (queue, hand-off,
/// expiry with the queue). `queue` and `waiters` are the lock's list and hash keys; the
/// record is loaded once (`load`, or `adopt` when already decoded), changed as a table, and
/// written back once (`flush`); `now` is Redis's clock in µs and `now_s` the same as a
/// string; `grant_ttl` (ms) is how long a record lives after a grant: the fence TTL, and at
/// least the lease plus a second (computed by the sidecar).
///
/// Lua creates a closure for each `local function` as the chunk runs it, on every call: the
/// claim, complete and abort scripts run their common case (no record yet, nobody queued)
/// before these definitions, on the codec alone (the claim's fresh grant on the clock alone).
macro_rules! helpers {
    () => {
        r#"
-- The record being stepped on: changed in place, written back once by `flush` with the
-- expiry last set (`rec_ttl`, ms; nil: keep the current one).
local rec_key, rec, rec_exists, rec_dirty, rec_ttl

local function load(state, v)
  rec_key, rec, rec_exists, rec_dirty, rec_ttl = state, decode(v), v and true, false, nil
end

-- Steps on record `r` of `state`, already read and decoded (it exists).
local function adopt(state, r)
  rec_key, rec, rec_exists, rec_dirty, rec_ttl = state, r, true, false, nil
end

local function touch()
  rec_dirty = true
end

local function set_ttl(ttl)
  rec_ttl, rec_dirty = ttl, true
end

-- The record's expiry from now (ms), as last set in this step.
local function record_pttl()
  return rec_ttl or redis.call('PTTL', rec_key)
end

-- Writes the record back if the step changed it. A record that did not exist is only
-- written with an expiry: without one the step merely cleared fields of nothing.
local function flush()
  if not rec_dirty then return end
  if rec_ttl then
    redis.call('SET', rec_key, encode(rec), 'PX', rec_ttl)
  elseif rec_exists then
    redis.call('SET', rec_key, encode(rec), 'KEEPTTL')
  end
end

-- `inbox, deadline, lease, fingerprint, alive, window` of a waiter record (nil: none).
local function parse_waiter(v)
  if not v then return nil end
  local inbox, deadline, lease, alive, window, fp =
    string.match(v, '^([^|]*)|(%d+)|(%d+)|(%d+)|(%d+)|(.*)$')
  return inbox, tonumber(deadline), tonumber(lease), fp, tonumber(alive), tonumber(window)
end

local function clear_holder()
  drop_holder(rec)
  touch()
end

local function clear_queue_mark()
  if rec.q then
    rec.q = false
    touch()
  end
end

-- Drops the name of `owner`'s place, if it has one (and the name still points to it).
local function forget_name(waiters, owner)
  local name = redis.call('HGET', waiters, 'n:' .. owner)
  if not name then return end
  redis.call('HDEL', waiters, 'n:' .. owner)
  if redis.call('HGET', waiters, 'w:' .. name) == owner then
    redis.call('HDEL', waiters, 'w:' .. name)
  end
end

-- The record lives `ttl` ms from now, and never less than the queue while one may exist.
local function expire(queue, queued, ttl)
  if queued then ttl = math.max(ttl, redis.call('PTTL', queue)) end
  set_ttl(ttl)
end

-- Grants a free key (no valid holder) for `lease` ms (a string); returns the fence (a
-- string). `last` is the record's fence (false: none); `kept` the end of a stored
-- response's retention (false: none), which the record's expiry must not cut short;
-- `pick` the hand-off's pick-up deadline in ms ('0': none, the claimant has it now).
local function grant(queue, queued, owner, fp, lease, now, now_s, last, kept, grant_ttl, pick)
  local f = now_s
  if last and tonumber(last) >= now then f = int(tonumber(last) + 1) end
  rec.fence, rec.owner, rec.fp, rec.since, rec.at, rec.lease, rec.pick =
    f, owner, fp, now_s, now_s, lease, pick
  local ttl = grant_ttl
  if kept then ttl = math.max(ttl, math.ceil((tonumber(kept) - now) / 1000)) end
  expire(queue, queued, ttl)
  return f
end

-- Takes `owner` out of the queue; the record's queue mark goes once the queue is empty.
local function dequeue(queue, waiters, owner)
  redis.call('LREM', queue, 0, owner)
  redis.call('HDEL', waiters, owner)
  forget_name(waiters, owner)
  if redis.call('LLEN', queue) == 0 then clear_queue_mark() end
end

-- Hands a free key to the first queued waiter whose wait has not ended and that is still
-- waited for (its claim stepped within its window), and tells its process. Only called
-- while the record's queue mark is set. Returns the new holder's owner, fence and lease
-- (nil when nobody is left waiting: then the mark goes). Its grant TTL: the fence TTL, at
-- least its lease plus a second; it must be picked up within the waiter's window.
local function promote(queue, waiters, last, kept, now, now_s, record_ttl, inbox_prefix)
  while true do
    local owner = redis.call('LPOP', queue)
    if not owner then
      clear_queue_mark()
      return nil
    end
    local inbox, deadline, lease, fp, alive, window =
      parse_waiter(redis.call('HGET', waiters, owner))
    redis.call('HDEL', waiters, owner)
    forget_name(waiters, owner)
    if inbox and deadline * 1000 > now and alive * 1000 > now then
      local ttl = math.max(record_ttl, lease + 1000)
      local pick = int(math.floor(now / 1000) + window)
      local f = grant(queue, true, owner, fp, int(lease), now, now_s, last, kept, ttl, pick)
      redis.call('PUBLISH', inbox_prefix .. inbox, owner)
      return owner, f, lease
    end
  end
end

-- Ends the current holding: to the next waiter if there is one, else the key is free.
local function release(queue, waiters, queued, last, kept, now, now_s, record_ttl,
    inbox_prefix)
  if queued and promote(queue, waiters, last, kept, now, now_s, record_ttl, inbox_prefix)
  then
    return
  end
  clear_holder()
end
"#
    };
}

/// Codec and helpers: what every script that changes a lock starts with.
macro_rules! prelude {
    () => {
        concat!(record_codec!(), helpers!())
    };
}
/// Claim (and re-check while queued).
///
/// KEYS: record, queue, waiters.
/// ARGV: owner, fingerprint ('' = none), mode ('idempotency'|'lock'), lease_ms,
///       wait_ms ('0' = do not queue), max_queue, record_ttl_ms, grant_ttl_ms, inbox_prefix,
///       inbox, waiter name ('' = none), alive window_ms.
/// Returns one string of `\n`-separated fields (`reply::Fields`: redis-rs parses an array
/// reply element by element, on every claim), `outcome, lease_expired(0|1), ...`:
///   `completed, status, headers_json, body` | `mismatch`
///   | `granted, fence, lease_ms, since_us[, now_us]` (`now_us`, the clock of this step, only
///     where it is not the grant's own time: a hand-off picked up now)
///   | `busy, ttl_ms, queue_len, age_ms, holder_lease_ms`
///   | `queue_full, ttl_ms, queue_len, age_ms, holder_lease_ms`
///   | `queued, position, queue_len, holder_ttl_ms` | `left`.
///
/// Atomic because the stored-response check, the holder check, the queue order and the
/// grant must see one state: otherwise two claimers both see "free" and both get a grant.
pub(crate) static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    // The fresh key's grant runs before the codec's functions are defined: Lua creates a
    // closure for each as the chunk runs past it, on every call.
    Script::new(concat!(
        clock!(),
        r#"
local state, queue, waiters = KEYS[1], KEYS[2], KEYS[3]
local owner, fp, mode, lease = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local wait_ms, name, grant_ttl = tonumber(ARGV[5]), ARGV[11], ARGV[8]

local now, now_s = clock()
-- No record: the key is free, nobody is queued, no fence or response is kept — granted by
-- this one call (fence and grant at the clock, no pick-up deadline). A record that does
-- exist is left as it is and read instead.
local v = redis.call('SET', state, cmsgpack.pack({now_s, owner, fp, now_s, now_s, lease, '0'}),
  'NX', 'GET', 'PX', grant_ttl)
if not v then return 'granted\n0\n' .. now_s .. '\n' .. lease .. '\n' .. now_s end
-- A named place given up while this claim waited: the claim ends here. Asked only once a
-- record exists: a place is given up only in a queue, behind a holder, so a key with no
-- record has none (were its record gone meanwhile, the grant above goes to a request that
-- left, whose filter gives an abandoned request's grant straight back).
local left = name ~= '' and wait_ms > 0 and redis.call('HGET', waiters, owner) == 'left'
"#,
        codec!(),
        helpers!(),
        r#"
local max_queue, record_ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local inbox_prefix, inbox, window = ARGV[9], ARGV[10], tonumber(ARGV[12])
grant_ttl = tonumber(grant_ttl)
load(state, v)

local holder, last, queued, kept, pick = rec.owner, rec.fence, rec.q == '1', rec.kept, rec.pick
local holder_end = holder and lease_end(rec.at, rec.lease)
-- A lease that ran out leaves its holder in the record: the key is free, and this claim is
-- the one that notices (and reports) it. Every path below that does not grant clears it.
-- So does a hand-off its waiter did not pick up in time (its process died meanwhile),
-- for everyone but that waiter.
local expired = 0
if holder and (holder_end <= now or (holder ~= owner and pick and pick ~= '0'
    and tonumber(pick) * 1000 <= now)) then
  holder = false
  expired = 1
end
local function clear_expired()
  if expired == 1 then clear_holder() end
end

local function differs(a, b)
  return a and b and a ~= '' and b ~= '' and a ~= b
end

local function leave_queue()
  if queued then dequeue(queue, waiters, owner) end
end

-- `ttl`: the holder's lease left (ms); `age`, `held_lease`: how long it has held the key
-- and under which lease (ms), for the wait hint of a busy or queue-full answer.
local function busy_or_queue(ttl, age, held_lease)
  local len = 0
  if queued then len = redis.call('LLEN', queue) end
  if wait_ms == 0 then return {'busy', expired, ttl, len, age, held_lease} end
  local pos = false
  if queued then pos = redis.call('LPOS', queue, owner) end
  local alive = int(math.floor(now / 1000) + window)
  if pos then
    -- Still waited for: renew the place's window.
    local head, tail = string.match(redis.call('HGET', waiters, owner) or '',
      '^([^|]*|%d+|%d+|)%d+(|.*)$')
    if head then redis.call('HSET', waiters, owner, head .. alive .. tail) end
  else
    if len >= max_queue then return {'queue_full', expired, ttl, len, age, held_lease} end
    redis.call('RPUSH', queue, owner)
    local deadline = math.floor(now / 1000) + wait_ms
    redis.call('HSET', waiters, owner, inbox .. '|' .. int(deadline) .. '|' .. lease .. '|'
      .. alive .. '|' .. int(window) .. '|' .. fp)
    if name ~= '' then
      redis.call('HSET', waiters, 'w:' .. name, owner, 'n:' .. owner, name)
    end
    -- The queue outlives its longest waiter by a second, then disappears by itself; the
    -- record outlives the queue.
    local keep = wait_ms + 1000
    if redis.call('PTTL', queue) < keep then
      redis.call('PEXPIRE', queue, keep)
      redis.call('PEXPIRE', waiters, keep)
      if record_pttl() < keep then set_ttl(keep) end
    end
    if not queued then
      rec.q = '1'
      touch()
    end
    pos = len
    len = len + 1
  end
  return {'queued', expired, pos, len, ttl}
end

local function step()
  if left then
    redis.call('HDEL', waiters, owner)
    clear_expired()
    return {'left', expired}
  end

  if mode == 'idempotency' and rec.status then
    if tonumber(kept) > now then
      leave_queue()
      clear_expired()
      if differs(rec.rfp, fp) then return {'mismatch', expired} end
      return {'completed', expired, rec.status, rec.headers, rec.body}
    end
    -- The retention is over (the record outlived it for its queue or a later grant).
    rec.status, rec.headers, rec.body, rec.rfp, rec.kept = false, false, false, false, false
    touch()
    kept = false
  end

  if holder then
    if holder == owner then
      if pick and pick ~= '0' then
        rec.pick = '0'
        touch()
      end
      return {'granted', expired, last, rec.lease, rec.since, now_s}
    end
    if mode == 'idempotency' and differs(rec.fp, fp) then
      leave_queue()
      return {'mismatch', expired}
    end
    return busy_or_queue(math.ceil((holder_end - now) / 1000), held_ms(rec.since, now), rec.lease)
  end

  -- Free. Whoever is first in line goes first (waiters whose wait ended are skipped).
  if queued then
    local head = redis.call('LINDEX', queue, 0)
    if head and head ~= owner then
      local o, f, l = promote(queue, waiters, last, kept, now, now_s, record_ttl, inbox_prefix)
      if o == owner then return {'granted', expired, f, l, now_s} end
      if o then return busy_or_queue(l, 0, l) end
      queued = false
    elseif head == owner then
      dequeue(queue, waiters, owner)
    end
  end
  local f = grant(queue, queued, owner, fp, lease, now, now_s, last, kept, grant_ttl, '0')
  return {'granted', expired, f, lease, now_s}
end

-- The reply packed into one string (`reply::Fields`); a fence may be above 1e14, past
-- what Lua's own spelling of a number keeps exact.
local function packed(t)
  for i = 1, #t do
    if type(t[i]) == 'number' then t[i] = int(t[i]) end
  end
  return table.concat(t, '\n')
end

local reply = packed(step())
flush()
return reply
"#
    ))
});

/// Leave the queue (wait budget over, caller gone, shutdown).
///
/// KEYS: record, queue, waiters.
/// ARGV: owner, release_if_granted ('1'|'0'), record_ttl_ms, inbox_prefix.
/// Returns `{'granted', fence, lease_ms, since_us}` | `{'left', holder_ttl_ms, queue_len}`.
///
/// Atomic because the key may be handed to this waiter at any moment: checking "am I the
/// holder" and removing the entry in two steps could leave a grant nobody will release.
pub(crate) static LEAVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prelude!(),
        r#"
local state, queue, waiters = KEYS[1], KEYS[2], KEYS[3]
local owner, release_if_granted = ARGV[1], ARGV[2]
local record_ttl, inbox_prefix = tonumber(ARGV[3]), ARGV[4]
load(state, redis.call('GET', state))
local now, now_s = clock()
local last, kept, queued = rec.fence, rec.kept, rec.q == '1'
local held = rec.owner and lease_end(rec.at, rec.lease) > now
local ttl = 0
if held then ttl = math.ceil((lease_end(rec.at, rec.lease) - now) / 1000) end
if held and rec.owner == owner then
  if release_if_granted ~= '1' then return {'granted', rec.fence, rec.lease, rec.since} end
  release(queue, waiters, queued, last, kept, now, now_s, record_ttl, inbox_prefix)
  ttl = 0
else
  -- Whatever the mark says: a waiter leaving is worth one LREM to be sure.
  dequeue(queue, waiters, owner)
  if not held and queued then
    local o, _, l = promote(queue, waiters, last, kept, now, now_s, record_ttl, inbox_prefix)
    if o then ttl = l end
  end
end
flush()
return {'left', ttl, redis.call('LLEN', queue)}
"#
    ))
});

/// Leave by name: the caller gave up the place it named in its claim.
///
/// KEYS: record, queue, waiters. ARGV: waiter name, record_ttl_ms, inbox_prefix.
/// Returns 'released' (the place was removed) | 'stale' (no such place: never queued,
/// answered, or already handed the key — that grant stands).
///
/// Atomic for the same reason as leave: a hand-off between "is it queued" and the removal
/// would leave a grant nobody is told about.
pub(crate) static LEAVE_NAMED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prelude!(),
        r#"
local state, queue, waiters = KEYS[1], KEYS[2], KEYS[3]
local name, record_ttl, inbox_prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local owner = redis.call('HGET', waiters, 'w:' .. name)
if not owner then return 'stale' end
local now, now_s = clock()
local inbox, deadline = parse_waiter(redis.call('HGET', waiters, owner))
load(state, redis.call('GET', state))
dequeue(queue, waiters, owner)
-- Its claim may still be waiting (on any sidecar): it must end, not queue again. The mark
-- lives as long as that wait could (the hash may have just emptied and lost its expiry).
redis.call('HSET', waiters, owner, 'left')
local keep = 1000
if deadline then keep = math.max(keep, deadline - math.floor(now / 1000) + 1000) end
if redis.call('PTTL', waiters) < keep then redis.call('PEXPIRE', waiters, keep) end
if inbox then redis.call('PUBLISH', inbox_prefix .. inbox, owner) end
if rec.q == '1' and not (rec.owner and lease_end(rec.at, rec.lease) > now) then
  promote(queue, waiters, rec.fence, rec.kept, now, now_s, record_ttl, inbox_prefix)
end
flush()
return 'released'
"#
    ))
});

/// The complete or abort of a grant this sidecar wrote with its own `SET` (`record.rs`),
/// while its lease is not over by the sidecar's reading: a compare-and-set of the record.
///
/// KEYS: record.
/// ARGV: the grant's record as the sidecar wrote it, the released record (`record::released`:
///       the fence, and the stored response), its expiry in ms ('' keeps the record's).
/// Returns 1 when the record was that grant, byte for byte, and is now the released one; 0
/// when it was anything else, and nothing was written: the sidecar then sends `COMPLETE`.
///
/// Why a script of its own: an equal record is this owner's, with this fence and
/// fingerprint, nobody queued and no response, and its lease was checked by the sidecar, so
/// there is nothing to decide but the equality. Redis's price for a script is mostly its
/// arguments (about 1,300 instructions each) and the functions it defines on every call:
/// `COMPLETE` takes fifteen and defines the codec and the queue helpers; this takes four and
/// defines nothing. The price of the split is one more round trip for a complete whose
/// record changed (waiters queued behind it, a lease that ran out).
pub(crate) static COMPLETE_FRESH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
"#,
    )
});

/// Complete and abort: owner-checked store-and-release (abort stores nothing).
///
/// KEYS: record, queue, waiters.
/// ARGV: owner, retention_ms, store ('1'|'0'), status, headers_json, body, record_ttl_ms,
///       inbox_prefix, fence, fingerprint, now_us — the last three from the grant this
///       sidecar answered (`held.rs`), or '' when it did not answer it.
/// Returns `released, held_ms, lease_ms` as one string of `\n`-separated fields, as the claim
/// does (how long the holding lasted, the lease it ran under: what the wait hints learn
/// from) | 'stale'. A grant the sidecar wrote itself whose record is unchanged never gets
/// here: `COMPLETE_FRESH` released it.
///
/// Atomic because the owner check, the stored response and the release must be one step:
/// a holder whose lease just ran out must not overwrite the next holder's state, and no
/// claim may see "free" before the response it should replay is stored.
///
/// With the grant known, the record is written *before* it is read: `SET XX GET` writes what
/// the release writes when nobody waits (the fence, and the response with its retention as
/// the expiry) and hands back the record it replaced, which is then checked — one call in
/// place of `GET`, `TIME` and `SET`. The clock is the sidecar's reading of Redis's
/// (`held.rs`: the grant's time plus what has passed since the claim was sent, never behind
/// Redis's own). Anything else — another owner, a lease that seems over, waiters queued, a
/// grant other than the one assumed — re-reads Redis's clock and either puts the record back
/// as it was (`stale`) or writes the release again from the record it read.
pub(crate) static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        record_codec!(),
        r#"
local state, queue, waiters = KEYS[1], KEYS[2], KEYS[3]
local owner, storing, fence = ARGV[1], ARGV[3] == '1', ARGV[9]
local r, now, now_s
if fence ~= '' then
  local fp, retention = ARGV[10], ARGV[2]
  now = tonumber(ARGV[11])
  local v
  if storing then
    v = redis.call('SET', state, encode({fence = fence, status = ARGV[4], headers = ARGV[5],
      body = ARGV[6], rfp = fp, kept = int(now + tonumber(retention) * 1000)}),
      'XX', 'GET', 'PX', retention)
  else
    v = redis.call('SET', state, encode({fence = fence}), 'XX', 'GET', 'KEEPTTL')
  end
  -- No record (`XX` wrote nothing): no holder.
  if not v then return 'stale' end
  r = decode(v)
  if r.owner == owner and lease_end(r.at, r.lease) > now and r.fence == fence
      and r.fp == fp and r.q ~= '1' and (storing or not r.status) then
    return 'released\n' .. held_ms(r.since, now) .. '\n' .. r.lease
  end
  now, now_s = clock()
  if r.owner ~= owner or lease_end(r.at, r.lease) <= now then
    -- Put back what the write replaced. Without a stored response its expiry was kept
    -- (`KEEPTTL`); with one it was replaced, and the record gets at least the expiry it had:
    -- what its holder's grant or renewal gave it, its stored response's retention, its
    -- queue's, or the fence TTL for a record that only keeps a fence.
    if not storing then
      redis.call('SET', state, v, 'KEEPTTL')
      return 'stale'
    end
    local record_ttl = tonumber(ARGV[7])
    local until_us = 0
    if r.owner then
      until_us = lease_end(r.at, math.max(record_ttl, tonumber(r.lease) + 1000))
    end
    if r.kept then until_us = math.max(until_us, tonumber(r.kept)) end
    if until_us == 0 then until_us = now + record_ttl * 1000 end
    if r.q == '1' then
      until_us = math.max(until_us, now + redis.call('PTTL', queue) * 1000)
    end
    redis.call('SET', state, v, 'PX', math.max(1, math.ceil((until_us - now) / 1000)))
    return 'stale'
  end
  -- Still this owner's, but the write assumed another record: written again below.
else
  r = decode(redis.call('GET', state))
  now, now_s = clock()
  if r.owner ~= owner or lease_end(r.at, r.lease) <= now then return 'stale' end
end
local queued = r.q == '1'
local reply = 'released\n' .. held_ms(r.since, now) .. '\n' .. r.lease
if storing then
  -- Every response field is written, so an older stored response leaves nothing behind.
  r.status, r.headers, r.body, r.rfp, r.kept =
    ARGV[4], ARGV[5], ARGV[6], r.fp or '', int(now + tonumber(ARGV[2]) * 1000)
end
if not queued then
  -- Nobody waits (the common case): the holding ends in one write of the record, which
  -- then lives the retention with a stored response (the retention bounds how long the
  -- body is kept, and the fence with it: later fences rest on the clock), or keeps its
  -- expiry.
  drop_holder(r)
  if storing then
    redis.call('SET', state, encode(r), 'PX', ARGV[2])
  else
    redis.call('SET', state, encode(r), 'KEEPTTL')
  end
  return reply
end
"#,
        helpers!(),
        r#"
local record_ttl, inbox_prefix = tonumber(ARGV[7]), ARGV[8]
adopt(state, r)
if storing then
  clear_holder()
  expire(queue, true, tonumber(ARGV[2]))
  -- Every queued waiter now gets the stored response: tell each one's process.
  for _, o in ipairs(redis.call('LRANGE', queue, 0, -1)) do
    local inbox = parse_waiter(redis.call('HGET', waiters, o))
    if inbox then redis.call('PUBLISH', inbox_prefix .. inbox, o) end
  end
else
  release(queue, waiters, true, rec.fence, rec.kept, now, now_s, record_ttl, inbox_prefix)
end
flush()
return reply
"#
    ))
});

/// Renew: owner-checked lease extension (the sidecar caps `lease_ms` before calling).
///
/// KEYS: record, queue. ARGV: owner, lease_ms, record_ttl_ms. Returns 1 (renewed) | 0 (stale).
///
/// Atomic because extending someone else's lease (the next holder's, after ours ran out)
/// would keep a key locked for a caller that no longer owns it.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prelude!(),
        r#"
local state, queue = KEYS[1], KEYS[2]
local lease, record_ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
load(state, redis.call('GET', state))
local now, now_s = clock()
if rec.owner ~= ARGV[1] or lease_end(rec.at, rec.lease) <= now then return 0 end
rec.at, rec.lease = now_s, ARGV[2]
-- The record must outlive the renewed lease, however long the key has been held.
expire(queue, rec.q == '1', math.max(record_ttl, lease + 1000))
flush()
return 1
"#
    ))
});

/// Force release by an operator: releases whoever validly holds the key, hands it on.
///
/// KEYS: record, queue, waiters. ARGV: record_ttl_ms, inbox_prefix.
/// Returns the released holder's fence (as a string) or false when the key was free.
///
/// Atomic so the fence reported (and audited) is the one actually released.
pub(crate) static FORCE_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prelude!(),
        r#"
local state, queue, waiters = KEYS[1], KEYS[2], KEYS[3]
load(state, redis.call('GET', state))
local now, now_s = clock()
if not rec.owner or lease_end(rec.at, rec.lease) <= now then return false end
local fence = rec.fence
release(queue, waiters, rec.q == '1', rec.fence, rec.kept, now, now_s, tonumber(ARGV[1]),
  ARGV[2])
flush()
return fence
"#
    ))
});

/// One GCRA step (`idemgate_wire::gcra` in Lua) on Redis's clock.
///
/// KEYS: the limit's state (the TAT in µs, as a string). ARGV: interval_us, burst.
/// Returns {allowed (1|0), tat_us, remaining, retry_after_us, reset_us}.
///
/// Atomic so concurrent checks from every gateway spend distinct units: a read-then-write
/// from the sidecar would let two requests both take the last one. The state expires by
/// itself once its TAT is past (PEXPIRE), when it would read as a fresh burst anyway.
/// Lua numbers are doubles: µs since the epoch (~2^51) and day-long windows stay exact.
pub(crate) static GCRA: LazyLock<Script> = LazyLock::new(|| {
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

/// Inspect: a consistent snapshot of one key for operators (reads only).
///
/// KEYS: record, queue.
/// Returns `{held(0|1), holder_age_ms, lease_remaining_ms, queue_len, last_fence,
///           resp_status|false, retention_remaining_ms}`.
///
/// A script so that the holder, queue and response are read at one instant.
pub(crate) static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        record_codec!(),
        r#"
local r = decode(redis.call('GET', KEYS[1]))
local now = clock()
local function remaining_ms(deadline)
  return math.max(math.ceil((deadline - now) / 1000), 0)
end
local held = r.owner and lease_end(r.at, r.lease) > now
local lease_left, age_ms = 0, 0
if held then
  lease_left = remaining_ms(lease_end(r.at, r.lease))
  -- A fresh key's grant time is the sidecar's reading of this clock, which may be ahead of it
  -- (`clock.rs`): such a holding is just granted, not of a negative age.
  age_ms = math.max(math.floor((now - tonumber(r.since)) / 1000), 0)
end
local status, kept_left = false, 0
if r.status and tonumber(r.kept) > now then
  status = r.status
  kept_left = remaining_ms(tonumber(r.kept))
end
return {held and 1 or 0, age_ms, lease_left, redis.call('LLEN', KEYS[2]), r.fence or '0',
  status, kept_left}
"#
    ))
});

/// Whether one record (found by the admin listing's SCAN) is held by an unexpired lease
/// now, on Redis's clock: a record outlives its holder, keeping the fence.
///
/// KEYS: record. Returns 1 (held) | 0.
pub(crate) static HELD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        record_codec!(),
        r#"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local r = decode(v)
if r.owner and lease_end(r.at, r.lease) > clock() then return 1 end
return 0
"#
    ))
});

/// Command `name` with room for `args` more arguments of `bytes` in all. `redis::cmd` starts
/// with two empty buffers that grow argument by argument: a few reallocations per command,
/// ~2,500 instructions per fresh claim+complete pair (callgrind).
pub(super) fn command(name: &str, args: usize, bytes: usize) -> Cmd {
    let mut cmd = Cmd::with_capacity(1 + args, name.len() + bytes);
    cmd.arg(name);
    cmd
}

/// `EVALSHA <sha> <numkeys> <keys...>`, ready for the script's ARGV: built straight into one
/// command buffer (redis-rs's `ScriptInvocation` copies every key and argument twice).
pub(super) fn evalsha(script: &Script, keys: &[impl AsRef<str>]) -> Cmd {
    // Room for the keys and a dozen short arguments; a stored body grows it.
    let key_bytes: usize = keys.iter().map(|k| k.as_ref().len()).sum();
    let mut cmd = command("EVALSHA", 2 + keys.len() + 12, 64 + key_bytes + 256);
    cmd.arg(script.get_hash()).arg(keys.len());
    for key in keys {
        cmd.arg(key.as_ref());
    }
    cmd
}
