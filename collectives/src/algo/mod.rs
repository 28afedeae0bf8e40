//! The algorithms, one file each, registered by name in [`ALGORITHMS`]: the
//! table that the selector, `Config::algo` / `COLL_ALGO` and `collbench
//! --algo` all read. An algorithm only builds a `Schedule`; it never sees a
//! transport.
//!
//! Owns: the algorithms and the `schedule` format they build (steps,
//! spans, `after` edges). May not touch: transports, the executor, the
//! communicator; an algorithm is a pure function of the call's shape.

mod binomial;
mod bruck;
mod chain;
mod direct;
mod dissemination;
mod halving;
pub(crate) mod hierarchical;
mod p2p;
mod pairwise;
mod ring;
pub(crate) mod schedule;
mod tree;

use crate::algo::schedule::{Buf, Schedule, Span, StepId};
use crate::call::args::{Peer, VarCounts};
use crate::{CallDesc, Collective};

/// The schedule of a point-to-point call (not a selectable algorithm).
pub(crate) const POINT_TO_POINT: fn(&Layout, &mut Schedule) = p2p::build;

/// What an algorithm needs to know about the call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout<'a> {
    pub rank: usize,
    pub size: usize,
    /// Elements in each rank's buffer.
    pub count: usize,
    /// Bytes per element.
    pub elem: usize,
    /// Bytes per pipelined chunk, a multiple of `elem`.
    pub chunk: usize,
    pub in_place: bool,
    /// The root of broadcast and reduce (0 otherwise).
    pub root: usize,
    /// The ranks of each host, in rank order.
    pub hosts: &'a [Vec<usize>],
    /// The call, for algorithms whose messages carry tags of their own.
    pub call: CallDesc,
    /// AllToAllv's blocks.
    pub counts: Option<&'a VarCounts>,
    /// Point-to-point: the other end.
    pub peer: Option<Peer>,
}

impl<'h> Layout<'h> {
    /// A call of `collective` with `count` elements of `dtype` on rank
    /// `rank` of `size` (sum, root 0, chunk rounded to whole elements), as
    /// the simulator and the schedule tests build one.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn of_call(
        collective: Collective,
        dtype: crate::DataType,
        rank: usize,
        size: usize,
        count: usize,
        chunk: usize,
        in_place: bool,
        hosts: &'h [Vec<usize>],
    ) -> Self {
        let elem = dtype.size();
        Layout {
            rank,
            size,
            count,
            elem,
            chunk: (chunk / elem).max(1) * elem,
            in_place,
            root: 0,
            hosts,
            call: CallDesc {
                collective,
                dtype,
                op: collective.reduces().then_some(crate::ReduceOp::Sum),
                count: count as u64,
                root: collective.rooted().then_some(0),
                seq: 0,
                comm: 0,
            },
            counts: None,
            peer: None,
        }
    }

    /// The buffer a rank's own contribution is read from.
    pub fn input(&self) -> Buf {
        if self.in_place {
            Buf::Output
        } else {
            Buf::Input
        }
    }

    /// Byte range `[offset, offset+len)` of block `i` when `count` elements
    /// are cut into `size` blocks as evenly as possible (the first
    /// `count % size` blocks get one element more).
    pub fn block(&self, i: usize) -> (usize, usize) {
        let (base, extra) = (self.count / self.size, self.count % self.size);
        let start = i * base + i.min(extra);
        let len = base + usize::from(i < extra);
        (start * self.elem, len * self.elem)
    }

    /// This rank's own block of an allgather's input: the whole send buffer,
    /// or block `rank` of the output when in place.
    pub fn own_block(&self) -> Span {
        let (offset, len) = self.block(self.rank);
        match self.in_place {
            true => Span {
                buf: Buf::Output,
                offset,
                len,
            },
            false => Span {
                buf: Buf::Input,
                offset: 0,
                len,
            },
        }
    }

    /// The whole buffer, `[0, count)`.
    pub fn all(&self) -> (usize, usize) {
        (0, self.count * self.elem)
    }

    /// `[offset, offset+len)` cut into chunk-sized spans of `buf`.
    pub fn chunks(&self, buf: Buf, range: (usize, usize)) -> impl Iterator<Item = Span> + '_ {
        (0..range.1.div_ceil(self.chunk)).map(move |k| self.chunk_at(buf, range, k).unwrap())
    }

    /// Like [`chunks`](Self::chunks), but an empty range is one empty span:
    /// a message that carries only its tag, so a peer expecting data
    /// learns that none comes (and which count was meant).
    pub fn messages(&self, buf: Buf, range: (usize, usize)) -> impl Iterator<Item = Span> + '_ {
        let empty = (range.1 == 0).then_some(Span {
            buf,
            offset: range.0,
            len: 0,
        });
        empty.into_iter().chain(self.chunks(buf, range))
    }

    /// Chunk `k` of [`chunks`](Self::chunks), if the range has one.
    pub fn chunk_at(&self, buf: Buf, (offset, len): (usize, usize), k: usize) -> Option<Span> {
        let at = k * self.chunk;
        let range = Span { buf, offset, len };
        (at < len).then(|| range.part(at, self.chunk.min(len - at)))
    }
}

