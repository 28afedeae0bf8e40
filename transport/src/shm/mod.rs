//! Shared-memory transport, for ranks on one host.
//!
//! Each connection owns a segment of two single-producer/single-consumer slot
//! rings (see `segment`), created with `memfd_create` and handed to the peer
//! over a Unix socket with `SCM_RIGHTS`: it never has a name in /dev/shm,
//! so even a SIGKILLed job leaves nothing behind. Small messages are copied
//! through the slots (two copies, no system call); large ones are described
//! in a slot and read by the receiver straight from the sender's memory with
//! `process_vm_readv` (cross-memory attach, one copy, as Open MPI's shared
//! memory path does) when both sides may; into memory whose owner allows
//! it, the sender may copy one itself while the receiver is busy with
//! another (`segment::Help`). A large message from a [`SharedBuffer`]
//! (memory the sender allocated to be mapped) is read instead through the
//! receiver's mapping of it, with `memcpy` (`peer_maps`). The Unix socket
//! stays open beside the rings as doorbell, abort channel and death
//! detector.
//!
//! Listening addresses are abstract Unix socket names: nothing on disk, and
//! private to the network namespace, like the host identity the bootstrap
//! uses to decide which ranks share memory.

mod connection;
mod costs;
#[cfg(test)]
mod hostile;
mod memfd;
mod peer_maps;
mod segment;
mod shared_buffer;

use std::io::{ErrorKind, Read, Write};
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

pub use connection::ShmConnection;
pub use memfd::{check_sealed, sealed_memfd};
use segment::Segment;
pub use shared_buffer::SharedBuffer;

use crate::wire::{self, ACK_LEN, HELLO_LEN};
use crate::{Connection, Error, Hello, Listener, MemRegion, Rank, Result, Transport};

/// A word whose address peers read with `process_vm_readv` to learn whether
/// cross-memory attach works between us (ptrace rules, seccomp, containers).
static PROBE: u64 = 0x636f_6c6c_7072_6f62;

/// Tuning knobs of the shared-memory transport.
#[derive(Clone, Copy, Debug)]
pub struct ShmOptions {
    /// Let receivers read large messages straight from the sender's memory
    /// (`process_vm_readv`) when the kernel allows; off means every byte is
    /// copied through the rings.
    pub single_copy: bool,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions { single_copy: true }
    }
}

/// Bytes of shared memory one connection holds when this process reaches
/// up to `peers` ranks of its host (its segment, every page touched).
pub fn connection_bytes(peers: usize) -> usize {
    segment::segment_bytes(segment::slot_bytes_for(peers))
}

/// Shared-memory transport.
#[derive(Debug, Default)]
pub struct ShmTransport {
    options: ShmOptions,
    /// The most ranks of this host a communicator of this process reaches
    /// (see [`Transport::expect_peers`]): what sizes a new segment's slots.
    peers: std::sync::atomic::AtomicUsize,
}

