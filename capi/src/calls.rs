//! The calls, NCCL's arguments in NCCL's order, and `collStart`, which
//! takes any of them as one `collCall_t` (UCC's `ucc_coll_args_t` shape)
//! and gives a request to wait on. In place is `sendbuff == recvbuff`, with
//! NCCL's offsets for AllGather (`sendbuff == recvbuff + rank * sendcount`)
//! and ReduceScatter (`recvbuff == sendbuff + rank * recvcount`); the
//! library decides it.

use std::ffi::{c_int, c_void};

use collectives::{AsyncCommunicator, Buffers, CallArgs, Collective, DataType, VarCounts};

use crate::boundary::{dtype, rank_arg, redop, with_comm, Failure};
use crate::request::{self, collRequest_t};
use crate::{collComm, collComm_t, collResult_t, group, DataTypeArg, RedOpArg};

/// Which call a `collCall_t` describes (each is the function of that name).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum collCallType_t {
    collCallAllReduce = 0,
    collCallAllToAll = 1,
    collCallAllToAllv = 2,
    collCallReduceScatter = 3,
    collCallAllGather = 4,
    collCallBroadcast = 5,
    collCallReduce = 6,
    collCallSend = 7,
    collCallRecv = 8,
    collCallBarrier = 9,
}

/// A `collCallType_t` as C passes it.
/// cbindgen:no-export
pub type CallTypeArg = c_int;

/// Any call, as the function of its type takes it (unused fields are
/// ignored; zero them).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct collCall_t {
    pub call: CallTypeArg,
    pub sendbuff: *const c_void,
    pub recvbuff: *mut c_void,
    /// The count the call's function takes (collAllGather's `sendcount`,
    /// collReduceScatter's `recvcount`, AllToAll's count per peer, ...).
    pub count: usize,
    pub datatype: DataTypeArg,
    /// AllReduce, ReduceScatter and Reduce's reduction.
    pub op: RedOpArg,
    /// Broadcast and Reduce's root, Send's and Recv's peer.
    pub peer: c_int,
    /// AllToAllv's counts and displacements, `nranks` entries each.
    pub sendcounts: *const usize,
    pub sdispls: *const usize,
    pub recvcounts: *const usize,
    pub rdispls: *const usize,
}

impl collCall_t {
    /// A call of type `call` on `datatype`, every other field zero.
    const fn new(call: collCallType_t, datatype: DataTypeArg) -> Self {
        collCall_t {
            call: call as c_int,
            sendbuff: std::ptr::null(),
            recvbuff: std::ptr::null_mut(),
            count: 0,
            datatype,
            op: 0,
            peer: 0,
            sendcounts: std::ptr::null(),
            sdispls: std::ptr::null(),
            recvcounts: std::ptr::null(),
            rdispls: std::ptr::null(),
        }
    }

    /// The library's arguments for this call on `n` ranks.
    ///
    /// # Safety
    /// AllToAllv's count arrays must be valid for `n` reads each.
    unsafe fn args(&self, n: usize) -> Result<CallArgs, Failure> {
        use collCallType_t as T;
        let dt = dtype(self.datatype)?;
        let with_op = |c| Ok(CallArgs::new(c, dt).op(redop(self.op)?));
        let with_root = |c| Ok(CallArgs::new(c, dt).root(rank_arg(self.peer, "root")?));
        match call_type(self.call)? {
            T::collCallAllReduce => with_op(Collective::AllReduce),
            T::collCallReduceScatter => with_op(Collective::ReduceScatter),
            T::collCallReduce => Ok(with_root(Collective::Reduce)?.op(redop(self.op)?)),
            T::collCallBroadcast => with_root(Collective::Broadcast),
            T::collCallAllToAll => Ok(CallArgs::new(Collective::AllToAll, dt)),
            T::collCallAllGather => Ok(CallArgs::new(Collective::AllGather, dt)),
            T::collCallBarrier => Ok(CallArgs::new(Collective::Barrier, DataType::U8)),
            T::collCallSend => Ok(CallArgs::send_to(dt, rank_arg(self.peer, "peer")?)),
            T::collCallRecv => Ok(CallArgs::recv_from(dt, rank_arg(self.peer, "peer")?)),
            T::collCallAllToAllv => {
                let list = |p: *const usize, what: &str| {
                    if p.is_null() {
                        return Err(Failure::invalid(format!("alltoallv: {what} is NULL")));
                    }
                    // SAFETY: non-null (checked); `n` entries by the caller's promise.
                    Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
                };
                let counts = VarCounts {
                    send_counts: list(self.sendcounts, "sendcounts")?,
                    send_displs: list(self.sdispls, "sdispls")?,
                    recv_counts: list(self.recvcounts, "recvcounts")?,
                    recv_displs: list(self.rdispls, "rdispls")?,
                };
                Ok(CallArgs::all_to_all_v(dt, counts))
            }
        }
    }
}

