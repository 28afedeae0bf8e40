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

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use transport::Rank;

use super::rendezvous::{receive_by, to_hex, PeerInfo, MAX_REPLY_BYTES};

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
/// MAC of it under the session.
#[derive(Serialize, Deserialize)]
pub(crate) struct Relay {
    proof: String,
    table: String,
}

fn prove(session: u128, table: &str) -> String {
    to_hex(&transport::proof::mac(
        session,
        "relay",
        &[table.as_bytes()],
    ))
}

/// Waits on `listener` for the table from rank `parent`: the first
/// connection that presents `session` and a whole table of `size` ranks.
pub(crate) fn await_table(
    listener: &TcpListener,
    session: u128,
    parent: Rank,
    size: usize,
    deadline: Instant,
) -> Result<Vec<PeerInfo>, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    while Instant::now() < deadline {
        let Ok((mut stream, from)) = listener.accept() else {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        };
        let _ = stream.set_nonblocking(false);
        let by = deadline.min(Instant::now() + RELAY_WITHIN);
        let problem = match receive_by::<Relay>(&mut stream, MAX_REPLY_BYTES, by) {
            Ok(r) if r.proof != prove(session, &r.table) => "no proof of this session".to_string(),
            Ok(r) => match serde_json::from_str::<Vec<PeerInfo>>(&r.table) {
                Ok(peers) => match check(&peers, size) {
                    Ok(()) => return Ok(peers),
                    Err(e) => e,
                },
                Err(e) => e.to_string(),
            },
            Err(e) => e.to_string(),
        };
        tracing::warn!(%from, "ignored a connection to the rendezvous relay: {problem}");
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

/// Sends the table to each child's relay listener, all at once; a child
/// that cannot be reached is logged (its subtree times out naming us).
pub(crate) fn pass_on(session: u128, peers: &[PeerInfo], to: &[SocketAddr], deadline: Instant) {
    if to.is_empty() {
        return;
    }
    let table = serde_json::to_string(peers).expect("a table serializes");
    let relay = Relay {
        proof: prove(session, &table),
        table,
    };
    let body = serde_json::to_vec(&relay).expect("a table serializes");
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
    stream.write_all(&(body.len() as u32).to_le_bytes())?;
    stream.write_all(body)
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
