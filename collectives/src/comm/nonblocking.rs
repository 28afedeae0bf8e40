//! Non-blocking calls. Each start returns a [`Handle`] at once; the calls
//! progress while the caller computes. Collectives run in start order among
//! themselves (every rank starts the same sequence); point-to-point calls
//! progress at once, concurrently with each other and with collectives,
//! matched in order per pair of ranks, so `send(next); recv(prev)` started
//! together complete at any size.
//!
//! Progress is made by whoever waits, as MPI's is in `MPI_Wait`: a thread
//! that waits on a handle takes the communicator and runs the executor
//! itself (no hand-off between threads, which costs tens of microseconds in
//! a VM), and a progress thread drives the calls nobody waits on. Both run
//! the same [`Engine::step`]; the progress thread steps aside while a
//! waiter wants the communicator.
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::call::args::{CallArgs, VarCounts};
use crate::comm::inflight::{CallId, RawBuf};
use crate::sys::doorbell::Doorbell;
use crate::{
    AbortHandle, Buffers, Collective, Communicator, DataType, Element, Error, Rank, ReduceOp,
    Result,
};

/// What a start asks for.
enum Job {
    /// Start a call on buffers kept alive by `done`, which receives the result.
    Call {
        ticket: u64,
        args: CallArgs,
        input: Option<RawBuf>,
        output: RawBuf,
        done: Reply,
    },
    /// Run a closure on the communicator.
    Run(Box<dyn FnOnce(&mut Communicator) + Send>),
}

/// Hands a call's result (and its buffers) back to its handle.
type Reply = Box<dyn FnOnce(Result<()>) + Send>;

/// A started call the engine has not finished yet.
struct Pending {
    ticket: u64,
    id: CallId,
    done: Reply,
}

/// The communicator and what is queued and in flight on it; whoever holds
/// it (a waiter or the progress thread) makes progress.
struct Engine {
    /// `None` once [`AsyncCommunicator::into_inner`] took it back.
    comm: Option<Communicator>,
    queue: mpsc::Receiver<Job>,
    pending: Vec<Pending>,
    /// Whether starts may still come (the sending side is alive).
    open: bool,
}

/// What the progress thread, the waiters and the starters share.
struct Shared {
    engine: Mutex<Engine>,
    /// Waiters that want the engine: the progress thread steps aside.
    waiters: Mutex<usize>,
    no_waiters: Condvar,
    /// Rung on every start and by every waiter: wakes whoever sleeps in
    /// `poll` holding the engine.
    doorbell: Doorbell,
}

/// How often a waiter that sees nothing move calls its `tick` (a binding
/// checks for Ctrl-C there).
const TICK: Duration = Duration::from_millis(100);

impl Engine {
    /// Starts every queued job, in start order. Returns whether starts may
    /// still come.
    fn start_queued(&mut self) -> bool {
        loop {
            match self.queue.try_recv() {
                Ok(job) => self.start(job),
                Err(mpsc::TryRecvError::Empty) => return self.open,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.open = false;
                    return false;
                }
            }
        }
    }

    fn start(&mut self, job: Job) {
        let Some(comm) = self.comm.as_mut() else {
            return;
        };
        match job {
            Job::Call {
                ticket,
                args,
                input,
                output,
                done,
            } => {
                // SAFETY: `done` owns the buffers (or the caller of
                // `start_bytes_then` vouched for them) until it is called,
                // which is once the call finished.
                match unsafe { comm.start(&args, input, output) } {
                    Ok(id) => self.pending.push(Pending { ticket, id, done }),
                    Err(e) => done(Err(e)),
                }
            }
            Job::Run(f) => f(comm),
        }
    }

    /// Hands every finished call's result to its handle.
    fn deliver(&mut self) {
        let Some(comm) = self.comm.as_mut() else {
            return;
        };
        let mut i = 0;
        while i < self.pending.len() {
            match comm.take_result(self.pending[i].id) {
                Some(r) => (self.pending.remove(i).done)(r),
                None => i += 1,
            }
        }
    }

    /// One round: start what is queued, step every call, deliver what
    /// finished; when nothing moved, sleep until a connection, an abort or
    /// the doorbell wakes us (if `may_sleep`: not when a waiter wants in).
    fn step(&mut self, bell: &Doorbell, may_sleep: impl Fn() -> bool) -> bool {
        bell.drain();
        self.start_queued();
        let Some(comm) = self.comm.as_mut() else {
            return false;
        };
        let moved = comm.step_all();
        self.deliver();
        // (Returns at once when no call runs.)
        if !moved && may_sleep() {
            if let Some(comm) = self.comm.as_mut() {
                comm.idle(Some(bell.fd()));
            }
        }
        moved
    }

    fn is_pending(&self, ticket: u64) -> bool {
        self.pending.iter().any(|p| p.ticket == ticket)
    }
}