/// Out of place, the whole input copied into the output: the result of a
/// rank whose result is its own input (a lone rank, a Broadcast's root).
pub(crate) fn copy_all(l: &Layout, s: &mut Schedule) {
    if !l.in_place && l.count > 0 {
        let (offset, len) = l.all();
        let whole = |buf| Span { buf, offset, len };
        s.copy(whole(Buf::Input), whole(Buf::Output));
    }
}

/// One chunk `c` up a tree: the children's partial results reduced into
/// ours in `children` order (the first with this rank's input), then sent
/// to the parent, if any. Returns the last reduction (`None` for a leaf) and
/// the send.
pub(crate) fn reduce_up(
    l: &Layout,
    s: &mut Schedule,
    c: Span,
    parent: Option<usize>,
    children: &[usize],
) -> (Option<StepId>, Option<StepId>) {
    let mine = Span {
        buf: l.input(),
        ..c
    };
    let mut reduced: Option<StepId> = None;
    for (i, &child) in children.iter().enumerate() {
        let with = i == 0 && !l.in_place;
        let finalize = parent.is_none() && i == children.len() - 1;
        reduced = Some(s.recv_reduce(child, c, with, finalize, reduced));
    }
    // A leaf sends its own data; an inner rank its partial result.
    let up = if reduced.is_some() { c } else { mine };
    (reduced, parent.map(|p| s.send(p, up, reduced)))
}

/// A registered algorithm.
pub struct Algorithm {
    pub name: &'static str,
    pub collective: Collective,
    /// One line for `--help` and logs.
    pub summary: &'static str,
    /// Whether it runs in place; if not, the communicator copies an in-place
    /// call's input aside first.
    pub in_place: bool,
    pub(crate) build: fn(&Layout, &mut Schedule),
}

/// Every algorithm, by collective; the first of each collective is its
/// default, the bandwidth-optimal one that `select` falls back to.
pub static ALGORITHMS: &[Algorithm] = &[
    ring::ALLREDUCE,
    direct::ALLREDUCE,
    tree::ALLREDUCE,
    hierarchical::ALLREDUCE,
    halving::ALLREDUCE,
    pairwise::ALLTOALL,
    bruck::ALLTOALL,
    pairwise::ALLTOALLV,
    dissemination::BARRIER,
    ring::REDUCE_SCATTER,
    tree::REDUCE_SCATTER,
    halving::REDUCE_SCATTER,
    ring::ALLGATHER,
    direct::ALLGATHER,
    bruck::ALLGATHER,
    chain::BROADCAST,
    binomial::BROADCAST,
    direct::BROADCAST,
    direct::BROADCAST_HALVES,
    chain::REDUCE,
    binomial::REDUCE,
    ring::REDUCE,
    direct::REDUCE,
];

