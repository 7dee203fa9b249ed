//! The plugin group's per-VM figures, each beside the no-op filter in the same run: module
//! compile time (wasmtime, cold: a fresh engine without the code cache the host uses), VM
//! start (instantiation and Envoy's start sequence), and the VM's linear memory across a
//! million requests, which must stay flat.

use crate::plugin_cost::{Driver, Kind, measured_requests};
use anyhow::{Context, Result, anyhow};
use idemgate_host::WasmModule;
use std::path::Path;
use std::time::{Duration, Instant};

/// Compile time of the module at `path` (ms), `runs` times. The engine's configuration is
/// the host's (wasmtime defaults: Cranelift, parallel compilation) minus its code cache.
pub fn compile_ms(path: &Path, runs: usize) -> Result<Vec<f64>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let engine = wasmtime::Engine::new(&wasmtime::Config::new()).map_err(wasmtime_error)?;
    let mut samples = Vec::with_capacity(runs);
    for _ in 0..runs {
        let started = Instant::now();
        let module = wasmtime::Module::new(&engine, &bytes).map_err(wasmtime_error)?;
        samples.push(started.elapsed().as_secs_f64() * 1e3);
        drop(module);
    }
    Ok(samples)
}

/// Mean VM start time (µs) over `boots` starts of a compiled module, `runs` times: what
/// Envoy pays per worker when a configuration (re)loads.
pub fn start_us(path: &Path, runs: usize, boots: u32) -> Result<Vec<f64>> {
    let module = WasmModule::load(path)?;
    // The first instantiation maps the compiled code: not a per-start cost.
    Driver::start(&module, Kind::NoRule)?;
    let mut samples = Vec::with_capacity(runs);
    for _ in 0..runs {
        let mut spent = Duration::ZERO;
        for _ in 0..boots {
            let started = Instant::now();
            let driver = Driver::start(&module, Kind::NoRule)?;
            spent += started.elapsed();
            drop(driver);
        }
        samples.push(spent.as_secs_f64() * 1e6 / f64::from(boots));
    }
    Ok(samples)
}

/// Linear memory (KiB) after each checkpoint's number of requests of `kind`, in one VM.
pub fn memory_kib(path: &Path, kind: Kind, checkpoints: &[u64]) -> Result<Vec<f64>> {
    let mut driver = Driver::boot(path, kind)?;
    let mut done = 0;
    let mut sizes = Vec::with_capacity(checkpoints.len());
    for &at in checkpoints {
        measured_requests(&mut driver, at.saturating_sub(done))?;
        done = done.max(at);
        sizes.push(driver.memory_bytes() as f64 / 1024.0);
    }
    Ok(sizes)
}

fn wasmtime_error(error: wasmtime::Error) -> anyhow::Error {
    anyhow!("wasmtime: {error:#}")
}
