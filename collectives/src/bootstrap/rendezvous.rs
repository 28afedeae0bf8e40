//! The rendezvous: one TCP server (in rank 0, or in the launcher) where every
//! rank posts who it is and how to reach it. Once all have arrived it sends
//! everyone's info to the first ranks only, which hand it down a tree
//! ([`super::relay`]); the others learn from it whom their table comes from.
//! Messages are length-prefixed JSON; it runs once per job.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use transport::Rank;

use super::relay;

/// What a rank tells the others about itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerInfo {
    pub rank: Rank,
    pub hostname: String,
    /// Ranks with equal host ids share a machine (see [`super::host`]).
    pub host_id: String,
    pub pid: u32,
    /// The cores its host gives the job (see [`crate::bootstrap::host::cores`]).
    pub cores: usize,
    /// Transport name to hex-encoded address blob.
    pub addresses: BTreeMap<String, String>,
    /// Settings every rank must share (transport choice, chunk size), as
    /// text; the communicator refuses a job whose ranks disagree.
    pub settings: String,
}

impl PeerInfo {
    /// This process's info: its host identity and transport addresses.
    pub(crate) fn new(rank: Rank, addresses: BTreeMap<String, String>, settings: String) -> Self {
        let (hostname, host_id) = super::host::identity();
        PeerInfo {
            rank,
            hostname,
            host_id,
            pid: std::process::id(),
            cores: crate::bootstrap::host::cores(),
            addresses,
            settings,
        }
    }
}

/// What the rendezvous sends first on every connection: the nonce a join
/// must prove the job's token with.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Challenge {
    nonce: String,
}

/// A join: its body (JSON of [`JoinBody`], the exact bytes proved) and the
/// proof, a MAC under the job's token of the challenge and the body: the
/// token itself never goes on the wire ([`transport::proof`]).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Join {
    proof: String,
    body: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct JoinBody {
    size: usize,
    info: PeerInfo,
    /// Where this rank accepts the table from its parent in the relay tree.
    relay: SocketAddr,
    /// The joiner's nonce, which the rendezvous's answer proves.
    nonce: String,
}

#[derive(Serialize, Deserialize)]
pub(crate) enum Reply {
    /// JSON of a [`Welcome`], proved under the job's token with the
    /// joiner's nonce: only the rendezvous of this job can answer.
    Proved {
        proof: String,
        body: String,
    },
    Refused {
        reason: String,
    },
}

/// What a member learns at the rendezvous. The session token is not in it:
/// each member derives it from the job's token and `session_nonce`.
#[derive(Serialize, Deserialize)]
pub(crate) enum Welcome {
    /// The table itself, to the first ranks of the relay tree.
    Table {
        session_nonce: String,
        peers: Vec<PeerInfo>,
        children: Vec<SocketAddr>,
    },
    /// The table comes from rank `parent`; pass it on to `children`.
    Relayed {
        session_nonce: String,
        parent: Rank,
        children: Vec<SocketAddr>,
    },
}

/// The session token of a job of token `job` whose rendezvous chose `nonce`.
fn session_of(job: u128, nonce: &str) -> u128 {
    super::derive_token(job, &format!("session {nonce}"))
}

/// What every rank learns at the rendezvous.
#[derive(Clone, Debug)]
pub struct Table {
    /// Token every transport connection of this job presents.
    pub session: u128,
    /// Everyone's info, indexed by rank.
    pub peers: Vec<PeerInfo>,
}

/// The most ranks a job may have: a larger size is a typo or an attack,
/// refused before it sizes anything.
pub const MAX_RANKS: usize = 1 << 22;
/// Connections the rendezvous reads at once, and how long each may take to
/// send its join, and how large the join may be.
const MAX_READERS: usize = 64;
const JOIN_WITHIN: Duration = Duration::from_secs(10);
const MAX_JOIN_BYTES: usize = 1 << 20;

