//! Communicators: unique ids, creation, splitting, queries, abort,
//! destruction, error strings.

use std::ffi::{c_char, c_int, CString};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use collectives::bootstrap::UniqueId;
use collectives::{AsyncCommunicator, Communicator, Config};

use crate::boundary::{
    guard, lookup, put, register, thread_last_error, unregister, with_comm, with_live, Failure,
};
use crate::{
    collComm, collComm_t, collConfig_t, collResult_t, collUniqueId, ResultArg, COLL_CONFIG_MAGIC,
};

fn wrap(comm: Communicator, blocking: bool) -> collComm_t {
    let (rank, size) = (comm.rank() as c_int, comm.size() as c_int);
    register(collComm {
        abort: comm.abort_handle(),
        comm: Mutex::new(AsyncCommunicator::new(comm)),
        blocking,
        background: Arc::default(),
        last_error: Mutex::new(CString::default()),
        rank,
        size,
    })
}

/// The settings a config asks for: (blocking, the library's config).
///
/// # Safety
/// `config` must be NULL or point to a `collConfig_t` of `config->size` bytes.
unsafe fn settings(config: *const collConfig_t) -> Result<(bool, Config), Failure> {
    let mut library = Config::from_env().map_err(Failure::invalid)?;
    // SAFETY: the caller's promise.
    let Some(c) = (unsafe { config.as_ref() }) else {
        return Ok((true, library));
    };
    if c.magic != COLL_CONFIG_MAGIC || c.size < std::mem::size_of::<collConfig_t>() {
        return Err(Failure::invalid(
            "config is not initialized (start from COLL_CONFIG_INITIALIZER)",
        ));
    }
    if c.timeoutMs > 0 {
        library.timeout = Duration::from_millis(c.timeoutMs as u64);
    }
    Ok((c.blocking != 0, library))
}

/// Makes a new unique id and serves its rendezvous from this process (until
/// the job has met, or COLL_TIMEOUT seconds). Call it on one rank and send
/// the id to the others (e.g. with MPI_Bcast), as with ncclGetUniqueId.
///
/// # Safety
/// `id` must be NULL or valid for a write of a `collUniqueId`.
#[no_mangle]
pub unsafe extern "C" fn collGetUniqueId(id: *mut collUniqueId) -> collResult_t {
    guard(None, || {
        if id.is_null() {
            return Err(Failure::invalid("id is NULL"));
        }
        let made = UniqueId::new().map_err(|e| Failure {
            code: collResult_t::collSystemError,
            message: format!("collGetUniqueId: {e}"),
        })?;
        let mut out = collUniqueId { internal: [0; 128] };
        for (o, b) in out.internal.iter_mut().zip(made.as_bytes()) {
            *o = *b as c_char;
        }
        // SAFETY: non-null (checked), valid by the caller's promise.
        unsafe { put(id, "id", out) }
    })
}

/// Joins the job `id` names as rank `rank` of `nranks`; every rank must
/// call it (blocks until all have). Settings come from COLL_* variables.
///
/// # Safety
/// `comm` must be NULL or valid for a write of a `collComm_t`.
#[no_mangle]
pub unsafe extern "C" fn collCommInitRank(
    comm: *mut collComm_t,
    nranks: c_int,
    id: collUniqueId,
    rank: c_int,
) -> collResult_t {
    // SAFETY: the caller's promise.
    unsafe { collCommInitRankConfig(comm, nranks, id, rank, std::ptr::null()) }
}

