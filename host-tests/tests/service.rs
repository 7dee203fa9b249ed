//! Singleton Wasm services (`bootstrap_extensions` → `envoy.bootstrap.wasm`) as Envoy runs
//! them (envoy `source/extensions/bootstrap/wasm/config.cc`, `source/extensions/common/wasm/
//! wasm.cc` `PluginConfig`): one VM on the main thread, after a configuration canary, with
//! its own timers, sharing shared data and queues with the workers' VMs of its `vm_id`.

use crate::util::{eventually, http, upstream};
use idemgate_host::gateway::bootstrap::{Bootstrap, FilterSpec, LISTENER};
use idemgate_host::gateway::config::EnvoyConfig;
use idemgate_host::gateway::{Gateway, GatewayOptions};
use serde_json::json;

const VM: &str = "shared_vm";

fn config(singleton: bool) -> Result<EnvoyConfig, idemgate_host::gateway::config::ConfigError> {
    let (backend, _) = upstream(Some("backend"));
    let code = idemgate_host::target_dir().join("fixtures/service.wasm");
    let filter = FilterSpec::new("feeder", VM, &code).configuration("filter");
    let mut value = Bootstrap::new(backend).filter(filter).to_value();
    value["bootstrap_extensions"] = json!([{
        "name": "envoy.bootstrap.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.wasm.v3.WasmService",
            "singleton": singleton,
            "config": {
                "name": "ticker",
                "root_id": "ticker_root",
                "vm_config": {
                    "vm_id": VM,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": { "local": { "filename": code.to_string_lossy() } }
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": "service"
                }
            }
        }
    }]);
    EnvoyConfig::from_yaml(
        &serde_norway::to_string(&value).unwrap(),
        std::path::Path::new("."),
    )
}

#[test]
fn a_singleton_service_ticks_on_the_main_thread_and_shares_data_and_queues_with_workers() {
    let gateway = Gateway::start(
        config(true).unwrap(),
        GatewayOptions {
            concurrency: 2,
            ..GatewayOptions::default()
        },
    )
    .unwrap();
    let shared = gateway.shared().clone();
    // Its own timer, on the main thread.
    eventually("the service ticks", || {
        shared
            .get_shared_data(VM, b"ticks")
            .is_some_and(|(v, _)| String::from_utf8_lossy(&v).parse::<u64>().unwrap_or(0) >= 3)
    });
    // A worker's filter enqueues to the service's queue; the service's on_queue_ready runs.
    let address = gateway.listener_address(LISTENER).unwrap();
    let reply = http(address, "GET", "/first", &[], "");
    assert_eq!(reply.status, 200);
    assert!(
        reply.body.starts_with("queued=true ticks="),
        "{}",
        reply.body
    );
    eventually("the service dequeued the event", || {
        shared.get_shared_data(VM, b"last_event").map(|(v, _)| v) == Some(b"/first".to_vec())
    });
    // The workers read what the service wrote (same vm_id).
    let reply = http(address, "GET", "/second", &[], "");
    assert!(
        reply.body.ends_with("last_event=/first\n"),
        "{}",
        reply.body
    );
    // on_configure ran on the canary and on the one main-thread VM (not per worker).
    let configured: Vec<usize> = shared
        .logs()
        .iter()
        .filter(|l| l.message == "service configured")
        .map(|l| l.worker)
        .collect();
    assert_eq!(
        configured,
        [idemgate_host::CANARY_WORKER, idemgate_host::MAIN_THREAD]
    );
    let ticking = shared
        .logs()
        .into_iter()
        .find(|l| l.message == "service ticking")
        .unwrap();
    assert_eq!(ticking.worker, idemgate_host::MAIN_THREAD);
    assert_eq!(
        ticking.envoy_line(),
        "wasm log ticker_root shared_vm: service ticking"
    );
    gateway.shutdown();
}

#[test]
fn a_non_singleton_service_and_other_bootstrap_extensions_are_refused_by_name() {
    let error = config(false).unwrap_err().to_string();
    assert!(
        error.contains("bootstrap_extensions[0].typed_config.singleton"),
        "{error}"
    );
    let (backend, _) = upstream(Some("backend"));
    let mut value = Bootstrap::new(backend).to_value();
    value["bootstrap_extensions"] = json!([{
        "name": "envoy.bootstrap.internal_listener",
        "typed_config": { "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener" }
    }]);
    let error = EnvoyConfig::from_yaml(
        &serde_norway::to_string(&value).unwrap(),
        std::path::Path::new("."),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("bootstrap_extensions[0]") && error.contains("envoy.bootstrap.wasm"),
        "{error}"
    );
}
