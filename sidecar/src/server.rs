//! Serving: the accept loop (HTTP/1.1 and h2c on one port), the store chosen by the
//! configuration, and graceful shutdown — stop accepting, answer every waiting long-poll
//! with a `shutting-down` problem, then let connections drain within the grace period.
//!
//! [`run`] takes a pre-bound listener and any shutdown future; [`Sidecar`] starts one on a
//! task (tests, the demo) and stops it again.

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
use hyper_util::server::graceful::GracefulShutdown;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
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
        metrics,
        shutting_down: stop_rx,
    });
    let api = Api::new(app);
    let graceful = accept(listener, &config, shutdown, move |req, peer| {
        let api = api.clone();
        let mut req = req;
        req.extensions_mut().insert(ConnectInfo(peer));
        api.handle(req)
    })
    .await;
    tracing::info!("shutting down: answering waiters, draining connections");
    let _ = stop_tx.send(true);
    if tokio::time::timeout(config.shutdown_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?config.shutdown_grace, "connections still open after the grace period; closing");
    }
    Ok(())
}

/// The accept loop every server of this crate runs: HTTP/1.1 and h2c on one port with the
/// sidecar's connection settings, each request answered by `handle(request, peer)`, until
/// `shutdown`. Returns the open connections, for a graceful drain.
async fn accept<H, F>(
    listener: TcpListener,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send,
    handle: H,
) -> GracefulShutdown
where
    H: Fn(hyper::Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = axum::response::Response> + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(config.h2_max_streams)
        .keep_alive_interval(Some(Duration::from_secs(20)));
    let graceful = GracefulShutdown::new();
    tracing::info!(addr = ?listener.local_addr().ok(), "idemgate sidecar listening (HTTP/1.1 and h2c)");
    tokio::pin!(shutdown);
    loop {
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
        let handle = handle.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let answer = handle(req, peer);
            async move { Ok::<_, std::convert::Infallible>(answer.await) }
        });
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(%peer, %err, "connection ended with an error");
            }
        });
    }
    graceful
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
            let graceful = accept(listener, &config, stopped, move |req, _| {
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
            let _ = tokio::time::timeout(config.shutdown_grace, graceful.shutdown()).await;
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
