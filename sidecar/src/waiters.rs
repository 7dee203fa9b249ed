//! The per-process registry of waiting claims: owner token → a wake-up handle.
//!
//! Stores wake a waiter when they hand it the key or store the response it waits for (the
//! memory store directly, the Redis store through its pub/sub inbox). A wake-up only means
//! "check again": the waiter re-reads the store, so a spurious or duplicated wake-up is
//! harmless, and [`tokio::sync::Notify`] keeps a wake-up that arrives before the waiter
//! sleeps. A lost one is covered by the waiter's bounded re-check interval.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::Notify;

#[derive(Debug, Default)]
pub struct Waiters {
    // A std mutex: held for a map operation only, never across an await.
    by_owner: Mutex<HashMap<String, Arc<Notify>>>,
}

impl Waiters {
    pub(crate) fn register(&self, owner: &str) -> Arc<Notify> {
        let notify = Arc::new(Notify::new());
        self.lock().insert(owner.to_owned(), Arc::clone(&notify));
        notify
    }

    pub(crate) fn unregister(&self, owner: &str) {
        self.lock().remove(owner);
    }

    /// Wakes the waiter with this owner token, if it waits in this process.
    pub(crate) fn wake(&self, owner: &str) {
        if let Some(notify) = self.lock().get(owner) {
            notify.notify_one();
        }
    }

    /// Wakes every waiter (after a gap in notifications, e.g. a pub/sub reconnect).
    pub(crate) fn wake_all(&self) {
        for notify in self.lock().values() {
            notify.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        // The map stays consistent even if a holder panicked: every operation is one call.
        self.by_owner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
