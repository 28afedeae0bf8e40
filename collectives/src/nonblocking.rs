//! Non-blocking calls: a progress thread owns the [`Communicator`], starts
//! each call as it arrives and steps every call in flight while the caller
//! computes; each start returns a [`Handle`] to wait on or test.
//! Collectives run in start order among themselves (every rank starts the
//! same sequence); point-to-point calls progress at once, concurrently with
//! each other and with collectives, matched in order per pair of ranks, so
//! `isend(next); irecv(prev)` completes at any size.
//!
//! Buffers are moved in and handed back by the handle, so the borrow checker
//! guarantees nobody touches them while they are in flight (the role MPI
//! gives to "do not access the buffer before MPI_Wait").
//!
//! ```no_run
//! use collectives::{AsyncCommunicator, Communicator, ReduceOp};
//!
//! let comm = AsyncCommunicator::new(Communicator::from_env()?);
//! let pending = comm.all_reduce(vec![1.0f32; 1 << 20], ReduceOp::Avg);
//! // ... compute the next bucket of gradients ...
//! let grads = pending.wait()?;
//! # Ok::<(), collectives::Error>(())
//! ```

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::args::{CallArgs, VarCounts};
use crate::doorbell::Doorbell;
use crate::inflight::{CallId, RawBuf};
use crate::{
    AbortHandle, Buffers, Collective, Communicator, DataType, Element, Error, Rank, ReduceOp,
    Result,
};

/// What the progress thread is asked to do.
enum Job {
    /// Start a call on buffers kept alive by `done`, which receives the result.
    Call {
        args: CallArgs,
        input: Option<RawBuf>,
        output: RawBuf,
        done: Reply,
    },
    /// Run a closure on the communicator, between steps.
    Run(Box<dyn FnOnce(&mut Communicator) + Send>),
}

/// Hands a call's result (and its buffers) back to its handle.
type Reply = Box<dyn FnOnce(Result<()>) + Send>;

/// A communicator whose calls run on a background thread (see the module
/// docs for the order they run in).
pub struct AsyncCommunicator {
    jobs: Option<mpsc::Sender<Job>>,
    doorbell: Arc<Doorbell>,
    abort: AbortHandle,
    thread: Option<JoinHandle<Communicator>>,
    rank: Rank,
    size: usize,
}

/// An operation in flight; its result (the buffer, back) once done.
#[must_use = "an operation's errors are only seen by waiting on its handle"]
pub struct Handle<T> {
    result: mpsc::Receiver<Result<T>>,
    done: Option<Result<T>>,
    rank: Rank,
}

impl<T> Handle<T> {
    /// Blocks until the operation is done.
    pub fn wait(mut self) -> Result<T> {
        if let Some(r) = self.done.take() {
            return r;
        }
        self.result.recv().unwrap_or_else(|_| Err(gone(self.rank)))
    }

    /// Whether the operation is done (then [`wait`](Self::wait) returns at once).
    pub fn test(&mut self) -> bool {
        self.wait_for(Duration::ZERO)
    }

    /// Waits up to `timeout` for the operation; whether it is done. Lets a
    /// caller that must stay responsive (to signals, say) wait in slices.
    pub fn wait_for(&mut self, timeout: Duration) -> bool {
        if self.done.is_none() {
            self.done = match self.result.recv_timeout(timeout) {
                Ok(r) => Some(r),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => Some(Err(gone(self.rank))),
            };
        }
        self.done.is_some()
    }
}

fn gone(rank: Rank) -> Error {
    Error::Aborted {
        rank,
        reason: "the progress thread ended before the operation completed".into(),
    }
}

impl AsyncCommunicator {
    /// Moves `comm` onto a progress thread of its own.
    pub fn new(comm: Communicator) -> Self {
        let (rank, size, abort) = (comm.rank(), comm.size(), comm.abort_handle());
        let doorbell = Arc::new(Doorbell::new().expect("eventfd for the progress thread"));
        let (jobs, queue) = mpsc::channel::<Job>();
        let bell = doorbell.clone();
        let thread = std::thread::Builder::new()
            .name(format!("coll-progress-{rank}"))
            .spawn(move || progress(comm, queue, &bell))
            .expect("cannot start the progress thread");
        AsyncCommunicator {
            jobs: Some(jobs),
            doorbell,
            abort,
            thread: Some(thread),
            rank,
            size,
        }
    }

    pub fn rank(&self) -> Rank {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Aborts the communicator from this thread: every call in flight and
    /// every later one fails, and the peers are told (see [`AbortHandle`]).
    pub fn abort(&self, reason: &str) {
        self.abort.abort(reason);
    }

    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }

    fn post_job(&self, job: Job) {
        let jobs = self.jobs.as_ref().expect("jobs is only taken on drop");
        // A send fails only if the thread is gone; the handle then says so.
        let _ = jobs.send(job);
        self.doorbell.ring();
    }

