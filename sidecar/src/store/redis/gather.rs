//! Commands that concurrent requests send at the same moment, written to Redis as one
//! pipeline.
//!
//! Why: redis-rs's multiplexed connection writes what its queue holds each time its driver
//! task runs, and tokio runs a task woken by another right after the waker yields (the worker's
//! LIFO slot). So every request's command woke the driver, which wrote that one command: at
//! concurrency 64 a claim+complete pair cost about one extra loopback `writev` per command
//! (~6.5 µs each on the benchmark VM), one `read` and one reply dispatch at Redis, and a
//! driver wake-up (benchmarks/sidecar.notes.md). Here a command sent with nothing else in
//! flight goes at once (a lone request pays nothing), and otherwise the first command into an
//! empty batch spawns a flusher that yields once before it takes the batch: tokio runs a yielded task only
//! when its worker has drained its run queue (or at the worker's periodic maintenance, every
//! 61 polls), so every request decoded in that scheduler pass adds its command to the same
//! pipeline. Idle, the pass is one turn of the scheduler; nothing waits on a timer.
//!
//! Every command keeps its own reply: a pipeline that is not a transaction answers each
//! command on its own, so one command's server error (a missing script, say) is that caller's
//! alone. A transport error fails the whole batch, as it failed every command in flight on the
//! multiplexed connection before.
//!
//! A Cluster's batch is split by primary (`slots.rs`: each command's slot, and the slot ranges
//! `CLUSTER NODES` listed): each primary's commands go as one pipeline to it, on a connection
//! of the sidecar's own, and so does a lone command whose primary the map knows; the cluster
//! client carries the rest (a slot not placed yet, a primary without a connection of its
//! own) and the redirected commands. The cluster client sends every command on its own
//! otherwise, and its connections to the primaries are multiplexed ones, so without this a
//! Cluster paid one write per command at any load (1.7 `writev` per claim+complete pair at
//! concurrency 64, against 0.2 on a server: `benchmarks/sidecar.notes.md`). The slot map may
//! be stale (a slot migrated, a failover): a command a primary answers with a redirect is sent
//! again on its own, through the client's own redirect handling, and the map is read again;
//! an `ASK` (a slot being migrated) goes with its `ASKING` in one pipeline to the importing
//! primary, which the client cannot do safely (`ClusterTarget::resend`).
//!
//! A Cluster's primaries fail apart: each one's callers are answered as soon as it answers,
//! each one's time-out is its own, and any failure of a primary, a time-out included, asks
//! for the slot map again. A primary that dies is refused at once; one that hangs (a frozen
//! host, a partition) only times out, so without the time-outs asking, the map kept the
//! hung node's slots on it after the Cluster had failed it over, for good.

use super::super::millis;
use super::conn::SentinelConn;
use super::slots::{SlotOwners, command_slot};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, RedisError, RedisResult, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;
use tokio::sync::oneshot;

/// One connection's sender, and the batch it is gathering.
pub(super) struct Gather {
    target: Target,
    /// How long a batch may wait for its replies: the store timeout, which bounds every
    /// caller's own wait too (the connection itself sets no response timeout).
    timeout: Duration,
    pending: Mutex<Vec<Pending>>,
    /// Commands sent and not yet answered (or given up).
    in_flight: AtomicUsize,
    /// Batches sent so far.
    batches: AtomicU64,
}

struct Pending {
    cmd: Cmd,
    reply: oneshot::Sender<RedisResult<Value>>,
}

/// Where a batch goes: the one server's connection, the master the Sentinels name now, or
/// a Cluster's primaries.
pub(super) enum Target {
    Server(ConnectionManager),
    Sentinel(Arc<SentinelConn>),
    Cluster(Arc<ClusterTarget>),
}

impl Gather {
    pub(super) fn new(target: Target, timeout: Duration) -> Arc<Gather> {
        Arc::new(Gather {
            target,
            timeout,
            pending: Mutex::default(),
            in_flight: AtomicUsize::new(0),
            batches: AtomicU64::new(0),
        })
    }

    pub(super) fn target(&self) -> &Target {
        &self.target
    }

    /// Batches sent so far (what the tests check the gathering by).
    #[cfg(test)]
    pub(super) fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Sends `cmd`: at once when nothing else is in flight (a lone request pays no gathering),
    /// else with whatever else is sent in this scheduler pass. Its reply, with a server error
    /// as `Err`.
    pub(super) async fn send(self: &Arc<Self>, cmd: &Cmd) -> RedisResult<Value> {
        let (_in_flight, alone) = InFlight::enter(&self.in_flight);
        if alone {
            return self.target.one(cmd).await.and_then(Value::extract_error);
        }
        let (reply, answer) = oneshot::channel();
        let first = {
            let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            pending.push(Pending {
                cmd: cmd.clone(),
                reply,
            });
            pending.len() == 1
        };
        if first {
            tokio::spawn(Arc::clone(self).flush());
        }
        // A reply dropped unanswered: the batch ran out of its time (a Cluster's batch drops
        // the primaries still unanswered then), or the runtime is shutting down.
        answer.await.unwrap_or_else(|_| Err(timeout_error()))
    }

    async fn flush(self: Arc<Self>) {
        tokio::task::yield_now().await;
        let batch =
            std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner));
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.target.batch(batch, self.timeout).await;
    }
}

/// Answers one caller of a batch, with a server error as `Err`.
fn answer(reply: oneshot::Sender<RedisResult<Value>>, answer: RedisResult<Value>) {
    // A caller that gave up (its timeout) dropped its receiver: nothing to do.
    let _ = reply.send(answer.and_then(Value::extract_error));
}

/// The Sentinel paths are boxed: a future's size is that of its largest state, and every
/// layer above a store call (verb, handler, router) embeds it and moves it whole, so a
/// standalone server's calls must not carry the Sentinel resolution's state.
impl Target {
    /// The connection a server's or the Sentinels' master's commands go on (a Cluster has
    /// one per primary, behind its client).
    pub(super) async fn connection(&self) -> RedisResult<ConnectionManager> {
        match self {
            Target::Server(conn) => Ok(conn.clone()),
            Target::Sentinel(sentinel) => Box::pin(sentinel.get()).await,
            Target::Cluster(_) => Err(RedisError::from((
                ErrorKind::Client,
                "a Cluster's commands go through its client",
            ))),
        }
    }

    /// Loads `script` on the server `cmd` goes to.
    pub(super) async fn load_script(&self, script: &redis::Script, cmd: &Cmd) -> RedisResult<()> {
        if let Target::Cluster(cluster) = self {
            return cluster.load_script(script, cmd).await;
        }
        script
            .load_async(&mut self.connection().await?)
            .await
            .map(drop)
    }

