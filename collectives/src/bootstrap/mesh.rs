//! A rank's plan for reaching every other rank: which transport each pair
//! uses (shared memory within a host, TCP between hosts, unless forced),
//! its listeners and the addresses it publishes. The connections follow
//! from [`super::connector`], one per [`Lane`] of a pair, so
//! point-to-point messages never queue behind (or between) a collective's.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use transport::shm::ShmTransport;
use transport::tcp::TcpTransport;
use transport::{Connection, Listener, Rank, Transport};

use crate::bootstrap::rendezvous::{self, Table};
use crate::Config;

/// Every transport this build offers and this host can use; peers publish
/// an address for each.
pub(crate) fn available(bind_ip: IpAddr, config: &Config) -> Vec<Arc<dyn Transport>> {
    #[allow(unused_mut)]
    let mut list: Vec<Arc<dyn Transport>> = vec![
        Arc::new(TcpTransport::new(bind_ip, config.tcp)),
        Arc::new(ShmTransport::new(config.shm)),
    ];
    #[cfg(feature = "verbs")]
    match transport::verbs::VerbsTransport::open(bind_ip) {
        Ok(v) => list.push(Arc::new(v)),
        // Not an error unless verbs is forced: the plan says so then.
        Err(e) => tracing::info!("verbs transport unavailable: {e}"),
    }
    list
}

/// Transport name to hex address blob, as published at the rendezvous.
pub(crate) type Addresses = BTreeMap<String, String>;

/// A listener per transport, and the address map to publish (the status
/// port's address is added by [`crate::observe::status::publish`]).
pub(crate) fn listen(
    available: &[Arc<dyn Transport>],
) -> transport::Result<(Vec<Box<dyn Listener>>, Addresses)> {
    let listeners: Vec<Box<dyn Listener>> = available
        .iter()
        .map(|t| t.listen())
        .collect::<Result<_, _>>()?;
    let addresses = available
        .iter()
        .zip(&listeners)
        .map(|(t, l)| (t.name().to_string(), rendezvous::to_hex(&l.address())))
        .collect();
    Ok((listeners, addresses))
}

/// The key of the status address among a rank's published addresses.
pub(crate) const STATUS: &str = "status";

/// Where `p` answers status questions, if it said.
pub(crate) fn status_address(p: &rendezvous::PeerInfo) -> Option<SocketAddr> {
    let blob = rendezvous::from_hex(p.addresses.get(STATUS)?)?;
    String::from_utf8(blob).ok()?.parse().ok()
}

/// Independent ordered message streams between each pair of ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    Collective = 0,
    PointToPoint = 1,
}

pub(crate) const LANES: usize = 2;

/// A connection to each peer (`None` for ourselves, and for a peer not
/// connected yet).
pub(crate) type Conns = Vec<Option<Box<dyn Connection>>>;

/// How each peer is to be reached (connections come later, from a
/// [`Connector`](super::connector::Connector)).
pub(crate) struct Plan {
    /// Index into the available transports, by peer (`None` for ourselves).
    pub transport: Vec<Option<usize>>,
    /// The transport used to reach each rank (`None` for ourselves).
    pub via: Vec<Option<&'static str>>,
    /// The transports some connection uses (all of them in a job of one):
    /// buffers are registered with each.
    pub used: Vec<Arc<dyn Transport>>,
}