    /// Runs `f` on the progress thread after every call started before it
    /// has started (calls in flight go on progressing while `f` blocks).
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Communicator) -> Result<R> + Send + 'static,
    ) -> Handle<R> {
        let (tx, result) = mpsc::channel();
        self.post_job(Job::Run(Box::new(move |comm| {
            // The caller may have dropped the handle: nothing to tell then.
            let _ = tx.send(f(comm));
        })));
        self.handle(result)
    }

    fn handle<T>(&self, result: mpsc::Receiver<Result<T>>) -> Handle<T> {
        Handle {
            result,
            done: None,
            rank: self.rank,
        }
    }

    /// Starts the call `args` on `bufs` (see [`Communicator::call`]), which
    /// `keep` owns; the handle gives `out(keep)` when the call finished.
    fn start_owned<K: Send + 'static, R: Send + 'static>(
        &self,
        args: CallArgs,
        (input, output): (Option<RawBuf>, RawBuf),
        keep: K,
        out: fn(K) -> R,
    ) -> Handle<R> {
        let (tx, result) = mpsc::channel();
        let done: Reply = Box::new(move |r| {
            let _ = tx.send(r.map(|()| out(keep)));
        });
        self.post_job(Job::Call {
            args,
            input,
            output,
            done,
        });
        self.handle(result)
    }

    /// Starts the call `args` on caller-owned byte buffers.
    ///
    /// # Safety
    /// The buffers must stay valid and untouched until the handle reports
    /// the call done (or this communicator is dropped, which waits for it).
    pub unsafe fn start_bytes(&self, args: CallArgs, bufs: Buffers<'_>) -> Handle<()> {
        self.start_owned(args, raw_bufs(bufs), (), same)
    }

    /// Starts the call `args` on caller-owned byte buffers; `done` gets its
    /// result, on the progress thread, once it finished (for bindings that
    /// complete their own futures).
    ///
    /// # Safety
    /// As [`start_bytes`](Self::start_bytes), until `done` is called.
    pub unsafe fn start_bytes_then(
        &self,
        args: CallArgs,
        bufs: Buffers<'_>,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) {
        let (input, output) = raw_bufs(bufs);
        self.post_job(Job::Call {
            args,
            input,
            output,
            done: Box::new(done),
        });
    }

    /// In-place AllReduce of `buf`.
    pub fn all_reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Handle<Vec<T>> {
        let args = CallArgs::new(Collective::AllReduce, T::DTYPE).op(op);
        // The Vec's heap buffer does not move when the Vec does.
        let bufs = (None, raw_mut(&mut buf));
        self.start_owned(args, bufs, buf, same)
    }

    /// In-place AllToAll of `buf`.
    pub fn all_to_all<T: Element>(&self, mut buf: Vec<T>) -> Handle<Vec<T>> {
        let args = CallArgs::new(Collective::AllToAll, T::DTYPE);
        let bufs = (None, raw_mut(&mut buf));
        self.start_owned(args, bufs, buf, same)
    }

    /// AllToAllv of `send` into a new buffer of `counts.total_received()`
    /// elements (with `counts`' displacements, it may need more: the end of
    /// the last receive block).
    pub fn all_to_all_v<T: Element>(&self, send: Vec<T>, counts: VarCounts) -> Handle<Vec<T>> {
        let len = (counts.recv_counts.iter().zip(&counts.recv_displs))
            .map(|(c, d)| c + d)
            .max()
            .unwrap_or(0);
        let mut recv = vec![T::zeroed(); len];
        let args = CallArgs::all_to_all_v(T::DTYPE, counts);
        let bufs = (Some(raw(&send)), raw_mut(&mut recv));
        self.start_owned(args, bufs, (send, recv), |(_, recv)| recv)
    }

    /// AllGather of `send` (one block) into a new buffer of `size` blocks.
    pub fn all_gather<T: Element>(&self, send: Vec<T>) -> Handle<Vec<T>> {
        let mut recv = vec![T::zeroed(); send.len() * self.size];
        let args = CallArgs::new(Collective::AllGather, T::DTYPE);
        let bufs = (Some(raw(&send)), raw_mut(&mut recv));
        self.start_owned(args, bufs, (send, recv), |(_, recv)| recv)
    }

    /// ReduceScatter of `send` (`size` blocks) into this rank's block.
    pub fn reduce_scatter<T: Element>(&self, send: Vec<T>, op: ReduceOp) -> Handle<Vec<T>> {
        let mut recv = vec![T::zeroed(); send.len() / self.size];
        let args = CallArgs::new(Collective::ReduceScatter, T::DTYPE).op(op);
        let bufs = (Some(raw(&send)), raw_mut(&mut recv));
        self.start_owned(args, bufs, (send, recv), |(_, recv)| recv)
    }

    /// Broadcast of `root`'s `buf`.
    pub fn broadcast<T: Element>(&self, mut buf: Vec<T>, root: Rank) -> Handle<Vec<T>> {
        let args = CallArgs::new(Collective::Broadcast, T::DTYPE).root(root);
        let bufs = (None, raw_mut(&mut buf));
        self.start_owned(args, bufs, buf, same)
    }

    /// In-place Reduce of `buf` to `root` (on other ranks `buf` ends with
    /// partial results).
    pub fn reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp, root: Rank) -> Handle<Vec<T>> {
        let args = CallArgs::new(Collective::Reduce, T::DTYPE)
            .op(op)
            .root(root);
        let bufs = (None, raw_mut(&mut buf));
        self.start_owned(args, bufs, buf, same)
    }

    /// Sends `buf` to `peer`; the handle gives it back once it left.
    pub fn send<T: Element>(&self, buf: Vec<T>, peer: Rank) -> Handle<Vec<T>> {
        let args = CallArgs::send_to(T::DTYPE, peer);
        let bufs = (Some(raw(&buf)), raw::<T>(&[]));
        self.start_owned(args, bufs, buf, same)
    }

    /// Receives `peer`'s next message into `buf`.
    pub fn recv<T: Element>(&self, mut buf: Vec<T>, peer: Rank) -> Handle<Vec<T>> {
        let args = CallArgs::recv_from(T::DTYPE, peer);
        let bufs = (None, raw_mut(&mut buf));
        self.start_owned(args, bufs, buf, same)
    }

    /// Barrier.
    pub fn barrier(&self) -> Handle<()> {
        let args = CallArgs::new(Collective::Barrier, DataType::U8);
        self.start_owned(args, (None, raw::<u8>(&[])), (), same)
    }

    /// Splits the communicator (see [`Communicator::split`]); the child is a
    /// blocking communicator (wrap it in an `AsyncCommunicator` of its own).
    pub fn split(&self, color: Option<u32>, key: i64) -> Handle<Option<Communicator>> {
        self.submit(move |c| c.split(color, key))
    }

    /// Waits for every operation started and returns the communicator.
    pub fn into_inner(mut self) -> Communicator {
        self.finish().expect("the progress thread panicked")
    }

    fn finish(&mut self) -> Option<Communicator> {
        drop(self.jobs.take());
        self.doorbell.ring();
        self.thread.take()?.join().ok()
    }
}

