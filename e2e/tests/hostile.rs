//! Hostile spellings and forged headers through live gateways to the demo backend, whose
//! `/stats` is the ground truth: every spelling of a guarded path is guarded under one key,
//! a request that reads two ways is refused, and no header only idemgate may set reaches the
//! backend unless idemgate set it.
//!
//! The gateways are rendered by the bootstrap builder, whose connection manager sets none of
//! Envoy's path normalisation (`normalize_path`, `merge_slashes`, escaped-slash action): what
//! holds here is the filter's own layer, for deployments that do not set Envoy's.

use idemgate_e2e::client::{Reply, http};
use idemgate_e2e::harness::dead_address;
use idemgate_e2e::live::*;
use idemgate_e2e::stack::Stack;
use idemgate_host::gateway::bootstrap::Bootstrap;
use std::net::SocketAddr;
use std::thread::JoinHandle;

/// The largest fencing token: a backend that saw it would refuse every later write.
const FORGED_FENCE: &str = "18446744073709551615";

fn post(gateway: SocketAddr, path: &str, seq: &str, work_ms: u64, extra: &[(&str, &str)]) -> Reply {
    let work = work_ms.to_string();
    let mut headers = vec![
        ("x-user-id", "u"),
        ("content-type", "application/json"),
        ("x-demo-seq", seq),
        ("x-demo-work-ms", work.as_str()),
    ];
    headers.extend_from_slice(extra);
    http(
        gateway,
        "POST",
        path,
        &headers,
        r#"{"tool":"t","amount":1}"#,
    )
}

fn spawn_post(
    gateway: SocketAddr,
    path: &'static str,
    seq: &'static str,
    work_ms: u64,
) -> JoinHandle<Reply> {
    std::thread::spawn(move || post(gateway, path, seq, work_ms, &[]))
}

fn assert_problem(reply: &Reply, status: u16, type_uri: &str) {
    assert_eq!(reply.status, status, "{reply:?}");
    assert_eq!(reply.problem_type(), type_uri, "{reply:?}");
}

