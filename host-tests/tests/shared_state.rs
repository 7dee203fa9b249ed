//! Shared data (CAS) across workers, shared queues, timers and metrics.

use idemgate_host::testing::{Request, TestHost, TestVm};
use idemgate_host::{HeaderMap, MetricKind, Status};
use std::time::Duration;

fn shared(host: &TestHost, workers: usize, config: &str) -> Vec<TestVm> {
    host.fixture("shared")
        .vm_id("shared_vm")
        .config(config)
        .boot_workers(workers)
        .unwrap()
}

#[test]
fn cas_increments_from_4_threaded_workers_lose_nothing() {
    let host = TestHost::new().cluster("sidecar");
    let workers = shared(&host, 4, "");
    // Seeded: with a missing key, cas is None and concurrent first writes both win (Envoy).
    assert_eq!(
        host.set_shared_data("shared_vm", "counter", b"0", 0),
        Status::Ok
    );
    let threads: Vec<_> = workers
        .into_iter()
        .map(|vm| {
            std::thread::spawn(move || {
                for _ in 0..25 {
                    vm.stream()
                        .send_request(Request::get("/").header("x-op", "incr:counter:4"));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (value, cas) = host.shared_data("shared_vm", "counter").unwrap();
    assert_eq!(String::from_utf8(value).unwrap(), "400");
    assert_eq!(
        cas, 401,
        "the seed and each of the 400 successful writes took a fresh cas"
    );
}

#[test]
fn a_cas_held_across_a_callout_loses_to_the_first_writer() {
    let host = TestHost::new().cluster("sidecar");
    let workers = shared(&host, 2, "");
    host.set_shared_data("shared_vm", "order-1", b"free", 0);
    let first = workers[0].stream();
    let second = workers[1].stream();
    first.send_request(Request::post("/").header("x-op", "claim:order-1"));
    second.send_request(Request::post("/").header("x-op", "claim:order-1"));
    workers[1].respond_callout(4, 200, HeaderMap::new(), "");
    workers[0].respond_callout(4, 200, HeaderMap::new(), "");
    assert_eq!(second.response_status(), Some(200));
    assert_eq!(first.response_status(), Some(409));
    assert_eq!(
        host.shared_data("shared_vm", "order-1").unwrap().0,
        b"ctx-2"
    );
}

#[test]
fn shared_data_is_scoped_by_vm_id() {
    let host = TestHost::new();
    shared(&host, 1, "")[0]
        .stream()
        .send_request(Request::get("/").header("x-op", "incr:k:1"));
    assert!(host.shared_data("shared_vm", "k").is_some());
    assert!(host.shared_data("other_vm", "k").is_none());
}

#[test]
fn enqueue_notifies_the_last_registrant_after_the_call() {
    let host = TestHost::new();
    let workers = shared(&host, 2, "");
    workers[0]
        .stream()
        .send_request(Request::get("/").header("x-op", "enqueue:job-1"));
    let dequeued: Vec<_> = host
        .logs()
        .into_iter()
        .filter(|r| r.message.starts_with("dequeued"))
        .map(|r| (r.worker, r.message))
        .collect();
    assert_eq!(
        dequeued,
        vec![(1, "dequeued job-1 root=1".to_owned())],
        "worker 1 registered last"
    );
    workers[0]
        .stream()
        .send_request(Request::get("/").header("x-op", "dequeue-empty"));
    assert_eq!(
        host.logs_containing("dequeue ->"),
        vec!["dequeue -> Ok(None)"]
    );
}

#[test]
fn ticks_fire_one_period_after_arming_and_then_every_period() {
    let host = TestHost::new();
    let _vm = shared(&host, 1, "tick_ms=100");
    host.advance(Duration::from_millis(99));
    assert!(host.logs_containing("tick n=").is_empty());
    host.advance(Duration::from_millis(1));
    host.advance(Duration::from_millis(250));
    let ticks = host.logs_containing("tick n=");
    assert_eq!(ticks.len(), 3, "{ticks:?}");
    let times: Vec<u128> = ticks
        .iter()
        .map(|t| t.rsplit('=').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(times[1] - times[0], 100);
    assert_eq!(times[2] - times[1], 100);
}

#[test]
fn ticks_run_per_worker() {
    let host = TestHost::new();
    let _vms = shared(&host, 3, "tick_ms=10");
    host.advance(Duration::from_millis(10));
    assert_eq!(host.logs_containing("tick n=1").len(), 3);
}

#[test]
fn metrics_follow_envoy_semantics_and_aggregate_across_workers() {
    let host = TestHost::new();
    let workers = shared(&host, 2, "");
    assert_eq!(
        host.logs_containing("metric ids"),
        vec!["metric ids counter=4 gauge=5 histogram=6"; 2]
    );
    for vm in &workers {
        let stream = vm.stream();
        stream.send_request(Request::get("/"));
        stream.respond(200, HeaderMap::new(), "");
    }
    let requests = host.metric("shared_requests").unwrap();
    assert_eq!((requests.kind, requests.value), (MetricKind::Counter, 2));
    assert_eq!(host.metric("shared_inflight").unwrap().value, 0);
    let sizes = host.metric("shared_sizes").unwrap().histogram;
    assert_eq!(
        (sizes.count(), sizes.sum(), sizes.quantile(0.5)),
        (2, 84, Some(42))
    );
    assert_eq!(
        host.logs_containing("counter+0")[0],
        "counter+0 -> Err(BadArgument), histogram get -> Err(BadArgument)"
    );
}
