//! Passive side: accepts peers, checks their hello, refuses strangers.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use socket2::{Domain, Socket, Type};

use super::{configure, TcpConnection, TcpOptions};
use crate::proof::Replays;
use crate::wire::{self, BadHello, HELLO_LEN};
use crate::{Connection, Error, Hello, Listener, Rank, Result};

/// How long an accepted socket may take to say hello before it is dropped.
const HELLO_PATIENCE: Duration = Duration::from_secs(10);

/// A listening socket plus the accepted sockets still owing their hello.
pub struct TcpListener {
    socket: std::net::TcpListener,
    address: SocketAddr,
    options: TcpOptions,
    greeting: Vec<Greeting>,
    /// Connections whose first stream is accepted and whose second is not yet.
    half_open: Vec<(Hello, TcpStream)>,
    replays: Replays,
}

/// An accepted socket whose hello is not complete yet.
struct Greeting {
    stream: TcpStream,
    from: SocketAddr,
    hello: [u8; HELLO_LEN],
    have: usize,
    since: Instant,
}

impl TcpListener {
    /// Listens on `ip` at a port the kernel picks.
    pub fn bind(ip: IpAddr, options: TcpOptions) -> Result<Self> {
        let addr = SocketAddr::new(ip, 0);
        let io = |what, e: &std::io::Error| Error::io(None, what, e);
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)
            .map_err(|e| io("create listening socket", &e))?;
        socket
            .bind(&addr.into())
            .map_err(|e| Error::Invalid(format!("cannot listen on {ip}: {e}")))?;
        // A deep backlog: every rank may connect to us at once.
        socket.listen(1024).map_err(|e| io("listen", &e))?;
        socket.set_nonblocking(true).map_err(|e| io("listen", &e))?;
        let socket: std::net::TcpListener = socket.into();
        let address = socket.local_addr().map_err(|e| io("listen", &e))?;
        Ok(TcpListener {
            socket,
            address,
            options,
            greeting: Vec::new(),
            half_open: Vec::new(),
            replays: Replays::default(),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }

    /// Takes every connection waiting in the backlog.
    fn drain_backlog(&mut self) -> Result<()> {
        loop {
            match self.socket.accept() {
                Ok((stream, from)) => {
                    stream
                        .set_nonblocking(true)
                        .map_err(|e| Error::io(None, "accept", &e))?;
                    self.greeting.push(Greeting {
                        stream,
                        from,
                        hello: [0; HELLO_LEN],
                        have: 0,
                        since: Instant::now(),
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(None, "accept", &e)),
            }
        }
    }

    /// Reads what hellos have arrived; returns the first valid one, dropping
    /// (and logging) strangers and the silent.
    fn take_greeted(&mut self, token: u128, me: Rank) -> Option<(Hello, TcpStream)> {
        let address = self.address();
        let mut i = 0;
        while i < self.greeting.len() {
            match self.greeting[i].check(token, me, &address, &mut self.replays) {
                Check::Waiting => i += 1,
                Check::Drop => {
                    self.greeting.swap_remove(i);
                }
                Check::Accept(rank) => return Some((rank, self.greeting.swap_remove(i).stream)),
            }
        }
        None
    }

    /// Sleeps until the listener or a greeting socket is readable.
    fn wait(&self, deadline: Instant) {
        let timeout = deadline
            .saturating_duration_since(Instant::now())
            .min(HELLO_PATIENCE);
        let ts = Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: timeout.subsec_nanos() as i64,
        };
        let mut fds: Vec<PollFd<'_>> = std::iter::once(PollFd::new(&self.socket, PollFlags::IN))
            .chain(
                self.greeting
                    .iter()
                    .map(|g| PollFd::new(&g.stream, PollFlags::IN)),
            )
            .collect();
        // EINTR or an error just means we look again.
        let _ = poll(&mut fds, Some(&ts));
    }
}

enum Check {
    Waiting,
    Drop,
    Accept(Hello),
}

impl Greeting {
    fn check(&mut self, token: u128, me: Rank, address: &[u8], replays: &mut Replays) -> Check {
        match self.stream.read(&mut self.hello[self.have..]) {
            Ok(0) => {
                tracing::warn!(from = %self.from, "connection closed before its hello; ignored");
                return Check::Drop;
            }
            Ok(n) => self.have += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => {
                tracing::warn!(from = %self.from, "connection failed before its hello ({e}); ignored");
                return Check::Drop;
            }
        }
        if self.have < HELLO_LEN {
            if self.since.elapsed() > HELLO_PATIENCE {
                tracing::warn!(from = %self.from, "refused a connection that sent no hello within {HELLO_PATIENCE:?}");
                return Check::Drop;
            }
            return Check::Waiting;
        }
        let refuse = |why: String| {
            tracing::warn!(from = %self.from, "refused a connection: {why}");
            Check::Drop
        };
        let heard = match wire::decode_hello(&self.hello) {
            Err(BadHello::NotOurs) => return refuse("not a collectives peer".into()),
            Err(BadHello::Version(v)) => {
                return refuse(format!("protocol version {v}, ours is {}", wire::VERSION))
            }
            Ok(h) => h,
        };
        let h = match wire::accept_hello(&heard, token, me, address, replays) {
            Ok(h) => h,
            Err(why) => return refuse(why),
        };
        let ack = wire::encode_ack(me, token, &heard.nonce);
        match self.stream.write(&ack) {
            Ok(n) if n == ack.len() => Check::Accept(h),
            _ => refuse(format!("could not acknowledge rank {}", h.from)),
        }
    }
}

impl Listener for TcpListener {
    fn address(&self) -> Vec<u8> {
        self.address.to_string().into_bytes()
    }

    fn accept(
        &mut self,
        token: u128,
        me: Rank,
        deadline: Instant,
    ) -> Result<(Hello, Box<dyn Connection>)> {
        // A peer dials its two streams in turn (see `TcpTransport::connect`).
        loop {
            let (hello, stream) =
                self.accept_greeted(token, me, deadline).map_err(|e| {
                    match self.half_open.first() {
                        Some(&(h, _)) => Error::io(
                            Some(h.from),
                            "accept",
                            &std::io::Error::new(
                                ErrorKind::TimedOut,
                                "it dialled the first of its two streams, not the second",
                            ),
                        ),
                        None => e,
                    }
                })?;
            let same = |h: &Hello| (h.from, h.channel) == (hello.from, hello.channel);
            match self.half_open.iter().position(|(h, _)| same(h)) {
                Some(i) => {
                    let (_, first) = self.half_open.swap_remove(i);
                    let conn = TcpConnection::new([first, stream], false, hello.from)?;
                    return Ok((hello, Box::new(conn)));
                }
                None => self.half_open.push((hello, stream)),
            }
        }
    }
}

impl TcpListener {
    /// The next peer that greets us properly, as a configured stream; the
    /// verbs transport uses it as its side channel too.
    pub(crate) fn accept_greeted(
        &mut self,
        token: u128,
        me: Rank,
        deadline: Instant,
    ) -> Result<(Hello, TcpStream)> {
        loop {
            self.drain_backlog()?;
            if let Some((hello, stream)) = self.take_greeted(token, me) {
                configure(&stream, self.options)
                    .map_err(|e| Error::io(Some(hello.from), "configure socket", &e))?;
                return Ok((hello, stream));
            }
            if Instant::now() >= deadline {
                return Err(Error::io(
                    None,
                    "accept",
                    &std::io::Error::new(ErrorKind::TimedOut, "no peer arrived in time"),
                ));
            }
            self.wait(deadline);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Hello;

    #[test]
    fn a_peer_with_one_of_two_streams_is_named() {
        let mut listener = TcpListener::bind([127, 0, 0, 1].into(), TcpOptions::default()).unwrap();
        let mut first = TcpStream::connect(listener.local_addr()).unwrap();
        let hello = Hello {
            token: 7,
            from: 3,
            to: 0,
            channel: 0,
        };
        let address = listener.address();
        first
            .write_all(&wire::encode_hello(&hello, &address).0)
            .unwrap();
        let deadline = Instant::now() + Duration::from_millis(300);
        let err = match listener.accept(7, 0, deadline) {
            Err(e) => e,
            Ok((h, _)) => panic!("accepted rank {} on one stream", h.from),
        };
        assert_eq!(err.peer(), Some(3), "{err}");
        assert!(err.to_string().contains("not the second"), "{err}");
    }
}
