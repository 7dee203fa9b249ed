//! The WASI subset Envoy provides, under both `wasi_snapshot_preview1` and `wasi_unstable`:
//! stdout/stderr to the log, clocks, random, environment from the VM config, `proc_exit` that
//! returns, and stubs with Envoy's errnos for everything file-system related.

use crate::abi::LogLevel;
use crate::hostcalls::Ctx;
use crate::vm::VmState;
use crate::vm::memory::{read, write};
use wasmtime::Linker;

const SUCCESS: i32 = 0;
const BADF: i32 = 8;
const FAULT: i32 = 21;
const INVAL: i32 = 28;
const NOENT: i32 = 44;
const NOSYS: i32 = 52;
const NOTSUP: i32 = 58;
/// `random_get` refuses more than this per call (BoringSSL's limit in Envoy).
const RANDOM_MAX: usize = 64 * 1024;

fn errno(r: Result<(), crate::abi::Status>) -> i32 {
    r.map_or(FAULT, |()| SUCCESS)
}

fn u32_at(c: &Ctx<'_>, ptr: i32) -> Option<u32> {
    let bytes: [u8; 4] = read(c, ptr, 4).ok()?.try_into().ok()?;
    Some(u32::from_le_bytes(bytes))
}

/// fd 1 → info, fd 2 → error; one log line per call, one trailing newline removed.
fn fd_write(c: &mut Ctx<'_>, fd: i32, iovs: i32, count: i32, written_out: i32) -> i32 {
    let level = match fd {
        1 => LogLevel::Info,
        2 => LogLevel::Error,
        _ => return BADF,
    };
    let mut text = Vec::new();
    for i in 0..count.max(0) {
        let at = iovs.wrapping_add(i.wrapping_mul(8));
        let (Some(ptr), Some(len)) = (u32_at(c, at), u32_at(c, at.wrapping_add(4))) else {
            return FAULT;
        };
        match read(c, ptr as i32, len as i32) {
            Ok(bytes) => text.extend_from_slice(&bytes),
            Err(_) => return FAULT,
        }
    }
    let written = text.len() as u32;
    if text.last() == Some(&b'\n') {
        text.pop();
    }
    c.data()
        .plugin_log(level, String::from_utf8_lossy(&text).into_owned());
    errno(write(c, written_out, &written.to_le_bytes()))
}

fn environment(c: &Ctx<'_>) -> Vec<Vec<u8>> {
    c.data()
        .plugin
        .environment
        .iter()
        .map(|(k, v)| format!("{k}={v}\0").into_bytes())
        .collect()
}

fn environ_sizes_get(c: &mut Ctx<'_>, count_out: i32, size_out: i32) -> i32 {
    let env = environment(c);
    let size: usize = env.iter().map(Vec::len).sum();
    if let Err(e) = write(c, count_out, &(env.len() as u32).to_le_bytes()) {
        return errno(Err(e));
    }
    errno(write(c, size_out, &(size as u32).to_le_bytes()))
}

fn environ_get(c: &mut Ctx<'_>, pointers: i32, buffer: i32) -> i32 {
    let mut at = buffer;
    for (i, entry) in environment(c).iter().enumerate() {
        let slot = pointers.wrapping_add((i * 4) as i32);
        if write(c, slot, &at.to_le_bytes()).is_err() || write(c, at, entry).is_err() {
            return FAULT;
        }
        at = at.wrapping_add(entry.len() as i32);
    }
    SUCCESS
}

fn clock_time_get(c: &mut Ctx<'_>, id: i32, out: i32) -> i32 {
    let clock = &c.data().shared.clock;
    let now = match id {
        0 => clock.realtime_ns(),
        1 => clock.monotonic_ns(),
        _ => return NOTSUP,
    };
    errno(write(c, out, &now.to_le_bytes()))
}

fn random_get(c: &mut Ctx<'_>, buf: i32, len: i32) -> i32 {
    let len = len as u32 as usize;
    if len > RANDOM_MAX {
        return INVAL;
    }
    let mut bytes = vec![0u8; len];
    if getrandom::fill(&mut bytes).is_err() {
        return INVAL;
    }
    errno(write(c, buf, &bytes))
}

