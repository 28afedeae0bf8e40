//! Memory peers on the host can map, as ncclMemAlloc/ncclMemFree: a large
//! message sent from it is read by the receiver with memcpy through a
//! mapping, instead of a single-copy system call (`SharedBuffer`).

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

use collectives::SharedBuffer;

use crate::boundary::{guard, put, Failure};
use crate::collResult_t;

/// The buffers collMemAlloc handed out, by address.
static BUFFERS: Mutex<BTreeMap<usize, SharedBuffer>> = Mutex::new(BTreeMap::new());

fn buffers() -> std::sync::MutexGuard<'static, BTreeMap<usize, SharedBuffer>> {
    BUFFERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Allocates `size` zeroed bytes that peers on the host map: pass them to
/// any call, as any buffer; sends from them are read without a system
/// call. Free with collMemFree.
///
/// # Safety
/// `ptr` must be NULL or valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn collMemAlloc(ptr: *mut *mut c_void, size: usize) -> collResult_t {
    guard(None, || {
        if ptr.is_null() {
            return Err(Failure::invalid("ptr is NULL"));
        }
        if size == 0 {
            return Err(Failure::invalid("collMemAlloc: size is 0"));
        }
        let mut buffer = SharedBuffer::new(size).map_err(|e| Failure {
            code: collResult_t::collSystemError,
            message: format!("collMemAlloc of {size} bytes: {e}"),
        })?;
        let address = buffer.as_mut_ptr();
        buffers().insert(address as usize, buffer);
        // SAFETY: non-null (checked), valid by the caller's promise.
        unsafe { put(ptr, "ptr", address.cast()) }
    })
}

/// Frees memory from collMemAlloc (NULL: nothing). No call may still use it.
///
/// # Safety
/// No call in flight may use the memory.
#[no_mangle]
pub unsafe extern "C" fn collMemFree(ptr: *mut c_void) -> collResult_t {
    guard(None, || {
        if ptr.is_null() {
            return Ok(());
        }
        match buffers().remove(&(ptr as usize)) {
            Some(_) => Ok(()),
            None => Err(Failure::invalid(format!(
                "collMemFree: {ptr:?} was not allocated by collMemAlloc (or was freed)"
            ))),
        }
    })
}
