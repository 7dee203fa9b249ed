//! What the filter decodes from the sidecar: claim and owner answers through
//! `idemgate_wire::decode` and the stored-response limits, and the release-answer handler.
//! Any bytes give a value or an error, never a panic.

#![no_main]

use idemgate_core::testing::Recorder;
use idemgate_core::{Answer, on_release_answer};
use idemgate_wire::{ClaimOutcome, Limits, OwnerOutcome, decode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((ClaimOutcome::Completed { response, .. }, payload)) = decode::<ClaimOutcome>(data) {
        let _ = Limits::default().stored_response(&response, payload);
    }
    let _ = decode::<OwnerOutcome>(data);
    let _ = on_release_answer(
        Answer::Http {
            status: 200,
            body: data,
        },
        &mut Recorder::default(),
    );
});
