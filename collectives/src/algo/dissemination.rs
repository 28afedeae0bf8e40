//! Dissemination barrier: in round k every rank signals rank + 2^k and waits
//! for rank - 2^k; after ceil(log2 n) rounds each rank has heard, directly or
//! not, from every other.

use super::{Algorithm, Layout};
use crate::algo::schedule::{Buf, Schedule, Span};
use crate::Collective;

pub(super) const BARRIER: Algorithm = Algorithm {
    name: "dissemination",
    collective: Collective::Barrier,
    summary: "log2(n) rounds of empty messages to rank + 2^k",
    in_place: true,
    build,
};

fn build(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    let empty = Span {
        buf: Buf::Output,
        offset: 0,
        len: 0,
    };
    let mut heard = None;
    let mut k = 1;
    while k < n {
        s.send((r + k) % n, empty, heard);
        heard = Some(s.recv((r + n - k) % n, empty, None));
        k *= 2;
    }
}