/// A bound rendezvous server, not yet serving.
pub struct Server {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Server {
    /// Binds `addr`, with messages that say what to do when it cannot.
    pub fn bind(addr: SocketAddr) -> Result<Self, String> {
        let listener = crate::sys::listener::bind(addr).map_err(|e| match e.kind() {
            ErrorKind::AddrInUse => format!(
                "cannot host the rendezvous: port {} on {} is already in use (another job, \
                 or a previous one still exiting?): choose another MASTER_PORT",
                addr.port(),
                addr.ip()
            ),
            ErrorKind::AddrNotAvailable => format!(
                "cannot host the rendezvous: {} is not an address of this host; MASTER_ADDR \
                 must name rank 0's host",
                addr.ip()
            ),
            _ => format!("cannot host the rendezvous on {addr}: {e}"),
        })?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        Ok(Server { listener, addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves one job of `size` ranks in a background thread, giving up at
    /// `deadline`. Without a size, the first rank to join sets it (the
    /// rendezvous of a unique id, made before anyone knows the size).
    pub fn spawn(
        self,
        size: Option<usize>,
        job: u128,
        deadline: Instant,
    ) -> JoinHandle<Result<(), String>> {
        std::thread::Builder::new()
            .name("rendezvous".into())
            .spawn(move || self.serve(size, job, deadline))
            .expect("spawn the rendezvous thread")
    }

    fn serve(self, size: Option<usize>, job: u128, deadline: Instant) -> Result<(), String> {
        let (tx, rx) = mpsc::channel::<(TcpStream, (Join, String))>();
        self.listener
            .set_nonblocking(true)
            .map_err(|e| e.to_string())?;
        let readers = Arc::new(AtomicUsize::new(0));
        // By rank: memory grows with the ranks that joined, never with what
        // a joiner claims the size is.
        let mut joined: BTreeMap<Rank, (TcpStream, JoinBody)> = BTreeMap::new();
        let mut size = size;
        // Joins refused (their senders were told why), for the timeout's error.
        let mut refused: Vec<String> = Vec::new();
        while size != Some(joined.len()) {
            if Instant::now() >= deadline {
                let reason = self.timed_out(size, &joined, &refused);
                refuse_all(joined.values_mut(), &reason);
                return Err(reason);
            }
            read_each(&self.listener, &readers, &tx, "rendezvous", |stream| {
                let within = Instant::now() + JOIN_WITHIN;
                let challenge = Challenge {
                    nonce: to_hex(&transport::proof::nonce()),
                };
                stream.set_write_timeout(Some(JOIN_WITHIN))?;
                send(stream, &challenge)?;
                let join = receive_by::<Join>(stream, MAX_JOIN_BYTES, within)?;
                stream.set_read_timeout(None)?;
                Ok((join, challenge.nonce))
            });
            let (mut stream, (join, challenge)) = match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(joiner) => joiner,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => unreachable!("we hold a sender"),
            };
            // A bad join is refused alone: whoever sent it cannot end the job.
            let j = proved_join(&join, job, &challenge);
            let problem = match &j {
                Err(e) => Some(e.clone()),
                Ok(j) => bad_join(j, size, &joined),
            };
            if let Some(reason) = problem {
                tracing::warn!("rendezvous refused a join: {reason}");
                let _ = send(
                    &mut stream,
                    &Reply::Refused {
                        reason: reason.clone(),
                    },
                );
                if refused.len() < 8 {
                    refused.push(reason);
                }
                continue;
            }
            let j = j.expect("refused above");
            tracing::debug!(rank = j.info.rank, host = %j.info.hostname, "joined the rendezvous");
            size.get_or_insert(j.size);
            joined.insert(j.info.rank, (stream, j));
        }
        answer(joined, job);
        Ok(())
    }

    /// The error when not every rank joined by the deadline.
    fn timed_out(
        &self,
        size: Option<usize>,
        joined: &BTreeMap<Rank, (TcpStream, JoinBody)>,
        refused: &[String],
    ) -> String {
        let size = size.unwrap_or(0);
        let missing: Vec<Rank> = (0..size)
            .filter(|r| !joined.contains_key(r))
            .take(16)
            .collect();
        let more = size - joined.len() - missing.len();
        let mut reason = format!(
            "Timed out waiting: rank(s) {missing:?}{} of {size} did not reach the rendezvous at {} \
             in time (did they start? do MASTER_ADDR/MASTER_PORT match?)",
            if more > 0 { format!(" and {more} more") } else { String::new() },
            self.addr
        );
        if !refused.is_empty() {
            reason += &format!("; joins refused: {}", refused.join("; "));
        }
        reason
    }
}

/// Accepts the connections waiting on the non-blocking `listener`; a thread
/// per connection runs `read` on it (which must end by its own deadline)
/// and hands the stream and what it read to `tx`. At most `MAX_READERS` run
/// at once (counted in `readers`), so a silent or trickling stranger holds
/// up nobody and a flood of them costs a bounded number of threads; past
/// that many, connections wait in the listener's backlog: a flood delays an
/// honest sender, never drops it. `what` names the listener in the log.
pub(crate) fn read_each<T: Send + 'static>(
    listener: &TcpListener,
    readers: &Arc<AtomicUsize>,
    tx: &mpsc::Sender<(TcpStream, T)>,
    what: &'static str,
    read: impl Fn(&mut TcpStream) -> std::io::Result<T> + Clone + Send + 'static,
) {
    // Only the caller's thread adds readers: the count cannot pass the cap.
    while readers.load(Ordering::SeqCst) < MAX_READERS {
        let Ok((mut stream, from)) = listener.accept() else {
            return;
        };
        readers.fetch_add(1, Ordering::SeqCst);
        let (tx, readers, read) = (tx.clone(), readers.clone(), read.clone());
        std::thread::spawn(move || {
            let got = stream
                .set_nonblocking(false)
                .and_then(|_| read(&mut stream));
            match got {
                Ok(t) => {
                    let _ = tx.send((stream, t));
                }
                Err(e) => tracing::warn!(%from, "{what} ignored a connection: {e}"),
            }
            readers.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// Answers every rank of a whole job (`joined` holds ranks `0..n`): the
/// table to the relay tree's first ranks, its parent to every other, first
/// to those that start the relay.
fn answer(mut joined: BTreeMap<Rank, (TcpStream, JoinBody)>, job: u128) {
    let size = joined.len();
    let peers: Vec<PeerInfo> = joined.values().map(|(_, j)| j.info.clone()).collect();
    let relays: Vec<SocketAddr> = joined.values().map(|(_, j)| j.relay).collect();
    let session_nonce = to_hex(&transport::proof::nonce());
    for (&rank, (stream, j)) in joined.iter_mut() {
        let children = relay::children(rank, size).map(|c| relays[c]).collect();
        let session_nonce = session_nonce.clone();
        let welcome = match relay::parent(rank) {
            None => Welcome::Table {
                session_nonce,
                peers: peers.clone(),
                children,
            },
            Some(parent) => Welcome::Relayed {
                session_nonce,
                parent,
                children,
            },
        };
        let body = serde_json::to_string(&welcome).expect("a welcome serializes");
        let reply = Reply::Proved {
            proof: prove(job, "welcome", &[j.nonce.as_bytes(), body.as_bytes()]),
            body,
        };
        if let Err(e) = send(stream, &reply) {
            tracing::warn!(rank, "could not answer at the rendezvous: {e}");
        }
    }
}

/// The body of a join proved under the job's token `job` with the
/// rendezvous's `challenge`, or why it is refused.
fn proved_join(j: &Join, job: u128, challenge: &str) -> Result<JoinBody, String> {
    if !proved(
        job,
        "join",
        &[challenge.as_bytes(), j.body.as_bytes()],
        &j.proof,
    ) {
        let rank = serde_json::from_str::<JoinBody>(&j.body).map(|b| b.info.rank);
        let who = rank.map_or("a joiner".into(), |r| format!("a joiner as rank {r}"));
        return Err(format!(
            "{who} did not prove this job's token (another job, or a stranger)"
        ));
    }
    serde_json::from_str(&j.body).map_err(|e| format!("a join that does not parse: {e}"))
}

/// Why a join of this job cannot be taken, if it cannot.
fn bad_join(
    j: &JoinBody,
    size: Option<usize>,
    joined: &BTreeMap<Rank, (TcpStream, JoinBody)>,
) -> Option<String> {
    let rank = j.info.rank;
    if !(1..=MAX_RANKS).contains(&j.size) {
        return Some(format!(
            "rank {rank} says WORLD_SIZE={}, not between 1 and {MAX_RANKS}",
            j.size
        ));
    }
    if let Some(size) = size.filter(|s| *s != j.size) {
        return Some(format!(
            "rank {rank} says WORLD_SIZE={} but the job has {size} ranks",
            j.size
        ));
    }
    if rank >= j.size {
        return Some(format!("rank {rank} is not below WORLD_SIZE={}", j.size));
    }
    let (_, first) = joined.get(&rank)?;
    Some(format!(
        "rank {rank} joined twice (pids {} and {}): the second is refused",
        first.info.pid, j.info.pid
    ))
}

fn refuse_all<'a>(joined: impl Iterator<Item = &'a mut (TcpStream, JoinBody)>, reason: &str) {
    for (stream, _) in joined {
        let _ = send(
            stream,
            &Reply::Refused {
                reason: reason.into(),
            },
        );
    }
}

/// Joins the rendezvous at `addr` and waits for everyone's info until
/// `deadline`, then passes it on to this rank's children in the relay tree.
pub fn join(
    addr: SocketAddr,
    job: u128,
    size: usize,
    me: PeerInfo,
    deadline: Instant,
) -> Result<Table, String> {
    let at = |e: std::io::Error| format!("rendezvous at {addr}: {e}");
    let mut stream = connect(addr, deadline)?;
    // Listen where the rendezvous reached us: our parent can reach us there.
    let ip = stream.local_addr().map_err(at)?.ip();
    let listener = crate::sys::listener::bind(SocketAddr::new(ip, 0)).map_err(at)?;
    let late = deadline + Duration::from_secs(2);
    let challenge: Challenge = receive_by(&mut stream, MAX_CHALLENGE_BYTES, late).map_err(at)?;
    let nonce = to_hex(&transport::proof::nonce());
    let body = JoinBody {
        size,
        info: me,
        relay: listener.local_addr().map_err(at)?,
        nonce: nonce.clone(),
    };
    let body = serde_json::to_string(&body).map_err(|e| e.to_string())?;
    let request = Join {
        proof: prove(job, "join", &[challenge.nonce.as_bytes(), body.as_bytes()]),
        body,
    };
    send(&mut stream, &request).map_err(at)?;
    // Wait a little past our own deadline: the rendezvous gives up at its
    // own, and only its answer can say which ranks never came.
    let welcome = match receive_by::<Reply>(&mut stream, MAX_REPLY_BYTES, late) {
        Ok(Reply::Proved { proof, body }) => {
            if !proved(job, "welcome", &[nonce.as_bytes(), body.as_bytes()], &proof) {
                return Err(format!("the rendezvous at {addr} did not prove it holds this job's token (another job's, or a stranger's)"));
            }
            serde_json::from_str::<Welcome>(&body).map_err(|e| format!("rendezvous at {addr}: {e}"))?
        }
        Ok(Reply::Refused { reason }) => return Err(format!("the rendezvous at {addr} refused the job: {reason}")),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return Err(format!(
            "Timed out waiting: not every rank reached the rendezvous at {addr} in time (started all {size}? same MASTER_ADDR/MASTER_PORT?)"
        )),
        Err(e) => return Err(at(e)),
    };
    let (session, relayed, peers, children) = match welcome {
        Welcome::Table {
            session_nonce,
            peers,
            children,
        } => {
            relay::check(&peers, size).map_err(|e| format!("rendezvous at {addr}: {e}"))?;
            let session = session_of(job, &session_nonce);
            (session, relay::Relay::new(session, &peers), peers, children)
        }
        Welcome::Relayed {
            session_nonce,
            parent,
            children,
        } => {
            let session = session_of(job, &session_nonce);
            let (relayed, peers) = relay::await_table(&listener, session, parent, size, late)?;
            (session, relayed, peers, children)
        }
    };
    relay::pass_on(&relayed, &children, late);
    Ok(Table { session, peers })
}

/// Connects, retrying while the server is not up yet.
fn connect(addr: SocketAddr, deadline: Instant) -> Result<TcpStream, String> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &addr,
            left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
        )
        .and_then(not_to_itself)
        {
            Ok(s) => return Ok(s),
            Err(e) if left > Duration::from_millis(100) => {
                tracing::debug!(%addr, "rendezvous not reachable yet: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(format!(
                "could not reach the rendezvous at {addr} (MASTER_ADDR:MASTER_PORT) in time: {e}; \
                     is rank 0 running, and do MASTER_ADDR/MASTER_PORT name its host and port?"
            ))
            }
        }
    }
}

/// A client retrying a local port in the ephemeral range can be handed that
/// very port as its own and connect to itself (TCP simultaneous open): that
/// is no rendezvous, so it counts as one not reachable yet.
fn not_to_itself(stream: TcpStream) -> std::io::Result<TcpStream> {
    if stream.local_addr()? == stream.peer_addr()? {
        return Err(std::io::Error::new(
            ErrorKind::ConnectionRefused,
            "connected to itself: nothing listens there",
        ));
    }
    Ok(stream)
}

fn send<T: Serialize>(stream: &mut TcpStream, msg: &T) -> std::io::Result<()> {
    send_bytes(stream, &serde_json::to_vec(msg)?)
}

/// One message already serialized: its length, then its bytes.
pub(crate) fn send_bytes(stream: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    stream.write_all(&(body.len() as u32).to_le_bytes())?;
    stream.write_all(body)
}

/// The MAC under `key` of `label` and `parts`, in hex, as messages carry it
/// ([`transport::proof`]).
pub(crate) fn prove(key: u128, label: &str, parts: &[&[u8]]) -> String {
    to_hex(&transport::proof::mac(key, label, parts))
}

/// Whether `proof` (hex) is the MAC under `key` of `label` and `parts`.
pub(crate) fn proved(key: u128, label: &str, parts: &[&[u8]], proof: &str) -> bool {
    from_hex(proof).is_some_and(|p| transport::proof::verify(key, label, parts, &p))
}

/// The longest challenge a joiner reads.
const MAX_CHALLENGE_BYTES: usize = 256;
/// The longest reply a joiner reads (the table of every rank).
pub(crate) const MAX_REPLY_BYTES: usize = 64 << 20;

/// One message of at most `max` bytes, all of it by `deadline` (a deadline
/// for the message, not for each read: a sender trickling a byte at a time
/// cannot hold the reader longer).
pub(crate) fn receive_by<T: for<'de> Deserialize<'de>>(
    stream: &mut TcpStream,
    max: usize,
    deadline: Instant,
) -> std::io::Result<T> {
    receive_at_most(&mut ByDeadline { stream, deadline }, max)
}

/// One length-prefixed JSON message of at most `max` bytes: a stranger's
/// length prefix allocates nothing beyond what it sends.
pub(crate) fn receive_at_most<T: for<'de> Deserialize<'de>>(
    stream: &mut impl Read,
    max: usize,
) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a rendezvous message of {len} bytes, above {max}"),
        ));
    }
    let mut body = Vec::new();
    stream.take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(ErrorKind::UnexpectedEof.into());
    }
    serde_json::from_slice(&body).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
}

