//! The Redis store: the scripts of `scripts.rs` over the keys of `keys.rs`, on a standalone
//! server, a Sentinel-managed master or a Cluster, plus this process's notification inbox.
//!
//! - `clock`: Redis's clock as this sidecar last read it;
//! - `compare_set`: a fresh grant's complete as `SET … IFEQ`, or a script where Redis has none;
//! - `conn`: connections by topology (and `Op`, what one call sends);
//! - `gather`: the commands sent at the same moment, written as one pipeline;
//! - `held`: the grants this sidecar answered, so their complete writes without reading;
//! - `inbox`: this process's wake-up channel;
//! - `keys`: every key and channel name; `scripts`: every Lua script; `record`: the one
//!   record written without a script, a fresh key's grant;
//! - `reply`: decoding script replies;
//! - `slots`: which Cluster primary serves a command, for gathering per primary;
//! - here: [`RedisStore`], the [`Store`] (and rate store) on top, every call bounded by the
//!   store timeout.

mod clock;
mod compare_set;
mod conn;
mod gather;
mod held;
mod inbox;
mod keys;
mod rate;
mod record;
mod reply;
mod scripts;
mod slots;

#[cfg(feature = "testing")]
pub(crate) use scripts::RECORD_CODEC;

use super::{
    ClaimArgs, ClaimReply, ClaimStep, CompletedInfo, Grant, HolderInfo, KeyInfo, KeyState,
    LeaveStep, Release, Store, StoreError, StoreResult, Stored, millis,
};
use crate::config::RedisConfig;
use crate::waiters::Waiters;
use bytes::Bytes;
use clock::{Reading, RedisClock};
use compare_set::CompareSet;
use conn::{Conn, Op};
use held::HeldGrants;
use idemgate_wire::{Mode, OwnerOutcome};
use keys::LockKeys;
use record::StoredFields;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{FromRedisValue, RedisError, Value};
use reply::{count, decode_claim, grant_at, number, owner_outcome, text, unexpected};
use scripts::evalsha;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

pub(crate) struct RedisStore {
    conn: Conn,
    prefix: String,
    inbox_prefix: String,
    inbox: String,
    waiters: Arc<Waiters>,
    /// How long an idle record lives (`--fence-ttl-secs`), in ms: scripts' `record_ttl`.
    record_ttl_ms: u64,
    timeout: Duration,
    subscriber: JoinHandle<()>,
    /// [`keep_a_timer_due_first`], for as long as the store lives.
    timer_floor: JoinHandle<()>,
    /// The grants answered here, for their complete or abort.
    held: HeldGrants,
    /// Redis's clock as the claims' scripts last read it: a fresh key's grant time. None on a
    /// Cluster: every primary has its own clock, and a reading of one is no bound on another's,
    /// so there every claim runs the script on its key's primary.
    clock: Option<RedisClock>,
    /// Whether a fresh grant's complete is sent as `SET … IFEQ` or as `COMPLETE_FRESH`.
    compare_set: CompareSet,
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        self.subscriber.abort();
        self.timer_floor.abort();
    }
}

/// Keeps a timer due within half the store timeout pending on the runtime, for as long as the
/// store lives, so that no store call's time-out is ever the runtime's earliest timer.
///
/// Why: every store call is bounded by a timer due a store timeout from now, and tokio's time
/// driver wakes its I/O driver (an `eventfd` write, and the worker's next `epoll_wait`
/// returns at once to read it) whenever a timer is registered to fire before the deadline
/// the driver last parked until, or when it parked with no timer at all (`reregister` in
/// tokio's `runtime/time/mod.rs`: `next_wake.is_none_or(|next| when < next)`). It does so
/// even when the thread registering the timer is the one that would park next, as the
/// sidecar's one worker is. So at a moderate load, where the sidecar idles between requests
/// with nothing in flight, nearly every call paid that write and the extra wake-up: 0.44
/// `eventfd` writes per request at the peer group's load, every one from the store timeout's
/// timer (`perf record -e syscalls:sys_enter_write --call-graph dwarf`). With this timer
/// pending, the driver always parks until at most half a store timeout ahead, and a call's
/// time-out, a whole store timeout ahead, is never earlier.
///
/// It costs one wake-up per half store timeout (one a second at the default 2 s), and
/// changes when nothing fires: the driver wakes at its earliest timer and parks again until
/// the next, so each store time-out still fires on time.
async fn keep_a_timer_due_first(store_timeout: Duration) {
    // At least 10 ms: a store timeout that short gains nothing from this, and must not make
    // it a busy loop.
    let period = (store_timeout / 2).max(Duration::from_millis(10));
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
    }
}

