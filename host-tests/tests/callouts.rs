//! HTTP callouts: validation, tokens, delivery to the root, failures, deferral, and real
//! HTTP forwarding.

use crate::util::{lines, probe};
use idemgate_host::testing::{Request, TestHost};
use idemgate_host::{CalloutOutcome, HeaderMap};
use std::io::{Read, Write};
use std::time::Duration;

fn callout(
    mode: &str,
) -> (
    TestHost,
    idemgate_host::testing::TestVm,
    idemgate_host::testing::TestStream,
) {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", mode));
    (host, vm, stream)
}

#[test]
fn callouts_are_validated_as_envoy_does() {
    for mode in [
        "callout-unknown-cluster",
        "callout-no-authority",
        "callout-negative-timeout",
    ] {
        let (host, vm, stream) = callout(mode);
        assert_eq!(
            lines(&host, "dispatch failed"),
            vec!["dispatch failed: BadArgument"],
            "{mode}"
        );
        assert!(vm.pending_callouts().is_empty());
        assert!(
            stream.upstream_headers().is_some(),
            "{mode}: plugin continued"
        );
    }
}

#[test]
fn tokens_count_4_8_12_and_requests_carry_what_the_plugin_sent() {
    let (_host, vm) = probe();
    for _ in 0..3 {
        vm.stream()
            .send_request(Request::get("/").header("x-probe", "callout"));
    }
    let calls = vm.pending_callouts();
    assert_eq!(
        calls.iter().map(|c| c.token).collect::<Vec<_>>(),
        vec![4, 8, 12]
    );
    let call = &calls[0];
    assert_eq!(call.cluster, "sidecar");
    assert_eq!(call.headers.get(":path").as_deref(), Some("/lock"));
    assert_eq!(call.headers.get("content-length").as_deref(), Some("5"));
    assert_eq!(call.body, b"claim");
    assert_eq!(call.timeout, Some(Duration::from_millis(1000)));
}

#[test]
fn a_200_resumes_the_paused_request_with_the_callout_result() {
    let (host, vm, stream) = callout("callout");
    assert!(stream.upstream_headers().is_none());
    let token = vm.pending_callouts()[0].token;
    assert!(vm.respond_callout(token, 200, HeaderMap::new(), "lock-7"));
    assert_eq!(
        lines(&host, "callout response"),
        vec!["callout response token=4 headers=1 body=6 trailers=0 ctx=2"]
    );
    let upstream = stream.upstream_headers().unwrap();
    assert_eq!(upstream.get("x-lock").as_deref(), Some("lock-7"));
    assert!(
        !vm.respond_callout(token, 200, HeaderMap::new(), ""),
        "answered once only"
    );
}

#[test]
fn a_timeout_arrives_as_a_504_response_when_virtual_time_passes() {
    let (host, vm, stream) = callout("callout");
    host.advance(Duration::from_millis(999));
    assert_eq!(vm.pending_callouts().len(), 1);
    host.advance(Duration::from_millis(1));
    assert!(vm.pending_callouts().is_empty());
    assert_eq!(stream.response_status(), Some(503));
    assert_eq!(
        stream
            .response_headers()
            .unwrap()
            .get("x-callout-status")
            .as_deref(),
        Some("504")
    );
    assert_eq!(stream.response_body_text(), "upstream request timeout");
}

#[test]
fn zero_timeout_never_expires() {
    let (host, vm, _stream) = callout("callout-no-timeout");
    host.advance(Duration::from_secs(3600));
    assert_eq!(vm.pending_callouts().len(), 1);
}

#[test]
fn a_reset_is_delivered_as_0_0_0_with_status_11_reset() {
    let (host, vm, stream) = callout("callout");
    vm.reset_callout(4);
    assert_eq!(
        lines(&host, "callout failed"),
        vec!["callout failed: status=11 message=reset"]
    );
    assert_eq!(stream.response_status(), Some(502));
}

#[test]
fn connect_failure_is_a_503_response() {
    let (_host, vm, stream) = callout("callout");
    vm.answer_callout(4, CalloutOutcome::connect_failure());
    assert_eq!(
        stream
            .response_headers()
            .unwrap()
            .get("x-callout-status")
            .as_deref(),
        Some("503")
    );
}

#[test]
fn callouts_outlive_the_stream_that_made_them() {
    let (host, vm, stream) = callout("callout");
    stream.abort();
    assert!(stream.is_finished());
    assert_eq!(vm.pending_callouts().len(), 1, "not cancelled");
    assert!(vm.respond_callout(4, 200, HeaderMap::new(), "late"));
    assert!(
        lines(&host, "callout response").is_empty(),
        "the SDK drops it: context gone"
    );
    assert!(!vm.is_failed());
}