fn fd_fdstat_get(c: &mut Ctx<'_>, fd: i32, out: i32) -> i32 {
    if fd != 1 && fd != 2 {
        return BADF;
    }
    // filetype u8 (2 = character device), flags u16, rights_base = FD_WRITE (1 << 6), inheriting 0.
    let mut stat = [0u8; 24];
    if let Some(filetype) = stat.first_mut() {
        *filetype = 2;
    }
    if let Some(rights) = stat.get_mut(8..16) {
        rights.copy_from_slice(&(1u64 << 6).to_le_bytes());
    }
    errno(write(c, out, &stat))
}

fn add_module(l: &mut Linker<VmState>, module: &str) -> wasmtime::Result<()> {
    l.func_wrap(
        module,
        "fd_write",
        |mut c: Ctx<'_>, fd: i32, iovs: i32, n: i32, out: i32| {
            Ok(fd_write(&mut c, fd, iovs, n, out))
        },
    )?;
    l.func_wrap(
        module,
        "fd_read",
        |_: Ctx<'_>, _: i32, _: i32, _: i32, _: i32| Ok(NOSYS),
    )?;
    l.func_wrap(
        module,
        "fd_seek",
        |c: Ctx<'_>, _: i32, _: i64, _: i32, _: i32| {
            c.data()
                .log(LogLevel::Error, "wasi fd_seek is not supported".into());
            Ok(SUCCESS)
        },
    )?;
    l.func_wrap(module, "fd_close", |c: Ctx<'_>, _: i32| {
        c.data()
            .log(LogLevel::Error, "wasi fd_close is not supported".into());
        Ok(SUCCESS)
    })?;
    l.func_wrap(
        module,
        "fd_fdstat_get",
        |mut c: Ctx<'_>, fd: i32, out: i32| Ok(fd_fdstat_get(&mut c, fd, out)),
    )?;
    l.func_wrap(module, "fd_prestat_get", |_: Ctx<'_>, _: i32, _: i32| {
        Ok(BADF)
    })?;
    l.func_wrap(
        module,
        "fd_prestat_dir_name",
        |_: Ctx<'_>, _: i32, _: i32, _: i32| Ok(NOTSUP),
    )?;
    l.func_wrap(
        module,
        "path_open",
        |_: Ctx<'_>, _: i32, _: i32, _: i32, _: i32, _: i32, _: i64, _: i64, _: i32, _: i32| {
            Ok(NOENT)
        },
    )?;
    l.func_wrap(
        module,
        "clock_time_get",
        |mut c: Ctx<'_>, id: i32, _precision: i64, out: i32| Ok(clock_time_get(&mut c, id, out)),
    )?;
    l.func_wrap(
        module,
        "clock_res_get",
        |mut c: Ctx<'_>, _: i32, out: i32| Ok(errno(write(&mut c, out, &1u64.to_le_bytes()))),
    )?;
    l.func_wrap(
        module,
        "random_get",
        |mut c: Ctx<'_>, buf: i32, len: i32| Ok(random_get(&mut c, buf, len)),
    )?;
    l.func_wrap(
        module,
        "environ_sizes_get",
        |mut c: Ctx<'_>, n: i32, s: i32| Ok(environ_sizes_get(&mut c, n, s)),
    )?;
    l.func_wrap(module, "environ_get", |mut c: Ctx<'_>, p: i32, b: i32| {
        Ok(environ_get(&mut c, p, b))
    })?;
    l.func_wrap(
        module,
        "args_sizes_get",
        |mut c: Ctx<'_>, n: i32, s: i32| {
            let zero = 0u32.to_le_bytes();
            Ok(errno(
                write(&mut c, n, &zero).and_then(|()| write(&mut c, s, &zero)),
            ))
        },
    )?;
    l.func_wrap(module, "args_get", |_: Ctx<'_>, _: i32, _: i32| Ok(SUCCESS))?;
    l.func_wrap(module, "proc_exit", |c: Ctx<'_>, code: i32| {
        // Envoy logs and returns; the module then traps on its own `unreachable`.
        c.data()
            .log(LogLevel::Error, format!("wasi_unstable proc_exit({code})"));
    })?;
    l.func_wrap(module, "sched_yield", |_: Ctx<'_>| Ok(SUCCESS))?;
    l.func_wrap(
        module,
        "poll_oneoff",
        |mut c: Ctx<'_>, _: i32, _: i32, _: i32, out: i32| {
            Ok(errno(write(&mut c, out, &0u32.to_le_bytes())))
        },
    )?;
    Ok(())
}

/// Links the WASI subset under both module names Envoy serves.
pub(crate) fn add_to_linker(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    add_module(l, "wasi_snapshot_preview1")?;
    add_module(l, "wasi_unstable")
}
