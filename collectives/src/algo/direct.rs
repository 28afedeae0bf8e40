//! Direct AllReduce: every rank sends its whole buffer to every other and
//! reduces all n contributions itself, in rank order, so every rank computes
//! the same bits. One step instead of the ring's 2(n-1), at the price of
//! n-1 full copies per rank: the algorithm for latency-bound sizes, and for
//! oversubscribed hosts where each ring step waits for a rank to be scheduled.
//!
//! Direct AllGather: every rank sends its block to every other, all pairs in
//! flight (in the pairwise exchange's order). Each rank sends its block n-1
//! times where the ring forwards n-1 blocks once: the same bytes received,
//! but no block waits for another rank to pass it on.
//!
//! Direct Reduce: every rank sends its buffer to the root, which reduces
//! them in turn from its successor on. A non-root only sends, so where
//! ranks crowd onto sockets none waits for another to be scheduled.
//!
//! Direct Broadcast: the root sends every chunk to every other rank. The
//! root's memory is read n-1 times where the chain reads each rank's once,
//! but no chunk waits for a rank to be scheduled to pass it on: on one host
//! whose ranks outnumber its cores, each chain hop waits for one.
//!
//! Direct Broadcast in halves ("halves"): the same, with the root's buffer
//! sent as two messages instead of chunks, for shared memory, where each
//! peer reads them from the root's memory: no peer waits for the root to be
//! scheduled to post its next chunk. In place the root has nothing to copy:
//! a peer reading the first half lets the root write the second
//! (`Schedule::sender_writes`), so two cores copy where one did.

use super::{Algorithm, Layout};
use crate::algo::schedule::{Action, Buf, Schedule, Span, StepId};
use crate::Collective;

pub(super) const ALLREDUCE: Algorithm = Algorithm {
    name: "direct",
    collective: Collective::AllReduce,
    summary: "every rank sends its buffer to every other and reduces all n in rank order; one step, for small messages",
    in_place: false,
    build,
};

pub(super) const ALLGATHER: Algorithm = Algorithm {
    name: "direct",
    collective: Collective::AllGather,
    summary: "every rank sends its block to every other, all pairs in flight; no block waits to be forwarded",
    in_place: true,
    build: all_gather,
};

pub(super) const BROADCAST: Algorithm = Algorithm {
    name: "direct",
    collective: Collective::Broadcast,
    summary: "the root sends every chunk to every other rank; no chunk waits to be forwarded",
    in_place: true,
    build: broadcast,
};

pub(super) const BROADCAST_HALVES: Algorithm = Algorithm {
    name: "halves",
    collective: Collective::Broadcast,
    summary: "the root sends its buffer to every other rank in two halves; in place it writes one while each reads the other; for shared memory",
    in_place: true,
    build: broadcast_in_halves,
};

pub(super) const REDUCE: Algorithm = Algorithm {
    name: "direct",
    collective: Collective::Reduce,
    summary: "every rank sends its buffer to the root, which reduces them in turn; one step, for small messages",
    in_place: true,
    build: reduce,
};

fn reduce(l: &Layout, s: &mut Schedule) {
    let (n, root) = (l.size, l.root);
    if n == 1 {
        return super::copy_all(l, s);
    }
    let (parent, children): (_, Vec<usize>) = match l.rank == root {
        true => (None, (1..n).map(|d| (root + d) % n).collect()),
        false => (Some(root), Vec::new()),
    };
    for c in l.chunks(Buf::Output, l.all()) {
        super::reduce_up(l, s, c, parent, &children);
    }
}

fn broadcast(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    if r != l.root {
        for c in l.chunks(Buf::Output, l.all()) {
            s.recv(l.root, c, None);
        }
        return;
    }
    super::copy_all(l, s);
    // Peers in turn from the root's successor: the executor posts their
    // queues in this order, so none is always served last.
    for p in (1..n).map(|d| (r + d) % n) {
        for c in l.chunks(l.input(), l.all()) {
            s.send(p, c, None);
        }
    }
}

fn broadcast_in_halves(l: &Layout, s: &mut Schedule) {
    let half = (l.count.div_ceil(2) * l.elem).max(l.elem);
    let halves = Layout { chunk: half, ..*l };
    s.sender_writes();
    broadcast(&halves, s);
}

fn build(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    let all = (0, l.count * l.elem);
    for p in (0..n).filter(|p| *p != r) {
        for c in l.chunks(Buf::Input, all) {
            s.send(p, c, None);
        }
    }
    for c in l.chunks(Buf::Output, all) {
        let mine = Span {
            buf: Buf::Input,
            ..c
        };
        let mut prev: Option<StepId> = None;
        for q in 0..n {
            let last = q == n - 1;
            let reduce = Action::Reduce {
                with_input: false,
                finalize: last,
            };
            prev = Some(match (q == r, q == 0) {
                (true, true) => s.local(r, Action::Copy, mine, c, None),
                (true, false) => s.local(r, reduce, mine, c, prev),
                (false, true) => s.recv_copy(q, c, None),
                (false, false) => s.recv_reduce(q, c, false, last, prev),
            });
        }
    }
}

fn all_gather(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    let own = l.own_block();
    if !l.in_place {
        s.copy(
            own,
            Span {
                buf: Buf::Output,
                offset: l.block(r).0,
                ..own
            },
        );
    }
    let partners = (0..n).map(|round| super::pairwise::partner(round, r, n));
    for p in partners.filter(|p| *p != r) {
        for c in l.chunks(own.buf, (own.offset, own.len)) {
            s.send(p, c, None);
        }
        for c in l.chunks(Buf::Output, l.block(p)) {
            s.recv(p, c, None);
        }
    }
}
