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

use super::{Algorithm, Layout};
use crate::schedule::{Action, Buf, Schedule, Span, StepId};
use crate::Collective;

pub(super) const ALLTOALL: Algorithm = Algorithm {
    name: "bruck",
    collective: Collective::AllToAll,
    summary: "log2(n) rounds, each packing half the blocks into one message; for small blocks on many ranks",
    in_place: true,
    build,
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
