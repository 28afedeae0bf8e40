//! Pipelined chains for the rooted collectives. Broadcast: the root sends
//! each chunk to root+1, which forwards it to root+2 as soon as it lands, and
//! so on. Reduce: the chain runs the other way round, from root+1 to the
//! root, each rank reducing the chunk it receives with its own before passing
//! it on. Every rank sends the buffer once and the chunks overlap along the
//! chain: bandwidth-optimal for large messages, n-1 hops of latency.

use super::{Algorithm, Layout};
use crate::algo::schedule::{Buf, Schedule};
use crate::Collective;

pub(super) const BROADCAST: Algorithm = Algorithm {
    name: "chain",
    collective: Collective::Broadcast,
    summary: "root -> root+1 -> ... chunk-pipelined; bandwidth-optimal",
    in_place: true,
    build: broadcast,
};

pub(super) const REDUCE: Algorithm = Algorithm {
    name: "chain",
    collective: Collective::Reduce,
    summary:
        "root+1 -> root+2 -> ... -> root, reducing on the way, chunk-pipelined; bandwidth-optimal",
    in_place: true,
    build: reduce,
};

fn broadcast(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Position along the chain, the root first.
    let pos = (r + n - l.root) % n;
    if pos == 0 {
        super::copy_all(l, s);
        if n > 1 {
            for c in l.chunks(l.input(), l.all()) {
                s.send(next, c, None);
            }
        }
        return;
    }
    for c in l.chunks(Buf::Output, l.all()) {
        let got = s.recv(prev, c, None);
        if pos < n - 1 {
            s.send(next, c, Some(got));
        }
    }
}

fn reduce(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Position along the chain, which ends at the root.
    let pos = (r + 2 * n - l.root - 1) % n;
    if n == 1 {
        return super::copy_all(l, s);
    }
    if pos == 0 {
        for c in l.chunks(l.input(), l.all()) {
            s.send(next, c, None);
        }
        return;
    }
    for c in l.chunks(Buf::Output, l.all()) {
        let reduced = s.recv_reduce(prev, c, !l.in_place, pos == n - 1, None);
        if pos < n - 1 {
            s.send(next, c, Some(reduced));
        }
    }
}