    /// One command sent at once.
    async fn one(&self, cmd: &Cmd) -> RedisResult<Value> {
        if let Target::Cluster(cluster) = self {
            return Box::pin(cluster.one(cmd)).await;
        }
        let mut conn = self.connection().await?;
        let answer = conn.req_packed_command(cmd).await;
        self.note(answer.as_ref().map(std::slice::from_ref)).await;
        answer
    }

    /// `batch` sent as one, each caller answered, bounded by `timeout` (every caller stops
    /// waiting then, and a batch on a connection that never answers must not keep its task
    /// alive after them).
    async fn batch(&self, batch: Vec<Pending>, timeout: Duration) {
        if let Target::Cluster(cluster) = self {
            return Box::pin(cluster.batch(batch, timeout)).await;
        }
        let count = batch.len();
        let mut pipe = redis::Pipeline::with_capacity(count);
        let mut replies = Vec::with_capacity(count);
        for pending in batch {
            pipe.add_command(pending.cmd);
            replies.push(pending.reply);
        }
        let sent = async {
            let mut conn = self.connection().await?;
            send_batch(&mut conn, &pipe).await
        };
        let answers = tokio::time::timeout(timeout, sent)
            .await
            .unwrap_or_else(|_| Err(timeout_error()));
        self.note(answers.as_deref()).await;
        match answers {
            Ok(values) => {
                for (reply, value) in replies.into_iter().zip(values) {
                    answer(reply, Ok(value));
                }
            }
            Err(e) => {
                for reply in replies {
                    answer(reply, Err(e.clone()));
                }
            }
        }
    }

    /// What a call's server answered, or how it failed (a call that ran out of the store
    /// timeout too, `Conn::timed_out`): for [`SentinelConn::checked`]; on a Cluster, a
    /// failure asks for the slot map (the primary may be gone or hung, and a hung one fails
    /// its commands only by their time-outs, which no other path sees).
    pub(super) async fn note(&self, answers: Result<&[Value], &RedisError>) {
        match self {
            Target::Sentinel(sentinel) => Box::pin(sentinel.checked(answers)).await,
            Target::Cluster(cluster) if answers.is_err() => cluster.read_map_soon(),
            _ => {}
        }
    }
}

/// What a call that ran out of the store timeout failed with: an I/O time-out, which
/// redis-rs retries rather than reconnects for (as its own response timeout failed).
pub(super) fn timeout_error() -> RedisError {
    RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
}

/// How long after reading a Cluster's slot map it may be read again: redirects during a
/// slot migration come by the hundred, and one read per interval follows them.
const REREAD_AFTER: Duration = Duration::from_millis(100);

/// How often a primary the slot map places without a connection of the sidecar's own is
/// tried again (`ClusterTarget::reconnect_soon`).
const RECONNECT_AFTER: Duration = Duration::from_secs(5);

/// Makes a primary's own connection from its address (the seed's settings otherwise:
/// credentials, TLS).
pub(super) type ConnectPrimary =
    Box<dyn Fn(&str, u16) -> RedisResult<ConnectionManager> + Send + Sync>;

/// A Cluster: its client, which primary serves which slot as last read, and a connection of
/// the sidecar's own to each primary, for the pipelines.
///
/// Why connections of its own: the cluster client answers a pipeline in which any command
/// was redirected by sending the whole pipeline again to the redirect's node, so commands the
/// first primary had run could run twice, or fail the whole pipeline after some ran. On a
/// plain connection each command keeps its own reply, and a redirect reply means that command
/// did not run: it alone goes again, through the cluster client.
pub(super) struct ClusterTarget {
    conn: ClusterConnection,
    connect: ConnectPrimary,
    /// The store timeout: what a map read's `PING` of a primary may take.
    timeout: Duration,
    map: RwLock<Arc<ClusterMap>>,
    /// The map is being read (or was, less than [`REREAD_AFTER`] ago).
    reading: AtomicBool,
    /// Commands sent in pipelines of two or more (what the tests check the grouping by).
    pipelined: AtomicU64,
    /// Slot map reads started (what the tests check the asking by).
    map_reads: AtomicU64,
    /// When a primary without a connection of the sidecar's own may next be tried again
    /// (`reconnect_soon`), in ms since `started`.
    reconnect_due_ms: AtomicU64,
    started: std::time::Instant,
}

/// Which primary serves which slot, and each primary's connection (by the same index).
#[derive(Default)]
struct ClusterMap {
    owners: SlotOwners,
    primaries: Vec<Primary>,
}

struct Primary {
    host: String,
    port: u16,
    /// None: its connection could not be made (its commands go through the client).
    conn: Option<ConnectionManager>,
}

impl ClusterMap {
    /// From a `CLUSTER NODES` reply, keeping the connections of primaries `old` knew. A
    /// primary's connection is used only once it answered a `PING` within `timeout`: one
    /// that cannot be made or does not answer (a TLS name that does not match the address
    /// the Cluster lists, say) leaves that primary's commands to the cluster client, one
    /// write each as before, rather than failing them.
    async fn read(
        nodes: &str,
        old: &ClusterMap,
        connect: &ConnectPrimary,
        timeout: Duration,
    ) -> ClusterMap {
        // Every primary at once: one that does not answer costs the read its timeout once.
        let primaries = super::slots::primaries(nodes).map(|p| async move {
            let known = old
                .primaries
                .iter()
                .find(|o| o.host == p.host && o.port == p.port)
                .and_then(|o| o.conn.clone());
            let conn = match known.map_or_else(|| connect(p.host, p.port), Ok) {
                Ok(conn) => answers(conn, timeout).await,
                Err(err) => Err(err),
            };
            let conn = conn
                .inspect_err(|err| {
                    tracing::warn!(
                        %err, host = p.host, port = p.port,
                        "no connection of its own to this Cluster primary: its commands go \
                         through the cluster client, one write each"
                    );
                })
                .ok();
            Primary {
                host: p.host.to_owned(),
                port: p.port,
                conn,
            }
        });
        let primaries = futures_util::future::join_all(primaries).await;
        ClusterMap {
            owners: SlotOwners::from_cluster_nodes(nodes),
            primaries,
        }
    }

    /// The connection of the primary serving `slot`, and its index, when known.
    fn primary_of(&self, slot: u16) -> Option<(u16, &ConnectionManager)> {
        let owner = self.owners.owner(slot)?;
        let conn = self.primaries.get(usize::from(owner))?.conn.as_ref()?;
        Some((owner, conn))
    }
}

