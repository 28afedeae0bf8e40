//! Setting up the flag path ([`crate::tiny`]) when a communicator is made:
//! the ranks of a host agree to use it, or none does.

use crate::tiny::{State as TinyState, Tiny};
use crate::{Communicator, ReduceOp, Result};

impl Communicator {
    /// Every rank creates its segment and opens the others'; on only if
    /// all could. Every rank calls this once, when the communicator is made.
    pub(crate) fn set_up_tiny(&mut self) -> Result<()> {
        if !matches!(self.tiny, TinyState::Untried) {
            return Ok(());
        }
        let max = self.config.tiny_bytes;
        // The calls below take the general path, and leave the numbering of
        // the caller's calls alone (every rank makes both, and each
        // connection delivers in order: no message of theirs can be taken
        // for one of a later call #0 or #1).
        self.tiny = TinyState::Off;
        let seq = self.ids.seq;
        let created = Tiny::create(max, self.ids.session, self.rank);
        let mine = created.as_ref().map_or([0, 0], |(_, id)| *id);
        let mut ids = vec![0u64; 2 * self.size];
        self.all_gather(&mine, &mut ids)?;
        let ids: Vec<[u64; 2]> = ids.chunks(2).map(|c| [c[0], c[1]]).collect();
        let opened =
            created.and_then(|(fd, _)| Tiny::open(self.rank, fd, &ids, max, self.ids.session));
        if let Err(e) = &opened {
            match e.kind() {
                // A segment that is not what its rank said: worth a warning.
                std::io::ErrorKind::InvalidData => {
                    tracing::warn!(rank = self.rank, "COLL_TINY: no flag path: {e}")
                }
                _ => tracing::info!(rank = self.rank, "COLL_TINY: no flag path: {e}"),
            }
        }
        let mut all = [u64::from(opened.is_ok())];
        self.all_reduce_in_place(&mut all, ReduceOp::Min)?;
        self.ids.seq = seq;
        if let (Ok(t), 1) = (opened, all[0]) {
            tracing::debug!(
                rank = self.rank,
                "COLL_TINY: collectives up to {max} B and barriers go through shared flags"
            );
            self.tiny = TinyState::On(Box::new(t));
        }
        Ok(())
    }
}
