//! A real `redis-server` and an in-process sidecar in front of it, from the rig
//! ([`idemgate_rig::Rig`]), with the sidecar readings the scenarios wait on.

use crate::client::http;
use idemgate_rig::Rig;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

pub struct Stack {
    rig: Rig,
    /// Where the sidecar listens (the same across restarts).
    pub addr: SocketAddr,
}

impl Stack {
    pub fn start() -> Stack {
        let rig = Rig::builder()
            .redis()
            .start()
            .expect("redis-server and the sidecar start (apt install redis-server)");
        let addr = rig.sidecar_addr();
        Stack { rig, addr }
    }

    pub fn rig(&self) -> &Rig {
        &self.rig
    }

    /// Kills the sidecar as a crash would: its runtime is dropped with every connection and
    /// long-poll in flight, nothing is released, Redis keeps what it holds.
    pub fn kill_sidecar(&mut self) {
        self.rig.kill_sidecar().expect("the sidecar dies");
    }

    /// Starts a new sidecar on the killed one's address, over the same Redis.
    pub fn restart_sidecar(&mut self) {
        self.rig
            .restart_sidecar()
            .expect("the sidecar starts again");
    }

    /// Redis loses everything it held, as a restart without persistence would.
    pub fn empty_redis(&self) {
        self.rig.empty_redis().expect("FLUSHALL");
    }

    /// The sidecar's `idemgate_sidecar_waiters` gauge: claims waiting through it, counted
    /// from before their first step reaches Redis (so that no hand-off is missed).
    pub fn waiters(&self) -> u64 {
        self.metric("idemgate_sidecar_waiters")
    }

    /// How many claims have joined a queue in Redis through the sidecar so far (the count of
    /// its `queue_position` histogram, observed once Redis answered `queued`).
    pub fn claims_queued(&self) -> u64 {
        self.metric("idemgate_sidecar_queue_position_count")
    }

    /// One unlabelled sample of the sidecar's `/metrics` (0 when absent).
    fn metric(&self, name: &str) -> u64 {
        let metrics = http(self.addr, "GET", "/metrics", &[], "");
        metrics
            .body
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// How many keys the sidecar holds now (`GET /admin/v1/keys`: held, not completed).
    pub fn held_keys(&self) -> usize {
        let reply = http(self.addr, "GET", "/admin/v1/keys", &[], "");
        let listed: serde_json::Value = serde_json::from_str(&reply.body).unwrap_or_default();
        let keys = listed["keys"].as_array();
        assert!(keys.is_some(), "the sidecar lists its held keys: {reply:?}");
        keys.map_or(0, Vec::len)
    }

    /// Waits (bounded) until `n` claims wait in the sidecar's queue for the stored `key`.
    pub fn wait_for_queue(&self, key: &str, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let reply = http(self.addr, "GET", &format!("/admin/v1/keys/{key}"), &[], "");
            let info: serde_json::Value = serde_json::from_str(&reply.body).unwrap_or_default();
            if info["queue_len"].as_u64() == Some(n) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "queue of {key} never reached {n}: {reply:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
