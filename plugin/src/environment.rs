//! The VM's environment variables (Envoy `vm_config.environment_variables`), read with WASI's
//! `environ_get` directly: `std::env::var` brings wasi-libc's environment machinery and costs
//! ~4.6 KiB of the filter's 256 KiB budget; this costs ~1.5 KiB.

/// The value of `name` in the VM's environment, if set and UTF-8.
#[cfg(target_os = "wasi")]
pub fn var(name: &str) -> Option<String> {
    #[link(wasm_import_module = "wasi_snapshot_preview1")]
    unsafe extern "C" {
        fn environ_sizes_get(count: *mut usize, size: *mut usize) -> u16;
        fn environ_get(entries: *mut u32, buffer: *mut u8) -> u16;
    }
    let (mut count, mut size) = (0usize, 0usize);
    // SAFETY: the host writes two integers to the two valid pointers.
    if unsafe { environ_sizes_get(&mut count, &mut size) } != 0 {
        return None;
    }
    // wasm32 pointers are 32-bit; the host writes the entries' starts here (unused: the
    // entries are read by splitting the buffer).
    let mut entries = vec![0u32; count];
    let mut buffer = vec![0u8; size];
    // SAFETY: `entries` holds `count` pointers and `buffer` `size` bytes, the sizes the host
    // just reported; it writes `NAME=value\0` entries into `buffer`.
    if unsafe { environ_get(entries.as_mut_ptr(), buffer.as_mut_ptr()) } != 0 {
        return None;
    }
    buffer.split(|b| *b == 0).find_map(|entry| {
        let value = entry.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
        core::str::from_utf8(value).ok().map(String::from)
    })
}

/// Native builds (clippy, unit tests of the workspace): the process environment.
#[cfg(not(target_os = "wasi"))]
pub fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}
