//! Meeting the other ranks: find (or host) the rendezvous, then join it.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::pmi::Pmi;
use super::rendezvous::{self, PeerInfo, Server, Table};
use super::{random_token, Bootstrap, Meeting};

/// The PMI key under which rank 0 publishes its rendezvous.
const PMI_KEY: &str = "coll-rendezvous";

/// Meets the other ranks of `boot`'s job and returns everyone's info.
pub(crate) fn meet(boot: &Bootstrap, me: PeerInfo, deadline: Instant) -> Result<Table, String> {
    let Some(meeting) = &boot.meeting else {
        return Ok(Table {
            session: 0,
            peers: vec![me],
        });
    };
    let hosting = boot.rank == 0;
    match meeting {
        Meeting::Address {
            addr,
            hosted_elsewhere,
            token,
        } => {
            let server = (hosting && !hosted_elsewhere)
                .then(|| Server::bind(*addr))
                .transpose()?;
            run(server, *addr, *token, boot, me, deadline)
        }
        Meeting::Pmi { fd } => {
            let mut pmi = Pmi::connect(*fd, deadline.saturating_duration_since(Instant::now()))?;
            let server = if hosting {
                let server = Server::bind(SocketAddr::new(boot.local_ip(), 0))?;
                let token = random_token();
                pmi.put(PMI_KEY, &format!("{}/{token:032x}", server.local_addr()))?;
                Some(server)
            } else {
                None
            };
            pmi.barrier()?;
            let (addr, token) = parse_announcement(&pmi.get(PMI_KEY)?)?;
            pmi.finalize()?;
            run(server, addr, token, boot, me, deadline)
        }
        #[cfg(feature = "mpi")]
        Meeting::Mpi => {
            let bind = || Server::bind(SocketAddr::new(boot.local_ip(), 0));
            let server = if hosting { Some(bind()) } else { None };
            let token = random_token();
            let announcement = server.as_ref().map(|s| {
                s.as_ref()
                    .map(|s| format!("{}/{token:032x}", s.local_addr()))
                    .map_err(Clone::clone)
            });
            let text = super::mpi::broadcast(boot, announcement)?;
            let (addr, token) = parse_announcement(&text)?;
            run(server.transpose()?, addr, token, boot, me, deadline)
        }
        Meeting::Local { key } => {
            let name = format!("coll-rendezvous-{key}");
            if hosting {
                let server = Server::bind("127.0.0.1:0".parse().unwrap())?;
                let (addr, token) = (server.local_addr(), random_token());
                let announcer = Announcer::start(&name, &format!("{addr}/{token:032x}"), deadline)?;
                let table = run(Some(server), addr, token, boot, me, deadline);
                announcer.stop();
                table
            } else {
                let (addr, token) = parse_announcement(&listen_for(&name, deadline)?)?;
                run(None, addr, token, boot, me, deadline)
            }
        }
    }
}

/// Serves the rendezvous if we host it, and joins it.
fn run(
    server: Option<Server>,
    addr: SocketAddr,
    token: u128,
    boot: &Bootstrap,
    me: PeerInfo,
    deadline: Instant,
) -> Result<Table, String> {
    let server = server.map(|s| s.spawn(Some(boot.size), token, deadline));
    let table = rendezvous::join(addr, token, boot.size, me, deadline);
    if let Some(server) = server {
        match server.join() {
            Ok(Err(e)) if table.is_ok() => return Err(e),
            Err(_) => return Err("the rendezvous thread panicked".into()),
            _ => {}
        }
    }
    table
}

/// `ip:port/token` as rank 0 announces it.
pub(crate) fn parse_announcement(text: &str) -> Result<(SocketAddr, u128), String> {
    let bad = || format!("rank 0 announced a rendezvous I cannot read: {text:?}");
    let (addr, token) = text.trim().split_once('/').ok_or_else(bad)?;
    Ok((
        addr.parse().map_err(|_| bad())?,
        u128::from_str_radix(token, 16).map_err(|_| bad())?,
    ))
}

/// Answers every connection to an abstract Unix socket with one line,
/// until stopped: how rank 0 tells the ranks of its host where to meet.
struct Announcer {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Announcer {
    fn start(name: &str, line: &str, deadline: Instant) -> Result<Self, String> {
        let addr = UnixAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| {
            format!("cannot announce the rendezvous on @{name}: {e} (another job of this launcher with the same size?)")
        })?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let (stop, line) = (Arc::new(AtomicBool::new(false)), format!("{line}\n"));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) && Instant::now() < deadline {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        let _ = s.set_nonblocking(false);
                        let _ = s.write_all(line.as_bytes());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(Announcer { stop, thread })
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}

/// Reads rank 0's announcement, retrying until rank 0 is up or `deadline`.
fn listen_for(name: &str, deadline: Instant) -> Result<String, String> {
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
    loop {
        match UnixStream::connect_addr(&addr) {
            Ok(s) => {
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let mut line = String::new();
                BufReader::new(s).read_line(&mut line).map_err(|e| format!("reading rank 0's announcement: {e}"))?;
                return Ok(line);
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                return Err(format!(
                    "rank 0 never announced the rendezvous on @{name} ({e}): is rank 0 running on this host? \
                     (without MASTER_ADDR, ranks meet this way only when they all share one host)"
                ))
            }
        }
    }
}