impl Shared {
    /// The engine, for a waiter: at once if it is free, else after telling
    /// the progress thread to step aside.
    fn engine_for_waiter(&self) -> MutexGuard<'_, Engine> {
        match self.engine.try_lock() {
            Ok(engine) => return engine,
            Err(std::sync::TryLockError::Poisoned(e)) => return e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
        *self.waiters.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.doorbell.ring();
        let engine = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        *waiters -= 1;
        if *waiters == 0 {
            self.no_waiters.notify_all();
        }
        engine
    }

    fn has_waiters(&self) -> bool {
        *self.waiters.lock().unwrap_or_else(|e| e.into_inner()) > 0
    }

    /// Drives the engine until the call `ticket` finished (its reply was
    /// called), calling `tick` every [`TICK`] that nothing moves.
    fn drive(&self, ticket: u64, tick: &mut dyn FnMut()) {
        let mut engine = self.engine_for_waiter();
        engine.start_queued();
        self.drive_until(&mut engine, |e| !e.is_pending(ticket), tick);
    }

    /// Starts a call after every call queued before it and drives it to its
    /// end on this thread, as [`drive`](Self::drive) does.
    ///
    /// # Safety
    /// The buffers must stay valid and untouched until this returns.
    unsafe fn run_here(
        &self,
        args: &CallArgs,
        input: Option<RawBuf>,
        output: RawBuf,
        tick: &mut dyn FnMut(),
    ) -> Result<()> {
        let mut engine = self.engine_for_waiter();
        engine.start_queued();
        let comm = (engine.comm.as_mut()).ok_or_else(|| gone(usize::MAX))?;
        // SAFETY: the caller's promise.
        let id = unsafe { comm.start(args, input, output)? };
        let mut result = None;
        let finished = |e: &mut Engine| {
            result = e.comm.as_mut().and_then(|c| c.take_result(id));
            result.is_some()
        };
        self.drive_until(&mut engine, finished, tick);
        result.expect("driven until finished")
    }

    /// Steps `engine` on this thread until `finished`, calling `tick` every
    /// [`TICK`] that nothing moves; what is still in flight then goes back
    /// to the progress thread.
    fn drive_until(
        &self,
        engine: &mut Engine,
        mut finished: impl FnMut(&mut Engine) -> bool,
        tick: &mut dyn FnMut(),
    ) {
        let mut ticked = Instant::now();
        while !finished(engine) {
            if engine.step(&self.doorbell, || true) {
                ticked = Instant::now();
            } else if ticked.elapsed() >= TICK {
                tick();
                ticked = Instant::now();
            }
        }
        if !engine.pending.is_empty() {
            self.doorbell.ring();
        }
    }
}

/// A started call, by which a waiter drives it to its end (see the module
/// docs). Bindings that complete their own futures keep one per call.
#[derive(Clone, Debug)]
pub struct Ticket {
    id: u64,
    shared: Weak<Shared>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Shared")
    }
}

impl Ticket {
    /// Makes progress on this thread until the call finished (its `done`
    /// was called), calling `tick` every 100 ms that nothing moves (to look
    /// for signals, say). Returns at once if the communicator is gone.
    pub fn drive(&self, tick: &mut dyn FnMut()) {
        if let Some(shared) = self.shared.upgrade() {
            shared.drive(self.id, tick);
        }
    }
}

/// A communicator whose calls progress in the background (see the module
/// docs for the order they run in).
pub struct AsyncCommunicator {
    jobs: Option<mpsc::Sender<Job>>,
    shared: Arc<Shared>,
    tickets: AtomicU64,
    abort: AbortHandle,
    thread: Option<JoinHandle<()>>,
    rank: Rank,
    size: usize,
}

