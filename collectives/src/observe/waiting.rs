//! What an unfinished call waits on: the fact that errors, dumps and the
//! status port report.

use transport::Rank;

/// The step an unfinished execution waits on, for errors and diagnostics.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Waiting {
    pub peer: Rank,
    pub send: bool,
    /// 1-based position of the step in its queue, and the queue's length.
    pub index: usize,
    pub of: usize,
    pub bytes: usize,
}