impl ShmTransport {
    pub fn new(options: ShmOptions) -> Self {
        ShmTransport {
            options,
            peers: Default::default(),
        }
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn listen(&self) -> Result<Box<dyn Listener>> {
        let random = u64::from_le_bytes(crate::proof::random());
        let name = format!("coll-shm-{}-{random:016x}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io(None, "listen", &e))?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| Error::io(None, "listen", &e))?;
        Ok(Box::new(ShmListener {
            listener,
            name,
            options: self.options,
            replays: Default::default(),
        }))
    }

    fn connect(
        &self,
        address: &[u8],
        hello: Hello,
        deadline: Instant,
    ) -> Result<Box<dyn Connection>> {
        Ok(Box::new(self.dial(address, hello, deadline)?))
    }

    fn expect_peers(&self, peers: usize) {
        (self.peers).fetch_max(peers, std::sync::atomic::Ordering::Relaxed);
    }

    fn register(&self, addr: *const u8, len: usize) -> Result<MemRegion> {
        // Peers read our memory by address (or we copy it into the rings):
        // nothing to pin. A range in a `SharedBuffer` carries where it lies,
        // for the receivers of its sends to map (looked up once here, not
        // per send).
        Ok(match shared_buffer::region_of(addr as usize, len) {
            Some(r) => MemRegion::new(addr, len, Box::new(r)),
            None => MemRegion::plain(addr, len),
        })
    }
}

impl ShmTransport {
    /// Connects to the listener at `address`: the segment is ours, made
    /// before we call, and goes to the peer with our hello.
    fn dial(&self, address: &[u8], hello: Hello, deadline: Instant) -> Result<ShmConnection> {
        let peer = Some(hello.to);
        let io = |what| move |e: std::io::Error| Error::io(peer, what, &e);
        let addr = SocketAddr::from_abstract_name(address).map_err(io("connect"))?;
        // Made (every page touched) before we connect: the listener gives
        // a caller `HELLO_WITHIN` to say hello.
        let peers = self.peers.load(std::sync::atomic::Ordering::Relaxed);
        let seg = Segment::create(segment::slot_bytes_for(peers))
            .map_err(io("create the shared segment"))?;
        let mut ctl = UnixStream::connect_addr(&addr).map_err(|e| match e.kind() {
            ErrorKind::ConnectionRefused | ErrorKind::NotFound => Error::Invalid(format!(
                "peer rank {} has no shared-memory listener here: it left, or is on another host or in another network namespace",
                hello.to
            )),
            _ => Error::io(peer, "connect", &e),
        })?;
        // Our segment goes to a process of our own user only.
        let pid = peer_of_this_user(&ctl)
            .map_err(|e| Error::Invalid(format!("peer rank {}: {e}", hello.to)))?;
        set_timeouts(&ctl, deadline).map_err(io("connect"))?;
        // hello and our probe address, with the segment's fd attached (no
        // pid: the kernel says who we are).
        let (greeting, nonce) = wire::encode_hello(&hello, address);
        let mut msg = greeting.to_vec();
        msg.extend_from_slice(&(&PROBE as *const u64 as u64).to_le_bytes());
        send_with_fd(&ctl, &msg, seg.fd()).map_err(io("send hello"))?;
        // ack, their probe address, and whether they can read us.
        let mut reply = [0u8; ACK_LEN + 8 + 1];
        ctl.read_exact(&mut reply).map_err(|e| match e.kind() {
            ErrorKind::UnexpectedEof => Error::Invalid(format!(
                "peer rank {} refused our connection (another job?)",
                hello.to
            )),
            _ => Error::io(peer, "wait for hello acknowledgement", &e),
        })?;
        let ack = reply[..ACK_LEN].try_into().unwrap();
        if wire::decode_ack(ack, hello.token, &nonce) != Some(hello.to) {
            return Err(Error::Invalid(format!(
                "expected peer rank {} at its shared-memory address, holding this job's token",
                hello.to
            )));
        }
        let (probe, they_read_us) = parse_identity(&reply[ACK_LEN..]);
        let we_read_them = probe_remote(pid, probe);
        ctl.write_all(&[we_read_them as u8])
            .map_err(io("finish the handshake"))?;
        let remote_reads = we_read_them && they_read_us;
        log_mode(hello.to, remote_reads);
        ShmConnection::new(seg, ctl, hello.to, pid, 0, remote_reads)
    }
}

/// How long a caller has to say hello (a peer that waits for a core,
/// ranks outnumbering cores, may take a while; a stranger gets no longer).
const HELLO_WITHIN: Duration = Duration::from_secs(2);

/// Listens on an abstract Unix socket.
pub struct ShmListener {
    listener: UnixListener,
    name: String,
    options: ShmOptions,
    replays: crate::proof::Replays,
}

impl Listener for ShmListener {
    fn address(&self) -> Vec<u8> {
        self.name.clone().into_bytes()
    }

    fn accept(
        &mut self,
        token: u128,
        me: Rank,
        deadline: Instant,
    ) -> Result<(Hello, Box<dyn Connection>)> {
        loop {
            let ctl = self.accept_one(deadline)?;
            let at = self.name.as_bytes();
            match handshake(ctl, token, me, at, self.options, &mut self.replays) {
                Ok(accepted) => return Ok(accepted),
                Err(why) => tracing::warn!("refused a shared-memory connection: {why}"),
            }
        }
    }
}

impl ShmListener {
    fn accept_one(&self, deadline: Instant) -> Result<UnixStream> {
        self.listener
            .set_nonblocking(true)
            .map_err(|e| Error::io(None, "accept", &e))?;
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)
                        .map_err(|e| Error::io(None, "accept", &e))?;
                    return Ok(s);
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(e) => return Err(Error::io(None, "accept", &e)),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let e = std::io::Error::new(ErrorKind::TimedOut, "no peer arrived in time");
                return Err(Error::io(None, "accept", &e));
            }
            let ts = rustix::event::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as i64,
            };
            let mut fds = [rustix::event::PollFd::new(
                &self.listener,
                rustix::event::PollFlags::IN,
            )];
            let _ = rustix::event::poll(&mut fds, Some(&ts));
        }
    }
}

