//! Binomial trees for the rooted collectives: ceil(log2 n) rounds instead of
//! the chain's n-1 hops, for latency-bound sizes. Ranks are numbered from the
//! root (v = rank - root mod n); v's parent is v with its highest bit
//! cleared, its children are v + 2^k for every 2^k above v's highest bit.
//! Broadcast sends each chunk to the children as soon as it arrives, the
//! largest subtree first; Reduce runs the same tree upwards, reducing the
//! children's chunks in a fixed order.

use super::{Algorithm, Layout};
use crate::algo::schedule::{Buf, Schedule, Span};
use crate::Collective;

pub(super) const BROADCAST: Algorithm = Algorithm {
    name: "binomial",
    collective: Collective::Broadcast,
    summary: "binomial tree from the root, log2(n) rounds; for small messages",
    in_place: true,
    build: broadcast,
};

pub(super) const REDUCE: Algorithm = Algorithm {
    name: "binomial",
    collective: Collective::Reduce,
    summary: "binomial tree towards the root, log2(n) rounds; for small messages",
    in_place: true,
    build: reduce,
};

/// (parent, children with the largest subtree first) of rank `r`.
fn tree(l: &Layout) -> (Option<usize>, Vec<usize>) {
    let n = l.size;
    let v = (l.rank + n - l.root) % n;
    let rank_of = |u: usize| (u + l.root) % n;
    let top = match v {
        0 => 0,
        v => 1 << (usize::BITS - 1 - v.leading_zeros()),
    };
    let parent = (v > 0).then(|| rank_of(v - top));
    let mut children = Vec::new();
    let mut step = if v == 0 { 1 } else { top << 1 };
    while v + step < n {
        children.push(rank_of(v + step));
        step <<= 1;
    }
    children.reverse();
    (parent, children)
}

fn broadcast(l: &Layout, s: &mut Schedule) {
    let (parent, children) = tree(l);
    let from = match parent {
        None => {
            super::copy_all(l, s);
            l.input()
        }
        Some(_) => Buf::Output,
    };
    for c in l.chunks(from, l.all()) {
        let got = parent.map(|p| {
            s.recv(
                p,
                Span {
                    buf: Buf::Output,
                    ..c
                },
                None,
            )
        });
        for &child in &children {
            s.send(child, c, got);
        }
    }
}

fn reduce(l: &Layout, s: &mut Schedule) {
    if l.size == 1 {
        return super::copy_all(l, s);
    }
    let (parent, mut children) = tree(l);
    // Smallest subtree first: its partial sum arrives first.
    children.reverse();
    for c in l.chunks(Buf::Output, l.all()) {
        super::reduce_up(l, s, c, parent, &children);
    }
}