impl RedisStore {
    /// Connects (lazily where the client allows it) and starts the inbox subscription.
    ///
    /// # Errors
    /// A URL that does not parse, or a Cluster whose seed nodes are all unreachable.
    pub(crate) async fn connect(
        cfg: &RedisConfig,
        waiters: Arc<Waiters>,
        fence_ttl: Duration,
        timeout: Duration,
    ) -> StoreResult<Self> {
        // rustls needs one process-wide crypto provider; an embedding application may have
        // installed its own already, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let conn = Conn::connect(cfg, timeout).await?;
        let clock = (!matches!(conn, Conn::Cluster(..))).then(RedisClock::default);
        let inbox = crate::locks::random_token();
        let inbox_prefix = keys::inbox_prefix(&cfg.prefix);
        let (subscribed_tx, subscribed_rx) = tokio::sync::oneshot::channel();
        let subscriber = tokio::spawn(inbox::subscribe_inbox(
            cfg.clone(),
            format!("{inbox_prefix}{inbox}"),
            Arc::clone(&waiters),
            subscribed_tx,
        ));
        // Wait (bounded) for the first subscription so the first hand-offs are prompt; if
        // Redis is down the store still starts and reports not ready until it is back.
        let _ = tokio::time::timeout(timeout, subscribed_rx).await;
        let timer_floor = tokio::spawn(keep_a_timer_due_first(timeout));
        Ok(RedisStore {
            conn,
            prefix: cfg.prefix.clone(),
            inbox_prefix,
            inbox,
            waiters,
            record_ttl_ms: millis(fence_ttl),
            timeout,
            subscriber,
            timer_floor,
            held: HeldGrants::default(),
            clock,
            compare_set: CompareSet::default(),
        })
    }

    fn keys(&self, key: &str) -> LockKeys {
        LockKeys::new(&self.prefix, key)
    }

    /// `request` bounded by the store timeout, its error classified.
    async fn bounded<T>(
        &self,
        request: impl Future<Output = Result<T, RedisError>>,
    ) -> StoreResult<T> {
        let bounded = tokio::time::timeout(self.timeout, request).await;
        self.settle(bounded).await
    }

    /// A bounded call's outcome as the store's: its reply or error, or, when it ran out of
    /// the store timeout, [`StoreError::Timeout`] once the connection has heard of it.
    async fn settle<T>(
        &self,
        bounded: Result<Result<T, RedisError>, tokio::time::error::Elapsed>,
    ) -> StoreResult<T> {
        match bounded {
            Ok(result) => Ok(result?),
            Err(_) => {
                self.conn.timed_out().await;
                Err(StoreError::Timeout(self.timeout))
            }
        }
    }

