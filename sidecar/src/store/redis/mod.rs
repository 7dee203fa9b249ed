//! The Redis store: the scripts of `scripts.rs` over the keys of `keys.rs`, on a standalone
//! server, a Sentinel-managed master or a Cluster, plus this process's notification inbox.
//!
//! Connections reconnect by themselves (redis-rs `ConnectionManager`, the cluster client,
//! re-resolving the Sentinel master after an error); every operation is bounded by the
//! store timeout. Redis errors become [`StoreError`]s in one place, [`classify`].
//!
//! Wake-ups: every sidecar process subscribes to one channel, its inbox; scripts that hand
//! a key to a queued waiter PUBLISH the waiter's owner token there. Plain PUBLISH reaches
//! subscribers on any Cluster node, so one subscription per process suffices whatever the
//! topology. Lost messages are covered by the waiters' re-check interval, and every
//! (re)subscription wakes all local waiters to re-check at once.

mod keys;
mod rate;
mod scripts;

use super::{
    ClaimArgs, ClaimReply, ClaimStep, CompletedInfo, Grant, HolderInfo, KeyInfo, KeyState,
    LeaveStep, Store, StoreError, StoreResult, Stored, millis,
};
use crate::config::{RedisConfig, RedisTls, RedisTopology, redact_url};
use crate::waiters::Waiters;
use bytes::Bytes;
use futures_util::StreamExt;
use idemgate_wire::{Mode, OwnerOutcome, StoredResponse};
use keys::LockKeys;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::sentinel::{
    SentinelClient, SentinelClientBuilder, SentinelNodeConnectionInfo, SentinelServerType,
};
use redis::{
    Cmd, ErrorKind, FromRedisValue, IntoConnectionInfo, RedisError, RetryMethod, Script,
    ServerErrorKind, Value,
};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, RwLock};
use tokio::task::JoinHandle;

/// Converts a Redis error, deciding once whether retrying can help.
fn classify(err: RedisError) -> StoreError {
    let permanent = matches!(err.retry_method(), RetryMethod::NoRetry)
        || err.kind() == ErrorKind::AuthenticationFailed;
    if permanent {
        StoreError::Permanent(err.to_string())
    } else {
        StoreError::Transient(err.to_string())
    }
}

/// TCP_NODELAY (redis-rs leaves Nagle on by default, which delays small request/response
/// exchanges) and keep-alive (a dead peer is noticed on an idle connection).
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(
            redis::io::tcp::socket2::TcpKeepalive::new().with_time(Duration::from_secs(30)),
        )
}

fn connection_info(url: &str) -> StoreResult<redis::ConnectionInfo> {
    Ok(url
        .into_connection_info()
        .map_err(classify)?
        .set_tcp_settings(tcp_settings()))
}

/// The configured CA and client certificate, when there are any.
fn certificates(tls: &RedisTls) -> Option<redis::TlsCertificates> {
    (!tls.is_empty()).then(|| redis::TlsCertificates {
        client_tls: tls
            .client_pem
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: tls.ca_pem.clone(),
    })
}

/// A client for one node; a `rediss://` URL gets the configured certificates.
fn node_client(url: &str, tls: &RedisTls) -> Result<redis::Client, RedisError> {
    let info = url.into_connection_info()?.set_tcp_settings(tcp_settings());
    match certificates(tls) {
        Some(certs) if url.starts_with("rediss://") => redis::Client::build_with_tls(info, certs),
        _ => redis::Client::open(info),
    }
}

fn unexpected(what: &str) -> StoreError {
    StoreError::Permanent(format!("unexpected reply from Redis: {what}"))
}

/// One logical connection, whatever the topology; cheap to clone per call.
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(Box<SentinelConn>),
}

/// The master behind Sentinels: resolved lazily and again after any transient error, so a
/// failover is followed without restarting.
struct SentinelConn {
    sentinel: Mutex<SentinelClient>,
    current: RwLock<Option<ConnectionManager>>,
    config: ConnectionManagerConfig,
}

impl SentinelConn {
    async fn get(&self) -> Result<ConnectionManager, RedisError> {
        if let Some(conn) = self.current.read().await.as_ref() {
            return Ok(conn.clone());
        }
        let mut current = self.current.write().await;
        if let Some(conn) = current.as_ref() {
            return Ok(conn.clone());
        }
        let client = self.sentinel.lock().await.async_get_client().await?;
        let conn = ConnectionManager::new_lazy_with_config(client, self.config.clone())?;
        *current = Some(conn.clone());
        Ok(conn)
    }

