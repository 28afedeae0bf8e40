//! The C ABI of the collectives library, in NCCL's shape: `coll*` for
//! `nccl*`, the same arguments, the same in-place rules. It translates and
//! nothing more: every function is a panic boundary, null checks, explicit
//! enum conversions (a C value is never taken for a Rust discriminant) and
//! one call into `collectives`; error kinds come from the library
//! (`Error::kind`), never from parsing messages. `include/collectives.h`
//! is generated from this crate by cbindgen (see `tests/header.rs`).

#![allow(non_camel_case_types)]

mod boundary;
mod calls;
mod comm;

use std::ffi::{c_char, c_int};
use std::sync::Mutex;

use collectives::{AbortHandle, Communicator};

pub use calls::*;
pub use comm::*;

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

/// A communicator (opaque).
pub struct collComm {
    comm: Mutex<Communicator>,
    abort: AbortHandle,
    /// The last error's full message, for `collGetLastError`.
    last_error: Mutex<std::ffi::CString>,
    rank: c_int,
    size: c_int,
}

/// A communicator handle.
pub type collComm_t = *mut collComm;