/// AllReduce sizes up to this many bytes go direct (one step) rather than
/// around the ring or the trees: the crossovers measured on one host with
/// 2 ranks, 3-7, and 8 or more (where the tree takes over from 2 KiB).
pub const DIRECT_MAX_BYTES: [usize; 3] = [8 << 10, 32 << 10, 2 << 10];
/// From this size on, AllReduces over several hosts go hierarchical (2
/// namespace hosts x 4 ranks: the tree led up to 256 KiB, hierarchical from
/// 512 KiB, 1.2-1.6x the ring above).
pub const HIERARCHICAL_MIN_BYTES: usize = 512 << 10;
/// From this many ranks on, AllReduces up to [`TREE_MAX_BYTES`] take the
/// double binary tree: at 8 ranks it beat direct from 32 KiB and the ring up
/// to 256 KiB (shared memory, 2 cores); at 4 it never beat both.
pub const TREE_MIN_RANKS: usize = 8;
pub const TREE_MAX_BYTES: usize = 512 << 10;
/// On one host, a power of two of 4 or more ranks takes Rabenseifner's
/// AllReduce from this size on where neither direct nor the tree does: its
/// log2(n) exchanges a half beat the ring's n-1 steps around (shared
/// memory, 2 cores, `collbench allreduce --algo`, paired time ratios to the
/// ring, 3-6 rounds: 4 ranks 0.87 / 0.89 / 0.92 / 0.93 / 0.96 / 0.96 at 256
/// KiB / 1 / 4 / 16 / 64 / 256 MiB; 8 ranks 0.89 / 0.71 / 0.93 / 0.90 /
/// 0.93 at 512 KiB / 1 / 4 / 16 / 256 MiB; 16 ranks not measured, from 17
/// on `at_scale` decides). Other counts fold their extra ranks in first,
/// which cost more than it saved: 3 ranks 1.21x the ring's time, 6 ranks
/// 1.06 / 0.88.
pub const HALVING_MIN_BYTES: usize = 256 << 10;
/// From this many ranks on (more than were measured here), a communicator
/// without a profile asks the simulator (`simulate::choice`), and AllReduces
/// too large to simulate then are chosen by `at_scale`, a table read off it.
pub const SCALE_MIN_RANKS: usize = 17;

/// AllToAlls on [`SCALE_MIN_RANKS`] or more with blocks (per peer) up to
/// this size take Bruck's algorithm: by the simulator (8 ranks per host,
/// 400 Gb/s), at 64 ranks 55 us vs pairwise's 83 with 1 KiB blocks, 566 vs
/// 322 with 16 KiB; at 512 ranks 80 vs 534 with 128 B, even with 2 KiB.
pub const BRUCK_MAX_BLOCK_BYTES: usize = 1 << 10;
/// Broadcast and Reduce up to this size take the binomial tree (log2 n
/// rounds), above it the chain (pipelined, bandwidth-optimal): the binomial
/// tree led at 256 KiB, the chain at 4 MiB (4 and 8 ranks). Broadcasts over
/// shared memory go direct from [`DIRECT_BROADCAST_MIN_BYTES`].
pub const BINOMIAL_MAX_BYTES: usize = 1 << 20;

/// AllGathers over shared memory on this many ranks or more, with blocks
/// of at least [`DIRECT_ALLGATHER_MIN_BLOCK`], go direct: the ring's blocks
/// each wait n-1 hops, which on an oversubscribed host means n-1 ranks
/// scheduled in turn (shared memory, 2 cores, `collbench allgather --algo`,
/// paired time ratios direct / ring, 6 rounds: 4 ranks 0.73 / 0.80 / 0.60 /
/// 0.68 / 0.98 at 256 KiB / 1 / 4 / 16 / 256 MiB, 0.96 / 0.80 in place at 1
/// / 16 MiB, 0.88 / 0.97 / 0.80 with fresh inputs at 1 / 4 / 16 MiB; 3
/// ranks 0.78 at 4 MiB; 8 ranks 0.73-0.91 from 512 KiB to 16 MiB with fresh
/// inputs, but 2.5 at 256 KiB, whose 32 KiB blocks are copied through the
/// slots). At 2 ranks both are one exchange.
pub const DIRECT_ALLGATHER_MIN_RANKS: usize = 3;
pub const DIRECT_ALLGATHER_MIN_BLOCK: usize = 64 << 10;