fn call_type(raw: CallTypeArg) -> Result<collCallType_t, Failure> {
    use collCallType_t as T;
    Ok(match raw {
        0 => T::collCallAllReduce,
        1 => T::collCallAllToAll,
        2 => T::collCallAllToAllv,
        3 => T::collCallReduceScatter,
        4 => T::collCallAllGather,
        5 => T::collCallBroadcast,
        6 => T::collCallReduce,
        7 => T::collCallSend,
        8 => T::collCallRecv,
        9 => T::collCallBarrier,
        _ => {
            return Err(Failure::invalid(format!(
                "call {raw} is not a collCallType_t"
            )))
        }
    })
}

/// Starts `call` on `comm` in the background and sets `*request` to it
/// (any communicator, blocking or not): wait for it with
/// collRequestWait, poll it with collRequestTest, or be told with
/// collRequestOnDone, then free it with collRequestFree. Calls started so
/// run as every call does: collectives in the order they were started,
/// send and receive at once. Arguments that cannot work fail here,
/// before anything starts; everything else, a mismatch across ranks or a
/// dead peer, is the request's result.
///
/// # Safety
/// `comm`: any handle (one not live is refused with collInvalidArgument);
/// `call` NULL or valid, its buffers
/// valid for what its count stands for until the request is done; `request`
/// NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn collStart(
    comm: collComm_t,
    call: *const collCall_t,
    request: *mut collRequest_t,
) -> collResult_t {
    // SAFETY: the caller's promise.
    let Some(call) = (unsafe { call.as_ref() }) else {
        return crate::boundary::guard(None, || Err(Failure::invalid("call is NULL")));
    };
    if request.is_null() {
        return crate::boundary::guard(None, || Err(Failure::invalid("request is NULL")));
    }
    // SAFETY: the caller's promise.
    unsafe { run(comm, call, Some(request)) }
}

/// Runs `call` on `comm` as the function of its type would: on this thread
/// for a blocking communicator, in the background (collInProgress) for a
/// non-blocking one, recorded inside a group. For bindings that describe
/// every call in one shape.
///
/// # Safety
/// As the function of the call's type.
#[no_mangle]
pub unsafe extern "C" fn collCall(comm: collComm_t, call: *const collCall_t) -> collResult_t {
    // SAFETY: the caller's promise.
    match unsafe { call.as_ref() } {
        // SAFETY: the caller's promise.
        Some(call) => unsafe { run(comm, call, None) },
        None => crate::boundary::guard(None, || Err(Failure::invalid("call is NULL"))),
    }
}

/// Runs one call: recorded inside a group; else started with a request
/// (collStart), run (blocking communicator) or started in the background
/// (non-blocking one: collInProgress).
///
/// # Safety
/// As every call below: buffers valid for what `count` stands for (for a
/// non-blocking communicator or a request, until done).
unsafe fn run(
    comm: collComm_t,
    call: &collCall_t,
    request: Option<*mut collRequest_t>,
) -> collResult_t {
    // Given the communicator's size: the count arrays have that many entries.
    // SAFETY: the caller's promise (count arrays of `n` entries).
    let args = |n: usize| unsafe { call.args(n) };
    let (send, recv) = (call.sendbuff.cast::<u8>(), call.recvbuff.cast::<u8>());
    if group::recording() {
        if request.is_some() {
            return crate::boundary::guard(None, || {
                Err(Failure::invalid(
                    "collStart inside a group: end the group first",
                ))
            });
        }
        // SAFETY: the caller's promise, until collGroupEnd.
        return unsafe { group::record(comm, args, send, recv, call.count) };
    }
    with_comm(comm, |c, inner| {
        let args = args(c.size as usize)?;
        // Lent to a Reduce off its root with a null receive buffer; owned
        // by the call (a background one frees it when done).
        let workspace = Box::into_raw(Box::<Vec<u64>>::default());
        // SAFETY: from Box::into_raw above, freed once (each path below frees
        // it, or hands it to the call that does).
        let free = |w: *mut Vec<u64>| drop(unsafe { Box::from_raw(w) });
        let (rank, size) = (c.rank as usize, c.size as usize);
        // SAFETY: the buffers hold `count` elements as the call's shape says
        // (the caller's promise); the workspace is ours until freed.
        let bufs =
            unsafe { args.nccl_buffers(rank, size, send, recv, call.count, &mut *workspace) };
        let bufs = match bufs {
            Ok(bufs) => bufs,
            Err(m) => {
                free(workspace);
                return Err(Failure::invalid(format!("rank {rank}: {m}")));
            }
        };
        if let Some(out) = request {
            let started = request::start(inner, args, bufs, workspace as usize);
            // SAFETY: `out` NULL or valid for a write (the caller's promise).
            return unsafe { crate::boundary::put(out, "request", started) };
        }
        if c.blocking {
            let r = inner.call_bytes(&args, bufs, &mut || {});
            free(workspace);
            return Ok(r?);
        }
        background(c, inner, args, bufs, workspace as usize)
    })
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
/// Buffers valid for `count` elements (`comm` may be any handle: one not live is refused).
#[no_mangle]
pub unsafe extern "C" fn collAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    comm: collComm_t,
) -> collResult_t {
    let call = collCall_t {
        sendbuff,
        recvbuff,
        count,
        op,
        ..collCall_t::new(collCallType_t::collCallAllReduce, datatype)
    };
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}

