//! The scenarios, one function each.

use crate::util::*;
use idemgate_host::HeaderMap;
use idemgate_host::testing::Request;

const PAYMENTS: &str = r#"[{"name":"payments","match":{"path_prefix":"/payments"}}]"#;

#[test]
fn first_call_goes_upstream_fenced_and_duplicates_replay_byte_for_byte() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", PAYMENTS), 1);
    let first = gw.worker(0).stream();
    first.send_request(post("/payments", "order-1", r#"{"amount":10}"#));
    assert!(
        first.upstream_headers().is_none(),
        "held while the claim is out"
    );
    gw.pump();
    let fence1 = fence(&first).expect("granted and fenced");
    assert_eq!(first.upstream_body(), br#"{"amount":10}"#);
    let body = b"{\"id\":\"pay_1\",\"amount\":10}";
    first.respond(
        201,
        HeaderMap::from([
            ("content-type", "application/json"),
            ("set-cookie", "s=1"),
            ("etag", "\"v1\""),
        ]),
        body,
    );
    gw.pump();
    assert_eq!(first.response_status(), Some(201));

    // Same gateway: replayed from the local tier, no callout.
    let again = gw.worker(0).stream();
    again.send_request(post("/payments", "order-1", r#"{"amount":10}"#));
    assert!(gw.pending().is_empty());
    assert_eq!(again.response_status(), Some(201));
    assert_eq!(again.response_body(), body);
    let headers = again.response_headers().unwrap();
    assert_eq!(headers.get("idempotent-replayed").as_deref(), Some("true"));
    assert_eq!(headers.get("etag").as_deref(), Some("\"v1\""));
    assert_eq!(headers.get("set-cookie"), None);

    // Another gateway: replayed from the sidecar.
    let other = Gateway::boot(stack.addr, &config("", PAYMENTS), 1);
    let remote = other.worker(0).stream();
    remote.send_request(post("/payments", "order-1", r#"{"amount":10}"#));
    other.pump();
    assert!(remote.upstream_headers().is_none());
    assert_eq!(remote.response_status(), Some(201));
    assert_eq!(remote.response_body(), body);
    assert_eq!(
        remote
            .response_headers()
            .unwrap()
            .get("idempotent-replayed")
            .as_deref(),
        Some("true")
    );
    assert!(fence1 > 0);
    assert_eq!(gw.counter("idemgate.requests.granted"), 1);
    assert_eq!(gw.counter("idemgate.local.hits"), 1);
    assert_eq!(other.counter("idemgate.requests.replayed"), 1);
}

#[test]
fn requests_matching_no_rule_pass_untouched() {
    let stack = Stack::start();
    let gw = Gateway::boot(stack.addr, &config("", PAYMENTS), 1);
    let get = gw.worker(0).stream();
    get.send_request(Request::get("/payments"));
    assert!(get.upstream_complete());
    assert!(gw.pending().is_empty());
    assert_eq!(get.upstream_headers().unwrap().get("x-fencing-token"), None);
}