/// Checks that the ranks agree on shared settings and picks a transport
/// per peer.
pub(crate) fn plan(
    available: &[Arc<dyn Transport>],
    rank: Rank,
    table: &Table,
    config: &Config,
) -> Result<Plan, String> {
    let me = &table.peers[rank];
    if let Some(p) = table.peers.iter().find(|p| p.settings != me.settings) {
        return Err(format!(
            "rank {} runs with {} but this rank with {}: COLL_TRANSPORT, COLL_CHUNK (or --transport, --chunk) must match on every rank",
            p.rank, p.settings, me.settings
        ));
    }
    let transport: Vec<Option<usize>> = table
        .peers
        .iter()
        .map(|p| {
            if p.rank == rank {
                return Ok(None);
            }
            let name = config
                .transport_for(p.host_id == me.host_id, has_verbs(me) && has_verbs(p))
                .map_err(|e| format!("{e} (rank {} is on {})", p.rank, p.hostname))?;
            Ok(available.iter().position(|t| t.name() == name))
        })
        .collect::<Result<_, String>>()?;
    let via = transport
        .iter()
        .map(|t| t.map(|i| available[i].name()))
        .collect();
    let mut used: Vec<Arc<dyn Transport>> = available
        .iter()
        .enumerate()
        .filter(|(i, _)| transport.contains(&Some(*i)))
        .map(|(_, t)| t.clone())
        .collect();
    if used.is_empty() {
        used = available.to_vec();
    }
    Ok(Plan {
        transport,
        via,
        used,
    })
}

/// Descriptors a connection over `transport` holds: two for TCP's two
/// streams, one otherwise.
pub(crate) fn descriptors(transport: &str) -> u64 {
    match transport {
        "tcp" => 2,
        _ => 1,
    }
}

/// Raises the soft limit on open descriptors to the hard one if `needed`
/// more (one per shared-memory or verbs connection, two per TCP one) would
/// not fit under it: Linux starts processes at 1024, which a TCP job of 256
/// ranks needs for its connections alone. Fails, saying so, where even the
/// hard limit is too low.
pub(crate) fn make_room_for(needed: u64) -> Result<(), String> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    // Besides the connections: listeners, shared segments, the std streams.
    let needed = needed + 32;
    let limit = getrlimit(Resource::Nofile);
    let (soft, hard) = (
        limit.current.unwrap_or(u64::MAX),
        limit.maximum.unwrap_or(u64::MAX),
    );
    if soft >= needed {
        return Ok(());
    }
    if hard < needed {
        return Err(format!(
            "this rank needs about {needed} open files for its connections, and the hard \
             limit is {hard}: raise it (ulimit -Hn, LimitNOFILE= for a service, \
             --ulimit nofile= for a container)"
        ));
    }
    let raised = rustix::process::Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    setrlimit(Resource::Nofile, raised)
        .map_err(|e| format!("could not raise the open files limit from {soft} to {hard}: {e}"))
}

fn has_verbs(p: &crate::bootstrap::rendezvous::PeerInfo) -> bool {
    p.addresses.contains_key("verbs")
}

/// One INFO line naming every peer, how it is reached, and its address.
pub(crate) fn log_peers(rank: Rank, table: &Table, via: &[Option<&'static str>]) {
    if !tracing::enabled!(tracing::Level::INFO) {
        return;
    }
    let me = &table.peers[rank];
    let peers: Vec<String> = table
        .peers
        .iter()
        .filter(|p| p.rank != rank)
        .map(|p| {
            let t = via[p.rank].unwrap_or("?");
            let addr = p.addresses.get(t).and_then(|h| rendezvous::from_hex(h));
            let addr = addr
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            let place = if p.host_id == me.host_id {
                "same host"
            } else {
                p.hostname.as_str()
            };
            format!("{} via {t} ({place}, {addr})", p.rank)
        })
        .collect();
    tracing::info!(rank, "connected to {}", peers.join(", "));
}

/// Whether every peer is reached through shared memory (each pair agrees on
/// its transport, so every rank of the job answers alike).
pub(crate) fn all_shared_memory(via: &[Option<&'static str>]) -> bool {
    via.iter().all(|v| v.is_none_or(|t| t == "shm"))
}

/// "shm", "tcp" or "shm+tcp": the transports in use, for headers and logs.
pub(crate) fn summary(via: &[Option<&'static str>]) -> String {
    let mut names: Vec<&str> = via.iter().flatten().copied().collect();
    names.sort_unstable();
    names.dedup();
    names.reverse();
    if names.is_empty() {
        "none (one rank)".into()
    } else {
        names.join("+")
    }
}
