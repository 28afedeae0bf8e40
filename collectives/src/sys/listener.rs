//! A TCP listener whose queue of not yet accepted connections is as long
//! as the kernel allows. The standard library's is 128: 512 ranks asking
//! one rank at once overflowed it, and a dropped SYN is retried after 1 s,
//! which the status questions' 2 s deadline counted as a failed rank.

use std::net::{SocketAddr, TcpListener};

/// The queue asked for; the kernel caps it at `net.core.somaxconn`.
const BACKLOG: i32 = 4096;

/// Binds `addr` and listens with the longest queue.
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let listener = TcpListener::bind(addr)?;
    // Listening again on a listening socket only sets its queue's length.
    rustix::net::listen(&listener, BACKLOG)?;
    Ok(listener)
}
