//! The HTTP surface: bad input, authentication, admin, health, metrics, h2c, shutdown.
//! Store-independent, so these run on the memory store.

use crate::util::{Backend, Client, Harness, claim_req, granted, waiting};
use hyper::{Method, StatusCode};
use idemgate_sidecar::KeyState;
use idemgate_wire::{ClaimOutcome, Mode, OwnerOutcome, StoredResponse, paths, problem_types};

#[tokio::test]
async fn malformed_and_oversized_requests_get_problems() {
    let h = Harness::start_with(Backend::Memory, |c| c.limits.max_body = 1000).await;
    let c = &h.client;
    let cases: Vec<(Vec<u8>, &str, StatusCode, &str)> = vec![
        (
            b"not json".to_vec(),
            paths::CLAIM,
            StatusCode::BAD_REQUEST,
            problem_types::BAD_REQUEST,
        ),
        (
            br#"{"key":"k","mode":"lock","lease_ms":0}"#.to_vec(),
            paths::CLAIM,
            StatusCode::BAD_REQUEST,
            problem_types::BAD_REQUEST,
        ),
        (
            br#"{"key":"has space","mode":"lock","lease_ms":10}"#.to_vec(),
            paths::CLAIM,
            StatusCode::BAD_REQUEST,
            problem_types::BAD_REQUEST,
        ),
        (
            format!(
                r#"{{"key":"{}","mode":"lock","lease_ms":10}}"#,
                "k".repeat(500)
            )
            .into_bytes(),
            paths::CLAIM,
            StatusCode::PAYLOAD_TOO_LARGE,
            problem_types::TOO_LARGE,
        ),
        (
            br#"{"key":"k","mode":"lock","lease_ms":10,"extra":1}"#.to_vec(),
            paths::CLAIM,
            StatusCode::BAD_REQUEST,
            problem_types::BAD_REQUEST,
        ),
        (
            br#"{"key":"k","mode":"lock","lease_ms":10}
payload"#
                .to_vec(),
            paths::CLAIM,
            StatusCode::BAD_REQUEST,
            problem_types::BAD_REQUEST,
        ),
        (
            [
                br#"{"key":"k","owner":"o","retention_ms":10,"response":{"status":200}}"#.to_vec(),
                b"\n".to_vec(),
                vec![b'x'; 2000],
            ]
            .concat(),
            paths::COMPLETE,
            StatusCode::PAYLOAD_TOO_LARGE,
            problem_types::TOO_LARGE,
        ),
        (
            vec![b'x'; 200_000],
            paths::COMPLETE,
            StatusCode::PAYLOAD_TOO_LARGE,
            problem_types::TOO_LARGE,
        ),
        (
            br#"{"key":"k","owner":"o","retention_ms":0,"response":{"status":200}}"#.to_vec(),
            paths::COMPLETE,
            StatusCode::BAD_REQUEST,
            problem_types::BAD_REQUEST,
        ),
        (
            br#"{"key":"k","owner":"o","lease_ms":10}"#.to_vec(),
            paths::ABORT,
            StatusCode::BAD_REQUEST,
            problem_types::BAD_REQUEST,
        ),
        (
            b"{}".to_vec(),
            "/v1/nope",
            StatusCode::NOT_FOUND,
            problem_types::NOT_FOUND,
        ),
    ];
    for (body, path, status, type_uri) in cases {
        let reply = c.send(Method::POST, path, body.clone()).await;
        assert_eq!(
            reply.status,
            status,
            "{path} {}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        );
        let problem = reply.problem();
        assert_eq!(problem.type_uri, type_uri);
        assert_eq!(problem.status, status.as_u16());
    }
    let reply = c.get(paths::CLAIM).await;
    assert_eq!(reply.status, StatusCode::METHOD_NOT_ALLOWED);
    // The sidecar is still fine afterwards.
    granted(
        &c.claim(&claim_req("after-bad-input", Mode::Lock, 1000))
            .await
            .0,
    );
}

/// One HTTP/1.1 request with a chunked body (no declared length), sent as `chunks`; the
/// answer's status line and body.
async fn chunked_post(
    addr: std::net::SocketAddr,
    path: &str,
    chunks: &[&[u8]],
) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: sidecar\r\ncontent-type: {}\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n",
        idemgate_wire::CONTENT_TYPE
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    for chunk in chunks {
        conn.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
            .await
            .unwrap();
        conn.write_all(chunk).await.unwrap();
        conn.write_all(b"\r\n").await.unwrap();
        // Each chunk its own read at the sidecar, as far as the network allows.
        conn.flush().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // A body refused early may close the connection before its end is written.
    let _ = conn.write_all(b"0\r\n\r\n").await;
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        conn.read_to_end(&mut answer),
    )
    .await
    .expect("the sidecar answers")
    .unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.lines().next().unwrap_or_default().to_owned();
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// A body without a declared length is read frame by frame: frames are joined, and the limit
/// holds against their sum.
#[tokio::test]
async fn bodies_of_several_frames_are_joined_and_limited() {
    let h = Harness::start_with(Backend::Memory, |c| c.limits.max_body = 1000).await;
    let claim = br#"{"key":"chunked","mode":"lock","lease_ms":10000}"#;
    let (status, body) = chunked_post(
        h.sidecar.addr(),
        paths::CLAIM,
        &[&claim[..10], &claim[10..30], &claim[30..]],
    )
    .await;
    assert!(status.contains(" 200 "), "{status}: {body}");
    assert!(body.contains("granted"), "{body}");
    // Each frame under the limit (1,000 bytes and the head's allowance), their sum over it.
    let (status, body) =
        chunked_post(h.sidecar.addr(), paths::CLAIM, &[&[b' '; 30_000][..]; 3]).await;
    assert!(status.contains(" 413 "), "{status}: {body}");
    assert!(body.contains(problem_types::TOO_LARGE), "{body}");
}

#[tokio::test]
async fn bearer_token_guards_protocol_and_admin_but_not_health() {
    let h = Harness::start_with(Backend::Memory, |c| c.auth_token = Some("s3cret".into())).await;
    let anonymous = &h.client;
    let wrong = h.client.clone().with_token("s3creT");
    let right = h.client.clone().with_token("s3cret");
    let req = claim_req("k-auth", Mode::Lock, 1000);
    for client in [anonymous, &wrong] {
        let reply = client.post(paths::CLAIM, &req, &[]).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        assert_eq!(reply.problem().type_uri, problem_types::UNAUTHORIZED);
        assert!(reply.headers.contains_key("www-authenticate"));
        assert_eq!(
            client.get("/admin/v1/keys").await.status,
            StatusCode::UNAUTHORIZED
        );
    }
    granted(&right.claim(&req).await.0);
    assert_eq!(right.get("/admin/v1/keys").await.status, StatusCode::OK);
    // The scheme is case-insensitive (RFC 9110 §11.1), the token is not.
    for value in ["bearer s3cret", "BEARER  s3cret"] {
        let other = h.client.clone().with_authorization(value);
        assert_eq!(
            other.get("/admin/v1/keys").await.status,
            StatusCode::OK,
            "{value}"
        );
    }
    for value in ["bearer S3CRET", "Basic s3cret", "Bearers3cret"] {
        let other = h.client.clone().with_authorization(value);
        let status = other.get("/admin/v1/keys").await.status;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{value}");
    }
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(anonymous.get(path).await.status, StatusCode::OK, "{path}");
    }
}