    /// After a failover the old master refuses writes (READONLY) or is gone: any error
    /// worth retrying makes the next call ask the Sentinels again.
    async fn checked<T>(&self, result: Result<T, RedisError>) -> Result<T, RedisError> {
        if result
            .as_ref()
            .is_err_and(|e| !matches!(e.retry_method(), RetryMethod::NoRetry))
        {
            *self.current.write().await = None;
        }
        result
    }
}

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
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        self.subscriber.abort();
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
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let first_url = cfg
            .urls
            .first()
            .ok_or_else(|| StoreError::Permanent("no Redis URL".into()))?;
        let conn = match &cfg.topology {
            RedisTopology::Standalone => {
                let client = node_client(first_url, &cfg.tls).map_err(classify)?;
                Conn::Single(
                    ConnectionManager::new_lazy_with_config(client, manager_config)
                        .map_err(classify)?,
                )
            }
            RedisTopology::Cluster => {
                let nodes = cfg
                    .urls
                    .iter()
                    .map(|u| connection_info(u))
                    .collect::<StoreResult<Vec<_>>>()?;
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes)
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .retries(2);
                if let Some(certs) = certificates(&cfg.tls) {
                    builder = builder.certs(certs);
                }
                let client = builder.build().map_err(classify)?;
                Conn::Cluster(client.get_async_connection().await.map_err(classify)?)
            }
            RedisTopology::Sentinel { master } => Conn::Sentinel(Box::new(SentinelConn {
                sentinel: Mutex::new(sentinel_client(cfg, master)?),
                current: RwLock::new(None),
                config: manager_config,
            })),
        };
        let inbox = crate::locks::random_token();
        let inbox_prefix = keys::inbox_prefix(&cfg.prefix);
        let (subscribed_tx, subscribed_rx) = tokio::sync::oneshot::channel();
        let subscriber = tokio::spawn(subscribe_inbox(
            cfg.clone(),
            format!("{inbox_prefix}{inbox}"),
            Arc::clone(&waiters),
            subscribed_tx,
        ));
        // Wait (bounded) for the first subscription so the first hand-offs are prompt; if
        // Redis is down the store still starts and reports not ready until it is back.
        let _ = tokio::time::timeout(timeout, subscribed_rx).await;
        Ok(RedisStore {
            conn,
            prefix: cfg.prefix.clone(),
            inbox_prefix,
            inbox,
            waiters,
            record_ttl_ms: millis(fence_ttl),
            timeout,
            subscriber,
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
        match tokio::time::timeout(self.timeout, request).await {
            Ok(result) => result.map_err(classify),
            Err(_) => Err(StoreError::Transient(format!(
                "Redis did not answer within {:?}",
                self.timeout
            ))),
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
            (Some((host, port)), Conn::Cluster(c)) => {
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
        let run = async {
            match &self.conn {
                Conn::Single(c) => op.send(&mut c.clone()).await,
                Conn::Cluster(c) => op.send(&mut c.clone()).await,
                Conn::Sentinel(s) => {
                    let result = match s.get().await {
                        Ok(mut c) => op.send(&mut c).await,
                        Err(e) => Err(e),
                    };
                    s.checked(result).await
                }
            }
        };
        self.bounded(run).await
    }

    async fn release_script(
        &self,
        script: &Script,
        key: &str,
        owner: Option<&str>,
    ) -> StoreResult<Value> {
        let k = self.keys(key);
        let mut cmd = evalsha(script, &k.all());
        if let Some(owner) = owner {
            cmd.arg(owner);
        }
        cmd.arg(self.record_ttl_ms).arg(&self.inbox_prefix);
        self.run(Op::Script(script, &cmd)).await
    }

    /// Which of `records` (found by SCAN) are held by an unexpired lease now (Redis's
    /// clock): a record outlives its holder, keeping the fence.
    async fn held_among(&self, records: &[String]) -> StoreResult<Vec<String>> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let (secs, micros): (u64, u64) = self.run(Op::Command(&redis::cmd("TIME"))).await?;
        let now_us = secs.saturating_mul(1_000_000).saturating_add(micros);
        let checks = records.iter().map(|record| async move {
            let mut cmd = redis::cmd("HMGET");
            cmd.arg(record).arg("owner").arg("at").arg("lease");
            let (owner, at, lease): (Option<String>, Option<u64>, Option<u64>) =
                self.run(Op::Command(&cmd)).await?;
            let ends = at
                .zip(lease)
                .map(|(at, lease)| at.saturating_add(lease.saturating_mul(1000)));
            let held = owner.is_some() && ends.is_some_and(|end| end > now_us);
            Ok::<_, StoreError>(if held {
                keys::key_of_state(&self.prefix, record)
            } else {
                None
            })
        });
        let found = futures_util::future::try_join_all(checks).await?;
        Ok(found.into_iter().flatten().collect())
    }
}

/// The primaries of a Cluster (`host`, `port`) from a `CLUSTER NODES` reply; failed ones
/// are left out (their slots' keys are listed once a replica took over).
fn cluster_primaries(nodes: &str) -> Vec<(String, u16)> {
    nodes
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let address = fields.nth(1)?;
            let flags = fields.next()?;
            let flag = |f: &str| flags.split(',').any(|x| x == f);
            if !flag("master") || flag("fail") || flag("noaddr") {
                return None;
            }
            // `ip:port@cport[,hostname]`
            let (host, port) = address.split(['@', ',']).next()?.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect()
}

/// What [`RedisStore::run`] sends.
#[derive(Clone, Copy)]
enum Op<'a> {
    Command(&'a Cmd),
    /// An `EVALSHA` built by [`evalsha`] for this script: loaded and retried once when the
    /// server does not know the script (first use, restart, failover).
    Script(&'a Script, &'a Cmd),
}

impl Op<'_> {
    async fn send<C, T>(self, conn: &mut C) -> Result<T, RedisError>
    where
        C: redis::aio::ConnectionLike + Send,
        T: FromRedisValue,
    {
        match self {
            Op::Command(cmd) => cmd.query_async(conn).await,
            Op::Script(script, cmd) => match cmd.query_async(conn).await {
                Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    script.load_async(conn).await?;
                    cmd.query_async(conn).await
                }
                other => other,
            },
        }
    }
}

