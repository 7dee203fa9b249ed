//! Redis's clock as this sidecar last read it, and what it must read now.
//!
//! Every claim script that grants answers with Redis's clock as the script read it, which
//! happened after the claim was sent. So that reading plus the time passed since sending
//! (with 0.1 % on top for the two clocks' drift) is never behind Redis's clock; it is ahead
//! by at most the claim's way to Redis and its wait there. Two things rest on that bound:
//! - a complete writes its record without reading it first (`held.rs`), and only trusts the
//!   reading to say a lease is *not* over (a lease that seems over is checked again on
//!   Redis's own clock by the script);
//! - a fresh key's claim is one `SET NX GET` with no script (`RedisStore::claim`), its fence
//!   and grant time this reading. A reading ahead of Redis only makes the lease end, as
//!   Redis sees it, a little after its holder's own view of it (which starts before the
//!   claim was sent), and the fence a little larger: both safe. The fence must still be
//!   above every fence issued earlier for the key. A key with no record had its last
//!   record expire after its last fence was issued (at least a second after, unless a
//!   response was stored with a shorter retention), and a reading is never behind Redis's
//!   clock, so it is above every fence Redis's clock gave. A fence from a reading is ahead
//!   of the clock by at most that reading's lead; only readings whose claim was answered
//!   within [`MAX_LEAD`] are kept, and one is used for at most [`FRESH_FOR`] (0.1 % drift
//!   allowance on top), so that lead stays far under the second. (A fence below an earlier
//!   one, where a response stored for less than that lead expired in between, would only
//!   make a fencing backend refuse the new holder; the earlier holder had completed.)
//!
//! One clock: a standalone server, or the master behind Sentinels. On a Cluster each
//! primary has its own, so no reading is kept there (`RedisStore`'s `clock`).
//!
//! After a Sentinel failover the reading follows the old master's clock for at most
//! [`FRESH_FOR`]: the clock its replicated records' fences and leases were written on, so a
//! grant made on it stands as those records do. What this does not cover is what Redis's
//! own clock does not either: a step backwards of the server's clock (NTP stepping it) puts
//! later fences below earlier ones for keys whose records expired, with or without this
//! reading.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a reading is used for a fresh key's claim; past it, the next claim runs the
/// script, which reads the clock again. Well under the second by which a record outlives
/// its last fence, and frequent enough that the drift allowance stays in the microseconds.
pub(super) const FRESH_FOR: Duration = Duration::from_millis(500);

/// How long a claim may take, sent to answered, for the clock it read to be kept: the most
/// a kept reading is ahead of Redis's clock. A slower answer's reading is not kept (the next
/// claims run the script until a prompt one reads the clock again).
pub(super) const MAX_LEAD: Duration = Duration::from_millis(50);

/// One reading of Redis's clock, in µs, and when the command that read it was sent.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    clock_us: u64,
    sent: Instant,
}

impl Reading {
    pub(super) fn new(clock_us: u64, sent: Instant) -> Self {
        Reading { clock_us, sent }
    }

    /// The clock as read, in µs.
    pub(super) fn read_us(&self) -> u64 {
        self.clock_us
    }

    /// Redis's clock now, never behind it (module docs), in µs.
    pub(super) fn now_us(&self) -> u64 {
        self.at_us(Instant::now())
    }

    /// Redis's clock at `now` (not before the reading was sent), never behind it, in µs.
    fn at_us(&self, now: Instant) -> u64 {
        let passed =
            u64::try_from(now.saturating_duration_since(self.sent).as_micros()).unwrap_or(u64::MAX);
        self.clock_us
            .saturating_add(passed)
            .saturating_add(passed / 1000)
            .saturating_add(1)
    }
}

/// The latest reading of Redis's clock on this sidecar's connection.
#[derive(Default)]
pub(super) struct RedisClock {
    last: Mutex<Option<Reading>>,
}

impl RedisClock {
    /// Keeps `reading`, answered now, if its command was answered within [`MAX_LEAD`] and
    /// sent after the one kept: every reading is a bound from above, and the later one has
    /// had less time to drift.
    pub(super) fn observe(&self, reading: Reading) {
        if reading.sent.elapsed() > MAX_LEAD {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if last.is_none_or(|kept| kept.sent <= reading.sent) {
            *last = Some(reading);
        }
    }

    /// Redis's clock now, never behind it, as a reading taken now, when the latest reading
    /// is younger than [`FRESH_FOR`].
    pub(super) fn fresh(&self) -> Option<Reading> {
        let last = (*self.last.lock().unwrap_or_else(PoisonError::into_inner))?;
        // One reading of the machine's clock for the age, the clock and the new `sent`: each
        // read costs tens of nanoseconds here, and the clock is then exactly that of `sent`.
        let now = Instant::now();
        (now.saturating_duration_since(last.sent) < FRESH_FOR).then(|| Reading {
            clock_us: last.at_us(now),
            sent: now,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn micros(d: Duration) -> u64 {
        u64::try_from(d.as_micros()).unwrap()
    }

    #[test]
    fn a_reading_is_never_behind_the_clock_plus_the_time_since_sending() {
        let sent = Instant::now();
        let reading = Reading::new(5_000_000, sent);
        std::thread::sleep(Duration::from_millis(20));
        let before = micros(sent.elapsed());
        let clock = reading.now_us();
        let after = micros(sent.elapsed());
        assert!(clock > 5_000_000 + before);
        // With the drift allowance, and not more than that.
        assert!(clock <= 5_000_000 + after + after / 1000 + 1);
    }

    #[test]
    fn only_a_young_reading_is_used_and_the_later_sent_one_is_kept() {
        let clock = RedisClock::default();
        assert!(clock.fresh().is_none());
        let earlier = Instant::now();
        let later = earlier + Duration::from_millis(1);
        clock.observe(Reading::new(2_000_000, later));
        // Arriving after it, but sent before it: not kept.
        clock.observe(Reading::new(1_000_000, earlier));
        let now = clock.fresh().unwrap().read_us();
        assert!(now >= 2_000_000, "{now}");
        let clock = RedisClock::default();
        let slow = Instant::now().checked_sub(MAX_LEAD * 2).unwrap();
        clock.observe(Reading::new(1_000_000, slow));
        assert!(
            clock.fresh().is_none(),
            "a reading answered late is not kept"
        );
        clock.observe(Reading::new(1_000_000, Instant::now()));
        assert!(clock.fresh().is_some());
        std::thread::sleep(FRESH_FOR);
        assert!(
            clock.fresh().is_none(),
            "a reading as old as FRESH_FOR is not used"
        );
    }
}
