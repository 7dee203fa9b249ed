//! Guest memory as proxy-wasm-cpp-host reads and writes it: bounds-checked copies in and out,
//! and `copyToPointerSize` for values returned to the module through its allocator.

use crate::abi::Status;
use crate::hostcalls::{Ctx, HostResult};

/// Unwraps a `Result<T, Status>`, returning the status to the module on error.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(status) => return Ok(status),
        }
    };
}

pub(crate) fn span(ptr: i32, len: i32) -> (usize, usize) {
    (ptr as u32 as usize, len as u32 as usize)
}

/// The bytes at `ptr`/`len` where they lie in guest memory `guest` (bounds-checked).
pub(crate) fn slice(guest: &[u8], ptr: i32, len: i32) -> Result<&[u8], Status> {
    let (p, l) = span(ptr, len);
    p.checked_add(l)
        .and_then(|end| guest.get(p..end))
        .ok_or(Status::InvalidMemoryAccess)
}

pub(crate) fn read(c: &Ctx<'_>, ptr: i32, len: i32) -> Result<Vec<u8>, Status> {
    let memory = c
        .data()
        .wasm
        .as_ref()
        .ok_or(Status::InvalidMemoryAccess)?
        .memory;
    slice(memory.data(c), ptr, len).map(<[u8]>::to_vec)
}

pub(crate) fn write(c: &mut Ctx<'_>, ptr: i32, bytes: &[u8]) -> Result<(), Status> {
    let memory = c
        .data()
        .wasm
        .as_ref()
        .ok_or(Status::InvalidMemoryAccess)?
        .memory;
    let p = ptr as u32 as usize;
    memory
        .data_mut(c)
        .get_mut(
            p..p.checked_add(bytes.len())
                .ok_or(Status::InvalidMemoryAccess)?,
        )
        .ok_or(Status::InvalidMemoryAccess)?
        .copy_from_slice(bytes);
    Ok(())
}

pub(crate) fn check_writable(c: &Ctx<'_>, ptr: i32, len: usize) -> Result<(), Status> {
    let memory = c
        .data()
        .wasm
        .as_ref()
        .ok_or(Status::InvalidMemoryAccess)?
        .memory;
    let end = (ptr as u32 as usize)
        .checked_add(len)
        .ok_or(Status::InvalidMemoryAccess)?;
    if end > memory.data_size(c) {
        return Err(Status::InvalidMemoryAccess);
    }
    Ok(())
}

/// HOST `copyToPointerSize`: empty → ptr 0/len 0 without allocating; otherwise the module's
/// allocator is called with exactly the length (a trap there propagates as a trap).
pub(crate) fn return_bytes(c: &mut Ctx<'_>, data: &[u8], ptr_out: i32, len_out: i32) -> HostResult {
    tri!(check_writable(c, ptr_out, 4));
    tri!(check_writable(c, len_out, 4));
    let ptr = if data.is_empty() {
        0
    } else {
        let Some(alloc) = c.data().wasm.as_ref().map(|w| w.alloc.clone()) else {
            return Ok(Status::InvalidMemoryAccess);
        };
        let ptr = alloc.call(&mut *c, data.len() as i32)?;
        tri!(write(c, ptr, data));
        ptr
    };
    tri!(write(c, ptr_out, &ptr.to_le_bytes()));
    tri!(write(c, len_out, &(data.len() as u32).to_le_bytes()));
    Ok(Status::Ok)
}

pub(crate) fn read_str(c: &Ctx<'_>, ptr: i32, len: i32) -> Result<String, Status> {
    Ok(String::from_utf8_lossy(&read(c, ptr, len)?).into_owned())
}