/// `EVALSHA <sha> <numkeys> <keys...>`, ready for the script's ARGV: built straight into one
/// command buffer (redis-rs's `ScriptInvocation` copies every key and argument twice).
fn evalsha(script: &Script, keys: &[&str]) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(keys.len());
    for key in keys {
        cmd.arg(*key);
    }
    cmd
}

fn sentinel_client(cfg: &RedisConfig, master: &str) -> StoreResult<SentinelClient> {
    let first = cfg
        .urls
        .first()
        .ok_or_else(|| StoreError::Permanent("no Sentinel URL".into()))?;
    let info = connection_info(first)?;
    if let Some(certs) = certificates(&cfg.tls) {
        return tls_sentinel_client(cfg, master, &info, certs);
    }
    let mut node = SentinelNodeConnectionInfo::default()
        .set_redis_connection_info(info.redis_settings().clone())
        .set_tcp_settings(info.tcp_settings().clone());
    if first.starts_with("rediss://") {
        node = node.set_tls_mode(redis::TlsMode::Secure);
    }
    SentinelClient::build(
        cfg.urls.iter().map(String::as_str).collect(),
        master,
        Some(node),
        SentinelServerType::Master,
    )
    .map_err(classify)
}

/// With a private CA or a client certificate: only the builder hands certificates to both
/// the Sentinel connections and the master's (the configuration made every URL `rediss://`).
/// The first URL's user, password and database apply to both, as one URL per Sentinel could
/// not say which credentials are the master's.
fn tls_sentinel_client(
    cfg: &RedisConfig,
    master: &str,
    first: &redis::ConnectionInfo,
    certs: redis::TlsCertificates,
) -> StoreResult<SentinelClient> {
    let sentinels = cfg
        .urls
        .iter()
        .map(|url| connection_info(url).map(|info| info.addr().clone()))
        .collect::<StoreResult<Vec<_>>>()?;
    let auth = first.redis_settings();
    let mut builder = SentinelClientBuilder::new(sentinels, master, SentinelServerType::Master)
        .map_err(classify)?
        .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure)
        .set_client_to_sentinel_certificates(certs.clone())
        .set_client_to_sentinel_tcp_settings(tcp_settings())
        .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
        .set_client_to_redis_certificates(certs)
        .set_client_to_redis_tcp_settings(tcp_settings())
        .set_client_to_redis_db(auth.db());
    if let Some(user) = auth.username() {
        builder = builder
            .set_client_to_sentinel_username(user)
            .set_client_to_redis_username(user);
    }
    if let Some(password) = auth.password() {
        builder = builder
            .set_client_to_sentinel_password(password)
            .set_client_to_redis_password(password);
    }
    builder.build().map_err(classify)
}