/// Broadcasts over shared memory of this size or more go direct (every
/// rank reads the root's chunks itself) rather than down the chain or the
/// binomial tree, whose hops each wait for a rank to be scheduled (shared
/// memory, 2 cores, `collbench broadcast --algo`, in place, paired time
/// ratios, 5-6 rounds: direct / chain 0.90 / 0.69 / 0.73 / 0.82 / 1.01 at 2
/// / 4 / 8 / 16 / 256 MiB on 8 ranks, 0.76 at 16 MiB on 4; direct /
/// binomial 0.95 / 0.85 / 0.78 at 2 / 4 / 8 MiB on 8 ranks, 1.26 / 1.00 /
/// 0.82 on 4). At 256 KiB and 1 MiB the tree once took 0.88-0.93x direct's
/// time, in minutes when a cache line crossed the cores in ~100 ns; but its
/// second hop waits on its first, and in the minutes it took ~500 ns the
/// tree took 2-4x direct's time (`ci/ab.py broadcast N SIZE 6 A
/// COLL_ALGO=direct:A --ip`, direct / binomial over minutes of both kinds:
/// 0.66 / 0.83 / 0.80 / 0.85 at 128 / 256 / 512 KiB / 1 MiB on 4 ranks,
/// 0.97 / 0.80 / 0.89 / 1.00 on 8, 0.91 at 256 KiB on 3; over all 16
/// paired series 0.88, three of them 1.05-1.19). From where the flag path
/// ends by default: with `COLL_TINY=0`, direct took 0.82-0.84x the tree's
/// time at 64 KiB on 4 and 8 ranks, but 1.14x at 4 KiB.
/// Over sockets the root would copy every byte into n-1 of them: the chain
/// stays there.
pub const DIRECT_BROADCAST_MIN_BYTES: usize = crate::config::DEFAULT_TINY_BYTES;

/// Broadcasts over shared memory go in halves (`direct::BROADCAST_HALVES`)
/// rather than chunks wherever they go direct, but on a host whose ranks
/// outnumber its cores only from this size, two default chunks: below it a
/// second message costs more than the root's writes save. Shared memory, 2
/// cores, in place, paired time ratios halves / chunks (`ci/ab.py broadcast
/// N SIZE 6-8 A B --ip`): 2 ranks 0.67 / 0.54 / 0.54 / 0.63 at 256 KiB / 1
/// / 16 / 256 MiB (out of place 1.21 / 1.08 / 1.02, 256 KiB / 1 / 16 MiB:
/// the root copies its own and declines); 4 ranks 1.08 / 1.05 / 0.84 / 0.91
/// / 0.87 / 0.87 at 256 KiB / 1 / 2 / 4 / 16 / 256 MiB; 8 ranks 0.96 / 1.06
/// / 0.91 / 0.99 / 0.96 / 0.87 at the same sizes.
pub const CROWDED_HALVES_MIN_BYTES: usize = 2 << 20;

/// What the built-in thresholds know of a job besides the call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Topology {
    /// Ranks by host, each host's in rank order.
    pub hosts: Vec<Vec<usize>>,
    /// Every message goes over TCP, on one host whose ranks outnumber its
    /// cores: each costs system calls on both sides and, as often as not,
    /// a context switch, so the algorithms that send fewer messages win
    /// (see [`CROWDED_TREE_MAX_BYTES`]).
    pub crowded_sockets: bool,
    /// One host, whose ranks outnumber its cores: a rank that waits hands
    /// its core to another (see [`CROWDED_HALVES_MIN_BYTES`]).
    pub crowded: bool,
    /// Every message goes through shared memory (every rank on one host): a
    /// receiver reads its sender's memory itself (see [`DIRECT_BROADCAST_MIN_BYTES`]).
    pub shared_memory: bool,
}

impl Topology {
    /// Ranks spread over `hosts`, messages not crowded onto sockets.
    pub fn new(hosts: Vec<Vec<usize>>) -> Self {
        Topology {
            hosts,
            crowded_sockets: false,
            crowded: false,
            shared_memory: false,
        }
    }

    pub fn size(&self) -> usize {
        self.hosts.iter().map(Vec::len).sum()
    }
}

