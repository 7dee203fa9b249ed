//! Loading, start sequence, context ids, teardown order, and trap handling.

use crate::util::{lines, probe, probe_with};
use idemgate_host::testing::{Request, TestHost};
use idemgate_host::{FailurePolicy, HeaderMap, LoadError};

#[test]
fn noop_loads_for_wasip1_and_wasm32_unknown_unknown() {
    for fixture in ["noop", "noop-unknown"] {
        let host = TestHost::new();
        let vm = host
            .fixture(fixture)
            .boot()
            .unwrap_or_else(|e| panic!("{fixture}: {e}"));
        let stream = vm.stream();
        stream.send_request(Request::get("/"));
        stream.respond(200, HeaderMap::new(), "ok");
        assert_eq!(stream.response_status(), Some(200), "{fixture}");
        assert!(stream.is_finished(), "{fixture}");
        assert_eq!(vm.root_context_id(), Some(1));
    }
}

#[test]
fn root_starts_with_id_1_then_vm_start_then_configure() {
    let (host, vm) = probe_with(|b| b.config("hello").vm_config("vmconf"));
    assert_eq!(vm.root_context_id(), Some(1));
    assert_eq!(
        lines(&host, "on_"),
        vec![
            "on_vm_start root=1 vm_config_size=6",
            "on_configure root=1 config=hello"
        ]
    );
}

#[test]
fn configure_returning_false_or_trapping_rejects_the_plugin() {
    for config in ["reject", "panic"] {
        let host = TestHost::new();
        let err = host.fixture("probe").config(config).boot().err();
        assert!(
            matches!(err, Some(LoadError::Start { .. })),
            "{config}: {err:?}"
        );
    }
}

#[test]
fn missing_artifact_names_the_build_command() {
    let err = TestHost::new()
        .plugin("/nonexistent/x.wasm")
        .boot()
        .err()
        .unwrap();
    assert!(err.to_string().contains("/nonexistent/x.wasm"), "{err}");
    assert!(err.to_string().contains("cargo xtask wasm"), "{err}");
}

#[test]
fn streams_get_context_ids_after_the_root_and_lazily_created() {
    let (host, vm) = probe();
    let first = vm.stream();
    let second = vm.stream();
    assert_eq!((first.context_id(), second.context_id()), (2, 3));
    assert!(
        lines(&host, "on_request_headers").is_empty(),
        "created lazily"
    );
    second.send_request(Request::get("/b"));
    assert_eq!(
        lines(&host, "on_request_headers"),
        vec!["on_request_headers ctx=3 n=6 eos=true"]
    );
}

#[test]
fn teardown_runs_on_log_then_on_done_then_on_delete() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/x"));
    stream.respond(204, HeaderMap::new(), "");
    let order: Vec<String> = host
        .logs_containing("ctx=2")
        .into_iter()
        .filter(|l| {
            l.starts_with("on_log") || l.starts_with("on_done") || l.starts_with("on_delete")
        })
        .collect();
    assert_eq!(
        order,
        vec![
            "on_log ctx=2 path=/x status=204",
            "on_done ctx=2",
            "on_delete ctx=2"
        ]
    );
}

#[test]
fn client_abort_while_paused_still_runs_teardown() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/x").header("x-probe", "pause"));
    assert!(stream.upstream_headers().is_none());
    stream.abort();
    assert!(stream.is_finished());
    assert_eq!(lines(&host, "on_log"), vec!["on_log ctx=2 path=/x status="]);
    assert_eq!(lines(&host, "on_delete").len(), 1);
}

#[test]
fn a_trap_fails_the_vm_and_later_streams_get_503_fail_closed() {
    let (host, vm) = probe();
    let stream = vm.stream();
    stream.send_request(Request::get("/").header("x-probe", "panic"));
    assert!(vm.is_failed());
    assert_eq!(stream.response_status(), Some(503));
    assert_eq!(stream.local_reply().unwrap().details, "wasm_fail_stream");
    assert!(stream.upstream_headers().is_none());
    assert!(
        !host
            .logs_containing("probe: request headers panic")
            .is_empty(),
        "panic hook logged"
    );

    let later = vm.stream();
    later.send_request(Request::get("/"));
    assert_eq!(later.response_status(), Some(503));
    assert!(
        later.callbacks().is_empty(),
        "no callback reaches a failed VM"
    );
}

#[test]
fn fail_open_bypasses_the_filter_on_a_failed_vm() {
    let (_host, vm) = probe_with(|b| b.failure_policy(FailurePolicy::FailOpen));
    let first = vm.stream();
    first.send_request(Request::get("/").header("x-probe", "panic"));
    assert!(vm.is_failed());
    assert!(
        first.upstream_headers().is_some(),
        "the failing stream continues"
    );
    let later = vm.stream();
    later.send_request(Request::get("/later"));
    later.respond(200, HeaderMap::new(), "fine");
    assert_eq!(later.response_status(), Some(200));
    assert_eq!(later.context_id(), 0, "filter not in the chain");
}

#[test]
fn fail_reload_recreates_the_vm_for_the_next_stream() {
    let (host, vm) = probe_with(|b| b.failure_policy(FailurePolicy::FailReload));
    vm.stream()
        .send_request(Request::get("/").header("x-probe", "panic"));
    assert!(vm.is_failed());
    let later = vm.stream();
    assert!(!vm.is_failed());
    later.send_request(Request::get("/after"));
    later.respond(200, HeaderMap::new(), "");
    assert_eq!(later.response_status(), Some(200));
    assert_eq!(later.context_id(), 2, "a fresh VM starts its ids again");
    assert_eq!(lines(&host, "on_configure").len(), 2);
}

#[test]
fn other_workers_are_unaffected_by_a_trap() {
    let host = TestHost::new();
    let workers = host.fixture("probe").boot_workers(2).unwrap();
    workers[0]
        .stream()
        .send_request(Request::get("/").header("x-probe", "panic"));
    assert!(workers[0].is_failed());
    assert!(!workers[1].is_failed());
    let ok = workers[1].stream();
    ok.send_request(Request::get("/"));
    assert!(ok.upstream_headers().is_some());
}

#[test]
fn only_logging_and_wasi_are_allowed_while_the_vm_starts() {
    let host = TestHost::new();
    let err = host.fixture("restricted").boot().err().unwrap();
    assert!(err.to_string().contains("restricted_callback"), "{err}");
    assert_eq!(
        host.logs_containing("starting"),
        vec!["starting"],
        "logging was allowed"
    );
}

#[test]
fn fail_reload_waits_for_its_backoff_between_reloads() {
    let (host, vm) = probe_with(|b| b.failure_policy(FailurePolicy::FailReload));
    vm.stream()
        .send_request(Request::get("/").header("x-probe", "panic"));
    vm.stream()
        .send_request(Request::get("/").header("x-probe", "panic"));
    assert!(vm.is_failed(), "reloaded once, failed again");
    let within_backoff = vm.stream();
    within_backoff.send_request(Request::get("/"));
    assert_eq!(
        within_backoff.response_status(),
        Some(503),
        "fail closed until the backoff ends"
    );
    host.advance(std::time::Duration::from_secs(1));
    let after = vm.stream();
    after.send_request(Request::get("/"));
    assert!(after.upstream_headers().is_some());
    assert_eq!(lines(&host, "on_configure").len(), 3);
}
