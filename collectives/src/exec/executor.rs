//! The one executor: the rules that decide which step of a [`Schedule`] may
//! be posted or retired next, and nothing else. What posting or retiring
//! does (a send on a connection, a reduction into memory) is behind the
//! [`Effects`] trait, so blocking calls, non-blocking ones, groups and
//! aborts all drive this same state machine, one bounded
//! [`progress`](Execution::progress) step at a time.
//!
//! The rules: steps of one peer and direction form a queue, posted in
//! schedule order; a queue keeps up to `depth` receives (and a deeper window
//! of sends) in flight; a staged receive gets a staging slot only in
//! schedule order (a slot held for a later exchange could starve the one
//! both ends need now); a step waits for its `after` step before it touches
//! its span; a staged receive's action (reduce or copy) runs as soon as it
//! landed and its `after` is done, so the receive of chunk k+1 overlaps the
//! reduction of chunk k; local copies start once the first sends are out
//! and go a piece per step, so peers start reading while this rank copies
//! its own block and find the sends behind the first window posted too.

use transport::{Rank, Tag};

use crate::algo::schedule::{Action, Kind, Schedule, Span, Step, StepId};
use crate::observe::waiting::Waiting;
use crate::sys::prefetch::prefetch;

/// What carrying out the rules does to the world: posting transfers,
/// moving bytes, reducing and copying memory.
pub(crate) trait Effects {
    /// Names a posted transfer until it completes.
    type Token: Copy;

    /// Posts `step`'s transfer, tagged `tag` (`None`: the call's tag): into
    /// staging slot `slot` for staged receives, else on `step.span`.
    fn post(
        &mut self,
        step: &Step,
        tag: Option<Tag>,
        slot: Option<usize>,
    ) -> transport::Result<Self::Token>;

    /// Whether the transfer `token` on the connection to `peer` completed.
    fn is_done(&mut self, peer: Rank, token: Self::Token) -> transport::Result<bool>;

    /// Of receive `token` from `peer`, not yet done, the bytes from its
    /// start that landed, in whole elements (0: not known before it is done).
    fn landed(&mut self, peer: Rank, token: Self::Token) -> usize {
        let _ = (peer, token);
        0
    }

    /// Moves bytes on the connections to the peers flagged in `involved`;
    /// whether anything moved.
    fn progress(&mut self, involved: &[bool]) -> transport::Result<bool>;

    /// `span (action)= from`.
    fn apply(&mut self, action: Action, span: Span, from: Source);

    /// `to = from`, both spans of the caller's buffers.
    fn copy(&mut self, from: Span, to: Span);
}

/// Where an action's operand comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Source {
    /// A staging slot holding a landed receive (or its landed part), from
    /// this byte of the slot.
    Slot(usize, usize),
    /// This rank's own data.
    Local(Span),
    /// The receive landed in the action's span itself (see [`lands_in_span`]).
    Span,
}

/// Whether staged step `step` receives straight into its own span instead
/// of a staging slot: a first reduction (`span = input op peer's`) that
/// waits for nothing. Its span holds nothing yet, so the peer's data may
/// land there, and `span = input op span` is then a two-operand pass: the
/// three-operand one reads input and slot and must fetch each line of the
/// span before writing it, a fourth stream: 2-rank Reduce of 4 MiB out of
/// place took 337 us against 284 in place, now 264 (Open MPI, which
/// receives into the result buffer the same way, 276).
pub(crate) fn lands_in_span(step: &Step) -> bool {
    matches!(
        step.kind,
        Kind::Staged(Action::Reduce {
            with_input: true,
            ..
        })
    ) && step.after().is_none()
}

/// How many transfers a queue keeps in flight.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Windows {
    pub sends: usize,
    /// Receives; staged ones are further bounded by the staging slots.
    pub recvs: usize,
    /// Staging slots available to this execution.
    pub slots: usize,
}

/// What one [`progress`](Execution::progress) step achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    /// Every step is done.
    Done,
    /// Something moved; step again.
    Moved,
    /// Nothing moved: wait for a connection before stepping again.
    Idle,
}