/// With `Topology::crowded_sockets`, AllReduces of 3 or more ranks up to
/// this size take the double binary tree, and AllToAlls of 4 or more with
/// blocks up to [`CROWDED_BRUCK_MAX_BLOCK_BYTES`] Bruck's algorithm: each
/// sends fewer messages than direct (n-1 per rank), the ring (2(n-1)) or
/// pairwise (n-1). Over loopback TCP on 2 cores (`collbench --algo`, paired
/// time ratios, 5 rounds): AllReduce tree / direct 0.93 / 0.72 / 0.71 /
/// 0.75 at 8 B / 1 / 8 / 16 KiB on 4 ranks, 0.55 and 0.43 at 8 B and 48 KiB
/// on 6, 0.90 and 0.67 at 8 B and 192 KiB on 3; tree / ring 0.54 / 0.83 /
/// 1.43 at 64 / 256 / 512 KiB on 4 ranks, 0.30 / 0.62 at 64 / 256 KiB on 8
/// (where 8 B went direct: 0.52x its time). AllToAll Bruck / pairwise
/// 0.71 / 0.75 / 0.75 at 1 / 16 / 64 KiB on 4 ranks (16 KiB blocks), 1.6
/// at 256 KiB; 0.50 / 0.67 at 1 / 64 KiB on 8, 0.83 at 48 KiB on 6; no gain
/// on 3 (as many rounds as peers). Over shared memory the ring stays ahead
/// (4 ranks, 128 KiB: the tree 2.3x its time).
pub const CROWDED_TREE_MAX_BYTES: usize = 256 << 10;
pub const CROWDED_BRUCK_MAX_BLOCK_BYTES: usize = 16 << 10;
/// With `Topology::crowded_sockets`, AllGathers of 3 or more ranks up to
/// this size (all blocks together) take Bruck's: log2(n) messages per rank
/// instead of the ring's n-1, each waiting for a rank to be scheduled.
/// Over loopback TCP on 2 cores (paired time ratios to the ring, 3 rounds):
/// 0.48 / 0.51 / 0.50 / 0.95 / 0.94 at 1 / 16 / 64 / 256 KiB / 1 MiB on 8
/// ranks (Open MPI 1.15-1.29x our time up to 64 KiB, where the ring took
/// 1.7-1.9x its), 0.61 / 0.63 / 0.84 / 0.79 / 0.74 on 4, 0.64 / 0.88 at
/// 16 KiB / 1 MiB on 6, 0.91 / 0.97 on 3; at 4 MiB 1.08 / 1.11 on 4 / 8.
pub const CROWDED_BRUCK_ALLGATHER_MAX_BYTES: usize = 1 << 20;
/// With `Topology::crowded_sockets`, ReduceScatters of 3 or more ranks
/// (other than the powers of two that `select` gives recursive halving)
/// with blocks up to this size take the tree: the whole buffer 2 log2(n)
/// hops instead of a block n-1 times around the ring. Over loopback TCP on
/// 2 cores (paired time ratios to the ring, 3 rounds): 0.77 / 1.43 at 1 /
/// 64 KiB on 3 ranks, 0.37 / 0.88 / 1.14 at 1 / 64 / 128 KiB on 5, 0.35 /
/// 0.42 / 0.72 / 1.35 at 1 / 16 / 64 / 256 KiB on 6.
pub const CROWDED_TREE_REDUCE_SCATTER_MAX_BLOCK: usize = 16 << 10;
/// With `Topology::crowded_sockets`, Reduces on these many ranks up to
/// [`CROWDED_DIRECT_REDUCE_MAX_BYTES`] go direct: a non-root only sends, so
/// it never waits for a peer to be scheduled, and the root takes each
/// peer's messages of many calls in one read. Over loopback TCP on 2 cores
/// (paired time ratios to the binomial tree, 7 rounds): 0.67 / 0.78 / 1.05
/// / 1.44 at 8 B / 1 / 4 / 16 KiB on 8 ranks, 0.85 / 0.77 at 8 B / 1 KiB on
/// 6, 0.89 at 8 B on 5, but 1.24 on 4; more ranks not measured.
pub const CROWDED_DIRECT_REDUCE_RANKS: std::ops::RangeInclusive<usize> = 5..=8;
pub const CROWDED_DIRECT_REDUCE_MAX_BYTES: usize = 1 << 10;

