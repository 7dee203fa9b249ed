//! Configuration in two stages: [`Cli`] is what the operator types (flags with env
//! equivalents, parsed by clap), [`Config`] is the validated form the server runs with.
//! Tests and embedding crates build a [`Config`] directly.

use crate::telemetry::{LogFormat, TelemetryConfig};
use clap::Parser;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The port the sidecar listens on unless told otherwise (on 127.0.0.1).
pub const DEFAULT_PORT: u16 = 9470;

/// Command-line flags of `idemgate-sidecar`; every flag also reads an environment variable.
#[derive(Debug, Parser)]
#[command(
    name = "idemgate-sidecar",
    version,
    about = "The idemgate lock and idempotency sidecar"
)]
pub struct Cli {
    /// Worker threads of the async runtime. Absent: one per CPU this process may use (a
    /// cgroup's CPU quota included). Set it to what the sidecar's CPU share is, not the node's
    /// core count: an idle worker is woken to take work from a busy one, and at a load well
    /// below one core every extra worker costs CPU per request (BENCHMARKS.md).
    #[arg(long, env = "IDEMGATE_WORKER_THREADS")]
    pub worker_threads: Option<std::num::NonZeroUsize>,
    /// Address to listen on (HTTP/1.1 and h2c on the same port).
    #[arg(long, env = "IDEMGATE_LISTEN", default_value_t = SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT)))]
    pub listen: SocketAddr,
    /// Redis URL(s): `redis://[user:pass@]host:port[/db]`, or `rediss://` for TLS. Repeat the flag
    /// (or separate with commas) for Cluster seed nodes or Sentinel addresses.
    /// Absent: the in-process memory store (one machine only).
    #[arg(long, env = "REDIS_URL", value_delimiter = ',')]
    pub redis_url: Vec<String>,
    /// Treat the Redis URLs as Redis Cluster seed nodes.
    #[arg(
        long,
        env = "IDEMGATE_REDIS_CLUSTER",
        conflicts_with = "redis_sentinel_master"
    )]
    pub redis_cluster: bool,
    /// Treat the Redis URLs as Sentinels and use the master of this name.
    #[arg(long, env = "IDEMGATE_REDIS_SENTINEL_MASTER")]
    pub redis_sentinel_master: Option<String>,
    /// Prefix of every Redis key and channel this sidecar uses.
    #[arg(long, env = "IDEMGATE_REDIS_PREFIX", default_value = "idemgate")]
    pub redis_prefix: String,
    /// PEM file with the CA certificate(s) that signed the Redis servers' certificates, for
    /// `rediss://` URLs (absent: the public web PKI roots).
    #[arg(long, env = "IDEMGATE_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
    /// PEM client certificate (chain) for Redis servers that authenticate clients
    /// (`tls-auth-clients yes`, Redis's default); needs `--redis-client-key`.
    #[arg(
        long,
        env = "IDEMGATE_REDIS_CLIENT_CERT",
        requires = "redis_client_key"
    )]
    pub redis_client_cert: Option<PathBuf>,
    /// PEM private key of `--redis-client-cert`.
    #[arg(
        long,
        env = "IDEMGATE_REDIS_CLIENT_KEY",
        requires = "redis_client_cert"
    )]
    pub redis_client_key: Option<PathBuf>,
    /// Bearer token required on /v1 and /admin requests (absent: no authentication).
    #[arg(long, env = "IDEMGATE_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// Largest stored response body accepted, in bytes.
    #[arg(long, env = "IDEMGATE_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Longest in-flight lease granted or renewed (requests asking more get this).
    #[arg(long, env = "IDEMGATE_MAX_LEASE_MS", default_value_t = 300_000)]
    pub max_lease_ms: u64,
    /// Longest time a claim may wait in a queue.
    #[arg(long, env = "IDEMGATE_MAX_WAIT_MS", default_value_t = 60_000)]
    pub max_wait_ms: u64,
    /// Most waiters queued on one key (a request's own `max_queue` can only lower it).
    #[arg(long, env = "IDEMGATE_MAX_QUEUE", default_value_t = 1000)]
    pub max_queue: u32,
    /// Longest retention of a stored response.
    #[arg(long, env = "IDEMGATE_MAX_RETENTION_MS", default_value_t = 7 * 24 * 3600 * 1000)]
    pub max_retention_ms: u64,
    /// A waiter re-checks its turn at least this often even without a notification.
    #[arg(long, env = "IDEMGATE_RECHECK_MS", default_value_t = 500)]
    pub recheck_ms: u64,
    /// How long a key's fencing counter outlives its last grant.
    #[arg(long, env = "IDEMGATE_FENCE_TTL_SECS", default_value_t = 7 * 24 * 3600)]
    pub fence_ttl_secs: u64,
    /// Timeout of one store operation; beyond it the request is answered 503.
    #[arg(long, env = "IDEMGATE_STORE_TIMEOUT_MS", default_value_t = 2_000)]
    pub store_timeout_ms: u64,
    /// HTTP/2 streams one connection may have open at once (each long-poll holds one).
    #[arg(long, env = "IDEMGATE_H2_MAX_STREAMS", default_value_t = 4096)]
    pub h2_max_streams: u32,
    /// On shutdown, how long in-flight requests get to finish after waiters were answered.
    #[arg(long, env = "IDEMGATE_SHUTDOWN_GRACE_MS", default_value_t = 10_000)]
    pub shutdown_grace_ms: u64,
    /// A new connection that sends nothing for this long is closed (and an HTTP/1.1
    /// request's head must arrive within it).
    #[arg(long, env = "IDEMGATE_FIRST_BYTE_TIMEOUT_MS", default_value_t = 10_000)]
    pub first_byte_timeout_ms: u64,
    /// A connection with no request in flight for this long is closed (HTTP/2: GOAWAY).
    /// Keep the gateways' own idle timeout to the sidecar below it.
    #[arg(long, env = "IDEMGATE_IDLE_TIMEOUT_MS", default_value_t = 120_000)]
    pub idle_timeout_ms: u64,
    /// Most client connections open at once; more wait in the listen backlog. The binary
    /// lowers it to fit the open-file limit.
    #[arg(long, env = "IDEMGATE_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Log lines on standard output: `text`, or `json` (one object per line, with the request's
    /// `request_id` and `trace_id` under `span`).
    #[arg(long, env = "IDEMGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Export a span per request over OTLP/HTTP (protobuf) to this collector, e.g.
    /// `http://otel-collector:4318` (`/v1/traces` is appended). Absent: nothing is exported.
    #[arg(long, env = "IDEMGATE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl Cli {
    /// The process-wide logging and tracing settings.
    pub fn telemetry(&self) -> TelemetryConfig {
        TelemetryConfig {
            log_format: self.log_format,
            otlp_endpoint: self.otlp_endpoint.clone().filter(|e| !e.trim().is_empty()),
        }
    }
}

