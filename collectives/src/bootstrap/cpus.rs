//! How many cores the ranks of one host share: whether waiting ranks may
//! spin (each has a core) or must yield (they outnumber the cores).
//!
//! Not the process's own affinity: a launcher that binds each rank to one
//! core (mpirun's default, `collbench --bind core`) leaves every rank an
//! affinity of one core, and ranks bound apart do not crowd each other.
//! The job's share of the host is its cpuset (a container's, a Slurm
//! allocation's), else every online CPU.

use std::time::Duration;

use transport::{Poller, Rank};

use crate::bootstrap::rendezvous::PeerInfo;

/// Whether `local_ranks` ranks on this host outnumber its cores.
pub(crate) fn oversubscribed(local_ranks: usize) -> bool {
    local_ranks > super::host::cores()
}

/// How long an idle rank spins before it yields ([`Poller`]'s phases):
/// not at all when ranks outnumber cores; through the whole patience when
/// the rank is bound to a core of its own (a yield would only hand that
/// core to whatever other work shares it, for a whole time slice, while no
/// peer of ours can be waiting for it); a few microseconds otherwise (the
/// scheduler may have put a peer on our core).
pub(crate) fn spin(local_ranks: usize) -> Duration {
    let bound = rustix::thread::sched_getaffinity(None).is_ok_and(|s| s.count() == 1);
    match (oversubscribed(local_ranks), bound) {
        (true, _) => Duration::ZERO,
        (false, true) => Poller::DEFAULT_PATIENCE,
        (false, false) => Poller::DEFAULT_SPIN,
    }
}

/// Whether every message goes over TCP on one host whose ranks outnumber
/// its cores ([`Topology::crowded_sockets`](crate::algo::Topology)): decided
/// from what every rank published (`transport` is a setting they share), so
/// that all pick the same algorithms.
pub(crate) fn crowded_sockets(transport: &str, peers: &[PeerInfo], hosts: &[Vec<Rank>]) -> bool {
    transport == "tcp" && crowded(peers, hosts)
}

/// Whether the job is one host whose ranks outnumber its cores
/// ([`Topology::crowded`](crate::algo::Topology)), from what every rank
/// published, so that all pick the same algorithms.
pub(crate) fn crowded(peers: &[PeerInfo], hosts: &[Vec<Rank>]) -> bool {
    let cores = peers.iter().map(|p| p.cores).min().unwrap_or(0);
    hosts.len() == 1 && peers.len() > cores
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockets_are_crowded_when_a_host_has_more_ranks_than_its_least_cores() {
        let peer = |rank, host: &str, cores| PeerInfo {
            rank,
            hostname: host.into(),
            host_id: host.into(),
            pid: 1,
            cores,
            addresses: Default::default(),
            settings: String::new(),
        };
        let one_host = [peer(0, "a", 4), peer(1, "a", 4), peer(2, "a", 2)];
        let hosts = [vec![0, 1, 2]];
        assert!(crowded_sockets("tcp", &one_host, &hosts));
        assert!(!crowded_sockets("auto", &one_host, &hosts));
        assert!(crowded(&one_host, &hosts));
        assert!(!crowded_sockets("tcp", &one_host[..2], &[vec![0, 1]]));
        let two_hosts = [peer(0, "a", 1), peer(1, "a", 1), peer(2, "b", 1)];
        assert!(!crowded_sockets("tcp", &two_hosts, &[vec![0, 1], vec![2]]));
        assert!(!crowded(&two_hosts, &[vec![0, 1], vec![2]]));
    }
}
