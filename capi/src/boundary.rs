//! The crossing: panics caught, errors turned into result codes (by kind)
//! and remembered as text, C enum values converted explicitly.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use collectives::{AsyncCommunicator, DataType, ErrorKind, ReduceOp};

use crate::{collComm, collComm_t, collResult_t, DataTypeArg, RedOpArg};

/// A failure on its way out: the code and the message `collGetLastError`
/// gives.
pub(crate) struct Failure {
    pub code: collResult_t,
    pub message: String,
}

impl Failure {
    /// A non-blocking call started; not a failure, but not done either.
    pub fn in_progress() -> Self {
        Failure {
            code: collResult_t::collInProgress,
            message: String::new(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Failure {
            code: collResult_t::collInvalidArgument,
            message: message.into(),
        }
    }
}

impl From<collectives::Error> for Failure {
    fn from(e: collectives::Error) -> Self {
        let code = match e.kind() {
            ErrorKind::InvalidArgument => collResult_t::collInvalidArgument,
            ErrorKind::Mismatch | ErrorKind::Aborted => collResult_t::collInvalidUsage,
            ErrorKind::Remote => collResult_t::collRemoteError,
            ErrorKind::Timeout => collResult_t::collTimeout,
            ErrorKind::System => collResult_t::collSystemError,
        };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

thread_local! {
    /// The last error of a call that had no communicator to keep it in.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Runs `f` behind a panic boundary; a failure is remembered (in `comm`
/// when there is one, else for this thread) and becomes its code.
pub(crate) fn guard(
    comm: Option<&collComm>,
    f: impl FnOnce() -> Result<(), Failure>,
) -> collResult_t {
    record(comm, catch(f))
}

/// `f`'s outcome, a panic included.
fn catch(f: impl FnOnce() -> Result<(), Failure>) -> Result<(), Failure> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        Err(Failure {
            code: collResult_t::collInternalError,
            message: format!("internal error (a bug): {}", panic_text(&panic)),
        })
    })
}

/// The code of `outcome`, its message kept for `collGetLastError`.
fn record(comm: Option<&collComm>, outcome: Result<(), Failure>) -> collResult_t {
    let failure = match outcome {
        Ok(()) => return collResult_t::collSuccess,
        Err(f) if f.code == collResult_t::collInProgress => return f.code,
        Err(f) => f,
    };
    let text = CString::new(failure.message.replace('\0', " ")).unwrap_or_default();
    match comm {
        Some(c) => *c.last_error.lock().unwrap_or_else(|e| e.into_inner()) = text,
        None => LAST_ERROR.with(|l| *l.borrow_mut() = text),
    }
    failure.code
}

/// The message of the last failure on this thread with no communicator.
pub(crate) fn thread_last_error() -> *const std::ffi::c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    (panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Every live communicator, by its handle. A handle not here (destroyed,
/// aborted, never made) is refused with collInvalidArgument instead of
/// being followed. Handles are numbers never given twice, not addresses:
/// a freed communicator's address may come back for the next one, and a
/// stale handle would then reach it. Calls hold a clone while
/// they run, so a communicator destroyed meanwhile is freed when the last
/// one returns, never under it.
/// A read lock per call: calls on different communicators (a torch job's
/// process groups, from their threads) do not wait for each other.
static LIVE: RwLock<BTreeMap<usize, Arc<collComm>>> = RwLock::new(BTreeMap::new());

/// The next handle (a multiple of the alignment a pointer has, so it
/// looks like one to C; never 0).
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(1);

/// Makes `comm` live and gives its handle.
pub(crate) fn register(comm: collComm) -> collComm_t {
    let align = std::mem::align_of::<collComm>();
    let handle = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed) * align;
    let mut live = LIVE.write().unwrap_or_else(|e| e.into_inner());
    live.insert(handle, Arc::new(comm));
    handle as collComm_t
}

/// The live communicator behind `comm`.
pub(crate) fn lookup(comm: collComm_t) -> Result<Arc<collComm>, Failure> {
    if comm.is_null() {
        return Err(Failure::invalid("comm is NULL"));
    }
    let live = LIVE.read().unwrap_or_else(|e| e.into_inner());
    live.get(&(comm as usize))
        .cloned()
        .ok_or_else(|| not_live(comm))
}

/// Takes `comm` out of the live ones (collCommDestroy, collCommAbort).
pub(crate) fn unregister(comm: collComm_t) -> Result<Arc<collComm>, Failure> {
    let mut live = LIVE.write().unwrap_or_else(|e| e.into_inner());
    live.remove(&(comm as usize)).ok_or_else(|| not_live(comm))
}

fn not_live(comm: collComm_t) -> Failure {
    Failure::invalid(format!(
        "comm {comm:?} is not a live communicator (destroyed, aborted, or never made)"
    ))
}

/// Runs `f` on the live communicator behind `comm`, behind the boundary;
/// a handle not live is refused there.
pub(crate) fn with_live(
    comm: collComm_t,
    f: impl FnOnce(&Arc<collComm>) -> Result<(), Failure>,
) -> collResult_t {
    match lookup(comm) {
        Ok(c) => guard(Some(&c), || f(&c)),
        Err(e) => guard(None, || Err(e)),
    }
}

/// Runs `f` on the live communicator behind `comm` (one thread at a time),
/// behind the boundary. The outcome is recorded before the lock is given
/// up: `collCommAbort`, waiting for the lock, may end the communicator the
/// moment it is.
pub(crate) fn with_comm(
    comm: collComm_t,
    f: impl FnOnce(&collComm, &AsyncCommunicator) -> Result<(), Failure>,
) -> collResult_t {
    let c = match lookup(comm) {
        Ok(c) => c,
        Err(e) => return guard(None, || Err(e)),
    };
    let inner = c.comm.lock().unwrap_or_else(|e| e.into_inner());
    let outcome = catch(|| f(&c, &inner));
    let code = record(Some(&c), outcome);
    drop(inner);
    code
}

/// Stores `value` through `out`, which C passed for a result.
///
/// # Safety
/// A non-null `out` must be valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, what: &str, value: T) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null (checked), valid by the caller's promise.
    unsafe { out.write(value) };
    Ok(())
}

pub(crate) fn dtype(raw: DataTypeArg) -> Result<DataType, Failure> {
    Ok(match raw {
        0 => DataType::I8,
        1 => DataType::U8,
        2 => DataType::I32,
        3 => DataType::U32,
        4 => DataType::I64,
        5 => DataType::U64,
        6 => DataType::F16,
        7 => DataType::F32,
        8 => DataType::F64,
        9 => DataType::Bf16,
        _ => {
            return Err(Failure::invalid(format!(
                "datatype {raw} is not a collDataType_t"
            )))
        }
    })
}

pub(crate) fn redop(raw: RedOpArg) -> Result<ReduceOp, Failure> {
    Ok(match raw {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        4 => ReduceOp::Avg,
        _ => return Err(Failure::invalid(format!("op {raw} is not a collRedOp_t"))),
    })
}

/// A C rank argument (root, peer) as a rank, refusing negative ones.
pub(crate) fn rank_arg(raw: c_int, what: &str) -> Result<usize, Failure> {
    usize::try_from(raw).map_err(|_| Failure::invalid(format!("{what} {raw} is negative")))
}
