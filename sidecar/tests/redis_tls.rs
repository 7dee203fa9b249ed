//! Reaching Redis securely: TLS (`rediss://`) with a private CA and the client certificate
//! Redis asks for by default — standalone and behind a Sentinel — and an ACL user named in
//! the URL. The certificates are made
//! at test time (`testing::tls`); nothing is read from or written to the machine's trust store.

use crate::util::{Client, Harness, claim_req, granted};
use hyper::StatusCode;
use idemgate_sidecar::testing::tls::{Pki, redis_has_tls};
use idemgate_sidecar::testing::{RedisSentinel, RedisServer};
use idemgate_sidecar::{RedisConfig, RedisTls, RedisTopology, StoreConfig};
use idemgate_wire::{ClaimOutcome, Mode, OwnerOutcome, paths};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn store(url: String, prefix: &str, tls: RedisTls) -> StoreConfig {
    StoreConfig::Redis(RedisConfig {
        urls: vec![url],
        topology: RedisTopology::Standalone,
        prefix: prefix.into(),
        tls,
    })
}

/// Ready, a claim, a queued waiter handed the key when the holder completes, its complete.
/// The hand-off's notification comes through the pub/sub inbox, which must reach Redis over
/// TLS as well.
async fn hand_off(c: &Client, key: &str) {
    assert_eq!(c.get("/readyz").await.status, StatusCode::OK);
    let (holder, fence) = granted(&c.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let waiter = c.queued_waiter(key).await;
    assert_eq!(
        c.complete(key, &holder, 1000, None).await,
        OwnerOutcome::Released
    );
    let (owner, next) = granted(&waiter.await.unwrap());
    assert!(next > fence);
    assert_eq!(
        c.complete(key, &owner, 1000, None).await,
        OwnerOutcome::Released
    );
}

/// The Sentinel and the master both speak TLS only to clients of the private CA: the
/// certificates go to both connections (the Sentinel reaches the master over TLS as well).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_behind_a_tls_sentinel_is_reached_with_a_private_ca() {
    if !redis_has_tls() {
        eprintln!("SKIPPED: the installed redis-server was built without TLS support");
        return;
    }
    let pki = Pki::create().unwrap();
    let (cert, key, ca) = (
        pki.path("server.pem"),
        pki.path("server.key"),
        pki.path("ca.pem"),
    );
    let master_tls = free_port();
    let master = pki.redis_server(master_tls).unwrap();
    let sentinel_tls = free_port();
    let sentinel = RedisSentinel::watching(
        master,
        master_tls,
        &format!(
            "tls-port {sentinel_tls}\ntls-cert-file {cert}\ntls-key-file {key}\n\
             tls-ca-cert-file {ca}\ntls-replication yes"
        ),
    )
    .unwrap();
    let store = StoreConfig::Redis(RedisConfig {
        urls: vec![format!("rediss://127.0.0.1:{sentinel_tls}")],
        topology: RedisTopology::Sentinel {
            master: RedisSentinel::MASTER.into(),
        },
        prefix: "idemgate".into(),
        tls: pki.client_tls().unwrap(),
    });
    let h = Harness::on_store(store, None, |_| {}).await;
    hand_off(&h.client, "sentinel-tls-key").await;
    assert!(
        sentinel
            .master()
            .cli(&["--scan"])
            .unwrap()
            .contains("idemgate:{sentinel-tls-key}:record")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_hand_offs_and_replays_work_over_tls() {
    if !redis_has_tls() {
        eprintln!("SKIPPED: the installed redis-server was built without TLS support");
        return;
    }
    let pki = Pki::create().unwrap();
    let tls_port = free_port();
    let redis = pki.redis_server(tls_port).unwrap();
    let url = format!("rediss://127.0.0.1:{tls_port}");
    let tls = pki.client_tls().unwrap();
    let h = Harness::on_store(store(url.clone(), "idemgate", tls.clone()), None, |_| {}).await;
    hand_off(&h.client, "tls-key").await;
    // The data really went to this server (read back over its plain port).
    assert!(
        redis
            .cli(&["--scan"])
            .unwrap()
            .contains("idemgate:{tls-key}:record")
    );

    // Without the private CA the server is not trusted: never ready, never a grant.
    let untrusted = RedisTls {
        ca_pem: None,
        ..tls.clone()
    };
    let (bad, reply) =
        Harness::claim_on_unusable_store(store(url.clone(), "idemgate", untrusted)).await;
    assert_eq!(
        bad.client.get("/readyz").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    // Without a client certificate Redis refuses the handshake: the same.
    let anonymous = RedisTls {
        client_pem: None,
        ..tls
    };
    let (_, reply) = Harness::claim_on_unusable_store(store(url, "idemgate", anonymous)).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!matches!(
        serde_json::from_slice::<ClaimOutcome>(&reply.body),
        Ok(ClaimOutcome::Granted { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_from_the_url_is_confined_to_its_prefix() {
    // The least a sidecar needs: its own keys and inbox channels, scripts, SCAN and PING.
    let redis = RedisServer::start_with(&[
        "--user",
        "idem",
        "on",
        ">s3cret",
        "~idemgate:*",
        "&idemgate:*",
        "+@all",
        "-@dangerous",
        "+scan",
    ])
    .unwrap();
    let url = format!("redis://idem:s3cret@127.0.0.1:{}", redis.port());
    let h = Harness::on_store(
        store(url.clone(), "idemgate", RedisTls::default()),
        None,
        |_| {},
    )
    .await;
    let c = &h.client;
    assert_eq!(c.get("/readyz").await.status, StatusCode::OK);
    let key = "acl-key";
    let (holder, fence) = granted(&c.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let waiter = c.queued_waiter(key).await;
    let list: serde_json::Value =
        serde_json::from_slice(&c.get("/admin/v1/keys").await.body).unwrap();
    assert_eq!(list["keys"][0], key);
    c.complete(key, &holder, 1000, None).await;
    let (owner, next) = granted(&waiter.await.unwrap());
    assert!(next > fence);
    c.complete(key, &owner, 1000, None).await;

    // The same user under another prefix is refused by Redis: a permanent store error.
    let other = Harness::on_store(store(url, "other", RedisTls::default()), None, |_| {}).await;
    let reply = other
        .client
        .post(paths::CLAIM, &claim_req("k", Mode::Lock, 1000), &[])
        .await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    let problem: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(problem["detail"], "permanent store error", "{problem}");
    assert!(reply.headers.get("retry-after").is_none());
}
