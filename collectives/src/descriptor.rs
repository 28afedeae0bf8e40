//! What one collective call is, packed into the [`Tag`] every message of the
//! call carries, so that ranks disagreeing on the operation, datatype, count,
//! reduction or call order get a precise error instead of a wrong result.

use std::fmt;

use transport::Tag;

use crate::{DataType, ReduceOp};

/// The collectives this library runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Collective {
    AllReduce = 1,
    AllToAll,
    Barrier,
}

impl Collective {
    pub const ALL: [Collective; 3] = [
        Collective::AllReduce,
        Collective::AllToAll,
        Collective::Barrier,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::AllToAll => "alltoall",
            Collective::Barrier => "barrier",
        }
    }

    fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|c| *c as u8 == v)
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One call: which collective, on what, and its sequence number on the communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpDesc {
    pub collective: Collective,
    pub dtype: DataType,
    pub op: Option<ReduceOp>,
    /// Elements per rank's buffer, as the caller passed it.
    pub count: u64,
    /// Calls made on this communicator before this one.
    pub seq: u32,
}

impl OpDesc {
    /// Layout: count (64 bits) | seq (32) | collective (8) | dtype (8) | op (8) | 0 (8).
    pub fn tag(&self) -> Tag {
        (self.count as u128)
            | (self.seq as u128) << 64
            | (self.collective as u128) << 96
            | (self.dtype as u128) << 104
            | (self.op.map_or(0, |o| o as u8) as u128) << 112
    }

    /// Inverse of [`tag`](Self::tag); `None` for bytes that are not a tag of ours.
    pub fn from_tag(tag: Tag) -> Option<Self> {
        let byte = |shift: u32| (tag >> shift) as u8;
        let op = match byte(112) {
            0 => None,
            v => Some(ReduceOp::from_u8(v)?),
        };
        Some(OpDesc {
            count: tag as u64,
            seq: (tag >> 64) as u32,
            collective: Collective::from_u8(byte(96))?,
            dtype: DataType::from_u8(byte(104))?,
            op,
        })
    }
}

impl fmt::Display for OpDesc {
    /// `allreduce #5 (1000 x f32, sum)`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.collective, self.seq)?;
        if self.collective != Collective::Barrier {
            write!(f, " ({} x {}", self.count, self.dtype)?;
            if let Some(op) = self.op {
                write!(f, ", {op}")?;
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
        let a = OpDesc {
            collective: Collective::AllReduce,
            dtype: DataType::Bf16,
            op: Some(ReduceOp::Avg),
            count: u64::MAX - 3,
            seq: 77,
        };
        assert_eq!(OpDesc::from_tag(a.tag()), Some(a));
        let b = OpDesc {
            op: None,
            collective: Collective::AllToAll,
            ..a
        };
        assert_eq!(OpDesc::from_tag(b.tag()), Some(b));
        assert_ne!(a.tag(), OpDesc { count: 1, ..a }.tag());
        assert_ne!(
            a.tag(),
            OpDesc {
                dtype: DataType::F16,
                ..a
            }
            .tag()
        );
        assert_eq!(
            a.to_string(),
            "allreduce #77 (18446744073709551612 x bf16, avg)"
        );
        assert_eq!(OpDesc::from_tag(0), None);
    }
}
