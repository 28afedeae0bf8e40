//! Direct AllReduce: every rank sends its whole buffer to every other and
//! reduces all n contributions itself, in rank order, so every rank computes
//! the same bits. One step instead of the ring's 2(n-1), at the price of
//! n-1 full copies per rank: the algorithm for latency-bound sizes, and for
//! oversubscribed hosts where each ring step waits for a rank to be scheduled.

use super::{Algorithm, Layout};
use crate::schedule::{Action, Buf, Schedule, Span, StepId};
use crate::Collective;

pub(super) const ALLREDUCE: Algorithm = Algorithm {
    name: "direct",
    collective: Collective::AllReduce,
    summary: "every rank sends its buffer to every other and reduces all n in rank order; one step, for small messages",
    in_place: false,
    build,
};

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
