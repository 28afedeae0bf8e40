//! Group calls, with NCCL's semantics: between collGroupStart and
//! collGroupEnd (nested: the outermost counts) calls are checked and
//! recorded and return collSuccess at once; the outermost collGroupEnd runs
//! each communicator's calls as one group (every transfer in flight at
//! once, small AllReduces fused; see the library's `Group`) and reports the
//! first failure. On a non-blocking communicator it returns collInProgress.

use std::cell::RefCell;
use std::ffi::c_void;

use collectives::{CallArgs, Communicator};

use crate::boundary::{guard, with_comm, with_live, Failure};
use crate::{collComm_t, collResult_t};

/// A call recorded in a group. Addresses, not pointers: the caller vouches
/// for the memory until the group ends, on whichever thread runs it.
struct Recorded {
    comm: usize,
    args: CallArgs,
    send: usize,
    recv: usize,
    count: usize,
}

#[derive(Default)]
struct Recording {
    depth: usize,
    calls: Vec<Recorded>,
}

thread_local! {
    static GROUP: RefCell<Recording> = RefCell::new(Recording::default());
}

/// Whether this thread is inside collGroupStart / collGroupEnd.
pub(crate) fn recording() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// Checks a call and records it for collGroupEnd.
///
/// # Safety
/// The buffers must stay valid until the group ends.
pub(crate) unsafe fn record(
    comm: collComm_t,
    args: impl FnOnce(usize) -> Result<CallArgs, Failure>,
    send: *const u8,
    recv: *mut u8,
    count: usize,
) -> collResult_t {
    with_live(comm, |c| {
        let args = args(c.size as usize)?;
        GROUP.with(|g| {
            g.borrow_mut().calls.push(Recorded {
                comm: comm as usize,
                args,
                send: send as usize,
                recv: recv as usize,
                count,
            })
        });
        Ok(())
    })
}

/// Starts (or nests) a group: later calls on this thread are recorded.
#[no_mangle]
pub extern "C" fn collGroupStart() -> collResult_t {
    GROUP.with(|g| g.borrow_mut().depth += 1);
    collResult_t::collSuccess
}

/// Ends a group; the outermost end runs what was recorded (see the module
/// docs) and returns its first failure.
///
/// # Safety
/// Every buffer recorded since collGroupStart must still be valid (for a
/// non-blocking communicator: until collCommGetAsyncError says done).
#[no_mangle]
pub unsafe extern "C" fn collGroupEnd() -> collResult_t {
    let ended = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        match g.depth {
            0 => None,
            1 => {
                g.depth = 0;
                Some(std::mem::take(&mut g.calls))
            }
            _ => {
                g.depth -= 1;
                Some(Vec::new())
            }
        }
    });
    let Some(mut calls) = ended else {
        return guard(None, || {
            Err(Failure {
                code: collResult_t::collInvalidUsage,
                message: "collGroupEnd without collGroupStart".into(),
            })
        });
    };
    // One group per communicator, in the order they first appear.
    let mut result = collResult_t::collSuccess;
    while let Some(first) = calls.first().map(|c| c.comm) {
        let (mine, rest) = calls.into_iter().partition(|c| c.comm == first);
        calls = rest;
        // SAFETY: the caller's promise.
        let r = unsafe { run(first as collComm_t, mine) };
        if result == collResult_t::collSuccess {
            result = r;
        }
    }
    result
}

/// Runs one communicator's recorded calls as a group.
///
/// # Safety
/// As collGroupEnd.
unsafe fn run(comm: collComm_t, calls: Vec<Recorded>) -> collResult_t {
    let job = move |cm: &mut Communicator| -> collectives::Result<()> {
        let mut group = cm.group();
        let mut first_error = None;
        for r in &calls {
            // SAFETY: the caller of collGroupEnd vouches for the memory.
            let added = unsafe {
                group.call_raw(
                    &r.args,
                    r.send as *const u8,
                    r.recv as *mut c_void as *mut u8,
                    r.count,
                )
            };
            if let Err(e) = added {
                first_error.get_or_insert(e);
            }
        }
        let ended = group.end();
        match first_error {
            Some(e) => Err(e),
            None => ended,
        }
    };
    with_comm(comm, |c, inner| {
        if c.blocking {
            return Ok(inner.submit(job).wait()?);
        }
        inner.run_then(job, c.begin_background());
        Err(Failure::in_progress())
    })
}
