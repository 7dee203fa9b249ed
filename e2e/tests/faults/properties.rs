//! Property tests of the lock protocol against a running sidecar (memory store and real
//! Redis): random interleavings of claim / complete / abort / renew by several clients, and
//! forged owners, checked against a model. Properties: never two grants for one key, only
//! the owner releases or renews, fencing tokens strictly increase per key, a completed key
//! is replayed, never granted again.

use idemgate_e2e::client::http;
use idemgate_sidecar::testing::RedisServer;
use idemgate_sidecar::{Config, Sidecar, StoreConfig};
use idemgate_wire::{
    AbortRequest, ClaimOutcome, ClaimRequest, CompleteRequest, Mode, OwnerOutcome, RenewRequest,
    StoredResponse, decode, encode, paths,
};
use proptest::prelude::*;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

const CLIENTS: u8 = 3;
const KEYS: u8 = 2;

#[derive(Debug, Clone)]
enum Op {
    Claim {
        client: u8,
        key: u8,
    },
    Complete {
        client: u8,
        key: u8,
    },
    Abort {
        client: u8,
        key: u8,
    },
    Renew {
        client: u8,
        key: u8,
    },
    /// Someone who never held the key presents the holder's owner token, altered.
    Forged {
        key: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let client = 0..CLIENTS;
    let key = 0..KEYS;
    prop_oneof![
        3 => (client.clone(), key.clone()).prop_map(|(client, key)| Op::Claim { client, key }),
        1 => (client.clone(), key.clone()).prop_map(|(client, key)| Op::Complete { client, key }),
        1 => (client.clone(), key.clone()).prop_map(|(client, key)| Op::Abort { client, key }),
        1 => (client, key.clone()).prop_map(|(client, key)| Op::Renew { client, key }),
        1 => key.prop_map(|key| Op::Forged { key }),
    ]
}

/// What the model knows of one key.
#[derive(Default)]
struct KeyModel {
    holder: Option<(u8, String)>,
    last_fence: u64,
    completed: bool,
}

struct Protocol {
    sidecar: SocketAddr,
    mode: Mode,
}

impl Protocol {
    fn call<T: serde::Serialize, A: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        req: &T,
        payload: &[u8],
    ) -> A {
        let body = String::from_utf8(encode(req, payload)).unwrap();
        let reply = http(
            self.sidecar,
            "POST",
            path,
            &[("content-type", idemgate_wire::CONTENT_TYPE)],
            &body,
        );
        assert_eq!(reply.status, 200, "{path}: {reply:?}");
        let (answer, _): (A, &[u8]) = decode(reply.body.as_bytes()).unwrap();
        answer
    }

    fn claim(&self, key: &str) -> ClaimOutcome {
        let req = ClaimRequest {
            key: key.to_owned(),
            mode: self.mode,
            lease_ms: 60_000,
            fingerprint: None,
            wait: None,
            waiter: None,
        };
        self.call(paths::CLAIM, &req, &[])
    }

    fn complete(&self, key: &str, owner: &str) -> OwnerOutcome {
        let response = (self.mode == Mode::Idempotency).then(|| StoredResponse {
            status: 201,
            headers: Vec::new(),
        });
        let req = CompleteRequest {
            key: key.to_owned(),
            owner: owner.to_owned(),
            retention_ms: 60_000,
            response,
        };
        let body: &[u8] = if req.response.is_some() { b"ok" } else { b"" };
        self.call(paths::COMPLETE, &req, body)
    }

    fn abort(&self, key: &str, owner: &str) -> OwnerOutcome {
        let req = AbortRequest {
            key: key.to_owned(),
            owner: owner.to_owned(),
        };
        self.call(paths::ABORT, &req, &[])
    }

    fn renew(&self, key: &str, owner: &str) -> OwnerOutcome {
        let req = RenewRequest {
            key: key.to_owned(),
            owner: owner.to_owned(),
            lease_ms: 60_000,
        };
        self.call(paths::RENEW, &req, &[])
    }

