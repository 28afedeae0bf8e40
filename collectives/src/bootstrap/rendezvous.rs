//! The rendezvous: one TCP server (in rank 0, or in the launcher) where every
//! rank posts who it is and how to reach it, and gets everyone's answer once
//! all have arrived. Messages are length-prefixed JSON; it runs once per job.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use transport::Rank;

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

#[derive(Serialize, Deserialize)]
pub(crate) struct Join {
    job: String,
    size: usize,
    info: PeerInfo,
}

#[derive(Serialize, Deserialize)]
pub(crate) enum Reply {
    Welcome {
        session: String,
        peers: Vec<PeerInfo>,
    },
    Refused {
        reason: String,
    },
}

/// What every rank learns at the rendezvous.
#[derive(Clone, Debug)]
pub struct Table {
    /// Token every transport connection of this job presents.
    pub session: u128,
    /// Everyone's info, indexed by rank.
    pub peers: Vec<PeerInfo>,
}

/// A bound rendezvous server, not yet serving.
pub struct Server {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Server {
    /// Binds `addr`, with messages that say what to do when it cannot.
    pub fn bind(addr: SocketAddr) -> Result<Self, String> {
        let listener = TcpListener::bind(addr).map_err(|e| match e.kind() {
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
        let (tx, rx) = mpsc::channel::<(TcpStream, Join)>();
        self.listener
            .set_nonblocking(true)
            .map_err(|e| e.to_string())?;
        let mut joined: Vec<Option<(TcpStream, PeerInfo)>> = Vec::new();
        let mut size = size;
        if let Some(n) = size {
            joined.resize_with(n, || None);
        }
        let mut count = 0;
        let job_hex = format!("{job:032x}");
        while size != Some(count) {
            if Instant::now() >= deadline {
                let size = size.unwrap_or(0);
                let missing: Vec<Rank> = (0..size).filter(|r| joined[*r].is_none()).collect();
                let reason = format!(
                    "Timed out waiting: rank(s) {missing:?} of {size} did not reach the rendezvous at {} in time \
                     (did they start? do MASTER_ADDR/MASTER_PORT match?)",
                    self.addr
                );
                refuse_all(&mut joined, &reason);
                return Err(reason);
            }
            self.accept_pending(&tx);
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok((mut stream, j)) => {
                    if j.job != job_hex {
                        tracing::warn!("rendezvous refused rank {} from another job", j.info.rank);
                        let _ = send(
                            &mut stream,
                            &Reply::Refused {
                                reason: "another job's rendezvous".into(),
                            },
                        );
                        continue;
                    }
                    let size = *size.get_or_insert(j.size);
                    joined.resize_with(size, || None);
                    let problem = if j.size != size {
                        Some(format!(
                            "rank {} says WORLD_SIZE={} but the job has {size} ranks",
                            j.info.rank, j.size
                        ))
                    } else if j.info.rank >= size {
                        Some(format!(
                            "rank {} is not below WORLD_SIZE={size}",
                            j.info.rank
                        ))
                    } else if let Some((_, first)) = &joined[j.info.rank] {
                        Some(format!(
                            "rank {} joined twice (pids {} and {})",
                            j.info.rank, first.pid, j.info.pid
                        ))
                    } else {
                        None
                    };
                    if let Some(reason) = problem {
                        let _ = send(
                            &mut stream,
                            &Reply::Refused {
                                reason: reason.clone(),
                            },
                        );
                        refuse_all(&mut joined, &reason);
                        return Err(reason);
                    }
                    tracing::debug!(rank = j.info.rank, host = %j.info.hostname, "joined the rendezvous");
                    let r = j.info.rank;
                    joined[r] = Some((stream, j.info));
                    count += 1;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => unreachable!("we hold a sender"),
            }
        }
        let peers: Vec<PeerInfo> = joined
            .iter()
            .map(|j| j.as_ref().unwrap().1.clone())
            .collect();
        let welcome = Reply::Welcome {
            session: format!("{:032x}", super::random_token()),
            peers,
        };
        for (stream, info) in joined.iter_mut().flatten() {
            if let Err(e) = send(stream, &welcome) {
                tracing::warn!(rank = info.rank, "could not answer at the rendezvous: {e}");
            }
        }
        Ok(())
    }

    /// Accepts waiting connections; a thread per connection reads its request,
    /// so a silent stranger holds up nobody.
    fn accept_pending(&self, tx: &mpsc::Sender<(TcpStream, Join)>) {
        while let Ok((mut stream, from)) = self.listener.accept() {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                match receive::<Join>(&mut stream) {
                    Ok(j) => {
                        let _ = stream.set_read_timeout(None);
                        let _ = tx.send((stream, j));
                    }
                    Err(e) => tracing::warn!(%from, "rendezvous ignored a connection: {e}"),
                }
            });
        }
    }
}

fn refuse_all(joined: &mut [Option<(TcpStream, PeerInfo)>], reason: &str) {
    for (stream, _) in joined.iter_mut().flatten() {
        let _ = send(
            stream,
            &Reply::Refused {
                reason: reason.into(),
            },
        );
    }
}

/// Joins the rendezvous at `addr` and waits for everyone's info until `deadline`.
pub fn join(
    addr: SocketAddr,
    job: u128,
    size: usize,
    me: PeerInfo,
    deadline: Instant,
) -> Result<Table, String> {
    let mut stream = connect(addr, deadline)?;
    let request = Join {
        job: format!("{job:032x}"),
        size,
        info: me,
    };
    send(&mut stream, &request).map_err(|e| format!("rendezvous at {addr}: {e}"))?;
    // Wait a little past our own deadline: the rendezvous gives up at its
    // own, and only its answer can say which ranks never came.
    let left = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(2);
    stream
        .set_read_timeout(Some(left))
        .map_err(|e| e.to_string())?;
    match receive::<Reply>(&mut stream) {
        Ok(Reply::Welcome { session, peers }) => Ok(Table {
            session: u128::from_str_radix(&session, 16).map_err(|e| e.to_string())?,
            peers,
        }),
        Ok(Reply::Refused { reason }) => Err(format!("the rendezvous at {addr} refused the job: {reason}")),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Err(format!(
            "Timed out waiting: not every rank reached the rendezvous at {addr} in time (started all {size}? same MASTER_ADDR/MASTER_PORT?)"
        )),
        Err(e) => Err(format!("rendezvous at {addr}: {e}")),
    }
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
    let body = serde_json::to_vec(msg)?;
    stream.write_all(&(body.len() as u32).to_le_bytes())?;
    stream.write_all(&body)
}

/// One length-prefixed JSON message (at most 64 MiB: a stranger's length
/// prefix allocates nothing beyond what it sends, up to that bound).
pub(crate) fn receive<T: for<'de> Deserialize<'de>>(stream: &mut impl Read) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 64 << 20 {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "oversized rendezvous message",
        ));
    }
    let mut body = Vec::new();
    stream.take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(ErrorKind::UnexpectedEof.into());
    }
    serde_json::from_slice(&body).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
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
}
