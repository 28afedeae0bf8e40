//! Ring algorithms: AllReduce as reduce-scatter then all-gather around the
//! ring, and those two phases on their own as ReduceScatter and AllGather.
//! Each step's block is cut into chunks, so a chunk moves on as soon as it
//! is reduced.
//!
//! With n ranks the buffer is cut into n blocks. In reduce-scatter step t,
//! rank r sends block r+d-1-t to r+1 and receives block r+d-2-t from r-1,
//! reducing it into its own; after n-1 steps rank r holds block r+d fully
//! reduced (d = 1 for AllReduce, 0 for ReduceScatter, whose rank r must end
//! with block r). All-gather circulates the owned blocks for n-1 more steps.
//! Each rank sends (n-1)/n of the buffer per phase: bandwidth-optimal.

use super::{Algorithm, Layout};
use crate::schedule::{Buf, OpId, Schedule, Span};
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

fn allreduce(l: &Layout, s: &mut Schedule) {
    if l.size == 1 {
        return copy_all(l, s);
    }
    let (finals, rs_sends) = reduce_scatter_phase(l, s, 1);
    all_gather_phase(l, s, 1, Source::Reduced(&finals), Some(&rs_sends));
}

fn reduce_scatter(l: &Layout, s: &mut Schedule) {
    if l.size == 1 {
        return copy_all(l, s);
    }
    reduce_scatter_phase(l, s, 0);
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
    all_gather_phase(l, s, 0, Source::Own(own), None);
}

/// Reduce-scatter steps leaving block r+d reduced in the output. Returns the
/// final reductions by chunk, and the sends by step and chunk.
fn reduce_scatter_phase(l: &Layout, s: &mut Schedule, d: usize) -> (Vec<OpId>, Vec<Vec<OpId>>) {
    let (n, r) = (l.size, l.rank);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Receives of the previous step, by chunk: the sends of this step wait for them.
    let mut prev_recvs: Vec<OpId> = Vec::new();
    let mut sends_by_step = Vec::with_capacity(n - 1);
    for t in 0..n - 1 {
        let send_block = (r + d + 2 * n - 1 - t) % n;
        let recv_block = (r + d + 2 * n - 2 - t) % n;
        let from = if t == 0 { l.input() } else { Buf::Output };
        let sends: Vec<OpId> = l
            .chunks(from, l.block(send_block))
            .enumerate()
            .map(|(k, c)| s.send(next, c, (t > 0).then(|| prev_recvs[k])))
            .collect();
        prev_recvs = l
            .chunks(Buf::Output, l.block(recv_block))
            .map(|c| {
                let with = (!l.in_place).then_some(Span {
                    buf: Buf::Input,
                    ..c
                });
                s.recv_reduce(prev, c, with, t == n - 2, None)
            })
            .collect();
        sends_by_step.push(sends);
    }
    (prev_recvs, sends_by_step)
}

/// Where the all-gather's first send reads the block it owns.
enum Source<'a> {
    /// The output, once these reductions (by chunk) are done.
    Reduced(&'a [OpId]),
    /// This span, ready now.
    Own(Span),
}

/// All-gather steps circulating the block r+d each rank owns. `overwrites`:
/// the reduce-scatter sends, by step and chunk, that read a block before
/// this phase may receive into it.
fn all_gather_phase(
    l: &Layout,
    s: &mut Schedule,
    d: usize,
    first: Source,
    overwrites: Option<&[Vec<OpId>]>,
) {
    let (n, r) = (l.size, l.rank);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut prev_recvs: Vec<OpId> = Vec::new();
    for t in 0..n - 1 {
        let send_block = l.block((r + d + n - t) % n);
        let recv_block = (r + d + 2 * n - 1 - t) % n;
        let sends: Vec<(Span, Option<OpId>)> = match (t, &first) {
            (0, Source::Own(own)) => l
                .chunks(own.buf, (own.offset, own.len))
                .map(|c| (c, None))
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
            s.send(next, c, after);
        }
        prev_recvs = l
            .chunks(Buf::Output, l.block(recv_block))
            .enumerate()
            .map(|(k, c)| s.recv(prev, c, overwrites.map(|o| o[t][k])))
            .collect();
    }
}

/// One rank: the result is the input (one block is the whole buffer).
pub(super) fn copy_all(l: &Layout, s: &mut Schedule) {
    if !l.in_place && l.count > 0 {
        s.copy(span(Buf::Input, l.all()), span(Buf::Output, l.all()));
    }
}

fn span(buf: Buf, (offset, len): (usize, usize)) -> Span {
    Span { buf, offset, len }
}