/// The algorithm the selector picks for a call of `bytes` per rank on
/// `topology`, and why.
pub(crate) fn select(
    collective: Collective,
    bytes: usize,
    topology: &Topology,
) -> (&'static Algorithm, &'static str) {
    use Collective::*;
    let (size, hosts) = (topology.size(), &topology.hosts[..]);
    let crowded = topology.crowded_sockets;
    match collective {
        AllReduce if crowded && size >= 3 && bytes <= CROWDED_TREE_MAX_BYTES => (
            &tree::ALLREDUCE,
            "every message a system call and a context switch: the tree sends the fewest",
        ),
        AllToAll if crowded && size >= 4 && bytes / size <= CROWDED_BRUCK_MAX_BLOCK_BYTES => (
            &bruck::ALLTOALL,
            "every message a system call and a context switch: log2(n) packed messages beat n-1",
        ),
        AllGather if crowded && size >= 3 && bytes <= CROWDED_BRUCK_ALLGATHER_MAX_BYTES => (
            &bruck::ALLGATHER,
            "every message a system call and a context switch: log2(n) messages beat the ring's n-1",
        ),
        Reduce
            if crowded
                && CROWDED_DIRECT_REDUCE_RANKS.contains(&size)
                && bytes <= CROWDED_DIRECT_REDUCE_MAX_BYTES =>
        {
            (
                &direct::REDUCE,
                "every message a system call and a context switch: non-roots only send",
            )
        }
        ReduceScatter if hosts.len() == 1 && size >= 4 && size.is_power_of_two() => (
            &halving::REDUCE_SCATTER,
            "one host, a power of two of ranks: log2(n) halving steps beat the ring's n-1",
        ),
        ReduceScatter
            if crowded && size >= 3 && bytes / size <= CROWDED_TREE_REDUCE_SCATTER_MAX_BLOCK =>
        {
            (
                &tree::REDUCE_SCATTER,
                "every message a system call and a context switch: the tree sends the fewest",
            )
        }
        AllReduce if size >= SCALE_MIN_RANKS => at_scale(bytes, hosts),
        AllReduce if hierarchical::applies(hosts) && bytes >= HIERARCHICAL_MIN_BYTES => (
            &hierarchical::ALLREDUCE,
            "several hosts of equal rank counts: slices cross the network in parallel rings",
        ),
        AllReduce if size > 1 && bytes <= DIRECT_MAX_BYTES[direct_class(size)] => (
            &direct::ALLREDUCE,
            "small message: one step beats the ring's 2(n-1) and the trees' 2 log2(n)",
        ),
        AllReduce if size >= TREE_MIN_RANKS && bytes <= TREE_MAX_BYTES => (
            &tree::ALLREDUCE,
            "many ranks, latency-bound size: 2 log2(n) hops beat the ring's 2(n-1)",
        ),
        AllReduce
            if hosts.len() == 1
                && size >= 4
                && size.is_power_of_two()
                && bytes >= HALVING_MIN_BYTES =>
        {
            (
                &halving::ALLREDUCE,
                "one host, a power of two of ranks: log2(n) exchanges beat the ring's n-1 steps",
            )
        }
        AllToAll if size >= SCALE_MIN_RANKS && bytes / size <= BRUCK_MAX_BLOCK_BYTES => (
            &bruck::ALLTOALL,
            "many ranks, small blocks: log2(n) packed messages beat n-1 (the simulator's pick)",
        ),
        AllGather
            if topology.shared_memory
                && size >= DIRECT_ALLGATHER_MIN_RANKS
                && bytes / size >= DIRECT_ALLGATHER_MIN_BLOCK =>
        {
            (
                &direct::ALLGATHER,
                "shared memory, large blocks: no block waits n-1 hops around the ring",
            )
        }
        Broadcast
            if topology.shared_memory
                && bytes >= DIRECT_BROADCAST_MIN_BYTES
                && (!topology.crowded || bytes >= CROWDED_HALVES_MIN_BYTES) =>
        {
            (
                &direct::BROADCAST_HALVES,
                "shared memory, large message: every rank reads the root's halves, the root writes one in place",
            )
        }
        Broadcast if topology.shared_memory && bytes >= DIRECT_BROADCAST_MIN_BYTES => (
            &direct::BROADCAST,
            "shared memory, large message: every rank reads the root's chunks, none waits for a hop",
        ),
        Broadcast | Reduce if bytes <= BINOMIAL_MAX_BYTES => (
            find(collective, "binomial").expect("registered"),
            "latency-bound size: log2(n) rounds beat the chain's n-1 hops",
        ),
        _ => (default_for(collective), "the bandwidth-optimal default"),
    }
}

