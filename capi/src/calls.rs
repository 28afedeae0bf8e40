//! The calls, NCCL's arguments in NCCL's order. In place is
//! `sendbuff == recvbuff`, with NCCL's offsets for AllGather
//! (`sendbuff == recvbuff + rank * sendcount`) and ReduceScatter
//! (`recvbuff == sendbuff + rank * recvcount`); the library decides it.

use std::ffi::{c_int, c_void};

use collectives::{AsyncCommunicator, Buffers, CallArgs, Collective, DataType, VarCounts};

use crate::boundary::{comm_ref, dtype, rank_arg, redop, with_comm, Failure};
use crate::{collComm, collComm_t, collResult_t, group, DataTypeArg, RedOpArg};

/// One call: recorded inside a group, else run (blocking communicator) or
/// started in the background (non-blocking one: collInProgress).
///
/// # Safety
/// As every call below: buffers valid for what `count` stands for (for a
/// non-blocking communicator, until collCommGetAsyncError says done).
unsafe fn call(
    comm: collComm_t,
    args: impl FnOnce() -> Result<CallArgs, Failure>,
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
) -> collResult_t {
    let (send, recv) = (sendbuff.cast::<u8>(), recvbuff.cast::<u8>());
    if group::recording() {
        // SAFETY: the caller's promise, until collGroupEnd.
        return unsafe { group::record(comm, args, send, recv, count) };
    }
    // SAFETY: the caller's promise.
    unsafe {
        with_comm(comm, |c, inner| {
            let args = args()?;
            // Lent to a Reduce off its root with a null receive buffer; owned
            // by the call (a background one frees it when done).
            let workspace = Box::into_raw(Box::<Vec<u64>>::default());
            let free = |w: *mut Vec<u64>| drop(Box::from_raw(w));
            let (rank, size) = (c.rank as usize, c.size as usize);
            let bufs = match args.nccl_buffers(rank, size, send, recv, count, &mut *workspace) {
                Ok(bufs) => bufs,
                Err(m) => {
                    free(workspace);
                    return Err(Failure::invalid(format!("rank {rank}: {m}")));
                }
            };
            if c.blocking {
                let r = inner.call_bytes(&args, bufs, &mut || {});
                free(workspace);
                return Ok(r?);
            }
            background(c, inner, args, bufs, workspace as usize)
        })
    }
}

/// Starts a call of a non-blocking communicator; collCommGetAsyncError
/// reports it.
///
/// # Safety
/// The buffers must stay valid until it finished.
/// `workspace` is the address of the call's boxed workspace, freed when done.
unsafe fn background(
    c: &collComm,
    inner: &AsyncCommunicator,
    args: CallArgs,
    bufs: Buffers<'_>,
    workspace: usize,
) -> Result<(), Failure> {
    let done = c.begin_background();
    // SAFETY: the caller's promise; the workspace lives until `done`.
    unsafe {
        inner.start_bytes_then(args, bufs, move |r| {
            drop(Box::from_raw(workspace as *mut Vec<u64>));
            done(r)
        })
    };
    Err(Failure::in_progress())
}

/// `recvbuff[i] = op over ranks of sendbuff[i]`, `count` elements.
///
/// # Safety
/// Buffers valid for `count` elements; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    comm: collComm_t,
) -> collResult_t {
    let args = || Ok(CallArgs::new(Collective::AllReduce, dtype(datatype)?).op(redop(op)?));
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, sendbuff, recvbuff, count) }
}

/// Block `j` (`count` elements) of `sendbuff` goes to rank `j`; block `j`
/// of `recvbuff` comes from rank `j`.
///
/// # Safety
/// Buffers valid for `count * nranks` elements; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collAllToAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    comm: collComm_t,
) -> collResult_t {
    let args = || Ok(CallArgs::new(Collective::AllToAll, dtype(datatype)?));
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, sendbuff, recvbuff, count) }
}

