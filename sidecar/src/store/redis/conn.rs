//! Connections, whatever the topology: a standalone server, a Sentinel-managed master or a
//! Cluster, with TLS where configured. Connections reconnect by themselves (redis-rs
//! `ConnectionManager`, the cluster client, re-resolving the Sentinel master after an error).

use super::StoreResult;
use super::gather::{ClusterTarget, ConnectPrimary, Gather, Target, timeout_error};
use crate::config::{RedisConfig, RedisTls, RedisTopology};
use crate::store::StoreError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{
    SentinelClient, SentinelClientBuilder, SentinelNodeConnectionInfo, SentinelServerType,
};
use redis::{
    Cmd, ConnectionAddr, ErrorKind, FromRedisValue, IntoConnectionInfo, RedisError, RedisResult,
    RetryMethod, Script, ServerErrorKind, Value,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, RwLock};

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
    Ok(url.into_connection_info()?.set_tcp_settings(tcp_settings()))
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
pub(super) fn node_client(url: &str, tls: &RedisTls) -> Result<redis::Client, RedisError> {
    let info = url.into_connection_info()?.set_tcp_settings(tcp_settings());
    match certificates(tls) {
        Some(certs) if url.starts_with("rediss://") => redis::Client::build_with_tls(info, certs),
        _ => redis::Client::open(info),
    }
}

/// One logical connection, whatever the topology. Commands go through a [`Gather`], which
/// writes those sent at the same moment as one pipeline (on a Cluster, one per primary).
pub(super) enum Conn {
    /// A standalone server, or the master behind Sentinels.
    Gathered(Arc<Gather>),
    /// A Cluster: its client (for what is routed by hand: `SCAN` per primary, `CLUSTER
    /// NODES`, loading scripts) and the gather over it.
    Cluster(ClusterConnection, Arc<Gather>),
}

/// The master behind Sentinels: resolved lazily and again after any transient error, so a
/// failover is followed without restarting.
pub(super) struct SentinelConn {
    sentinel: Mutex<SentinelClient>,
    current: RwLock<Option<ConnectionManager>>,
    config: ConnectionManagerConfig,
}

impl SentinelConn {
    pub(super) async fn get(&self) -> Result<ConnectionManager, RedisError> {
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
    /// worth retrying, of the batch or of one of its commands, makes the next call ask the
    /// Sentinels again.
    pub(super) async fn checked(&self, answers: Result<&[Value], &RedisError>) {
        let retryable = |e: &RedisError| !matches!(e.retry_method(), RetryMethod::NoRetry);
        let stale = match answers {
            Err(e) => retryable(e),
            Ok(values) => values.iter().any(|v| {
                matches!(v, Value::ServerError(_))
                    && v.clone().extract_error().is_err_and(|e| retryable(&e))
            }),
        };
        if stale {
            *self.current.write().await = None;
        }
    }
}

impl Conn {
    pub(super) fn gather(&self) -> &Arc<Gather> {
        match self {
            Conn::Gathered(gather) | Conn::Cluster(_, gather) => gather,
        }
    }

    /// A call that ran out of the store timeout: behind Sentinels, the master may be gone
    /// or hung, so the next call asks the Sentinels again (the call's own future, dropped
    /// at the timeout, never saw an answer to note).
    pub(super) async fn timed_out(&self) {
        self.gather().target().note(Err(&timeout_error())).await;
    }

    /// Connects to the configured topology: lazily where the client allows it (a server or
    /// Sentinel that is down only makes calls fail until it is back).
    ///
    /// # Errors
    /// A URL that does not parse, or a Cluster whose seed nodes are all unreachable.
    pub(super) async fn connect(cfg: &RedisConfig, timeout: Duration) -> StoreResult<Conn> {
        // No response timeout on the connection: every call is bounded by the store timeout
        // already (`RedisStore::bounded`, and a gathered batch by `Gather`), and a second
        // timer per command is not free: a timer due before any other makes tokio wake its
        // I/O driver with an `eventfd` write, one more system call per command at low load.
        // A response timeout does nothing a store timeout does not: in redis-rs it fails the
        // call without dropping the connection, which a store timeout also does.
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let first_url = cfg.urls.first().ok_or(StoreError::Config("no Redis URL"))?;
        Ok(match &cfg.topology {
            RedisTopology::Standalone => {
                let client = node_client(first_url, &cfg.tls)?;
                Conn::Gathered(Gather::new(
                    Target::Server(ConnectionManager::new_lazy_with_config(
                        client,
                        manager_config,
                    )?),
                    timeout,
                ))
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
                let conn = builder.build()?.get_async_connection().await?;
                let connect =
                    primary_connections(connection_info(first_url)?, &cfg.tls, manager_config);
                let target = ClusterTarget::new(conn.clone(), connect, timeout);
                Conn::Cluster(conn, Gather::new(Target::Cluster(target), timeout))
            }
            RedisTopology::Sentinel { master } => Conn::Gathered(Gather::new(
                Target::Sentinel(Arc::new(SentinelConn {
                    sentinel: Mutex::new(sentinel_client(cfg, master)?),
                    current: RwLock::new(None),
                    config: manager_config,
                })),
                timeout,
            )),
        })
    }