/// AllReduce at [`SCALE_MIN_RANKS`] or more, by the simulator (`collbench
/// simulate allreduce --ranks N`, 8 ranks per host, 400 Gb/s NICs; time per
/// call in us at 64 / 512 / 4096 ranks):
///
/// | size  | rabenseifner      | hierarchical (tree or ring across) | tree          | direct     |
/// |-------|-------------------|------------------------------------|---------------|------------|
/// | 8 B   | 24.5 / 40 / 57    | 34 / 52 / 70                       | 29 / 46 / 62  | 120 / 1016 |
/// | 64 KiB| 65 / 165 / 347    | 48 / 69 / 91                       |               |            |
/// | 1 MiB | 199 / 312 / 508   | 182 / 356 / 437                    |               |            |
/// | 4 MiB | 685 / 868 / 1071  | 641 / 855 / 1561                   |               |            |
///
/// (8 B is two elements: Rabenseifner's blocks are then mostly empty.) On
/// one host of 32 ranks Rabenseifner led from 64 KiB to 1 MiB, the tree at
/// 8 B by 4%, the ring at 256 MiB by 5%.
fn at_scale(bytes: usize, hosts: &[Vec<usize>]) -> (&'static Algorithm, &'static str) {
    const TREE_ACROSS: std::ops::Range<usize> = (1 << 10)..(4 << 20);
    const HALVING_MAX_BYTES: usize = 16 << 20;
    let several_hosts = hierarchical::applies(hosts);
    if several_hosts && (TREE_ACROSS.contains(&bytes) || bytes >= HALVING_MAX_BYTES) {
        (
            &hierarchical::ALLREDUCE,
            "many ranks on several hosts: reductions within hosts, a tree or rings across (the simulator's pick)",
        )
    } else if bytes < HALVING_MAX_BYTES {
        (
            &halving::ALLREDUCE,
            "many ranks: 2 log2(n) steps, bandwidth-optimal (the simulator's pick)",
        )
    } else {
        (
            &ring::ALLREDUCE,
            "many ranks on one host, large message: the ring (the simulator's pick)",
        )
    }
}

/// Which [`DIRECT_MAX_BYTES`] applies to `size` ranks.
fn direct_class(size: usize) -> usize {
    match size {
        ..=2 => 0,
        s if s < TREE_MIN_RANKS => 1,
        _ => 2,
    }
}

/// Whether the algorithm `name` runs as itself on these hosts (the
/// hierarchical one needs several of equal rank counts, else it is the ring).
pub fn fits(name: &str, hosts: &[Vec<usize>]) -> bool {
    name != hierarchical::ALLREDUCE.name || hierarchical::applies(hosts)
}

/// The algorithm named `name` for `collective`.
pub fn find(collective: Collective, name: &str) -> Option<&'static Algorithm> {
    ALGORITHMS
        .iter()
        .find(|a| a.collective == collective && a.name == name)
}

/// Names of the algorithms for `collective`, default first.
pub fn names(collective: Collective) -> Vec<&'static str> {
    ALGORITHMS
        .iter()
        .filter(|a| a.collective == collective)
        .map(|a| a.name)
        .collect()
}

/// The default algorithm for `collective`.
pub(crate) fn default_for(collective: Collective) -> &'static Algorithm {
    ALGORITHMS
        .iter()
        .find(|a| a.collective == collective)
        .expect("every collective has an algorithm")
}

#[cfg(test)]
mod tests {
    use super::*;
    use Collective::*;

