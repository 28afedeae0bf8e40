//! Double binary tree AllReduce (as NCCL's): two binary trees over the
//! ranks, each carrying half of the buffer, reduced up to its root and
//! broadcast back down, chunk by chunk so the two directions pipeline.
//! 2 log2(n) hops instead of the ring's 2(n-1): the algorithm for
//! latency-bound sizes at larger rank counts.
//!
//! The first tree is the in-order binary tree over 1..=n (node i's parent
//! differs from i in its lowest set bit); the second is its mirror image
//! (even n) or its shift by one (odd n), so a rank that is interior in one
//! tree is a leaf in the other and every rank's links carry about the same.
//!
//! ReduceScatter by the tree: the whole buffer reduced as the AllReduce
//! does, each rank keeping its block (the communicator copies it out; in
//! place the other blocks, scratch to the caller, end reduced too). Every
//! rank sends the whole buffer 2 log2(n) hops instead of 1/n of it n-1
//! times: for small messages where each message costs a context switch.

use super::{Algorithm, Layout};
use crate::algo::schedule::{Buf, Schedule, Span};
use crate::Collective;

pub(super) const ALLREDUCE: Algorithm = Algorithm {
    name: "tree",
    collective: Collective::AllReduce,
    summary: "double binary tree, each tree half the data, reduce up then broadcast down, chunk-pipelined; 2 log2(n) hops",
    in_place: true,
    build,
};

pub(super) const REDUCE_SCATTER: Algorithm = Algorithm {
    name: "tree",
    collective: Collective::ReduceScatter,
    summary: "the double binary tree's AllReduce, each rank keeping its block; 2 log2(n) hops, for small messages",
    in_place: true,
    build,
};

/// Parent of rank `r` in the in-order binary tree over `n` ranks.
fn parent_in_order(r: usize, n: usize) -> Option<usize> {
    let root = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let up = |i: usize| {
        let low = i & i.wrapping_neg();
        if i & (low << 1) != 0 {
            i - low
        } else {
            i + low
        }
    };
    let mut i = r + 1;
    if i == root {
        return None;
    }
    // Nodes past n are skipped: their would-be children hang one level higher.
    i = up(i);
    while i > n {
        i = up(i);
    }
    Some(i - 1)
}

/// Parent of rank `r` in tree `t` (0 or 1) over `n` ranks.
pub(crate) fn parent(t: usize, r: usize, n: usize) -> Option<usize> {
    match (t, n % 2) {
        (0, _) => parent_in_order(r, n),
        // The mirror image for even n, the shift by one for odd n.
        (_, 0) => parent_in_order(n - 1 - r, n).map(|p| n - 1 - p),
        _ => parent_in_order((r + 1) % n, n).map(|p| (p + n - 1) % n),
    }
}

/// Children of rank `r` in the in-order binary tree over `n` ranks, at most
/// two, in rank order (`None` where there is none).
fn children_in_order(r: usize, n: usize) -> [Option<usize>; 2] {
    let i = r + 1;
    let half = (i & i.wrapping_neg()) / 2;
    if half == 0 {
        return [None, None];
    }
    // The right child's place may lie past n: then its left descendants
    // stand in for it, as `parent_in_order` skips such places going up.
    let right = (i < n).then(|| {
        let mut c = i + half;
        while c > n {
            c -= (c & c.wrapping_neg()) / 2;
        }
        c - 1
    });
    [Some(i - half - 1), right]
}

/// Children of rank `r` in tree `t`, in rank order: `kids[..count]`.
pub(crate) fn children(t: usize, r: usize, n: usize) -> ([usize; 2], usize) {
    let found = match (t, n % 2) {
        (0, _) => children_in_order(r, n),
        (_, 0) => children_in_order(n - 1 - r, n).map(|c| c.map(|c| n - 1 - c)),
        _ => children_in_order((r + 1) % n, n).map(|c| c.map(|c| (c + n - 1) % n)),
    };
    match found {
        [Some(a), Some(b)] => ([a.min(b), a.max(b)], 2),
        [Some(c), None] | [None, Some(c)] => ([c, 0], 1),
        [None, None] => ([0, 0], 0),
    }
}

fn build(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    if n == 1 {
        return super::copy_all(l, s);
    }
    // Half the elements each (the first tree takes the odd one); a message
    // of one chunk or less takes the first tree only: halving it would not
    // shorten its path, only double its messages.
    let bytes = l.count * l.elem;
    let first = match bytes <= l.chunk {
        true => bytes,
        false => l.count.div_ceil(2) * l.elem,
    };
    let halves = [(0, first), (first, bytes - first)];
    let trees = [0, 1].map(|t| (parent(t, r, n), children(t, r, n)));
    // Chunk by chunk, alternating trees: every pair of ranks then adds its
    // ops in one global order, so neither tree's traffic waits on the other's.
    for k in 0..first.div_ceil(l.chunk) {
        for (t, half) in halves.into_iter().enumerate() {
            if let Some(c) = l.chunk_at(Buf::Output, half, k) {
                let (parent, (kids, count)) = trees[t];
                chunk(l, s, c, parent, &kids[..count]);
            }
        }
    }
}

/// One chunk through one tree: reduce the children's partial results into
/// ours, pass it up, take the final result from above, pass it down.
fn chunk(l: &Layout, s: &mut Schedule, c: Span, parent: Option<usize>, children: &[usize]) {
    let (reduced, sent) = super::reduce_up(l, s, c, parent, children);
    // The result overwrites what was sent up: only once it has left.
    let have = match (parent, sent) {
        (Some(p), Some(sent)) => Some(s.recv(p, c, Some(sent))),
        _ => reduced,
    };
    for &child in children {
        s.send(child, c, have);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_trees_span_every_rank_with_at_most_two_children() {
        for n in 1..=200 {
            for t in 0..2 {
                let roots: Vec<usize> = (0..n).filter(|&r| parent(t, r, n).is_none()).collect();
                assert_eq!(roots.len(), 1, "n={n} tree {t}: roots {roots:?}");
                for r in 0..n {
                    // The children are exactly the ranks whose parent is r
                    // (at most two, in rank order).
                    let (kids, count) = children(t, r, n);
                    let want: Vec<usize> = (0..n).filter(|&c| parent(t, c, n) == Some(r)).collect();
                    assert_eq!(&kids[..count], &want[..], "n={n} tree {t} rank {r}");
                    // Walking up reaches the root within log2(n)+1 steps.
                    let (mut at, mut hops) = (r, 0);
                    while let Some(p) = parent(t, at, n) {
                        assert!(p < n);
                        at = p;
                        hops += 1;
                        assert!(hops <= 1 + n.ilog2() as usize, "n={n} tree {t} rank {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn with_even_ranks_no_rank_is_interior_in_both_trees() {
        for n in (2..=64).step_by(2) {
            for r in 0..n {
                let inner = |t| children(t, r, n).1 > 0;
                assert!(!(inner(0) && inner(1)), "n={n} rank {r}");
            }
        }
    }
}
