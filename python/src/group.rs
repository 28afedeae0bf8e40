//! `Communicator.group()`: calls recorded in a `with` block run together at
//! its end (every transfer in flight at once, small AllReduces fused), as
//! the library's `Group` does; the first error is raised there.

use std::sync::Mutex;

use collectives::{Buffers, CallArgs, Collective, Communicator as Native, ReduceOp};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::buffers::{array, Array};
use crate::comm::Communicator;
use crate::errors::to_py;

/// An array by address and length, to cross to the thread that runs the group.
type Raw = (usize, usize);

/// A recorded call: its arguments and arrays (kept alive by the group).
struct Recorded {
    args: CallArgs,
    input: Option<Array>,
    output: Option<Array>,
}

/// Calls recorded for one run (see ``Communicator.group``).
#[pyclass(module = "collectives", frozen)]
pub struct Group {
    comm: Py<Communicator>,
    calls: Mutex<Vec<Recorded>>,
}

impl Group {
    pub fn new(comm: Py<Communicator>) -> Self {
        Group {
            comm,
            calls: Mutex::new(Vec::new()),
        }
    }

    fn add(&self, args: CallArgs, input: Option<Array>, output: Option<Array>) {
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.push(Recorded {
            args,
            input,
            output,
        });
    }

    /// Runs the recorded calls as one group (GIL released).
    fn run(&self, py: Python<'_>) -> PyResult<()> {
        let calls = std::mem::take(&mut *self.calls.lock().unwrap_or_else(|e| e.into_inner()));
        // Addresses cross to the thread that runs the group; the arrays
        // stay alive in `calls` here until it returns.
        let jobs: Vec<(CallArgs, Option<Raw>, Option<Raw>)> = calls
            .iter()
            .map(|c| {
                let raw = |a: &Array| (a.ptr as usize, a.len);
                (
                    c.args.clone(),
                    c.input.as_ref().map(raw),
                    c.output.as_ref().map(raw),
                )
            })
            .collect();
        let run = move |comm: &mut Native| -> collectives::Result<()> {
            let mut group = comm.group();
            for (args, input, output) in &jobs {
                // SAFETY: the arrays are kept alive by the Python group
                // until this returns, and nobody else touches them meanwhile.
                let bytes = |(p, n): Raw| unsafe {
                    std::slice::from_raw_parts_mut(
                        if n == 0 {
                            std::ptr::dangling_mut()
                        } else {
                            p as *mut u8
                        },
                        n,
                    )
                };
                let bufs = match (input, output) {
                    (None, Some(o)) => Buffers::InPlace(bytes(*o)),
                    (Some(i), o) => Buffers::OutOfPlace {
                        send: bytes(*i),
                        recv: o.map_or(&mut [][..], bytes),
                    },
                    (None, None) => Buffers::InPlace(&mut []),
                };
                group.call(args, bufs)?;
            }
            group.end()
        };
        let comm = self.comm.get();
        let pending = comm.with_async(|c| c.submit(run))?;
        let result = py.detach(|| pending.wait());
        drop(calls);
        result.map_err(to_py)
    }
}

#[pymethods]
impl Group {
    /// Records a send of `a` to `peer` (this rank included).
    fn send(&self, a: &Bound<'_, PyAny>, peer: usize) -> PyResult<()> {
        let a = array(a, "a", false)?;
        self.add(CallArgs::send_to(a.dtype, peer), Some(a), None);
        Ok(())
    }

    /// Records a receive from `peer` (this rank included) into `a`.
    fn recv(&self, a: &Bound<'_, PyAny>, peer: usize) -> PyResult<()> {
        let a = array(a, "a", true)?;
        self.add(CallArgs::recv_from(a.dtype, peer), None, Some(a));
        Ok(())
    }

    /// Records an in-place AllReduce of `a` (small ones are fused).
    #[pyo3(signature = (a, op="sum"))]
    fn all_reduce(&self, a: &Bound<'_, PyAny>, op: &str) -> PyResult<()> {
        let a = array(a, "a", true)?;
        let op = op.parse::<ReduceOp>().map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "op '{op}': one of sum, prod, min, max, avg"
            ))
        })?;
        self.add(
            CallArgs::new(Collective::AllReduce, a.dtype).op(op),
            None,
            Some(a),
        );
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Runs the group unless the block raised.
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<Py<PyAny>>,
        _value: Option<Py<PyAny>>,
        _tb: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        if exc_type.is_some() {
            self.calls.lock().unwrap_or_else(|e| e.into_inner()).clear();
            return Ok(());
        }
        self.run(py)
    }

    fn __repr__(&self) -> String {
        let n = self.calls.lock().unwrap_or_else(|e| e.into_inner()).len();
        format!("<collectives.Group of {n} call(s)>")
    }
}

impl Communicator {
    /// `f` on the async communicator, or an error once it was closed.
    pub fn with_async<R>(
        &self,
        f: impl FnOnce(&collectives::AsyncCommunicator) -> R,
    ) -> PyResult<R> {
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let comm = guard
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the communicator was closed"))?;
        Ok(f(comm))
    }
}
