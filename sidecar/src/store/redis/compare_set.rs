//! How a fresh grant's complete sends its compare-and-set: one `SET … IFEQ` where the
//! server has it, the `COMPLETE_FRESH` script where it has not.
//!
//! The complete of a grant this sidecar wrote itself (`held.rs`) has nothing to decide but
//! "is the record still that grant, byte for byte": if so it becomes the released record.
//! `SET key released IFEQ grant` is exactly that, as one command: Valkey has it since 8.1,
//! Redis since 8.4 (`IFEQ`: set only if the key exists and its value equals the one given;
//! the reply is `OK` when it set, nil when not). Redis 7 and earlier have no such command,
//! and the script does the same with a `GET` and a `SET` inside Lua. On Redis 7.0 the script
//! is two thirds of the server's instructions for a fresh claim+complete pair (callgrind,
//! BENCHMARKS.md, the peer group's notes): Lua's call machinery and the copy of the record
//! into a Lua string, then out again.
//!
//! Which one a server has is learnt by sending it: a server without `IFEQ` refuses the
//! command with a plain `ERR` (Redis 7: `ERR syntax error`), having written nothing. The
//! complete then runs the script, and the store sends the script for a while before trying
//! the command again, so a server upgraded in place (or a failover to a newer replica) is
//! noticed without a restart, and an old one costs one refused command a minute.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a server that refused `IFEQ` is sent the script before the command is tried again.
pub(super) const RETRY_AFTER: Duration = Duration::from_secs(60);

/// Whether to send `SET … IFEQ` now, learnt from the server's answers.
pub(super) struct CompareSet {
    /// What `until_ms` counts from.
    since: Instant,
    /// Until this many ms after `since`, send the script (0: send the command).
    until_ms: AtomicU64,
    /// A refusal was logged: later ones are not (one a minute on an old server).
    logged: AtomicBool,
}

impl Default for CompareSet {
    fn default() -> Self {
        CompareSet {
            since: Instant::now(),
            until_ms: AtomicU64::new(0),
            logged: AtomicBool::new(false),
        }
    }
}

impl CompareSet {
    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Send `SET … IFEQ` (not the script).
    pub(super) fn command(&self) -> bool {
        let until = self.until_ms.load(Ordering::Relaxed);
        until == 0 || self.elapsed_ms() >= until
    }

    /// The server answered the command: keep sending it.
    pub(super) fn answered(&self) {
        if self.until_ms.load(Ordering::Relaxed) != 0 {
            self.until_ms.store(0, Ordering::Relaxed);
        }
    }

    /// The server refused the command: send the script for [`RETRY_AFTER`].
    pub(super) fn refused(&self, err: &redis::RedisError) {
        let until = self
            .elapsed_ms()
            .saturating_add(u64::try_from(RETRY_AFTER.as_millis()).unwrap_or(u64::MAX))
            .max(1);
        self.until_ms.store(until, Ordering::Relaxed);
        if !self.logged.swap(true, Ordering::Relaxed) {
            tracing::info!(
                error = %err,
                "Redis refused SET IFEQ (it needs Valkey 8.1 or Redis 8.4); completes use a script, and the command is tried again every {} s",
                RETRY_AFTER.as_secs()
            );
        }
    }
}

/// Whether `err` is a server's refusal of the command as such: a plain `ERR` reply, which is
/// what a server answers to an option it does not know (and then writes nothing). Not a
/// connection error, a time-out, a failover's `READONLY` or `LOADING`, nor `OOM`: those are
/// the store's errors, whatever the command.
pub(super) fn is_refusal(err: &redis::RedisError) -> bool {
    err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn syntax_error() -> redis::RedisError {
        redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "An error was signalled by the server",
            "syntax error".to_owned(),
        ))
    }

    #[test]
    fn a_refusal_sends_the_script_until_the_retry_is_due() {
        let cs = CompareSet::default();
        assert!(cs.command());
        cs.refused(&syntax_error());
        assert!(!cs.command());
        // Due again: the command is sent, and an answer keeps it.
        cs.until_ms.store(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(2));
        assert!(cs.command());
        cs.answered();
        assert_eq!(cs.until_ms.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn only_a_plain_err_is_a_refusal() {
        assert!(is_refusal(&syntax_error()));
        let readonly = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "read only",
        ));
        assert!(!is_refusal(&readonly));
        let io = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert!(!is_refusal(&io));
    }
}
