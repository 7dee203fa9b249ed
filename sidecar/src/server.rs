//! Serving: the accept loop (HTTP/1.1 and h2c on one port), the store chosen by the
//! configuration, and graceful shutdown — stop accepting, answer every waiting long-poll
//! with a `shutting-down` problem, then let connections drain within the grace period.
//!
//! [`run`] takes a pre-bound listener and any shutdown future; [`Sidecar`] starts one on a
//! task (tests, the demo) and stops it again.

use crate::batched::BatchedWrites;
use crate::config::{Config, StoreConfig};
use crate::http::{Api, App};
use crate::locks::Locks;
use crate::metrics::Metrics;
use crate::store::memory::MemoryStore;
use crate::store::redis::RedisStore;
use crate::store::{Store, StoreError};
use crate::waiters::Waiters;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, oneshot, watch};
use tokio::task::JoinHandle;

/// Why the server could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot use the store: {0}")]
    Store(#[from] StoreError),
    #[error("cannot set up metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
    #[error("the server task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Serves the sidecar API on `listener` until `shutdown` completes, then shuts down
/// gracefully.
///
/// # Errors
/// The store cannot be set up (a malformed Redis URL, an unreachable Cluster).
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    let config = Arc::new(config);
    let waiters = Arc::new(Waiters::default());
    match &config.store {
        StoreConfig::Memory => {
            let store = MemoryStore::new(waiters, config.fence_ttl);
            serve(listener, config, Arc::new(store), shutdown).await
        }
        StoreConfig::Redis(redis) => {
            let store =
                RedisStore::connect(redis, waiters, config.fence_ttl, config.store_timeout).await?;
            serve(listener, config, Arc::new(store), shutdown).await
        }
    }
}

async fn serve<S: Store>(
    listener: TcpListener,
    config: Arc<Config>,
    store: Arc<S>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServerError> {
    let metrics = Arc::new(Metrics::new()?);
    let (stop_tx, stop_rx) = watch::channel(false);
    let app = Arc::new(App {
        locks: Locks::new(
            store,
            Arc::clone(&config),
            Arc::clone(&metrics),
            stop_rx.clone(),
        ),
        config: Arc::clone(&config),
        metrics: Arc::clone(&metrics),
        shutting_down: stop_rx,
    });
    let api = Api::new(app);
    let drain = accept(listener, &config, &metrics, shutdown, move |req, peer| {
        let api = api.clone();
        let mut req = req;
        req.extensions_mut().insert(ConnectInfo(peer));
        api.handle(req)
    })
    .await;
    tracing::info!("shutting down: answering waiters, draining connections");
    let _ = stop_tx.send(true);
    if tokio::time::timeout(config.shutdown_grace, drain.wait())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?config.shutdown_grace, "connections still open after the grace period; closing");
    }
    Ok(())
}

/// What one connection is doing, for its idle timeout: requests in flight and when the
/// last one started or ended.
struct Activity {
    opened: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds from `opened` to the last request's start or end.
    last_ms: AtomicU64,
}

