//! The C ABI of the collectives library, in NCCL's shape: `coll*` for
//! `nccl*`, the same arguments, the same in-place rules. It translates and
//! nothing more: every function is a panic boundary, null checks, explicit
//! enum conversions (a C value is never taken for a Rust discriminant) and
//! one call into `collectives`; error kinds come from the library
//! (`Error::kind`), never from parsing messages. `include/collectives.h`
//! is generated from this crate by cbindgen (see `tests/header.rs`).

#![allow(non_camel_case_types, non_snake_case)]

mod boundary;
mod calls;
mod comm;
mod group;
mod memory;
mod request;

use std::ffi::{c_char, c_int};
use std::sync::Mutex;

use collectives::{AbortHandle, AsyncCommunicator};

pub use calls::*;
pub use comm::*;
pub use group::*;
pub use memory::*;
pub use request::*;

/// Result of every call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum collResult_t {
    collSuccess = 0,
    /// The system refused something: sockets, memory, the rendezvous.
    collSystemError = 1,
    /// A bug in the library (a panic caught at the boundary).
    collInternalError = 2,
    /// A bad argument: nothing moved, the communicator is still usable.
    collInvalidArgument = 3,
    /// The ranks disagree on a call, or the communicator was aborted.
    collInvalidUsage = 4,
    /// A peer died, closed its connection or aborted.
    collRemoteError = 5,
    /// Nothing moved for the timeout (COLL_TIMEOUT seconds).
    collTimeout = 6,
    /// A non-blocking communicator's call is running (see collCommGetAsyncError).
    collInProgress = 7,
}

/// Element types.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum collDataType_t {
    collInt8 = 0,
    collUint8 = 1,
    collInt32 = 2,
    collUint32 = 3,
    collInt64 = 4,
    collUint64 = 5,
    collFloat16 = 6,
    collFloat32 = 7,
    collFloat64 = 8,
    collBfloat16 = 9,
}

/// Reductions. Integers wrap; average truncates for integers.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum collRedOp_t {
    collSum = 0,
    collProd = 1,
    collMax = 2,
    collMin = 3,
    collAvg = 4,
}

/// A `collDataType_t` as C passes it (converted explicitly).
/// cbindgen:no-export
pub type DataTypeArg = c_int;
/// A `collRedOp_t` as C passes it.
/// cbindgen:no-export
pub type RedOpArg = c_int;
/// A `collResult_t` as C passes it.
/// cbindgen:no-export
pub type ResultArg = c_int;

/// Where a job's ranks meet, made by `collGetUniqueId` on one rank and
/// handed to the others out of band (MPI_Bcast, a file, a store).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct collUniqueId {
    pub internal: [c_char; 128],
}

/// `collCommSplit`'s color for ranks that join no new communicator.
pub const COLL_SPLIT_NOCOLOR: c_int = -1;

/// collCommShrink's flags: shrink as is, or abort what is in flight on the
/// communicator first (as NCCL_SHRINK_DEFAULT / NCCL_SHRINK_ABORT).
pub const COLL_SHRINK_DEFAULT: c_int = 0;
pub const COLL_SHRINK_ABORT: c_int = 1;

/// The value of `collConfig_t::magic` (COLL_CONFIG_INITIALIZER sets it).
pub const COLL_CONFIG_MAGIC: u32 = 0xc011_c0f1;
/// The version of `collConfig_t` this library knows.
pub const COLL_CONFIG_VERSION: u32 = 1;

/// Communicator settings (NCCL's ncclConfig_t shape: size, magic and version
/// first, so that it can grow). Start from COLL_CONFIG_INITIALIZER.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct collConfig_t {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    /// 1: calls return when done. 0: calls return collInProgress at once and
    /// run in the background; collCommGetAsyncError says when they are done.
    pub blocking: c_int,
    /// Milliseconds without progress before a call fails (0: COLL_TIMEOUT).
    pub timeoutMs: c_int,
}

/// A communicator (opaque).
pub struct collComm {
    /// Held during every call: one thread at a time, and collCommAbort frees
    /// only once a blocked call has returned.
    comm: Mutex<AsyncCommunicator>,
    abort: AbortHandle,
    blocking: bool,
    /// Non-blocking calls in flight and the first error of one.
    background: std::sync::Arc<Mutex<Background>>,
    /// The last error's full message, for `collGetLastError`.
    last_error: Mutex<std::ffi::CString>,
    rank: c_int,
    size: c_int,
}

/// What collCommGetAsyncError reports of a non-blocking communicator.
#[derive(Default)]
struct Background {
    in_flight: usize,
    error: Option<(collResult_t, String)>,
}

/// A communicator handle.
pub type collComm_t = *mut collComm;

impl collComm {
    /// Counts a non-blocking call in; the returned function counts it out
    /// with its result (the first failure is kept for collCommGetAsyncError).
    fn begin_background(&self) -> impl FnOnce(collectives::Result<()>) + Send + 'static {
        let background = self.background.clone();
        background
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .in_flight += 1;
        move |r| {
            let mut b = background.lock().unwrap_or_else(|e| e.into_inner());
            b.in_flight -= 1;
            if let (Err(e), None) = (r, &b.error) {
                let f = boundary::Failure::from(e);
                b.error = Some((f.code, f.message));
            }
        }
    }
}