impl ClusterTarget {
    /// The client's commands, gathered per primary once the slot map is read (it is read
    /// now, in the background: until then commands go through the client on their own).
    pub(super) fn new(
        conn: ClusterConnection,
        connect: ConnectPrimary,
        timeout: Duration,
    ) -> Arc<ClusterTarget> {
        let cluster = Arc::new(ClusterTarget {
            conn,
            connect,
            timeout,
            map: RwLock::default(),
            reading: AtomicBool::new(false),
            pipelined: AtomicU64::new(0),
            map_reads: AtomicU64::new(0),
            reconnect_due_ms: AtomicU64::new(0),
            started: std::time::Instant::now(),
        });
        cluster.read_map_soon();
        cluster
    }

    /// Commands sent in pipelines so far.
    #[cfg(test)]
    pub(super) fn pipelined(&self) -> u64 {
        self.pipelined.load(Ordering::Relaxed)
    }

    /// Slot map reads started so far.
    #[cfg(test)]
    pub(super) fn map_reads(&self) -> u64 {
        self.map_reads.load(Ordering::Relaxed)
    }

    /// Whether the slot map knows `slot`'s primary, and with a connection of its own to it.
    #[cfg(test)]
    pub(super) fn knows(&self, slot: u16) -> (bool, bool) {
        let map = self.current();
        (
            map.owners.owner(slot).is_some(),
            map.primary_of(slot).is_some(),
        )
    }

    /// The port of the primary the slot map has serving `slot`, with a connection of the
    /// sidecar's own to it.
    #[cfg(test)]
    pub(super) fn connected_owner_port(&self, slot: u16) -> Option<u16> {
        let map = self.current();
        let (index, _) = map.primary_of(slot)?;
        map.primaries.get(usize::from(index)).map(|p| p.port)
    }

    /// Replaces the slot map with one read from `nodes` (tests: a stale one).
    #[cfg(test)]
    pub(super) async fn set_map(&self, nodes: &str) {
        let map = ClusterMap::read(nodes, &self.current(), &self.connect, self.timeout).await;
        *self.map.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(map);
    }