    /// One page of `SCAN` for lock records, on `node` (a Cluster primary) or the one server.
    async fn scan_page(
        &self,
        node: Option<&(String, u16)>,
        cursor: u64,
        pattern: &str,
    ) -> StoreResult<(u64, Vec<String>)> {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        match (node, &self.conn) {
            (Some((host, port)), Conn::Cluster(c, _)) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                let page = self.bounded(c.clone().route_command(scan, routing)).await?;
                redis::from_redis_value(page).map_err(|e| unexpected(&e.to_string()))
            }
            _ => self.run(Op::Command(&scan)).await,
        }
    }

    /// Runs one command or script on the current connection, bounded by the store timeout.
    async fn run<T: FromRedisValue>(&self, op: Op<'_>) -> StoreResult<T> {
        // Not `self.bounded(self.conn.send(op))`: an `async fn` keeps a future passed as its
        // argument and the copy it awaits side by side, and this is every store call's path.
        // (The timeout's outcome bound first: as a call's argument it would stay a live
        // temporary beside `settle`'s future, and the state machine would hold both.)
        let bounded = tokio::time::timeout(self.timeout, self.conn.send(op)).await;
        self.settle(bounded).await
    }

    async fn force_release_script(&self, key: &str) -> StoreResult<Value> {
        let k = self.keys(key);
        let script = &*scripts::FORCE_RELEASE;
        let mut cmd = evalsha(script, &k.all());
        cmd.arg(self.record_ttl_ms).arg(&self.inbox_prefix);
        self.run(Op::Script(script, &cmd)).await
    }

    /// Complete (storing `response` for its retention, if any) or abort. The grant this
    /// sidecar wrote itself, with its lease not over, is released by a compare-and-set of its
    /// record (`COMPLETE_FRESH`); anything else, or a record that changed since, by `COMPLETE`.
    async fn release(
        &self,
        key: &str,
        owner: &str,
        response: Option<(Duration, Stored)>,
    ) -> StoreResult<Release> {
        let k = self.keys(key);
        let retention_ms = response
            .as_ref()
            .map(|(retention, _)| millis(*retention).max(1));
        let headers = match &response {
            Some((_, stored)) => serde_json::to_string(&stored.response.headers)?,
            None => String::new(),
        };
        // The grant this sidecar answered, with the reading its lease is checked on.
        let grant = self.held.take(owner).map(|grant| {
            let now_us = grant.clock.now_us();
            (grant, now_us)
        });
        if let Some((grant, now_us)) = &grant
            && let Some(record) = grant.fresh_record(owner, *now_us)
        {
            let stored = response
                .as_ref()
                .zip(retention_ms)
                .map(|((_, stored), ms)| StoredFields {
                    status: stored.response.status,
                    headers: &headers,
                    body: &stored.body,
                    fingerprint: &grant.fingerprint,
                    kept_us: now_us.saturating_add(ms.saturating_mul(1000)),
                });
            let released = record::released(grant.fence, stored.as_ref());
            if self
                .compare_and_release(&k, &record, released, retention_ms)
                .await?
            {
                return Ok(Release::Released {
                    held_ms: now_us.saturating_sub(grant.fence) / 1000,
                    lease_ms: grant.lease_ms,
                });
            }
        }
        let (store, status, body) = match &response {
            Some((_, stored)) => ("1", stored.response.status, stored.body.clone()),
            None => ("0", 0, Bytes::new()),
        };
        let script = &*scripts::COMPLETE;
        let mut cmd = evalsha(script, &k.all());
        cmd.arg(owner)
            .arg(retention_ms.unwrap_or(0))
            .arg(store)
            .arg(status)
            .arg(headers)
            .arg(body.as_ref())
            .arg(self.record_ttl_ms)
            .arg(&self.inbox_prefix);
        match grant {
            Some((grant, now_us)) => {
                cmd.arg(grant.fence).arg(&*grant.fingerprint).arg(now_us);
            }
            None => {
                cmd.arg("").arg("").arg("");
            }
        }
        let reply: Value = self.run(Op::Script(script, &cmd)).await?;
        reply::release(&reply)
    }

    /// Whether the record was `grant` byte for byte and is now `released`, expiring after
    /// `expiry_ms` (`None`: its expiry kept). `false`: the record is anything else, and
    /// nothing was written. One `SET … IFEQ` where the server has it, else the
    /// `COMPLETE_FRESH` script (`compare_set.rs`).
    async fn compare_and_release(
        &self,
        k: &LockKeys,
        grant: &[u8],
        released: Vec<u8>,
        expiry_ms: Option<u64>,
    ) -> StoreResult<bool> {
        if self.compare_set.command() {
            let mut set =
                scripts::command("SET", 6, k.record.len() + released.len() + grant.len() + 32);
            set.arg(&k.record).arg(&released).arg("IFEQ").arg(grant);
            match expiry_ms {
                Some(ms) => set.arg("PX").arg(ms),
                None => set.arg("KEEPTTL"),
            };
            match self.run::<Value>(Op::Command(&set)).await {
                Ok(reply) => {
                    self.compare_set.answered();
                    return match reply {
                        Value::Okay => Ok(true),
                        Value::Nil => Ok(false),
                        _ => Err(unexpected("SET IFEQ")),
                    };
                }
                Err(StoreError::Redis(err)) if compare_set::is_refusal(&err) => {
                    self.compare_set.refused(&err);
                }
                Err(err) => return Err(err),
            }
        }
        let script = &*scripts::COMPLETE_FRESH;
        let mut cmd = evalsha(script, &[&k.record]);
        cmd.arg(grant).arg(released);
        match expiry_ms {
            Some(ms) => cmd.arg(ms),
            None => cmd.arg(""),
        };
        let swapped: i64 = self.run(Op::Script(script, &cmd)).await?;
        Ok(swapped == 1)
    }

    /// A claim's first step with a fresh reading of Redis's clock: the grant written by one
    /// `SET NX GET PX`, no script (`clock.rs` says why the reading may stand for the script's
    /// `TIME`). `None` when the key has a record: nothing was written, and the claim script
    /// decides on it as for any claim.
    async fn claim_fresh(
        &self,
        k: &LockKeys,
        args: &ClaimArgs<'_>,
        clock: Reading,
        grant_ttl_ms: u64,
    ) -> StoreResult<Option<ClaimReply>> {
        let now_us = clock.read_us();
        let lease_ms = millis(args.lease);
        let fingerprint = args.fingerprint.unwrap_or("");
        let packed = record::fresh_grant(now_us, args.owner, fingerprint, lease_ms);
        let mut set = scripts::command("SET", 6, k.record.len() + packed.len() + 32);
        set.arg(&k.record)
            .arg(packed)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(grant_ttl_ms);
        let sent = Instant::now();
        match self.run::<Value>(Op::Command(&set)).await? {
            Value::Nil => {}
            Value::BulkString(_) => return Ok(None),
            _ => return Err(unexpected("SET NX GET")),
        }
        let grant = Grant {
            fence: now_us,
            lease_ms,
            granted_at_us: now_us,
        };
        self.remember(args, &grant, clock, sent, true);
        Ok(Some(ClaimReply {
            step: ClaimStep::Granted(grant),
            lease_expired: false,
        }))
    }

    /// Remembers a grant answered here, for its complete or abort (`held.rs`).
    fn remember(
        &self,
        args: &ClaimArgs<'_>,
        grant: &Grant,
        clock: Reading,
        sent: Instant,
        fresh: bool,
    ) {
        let answered = held::Answered {
            fence: grant.fence,
            fingerprint: args.fingerprint.unwrap_or(""),
            lease: Duration::from_millis(grant.lease_ms),
            clock,
            sent,
            fresh,
        };
        self.held.insert(args.owner, &answered);
    }

    /// Which of `records` (found by SCAN) are held by an unexpired lease now (Redis's
    /// clock): a record outlives its holder, keeping the fence.
    async fn held_among(&self, records: &[String]) -> StoreResult<Vec<String>> {
        let script = &*scripts::HELD;
        let checks = records.iter().map(|record| async move {
            let cmd = evalsha(script, &[record.as_str()]);
            let held: i64 = self.run(Op::Script(script, &cmd)).await?;
            Ok::<_, StoreError>(if held == 1 {
                keys::key_of_record(&self.prefix, record)
            } else {
                None
            })
        });
        let found = futures_util::future::try_join_all(checks).await?;
        Ok(found.into_iter().flatten().collect())
    }
}