#[derive(Clone, Copy, Debug)]
enum State<T> {
    Waiting,
    /// With its staging slot, if staged (u16: a step's state is held for
    /// every step of a simulation of thousands of ranks).
    Posted(T, Option<u16>),
    /// A staged receive that completed; its action waits for `after`.
    Landed(u16),
    Done,
}

/// Steps of one peer and direction, in posting order: `order[start..start + len]`.
#[derive(Debug)]
struct Queue {
    peer: Rank,
    sends: bool,
    start: usize,
    len: usize,
    posted: usize,
    done: usize,
    /// Bytes of the front step's action applied while its receive landed.
    applied: usize,
}

/// One schedule in execution: its queues and the state of every step. Its
/// memory is reused by the next [`start`](Self::start), so a small call
/// allocates nothing.
pub(crate) struct Execution<T> {
    queues: Vec<Queue>,
    /// Step ids grouped by queue (a counting sort of the schedule).
    order: Vec<u32>,
    /// Per rank, its send and receive queue's index (`usize::MAX`: none).
    queue_of: Vec<[usize; 2]>,
    /// Local steps that may run once their `after` is done, in schedule order.
    locals: Vec<StepId>,
    /// `(after, step)` for local steps waiting on another local step, by
    /// `after`: released into `locals` when it runs, so a chain of n copies
    /// costs one check per step, not n.
    chained: Vec<(StepId, StepId)>,
    /// The peers some step exchanges with.
    involved: Vec<bool>,
    state: Vec<State<T>>,
    free_slots: Vec<usize>,
    /// Staged receives in schedule order, and the next one to get a slot.
    staged: Vec<u32>,
    next_staged: usize,
    remaining: usize,
    /// The next copy of `Schedule::copies` and the bytes of it done.
    copy_at: (usize, usize),
    windows: Windows,
}

/// Bytes of the schedule's local copies done per [`progress`](Execution::progress)
/// step. Done in one go, a root's copy of its 256 MiB Broadcast input held
/// up its sends beyond the first window for the copy's 25 ms, and its peer
/// read nothing meanwhile: 2 ranks took the copy's time plus the transfer's.
pub(crate) const COPY_PIECE: usize = 256 << 10;

impl<T> Default for Execution<T> {
    fn default() -> Self {
        Execution {
            queues: Vec::new(),
            order: Vec::new(),
            queue_of: Vec::new(),
            locals: Vec::new(),
            chained: Vec::new(),
            involved: Vec::new(),
            state: Vec::new(),
            free_slots: Vec::new(),
            staged: Vec::new(),
            next_staged: 0,
            remaining: 0,
            copy_at: (0, 0),
            windows: Windows {
                sends: 1,
                recvs: 1,
                slots: 0,
            },
        }
    }
}

impl<T: Copy> Execution<T> {
    /// Prepares to run `sched` among `npeers` ranks.
    pub fn start(&mut self, sched: &Schedule, npeers: usize, windows: Windows) {
        self.windows = windows;
        self.group_into_queues(sched, npeers);
        let steps = &sched.steps;
        self.state.clear();
        self.state.resize(steps.len(), State::Waiting);
        self.free_slots.clear();
        assert!(
            windows.slots <= usize::from(u16::MAX),
            "too many staging slots"
        );
        self.free_slots.extend((0..windows.slots).rev());
        self.staged.clear();
        self.staged.extend((0..steps.len() as u32).filter(|&id| {
            let step = &steps[id as StepId];
            matches!(step.kind, Kind::Staged(_)) && !lands_in_span(step)
        }));
        self.next_staged = 0;
        self.remaining = steps.len() + sched.copies.len();
        self.copy_at = (0, 0);
    }

    /// Frees what only [`start`](Self::start) uses (a table of one entry
    /// per rank), for the simulator, which holds thousands of executions.
    pub fn trim(&mut self) {
        self.queue_of = Vec::new();
    }