    fn current(&self) -> Arc<ClusterMap> {
        Arc::clone(&self.map.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Reads `CLUSTER NODES` into the slot map, in the background, unless a read is under
    /// way or was made less than [`REREAD_AFTER`] ago. A read that fails leaves the map as
    /// it was (stale entries only cost redirects).
    fn read_map_soon(self: &Arc<Self>) {
        if self.reading.swap(true, Ordering::AcqRel) {
            return;
        }
        self.map_reads.fetch_add(1, Ordering::Relaxed);
        let cluster = Arc::clone(self);
        tokio::spawn(async move {
            match cluster.cluster_nodes().await {
                Ok(nodes) => {
                    let old = cluster.current();
                    let map =
                        ClusterMap::read(&nodes, &old, &cluster.connect, cluster.timeout).await;
                    *cluster.map.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(map);
                }
                Err(err) => tracing::debug!(%err, "could not read the Cluster's slot map"),
            }
            tokio::time::sleep(REREAD_AFTER).await;
            cluster.reading.store(false, Ordering::Release);
        });
    }

    /// A command with `slot` goes through the client, the map giving no connection of the
    /// sidecar's own for it: a slot the map does not place asks for the map, one whose
    /// primary it places without a connection asks for a reconnect. Both are rate-limited,
    /// so asking once per such command costs nothing more than asking once per batch.
    fn through_the_client(self: &Arc<Self>, map: &ClusterMap, slot: Option<u16>) {
        match slot.map(|slot| map.owners.owner(slot).is_some()) {
            Some(true) => self.reconnect_soon(),
            Some(false) => self.read_map_soon(),
            None => {}
        }
    }

    /// A command went through the client because the map places its primary but has no
    /// connection of the sidecar's own to it: the map is read again (which connects to every
    /// primary without one) at most every [`RECONNECT_AFTER`]. A primary that did not answer
    /// a map's `PING` (it hung for a moment, shorter than the Cluster's node timeout, so no
    /// failover followed) otherwise stayed without its connection for good once it was back:
    /// its commands went through the client, one write each, until something else asked for
    /// the map. One that cannot be reached at all (a TLS name that does not match) costs an
    /// attempt and a warning per interval, not per command.
    fn reconnect_soon(self: &Arc<Self>) {
        let now = millis(self.started.elapsed());
        let due = self.reconnect_due_ms.load(Ordering::Relaxed);
        let next = now.saturating_add(millis(RECONNECT_AFTER));
        if now >= due
            && self
                .reconnect_due_ms
                .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.read_map_soon();
        }
    }

    /// `CLUSTER NODES` as the first node to answer gives it: every primary the map has a
    /// connection to and the cluster client are asked at once, each bounded by the store
    /// timeout. Asked through the client alone, the read could go to the very primary that
    /// hangs (the client picks a node of its own view) and wait out its timeout at every
    /// try, the map never changing: the slots stayed on the hung node after the Cluster had
    /// failed it over.
    async fn cluster_nodes(&self) -> RedisResult<String> {
        use futures_util::future::BoxFuture;
        fn ask<'a>(
            mut conn: impl ConnectionLike + Send + 'a,
            timeout: Duration,
        ) -> BoxFuture<'a, RedisResult<String>> {
            Box::pin(async move {
                let mut cmd = redis::cmd("CLUSTER");
                cmd.arg("NODES");
                tokio::time::timeout(timeout, cmd.query_async(&mut conn))
                    .await
                    .unwrap_or_else(|_| Err(timeout_error()))
            })
        }
        let map = self.current();
        let mut asked: Vec<BoxFuture<'_, RedisResult<String>>> = map
            .primaries
            .iter()
            .filter_map(|p| p.conn.clone())
            .map(|conn| ask(conn, self.timeout))
            .collect();
        asked.push(ask(self.conn.clone(), self.timeout));
        // Not empty (the client is always asked): `select_ok` panics on none.
        futures_util::future::select_ok(asked)
            .await
            .map(|(nodes, _)| nodes)
    }

    /// `batch` split by primary: each primary's commands as one pipeline on the sidecar's
    /// own connection to it; a command whose primary the map does not know (or has no
    /// connection to) through the client. Each primary's callers are answered as soon as it
    /// answers, so a primary that hangs holds up nobody else's commands. By `timeout` the
    /// groups still unanswered are dropped (their callers get a time-out) and the slot map
    /// is read again: one timer for the batch, not one per primary (each is a timer entry
    /// to register and cancel, per batch).
    async fn batch(self: &Arc<Self>, batch: Vec<Pending>, timeout: Duration) {
        let map = self.current();
        let mut groups: Vec<Group<'_>> = Vec::new();
        for Pending { cmd, reply } in batch {
            let slot = command_slot(&cmd);
            let primary = slot.and_then(|slot| map.primary_of(slot));
            if primary.is_none() {
                self.through_the_client(&map, slot);
            }
            let same = primary.and_then(|(index, _)| {
                groups
                    .iter_mut()
                    .find(|g| g.primary.is_some_and(|(i, _)| i == index))
            });
            match same {
                Some(group) => group.add(reply, cmd),
                None => {
                    let mut group = Group {
                        primary,
                        replies: Vec::new(),
                        cmds: redis::Pipeline::new(),
                    };
                    group.add(reply, cmd);
                    groups.push(group);
                }
            }
        }
        let answered = groups
            .into_iter()
            .map(|group| self.answer_group(&map, group));
        let answered = futures_util::future::join_all(answered);
        if tokio::time::timeout(timeout, answered).await.is_err() {
            // A primary that did not answer in time may be gone or hung.
            self.read_map_soon();
        }
    }

    /// Sends one group of a batch and answers its callers: a redirected command sent once
    /// more ([`ClusterTarget::resend`]); on a failure every member gets the error and the
    /// slot map is read again.
    async fn answer_group(self: &Arc<Self>, map: &ClusterMap, group: Group<'_>) {
        let sent = self.send(&group).await;
        let Group {
            primary,
            replies,
            cmds,
        } = group;
        let values = match sent {
            Ok(values) => values,
            Err(e) => {
                // The primary may be gone or hung: the map may be out of date.
                self.read_map_soon();
                for reply in replies {
                    answer(reply, Err(e.clone()));
                }
                return;
            }
        };
        let mut again = Vec::new();
        for ((reply, cmd), value) in replies.into_iter().zip(cmds.cmd_iter()).zip(values) {
            if primary.is_some() && is_redirect(&value) {
                again.push((reply, cmd, value));
            } else {
                answer(reply, Ok(value));
            }
        }
        if again.is_empty() {
            return;
        }
        self.read_map_soon();
        let resent = again.into_iter().map(|(reply, cmd, redirect)| async move {
            answer(reply, self.resend(map, cmd, &redirect).await);
        });
        futures_util::future::join_all(resent).await;
    }

    /// A command a primary answered with `redirect`, sent once more. An `ASK` (its slot is
    /// being migrated and the key is not on the primary any more) goes to the importing
    /// primary as `ASKING` and the command in one pipeline, on the sidecar's own connection
    /// to it: `ASKING` lets only the connection's next command through, and one pipeline is
    /// written whole, so no other command comes between. The cluster client sends the two
    /// apart on a connection other requests share (`get_redirected_connection` in redis-rs
    /// 1.8), so with several redirected at once one's `ASKING` could let another's command
    /// through and leave its own to be redirected again, until its retries ran out and the
    /// caller got the `ASK` (the regression test below). A `MOVED` or an answer the
    /// importing primary redirects again goes through the client, which follows it.
    async fn resend(&self, map: &ClusterMap, cmd: &Cmd, redirect: &Value) -> RedisResult<Value> {
        if let Some(conn) = asked_primary(map, redirect) {
            let mut asking = redis::Pipeline::with_capacity(2);
            asking.cmd("ASKING").add_command(cmd.clone());
            let answered = send_batch(&mut conn.clone(), &asking).await?.pop();
            if let Some(value) = answered.filter(|value| !is_redirect(value)) {
                return Ok(value);
            }
        }
        self.conn.clone().req_packed_command(cmd).await
    }

    /// One command sent at once: on the sidecar's own connection to its primary when the
    /// map knows it (a redirect answer sent again as [`ClusterTarget::resend`] says), else
    /// through the client.
    async fn one(self: &Arc<Self>, cmd: &Cmd) -> RedisResult<Value> {
        let map = self.current();
        let slot = command_slot(cmd);
        let answer = match slot.and_then(|slot| map.primary_of(slot)) {
            Some((_, conn)) => match conn.clone().req_packed_command(cmd).await {
                Ok(value) if is_redirect(&value) => {
                    self.read_map_soon();
                    self.resend(&map, cmd, &value).await
                }
                answer => answer,
            },
            None => {
                self.through_the_client(&map, slot);
                self.conn.clone().req_packed_command(cmd).await
            }
        };
        if answer.is_err() {
            // The primary may be gone or hung: the map may be out of date. Through the
            // client too: a primary the map keeps without a connection (it did not answer
            // the map's `PING`) is reached through the client, whose own response timeout
            // can end the call before the store timeout does, and nothing else would ask.
            self.read_map_soon();
        }
        answer
    }

    /// Loads `script` where `cmd` goes: on the sidecar's own connection to the primary of
    /// its slot when the map knows it, else through the client (which loads it on every
    /// primary it knows). Not through the client when the map knows better: after a
    /// failover (where the promoted replica answers `NOSCRIPT`, the script cache not being
    /// replicated) the client's own view may still hold the old primary, and a hung one
    /// makes its load to all of them wait out the store timeout at every try.
    async fn load_script(&self, script: &redis::Script, cmd: &Cmd) -> RedisResult<()> {
        let map = self.current();
        match command_slot(cmd).and_then(|slot| map.primary_of(slot)) {
            Some((_, conn)) => script.load_async(&mut conn.clone()).await,
            None => script.load_async(&mut self.conn.clone()).await,
        }
        .map(drop)
    }

    /// One group: its commands on the sidecar's own connection to their primary (one
    /// pipeline), or through the client one by one when the map has no connection for them.
    /// One reply per member, or the error that failed them all.
    async fn send(&self, group: &Group<'_>) -> RedisResult<Vec<Value>> {
        match group.primary {
            Some((_, conn)) => {
                if group.pipelined() {
                    let members = group.replies.len() as u64;
                    self.pipelined.fetch_add(members, Ordering::Relaxed);
                }
                send_batch(&mut conn.clone(), &group.cmds).await
            }
            None => {
                let mut client = self.conn.clone();
                let mut values = Vec::with_capacity(group.replies.len());
                for cmd in group.cmds.cmd_iter() {
                    values.push(client.req_packed_command(cmd).await?);
                }
                Ok(values)
            }
        }
    }
}

/// Commands of one batch for one primary (or one command the map cannot place).
struct Group<'m> {
    /// Its primary's index and the sidecar's own connection to it, when the map knows them.
    primary: Option<(u16, &'m ConnectionManager)>,
    /// Each command's caller, in the order of `cmds`.
    replies: Vec<oneshot::Sender<RedisResult<Value>>>,
    cmds: redis::Pipeline,
}

impl Group<'_> {
    fn add(&mut self, reply: oneshot::Sender<RedisResult<Value>>, cmd: Cmd) {
        self.replies.push(reply);
        self.cmds.add_command(cmd);
    }

    /// Sent as a pipeline of two or more on the sidecar's own connection.
    fn pipelined(&self) -> bool {
        self.primary.is_some() && self.replies.len() > 1
    }
}

