//! TCP transport: two streams per peer (see `connection`), messages framed by a 32-byte header
//! (see `wire`), read straight into the posted buffer, written straight from
//! the sent one. The kernel's socket buffers are the bounded staging and TCP's
//! window is the credit: a receiver that posts no receive stops reading, its
//! window closes, and its sender's `progress` stops moving.

mod connection;
mod listener;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use socket2::SockRef;

pub use connection::TcpConnection;
pub use listener::TcpListener;

use crate::wire::{self, ACK_LEN};
use crate::{Connection, Error, Hello, Listener, MemRegion, Result, Transport};

/// Tuning knobs of the TCP transport.
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpOptions {
    /// `SO_SNDBUF`/`SO_RCVBUF` in bytes. `None` (the default) leaves Linux's
    /// autotuning on, which grows buffers up to `net.ipv4.tcp_{w,r}mem`,
    /// except for the send buffer of a connection within the host
    /// ([`SAME_HOST_SEND_BUFFER`]); setting a size turns autotuning off and
    /// is capped by `net.core.{w,r}mem_max`.
    pub socket_buffer: Option<usize>,
}

/// TCP transport bound to one local address.
#[derive(Debug)]
pub struct TcpTransport {
    bind_ip: IpAddr,
    options: TcpOptions,
}

impl TcpTransport {
    /// A transport whose listeners bind `bind_ip` (the address peers reach us at).
    pub fn new(bind_ip: IpAddr, options: TcpOptions) -> Self {
        TcpTransport { bind_ip, options }
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn listen(&self) -> Result<Box<dyn Listener>> {
        Ok(Box::new(TcpListener::bind(self.bind_ip, self.options)?))
    }

    fn connect(
        &self,
        address: &[u8],
        hello: Hello,
        deadline: Instant,
    ) -> Result<Box<dyn Connection>> {
        // Two lanes (see `TcpConnection`), dialled one after the other: the
        // second only once the first is acknowledged, so the listener
        // tells them apart by their order (see `TcpListener::accept`).
        let first = connect_greeted(address, hello, self.options, deadline)?;
        let second = connect_greeted(address, hello, self.options, deadline)?;
        Ok(Box::new(TcpConnection::new(
            [first, second],
            true,
            hello.to,
        )?))
    }

    fn register(&self, addr: *const u8, len: usize) -> Result<MemRegion> {
        // Sockets read and write any memory: nothing to pin.
        Ok(MemRegion::plain(addr, len))
    }
}

/// Connects to the listener at `address` (an `ip:port` blob), says `hello`
/// and waits for the acknowledgement: a stream to the right peer of the
/// right job. The verbs transport uses it as its side channel too.
pub(crate) fn connect_greeted(
    address: &[u8],
    hello: Hello,
    options: TcpOptions,
    deadline: Instant,
) -> Result<TcpStream> {
    let addr = parse_address(address)?;
    let peer = Some(hello.to);
    let mut stream = connect_with_retry(addr, hello, deadline)?;
    configure(&stream, options).map_err(|e| Error::io(peer, "configure socket", &e))?;
    let (greeting, nonce) = wire::encode_hello(&hello, address);
    stream
        .set_write_timeout(Some(remaining(deadline)))
        .and_then(|_| stream.write_all(&greeting))
        .map_err(|e| Error::io(peer, "send hello", &e))?;
    let mut ack = [0u8; ACK_LEN];
    stream
        .set_read_timeout(Some(remaining(deadline)))
        .and_then(|_| stream.read_exact(&mut ack))
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::Invalid(format!(
                "peer rank {} at {addr} refused our connection (another job's listener?)",
                hello.to
            )),
            _ => Error::io(peer, "wait for hello acknowledgement", &e),
        })?;
    match wire::decode_ack(&ack, hello.token, &nonce) {
        Some(r) if r == hello.to => Ok(stream),
        Some(r) => Err(Error::Invalid(format!(
            "expected peer rank {} at {addr}, found rank {r}",
            hello.to
        ))),
        None => Err(Error::Invalid(format!(
            "the listener at {addr} did not prove it holds this job's token: not peer rank {}",
            hello.to
        ))),
    }
}

