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
//! path ([`crate::tiny`]) until it has to wait longer than a spin: it then
//! joins the queue, where every waiting policy and failure lives.
//!
//! This file holds the calls' states and how a call starts; stepping,
//! waiting and failing are in `progress.rs`.

use transport::{Poller, Request};

use crate::algo::schedule::Schedule;
use crate::bootstrap::mesh::LANES;
use crate::call::args::CallArgs;
use crate::call::descriptor::CallDesc;
use crate::exec::executor::Execution;
use crate::exec::transfers::Region;
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

    pub(super) fn ptr_or_dangling(self) -> *mut u8 {
        if self.len == 0 {
            std::ptr::dangling_mut()
        } else {
            self.ptr
        }
    }
}

pub(super) enum State {
    /// A collective waiting for the one before it.
    Queued,
    Running(Box<Running>),
    /// A small call on the flag path (`tiny.rs`).
    Flags(FlagCall),
    Finished(Result<()>),
}

pub(super) struct Call {
    pub(super) id: CallId,
    pub(super) args: CallArgs,
    pub(super) desc: CallDesc,
    pub(super) input: Option<RawBuf>,
    pub(super) output: RawBuf,
    pub(super) state: State,
    /// Its record in the flight recorder.
    pub(super) slot: Slot,
}

impl Call {
    /// See [`larger`].
    pub(super) fn larger(&self) -> usize {
        larger(self.input, self.output)
    }
}

/// The length of a call's larger buffer: what the selector and the flag
/// path go by.
pub(super) fn larger(input: Option<RawBuf>, output: RawBuf) -> usize {
    input.map_or(0, |b| b.len).max(output.len)
}

/// Posts flag call `flags` on the caller's buffers.
/// Inlined, as `alone` says.
#[inline(always)]
pub(super) fn post_flags(
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
pub(super) fn poll_flags(
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
pub(super) struct Admitted {
    pub(super) id: CallId,
    pub(super) slot: Slot,
    pub(super) desc: CallDesc,
    /// Its larger buffer's length.
    pub(super) bytes: usize,
    /// It has nothing to move: finished already.
    pub(super) skip: bool,
}

impl Admitted {
    /// The state it joins the queue in.
    pub(super) fn state(&self) -> State {
        match self.skip {
            true => State::Finished(Ok(())),
            false => State::Queued,
        }
    }
}

/// What became of a blocking call that tried the flag path alone.
pub(super) enum Alone {
    Done,
    /// It goes to the queue: to begin there, or posted and waiting.
    Queue(State),
    /// It goes to the queue and fails there (aborting the communicator).
    Failed(State, transport::Error),
}

/// A running call's schedule, execution and registered buffers; kept for
/// reuse when it finishes, so a small call allocates nothing.
#[derive(Default)]
pub(super) struct Running {
    pub(super) sched: Schedule,
    pub(super) exec: Execution<Request>,
    pub(super) lane: usize,
    pub(super) input: Option<Region>,
    pub(super) output: Option<Region>,
    /// The schedule's scratch (a call's own: calls of a group run at once).
    pub(super) scratch_buf: Vec<u64>,
    pub(super) scratch: Option<Region>,
    /// An out-of-place reduce-scatter reduces in a whole-size buffer of
    /// ours and copies this rank's block here when done.
    pub(super) copy_out: Option<RawBuf>,
}

/// How often a blocking flag call alone polls before it joins the queue
/// (a few microseconds, about the poller's spin): the queue's bookkeeping
/// is half the cost of an 8-byte call.
pub(super) const ALONE_POLLS: u32 = 64;

/// The longest sleep on a flag: a peer's death or abort shows this soon.
pub(super) const FLAG_SLEEP: std::time::Duration = std::time::Duration::from_millis(10);
/// ... while other calls run, whose progress a flag does not announce.
pub(super) const FLAG_SLEEP_WITH_OTHERS: std::time::Duration = std::time::Duration::from_micros(50);

/// The calls in flight, in start order.
pub(crate) struct InFlight {
    pub(super) next_id: u64,
    pub(super) calls: Vec<Call>,
    /// Boxed: a running call's state moves between here and its call
    /// without reallocating.
    #[allow(clippy::vec_box)]
    pub(super) spare: Vec<Box<Running>>,
    pub(super) poller: Poller,
    /// Per lane and peer: whether a running call waits on the connection.
    pub(super) involved: [Vec<bool>; LANES],
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
    pub(super) unsafe fn run_moving(
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
    pub(super) fn alone(&mut self, a: &Admitted, input: Option<RawBuf>, output: RawBuf) -> Alone {
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
    pub(super) fn nothing_to_move(&mut self, args: &CallArgs, out_of_place: bool) -> Result<()> {
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
    pub(super) fn refuse_if_aborted(&mut self) -> Result<()> {
        match self.is_aborted() {
            false => Ok(()),
            true => self.refuse_aborted(),
        }
    }

    #[cold]
    pub(super) fn refuse_aborted(&mut self) -> Result<()> {
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
    pub(super) unsafe fn admit(
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
    pub(super) fn enqueue(
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
    pub(super) fn describe(
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
            comm: self.ids.session as u8,
        })
    }
}

/// What the transport learns of how a call uses one of its buffers
/// (`Communicator::region`; each flag is `transport::MemRegion`'s of the
/// same name).
#[derive(Clone, Copy, Default)]
pub(super) struct Access {
    /// Peers may write the receives posted in it.
    pub(super) peer_writes: bool,
    /// Its sends are all posted at once.
    pub(super) all_in_flight: bool,
    /// Its sends take up no offer to write.
    pub(super) declines_help: bool,
}

/// Makes `buf` hold at least `bytes` bytes.
pub(super) fn grow(buf: &mut Vec<u64>, bytes: usize) {
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