#[test]
fn every_spelling_of_a_guarded_path_is_guarded_by_the_filter_itself() {
    let stack = Stack::start();
    let demo = Demo::start();
    let bootstrap = Bootstrap::idemgate(demo.addr, stack.addr, &shipped_plugin().to_string());
    assert!(
        !bootstrap.to_yaml().contains("normalize_path")
            && !bootstrap.to_yaml().contains("merge_slashes"),
        "the proof needs a gateway without Envoy's normalisation"
    );
    let gateway = variant_of(bootstrap, 1);
    let g = gateway.addr();

    // Two spellings of agent a2's "attach tool" (queue mode) never run together.
    let plain = spawn_post(g, "/agents/a2/tools", "plain", 300);
    demo.wait_started("agent:a2", "plain");
    let encoded = spawn_post(g, "/agents/%61%32/tools", "encoded", 50);
    assert_eq!(plain.join().unwrap().status, 200);
    assert_eq!(encoded.join().unwrap().status, 200);
    let b = demo.stats();
    assert_eq!(
        (b.tool_attaches, b.lost_updates, b.max_overlap),
        (2, 0, 1),
        "{b:?}"
    );
    assert_eq!(b.order["agent:a2"], ["plain", "encoded"]);
    let fences = &b.fences["agent:a2"];
    assert!(fences.len() == 2 && fences[0] < fences[1], "{fences:?}");

    // Two spellings of "start bot b2" (reject mode) start one engine.
    let first = spawn_post(g, "/bots/b2/start", "first", 600);
    demo.wait_started("bot:b2", "first");
    let encoded = post(g, "/bots/%62%32/start", "encoded", 10, &[]);
    assert_problem(&encoded, 409, "urn:idemgate:problem:in-progress");
    // Spellings the backend may route the same way are guarded too, under the same key.
    for path in [
        "//bots/b2/start",
        "/bots/b2/./start",
        "/bots/b2/start/",
        "/bots/x/../b2/start",
    ] {
        let reply = post(g, path, path, 10, &[]);
        assert_problem(&reply, 409, "urn:idemgate:problem:in-progress");
    }
    assert_eq!(first.join().unwrap().status, 201);
    let b = demo.stats();
    assert_eq!((b.engines_started, b.duplicate_engines), (1, 0), "{b:?}");

    // Extra slashes and dot segments are claimed (and so fenced) like the plain spelling,
    // whatever the backend's router then makes of them.
    let granted = gateway.counter("idemgate.requests.granted");
    for path in ["//agents/a4/tools", "/agents/a4/./tools"] {
        post(g, path, path, 10, &[]);
    }
    assert_eq!(gateway.counter("idemgate.requests.granted"), granted + 2);

    // Requests that read two ways are refused before anything runs.
    let executions = demo.stats().executions;
    for path in [
        "/agents/a%2Fb/tools",
        "/agents/a%5cb/tools",
        "/agents%2Fa5%2Ftools",
    ] {
        let reply = post(g, path, path, 10, &[]);
        assert_problem(&reply, 400, "urn:idemgate:problem:ambiguous-request");
    }
    let pay = |headers: &[(&str, &str)]| {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        http(g, "POST", "/payments", &all, r#"{"amount":1}"#)
    };
    let two_users = pay(&[
        ("x-user-id", "alice"),
        ("x-user-id", "mallory"),
        ("idempotency-key", "k1"),
    ]);
    assert_problem(&two_users, 400, "urn:idemgate:problem:ambiguous-request");
    for keys in [
        &[("idempotency-key", "k1"), ("idempotency-key", "k2")][..],
        &[("idempotency-key", "k1, k2")][..],
    ] {
        let mut headers = vec![("x-user-id", "alice")];
        headers.extend_from_slice(keys);
        assert_problem(&pay(&headers), 400, "urn:idemgate:problem:invalid-key");
    }
    assert_eq!(demo.stats().executions, executions, "nothing ran");
    assert_eq!(gateway.counter("idemgate.requests.ambiguous"), 4);
}

#[test]
fn a_backend_never_sees_a_fencing_or_degraded_header_idemgate_did_not_set() {
    let stack = Stack::start();
    let demo = Demo::start();
    let forged = [
        ("x-fencing-token", FORGED_FENCE),
        ("x-idemgate-degraded", "open"),
    ];
    // Forwarded without a grant: the sidecar is unreachable and the failure mode is `open`,
    // "start bot" matches no rule, and a payment's key is optional.
    let mut plugin = shipped_plugin();
    plugin["failure_mode"] = "open".into();
    plugin["rules"]
        .as_array_mut()
        .unwrap()
        .retain(|r| r["name"] != "start-bot");
    rule(&mut plugin, "payments")["key"]["required"] = false.into();
    let degraded = variant(demo.addr, dead_address(), &plugin, 1);
    let d = degraded.addr();
    assert_eq!(
        post(d, "/bots/f1/start", "unmatched", 10, &forged).status,
        201
    );
    assert_eq!(
        post(d, "/agents/f1/tools", "failed-open", 10, &forged).status,
        200
    );
    assert_eq!(post(d, "/payments", "keyless", 10, &forged).status, 201);
    let b = demo.stats();
    assert!(
        b.fences.is_empty(),
        "no forged token reached the backend: {:?}",
        b.fences
    );
    assert_eq!(
        b.degraded, 1,
        "only the failed-open call is marked degraded: {b:?}"
    );

    // Granted by the sidecar: the backend sees idemgate's token only, and a later guarded
    // write on the resource the forged calls touched is not refused.
    let guarded = variant(demo.addr, stack.addr, &shipped_plugin(), 1);
    let reply = post(guarded.addr(), "/agents/f1/tools", "granted", 10, &forged);
    assert_eq!(reply.status, 200, "{reply:?}");
    let b = demo.stats();
    let fences = &b.fences["agent:f1"];
    assert!(
        fences.len() == 1 && fences[0].to_string() != FORGED_FENCE,
        "the sidecar's token, not the client's: {fences:?}"
    );
    assert_eq!((b.stale_refused, b.degraded), (0, 1), "{b:?}");
}
