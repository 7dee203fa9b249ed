//! Test fixtures: a sidecar on an ephemeral loopback port over a chosen store (with its
//! own redis-server when Redis), and a small client speaking the framed protocol over
//! HTTP/1.1 or h2c.

mod process;

pub use process::SidecarProcess;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idemgate_sidecar::testing::RedisServer;
use idemgate_sidecar::{Config, KeyInfo, Sidecar, StoreConfig};
use idemgate_wire::{
    AbortRequest, ClaimOutcome, ClaimRequest, CompleteRequest, LeaveRequest, Mode, OwnerOutcome,
    RenewRequest, StoredResponse, WaitPolicy, paths,
};
use std::time::Duration;

/// A running sidecar, its client, and the Redis it owns (if any).
pub struct Harness {
    pub sidecar: Sidecar,
    pub client: Client,
    pub redis: Option<RedisServer>,
}

#[derive(Clone, Copy, Debug)]
pub enum Backend {
    Memory,
    /// `redis-server` as the machine has it (Debian 12: 7.0, no `SET … IFEQ`).
    Redis,
    /// Valkey 8.1 (`testing::valkey_server`): a server with `SET … IFEQ`.
    Valkey,
}

impl Harness {
    pub async fn start(backend: Backend) -> Harness {
        Self::start_with(backend, |_| {}).await
    }

    pub async fn start_with(backend: Backend, tweak: impl FnOnce(&mut Config)) -> Harness {
        let redis = match backend {
            Backend::Memory => None,
            Backend::Redis => Some(RedisServer::start().expect("redis-server starts")),
            Backend::Valkey => Some(
                RedisServer::start_valkey()
                    .expect("valkey-server starts (cargo xtask test builds it)"),
            ),
        };
        let store = redis
            .as_ref()
            .map_or(StoreConfig::Memory, RedisServer::store_config);
        Self::on_store(store, redis, tweak).await
    }

    pub async fn on_store(
        store: StoreConfig,
        redis: Option<RedisServer>,
        tweak: impl FnOnce(&mut Config),
    ) -> Harness {
        let mut config = Config::loopback(store);
        // Lost notifications must not hide in tests: a slow re-check would show as slowness.
        config.recheck = Duration::from_millis(500);
        tweak(&mut config);
        let sidecar = Sidecar::spawn(config).await.expect("sidecar starts");
        let client = Client::h2c(&sidecar.url());
        Harness {
            sidecar,
            client,
            redis,
        }
    }

    /// A sidecar on a store it cannot use (wrong password, untrusted certificate, no client
    /// certificate), and its answer to a claim: store calls give up after 500 ms.
    pub async fn claim_on_unusable_store(store: StoreConfig) -> (Harness, Reply) {
        let h = Self::on_store(store, None, |c| {
            c.store_timeout = Duration::from_millis(500)
        })
        .await;
        let reply = h
            .client
            .post(paths::CLAIM, &claim_req("k", Mode::Lock, 1000), &[])
            .await;
        (h, reply)
    }
}

pub fn claim_req(key: &str, mode: Mode, lease_ms: u64) -> ClaimRequest {
    ClaimRequest {
        key: key.to_owned(),
        mode,
        lease_ms,
        fingerprint: None,
        wait: None,
        waiter: None,
    }
}

/// `req` waiting in a queue place named `waiter` (see [`waiting`]).
pub fn named_waiting(
    req: ClaimRequest,
    waiter: &str,
    budget_ms: u64,
    max_queue: u32,
) -> ClaimRequest {
    ClaimRequest {
        waiter: Some(waiter.to_owned()),
        ..waiting(req, budget_ms, max_queue)
    }
}

pub fn waiting(mut req: ClaimRequest, budget_ms: u64, max_queue: u32) -> ClaimRequest {
    req.wait = Some(WaitPolicy {
        budget_ms,
        per_waiter_ms: 0,
        max_budget_ms: 0,
        max_queue,
    });
    req
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn problem(&self) -> idemgate_wire::Problem {
        assert_eq!(
            self.headers
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some(idemgate_wire::PROBLEM_CONTENT_TYPE),
            "status {} body {:?}",
            self.status,
            self.body
        );
        serde_json::from_slice(&self.body).expect("problem+json body")
    }
}

#[derive(Clone)]
pub struct Client {
    base: String,
    inner: HyperClient<HttpConnector, Full<Bytes>>,
    /// Sent with every request (`authorization`, trace context).
    headers: Vec<(String, String)>,
}

impl Client {
    /// HTTP/1.1 with a connection pool.
    pub fn h1(base: &str) -> Client {
        Self::build(base, false)
    }

    /// HTTP/2 with prior knowledge: every request multiplexed on one connection.
    pub fn h2c(base: &str) -> Client {
        Self::build(base, true)
    }

    fn build(base: &str, h2: bool) -> Client {
        // Without TCP_NODELAY a request written in two segments waits out the server's
        // delayed ACK (~40 ms a request), as Envoy's callouts, which set it, do not.
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let inner = HyperClient::builder(TokioExecutor::new())
            .http2_only(h2)
            .build(connector);
        Client {
            base: base.to_owned(),
            inner,
            headers: Vec::new(),
        }
    }

