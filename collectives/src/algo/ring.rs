//! Ring algorithms: AllReduce as reduce-scatter then all-gather around the
//! ring, and those two phases on their own as ReduceScatter and AllGather;
//! Reduce as reduce-scatter then every block straight to the root.
//! Each step's block is cut into chunks, so a chunk moves on as soon as it
//! is reduced. The phases run on any [`Ring`] (a group of ranks and a byte
//! range), which is how the hierarchical AllReduce reuses them.
//!
//! With n ranks the range is cut into n blocks. In reduce-scatter step t,
//! member m sends block m+d-1-t to m+1 and receives block m+d-2-t from m-1,
//! reducing it into its own; after n-1 steps member m holds block m+d fully
//! reduced (d = 1 for AllReduce, 0 for ReduceScatter, whose rank r must end
//! with block r). All-gather circulates the owned blocks for n-1 more steps.
//! Each rank sends (n-1)/n of the range per phase: bandwidth-optimal.

use super::{copy_all, Algorithm, Layout};
use crate::algo::schedule::{Buf, Schedule, Span, StepId};
use crate::Collective;

pub(super) const ALLREDUCE: Algorithm = Algorithm {
    name: "ring",
    collective: Collective::AllReduce,
    summary: "reduce-scatter + all-gather around a ring, chunk-pipelined; bandwidth-optimal",
    in_place: true,
    build: allreduce,
};

pub(super) const REDUCE_SCATTER: Algorithm = Algorithm {
    name: "ring",
    collective: Collective::ReduceScatter,
    summary: "n-1 steps around a ring, each reducing one block on the way; bandwidth-optimal",
    in_place: true,
    build: reduce_scatter,
};

pub(super) const ALLGATHER: Algorithm = Algorithm {
    name: "ring",
    collective: Collective::AllGather,
    summary: "n-1 steps around a ring, each forwarding the block just received; bandwidth-optimal",
    in_place: true,
    build: all_gather,
};

pub(super) const REDUCE: Algorithm = Algorithm {
    name: "ring",
    collective: Collective::Reduce,
    summary: "reduce-scatter around a ring, then every rank sends its reduced block to the root; each rank reduces 1/n",
    in_place: true,
    build: reduce,
};

/// A ring: `members` in ring order (this rank at `me`), over the byte range
/// `[offset, offset + len)` of the buffers.
pub(super) struct Ring {
    pub members: Vec<usize>,
    pub me: usize,
    pub offset: usize,
    pub len: usize,
}

impl Ring {
    /// Every rank of the call, over the whole buffer.
    pub fn world(l: &Layout) -> Self {
        Ring {
            members: (0..l.size).collect(),
            me: l.rank,
            offset: 0,
            len: l.count * l.elem,
        }
    }

    fn n(&self) -> usize {
        self.members.len()
    }

    fn next(&self) -> usize {
        self.members[(self.me + 1) % self.n()]
    }

    fn prev(&self) -> usize {
        self.members[(self.me + self.n() - 1) % self.n()]
    }

    /// The block this member sends at reduce-scatter step `t` (me+d-1-t mod
    /// n); the one it receives at step t is the one it sends at t+1.
    fn reduce_scatter_sends(&self, d: usize, t: usize) -> usize {
        (self.me + d + 2 * self.n() - 1 - t) % self.n()
    }

    /// The reduce-scatter step at which this member sends `block` (any but
    /// its own block me+d): the inverse of [`reduce_scatter_sends`](Self::reduce_scatter_sends).
    fn reduce_scatter_step_sending(&self, d: usize, block: usize) -> usize {
        let t = (self.me + d + 2 * self.n() - 1 - block) % self.n();
        debug_assert_eq!(self.reduce_scatter_sends(d, t), block);
        t
    }

    /// Block `i` (mod n) of the range, cut as evenly as elements allow.
    pub fn block(&self, l: &Layout, i: usize) -> (usize, usize) {
        let (n, i) = (self.n(), i % self.n());
        let count = self.len / l.elem;
        let (base, extra) = (count / n, count % n);
        let start = i * base + i.min(extra);
        let len = base + usize::from(i < extra);
        (self.offset + start * l.elem, len * l.elem)
    }
}

/// Where a reduce-scatter phase reads this rank's own contribution.
pub(super) struct Contribution {
    /// `Buf::Input` (out of place), or the output that already holds it.
    pub buf: Buf,
    /// Done before the output may be read or reduced into.
    pub after: Option<StepId>,
}

impl Contribution {
    pub fn input(l: &Layout) -> Self {
        Contribution {
            buf: l.input(),
            after: None,
        }
    }
}

/// What a phase leaves for the next to wait on.
pub(super) struct Phase {
    /// The final reductions (reduce-scatter), by chunk of the owned block.
    pub finals: Vec<StepId>,
    /// The sends, by step and chunk: a later receive into the same block
    /// must wait for them.
    pub sends: Vec<Vec<StepId>>,
    /// The last receive: receives from one peer retire in order, so once it
    /// is done every receive of the phase is.
    pub last_recv: Option<StepId>,
}

fn allreduce(l: &Layout, s: &mut Schedule) {
    if l.size == 1 {
        return copy_all(l, s);
    }
    let ring = Ring::world(l);
    let rs = reduce_scatter_phase(l, s, &ring, 1, Contribution::input(l), true);
    all_gather_phase(l, s, &ring, 1, Source::Reduced(&rs.finals), Some(&rs.sends));
}

fn reduce_scatter(l: &Layout, s: &mut Schedule) {
    if l.size == 1 {
        return copy_all(l, s);
    }
    let ring = Ring::world(l);
    reduce_scatter_phase(l, s, &ring, 0, Contribution::input(l), true);
}

