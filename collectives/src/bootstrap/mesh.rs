//! A rank's connections to every other rank: which transport each pair
//! uses (shared memory within a host, TCP between hosts, unless forced),
//! and setting them up: each rank dials the lower ranks and accepts the
//! higher ones, all at once. Every pair gets one connection per [`Lane`], so
//! point-to-point messages never queue behind (or between) a collective's.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use transport::shm::ShmTransport;
use transport::tcp::TcpTransport;
use transport::{Connection, Hello, Listener, Rank, Transport};

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

/// A connection to each peer (`None` for ourselves).
pub(crate) type Conns = Vec<Option<Box<dyn Connection>>>;

/// The connections, and how each was made.
pub(crate) struct Mesh {
    /// By lane, then by peer.
    pub lanes: [Conns; LANES],
    /// The transport used to reach each rank (`None` for ourselves).
    pub via: Vec<Option<&'static str>>,
    /// The transports some connection uses (all of them in a job of one):
    /// buffers are registered with each.
    pub used: Vec<Arc<dyn Transport>>,
}

/// Checks that the ranks agree on shared settings, picks a transport per
/// peer, and connects to every peer.
pub(crate) fn connect(
    available: &[Arc<dyn Transport>],
    listeners: Vec<Box<dyn Listener>>,
    rank: Rank,
    table: &Table,
    config: &Config,
    deadline: Instant,
) -> Result<Mesh, String> {
    let me = &table.peers[rank];
    if let Some(p) = table.peers.iter().find(|p| p.settings != me.settings) {
        return Err(format!(
            "rank {} runs with {} but this rank with {}: COLL_TRANSPORT, COLL_CHUNK (or --transport, --chunk) must match on every rank",
            p.rank, p.settings, me.settings
        ));
    }
    let plan: Vec<Option<usize>> = table
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
    let streams = plan.iter().flatten().map(|&t| match available[t].name() {
        "tcp" => 2,
        _ => 1,
    });
    make_room_for(LANES as u64 * streams.sum::<u64>())?;
    let acceptors = spawn_acceptors(listeners, rank, &plan, table.session, deadline);
    let mut lanes: [Conns; LANES] =
        std::array::from_fn(|_| (0..plan.len()).map(|_| None).collect());
    let mut first_error = None;
    // A peer's lanes are dialled one after the other, so its acceptor sees
    // them in lane order.
    'dial: for peer in 0..rank {
        let t = &available[plan[peer].expect("peers have a transport")];
        for lane in &mut lanes {
            match dial(&**t, table, rank, peer, deadline) {
                Ok(c) => lane[peer] = Some(c),
                Err(e) => {
                    first_error = Some(e);
                    break 'dial;
                }
            }
        }
    }
    for acceptor in acceptors {
        let accepted = acceptor
            .join()
            .map_err(|_| "the accepting thread panicked".to_string())?;
        for (peer, c) in accepted? {
            let lane = (lanes.iter_mut())
                .find(|l| l[peer].is_none())
                .expect("an acceptor takes LANES connections per peer");
            lane[peer] = Some(c);
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let via = plan
        .iter()
        .map(|t| t.map(|i| available[i].name()))
        .collect();
    let mut used: Vec<Arc<dyn Transport>> = available
        .iter()
        .enumerate()
        .filter(|(i, _)| plan.contains(&Some(*i)))
        .map(|(_, t)| t.clone())
        .collect();
    if used.is_empty() {
        used = available.to_vec();
    }
    Ok(Mesh { lanes, via, used })
}

/// Raises the soft limit on open descriptors to the hard one if `needed`
/// more (one per shared-memory or verbs connection, two per TCP one) would
/// not fit under it: Linux starts processes at 1024, which a TCP job of 256
/// ranks needs for its connections alone. Fails, saying so, where even the
/// hard limit is too low.
fn make_room_for(needed: u64) -> Result<(), String> {
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

fn dial(
    t: &dyn Transport,
    table: &Table,
    rank: Rank,
    peer: Rank,
    deadline: Instant,
) -> Result<Box<dyn Connection>, String> {
    let blob = table.peers[peer]
        .addresses
        .get(t.name())
        .and_then(|h| rendezvous::from_hex(h))
        .ok_or_else(|| format!("rank {peer} published no {} address", t.name()))?;
    let hello = Hello {
        token: table.session,
        from: rank,
        to: peer,
    };
    t.connect(&blob, hello, deadline)
        .map_err(|e| format!("could not connect to rank {peer} over {}: {e}", t.name()))
}

/// Connections from higher ranks, as an accepting thread collects them.
type Accepted = Vec<(Rank, Box<dyn Connection>)>;

/// A thread per listener that some higher rank will dial.
fn spawn_acceptors(
    listeners: Vec<Box<dyn Listener>>,
    rank: Rank,
    plan: &[Option<usize>],
    token: u128,
    deadline: Instant,
) -> Vec<JoinHandle<Result<Accepted, String>>> {
    listeners
        .into_iter()
        .enumerate()
        .filter_map(|(t, listener)| {
            let expect: Vec<Rank> = (rank + 1..plan.len())
                .filter(|r| plan[*r] == Some(t))
                .flat_map(|r| [r; LANES])
                .collect();
            (!expect.is_empty()).then(|| {
                std::thread::spawn(move || accept_from(listener, rank, expect, token, deadline))
            })
        })
        .collect()
}

fn accept_from(
    mut listener: Box<dyn Listener>,
    rank: Rank,
    expect: Vec<Rank>,
    token: u128,
    deadline: Instant,
) -> Result<Accepted, String> {
    let mut got: Accepted = Vec::with_capacity(expect.len());
    let count = |got: &Accepted, peer| got.iter().filter(|(r, _)| *r == peer).count();
    while got.len() < expect.len() {
        match listener.accept(token, rank, deadline) {
            Ok((peer, conn)) if count(&got, peer) < count_in(&expect, peer) => {
                got.push((peer, conn))
            }
            Ok((peer, _)) => {
                tracing::warn!(rank, "refused an unexpected connection from rank {peer}")
            }
            Err(e) => {
                let mut missing: Vec<Rank> = expect
                    .iter()
                    .copied()
                    .filter(|r| count(&got, *r) < count_in(&expect, *r))
                    .collect();
                missing.dedup();
                return Err(format!("rank(s) {missing:?} never connected: {e}"));
            }
        }
    }
    Ok(got)
}

fn count_in(expect: &[Rank], peer: Rank) -> usize {
    expect.iter().filter(|r| **r == peer).count()
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
