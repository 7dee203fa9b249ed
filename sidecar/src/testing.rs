//! Real Redis for tests (feature `testing`): a `redis-server` on a free loopback port, a
//! master behind a Sentinel, or a three-node Redis Cluster, started and stopped by the
//! test — never the default port.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idemgate_sidecar::testing::RedisServer;
//! use idemgate_sidecar::{Config, Sidecar};
//! let redis = RedisServer::start()?;
//! let sidecar = Sidecar::spawn(Config::loopback(redis.store_config())).await?;
//! // ... drive sidecar.url() ...
//! sidecar.shutdown().await?;
//! # Ok(()) }
//! ```
//!
//! Needs `redis-server` (and `redis-cli` for the Cluster) on PATH; `cargo xtask test`
//! installs them.

pub mod otlp;
pub mod tls;

/// The Lua functions that read and write a lock record (`decode(value)` → a table of
/// fields, `encode(table)`, `clock()`, `lease_end(at, lease)`): what the sidecar's own
/// scripts start with, for tests that read Redis behind its back.
pub const RECORD_CODEC: &str = crate::store::redis::RECORD_CODEC;

use crate::config::{RedisConfig, RedisTls, RedisTopology, StoreConfig};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The Redis server the tests start (Debian 12's is 7.0).
const REDIS_SERVER: &str = "redis-server";

/// The store of one Redis (or Valkey) server at `url`, its keys under `prefix`, no TLS.
pub fn standalone_store(url: String, prefix: &str) -> StoreConfig {
    StoreConfig::Redis(RedisConfig {
        urls: vec![url],
        topology: RedisTopology::Standalone,
        prefix: prefix.to_owned(),
        tls: RedisTls::default(),
    })
}

/// How long a starting server gets before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// The Valkey server the tests start where they need a server with `SET … IFEQ` (Valkey
/// 8.1 or later): `$IDEMGATE_VALKEY_SERVER`, which `cargo xtask test` sets to the one it
/// builds, or `valkey-server` on PATH.
pub fn valkey_server() -> String {
    std::env::var("IDEMGATE_VALKEY_SERVER").unwrap_or_else(|_| "valkey-server".to_owned())
}

/// A `redis-server` (or Valkey) process owned by a test; killed on drop.
pub struct RedisServer {
    /// The server's executable: `redis-server`, or [`valkey_server`].
    program: String,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    /// Runs as a Sentinel with this configuration file instead of a data node.
    sentinel_conf: Option<PathBuf>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a throw-away standalone server (no persistence) on a free loopback port.
    ///
    /// # Errors
    /// `redis-server` is missing or does not come up.
    pub fn start() -> io::Result<Self> {
        Self::start_with(&[])
    }

    /// Like [`RedisServer::start`], with extra `redis-server` arguments
    /// (e.g. `["--requirepass", "secret"]`).
    ///
    /// # Errors
    /// `redis-server` is missing or does not come up.
    pub fn start_with(extra: &[&str]) -> io::Result<Self> {
        Self::start_program(REDIS_SERVER, extra)
    }

    /// Starts a throw-away Valkey server ([`valkey_server`]): a server with `SET … IFEQ`,
    /// which a fresh grant's complete is sent as where the server has it.
    ///
    /// # Errors
    /// The Valkey server is missing or does not come up.
    pub fn start_valkey() -> io::Result<Self> {
        Self::start_program(&valkey_server(), &[])
    }

    fn start_program(program: &str, extra: &[&str]) -> io::Result<Self> {
        let mut last_err = None;
        // A port found free can be taken before redis binds it: try a few.
        for _ in 0..5 {
            let port = free_port(false)?;
            let mut server = RedisServer {
                program: program.to_owned(),
                port,
                dir: scratch_dir(port)?,
                extra: extra.iter().map(|s| (*s).to_owned()).collect(),
                sentinel_conf: None,
                child: None,
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(err) => last_err = Some(err),
            }
        }
        Err(last_err.unwrap_or_else(|| io::Error::other("redis-server did not start")))
    }

    fn spawn(&mut self) -> io::Result<()> {
        let port = self.port.to_string();
        let dir = self.dir.to_string_lossy().into_owned();
        let conf = self
            .sentinel_conf
            .as_ref()
            .map(|c| c.to_string_lossy().into_owned());
        let args: Vec<&str> = match &conf {
            // A Sentinel takes everything from its (writable) configuration file.
            Some(conf) => vec![conf.as_str(), "--sentinel"],
            None => {
                let mut args = vec![
                    "--port",
                    &port,
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    &dir,
                    "--protected-mode",
                    "no",
                ];
                args.extend(self.extra.iter().map(String::as_str));
                args
            }
        };
        let child = Command::new(&self.program)
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "cannot run {} ({e}); install it (cargo xtask test does)",
                        self.program
                    ),
                )
            })?;
        self.child = Some(child);
        if let Err(err) = wait_ready(self.port, self.password()) {
            self.stop();
            return Err(err);
        }
        Ok(())
    }

    fn password(&self) -> Option<&str> {
        let i = self.extra.iter().position(|a| a == "--requirepass")?;
        self.extra.get(i + 1).map(String::as_str)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>` (with the password when one was set).
    pub fn url(&self) -> String {
        match self.password() {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    /// A standalone Redis store configuration for this server.
    pub fn store_config(&self) -> StoreConfig {
        self.store_config_with_prefix("idemgate")
    }

    pub fn store_config_with_prefix(&self, prefix: &str) -> StoreConfig {
        standalone_store(self.url(), prefix)
    }

    /// Kills the server (its data is gone; the port stays reserved for [`Self::restart`]).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the server (`SIGSTOP`), as a hung host or a network partition would: the
    /// kernel still accepts connections for it, but nothing is answered. Killing it (drop,
    /// [`Self::stop`]) works on a frozen server too.
    ///
    /// # Errors
    /// The server is not running, or `kill` failed.
    pub fn freeze(&self) -> io::Result<()> {
        self.signal("-STOP")
    }

    /// Resumes a server [`Self::freeze`] froze (`SIGCONT`): it answers what queued meanwhile.
    ///
    /// # Errors
    /// The server is not running, or `kill` failed.
    pub fn thaw(&self) -> io::Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, signal: &str) -> io::Result<()> {
        let child = self
            .child
            .as_ref()
            .ok_or_else(|| io::Error::other("the server is not running"))?;
        let status = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!("kill {signal} failed: {status}")))
        }
    }

    /// Starts a fresh, empty server on the same port.
    ///
    /// # Errors
    /// The server does not come up again.
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(err) if Instant::now() > deadline => return Err(err),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Runs one command through `redis-cli` and returns its output (for assertions).
    ///
    /// # Errors
    /// `redis-cli` is missing or fails.
    pub fn cli(&self, args: &[&str]) -> io::Result<String> {
        redis_cli(self.port, self.password(), args)
    }

    /// One field of the lock record `record` (`<prefix>:{key}:record`; fields as the
    /// sidecar's scripts pack them: `owner`, `fence`, `q`, ...), `None` when the field is
    /// absent or there is no record.
    ///
    /// # Errors
    /// `redis-cli` is missing or fails.
    pub fn record_field(&self, record: &str, field: &str) -> io::Result<Option<String>> {
        let script = format!(
            "{}\nlocal f = decode(redis.call('GET', KEYS[1]))[ARGV[1]]\n\
             if f then return f end\nreturn nil",
            RECORD_CODEC
        );
        let out = self.cli(&["--raw", "EVAL", &script, "1", record, field])?;
        let value = out.strip_suffix('\n').unwrap_or(&out);
        Ok((!value.is_empty()).then(|| value.to_owned()))
    }

    /// Clears one field of the lock record `record` behind the sidecar's back (its expiry
    /// kept), as a lost write or an operator's edit would; `false` when there is no record.
    ///
    /// # Errors
    /// `redis-cli` is missing or fails.
    pub fn clear_record_field(&self, record: &str, field: &str) -> io::Result<bool> {
        self.edit_record_field(record, field, None)
    }

    /// Sets one field of the lock record `record` to `value` behind the sidecar's back (its
    /// expiry kept); `false` when there is no record.
    ///
    /// # Errors
    /// `redis-cli` is missing or fails.
    pub fn set_record_field(&self, record: &str, field: &str, value: &str) -> io::Result<bool> {
        self.edit_record_field(record, field, Some(value))
    }

    fn edit_record_field(
        &self,
        record: &str,
        field: &str,
        value: Option<&str>,
    ) -> io::Result<bool> {
        let script = format!(
            "{}\nlocal v = redis.call('GET', KEYS[1])\nif not v then return 0 end\n\
             local r = decode(v)\nr[ARGV[1]] = ARGV[2] or false\n\
             redis.call('SET', KEYS[1], encode(r), 'KEEPTTL')\nreturn 1",
            RECORD_CODEC
        );
        let mut args = vec!["EVAL", &script, "1", record, field];
        args.extend(value);
        Ok(self.cli(&args)?.trim() == "1")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three `redis-server --cluster-enabled yes` nodes joined with `redis-cli --cluster create`.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three primaries (no replicas) and waits until the cluster is `ok`.
    ///
    /// # Errors
    /// A node does not start or the cluster does not form.
    pub fn start() -> io::Result<Self> {
        Self::start_with(|| Ok(Vec::new()))
    }

    /// Starts three primaries as [`RedisCluster::start`] does, each with the arguments
    /// `node_args` makes for it (`tls::Pki::redis_cluster`: a TLS port of its own).
    ///
    /// # Errors
    /// `node_args` fails, a node does not start or the cluster does not form.
    pub fn start_with(node_args: impl Fn() -> io::Result<Vec<String>>) -> io::Result<Self> {
        Self::start_nodes(0, node_args)
    }

    /// Three primaries, each with one replica (six nodes), for failovers: the replicas are
    /// in sync when this returns.
    ///
    /// # Errors
    /// A node does not start, the cluster does not form or a replica does not sync.
    pub fn with_replicas() -> io::Result<Self> {
        let cluster = Self::start_nodes(1, || Ok(Vec::new()))?;
        let deadline = Instant::now() + START_TIMEOUT;
        for node in &cluster.nodes {
            while node.cli(&["INFO", "replication"]).is_ok_and(|info| {
                info.contains("role:slave") && !info.contains("master_link_status:up")
            }) {
                if Instant::now() > deadline {
                    return Err(io::Error::other("a replica did not sync with its primary"));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(cluster)
    }

    /// Kills node `index` (of [`Self::nodes`]), as a crash would.
    pub fn stop_node(&mut self, index: usize) {
        if let Some(node) = self.nodes.get_mut(index) {
            node.stop();
        }
    }

    /// Freezes node `index` (of [`Self::nodes`]), as a hung host or a partition would
    /// ([`RedisServer::freeze`]).
    ///
    /// # Errors
    /// No such node, or it could not be frozen.
    pub fn freeze_node(&self, index: usize) -> io::Result<()> {
        self.nodes
            .get(index)
            .ok_or_else(|| io::Error::other("no such node"))?
            .freeze()
    }

    fn start_nodes(
        replicas: usize,
        node_args: impl Fn() -> io::Result<Vec<String>>,
    ) -> io::Result<Self> {
        let replicas_arg = replicas.to_string();
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            nodes.push(Self::start_node(node_args()?)?);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", &replicas_arg, "--cluster-yes"]);
        let out = Command::new("redis-cli").args(&args).output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            )));
        }
        let deadline = Instant::now() + START_TIMEOUT;
        for node in &nodes {
            while !node
                .cli(&["cluster", "info"])
                .is_ok_and(|info| info.contains("cluster_state:ok"))
            {
                if Instant::now() > deadline {
                    return Err(io::Error::other("the cluster did not reach state ok"));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(RedisCluster { nodes })
    }

    fn start_node(args: Vec<String>) -> io::Result<RedisServer> {
        let mut last_err = None;
        for _ in 0..5 {
            // The cluster bus listens on port + 10000: both must be free.
            let port = free_port(true)?;
            let dir = scratch_dir(port)?;
            let conf = dir.join("nodes.conf").to_string_lossy().into_owned();
            let mut node = RedisServer {
                program: REDIS_SERVER.to_owned(),
                port,
                dir,
                extra: vec![
                    "--cluster-enabled".into(),
                    "yes".into(),
                    "--cluster-config-file".into(),
                    conf,
                    "--cluster-node-timeout".into(),
                    "2000".into(),
                ]
                .into_iter()
                .chain(args.iter().cloned())
                .collect(),
                sentinel_conf: None,
                child: None,
            };
            match node.spawn() {
                Ok(()) => return Ok(node),
                Err(err) => last_err = Some(err),
            }
        }
        Err(last_err.unwrap_or_else(|| io::Error::other("cluster node did not start")))
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// A Cluster store configuration with every node as a seed.
    pub fn store_config(&self) -> StoreConfig {
        StoreConfig::Redis(RedisConfig {
            urls: self.urls(),
            topology: RedisTopology::Cluster,
            prefix: "idemgate".to_owned(),
            tls: RedisTls::default(),
        })
    }
}

/// A data node watched by one Redis Sentinel, which the sidecar asks for the master.
pub struct RedisSentinel {
    master: RedisServer,
    sentinel: RedisServer,
}

impl RedisSentinel {
    /// The master name the Sentinel monitors.
    pub const MASTER: &'static str = "idemgate";

    /// Starts a master and a Sentinel monitoring it, and waits until the Sentinel knows it.
    ///
    /// # Errors
    /// Either process does not start, or the Sentinel does not report the master.
    pub fn start() -> io::Result<Self> {
        let master = RedisServer::start()?;
        let port = master.port;
        Self::watching(master, port, "")
    }

    /// A Sentinel watching `master` at `monitored_port` (its TLS port, say), with extra
    /// configuration lines (e.g. the Sentinel's own `tls-port` and certificates).
    ///
    /// # Errors
    /// The Sentinel does not start, or does not report the master.
    pub fn watching(
        master: RedisServer,
        monitored_port: u16,
        extra_conf: &str,
    ) -> io::Result<Self> {
        let mut last_err = None;
        for _ in 0..5 {
            let port = free_port(false)?;
            let dir = scratch_dir(port)?;
            let conf = dir.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\n{extra_conf}\n\
                     sentinel monitor {} 127.0.0.1 {monitored_port} 1\n\
                     sentinel down-after-milliseconds {} 2000\n",
                    dir.display(),
                    Self::MASTER,
                    Self::MASTER,
                ),
            )?;
            let mut sentinel = RedisServer {
                program: REDIS_SERVER.to_owned(),
                port,
                dir,
                extra: Vec::new(),
                sentinel_conf: Some(conf),
                child: None,
            };
            match sentinel.spawn() {
                Ok(()) => {
                    let deadline = Instant::now() + START_TIMEOUT;
                    let expected = monitored_port.to_string();
                    while !sentinel
                        .cli(&["sentinel", "get-master-addr-by-name", Self::MASTER])
                        .is_ok_and(|out| out.contains(&expected))
                    {
                        if Instant::now() > deadline {
                            return Err(io::Error::other("the Sentinel does not know the master"));
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    return Ok(RedisSentinel { master, sentinel });
                }
                Err(err) => last_err = Some(err),
            }
        }
        Err(last_err.unwrap_or_else(|| io::Error::other("redis sentinel did not start")))
    }

    pub fn master(&self) -> &RedisServer {
        &self.master
    }

    /// A Sentinel store configuration (the Sentinel's URL, master [`Self::MASTER`]).
    pub fn store_config(&self) -> StoreConfig {
        StoreConfig::Redis(RedisConfig {
            urls: vec![self.sentinel.url()],
            topology: RedisTopology::Sentinel {
                master: Self::MASTER.to_owned(),
            },
            prefix: "idemgate".to_owned(),
            tls: RedisTls::default(),
        })
    }
}

fn free_port(with_bus: bool) -> io::Result<u16> {
    for _ in 0..50 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if port == 6379 || (with_bus && port > 55_535) {
            continue;
        }
        if with_bus && TcpListener::bind(("127.0.0.1", port + 10_000)).is_err() {
            continue;
        }
        return Ok(port);
    }
    Err(io::Error::other("no free loopback port"))
}

fn scratch_dir(port: u16) -> io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("idemgate-redis-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Waits until the server answers PING (a raw RESP exchange: no client needed).
fn wait_ready(port: u16, password: Option<&str>) -> io::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let attempt = (|| -> io::Result<bool> {
            let mut stream = TcpStream::connect(("127.0.0.1", port))?;
            stream.set_read_timeout(Some(Duration::from_secs(1)))?;
            if let Some(pw) = password {
                write!(stream, "*2\r\n$4\r\nAUTH\r\n${}\r\n{pw}\r\n", pw.len())?;
            }
            stream.write_all(b"PING\r\n")?;
            let mut buf = [0u8; 64];
            let mut got = Vec::new();
            while !got.ends_with(b"PONG\r\n") && got.len() < 64 {
                let n = stream.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                got.extend_from_slice(buf.get(..n).unwrap_or_default());
            }
            Ok(got.ends_with(b"PONG\r\n"))
        })();
        if attempt.is_ok_and(|ok| ok) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(io::Error::other(format!(
                "redis-server on port {port} did not answer PING"
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn redis_cli(port: u16, password: Option<&str>, args: &[&str]) -> io::Result<String> {
    let port = port.to_string();
    let mut cmd = Command::new("redis-cli");
    cmd.args(["-h", "127.0.0.1", "-p", &port]);
    if let Some(pw) = password {
        cmd.args(["--no-auth-warning", "-a", pw]);
    }
    let out = cmd.args(args).output()?;
    if !out.status.success() {
        return Err(io::Error::other(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
