//! Pairwise AllToAll: every pair exchanges its blocks, all pairs in flight.
//!
//! Block j of the input goes to rank j; block j of the output comes from rank
//! j. Peers are visited in the symmetric order of the classic pairwise
//! exchange (in round i, rank r pairs with rank (i - r) mod n, which pairs back
//! with r), so an in-place call, whose receives wait in staging until the
//! block they overwrite has been sent, always has its partner's receive ready.

use super::{Algorithm, Layout};
use crate::schedule::{Buf, Schedule, Span};
use crate::Collective;

pub(super) const ALLTOALL: Algorithm = Algorithm {
    name: "pairwise",
    collective: Collective::AllToAll,
    summary: "every rank exchanges a block with every other, all pairs in flight",
    in_place: true,
    build,
};

fn build(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
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
        let p = (round + n - r) % n;
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
