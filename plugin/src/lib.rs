//! The proxy-wasm glue of the idemgate filter: it moves bytes between Envoy and
//! `idemgate-core`, where every decision is made.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(IdemgateRoot));
}}

struct IdemgateRoot;

impl Context for IdemgateRoot {}

impl RootContext for IdemgateRoot {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        log::info!("idemgate {} starting", env!("CARGO_PKG_VERSION"));
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(IdemgateStream))
    }
}

struct IdemgateStream;

impl Context for IdemgateStream {}

impl HttpContext for IdemgateStream {}