/// `conn` once it answered a `PING` within `timeout`.
async fn answers(conn: ConnectionManager, timeout: Duration) -> RedisResult<ConnectionManager> {
    let mut pinged = conn.clone();
    let ping = redis::cmd("PING");
    match tokio::time::timeout(timeout, ping.query_async::<String>(&mut pinged)).await {
        Ok(Ok(_)) => Ok(conn),
        Ok(Err(err)) => Err(err),
        Err(_) => Err(timeout_error()),
    }
}

/// A primary's answer that the command's slot is served elsewhere now, or not at the moment
/// (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`): the command did not run, and the cluster
/// client's own path sends it again where it belongs.
/// The sidecar's own connection to the primary an `ASK` answer names, when it has one.
fn asked_primary<'m>(map: &'m ClusterMap, answer: &Value) -> Option<&'m ConnectionManager> {
    let Value::ServerError(_) = answer else {
        return None;
    };
    let err = answer.clone().extract_error().err()?;
    if err.kind() != ErrorKind::Server(redis::ServerErrorKind::Ask) {
        return None;
    }
    let (host, port) = err.redirect_node()?.0.rsplit_once(':')?;
    let port = port.parse::<u16>().ok()?;
    map.primaries
        .iter()
        .find(|p| p.host == host && p.port == port)?
        .conn
        .as_ref()
}

fn is_redirect(value: &Value) -> bool {
    matches!(value, Value::ServerError(_))
        && value
            .clone()
            .extract_error()
            .is_err_and(|e| e.is_cluster_error())
}

