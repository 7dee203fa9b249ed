//! gRPC calls through the flow: gRPC statuses for every local reply, the outcome read from
//! `grpc-status` (held until the trailers), replays as statuses.

use super::*;

/// `pay.Payments`: `Attach` locks the agent named in metadata (queued), every other method is
/// idempotent per `idempotency-key`; `/payments` is an HTTP rule.
const RULES: &str = r#"[
    {"name":"attach","mode":"lock","grpc":{"service":"pay.Payments","method":"Attach"},
     "key":{"header":"x-agent-id"},"on_conflict":"queue","on_client_abort":"release"},
    {"name":"pay","grpc":{"service":"pay.Payments"}},
    {"name":"http","match":{"path_prefix":"/payments"}}
]"#;

fn call(method: &str, key: &str) -> Req {
    Req::new("POST", &format!("/pay.Payments/{method}"))
        .with("content-type", "application/grpc")
        .with("idempotency-key", key)
}

fn grpc_headers(status: &str, extra: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    let mut headers = vec![
        (":status".to_string(), status.as_bytes().to_vec()),
        ("content-type".to_string(), b"application/grpc".to_vec()),
    ];
    headers.extend(
        extra
            .iter()
            .map(|(n, v)| ((*n).to_string(), v.as_bytes().to_vec())),
    );
    headers
}

/// The response of a forwarded call: headers, one message, then `trailers`.
fn respond_grpc(gw: &mut Gateway, flow: &mut Flow, trailers: &[(&str, &str)]) {
    let headers = grpc_headers("200", &[]);
    gw.with(|c, env| flow.on_response_headers(c, &headers, false, env));
    assert!(
        !flow.wants_response_body(),
        "a call's messages are not stored"
    );
    gw.with(|c, env| flow.on_response_body(c, &[], false, env));
    assert!(
        flow.take_release().is_none(),
        "nothing is released before the trailers"
    );
    let trailers: Vec<(String, Vec<u8>)> = trailers
        .iter()
        .map(|(n, v)| ((*n).to_string(), v.as_bytes().to_vec()))
        .collect();
    gw.with(|c, env| flow.on_response_trailers(c, &trailers, env));
}

fn completed(flow: &mut Flow) -> CompleteRequest {
    let (path, body) = release(flow);
    assert_eq!(path, paths::COMPLETE);
    let (complete, payload): (CompleteRequest, &[u8]) = idemgate_wire::decode(&body).unwrap();
    assert!(
        payload.is_empty(),
        "no message body is stored for a gRPC call"
    );
    complete
}

#[test]
fn every_refusal_of_a_grpc_call_is_a_grpc_status() {
    let mut gw = Gateway::rules(RULES);
    // Missing key: INVALID_ARGUMENT, the problem's title and detail as the message.
    let no_key =
        Req::new("POST", "/pay.Payments/Charge").with("content-type", "application/grpc+proto");
    let r = reply(gw.start(&no_key).1);
    assert_eq!(r.grpc_status, Some(3));
    assert_eq!(
        r.body,
        b"Idempotency key required: this endpoint requires an idempotency key"
    );
    assert!(
        r.headers.is_empty(),
        "no problem+json headers: {:?}",
        r.headers
    );
    // In progress on this gateway: ABORTED with the wait as gRPC retry pushback (ms).
    let (mut first, _, _) = gw.claim(&call("Charge", "k"));
    gw.grant(&mut first, 1);
    gw.now += 1_000;
    let r = reply(gw.start(&call("Charge", "k")).1);
    assert_eq!((r.status, r.grpc_status), (409, Some(10)));
    assert_eq!(header(&r, "grpc-retry-pushback-ms"), Some("29000"));
    assert_eq!(header(&r, "retry-after"), None);
    // The same key on another method of the rule: FAILED_PRECONDITION.
    let (mut other, _, _) = gw.claim(&call("Refund", "k2"));
    let r = reply(gw.answer_with(&mut other, &ClaimOutcome::Mismatch, &[]));
    assert_eq!(r.grpc_status, Some(9));
    // Queue full and wait expired at the sidecar.
    let (mut queued, _, _) = gw.claim(
        &Req::new("POST", "/pay.Payments/Attach")
            .with("content-type", "application/grpc")
            .with("x-agent-id", "a1"),
    );
    let full = ClaimOutcome::QueueFull {
        retry_after_ms: 700,
        queue_len: 16,
    };
    let r = reply(gw.answer_with(&mut queued, &full, &[]));
    assert_eq!(
        (r.grpc_status, header(&r, "grpc-retry-pushback-ms")),
        (Some(8), Some("700"))
    );
    // Sidecar down, failing closed: UNAVAILABLE.
    let (mut down, _, _) = gw.claim(&call("Charge", "k3"));
    let r = reply(gw.answer(&mut down, Answer::Failed));
    assert_eq!((r.status, r.grpc_status), (503, Some(14)));
    assert_eq!(header(&r, "grpc-retry-pushback-ms"), Some("5000"));
    // An HTTP request under an HTTP rule still gets problem+json.
    let r = reply(gw.start(&Req::new("POST", "/payments")).1);
    assert_eq!((r.status, r.grpc_status), (400, None));
    assert_eq!(problem_type(&r), types::MISSING_KEY);
}

