//! The parts of a [`Communicator`](crate::Communicator), grouped by what
//! they serve.

use std::sync::Arc;
use std::time::Instant;

use transport::{Rank, RegistrationCache, Transport};

use crate::bootstrap::connector::Connector;
use crate::bootstrap::mesh::{self, Conns, LANES};
use crate::bootstrap::rendezvous::PeerInfo;
use crate::exec::transfers::Staging;

/// Who is in the job and how each rank is reached.
pub(crate) struct Job {
    pub peers: Vec<PeerInfo>,
    /// The ranks on this rank's host.
    pub local_ranks: Vec<Rank>,
    /// The ranks of each host, in rank order.
    pub hosts: Vec<Vec<Rank>>,
    /// How each rank is reached (`None` for ourselves).
    pub via: Vec<Option<&'static str>>,
}

/// The connections, and the memory registered for them.
pub(crate) struct Links {
    /// Every transport this process offers (children of a split listen on them).
    pub available: Vec<Arc<dyn Transport>>,
    /// Transports some connection uses; buffers are registered with each.
    pub transports: Vec<Arc<dyn Transport>>,
    /// By lane, then by peer; `None` until a call needs the peer.
    pub lanes: [Conns; LANES],
    /// Makes the connections.
    pub connector: Connector,
    pub staging: Staging,
    pub registrations: RegistrationCache,
}

impl Links {
    /// Connects, on `lane`, to those of `peers` it has no connection to
    /// yet (`via`: how each rank is reached), waiting until `deadline`.
    pub fn connect(
        &mut self,
        lane: usize,
        peers: &[Rank],
        via: &[Option<&'static str>],
        deadline: Instant,
    ) -> transport::Result<()> {
        let conns = &mut self.lanes[lane];
        let missing: Vec<Rank> = (peers.iter().copied())
            .filter(|&p| conns[p].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let held: u64 = (conns.iter().enumerate())
            .filter(|(_, c)| c.is_some())
            .chain(missing.iter().map(|&p| (p, &None)))
            .map(|(p, _)| via[p].map_or(0, mesh::descriptors))
            .sum();
        // Every lane may come to hold as many: a coarse bound, raised once.
        mesh::make_room_for(LANES as u64 * held).map_err(transport::Error::Invalid)?;
        for (p, c) in self.connector.connect(&missing, lane as u8, deadline)? {
            conns[p] = Some(c);
        }
        Ok(())
    }
}

/// The numbers that keep calls, messages and children apart.
pub(crate) struct Ids {
    /// This communicator's identity: the session token its connections
    /// present, and the byte of it every message tag carries.
    pub session: u128,
    /// Collective calls made so far.
    pub seq: u32,
    /// Point-to-point messages sent to and received from each rank so far:
    /// their own sequence, so p2p never shifts the collectives'.
    pub p2p_sent: Vec<u32>,
    pub p2p_received: Vec<u32>,
    /// Splits made so far (each child's token derives from it).
    pub splits: u32,
    /// Agreements on failed ranks made so far (see [`crate::fault::agree`]).
    pub agreements: u32,
}

/// Memory algorithms borrow during a call, kept between calls.
#[derive(Default)]
pub(crate) struct Workspace {
    /// An in-place call's input, copied aside for algorithms that need one.
    pub scratch: Vec<u64>,
    /// Where an out-of-place reduce-scatter reduces.
    pub reduce_scatter_buf: Vec<u64>,
}
