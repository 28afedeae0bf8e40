//! Ring AllReduce: reduce-scatter then all-gather around the ring, each step's
//! block cut into chunks so that a chunk moves on as soon as it is reduced.
//!
//! With n ranks the buffer is cut into n blocks. In reduce-scatter step t rank
//! r sends block r-t to r+1 and receives block r-t-1 from r-1, reducing it into
//! its own; after n-1 steps rank r holds block r+1 fully reduced. All-gather
//! then circulates the reduced blocks for n-1 more steps. Each rank sends
//! 2(n-1)/n of the buffer: bandwidth-optimal.

use super::{Algorithm, Layout};
use crate::schedule::{Buf, OpId, Schedule, Span};
use crate::Collective;

pub(super) const ALLREDUCE: Algorithm = Algorithm {
    name: "ring",
    collective: Collective::AllReduce,
    summary: "reduce-scatter + all-gather around a ring, chunk-pipelined; bandwidth-optimal",
    in_place: true,
    build,
};

fn build(l: &Layout, s: &mut Schedule) {
    let (n, r) = (l.size, l.rank);
    if n == 1 {
        if !l.in_place {
            let all = (0, l.count * l.elem);
            s.copy(span(Buf::Input, all), span(Buf::Output, all));
        }
        return;
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Receives of the previous step, by chunk: the sends of this step wait for them.
    let mut prev_recvs: Vec<OpId> = Vec::new();
    // Reduce-scatter sends, by step and chunk: an all-gather receive into the
    // same block must wait until that send has read it.
    let mut rs_sends: Vec<Vec<OpId>> = Vec::with_capacity(n - 1);
    for t in 0..2 * (n - 1) {
        let reduce_scatter = t < n - 1;
        let (send_block, recv_block) = if reduce_scatter {
            ((r + n - t) % n, (r + 2 * n - t - 1) % n)
        } else {
            let t = t - (n - 1);
            ((r + 1 + n - t) % n, (r + n - t) % n)
        };
        let from = if t == 0 { l.input() } else { Buf::Output };
        let sends: Vec<OpId> = l
            .chunks(from, l.block(send_block))
            .enumerate()
            .map(|(k, c)| s.send(next, c, (t > 0).then(|| prev_recvs[k])))
            .collect();
        prev_recvs = l
            .chunks(Buf::Output, l.block(recv_block))
            .enumerate()
            .map(|(k, c)| {
                if reduce_scatter {
                    let with = (!l.in_place).then_some(Span {
                        buf: Buf::Input,
                        ..c
                    });
                    s.recv_reduce(prev, c, with, t == n - 2, None)
                } else {
                    s.recv(prev, c, Some(rs_sends[t - (n - 1)][k]))
                }
            })
            .collect();
        if reduce_scatter {
            rs_sends.push(sends);
        }
    }
}

fn span(buf: Buf, (offset, len): (usize, usize)) -> Span {
    Span { buf, offset, len }
}