/// An operation in flight; its result (the buffer, back) once done.
#[must_use = "an operation's errors are only seen by waiting on its handle"]
pub struct Handle<T> {
    result: mpsc::Receiver<Result<T>>,
    done: Option<Result<T>>,
    ticket: Option<Ticket>,
    rank: Rank,
}

impl<T> Handle<T> {
    /// Blocks until the operation is done, driving it on this thread.
    pub fn wait(mut self) -> Result<T> {
        if let Some(r) = self.done.take() {
            return r;
        }
        if let Some(ticket) = &self.ticket {
            ticket.drive(&mut || {});
        }
        self.result.recv().unwrap_or_else(|_| Err(gone(self.rank)))
    }

    /// Whether the operation is done (then [`wait`](Self::wait) returns at once).
    pub fn test(&mut self) -> bool {
        self.wait_for(Duration::ZERO)
    }

    /// Waits up to `timeout` for the operation (the progress thread drives
    /// it meanwhile); whether it is done.
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
    /// Takes `comm` over, with a progress thread of its own.
    pub fn new(comm: Communicator) -> Self {
        let (rank, size, abort) = (comm.rank(), comm.size(), comm.abort_handle());
        let (jobs, queue) = mpsc::channel::<Job>();
        let shared = Arc::new(Shared {
            engine: Mutex::new(Engine {
                comm: Some(comm),
                queue,
                pending: Vec::new(),
                open: true,
            }),
            waiters: Mutex::new(0),
            no_waiters: Condvar::new(),
            doorbell: Doorbell::new().expect("eventfd for the progress thread"),
        });
        let for_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("coll-progress-{rank}"))
            .spawn(move || progress(&for_thread))
            .expect("cannot start the progress thread");
        AsyncCommunicator {
            jobs: Some(jobs),
            shared,
            tickets: AtomicU64::new(0),
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
        // A send fails only if the engine is gone; the handle then says so.
        let _ = jobs.send(job);
        self.shared.doorbell.ring();
    }

    fn ticket(&self) -> Ticket {
        Ticket {
            id: self.tickets.fetch_add(1, Ordering::Relaxed),
            shared: Arc::downgrade(&self.shared),
        }
    }