impl Store for RedisStore {
    fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    async fn claim(&self, args: &ClaimArgs<'_>) -> StoreResult<ClaimReply> {
        let k = self.keys(args.key);
        // A record outlives every lease granted in it by a second.
        let grant_ttl_ms = self
            .record_ttl_ms
            .max(millis(args.lease).saturating_add(1000));
        if !args.recheck
            && let Some(clock) = self.clock.as_ref().and_then(RedisClock::fresh)
            && let Some(reply) = self.claim_fresh(&k, args, clock, grant_ttl_ms).await?
        {
            return Ok(reply);
        }
        let (wait_ms, max_queue, waiter, alive_ms) = args.queue.map_or((0, 0, "", 0), |q| {
            (
                millis(q.wait).max(1),
                q.max_queue,
                q.waiter.unwrap_or(""),
                millis(q.alive).max(1),
            )
        });
        let mode = match args.mode {
            Mode::Idempotency => "idempotency",
            Mode::Lock => "lock",
        };
        let script = &*scripts::CLAIM;
        let mut cmd = evalsha(script, &k.all());
        cmd.arg(args.owner)
            .arg(args.fingerprint.unwrap_or(""))
            .arg(mode)
            .arg(millis(args.lease))
            .arg(wait_ms)
            .arg(max_queue)
            .arg(self.record_ttl_ms)
            .arg(grant_ttl_ms)
            .arg(&self.inbox_prefix)
            .arg(&self.inbox)
            .arg(waiter)
            .arg(alive_ms);
        let sent = Instant::now();
        let packed: Value = self.run(Op::Script(script, &cmd)).await?;
        let (reply, step_clock_us) = decode_claim(&packed)?;
        if let ClaimStep::Granted(grant) = &reply.step {
            // The script's clock: the grant's time, unless the grant was a hand-off made
            // earlier and picked up by this step (then the step's clock follows).
            let clock = Reading::new(step_clock_us.unwrap_or(grant.granted_at_us), sent);
            if let Some(redis_clock) = &self.clock {
                redis_clock.observe(clock);
            }
            self.remember(args, grant, clock, sent, false);
        }
        Ok(reply)
    }

