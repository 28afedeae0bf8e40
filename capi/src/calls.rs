//! The calls, NCCL's arguments in NCCL's order. In place is
//! `sendbuff == recvbuff`, with NCCL's offsets for AllGather
//! (`sendbuff == recvbuff + rank * sendcount`) and ReduceScatter
//! (`recvbuff == sendbuff + rank * recvcount`); the library decides it.

use std::ffi::{c_int, c_void};

use collectives::{CallArgs, Collective, DataType, VarCounts};

use crate::boundary::{dtype, rank_arg, redop, with_comm, Failure};
use crate::{collComm_t, collResult_t, DataTypeArg, RedOpArg};

/// One call through the library's NCCL-shaped entry.
///
/// # Safety
/// As every call below: buffers valid for what `count` stands for.
unsafe fn call(
    comm: collComm_t,
    args: impl FnOnce() -> Result<CallArgs, Failure>,
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
) -> collResult_t {
    // SAFETY: the caller's promise.
    unsafe {
        with_comm(comm, |c| {
            let args = args()?;
            Ok(c.call_raw(&args, sendbuff.cast(), recvbuff.cast(), count)?)
        })
    }
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
    unsafe {
        with_comm(comm, |c| {
            let n = c.size();
            let list = |p: *const usize, what: &str| {
                if p.is_null() {
                    return Err(Failure::invalid(format!("alltoallv: {what} is NULL")));
                }
                // SAFETY: non-null (checked); `nranks` entries by the caller's promise.
                Ok(std::slice::from_raw_parts(p, n).to_vec())
            };
            let counts = VarCounts {
                send_counts: list(sendcounts, "sendcounts")?,
                send_displs: list(sdispls, "sdispls")?,
                recv_counts: list(recvcounts, "recvcounts")?,
                recv_displs: list(rdispls, "rdispls")?,
            };
            let args = CallArgs::all_to_all_v(dtype(datatype)?, counts);
            Ok(c.call_raw(&args, sendbuff.cast(), recvbuff.cast(), 0)?)
        })
    }
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
