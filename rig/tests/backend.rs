//! The demo backend really breaks under concurrency (otherwise the demo proves nothing),
//! and really refuses stale fencing tokens.

// The whole crate is test code, helpers included: clippy's allow-*-in-tests settings
// (clippy.toml) see only `#[test]` functions and `cfg(test)` items as tests.
#![cfg(test)]

use idemgate_rig::backend::{self, Backend, Stats, Timings};
use std::net::SocketAddr;
use std::time::Duration;

async fn start(timings: Timings) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(backend::serve(
        listener,
        Backend::new(timings),
        std::future::pending(),
    ));
    addr
}

fn fast() -> Timings {
    Timings {
        bot_spawn: Duration::from_millis(200),
        attach: Duration::from_millis(100),
        payment: Duration::from_millis(50),
    }
}

async fn stats(client: &reqwest::Client, addr: SocketAddr) -> Stats {
    let resp = client
        .get(format!("http://{addr}/stats"))
        .send()
        .await
        .unwrap();
    resp.json().await.unwrap()
}

#[tokio::test]
async fn concurrent_attaches_lose_updates() {
    let addr = start(fast()).await;
    let client = reqwest::Client::new();
    let calls = ["web_search", "davinci", "file_read", "naver_news"].map(|tool| {
        let client = client.clone();
        async move {
            client
                .post(format!("http://{addr}/agents/a1/tools"))
                .json(&serde_json::json!({ "tool": tool }))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    for status in futures::future::join_all(calls).await {
        assert_eq!(status, 200);
    }
    let stats = stats(&client, addr).await;
    assert_eq!(stats.tool_attaches, 4);
    assert!(stats.lost_updates >= 1, "{stats:?}");
    assert!(stats.agent_tools["a1"].len() < 4);
    assert!(stats.max_overlap > 1);
}

#[tokio::test]
async fn double_click_starts_two_engines_and_a_later_repeat_is_refused() {
    let addr = start(fast()).await;
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/bots/b1/start");
    let first = client.post(&url).send();
    let second = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        client.post(&url).send().await
    };
    let (a, b) = tokio::join!(first, second);
    assert_eq!(a.unwrap().status(), 201);
    assert_eq!(b.unwrap().status(), 201);
    assert_eq!(client.post(&url).send().await.unwrap().status(), 409);
    let stats = stats(&client, addr).await;
    assert_eq!(stats.engines_started, 2);
    assert_eq!(stats.duplicate_engines, 1);
}

#[tokio::test]
async fn stale_fencing_token_is_refused_and_nothing_is_written() {
    let addr = start(fast()).await;
    let client = reqwest::Client::new();
    let pay = |fence: u64| {
        client
            .post(format!("http://{addr}/payments"))
            .header("x-user-id", "u1")
            .header("idempotency-key", "k1")
            .header("x-fencing-token", fence.to_string())
            .json(&serde_json::json!({ "amount": 10 }))
            .send()
    };
    assert_eq!(pay(7).await.unwrap().status(), 201);
    assert_eq!(pay(6).await.unwrap().status(), 409);
    let stats = stats(&client, addr).await;
    assert_eq!(stats.charges, 1);
    assert_eq!(stats.stale_refused, 1);
    assert_eq!(stats.fences["payment:u1:k1"], vec![7]);
}
