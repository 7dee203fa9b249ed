//! One request, end to end: a client's `traceparent` (or `b3`) enters the live gateway
//! running the shipped `envoy/envoy.yaml`, the filter's callouts carry it to the sidecar
//! binary, and the sidecar's spans — exported over OTLP/HTTP to a receiver started here —
//! continue the client's trace as children of the client's span; the shipped access log's
//! line shows the filter's decision from its filter state.

use crate::demo::bin_dir;
use idemgate_e2e::client::http;
use idemgate_e2e::live::{Demo, shipped};
use idemgate_sidecar::testing::otlp::{OtlpReceiver, OtlpSpan, hex};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The sidecar binary on a free loopback port, exporting its spans to `otlp`, killed on drop.
struct SidecarBinary {
    child: Child,
    addr: SocketAddr,
}

impl SidecarBinary {
    fn start(otlp: &str) -> SidecarBinary {
        let addr = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port");
        let child = Command::new(bin_dir().join("idemgate-sidecar"))
            .args(["--listen", &addr.to_string(), "--otlp-endpoint", otlp])
            .env_remove("REDIS_URL")
            // Export each batch within 50 ms rather than the default 5 s.
            .env("OTEL_BSP_SCHEDULE_DELAY", "50")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("the sidecar binary starts");
        let sidecar = SidecarBinary { child, addr };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "the sidecar never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        sidecar
    }
}

impl Drop for SidecarBinary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const TRACE: &str = "5b8efff798038103d269b633813fc60c";
const CLIENT_SPAN: &str = "eee19b7ec3c1b174";
const B3_TRACE: &str = "80f198ee56343ba864fe8b2a57d3eff7";
const B3_SPAN: &str = "e457b5a2e4d86bd1";

#[test]
fn the_sidecars_spans_continue_the_clients_trace_and_the_access_log_shows_the_decision() {
    let runtime = tokio::runtime::Runtime::new().expect("a runtime for the receiver");
    let receiver = runtime.block_on(OtlpReceiver::start());
    let sidecar = SidecarBinary::start(&receiver.endpoint());
    let demo = Demo::start();
    let gateway = shipped(demo.addr, sidecar.addr, 1);

    // W3C trace context on an idempotent payment: a claim, then a complete.
    let traceparent = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let pay = |request_id: &str| {
        http(
            gateway.addr(),
            "POST",
            "/payments",
            &[
                ("idempotency-key", "trace-pay-1"),
                ("x-user-id", "alice"),
                ("content-type", "application/json"),
                ("traceparent", &traceparent),
                ("tracestate", "client=e2e"),
                ("x-request-id", request_id),
            ],
            r#"{"amount":5}"#,
        )
    };
    let paid = pay("e2e-trace-1");
    assert!(paid.status < 300, "{paid:?}");
    // Only B3 on a lock: its claim and its release.
    let started = http(
        gateway.addr(),
        "POST",
        "/bots/trace-bot/start",
        &[("b3", &format!("{B3_TRACE}-{B3_SPAN}-1"))],
        "",
    );
    assert!(started.status < 300, "{started:?}");

    let spans = runtime.block_on(receiver.wait_for(4));
    let in_trace = |trace: &str| -> Vec<&OtlpSpan> {
        spans
            .iter()
            .map(|(_, span)| span)
            .filter(|span| hex(&span.trace_id) == trace && span.name != "wait")
            .collect()
    };
    let names = |spans: &[&OtlpSpan]| -> Vec<String> {
        let mut names: Vec<String> = spans.iter().map(|s| s.name.clone()).collect();
        names.sort();
        names
    };

    let paid_spans = in_trace(TRACE);
    assert_eq!(names(&paid_spans), ["claim", "complete"], "{spans:#?}");
    for span in &paid_spans {
        assert_eq!(hex(&span.parent_span_id), CLIENT_SPAN, "{span:#?}");
        assert_eq!(span.trace_state, "client=e2e", "{span:#?}");
    }
    let bot_spans = in_trace(B3_TRACE);
    assert_eq!(names(&bot_spans), ["claim", "complete"], "{spans:#?}");
    for span in &bot_spans {
        assert_eq!(hex(&span.parent_span_id), B3_SPAN, "{span:#?}");
    }
    assert!(receiver.refused().is_empty(), "{:?}", receiver.refused());

    // The access log: each line ends with what the filter left in the stream's filter state.
    let replayed = pay("e2e-trace-2");
    assert_eq!(
        replayed.header("idempotent-replayed"),
        Some("true"),
        "{replayed:?}"
    );
    let unguarded = http(
        gateway.addr(),
        "GET",
        "/payments",
        &[("x-request-id", "e2e-trace-3")],
        "",
    );
    assert!(unguarded.status < 500, "{unguarded:?}");
    let lines = gateway.gateway().shared().access_log();
    let line = |request_id: &str| -> String {
        lines
            .iter()
            .find(|l| l.contains(&format!("\"{request_id}\"")))
            .unwrap_or_else(|| panic!("no access log line for {request_id}: {lines:#?}"))
            .clone()
    };
    let first = line("e2e-trace-1");
    let fence = first
        .split_once(" rule=payments decision=granted fence=")
        .and_then(|(_, rest)| rest.split_once(' '))
        .map(|(fence, _)| fence.to_owned())
        .unwrap_or_else(|| panic!("{first}"));
    assert!(fence.parse::<u64>().is_ok(), "{first}");
    assert!(
        first.ends_with(&format!("traceparent={traceparent}\n")),
        "{first}"
    );
    assert!(
        line("e2e-trace-2").contains(" rule=payments decision=replayed fence=- wait_ms=- "),
        "{lines:#?}"
    );
    assert!(
        line("e2e-trace-3")
            .contains(" rule=- decision=- fence=- wait_ms=- would_block=- traceparent=-"),
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("POST /bots/trace-bot/start")
                && l.contains(" rule=start-bot decision=granted fence=")),
        "{lines:#?}"
    );
    gateway.shutdown();
}