/// Reads that all end by one deadline.
struct ByDeadline<'a> {
    stream: &'a mut TcpStream,
    deadline: Instant,
}

impl Read for ByDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

/// Hex encoding for address blobs in [`PeerInfo::addresses`].
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{
        bind, connect, getsockname, socket, AddressFamily, SocketAddrV4, SocketType,
    };

    #[test]
    fn a_connection_to_itself_is_not_the_rendezvous() {
        // Bound to a port and connected to that same port: Linux joins the
        // socket to itself, as a retrying client's connect can by chance.
        let sock = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
        bind(&sock, &SocketAddrV4::new([127, 0, 0, 1].into(), 0)).unwrap();
        let own = getsockname(&sock).unwrap();
        connect(&sock, &own).unwrap();
        let err = not_to_itself(TcpStream::from(sock)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ConnectionRefused);

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let to_listener = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(not_to_itself(to_listener).is_ok());
    }

    fn info(rank: Rank) -> PeerInfo {
        PeerInfo::new(rank, BTreeMap::new(), String::new())
    }

    /// A stranger, a trickler and bad joins of the job's own kind are each
    /// refused alone; the honest ranks still form the job.
    #[test]
    fn bad_joins_are_refused_without_ending_the_job() {
        let server = Server::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = server.local_addr();
        let deadline = Instant::now() + Duration::from_secs(20);
        let serving = server.spawn(Some(2), 7, deadline);
        // Connects and says nothing; another sends a byte and stops.
        let _silent = TcpStream::connect(addr).unwrap();
        let mut trickle = TcpStream::connect(addr).unwrap();
        trickle.write_all(&[1]).unwrap();
        let bad = |job: u128, size: usize, rank: Rank| {
            join(addr, job, size, info(rank), deadline).unwrap_err()
        };
        assert!(bad(8, 2, 0).contains("did not prove this job's token"));
        assert!(bad(7, 1 << 50, 0).contains("not between 1 and"));
        assert!(bad(7, 3, 0).contains("but the job has 2 ranks"));
        assert!(bad(7, 2, 5).contains("is not below"));
        let first = std::thread::spawn(move || join(addr, 7, 2, info(0), deadline));
        std::thread::sleep(Duration::from_millis(200));
        assert!(bad(7, 2, 0).contains("joined twice"));
        let second = join(addr, 7, 2, info(1), deadline).unwrap();
        let first = first.join().unwrap().unwrap();
        assert_eq!(first.peers.len(), 2);
        assert_eq!((first.session, second.peers[1].rank), (second.session, 1));
        serving.join().unwrap().unwrap();
    }

    /// A job larger than the relay's fanout: the table reaches every rank,
    /// most of them through other ranks, the same everywhere.
    #[test]
    fn the_table_reaches_every_rank_down_the_tree() {
        let size = 3 * relay::FANOUT + 1;
        let server = Server::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = server.local_addr();
        let deadline = Instant::now() + Duration::from_secs(30);
        let serving = server.spawn(Some(size), 9, deadline);
        let joins: Vec<_> = (0..size)
            .map(|r| std::thread::spawn(move || join(addr, 9, size, info(r), deadline)))
            .collect();
        let tables: Vec<Table> = joins
            .into_iter()
            .map(|j| j.join().unwrap().unwrap())
            .collect();
        for t in &tables {
            assert_eq!(t.session, tables[0].session);
            let ranks: Vec<Rank> = t.peers.iter().map(|p| p.rank).collect();
            assert_eq!(ranks, (0..size).collect::<Vec<_>>());
        }
        serving.join().unwrap().unwrap();
    }

    /// The relay takes its table only from a connection with the session:
    /// a stranger's, a wrong session's or a short table is ignored.
    #[test]
    fn the_relay_ignores_strangers() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut silent = TcpStream::connect(at).unwrap();
        silent.write_all(&[9]).unwrap();
        drop(silent);
        let table = vec![info(0), info(1)];
        let (bad, good) = (5, 6);
        let _silent = TcpStream::connect(at).unwrap();
        relay::pass_on(&relay::Relay::new(bad, &table), &[at], deadline);
        relay::pass_on(&relay::Relay::new(good, &table[..1]), &[at], deadline);
        relay::pass_on(&relay::Relay::new(good, &table), &[at], deadline);
        let (_, got) = relay::await_table(&listener, good, 0, 2, deadline).unwrap();
        assert_eq!(got.len(), 2);
        let soon = Instant::now() + Duration::from_millis(300);
        let e = relay::await_table(&listener, good, 0, 2, soon).unwrap_err();
        assert!(e.contains("rank 0 never passed on"), "{e}");
    }

    #[test]
    fn a_join_must_arrive_whole_by_its_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server_side, _) = listener.accept().unwrap();
        client.write_all(&100u32.to_le_bytes()).unwrap();
        client.write_all(b"{").unwrap();
        let within = Instant::now() + Duration::from_millis(300);
        let e = receive_by::<Join>(&mut server_side, MAX_JOIN_BYTES, within).unwrap_err();
        assert!(
            matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock),
            "{e}"
        );
        assert!(Instant::now() < within + Duration::from_secs(1));
        let mut big = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        big.write_all(&(2u32 << 20).to_le_bytes()).unwrap();
        let (mut other, _) = listener.accept().unwrap();
        let within = Instant::now() + Duration::from_secs(5);
        let e = receive_by::<Join>(&mut other, MAX_JOIN_BYTES, within).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidData, "{e}");
    }
}
