//! What an operator sees of the sidecar binary: the spans it exports to a real OTLP/HTTP
//! receiver started here (ids continued from the caller, one span per verb, attributes), its
//! JSON log lines (request and trace ids on each, never a key, token or body), and the
//! build, process and store metrics on `/metrics`.

use crate::util::{Backend, Client, Harness, SidecarProcess, claim_req, granted, named_waiting};
use hyper::StatusCode;
use idemgate_sidecar::testing::otlp::{OtlpReceiver, OtlpSpan, SpanKind, attributes, hex};
use idemgate_wire::{Mode, OwnerOutcome, RateCheck, RateRequest, StoredResponse, paths};

/// The caller of one callout: its trace, its span (the parent the sidecar must name) and a
/// request id.
struct Caller {
    trace: String,
    span: String,
    request_id: String,
}

impl Caller {
    /// Trace and span ids derived from `n` (never zero), request id `req-<n>`.
    fn new(n: u8) -> Caller {
        Caller {
            trace: format!("4bf92f3577b34da6a3ce929d0e0e47{n:02x}"),
            span: format!("00f067aa0ba902{n:02x}"),
            request_id: format!("req-{n}"),
        }
    }

    fn client(&self, base: &Client) -> Client {
        base.clone()
            .with_header(
                "traceparent",
                &format!("00-{}-{}-01", self.trace, self.span),
            )
            .with_header("tracestate", "vendor=idemgate-test")
            .with_header("x-request-id", &self.request_id)
    }
}

