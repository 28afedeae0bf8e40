//! Calls in flight on one communicator. A call is started (checked, given
//! its sequence number), runs (its schedule stepped by the executor) and
//! finishes; several can be in flight at once, all driven by the same
//! executor step:
//!
//! * collectives run one at a time, in start order, on the collective lane
//!   (their messages to a peer must not interleave); a collective started
//!   while another runs is queued;
//! * point-to-point calls run at once on their own lane, each one message
//!   posted whole in its first step, so messages of one pair stay in start
//!   order however many are in flight.
//!
//! A blocking call is `start` then `wait`; the non-blocking layer starts
//! calls as they come and steps them all while its caller computes. A
//! blocking small call with nothing else in flight runs alone on the flag
//! path (`tiny.rs`) until it has to wait longer than a spin: it then joins
//! the queue, where every waiting policy and failure lives.

use std::os::fd::BorrowedFd;

use transport::{Phase, Poller, Request};

use crate::algo::schedule::Schedule;
use crate::algo::{self, Layout};
use crate::bootstrap::mesh::{Lane, LANES};
use crate::call::args::CallArgs;
use crate::call::descriptor::{CallDesc, Collective};
use crate::exec::executor::{Execution, Progress, Windows};
use crate::exec::transfers::{self, Region, Transfers};
use crate::observe::recorder::{self, Slot};
use crate::tiny::{FlagCall, Tiny};
use crate::{Communicator, Error, ReduceOp, Result};

/// A call started on a communicator, until its result is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallId(u64);

/// A caller's buffer by address (the caller keeps it alive and untouched
/// until the call finishes).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawBuf {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: a RawBuf names memory its call reserved until it finishes; only
// the thread that owns the communicator dereferences it.
unsafe impl Send for RawBuf {}

impl RawBuf {
    /// A buffer the call only reads.
    pub fn of(b: &[u8]) -> Self {
        RawBuf {
            ptr: b.as_ptr().cast_mut(),
            len: b.len(),
        }
    }

    /// The executor's view of a call's buffers: `(None, buf)` in place.
    pub fn from_buffers(bufs: crate::Buffers<'_>) -> (Option<RawBuf>, RawBuf) {
        match bufs {
            crate::Buffers::InPlace(b) => (None, RawBuf::of_mut(b)),
            crate::Buffers::OutOfPlace { send, recv } => {
                (Some(RawBuf::of(send)), RawBuf::of_mut(recv))
            }
        }
    }

    /// A buffer the call writes.
    pub fn of_mut(b: &mut [u8]) -> Self {
        RawBuf {
            ptr: b.as_mut_ptr(),
            len: b.len(),
        }
    }

    /// # Safety
    /// The memory must be valid for `len` bytes, and no other reference to
    /// it live while the result is.
    pub(crate) unsafe fn bytes_mut<'a>(self) -> &'a mut [u8] {
        // SAFETY: the caller's promise; an empty slice needs no memory.
        unsafe { std::slice::from_raw_parts_mut(self.ptr_or_dangling(), self.len) }
    }

    /// # Safety
    /// The memory must be valid for `len` bytes.
    pub(crate) unsafe fn bytes<'a>(self) -> &'a [u8] {
        // SAFETY: the caller's promise; an empty slice needs no memory.
        unsafe { std::slice::from_raw_parts(self.ptr_or_dangling(), self.len) }
    }

    fn ptr_or_dangling(self) -> *mut u8 {
        if self.len == 0 {
            std::ptr::dangling_mut()
        } else {
            self.ptr
        }
    }
}

enum State {
    /// A collective waiting for the one before it.
    Queued,
    Running(Box<Running>),
    /// A small call on the flag path (`tiny.rs`).
    Flags(FlagCall),
    Finished(Result<()>),
}

struct Call {
    id: CallId,
    args: CallArgs,
    desc: CallDesc,
    input: Option<RawBuf>,
    output: RawBuf,
    state: State,
    /// Its record in the flight recorder.
    slot: Slot,
}

impl Call {
    /// See [`larger`].
    fn larger(&self) -> usize {
        larger(self.input, self.output)
    }
}

/// The length of a call's larger buffer: what the selector and the flag
/// path go by.
fn larger(input: Option<RawBuf>, output: RawBuf) -> usize {
    input.map_or(0, |b| b.len).max(output.len)
}

/// Posts flag call `flags` on the caller's buffers.
/// Inlined, as `alone` says.
#[inline(always)]
fn post_flags(
    tiny: &mut Tiny,
    flags: &mut FlagCall,
    input: Option<RawBuf>,
    output: RawBuf,
) -> transport::Result<()> {
    // SAFETY: the caller's buffers, reserved for this call.
    let (input, output) = unsafe { (input.map(|b| b.bytes()), output.bytes()) };
    tiny.try_post(flags, input, output).map(drop)
}

