//! Errors of the collectives layer. Each names the local rank; failures of a
//! collective also name the operation with its sequence number and the peer.

use transport::Rank;

use crate::descriptor::OpDesc;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Finding the other ranks failed: bad environment, unreachable
    /// rendezvous, a rank that never arrived.
    #[error("rank {rank}: bootstrap failed: {message}")]
    Bootstrap { rank: Rank, message: String },

    /// A collective failed; `source` names the peer.
    #[error("rank {rank}: {op} failed: {source}")]
    Collective {
        rank: Rank,
        op: OpDesc,
        #[source]
        source: transport::Error,
    },

    /// A peer called a different operation than this rank.
    #[error("rank {rank}: {ours} failed: peer rank {peer} is in {theirs}: the ranks disagree on the operation, its count, datatype or reduction, or on the order of calls")]
    Mismatch {
        rank: Rank,
        peer: Rank,
        ours: OpDesc,
        theirs: String,
    },

    /// The caller's arguments cannot work (checked before any byte moves).
    #[error("rank {rank}: {message}")]
    InvalidArgument { rank: Rank, message: String },

    /// An earlier failure left the communicator unusable.
    #[error("rank {rank}: the communicator was aborted by an earlier failure ({reason}); create a new one")]
    Aborted { rank: Rank, reason: String },
}

impl Error {
    /// Turns a transport failure during `op` into the error users see.
    pub(crate) fn collective(rank: Rank, op: OpDesc, source: transport::Error) -> Self {
        match source {
            transport::Error::Mismatch {
                peer,
                got_tag,
                got_len,
                expected_len,
                ..
            } => Error::Mismatch {
                rank,
                peer,
                ours: op,
                theirs: match OpDesc::from_tag(got_tag) {
                    Some(t) if t.tag() != op.tag() => t.to_string(),
                    _ => format!("the same operation but a message of {got_len} bytes where {expected_len} were expected"),
                },
            },
            source => Error::Collective { rank, op, source },
        }
    }
}
