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

use super::conn::SentinelConn;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, ErrorKind, RedisError, RedisResult, Value};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
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

/// Where a batch goes: the one server's connection, or the master the Sentinels name now.
pub(super) enum Target {
    Server(ConnectionManager),
    Sentinel(Arc<SentinelConn>),
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
            let mut conn = self.target.connection().await?;
            let answer = conn.req_packed_command(cmd).await;
            self.target
                .note(answer.as_ref().map(std::slice::from_ref))
                .await;
            return answer.and_then(Value::extract_error);
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
        answer.await.unwrap_or_else(|_| {
            Err(RedisError::from((
                ErrorKind::Io,
                "the Redis batch was dropped before it was answered",
            )))
        })
    }

    async fn flush(self: Arc<Self>) {
        tokio::task::yield_now().await;
        let batch =
            std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner));
        self.batches.fetch_add(1, Ordering::Relaxed);
        let (cmds, replies): (Vec<Cmd>, Vec<_>) =
            batch.into_iter().map(|p| (p.cmd, p.reply)).unzip();
        // Bounded: every caller stops waiting at the store timeout, and a batch on a
        // connection that never answers must not keep its task alive after them.
        let sent = async {
            let mut conn = self.target.connection().await?;
            send_batch(&mut conn, cmds).await
        };
        let answers = tokio::time::timeout(self.timeout, sent)
            .await
            .unwrap_or_else(|_| Err(timeout_error()));
        self.target.note(answers.as_deref()).await;
        match answers {
            Ok(values) => {
                for (reply, value) in replies.into_iter().zip(values) {
                    // A caller that gave up (its timeout) dropped its receiver: nothing to do.
                    let _ = reply.send(value.extract_error());
                }
            }
            Err(e) => {
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// The Sentinel paths are boxed: a future's size is that of its largest state, and every
/// layer above a store call (verb, handler, router) embeds it and moves it whole, so a
/// standalone server's calls must not carry the Sentinel resolution's state.
impl Target {
    pub(super) async fn connection(&self) -> RedisResult<ConnectionManager> {
        match self {
            Target::Server(conn) => Ok(conn.clone()),
            Target::Sentinel(sentinel) => Box::pin(sentinel.get()).await,
        }
    }

    /// What the Sentinels' master answered, for [`SentinelConn::checked`].
    pub(super) async fn note(&self, answers: Result<&[Value], &RedisError>) {
        if let Target::Sentinel(sentinel) = self {
            Box::pin(sentinel.checked(answers)).await;
        }
    }
}

/// What a call that ran out of the store timeout failed with: an I/O time-out, which
/// redis-rs retries rather than reconnects for (as its own response timeout failed).
pub(super) fn timeout_error() -> RedisError {
    RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
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

/// Several commands as one pipeline (one as itself); one reply per command either way.
async fn send_batch(conn: &mut ConnectionManager, cmds: Vec<Cmd>) -> RedisResult<Vec<Value>> {
    let count = cmds.len();
    let values = if let [cmd] = cmds.as_slice() {
        vec![conn.req_packed_command(cmd).await?]
    } else {
        let mut pipe = redis::Pipeline::with_capacity(count);
        for cmd in cmds {
            pipe.add_command(cmd);
        }
        conn.req_packed_commands(&pipe, 0, count).await?
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
    use super::{Gather, Target};
    use redis::aio::ConnectionManager;
    use std::collections::BTreeSet;

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
}