/// collCommInitRank with settings (NULL: the defaults). With
/// `config->blocking == 0` every later call on the communicator returns
/// collInProgress at once and runs in the background (the init itself
/// blocks until every rank joined).
///
/// # Safety
/// `comm` must be NULL or valid for a write of a `collComm_t`; `config` NULL
/// or an initialized `collConfig_t`.
#[no_mangle]
pub unsafe extern "C" fn collCommInitRankConfig(
    comm: *mut collComm_t,
    nranks: c_int,
    id: collUniqueId,
    rank: c_int,
    config: *const collConfig_t,
) -> collResult_t {
    guard(None, || {
        if comm.is_null() {
            return Err(Failure::invalid("comm is NULL"));
        }
        let (Ok(size), Ok(me)) = (usize::try_from(nranks), usize::try_from(rank)) else {
            return Err(Failure::invalid(format!(
                "rank {rank} of {nranks}: negative"
            )));
        };
        let bytes: Vec<u8> = id.internal.iter().map(|b| *b as u8).collect();
        let unique = UniqueId::from_bytes(&bytes).map_err(Failure::invalid)?;
        let boot = unique.bootstrap(me, size).map_err(Failure::invalid)?;
        // SAFETY: the caller's promise.
        let (blocking, config) = unsafe { settings(config)? };
        let made = Communicator::init(boot, config)?;
        // SAFETY: non-null (checked), valid by the caller's promise.
        unsafe { put(comm, "comm", wrap(made, blocking)) }
    })
}

/// Joins the job the environment describes: torchrun's RANK/WORLD_SIZE/
/// MASTER_ADDR/MASTER_PORT, Open MPI's or MPICH's mpirun, Slurm.
///
/// # Safety
/// `comm` must be NULL or valid for a write of a `collComm_t`.
#[no_mangle]
pub unsafe extern "C" fn collCommInitFromEnv(comm: *mut collComm_t) -> collResult_t {
    guard(None, || {
        if comm.is_null() {
            return Err(Failure::invalid("comm is NULL"));
        }
        let made = Communicator::from_env()?;
        // SAFETY: non-null (checked), valid by the caller's promise.
        unsafe { put(comm, "comm", wrap(made, true)) }
    })
}

/// Splits `comm`: ranks with the same `color` form `*newcomm`, ranked by
/// `key` (then by rank in `comm`); COLL_SPLIT_NOCOLOR (any negative color)
/// joins none and sets `*newcomm` to NULL. Every rank of `comm` must call it.
/// It blocks, and the child is blocking or not as `comm` is.
///
/// # Safety
/// `comm`: any handle (one not live is refused with collInvalidArgument);
/// `newcomm` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn collCommSplit(
    comm: collComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut collComm_t,
) -> collResult_t {
    with_comm(comm, |c, inner| {
        if newcomm.is_null() {
            return Err(Failure::invalid("newcomm is NULL"));
        }
        let color = u32::try_from(color).ok();
        let child = inner.split(color, key.into()).wait()?;
        let child = child.map_or(std::ptr::null_mut(), |ch| wrap(ch, c.blocking));
        // SAFETY: non-null (checked), valid by the caller's promise.
        unsafe { put(newcomm, "newcomm", child) }
    })
}

/// The ranks of `comm` that failed, the same set on every survivor (as
/// ULFM's agreement): every survivor calls it. A rank counts as failed when
/// its process is gone, its communicator was destroyed, or it does not
/// answer within 2 s (its host cannot be reached for 10 s); every wait is
/// bounded by the timeout. Works on a
/// communicator that failed or was aborted. `*count` is the number of
/// failed ranks; up to `capacity` of them are written to `ranks` (a
/// `capacity` too small is collInvalidArgument, with `*count` set).
///
/// # Safety
/// `comm`: any handle (one not live is refused with collInvalidArgument);
/// `ranks` valid for `capacity` writes
/// (or NULL with `capacity` 0); `count` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn collCommGetFailedRanks(
    comm: collComm_t,
    ranks: *mut c_int,
    capacity: c_int,
    count: *mut c_int,
) -> collResult_t {
    with_comm(comm, |_, inner| {
        if count.is_null() || (ranks.is_null() && capacity > 0) || capacity < 0 {
            return Err(Failure::invalid(
                "count is NULL, or ranks is NULL with a capacity",
            ));
        }
        let failed = inner.failed_ranks().wait()?;
        // SAFETY: non-null (checked), valid by the caller's promise.
        unsafe { put(count, "count", failed.len() as c_int) }?;
        for (i, r) in failed.iter().take(capacity as usize).enumerate() {
            // SAFETY: i < capacity, for which `ranks` is valid (the caller's promise).
            unsafe { ranks.add(i).write(*r as c_int) };
        }
        match failed.len() <= capacity as usize {
            true => Ok(()),
            false => Err(Failure::invalid(format!(
                "{} ranks failed, ranks has room for {capacity}",
                failed.len()
            ))),
        }
    })
}

