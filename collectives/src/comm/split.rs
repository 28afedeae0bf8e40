//! Splitting a communicator (`MPI_Comm_split`, `ncclCommSplit`): ranks
//! that give the same color form a child communicator, ordered by key. The
//! parent is the rendezvous: every rank opens fresh listeners, the ranks
//! all-gather (color, key, addresses) over the parent, and each color's
//! members connect among themselves with a token derived from the parent's,
//! through the second half of [`Communicator::init`]. Children have
//! connections of their own, so a parent and its children can be used at
//! once, from different threads, without their messages meeting.

use std::time::Instant;

use crate::bootstrap::derive_token;
use crate::bootstrap::rendezvous::{PeerInfo, Table};
use crate::comm::Setup;
use crate::{Communicator, Error, ReduceOp, Result};
use serde::{Deserialize, Serialize};

/// What each rank contributes to a split.
#[derive(Serialize, Deserialize)]
struct Entry {
    color: Option<u32>,
    key: i64,
    info: PeerInfo,
}

impl Communicator {
    /// Splits this communicator: every rank must call it (in the same
    /// order among its other calls). Ranks with the same `color` form a
    /// new communicator, ranked by `key` then by rank here; `None` opts
    /// out and returns `Ok(None)`. The new communicator has the settings
    /// of this one and its own connections.
    pub fn split(&mut self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let rank = self.rank();
        let started = Instant::now();
        let fail = |message: String| Error::Bootstrap {
            rank,
            message: format!("split: {message}"),
        };
        let (listeners, addresses) = super::listen(&self.links.available).map_err(fail)?;
        let me = Entry {
            color,
            key,
            info: PeerInfo::new(rank, addresses, self.config.shared_settings()),
        };
        let entries = self.all_gather_json(&me)?;
        let salt = format!("split {} color {color:?}", self.ids.splits);
        self.ids.splits += 1;
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<&Entry> = (entries.iter())
            .filter(|e| e.color == Some(color))
            .collect();
        members.sort_by_key(|e| (e.key, e.info.rank));
        let new_rank = (members.iter())
            .position(|e| e.info.rank == rank)
            .expect("this rank is a member of its color");
        let peers = (members.iter().enumerate())
            .map(|(r, e)| PeerInfo {
                rank: r,
                ..e.info.clone()
            })
            .collect();
        let table = Table {
            session: derive_token(self.ids.session, &salt),
            peers,
        };
        tracing::info!(rank, color, new_rank, size = members.len(), "split");
        Communicator::connect(Setup {
            rank: new_rank,
            table,
            available: self.links.available.clone(),
            listeners,
            config: self.config.clone(),
            deadline: Instant::now() + self.config.timeout,
            started,
            local_rank_hint: None,
            source: "split",
        })
        .map(Some)
    }

    /// Every rank's `value`, by rank, through this communicator: the
    /// longest encoding's length first, then an all-gather of padded blocks.
    fn all_gather_json<T: Serialize + for<'de> Deserialize<'de>>(
        &mut self,
        value: &T,
    ) -> Result<Vec<T>> {
        let mine = serde_json::to_vec(value).expect("plain data serializes");
        let mut longest = [mine.len() as u64];
        self.all_reduce_in_place(&mut longest, ReduceOp::Max)?;
        let block = longest[0] as usize;
        let mut padded = mine;
        padded.resize(block, b' ');
        let mut all = vec![0u8; block * self.size()];
        self.all_gather(&padded, &mut all)?;
        all.chunks(block.max(1))
            .take(self.size())
            .enumerate()
            .map(|(r, b)| {
                serde_json::from_slice(b).map_err(|e| Error::Bootstrap {
                    rank: self.rank(),
                    message: format!("split: rank {r}'s entry is unreadable: {e}"),
                })
            })
            .collect()
    }
}
