//! A collective call as a schedule of sends and receives, and the one executor
//! that runs every algorithm's schedule.
//!
//! Algorithms only build schedules (see `algo/`): "send this span to peer p
//! after op k", "receive from p into a staging slot, then reduce it into this
//! span". The executor keeps up to `depth` receives (and more sends) in
//! flight per peer, reduces each staged chunk as soon as it lands (so the receive of
//! chunk k+1 overlaps the reduction of chunk k), sleeps in `poll` when nothing
//! moves, and fails with the peer named when nothing moves for `timeout`.

use std::time::Duration;

use transport::{Connection, MemRegion, Poller, Rank, Request, Tag};

use crate::reduce;
use crate::{DataType, ReduceOp};

pub(crate) type OpId = usize;

/// Which of the caller's buffers a span lies in. `Input` is the send buffer,
/// or the output buffer itself for in-place calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Buf {
    Input,
    Output,
}

/// A byte range of one of the caller's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub buf: Buf,
    pub offset: usize,
    pub len: usize,
}

/// What happens to a receive that lands in a staging slot.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Action {
    /// `span = with op slot` (or `span op= slot` without `with`), then divide
    /// by the rank count if `finalize` and the reduction is an average.
    Reduce { with: Option<Span>, finalize: bool },
    /// `span = slot`.
    Copy,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Send,
    Recv,
    Staged(Action),
    /// An action on this rank's own data: `from` (an input span) instead of
    /// a staging slot, once `after` is done.
    Local(Action, Span),
}

#[derive(Clone, Copy, Debug)]
struct Op {
    peer: Rank,
    kind: Kind,
    span: Span,
    /// Must be done before this op touches `span`: before posting a send or a
    /// direct receive, before applying a staged receive's action.
    after: Option<OpId>,
}

/// The sends and receives of one call. Ops to the same peer in the same
/// direction are posted in the order they were added, so both ends of a
/// connection must add matching ops in the same order.
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    ops: Vec<Op>,
    /// Local copies `(from, to)`, done once the first ops are posted; no
    /// receive may target their spans.
    copies: Vec<(Span, Span)>,
}

impl Schedule {
    fn push(&mut self, peer: Rank, kind: Kind, span: Span, after: Option<OpId>) -> OpId {
        self.ops.push(Op {
            peer,
            kind,
            span,
            after,
        });
        self.ops.len() - 1
    }

    pub fn send(&mut self, peer: Rank, span: Span, after: Option<OpId>) -> OpId {
        self.push(peer, Kind::Send, span, after)
    }

    /// Receive straight into `span` (an output span).
    pub fn recv(&mut self, peer: Rank, span: Span, after: Option<OpId>) -> OpId {
        debug_assert_eq!(span.buf, Buf::Output);
        self.push(peer, Kind::Recv, span, after)
    }

    /// Receive into a staging slot, then reduce into `span` once `after` is
    /// done (an order of reductions that every rank follows makes every
    /// rank's result bitwise identical).
    pub fn recv_reduce(
        &mut self,
        peer: Rank,
        span: Span,
        with: Option<Span>,
        finalize: bool,
        after: Option<OpId>,
    ) -> OpId {
        debug_assert_eq!(span.buf, Buf::Output);
        debug_assert!(with.is_none_or(|w| w.buf == Buf::Input && w.len == span.len));
        self.push(
            peer,
            Kind::Staged(Action::Reduce { with, finalize }),
            span,
            after,
        )
    }

    /// Apply `action` from this rank's `from` (an input span) to `span`
    /// once `after` is done. `me` is this rank.
    pub fn local(
        &mut self,
        me: Rank,
        action: Action,
        from: Span,
        span: Span,
        after: Option<OpId>,
    ) -> OpId {
        debug_assert!(from.buf == Buf::Input && span.buf == Buf::Output && from.len == span.len);
        self.push(me, Kind::Local(action, from), span, after)
    }