/// The accepting side of the handshake; `Err` says why a caller is refused.
fn handshake(
    mut ctl: UnixStream,
    token: u128,
    me: Rank,
    address: &[u8],
    options: ShmOptions,
    replays: &mut crate::proof::Replays,
) -> std::result::Result<(Hello, Box<dyn Connection>), String> {
    // Another user's process learns nothing and maps nothing of ours.
    let pid = peer_of_this_user(&ctl)?;
    // A caller gets `HELLO_WITHIN` to say hello (the accepting thread
    // serves one at a time), then the handshake's time to finish, whatever
    // the wait for it was.
    set_timeouts(&ctl, Instant::now() + HELLO_WITHIN).map_err(|e| e.to_string())?;
    let mut msg = [0u8; HELLO_LEN + 8];
    let fd = recv_with_fd(&ctl, &mut msg).map_err(|e| format!("no hello: {e}"))?;
    let heard = wire::decode_hello(msg[..HELLO_LEN].try_into().unwrap())
        .map_err(|e| format!("bad hello: {e:?}"))?;
    let hello = wire::accept_hello(&heard, token, me, address, replays)?;
    set_timeouts(&ctl, crate::handshake_deadline(Instant::now())).map_err(|e| e.to_string())?;
    let seg = Segment::open(fd.ok_or("no segment attached")?)
        .map_err(|e| format!("cannot map the segment of rank {}: {e}", hello.from))?;
    let (probe, _) = parse_identity(&msg[HELLO_LEN..]);
    let we_read_them = options.single_copy && probe_remote(pid, probe);
    let mut reply = wire::encode_ack(me, token, &heard.nonce).to_vec();
    reply.extend_from_slice(&(&PROBE as *const u64 as u64).to_le_bytes());
    reply.push(we_read_them as u8);
    ctl.write_all(&reply).map_err(|e| e.to_string())?;
    let mut they_read_us = [0u8];
    ctl.read_exact(&mut they_read_us)
        .map_err(|e| e.to_string())?;
    let remote_reads = we_read_them && they_read_us[0] == 1;
    log_mode(hello.from, remote_reads);
    let conn = ShmConnection::new(seg, ctl, hello.from, pid, 1, remote_reads)
        .map_err(|e| e.to_string())?;
    Ok((hello, Box::new(conn)))
}

fn log_mode(peer: Rank, remote_reads: bool) {
    if remote_reads {
        tracing::debug!(
            peer,
            "shared memory with single-copy reads (process_vm_readv)"
        );
    } else {
        tracing::info!(peer, "shared memory without process_vm_readv (ptrace rules or seccomp forbid it): large messages take two copies");
    }
}

/// The probe address and (for replies) the peer's verdict, little-endian;
/// missing bytes read as zeros (address 0 fails the probe). A peer's pid
/// is not in it: it comes from the kernel (`SO_PEERCRED`), never from what
/// the peer says.
pub(crate) fn parse_identity(b: &[u8]) -> (u64, bool) {
    let mut f = [0u8; 9];
    let n = b.len().min(f.len());
    f[..n].copy_from_slice(&b[..n]);
    (u64::from_le_bytes(f[0..8].try_into().unwrap()), f[8] == 1)
}

/// The pid of the process at the other end of a Unix socket, from the
/// kernel (`SO_PEERCRED`), not from what it says; a process of another user
/// is refused (it may not share memory with this rank, nor learn a job's
/// secrets from it).
pub fn peer_of_this_user(s: &UnixStream) -> std::result::Result<i32, String> {
    let cred = rustix::net::sockopt::socket_peercred(s)
        .map_err(|e| format!("cannot learn who is at the other end of the socket: {e}"))?;
    let (theirs, ours) = (cred.uid.as_raw(), rustix::process::getuid().as_raw());
    let pid = cred.pid.as_raw_nonzero().get();
    match theirs == ours {
        true => Ok(pid),
        false => Err(format!(
            "pid {pid} of uid {theirs} is at the other end, not a process of this user (uid {ours})"
        )),
    }
}

/// Whether we can read the peer's memory with process_vm_readv.
fn probe_remote(pid: i32, addr: u64) -> bool {
    let mut v = 0u64;
    connection::read_remote(pid, addr as usize, (&mut v as *mut u64).cast(), 8).is_ok()
        && v == PROBE
}

fn set_timeouts(s: &UnixStream, deadline: Instant) -> std::io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))
}

fn send_with_fd(
    s: &UnixStream,
    bytes: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<()> {
    let fds = [fd];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    anc.push(SendAncillaryMessage::ScmRights(&fds));
    let n = rustix::net::sendmsg(
        s,
        &[std::io::IoSlice::new(bytes)],
        &mut anc,
        SendFlags::NOSIGNAL,
    )?;
    if n != bytes.len() {
        return Err(std::io::Error::new(ErrorKind::WriteZero, "short hello"));
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes; returns the fd that came with them, if any.
fn recv_with_fd(s: &UnixStream, buf: &mut [u8]) -> std::io::Result<Option<OwnedFd>> {
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        s,
        &mut [std::io::IoSliceMut::new(buf)],
        &mut anc,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fd = None;
    for msg in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(mut fds) = msg {
            fd = fds.next();
        }
    }
    let mut have = got.bytes;
    while have < buf.len() {
        let n = (&*s).read(&mut buf[have..])?;
        if n == 0 {
            return Err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                "connection closed",
            ));
        }
        have += n;
    }
    Ok(fd)
}