#[test]
fn a_grpc_rule_takes_only_grpc_calls_of_its_service_and_method() {
    let gw = Gateway::rules(RULES);
    let rule = |req: &Req| Flow::route(&gw.config, req).map(|r| r.rule.name.clone());
    assert_eq!(rule(&call("Attach", "k")).as_deref(), Some("attach"));
    assert_eq!(rule(&call("Charge", "k")).as_deref(), Some("pay"));
    assert_eq!(rule(&call("Charge/x", "k")), None);
    let other_service =
        Req::new("POST", "/pay.Other/Charge").with("content-type", "application/grpc");
    assert_eq!(rule(&other_service), None);
    // gRPC-Web and JSON to the same path are not gRPC calls.
    for ct in ["application/grpc-web", "application/json"] {
        let req = Req::new("POST", "/pay.Payments/Charge").with("content-type", ct);
        assert_eq!(rule(&req), None, "{ct}");
    }
    // A rule without `grpc` answers a gRPC call to its paths in gRPC terms too.
    let mut gw = Gateway::rules(REJECT);
    let req = Req::new("POST", "/payments").with("content-type", "application/grpc");
    assert_eq!(reply(gw.start(&req).1).grpc_status, Some(3));
}

#[test]
fn the_outcome_is_the_grpc_status_in_the_trailers() {
    let mut gw = Gateway::rules(RULES);
    // OK: stored (status only), released when the trailers came.
    let (mut flow, claim, _) = gw.claim(&call("Charge", "ok"));
    gw.grant(&mut flow, 1);
    respond_grpc(&mut gw, &mut flow, &[("grpc-status", "0")]);
    let complete = completed(&mut flow);
    assert_eq!(complete.key, claim.key);
    let stored = complete.response.unwrap();
    assert_eq!(
        (stored.status, stored.headers),
        (
            200,
            vec![
                ("grpc-status".into(), "0".into()),
                ("grpc-message".into(), String::new())
            ]
        )
    );
    // HTTP 200 with INTERNAL: a failed call, aborted so a retry runs.
    let (mut flow, _, _) = gw.claim(&call("Charge", "internal"));
    gw.grant(&mut flow, 2);
    respond_grpc(
        &mut gw,
        &mut flow,
        &[("grpc-status", "13"), ("grpc-message", "boom")],
    );
    assert_eq!(release(&mut flow).0, paths::ABORT);
    // The stream ended without trailers, or with trailers but no grpc-status: unknown, aborted.
    let (mut flow, _, _) = gw.claim(&call("Charge", "no-trailers"));
    gw.grant(&mut flow, 3);
    let headers = grpc_headers("200", &[]);
    gw.with(|c, env| flow.on_response_headers(c, &headers, false, env));
    gw.with(|c, env| flow.on_response_body(c, &[], true, env));
    assert_eq!(release(&mut flow).0, paths::ABORT);
    let (mut flow, _, _) = gw.claim(&call("Charge", "no-status"));
    gw.grant(&mut flow, 4);
    respond_grpc(&mut gw, &mut flow, &[("x-other", "1")]);
    assert_eq!(release(&mut flow).0, paths::ABORT);
    // A trailers-only response: the status is in the headers, the response ends with them.
    let (mut flow, _, _) = gw.claim(&call("Charge", "trailers-only"));
    gw.grant(&mut flow, 5);
    let headers = grpc_headers(
        "200",
        &[("grpc-status", "5"), ("grpc-message", "no%20such")],
    );
    gw.with(|c, env| flow.on_response_headers(c, &headers, true, env));
    let stored = completed(&mut flow).response.unwrap();
    assert_eq!(stored.headers[0], ("grpc-status".into(), "5".into()));
    // The stream reset before its trailers: the rule's client-abort policy decides (hold).
    let (mut flow, _, _) = gw.claim(&call("Charge", "reset"));
    gw.grant(&mut flow, 6);
    gw.with(|c, env| flow.on_response_headers(c, &grpc_headers("200", &[]), false, env));
    assert!(!gw.end(&mut flow));
    assert!(flow.take_release().is_none(), "held until its lease ends");
}