impl Activity {
    fn touch(&self) {
        let ms = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// How long the connection has had nothing in flight (zero while a request runs).
    fn idle_for(&self) -> Duration {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return Duration::ZERO;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.opened.elapsed().saturating_sub(last)
    }
}

/// Counts a request in flight until dropped (answered, or cancelled with its connection).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::Relaxed);
        activity.touch();
        InFlight(Arc::clone(activity))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The open connections of a server that stopped accepting: [`Drain::wait`] returns once
/// every one has closed (each was told to finish gracefully).
pub(crate) struct Drain(watch::Sender<()>);

impl Drain {
    async fn wait(self) {
        // No receiver left (no connection open) is as good as told.
        let _ = self.0.send(());
        self.0.closed().await;
    }
}

/// The accept loop every server of this crate runs: HTTP/1.1 and h2c on one port with the
/// sidecar's connection settings, each request answered by `handle(request, peer)`, until
/// `shutdown`. Returns the open connections, for a graceful drain.
///
/// Connections cost a file descriptor each, so none may be held for free: at most
/// `max_connections` are open (more wait in the kernel's listen backlog), one that sends
/// nothing within `first_byte_timeout` is closed, and so is one with no request in flight
/// for `idle_timeout`.
async fn accept<H, F>(
    listener: TcpListener,
    config: &Config,
    metrics: &Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send,
    handle: H,
) -> Drain
where
    H: Fn(hyper::Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = axum::response::Response> + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.first_byte_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(config.h2_max_streams)
        .keep_alive_interval(Some(Duration::from_secs(20)));
    let builder = Arc::new(builder);
    let (drain, stopping) = watch::channel(());
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let (first_byte, idle) = (config.first_byte_timeout, config.idle_timeout);
    tracing::info!(
        addr = ?listener.local_addr().ok(),
        max_connections = config.max_connections,
        ?first_byte,
        ?idle,
        "idemgate sidecar listening (HTTP/1.1 and h2c)"
    );
    tokio::pin!(shutdown);
    loop {
        let slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                tracing::warn!(
                    max_connections = config.max_connections,
                    "connection cap reached; new connections wait in the listen backlog"
                );
                tokio::select! {
                    slot = Arc::clone(&slots).acquire_owned() => match slot {
                        Ok(slot) => slot,
                        Err(_) => break, // never closed
                    },
                    () = &mut shutdown => break,
                }
            }
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Usually out of file descriptors: back off instead of spinning.
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Small request/response messages: do not let Nagle hold them back.
        let _ = stream.set_nodelay(true);
        let (handle, builder, metrics) =
            (handle.clone(), Arc::clone(&builder), Arc::clone(metrics));
        let mut stopping = stopping.clone();
        tokio::spawn(async move {
            let _slot = slot;
            metrics.connections.inc();
            let closed = serve_connection(
                stream,
                peer,
                &builder,
                handle,
                first_byte,
                idle,
                &mut stopping,
            )
            .await;
            metrics.connections.dec();
            if let Some(reason) = closed {
                metrics
                    .connections_closed
                    .with_label_values(&[reason])
                    .inc();
            }
        });
    }
    Drain(drain)
}

/// Serves one connection until it ends; returns why the server closed it, if it did
/// (`first_byte_timeout` or `idle_timeout`).
async fn serve_connection<H, F>(
    stream: TcpStream,
    peer: SocketAddr,
    builder: &auto::Builder<TokioExecutor>,
    handle: H,
    first_byte: Duration,
    idle: Duration,
    stopping: &mut watch::Receiver<()>,
) -> Option<&'static str>
where
    H: Fn(hyper::Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = axum::response::Response> + Send + 'static,
{
    // Nothing is parsed (HTTP/1.1 or h2c?) before the first byte: bound that wait here.
    let mut first = [0u8; 1];
    tokio::select! {
        // `peek` waits for a byte (`readable` may report a fresh socket ready at once).
        peeked = tokio::time::timeout(first_byte, stream.peek(&mut first)) => match peeked {
            Ok(Ok(0) | Err(_)) => return None,
            Ok(Ok(_)) => {}
            Err(_) => {
                tracing::debug!(%peer, "closed a connection that sent nothing");
                return Some("first_byte_timeout");
            }
        },
        _ = stopping.changed() => return None,
    }
    let activity = Arc::new(Activity {
        opened: Instant::now(),
        in_flight: AtomicUsize::new(0),
        last_ms: AtomicU64::new(0),
    });
    let service = {
        let activity = Arc::clone(&activity);
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let in_flight = InFlight::start(&activity);
            // Boxed: hyper spawns each h2 stream as a task holding this future, and tokio
            // moves a task's future by value when it is spawned and again when it finishes.
            // The sidecar's answer future is kilobytes (router, extractors, the store call);
            // behind a box those moves are a pointer's, which costs one allocation instead
            // of ~3,800 instructions of `memcpy` per claim+complete pair (callgrind).
            let answer = Box::pin(handle(req, peer));
            async move {
                let response = answer.await;
                drop(in_flight);
                Ok::<_, std::convert::Infallible>(response)
            }
        })
    };
    // A request counts itself out before hyper writes its answer, so any left are others.
    let others_in_flight = {
        let activity = Arc::clone(&activity);
        move || activity.in_flight.load(Ordering::Relaxed) > 0
    };
    let connection = builder
        .serve_connection(
            TokioIo::new(BatchedWrites::new(stream, others_in_flight)),
            service,
        )
        .into_owned();
    tokio::pin!(connection);
    let mut closed_by = None;
    // Checked often enough to close within a quarter of the timeout past it.
    let check_every = (idle / 4).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(err) = result {
                    tracing::debug!(%peer, %err, "connection ended with an error");
                }
                return closed_by;
            }
            _ = stopping.changed(), if closed_by.is_none() => {
                connection.as_mut().graceful_shutdown();
                closed_by = Some("shutdown");
            }
            () = tokio::time::sleep(check_every), if closed_by.is_none() => {
                if activity.idle_for() >= idle {
                    tracing::debug!(%peer, "closing an idle connection");
                    connection.as_mut().graceful_shutdown();
                    closed_by = Some("idle_timeout");
                }
            }
        }
    }
}

