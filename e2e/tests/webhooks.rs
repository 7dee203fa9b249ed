//! Webhook deliveries keyed on the event id in the JSON body (`key.body_pointer`), end to end:
//! clients over real sockets → a live gateway running the shipped `envoy/envoy.yaml` (its
//! "order-webhooks" rule; Envoy's and the plugin's `allow_on_headers_stop_iteration` set) →
//! the demo backend, whose `/stats` counts what it shipped, with a real sidecar on a real
//! Redis. Where a test needs another cap or an optional key, it changes only that in the
//! shipped plugin configuration.

use idemgate_demo::scenarios;
use idemgate_e2e::client::{Reply, http, read_reply};
use idemgate_e2e::live::*;
use idemgate_e2e::stack::Stack;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const WEBHOOKS: &str = "order-webhooks";

fn deliver(gateway: SocketAddr, body: &str) -> Reply {
    http(
        gateway,
        "POST",
        "/webhooks/orders",
        &[("content-type", "application/json")],
        body,
    )
}

/// One delivery whose body is written in `parts`, 50 ms apart, so the gateway receives it
/// in several reads (and the filter in several body callbacks).
fn deliver_in_parts(gateway: SocketAddr, parts: &[&str]) -> Reply {
    let length: usize = parts.iter().map(|p| p.len()).sum();
    let mut conn = TcpStream::connect(gateway).expect("connect");
    conn.set_nodelay(true).expect("nodelay");
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let head = format!(
        "POST /webhooks/orders HTTP/1.1\r\nhost: api.test\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).expect("send");
    for part in parts {
        std::thread::sleep(Duration::from_millis(50));
        conn.write_all(part.as_bytes()).expect("send");
    }
    read_reply(&mut conn)
}

/// An order event of exactly `len` bytes (padded), with event id `id`.
fn event_of_len(id: &str, len: usize) -> String {
    let bare = format!(r#"{{"id":"{id}","type":"order.paid","pad":""}}"#);
    let pad = "x".repeat(len.checked_sub(bare.len()).expect("long enough"));
    let event = format!(r#"{{"id":"{id}","type":"order.paid","pad":"{pad}"}}"#);
    assert_eq!(event.len(), len);
    event
}

/// The demo's redelivery: twice at once and once after, straight to the backend it ships
/// three times; through the gateway once, and both redeliveries get the first's response.
#[test]
fn a_webhook_delivered_twice_at_once_and_again_after_runs_once() {
    let stack = Stack::start();
    let demo = Demo::start();
    let gateway = shipped(demo.addr, stack.addr, 2);
    let scenario = scenarios::webhook_redelivery("evt_1");
    let direct = demo.play_direct(&scenario);
    assert_eq!(
        (
            direct.backend.webhook_events,
            direct.backend.duplicate_events
        ),
        (3, 2),
        "without idemgate the redeliveries ship again"
    );
    demo.reset();
    let run = demo.play(&gateway, &scenario);
    assert_eq!(run.count(200), 3, "{:?}", run.outcomes);
    assert_eq!(run.replays(), 2, "{:?}", run.outcomes);
    assert!(
        run.outcomes.iter().all(|o| o.body == run.outcomes[0].body),
        "one shipment, one response: {:?}",
        run.outcomes
    );
    let b = &run.backend;
    assert_eq!((b.webhook_events, b.duplicate_events), (1, 0), "{b:?}");
}

/// Two events delivered at once are two keys: both ship, neither is a replay.
#[test]
fn two_events_delivered_at_once_both_run() {
    let stack = Stack::start();
    let demo = Demo::start();
    let gateway = shipped(demo.addr, stack.addr, 2);
    let addr = gateway.addr();
    let deliveries: Vec<_> = ["evt_a", "evt_b"]
        .into_iter()
        .map(|id| {
            std::thread::spawn(move || {
                deliver(addr, &format!(r#"{{"id":"{id}","type":"order.paid"}}"#))
            })
        })
        .collect();
    for delivery in deliveries {
        let reply = delivery.join().unwrap();
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.header("idempotent-replayed"), None);
    }
    let b = demo.stats();
    assert_eq!((b.webhook_events, b.duplicate_events), (2, 0), "{b:?}");
    // A number is an id too: its digits are the key.
    assert_eq!(deliver(addr, r#"{"id":42}"#).status, 200);
    let again = deliver(addr, r#"{"id":42}"#);
    assert_eq!(
        again.header("idempotent-replayed"),
        Some("true"),
        "{again:?}"
    );
    assert_eq!(demo.stats().webhook_events, 3);
}

/// A body that is not JSON is refused with its own problem type; nothing reaches the backend.
#[test]
fn a_delivery_that_is_not_json_is_400_not_json() {
    let stack = Stack::start();
    let demo = Demo::start();
    let gateway = shipped(demo.addr, stack.addr, 1);
    for body in ["id=evt_1", r#"{"id":"evt_1""#] {
        let reply = deliver(gateway.addr(), body);
        assert_eq!(reply.status, 400, "{reply:?}");
        assert_eq!(reply.problem_type(), "urn:idemgate:problem:not-json");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
    }
    assert_eq!(demo.stats().executions, 0);
}

/// The cap (`fingerprint.max_body_bytes`, 1 KiB here): a delivery of exactly 1 KiB, in three
/// parts, is keyed and runs once; one byte more is 413, and claims nothing (the same event
/// right after runs, not a replay).
#[test]
fn a_delivery_up_to_the_cap_runs_and_one_byte_more_is_413() {
    let stack = Stack::start();
    let demo = Demo::start();
    let mut plugin = shipped_plugin();
    rule(&mut plugin, WEBHOOKS)["fingerprint"]["max_body_bytes"] = 1024.into();
    let gateway = variant(demo.addr, stack.addr, &plugin, 1);
    let over = event_of_len("evt_big", 1025);
    let refused = deliver(gateway.addr(), &over);
    assert_eq!(refused.status, 413, "{refused:?}");
    assert_eq!(refused.problem_type(), "urn:idemgate:problem:too-large");
    assert_eq!(demo.stats().executions, 0);
    let at_cap = event_of_len("evt_big", 1024);
    let (a, b) = at_cap.split_at(300);
    let (b, c) = b.split_at(400);
    let first = deliver_in_parts(gateway.addr(), &[a, b, c]);
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(
        first.header("idempotent-replayed"),
        None,
        "nothing was claimed"
    );
    let again = deliver_in_parts(gateway.addr(), &[a, b, c]);
    assert_eq!(
        again.header("idempotent-replayed"),
        Some("true"),
        "{again:?}"
    );
    let stats = demo.stats();
    assert_eq!((stats.webhook_events, stats.duplicate_events), (1, 0));
}

/// Without the event id: required (as shipped) → 400 missing-key; optional → the delivery
/// passes unguarded, so each one runs.
#[test]
fn a_delivery_without_the_event_id_follows_key_required() {
    let stack = Stack::start();
    let demo = Demo::start();
    let gateway = shipped(demo.addr, stack.addr, 1);
    for body in [
        r#"{"type":"order.paid"}"#,
        r#"{"id":null}"#,
        r#"{"id":{"n":1}}"#,
    ] {
        let reply = deliver(gateway.addr(), body);
        assert_eq!(reply.status, 400, "{body}: {reply:?}");
        assert_eq!(reply.problem_type(), "urn:idemgate:problem:missing-key");
    }
    assert_eq!(demo.stats().executions, 0);
    let mut plugin = shipped_plugin();
    rule(&mut plugin, WEBHOOKS)["key"]["required"] = false.into();
    let optional = variant(demo.addr, stack.addr, &plugin, 1);
    for _ in 0..2 {
        let reply = deliver(optional.addr(), r#"{"type":"order.paid"}"#);
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.header("idempotent-replayed"), None);
    }
    assert_eq!(demo.stats().webhook_events, 2, "unguarded: both ran");
}