#[test]
fn a_lock_is_held_until_the_trailers_and_released_on_a_reset() {
    let mut gw = Gateway::rules(RULES);
    let attach = Req::new("POST", "/pay.Payments/Attach")
        .with("content-type", "application/grpc")
        .with("x-agent-id", "a1");
    let (mut flow, claim, _) = gw.claim(&attach);
    assert_eq!(claim.mode, Mode::Lock);
    gw.grant(&mut flow, 1);
    respond_grpc(&mut gw, &mut flow, &[("grpc-status", "13")]);
    let complete = completed(&mut flow);
    assert_eq!(
        complete.response, None,
        "a lock stores nothing, whatever the status"
    );
    // Reset mid-response under `on_client_abort: release`: aborted at once.
    let (mut flow, _, _) = gw.claim(&attach);
    gw.grant(&mut flow, 2);
    gw.with(|c, env| flow.on_response_headers(c, &grpc_headers("200", &[]), false, env));
    assert!(!gw.end(&mut flow));
    assert_eq!(release(&mut flow).0, paths::ABORT);
}

#[test]
fn a_duplicate_of_a_completed_call_gets_its_status_or_already_exists() {
    let mut gw = Gateway::rules(RULES);
    let stored = |code: &str, message: &str| ClaimOutcome::Completed {
        response: StoredResponse {
            status: 200,
            headers: vec![
                ("grpc-status".into(), code.into()),
                ("grpc-message".into(), message.into()),
            ],
        },
        waited_ms: 0,
    };
    // A stored failure comes back exactly, its message decoded (Envoy encodes it again).
    let (mut flow, _, _) = gw.claim(&call("Charge", "nf"));
    let r = reply(gw.answer_with(&mut flow, &stored("5", "no such%3A 100%25"), &[]));
    assert_eq!(
        (r.grpc_status, r.body.as_slice()),
        (Some(5), &b"no such: 100%"[..])
    );
    assert_eq!(header(&r, "idempotent-replayed"), Some("true"));
    // OK: ALREADY_EXISTS, saying the call ran.
    let (mut flow, _, _) = gw.claim(&call("Charge", "ok"));
    let r = reply(gw.answer_with(&mut flow, &stored("0", ""), &[]));
    assert_eq!(r.grpc_status, Some(6));
    assert_eq!(
        r.body,
        b"a call with this idempotency key already completed (OK)"
    );
    assert_eq!(
        r.headers,
        vec![("idempotent-replayed".into(), "true".into())]
    );
    // The replay filled this gateway's slot: the next duplicate is answered locally, alike.
    let r = reply(gw.start(&call("Charge", "ok")).1);
    assert_eq!(r.grpc_status, Some(6));
    // Completed by this gateway's own call: the local tier replays it the same way.
    let (mut first, _, _) = gw.claim(&call("Charge", "local"));
    gw.grant(&mut first, 9);
    respond_grpc(&mut gw, &mut first, &[("grpc-status", "0")]);
    completed(&mut first);
    let r = reply(gw.start(&call("Charge", "local")).1);
    assert_eq!(
        (r.grpc_status, header(&r, "idempotent-replayed")),
        (Some(6), Some("true"))
    );
}
