//! `collectives.Communicator`: every call is started on the library's
//! progress thread and, unless `async_op=True`, waited for with the GIL
//! released. Calls are in place where one array is given; send and
//! receive arrays must share a dtype.

use collectives::bootstrap::UniqueId;
use collectives::{
    AbortHandle, AsyncCommunicator, Buffers, CallArgs, Collective, Config, ReduceOp, VarCounts,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::buffers::{array, Array};
use crate::errors::to_py;
use crate::handle::{interrupt_check, Handle};

/// One rank's communicator (see the package docs).
#[pyclass(module = "collectives", frozen)]
pub struct Communicator {
    pub(crate) inner: std::sync::Mutex<Option<AsyncCommunicator>>,
    abort: AbortHandle,
    rank: usize,
    size: usize,
}

impl Communicator {
    fn wrap(comm: collectives::Communicator) -> Self {
        let (rank, size, abort) = (comm.rank(), comm.size(), comm.abort_handle());
        Communicator {
            inner: std::sync::Mutex::new(Some(AsyncCommunicator::new(comm))),
            abort,
            rank,
            size,
        }
    }

    /// `f` on the communicator, unless it was closed.
    fn with<T>(&self, f: impl FnOnce(&AsyncCommunicator) -> T) -> PyResult<T> {
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let comm = guard
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the communicator was closed"))?;
        Ok(f(comm))
    }

    /// Runs `args` on the arrays (`output` `None`: nothing is written;
    /// `input` `None`: in place on `output`): on this thread with the GIL
    /// released, or, with `async_op`, in the background, keeping the
    /// arrays alive until it finished.
    fn start(
        &self,
        py: Python<'_>,
        args: CallArgs,
        input: Option<Array>,
        output: Option<Array>,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        // SAFETY: the arrays stay alive until the call finished: held by
        // this frame through a blocking call, by the handle's `finish`
        // closure through an async one (Python code must not touch them in
        // flight: the documented contract of async_op=True).
        let bufs = unsafe {
            match (&input, &output) {
                (None, Some(o)) => Buffers::InPlace(o.bytes_mut()),
                (Some(i), Some(o)) => Buffers::OutOfPlace {
                    send: i.bytes(),
                    recv: o.bytes_mut(),
                },
                (Some(i), None) => Buffers::OutOfPlace {
                    send: i.bytes(),
                    recv: &mut [],
                },
                (None, None) => Buffers::InPlace(&mut []),
            }
        };
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let comm = guard
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the communicator was closed"))?;
        if !async_op {
            let mut signal = None;
            let mut tick = interrupt_check(&self.abort, self.rank, &mut signal);
            // SAFETY: as above; this frame holds the arrays until it returns.
            let result = py.detach(|| unsafe { comm.call_bytes(&args, bufs, &mut tick) });
            drop(tick);
            if let Some(signal) = signal {
                return Err(signal);
            }
            return result.map(|()| None).map_err(to_py);
        }
        let keep = input
            .iter()
            .chain(&output)
            .map(|a| a.owner.clone_ref(py))
            .collect();
        let (handle, finish) = Handle::pending(self.abort.clone(), self.rank, keep);
        // SAFETY: as above.
        let ticket = unsafe { comm.start_bytes_then(args, bufs, finish) };
        handle.set_ticket(ticket);
        Ok(Some(handle))
    }
}

/// The dtype two arrays share, or a TypeError naming both.
fn same_dtype(send: &Array, recv: &Array) -> PyResult<collectives::DataType> {
    if send.dtype != recv.dtype {
        return Err(PyTypeError::new_err(format!(
            "send is {} but recv is {}: both must have one dtype",
            send.dtype, recv.dtype
        )));
    }
    Ok(send.dtype)
}

fn op(name: &str) -> PyResult<ReduceOp> {
    name.parse::<ReduceOp>()
        .map_err(|_| PyValueError::new_err(format!("op '{name}': one of sum, prod, min, max, avg")))
}

/// An out-of-place pair, or in place when `recv` is `send` itself.
fn pair(
    send: &Bound<'_, PyAny>,
    recv: &Bound<'_, PyAny>,
) -> PyResult<(Option<Array>, Array, collectives::DataType)> {
    let out = array(recv, "recv", true)?;
    if send.is(recv) {
        let dtype = out.dtype;
        return Ok((None, out, dtype));
    }
    let input = array(send, "send", false)?;
    let dtype = same_dtype(&input, &out)?;
    Ok((Some(input), out, dtype))
}

#[pymethods]
impl Communicator {
    /// Joins the job the environment describes: torchrun's RANK,
    /// WORLD_SIZE, MASTER_ADDR, MASTER_PORT; Open MPI's or MPICH's mpirun;
    /// Slurm. Blocks until every rank has joined.
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<Self> {
        py.detach(collectives::Communicator::from_env)
            .map(Self::wrap)
            .map_err(to_py)
    }

    /// Joins the job a `unique_id()` names, as rank `rank` of `size`.
    /// `timeout` (seconds) overrides COLL_TIMEOUT.
    #[staticmethod]
    #[pyo3(signature = (rank, size, unique_id, timeout=None))]
    fn init(
        py: Python<'_>,
        rank: usize,
        size: usize,
        unique_id: &[u8],
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let id = UniqueId::from_bytes(unique_id).map_err(PyValueError::new_err)?;
        let boot = id.bootstrap(rank, size).map_err(PyValueError::new_err)?;
        let mut config = Config::from_env().map_err(PyValueError::new_err)?;
        if let Some(t) = timeout {
            config.timeout = collectives::seconds(t).map_err(PyValueError::new_err)?;
        }
        py.detach(|| collectives::Communicator::init(boot, config))
            .map(Self::wrap)
            .map_err(to_py)
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// `a[i] = op over ranks of a[i]`, in place.
    #[pyo3(signature = (a, op="sum", *, async_op=false))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        a: &Bound<'_, PyAny>,
        op: &str,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let a = array(a, "a", true)?;
        let args = CallArgs::new(Collective::AllReduce, a.dtype).op(self::op(op)?);
        self.start(py, args, None, Some(a), async_op)
    }

    /// Block j of `send` goes to rank j; block j of `recv` comes from rank
    /// j (`recv` may be `send`: in place).
    #[pyo3(signature = (send, recv, *, async_op=false))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let (input, output, dtype) = pair(send, recv)?;
        self.start(
            py,
            CallArgs::new(Collective::AllToAll, dtype),
            input,
            Some(output),
            async_op,
        )
    }

    /// AllToAll with a count per peer: `send_counts[j]` elements of `send`
    /// (blocks one after another) go to rank j, `recv_counts[j]` from rank
    /// j land in `recv`, packed the same way.
    #[pyo3(signature = (send, send_counts, recv, recv_counts, *, async_op=false))]
    fn all_to_all_v(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        send_counts: Vec<usize>,
        recv: &Bound<'_, PyAny>,
        recv_counts: Vec<usize>,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let (input, output) = (array(send, "send", false)?, array(recv, "recv", true)?);
        let dtype = same_dtype(&input, &output)?;
        let args = CallArgs::all_to_all_v(dtype, VarCounts::packed(&send_counts, &recv_counts));
        self.start(py, args, Some(input), Some(output), async_op)
    }

    /// `recv` = block `rank` of (op over ranks of `send`), `send` holding
    /// one block of `len(recv)` elements per rank.
    #[pyo3(signature = (send, recv, op="sum", *, async_op=false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        op: &str,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let (input, output, dtype) = pair(send, recv)?;
        let args = CallArgs::new(Collective::ReduceScatter, dtype).op(self::op(op)?);
        self.start(py, args, input, Some(output), async_op)
    }

    /// Block j of `recv` (each `len(send)` elements) = rank j's `send`.
    #[pyo3(signature = (send, recv, *, async_op=false))]
    fn all_gather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let (input, output, dtype) = pair(send, recv)?;
        self.start(
            py,
            CallArgs::new(Collective::AllGather, dtype),
            input,
            Some(output),
            async_op,
        )
    }

    /// Every rank's `a` becomes rank `root`'s.
    #[pyo3(signature = (a, root=0, *, async_op=false))]
    fn broadcast(
        &self,
        py: Python<'_>,
        a: &Bound<'_, PyAny>,
        root: usize,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let a = array(a, "a", true)?;
        let args = CallArgs::new(Collective::Broadcast, a.dtype).root(root);
        self.start(py, args, None, Some(a), async_op)
    }

    /// `recv` on `root` = op over ranks of `send` (elsewhere `recv` is
    /// workspace and ends with partial results).
    #[pyo3(signature = (send, recv, op="sum", root=0, *, async_op=false))]
    fn reduce(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        op: &str,
        root: usize,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let (input, output, dtype) = pair(send, recv)?;
        let args = CallArgs::new(Collective::Reduce, dtype)
            .op(self::op(op)?)
            .root(root);
        self.start(py, args, input, Some(output), async_op)
    }

    /// Sends `a` to rank `peer`, whose `recv` must expect the same count
    /// and dtype (matched in order per pair of ranks).
    #[pyo3(signature = (a, peer, *, async_op=false))]
    fn send(
        &self,
        py: Python<'_>,
        a: &Bound<'_, PyAny>,
        peer: usize,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let a = array(a, "a", false)?;
        let args = CallArgs::send_to(a.dtype, peer);
        self.start(py, args, Some(a), None, async_op)
    }

    /// Receives into `a` the next message rank `peer` sends this rank.
    #[pyo3(signature = (a, peer, *, async_op=false))]
    fn recv(
        &self,
        py: Python<'_>,
        a: &Bound<'_, PyAny>,
        peer: usize,
        async_op: bool,
    ) -> PyResult<Option<Handle>> {
        let a = array(a, "a", true)?;
        let args = CallArgs::recv_from(a.dtype, peer);
        self.start(py, args, None, Some(a), async_op)
    }

    /// Returns once every rank has entered the barrier.
    #[pyo3(signature = (*, async_op=false))]
    fn barrier(&self, py: Python<'_>, async_op: bool) -> PyResult<Option<Handle>> {
        let args = CallArgs::new(Collective::Barrier, collectives::DataType::U8);
        self.start(py, args, None, None, async_op)
    }

    /// A group of calls, run together at the end of a ``with`` block: every
    /// transfer in flight at once (so a ring of sends and receives cannot
    /// deadlock), small AllReduces fused into one, sends to and receives
    /// from this rank itself copied::
    ///
    ///     with comm.group() as g:
    ///         g.send(out, (comm.rank + 1) % comm.size)
    ///         g.recv(inp, (comm.rank - 1) % comm.size)
    fn group(slf: Py<Self>) -> crate::group::Group {
        crate::group::Group::new(slf)
    }

    /// Ranks with the same `color` form a new communicator, ranked by `key`
    /// (then by rank here); `color=None` (or negative) opts out and returns
    /// None. Every rank must call it.
    #[pyo3(signature = (color, key=0))]
    fn split(
        &self,
        py: Python<'_>,
        color: Option<i64>,
        key: i64,
    ) -> PyResult<Option<Communicator>> {
        let color = color.and_then(|c| u32::try_from(c).ok());
        let pending = {
            let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            let comm = guard
                .as_ref()
                .ok_or_else(|| PyRuntimeError::new_err("the communicator was closed"))?;
            comm.split(color, key)
        };
        let child = py.detach(|| pending.wait()).map_err(to_py)?;
        Ok(child.map(Self::wrap))
    }

    /// The ranks that failed, the same list on every survivor (each must
    /// call it): their process is gone, their communicator was closed, or
    /// they did not answer within 2 s (their host could not be reached for
    /// 10 s). Works after a failure or an abort.
    fn failed_ranks(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        let pending = self.with(|c| c.failed_ranks())?;
        py.detach(|| pending.wait()).map_err(to_py)
    }

    /// A communicator of the ranks not in `excluded` (nor failed
    /// meanwhile), renumbered in order; every survivor calls it, excluded
    /// ranks do not. `abort=True` first ends the calls in flight here (needed
    /// when one may be stuck on a failed rank). If a rank dies during the
    /// shrink it raises: call `failed_ranks()` and shrink again.
    #[pyo3(signature = (excluded, abort=false))]
    fn shrink(&self, py: Python<'_>, excluded: Vec<usize>, abort: bool) -> PyResult<Communicator> {
        let pending = self.with(|c| c.shrink(excluded, abort))?;
        let child = py.detach(|| pending.wait()).map_err(to_py)?;
        Ok(Self::wrap(child))
    }

    /// Aborts the communicator: calls in flight and later ones fail, and
    /// every peer's pending or next call fails naming this rank and `reason`.
    /// Safe from any thread.
    #[pyo3(signature = (reason="aborted by the application"))]
    fn abort(&self, reason: &str) {
        self.abort.abort(reason);
    }

    /// Finishes the calls in flight and closes the connections (also at
    /// the end of a `with` block). Later calls raise.
    fn close(&self, py: Python<'_>) {
        let comm = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.detach(|| drop(comm));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: Py<PyAny>, _v: Py<PyAny>, _tb: Py<PyAny>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        format!(
            "<collectives.Communicator rank {} of {}>",
            self.rank, self.size
        )
    }
}