impl Drop for AsyncCommunicator {
    fn drop(&mut self) {
        self.finish();
    }
}

fn raw_bufs(bufs: Buffers<'_>) -> (Option<RawBuf>, RawBuf) {
    match bufs {
        Buffers::InPlace(b) => (None, RawBuf::of_mut(b)),
        Buffers::OutOfPlace { send, recv } => (Some(RawBuf::of(send)), RawBuf::of_mut(recv)),
    }
}

/// `buf`'s memory by address, for a call that only reads it.
fn raw<T: Element>(buf: &[T]) -> RawBuf {
    RawBuf::of(bytemuck::cast_slice(buf))
}

/// `buf`'s memory by address, for a call that writes it (the Vec moves
/// into the call with it; its heap buffer stays where it is).
fn raw_mut<T: Element>(buf: &mut [T]) -> RawBuf {
    RawBuf::of_mut(bytemuck::cast_slice_mut(buf))
}

fn same<K>(k: K) -> K {
    k
}

/// The progress thread: starts calls as they come, steps every call in
/// flight, hands results back, sleeps on the connections and the doorbell.
/// Ends, returning the communicator, once the jobs channel closed and every
/// call finished.
fn progress(mut comm: Communicator, queue: mpsc::Receiver<Job>, bell: &Doorbell) -> Communicator {
    let mut pending: Vec<(CallId, Reply)> = Vec::new();
    let mut open = true;
    loop {
        bell.drain();
        loop {
            let job = if pending.is_empty() && open {
                // Nothing in flight: block until the next job.
                queue.recv().map_err(|_| mpsc::TryRecvError::Disconnected)
            } else {
                queue.try_recv()
            };
            match job {
                Ok(Job::Call {
                    args,
                    input,
                    output,
                    done,
                }) => {
                    // SAFETY: `done` owns the buffers (or the caller of
                    // `start_bytes` vouched for them) until it is called,
                    // which is once the call finished.
                    match unsafe { comm.start(&args, input, output) } {
                        Ok(id) => pending.push((id, done)),
                        Err(e) => done(Err(e)),
                    }
                }
                Ok(Job::Run(f)) => f(&mut comm),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if pending.is_empty() {
            if !open {
                return comm;
            }
            continue;
        }
        let moved = comm.step_all();
        let mut i = 0;
        while i < pending.len() {
            match comm.take_result(pending[i].0) {
                Some(r) => (pending.swap_remove(i).1)(r),
                None => i += 1,
            }
        }
        if !moved {
            comm.idle(Some(bell.fd()));
        }
    }
}