/// Polls flag call `flags` of `desc` on the caller's buffers. Inlined, as
/// `alone` says.
#[inline(always)]
fn poll_flags(
    tiny: &mut Tiny,
    flags: &mut FlagCall,
    desc: &CallDesc,
    input: Option<RawBuf>,
    output: RawBuf,
) -> transport::Result<bool> {
    // SAFETY: the caller's buffers, reserved for this call.
    let (input, output) = unsafe { (input.map(|b| b.bytes()), output.bytes_mut()) };
    let op = desc.op.unwrap_or(ReduceOp::Sum);
    tiny.poll(flags, input, output, desc.dtype, op)
}

/// A call checked, numbered and recorded, before it is queued.
#[derive(Clone, Copy)]
struct Admitted {
    id: CallId,
    slot: Slot,
    desc: CallDesc,
    /// Its larger buffer's length.
    bytes: usize,
    /// It has nothing to move: finished already.
    skip: bool,
}

impl Admitted {
    /// The state it joins the queue in.
    fn state(&self) -> State {
        match self.skip {
            true => State::Finished(Ok(())),
            false => State::Queued,
        }
    }
}

/// What became of a blocking call that tried the flag path alone.
enum Alone {
    Done,
    /// It goes to the queue: to begin there, or posted and waiting.
    Queue(State),
    /// It goes to the queue and fails there (aborting the communicator).
    Failed(State, transport::Error),
}

/// A running call's schedule, execution and registered buffers; kept for
/// reuse when it finishes, so a small call allocates nothing.
#[derive(Default)]
struct Running {
    sched: Schedule,
    exec: Execution<Request>,
    lane: usize,
    input: Option<Region>,
    output: Option<Region>,
    /// The schedule's scratch (a call's own: calls of a group run at once).
    scratch_buf: Vec<u64>,
    scratch: Option<Region>,
    /// An out-of-place reduce-scatter reduces in a whole-size buffer of
    /// ours and copies this rank's block here when done.
    copy_out: Option<RawBuf>,
}

/// How often a blocking flag call alone polls before it joins the queue
/// (a few microseconds, about the poller's spin): the queue's bookkeeping
/// is half the cost of an 8-byte call.
const ALONE_POLLS: u32 = 64;

/// The longest sleep on a flag: a peer's death or abort shows this soon.
const FLAG_SLEEP: std::time::Duration = std::time::Duration::from_millis(10);
/// ... while other calls run, whose progress a flag does not announce.
const FLAG_SLEEP_WITH_OTHERS: std::time::Duration = std::time::Duration::from_micros(50);

/// The calls in flight, in start order.
pub(crate) struct InFlight {
    next_id: u64,
    calls: Vec<Call>,
    /// Boxed: a running call's state moves between here and its call
    /// without reallocating.
    #[allow(clippy::vec_box)]
    spare: Vec<Box<Running>>,
    poller: Poller,
    /// Per lane and peer: whether a running call waits on the connection.
    involved: [Vec<bool>; LANES],
}

impl InFlight {
    pub fn new(spin: std::time::Duration, rank: usize) -> Self {
        InFlight {
            next_id: 0,
            calls: Vec::new(),
            spare: Vec::new(),
            poller: Poller::new(spin, Poller::DEFAULT_PATIENCE).with_rank(rank),
            involved: Default::default(),
        }
    }

    /// Fails every unfinished call with `reason`; their buffers are free
    /// once the connections were aborted.
    pub fn fail_all(&mut self, rank: usize, reason: &str) {
        for c in &mut self.calls {
            if !matches!(c.state, State::Finished(_)) {
                if let State::Running(r) = std::mem::replace(&mut c.state, State::Queued) {
                    self.spare.push(r);
                }
                c.state = State::Finished(Err(Error::Aborted {
                    rank,
                    reason: reason.to_string(),
                }));
            }
        }
    }
}

impl Communicator {
    /// Starts a call on `input` (`None` in place) and `output`: checks it,
    /// gives it its sequence number and queues or runs it. Argument errors
    /// come back at once (the sequence number is used up all the same, so
    /// a rank that goes on is caught by its peers' next call).
    ///
    /// # Safety
    /// The buffers must stay valid, and untouched by anyone else, until the
    /// call is finished: [`wait`](Self::wait) returned for it, or the
    /// communicator was aborted or dropped.
    pub(crate) unsafe fn start(
        &mut self,
        args: &CallArgs,
        input: Option<RawBuf>,
        output: RawBuf,
    ) -> Result<CallId> {
        // SAFETY: the caller's promise.
        let a = unsafe { self.admit(args, input, output) }.map_err(|e| *e)?;
        self.enqueue(a, args, input, output, a.state());
        self.begin_ready();
        Ok(a.id)
    }

