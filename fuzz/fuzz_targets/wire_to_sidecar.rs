//! What the sidecar decodes from a filter: each request frame (`JSON\n<payload>`) through
//! `idemgate_wire::decode` and the field limits, as the sidecar's handlers do. Any bytes give
//! a value or an error, never a panic.

#![no_main]

use idemgate_wire::{AbortRequest, ClaimRequest, CompleteRequest, Limits, RenewRequest, decode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    if let Ok((req, payload)) = decode::<ClaimRequest>(data) {
        let _ = limits.claim(&req);
        let _ = payload.len();
    }
    if let Ok((req, payload)) = decode::<CompleteRequest>(data) {
        let _ = limits.complete(&req, payload);
    }
    if let Ok((req, _)) = decode::<AbortRequest>(data) {
        let _ = limits.abort(&req);
    }
    if let Ok((req, _)) = decode::<RenewRequest>(data) {
        let _ = limits.renew(&req);
    }
});
