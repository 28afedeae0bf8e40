//! A call as a schedule: the sends, receives and local steps of one rank,
//! with the `after` edges that order them. Algorithms build schedules (see
//! `algo/`); the executor (`executor.rs`) runs them. A schedule is plain
//! data: it never touches a transport or memory.

use transport::{Rank, Tag};

pub(crate) type StepId = usize;

/// Which of the caller's buffers a span lies in. `Input` is the send buffer,
/// or the output buffer itself for in-place calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Buf {
    Input,
    Output,
    /// A buffer of the call's own, [`Schedule::scratch`] bytes (packing).
    Scratch,
}

/// A byte range of one of the caller's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub buf: Buf,
    pub offset: usize,
    pub len: usize,
}

impl Span {
    /// The `len` bytes of this span from its byte `at`.
    pub fn part(self, at: usize, len: usize) -> Span {
        debug_assert!(at + len <= self.len, "a part beyond its span");
        Span {
            offset: self.offset + at,
            len,
            ..self
        }
    }
}

/// What happens to a receive that lands in a staging slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// `span = input op slot` (the same range of the input buffer) with
    /// `with_input`, else `span op= slot`; then divide by the rank count if
    /// `finalize` and the reduction is an average.
    Reduce { with_input: bool, finalize: bool },
    /// `span = slot`.
    Copy,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Kind {
    Send,
    Recv,
    Staged(Action),
    /// An action on this rank's own data: a span of the schedule's (see
    /// [`Schedule::operand`]) instead of a staging slot, once `after` is done.
    Local(Action),
}

/// One step of a schedule, 32 bytes: a simulation of thousands of ranks
/// holds every rank's steps, and the executor's cost per step is the cache
/// lines it touches, so the span is stored flat (a nested [`Span`] pads to
/// 24 bytes) and what is rare (a message's own tag, a local step's operand)
/// lives in side tables of the [`Schedule`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step {
    offset: usize,
    len: usize,
    peer: u32,
    /// [`NONE`] or a step id.
    after: u32,
    /// A message: 0 for the call's tag, else 1 + an index into
    /// [`Schedule::tags`]. A local step: its index into
    /// [`Schedule::operands`].
    extra: u32,
    pub kind: Kind,
    buf: Buf,
}

const NONE: u32 = u32::MAX;

impl Step {
    /// What the step sends, receives into or acts on.
    pub fn span(&self) -> Span {
        Span {
            buf: self.buf,
            offset: self.offset,
            len: self.len,
        }
    }

    pub fn is_send(&self) -> bool {
        matches!(self.kind, Kind::Send)
    }

    pub fn peer(&self) -> Rank {
        self.peer as Rank
    }

    /// Must be done before this step touches `span`: before posting a send
    /// or a direct receive, before applying a staged receive's action.
    pub fn after(&self) -> Option<StepId> {
        (self.after != NONE).then_some(self.after as StepId)
    }
}

/// The steps of one call. Steps to the same peer in the same direction are
/// posted in the order they were added, so both ends of a connection must
/// add matching steps in the same order.
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    pub(crate) steps: Vec<Step>,
    /// Local copies `(from, to)`, started once the first steps are posted and
    /// done a piece per executor step; no step may read or write their
    /// `to` spans.
    pub(crate) copies: Vec<(Span, Span)>,
    /// Tags of messages that carry their own (AllToAllv pairs and
    /// point-to-point messages carry their own counts).
    tags: Vec<Tag>,
    /// The tag given to steps added from now on (see [`Step`]).
    tag: u32,
    /// The `from` spans of local steps.
    operands: Vec<Span>,
    /// Bytes of [`Buf::Scratch`] the steps use.
    pub(crate) scratch: usize,
    /// Every send is posted at once, none waits on a receive (see
    /// [`all_in_flight`](Self::all_in_flight)).
    pub(crate) all_in_flight: bool,
    /// Receivers let the sender write what they receive (see
    /// [`sender_writes`](Self::sender_writes)).
    pub(crate) sender_writes: bool,
}

impl Schedule {
    fn push(&mut self, peer: Rank, kind: Kind, span: Span, after: Option<StepId>) -> StepId {
        let extra = self.tag;
        self.push_with(peer, kind, span, after, extra)
    }

    fn push_with(
        &mut self,
        peer: Rank,
        kind: Kind,
        span: Span,
        after: Option<StepId>,
        extra: u32,
    ) -> StepId {
        let id = self.steps.len();
        assert!(
            id < NONE as usize && peer < NONE as usize,
            "schedule too large"
        );
        self.steps.push(Step {
            offset: span.offset,
            len: span.len,
            peer: peer as u32,
            after: after.map_or(NONE, |a| a as u32),
            extra,
            kind,
            buf: span.buf,
        });
        id
    }