    fn group_into_queues(&mut self, sched: &Schedule, npeers: usize) {
        let steps = &sched.steps;
        self.queue_of.clear();
        self.queue_of.resize(npeers, [usize::MAX; 2]);
        self.queues.clear();
        self.locals.clear();
        self.chained.clear();
        for (id, step) in steps.iter().enumerate() {
            if matches!(step.kind, Kind::Local(..)) {
                match step.after() {
                    Some(a) if matches!(steps[a].kind, Kind::Local(..)) => {
                        self.chained.push((a, id))
                    }
                    _ => self.locals.push(id),
                }
                continue;
            }
            let qi = &mut self.queue_of[step.peer()][usize::from(step.is_send())];
            if *qi == usize::MAX {
                *qi = self.queues.len();
                self.queues.push(Queue {
                    peer: step.peer(),
                    sends: step.is_send(),
                    start: 0,
                    len: 0,
                    posted: 0,
                    done: 0,
                    applied: 0,
                });
            }
            self.queues[*qi].len += 1;
        }
        self.chained.sort_unstable();
        let mut start = 0;
        for q in &mut self.queues {
            q.start = start;
            start += q.len;
        }
        self.order.clear();
        self.order.resize(start, 0);
        for (id, step) in steps.iter().enumerate() {
            if !matches!(step.kind, Kind::Local(..)) {
                let q = &mut self.queues[self.queue_of[step.peer()][usize::from(step.is_send())]];
                self.order[q.start + q.posted] = id as u32;
                q.posted += 1;
            }
        }
        self.queues.iter_mut().for_each(|q| q.posted = 0);
        self.involved.clear();
        self.involved.resize(npeers, false);
        for q in &self.queues {
            self.involved[q.peer] = true;
        }
    }

    /// The peers this execution exchanges with, as flags by rank.
    pub fn involved(&self) -> &[bool] {
        &self.involved
    }

    /// One bounded step: post what may be posted, move bytes, retire what
    /// completed, run the actions whose turn has come. Errors name the
    /// peer; on error some transfers may still be posted, so the caller
    /// must abort the connections before the buffers go away.
    pub fn progress<E: Effects<Token = T>>(
        &mut self,
        sched: &Schedule,
        fx: &mut E,
    ) -> transport::Result<Progress> {
        let mut moved = false;
        for qi in 0..self.queues.len() {
            moved |= self.post_ready(qi, sched, fx)?;
        }
        moved |= fx.progress(&self.involved)?;
        moved |= self.copy_piece(sched, fx);
        for qi in 0..self.queues.len() {
            moved |= self.complete_ready(qi, sched, fx)?;
        }
        moved |= self.run_locals(sched, fx);
        Ok(match (self.remaining, moved) {
            (0, _) => Progress::Done,
            (_, true) => Progress::Moved,
            (_, false) => Progress::Idle,
        })
    }

    /// Posts queue `qi`'s next steps while its window, `after` edges and
    /// the staging slots allow.
    fn post_ready<E: Effects<Token = T>>(
        &mut self,
        qi: usize,
        sched: &Schedule,
        fx: &mut E,
    ) -> transport::Result<bool> {
        let q = &self.queues[qi];
        // Sends only point into the caller's memory, so they get a deeper
        // window than receives, whose depth is bounded by the staging slots:
        // a peer busy copying one chunk then finds the next ones published.
        let window = if q.sends {
            self.windows.sends
        } else {
            self.windows.recvs
        };
        let mut moved = false;
        loop {
            let q = &self.queues[qi];
            if q.posted == q.len || q.posted - q.done >= window {
                break;
            }
            let id = self.order[q.start + q.posted] as StepId;
            let step = &sched.steps[id];
            let slot = match step.kind {
                Kind::Send | Kind::Recv if self.done(step.after()) => None,
                Kind::Staged(_) if lands_in_span(step) => None,
                Kind::Staged(_)
                    if !self.free_slots.is_empty()
                        && self.staged.get(self.next_staged) == Some(&(id as u32)) =>
                {
                    self.next_staged += 1;
                    self.free_slots.pop()
                }
                _ => break,
            };
            let token = fx.post(step, sched.tag_of(step), slot)?;
            self.state[id] = State::Posted(token, slot.map(|s| s as u16));
            self.queues[qi].posted += 1;
            moved = true;
        }
        Ok(moved)
    }

