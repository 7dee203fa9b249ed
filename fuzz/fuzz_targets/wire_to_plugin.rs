//! What the filter decodes from the sidecar: claim and owner answers through
//! `idemgate_wire::decode_answer` (and the typed `decode` it must agree with) and the
//! stored-response limits, and the release-answer handler.
//! Any bytes give a value or an error, never a panic.

#![no_main]

use idemgate_core::testing::Recorder;
use idemgate_core::{Answer, on_release_answer};
use idemgate_wire::{ClaimOutcome, Limits, OwnerOutcome, decode, decode_answer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let claim = decode_answer::<ClaimOutcome>(data).ok();
    if let Some((ClaimOutcome::Completed { response, .. }, payload)) = &claim {
        let _ = Limits::default().stored_response(response, payload);
    }
    // The filter's decoding accepts and reads exactly what the typed decoding does.
    assert_eq!(claim, decode::<ClaimOutcome>(data).ok());
    assert_eq!(
        decode_answer::<OwnerOutcome>(data).ok(),
        decode::<OwnerOutcome>(data).ok()
    );
    let _ = on_release_answer(
        Answer::Http {
            status: 200,
            body: data,
        },
        &mut Recorder::default(),
    );
});
