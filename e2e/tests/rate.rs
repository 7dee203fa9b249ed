//! Rate limits through the harness: the built filter on worker VMs driven from
//! threads (as Envoy's workers run), one or two gateways, a real sidecar and Redis for the
//! global tier.
//!
//! The local tier runs on the harness's virtual clock, so its counts are exact; the global
//! tier runs on Redis's clock, so tests there use rates whose refill during the test is below
//! one request, and state that tolerance.

use idemgate_e2e::harness::*;
use idemgate_e2e::stack::Stack;
use idemgate_host::testing::{TestStream, TestVm};
use std::time::{Duration, Instant};

/// `/payments`, limited per caller (`x-user-id`): `requests` per `per`, burst `burst`.
fn limited(tier: &str, requests: u32, per: &str, burst: u32) -> String {
    format!(
        r#"[{{"name":"pay","match":{{"path_prefix":"/payments"}},"scope":{{"headers":["x-user-id"]}},
            "rate":{{"tier":"{tier}","expose":true,
                     "limits":[{{"by":"scope","requests":{requests},"per":"{per}","burst":{burst}}}]}}}}]"#
    )
}

fn request(user: &str, key: &str) -> idemgate_host::testing::Request {
    post("/payments", key, "{}").header("x-user-id", user)
}