    /// Retires queue `qi`'s completed steps in order, applying staged actions.
    fn complete_ready<E: Effects<Token = T>>(
        &mut self,
        qi: usize,
        sched: &Schedule,
        fx: &mut E,
    ) -> transport::Result<bool> {
        let mut moved = false;
        loop {
            let q = &self.queues[qi];
            if q.done == q.posted {
                break;
            }
            let id = self.order[q.start + q.done] as StepId;
            let step = &sched.steps[id];
            match self.state[id] {
                State::Posted(token, slot) => {
                    if !fx.is_done(step.peer(), token)? {
                        moved |= self.apply_landed(qi, step, token, slot, fx);
                        break;
                    }
                    moved = true;
                    match (slot, step.kind) {
                        (Some(slot), _) => {
                            self.state[id] = State::Landed(slot);
                            continue;
                        }
                        (None, Kind::Staged(action)) => {
                            let rest = self.unapplied(qi, step.span());
                            fx.apply(action, rest, Source::Span)
                        }
                        (None, _) => {}
                    }
                }
                State::Landed(slot) => {
                    if !self.done(step.after()) {
                        break;
                    }
                    let Kind::Staged(action) = step.kind else {
                        unreachable!("only staged receives land")
                    };
                    let (rest, from) = (self.unapplied(qi, step.span()), self.queues[qi].applied);
                    fx.apply(action, rest, Source::Slot(slot as usize, from));
                    self.free_slots.push(slot as usize);
                }
                State::Waiting | State::Done => unreachable!("queue cursor out of step"),
            }
            self.state[id] = State::Done;
            self.remaining -= 1;
            self.queues[qi].done += 1;
            self.queues[qi].applied = 0;
        }
        Ok(moved)
    }

    /// Reduces what landed of queue `qi`'s front receive, `step`, since
    /// last time, while the rest arrives: the reduction finds those bytes
    /// still in cache. Only once the step's `after` is done, as whole.
    fn apply_landed<E: Effects<Token = T>>(
        &mut self,
        qi: usize,
        step: &Step,
        token: T,
        slot: Option<u16>,
        fx: &mut E,
    ) -> bool {
        let Kind::Staged(action @ Action::Reduce { .. }) = step.kind else {
            return false;
        };
        if !self.done(step.after()) {
            return false;
        }
        let (applied, landed) = (self.queues[qi].applied, fx.landed(step.peer(), token));
        if landed <= applied {
            return false;
        }
        let part = step.span().part(applied, landed - applied);
        let from = match slot {
            Some(slot) => Source::Slot(slot as usize, applied),
            None => Source::Span,
        };
        fx.apply(action, part, from);
        self.queues[qi].applied = landed;
        true
    }

    /// What of `span`, queue `qi`'s front step's, is not yet applied.
    fn unapplied(&self, qi: usize, span: Span) -> Span {
        let applied = self.queues[qi].applied;
        span.part(applied, span.len - applied)
    }

    /// Copies the next [`COPY_PIECE`] bytes of the schedule's local copies.
    fn copy_piece<E: Effects<Token = T>>(&mut self, sched: &Schedule, fx: &mut E) -> bool {
        let (i, done) = self.copy_at;
        let Some(&(from, to)) = sched.copies.get(i) else {
            return false;
        };
        let len = COPY_PIECE.min(from.len - done);
        fx.copy(from.part(done, len), to.part(done, len));
        self.copy_at = if done + len == from.len {
            self.remaining -= 1;
            (i + 1, 0)
        } else {
            (i, done + len)
        };
        true
    }

    /// Applies the local steps whose turn has come, in schedule order.
    fn run_locals<E: Effects<Token = T>>(&mut self, sched: &Schedule, fx: &mut E) -> bool {
        let mut ran = false;
        let mut i = 0;
        while i < self.locals.len() {
            let id = self.locals[i];
            let step = &sched.steps[id];
            if !self.done(step.after()) {
                i += 1;
                continue;
            }
            let Kind::Local(action) = step.kind else {
                unreachable!("only local steps")
            };
            fx.apply(action, step.span(), Source::Local(sched.operand(step)));
            self.state[id] = State::Done;
            self.remaining -= 1;
            self.locals.remove(i);
            // Its dependents may run now, later in this same pass.
            let first = self.chained.partition_point(|&(a, _)| a < id);
            let released = self.chained[first..].iter().take_while(|&&(a, _)| a == id);
            self.locals.extend(released.map(|&(_, c)| c));
            ran = true;
        }
        ran
    }