    /// Starts a call and waits for it: [`start`](Self::start) then
    /// [`wait`](Self::wait), or, for a small call with nothing else in
    /// flight, the flag path alone. Always inlined (a hint left it out
    /// of line in collbench's loop): a call of nothing then costs what
    /// Open MPI's does (4-rank AllGather of 8 B: 0.005 -> 0.004 us).
    ///
    /// # Safety
    /// As [`start`](Self::start).
    #[inline(always)]
    pub(crate) unsafe fn run_raw(
        &mut self,
        args: &CallArgs,
        input: Option<RawBuf>,
        output: RawBuf,
    ) -> Result<()> {
        if args.moves_nothing(input.map(|b| b.len), output.len) {
            return self.nothing_to_move(args, input.is_some());
        }
        // SAFETY: the caller's promise.
        unsafe { self.run_moving(args, input, output) }
    }

    /// [`run_raw`](Self::run_raw) for a call with something to move: out
    /// of line, so that a call of nothing, inlined into the caller, pays
    /// for none of this one's stack frame (with the inlined fast path of
    /// `check_roles`: 4-rank AllGather of 8 B, no element a rank, 0.012 ->
    /// 0.005 us a call; Open MPI 0.004).
    ///
    /// # Safety
    /// As [`start`](Self::start).
    #[inline(never)]
    unsafe fn run_moving(
        &mut self,
        args: &CallArgs,
        input: Option<RawBuf>,
        output: RawBuf,
    ) -> Result<()> {
        // SAFETY: the caller's promise.
        let a = unsafe { self.admit(args, input, output) }.map_err(|e| *e)?;
        let (state, failure) = match self.alone(&a, input, output) {
            Alone::Done => return Ok(()),
            Alone::Queue(state) => (state, None),
            Alone::Failed(state, e) => (state, Some(e)),
        };
        let at = self.enqueue(a, args, input, output, state);
        match failure {
            Some(e) => self.fail(at, Error::collective(self.rank, a.desc, e)),
            None => self.begin_ready(),
        }
        self.wait(a.id)
    }

    /// Runs call `a` (with something to move) on the flag path by itself
    /// if nothing else is in flight and it takes that path: posts it and
    /// polls it a while. A call that must wait longer, or fails, goes to the
    /// queue in the state it is in.
    ///
    /// Inlined into `run_raw`, as are `admit`, `Tiny::try_post` and what they
    /// call: each returned a struct of 100-200 bytes through the stack, and
    /// reading it back stalled on store forwarding (a third of `run_raw`'s
    /// samples in a 2-rank 8 B Broadcast; inlined, `ci/ab.py`: 4-rank 8 B
    /// Broadcast 0.70x the time, 2-rank 8 B AllToAll, AllGather, Reduce and
    /// ReduceScatter 0.94-0.96x, calls with nothing to move 0.89x).
    #[inline(always)]
    fn alone(&mut self, a: &Admitted, input: Option<RawBuf>, output: RawBuf) -> Alone {
        let eligible =
            self.inflight.calls.is_empty() && recorder::dump_requests() <= self.recorder.dumps_seen;
        let Some(tiny) =
            (self.tiny.on_mut()).filter(|t| eligible && t.takes(a.desc.collective, a.bytes))
        else {
            return Alone::Queue(State::Queued);
        };
        let mut flags = tiny.number(&a.desc, a.bytes, input.is_none());
        if let Err(e) = post_flags(tiny, &mut flags, input, output) {
            return Alone::Failed(State::Queued, e);
        }
        self.recorder.running(a.slot, "tiny", a.bytes);
        for polls in 0..ALONE_POLLS {
            match poll_flags(tiny, &mut flags, &a.desc, input, output) {
                Ok(true) => {
                    match polls {
                        0 => self.recorder.finished_at_once(a.slot),
                        _ => self.recorder.finished(a.slot, true),
                    }
                    return Alone::Done;
                }
                Ok(false) => {}
                Err(e) => return Alone::Failed(State::Flags(flags), e),
            }
            if polls == 0 {
                self.recorder.waits(a.slot);
                // The queue's first idle round yields to a peer on our core.
                if tiny.yields_core(&flags) {
                    break;
                }
            }
            std::hint::spin_loop();
        }
        Alone::Queue(State::Flags(flags))
    }

    /// A blocking call that moves nothing: checked, numbered and counted as
    /// `admit` would, and done, without its buffers' checks (which empty
    /// buffers pass), a descriptor or a record entry (a 4-rank AllToAll of 8
    /// B, 2 bytes a block, so none: 0.033 -> 0.016 us a call; Open MPI 0.004).
    #[inline(always)]
    fn nothing_to_move(&mut self, args: &CallArgs, out_of_place: bool) -> Result<()> {
        self.refuse_if_aborted()?;
        let rank = self.rank;
        self.next_seq(None); // used up by an argument error too, as in `admit`
        (args.check_roles(rank, self.size, out_of_place))
            .map_err(|message| Error::InvalidArgument { rank, message })?;
        self.recorder.skipped(args.collective);
        Ok(())
    }