/// One command counted in flight until its future ends, answered or dropped.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    /// Counts one more; whether it is the only one.
    fn enter(count: &'a AtomicUsize) -> (Self, bool) {
        let before = count.fetch_add(1, Ordering::Relaxed);
        (InFlight(count), before == 0)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The commands of `pipe` as one pipeline (one as itself); one reply per command either way.
async fn send_batch(
    conn: &mut ConnectionManager,
    pipe: &redis::Pipeline,
) -> RedisResult<Vec<Value>> {
    let count = pipe.len();
    let values = match pipe.cmd_iter().next() {
        Some(cmd) if count == 1 => vec![conn.req_packed_command(cmd).await?],
        _ => conn.req_packed_commands(pipe, 0, count).await?,
    };
    if values.len() == count {
        Ok(values)
    } else {
        Err(RedisError::from((
            ErrorKind::Client,
            "a pipeline's reply count differs from its commands",
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::{ClusterTarget, Gather, Target};
    use redis::aio::ConnectionManager;
    use std::collections::BTreeSet;
    use std::sync::Arc;

    async fn gather_on(redis: &crate::testing::RedisServer) -> std::sync::Arc<Gather> {
        let client = redis::Client::open(redis.url()).unwrap();
        let conn = ConnectionManager::new(client).await.unwrap();
        Gather::new(Target::Server(conn), std::time::Duration::from_secs(5))
    }

    /// Requests are separate tasks, each sending one command as it is decoded: those sent in
    /// one scheduler pass go to Redis as one batch. (Without the flusher's yield, each of the
    /// 64 goes alone.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn commands_sent_together_reach_redis_in_a_few_writes() {
        const TASKS: i64 = 64;
        let redis = crate::testing::RedisServer::start().unwrap();
        let gather = gather_on(&redis).await;
        // Connected and idle before counting.
        let _: String =
            redis::from_redis_value(gather.send(&redis::cmd("PING")).await.unwrap()).unwrap();
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let gather = std::sync::Arc::clone(&gather);
                tokio::spawn(async move {
                    let reply = gather.send(redis::cmd("INCR").arg("n")).await.unwrap();
                    redis::from_redis_value::<i64>(reply).unwrap()
                })
            })
            .collect();
        let mut seen = BTreeSet::new();
        for task in tasks {
            seen.insert(task.await.unwrap());
        }
        // Every caller got its own command's reply.
        assert_eq!(seen, (1..=TASKS).collect::<BTreeSet<_>>());
        let batches = gather.batches();
        assert!(batches <= 8, "{TASKS} commands took {batches} batches");
    }

    /// One command's server error is its caller's alone; the rest of its batch succeeds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_command_that_fails_fails_alone() {
        let redis = crate::testing::RedisServer::start().unwrap();
        let gather = gather_on(&redis).await;
        redis.cli(&["SET", "text", "not a number"]).unwrap();
        let send = |cmd: redis::Cmd| {
            let gather = std::sync::Arc::clone(&gather);
            tokio::spawn(async move { gather.send(&cmd).await })
        };
        // In flight for 200 ms (and holding the connection's replies back): what follows is
        // gathered.
        let blocking = send(redis::cmd("BLPOP").arg("nothing").arg(0.2).clone());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let incr = |key: &str| send(redis::cmd("INCR").arg(key).clone());
        let (good, bad, other) = (incr("n"), incr("text"), incr("m"));
        let bad = bad.await.unwrap().unwrap_err();
        assert_eq!(
            bad.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError)
        );
        for ok in [good, other] {
            let value = ok.await.unwrap().unwrap();
            assert_eq!(redis::from_redis_value::<i64>(value).unwrap(), 1);
        }
        assert_eq!(blocking.await.unwrap().unwrap(), redis::Value::Nil);
        assert!(gather.batches() >= 1, "the three were gathered");
    }

    async fn cluster_gather(
        cluster: &crate::testing::RedisCluster,
    ) -> (Arc<Gather>, Arc<ClusterTarget>) {
        cluster_gather_reaching(cluster, |host, port| format!("redis://{host}:{port}")).await
    }

    /// A gather whose connections of its own to a primary go to `url(host, port)`.
    async fn cluster_gather_reaching(
        cluster: &crate::testing::RedisCluster,
        url: fn(&str, u16) -> String,
    ) -> (Arc<Gather>, Arc<ClusterTarget>) {
        let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
        gather_over(&client, url).await
    }

    /// A gather over `client`'s connection, its connections of its own to a primary going
    /// to `url(host, port)`.
    async fn gather_over(
        client: &redis::cluster::ClusterClient,
        url: fn(&str, u16) -> String,
    ) -> (Arc<Gather>, Arc<ClusterTarget>) {
        let conn = client.get_async_connection().await.unwrap();
        let target = ClusterTarget::new(
            conn,
            Box::new(move |host: &str, port: u16| {
                let client = redis::Client::open(url(host, port))?;
                ConnectionManager::new_lazy_with_config(client, Default::default())
            }),
            std::time::Duration::from_secs(2),
        );
        let gather = Gather::new(
            Target::Cluster(Arc::clone(&target)),
            std::time::Duration::from_secs(5),
        );
        (gather, target)
    }

    /// Waits (bounded) until the slot map's view of slot 0, (placed, with a connection of
    /// its own), satisfies `read`.
    async fn map_read(target: &ClusterTarget, read: fn((bool, bool)) -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !read(target.knows(0)) {
            assert!(
                std::time::Instant::now() < deadline,
                "the slot map was not read"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// The gather of a store connected to `cfg` as the sidecar connects (`Conn::connect`,
    /// with the sidecar's connection settings), once its slot map has connections of its own.
    async fn sidecar_gather(
        cfg: &crate::config::RedisConfig,
        timeout: std::time::Duration,
    ) -> (Arc<Gather>, Arc<ClusterTarget>) {
        let conn = super::super::conn::Conn::connect(cfg, timeout)
            .await
            .unwrap();
        let gather = Arc::clone(conn.gather());
        let Target::Cluster(target) = gather.target() else {
            panic!("a Cluster configuration gave another target");
        };
        let target = Arc::clone(target);
        map_read(&target, |(_, connected)| connected).await;
        (gather, target)
    }

    /// The index (in [`crate::testing::RedisCluster::nodes`]) of the node on `port`.
    fn node_index(cluster: &crate::testing::RedisCluster, port: u16) -> usize {
        cluster
            .nodes()
            .iter()
            .position(|n| n.port() == port)
            .expect("a node of the cluster")
    }

    /// The port of the primary serving `slot`, as `CLUSTER NODES` says now, and that reply.
    fn primary_port(cluster: &crate::testing::RedisCluster, slot: u16) -> (u16, String) {
        use super::super::slots::{SlotOwners, primaries};
        let nodes = cluster.nodes()[0].cli(&["CLUSTER", "NODES"]).unwrap();
        let owner = SlotOwners::from_cluster_nodes(&nodes).owner(slot).unwrap();
        let port = primaries(&nodes).nth(usize::from(owner)).unwrap().port;
        (port, nodes)
    }

    /// `INCR` of 64 keys spread over the Cluster's slots, each on a task of its own, all
    /// in flight together: the replies, by key.
    async fn incr_spread(gather: &Arc<Gather>) -> Vec<i64> {
        try_incr_spread(gather)
            .await
            .into_iter()
            .map(|reply| reply.unwrap())
            .collect()
    }

    /// [`incr_spread`], each reply as it came, error or not.
    async fn try_incr_spread(gather: &Arc<Gather>) -> Vec<redis::RedisResult<i64>> {
        try_incr_spread_within(gather, std::time::Duration::from_secs(5)).await
    }

    /// [`try_incr_spread`], each command bounded by `timeout` as the store bounds its calls
    /// (`RedisStore::bounded`: a call that runs out of it is noted, `Conn::timed_out`).
    async fn try_incr_spread_within(
        gather: &Arc<Gather>,
        timeout: std::time::Duration,
    ) -> Vec<redis::RedisResult<i64>> {
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let gather = Arc::clone(gather);
                tokio::spawn(async move {
                    let cmd = redis::cmd("INCR").arg(format!("n:{{{i}}}")).clone();
                    let Ok(reply) = tokio::time::timeout(timeout, gather.send(&cmd)).await else {
                        let timed_out = super::timeout_error();
                        gather.target().note(Err(&timed_out)).await;
                        return Err(timed_out);
                    };
                    reply.and_then(|v| Ok(redis::from_redis_value::<i64>(v)?))
                })
            })
            .collect();
        let mut replies = Vec::new();
        for task in tasks {
            replies.push(task.await.unwrap());
        }
        replies
    }

    /// Once the slot map is read, commands sent together go in one pipeline per primary,
    /// each answered by its own key's primary.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_clusters_commands_go_in_one_pipeline_per_primary() {
        let cluster = crate::testing::RedisCluster::start().unwrap();
        let (gather, target) = cluster_gather(&cluster).await;
        map_read(&target, |(_, connected)| connected).await;
        // What the primaries read: one read per command when each goes on its own.
        let reads = || -> u64 {
            cluster
                .nodes()
                .iter()
                .map(|node| {
                    let stats = node.cli(&["INFO", "stats"]).unwrap();
                    stats
                        .lines()
                        .find_map(|l| l.strip_prefix("total_reads_processed:"))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .unwrap()
                })
                .sum()
        };
        let before = reads();
        assert_eq!(incr_spread(&gather).await, vec![1; 64]);
        assert_eq!(incr_spread(&gather).await, vec![2; 64]);
        // Each `INFO` is a read of its own as well.
        let read = reads() - before - 3;
        assert!(
            read <= 40,
            "128 commands took {read} reads at the primaries"
        );
        // All but the first of each round (sent alone) and a primary's lone command of a
        // batch went in pipelines.
        let pipelined = target.pipelined();
        assert!(pipelined >= 96, "{pipelined} of 128 commands in pipelines");
    }

    /// A slot map that names the wrong primary for most slots (one primary owning them all,
    /// as after a reshard the map has not seen) costs redirects, not errors: each command a
    /// primary answers `MOVED` goes again on its own, to the primary the client finds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_slot_map_costs_redirects_not_errors() {
        let cluster = crate::testing::RedisCluster::start().unwrap();
        let (gather, target) = cluster_gather(&cluster).await;
        // Past the first read of the map, which would replace the stale one.
        map_read(&target, |(_, connected)| connected).await;
        let first = cluster.nodes()[0].port();
        target
            .set_map(&format!(
                "a 127.0.0.1:{first}@2 master - 0 0 1 connected 0-16383\n"
            ))
            .await;
        // Each ran once, on its own key's primary.
        assert_eq!(incr_spread(&gather).await, vec![1; 64]);
        assert!(target.pipelined() > 0, "the stale map's pipeline was used");
        let errors = cluster.nodes()[0].cli(&["INFO", "errorstats"]).unwrap();
        assert!(
            errors.contains("errorstat_MOVED:count="),
            "the first primary redirected none: {errors}"
        );
    }

    /// A slot being migrated answers `ASK` for a key its old primary no longer has (here:
    /// none yet, so every key of the slot): each such command goes again on its own through
    /// the client, which sends it with `ASKING` to the importing primary, and runs there
    /// exactly once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_migrating_slots_ask_sends_the_command_to_the_importing_primary() {
        use super::super::slots::key_slot;
        let cluster = crate::testing::RedisCluster::start().unwrap();
        let (gather, target) = cluster_gather(&cluster).await;
        map_read(&target, |(_, connected)| connected).await;
        // Every key of this test shares one slot (the hash tag): one primary's pipeline.
        let slot = key_slot(b"{ask}");
        let (owner_port, _) = primary_port(&cluster, slot);
        let node = |port: u16| &cluster.nodes()[node_index(&cluster, port)];
        let (from, to) = (
            node(owner_port),
            cluster
                .nodes()
                .iter()
                .find(|n| n.port() != owner_port)
                .unwrap(),
        );
        let id = |n: &crate::testing::RedisServer| n.cli(&["CLUSTER", "MYID"]).unwrap();
        let slot_arg = slot.to_string();
        let set = |on: &crate::testing::RedisServer, state: &str, peer: &str| {
            let reply = on
                .cli(&["CLUSTER", "SETSLOT", &slot_arg, state, peer.trim()])
                .unwrap();
            assert_eq!(reply.trim(), "OK", "SETSLOT {state}: {reply}");
        };
        set(to, "IMPORTING", &id(from));
        set(from, "MIGRATING", &id(to));
        let incr_all = || {
            let tasks: Vec<_> = (0..16)
                .map(|i| {
                    let gather = Arc::clone(&gather);
                    tokio::spawn(async move {
                        let cmd = redis::cmd("INCR").arg(format!("{{ask}}:{i}")).clone();
                        redis::from_redis_value::<i64>(gather.send(&cmd).await.unwrap()).unwrap()
                    })
                })
                .collect::<Vec<_>>();
            async move {
                let mut replies = Vec::new();
                for task in tasks {
                    replies.push(task.await.unwrap());
                }
                replies
            }
        };
        // Each ran once, and the second time found what the first wrote.
        assert_eq!(incr_all().await, vec![1; 16]);
        assert_eq!(incr_all().await, vec![2; 16]);
        assert!(
            target.pipelined() > 0,
            "the migrating primary's pipeline was used"
        );
        let errors = from.cli(&["INFO", "errorstats"]).unwrap();
        assert!(
            errors.contains("errorstat_ASK:count="),
            "the migrating primary answered no ASK: {errors}"
        );
        let count = |n: &crate::testing::RedisServer| {
            let reply = n.cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot_arg]).unwrap();
            reply.trim().parse::<u64>().unwrap()
        };
        assert_eq!(
            (count(from), count(to)),
            (0, 16),
            "the keys live on the importing primary"
        );
    }

    /// A Cluster reached over TLS (`rediss://` seeds, a private CA, the client certificate
    /// Redis asks for): the primaries' own connections take the seed's TLS settings at the
    /// addresses the Cluster lists (its nodes' TLS ports, `tls-cluster yes`), answer, and
    /// carry the pipelines. Were they refused (a certificate not matching the listed address,
    /// say), the map would never have them and the wait below would fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tls_clusters_primaries_are_pipelined_on_tls_connections_of_their_own() {
        use crate::config::{RedisConfig, RedisTopology};
        use crate::testing::tls::{Pki, redis_has_tls};
        if !redis_has_tls() {
            eprintln!("SKIPPED: the installed redis-server was built without TLS support");
            return;
        }
        let pki = Pki::create().unwrap();
        let cluster = pki.redis_cluster().unwrap();
        let urls = cluster
            .nodes()
            .iter()
            .map(|node| {
                let reply = node.cli(&["CONFIG", "GET", "tls-port"]).unwrap();
                let port = reply.lines().last().unwrap().trim().parse::<u16>().unwrap();
                format!("rediss://127.0.0.1:{port}")
            })
            .collect();
        let cfg = RedisConfig {
            urls,
            topology: RedisTopology::Cluster,
            prefix: "idemgate".into(),
            tls: pki.client_tls().unwrap(),
        };
        let (gather, target) = sidecar_gather(&cfg, std::time::Duration::from_secs(5)).await;
        assert_eq!(incr_spread(&gather).await, vec![1; 64]);
        assert_eq!(incr_spread(&gather).await, vec![2; 64]);
        let pipelined = target.pipelined();
        assert!(pipelined >= 96, "{pipelined} of 128 commands in pipelines");
    }

    /// A primary that dies is replaced by its replica, the Cluster's own failover: the
    /// commands for its slots fail while it is down, then reach the promoted replica, on a
    /// connection of the sidecar's own once the slot map is read again (the errors ask for
    /// that). No command is lost to a stale map after the failover.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_failover_commands_reach_the_promoted_replica_on_an_own_connection() {
        failover(|cluster, index| cluster.stop_node(index)).await;
    }

    /// A primary that hangs (a frozen host, a partition) rather than dies: its commands
    /// answer nothing, and fail only at the store timeout, so it is the time-outs that must
    /// ask for the slot map (and the map read must not wait on the hung node). Meanwhile the
    /// other primaries' commands in the same batches are answered at once, not held until
    /// the hung one's time out. Without the time-outs asking, the map was never read again
    /// once the Cluster had failed over, and the slots stayed on the hung node for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_hung_primarys_failover_commands_reach_the_promoted_replica() {
        failover(|cluster, index| cluster.freeze_node(index).unwrap()).await;
    }

    /// Loses slot 0's primary with `lose` (on a Cluster with replicas, a one-second store
    /// timeout), then sends rounds of [`try_incr_spread`] until one whole round succeeds:
    /// it must within 30 s, on the promoted replica's own connection, and the lost
    /// primary's failing commands must not have failed the others in their rounds.
    async fn failover(lose: impl FnOnce(&mut crate::testing::RedisCluster, usize)) {
        let mut cluster = crate::testing::RedisCluster::with_replicas().unwrap();
        let crate::StoreConfig::Redis(cfg) = cluster.store_config() else {
            panic!("a Cluster's store configuration is Redis");
        };
        // A one-second store timeout: each failing round costs that at most.
        let timeout = std::time::Duration::from_secs(1);
        let (gather, target) = sidecar_gather(&cfg, timeout).await;
        assert_eq!(incr_spread(&gather).await, vec![1; 64]);
        // Slot 0's primary, and the replica of it.
        let (owner_port, nodes) = primary_port(&cluster, 0);
        let line_of = |port: u16| {
            nodes
                .lines()
                .find(|l| l.contains(&format!("127.0.0.1:{port}@")))
                .unwrap()
                .to_owned()
        };
        let owner_id = line_of(owner_port)
            .split_whitespace()
            .next()
            .unwrap()
            .to_owned();
        let replica_port = cluster
            .nodes()
            .iter()
            .map(crate::testing::RedisServer::port)
            .find(|port| line_of(*port).split_whitespace().nth(3) == Some(owner_id.as_str()))
            .expect("slot 0's primary has a replica");
        let index = node_index(&cluster, owner_port);
        lose(&mut cluster, index);
        let lost = std::time::Instant::now();
        // Bounded: the node timeout is 2 s, the failover a few seconds after it.
        let deadline = lost + std::time::Duration::from_secs(30);
        let mut failed_rounds = 0;
        let mut partly_failed_rounds = 0;
        loop {
            let replies = try_incr_spread_within(&gather, timeout).await;
            let failed = replies.iter().filter(|r| r.is_err()).count();
            if failed == 0 {
                break;
            }
            failed_rounds += 1;
            if failed < replies.len() {
                partly_failed_rounds += 1;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no recovery after the failover: {:?}",
                replies.iter().find(|r| r.is_err())
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        assert!(failed_rounds > 0, "the lost primary's slots never failed");
        // Before the Cluster notices (the 2 s node timeout), only the lost primary's
        // commands fail.
        assert!(
            partly_failed_rounds > 0,
            "the lost primary's commands failed the other primaries' too"
        );
        eprintln!(
            "recovered {:?} after the loss, {failed_rounds} rounds failing",
            lost.elapsed()
        );
        // Served by the promoted replica on a connection of the sidecar's own.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while target.connected_owner_port(0) != Some(replica_port) {
            assert!(
                std::time::Instant::now() < deadline,
                "slot 0 is mapped to {:?}, not the promoted replica {replica_port}",
                target.connected_owner_port(0)
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let before = target.pipelined();
        assert!(try_incr_spread(&gather).await.iter().all(Result::is_ok));
        assert!(
            target.pipelined() > before,
            "the promoted replica's pipelines were used"
        );
    }

    /// The slot map's `CLUSTER NODES` is answered while a primary hangs, every time and
    /// at once: it is asked of every primary and the client together, and the first answer
    /// is taken. Asked through the client alone, it goes to a node of the client's choosing,
    /// the hung one among them, and then waits out the timeout and fails (the hung-primary
    /// failover through the API recovered 18 and 28 s after the freeze in two runs of three
    /// that way, against 4–5 s).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_slot_map_is_read_while_a_primary_hangs() {
        let cluster = crate::testing::RedisCluster::start().unwrap();
        let (_gather, target) = cluster_gather(&cluster).await;
        map_read(&target, |(_, connected)| connected).await;
        cluster.freeze_node(0).unwrap();
        // Twenty reads: through the client alone about one in three would go to the hung
        // node (it picks among the three primaries).
        for read in 0..20 {
            let started = std::time::Instant::now();
            let nodes = target.cluster_nodes().await;
            assert!(
                nodes.is_ok() && started.elapsed() < std::time::Duration::from_millis(500),
                "read {read}: {:?} after {:?}",
                nodes.map(|n| n.lines().count()),
                started.elapsed()
            );
        }
    }

    /// A primary that hangs for a moment, shorter than the Cluster's node timeout (no
    /// failover follows), loses its connection of the sidecar's own at the map read its
    /// time-outs ask for (it does not answer the map's `PING`), and gets it back once it
    /// answers again: its commands go in pipelines again, not one write each through the
    /// client for good (as they did before `reconnect_soon`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_primary_that_hung_for_a_moment_gets_its_own_connection_back() {
        let cluster = crate::testing::RedisCluster::start().unwrap();
        let crate::StoreConfig::Redis(cfg) = cluster.store_config() else {
            panic!("a Cluster's store configuration is Redis");
        };
        let timeout = std::time::Duration::from_secs(1);
        let (gather, target) = sidecar_gather(&cfg, timeout).await;
        let (port, _) = primary_port(&cluster, 0);
        let node = &cluster.nodes()[node_index(&cluster, port)];
        node.freeze().unwrap();
        let frozen = try_incr_spread_within(&gather, timeout).await;
        assert!(
            frozen.iter().any(Result::is_err),
            "the frozen primary answered"
        );
        // The map read its time-outs asked for drops its connection (bounded: the read's
        // `PING` waits the store timeout).
        map_read(&target, |(placed, connected)| placed && !connected).await;
        node.thaw().unwrap();
        // Bounded: the next try comes within RECONNECT_AFTER of the last.
        let deadline = std::time::Instant::now() + super::RECONNECT_AFTER * 3;
        loop {
            let before = target.pipelined();
            let replies = try_incr_spread_within(&gather, timeout).await;
            assert!(replies.iter().all(Result::is_ok), "{replies:?}");
            let pipelined = target.pipelined() - before;
            if target.knows(0) == (true, true) && pipelined >= 56 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "slot 0's primary is still without its own connection ({pipelined} of 64 \
                 commands pipelined)"
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    /// A command that fails through the cluster client asks for the slot map, as one that
    /// fails on a connection of the sidecar's own does: a primary the map keeps without a
    /// connection (one that did not answer the map's `PING`: it hangs) is reached through the
    /// client, whose own response timeout can end the call before the store timeout does,
    /// and then nothing else asked (the hung-primary failover through the API stayed on the
    /// hung node past its 20 s bound in about one run of three).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_command_failing_through_the_client_asks_for_the_slot_map() {
        let mut cluster = crate::testing::RedisCluster::start().unwrap();
        // No connections of its own (a closed port), and a client that gives up at once.
        let client = redis::cluster::ClusterClientBuilder::new(cluster.urls())
            .retries(0)
            .response_timeout(std::time::Duration::from_secs(1))
            .build()
            .unwrap();
        let (gather, target) = gather_over(&client, |_, _| "redis://127.0.0.1:1".to_owned()).await;
        map_read(&target, |(placed, connected)| placed && !connected).await;
        // Past the re-read interval, so that a read can start again.
        tokio::time::sleep(super::REREAD_AFTER * 2).await;
        let (port, _) = primary_port(&cluster, 0);
        cluster.stop_node(node_index(&cluster, port));
        // A key of the stopped primary's: slot 0 is its.
        let key = (0..)
            .map(|i| format!("k{i}"))
            .find(|key| super::super::slots::key_slot(key.as_bytes()) == 0)
            .unwrap();
        let reads = target.map_reads();
        let sent = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            gather.send(redis::cmd("INCR").arg(&key)),
        )
        .await;
        assert!(matches!(sent, Ok(Err(_))), "{sent:?}");
        assert!(
            target.map_reads() > reads,
            "the failure did not ask for the slot map"
        );
    }

    /// A primary the sidecar cannot reach on a connection of its own (here every one: the
    /// connections go to a closed port, as a TLS name that does not match the listed address
    /// would fail) costs the batching, not the commands: they go through the cluster client.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn primaries_without_a_connection_of_its_own_go_through_the_client() {
        let cluster = crate::testing::RedisCluster::start().unwrap();
        let (gather, target) =
            cluster_gather_reaching(&cluster, |_, _| "redis://127.0.0.1:1".to_owned()).await;
        map_read(&target, |(placed, _)| placed).await;
        assert_eq!(target.knows(0), (true, false));
        assert_eq!(incr_spread(&gather).await, vec![1; 64]);
        assert_eq!(target.pipelined(), 0);
    }
}
