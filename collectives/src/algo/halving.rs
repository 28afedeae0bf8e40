//! Rabenseifner's AllReduce: a reduce-scatter by recursive halving, then an
//! all-gather by recursive doubling, among the largest power of two p <= n
//! ranks: 2 log2(p) steps (the ring's 2(n-1)) while each rank still sends
//! only 2(p-1)/p of the buffer, so it suits sizes too large for the trees
//! and rank counts too large for the ring's latency.
//!
//! Non-powers of two: of the first 2r ranks (r = n - p), each even one sends
//! its buffer to the odd one after it, which reduces it and takes part for
//! both; the even one receives the result at the end.
//!
//! With p ranks numbered 0..p (`id`, bits reversed: see [`Plan::flip`]), the buffer is cut into p blocks and
//! `group(x, i)` is the block range of the 2^i ids that share x's bits above
//! bit i. Halving step with distance d = p/2, p/4, .., 1: partners id and
//! id ^ d split the range they hold, `group(id, log2 d + 1)`; the one with
//! bit d clear keeps the lower half. Each reduces the half it keeps, so id
//! ends with block id fully reduced (reduced at one rank only: every rank
//! gets the same bits). Doubling retraces the steps, each rank sending all
//! it holds. Messages are cut at multiples of the chunk size from the
//! buffer's start, so a chunk reduced and sent on lies inside the chunk that
//! wrote it (its `after`), whichever half it belongs to.
//!
//! ReduceScatter by recursive halving: the AllReduce's first half on a
//! power of two of ranks, ids not reversed, so rank r ends with block r
//! reduced: log2(n) steps instead of the ring's n-1, each rank still
//! sending (n-1)/n of the buffer. Other rank counts take the ring.

use super::{Algorithm, Layout};
use crate::algo::schedule::{Buf, Schedule, Span, StepId};
use crate::Collective;

pub(super) const ALLREDUCE: Algorithm = Algorithm {
    name: "rabenseifner",
    collective: Collective::AllReduce,
    summary: "reduce-scatter by recursive halving, all-gather by recursive doubling; 2 log2(n) steps, bandwidth-optimal",
    in_place: true,
    build,
};

pub(super) const REDUCE_SCATTER: Algorithm = Algorithm {
    name: "halving",
    collective: Collective::ReduceScatter,
    summary: "recursive halving, log2(n) steps on a power of two of ranks (else the ring); bandwidth-optimal",
    in_place: true,
    build: reduce_scatter,
};

/// The ranks taking part (p of them) and this rank's role.
struct Plan {
    p: usize,
    /// Ranks paired off before and after (`r` = n - p).
    r: usize,
    levels: u32,
    /// Whether ids are numbered with their bits reversed ([`Plan::flip`]).
    reversed: bool,
}

impl Plan {
    fn new(n: usize) -> Self {
        let p = 1 << n.ilog2();
        Plan {
            p,
            r: n - p,
            levels: p.ilog2(),
            reversed: true,
        }
    }

    /// The id of a rank that takes part.
    fn id(&self, rank: usize) -> Option<usize> {
        match rank {
            r if r < 2 * self.r => (r % 2 == 1).then_some(r / 2),
            r => Some(r - self.r),
        }
    }

    /// `id` with its `levels` bits reversed. The steps below pair ids at
    /// distances p/2, p/4, .., 1; pairing the reversed ids instead puts the
    /// largest halves between neighbouring ranks (on one host, when ranks
    /// are numbered host by host) and only the small ones across hosts.
    fn flip(&self, id: usize) -> usize {
        match self.levels {
            l if self.reversed && l > 0 => id.reverse_bits() >> (usize::BITS - l),
            _ => id,
        }
    }

    /// The rank of (reversed) id `v`.
    fn rank(&self, v: usize) -> usize {
        let id = self.flip(v);
        if id < self.r {
            2 * id + 1
        } else {
            id + self.r
        }
    }
}

/// What this rank wrote, by byte range, so a later step on a range can
/// wait for it. Every span here lies in one chunk cell of the grid (see
/// [`grid`]), so writes are chained per cell: a lookup reads only its cell's.
struct Writes {
    chunk: usize,
    /// `(start, end, step, previous write in the same cell)`.
    all: Vec<(usize, usize, StepId, usize)>,
    /// Per cell, the newest write's index in `all`.
    newest: Vec<usize>,
}

impl Writes {
    fn new(l: &Layout) -> Self {
        Writes {
            chunk: l.chunk,
            all: Vec::new(),
            newest: vec![usize::MAX; (l.count * l.elem).div_ceil(l.chunk)],
        }
    }

    fn record(&mut self, span: Span, step: StepId) {
        let cell = span.offset / self.chunk;
        let end = span.offset + span.len;
        self.all.push((span.offset, end, step, self.newest[cell]));
        self.newest[cell] = self.all.len() - 1;
    }

    /// The newest step that wrote into `span`. Its bytes were last written
    /// by steps of one queue (one partner's receives at one step, which
    /// retire in order), so waiting for the newest waits for all.
    fn of(&self, span: Span) -> Option<StepId> {
        let end = span.offset + span.len;
        let mut at = self.newest[span.offset / self.chunk];
        while at != usize::MAX {
            let (a, b, step, previous) = self.all[at];
            if a < end && span.offset < b {
                return Some(step);
            }
            at = previous;
        }
        None
    }
}