/// Block `j` (`count` elements) of `sendbuff` goes to rank `j`; block `j`
/// of `recvbuff` comes from rank `j`.
///
/// # Safety
/// Buffers valid for `count * nranks` elements (`comm` may be any handle: one not live is refused).
#[no_mangle]
pub unsafe extern "C" fn collAllToAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    comm: collComm_t,
) -> collResult_t {
    let call = collCall_t {
        sendbuff,
        recvbuff,
        count,
        ..collCall_t::new(collCallType_t::collCallAllToAll, datatype)
    };
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}

/// AllToAll with a count per peer: `sendcounts[j]` elements from
/// `sendbuff + sdispls[j]` go to rank `j`, `recvcounts[j]` elements from
/// rank `j` land at `recvbuff + rdispls[j]` (counts and displacements in
/// elements, `nranks` each). Rank i's `sendcounts[j]` must equal rank j's
/// `recvcounts[i]`: where they differ both fail with collInvalidUsage.
///
/// # Safety
/// Count arrays valid for `nranks` entries; buffers for the blocks they
/// describe (`comm` may be any handle: one not live is refused).
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
    let call = collCall_t {
        sendbuff,
        recvbuff,
        sendcounts,
        sdispls,
        recvcounts,
        rdispls,
        ..collCall_t::new(collCallType_t::collCallAllToAllv, datatype)
    };
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}

/// `recvbuff` (`recvcount` elements) = block `rank` of the reduction over
/// ranks of `sendbuff` (`recvcount * nranks` elements).
///
/// # Safety
/// Buffers valid for their counts (`comm` may be any handle: one not live is refused).
#[no_mangle]
pub unsafe extern "C" fn collReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    comm: collComm_t,
) -> collResult_t {
    let call = collCall_t {
        sendbuff,
        recvbuff,
        count: recvcount,
        op,
        ..collCall_t::new(collCallType_t::collCallReduceScatter, datatype)
    };
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}

/// Block `j` of `recvbuff` (`sendcount` elements each) = rank `j`'s `sendbuff`.
///
/// # Safety
/// Buffers valid for their counts (`comm` may be any handle: one not live is refused).
#[no_mangle]
pub unsafe extern "C" fn collAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: DataTypeArg,
    comm: collComm_t,
) -> collResult_t {
    let call = collCall_t {
        sendbuff,
        recvbuff,
        count: sendcount,
        ..collCall_t::new(collCallType_t::collCallAllGather, datatype)
    };
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}

/// Every rank's `recvbuff` = `root`'s `sendbuff` (`sendbuff` is read on the
/// root only).
///
/// # Safety
/// Buffers valid for `count` elements (`comm` may be any handle: one not live is refused).
#[no_mangle]
pub unsafe extern "C" fn collBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    root: c_int,
    comm: collComm_t,
) -> collResult_t {
    let call = collCall_t {
        sendbuff,
        recvbuff,
        count,
        peer: root,
        ..collCall_t::new(collCallType_t::collCallBroadcast, datatype)
    };
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}

/// `recvbuff[i]` on `root` = op over ranks of `sendbuff[i]` (`recvbuff` is
/// written on the root only and may be NULL elsewhere).
///
/// # Safety
/// Buffers valid for `count` elements (`comm` may be any handle: one not live is refused).
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
    let call = collCall_t {
        sendbuff,
        recvbuff,
        count,
        op,
        peer: root,
        ..collCall_t::new(collCallType_t::collCallReduce, datatype)
    };
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}

/// Sends `count` elements to `peer`, whose collRecv must expect the same
/// count and datatype. Matched in order per pair of ranks, independently of
/// collectives.
///
/// # Safety
/// `sendbuff` valid for `count` elements (`comm` may be any handle: one not live is refused).
#[no_mangle]
pub unsafe extern "C" fn collSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: DataTypeArg,
    peer: c_int,
    comm: collComm_t,
) -> collResult_t {
    let call = collCall_t {
        sendbuff,
        count,
        peer,
        ..collCall_t::new(collCallType_t::collCallSend, datatype)
    };
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}

/// Receives `count` elements from `peer`.
///
/// # Safety
/// `recvbuff` valid for `count` elements (`comm` may be any handle: one not live is refused).
#[no_mangle]
pub unsafe extern "C" fn collRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    peer: c_int,
    comm: collComm_t,
) -> collResult_t {
    let call = collCall_t {
        recvbuff,
        count,
        peer,
        ..collCall_t::new(collCallType_t::collCallRecv, datatype)
    };
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}

/// Returns once every rank of `comm` has entered it.
///
/// # Safety
/// `comm` live.
#[no_mangle]
pub unsafe extern "C" fn collBarrier(comm: collComm_t) -> collResult_t {
    let call = collCall_t::new(collCallType_t::collCallBarrier, 1);
    // SAFETY: the caller's promise.
    unsafe { run(comm, &call, None) }
}