    /// An error naming the reason if the communicator was aborted (and
    /// closes it, if a peer's abort is news). Two loads while it was not.
    #[inline(always)]
    fn refuse_if_aborted(&mut self) -> Result<()> {
        match self.is_aborted() {
            false => Ok(()),
            true => self.refuse_aborted(),
        }
    }

    #[cold]
    fn refuse_aborted(&mut self) -> Result<()> {
        let reason = self.aborted().unwrap_or_default();
        self.close(&reason);
        Err(Error::Aborted {
            rank: self.rank(),
            reason,
        })
    }

    /// Checks and numbers a call (an argument error comes back here) and
    /// records it; it is not queued yet. The error comes boxed: held
    /// inline, it put a one-byte tag before the admitted call, and the
    /// caller's 4-byte reads over that tag's store stalled on store
    /// forwarding, a sixth of `run_moving`'s samples beside a busy loop
    /// (boxed, 2-rank 8 B Broadcasts 0.97x the time idle, 0.96x beside the
    /// loop, the rank on the loop's core 0.89x the CPU).
    ///
    /// # Safety
    /// As [`start`](Self::start). Inlined, as `alone` says.
    #[inline(always)]
    unsafe fn admit(
        &mut self,
        args: &CallArgs,
        input: Option<RawBuf>,
        output: RawBuf,
    ) -> std::result::Result<Admitted, Box<Error>> {
        self.refuse_if_aborted()?;
        // SAFETY: the caller's promise.
        let (i, o) = unsafe { (input.map(|b| b.bytes()), output.bytes()) };
        let desc = self.describe(args, i, o)?;
        let skip = args.moves_nothing(input.map(|b| b.len), output.len);
        let id = CallId(self.inflight.next_id);
        self.inflight.next_id += 1;
        let peer = args
            .peer
            .map(|p| (p.rank(), matches!(p, crate::Peer::To(_))));
        let bytes = larger(input, output);
        let slot = match skip {
            true => self.recorder.skipped(desc.collective),
            false => self.recorder.start(desc, peer, bytes),
        };
        Ok(Admitted {
            id,
            slot,
            desc,
            bytes,
            skip,
        })
    }

    /// Queues an admitted call in `state`; returns where it lies.
    fn enqueue(
        &mut self,
        a: Admitted,
        args: &CallArgs,
        input: Option<RawBuf>,
        output: RawBuf,
        state: State,
    ) -> usize {
        self.recorder.waits(a.slot);
        self.inflight.calls.push(Call {
            id: a.id,
            slot: a.slot,
            args: args.clone(),
            desc: a.desc,
            input,
            output,
            state,
        });
        self.inflight.calls.len() - 1
    }

    /// Gives a call its sequence number and checks it: its descriptor, or
    /// an argument error (the number is used up all the same, so a rank
    /// that goes on is caught by its peers' next call). Inlined, as `alone`
    /// says: its result came back through the stack in byte-sized stores,
    /// read back in words (a failed store forward, 40% of `run_raw`).
    #[inline(always)]
    fn describe(
        &mut self,
        args: &CallArgs,
        input: Option<&[u8]>,
        output: &[u8],
    ) -> Result<CallDesc> {
        let seq = self.next_seq(args.peer);
        let rank = self.rank;
        let count = (args.check(rank, self.size, input, output))
            .map_err(|message| Error::InvalidArgument { rank, message })?;
        Ok(CallDesc {
            collective: args.collective,
            dtype: args.dtype,
            op: args.op,
            count,
            root: args.root.map(|r| u16::try_from(r).unwrap_or(u16::MAX)),
            seq,
            comm: self.session as u8,
        })
    }

    /// The result of `id` if it finished (the call is then forgotten).
    pub(crate) fn take_result(&mut self, id: CallId) -> Option<Result<()>> {
        let calls = &mut self.inflight.calls;
        let at = calls.iter().position(|c| c.id == id)?;
        if !matches!(calls[at].state, State::Finished(_)) {
            return None;
        }
        let State::Finished(r) = std::mem::replace(&mut calls[at].state, State::Queued) else {
            unreachable!()
        };
        // The newest call (a blocking caller's) is dropped where it lies:
        // moving a call out costs copies a small call notices.
        match at + 1 == calls.len() {
            true => calls.truncate(at),
            false => drop(calls.remove(at)),
        }
        Some(r)
    }

    /// Drives every call in flight until `id` finished, and returns its result.
    pub(crate) fn wait(&mut self, id: CallId) -> Result<()> {
        loop {
            if let Some(result) = self.take_result(id) {
                return result;
            }
            if !self.step_all() {
                self.idle(None);
            }
        }
    }

