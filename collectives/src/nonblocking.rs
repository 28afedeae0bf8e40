//! Non-blocking collectives: a progress thread owns the [`Communicator`] and
//! runs operations in the order they were started while the caller computes;
//! each start returns a [`Handle`] to wait on or test.
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
use std::thread::JoinHandle;

use crate::{Communicator, Element, Error, Rank, ReduceOp, Result};

type Job = Box<dyn FnOnce(&mut Communicator) + Send>;

/// A communicator whose collectives run on a background thread, one after
/// another in start order (every rank must start the same sequence).
pub struct AsyncCommunicator {
    jobs: Option<mpsc::Sender<Job>>,
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
        if self.done.is_none() {
            self.done = match self.result.try_recv() {
                Ok(r) => Some(r),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => Some(Err(gone(self.rank))),
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
        let (rank, size) = (comm.rank(), comm.size());
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("coll-progress-{rank}"))
            .spawn(move || {
                let mut comm = comm;
                for job in queue {
                    job(&mut comm);
                }
                comm
            })
            .expect("cannot start the progress thread");
        AsyncCommunicator {
            jobs: Some(jobs),
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

    /// Starts `f` on the progress thread after every operation started before.
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Communicator) -> Result<R> + Send + 'static,
    ) -> Handle<R> {
        let (tx, result) = mpsc::channel();
        let job: Job = Box::new(move |comm| {
            // The caller may have dropped the handle: nothing to tell then.
            let _ = tx.send(f(comm));
        });
        let jobs = self.jobs.as_ref().expect("jobs is only taken on drop");
        // A send fails only if the thread is gone; the handle then says so.
        let _ = jobs.send(job);
        Handle {
            result,
            done: None,
            rank: self.rank,
        }
    }

    /// In-place AllReduce of `buf`.
    pub fn all_reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Handle<Vec<T>> {
        self.submit(move |c| c.all_reduce_in_place(&mut buf, op).map(|()| buf))
    }

    /// In-place AllToAll of `buf`.
    pub fn all_to_all<T: Element>(&self, mut buf: Vec<T>) -> Handle<Vec<T>> {
        self.submit(move |c| c.all_to_all_in_place(&mut buf).map(|()| buf))
    }

    /// AllGather of `send` (one block) into a new buffer of `size` blocks.
    pub fn all_gather<T: Element>(&self, send: Vec<T>) -> Handle<Vec<T>> {
        let n = self.size;
        self.submit(move |c| {
            let mut recv = vec![T::zeroed(); send.len() * n];
            c.all_gather(&send, &mut recv).map(|()| recv)
        })
    }

    /// ReduceScatter of `send` (`size` blocks) into this rank's block.
    pub fn reduce_scatter<T: Element>(&self, send: Vec<T>, op: ReduceOp) -> Handle<Vec<T>> {
        let n = self.size;
        self.submit(move |c| {
            let mut recv = vec![T::zeroed(); send.len() / n];
            c.reduce_scatter(&send, &mut recv, op).map(|()| recv)
        })
    }

    /// Broadcast of `root`'s `buf`.
    pub fn broadcast<T: Element>(&self, mut buf: Vec<T>, root: Rank) -> Handle<Vec<T>> {
        self.submit(move |c| c.broadcast(&mut buf, root).map(|()| buf))
    }

    /// Barrier.
    pub fn barrier(&self) -> Handle<()> {
        self.submit(|c| c.barrier())
    }

    /// Waits for every operation started and returns the communicator.
    pub fn into_inner(mut self) -> Communicator {
        self.finish().expect("the progress thread panicked")
    }

    fn finish(&mut self) -> Option<Communicator> {
        drop(self.jobs.take());
        self.thread.take()?.join().ok()
    }
}

impl Drop for AsyncCommunicator {
    fn drop(&mut self) {
        self.finish();
    }
}