/// Where state lives.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// In-process maps: for one machine and for tests.
    Memory,
    /// Redis, in one of its deployment shapes.
    Redis(RedisConfig),
}

/// How to reach Redis. URLs may carry credentials: [`fmt::Debug`] redacts them.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    pub urls: Vec<String>,
    pub topology: RedisTopology,
    /// Prefix of every key and channel (letters, digits, `_.-`).
    pub prefix: String,
    /// Certificates for `rediss://` beyond the defaults.
    pub tls: RedisTls,
}

/// TLS material for `rediss://` connections, as PEM. Empty (the default): the server's
/// certificate is checked against the public web PKI roots, and no client certificate is sent.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// CA certificates to trust instead of the public roots (a private CA).
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate chain and its private key, for servers that authenticate clients.
    pub client_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl RedisTls {
    /// Reads the PEM files named by the flags.
    ///
    /// # Errors
    /// A file cannot be read or holds no PEM block; the error names the flag.
    pub fn from_files(
        ca: Option<&Path>,
        client: Option<(&Path, &Path)>,
    ) -> Result<Self, ConfigError> {
        let read = |flag: &'static str, path: &Path| {
            let bytes = std::fs::read(path).map_err(|err| ConfigError {
                flag,
                reason: format!("cannot read {}: {err}", path.display()),
            })?;
            if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(ConfigError {
                    flag,
                    reason: format!("{} holds no PEM block", path.display()),
                });
            }
            Ok(bytes)
        };
        Ok(RedisTls {
            ca_pem: ca.map(|p| read("redis-ca-file", p)).transpose()?,
            client_pem: match client {
                Some((cert, key)) => Some((
                    read("redis-client-cert", cert)?,
                    read("redis-client-key", key)?,
                )),
                None => None,
            },
        })
    }

    pub fn is_empty(&self) -> bool {
        self.ca_pem.is_none() && self.client_pem.is_none()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTopology {
    Standalone,
    Cluster,
    Sentinel { master: String },
}

/// The validated configuration the server runs with.
#[derive(Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub store: StoreConfig,
    pub auth_token: Option<String>,
    pub limits: idemgate_wire::Limits,
    pub max_lease: Duration,
    pub max_wait: Duration,
    pub max_queue: u32,
    pub max_retention: Duration,
    pub recheck: Duration,
    pub fence_ttl: Duration,
    pub store_timeout: Duration,
    pub h2_max_streams: u32,
    pub shutdown_grace: Duration,
    pub first_byte_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

/// A flag value the server cannot run with.
#[derive(Debug, thiserror::Error)]
#[error("invalid --{flag}: {reason}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub reason: String,
}