#[tokio::test]
async fn admin_inspects_lists_and_force_releases() {
    let h = Harness::start(Backend::Memory).await;
    let c = &h.client;
    let (owner, fence) = granted(&c.claim(&claim_req("adm/1", Mode::Lock, 60_000)).await.0);
    granted(&c.claim(&claim_req("adm-2", Mode::Lock, 60_000)).await.0);

    let info = c.inspect("adm/1").await;
    assert_eq!(info.state, KeyState::Held);
    assert_eq!(info.holder.as_ref().map(|h| h.fence), Some(fence));
    assert_eq!(info.last_fence, fence);

    let list: serde_json::Value =
        serde_json::from_slice(&c.get("/admin/v1/keys?limit=1").await.body).unwrap();
    assert_eq!(list["keys"].as_array().map(Vec::len), Some(1));
    assert_eq!(list["truncated"], true);
    assert_eq!(
        c.get("/admin/v1/keys?limit=0").await.status,
        StatusCode::BAD_REQUEST
    );

    let reply = c
        .send(
            Method::POST,
            "/admin/v1/release",
            br#"{"key":"adm/1"}"#.to_vec(),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    let released: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(released["fence"], fence);
    assert_eq!(c.inspect("adm/1").await.state, KeyState::Free);
    assert_eq!(
        c.complete("adm/1", &owner, 1000, None).await,
        OwnerOutcome::Stale
    );
    let bad = c
        .send(Method::POST, "/admin/v1/release", br#"{"key":""}"#.to_vec())
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(c.metric("idemgate_sidecar_force_releases_total").await, 1.0);
}

#[tokio::test]
async fn completed_state_and_metrics_are_visible() {
    let h = Harness::start(Backend::Memory).await;
    let c = &h.client;
    let req = claim_req("k-metrics", Mode::Idempotency, 60_000);
    let (owner, _) = granted(&c.claim(&req).await.0);
    let response = StoredResponse {
        status: 200,
        headers: vec![],
    };
    c.complete("k-metrics", &owner, 60_000, Some((response, b"ok")))
        .await;
    let info = c.inspect("k-metrics").await;
    assert_eq!(info.state, KeyState::Completed);
    assert_eq!(info.completed.map(|c| c.status), Some(200));
    assert!(matches!(
        c.claim(&req).await.0,
        ClaimOutcome::Completed { .. }
    ));
    let text = String::from_utf8_lossy(&c.get("/metrics").await.body).into_owned();
    for name in [
        "idemgate_sidecar_claims_total{outcome=\"granted\"} 1",
        "idemgate_sidecar_claims_total{outcome=\"completed\"} 1",
        "idemgate_sidecar_request_seconds_bucket{route=\"/v1/claim\",status=\"200\"",
        "idemgate_sidecar_wait_seconds",
        "idemgate_sidecar_handoff_seconds",
        "idemgate_sidecar_waiters 0",
    ] {
        assert!(text.contains(name), "{name} missing in\n{text}");
    }
}

#[tokio::test]
async fn http1_and_h2c_share_one_port_and_h2c_multiplexes_long_polls() {
    let h = Harness::start(Backend::Memory).await;
    let h1 = Client::h1(&h.sidecar.url());
    let key = "k-proto";
    let (holder, _) = granted(&h1.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    // 300 long-polls over the single h2c connection of `h.client`.
    let mut waiters = Vec::new();
    for _ in 0..300 {
        let client = h.client.clone();
        waiters.push(tokio::spawn(async move {
            client
                .claim(&waiting(claim_req(key, Mode::Lock, 10_000), 30_000, 1000))
                .await
                .0
        }));
    }
    h1.wait_for_key(key, "all waiters queued", |i| i.queue_len == 300)
        .await;
    h1.complete(key, &holder, 1000, None).await;
    for waiter in waiters {
        let (owner, _) = granted(&waiter.await.unwrap());
        h1.complete(key, &owner, 1000, None).await;
    }
}

#[tokio::test]
async fn shutdown_answers_waiting_long_polls_with_a_problem() {
    let h = Harness::start(Backend::Memory).await;
    let key = "k-shutdown";
    granted(&h.client.claim(&claim_req(key, Mode::Lock, 60_000)).await.0);
    let client = h.client.clone();
    let waiter = tokio::spawn(async move {
        client
            .post(
                paths::CLAIM,
                &waiting(claim_req(key, Mode::Lock, 1000), 60_000, 10),
                &[],
            )
            .await
    });
    h.client
        .wait_for_key(key, "the waiter to queue", |i| i.queue_len == 1)
        .await;
    h.sidecar.shutdown().await.unwrap();
    let reply = waiter.await.unwrap();
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem().type_uri, problem_types::SHUTTING_DOWN);
    assert!(reply.headers.contains_key("retry-after"));
}
