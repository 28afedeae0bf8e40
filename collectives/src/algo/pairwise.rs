//! Pairwise AllToAll and AllToAllv: every pair exchanges its blocks, all
//! pairs in flight.
//!
//! Block j of the input goes to rank j; block j of the output comes from rank
//! j. Peers are visited in the symmetric order of the classic pairwise
//! exchange (in round i, rank r pairs with rank (i - r) mod n, which pairs back
//! with r), so an in-place call, whose receives wait in staging until the
//! block they overwrite has been sent, always has its partner's receive ready.

use super::{Algorithm, Layout};
use crate::algo::schedule::{Buf, Schedule, Span};
use crate::{CallDesc, Collective};

pub(super) const ALLTOALL: Algorithm = Algorithm {
    name: "pairwise",
    collective: Collective::AllToAll,
    summary: "every rank exchanges a block with every other, all pairs in flight",
    in_place: true,
    build,
};

pub(super) const ALLTOALLV: Algorithm = Algorithm {
    name: "pairwise",
    collective: Collective::AllToAllV,
    summary: "every rank exchanges its block (any size, empty ones included) with every other, all pairs in flight",
    in_place: false,
    build: build_v,
};

/// The peer of rank `r` in round `round`: rounds pair ranks symmetrically.
pub(super) fn partner(round: usize, r: usize, n: usize) -> usize {
    (round + n - r) % n
}

fn build(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    s.all_in_flight();
    let block = |j: usize| {
        let len = l.count / n * l.elem;
        (j * len, len)
    };
    if !l.in_place {
        let (offset, len) = block(r);
        let own = |buf| Span { buf, offset, len };
        s.copy(own(Buf::Input), own(Buf::Output));
    }
    for round in 0..n {
        let p = partner(round, r, n);
        if p == r {
            continue;
        }
        let sends: Vec<_> = l
            .chunks(l.input(), block(p))
            .map(|c| s.send(p, c, None))
            .collect();
        for (k, c) in l.chunks(Buf::Output, block(p)).enumerate() {
            if l.in_place {
                s.recv_copy(p, c, Some(sends[k]));
            } else {
                s.recv(p, c, None);
            }
        }
    }
}

/// AllToAllv, out of place: this rank's own block is copied; every other
/// pair exchanges at least one message each way, whose tag carries the
/// pair's count, so a rank that expects another count than its peer sends
/// (zero included) gets a "disagree" error naming the peer, never a
/// truncation or a wait for data that never comes.
fn build_v(l: &Layout, s: &mut Schedule) {
    let (n, r, e) = (l.size, l.rank, l.elem);
    let c = l.counts.expect("alltoallv has counts");
    let sent = |j: usize| (c.send_displs[j] * e, c.send_counts[j] * e);
    let received = |j: usize| (c.recv_displs[j] * e, c.recv_counts[j] * e);
    let tag = |count: usize| {
        let desc = CallDesc {
            count: count as u64,
            ..l.call
        };
        Some(desc.tag())
    };
    s.all_in_flight();
    let (from, to) = (sent(r), received(r));
    if from.1 == to.1 && from.1 > 0 {
        let span = |buf, (offset, len): (usize, usize)| Span { buf, offset, len };
        s.copy(span(Buf::Input, from), span(Buf::Output, to));
    }
    for round in 0..n {
        let p = partner(round, r, n);
        if p == r {
            continue;
        }
        s.set_tag(tag(c.send_counts[p]));
        for m in l.messages(Buf::Input, sent(p)) {
            s.send(p, m, None);
        }
        s.set_tag(tag(c.recv_counts[p]));
        for m in l.messages(Buf::Output, received(p)) {
            s.recv(p, m, None);
        }
    }
    s.set_tag(None);
}