impl Default for Config {
    /// The defaults of the flags, with the memory store.
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT)),
            store: StoreConfig::Memory,
            auth_token: None,
            limits: idemgate_wire::Limits::default(),
            max_lease: Duration::from_secs(300),
            max_wait: Duration::from_secs(60),
            max_queue: 1000,
            max_retention: Duration::from_secs(7 * 24 * 3600),
            recheck: Duration::from_millis(500),
            fence_ttl: Duration::from_secs(7 * 24 * 3600),
            store_timeout: Duration::from_secs(2),
            h2_max_streams: 4096,
            shutdown_grace: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            max_connections: 4096,
        }
    }
}

impl Config {
    /// A configuration for an in-process test sidecar on an ephemeral loopback port.
    pub fn loopback(store: StoreConfig) -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            store,
            ..Config::default()
        }
    }

    /// How long a queued place counts as waited for after its claim's last step. A waiting
    /// claim steps at least every `recheck`, and a step may take up to the store timeout:
    /// twice the one plus the other (at least a second) leaves room for a slow step, and a
    /// place whose process died stops being handed the key that much after its last step.
    pub fn alive_window(&self) -> Duration {
        (self.recheck * 2 + self.store_timeout).max(Duration::from_secs(1))
    }

    /// Validates flags into a runnable configuration.
    ///
    /// # Errors
    /// Names the first flag whose value cannot work.
    pub fn from_cli(cli: Cli) -> Result<Self, ConfigError> {
        let bad = |flag, reason: &str| ConfigError {
            flag,
            reason: reason.to_owned(),
        };
        let positive = |flag, v: u64| {
            if v == 0 {
                Err(bad(flag, "must be greater than zero"))
            } else {
                Ok(Duration::from_millis(v))
            }
        };
        let urls: Vec<String> = cli
            .redis_url
            .into_iter()
            .map(|u| u.trim().to_owned())
            .filter(|u| !u.is_empty())
            .collect();
        let store = if urls.is_empty() {
            if cli.redis_cluster
                || cli.redis_sentinel_master.is_some()
                || cli.redis_ca_file.is_some()
                || cli.redis_client_cert.is_some()
            {
                return Err(bad(
                    "redis-url",
                    "required with --redis-cluster, --redis-sentinel-master and the TLS files",
                ));
            }
            StoreConfig::Memory
        } else {
            for url in &urls {
                if !(url.starts_with("redis://")
                    || url.starts_with("rediss://")
                    || url.starts_with("redis+unix://")
                    || url.starts_with("unix://"))
                {
                    return Err(bad(
                        "redis-url",
                        "must start with redis://, rediss:// or unix://",
                    ));
                }
            }
            let topology = match (cli.redis_cluster, cli.redis_sentinel_master) {
                (true, _) => RedisTopology::Cluster,
                (false, Some(master)) if !master.is_empty() => RedisTopology::Sentinel { master },
                (false, Some(_)) => return Err(bad("redis-sentinel-master", "must not be empty")),
                (false, None) if urls.len() > 1 => {
                    return Err(bad(
                        "redis-url",
                        "several URLs need --redis-cluster or --redis-sentinel-master",
                    ));
                }
                (false, None) => RedisTopology::Standalone,
            };
            let prefix = cli.redis_prefix;
            if prefix.is_empty()
                || !prefix
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
            {
                return Err(bad(
                    "redis-prefix",
                    "must be letters, digits, '_', '.' or '-'",
                ));
            }
            let client = cli
                .redis_client_cert
                .as_deref()
                .zip(cli.redis_client_key.as_deref());
            let tls = RedisTls::from_files(cli.redis_ca_file.as_deref(), client)?;
            if !tls.is_empty() && !urls.iter().all(|u| u.starts_with("rediss://")) {
                return Err(bad(
                    "redis-url",
                    "TLS certificates are given: every URL must be rediss://",
                ));
            }
            StoreConfig::Redis(RedisConfig {
                urls,
                topology,
                prefix,
                tls,
            })
        };
        if cli.auth_token.as_deref() == Some("") {
            return Err(bad("auth-token", "must not be empty when given"));
        }
        if cli.max_body_bytes == 0 {
            return Err(bad("max-body-bytes", "must be greater than zero"));
        }
        if cli.max_queue == 0 {
            return Err(bad("max-queue", "must be greater than zero"));
        }
        if cli.h2_max_streams == 0 {
            return Err(bad("h2-max-streams", "must be greater than zero"));
        }
        let fence_ttl = positive("fence-ttl-secs", cli.fence_ttl_secs.saturating_mul(1000))?;
        if fence_ttl < Duration::from_secs(60) {
            return Err(bad("fence-ttl-secs", "must be at least 60"));
        }
        let max_lease = positive("max-lease-ms", cli.max_lease_ms)?;
        if fence_ttl <= max_lease {
            // A key's record (its last fence) is kept this long after a grant; shorter than
            // a lease, the setting would not mean what it says (the store keeps a record at
            // least as long as its lease anyway).
            return Err(bad("fence-ttl-secs", "must exceed --max-lease-ms"));
        }
        Ok(Config {
            listen: cli.listen,
            store,
            auth_token: cli.auth_token,
            limits: idemgate_wire::Limits {
                max_body: cli.max_body_bytes,
                ..idemgate_wire::Limits::default()
            },
            max_lease,
            max_wait: positive("max-wait-ms", cli.max_wait_ms)?,
            max_queue: cli.max_queue,
            max_retention: positive("max-retention-ms", cli.max_retention_ms)?,
            recheck: positive("recheck-ms", cli.recheck_ms)?,
            fence_ttl,
            store_timeout: positive("store-timeout-ms", cli.store_timeout_ms)?,
            h2_max_streams: cli.h2_max_streams,
            shutdown_grace: Duration::from_millis(cli.shutdown_grace_ms),
            first_byte_timeout: positive("first-byte-timeout-ms", cli.first_byte_timeout_ms)?,
            idle_timeout: positive("idle-timeout-ms", cli.idle_timeout_ms)?,
            max_connections: match cli.max_connections {
                0 => return Err(bad("max-connections", "must be greater than zero")),
                n => n,
            },
        })
    }
}