    #[test]
    fn crowded_sockets_take_the_algorithms_that_send_fewest_messages() {
        let one_host = |n: usize| Topology::new(vec![(0..n).collect()]);
        let crowded = |n| Topology {
            crowded_sockets: true,
            ..one_host(n)
        };
        let pick = |c, bytes, t: Topology| select(c, bytes, &t).0.name;
        assert_eq!(pick(AllReduce, 8, one_host(4)), "direct");
        assert_eq!(pick(AllReduce, 8, crowded(4)), "tree");
        assert_eq!(pick(AllReduce, 64 << 10, one_host(4)), "ring");
        assert_eq!(pick(AllReduce, CROWDED_TREE_MAX_BYTES, crowded(3)), "tree");
        assert_eq!(
            pick(AllReduce, 2 * CROWDED_TREE_MAX_BYTES, crowded(4)),
            "rabenseifner"
        );
        // Two ranks send one message each way whichever runs.
        assert_eq!(pick(AllReduce, 8, crowded(2)), "direct");
        assert_eq!(pick(AllToAll, 64 << 10, one_host(4)), "pairwise");
        assert_eq!(pick(AllToAll, 64 << 10, crowded(4)), "bruck");
        assert_eq!(pick(AllToAll, 128 << 10, crowded(4)), "pairwise");
        // Three ranks: Bruck's two rounds are as many as the peers.
        assert_eq!(pick(AllToAll, 3 << 10, crowded(3)), "pairwise");
        let gather_max = CROWDED_BRUCK_ALLGATHER_MAX_BYTES;
        assert_eq!(pick(AllGather, gather_max, crowded(3)), "bruck");
        assert_eq!(pick(AllGather, gather_max + 8, crowded(8)), "ring");
        assert_eq!(pick(AllGather, 8 << 10, crowded(2)), "ring");
        assert_eq!(pick(AllGather, 8 << 10, one_host(8)), "ring");
        let block = CROWDED_TREE_REDUCE_SCATTER_MAX_BLOCK;
        assert_eq!(pick(ReduceScatter, 6 * block, crowded(6)), "tree");
        assert_eq!(pick(ReduceScatter, 6 * block + 6, crowded(6)), "ring");
        assert_eq!(pick(ReduceScatter, 8, crowded(2)), "ring");
        assert_eq!(pick(Reduce, 8, crowded(8)), "direct");
        assert_eq!(pick(Reduce, 8, crowded(4)), "binomial");
        assert_eq!(pick(Reduce, 8, one_host(8)), "binomial");
        assert_eq!(pick(Reduce, 2 << 10, crowded(8)), "binomial");
    }

    #[test]
    fn reduce_scatters_halve_on_one_host_of_a_power_of_two_ranks() {
        let hosts = |n: usize, per: usize| {
            let ranks: Vec<usize> = (0..n).collect();
            Topology::new(ranks.chunks(per).map(<[usize]>::to_vec).collect())
        };
        let pick = |bytes, t: Topology| select(ReduceScatter, bytes, &t).0.name;
        assert_eq!(pick(1 << 20, hosts(4, 4)), "halving");
        assert_eq!(pick(8, hosts(8, 8)), "halving");
        assert_eq!(pick(1 << 20, hosts(2, 2)), "ring");
        assert_eq!(pick(1 << 20, hosts(6, 6)), "ring");
        assert_eq!(pick(1 << 20, hosts(8, 4)), "ring");
    }

    #[test]
    fn large_broadcasts_and_allgathers_go_direct_only_over_shared_memory() {
        let memory = |n: usize| Topology {
            shared_memory: true,
            ..Topology::new(vec![(0..n).collect()])
        };
        let crowded = |n: usize| Topology {
            crowded: true,
            ..memory(n)
        };
        let pick = |bytes, t: Topology| select(Broadcast, bytes, &t).0.name;
        assert_eq!(pick(DIRECT_BROADCAST_MIN_BYTES - 4, memory(8)), "binomial");
        assert_eq!(pick(DIRECT_BROADCAST_MIN_BYTES, memory(8)), "halves");
        assert_eq!(pick(BINOMIAL_MAX_BYTES, memory(4)), "halves");
        // Where ranks outnumber cores, in chunks below CROWDED_HALVES_MIN_BYTES.
        assert_eq!(pick(DIRECT_BROADCAST_MIN_BYTES, crowded(8)), "direct");
        assert_eq!(pick(CROWDED_HALVES_MIN_BYTES - 4, crowded(4)), "direct");
        assert_eq!(pick(CROWDED_HALVES_MIN_BYTES, crowded(4)), "halves");
        let sockets = Topology::new(vec![(0..8).collect()]);
        assert_eq!(pick(16 << 20, sockets.clone()), "chain");
        // AllGather likewise from 3 ranks and 64 KiB blocks.
        let gather = |bytes, t: Topology| select(AllGather, bytes, &t).0.name;
        assert_eq!(gather(3 * DIRECT_ALLGATHER_MIN_BLOCK, memory(3)), "direct");
        assert_eq!(
            gather(3 * DIRECT_ALLGATHER_MIN_BLOCK - 3, memory(3)),
            "ring"
        );
        assert_eq!(gather(16 << 20, sockets), "ring");
    }
}
