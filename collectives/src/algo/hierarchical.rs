//! Hierarchical AllReduce, every local rank owning a slice (as NCCL's
//! channels do, rather than one leader per host): with H hosts of L ranks,
//!
//! 1. a ring reduce-scatter among the L ranks of each host (shared memory)
//!    leaves local rank i with slice i summed over its host;
//! 2. a ring AllReduce of slice i among the H ranks with local index i, one
//!    per host (the network): L such rings run at once, so every rank's
//!    link carries 2(H-1)/(H L) of the buffer instead of the flat ring's
//!    2(n-1)/n, and each ring crosses hosts only H-1 times per step;
//! 3. a ring all-gather among the L ranks of each host.
//!
//! Phases chain through their last receives (receives from one peer retire
//! in order). Hosts of unequal rank counts fall back to the flat ring.

use super::ring::{self, Contribution, Ring, Source};
use super::tree;
use super::{Algorithm, Layout};
use crate::algo::schedule::{Buf, Schedule, Span, StepId};
use crate::Collective;

pub(crate) const ALLREDUCE: Algorithm = Algorithm {
    name: "hierarchical",
    collective: Collective::AllReduce,
    summary: "reduce-scatter within each host, ring AllReduce of each slice across hosts, all-gather within; for several hosts",
    in_place: true,
    build,
};

/// Whether the hosts suit it: more than one, all with the same rank count.
pub(super) fn applies(hosts: &[Vec<usize>]) -> bool {
    hosts.len() > 1 && hosts.iter().all(|h| h.len() == hosts[0].len())
}

fn build(l: &Layout, s: &mut Schedule) {
    if !applies(l.hosts) {
        return (ring::ALLREDUCE.build)(l, s);
    }
    let host = l
        .hosts
        .iter()
        .position(|h| h.contains(&l.rank))
        .expect("every rank is on a host");
    let local = &l.hosts[host];
    let i = local
        .iter()
        .position(|&r| r == l.rank)
        .expect("on its host");
    let width = local.len();
    let within = Ring {
        members: local.clone(),
        me: i,
        offset: 0,
        len: l.count * l.elem,
    };
    // Phase 1: slice i summed over the host (nothing to do alone on a host).
    let (mine, rs) = if width > 1 {
        let rs = ring::reduce_scatter_phase(l, s, &within, 0, Contribution::input(l), false);
        let mine = Contribution {
            buf: Buf::Output,
            after: rs.last_recv,
        };
        (mine, Some(rs))
    } else {
        (Contribution::input(l), None)
    };
    // Phase 2: slice i across hosts, by the ranks of local index i.
    let (offset, len) = within.block(l, i);
    let across = Ring {
        members: l.hosts.iter().map(|h| h[i]).collect(),
        me: host,
        offset,
        len,
    };
    let reduced = if len <= TREE_SLICE_BYTES_PER_HOST * l.hosts.len() {
        tree_across(l, s, &across, mine)
    } else {
        let before = mine.after;
        let rs2 = ring::reduce_scatter_phase(l, s, &across, 1, mine, true);
        let ag2 = ring::all_gather_phase(
            l,
            s,
            &across,
            1,
            Source::Reduced(&rs2.finals),
            Some(&rs2.sends),
        );
        // (A slice too small to give every host a block may have no receives.)
        ag2.last_recv.or(rs2.last_recv).or(before)
    };
    // Phase 3: the slices around the host.
    if let Some(rs) = rs {
        let own = Span {
            buf: Buf::Output,
            offset,
            len,
        };
        ring::all_gather_phase(l, s, &within, 0, Source::Own(own, reduced), Some(&rs.sends));
    }
}

/// Slices up to this many bytes per host cross hosts by a binary tree
/// (2 log2(H) hops) rather than a ring (2(H-1) steps). By the simulator (8
/// ranks per host, 400 Gb/s), the ring took over from slices of 16-32 KiB
/// on 8 hosts, 128-512 KiB on 64, 0.5-2 MiB on 512.
pub(crate) const TREE_SLICE_BYTES_PER_HOST: usize = 4 << 10;

/// Phase 2 for small slices: the slice reduced up a binary tree over the
/// ranks of `across` and broadcast back down, chunk by chunk; returns the
/// step after which this rank holds the whole result.
fn tree_across(l: &Layout, s: &mut Schedule, across: &Ring, mine: Contribution) -> Option<StepId> {
    let (n, me) = (across.members.len(), across.me);
    let parent = tree::parent(0, me, n).map(|p| across.members[p]);
    let (kids, count) = tree::children(0, me, n);
    let children: Vec<usize> = kids[..count].iter().map(|&k| across.members[k]).collect();
    let mut have = mine.after;
    for c in l.chunks(Buf::Output, (across.offset, across.len)) {
        let own = Span { buf: mine.buf, ..c };
        let mut reduced = None;
        for (k, &child) in children.iter().enumerate() {
            // The first reduction reads the input, or the output once phase 1 left it there.
            let (with, after) = match (k, mine.buf) {
                (0, Buf::Input) => (true, None),
                (0, Buf::Output) => (false, mine.after),
                _ => (false, reduced),
            };
            let finalize = parent.is_none() && k + 1 == children.len();
            reduced = Some(s.recv_reduce(child, c, with, finalize, after));
        }
        have = match parent {
            Some(p) => {
                let (up, after) = match reduced {
                    Some(r) => (c, Some(r)),
                    None => (own, mine.after),
                };
                let sent = s.send(p, up, after);
                // The result overwrites what was sent up: only once it has left.
                Some(s.recv(p, c, Some(sent)))
            }
            None => reduced,
        };
        for &child in &children {
            s.send(child, c, have);
        }
    }
    have
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sends(rank: usize, hosts: &[Vec<usize>]) -> Vec<usize> {
        let size = hosts.iter().map(Vec::len).sum();
        let (collective, dtype) = (crate::Collective::AllReduce, crate::DataType::F32);
        let l = Layout::of_call(collective, dtype, rank, size, 1 << 16, 4096, false, hosts);
        let mut s = Schedule::default();
        build(&l, &mut s);
        s.send_peers()
    }

    #[test]
    fn rings_run_within_hosts_and_across_them_by_local_index() {
        let two_by_four = [vec![0, 1, 2, 3], vec![4, 5, 6, 7]];
        // Rank 3: its host's ring (next is 0) and local index 3 on host 1.
        assert_eq!(sends(3, &two_by_four), vec![0, 7]);
        assert_eq!(sends(4, &two_by_four), vec![0, 5]);
        let one_per_host = [vec![0], vec![1], vec![2]];
        assert_eq!(sends(2, &one_per_host), vec![0]);
        // Unequal hosts: the flat ring.
        assert_eq!(sends(2, &[vec![0, 1, 2], vec![3]]), vec![3]);
    }
}
