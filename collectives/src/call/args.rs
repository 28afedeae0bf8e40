//! One argument struct for every call (UCC's `ucc_coll_args_t`): which
//! collective, datatype, reduction, root, peer and per-peer counts, and the
//! shape rules that say which buffers fit it. The communicator, collbench,
//! the non-blocking layer and the C and Python bindings all ask it, so the
//! rules are written once.

use transport::Rank;

use crate::{Collective, DataType, ReduceOp};

/// The per-peer blocks of an AllToAllv, in elements: block `j` of the send
/// buffer (`send_counts[j]` elements from `send_displs[j]`) goes to rank
/// `j`; block `j` of the receive buffer comes from rank `j`. Rank `i`'s
/// `send_counts[j]` must equal rank `j`'s `recv_counts[i]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VarCounts {
    pub send_counts: Vec<usize>,
    pub send_displs: Vec<usize>,
    pub recv_counts: Vec<usize>,
    pub recv_displs: Vec<usize>,
}

impl VarCounts {
    /// Blocks packed one after another in rank order (torch's
    /// `all_to_all_single` with split sizes).
    pub fn packed(send_counts: &[usize], recv_counts: &[usize]) -> Self {
        VarCounts {
            send_displs: prefix_sums(send_counts),
            recv_displs: prefix_sums(recv_counts),
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
        }
    }

    /// Elements sent in all.
    pub fn total_sent(&self) -> usize {
        self.send_counts.iter().sum()
    }

    /// Elements received in all.
    pub fn total_received(&self) -> usize {
        self.recv_counts.iter().sum()
    }

    /// Checks the blocks against `n` ranks (this one `rank`) and buffers of
    /// `send_len` and `recv_len` elements: every block inside its buffer,
    /// receive blocks not overlapping, this rank's block to itself the
    /// same size both ways.
    fn check(&self, rank: Rank, n: usize, send_len: usize, recv_len: usize) -> Result<(), String> {
        let lists = [
            ("send_counts", &self.send_counts),
            ("send_displs", &self.send_displs),
            ("recv_counts", &self.recv_counts),
            ("recv_displs", &self.recv_displs),
        ];
        if let Some((name, l)) = lists.iter().find(|(_, l)| l.len() != n) {
            return Err(format!("{name} has {} entries for {n} ranks", l.len()));
        }
        if self.send_counts[rank] != self.recv_counts[rank] {
            return Err(format!(
                "rank {rank} sends itself {} elements but expects {} from itself",
                self.send_counts[rank], self.recv_counts[rank]
            ));
        }
        let sides = [
            ("send", &self.send_counts, &self.send_displs, send_len),
            ("receive", &self.recv_counts, &self.recv_displs, recv_len),
        ];
        for (side, counts, displs, len) in sides {
            for (j, (&c, &d)) in counts.iter().zip(displs.iter()).enumerate() {
                if d.checked_add(c).is_none_or(|end| end > len) {
                    return Err(format!(
                        "{side} block {j} ({c} elements at {d}) ends beyond the {len}-element {side} buffer"
                    ));
                }
            }
        }
        let mut blocks: Vec<(usize, usize, usize)> = (0..n)
            .filter(|&j| self.recv_counts[j] > 0)
            .map(|j| (self.recv_displs[j], self.recv_counts[j], j))
            .collect();
        blocks.sort_unstable();
        for w in blocks.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "receive blocks from ranks {} and {} overlap",
                    w[0].2, w[1].2
                ));
            }
        }
        Ok(())
    }
}

fn prefix_sums(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect()
}

/// Everything about a call but its buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallArgs {
    pub collective: Collective,
    pub dtype: DataType,
    /// The reduction, for the collectives that reduce.
    pub op: Option<ReduceOp>,
    /// The root of broadcast and reduce.
    pub root: Option<Rank>,
    /// Point-to-point: the rank a `send` goes to, or a `recv` comes from.
    pub peer: Option<Peer>,
    /// AllToAllv's blocks.
    pub counts: Option<VarCounts>,
}

/// The other end of a point-to-point call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    To(Rank),
    From(Rank),
}

impl Peer {
    pub fn rank(self) -> Rank {
        match self {
            Peer::To(r) | Peer::From(r) => r,
        }
    }
}