    /// One executor step of every running call. Returns whether anything
    /// moved (or finished).
    pub(crate) fn step_all(&mut self) -> bool {
        if let Some(reason) = self.abort.reason() {
            self.close(&reason);
            return true;
        }
        if recorder::dump_requests() > self.recorder.dumps_seen {
            self.recorder.dumps_seen = recorder::dump_requests();
            self.dump_logged("SIGUSR1");
        }
        let mut moved = false;
        for at in 0..self.inflight.calls.len() {
            let call = &mut self.inflight.calls[at];
            if let State::Flags(flags) = &mut call.state {
                let tiny = self.tiny.on_mut().expect("a flag call has the flag path");
                let (before, desc) = (flags.mark(), call.desc);
                match poll_flags(tiny, flags, &desc, call.input, call.output) {
                    Ok(true) => self.finish(at, Ok(())),
                    Ok(false) if flags.mark() == before => continue,
                    Ok(false) => {}
                    Err(e) => {
                        self.fail(at, Error::collective(self.rank, desc, e));
                        return true;
                    }
                }
                moved = true;
                continue;
            }
            let State::Running(run) = &mut call.state else {
                continue;
            };
            let desc = call.desc;
            let mut fx = Transfers {
                recorder: &mut self.recorder,
                lane: run.lane,
                peers: &mut self.lanes[run.lane],
                input: run.input.as_ref(),
                output: run.output.as_ref().expect("a running call has its output"),
                scratch: run.scratch.as_ref(),
                staging: &self.staging,
                dtype: desc.dtype,
                op: desc.op.unwrap_or(ReduceOp::Sum),
                nranks: self.size,
                tag: desc.tag(),
            };
            match run.exec.progress(&run.sched, &mut fx) {
                Ok(Progress::Idle) => {}
                Ok(Progress::Moved) => moved = true,
                Ok(Progress::Done) => {
                    moved = true;
                    self.finish(at, Ok(()));
                }
                Err(e) => {
                    let e = Error::collective(self.rank, desc, e);
                    self.fail(at, e);
                    return true;
                }
            }
        }
        if moved {
            self.inflight.poller.busy();
            self.begin_ready();
        }
        moved
    }

    /// Waits for a connection of a running call (or `extra`) to be ready,
    /// after spinning and yielding; fails the oldest running call once
    /// nothing moved for the timeout.
    pub(crate) fn idle(&mut self, extra: Option<BorrowedFd<'_>>) {
        if self.inflight.poller.spin() {
            return;
        }
        if let Some(at) =
            (self.inflight.calls.iter()).position(|c| matches!(c.state, State::Flags(_)))
        {
            return self.idle_flags(at);
        }
        let Some(oldest) =
            (self.inflight.calls.iter()).position(|c| matches!(c.state, State::Running(_)))
        else {
            return;
        };
        for (lane, flags) in self.inflight.involved.iter_mut().enumerate() {
            flags.clear();
            flags.resize(self.size, false);
            for c in &self.inflight.calls {
                if let State::Running(r) = &c.state {
                    if r.lane == lane {
                        (flags.iter_mut().zip(r.exec.involved())).for_each(|(f, i)| *f |= *i);
                    }
                }
            }
        }
        let involved = &self.inflight.involved;
        let conns = (self.lanes.iter_mut().zip(involved))
            .flat_map(|(lane, flags)| lane.iter_mut().zip(flags))
            .filter(|(_, i)| **i)
            .filter_map(|(c, _)| c.as_mut());
        let wake = [self.abort.wake_fd()];
        let extra = extra.into_iter().chain(wake);
        let timeout = self.config.timeout;
        let idled = std::time::Instant::now();
        let tiny = self.tiny.on();
        let alone = || tiny.is_some_and(Tiny::alone_on_cpu);
        let idle = self.inflight.poller.idle(conns, extra, timeout, alone);
        self.recorder.stats.wait_seconds += idled.elapsed().as_secs_f64();
        match idle {
            Ok(true) if self.inflight.poller.asleep() => self.publish_wait(oldest),
            Ok(true) => {}
            Ok(false) => {
                let State::Running(run) = &self.inflight.calls[oldest].state else {
                    unreachable!()
                };
                let waited = self.inflight.poller.idle_for();
                let source = transfers::timeout_error(&run.exec, &run.sched, waited);
                self.stall(oldest, source);
            }
            Err(e) => {
                let e = Error::collective(self.rank, self.inflight.calls[oldest].desc, e);
                self.fail(oldest, e);
            }
        }
    }

