//! Seeing what a rank does and where it is: the flight `recorder` (the
//! last calls, dumped when a call fails), the Chrome-trace `timeline`, what
//! an unfinished call waits on, and the [`status`] port that answers "where
//! are you" from other ranks (the root cause of a timeout) and, for the
//! agreement on failed ranks, this rank's `ballot`.
//!
//! Owns: records, dumps and answers. May not touch: the executor or the
//! communicator (they call in; it never calls out), and it never decides
//! anything: the agreement's protocol is in `crate::fault`.

pub(crate) mod ballot;
pub(crate) mod recorder;
pub mod status;
pub(crate) mod timeline;
pub(crate) mod waiting;