    /// Asks the CPU to start loading what the next [`progress`](Self::progress)
    /// step reads first, for a rank that runs soon (the simulator's: with
    /// thousands of ranks, those lines are never in cache). Four stages,
    /// each reading only what the one before loaded: 0, the queues'
    /// cursors; 1, the step ids at the cursors and the next staged one; 2,
    /// those steps and states; 3, the states of the steps they come after.
    pub fn prefetch(&self, sched: &Schedule, stage: u8) {
        if stage == 1 {
            if let Some(next) = self.staged.get(self.next_staged) {
                prefetch(next);
            }
        }
        for q in self.queues.iter().take(2) {
            if stage == 0 {
                prefetch(q);
                continue;
            }
            for k in [q.posted, q.done].into_iter().filter(|&k| k < q.len) {
                let at = &self.order[q.start + k];
                match stage {
                    1 => prefetch(at),
                    2 => {
                        prefetch(&sched.steps[*at as usize]);
                        prefetch(&self.state[*at as usize]);
                    }
                    _ => {
                        if let Some(after) = sched.steps[*at as usize].after() {
                            prefetch(&self.state[after]);
                        }
                    }
                }
            }
        }
    }

    /// The tokens of the posted transfers at the heads of the queues: an
    /// execution that stopped moves again only once one of them completes
    /// (each queue retires in order).
    pub fn awaited(&self) -> impl Iterator<Item = T> + '_ {
        (self.queues.iter())
            .filter(|q| q.done < q.posted)
            .filter_map(
                |q| match self.state[self.order[q.start + q.done] as StepId] {
                    State::Posted(token, _) => Some(token),
                    _ => None,
                },
            )
    }

    fn done(&self, step: Option<StepId>) -> bool {
        step.is_none_or(|id| matches!(self.state[id], State::Done))
    }

    /// What this execution waits on: the first unfinished receive (what a
    /// silent peer starves), else the first unfinished send.
    pub fn waiting_on(&self, sched: &Schedule) -> Option<Waiting> {
        let q = (self.queues.iter())
            .filter(|q| q.done < q.len)
            .min_by_key(|q| q.sends)?;
        let step = &sched.steps[self.order[q.start + q.done] as StepId];
        Some(Waiting {
            peer: q.peer,
            send: q.sends,
            index: q.done + 1,
            of: q.len,
            bytes: step.span().len,
        })
    }
}

