//! Bruck's AllToAll: ceil(log2 n) rounds instead of n-1 exchanges, for
//! small blocks on many ranks, where a message's fixed cost outweighs its
//! bytes.
//!
//! In scratch, `tmp[i]` starts as the block for rank r+i (the input
//! rotated by r). In round k every rank sends the blocks whose index has
//! bit k set, packed into one message, to rank r + 2^k, and unpacks what
//! rank r - 2^k sent into the same indices: a block for rank r+i moves
//! forward by the bits of i, so after the last round `tmp[i]` is the block
//! from rank r-i, copied to output block r-i. Each rank sends about
//! n/2 log2(n) blocks instead of n-1: the price of the fewer messages.
//!
//! Every local copy waits for the one before it (they are all this rank's
//! own memory); a round's messages wait for its packing, and its unpacking
//! for its receive. Each round packs and lands in scratch of its own.
//!
//! Bruck's AllGather: ceil(log2 n) rounds instead of the ring's n-1 steps.
//! After round k rank r holds blocks r .. r + 2^(k+1) (mod n); in round k it
//! sends those it held before, min(2^k, n - 2^k) of them, to rank r - 2^k
//! and receives as many from rank r + 2^k. The blocks held are one run of
//! the output modulo n, so each round is one message (two where the run
//! wraps past block n-1) straight from and into the output: no packing, no
//! final rotation. A round's messages wait for everything received before,
//! which the chain of receives gives: each round's receives are posted once
//! the last of the round before is done.

use super::{Algorithm, Layout};
use crate::algo::schedule::{Action, Buf, Schedule, Span, StepId};
use crate::Collective;

pub(super) const ALLTOALL: Algorithm = Algorithm {
    name: "bruck",
    collective: Collective::AllToAll,
    summary: "log2(n) rounds, each packing half the blocks into one message; for small blocks on many ranks",
    in_place: true,
    build,
};

pub(super) const ALLGATHER: Algorithm = Algorithm {
    name: "bruck",
    collective: Collective::AllGather,
    summary: "log2(n) rounds, each sending every block held so far to rank - 2^k; for small blocks on many ranks",
    in_place: true,
    build: all_gather,
};

/// Indices in `1..n` with bit `k` set, as runs `[start, end)`.
fn runs(k: u32, n: usize) -> impl Iterator<Item = (usize, usize)> {
    let d = 1usize << k;
    (d..n).step_by(2 * d).map(move |a| (a, (a + d).min(n)))
}

fn build(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    let b = l.count / n * l.elem;
    if n == 1 || b == 0 {
        if !l.in_place && b > 0 {
            s.copy(span(Buf::Input, 0, b), span(Buf::Output, 0, b));
        }
        return;
    }
    let rounds = (n - 1).ilog2() + 1;
    let blocks = |k| runs(k, n).map(|(a, e)| e - a).sum::<usize>();
    s.need_scratch(n * b + (0..rounds).map(|k| 2 * blocks(k) * b).sum::<usize>());
    let tmp = |i: usize, len: usize| span(Buf::Scratch, i * b, len * b);
    let mut chain = Chain { me: r, last: None };
    // tmp[i] = input block r+i: blocks r.. then ..r.
    chain.copy(s, span(l.input(), r * b, (n - r) * b), tmp(0, n - r));
    if r > 0 {
        chain.copy(s, span(l.input(), 0, r * b), tmp(n - r, r));
    }
    let mut area = n * b;
    for k in 0..rounds {
        let (to, from) = ((r + (1 << k)) % n, (r + n - (1 << k)) % n);
        let len = blocks(k) * b;
        let (pack, land) = (area, area + len);
        area += 2 * len;
        let mut at = pack;
        for (a, e) in runs(k, n) {
            chain.copy(s, tmp(a, e - a), span(Buf::Scratch, at, (e - a) * b));
            at += (e - a) * b;
        }
        for c in l.chunks(Buf::Scratch, (pack, len)) {
            s.send(to, c, chain.last);
        }
        // Posted once packed: unpacking overwrites what was packed.
        let packed = chain.last;
        for c in l.chunks(Buf::Scratch, (land, len)) {
            chain.last = Some(s.recv(from, c, packed));
        }
        let mut at = land;
        for (a, e) in runs(k, n) {
            chain.copy(s, span(Buf::Scratch, at, (e - a) * b), tmp(a, e - a));
            at += (e - a) * b;
        }
    }
    for i in 0..n {
        chain.copy(s, tmp(i, 1), span(Buf::Output, (r + n - i) % n * b, b));
    }
}

fn all_gather(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    if n == 1 {
        return super::copy_all(l, s);
    }
    // The own block is sent again from the output in later rounds, so it is
    // copied there by a step that those rounds can wait for.
    let mut last = (!l.in_place).then(|| {
        let (offset, len) = l.block(r);
        s.local(
            r,
            Action::Copy,
            l.own_block(),
            span(Buf::Output, offset, len),
            None,
        )
    });
    let mut d = 1;
    while d < n {
        let count = d.min(n - d);
        let before = last;
        for range in runs_of_blocks(l, r, count) {
            for c in l.chunks(Buf::Output, range) {
                s.send((r + n - d) % n, c, before);
            }
        }
        for range in runs_of_blocks(l, (r + d) % n, count) {
            for c in l.chunks(Buf::Output, range) {
                last = Some(s.recv((r + d) % n, c, before));
            }
        }
        d *= 2;
    }
}

/// The byte ranges of blocks `first .. first + count` (mod n): one run, and
/// a second where it wraps past the last block.
fn runs_of_blocks(l: &Layout, first: usize, count: usize) -> impl Iterator<Item = (usize, usize)> {
    let bytes = |a: usize, e: usize| {
        let start = l.block(a).0;
        let (last, len) = l.block(e - 1);
        (start, last + len - start)
    };
    let (n, end) = (l.size, first + count);
    let wrapped = (end > n).then(|| bytes(0, end - n));
    std::iter::once(bytes(first, end.min(n))).chain(wrapped)
}

/// Local copies, each after the step before.
struct Chain {
    me: usize,
    last: Option<StepId>,
}

impl Chain {
    fn copy(&mut self, s: &mut Schedule, from: Span, to: Span) {
        self.last = Some(s.local(self.me, Action::Copy, from, to, self.last));
    }
}

fn span(buf: Buf, offset: usize, len: usize) -> Span {
    Span { buf, offset, len }
}