/// A one-shot HTTP/1.1 server on a loopback port answering every request with `body`.
fn one_shot_server(body: &'static str) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        if let Ok((mut socket, _)) = listener.accept() {
            socket.set_read_timeout(Some(Duration::from_secs(10))).ok();
            let mut buf = [0u8; 4096];
            let mut seen = Vec::new();
            while !String::from_utf8_lossy(&seen).contains("claim") {
                match socket.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
            }
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nx-seen-path: {}\r\n\r\n{body}",
                body.len(),
                String::from_utf8_lossy(&seen).contains("POST /lock HTTP/1.1")
            );
            let _ = socket.write_all(reply.as_bytes());
        }
    });
    address
}

#[test]
fn callouts_can_be_forwarded_over_real_http() {
    let address = one_shot_server("real-lock");
    let host = TestHost::new().cluster_at("sidecar", address);
    let vm = host.fixture("probe").boot().unwrap();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "callout"));
    assert_eq!(vm.forward_all_callouts(), 1);
    assert_eq!(
        stream.upstream_headers().unwrap().get("x-lock").as_deref(),
        Some("real-lock")
    );
}

#[test]
fn forwarding_to_a_closed_port_is_a_503() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let host = TestHost::new().cluster_at("sidecar", port);
    let vm = host.fixture("probe").boot().unwrap();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "callout"));
    vm.forward_all_callouts();
    assert_eq!(
        stream
            .response_headers()
            .unwrap()
            .get("x-callout-status")
            .as_deref(),
        Some("503")
    );
}

/// A loopback HTTP/2 (prior knowledge) server answering `body` to every request.
fn h2_server(body: &'static str) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let address = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| async move {
                            let proto = format!("{:?}", req.version());
                            let response = http::Response::builder()
                                .header("x-proto", proto)
                                .body(http_body_util::Full::new(bytes::Bytes::from_static(
                                    body.as_bytes(),
                                )))
                                .unwrap();
                            Ok::<_, std::convert::Infallible>(response)
                        },
                    );
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
                });
            }
        });
    });
    address
}

#[test]
fn http2_clusters_get_prior_knowledge_http2_callouts() {
    let address = h2_server("h2-lock");
    let cluster = idemgate_host::Cluster {
        http2: true,
        ..idemgate_host::Cluster::at("sidecar", address)
    };
    let host = TestHost::new().with_cluster(cluster);
    let vm = host.fixture("probe").boot().unwrap();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "callout"));
    assert!(vm.forward_callout(4));
    assert_eq!(
        stream.upstream_headers().unwrap().get("x-lock").as_deref(),
        Some("h2-lock")
    );
}

#[test]
fn a_body_held_by_stop_all_reaches_the_plugin_after_resume() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request_headers(
        Request::post("/")
            .header("x-probe", "callout")
            .headers_for(1),
        false,
    );
    stream
        .send_request_body("part1-", false)
        .send_request_body("part2", true);
    assert!(
        lines(&host, "on_request_body").is_empty(),
        "held while stopped at headers"
    );
    vm.respond_callout(4, 200, HeaderMap::new(), "ok");
    assert_eq!(
        lines(&host, "on_request_body"),
        vec!["on_request_body ctx=2 size=11 eos=true"]
    );
    assert_eq!(stream.upstream_body(), b"part1-part2");
    assert!(stream.upstream_complete());
}

#[test]
fn a_full_circuit_breaker_fails_the_dispatch_inline() {
    let cluster = idemgate_host::Cluster {
        max_requests: 1,
        ..idemgate_host::Cluster::named("sidecar")
    };
    let host = TestHost::new().with_cluster(cluster);
    let vm = host.fixture("probe").boot().unwrap();
    vm.stream()
        .send_request(Request::get("/").header("x-probe", "callout"));
    vm.stream()
        .send_request(Request::get("/").header("x-probe", "callout"));
    assert_eq!(
        lines(&host, "dispatch failed"),
        vec!["dispatch failed: InternalFailure"]
    );
    assert_eq!(host.shared().cluster_requests("sidecar"), 1);
    vm.respond_callout(4, 200, HeaderMap::new(), "ok");
    assert_eq!(host.shared().cluster_requests("sidecar"), 0);
    vm.stream()
        .send_request(Request::get("/").header("x-probe", "callout"));
    assert_eq!(vm.pending_callouts().len(), 1);
}