    /// Sends one command or script on the current connection (not bounded in time: the
    /// caller bounds it).
    ///
    /// A future's size is that of its largest state, and every layer above (store call,
    /// verb, handler, router) embeds and moves it whole: the Cluster client's state and a
    /// script's first load are kept behind boxes of their own, so the common call does not
    /// pay for them (they made every request's future several kilobytes, copied at each
    /// layer: a quarter of the sidecar's instructions per claim).
    pub(super) async fn send<T: FromRedisValue>(&self, op: Op<'_>) -> Result<T, RedisError> {
        let first = self.send_once(op.cmd()).await;
        let value = match op.missing_script(&first) {
            Some(script) => Box::pin(self.load_and_send(script, op.cmd())).await,
            None => first,
        }?;
        Ok(redis::from_redis_value(value)?)
    }

    /// One command; its reply, with a server error as `Err`.
    async fn send_once(&self, cmd: &Cmd) -> RedisResult<Value> {
        self.gather().send(cmd).await
    }

    /// Loads a script the server did not know (first use, restart, failover) and sends its
    /// command once more.
    async fn load_and_send(&self, script: &Script, cmd: &Cmd) -> RedisResult<Value> {
        Box::pin(self.gather().target().load_script(script, cmd)).await?;
        self.send_once(cmd).await
    }
}

/// A Cluster primary's own connection (for the gather's pipelines): the first seed's
/// settings (credentials, TLS and its certificates) at the primary's address.
fn primary_connections(
    seed: redis::ConnectionInfo,
    tls: &RedisTls,
    config: ConnectionManagerConfig,
) -> ConnectPrimary {
    let certs = certificates(tls);
    Box::new(move |host: &str, port: u16| {
        let (addr, secure) = match seed.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => (
                ConnectionAddr::TcpTls {
                    host: host.to_owned(),
                    port,
                    insecure: *insecure,
                    tls_params: tls_params.clone(),
                },
                true,
            ),
            _ => (ConnectionAddr::Tcp(host.to_owned(), port), false),
        };
        let info = seed.clone().set_addr(addr);
        let client = match &certs {
            Some(certs) if secure => redis::Client::build_with_tls(info, certs.clone())?,
            _ => redis::Client::open(info)?,
        };
        ConnectionManager::new_lazy_with_config(client, config.clone())
    })
}

/// What [`RedisStore::run`] sends.
#[derive(Clone, Copy)]
pub(super) enum Op<'a> {
    Command(&'a Cmd),
    /// An `EVALSHA` built by [`evalsha`] for this script: loaded and retried once when the
    /// server does not know the script (first use, restart, failover).
    Script(&'a Script, &'a Cmd),
}

impl<'a> Op<'a> {
    /// The command itself (a script's `EVALSHA`).
    fn cmd(self) -> &'a Cmd {
        match self {
            Op::Command(cmd) | Op::Script(_, cmd) => cmd,
        }
    }

    /// The script to load when `reply` says the server does not know it.
    fn missing_script(self, reply: &RedisResult<Value>) -> Option<&'a Script> {
        match (self, reply) {
            (Op::Script(script, _), Err(e))
                if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
            {
                Some(script)
            }
            _ => None,
        }
    }
}

pub(super) fn sentinel_client(cfg: &RedisConfig, master: &str) -> StoreResult<SentinelClient> {
    let first = cfg
        .urls
        .first()
        .ok_or(StoreError::Config("no Sentinel URL"))?;
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
    .map_err(StoreError::from)
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
    let mut builder = SentinelClientBuilder::new(sentinels, master, SentinelServerType::Master)?
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
    Ok(builder.build()?)
}

#[cfg(test)]
mod tests {
    use super::{Conn, ConnectionManager, ConnectionManagerConfig, Gather, SentinelConn, Target};
    use redis::sentinel::{SentinelClient, SentinelServerType};
    use std::sync::Arc;
    use tokio::sync::{Mutex, RwLock};

    /// A call that ran out of the store timeout behind Sentinels makes the next call ask the
    /// Sentinels again: the connection sets no response timeout of its own, so nothing else
    /// would tell it that the master it holds stopped answering.
    #[tokio::test]
    async fn a_store_timeout_behind_sentinels_asks_them_again() {
        let nowhere = "redis://127.0.0.1:1";
        let config = ConnectionManagerConfig::new();
        let held = ConnectionManager::new_lazy_with_config(
            redis::Client::open(nowhere).unwrap(),
            config.clone(),
        )
        .unwrap();
        let sentinel = Arc::new(SentinelConn {
            sentinel: Mutex::new(
                SentinelClient::build(vec![nowhere], "m", None, SentinelServerType::Master)
                    .unwrap(),
            ),
            current: RwLock::new(Some(held)),
            config,
        });
        let conn = Conn::Gathered(Gather::new(
            Target::Sentinel(Arc::clone(&sentinel)),
            std::time::Duration::from_secs(1),
        ));
        conn.timed_out().await;
        assert!(sentinel.current.read().await.is_none());
    }
}
