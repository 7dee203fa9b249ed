//! What a VM runs: the compiled module (compiled once per file and shared by every VM, as
//! Envoy clones one base VM) and the plugin's Envoy configuration.

use crate::shared::lock;
use crate::vm::VmState;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};
use wasmtime::{Cache, CacheConfig, Config, Engine, InstancePre, Linker, Module};

/// Errors loading a module or booting a VM.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "reading {path}: {source} (build the modules with `cargo xtask wasm` from the workspace root)"
    )]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("compiling {path}: {message}")]
    Compile { path: PathBuf, message: String },
    /// Envoy refuses such a module ("missing import", no ABI marker, no allocator).
    #[error("{path} is not a loadable proxy-wasm module: {message}")]
    NotProxyWasm { path: PathBuf, message: String },
    #[error("instantiating the VM: {0}")]
    Instantiate(String),
    /// A start callback trapped or returned false (Envoy rejects the configuration).
    #[error("plugin {plugin} failed to start: {message}")]
    Start { plugin: String, message: String },
}

/// Envoy's `failure_policy` (or the legacy `fail_open`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Streams on a failed VM get a 503 with details `wasm_fail_stream` (Envoy's default).
    #[default]
    FailClosed,
    /// The filter is skipped on a failed VM.
    FailOpen,
    /// A failed VM is re-created for the next stream (at most once per backoff interval).
    FailReload,
}

/// One `envoy.filters.http.wasm` filter's configuration (`PluginConfig` + `VmConfig`).
#[derive(Debug, Clone)]
pub struct PluginSettings {
    /// `config.name`: the `plugin_name` property and the log prefix.
    pub name: String,
    pub root_id: String,
    /// Shared data and queues are scoped by it.
    pub vm_id: String,
    /// `vm_config.configuration` (given to `on_vm_start`).
    pub vm_configuration: Vec<u8>,
    /// `config.configuration` (given to `on_configure`).
    pub configuration: Vec<u8>,
    pub failure_policy: FailurePolicy,
    /// FAIL_RELOAD backoff (`reload_config.backoff.base_interval`, default 1 s).
    pub reload_backoff: Duration,
    pub allow_on_headers_stop_iteration: bool,
    /// The stream buffer limit (listener `per_connection_buffer_limit_bytes`, default 1 MiB).
    pub buffer_limit: usize,
    /// `vm_config.environment_variables.key_values`.
    pub environment: Vec<(String, String)>,
    /// What `proxy_get_log_level` reports (Envoy's `wasm` logger level, default info).
    pub log_level: crate::abi::LogLevel,
}

impl Default for PluginSettings {
    fn default() -> Self {
        Self {
            name: String::new(),
            root_id: String::new(),
            vm_id: String::new(),
            vm_configuration: Vec::new(),
            configuration: Vec::new(),
            failure_policy: FailurePolicy::FailClosed,
            reload_backoff: Duration::from_secs(1),
            allow_on_headers_stop_iteration: false,
            buffer_limit: 1 << 20,
            environment: Vec::new(),
            log_level: crate::abi::LogLevel::Info,
        }
    }
}

/// An upstream cluster a callout may name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    pub name: String,
    /// Loopback endpoint; `None` for clusters that exist only by name (deterministic tests).
    pub address: Option<SocketAddr>,
    /// `explicit_http_config.http2_protocol_options` (HTTP/2 prior knowledge).
    pub http2: bool,
    pub connect_timeout: Duration,
    /// `http2_protocol_options.max_concurrent_streams`: streams opened on one connection
    /// before the server's own limit is known.
    pub max_concurrent_streams: Option<u32>,
    /// Circuit breaker `max_requests` (Envoy's default 1024): concurrent requests to the
    /// cluster from the whole process, callouts included; beyond it callouts fail inline
    /// (InternalFailure) and routed requests get a 503 overflow.
    pub max_requests: u32,
}

impl Cluster {
    pub fn named(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            address: None,
            http2: false,
            connect_timeout: Duration::from_secs(5),
            max_concurrent_streams: None,
            max_requests: 1024,
        }
    }

    pub fn at(name: &str, address: SocketAddr) -> Self {
        Self {
            address: Some(address),
            ..Self::named(name)
        }
    }
}

/// The clusters known to the host (Envoy's thread-local cluster manager), by name.
pub type Clusters = Arc<BTreeMap<String, Cluster>>;

/// A compiled proxy-wasm module, ready to be instantiated once per worker.
#[derive(Clone)]
pub struct WasmModule {
    pub(crate) pre: InstancePre<VmState>,
    path: PathBuf,
}

impl std::fmt::Debug for WasmModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmModule")
            .field("path", &self.path)
            .finish()
    }
}

/// One engine per process, with wasmtime's on-disk code cache under `target/wasm-cache`:
/// compiling the filter costs ~100 ms (seconds under valgrind), loading its cached machine
/// code ~0.3 ms, and every test binary and benchmark child would otherwise compile it again.
/// A cache that cannot be set up only costs time, so the engine then runs without one.
fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut config = Config::new();
        let mut cache = CacheConfig::new();
        cache.with_directory(crate::target_dir().join("wasm-cache"));
        if let Ok(cache) = Cache::new(cache) {
            config.cache(Some(cache));
        }
        Engine::new(&config).unwrap_or_default()
    })
}

type CacheKey = (PathBuf, Option<SystemTime>);

/// Compiled code is immutable, so one process-wide cache keyed by (file, mtime) is safe to
/// share between parallel tests; all per-test state lives in each VM's `Store`.
fn cache() -> &'static Mutex<HashMap<CacheKey, WasmModule>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, WasmModule>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

impl WasmModule {
    /// Compiles (or reuses the compilation of) a module, checking it is loadable as Envoy would.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let meta = std::fs::metadata(path).map_err(|source| LoadError::Read {
            path: path.to_owned(),
            source,
        })?;
        let key = (path.to_owned(), meta.modified().ok());
        if let Some(module) = lock(cache()).get(&key) {
            return Ok(module.clone());
        }
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
            path: path.to_owned(),
            source,
        })?;
        let module = Self::from_bytes(&bytes, path)?;
        lock(cache()).insert(key, module.clone());
        Ok(module)
    }

    fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, LoadError> {
        let not_proxy_wasm = |message: String| LoadError::NotProxyWasm {
            path: path.to_owned(),
            message,
        };
        let module = Module::new(engine(), bytes).map_err(|e| LoadError::Compile {
            path: path.to_owned(),
            message: format!("{e:#}"),
        })?;
        let exports: Vec<&str> = module.exports().map(|e| e.name()).collect();
        if !exports.contains(&"proxy_abi_version_0_2_1") {
            return Err(not_proxy_wasm(
                "no proxy_abi_version_0_2_1 export (only ABI 0.2.1 is supported)".into(),
            ));
        }
        if !exports.contains(&"malloc") && !exports.contains(&"proxy_on_memory_allocate") {
            return Err(not_proxy_wasm(
                "exports neither malloc nor proxy_on_memory_allocate".into(),
            ));
        }
        let mut linker: Linker<VmState> = Linker::new(engine());
        crate::hostcalls::add_to_linker(&mut linker)
            .map_err(|e| not_proxy_wasm(format!("{e:#}")))?;
        crate::wasi::add_to_linker(&mut linker).map_err(|e| not_proxy_wasm(format!("{e:#}")))?;
        let pre = linker
            .instantiate_pre(&module)
            .map_err(|e| not_proxy_wasm(format!("missing import: {e:#}")))?;
        Ok(Self {
            pre,
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}
