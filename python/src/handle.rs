//! A call in flight, as Python sees it: `wait()` (GIL released, in slices
//! short enough that Ctrl-C raises KeyboardInterrupt within a second),
//! `is_done()`, and `add_done_callback(fn)`, whose callbacks run on one
//! completer thread holding the GIL, never on the progress thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use collectives::{AbortHandle, Ticket};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::Failure;

/// How long a wait sleeps between looks at pending signals.
const SLICE: Duration = Duration::from_millis(100);

#[derive(Default)]
struct State {
    result: Option<Result<(), Failure>>,
    callbacks: Vec<Py<PyAny>>,
    /// The arrays the call uses, released by the handle (which holds the
    /// GIL when it is waited on or collected), or by the completer if the
    /// handle went away before the call finished.
    keep: Vec<Py<PyAny>>,
    orphaned: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    done: Condvar,
}

/// A call in flight (returned by every method called with `async_op=True`).
#[pyclass(module = "collectives", frozen)]
pub struct Handle {
    shared: Arc<Shared>,
    ticket: Mutex<Option<Ticket>>,
    abort: AbortHandle,
    rank: usize,
}

/// What finishing a call hands the completer thread: callbacks to run and
/// the arrays the call kept alive, released with the GIL held.
struct Finished {
    callbacks: Vec<Py<PyAny>>,
    result: Result<(), Failure>,
    keep: Vec<Py<PyAny>>,
}

impl Handle {
    /// A pending handle, and the function that finishes it (called by the
    /// progress thread; `keep` is what must outlive the call).
    pub fn pending(
        abort: AbortHandle,
        rank: usize,
        keep: Vec<Py<PyAny>>,
    ) -> (
        Handle,
        impl FnOnce(collectives::Result<()>) + Send + 'static,
    ) {
        let shared = Arc::new(Shared::default());
        shared.state.lock().unwrap_or_else(|e| e.into_inner()).keep = keep;
        let finish = {
            let shared = shared.clone();
            move |r: collectives::Result<()>| {
                let result = r.map_err(Failure::from);
                let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
                state.result = Some(result.clone());
                let callbacks = std::mem::take(&mut state.callbacks);
                let keep = match state.orphaned {
                    true => std::mem::take(&mut state.keep),
                    false => Vec::new(),
                };
                drop(state);
                shared.done.notify_all();
                // Only callbacks, or arrays nobody else will release, need
                // the completer (and the GIL) here.
                if !callbacks.is_empty() || !keep.is_empty() {
                    let _ = completer().send(Finished {
                        callbacks,
                        result,
                        keep,
                    });
                }
            }
        };
        (
            Handle {
                shared,
                ticket: Mutex::new(None),
                abort,
                rank,
            },
            finish,
        )
    }

    /// The ticket by which a waiter drives the call (set once started).
    pub fn set_ticket(&self, ticket: Ticket) {
        *self.ticket.lock().unwrap_or_else(|e| e.into_inner()) = Some(ticket);
    }

    fn result(&self) -> Option<Result<(), Failure>> {
        let state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        state.result.clone()
    }

