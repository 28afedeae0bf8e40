//! Errors of the collectives layer. Each names the local rank; failures of a
//! call also name the call with its sequence number and the peer. Bindings
//! map errors by [`Error::kind`], never by their text.

use transport::Rank;

use crate::call::descriptor::CallDesc;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Finding the other ranks failed: bad environment, unreachable
    /// rendezvous, a rank that never arrived.
    #[error("rank {rank}: bootstrap failed: {message}")]
    Bootstrap { rank: Rank, message: String },

    /// A call failed; `source` names the peer.
    #[error("rank {rank}: {op} failed: {source}")]
    Collective {
        rank: Rank,
        op: CallDesc,
        #[source]
        source: transport::Error,
    },

    /// A call saw no progress for the timeout; the ranks were asked where
    /// each is, and `cause` says who is at fault.
    #[error("rank {rank}: {op} failed: {source}; root cause: {cause}")]
    Stalled {
        rank: Rank,
        op: CallDesc,
        #[source]
        source: Box<transport::Error>,
        cause: String,
    },

    /// A peer called a different operation than this rank.
    #[error("rank {rank}: {ours} failed: peer rank {peer} is in {theirs}: the ranks disagree on the operation, its count, datatype or reduction, or on the order of calls")]
    Mismatch {
        rank: Rank,
        peer: Rank,
        ours: CallDesc,
        theirs: String,
    },

    /// The caller's arguments cannot work (checked before any byte moves).
    #[error("rank {rank}: {message}")]
    InvalidArgument { rank: Rank, message: String },

    /// The communicator was aborted, on request or by an earlier failure.
    #[error("rank {rank}: the communicator was aborted ({reason}); create a new one")]
    Aborted { rank: Rank, reason: String },
}

/// What kind of failure an [`Error`] is, for callers that react to kinds
/// (the C ABI's result codes, the Python exception classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Bad arguments; nothing moved, the communicator is still usable.
    InvalidArgument,
    /// The ranks disagree on a call (count, datatype, reduction, root, order).
    Mismatch,
    /// A peer died, closed its connection or aborted.
    Remote,
    /// Nothing moved for the timeout.
    Timeout,
    /// This communicator was aborted.
    Aborted,
    /// The system refused something: rendezvous, sockets, memory, devices.
    System,
}

impl Error {
    /// Turns a transport failure during `op` into the error users see.
    pub(crate) fn collective(rank: Rank, op: CallDesc, source: transport::Error) -> Self {
        match source {
            transport::Error::Mismatch {
                peer,
                expected_tag,
                got_tag,
                got_len,
                expected_len,
            } => Error::Mismatch {
                rank,
                peer,
                // The message's own tag: an AllToAllv pair's or a p2p's count.
                ours: CallDesc::from_tag(expected_tag).unwrap_or(op),
                theirs: match CallDesc::from_tag(got_tag) {
                    Some(t) if t.tag() != op.tag() => t.to_string(),
                    None => format!("a message whose tag {got_tag:#x} names no call"),
                    Some(_) if got_len == expected_len => format!(
                        "the same operation but a message tagged {got_tag:#x} where {expected_tag:#x} was expected"
                    ),
                    Some(_) => format!("the same operation but a message of {got_len} bytes where {expected_len} were expected"),
                },
            },
            source => Error::Collective { rank, op, source },
        }
    }

    pub fn kind(&self) -> ErrorKind {
        use transport::Error as T;
        match self {
            Error::Bootstrap { .. } => ErrorKind::System,
            Error::InvalidArgument { .. } => ErrorKind::InvalidArgument,
            Error::Mismatch { .. } => ErrorKind::Mismatch,
            Error::Aborted { .. } => ErrorKind::Aborted,
            Error::Stalled { .. } => ErrorKind::Timeout,
            Error::Collective { source, .. } => match source {
                T::Closed { .. } | T::PeerAborted { .. } => ErrorKind::Remote,
                T::Timeout { .. } => ErrorKind::Timeout,
                T::Mismatch { .. } => ErrorKind::Mismatch,
                T::Aborted { .. } => ErrorKind::Aborted,
                T::Io { .. } | T::Invalid(_) => ErrorKind::System,
            },
        }
    }

    /// The rank this error was raised on.
    pub fn rank(&self) -> Rank {
        match self {
            Error::Bootstrap { rank, .. }
            | Error::Collective { rank, .. }
            | Error::Stalled { rank, .. }
            | Error::Mismatch { rank, .. }
            | Error::InvalidArgument { rank, .. }
            | Error::Aborted { rank, .. } => *rank,
        }
    }

    /// The peer the failure concerns, when one is known.
    pub fn peer(&self) -> Option<Rank> {
        match self {
            Error::Collective { source, .. } => source.peer(),
            Error::Stalled { source, .. } => source.peer(),
            Error::Mismatch { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}