fn build(l: &Layout, s: &mut Schedule) {
    let n = l.size;
    if n == 1 {
        return super::copy_all(l, s);
    }
    let plan = Plan::new(n);
    let mut writes = Writes::new(l);
    let Some(id) = plan.id(l.rank).map(|id| plan.flip(id)) else {
        // Paired off: contribute, then receive the partner's result.
        let partner = l.rank + 1;
        let mut last = None;
        for c in grid(l, l.all()) {
            last = Some(s.send(
                partner,
                Span {
                    buf: l.input(),
                    ..c
                },
                None,
            ));
        }
        let pid = plan.flip(plan.id(partner).expect("odd ranks take part"));
        for piece in pieces(l, &plan, pid, plan.levels) {
            for c in grid(l, piece) {
                s.recv(partner, c, last);
            }
        }
        return;
    };
    // Where this rank's partial result is: its input until it reduced something.
    let mut in_output = l.in_place;
    if l.rank < 2 * plan.r {
        let with = !l.in_place;
        for c in grid(l, l.all()) {
            let step = s.recv_reduce(l.rank - 1, c, with, false, None);
            writes.record(c, step);
        }
        in_output = true;
    }
    let last_sends = halve(l, s, &plan, id, &mut writes, in_output);
    double(l, s, &plan, id, &mut writes, &last_sends);
    if l.rank < 2 * plan.r {
        for piece in pieces(l, &plan, id, plan.levels) {
            for c in grid(l, piece) {
                s.send(l.rank - 1, c, writes.of(c));
            }
        }
    }
}

fn reduce_scatter(l: &Layout, s: &mut Schedule) {
    let n = l.size;
    if !n.is_power_of_two() || n == 1 {
        return (super::ring::REDUCE_SCATTER.build)(l, s);
    }
    // Rank r must end with block r: ids in rank order.
    let plan = Plan {
        reversed: false,
        ..Plan::new(n)
    };
    halve(l, s, &plan, l.rank, &mut Writes::new(l), l.in_place);
}

/// The reduce-scatter: returns, per step, the last send (a later receive
/// into what it sent must wait for it when in place).
fn halve(
    l: &Layout,
    s: &mut Schedule,
    plan: &Plan,
    id: usize,
    writes: &mut Writes,
    mut in_output: bool,
) -> Vec<Option<StepId>> {
    let mut last_sends = Vec::new();
    for level in (1..=plan.levels).rev() {
        let d = 1 << (level - 1);
        let partner = plan.rank(id ^ d);
        let keep = group(l, plan, id, level - 1);
        let give = group(l, plan, id ^ d, level - 1);
        let from = if in_output { Buf::Output } else { l.input() };
        let mut last = None;
        for c in grid(l, give) {
            last = Some(s.send(partner, Span { buf: from, ..c }, writes.of(c)));
        }
        last_sends.push(last);
        for c in grid(l, keep) {
            let with = !in_output && !l.in_place;
            let step = s.recv_reduce(partner, c, with, level == 1, writes.of(c));
            writes.record(c, step);
        }
        in_output = true;
    }
    last_sends
}

/// The all-gather: each step sends every piece this rank holds and receives
/// the partner's.
fn double(
    l: &Layout,
    s: &mut Schedule,
    plan: &Plan,
    id: usize,
    writes: &mut Writes,
    last_sends: &[Option<StepId>],
) {
    for level in 0..plan.levels {
        let d = 1 << level;
        let partner = plan.rank(id ^ d);
        for piece in pieces(l, plan, id, level) {
            for c in grid(l, piece) {
                s.send(partner, c, writes.of(c));
            }
        }
        // The halving step with the same partner sent what lands here.
        let sent = last_sends[(plan.levels - 1 - level) as usize];
        for piece in pieces(l, plan, id ^ d, level) {
            for c in grid(l, piece) {
                let step = s.recv(partner, c, sent);
                writes.record(c, step);
            }
        }
    }
}

/// Byte range of the blocks of the 2^level ids sharing `id`'s bits above `level`.
fn group(l: &Layout, plan: &Plan, id: usize, level: u32) -> (usize, usize) {
    let first = id & !((1 << level) - 1);
    let (start, _) = block(l, plan, first);
    let (last, len) = block(l, plan, first + (1 << level) - 1);
    (start, last + len - start)
}

/// Block `i` of p, as `(offset, len)` in bytes.
fn block(l: &Layout, plan: &Plan, i: usize) -> (usize, usize) {
    let (base, extra) = (l.count / plan.p, l.count % plan.p);
    let start = i * base + i.min(extra);
    (start * l.elem, (base + usize::from(i < extra)) * l.elem)
}

/// What `id` holds after `level` doubling steps, as ranges in ascending
/// order, each written by one step: its own block and one group per step.
fn pieces(l: &Layout, plan: &Plan, id: usize, level: u32) -> Vec<(usize, usize)> {
    let mut v: Vec<_> = std::iter::once(group(l, plan, id, 0))
        .chain((0..level).map(|i| group(l, plan, id ^ (1 << i), i)))
        .collect();
    v.sort_unstable();
    v
}

/// `(offset, len)` cut at multiples of the chunk size from the buffer's start.
fn grid(l: &Layout, (offset, len): (usize, usize)) -> impl Iterator<Item = Span> + use<> {
    let chunk = l.chunk;
    let end = offset + len;
    let mut at = offset;
    std::iter::from_fn(move || {
        (at < end).then(|| {
            let next = ((at / chunk + 1) * chunk).min(end);
            let span = Span {
                buf: Buf::Output,
                offset: at,
                len: next - at,
            };
            at = next;
            span
        })
    })
}