    async fn leave(
        &self,
        key: &str,
        owner: &str,
        release_if_granted: bool,
    ) -> StoreResult<LeaveStep> {
        let k = self.keys(key);
        let script = &*scripts::LEAVE;
        let mut cmd = evalsha(script, &k.all());
        cmd.arg(owner)
            .arg(if release_if_granted { "1" } else { "0" })
            .arg(self.record_ttl_ms)
            .arg(&self.inbox_prefix);
        let items: Vec<Value> = self.run(Op::Script(script, &cmd)).await?;
        match text(items.first()).as_deref() {
            Some("granted") => Ok(LeaveStep::Granted(grant_at(&items, 1)?)),
            Some("left") => Ok(LeaveStep::Left {
                retry_after_ms: number(items.get(1))?,
                queue_len: count(items.get(2))?,
            }),
            _ => Err(unexpected("leave outcome")),
        }
    }

    async fn leave_named(&self, key: &str, waiter: &str) -> StoreResult<OwnerOutcome> {
        let k = self.keys(key);
        let script = &*scripts::LEAVE_NAMED;
        let mut cmd = evalsha(script, &k.all());
        cmd.arg(waiter)
            .arg(self.record_ttl_ms)
            .arg(&self.inbox_prefix);
        let reply: String = self.run(Op::Script(script, &cmd)).await?;
        owner_outcome(&reply)
    }

    async fn complete(
        &self,
        key: &str,
        owner: &str,
        retention: Duration,
        response: Option<Stored>,
    ) -> StoreResult<Release> {
        self.release(key, owner, response.map(|stored| (retention, stored)))
            .await
    }

    async fn abort(&self, key: &str, owner: &str) -> StoreResult<Release> {
        self.release(key, owner, None).await
    }

    async fn renew(&self, key: &str, owner: &str, lease: Duration) -> StoreResult<OwnerOutcome> {
        let k = self.keys(key);
        let script = &*scripts::RENEW;
        let mut cmd = evalsha(script, &[k.record.as_str(), &k.queue()]);
        cmd.arg(owner).arg(millis(lease)).arg(self.record_ttl_ms);
        let renewed: i64 = self.run(Op::Script(script, &cmd)).await?;
        Ok(if renewed == 1 {
            OwnerOutcome::Renewed {
                lease_ms: millis(lease),
            }
        } else {
            OwnerOutcome::Stale
        })
    }

    async fn inspect(&self, key: &str) -> StoreResult<KeyInfo> {
        let k = self.keys(key);
        let script = &*scripts::INSPECT;
        let cmd = evalsha(script, &[k.record.as_str(), &k.queue()]);
        let items: Vec<Value> = self.run(Op::Script(script, &cmd)).await?;
        let held = number(items.first())? == 1;
        let last_fence = number(items.get(4))?;
        let status = match items.get(5) {
            Some(Value::Nil) | None => None,
            other => Some(u16::try_from(number(other)?).map_err(|_| unexpected("status"))?),
        };
        let holder = if held {
            Some(HolderInfo {
                fence: last_fence,
                age_ms: number(items.get(1))?,
                lease_remaining_ms: number(items.get(2))?,
            })
        } else {
            None
        };
        Ok(KeyInfo {
            key: key.to_owned(),
            state: match (held, status) {
                (true, _) => KeyState::Held,
                (false, Some(_)) => KeyState::Completed,
                (false, None) => KeyState::Free,
            },
            last_fence,
            holder,
            queue_len: count(items.get(3))?,
            completed: status.map(|status| CompletedInfo {
                status,
                retention_remaining_ms: number(items.get(6)).unwrap_or(0),
            }),
        })
    }