/// Every rank ends the reduce-scatter owning its block r, reduced in its
/// output, and sends it to the root; the root receives each into its place
/// once its own reduce-scatter sends have read that block. The chain has
/// the root copy and reduce the whole buffer; here each rank reduces 1/n of
/// it and the root copies the other (n-1)/n in once more: less work for the
/// root at 2 ranks (1.5 buffers moved or reduced against 2), more from 4.
/// Not a built-in pick: 2 ranks idle took 0.82-0.91x the chain's time at 1-16
/// MiB, but with a busy loop on the non-root's core 1.14-1.59x (that rank now
/// reduces half); a profile (`collbench tune`) takes it where it measures faster.
fn reduce(l: &Layout, s: &mut Schedule) {
    let (n, r, root) = (l.size, l.rank, l.root);
    if n == 1 {
        return copy_all(l, s);
    }
    let ring = Ring::world(l);
    let rs = reduce_scatter_phase(l, s, &ring, 0, Contribution::input(l), true);
    if r != root {
        for (k, c) in l.chunks(Buf::Output, ring.block(l, r)).enumerate() {
            s.send(root, c, Some(rs.finals[k]));
        }
        return;
    }
    for p in (0..n).filter(|&p| p != root) {
        let t = ring.reduce_scatter_step_sending(0, p);
        for (k, c) in l.chunks(Buf::Output, ring.block(l, p)).enumerate() {
            s.recv(p, c, Some(rs.sends[t][k]));
        }
    }
}

fn all_gather(l: &Layout, s: &mut Schedule) {
    if l.size == 1 {
        return copy_all(l, s);
    }
    let own = l.own_block();
    if !l.in_place {
        let (offset, len) = l.block(l.rank);
        s.copy(own, span(Buf::Output, (offset, len)));
    }
    all_gather_phase(l, s, &Ring::world(l), 0, Source::Own(own, None), None);
}

/// Reduce-scatter steps leaving block me+d reduced in the output (divided
/// for avg if `finalize`).
pub(super) fn reduce_scatter_phase(
    l: &Layout,
    s: &mut Schedule,
    ring: &Ring,
    d: usize,
    mine: Contribution,
    finalize: bool,
) -> Phase {
    let n = ring.n();
    // Receives of the previous step, by chunk: the sends of this step wait for them.
    let mut prev_recvs: Vec<StepId> = Vec::new();
    let mut phase = Phase {
        finals: Vec::new(),
        sends: Vec::with_capacity(n - 1),
        last_recv: None,
    };
    let with_input = mine.buf == Buf::Input;
    for t in 0..n - 1 {
        let send_block = ring.block(l, ring.reduce_scatter_sends(d, t));
        let recv_block = ring.block(l, ring.reduce_scatter_sends(d, t + 1));
        let from = if t == 0 { mine.buf } else { Buf::Output };
        let sends: Vec<StepId> = l
            .chunks(from, send_block)
            .enumerate()
            .map(|(k, c)| {
                let after = if t == 0 {
                    mine.after
                } else {
                    Some(prev_recvs[k])
                };
                s.send(ring.next(), c, after)
            })
            .collect();
        prev_recvs = l
            .chunks(Buf::Output, recv_block)
            .map(|c| {
                s.recv_reduce(
                    ring.prev(),
                    c,
                    with_input,
                    finalize && t == n - 2,
                    mine.after,
                )
            })
            .collect();
        phase.last_recv = prev_recvs.last().copied().or(phase.last_recv);
        phase.sends.push(sends);
    }
    phase.finals = prev_recvs;
    phase
}

/// Where the all-gather's first send reads the block it owns.
pub(super) enum Source<'a> {
    /// The output, once these reductions (by chunk) are done.
    Reduced(&'a [StepId]),
    /// This span, once this op is done.
    Own(Span, Option<StepId>),
}

/// All-gather steps circulating the block me+d each member owns.
/// `overwrites`: sends, by step and chunk, that read a block before this
/// phase may receive into it (a reduce-scatter phase's, same `d`).
pub(super) fn all_gather_phase(
    l: &Layout,
    s: &mut Schedule,
    ring: &Ring,
    d: usize,
    first: Source,
    overwrites: Option<&[Vec<StepId>]>,
) -> Phase {
    let (n, m) = (ring.n(), ring.me);
    let mut prev_recvs: Vec<StepId> = Vec::new();
    let mut last_recv = None;
    for t in 0..n - 1 {
        let send_block = ring.block(l, m + d + n - t);
        // The block the reduce-scatter phase sent at step t (`overwrites`).
        let recv_block = ring.block(l, ring.reduce_scatter_sends(d, t));
        let sends: Vec<(Span, Option<StepId>)> = match (t, &first) {
            (0, Source::Own(own, after)) => l
                .chunks(own.buf, (own.offset, own.len))
                .map(|c| (c, *after))
                .collect(),
            (0, Source::Reduced(done)) => l
                .chunks(Buf::Output, send_block)
                .enumerate()
                .map(|(k, c)| (c, Some(done[k])))
                .collect(),
            _ => l
                .chunks(Buf::Output, send_block)
                .enumerate()
                .map(|(k, c)| (c, Some(prev_recvs[k])))
                .collect(),
        };
        for (c, after) in sends {
            s.send(ring.next(), c, after);
        }
        prev_recvs = l
            .chunks(Buf::Output, recv_block)
            .enumerate()
            .map(|(k, c)| s.recv(ring.prev(), c, overwrites.map(|o| o[t][k])))
            .collect();
        last_recv = prev_recvs.last().copied().or(last_recv);
    }
    Phase {
        finals: Vec::new(),
        sends: Vec::new(),
        last_recv,
    }
}

fn span(buf: Buf, (offset, len): (usize, usize)) -> Span {
    Span { buf, offset, len }
}