    /// Waits for the flag call `at`: spins, then sleeps on the flag it
    /// waits for (woken by its writer), but not long while other calls
    /// run (they wake through descriptors). A peer gone, on the general
    /// path for this call, or aborted fails the call, and so does the timeout.
    fn idle_flags(&mut self, at: usize) {
        let phase = self.inflight.poller.phase(self.config.timeout);
        let tiny = self.tiny.on().expect("a flag call has the flag path");
        let call = &self.inflight.calls[at];
        let State::Flags(flags) = &call.state else {
            unreachable!("idle_flags is called for a flag call")
        };
        // Polling goes on for the poller's patience: a sleeping reader
        // makes its writer pay a wake-up, and a late reader the next
        // writer, a convoy. Yielding would hand a core shared with other
        // work to that work for a whole time slice: only a rank whose peer
        // last ran on its core yields, and at once (`Tiny::yields_core`).
        match phase {
            Phase::Spin | Phase::Yield if tiny.yields_core(flags) => {
                return std::thread::yield_now()
            }
            Phase::Spin | Phase::Yield => return std::hint::spin_loop(),
            Phase::Sleep(_) | Phase::Expired => {}
        }
        let (desc, peer) = (call.desc, flags.peer());
        // A peer that published what we wait for and then left (it finished
        // and exited) is no failure: the next poll takes its part.
        let checked = match tiny.check(flags) {
            Ok(true) => return,
            checked => checked.map(|_| ()),
        };
        // A peer's abort shows on its connection, with its reason (read
        // after the check: a peer that left aborted its connections first).
        let lane = &mut self.lanes[Lane::Collective as usize];
        let connection = lane[peer]
            .as_mut()
            .map_or(Ok(()), |c| c.progress().map(|_| ()));
        let others = (self.inflight.calls.iter()).any(|c| matches!(c.state, State::Running(_)));
        match (connection.and(checked), phase) {
            (Err(e), _) => self.fail(at, Error::collective(self.rank, desc, e)),
            (Ok(()), Phase::Expired) => {
                let waited = self.inflight.poller.idle_for();
                let waiting_for = format!("its part of {desc}, by shared flags");
                self.stall(
                    at,
                    transport::Error::Timeout {
                        peer,
                        waited,
                        waiting_for,
                    },
                );
            }
            (Ok(()), _) if others => tiny.sleep(flags, FLAG_SLEEP_WITH_OTHERS),
            (Ok(()), _) => {
                tiny.sleep(flags, FLAG_SLEEP);
                self.publish_wait(at);
            }
        }
    }

    /// Call `at` saw no progress for the timeout (`source` says on what):
    /// fails it with every rank's answer to where it is.
    fn stall(&mut self, at: usize, source: transport::Error) {
        self.recorder.stats.timeouts += 1;
        self.publish_wait(at);
        let op = self.inflight.calls[at].desc;
        tracing::warn!(
            rank = self.rank,
            "{op} timed out; asking every rank where it is"
        );
        let cause = crate::observe::status::diagnose(
            self.rank,
            self.recorder.board.position(),
            &self.status_addresses(),
            self.session,
        );
        let rank = self.rank;
        let source = Box::new(source);
        let e = Error::Stalled {
            rank,
            op,
            source,
            cause,
        };
        self.fail(at, e);
    }

    /// Puts what call `at` waits on where the other ranks can ask (only
    /// when the rank sleeps: a long wait).
    fn publish_wait(&self, at: usize) {
        let call = &self.inflight.calls[at];
        let waiting = match &call.state {
            State::Running(run) => run.exec.waiting_on(&run.sched),
            State::Flags(flags) => Some(flags.waiting()),
            _ => None,
        };
        if let Some(w) = waiting {
            self.recorder.board.waiting(call.desc.tag(), &w);
        }
    }

    /// Call `at` failed with `e`: the communicator is aborted (telling the
    /// peers why) and every other call fails with it.
    fn fail(&mut self, at: usize, e: Error) {
        if let Error::Collective {
            source: transport::Error::Io {
                what: "completion", ..
            },
            ..
        } = &e
        {
            self.recorder.stats.completion_errors += 1;
        }
        let reason = root_cause(&e);
        // Dumped while the call still shows what it waits on.
        self.dump_logged(&e.to_string());
        self.finish(at, Err(e));
        self.close(&reason);
    }

    /// Dumps the flight record, saying where in the log (failures only
    /// warn: the caller gets the error itself).
    fn dump_logged(&self, reason: &str) {
        match self.dump_trace(reason) {
            Ok(path) => tracing::warn!(
                rank = self.rank,
                "flight record dumped to {} (collbench trace {} merges every rank's)",
                path.display(),
                recorder::dump_dir().display()
            ),
            Err(e) => tracing::warn!(rank = self.rank, "could not dump the flight record: {e}"),
        }
    }

    /// What the running call recorded as number `n` waits on.
    pub(crate) fn waiting_on(&self, n: u64) -> Option<crate::observe::waiting::Waiting> {
        let call = self.inflight.calls.iter().find(|c| c.slot.number() == n)?;
        match &call.state {
            State::Running(run) => run.exec.waiting_on(&run.sched),
            State::Flags(flags) => Some(flags.waiting()),
            _ => None,
        }
    }

