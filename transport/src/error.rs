//! Transport errors. Each names the peer rank it concerns, so the collectives
//! layer only has to add the local rank, the operation and its sequence number.

use std::io;
use std::time::Duration;

use crate::{Rank, Tag};

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A transport failure. Cloneable because a failed connection keeps returning
/// the error that broke it.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    /// A system call failed.
    #[error("{what} {}: {message}", peer_text(*.peer))]
    Io {
        peer: Option<Rank>,
        what: &'static str,
        kind: io::ErrorKind,
        message: String,
    },

    /// The peer closed the connection without a word: its process exited or
    /// was killed. (Gloo's phrase, "Connection closed by peer", which torch's
    /// and torchft's tooling match.)
    #[error("Connection closed by peer rank {peer} (its process exited or was killed)")]
    Closed { peer: Rank },

    /// The peer gave up on the operation and said why.
    /// (Its connections close as it leaves: Gloo's phrase for that too.)
    #[error("peer rank {peer} aborted (Connection closed by peer): {reason}")]
    PeerAborted { peer: Rank, reason: String },

    /// We gave up on the connection ourselves (see [`crate::Connection::abort`]).
    #[error("connection to peer rank {peer} was aborted: {reason}")]
    Aborted { peer: Rank, reason: String },

    /// Nothing arrived from the peer before the deadline. (Gloo's phrase,
    /// "Timed out waiting", which torch's and torchft's tooling match.)
    #[error("Timed out waiting {:.1}s for peer rank {peer} ({waiting_for})", waited.as_secs_f64())]
    Timeout {
        peer: Rank,
        waited: Duration,
        waiting_for: String,
    },

    /// The peer sent a message other than the one posted for: the ranks
    /// disagree on the operation, its size or its order.
    #[error("peer rank {peer} sent {got_len} bytes with tag {got_tag:#x} where {expected_len} bytes with tag {expected_tag:#x} were expected")]
    Mismatch {
        peer: Rank,
        expected_tag: Tag,
        expected_len: usize,
        got_tag: Tag,
        got_len: usize,
    },

    /// Bad arguments or a bad address blob; a bug or a misconfiguration.
    #[error("{0}")]
    Invalid(String),
}

fn peer_text(peer: Option<Rank>) -> String {
    match peer {
        Some(p) => format!("(peer rank {p})"),
        None => String::new(),
    }
}

impl Error {
    pub(crate) fn io(peer: Option<Rank>, what: &'static str, e: &io::Error) -> Self {
        Error::Io {
            peer,
            what,
            kind: e.kind(),
            message: e.to_string(),
        }
    }

    /// The peer this error concerns, if any.
    pub fn peer(&self) -> Option<Rank> {
        match self {
            Error::Io { peer, .. } => *peer,
            Error::Closed { peer }
            | Error::PeerAborted { peer, .. }
            | Error::Aborted { peer, .. }
            | Error::Timeout { peer, .. }
            | Error::Mismatch { peer, .. } => Some(*peer),
            Error::Invalid(_) => None,
        }
    }
}