    /// Receive into a staging slot, then copy into `span` once `after` is done.
    pub fn recv_copy(&mut self, peer: Rank, span: Span, after: Option<OpId>) -> OpId {
        debug_assert_eq!(span.buf, Buf::Output);
        self.push(peer, Kind::Staged(Action::Copy), span, after)
    }

    /// Copy `from` (input) to `to` (output) locally, as the exchange starts.
    pub fn copy(&mut self, from: Span, to: Span) {
        debug_assert!(from.buf == Buf::Input && to.buf == Buf::Output && from.len == to.len);
        self.copies.push((from, to));
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// The peers this schedule sends to, ascending (for tests of algorithms).
    #[cfg(test)]
    pub fn send_peers(&self) -> Vec<Rank> {
        let mut p: Vec<Rank> = (self.ops.iter())
            .filter(|o| matches!(o.kind, Kind::Send))
            .map(|o| o.peer)
            .collect();
        p.sort();
        p.dedup();
        p
    }

    /// Empties the schedule, keeping its memory for the next call.
    pub fn clear(&mut self) {
        self.ops.clear();
        self.copies.clear();
    }
}

/// A caller buffer as the executor sees it.
pub(crate) struct Region {
    pub ptr: *mut u8,
    pub len: usize,
    pub mr: MemRegion,
}

/// Chunk-sized receive slots, registered once and reused by every call.
pub(crate) struct Staging {
    storage: Vec<u64>,
    mr: MemRegion,
    pub slot_bytes: usize,
    pub slots: usize,
}

impl Staging {
    pub fn new(
        transports: &[&dyn transport::Transport],
        slot_bytes: usize,
        slots: usize,
    ) -> transport::Result<Self> {
        // u64 storage keeps every slot aligned for any datatype.
        let slot_bytes = slot_bytes.next_multiple_of(64);
        let mut storage = vec![0u64; slot_bytes * slots / 8];
        let mr = transport::register_all(
            transports.iter().copied(),
            storage.as_mut_ptr().cast(),
            slot_bytes * slots,
        )?;
        Ok(Staging {
            storage,
            mr,
            slot_bytes,
            slots,
        })
    }

    /// The bytes of `slot`'s first `len` bytes.
    fn slot(&self, slot: usize, len: usize) -> &[u8] {
        &bytemuck::cast_slice(&self.storage)[slot * self.slot_bytes..][..len]
    }
}

/// Everything a schedule runs against.
pub(crate) struct Exec<'a> {
    pub peers: &'a mut [Option<Box<dyn Connection>>],
    /// `None` for in-place calls.
    pub input: Option<Region>,
    pub output: Region,
    pub staging: &'a mut Staging,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub nranks: usize,
    pub tag: Tag,
    pub timeout: Duration,
    pub depth: usize,
    /// How long an idle rank spins before it yields its core.
    pub spin: Duration,
}

#[derive(Clone, Copy, Debug)]
enum State {
    Waiting,
    Posted(Request, Option<usize>),
    /// A staged receive that completed; its action waits for `after`.
    Landed(usize),
    Done,
}

/// Sends in flight per peer.
const SEND_WINDOW: usize = 16;

/// Ops of one peer and direction, in posting order: `order[start..start + len]`.
struct Queue {
    peer: Rank,
    sends: bool,
    start: usize,
    len: usize,
    posted: usize,
    done: usize,
}

impl Queue {
    /// The `i`-th op of the queue.
    fn op(&self, order: &[OpId], i: usize) -> OpId {
        order[self.start + i]
    }
}

/// The executor's memory, kept by the communicator and reused by every call
/// so that a small collective allocates nothing.
#[derive(Default)]
pub(crate) struct Workspace {
    /// The schedule of the current call (cleared before each build).
    pub sched: Schedule,
    queues: Vec<Queue>,
    /// Op ids grouped by queue (a counting sort of the schedule).
    order: Vec<OpId>,
    /// Per rank, its send and receive queue's index (`usize::MAX`: none).
    queue_of: Vec<[usize; 2]>,
    locals: Vec<OpId>,
    involved: Vec<bool>,
    run: Run,
}