/// The key every traced call uses: it must never show up in a span.
const TRACED_KEY: &str = "orders-secret-key-1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callouts_continue_the_callers_trace_with_one_span_per_verb() {
    let receiver = OtlpReceiver::start().await;
    let sidecar = SidecarProcess::spawn_env(
        &[
            "--otlp-endpoint",
            &receiver.endpoint(),
            "--recheck-ms",
            "100",
        ],
        &[("OTEL_BSP_SCHEDULE_DELAY", "50")],
    );
    let base = sidecar.client();
    let callers: Vec<Caller> = (1..=9).map(Caller::new).collect();
    let [claim, wait, renew, complete, abort, leave, rate, b3, bad] = &callers[..] else {
        unreachable!()
    };

    // A claim, then a second one that queues behind it and is handed the key on complete.
    let (owner, _) = granted(
        &claim
            .client(&base)
            .claim(&claim_req(TRACED_KEY, Mode::Lock, 10_000))
            .await
            .0,
    );
    let waiter = {
        let client = wait.client(&base);
        let req = named_waiting(claim_req(TRACED_KEY, Mode::Lock, 10_000), "w-1", 10_000, 10);
        tokio::spawn(async move { client.claim(&req).await.0 })
    };
    base.wait_for_key(TRACED_KEY, "the waiter to queue", |k| k.queue_len == 1)
        .await;
    assert!(matches!(
        renew.client(&base).renew(TRACED_KEY, &owner, 10_000).await,
        OwnerOutcome::Renewed { .. }
    ));
    assert_eq!(
        complete
            .client(&base)
            .complete(TRACED_KEY, &owner, 0, None)
            .await,
        OwnerOutcome::Released
    );
    let (next_owner, _) = granted(&waiter.await.expect("waiter"));
    assert_eq!(
        abort.client(&base).abort(TRACED_KEY, &next_owner).await,
        OwnerOutcome::Released
    );
    assert_eq!(
        leave.client(&base).leave(TRACED_KEY, "nobody").await,
        OwnerOutcome::Stale
    );
    let rate_req = RateRequest {
        checks: vec![RateCheck {
            key: "rate-secret-key".into(),
            interval_us: 1_000_000,
            burst: 5,
        }],
    };
    assert_eq!(
        rate.client(&base)
            .post(paths::RATE, &rate_req, &[])
            .await
            .status,
        StatusCode::OK
    );
    // A caller that speaks only B3 (single header), one without any trace, one sending garbage.
    let b3_client = base
        .clone()
        .with_header("b3", &format!("{}-{}-1", b3.trace, b3.span));
    granted(
        &b3_client
            .claim(&claim_req("b3-key", Mode::Lock, 1_000))
            .await
            .0,
    );
    granted(
        &base
            .claim(&claim_req("untraced-key", Mode::Lock, 1_000))
            .await
            .0,
    );
    let refused = bad
        .client(&base)
        .send(hyper::Method::POST, paths::CLAIM, b"{not json".to_vec())
        .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);

    // Nine callouts with a caller, the untraced one, and the queued claim's `wait`.
    let spans = receiver.wait_for(11).await;
    let spans: Vec<&OtlpSpan> = spans
        .iter()
        .map(|(service, span)| {
            assert_eq!(service, "idemgate-sidecar");
            span
        })
        .collect();
    let in_trace = |caller: &Caller| -> Vec<&OtlpSpan> {
        spans
            .iter()
            .copied()
            .filter(|s| hex(&s.trace_id) == caller.trace)
            .collect()
    };
    // The callout's own span: a server span, child of the caller's span.
    let callout = |caller: &Caller, verb: &str, outcome: &str| -> OtlpSpan {
        let found = in_trace(caller);
        let span = found
            .iter()
            .find(|s| s.name == verb)
            .unwrap_or_else(|| panic!("no {verb} span in trace {}: {found:#?}", caller.trace));
        assert_eq!(
            hex(&span.parent_span_id),
            caller.span,
            "{verb}: parent span"
        );
        assert_eq!(span.kind, SpanKind::Server as i32, "{verb}: kind");
        assert_eq!(
            span.trace_state, "vendor=idemgate-test",
            "{verb}: tracestate"
        );
        let attrs = attributes(span);
        assert_eq!(
            attrs.get("idemgate.outcome").map(String::as_str),
            Some(outcome),
            "{verb}: {attrs:?}"
        );
        assert_eq!(
            attrs.get("request_id"),
            Some(&caller.request_id),
            "{verb}: {attrs:?}"
        );
        assert_eq!(
            attrs.get("trace_id"),
            Some(&caller.trace),
            "{verb}: {attrs:?}"
        );
        (*span).clone()
    };
    let store_ms = |span: &OtlpSpan| -> f64 {
        attributes(span)
            .get("idemgate.store_ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(-1.0)
    };
    for (caller, verb, outcome) in [
        (claim, "claim", "granted"),
        (renew, "renew", "renewed"),
        (complete, "complete", "released"),
        (abort, "abort", "released"),
        (leave, "leave", "stale"),
        (rate, "rate", "allowed"),
    ] {
        let span = callout(caller, verb, outcome);
        assert!(
            store_ms(&span) >= 0.0,
            "{verb}: store time {:?}",
            attributes(&span)
        );
        assert_eq!(in_trace(caller).len(), 1, "{verb}: one span");
    }

    // The queued claim: granted after waiting in place 0, with a child `wait` span.
    let queued = callout(wait, "claim", "granted");
    let attrs = attributes(&queued);
    assert_eq!(
        attrs.get("idemgate.queue_position").map(String::as_str),
        Some("0")
    );
    let waited: f64 = attrs
        .get("idemgate.wait_ms")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(waited > 0.0, "{attrs:?}");
    let wait_span = in_trace(wait)
        .into_iter()
        .find(|s| s.name == "wait")
        .unwrap_or_else(|| panic!("no wait span: {:#?}", in_trace(wait)));
    assert_eq!(
        wait_span.parent_span_id, queued.span_id,
        "wait is the claim's child"
    );
    let wait_attrs = attributes(wait_span);
    assert_eq!(
        wait_attrs
            .get("idemgate.queue_position")
            .map(String::as_str),
        Some("0")
    );
    assert_eq!(
        wait_attrs.get("idemgate.outcome").map(String::as_str),
        Some("granted")
    );
    assert!(wait_span.start_time_unix_nano >= queued.start_time_unix_nano);
    assert!(wait_span.end_time_unix_nano <= queued.end_time_unix_nano);
    assert!(store_ms(&queued) > 0.0);

    // B3: the same continuation, parent and trace from the `b3` header.
    let b3_span = in_trace(b3);
    assert_eq!(b3_span.len(), 1, "{b3_span:#?}");
    assert_eq!(hex(&b3_span[0].parent_span_id), b3.span);
    // No caller trace: a new trace, a root span.
    let untraced: Vec<&&OtlpSpan> = spans
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .collect();
    assert_eq!(untraced.len(), 1, "{untraced:#?}");
    assert_eq!(untraced[0].name, "claim");
    // A refused request: its span says so.
    let problem = attributes(&callout(bad, "claim", "problem"));
    assert_eq!(
        problem.get("http.response.status_code").map(String::as_str),
        Some("400")
    );

    let everything = format!("{spans:?}");
    for secret in [TRACED_KEY, "rate-secret-key", "b3-key", "untraced-key"] {
        assert!(!everything.contains(secret), "{secret} leaked into a span");
    }
    assert!(receiver.refused().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_log_lines_carry_request_and_trace_ids_and_no_secrets() {
    const TOKEN: &str = "tok-SECRET-9f3e";
    const KEY: &str = "raw-idempotency-key-SECRET";
    const BODY: &[u8] = b"BODY-SECRET-payment-42";
    let sidecar = SidecarProcess::spawn_env(
        &["--log-format", "json", "--auth-token", TOKEN],
        &[("RUST_LOG", "info,idemgate_sidecar=debug")],
    );
    let caller = Caller::new(42);
    let client = caller.client(&sidecar.client()).with_token(TOKEN);
    let (owner, _) = granted(
        &client
            .claim(&claim_req(KEY, Mode::Idempotency, 10_000))
            .await
            .0,
    );
    let response = StoredResponse {
        status: 201,
        headers: vec![("x-order".into(), "SECRET-header-value".into())],
    };
    assert_eq!(
        client
            .complete(KEY, &owner, 60_000, Some((response, BODY)))
            .await,
        OwnerOutcome::Released
    );
    // A late complete from the same owner (info line), an operator's force release (warn
    // line), and a request with a wrong token.
    assert_eq!(client.abort(KEY, &owner).await, OwnerOutcome::Stale);
    let release = serde_json::json!({ "key": KEY });
    let reply = client
        .send(
            hyper::Method::POST,
            "/admin/v1/release",
            release.to_string().into_bytes(),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let stranger = Caller::new(43);
    let wrong = stranger
        .client(&sidecar.client())
        .with_token("tok-SECRET-wrong");
    assert_eq!(
        wrong
            .post(paths::CLAIM, &claim_req(KEY, Mode::Lock, 1_000), &[])
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );

    let log = sidecar.log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let message = |l: &serde_json::Value| {
        l["fields"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    // Every line written inside a request names the request and its trace.
    let in_request: Vec<&serde_json::Value> =
        lines.iter().filter(|l| l.get("span").is_some()).collect();
    for line in &in_request {
        let ids = (
            line["span"]["request_id"].as_str().unwrap_or_default(),
            line["span"]["trace_id"].as_str().unwrap_or_default(),
        );
        assert!(
            [&caller, &stranger]
                .iter()
                .any(|c| ids == (c.request_id.as_str(), c.trace.as_str())),
            "{line}"
        );
    }
    for expected in [
        "refused a stale owner",
        "operator force-released a key",
        "answered",
    ] {
        assert!(
            in_request.iter().any(|l| message(l) == expected),
            "no `{expected}` line inside a request: {log}"
        );
    }
    let audit = in_request
        .iter()
        .find(|l| message(l) == "operator force-released a key")
        .map(|l| {
            l["fields"]["key_digest"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        });
    assert_eq!(
        audit.map(|d| d.len()),
        Some(16),
        "the audit line names the key by digest"
    );
    // The start line is JSON too, with the version and commit.
    assert!(
        lines
            .iter()
            .any(|l| message(l) == "starting idemgate-sidecar"
                && l["fields"]["commit"] == env!("IDEMGATE_GIT_COMMIT"))
    );
    for secret in [
        TOKEN,
        "tok-SECRET-wrong",
        KEY,
        "SECRET-header-value",
        "BODY-SECRET",
    ] {
        assert!(!log.contains(secret), "`{secret}` is in the log:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_the_build_the_process_and_store_latency_by_verb() {
    let h = Harness::start(Backend::Redis).await;
    let (owner, _) = granted(&h.client.claim(&claim_req("m", Mode::Lock, 5_000)).await.0);
    assert_eq!(
        h.client.renew("m", &owner, 5_000).await,
        OwnerOutcome::Renewed { lease_ms: 5_000 }
    );
    assert_eq!(
        h.client.complete("m", &owner, 0, None).await,
        OwnerOutcome::Released
    );
    let rate = RateRequest {
        checks: vec![RateCheck {
            key: "m".into(),
            interval_us: 1_000,
            burst: 1,
        }],
    };
    assert_eq!(
        h.client.post(paths::RATE, &rate, &[]).await.status,
        StatusCode::OK
    );
    let build = format!(
        "idemgate_sidecar_build_info{{git_sha=\"{}\",version=\"{}\"}}",
        env!("IDEMGATE_GIT_COMMIT"),
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(h.client.metric(&build).await, 1.0);
    for verb in ["claim", "renew", "complete", "rate"] {
        let count = h
            .client
            .metric(&format!(
                "idemgate_sidecar_store_seconds_count{{verb=\"{verb}\"}}"
            ))
            .await;
        assert!(count >= 1.0, "{verb}: {count}");
    }
    // Nothing was aborted: the series is there, at zero, rather than missing.
    let text = String::from_utf8_lossy(&h.client.get("/metrics").await.body).into_owned();
    assert!(
        text.contains("idemgate_sidecar_store_seconds_count{verb=\"abort\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("idemgate_sidecar_store_errors_total{kind=\"transient\"} 0"),
        "{text}"
    );
    assert!(h.client.metric("process_resident_memory_bytes").await > 1e6);
    assert!(h.client.metric("process_start_time_seconds").await > 1.6e9);
    assert!(h.client.metric("process_open_fds").await >= 3.0);
    assert!(text.contains("\nprocess_cpu_seconds_total "), "{text}");
}