/// AllToAll with a count per peer: `sendcounts[j]` elements from
/// `sendbuff + sdispls[j]` go to rank `j`, `recvcounts[j]` elements from
/// rank `j` land at `recvbuff + rdispls[j]` (counts and displacements in
/// elements, `nranks` each). Rank i's `sendcounts[j]` must equal rank j's
/// `recvcounts[i]`: where they differ both fail with collInvalidUsage.
///
/// # Safety
/// Count arrays valid for `nranks` entries; buffers for the blocks they
/// describe; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collAllToAllv(
    sendbuff: *const c_void,
    sendcounts: *const usize,
    sdispls: *const usize,
    recvbuff: *mut c_void,
    recvcounts: *const usize,
    rdispls: *const usize,
    datatype: DataTypeArg,
    comm: collComm_t,
) -> collResult_t {
    // SAFETY: the caller's promise.
    let n = unsafe { comm_ref(comm) }.map_or(0, |c| c.size as usize);
    let args = || {
        let list = |p: *const usize, what: &str| {
            if p.is_null() {
                return Err(Failure::invalid(format!("alltoallv: {what} is NULL")));
            }
            // SAFETY: non-null (checked); `nranks` entries by the caller's promise.
            Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
        };
        let counts = VarCounts {
            send_counts: list(sendcounts, "sendcounts")?,
            send_displs: list(sdispls, "sdispls")?,
            recv_counts: list(recvcounts, "recvcounts")?,
            recv_displs: list(rdispls, "rdispls")?,
        };
        Ok(CallArgs::all_to_all_v(dtype(datatype)?, counts))
    };
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, sendbuff, recvbuff, 0) }
}

/// `recvbuff` (`recvcount` elements) = block `rank` of the reduction over
/// ranks of `sendbuff` (`recvcount * nranks` elements).
///
/// # Safety
/// Buffers valid for their counts; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    comm: collComm_t,
) -> collResult_t {
    let args = || Ok(CallArgs::new(Collective::ReduceScatter, dtype(datatype)?).op(redop(op)?));
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, sendbuff, recvbuff, recvcount) }
}

/// Block `j` of `recvbuff` (`sendcount` elements each) = rank `j`'s `sendbuff`.
///
/// # Safety
/// Buffers valid for their counts; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: DataTypeArg,
    comm: collComm_t,
) -> collResult_t {
    let args = || Ok(CallArgs::new(Collective::AllGather, dtype(datatype)?));
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, sendbuff, recvbuff, sendcount) }
}

/// Every rank's `recvbuff` = `root`'s `sendbuff` (`sendbuff` is read on the
/// root only).
///
/// # Safety
/// Buffers valid for `count` elements; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    root: c_int,
    comm: collComm_t,
) -> collResult_t {
    let args = || {
        let root = rank_arg(root, "root")?;
        Ok(CallArgs::new(Collective::Broadcast, dtype(datatype)?).root(root))
    };
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, sendbuff, recvbuff, count) }
}

/// `recvbuff[i]` on `root` = op over ranks of `sendbuff[i]` (`recvbuff` is
/// written on the root only and may be NULL elsewhere).
///
/// # Safety
/// Buffers valid for `count` elements; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    root: c_int,
    comm: collComm_t,
) -> collResult_t {
    let args = || {
        let root = rank_arg(root, "root")?;
        Ok(CallArgs::new(Collective::Reduce, dtype(datatype)?)
            .op(redop(op)?)
            .root(root))
    };
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, sendbuff, recvbuff, count) }
}

/// Sends `count` elements to `peer`, whose collRecv must expect the same
/// count and datatype. Matched in order per pair of ranks, independently of
/// collectives.
///
/// # Safety
/// `sendbuff` valid for `count` elements; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: DataTypeArg,
    peer: c_int,
    comm: collComm_t,
) -> collResult_t {
    let args = || Ok(CallArgs::send_to(dtype(datatype)?, rank_arg(peer, "peer")?));
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, sendbuff, std::ptr::null_mut(), count) }
}

/// Receives `count` elements from `peer`.
///
/// # Safety
/// `recvbuff` valid for `count` elements; `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    peer: c_int,
    comm: collComm_t,
) -> collResult_t {
    let args = || {
        Ok(CallArgs::recv_from(
            dtype(datatype)?,
            rank_arg(peer, "peer")?,
        ))
    };
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, std::ptr::null(), recvbuff, count) }
}

/// Returns once every rank of `comm` has entered it.
///
/// # Safety
/// `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collBarrier(comm: collComm_t) -> collResult_t {
    let args = || Ok(CallArgs::new(Collective::Barrier, DataType::U8));
    // SAFETY: the caller's promise.
    unsafe { call(comm, args, std::ptr::null(), std::ptr::null_mut(), 0) }
}