    /// Waits up to `timeout` (forever: `None`, driving the call on this
    /// thread): `Ok(true)` once done and successful. A pending signal
    /// (Ctrl-C) aborts the communicator, so the peers learn why, and raises
    /// once the call has ended (until then the library may use its arrays).
    pub fn wait_done(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<bool> {
        let ticket = self
            .ticket
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let (None, Some(ticket)) = (timeout, ticket) {
            let mut signal = None;
            py.detach(|| ticket.drive(&mut interrupt_check(&self.abort, self.rank, &mut signal)));
            if let Some(signal) = signal {
                self.wait_ended(py);
                return Err(signal);
            }
        }
        let start = Instant::now();
        loop {
            if let Some(r) = self.result() {
                return r.map(|()| true).map_err(PyErr::from);
            }
            let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
            if left == Some(Duration::ZERO) {
                return Ok(false);
            }
            let slice = left.map_or(SLICE, |l| l.min(SLICE));
            py.detach(|| {
                let state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
                let _ = (self.shared.done).wait_timeout_while(state, slice, |s| s.result.is_none());
            });
            if let Err(signal) = py.check_signals() {
                self.abort.abort(&interrupted(self.rank, &signal));
                self.wait_ended(py);
                return Err(signal);
            }
        }
    }

    /// Waits (GIL released) until the call ended, however.
    fn wait_ended(&self, py: Python<'_>) {
        py.detach(|| {
            let state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            drop((self.shared.done).wait_while(state, |s| s.result.is_none()));
        });
    }
}

/// What an interrupted rank tells its peers.
fn interrupted(rank: usize, signal: &PyErr) -> String {
    format!("rank {rank} was interrupted ({signal})")
}

/// A `tick` for the library's waits: looks for a pending signal (Ctrl-C)
/// and, on one, aborts the communicator (the wait then ends) and keeps the
/// exception in `signal` to raise.
pub fn interrupt_check<'a>(
    abort: &'a AbortHandle,
    rank: usize,
    signal: &'a mut Option<PyErr>,
) -> impl FnMut() + 'a {
    move || {
        if signal.is_some() {
            return;
        }
        if let Err(e) = Python::attach(|py| py.check_signals()) {
            abort.abort(&interrupted(rank, &e));
            *signal = Some(e);
        }
    }
}

impl Drop for Handle {
    /// Runs with the GIL held (a Python object's deallocation).
    fn drop(&mut self) {
        let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.result.is_some() {
            state.keep.clear();
        } else {
            state.orphaned = true;
        }
    }
}

#[pymethods]
impl Handle {
    /// Blocks until the call finished (or `timeout` seconds passed: then
    /// returns False), raising its error if it failed. Returns True once done.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        // 0 or less: only look. NaN, infinity and over a year are refused.
        let timeout = timeout
            .map(|t| match t <= 0.0 {
                true => Ok(Duration::ZERO),
                false => collectives::seconds(t).map_err(PyValueError::new_err),
            })
            .transpose()?;
        self.wait_done(py, timeout)
    }

    /// Whether the call finished (successfully or not).
    fn is_done(&self) -> bool {
        self.result().is_some()
    }

    /// Calls `fn(error)` once the call finished: `error` is None or the
    /// exception `wait()` would raise. Runs on a library thread holding
    /// the GIL (at once, here, if the call already finished).
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        match state.result.clone() {
            None => {
                state.callbacks.push(callback);
                Ok(())
            }
            Some(r) => {
                drop(state);
                callback.call1(py, (outcome(py, r),)).map(drop)
            }
        }
    }

    fn __repr__(&self) -> String {
        match self.result() {
            None => "<collectives.Handle pending>".into(),
            Some(Ok(())) => "<collectives.Handle done>".into(),
            Some(Err(f)) => format!("<collectives.Handle failed: {}>", f.message),
        }
    }
}

/// None, or the exception a failure raises.
fn outcome(py: Python<'_>, r: Result<(), Failure>) -> Py<PyAny> {
    match r {
        Ok(()) => py.None(),
        Err(f) => PyErr::from(f).into_value(py).into_any(),
    }
}

/// Set by an `atexit` hook: the interpreter is going away, and the
/// completer must not touch it any more (what it holds is left to the OS).
static EXITING: AtomicBool = AtomicBool::new(false);

/// Registered with `atexit` when the module loads.
#[pyfunction]
pub fn _at_exit() {
    EXITING.store(true, Ordering::SeqCst);
}

/// The completer thread's queue, started on first use.
fn completer() -> &'static Sender<Finished> {
    static QUEUE: OnceLock<Sender<Finished>> = OnceLock::new();
    QUEUE.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Finished>();
        std::thread::Builder::new()
            .name("collectives-completer".into())
            .spawn(move || {
                for f in rx {
                    if EXITING.load(Ordering::SeqCst) {
                        std::mem::forget(f);
                        continue;
                    }
                    Python::attach(|py| {
                        for cb in f.callbacks {
                            if let Err(e) = cb.call1(py, (outcome(py, f.result.clone()),)) {
                                e.write_unraisable(py, Some(cb.bind(py)));
                            }
                        }
                        drop(f.keep);
                    });
                }
            })
            .expect("start the completer thread");
        tx
    })
}