    /// Steps added from now on carry `tag` instead of the call's.
    pub fn set_tag(&mut self, tag: Option<Tag>) {
        self.tag = match tag {
            Some(t) => {
                self.tags.push(t);
                self.tags.len() as u32
            }
            None => 0,
        };
    }

    /// A message `step`'s own tag, if it has one (else the call's).
    pub fn tag_of(&self, step: &Step) -> Option<Tag> {
        debug_assert!(!matches!(step.kind, Kind::Local(_)));
        (step.extra != 0).then(|| self.tags[step.extra as usize - 1])
    }

    /// A local step's `from` span.
    pub fn operand(&self, step: &Step) -> Span {
        debug_assert!(matches!(step.kind, Kind::Local(_)));
        self.operands[step.extra as usize]
    }

    pub fn send(&mut self, peer: Rank, span: Span, after: Option<StepId>) -> StepId {
        self.push(peer, Kind::Send, span, after)
    }

    /// Receive straight into `span` (an output or scratch span).
    pub fn recv(&mut self, peer: Rank, span: Span, after: Option<StepId>) -> StepId {
        debug_assert_ne!(span.buf, Buf::Input);
        self.push(peer, Kind::Recv, span, after)
    }

    /// Receive into a staging slot, then reduce into `span` once `after` is
    /// done (an order of reductions that every rank follows makes every
    /// rank's result bitwise identical). A first reduction (`with_input`)
    /// without `after` receives into `span` itself instead (the executor's
    /// `lands_in_span`): nothing may read or write `span` before it.
    pub fn recv_reduce(
        &mut self,
        peer: Rank,
        span: Span,
        with_input: bool,
        finalize: bool,
        after: Option<StepId>,
    ) -> StepId {
        debug_assert_eq!(span.buf, Buf::Output);
        let action = Action::Reduce {
            with_input,
            finalize,
        };
        self.push(peer, Kind::Staged(action), span, after)
    }

    /// Apply `action` from this rank's `from` (any of its spans) to `span`
    /// (an output or scratch span) once `after` is done. `me` is this rank.
    pub fn local(
        &mut self,
        me: Rank,
        action: Action,
        from: Span,
        span: Span,
        after: Option<StepId>,
    ) -> StepId {
        debug_assert!(span.buf != Buf::Input && from.len == span.len);
        self.operands.push(from);
        let operand = (self.operands.len() - 1) as u32;
        self.push_with(me, Kind::Local(action), span, after, operand)
    }

    /// Receive into a staging slot, then copy into `span` once `after` is done.
    pub fn recv_copy(&mut self, peer: Rank, span: Span, after: Option<StepId>) -> StepId {
        debug_assert_eq!(span.buf, Buf::Output);
        self.push(peer, Kind::Staged(Action::Copy), span, after)
    }

    /// Copy `from` (input) to `to` (output) locally, as the exchange starts.
    pub fn copy(&mut self, from: Span, to: Span) {
        debug_assert!(from.buf == Buf::Input && to.buf == Buf::Output && from.len == to.len);
        self.copies.push((from, to));
    }

    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// The steps use `bytes` of scratch (the most any asks for).
    pub fn need_scratch(&mut self, bytes: usize) {
        self.scratch = self.scratch.max(bytes);
    }

    /// Every send is out at once and none forwards what a receive brought
    /// (pairwise AllToAll): the call's buffers say so to the transport
    /// (`MemRegion::all_in_flight`), whose peers then read smaller
    /// messages in place.
    pub fn all_in_flight(&mut self) {
        self.all_in_flight = true;
    }

    /// A sender with nothing else to do may copy what its peers receive
    /// into their buffers itself while they read other messages (an
    /// in-place Broadcast's root: `MemRegion::allow_peer_writes`); one
    /// that sends out of an input buffer copies that to its output
    /// meanwhile, and declines (`MemRegion::declines_help`).
    pub fn sender_writes(&mut self) {
        self.sender_writes = true;
    }

    /// The peers this schedule sends to, ascending (for tests of algorithms).
    #[cfg(test)]
    pub fn send_peers(&self) -> Vec<Rank> {
        let mut p: Vec<Rank> = (self.steps.iter())
            .filter(|s| s.is_send())
            .map(|s| s.peer())
            .collect();
        p.sort();
        p.dedup();
        p
    }

    /// Empties the schedule, keeping its memory for the next call.
    pub fn clear(&mut self) {
        self.steps.clear();
        self.copies.clear();
        self.tags.clear();
        self.tag = 0;
        self.operands.clear();
        self.scratch = 0;
        self.all_in_flight = false;
        self.sender_writes = false;
    }
}

// The size the simulator's memory and the executor's cache misses scale with.
const _: () = assert!(std::mem::size_of::<Step>() == 32);
