//! Requests: calls started by `collStart`, as MPI's requests (wait, test)
//! with a completion callback for bindings that complete futures of their
//! own (a torch Work). A request's result outlives its communicator.

use std::ffi::{c_int, c_void, CString};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use collectives::{AsyncCommunicator, Buffers, CallArgs, Ticket};

use crate::boundary::{guard, put, Failure};
use crate::collResult_t;

/// Called once when a request's call ended, with `arg` and its result: on
/// the thread that finished the call (a library thread, or a waiter), or at
/// once in collRequestOnDone if it already had. It must be quick and must
/// not call the library (wake a thread, set a flag).
pub type collRequestCallback_t =
    Option<unsafe extern "C" fn(arg: *mut c_void, result: collResult_t)>;

/// A started call (opaque).
pub struct collRequest {
    state: Arc<State>,
    ticket: Ticket,
}

/// A request handle.
pub type collRequest_t = *mut collRequest;

#[derive(Default)]
struct State {
    inner: Mutex<Inner>,
    done: Condvar,
}

#[derive(Default)]
struct Inner {
    /// The call's result and its message, once it ended.
    result: Option<(collResult_t, CString)>,
    /// The callback and its argument (an address: C vouches for it).
    on_done: Option<(unsafe extern "C" fn(*mut c_void, collResult_t), usize)>,
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the call's result, wakes the waiters, calls the callback.
    fn finish(&self, r: collectives::Result<()>) {
        let (code, text) = match r {
            Ok(()) => (collResult_t::collSuccess, CString::default()),
            Err(e) => {
                let f = Failure::from(e);
                (
                    f.code,
                    CString::new(f.message.replace('\0', " ")).unwrap_or_default(),
                )
            }
        };
        let mut inner = self.lock();
        inner.result = Some((code, text));
        let on_done = inner.on_done.take();
        drop(inner);
        self.done.notify_all();
        if let Some((f, arg)) = on_done {
            // SAFETY: C registered `f` with `arg` for exactly this.
            unsafe { f(arg as *mut c_void, code) };
        }
    }

    fn code(&self) -> Option<collResult_t> {
        self.lock().result.as_ref().map(|(code, _)| *code)
    }
}

/// Starts `args` on `bufs` and makes its request; `workspace` is the
/// address of the call's boxed workspace, freed when it ends.
///
/// # Safety
/// The buffers must stay valid until the call ended.
pub(crate) unsafe fn start(
    inner: &AsyncCommunicator,
    args: CallArgs,
    bufs: Buffers<'_>,
    workspace: usize,
) -> collRequest_t {
    let state = Arc::new(State::default());
    let finish = state.clone();
    // SAFETY: the caller's promise; the workspace lives until the call ended.
    let ticket = unsafe {
        inner.start_bytes_then(args, bufs, move |r| {
            drop(Box::from_raw(workspace as *mut Vec<u64>));
            finish.finish(r)
        })
    };
    Box::into_raw(Box::new(collRequest { state, ticket }))
}

/// # Safety
/// `request` NULL or live.
unsafe fn request_ref<'a>(request: collRequest_t) -> Result<&'a collRequest, Failure> {
    // SAFETY: the caller's promise; null is checked by `as_ref`.
    unsafe { request.as_ref() }.ok_or_else(|| Failure::invalid("request is NULL"))
}

/// Waits for the request's call: `timeoutMs < 0` until it ended (driving it
/// on this thread, the fastest way), else up to that long. Returns the
/// call's result (its message in collRequestGetError), or collInProgress
/// if the time ran out first.
///
/// # Safety
/// `request` must be NULL or live.
#[no_mangle]
pub unsafe extern "C" fn collRequestWait(request: collRequest_t, timeoutMs: c_int) -> collResult_t {
    let mut code = collResult_t::collInProgress;
    let r = guard(None, || {
        // SAFETY: the caller's promise.
        let req = unsafe { request_ref(request)? };
        if timeoutMs < 0 {
            req.ticket.drive(&mut || {});
        }
        // (When the communicator went away first, its calls still end: wait.)
        let limit = Duration::from_millis(timeoutMs.max(0) as u64);
        let inner = req.state.lock();
        let wait = |i: &mut Inner| i.result.is_none();
        let done = &req.state.done;
        let inner = match timeoutMs < 0 {
            true => done
                .wait_while(inner, wait)
                .unwrap_or_else(|e| e.into_inner()),
            false => {
                done.wait_timeout_while(inner, limit, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
        code = inner.result.as_ref().map_or(code, |(c, _)| *c);
        Ok(())
    });
    match r {
        collResult_t::collSuccess => code,
        failed => failed,
    }
}

/// Whether the request's call ended: `*done` is 1 (then collRequestWait
/// returns at once) or 0.
///
/// # Safety
/// `request` must be NULL or live; `done` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn collRequestTest(request: collRequest_t, done: *mut c_int) -> collResult_t {
    guard(None, || {
        // SAFETY: the caller's promise.
        let req = unsafe { request_ref(request)? };
        let ended = req.state.code().is_some();
        // SAFETY: the caller's promise.
        unsafe { put(done, "done", ended as c_int) }
    })
}

/// Has `callback(arg, result)` called once the request's call ended (see
/// collRequestCallback_t); at most one callback per request.
///
/// # Safety
/// `request` must be NULL or live; `arg` valid for whatever `callback`
/// does with it until it is called.
#[no_mangle]
pub unsafe extern "C" fn collRequestOnDone(
    request: collRequest_t,
    callback: collRequestCallback_t,
    arg: *mut c_void,
) -> collResult_t {
    guard(None, || {
        // SAFETY: the caller's promise.
        let req = unsafe { request_ref(request)? };
        let f = callback.ok_or_else(|| Failure::invalid("callback is NULL"))?;
        let mut inner = req.state.lock();
        if inner.on_done.is_some() {
            return Err(Failure::invalid("the request already has a callback"));
        }
        // Kept even when called at once below: a second callback is refused
        // whether or not the call had ended.
        inner.on_done = Some((f, arg as usize));
        match inner.result.as_ref().map(|(code, _)| *code) {
            None => {}
            Some(code) => {
                drop(inner);
                // SAFETY: the caller's promise.
                unsafe { f(arg, code) };
            }
        }
        Ok(())
    })
}

/// The message of the request's failed call (naming the rank, the peer and
/// the call), or "" while it runs or when it succeeded. Valid until the
/// request is freed.
///
/// # Safety
/// `request` must be a live request.
#[no_mangle]
pub unsafe extern "C" fn collRequestGetError(request: collRequest_t) -> *const std::ffi::c_char {
    // SAFETY: the caller's promise.
    match unsafe { request.as_ref() } {
        None => c"request is NULL".as_ptr(),
        Some(req) => match &req.state.lock().result {
            // The CString's heap buffer stays put while the request lives.
            Some((_, text)) => text.as_ptr(),
            None => c"".as_ptr(),
        },
    }
}

/// Frees a request. A call still running goes on (its buffers must stay
/// valid until it ended; its callback is still called).
///
/// # Safety
/// `request` must be NULL or live, and not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn collRequestFree(request: collRequest_t) -> collResult_t {
    if request.is_null() {
        return collResult_t::collSuccess;
    }
    guard(None, || {
        // SAFETY: made by Box::into_raw in `start`; the caller gives it up.
        drop(unsafe { Box::from_raw(request) });
        Ok(())
    })
}