    pub fn with_token(self, token: &str) -> Client {
        self.with_authorization(&format!("Bearer {token}"))
    }

    /// Sends `value` as the `authorization` header of every request.
    pub fn with_authorization(self, value: &str) -> Client {
        self.with_header("authorization", value)
    }

    /// Sends `name: value` with every request (replacing an earlier value of `name`).
    pub fn with_header(mut self, name: &str, value: &str) -> Client {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub async fn send(&self, method: Method, path: &str, body: Vec<u8>) -> Reply {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", idemgate_wire::CONTENT_TYPE);
        for (name, value) in &self.headers {
            req = req.header(name, value);
        }
        let req = req.body(Full::new(Bytes::from(body))).expect("request");
        let response = tokio::time::timeout(Duration::from_secs(60), self.inner.request(req))
            .await
            .expect("answer within 60 s")
            .expect("HTTP exchange");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    pub async fn post<T: serde::Serialize>(&self, path: &str, head: &T, payload: &[u8]) -> Reply {
        self.send(Method::POST, path, idemgate_wire::encode(head, payload))
            .await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(Method::GET, path, Vec::new()).await
    }

    fn framed<T: serde::de::DeserializeOwned>(reply: &Reply) -> (T, Bytes) {
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "body: {}",
            String::from_utf8_lossy(&reply.body)
        );
        let (head, payload) = idemgate_wire::decode::<T>(&reply.body).expect("framed answer");
        (head, reply.body.slice_ref(payload))
    }

    pub async fn claim(&self, req: &ClaimRequest) -> (ClaimOutcome, Bytes) {
        Self::framed(&self.post(paths::CLAIM, req, &[]).await)
    }

    pub async fn complete(
        &self,
        key: &str,
        owner: &str,
        retention_ms: u64,
        response: Option<(StoredResponse, &[u8])>,
    ) -> OwnerOutcome {
        let (response, body) = match response {
            Some((r, b)) => (Some(r), b),
            None => (None, &[][..]),
        };
        let req = CompleteRequest {
            key: key.to_owned(),
            owner: owner.to_owned(),
            retention_ms,
            response,
        };
        Self::framed(&self.post(paths::COMPLETE, &req, body).await).0
    }

    pub async fn abort(&self, key: &str, owner: &str) -> OwnerOutcome {
        let req = AbortRequest {
            key: key.to_owned(),
            owner: owner.to_owned(),
        };
        Self::framed(&self.post(paths::ABORT, &req, &[]).await).0
    }

    pub async fn leave(&self, key: &str, waiter: &str) -> OwnerOutcome {
        let req = LeaveRequest {
            key: key.to_owned(),
            waiter: waiter.to_owned(),
        };
        Self::framed(&self.post(paths::LEAVE, &req, &[]).await).0
    }

    pub async fn renew(&self, key: &str, owner: &str, lease_ms: u64) -> OwnerOutcome {
        let req = RenewRequest {
            key: key.to_owned(),
            owner: owner.to_owned(),
            lease_ms,
        };
        Self::framed(&self.post(paths::RENEW, &req, &[]).await).0
    }

    pub async fn inspect(&self, key: &str) -> KeyInfo {
        let reply = self.get(&format!("/admin/v1/keys/{key}")).await;
        assert_eq!(reply.status, StatusCode::OK);
        serde_json::from_slice(&reply.body).expect("key info")
    }

    /// Polls until `check` holds on the key's info (bounded: fails after 20 s).
    pub async fn wait_for_key(&self, key: &str, what: &str, check: impl Fn(&KeyInfo) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let info = self.inspect(key).await;
            if check(&info) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}: {info:?}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Starts a lock-mode claim on a held `key` that waits in its queue (10 s lease, 30 s
    /// budget) and returns once the sidecar shows it queued; the task ends with its outcome.
    pub async fn queued_waiter(&self, key: &str) -> tokio::task::JoinHandle<ClaimOutcome> {
        let client = self.clone();
        let req = waiting(claim_req(key, Mode::Lock, 10_000), 30_000, 10);
        let waiter = tokio::spawn(async move { client.claim(&req).await.0 });
        self.wait_for_key(key, "the waiter to queue", |info| info.queue_len == 1)
            .await;
        waiter
    }

    pub async fn metric(&self, name_and_labels: &str) -> f64 {
        let text = self.get("/metrics").await.body;
        String::from_utf8_lossy(&text)
            .lines()
            .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
            .unwrap_or(0.0)
    }
}

pub fn granted(outcome: &ClaimOutcome) -> (String, u64) {
    match outcome {
        ClaimOutcome::Granted { owner, fence, .. } => (owner.clone(), *fence),
        other => panic!("expected granted, got {other:?}"),
    }
}

/// Expands each scenario `async fn name(Backend)` of the calling module into
/// `memory::<name>`, `redis::<name>` and `valkey::<name>` tests, so both stores pass one
/// suite, and the Redis store on a server with `SET … IFEQ` and on one without.
macro_rules! store_suite {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(crate::util::Backend::Memory).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(crate::util::Backend::Redis).await;
                }
            )*
        }
        mod valkey {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(crate::util::Backend::Valkey).await;
                }
            )*
        }
    };
}
pub(crate) use store_suite;