    fn finish(&mut self, at: usize, result: Result<()>) {
        let ok = result.is_ok();
        self.recorder.finished(self.inflight.calls[at].slot, ok);
        let state = std::mem::replace(&mut self.inflight.calls[at].state, State::Finished(result));
        if let State::Running(mut run) = state {
            if let (Some(out), true) = (run.copy_out, ok) {
                // The reduce-scatter's whole-size buffer holds every block.
                let whole = bytemuck::cast_slice::<u64, u8>(&self.reduce_scatter_buf);
                let (mine, len) = (self.rank * out.len, out.len);
                // SAFETY: `out` is the caller's receive buffer of `len` bytes,
                // still reserved for this call.
                let out = unsafe { std::slice::from_raw_parts_mut(out.ptr_or_dangling(), len) };
                out.copy_from_slice(&whole[mine..mine + len]);
            }
            run.input = None;
            run.output = None;
            self.inflight.spare.push(run);
        }
    }

    /// Runs every call whose turn has come: all point-to-point calls, and
    /// the oldest unfinished collective once nothing is ahead of it.
    fn begin_ready(&mut self) {
        let mut collective_busy = false;
        for at in 0..self.inflight.calls.len() {
            let call = &self.inflight.calls[at];
            let p2p = call.args.collective == Collective::PointToPoint;
            match call.state {
                State::Running(_) | State::Flags(_) if !p2p => collective_busy = true,
                State::Queued if p2p || !collective_busy => {
                    if !p2p {
                        collective_busy = true;
                    }
                    if let Err(e) = self.begin(at) {
                        self.fail(at, e);
                        return;
                    }
                }
                _ => {}
            }
        }
    }

    /// Chooses the call's algorithm, builds its schedule, registers its
    /// buffers and starts its execution.
    fn begin(&mut self, at: usize) -> Result<()> {
        if self.begin_flags(at)? {
            return Ok(());
        }
        let rank = self.rank;
        let call = &mut self.inflight.calls[at];
        let (desc, peer, counts) = (call.desc, call.args.peer, call.args.counts.take());
        let (mut input, mut output) = (call.input, call.output);
        let elem = desc.dtype.size();
        let larger = call.larger();
        let (chunk_bytes, slots) = self.pipeline(desc.collective, larger);
        let (build, in_place_ok, lane, windows, algo_name) = match desc.collective {
            Collective::PointToPoint => (
                algo::POINT_TO_POINT,
                true,
                Lane::PointToPoint,
                Windows {
                    sends: usize::MAX,
                    recvs: usize::MAX,
                    slots: 0,
                },
                "p2p",
            ),
            c => {
                let algo = self.selector.choose_cached(&self.config, c, larger)?;
                let windows = Windows {
                    sends: transfers::SEND_WINDOW.max(self.config.depth),
                    recvs: self.config.depth,
                    slots,
                };
                (
                    algo.build,
                    algo.in_place,
                    Lane::Collective,
                    windows,
                    algo.name,
                )
            }
        };
        let mut copy_out = None;
        if let (Some(send), Collective::ReduceScatter) = (input, desc.collective) {
            grow(&mut self.reduce_scatter_buf, send.len);
            copy_out = Some(output);
            output = RawBuf {
                ptr: self.reduce_scatter_buf.as_mut_ptr().cast(),
                len: send.len,
            };
        }
        if input.is_none() && !in_place_ok {
            // An algorithm that cannot run in place gets a copy of the input.
            grow(&mut self.scratch, output.len);
            let copy = &mut bytemuck::cast_slice_mut(&mut self.scratch)[..output.len];
            // SAFETY: the caller's buffer, reserved for this call.
            copy.copy_from_slice(unsafe { output.bytes() });
            input = Some(RawBuf::of(copy));
        }
        let layout = Layout {
            rank,
            size: self.size,
            count: desc.count as usize,
            elem,
            chunk: (chunk_bytes / elem).max(1) * elem,
            in_place: input.is_none(),
            root: desc.root.map_or(0, usize::from),
            hosts: &self.hosts,
            call: desc,
            counts: counts.as_ref(),
            peer,
        };
        let mut run = self.inflight.spare.pop().unwrap_or_default();
        run.sched.clear();
        build(&layout, &mut run.sched);
        let slot = self.inflight.calls[at].slot;
        self.recorder.running(slot, algo_name, layout.chunk);
        tracing::debug!(rank, call = %desc, chunk = layout.chunk, steps = run.sched.len(), "start");
        self.inflight.calls[at].args.counts = counts;
        // The sender may write what a reduction receives (see
        // `MemRegion::allow_peer_writes`): the receiver then reduces one
        // chunk while the next is copied in. Not what is only copied: read
        // by the receiver, it lands in the receiver's own cache; unless
        // our core is shared with other work, where our copies crawl and a
        // sender with a core of its own is better placed to make them
        // (2-rank Broadcast of 16 MiB beside a busy loop: 0.70-0.78x the time),
        // or from a sender with nothing else to do (`Schedule::sender_writes`).
        // Staging slots follow the call's buffers (`Transfers::post`).
        let sender_writes = run.sched.sender_writes;
        let written = Access {
            peer_writes: desc.collective.reduces() || sender_writes || transport::core_shared(),
            ..Access::default()
        };
        // The input's sends only, out of place: in place, a block read in
        // place holds up the staged receive that overwrites it (4-rank
        // AllToAll of 128 KiB: 1.74x the time; out of place 0.80x). And a
        // root whose peers offer it their copies (`sender_writes`) declines
        // them for sends out of an input: it copies that to its output meanwhile.
        let read = Access {
            all_in_flight: run.sched.all_in_flight,
            declines_help: sender_writes,
            ..Access::default()
        };
        run.input = match input {
            Some(b) => Some(
                self.region(b, read)
                    .map_err(|e| Error::collective(rank, desc, e))?,
            ),
            None => None,
        };
        run.output = Some(
            self.region(output, written)
                .map_err(|e| Error::collective(rank, desc, e))?,
        );
        run.scratch = match run.sched.scratch {
            0 => None,
            bytes => {
                grow(&mut run.scratch_buf, bytes);
                let b = RawBuf {
                    ptr: run.scratch_buf.as_mut_ptr().cast(),
                    len: bytes,
                };
                Some(
                    self.region(b, written)
                        .map_err(|e| Error::collective(rank, desc, e))?,
                )
            }
        };
        run.lane = lane as usize;
        run.copy_out = copy_out;
        run.exec.start(&run.sched, self.size, windows);
        self.inflight.calls[at].state = State::Running(run);
        Ok(())
    }