/// A communicator of the ranks of `comm` not in `excludeRanks` (and not
/// failed meanwhile), renumbered in order, as ncclCommShrink: every
/// survivor calls it, excluded ranks do not. COLL_SHRINK_ABORT first ends
/// what is in flight on `comm` (required when `comm` may be stuck on a
/// failed rank); COLL_SHRINK_DEFAULT leaves it. No launcher or rendezvous
/// is involved; `comm` may have failed or been aborted, and stays to be
/// destroyed. `config` (or NULL: as `comm`) says whether the new
/// communicator is blocking; it keeps `comm`'s timeout. If a rank dies
/// during the shrink, it fails: get the failed ranks and shrink again.
///
/// # Safety
/// `comm`: any handle (one not live is refused with collInvalidArgument);
/// `excludeRanks` valid for
/// `excludeCount` reads (or NULL with 0); `newcomm` valid for a write;
/// `config` NULL or initialized from COLL_CONFIG_INITIALIZER.
#[no_mangle]
pub unsafe extern "C" fn collCommShrink(
    comm: collComm_t,
    excludeRanks: *const c_int,
    excludeCount: c_int,
    newcomm: *mut collComm_t,
    config: *const collConfig_t,
    flags: c_int,
) -> collResult_t {
    with_comm(comm, |c, inner| {
        if newcomm.is_null() || excludeCount < 0 || (excludeRanks.is_null() && excludeCount > 0) {
            return Err(Failure::invalid(
                "newcomm is NULL, or excludeRanks does not hold excludeCount ranks",
            ));
        }
        let abort_first = match flags {
            crate::COLL_SHRINK_DEFAULT => false,
            crate::COLL_SHRINK_ABORT => true,
            other => return Err(Failure::invalid(format!("unknown shrink flags {other}"))),
        };
        let blocking = match config.is_null() {
            true => c.blocking,
            // SAFETY: non-null, initialized by the caller (its promise).
            false => unsafe { settings(config) }?.0,
        };
        let excluded: Vec<usize> = (0..excludeCount as usize)
            // SAFETY: i < excludeCount, for which `excludeRanks` is valid.
            .map(|i| usize::try_from(unsafe { *excludeRanks.add(i) }))
            .collect::<Result<_, _>>()
            .map_err(|_| Failure::invalid("a negative rank in excludeRanks"))?;
        let child = inner.shrink(excluded, abort_first).wait()?;
        // SAFETY: non-null (checked), valid by the caller's promise.
        unsafe { put(newcomm, "newcomm", wrap(child, blocking)) }
    })
}

/// The number of ranks of `comm`.
///
/// # Safety
/// `comm`: any handle (one not live is refused with collInvalidArgument);
/// `count` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn collCommCount(comm: collComm_t, count: *mut c_int) -> collResult_t {
    // SAFETY: the caller's promise.
    with_live(comm, |c| unsafe { put(count, "count", c.size) })
}

/// This process's rank in `comm`.
///
/// # Safety
/// `comm`: any handle (one not live is refused with collInvalidArgument);
/// `rank` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn collCommUserRank(comm: collComm_t, rank: *mut c_int) -> collResult_t {
    // SAFETY: the caller's promise.
    with_live(comm, |c| unsafe { put(rank, "rank", c.rank) })
}

/// Aborts `comm` and frees it, as ncclCommAbort: a call blocked on it in
/// another thread returns at once with an error, every peer's pending or
/// next call fails naming this rank ("peer rank R aborted"). Afterwards
/// `comm` is refused (a thread still inside a call on it returns before
/// this does).
///
/// # Safety
/// `comm`: any handle (NULL does nothing; one not live is refused).
#[no_mangle]
pub unsafe extern "C" fn collCommAbort(comm: collComm_t) -> collResult_t {
    if comm.is_null() {
        return collResult_t::collSuccess;
    }
    guard(None, || {
        let c = unregister(comm)?;
        c.abort
            .abort(&format!("rank {} called collCommAbort", c.rank));
        // The lock waits for a blocked call, which the abort just ended.
        drop(c.comm.lock().unwrap_or_else(|e| e.into_inner()));
        // Ending it tells the peers (the abort is acted on first); a call
        // still returning on another thread holds it until it has.
        drop(c);
        Ok(())
    })
}