impl CallArgs {
    /// A call of `collective` on `dtype` elements, no reduction or root yet.
    pub fn new(collective: Collective, dtype: DataType) -> Self {
        CallArgs {
            collective,
            dtype,
            op: None,
            root: None,
            peer: None,
            counts: None,
        }
    }

    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = Some(op);
        self
    }

    pub fn root(mut self, root: Rank) -> Self {
        self.root = Some(root);
        self
    }

    pub fn send_to(dtype: DataType, peer: Rank) -> Self {
        CallArgs {
            peer: Some(Peer::To(peer)),
            ..Self::new(Collective::PointToPoint, dtype)
        }
    }

    pub fn recv_from(dtype: DataType, peer: Rank) -> Self {
        CallArgs {
            peer: Some(Peer::From(peer)),
            ..Self::new(Collective::PointToPoint, dtype)
        }
    }

    pub fn all_to_all_v(dtype: DataType, counts: VarCounts) -> Self {
        CallArgs {
            counts: Some(counts),
            ..Self::new(Collective::AllToAllV, dtype)
        }
    }

    /// The send and receive buffer lengths, in elements, that NCCL's
    /// `count` argument stands for on `n` ranks: per peer for AllToAll,
    /// the receive block for ReduceScatter, the send block for AllGather,
    /// the whole buffer otherwise. AllToAllv's come from its counts.
    pub fn nccl_lengths(&self, count: usize, n: usize) -> Option<(usize, usize)> {
        let times_n = |c: usize| c.checked_mul(n);
        Some(match self.collective {
            Collective::AllToAll => (times_n(count)?, times_n(count)?),
            Collective::ReduceScatter => (times_n(count)?, count),
            Collective::AllGather => (count, times_n(count)?),
            Collective::Barrier => (0, 0),
            Collective::AllToAllV => {
                let c = self.counts.as_ref()?;
                let end = |counts: &[usize], displs: &[usize]| {
                    (counts.iter().zip(displs))
                        .map(|(c, d)| c.checked_add(*d))
                        .try_fold(0usize, |m, e| Some(m.max(e?)))
                };
                (
                    end(&c.send_counts, &c.send_displs)?,
                    end(&c.recv_counts, &c.recv_displs)?,
                )
            }
            Collective::PointToPoint => match self.peer? {
                Peer::To(_) => (count, 0),
                Peer::From(_) => (0, count),
            },
            _ => (count, count),
        })
    }

    /// Whether NCCL's buffer addresses mean in place: `send == recv`, or,
    /// as NCCL defines it, AllGather's send block at block `rank` of the
    /// receive buffer and ReduceScatter's receive block at block `rank` of
    /// the send buffer (`count` as in [`nccl_lengths`](Self::nccl_lengths));
    /// a Broadcast off its root, whose send buffer is never read, and a
    /// receive, too.
    pub fn nccl_in_place(&self, send: usize, recv: usize, count: usize, rank: Rank) -> bool {
        let block = count.saturating_mul(self.dtype.size()).saturating_mul(rank);
        match self.collective {
            Collective::AllGather => send == recv.wrapping_add(block),
            Collective::ReduceScatter => recv == send.wrapping_add(block),
            Collective::Broadcast => send == recv || self.root != Some(rank),
            // A receive writes its one buffer; a send reads its one.
            Collective::PointToPoint => matches!(self.peer, Some(Peer::From(_))),
            _ => send == recv,
        }
    }

    /// NCCL's buffer addresses as the library's buffers, on `n` ranks (this
    /// one `rank`): lengths from [`nccl_lengths`](Self::nccl_lengths), in
    /// place by [`nccl_in_place`](Self::nccl_in_place); a Reduce's receive
    /// buffer may be null off the root (then `workspace` is lent).
    ///
    /// # Safety
    /// `send` and `recv` must be valid for the lengths `count` stands for
    /// (either may be null when its length is zero) for `'a`.
    pub unsafe fn nccl_buffers<'a>(
        &self,
        rank: Rank,
        n: usize,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        workspace: &'a mut Vec<u64>,
    ) -> Result<crate::Buffers<'a>, String> {
        let elem = self.dtype.size();
        let (send_len, recv_len) = (self.nccl_lengths(count, n))
            .and_then(|(s, r)| Some((s.checked_mul(elem)?, r.checked_mul(elem)?)))
            .ok_or_else(|| format!("{}: count {count} overflows", self.collective))?;
        let in_place = self.nccl_in_place(send as usize, recv as usize, count, rank);
        let recv =
            if self.collective == Collective::Reduce && self.root != Some(rank) && recv.is_null() {
                workspace.resize(recv_len.div_ceil(8), 0u64);
                workspace.as_mut_ptr().cast()
            } else {
                recv
            };
        let null = |p: *const u8, len: usize| p.is_null() && len > 0;
        if null(send, send_len) || (null(recv, recv_len) && !in_place) {
            return Err(format!("{}: a buffer is a null pointer", self.collective));
        }
        // SAFETY: the caller vouches for both ranges; empty ones are never
        // dereferenced (a dangling pointer stands in for null).
        let slice = |p: *mut u8, len: usize| unsafe {
            let p = if len == 0 {
                std::ptr::dangling_mut()
            } else {
                p
            };
            std::slice::from_raw_parts_mut(p, len)
        };
        Ok(match (in_place, self.collective) {
            (true, Collective::ReduceScatter) => {
                crate::Buffers::InPlace(slice(send.cast_mut(), send_len))
            }
            (true, _) => crate::Buffers::InPlace(slice(recv, recv_len)),
            (false, _) => crate::Buffers::OutOfPlace {
                send: slice(send.cast_mut(), send_len),
                recv: slice(recv, recv_len),
            },
        })
    }

    /// Checks the call on `n` ranks (this one `rank`) with `input` (`None`
    /// in place) and `output`, before any byte moves. Returns the count
    /// the call's tag carries: elements of the larger buffer (AllToAllv:
    /// elements sent).
    pub fn check(
        &self,
        rank: Rank,
        n: usize,
        input: Option<&[u8]>,
        output: &[u8],
    ) -> Result<u64, String> {
        let (collective, dtype, elem) = (self.collective, self.dtype, self.dtype.size());
        // Element sizes are powers of two: masks, not divisions (every
        // call is checked; a division costs a tenth of a call of nothing).
        let whole = |bytes: usize| bytes & (elem - 1) == 0;
        self.check_roles(rank, n, input.is_some())?;
        for b in input.into_iter().chain([output]) {
            if !whole(b.len()) {
                return Err(format!(
                    "{collective}: {} bytes is not a whole number of {dtype} elements",
                    b.len()
                ));
            }
            if !b.is_empty() && !whole(b.as_ptr() as usize) {
                return Err(format!(
                    "{collective}: buffer at {:p} is not aligned for {dtype}",
                    b.as_ptr()
                ));
            }
        }
        let count = match &self.counts {
            Some(c) => {
                let send = input.ok_or(format!(
                    "{collective} runs out of place only (send and receive blocks differ)"
                ))?;
                c.check(rank, n, send.len() / elem, output.len() / elem)
                    .map_err(|e| format!("{collective}: {e}"))?;
                c.total_sent()
            }
            None if collective == Collective::AllToAllV => {
                return Err(format!("{collective} needs per-peer counts"))
            }
            None => self.check_uniform(n, input, output)?,
        };
        if count as u64 > crate::CallDesc::MAX_COUNT {
            return Err(format!("{collective}: {count} elements is too many"));
        }
        Ok(count as u64)
    }

    /// Whether the call moves nothing: a collective of fixed shape whose
    /// buffers are empty. It returns at once, as in NCCL and MPI, after
    /// `check_roles` (every other check passes empty buffers); barriers,
    /// point-to-point and AllToAllv (whose peers may expect blocks) always run.
    #[inline(always)]
    pub(crate) fn moves_nothing(&self, input_len: Option<usize>, output_len: usize) -> bool {
        output_len == 0
            && input_len.is_none_or(|l| l == 0)
            && !matches!(
                self.collective,
                Collective::Barrier | Collective::PointToPoint | Collective::AllToAllV
            )
    }

    /// The checks that do not look at the buffers: op, root and peer, for
    /// a call with a send buffer (`out_of_place`) or without.
    #[inline]
    pub(crate) fn check_roles(
        &self,
        rank: Rank,
        n: usize,
        out_of_place: bool,
    ) -> Result<(), String> {
        // The common case in a few compares, inlined into every call; the
        // rest (point-to-point, errors) is out of line.
        let collective = self.collective;
        let root_fits = match self.root {
            Some(root) => collective.rooted() && root < n,
            None => !collective.rooted(),
        };
        if collective.reduces() == self.op.is_some()
            && root_fits
            && self.peer.is_none()
            && collective != Collective::PointToPoint
        {
            return Ok(());
        }
        self.diagnose_roles(rank, n, out_of_place)
    }

    /// [`check_roles`](Self::check_roles) in full: which check fails, if any.
    #[inline(never)]
    fn diagnose_roles(&self, rank: Rank, n: usize, out_of_place: bool) -> Result<(), String> {
        let collective = self.collective;
        if collective.reduces() != self.op.is_some() {
            let need = if self.op.is_some() {
                "not used here"
            } else {
                "needed"
            };
            return Err(format!("{collective}: a reduction op is {need}"));
        }
        match self.root {
            Some(_) if !collective.rooted() => Err(format!("{collective} has no root")),
            Some(root) if root >= n => Err(format!(
                "{collective}: root {root} is not a rank of the {n}"
            )),
            None if collective.rooted() => Err(format!("{collective} needs a root")),
            _ => self.check_peer(rank, n, out_of_place),
        }
    }

    fn check_peer(&self, rank: Rank, n: usize, out_of_place: bool) -> Result<(), String> {
        let collective = self.collective;
        match (collective, self.peer) {
            (Collective::PointToPoint, None) => Err("send/recv needs a peer".into()),
            (Collective::PointToPoint, Some(p)) if p.rank() >= n => {
                Err(format!("peer {} is not a rank of the {n}", p.rank()))
            }
            (Collective::PointToPoint, Some(p)) if p.rank() == rank => Err(format!(
                "rank {rank} cannot send to or receive from itself outside a group"
            )),
            (Collective::PointToPoint, Some(Peer::To(_))) if !out_of_place => {
                Err("send: no send buffer".into())
            }
            (Collective::PointToPoint, Some(Peer::From(_))) if out_of_place => {
                Err("recv: a send buffer is not used here".into())
            }
            (Collective::PointToPoint, _) => Ok(()),
            (_, Some(_)) => Err(format!("{collective} has no peer")),
            (_, None) => Ok(()),
        }
    }

    /// Same-shape collectives: returns elements of the larger buffer.
    fn check_uniform(
        &self,
        n: usize,
        input: Option<&[u8]>,
        output: &[u8],
    ) -> Result<usize, String> {
        let (collective, shift) = (self.collective, self.dtype.size().trailing_zeros());
        if collective == Collective::PointToPoint {
            return Ok(input.map_or(output.len(), <[u8]>::len) >> shift);
        }
        // The one buffer of an in-place call, or the send buffer's length
        // relative to the receive buffer's.
        let (smaller, factor) = match collective {
            Collective::ReduceScatter => (input.map(|_| output.len()), n),
            Collective::AllGather => (input.map(<[u8]>::len), n),
            _ => (input.map(<[u8]>::len), 1),
        };
        let larger = input.map_or(output.len(), |i| i.len().max(output.len()));
        if let (Some(input), Some(smaller)) = (input, smaller) {
            if smaller * factor != larger || input.len().min(output.len()) != smaller {
                let rule = match factor {
                    1 => "equal".to_string(),
                    _ => format!("the larger {n} times the smaller (one block per rank)"),
                };
                return Err(format!(
                    "{collective}: send buffer has {} bytes, receive buffer {}; they must be {rule}",
                    input.len(),
                    output.len()
                ));
            }
        }
        let count = larger >> shift;
        if collective.blocks() && count % n != 0 {
            return Err(format!(
                "{collective}: count {count} is not divisible by the {n} ranks (one block per rank)",
            ));
        }
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_role_check_agrees_with_the_full_one() {
        let all = Collective::ALL
            .into_iter()
            .chain([Collective::PointToPoint]);
        let peers = [None, Some(Peer::To(1)), Some(Peer::From(1))];
        let peers = peers
            .into_iter()
            .chain([Some(Peer::To(0)), Some(Peer::To(4))]);
        let peers: Vec<_> = peers.collect();
        let mut accepted = 0;
        for collective in all {
            for op in [None, Some(ReduceOp::Sum)] {
                for root in [None, Some(0), Some(3), Some(4)] {
                    for &peer in &peers {
                        let args = CallArgs {
                            op,
                            root,
                            peer,
                            ..CallArgs::new(collective, DataType::F32)
                        };
                        for out_of_place in [false, true] {
                            let fast = args.check_roles(0, 4, out_of_place);
                            let full = args.diagnose_roles(0, 4, out_of_place);
                            assert_eq!(fast, full, "{args:?}, out of place {out_of_place}");
                            accepted += fast.is_ok() as usize;
                        }
                    }
                }
            }
        }
        // Each of the 8 collectives in one valid shape (root 0 or 3 when
        // rooted), both modes; a send to 1 out of place, a recv from 1 in place.
        assert_eq!(accepted, 6 * 2 + 2 * 2 * 2 + 2);
    }

    #[test]
    fn var_counts_are_checked() {
        let c = VarCounts::packed(&[1, 0, 2], &[2, 2, 0]);
        assert_eq!(c.send_displs, [0, 1, 1]);
        assert_eq!(c.recv_displs, [0, 2, 4]);
        assert!(c.check(2, 3, 3, 4).unwrap_err().contains("sends itself 2"));
        assert!(c.check(1, 3, 3, 4).is_err());
        let c = VarCounts::packed(&[1, 2, 2], &[2, 2, 0]);
        assert!(c.check(1, 3, 5, 4).is_ok());
        assert!(c.check(1, 3, 4, 4).unwrap_err().contains("send block 2"));
        assert!(c
            .check(1, 2, 5, 4)
            .unwrap_err()
            .contains("3 entries for 2 ranks"));
        let overlapping = VarCounts {
            recv_displs: vec![0, 1, 4],
            ..c.clone()
        };
        assert!(overlapping
            .check(1, 3, 5, 5)
            .unwrap_err()
            .contains("ranks 0 and 1 overlap"));
    }

    #[test]
    fn nccl_lengths_and_in_place() {
        let ag = CallArgs::new(Collective::AllGather, DataType::F32);
        assert_eq!(ag.nccl_lengths(10, 4), Some((10, 40)));
        assert!(ag.nccl_in_place(1000 + 2 * 40, 1000, 10, 2));
        assert!(!ag.nccl_in_place(1000, 1000, 10, 2));
        let rs = CallArgs::new(Collective::ReduceScatter, DataType::F64).op(ReduceOp::Sum);
        assert_eq!(rs.nccl_lengths(3, 2), Some((6, 3)));
        assert!(rs.nccl_in_place(64, 64 + 24, 3, 1));
        assert_eq!(
            CallArgs::new(Collective::AllToAll, DataType::U8).nccl_lengths(usize::MAX, 2),
            None
        );
        let send = CallArgs::send_to(DataType::U8, 1);
        assert_eq!(send.nccl_lengths(5, 4), Some((5, 0)));
    }

    #[test]
    fn shapes_are_checked() {
        let ar = CallArgs::new(Collective::AllReduce, DataType::F32);
        let (a, mut b) = ([0u32; 4], [0u32; 3]);
        let (a, b) = (bytemuck::cast_slice(&a), bytemuck::cast_slice_mut(&mut b));
        assert!(ar
            .check(0, 2, Some(a), b)
            .unwrap_err()
            .contains("op is needed"));
        let ar = ar.op(ReduceOp::Sum);
        assert!(ar
            .check(0, 2, Some(a), b)
            .unwrap_err()
            .contains("must be equal"));
        assert_eq!(ar.check(0, 2, None, b), Ok(3));
        let p2p = CallArgs::send_to(DataType::F32, 0);
        assert!(p2p
            .check(0, 2, Some(a), &[])
            .unwrap_err()
            .contains("itself"));
        assert_eq!(
            CallArgs::send_to(DataType::F32, 1).check(0, 2, Some(a), &[]),
            Ok(4)
        );
    }
}