/// A sidecar running on a task of the current runtime: for tests, the demo, embedding.
///
/// ```no_run
/// # async fn demo() -> Result<(), idemgate_sidecar::ServerError> {
/// use idemgate_sidecar::{Config, Sidecar, StoreConfig};
/// let sidecar = Sidecar::spawn(Config::loopback(StoreConfig::Memory)).await?;
/// println!("claim at {}/v1/claim", sidecar.url());
/// sidecar.shutdown().await
/// # }
/// ```
pub struct Sidecar {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServerError>>>,
}

impl Sidecar {
    /// Binds `config.listen` (use port 0 for an ephemeral port) and starts serving.
    ///
    /// # Errors
    /// The address cannot be bound. Store set-up errors surface from [`Sidecar::shutdown`].
    pub async fn spawn(config: Config) -> Result<Sidecar, ServerError> {
        let listener = TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run(listener, config, async {
            let _ = stopped.await;
        }));
        Ok(Sidecar {
            addr,
            stop: Some(stop),
            task: Some(task),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Shuts down gracefully and waits for it.
    ///
    /// # Errors
    /// What stopped the server early (e.g. the store could not be set up).
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await?,
            None => Ok(()),
        }
    }
}

#[cfg(feature = "testing")]
impl Sidecar {
    /// A server on the sidecar's own stack (accept loop, connection settings, axum) whose
    /// `claim` answers `granted` and `complete` answers `released` with fixed bodies, without
    /// a store or any protocol work: the HTTP hop alone, the floor under every store
    /// (benchmarks compare against it).
    ///
    /// # Errors
    /// The address cannot be bound.
    pub async fn spawn_canned(config: Config) -> Result<Sidecar, ServerError> {
        let listener = TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let router = crate::http::canned_router(&config);
        let task = tokio::spawn(async move {
            let stopped = async {
                let _ = stopped.await;
            };
            let metrics = Arc::new(Metrics::new()?);
            let drain = accept(listener, &config, &metrics, stopped, move |req, _| {
                use tower::ServiceExt;
                let answer = router.clone().oneshot(req.map(axum::body::Body::new));
                async move {
                    match answer.await {
                        Ok(response) => response,
                        Err(never) => match never {},
                    }
                }
            })
            .await;
            let _ = tokio::time::timeout(config.shutdown_grace, drain.wait()).await;
            Ok(())
        });
        Ok(Sidecar {
            addr,
            stop: Some(stop),
            task: Some(task),
        })
    }
}

impl Drop for Sidecar {
    /// Dropping without [`Sidecar::shutdown`] still starts a graceful shutdown.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