/// `scheme://user:***@host...`: the URL with any password replaced, for logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            let masked = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                // `redis://secret@host` puts the password where a user would be.
                "***".to_owned()
            };
            format!("{scheme}://{masked}@{host}{tail}")
        }
        None => url.to_owned(),
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|u| redact_url(u)).collect();
        f.debug_struct("RedisConfig")
            .field("urls", &urls)
            .field("topology", &self.topology)
            .field("prefix", &self.prefix)
            .field("tls_ca", &self.tls.ca_pem.is_some())
            .field("tls_client_cert", &self.tls.client_pem.is_some())
            .finish()
    }
}

impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreConfig::Memory => f.write_str("Memory"),
            StoreConfig::Redis(redis) => redis.fmt(f),
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("listen", &self.listen)
            .field("store", &self.store)
            .field("auth_token", &self.auth_token.as_ref().map(|_| "***"))
            .field("limits", &self.limits)
            .field("max_lease", &self.max_lease)
            .field("max_wait", &self.max_wait)
            .field("max_queue", &self.max_queue)
            .field("max_retention", &self.max_retention)
            .field("recheck", &self.recheck)
            .field("fence_ttl", &self.fence_ttl)
            .field("store_timeout", &self.store_timeout)
            .field("h2_max_streams", &self.h2_max_streams)
            .field("shutdown_grace", &self.shutdown_grace)
            .field("first_byte_timeout", &self.first_byte_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_in_urls() {
        assert_eq!(
            redact_url("redis://user:secret@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
        assert_eq!(redact_url("rediss://:secret@host"), "rediss://:***@host");
        assert_eq!(redact_url("redis://secret@host"), "redis://***@host");
        assert_eq!(redact_url("redis://host:6379"), "redis://host:6379");
    }

    #[test]
    fn debug_output_hides_secrets() {
        let cli = Cli::parse_from([
            "idemgate-sidecar",
            "--redis-url",
            "redis://u:pw@h:1",
            "--auth-token",
            "tok3n",
        ]);
        let text = format!("{:?}", Config::from_cli(cli).map_err(|e| e.to_string()));
        assert!(!text.contains("pw@") && !text.contains("tok3n"), "{text}");
    }

    #[test]
    fn flag_defaults_are_the_config_defaults() {
        let parsed = Config::from_cli(Cli::parse_from(["idemgate-sidecar"]))
            .map(|c| format!("{c:?}"))
            .map_err(|e| e.to_string());
        assert_eq!(parsed, Ok(format!("{:?}", Config::default())));
    }

    #[test]
    fn tls_files_are_checked_and_need_rediss_urls() {
        let flag_of = |args: &[&str]| {
            let cli = Cli::parse_from(["idemgate-sidecar"].iter().chain(args));
            Config::from_cli(cli).err().map(|e| e.flag)
        };
        let missing = "/nonexistent/ca.pem";
        assert_eq!(
            flag_of(&["--redis-url", "rediss://h:1", "--redis-ca-file", missing]),
            Some("redis-ca-file")
        );
        let not_pem = std::env::temp_dir().join(format!("idemgate-not-pem-{}", std::process::id()));
        std::fs::write(&not_pem, "plain text").unwrap_or_default();
        let not_pem = not_pem.to_string_lossy().into_owned();
        assert_eq!(
            flag_of(&["--redis-url", "rediss://h:1", "--redis-ca-file", &not_pem]),
            Some("redis-ca-file")
        );
        let _ = std::fs::remove_file(&not_pem);
        let ca = std::env::temp_dir().join(format!("idemgate-ca-{}.pem", std::process::id()));
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap_or_default();
        let ca = ca.to_string_lossy().into_owned();
        assert_eq!(
            flag_of(&["--redis-url", "redis://h:1", "--redis-ca-file", &ca]),
            Some("redis-url")
        );
        assert_eq!(flag_of(&["--redis-ca-file", &ca]), Some("redis-url"));
        assert_eq!(
            flag_of(&["--redis-url", "rediss://h:1", "--redis-ca-file", &ca]),
            None
        );
        let _ = std::fs::remove_file(&ca);
    }

    #[test]
    fn several_urls_need_a_topology() {
        let cli = Cli::parse_from(["x", "--redis-url", "redis://a,redis://b"]);
        let err = Config::from_cli(cli).err().map(|e| e.flag);
        assert_eq!(err, Some("redis-url"));
    }
}
