//! The proxy-wasm glue of the idemgate filter: it moves bytes between Envoy and
//! `idemgate-core`, where every decision is made.
//!
//! | module | owns |
//! |---|---|
//! | `root` | the root context: configuration, the tick, every sidecar callout and its answer |
//! | `stream` | the HTTP context: feeds stream events to the request's `Flow` |
//! | `environment` | the VM's environment variables (`sidecar.token_env`) |
//! | `host` | the ports of `idemgate-core` over `proxy_wasm::hostcalls` (never the panicking helpers) |
//! | `vm` | the per-VM state shared by the root and its streams |

mod environment;
mod host;
mod root;
mod stream;
mod vm;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(root::Root::new()));
}}