// What the simulator holds per step of every rank (with u32 tokens).
const _: () = assert!(std::mem::size_of::<State<u32>>() == 8);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::schedule::Buf;

    /// Effects on a log: transfers complete on the step after posting.
    #[derive(Default)]
    struct Log {
        posted: Vec<(Rank, bool, Option<usize>)>,
        applied: Vec<(usize, Option<usize>)>,
        /// `(offset, len, sends posted so far)` of each local copy.
        copied: Vec<(usize, usize, usize)>,
        round: usize,
        pending: Vec<(usize, usize)>,
    }

    impl Effects for Log {
        type Token = usize;
        fn post(
            &mut self,
            step: &Step,
            _: Option<Tag>,
            slot: Option<usize>,
        ) -> transport::Result<usize> {
            self.posted.push((step.peer(), step.is_send(), slot));
            self.pending.push((self.posted.len() - 1, self.round));
            Ok(self.posted.len() - 1)
        }
        fn is_done(&mut self, _: Rank, token: usize) -> transport::Result<bool> {
            Ok(self
                .pending
                .iter()
                .any(|&(t, r)| t == token && r < self.round))
        }
        fn progress(&mut self, _: &[bool]) -> transport::Result<bool> {
            self.round += 1;
            Ok(false)
        }
        fn apply(&mut self, _: Action, span: Span, from: Source) {
            let slot = match from {
                Source::Slot(s, _) => Some(s),
                Source::Local(_) | Source::Span => None,
            };
            self.applied.push((span.offset, slot));
        }
        fn copy(&mut self, from: Span, to: Span) {
            assert_eq!((from.offset, from.len), (to.offset, to.len));
            self.copied.push((to.offset, to.len, self.posted.len()));
        }
    }

    fn span(offset: usize) -> Span {
        Span {
            buf: Buf::Output,
            offset,
            len: 8,
        }
    }

    /// Runs `s` on rank 0 of 2 to the end, `window` transfers in flight
    /// per queue and `slots` staging slots.
    fn run(s: &Schedule, window: usize, slots: usize) -> (Execution<usize>, Log) {
        let mut e = Execution::default();
        let windows = Windows {
            sends: window,
            recvs: window,
            slots,
        };
        e.start(s, 2, windows);
        let mut fx = Log::default();
        let mut steps = 0;
        while e.progress(s, &mut fx).unwrap() != Progress::Done {
            steps += 1;
            assert!(steps < 100, "never finished");
        }
        (e, fx)
    }

    #[test]
    fn windows_slots_and_after_edges_are_respected() {
        let mut s = Schedule::default();
        // Three staged receives from rank 1 with one slot, reduced in order,
        // and a send that waits for the last reduction.
        let mut last = None;
        for k in 0..3 {
            last = Some(s.recv_reduce(1, span(8 * k), false, false, last));
        }
        s.send(1, span(0), last);
        let (e, fx) = run(&s, 4, 1);
        // One slot: each receive is posted only after the previous one
        // was reduced, and the send only after all three.
        let kinds: Vec<bool> = fx.posted.iter().map(|p| p.1).collect();
        assert_eq!(kinds, [false, false, false, true]);
        assert!(fx.posted[..3].iter().all(|p| p.2 == Some(0)));
        assert_eq!(fx.applied, [(0, Some(0)), (8, Some(0)), (16, Some(0))]);
        assert!(e.waiting_on(&s).is_none());
    }

    #[test]
    fn a_first_reduction_that_waits_for_nothing_lands_in_its_span() {
        // Out of place, chunk 0's first reduction waits for nothing: it
        // takes no slot and is applied from its own span. Chunk 1's waits
        // for chunk 0's and must go through the one slot, as must a later,
        // second reduction.
        let mut s = Schedule::default();
        let first = s.recv_reduce(1, span(0), true, false, None);
        s.recv_reduce(1, span(8), true, false, Some(first));
        s.recv_reduce(1, span(0), false, false, Some(first));
        assert!(lands_in_span(&s.steps[first]));
        assert!(!lands_in_span(&s.steps[first + 1]) && !lands_in_span(&s.steps[first + 2]));
        let (_, fx) = run(&s, 4, 1);
        let slots: Vec<_> = fx.posted.iter().map(|p| p.2).collect();
        assert_eq!(slots, [None, Some(0), Some(0)]);
        assert_eq!(fx.applied, [(0, None), (8, Some(0)), (0, Some(0))]);
    }

    #[test]
    fn a_large_copy_goes_a_piece_a_step_while_sends_keep_being_posted() {
        // A Broadcast root out of place: its whole buffer copied, and eight
        // chunk sends with a window of two.
        let len = 3 * COPY_PIECE + 8;
        let mut s = Schedule::default();
        let whole = |buf| Span {
            buf,
            offset: 0,
            len,
        };
        s.copy(whole(Buf::Input), whole(Buf::Output));
        for k in 0..8 {
            s.send(1, span(8 * k), None);
        }
        let (_, fx) = run(&s, 2, 0);
        let pieces: Vec<_> = fx.copied.iter().map(|&(o, l, _)| (o, l)).collect();
        let p = COPY_PIECE;
        assert_eq!(pieces, [(0, p), (p, p), (2 * p, p), (3 * p, 8)]);
        // Each piece waits for the step's posts, and sends beyond the first
        // window go out between the pieces, not after the last.
        let posted: Vec<_> = fx.copied.iter().map(|c| c.2).collect();
        assert_eq!(posted[0], 2);
        assert!(posted[3] > 2, "no send posted while copying: {posted:?}");
    }
}