/// A call of agent `w1` through `gateway`, labelled `seq` (also its request id), that takes
/// `work_ms` at the backend.
fn attach(gateway: SocketAddr, seq: &str, work_ms: u64) -> idemgate_e2e::client::Reply {
    let work = work_ms.to_string();
    http(
        gateway,
        "POST",
        "/agents/w1/tools",
        &[
            ("content-type", "application/json"),
            ("x-demo-seq", seq),
            ("x-demo-work-ms", &work),
            ("x-request-id", seq),
        ],
        r#"{"tool":"t"}"#,
    )
}

#[test]
fn a_queued_call_whose_wait_runs_out_is_logged_as_wait_expired_with_the_time_it_waited() {
    let stack = idemgate_e2e::stack::Stack::start();
    let demo = Demo::start();
    let mut plugin = idemgate_e2e::live::shipped_plugin();
    idemgate_e2e::live::rule(&mut plugin, "attach-tool")["queue"] =
        serde_json::json!({"max_wait": "400ms"});
    let gateway = idemgate_rig::gateway::Shipped::default()
        .plugin(plugin.to_string())
        .start(demo.addr, stack.addr)
        .expect("the shipped envoy.yaml runs (build target/idemgate.wasm: cargo xtask wasm)");
    let g = gateway.addr();
    let holder = std::thread::spawn(move || attach(g, "e2e-holder", 2_000));
    demo.wait_started("agent:w1", "e2e-holder");
    let waiter = attach(g, "e2e-waiter", 10);
    assert_eq!(
        (waiter.status, waiter.problem_type().as_str()),
        (503, "urn:idemgate:problem:wait-expired"),
        "{waiter:?}"
    );
    assert_eq!(holder.join().expect("the holder's client").status, 200);
    let lines = gateway.gateway().shared().access_log();
    let line = lines
        .iter()
        .find(|l| l.contains("\"e2e-waiter\""))
        .unwrap_or_else(|| panic!("no access log line for the waiter: {lines:#?}"));
    let waited: u64 = line
        .split_once(" rule=attach-tool decision=wait_expired fence=- wait_ms=")
        .and_then(|(_, rest)| rest.split_once(' '))
        .and_then(|(ms, _)| ms.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    // Its whole budget, and less than the holder took (it was still running).
    assert!((400..2_000).contains(&waited), "{line}");
    gateway.shutdown();
}
