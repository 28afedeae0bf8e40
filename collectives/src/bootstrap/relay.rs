//! Handing the rendezvous's table down a tree. The rendezvous sends the
//! whole table to ranks `0..FANOUT` only; every rank passes it on to its
//! `FANOUT` children. Nobody sends it more than `FANOUT` times, and the last
//! rank has it after `hops(n)` = about log_FANOUT(n) hand-overs: the hub's
//! part is n small joins in and `FANOUT` tables out, not n tables out.
//!
//! A rank learns from the rendezvous who its parent is, the session token
//! (by a nonce it derives it from), and where its children listen; a table
//! is taken only with a proof under that session (a MAC, the session itself
//! never on the wire): a stranger who finds the port is ignored.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::AtomicUsize;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use transport::Rank;

use super::rendezvous::{
    prove, proved, read_each, receive_by, send_bytes, PeerInfo, MAX_REPLY_BYTES,
};

/// Children per rank in the tree.
pub const FANOUT: usize = 8;
/// How long a connection to the relay listener may take to send its table.
const RELAY_WITHIN: Duration = Duration::from_secs(10);

/// Who sends `rank` the table; `None`: the rendezvous itself.
pub fn parent(rank: Rank) -> Option<Rank> {
    (rank >= FANOUT).then(|| rank / FANOUT - 1)
}

/// The ranks `rank` passes the table to in a job of `size`.
pub fn children(rank: Rank, size: usize) -> Range<Rank> {
    let first = FANOUT.saturating_mul(rank + 1);
    first.min(size)..first.saturating_add(FANOUT).min(size)
}

/// Hand-overs until the last rank of a job of `size` has the table (the
/// rendezvous's own counts as one).
pub fn hops(size: usize) -> usize {
    let mut at = size.saturating_sub(1);
    let mut hops = 1;
    while let Some(p) = parent(at) {
        (at, hops) = (p, hops + 1);
    }
    hops
}

/// The table as it travels from a parent to a child: its JSON, and the
/// MAC of it under the session. A rank passes on what it received as it
/// came, without writing the table again.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Relay {
    proof: String,
    table: String,
}

impl Relay {
    /// The relay of `peers` in the session `session`.
    pub(crate) fn new(session: u128, peers: &[PeerInfo]) -> Self {
        let table = serde_json::to_string(peers).expect("a table serializes");
        Relay {
            proof: prove(session, "relay", &[table.as_bytes()]),
            table,
        }
    }

    /// The table, if it is proved under `session` and names every rank of
    /// a job of `size` once, in order.
    fn open(&self, session: u128, size: usize) -> Result<Vec<PeerInfo>, String> {
        if !proved(session, "relay", &[self.table.as_bytes()], &self.proof) {
            return Err("no proof of this session".into());
        }
        let peers: Vec<PeerInfo> = serde_json::from_str(&self.table).map_err(|e| e.to_string())?;
        check(&peers, size)?;
        Ok(peers)
    }
}

/// Waits on `listener` for the table from rank `parent`: the first
/// connection that brings a relay proved under `session`, with a whole
/// table of `size` ranks. Connections are read side by side (see
/// [`read_each`]): a silent stranger holds up nothing.
pub(crate) fn await_table(
    listener: &TcpListener,
    session: u128,
    parent: Rank,
    size: usize,
    deadline: Instant,
) -> Result<(Relay, Vec<PeerInfo>), String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let (tx, rx) = mpsc::channel();
    let readers = Arc::new(AtomicUsize::new(0));
    while Instant::now() < deadline {
        read_each(listener, &readers, &tx, "the rendezvous relay", move |s| {
            receive_by::<Relay>(
                s,
                MAX_REPLY_BYTES,
                deadline.min(Instant::now() + RELAY_WITHIN),
            )
        });
        let Ok((stream, relay)) = rx.recv_timeout(Duration::from_millis(2)) else {
            continue;
        };
        match relay.open(session, size) {
            Ok(peers) => return Ok((relay, peers)),
            Err(e) => {
                tracing::warn!(from = ?stream.peer_addr().ok(), "ignored a connection to the rendezvous relay: {e}")
            }
        }
    }
    Err(format!(
        "Timed out waiting: rank {parent} never passed on the rendezvous's table (it relays \
         it to ranks {:?}; did it fail as it started?)",
        children(parent, size)
    ))
}

/// A table names every rank of the job once, in order.
pub(crate) fn check(peers: &[PeerInfo], size: usize) -> Result<(), String> {
    if peers.len() != size {
        return Err(format!("a table of {} ranks, not {size}", peers.len()));
    }
    match peers.iter().enumerate().find(|(i, p)| p.rank != *i) {
        Some((i, p)) => Err(format!("a table with rank {} in place {i}", p.rank)),
        None => Ok(()),
    }
}

/// Sends `relay` to each child's relay listener, all at once; a child that
/// cannot be reached is logged (its subtree times out naming us).
pub(crate) fn pass_on(relay: &Relay, to: &[SocketAddr], deadline: Instant) {
    if to.is_empty() {
        return;
    }
    let body = serde_json::to_vec(relay).expect("a relay serializes");
    std::thread::scope(|s| {
        for addr in to {
            let body = &body;
            s.spawn(move || {
                if let Err(e) = send_to(*addr, body, deadline) {
                    tracing::warn!(%addr, "could not pass the rendezvous's table on: {e}");
                }
            });
        }
    });
}

fn send_to(addr: SocketAddr, body: &[u8], deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    let timeout = left.clamp(Duration::from_millis(1), Duration::from_secs(5));
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
    send_bytes(&mut stream, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_has_one_parent_and_is_reached() {
        for size in [1, 2, 8, 9, 72, 73, 1000] {
            let mut reached = vec![false; size];
            reached[..size.min(FANOUT)].fill(true);
            for r in 0..size {
                for c in children(r, size) {
                    assert_eq!(parent(c), Some(r));
                    assert!(!reached[c] || c < FANOUT);
                    reached[c] = true;
                }
            }
            assert!(reached.iter().all(|r| *r), "size {size}");
        }
        assert_eq!(
            (hops(1), hops(8), hops(9), hops(72), hops(73)),
            (1, 1, 2, 2, 3)
        );
        assert_eq!(hops(100_000), 6);
    }
}