pub(crate) fn parse_address(blob: &[u8]) -> Result<SocketAddr> {
    std::str::from_utf8(blob)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            Error::Invalid(format!(
                "bad TCP address blob {:?}",
                String::from_utf8_lossy(blob)
            ))
        })
}

/// Connects, retrying failures until `deadline` (a listener's backlog can
/// overflow when many ranks connect at once), refusals for a second at
/// most: a port nobody listens on any more is a peer that left.
fn connect_with_retry(addr: SocketAddr, hello: Hello, deadline: Instant) -> Result<TcpStream> {
    let refused_for = Instant::now() + REFUSED_PATIENCE;
    loop {
        match TcpStream::connect_timeout(&addr, remaining(deadline)) {
            Ok(s) => return Ok(s),
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && Instant::now() >= refused_for =>
            {
                return Err(Error::Closed { peer: hello.to })
            }
            Err(e) if Instant::now() + Duration::from_millis(20) < deadline => {
                tracing::debug!(peer = hello.to, %addr, "connect failed ({e}), retrying");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(Error::io(Some(hello.to), "connect", &e)),
        }
    }
}

/// How long a refused connection is retried.
const REFUSED_PATIENCE: Duration = Duration::from_secs(1);

/// Time left before `deadline`, at least a millisecond (zero means "forever"
/// to socket timeouts).
fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// The send buffer of a connection to a peer on this host, unless
/// `socket_buffer` says otherwise (Linux doubles it: 1 MiB may be unsent or
/// unacknowledged). Loopback has no round trip to cover, so a larger buffer
/// only lets a sender run ahead of its receiver: autotuned to 4 MiB a
/// socket, a 4-rank AllToAll of 16 MiB over loopback TCP kept 11-20 MB
/// queued in its sockets' send and receive queues (`ss -tm`), 4-9 with this
/// cap, and took 0.67-0.78x the time at 4-64 MiB, 8-rank AllReduce of 4 MiB
/// 0.75-0.82x, 2-rank 256 MiB 0.85-0.92x. 128 KiB made 2-rank calls slower;
/// capping the receive buffer too made every call slower (1.2-1.6x).
pub const SAME_HOST_SEND_BUFFER: usize = 512 << 10;

fn configure(stream: &TcpStream, options: TcpOptions) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let s = SockRef::from(stream);
    if let Some(size) = options.socket_buffer {
        s.set_send_buffer_size(size)?;
        s.set_recv_buffer_size(size)?;
    } else if same_host(stream)? {
        s.set_send_buffer_size(SAME_HOST_SEND_BUFFER)?;
    }
    Ok(())
}

/// Whether the peer is on this host: reached over loopback, or at our own
/// address. Between hosts the buffer must cover the path's bandwidth-delay
/// product, which autotuning measures.
fn same_host(stream: &TcpStream) -> std::io::Result<bool> {
    let (ours, theirs) = (stream.local_addr()?.ip(), stream.peer_addr()?.ip());
    Ok(theirs.is_loopback() || theirs == ours)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configured loopback pair: (dialled, accepted).
    fn pair(options: TcpOptions) -> (TcpStream, TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dialled = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let accepted = listener.accept().unwrap().0;
        for s in [&dialled, &accepted] {
            configure(s, options).unwrap();
        }
        (dialled, accepted)
    }

    fn send_buffer(s: &TcpStream) -> usize {
        SockRef::from(s).send_buffer_size().unwrap()
    }

    /// What Linux makes of a send buffer of `size`: at most
    /// `net.core.wmem_max`, doubled (bookkeeping overhead).
    fn granted(size: usize) -> usize {
        let max = std::fs::read_to_string("/proc/sys/net/core/wmem_max").unwrap();
        2 * size.min(max.trim().parse().unwrap())
    }

    #[test]
    fn a_peer_on_this_host_gets_the_small_send_buffer_unless_one_is_set() {
        for s in <[_; 2]>::from(pair(TcpOptions::default())) {
            assert!(same_host(&s).unwrap());
            assert_eq!(send_buffer(&s), granted(SAME_HOST_SEND_BUFFER));
        }
        let set = TcpOptions {
            socket_buffer: Some(192 << 10),
        };
        for s in <[_; 2]>::from(pair(set)) {
            assert_eq!(send_buffer(&s), granted(192 << 10));
        }
    }
}
