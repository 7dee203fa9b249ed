//! A proxy-wasm ABI 0.2.1 host on wasmtime that behaves as Envoy does (work in progress:
//! see the host-tests issue). For now it locates the built artifacts.

use std::path::PathBuf;

/// The workspace's `target/` directory, where `cargo xtask wasm` writes its artifacts.
pub fn target_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target")
}

/// Path of a built wasm artifact, or an error naming the command that builds it.
pub fn artifact(relative: &str) -> anyhow::Result<PathBuf> {
    let path = target_dir().join(relative);
    if path.is_file() {
        Ok(path)
    } else {
        anyhow::bail!(
            "{} is missing: build it with `cargo xtask wasm` (from the workspace root)",
            path.display()
        )
    }
}
