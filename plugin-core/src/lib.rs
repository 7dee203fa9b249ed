//! idemgate's filter logic without proxy-wasm: configuration, key derivation and the
//! per-request decision state machine. The `idemgate-plugin` cdylib is thin glue over this.

#![no_std]
extern crate alloc;