/// Aborts `comm` without freeing it (MPI_Comm_revoke's effect, ncclCommAbort's
/// without the free): every call in flight on it, in any thread, and every
/// later one fails, and the peers are told ("peer rank R aborted"). Any thread
/// may call it at any time, even while another is inside a call;
/// collCommDestroy frees it afterwards. For bindings whose own abort must not
/// free what other threads may still hold (a torch backend's).
///
/// `reason` (NULL: "revoked") is what the errors say.
///
/// # Safety
/// `comm`: any handle (NULL does nothing; one not live is refused);
/// `reason` NULL or a
/// NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn collCommRevoke(comm: collComm_t, reason: *const c_char) -> collResult_t {
    if comm.is_null() {
        return collResult_t::collSuccess;
    }
    with_live(comm, |c| {
        let why = match reason.is_null() {
            true => "revoked".into(),
            // SAFETY: non-null (checked), NUL-terminated by the caller's promise.
            false => unsafe { std::ffi::CStr::from_ptr(reason) }.to_string_lossy(),
        };
        c.abort.abort(&format!("rank {}: {why}", c.rank));
        Ok(())
    })
}

/// Frees `comm` (its connections close; peers that still wait on this rank
/// see it leave).
///
/// # Safety
/// `comm`: any handle (NULL does nothing; one already destroyed or aborted
/// is refused with collInvalidArgument).
#[no_mangle]
pub unsafe extern "C" fn collCommDestroy(comm: collComm_t) -> collResult_t {
    if comm.is_null() {
        return collResult_t::collSuccess;
    }
    // A call still running on another thread holds it until it returns.
    guard(None, || unregister(comm).map(drop))
}

/// A short description of `result`.
#[no_mangle]
pub extern "C" fn collGetErrorString(result: ResultArg) -> *const c_char {
    let text: &'static [u8] = match result {
        0 => b"no error\0",
        1 => b"system error (sockets, memory, rendezvous)\0",
        2 => b"internal error (a bug in the library)\0",
        3 => b"invalid argument\0",
        4 => b"invalid usage (ranks disagree on a call, or the communicator was aborted)\0",
        5 => b"remote error (a peer died, closed its connection or aborted)\0",
        6 => b"timeout (nothing moved for COLL_TIMEOUT seconds)\0",
        7 => b"in progress (a non-blocking communicator's call is running)\0",
        _ => b"unknown result code\0",
    };
    text.as_ptr().cast()
}

/// The full message of the last failed call on `comm` (or, with NULL, of
/// the last failed call on this thread that had no communicator, such as an
/// init): it names the rank, the peer and the call. Valid until the next
/// failure it would report.
///
/// # Safety
/// `comm`: any handle (NULL does nothing; one not live is refused).
#[no_mangle]
pub unsafe extern "C" fn collGetLastError(comm: collComm_t) -> *const c_char {
    match lookup(comm) {
        // The text lives in the communicator: valid while it is.
        Ok(c) => c
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ptr(),
        Err(_) => thread_last_error(),
    }
}

/// A non-blocking communicator's state: collInProgress while a call runs,
/// then collSuccess, or the first failed call's result (its message in
/// collGetLastError). A blocking communicator reports collSuccess.
///
/// # Safety
/// `comm`: any handle (one not live is refused with collInvalidArgument);
/// `asyncError` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn collCommGetAsyncError(
    comm: collComm_t,
    asyncError: *mut collResult_t,
) -> collResult_t {
    with_live(comm, |c| {
        let background = c.background.lock().unwrap_or_else(|e| e.into_inner());
        let state = match (&background.error, background.in_flight) {
            (Some((code, message)), _) => {
                let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
                *c.last_error.lock().unwrap_or_else(|e| e.into_inner()) = text;
                *code
            }
            (None, 0) => collResult_t::collSuccess,
            (None, _) => collResult_t::collInProgress,
        };
        // SAFETY: the caller's promise.
        unsafe { put(asyncError, "asyncError", state) }
    })
}
