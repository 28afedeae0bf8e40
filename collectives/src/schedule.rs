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
pub(crate) enum Kind {
    Send,
    Recv,
    Staged(Action),
    /// An action on this rank's own data: `from` (an input span) instead of
    /// a staging slot, once `after` is done.
    Local(Action, Span),
}

/// One step of a schedule.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step {
    pub peer: Rank,
    pub kind: Kind,
    pub span: Span,
    /// Must be done before this step touches `span`: before posting a send
    /// or a direct receive, before applying a staged receive's action.
    pub after: Option<StepId>,
    /// The message's tag when it is not the call's (AllToAllv pairs and
    /// point-to-point messages carry their own counts).
    pub tag: Option<Tag>,
}

impl Step {
    pub fn is_send(&self) -> bool {
        matches!(self.kind, Kind::Send)
    }
}

/// The steps of one call. Steps to the same peer in the same direction are
/// posted in the order they were added, so both ends of a connection must
/// add matching steps in the same order.
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    pub(crate) steps: Vec<Step>,
    /// Local copies `(from, to)`, done once the first steps are posted; no
    /// receive may target their spans.
    pub(crate) copies: Vec<(Span, Span)>,
    /// The tag given to steps added from now on (`None`: the call's).
    tag: Option<Tag>,
    /// Bytes of [`Buf::Scratch`] the steps use.
    pub(crate) scratch: usize,
}

impl Schedule {
    fn push(&mut self, peer: Rank, kind: Kind, span: Span, after: Option<StepId>) -> StepId {
        self.steps.push(Step {
            peer,
            kind,
            span,
            after,
            tag: self.tag,
        });
        self.steps.len() - 1
    }

    /// Steps added from now on carry `tag` instead of the call's.
    pub fn set_tag(&mut self, tag: Option<Tag>) {
        self.tag = tag;
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
    /// rank's result bitwise identical).
    pub fn recv_reduce(
        &mut self,
        peer: Rank,
        span: Span,
        with: Option<Span>,
        finalize: bool,
        after: Option<StepId>,
    ) -> StepId {
        debug_assert_eq!(span.buf, Buf::Output);
        debug_assert!(with.is_none_or(|w| w.buf == Buf::Input && w.len == span.len));
        self.push(
            peer,
            Kind::Staged(Action::Reduce { with, finalize }),
            span,
            after,
        )
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
        self.push(me, Kind::Local(action, from), span, after)
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

    /// The peers this schedule sends to, ascending (for tests of algorithms).
    #[cfg(test)]
    pub fn send_peers(&self) -> Vec<Rank> {
        let mut p: Vec<Rank> = (self.steps.iter())
            .filter(|s| s.is_send())
            .map(|s| s.peer)
            .collect();
        p.sort();
        p.dedup();
        p
    }

    /// Empties the schedule, keeping its memory for the next call.
    pub fn clear(&mut self) {
        self.steps.clear();
        self.copies.clear();
        self.tag = None;
        self.scratch = 0;
    }
}