/// Every worker sends `each` requests of `user` at once, from its own thread; returns the
/// streams (distinct idempotency keys: only the rate limit can stop them).
fn burst(workers: &[TestVm], user: &str, tag: &str, each: usize) -> Vec<TestStream> {
    let threads: Vec<_> = workers
        .iter()
        .enumerate()
        .map(|(w, vm)| {
            let vm = vm.clone();
            let (user, tag) = (user.to_owned(), tag.to_owned());
            std::thread::spawn(move || {
                (0..each)
                    .map(|i| {
                        let s = vm.stream();
                        s.send_request(request(&user, &format!("{tag}-{w}-{i}")));
                        s
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect()
}

/// The `Retry-After` seconds of a limited answer.
fn retry_after_s(limited: &TestStream) -> u64 {
    limited
        .response_headers()
        .unwrap()
        .get("retry-after")
        .unwrap()
        .parse()
        .unwrap()
}

fn count_limited(streams: &[TestStream]) -> usize {
    streams
        .iter()
        .filter(|s| s.response_status() == Some(429))
        .count()
}

#[test]
fn local_limit_holds_across_four_workers_exactly() {
    // Sidecar down and never asked for the rate (tier local); allowed requests wait on their
    // claim, limited ones are answered 429 at once.
    let gw = Gateway::boot(
        dead_address(),
        &config("", &limited("local", 10, "1s", 20)),
        4,
    );
    let streams = burst(&gw.workers, "alice", "a", 15);
    assert_eq!(streams.len(), 60);
    assert_eq!(
        count_limited(&streams),
        40,
        "exactly the burst of 20 passes"
    );
    let limited = streams
        .iter()
        .find(|s| s.response_status() == Some(429))
        .unwrap();
    assert_eq!(problem_type(limited), "urn:idemgate:problem:rate-limited");
    let headers = limited.response_headers().unwrap();
    assert_eq!(headers.get("retry-after").as_deref(), Some("1"));
    assert_eq!(
        headers.get("ratelimit-policy").as_deref(),
        Some("\"scope\";q=20;w=2")
    );
    assert_eq!(
        headers.get("ratelimit").as_deref(),
        Some("\"scope\";r=0;t=1")
    );
    // Another caller is not affected.
    assert_eq!(count_limited(&burst(&gw.workers, "bob", "b", 2)), 0);
    assert_eq!(gw.counter("idemgate.rate.local.limited"), 40);
    assert_eq!(gw.counter("idemgate.rate.rule.pay.limited"), 40);
    assert_eq!(gw.counter("idemgate.rate.rule.pay.allowed"), 28);
}

#[test]
fn local_limit_does_not_drift_under_sustained_concurrent_load() {
    // 10/s, burst 5, over 3 virtual seconds: 5 + 30 requests pass, whatever the contention.
    let gw = Gateway::boot(
        dead_address(),
        &config("", &limited("local", 10, "1s", 5)),
        4,
    );
    let mut allowed = 0;
    for round in 0..=30 {
        if round > 0 {
            gw.host.advance(Duration::from_millis(100));
        }
        let streams = burst(&gw.workers, "carol", &format!("r{round}"), 3);
        allowed += streams.len() - count_limited(&streams);
    }
    assert_eq!(allowed, 5 + 30);
}

#[test]
fn a_client_that_waits_retry_after_is_let_through() {
    let gw = Gateway::boot(
        dead_address(),
        &config("", &limited("local", 2, "3s", 2)),
        2,
    );
    let mut limited = None;
    for i in 0..3 {
        let s = gw.worker(i).stream();
        s.send_request(request("dave", &format!("k{i}")));
        if s.response_status() == Some(429) {
            limited = Some(s);
        }
    }
    let limited = limited.expect("the third request is limited");
    let wait = retry_after_s(&limited);
    assert_eq!(wait, 2, "one request every 1.5 s, rounded up");
    gw.host.advance(Duration::from_secs(wait));
    let retry = gw.worker(1).stream();
    retry.send_request(request("dave", "k-retry"));
    assert_ne!(retry.response_status(), Some(429));
}

#[test]
fn global_limit_holds_across_two_gateways() {
    let stack = Stack::start();
    // One a minute, burst 12: refill during the test stays below one request (tolerance 0,
    // plus one per elapsed minute).
    let plugin = config("", &limited("global", 1, "1m", 12));
    let gateways = [
        Gateway::boot(stack.addr, &plugin, 2),
        Gateway::boot(stack.addr, &plugin, 2),
    ];
    let started = Instant::now();
    let mut streams = Vec::new();
    for round in 0..5 {
        for (g, gw) in gateways.iter().enumerate() {
            streams.extend(burst(&gw.workers, "erin", &format!("g{g}-{round}"), 2));
        }
        for gw in &gateways {
            gw.pump();
        }
    }
    let allowed = streams.len() - count_limited(&streams);
    let refill = (started.elapsed().as_secs() / 60) as usize;
    assert!(
        (12..=12 + refill).contains(&allowed),
        "{allowed} of {} passed",
        streams.len()
    );
    let total: i64 = gateways
        .iter()
        .map(|g| g.counter("idemgate.rate.global.limited"))
        .sum();
    assert_eq!(total as usize, streams.len() - allowed);
    // The allowed ones went on to their claim and upstream, fenced.
    assert_eq!(
        streams.iter().filter(|s| fence(s).is_some()).count(),
        allowed
    );
}

#[test]
fn global_retry_after_is_enough_and_the_quota_is_exposed() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", &limited("global", 2, "1s", 2)), 1);
    let send = |key: &str| {
        let s = gw.worker(0).stream();
        s.send_request(request("frank", key));
        gw.pump();
        s
    };
    let first = send("k1");
    assert!(fence(&first).is_some());
    first.respond(
        201,
        idemgate_host::HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    let exposed = first.response_headers().unwrap();
    assert_eq!(
        exposed.get("ratelimit-policy").as_deref(),
        Some("\"scope\";q=2;w=1")
    );
    assert!(
        exposed
            .get("ratelimit")
            .unwrap()
            .starts_with("\"scope\";r=")
    );
    let mut limited = None;
    for i in 0..5 {
        let s = send(&format!("k-more-{i}"));
        if s.response_status() == Some(429) {
            limited = Some(s);
            break;
        }
    }
    let limited = limited.expect("over two per second");
    let wait = retry_after_s(&limited);
    assert!((1..=2).contains(&wait), "{wait}");
    std::thread::sleep(Duration::from_secs(wait));
    assert!(fence(&send("k-after-wait")).is_some());
}

#[test]
fn global_tier_down_follows_the_failure_mode() {
    // closed (default): 503; local: this gateway's table decides.
    let gw = Gateway::boot(
        dead_address(),
        &config("", &limited("global", 1, "1m", 1)),
        1,
    );
    let s = gw.worker(0).stream();
    s.send_request(request("gina", "k"));
    gw.pump();
    assert_eq!(s.response_status(), Some(503));
    let gw = Gateway::boot(
        dead_address(),
        &config(r#""failure_mode":"local""#, &limited("global", 1, "1m", 1)),
        1,
    );
    let statuses: Vec<Option<u16>> = (0..2)
        .map(|i| {
            let s = gw.worker(0).stream();
            s.send_request(request("gina", &format!("k{i}")));
            gw.pump();
            s.response_status()
        })
        .collect();
    assert_eq!(statuses[1], Some(429), "{statuses:?}");
    assert_ne!(statuses[0], Some(429));
}
