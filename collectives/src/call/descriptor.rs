//! What one call is, packed into the [`Tag`] every message of the call
//! carries, so that ranks disagreeing on the collective, datatype, count,
//! reduction, root, call order or communicator get a precise error instead
//! of a wrong result.

use std::fmt;

use transport::Tag;

use crate::{DataType, ReduceOp};

/// The calls this library runs: the collectives, and point-to-point
/// messages (`send`/`recv`), which are not in [`ALL`](Self::ALL).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Collective {
    AllReduce = 1,
    AllToAll,
    Barrier,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
    /// AllToAll with a count per pair of ranks (`MPI_Alltoallv`).
    AllToAllV,
    /// A `send` matched by a `recv`.
    PointToPoint,
}

impl Collective {
    /// The collectives (every rank takes part), each with algorithms.
    pub const ALL: [Collective; 8] = [
        Collective::AllReduce,
        Collective::AllToAll,
        Collective::Barrier,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::AllToAllV,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::AllToAll => "alltoall",
            Collective::Barrier => "barrier",
            Collective::ReduceScatter => "reducescatter",
            Collective::AllGather => "allgather",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::AllToAllV => "alltoallv",
            Collective::PointToPoint => "send/recv",
        }
    }

    /// Whether it combines values with a [`ReduceOp`].
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        )
    }

    /// Whether it has a root rank.
    pub const fn rooted(self) -> bool {
        matches!(self, Collective::Broadcast | Collective::Reduce)
    }

    /// nccl-tests' bus bandwidth factor on `n` ranks: busbw = algbw x factor,
    /// the fraction of the data each rank's link must carry.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllToAll
            | Collective::AllToAllV
            | Collective::ReduceScatter
            | Collective::AllGather => (n - 1.0) / n,
            Collective::Broadcast
            | Collective::Reduce
            | Collective::Barrier
            | Collective::PointToPoint => 1.0,
        }
    }

    /// Whether the buffer is cut into one block per rank.
    pub const fn blocks(self) -> bool {
        matches!(
            self,
            Collective::AllToAll | Collective::ReduceScatter | Collective::AllGather
        )
    }

    fn from_u8(v: u8) -> Option<Self> {
        (Self::ALL.into_iter())
            .chain([Collective::PointToPoint])
            .find(|c| *c as u8 == v)
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One call: which collective, on what, and its sequence number on the
/// communicator (for point-to-point: on the pair of ranks, per direction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallDesc {
    pub collective: Collective,
    pub dtype: DataType,
    pub op: Option<ReduceOp>,
    /// Elements of the larger of a rank's buffers (the whole gathered or
    /// scattered buffer for allgather and reducescatter, as nccl-tests counts).
    pub count: u64,
    /// The root of broadcast and reduce.
    pub root: Option<u16>,
    /// Calls made on this communicator before this one.
    pub seq: u32,
    /// The communicator's identity, hashed to a byte (see
    /// [`Communicator::split`](crate::Communicator::split)).
    pub comm: u8,
}

impl CallDesc {
    /// Counts above this do not fit a tag (no buffer comes near).
    pub const MAX_COUNT: u64 = (1 << 47) - 1;

    /// Layout: count (47 bits) | has root (1) | root (16) | seq (32) |
    /// collective (8) | dtype (8) | op (8) | comm (8).
    pub fn tag(&self) -> Tag {
        ((self.count & Self::MAX_COUNT) as u128)
            | (self.root.map_or(0, |_| 1u128) << 47)
            | (self.root.unwrap_or(0) as u128) << 48
            | (self.seq as u128) << 64
            | (self.collective as u128) << 96
            | (self.dtype as u128) << 104
            | (self.op.map_or(0, |o| o as u8) as u128) << 112
            | (self.comm as u128) << 120
    }

    /// Inverse of [`tag`](Self::tag); `None` for bytes that are not a tag of ours.
    pub fn from_tag(tag: Tag) -> Option<Self> {
        let byte = |shift: u32| (tag >> shift) as u8;
        let op = match byte(112) {
            0 => None,
            v => Some(ReduceOp::from_u8(v)?),
        };
        Some(CallDesc {
            comm: byte(120),
            count: tag as u64 & Self::MAX_COUNT,
            root: ((tag >> 47) & 1 == 1).then_some((tag >> 48) as u16),
            seq: (tag >> 64) as u32,
            collective: Collective::from_u8(byte(96))?,
            dtype: DataType::from_u8(byte(104))?,
            op,
        })
    }
}

impl fmt::Display for CallDesc {
    /// `allreduce #5 (1000 x f32, sum)`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.collective, self.seq)?;
        if self.collective != Collective::Barrier {
            write!(f, " ({} x {}", self.count, self.dtype)?;
            if let Some(op) = self.op {
                write!(f, ", {op}")?;
            }
            if let Some(root) = self.root {
                write!(f, ", root {root}")?;
            }
            write!(f, ")")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_differ() {
        let a = CallDesc {
            collective: Collective::AllReduce,
            dtype: DataType::Bf16,
            op: Some(ReduceOp::Avg),
            count: CallDesc::MAX_COUNT - 3,
            root: None,
            seq: 77,
            comm: 9,
        };
        assert_eq!(CallDesc::from_tag(a.tag()), Some(a));
        let b = CallDesc {
            op: None,
            collective: Collective::AllToAll,
            ..a
        };
        assert_eq!(CallDesc::from_tag(b.tag()), Some(b));
        let c = CallDesc {
            collective: Collective::Broadcast,
            root: Some(65535),
            ..b
        };
        assert_eq!(CallDesc::from_tag(c.tag()), Some(c));
        assert_ne!(c.tag(), CallDesc { root: Some(0), ..c }.tag());
        assert_ne!(
            CallDesc { root: Some(0), ..c }.tag(),
            CallDesc { root: None, ..c }.tag()
        );
        assert_ne!(a.tag(), CallDesc { count: 1, ..a }.tag());
        assert_ne!(
            a.tag(),
            CallDesc {
                dtype: DataType::F16,
                ..a
            }
            .tag()
        );
        assert_ne!(a.tag(), CallDesc { comm: 10, ..a }.tag());
        assert_eq!(a.to_string(), "allreduce #77 (140737488355324 x bf16, avg)");
        assert_eq!(CallDesc::from_tag(0), None);
    }
}
