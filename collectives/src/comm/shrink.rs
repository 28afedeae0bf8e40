//! Going on without failed ranks: agreeing on who failed
//! ([`Communicator::failed_ranks`]) and building a communicator of the
//! survivors ([`Communicator::shrink`]), as `ncclCommShrink` and ULFM's
//! `MPIX_Comm_shrink` do. Both run over the status channel
//! ([`crate::fault::agree`]), so they work on a communicator that failed or was
//! aborted; no launcher or rendezvous is involved, and every wait is
//! bounded by the communicator's timeout.
//!
//! A split child, or an [`AsyncCommunicator`](crate::AsyncCommunicator)'s
//! communicator, is a communicator like any other: when a member dies it
//! fails too and is shrunk on its own; shrinking a parent leaves its
//! children as they are.

use std::collections::BTreeSet;
use std::time::Instant;

use crate::bootstrap::derive_token;
use crate::bootstrap::mesh;
use crate::bootstrap::rendezvous::{PeerInfo, Table};
use crate::comm::Setup;
use crate::fault::agree;
use crate::{Communicator, Error, Rank, Result};

impl Communicator {
    /// The ranks that failed, the same set on every survivor: each
    /// survivor must call it (as with collectives, in the same order among
    /// its agreement calls). A rank counts as failed when its process is
    /// gone, its communicator was destroyed, or it does not answer within
    /// 2 s (a rank no connection gets through to: when that lasted 10 s).
    /// Works on a communicator that failed or was aborted.
    pub fn failed_ranks(&mut self) -> Result<Vec<Rank>> {
        let k = self.next_agreement();
        let deadline = Instant::now() + self.config.timeout;
        self.agree(k, BTreeSet::new(), None, deadline)
            .map(|o| o.failed)
    }

    /// A communicator of the ranks not in `excluded` and not failed,
    /// renumbered in order (as `ncclCommShrink`): every survivor calls it.
    /// The ranks excluded are those of `excluded` plus any the survivors
    /// agree failed meanwhile (then a warning says so; compare the new
    /// size). `abort_first` aborts what is in flight on this communicator
    /// first (`COLL_SHRINK_ABORT`). The new communicator has this one's
    /// settings and connections of its own. If a rank dies during the
    /// shrink, it fails: agree ([`failed_ranks`](Self::failed_ranks)) and
    /// shrink this communicator again.
    pub fn shrink(&mut self, excluded: &[Rank], abort_first: bool) -> Result<Communicator> {
        let rank = self.rank;
        let fail = |message: String| Error::Bootstrap {
            rank,
            message: format!("shrink: {message}"),
        };
        if let Some(bad) = excluded.iter().find(|r| **r >= self.size || **r == rank) {
            return Err(Error::InvalidArgument {
                rank,
                message: format!(
                    "shrink: cannot exclude rank {bad} (this is rank {rank} of {}; excluded ranks do not call shrink)",
                    self.size
                ),
            });
        }
        if abort_first {
            self.abort("shrinking the communicator");
        }
        let k = self.next_agreement();
        let started = Instant::now();
        let deadline = started + self.config.timeout;
        let (listeners, addresses) = super::listen(&self.links.available).map_err(fail)?;
        let wanted: BTreeSet<Rank> = excluded.iter().copied().collect();
        let outcome = self.agree(k, wanted.clone(), Some(addresses), deadline)?;
        let gone: BTreeSet<Rank> = outcome.failed.iter().copied().collect();
        if gone != wanted {
            tracing::warn!(
                rank,
                "shrink: excluding rank(s) {:?}, not only {:?}: the survivors agreed these failed",
                gone,
                wanted
            );
        }
        let survivors: Vec<Rank> = (0..self.size).filter(|r| !gone.contains(r)).collect();
        let mut peers = Vec::with_capacity(survivors.len());
        for (new, &old) in survivors.iter().enumerate() {
            let addresses = (outcome.payloads[old].clone())
                .ok_or_else(|| fail(format!("rank {old} published no addresses")))?;
            peers.push(PeerInfo {
                rank: new,
                addresses,
                ..self.job.peers[old].clone()
            });
        }
        let new_rank = survivors.iter().position(|r| *r == rank).unwrap();
        tracing::info!(rank, new_rank, size = survivors.len(), excluded = ?gone, "shrink");
        let mut shrunk = Communicator::connect(Setup {
            rank: new_rank,
            table: Table {
                session: derive_token(self.ids.session, &format!("shrink {k}")),
                peers,
            },
            available: self.links.available.clone(),
            listeners,
            config: self.config.clone(),
            deadline,
            started,
            local_rank_hint: None,
            source: "shrink",
        })?;
        // Everyone connected: a rank that died meanwhile fails this here,
        // on every survivor, rather than the caller's first call on some.
        shrunk.barrier()?;
        Ok(shrunk)
    }

    fn next_agreement(&mut self) -> u32 {
        self.ids.agreements += 1;
        self.ids.agreements
    }

    fn agree(
        &self,
        k: u32,
        known: BTreeSet<Rank>,
        payload: Option<mesh::Addresses>,
        deadline: Instant,
    ) -> Result<agree::Outcome> {
        let addresses = self.status_addresses();
        let members = agree::Members {
            me: self.rank,
            addresses: &addresses,
            session: self.ids.session,
            board: &self.recorder.board,
        };
        agree::agree(&members, k, known, payload, deadline).map_err(|message| Error::Bootstrap {
            rank: self.rank,
            message: format!("agreement #{k} on the failed ranks: {message}"),
        })
    }
}