impl Workspace {
    /// Groups the schedule's ops into per-peer queues and resets the state.
    fn prepare(&mut self, npeers: usize, slots: usize) {
        let ops = &self.sched.ops;
        self.queue_of.clear();
        self.queue_of.resize(npeers, [usize::MAX; 2]);
        self.queues.clear();
        self.locals.clear();
        for (id, op) in ops.iter().enumerate() {
            if matches!(op.kind, Kind::Local(..)) {
                self.locals.push(id);
                continue;
            }
            let sends = matches!(op.kind, Kind::Send);
            let qi = &mut self.queue_of[op.peer][usize::from(sends)];
            if *qi == usize::MAX {
                *qi = self.queues.len();
                self.queues.push(Queue {
                    peer: op.peer,
                    sends,
                    start: 0,
                    len: 0,
                    posted: 0,
                    done: 0,
                });
            }
            self.queues[*qi].len += 1;
        }
        let mut start = 0;
        for q in &mut self.queues {
            q.start = start;
            start += q.len;
        }
        self.order.clear();
        self.order.resize(start, 0);
        for (id, op) in ops.iter().enumerate() {
            if !matches!(op.kind, Kind::Local(..)) {
                let q = &mut self.queues
                    [self.queue_of[op.peer][usize::from(matches!(op.kind, Kind::Send))]];
                self.order[q.start + q.posted] = id;
                q.posted += 1;
            }
        }
        self.queues.iter_mut().for_each(|q| q.posted = 0);
        self.involved.clear();
        self.involved.resize(npeers, false);
        self.queues
            .iter()
            .for_each(|q| self.involved[q.peer] = true);
        let run = &mut self.run;
        run.state.clear();
        run.state.resize(ops.len(), State::Waiting);
        run.free_slots.clear();
        run.free_slots.extend((0..slots).rev());
        run.staged.clear();
        run.staged
            .extend((0..ops.len()).filter(|id| matches!(ops[*id].kind, Kind::Staged(_))));
        run.next_staged = 0;
        run.remaining = ops.len();
    }
}

