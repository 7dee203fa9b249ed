//! HTTP stream semantics: return-code mapping, header availability, body buffering, local
//! replies through the encoder path, properties.

use crate::util::{lines, probe, probe_with};
use idemgate_host::testing::Request;
use idemgate_host::{HeaderMap, StreamEvent};

#[test]
fn header_mutations_are_visible_upstream_and_downstream() {
    let (_host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "add-header"));
    let upstream = stream.upstream_headers().unwrap();
    assert_eq!(upstream.get("x-probe-added").as_deref(), Some("1"));
    assert_eq!(upstream.get_joined("x-multi"), Some(b"a,b".to_vec()));
    stream.respond(200, HeaderMap::new(), "body");
    assert_eq!(
        stream
            .response_headers()
            .unwrap()
            .get("x-probe-response")
            .as_deref(),
        Some("1")
    );
    assert_eq!(stream.response_body_text(), "body");
}

#[test]
fn pause_in_headers_stops_all_and_the_body_waits_for_resume() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::post("/").header("x-probe", "pause").body("abc"));
    assert_eq!(stream.returned("proxy_on_request_headers"), Some(1));
    assert!(stream.upstream_headers().is_none());
    assert!(
        lines(&host, "on_request_body").is_empty(),
        "stop-all: no body callback"
    );
}

#[test]
fn allow_on_headers_stop_iteration_keeps_body_callbacks_firing() {
    let (host, vm) = probe_with(|b| b.allow_on_headers_stop_iteration(true));
    let stream = vm.stream();
    stream.send_request(Request::post("/").header("x-probe", "pause").body("abc"));
    assert_eq!(
        lines(&host, "on_request_body"),
        vec!["on_request_body ctx=2 size=3 eos=true"]
    );
    assert!(
        stream.upstream_headers().is_some(),
        "body Continue releases the held headers"
    );
    assert_eq!(stream.upstream_body(), b"abc");
}

#[test]
fn body_pause_buffers_and_later_calls_see_the_total() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request_headers(
        Request::post("/")
            .header("x-probe", "buffer-body")
            .headers_for(1),
        false,
    );
    stream
        .send_request_body("ab", false)
        .send_request_body("cd", true);
    assert_eq!(
        lines(&host, "on_request_body"),
        vec![
            "on_request_body ctx=2 size=2 eos=false",
            "on_request_body ctx=2 size=4 eos=true"
        ]
    );
    assert_eq!(stream.upstream_body(), b"ABCD");
    assert!(stream.upstream_complete());
}

#[test]
fn buffering_past_the_limit_answers_413() {
    let (_host, vm) = probe_with(|b| b.buffer_limit(8));
    let stream = vm.stream();
    stream.send_request_headers(
        Request::post("/")
            .header("x-probe", "pause-body")
            .headers_for(1),
        false,
    );
    stream
        .send_request_body("12345", false)
        .send_request_body("67890", false);
    assert_eq!(stream.response_status(), Some(413));
    assert!(stream.is_finished());
}

#[test]
fn local_reply_runs_the_same_streams_encoder_callbacks_after_the_call_returns() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "local-reply"));
    assert_eq!(stream.response_status(), Some(403));
    assert_eq!(stream.response_body_text(), "denied by probe");
    let headers = stream.response_headers().unwrap();
    assert_eq!(headers.get("x-probe").as_deref(), Some("denied"));
    assert_eq!(headers.get("content-length").as_deref(), Some("15"));
    assert_eq!(headers.get("content-type").as_deref(), Some("text/plain"));
    assert!(stream.upstream_headers().is_none());
    let order: Vec<String> = host
        .logs()
        .into_iter()
        .map(|r| r.message)
        .filter(|m| m.starts_with("on_"))
        .skip(2)
        .collect();
    assert_eq!(
        order,
        vec![
            "on_request_headers ctx=2 n=7 eos=true",
            "on_response_headers ctx=2 n=4 eos=false status=403",
            "on_response_body ctx=2 size=15 eos=true",
            "on_log ctx=2 path=/ status=403",
            "on_done ctx=2",
            "on_delete ctx=2",
        ]
    );
}

