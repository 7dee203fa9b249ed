//! A plugin trap in one worker VM: the other workers keep deciding, the trapped VM's key is
//! not leaked past its lease (local tier and sidecar), and the trapped worker fails closed.

use idemgate_e2e::harness::{Gateway, config, fence, post};
use idemgate_e2e::stack::Stack;
use idemgate_host::HeaderMap;
use std::time::Duration;

#[test]
fn a_trap_in_one_worker_neither_wedges_the_others_nor_leaks_the_key() {
    let stack = Stack::start();
    let rules = r#"[{"name":"payments","match":{"path_prefix":"/payments"},"lease":"2s"}]"#;
    let gw = Gateway::boot(stack.addr, &config("", rules), 2);
    let holder = gw.worker(0).stream();
    holder.send_request(post("/payments", "trap-k", "{}"));
    gw.pump();
    let first = fence(&holder).expect("granted on worker 0");

    gw.worker(0).with(|vm| vm.inject_trap());
    assert!(gw.worker(0).is_failed(), "worker 0 trapped");
    // The holder's response never reaches the failed VM: nothing releases the key.
    holder.respond(201, HeaderMap::new(), "{}");
    gw.pump();

    // Worker 1 is not wedged: the duplicate is caught (the key is still in flight), other
    // keys go through.
    let dup = gw.worker(1).stream();
    dup.send_request(post("/payments", "trap-k", "{}"));
    gw.pump();
    assert_eq!(dup.response_status(), Some(409));
    let other = gw.worker(1).stream();
    other.send_request(post("/payments", "trap-other", "{}"));
    gw.pump();
    assert!(
        fence(&other).is_some(),
        "another key is granted on worker 1"
    );
    other.respond(
        201,
        HeaderMap::from([("content-type", "application/json")]),
        "{}",
    );
    gw.pump();

    // The trapped worker fails its streams closed (Envoy's FAIL_CLOSED: 503).
    let on_failed = gw.worker(0).stream();
    on_failed.send_request(post("/payments", "trap-later", "{}"));
    assert_eq!(on_failed.response_status(), Some(503));

    // One lease later (both clocks: the sidecar's is real, the gateway's virtual) the key
    // is claimable again, with a higher fence.
    std::thread::sleep(Duration::from_millis(2_200));
    gw.host.advance(Duration::from_millis(2_200));
    let retry = gw.worker(1).stream();
    retry.send_request(post("/payments", "trap-k", "{}"));
    gw.pump();
    let next = fence(&retry).expect("granted after the lease");
    assert!(next > first, "{next} > {first}");
}