    /// Runs `f` on the communicator after every call started before it has
    /// started (calls in flight go on progressing while `f` blocks).
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Communicator) -> Result<R> + Send + 'static,
    ) -> Handle<R> {
        let (tx, result) = mpsc::channel();
        self.post_job(Job::Run(Box::new(move |comm| {
            // The caller may have dropped the handle: nothing to tell then.
            let _ = tx.send(f(comm));
        })));
        Handle {
            result,
            done: None,
            ticket: None,
            rank: self.rank,
        }
    }

    /// Runs `f` on the communicator after every call started before it;
    /// `done` gets its result (on whichever thread runs it).
    pub fn run_then(
        &self,
        f: impl FnOnce(&mut Communicator) -> Result<()> + Send + 'static,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) {
        self.post_job(Job::Run(Box::new(move |comm| done(f(comm)))));
    }

    /// Starts the call `args` on `(input, output)`, which `keep` owns; the
    /// handle gives `out(keep)` when the call finished.
    fn start_owned<K: Send + 'static, R: Send + 'static>(
        &self,
        args: CallArgs,
        (input, output): (Option<RawBuf>, RawBuf),
        keep: K,
        out: fn(K) -> R,
    ) -> Handle<R> {
        let (tx, result) = mpsc::channel();
        let ticket = self.ticket();
        self.post_job(Job::Call {
            ticket: ticket.id,
            args,
            input,
            output,
            done: Box::new(move |r| {
                let _ = tx.send(r.map(|()| out(keep)));
            }),
        });
        Handle {
            result,
            done: None,
            ticket: Some(ticket),
            rank: self.rank,
        }
    }

    /// Starts the call `args` on caller-owned byte buffers.
    ///
    /// # Safety
    /// The buffers must stay valid and untouched until the handle reports
    /// the call done (or this communicator is dropped, which waits for it).
    pub unsafe fn start_bytes(&self, args: CallArgs, bufs: Buffers<'_>) -> Handle<()> {
        self.start_owned(args, RawBuf::from_buffers(bufs), (), same)
    }

    /// Runs the call `args` on this thread, after every call started before
    /// it (the blocking form, for bindings: no hand-off to another thread),
    /// calling `tick` every 100 ms that nothing moves.
    ///
    /// # Safety
    /// The buffers must stay valid and untouched until this returns.
    pub unsafe fn call_bytes(
        &self,
        args: &CallArgs,
        bufs: Buffers<'_>,
        tick: &mut dyn FnMut(),
    ) -> Result<()> {
        let (input, output) = RawBuf::from_buffers(bufs);
        // SAFETY: the caller's promise.
        unsafe { self.shared.run_here(args, input, output, tick) }.map_err(|e| match e {
            Error::Aborted {
                rank: usize::MAX,
                reason,
            } => Error::Aborted {
                rank: self.rank,
                reason,
            },
            e => e,
        })
    }

    /// Starts the call `args` on caller-owned byte buffers; `done` gets its
    /// result once it finished, on whichever thread drives it (for bindings
    /// that complete their own futures). [`Ticket::drive`] makes progress on
    /// it from the caller's thread.
    ///
    /// # Safety
    /// As [`start_bytes`](Self::start_bytes), until `done` is called.
    pub unsafe fn start_bytes_then(
        &self,
        args: CallArgs,
        bufs: Buffers<'_>,
        done: impl FnOnce(Result<()>) + Send + 'static,
    ) -> Ticket {
        let (input, output) = RawBuf::from_buffers(bufs);
        let ticket = self.ticket();
        self.post_job(Job::Call {
            ticket: ticket.id,
            args,
            input,
            output,
            done: Box::new(done),
        });
        ticket
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

    /// AllToAllv of `send` into a new buffer reaching the end of the last
    /// receive block.
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

    /// Agrees with the other survivors on the failed ranks (see
    /// [`Communicator::failed_ranks`]).
    pub fn failed_ranks(&self) -> Handle<Vec<Rank>> {
        self.submit(|c| c.failed_ranks())
    }

    /// A communicator of the survivors (see [`Communicator::shrink`]);
    /// `abort_first` ends the calls in flight here first, as the abort
    /// handle does.
    pub fn shrink(&self, excluded: Vec<Rank>, abort_first: bool) -> Handle<Communicator> {
        if abort_first {
            self.abort("shrinking the communicator");
        }
        self.submit(move |c| c.shrink(&excluded, false))
    }

    /// Waits for every operation started and returns the communicator.
    pub fn into_inner(mut self) -> Communicator {
        self.finish().expect("the progress thread panicked")
    }

    fn finish(&mut self) -> Option<Communicator> {
        drop(self.jobs.take());
        self.shared.doorbell.ring();
        self.thread.take()?.join().ok()?;
        let mut engine = self.shared.engine.lock().unwrap_or_else(|e| e.into_inner());
        engine.comm.take()
    }
}

impl Drop for AsyncCommunicator {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The progress thread: drives the calls nobody waits on, steps aside for
/// waiters, sleeps on the doorbell when nothing is in flight. Ends once no
/// start can come any more and every call finished.
fn progress(shared: &Shared) {
    loop {
        {
            let waiters = shared.waiters.lock().unwrap_or_else(|e| e.into_inner());
            drop((shared.no_waiters).wait_while(waiters, |w| *w > 0));
        }
        let mut engine = shared.engine.lock().unwrap_or_else(|e| e.into_inner());
        engine.step(&shared.doorbell, || !shared.has_waiters());
        if engine.pending.is_empty() && engine.queue_is_empty() {
            if !engine.open {
                return;
            }
            drop(engine);
            shared.doorbell.wait(Duration::from_secs(1));
        }
    }
}

impl Engine {
    /// Whether nothing is queued (peeking would take a job; `open` turns
    /// false when the queue disconnected).
    fn queue_is_empty(&mut self) -> bool {
        match self.queue.try_recv() {
            Ok(job) => {
                self.start(job);
                false
            }
            Err(mpsc::TryRecvError::Empty) => true,
            Err(mpsc::TryRecvError::Disconnected) => {
                self.open = false;
                true
            }
        }
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
