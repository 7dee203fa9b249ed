//! The plugin configuration parser (`on_configure`): any bytes give a `Config` or a
//! `ConfigError` naming a field — never a panic (a trap in Envoy).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = idemgate_core::config::parse(data) {
        // The message is what the operator sees: it must render.
        let _ = e.to_string();
    }
});
