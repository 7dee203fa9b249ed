//! HTTP client connections to clusters — HTTP/1.1, or HTTP/2 with prior knowledge when the
//! cluster says so — kept in a per-worker pool of keep-alive connections, as Envoy pools
//! upstream connections per worker. Everything here runs on a `LocalSet` (bodies need not be
//! `Send`).

use crate::plugin::Cluster;
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::TokioIo;
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Any request body the gateway sends (callout bodies, streamed client bodies).
pub(crate) type ClientBody = UnsyncBoxBody<Bytes, BoxError>;

/// How an exchange failed before a response head arrived (Envoy's router turns both into a
/// 503 "upstream connect error or disconnect/reset before headers").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    Connect,
    ResetBeforeHeaders,
}

/// hyper's executor for single-threaded event loops: tasks stay on this thread.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: std::future::Future + 'static,
    F::Output: 'static,
{
    fn execute(&self, future: F) {
        tokio::task::spawn_local(future);
    }
}

enum Sender {
    Http1(http1::SendRequest<ClientBody>),
    Http2(http2::SendRequest<ClientBody>),
}

impl Sender {
    fn is_closed(&self) -> bool {
        match self {
            Self::Http1(s) => s.is_closed(),
            Self::Http2(s) => s.is_closed(),
        }
    }

    fn is_ready(&self) -> bool {
        match self {
            Self::Http1(s) => s.is_ready(),
            Self::Http2(s) => s.is_ready(),
        }
    }
}

/// Idle connections kept per endpoint.
const MAX_IDLE: usize = 64;

/// Keep-alive connections by endpoint and protocol. An HTTP/1.1 connection is returned as
/// soon as its response head arrived and is reused once hyper reports it ready (its body was
/// read); one HTTP/2 connection per endpoint is shared by all requests. Two clusters on one
/// endpoint with different protocols (a backend's REST and gRPC clusters on its one port)
/// never share a connection: Envoy's pools belong to a cluster's per-worker entry, one per
/// host and protocol (`ClusterEntry::httpConnPool`, source/common/upstream/cluster_manager_impl.cc).
#[derive(Default)]
pub(crate) struct Pool {
    idle: RefCell<HashMap<Endpoint, Vec<Sender>>>,
}

/// A pool's key: the endpoint's address and whether the cluster speaks HTTP/2.
type Endpoint = (SocketAddr, bool);

async fn connect(cluster: &Cluster, address: SocketAddr) -> Result<Sender, Failure> {
    let stream = tokio::time::timeout(
        cluster.connect_timeout,
        tokio::net::TcpStream::connect(address),
    )
    .await
    .map_err(|_| Failure::Connect)?
    .map_err(|_| Failure::Connect)?;
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(stream);
    if cluster.http2 {
        let mut builder = http2::Builder::new(LocalExec);
        if let Some(streams) = cluster.max_concurrent_streams {
            builder.initial_max_send_streams(streams as usize);
        }
        let (sender, conn) = builder.handshake(io).await.map_err(|_| Failure::Connect)?;
        tokio::task::spawn_local(conn);
        Ok(Sender::Http2(sender))
    } else {
        let (sender, conn) = http1::handshake(io).await.map_err(|_| Failure::Connect)?;
        tokio::task::spawn_local(conn);
        Ok(Sender::Http1(sender))
    }
}

impl Pool {
    fn take_ready(&self, address: Endpoint) -> Option<Sender> {
        let mut idle = self.idle.borrow_mut();
        let list = idle.get_mut(&address)?;
        list.retain(|s| !s.is_closed());
        let at = list.iter().position(Sender::is_ready)?;
        Some(match list.swap_remove(at) {
            Sender::Http2(shared) => {
                list.push(Sender::Http2(shared.clone()));
                Sender::Http2(shared)
            }
            http1 => http1,
        })
    }

    fn give_back(&self, address: Endpoint, sender: Sender) {
        let mut idle = self.idle.borrow_mut();
        let list = idle.entry(address).or_default();
        let shared_h2 = matches!(sender, Sender::Http2(_))
            && list.iter().any(|s| matches!(s, Sender::Http2(_)));
        if !shared_h2 && list.len() < MAX_IDLE {
            list.push(sender);
        }
    }

    /// Sends `request` to the cluster's endpoint; the response body streams from the socket.
    pub(crate) async fn send(
        &self,
        cluster: &Cluster,
        request: http::Request<ClientBody>,
    ) -> Result<http::Response<Incoming>, Failure> {
        let address = cluster.address.ok_or(Failure::Connect)?;
        let endpoint = (address, cluster.http2);
        let mut sender = match self.take_ready(endpoint) {
            Some(sender) => sender,
            None => connect(cluster, address).await?,
        };
        let response = match &mut sender {
            Sender::Http1(s) => s.send_request(request).await,
            Sender::Http2(s) => s.send_request(request).await,
        }
        .map_err(|_| Failure::ResetBeforeHeaders)?;
        self.give_back(endpoint, sender);
        Ok(response)
    }
}