    /// On a communicator with the flag path, starts call `at` there if it
    /// takes it (returns whether it did), or says it takes the general path.
    fn begin_flags(&mut self, at: usize) -> Result<bool> {
        let call = &mut self.inflight.calls[at];
        let Some(tiny) = self.tiny.on_mut() else {
            return Ok(false);
        };
        let bytes = call.larger();
        if call.desc.collective == Collective::PointToPoint {
            return Ok(false);
        }
        if !tiny.takes(call.desc.collective, bytes) {
            tiny.mark_general(&call.desc, bytes);
            return Ok(false);
        }
        let mut flags = tiny.number(&call.desc, bytes, call.input.is_none());
        post_flags(tiny, &mut flags, call.input, call.output)
            .map_err(|e| Error::collective(self.rank, call.desc, e))?;
        call.state = State::Flags(flags);
        self.recorder.running(call.slot, "tiny", bytes);
        Ok(true)
    }

    /// `b` as the executor sees it: registered with every transport in use
    /// (or found in the registration cache), flagged for the use `access`
    /// says.
    fn region(&mut self, b: RawBuf, access: Access) -> transport::Result<Region> {
        let ptr = b.ptr_or_dangling();
        let mut mr = match self.registrations.lookup(ptr, b.len) {
            Some(mr) => mr,
            None => {
                let mr = transport::register_all(self.transports.iter().map(|t| &**t), ptr, b.len)?;
                self.recorder.stats.registrations += mr.is_registered() as u64;
                mr
            }
        };
        // A failed call aborts its connections, which takes back every
        // offer to write, before the caller gets its buffers back.
        if access.peer_writes {
            mr = mr.allow_peer_writes();
        }
        if access.all_in_flight {
            mr = mr.all_in_flight();
        }
        if access.declines_help {
            mr = mr.declines_help();
        }
        Ok(Region {
            ptr,
            len: b.len,
            mr,
        })
    }
}

/// What the transport learns of how a call uses one of its buffers
/// (`Communicator::region`; each flag is `transport::MemRegion`'s of the
/// same name).
#[derive(Clone, Copy, Default)]
struct Access {
    /// Peers may write the receives posted in it.
    peer_writes: bool,
    /// Its sends are all posted at once.
    all_in_flight: bool,
    /// Its sends take up no offer to write.
    declines_help: bool,
}

/// Makes `buf` hold at least `bytes` bytes.
fn grow(buf: &mut Vec<u64>, bytes: usize) {
    let words = bytes.div_ceil(8);
    if buf.len() < words {
        buf.resize(words, 0);
    }
}

/// What to tell the peers when `e` aborts us: a peer's own abort reason is
/// passed on as it came, so every rank names the first failure, one level deep.
pub(crate) fn root_cause(e: &Error) -> String {
    match e {
        Error::Collective {
            source: transport::Error::PeerAborted { reason, .. },
            ..
        } => reason.clone(),
        Error::Aborted { reason, .. } => reason.clone(),
        e => e.to_string(),
    }
}