    async fn list_held(&self, limit: usize) -> StoreResult<(Vec<String>, bool)> {
        let pattern = keys::record_pattern(&self.prefix);
        // SCAN walks one server's keyspace: on a Cluster, every primary's in turn.
        let nodes = match &self.conn {
            Conn::Cluster(c, _) => {
                let nodes: String = self
                    .bounded(
                        redis::cmd("CLUSTER")
                            .arg("NODES")
                            .query_async(&mut c.clone()),
                    )
                    .await?;
                slots::primaries(&nodes)
                    .map(|p| Some((p.host.to_owned(), p.port)))
                    .collect()
            }
            _ => vec![None],
        };
        let mut found = std::collections::BTreeSet::new();
        // Bounded: at most 1000 SCAN round trips however large the keyspace.
        let mut round_trips = 0;
        for node in &nodes {
            let mut cursor = 0u64;
            loop {
                if round_trips == 1000 {
                    return Ok((found.into_iter().take(limit).collect(), true));
                }
                round_trips += 1;
                let (next, batch) = self.scan_page(node.as_ref(), cursor, &pattern).await?;
                // SCAN may repeat a key across pages: the set keeps each once.
                found.extend(self.held_among(&batch).await?);
                if found.len() > limit {
                    return Ok((found.into_iter().take(limit).collect(), true));
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok((found.into_iter().collect(), false))
    }

    async fn force_release(&self, key: &str) -> StoreResult<Option<u64>> {
        let reply = self.force_release_script(key).await?;
        match reply {
            Value::Nil => Ok(None),
            other => Ok(Some(number(Some(&other))?)),
        }
    }

    async fn ping(&self) -> StoreResult<()> {
        // A write, not PING: a Redis at `maxmemory` (noeviction) answers PING but refuses
        // every claim, and must not be reported ready.
        let mut probe = redis::cmd("SET");
        probe
            .arg(format!("{}:ready-probe", self.prefix))
            .arg(&self.inbox)
            .arg("PX")
            .arg(10_000);
        let ok: String = self.run(Op::Command(&probe)).await?;
        if ok == "OK" {
            Ok(())
        } else {
            Err(unexpected("SET"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ClaimArgs, RedisStore, Store};
    use crate::waiters::Waiters;
    use std::sync::Arc;
    use std::time::Duration;

    /// Every layer above a store call (verb, handler, router) embeds its future and moves it
    /// whole, several times per request: the Cluster and Sentinel paths, boxed, must not
    /// size a standalone server's calls (unboxed, a claim's future was ~7 KB in a debug
    /// build; ~0.7 KB boxed).
    #[tokio::test]
    async fn a_store_calls_future_is_small_on_a_standalone_server() {
        let redis = crate::testing::RedisServer::start().unwrap();
        let crate::config::StoreConfig::Redis(cfg) = redis.store_config() else {
            panic!("a Redis store config");
        };
        let timeout = Duration::from_secs(2);
        let store = RedisStore::connect(&cfg, Arc::new(Waiters::default()), timeout, timeout)
            .await
            .unwrap();
        let args = ClaimArgs {
            key: "k",
            mode: idemgate_wire::Mode::Lock,
            owner: "0123456789abcdef0123456789abcdef",
            fingerprint: None,
            lease: Duration::from_secs(1),
            queue: None,
            recheck: false,
        };
        let claim = store.claim(&args);
        let complete = store.complete("k", args.owner, timeout, None);
        for (what, size) in [
            ("claim", std::mem::size_of_val(&claim)),
            ("complete", std::mem::size_of_val(&complete)),
        ] {
            assert!(size <= 2048, "{what}: a {size}-byte future");
        }
    }
}
