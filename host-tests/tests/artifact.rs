//! The built filter is a real proxy-wasm ABI 0.2.1 module that Envoy can load.

use wasmtime::{Engine, ExternType, Module};

fn module(relative: &str) -> Module {
    let path = idemgate_host::artifact(relative).unwrap_or_else(|e| panic!("{e:#}"));
    Module::from_file(&Engine::default(), &path).unwrap_or_else(|e| panic!("{e:#}"))
}

#[test]
fn idemgate_wasm_exports_the_proxy_wasm_abi() {
    let module = module("idemgate.wasm");
    let exports: Vec<&str> = module.exports().map(|e| e.name()).collect();
    for required in [
        "proxy_abi_version_0_2_1",
        "_initialize",
        "proxy_on_memory_allocate",
        "proxy_on_request_headers",
        "proxy_on_context_create",
        "proxy_on_configure",
        "proxy_on_http_call_response",
        "memory",
        // A stream's life after its request headers: what the filter does there (complete,
        // abort or release a claim) is lost if one of these is missing.
        "proxy_on_response_headers",
        "proxy_on_response_body",
        "proxy_on_response_trailers",
        "proxy_on_request_body",
        "proxy_on_done",
        "proxy_on_delete",
        "proxy_on_tick",
        "proxy_on_queue_ready",
    ] {
        assert!(
            exports.contains(&required),
            "missing export {required}: {exports:?}"
        );
    }
    // Dropped by `cargo xtask wasm` because the filter does nothing there, and each one Envoy
    // finds exported it calls: `proxy_on_log` on every request.
    for dropped in [
        "proxy_on_log",
        "proxy_on_grpc_receive",
        "proxy_on_downstream_data",
    ] {
        assert!(
            !exports.contains(&dropped),
            "{dropped} is exported: {exports:?}"
        );
    }
    for import in module.imports() {
        assert!(
            matches!(import.module(), "env" | "wasi_snapshot_preview1"),
            "import {}.{} is outside env and wasi_snapshot_preview1",
            import.module(),
            import.name()
        );
        assert!(
            matches!(import.ty(), ExternType::Func(_)),
            "import {}.{} is not a function",
            import.module(),
            import.name()
        );
    }
}

#[test]
fn idemgate_wasm_imports_only_what_envoy_provides() {
    let module = module("idemgate.wasm");
    for import in module.imports().filter(|i| i.module() == "env") {
        assert!(
            import.name().starts_with("proxy_"),
            "env.{} is not a proxy-wasm hostcall Envoy provides",
            import.name()
        );
    }
}
