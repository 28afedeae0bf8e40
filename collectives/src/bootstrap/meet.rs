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
use transport::shm::peer_of_this_user;

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
            secret,
        } => {
            if !secret && hosting {
                tracing::warn!(
                    "the job's token is derived from MASTER_ADDR:MASTER_PORT ({addr}) and its size: \
                     anyone who can reach that port can join; set {} to a random hex secret, the \
                     same on every rank, to require it",
                    super::TOKEN_VAR
                );
            }
            let server = (hosting && !hosted_elsewhere)
                .then(|| Server::bind(*addr))
                .transpose()?;
            run(server, *addr, *token, boot, me, deadline)
        }
        Meeting::Pmi { fd } => {
            let mut pmi = Pmi::connect(*fd, deadline.saturating_duration_since(Instant::now()))?;
            let server = if hosting {
                let server = Server::bind(SocketAddr::new(boot.local_ip()?, 0))?;
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
            let bind = || Server::bind(SocketAddr::new(boot.local_ip()?, 0));
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
        let (flag, name) = (stop.clone(), name.to_string());
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) && Instant::now() < deadline {
                match listener.accept() {
                    // Another user's process learns nothing (abstract
                    // sockets have no permissions: the kernel says who it is).
                    Ok((mut s, _)) => match peer_of_this_user(&s) {
                        Ok(_) => {
                            let _ = s.set_nonblocking(false);
                            let _ = s.write_all(line.as_bytes());
                        }
                        Err(e) => tracing::warn!("the rendezvous announcement on @{name}: {e}"),
                    },
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
                // Whoever holds the name first is not trusted for it: a
                // process of another user may have taken it.
                peer_of_this_user(&s).map_err(|e| format!("the rendezvous announcement on @{name}: {e}"))?;
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

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    use super::*;

    /// Runs a Python script as user `nobody`, or `None` when this test
    /// cannot (not root, or no python3).
    fn as_nobody(script: &str) -> Option<std::process::Child> {
        if !rustix::process::getuid().is_root() {
            eprintln!("skipped: needs root to run a process as another user");
            return None;
        }
        Command::new("python3")
            .args(["-c", script])
            .uid(65534)
            .gid(65534)
            .stdout(Stdio::piped())
            .spawn()
            .ok()
    }

    /// Another user who takes the name first gets no rank to join it, and
    /// one who asks rank 0's announcement gets nothing.
    #[test]
    fn another_users_process_neither_squats_nor_reads_the_announcement() {
        let name = format!("coll-test-squat-{}", std::process::id());
        let squat = format!(
            "import socket,time\ns=socket.socket(socket.AF_UNIX)\ns.bind('\\0{name}')\ns.listen()\n\
             print('up',flush=True)\nc,_=s.accept()\nc.sendall(b'127.0.0.1:1/{:032x}\\n')\ntime.sleep(1)",
            7
        );
        let Some(mut squatter) = as_nobody(&squat) else {
            return;
        };
        let mut up = String::new();
        BufReader::new(squatter.stdout.take().unwrap())
            .read_line(&mut up)
            .unwrap();
        let e = listen_for(&name, Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(e.contains("uid 65534"), "{e}");
        let _ = squatter.kill();
        let _ = squatter.wait();

        let name = format!("coll-test-read-{}", std::process::id());
        let deadline = Instant::now() + Duration::from_secs(10);
        let announcer = Announcer::start(&name, "127.0.0.1:1/secret", deadline).unwrap();
        let read = format!(
            "import socket\ns=socket.socket(socket.AF_UNIX)\ns.connect('\\0{name}')\n\
             s.settimeout(2)\ntry: print(repr(s.recv(100)))\nexcept Exception as e: print('nothing')"
        );
        let reader = as_nobody(&read).unwrap().wait_with_output().unwrap();
        let said = String::from_utf8_lossy(&reader.stdout);
        assert!(
            !said.contains("secret"),
            "another user read the announcement: {said}"
        );
        assert_eq!(
            listen_for(&name, deadline).unwrap().trim(),
            "127.0.0.1:1/secret"
        );
        announcer.stop();
    }
}
