//! This process's notification inbox: one pub/sub channel per sidecar process, which
//! scripts that hand a key to one of its waiters PUBLISH the waiter's owner token to. Plain
//! PUBLISH reaches subscribers on any Cluster node, so one subscription per process suffices
//! whatever the topology. Lost messages are covered by the waiters' re-check interval, and
//! every (re)subscription wakes all local waiters to re-check at once.

use super::conn::{node_client, sentinel_client};
use crate::config::{RedisConfig, RedisTopology, redact_url};
use crate::waiters::Waiters;
use futures_util::StreamExt;
use redis::{ErrorKind, RedisError};
use std::sync::Arc;
use std::time::Duration;

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
pub(super) async fn subscribe_inbox(
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