impl Exec<'_> {
    /// Runs the workspace's schedule to completion. Errors name the peer; on
    /// error some ops may still be posted: the caller must abort the
    /// connections before the buffers go away.
    pub fn run(mut self, ws: &mut Workspace) -> transport::Result<()> {
        ws.prepare(self.peers.len(), self.staging.slots);
        let Workspace {
            sched,
            queues,
            order,
            locals,
            involved,
            run,
            ..
        } = ws;
        let mut poller = Poller::new(self.spin, Poller::DEFAULT_PATIENCE);
        let mut copies = sched.copies.as_slice();
        loop {
            let mut moved = false;
            for q in queues.iter_mut() {
                moved |= self.post_ready(sched, q, order, run)?;
            }
            for conn in self.involved(involved) {
                moved |= conn.progress()?;
            }
            // Local copies once the first sends are out, so that peers
            // start reading while this rank copies its own block.
            for (from, to) in std::mem::take(&mut copies) {
                self.span_mut(*to).copy_from_slice(self.span(*from));
            }
            if run.remaining == 0 {
                break;
            }
            for q in queues.iter_mut() {
                moved |= self.complete_ready(sched, q, order, run)?;
            }
            moved |= self.run_locals(sched, locals, run);
            if moved {
                poller.busy();
            } else {
                let timeout = self.timeout;
                if !poller.idle(self.involved(involved), timeout)? {
                    return Err(self.timeout_error(sched, queues, order, poller.idle_for()));
                }
            }
        }
        Ok(())
    }

    fn involved<'b>(
        &'b mut self,
        involved: &'b [bool],
    ) -> impl Iterator<Item = &'b mut Box<dyn Connection>> + 'b {
        self.peers
            .iter_mut()
            .zip(involved)
            .filter(|(_, inv)| **inv)
            .filter_map(|(c, _)| c.as_mut())
    }

    /// Posts the queue's next ops while the window, dependencies and staging allow.
    fn post_ready(
        &mut self,
        sched: &Schedule,
        q: &mut Queue,
        order: &[OpId],
        run: &mut Run,
    ) -> transport::Result<bool> {
        let mut moved = false;
        // Sends only point into the caller's memory, so they get a deeper
        // window than receives, whose depth is bounded by the staging slots:
        // a peer busy copying one chunk then finds the next ones published.
        let window = if q.sends {
            SEND_WINDOW.max(self.depth)
        } else {
            self.depth
        };
        while q.posted < q.len && q.posted - q.done < window {
            let id = q.op(order, q.posted);
            let op = sched.ops[id];
            let ready = match op.kind {
                Kind::Send | Kind::Recv => run.done(op.after),
                // Slots go to staged receives in schedule order, never to a
                // later one first: a slot held for a later exchange could
                // starve the one both ends need now.
                Kind::Staged(_) => {
                    !run.free_slots.is_empty() && run.staged.get(run.next_staged) == Some(&id)
                }
                Kind::Local(..) => unreachable!("local ops are in no queue"),
            };
            if !ready {
                break;
            }
            let (mr, offset, slot) = match op.kind {
                Kind::Staged(_) => {
                    let slot = run.free_slots.pop().expect("checked above");
                    run.next_staged += 1;
                    if op.span.len > self.staging.slot_bytes {
                        return Err(transport::Error::Invalid(format!(
                            "a staged receive of {} bytes exceeds the {}-byte staging slots",
                            op.span.len, self.staging.slot_bytes
                        )));
                    }
                    (
                        self.staging.mr.clone(),
                        slot * self.staging.slot_bytes,
                        Some(slot),
                    )
                }
                _ => (self.region(op.span.buf).mr.clone(), op.span.offset, None),
            };
            let conn = connection(self.peers, op.peer)?;
            // SAFETY: the span or slot stays valid for the whole call (the
            // caller aborts the connections before returning on error), and
            // the schedule's `after` edges keep anyone else off these bytes
            // until the request completes.
            let req = unsafe {
                match op.kind {
                    Kind::Send => conn.isend(&mr, offset, op.span.len, self.tag)?,
                    _ => conn.irecv(&mr, offset, op.span.len, self.tag)?,
                }
            };
            run.state[id] = State::Posted(req, slot);
            q.posted += 1;
            moved = true;
        }
        Ok(moved)
    }

    /// Retires the queue's completed ops in order, applying staged actions.
    fn complete_ready(
        &mut self,
        sched: &Schedule,
        q: &mut Queue,
        order: &[OpId],
        run: &mut Run,
    ) -> transport::Result<bool> {
        let mut moved = false;
        while q.done < q.posted {
            let id = q.op(order, q.done);
            let op = sched.ops[id];
            match run.state[id] {
                State::Posted(req, slot) => {
                    if !connection(self.peers, op.peer)?.is_done(req) {
                        break;
                    }
                    moved = true;
                    if let Some(slot) = slot {
                        run.state[id] = State::Landed(slot);
                        continue;
                    }
                }
                State::Landed(slot) => {
                    if !run.done(op.after) {
                        break;
                    }
                    let Kind::Staged(action) = op.kind else {
                        unreachable!("only staged receives land")
                    };
                    // The slot holds a completed receive; no request targets
                    // it until it is freed below.
                    self.apply(action, op.span, self.staging.slot(slot, op.span.len));
                    run.free_slots.push(slot);
                }
                State::Waiting | State::Done => unreachable!("queue cursor out of step"),
            }
            run.state[id] = State::Done;
            run.remaining -= 1;
            q.done += 1;
        }
        Ok(moved)
    }

    /// Applies the local ops whose turn has come, in schedule order.
    fn run_locals(&mut self, sched: &Schedule, locals: &mut Vec<OpId>, run: &mut Run) -> bool {
        let before = locals.len();
        locals.retain(|&id| {
            let op = sched.ops[id];
            let Kind::Local(action, from) = op.kind else {
                unreachable!("only local ops")
            };
            if !run.done(op.after) {
                return true;
            }
            self.apply(action, op.span, self.span(from));
            run.state[id] = State::Done;
            run.remaining -= 1;
            false
        });
        locals.len() != before
    }

    /// Folds `src` (a landed staging slot, or this rank's own input) into `span`.
    fn apply(&self, action: Action, span: Span, src: &[u8]) {
        let dst = self.span_mut(span);
        match action {
            Action::Copy => dst.copy_from_slice(src),
            Action::Reduce { with, finalize } => {
                match with {
                    None => reduce::reduce_into(self.dtype, self.op, dst, src),
                    Some(w) => {
                        let a = self.span(w);
                        reduce::reduce_to(self.dtype, self.op, dst, a, src)
                    }
                }
                if finalize {
                    reduce::finalize(self.dtype, self.op, dst, self.nranks);
                }
            }
        }
    }

    fn region(&self, buf: Buf) -> &Region {
        match (buf, &self.input) {
            (Buf::Input, Some(input)) => input,
            _ => &self.output,
        }
    }

    fn span(&self, span: Span) -> &[u8] {
        let r = self.region(span.buf);
        assert!(span.offset + span.len <= r.len);
        // SAFETY: in bounds (checked); input spans are never written, and the
        // schedule keeps receives off any span while it is read here.
        unsafe { std::slice::from_raw_parts(r.ptr.add(span.offset), span.len) }
    }

    #[allow(clippy::mut_from_ref)] // the buffer is reached through a raw pointer
    fn span_mut(&self, span: Span) -> &mut [u8] {
        assert_eq!(span.buf, Buf::Output, "only the output buffer is written");
        let r = &self.output;
        assert!(span.offset + span.len <= r.len);
        // SAFETY: in bounds (checked); the schedule's `after` edges guarantee
        // no posted request reads or writes this span while it is written,
        // and `with` spans live in the distinct input buffer.
        unsafe { std::slice::from_raw_parts_mut(r.ptr.add(span.offset), span.len) }
    }

    fn timeout_error(
        &self,
        sched: &Schedule,
        queues: &[Queue],
        order: &[OpId],
        waited: Duration,
    ) -> transport::Error {
        // Blame the first unfinished receive: it is what a silent peer starves.
        let stuck = queues
            .iter()
            .filter(|q| q.done < q.len)
            .min_by_key(|q| q.sends)
            .expect("timed out with nothing pending");
        let op = sched.ops[stuck.op(order, stuck.done)];
        let (what, dir) = if matches!(op.kind, Kind::Send) {
            ("send", "to")
        } else {
            ("receive", "from")
        };
        transport::Error::Timeout {
            peer: stuck.peer,
            waited,
            waiting_for: format!(
                "{what} {} of {} {dir} it, {} bytes, not complete",
                stuck.done + 1,
                stuck.len,
                op.span.len
            ),
        }
    }
}

#[derive(Default)]
struct Run {
    state: Vec<State>,
    free_slots: Vec<usize>,
    /// Staged receives in schedule order, and the next one to get a slot.
    staged: Vec<OpId>,
    next_staged: usize,
    remaining: usize,
}

impl Run {
    fn done(&self, op: Option<OpId>) -> bool {
        op.is_none_or(|id| matches!(self.state[id], State::Done))
    }
}

fn connection(
    peers: &mut [Option<Box<dyn Connection>>],
    peer: Rank,
) -> transport::Result<&mut Box<dyn Connection>> {
    peers
        .get_mut(peer)
        .and_then(|c| c.as_mut())
        .ok_or_else(|| transport::Error::Invalid(format!("no connection to rank {peer}")))
}