/// A plain client to one node that receives PUBLISHed messages (any Cluster node does).
async fn pubsub_client(cfg: &RedisConfig, attempt: usize) -> Result<redis::Client, RedisError> {
    match &cfg.topology {
        RedisTopology::Sentinel { master } => {
            let mut sentinel = sentinel_client(cfg, master)
                .map_err(|e| RedisError::from((ErrorKind::Client, "sentinel", e.to_string())))?;
            sentinel.async_get_client().await
        }
        _ => {
            let n = cfg.urls.len().max(1);
            let url = cfg.urls.get(attempt % n).map_or("", String::as_str);
            node_client(url, &cfg.tls)
        }
    }
}

/// Keeps this process subscribed to its inbox, forever (aborted with the store).
async fn subscribe_inbox(
    cfg: RedisConfig,
    channel: String,
    waiters: Arc<Waiters>,
    subscribed: tokio::sync::oneshot::Sender<()>,
) {
    let mut subscribed = Some(subscribed);
    let mut attempt = 0usize;
    // Retries back off to this, so an outage neither floods the log nor delays the
    // resubscription much once Redis is back (waiters re-check meanwhile anyway).
    const MAX_BACKOFF: Duration = Duration::from_secs(2);
    let mut backoff = Duration::from_millis(100);
    loop {
        let result = async {
            let client = pubsub_client(&cfg, attempt).await?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, RedisError>(pubsub)
        }
        .await;
        match result {
            Ok(mut pubsub) => {
                attempt = 0;
                backoff = Duration::from_millis(100);
                if let Some(tx) = subscribed.take() {
                    let _ = tx.send(());
                }
                // Anything published while we were not subscribed is lost: re-check all.
                waiters.wake_all();
                let mut messages = pubsub.on_message();
                while let Some(msg) = messages.next().await {
                    if let Ok(owner) = std::str::from_utf8(msg.get_payload_bytes()) {
                        waiters.wake(owner);
                    }
                }
                tracing::warn!("Redis inbox subscription lost; resubscribing");
            }
            Err(err) => {
                let url = cfg.urls.get(attempt % cfg.urls.len().max(1));
                tracing::warn!(
                    url = %url.map(|u| redact_url(u)).unwrap_or_default(),
                    error = %err,
                    "cannot subscribe to the Redis inbox; retrying"
                );
                attempt = attempt.wrapping_add(1);
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

// === decoding script replies ===

fn text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn number(v: Option<&Value>) -> StoreResult<u64> {
    match v {
        Some(Value::Int(i)) => u64::try_from(*i).map_err(|_| unexpected("negative number")),
        other => text(other)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected("number expected")),
    }
}

fn count(v: Option<&Value>) -> StoreResult<u32> {
    number(v).map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

fn grant_at(items: &[Value], at: usize) -> StoreResult<Grant> {
    Ok(Grant {
        fence: number(items.get(at))?,
        lease_ms: number(items.get(at + 1))?,
        granted_at_us: number(items.get(at + 2))?,
    })
}

fn decode_claim(items: &[Value]) -> StoreResult<ClaimReply> {
    let tag = text(items.first()).ok_or_else(|| unexpected("claim outcome"))?;
    let lease_expired = number(items.get(1))? == 1;
    let step = match tag.as_str() {
        "granted" => ClaimStep::Granted(grant_at(items, 2)?),
        "completed" => {
            let status =
                u16::try_from(number(items.get(2))?).map_err(|_| unexpected("stored status"))?;
            let headers: Vec<(String, String)> = text(items.get(3))
                .and_then(|h| serde_json::from_str(&h).ok())
                .ok_or_else(|| unexpected("stored headers"))?;
            let body = match items.get(4) {
                Some(Value::BulkString(b)) => Bytes::from(b.clone()),
                _ => return Err(unexpected("stored body")),
            };
            ClaimStep::Completed(Stored {
                response: StoredResponse { status, headers },
                body,
            })
        }
        "mismatch" => ClaimStep::Mismatch,
        "busy" => ClaimStep::Busy {
            retry_after_ms: number(items.get(2))?,
            queue_len: count(items.get(3))?,
        },
        "queue_full" => ClaimStep::QueueFull {
            retry_after_ms: number(items.get(2))?,
            queue_len: count(items.get(3))?,
        },
        "queued" => ClaimStep::Queued {
            position: count(items.get(2))?,
            queue_len: count(items.get(3))?,
            holder_ttl_ms: number(items.get(4))?,
        },
        "left" => ClaimStep::Left,
        other => return Err(unexpected(other)),
    };
    Ok(ClaimReply {
        step,
        lease_expired,
    })
}

fn owner_outcome(reply: &str) -> StoreResult<OwnerOutcome> {
    match reply {
        "released" => Ok(OwnerOutcome::Released),
        "stale" => Ok(OwnerOutcome::Stale),
        other => Err(unexpected(other)),
    }
}

impl Store for RedisStore {
    fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    async fn claim(&self, args: &ClaimArgs<'_>) -> StoreResult<ClaimReply> {
        let k = self.keys(args.key);
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
            // A record outlives every lease granted in it by a second.
            .arg(
                self.record_ttl_ms
                    .max(millis(args.lease).saturating_add(1000)),
            )
            .arg(&self.inbox_prefix)
            .arg(&self.inbox)
            .arg(waiter)
            .arg(alive_ms);
        let items: Vec<Value> = self.run(Op::Script(script, &cmd)).await?;
        decode_claim(&items)
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
    ) -> StoreResult<OwnerOutcome> {
        let k = self.keys(key);
        let (store, status, headers, body) = match response {
            Some(stored) => (
                "1",
                stored.response.status,
                serde_json::to_string(&stored.response.headers)
                    .map_err(|e| StoreError::Permanent(e.to_string()))?,
                stored.body,
            ),
            None => ("0", 0, String::new(), Bytes::new()),
        };
        let script = &*scripts::COMPLETE;
        let mut cmd = evalsha(script, &k.all());
        cmd.arg(owner)
            .arg(millis(retention).max(1))
            .arg(store)
            .arg(status)
            .arg(headers)
            .arg(body.as_ref())
            .arg(self.record_ttl_ms)
            .arg(&self.inbox_prefix);
        let reply: String = self.run(Op::Script(script, &cmd)).await?;
        owner_outcome(&reply)
    }

    async fn abort(&self, key: &str, owner: &str) -> StoreResult<OwnerOutcome> {
        let reply = self
            .release_script(&scripts::ABORT, key, Some(owner))
            .await?;
        owner_outcome(&text(Some(&reply)).unwrap_or_default())
    }

    async fn renew(&self, key: &str, owner: &str, lease: Duration) -> StoreResult<OwnerOutcome> {
        let k = self.keys(key);
        let script = &*scripts::RENEW;
        let mut cmd = evalsha(script, &[&k.state, &k.queue]);
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
        let cmd = evalsha(script, &[&k.state, &k.queue]);
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
        let pattern = keys::state_pattern(&self.prefix);
        // SCAN walks one server's keyspace: on a Cluster, every primary's in turn.
        let nodes = match &self.conn {
            Conn::Cluster(c) => {
                let nodes: String = self
                    .bounded(
                        redis::cmd("CLUSTER")
                            .arg("NODES")
                            .query_async(&mut c.clone()),
                    )
                    .await?;
                cluster_primaries(&nodes).into_iter().map(Some).collect()
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
        let reply = self
            .release_script(&scripts::FORCE_RELEASE, key, None)
            .await?;
        match reply {
            Value::Nil => Ok(None),
            other => Ok(Some(number(Some(&other))?)),
        }
    }

    async fn ping(&self) -> StoreResult<()> {
        let pong: String = self.run(Op::Command(&redis::cmd("PING"))).await?;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(unexpected("PING"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::cluster_primaries;

    #[test]
    fn cluster_primaries_come_from_cluster_nodes() {
        let nodes = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@17002,redis-b master - 0 1 2 connected 5461-10922
c3 127.0.0.1:7003@17003 master,fail - 0 1 3 disconnected
d4 127.0.0.1:7004@17004 slave a1 0 1 1 connected
e5 [::1]:7005@17005 master - 0 1 5 connected 10923-16383
";
        assert_eq!(
            cluster_primaries(nodes),
            vec![
                ("127.0.0.1".to_owned(), 7001),
                ("127.0.0.1".to_owned(), 7002),
                ("[::1]".to_owned(), 7005),
            ]
        );
    }
}