    /// Runs `ops` on fresh keys and checks every answer against the model.
    fn check(&self, case: u64, ops: &[Op]) {
        let name = |k: u8| format!("prop-{case}-{k}");
        let mut model: HashMap<u8, KeyModel> = HashMap::new();
        // The last owner token each client was granted, per key (possibly stale).
        let mut tokens: HashMap<(u8, u8), String> = HashMap::new();
        for op in ops {
            match *op {
                Op::Claim { client, key } => {
                    let m = model.entry(key).or_default();
                    match self.claim(&name(key)) {
                        ClaimOutcome::Granted { owner, fence, .. } => {
                            assert!(m.holder.is_none(), "second grant while held: {ops:?}");
                            assert!(!m.completed, "granted after completion: {ops:?}");
                            assert!(fence > m.last_fence, "fence {fence} after {}", m.last_fence);
                            m.last_fence = fence;
                            m.holder = Some((client, owner.clone()));
                            tokens.insert((client, key), owner);
                        }
                        ClaimOutcome::Busy { .. } => {
                            assert!(m.holder.is_some(), "busy while free: {ops:?}")
                        }
                        ClaimOutcome::Completed { response, .. } => {
                            assert!(m.completed && m.holder.is_none(), "{ops:?}");
                            assert_eq!(response.status, 201);
                        }
                        other => panic!("unexpected {other:?} for {op:?}"),
                    }
                }
                Op::Complete { client, key }
                | Op::Abort { client, key }
                | Op::Renew { client, key } => {
                    let Some(token) = tokens.get(&(client, key)).cloned() else {
                        continue;
                    };
                    let m = model.entry(key).or_default();
                    let owns = m.holder.as_ref().is_some_and(|(_, o)| *o == token);
                    let outcome = match op {
                        Op::Complete { .. } => self.complete(&name(key), &token),
                        Op::Abort { .. } => self.abort(&name(key), &token),
                        _ => self.renew(&name(key), &token),
                    };
                    let renewing = matches!(op, Op::Renew { .. });
                    match (owns, renewing, outcome) {
                        (true, true, OwnerOutcome::Renewed { .. }) => {}
                        (true, false, OwnerOutcome::Released) => {
                            m.holder = None;
                            if matches!(op, Op::Complete { .. }) && self.mode == Mode::Idempotency {
                                m.completed = true;
                            }
                        }
                        (false, _, OwnerOutcome::Stale) => {}
                        (owns, _, outcome) => {
                            panic!("owner={owns} got {outcome:?} for {op:?} in {ops:?}")
                        }
                    }
                }
                Op::Forged { key } => {
                    let m = model.entry(key).or_default();
                    let Some((_, owner)) = &m.holder else {
                        continue;
                    };
                    let mut forged = owner.clone();
                    let last = forged
                        .pop()
                        .map_or('a', |c| if c == 'a' { 'b' } else { 'a' });
                    forged.push(last);
                    assert_eq!(self.abort(&name(key), &forged), OwnerOutcome::Stale);
                    assert_eq!(
                        self.renew(&name(key), &forged),
                        OwnerOutcome::Stale,
                        "only the owner renews"
                    );
                }
            }
        }
    }
}

fn run(store: StoreConfig) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sidecar = runtime
        .block_on(Sidecar::spawn(Config::loopback(store)))
        .unwrap();
    let case = AtomicU64::new(0);
    for mode in [Mode::Lock, Mode::Idempotency] {
        let protocol = Protocol {
            sidecar: sidecar.addr(),
            mode,
        };
        proptest!(ProptestConfig::with_cases(40), |(ops in prop::collection::vec(op(), 1..30))| {
            protocol.check(case.fetch_add(1, Ordering::Relaxed), &ops);
        });
    }
    runtime.block_on(sidecar.shutdown()).unwrap();
}

#[test]
fn lock_protocol_properties_hold_on_the_memory_store() {
    run(StoreConfig::Memory);
}

#[test]
fn lock_protocol_properties_hold_on_redis() {
    let redis = RedisServer::start().unwrap();
    run(redis.store_config());
}