#[test]
fn local_reply_from_response_headers_replaces_the_upstream_response_directly() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "local-reply-in-response"));
    stream.respond(200, HeaderMap::new(), "upstream body");
    assert_eq!(stream.response_status(), Some(500));
    assert_eq!(stream.response_body_text(), "replaced");
    assert_eq!(
        lines(&host, "on_response_headers").len(),
        1,
        "no filter callbacks on the reply"
    );
    assert!(lines(&host, "on_response_body").is_empty());
}

#[test]
fn request_headers_are_gone_after_continue() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "read-request-in-response"));
    stream.respond(200, HeaderMap::new(), "");
    assert_eq!(
        lines(&host, "request headers in response"),
        vec!["request headers in response: 0"]
    );
    assert!(!vm.is_failed());
}

#[test]
fn reading_one_request_header_after_continue_traps_the_plugin() {
    let (_host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "panic-request-header-in-response"));
    stream.respond(200, HeaderMap::new(), "ok");
    assert!(vm.is_failed(), "BadArgument makes the SDK panic");
    assert_eq!(stream.response_status(), Some(503));
}

#[test]
fn close_stream_resets_after_the_call() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "close"));
    assert!(stream.was_reset());
    assert!(stream.is_finished());
    assert_eq!(lines(&host, "on_done").len(), 1);
}

#[test]
fn properties_are_served_as_envoy_serializes_them() {
    let (host, vm) = probe();
    vm.stream()
        .send_request(Request::get("/p?q=1").header("x-probe", "properties"));
    let props = lines(&host, "property ");
    for expected in [
        "property plugin_name=Some(\"probe\")",
        "property plugin_root_id=Some(\"probe_root\")",
        "property plugin_vm_id=Some(\"probe_vm\")",
        "property request.path=Some(\"/p?q=1\")",
        "property request.method=Some(\"GET\")",
        "property request.host=Some(\"example.com\")",
        "property request.headers.x-probe=Some(\"properties\")",
        "property nonexistent=None",
    ] {
        assert!(
            props.iter().any(|p| p == expected),
            "{expected} not in {props:#?}"
        );
    }
    assert!(
        props
            .iter()
            .any(|p| p.starts_with("property source.address=Some(\"127.0.0.1:"))
    );
    assert!(
        props
            .iter()
            .any(|p| p.starts_with("property source.port=Some("))
    );
    assert!(
        props.contains(&"property request.time=Some(1767225600000000000)".to_owned()),
        "virtual realtime starts at 2026-01-01: {props:#?}"
    );
}

#[test]
fn trailers_reach_the_plugin_and_upstream() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::post("/").body("x").trailer("grpc-status", "0"));
    assert_eq!(
        lines(&host, "on_request_trailers"),
        vec!["on_request_trailers ctx=2 n=1"]
    );
    assert!(
        stream
            .events()
            .iter()
            .any(|e| matches!(e, StreamEvent::UpstreamTrailers(_)))
    );
}

/// The gateway wakes after a VM call only the streams the call gave events: the VM names
/// exactly those, once (the gateway used to look up every stream in flight after every call).
#[test]
fn a_vm_call_names_only_the_streams_it_gave_events() {
    let (_host, vm) = probe();
    let (quiet, busy, also_quiet) = (vm.stream(), vm.stream(), vm.stream());
    quiet.send_request_headers(
        Request::get("/").header("x-probe", "pause").headers_for(1),
        true,
    );
    also_quiet.send_request_headers(
        Request::get("/").header("x-probe", "pause").headers_for(3),
        true,
    );
    assert_eq!(vm.with(|vm| vm.streams_with_events()), Vec::<u64>::new());
    busy.send_request(Request::get("/"));
    assert_eq!(vm.with(|vm| vm.streams_with_events()), vec![busy.id()]);
    // Named once: the next call names only what gets events after this one.
    assert_eq!(vm.with(|vm| vm.streams_with_events()), Vec::<u64>::new());
    assert!(busy.upstream_headers().is_some());
}
