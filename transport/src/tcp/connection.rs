//! One peer's TCP connection: two streams ("lanes"), posted sends and
//! receives, moved by `progress`.
//!
//! Small messages both ways share lane 0, so each side's acknowledgements
//! ride on the other's replies. Large ones ([`LARGE`] and up) go one way
//! per lane: the dialer's on lane 0, the acceptor's on lane 1. A socket
//! that carries bulk data both ways is locked by our sends, our receives
//! and the peer's arriving packets alike, each queueing behind the others:
//! two processes swapping 2 MiB over loopback took 0.65-0.8x the time with
//! a socket per direction (`ci/tcp_exchange.c`). Small messages on a socket
//! per direction cost an acknowledgement each: an 8-byte AllReduce took
//! 1.2x as long.
//!
//! Messages of a direction are numbered, and the receiver takes message k
//! from whichever lane brings it: only the sender applies the rule, and a
//! receive whose length disagrees with its message is a `Mismatch` on
//! either lane.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use rustix::net::{sendmsg, SendAncillaryBuffer, SendFlags};

use crate::wire::{self, Frame, HEADER_LEN};
use crate::{
    Connection, Direction, Error, Interest, MemRegion, Rank, Request, Requests, Result, Tag, Wake,
};

/// How long `abort` may spend telling the peer.
const ABORT_PATIENCE: Duration = Duration::from_secs(1);

/// Messages from this size on take their sender's own lane. A 2-rank
/// AllReduce of 64 KiB (32 KiB messages) was 0.88x the time on the shared
/// lane, one of 128 KiB (64 KiB messages) 0.88x on lanes of its own.
pub(crate) const LARGE: usize = 64 << 10;

/// Bytes a lane reads at once while the first posted receive is small: one
/// system call then brings its header, its payload and what the peer sent
/// after it (a rooted call's peers run ahead of the root, so their messages
/// queue in the socket). Read one by one, a header and a payload each cost a
/// system call: the 4-rank 8 B Reduce over loopback took 2x Open MPI's time.
const READ_AHEAD: usize = 16 << 10;

/// A receive waiting on one lane looks at the other every this many idle
/// rounds: a message there is a later one, or a mismatch or an abort to
/// report, and each look costs a system call.
const OTHER_LANE_EVERY: u32 = 16;

pub struct TcpConnection {
    lanes: [Lane; 2],
    /// The lane our large messages take; the peer's take the other.
    large_out: usize,
    peer: Rank,
    sends: VecDeque<Outgoing>,
    recvs: VecDeque<Incoming>,
    /// Requests posted and completed so far, per [`Direction`].
    requests: Requests,
    /// The number the next message we send carries, and the one the first
    /// posted receive waits for.
    next_send: u32,
    next_recv: u32,
    /// The lane the first posted receive reads its payload from, and how
    /// many bytes of it are in.
    reading: Option<(usize, usize)>,
    /// Idle looks for the first receive's message since it was posted.
    looks: u32,
    failed: Option<Error>,
}

// SAFETY: the raw pointers in `Outgoing`/`Incoming` point into memory the
// poster promised (isend/irecv contract) to keep valid for the request's
// lifetime, whichever thread drives progress.
unsafe impl Send for TcpConnection {}

/// One stream and the header of its next incoming message, as far as it
/// has arrived (a complete one waits there until its receive is first).
struct Lane {
    stream: TcpStream,
    header: [u8; HEADER_LEN],
    header_have: usize,
    ahead: ReadAhead,
}

/// Bytes read from a stream but not yet taken: `buf[at..end]`.
struct ReadAhead {
    buf: Box<[u8]>,
    at: usize,
    end: usize,
}

impl ReadAhead {
    /// Reads into `dst` what was read ahead, else from `stream`: through
    /// the buffer (made on first use) when `ahead`, else straight into
    /// `dst`. `None` when nothing has come.
    fn read(
        &mut self,
        stream: &mut TcpStream,
        dst: &mut [u8],
        ahead: bool,
        peer: Rank,
    ) -> Result<Option<usize>> {
        if self.at == self.end && ahead {
            if self.buf.is_empty() {
                self.buf = vec![0; READ_AHEAD].into_boxed_slice();
            }
            match read_some(stream, &mut self.buf, peer)? {
                None => return Ok(None),
                Some(n) => (self.at, self.end) = (0, n),
            }
        }
        match self.take(dst) {
            0 => read_some(stream, dst, peer),
            n => Ok(Some(n)),
        }
    }

    /// Copies what was read ahead into `dst`, as much as fits; how much.
    fn take(&mut self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.end - self.at);
        dst[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        n
    }
}

/// A posted send: header then payload on `lane`; `written` counts both.
struct Outgoing {
    header: [u8; HEADER_LEN],
    data: *const u8,
    len: usize,
    written: usize,
    lane: usize,
}

/// A posted receive.
struct Incoming {
    data: *mut u8,
    len: usize,
    tag: Tag,
}

impl TcpConnection {
    /// `lanes` in the order the dialer dialled them; `dialer`: we did.
    pub(crate) fn new(lanes: [TcpStream; 2], dialer: bool, peer: Rank) -> Result<Self> {
        for stream in &lanes {
            stream
                .set_nonblocking(true)
                .map_err(|e| Error::io(Some(peer), "configure socket", &e))?;
        }
        Ok(TcpConnection {
            lanes: lanes.map(|stream| Lane {
                stream,
                header: [0; HEADER_LEN],
                header_have: 0,
                ahead: ReadAhead {
                    buf: Box::default(),
                    at: 0,
                    end: 0,
                },
            }),
            large_out: if dialer { 0 } else { 1 },
            peer,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            requests: Requests::default(),
            next_send: 0,
            next_recv: 0,
            reading: None,
            looks: 0,
            failed: None,
        })
    }

    fn check_usable(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The lane a message of `len` bytes takes from its sender: ours when
    /// `ours`, else the peer's.
    fn lane_for(&self, len: usize, ours: bool) -> usize {
        match (len >= LARGE, ours) {
            (false, _) => 0,
            (true, true) => self.large_out,
            (true, false) => 1 - self.large_out,
        }
    }

    /// Writes queued messages until a socket is full or the queue empty.
    fn progress_sends(&mut self) -> Result<bool> {
        let mut moved = false;
        while let Some(out) = self.sends.front_mut() {
            let total = HEADER_LEN + out.len;
            let stream = &self.lanes[out.lane].stream;
            // SAFETY: `data..data+len` is valid per the isend contract.
            let payload = unsafe { std::slice::from_raw_parts(out.data, out.len) };
            let result = if out.written < HEADER_LEN {
                let iov = [
                    IoSlice::new(&out.header[out.written..]),
                    IoSlice::new(payload),
                ];
                send_nosignal(stream, &iov)
            } else {
                send_nosignal(
                    stream,
                    &[IoSlice::new(&payload[out.written - HEADER_LEN..])],
                )
            };
            match result {
                Ok(n) => {
                    moved = true;
                    out.written += n;
                    if out.written == total {
                        self.sends.pop_front();
                        self.requests.complete(Direction::Send);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_error(self.peer, "send", &e)),
            }
        }
        Ok(moved)
    }

    /// Reads incoming messages into posted receives, in order. Reads no
    /// payload while no receive is posted: unread bytes stay in the kernel
    /// and close the window.
    fn progress_recvs(&mut self) -> Result<bool> {
        let mut moved = false;
        while let Some(inc) = self.recvs.front() {
            let (data, len) = (inc.data, inc.len);
            let (lane, have) = match self.reading {
                Some(at) => at,
                None => match self.find_message(&mut moved)? {
                    Some(lane) => (lane, 0),
                    None => break,
                },
            };
            if have < len {
                // SAFETY: `data..data+len` is valid and ours alone per the irecv contract.
                let dst = unsafe { std::slice::from_raw_parts_mut(data.add(have), len - have) };
                let l = &mut self.lanes[lane];
                let got = l.ahead.read(&mut l.stream, dst, false, self.peer)?;
                self.reading = Some((lane, have + got.unwrap_or(0)));
                match got {
                    None => break,
                    Some(n) if have + n < len => {
                        moved = true;
                        continue;
                    }
                    Some(_) => {}
                }
            }
            self.recvs.pop_front();
            self.reading = None;
            self.looks = 0;
            self.lanes[lane].header_have = 0;
            self.next_recv = self.next_recv.wrapping_add(1);
            self.requests.complete(Direction::Recv);
            moved = true;
        }
        Ok(moved)
    }

    /// The lane whose next message is the one the first receive waits for,
    /// its header checked against it; `None` while it has not arrived. The
    /// lane the receive's length says is looked at every round, the other
    /// every [`OTHER_LANE_EVERY`]th.
    fn find_message(&mut self, moved: &mut bool) -> Result<Option<usize>> {
        let len = self.recvs[0].len;
        let expected = self.lane_for(len, false);
        self.looks = self.looks.wrapping_add(1);
        let both = self.looks % OTHER_LANE_EVERY == 0;
        for lane in [expected, 1 - expected].into_iter().take(1 + both as usize) {
            // Only the lane a small receive expects reads ahead: the other
            // carries large messages, whose payload would only be copied
            // through the buffer.
            let ahead = lane == expected && len < READ_AHEAD;
            if self.read_header(lane, ahead, moved)? && self.is_next(lane)? {
                return Ok(Some(lane));
            }
        }
        Ok(None)
    }

    /// Reads what has come of `lane`'s next header (reading `ahead` of
    /// it); whether it is complete.
    fn read_header(&mut self, lane: usize, ahead: bool, moved: &mut bool) -> Result<bool> {
        let l = &mut self.lanes[lane];
        if l.header_have < HEADER_LEN {
            let header = &mut l.header[l.header_have..];
            match l.ahead.read(&mut l.stream, header, ahead, self.peer)? {
                None => return Ok(false),
                Some(n) => {
                    *moved = true;
                    l.header_have += n;
                }
            }
        }
        Ok(l.header_have == HEADER_LEN)
    }

    /// Whether `lane`'s complete header is the first receive's message:
    /// `false` for a later one; an error for a message that disagrees
    /// with the receive, an abort, or garbage.
    fn is_next(&mut self, lane: usize) -> Result<bool> {
        let inc = &self.recvs[0];
        match wire::decode_header(&self.lanes[lane].header) {
            Some(Frame::Data { seq, tag, len }) if seq == self.next_recv => {
                if tag == inc.tag && len == inc.len {
                    return Ok(true);
                }
                Err(Error::Mismatch {
                    peer: self.peer,
                    expected_tag: inc.tag,
                    expected_len: inc.len,
                    got_tag: tag,
                    got_len: len,
                })
            }
            // A later message: its sender went on to it on this lane.
            Some(Frame::Data { seq, .. }) if seq.wrapping_sub(self.next_recv) < u32::MAX / 2 => {
                Ok(false)
            }
            Some(Frame::Abort { reason_len }) => Err(Error::PeerAborted {
                peer: self.peer,
                reason: self.read_reason(lane, reason_len),
            }),
            _ => Err(self.corrupt()),
        }
    }

    fn corrupt(&self) -> Error {
        Error::Invalid(format!(
            "peer rank {} sent a corrupt message header",
            self.peer
        ))
    }

    /// Reads an abort frame's text from `lane` (what was read ahead first),
    /// waiting at most [`ABORT_PATIENCE`].
    fn read_reason(&mut self, lane: usize, len: usize) -> String {
        let l = &mut self.lanes[lane];
        let mut buf = vec![0u8; len];
        let early = l.ahead.take(&mut buf);
        let stream = &mut l.stream;
        let ok = stream.set_nonblocking(false).is_ok()
            && stream.set_read_timeout(Some(ABORT_PATIENCE)).is_ok()
            && stream.read_exact(&mut buf[early..]).is_ok();
        if ok {
            String::from_utf8_lossy(&buf).into_owned()
        } else {
            "(reason lost)".into()
        }
    }

    /// Best effort: completes a half-written message so that every lane is
    /// at a message boundary, then sends the abort frame on both (the peer
    /// may be reading either).
    fn send_abort(&mut self, reason: &str) -> std::io::Result<()> {
        let deadline = Instant::now() + ABORT_PATIENCE;
        let left = || {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        for lane in &self.lanes {
            lane.stream.set_nonblocking(false)?;
        }
        if let Some(out) = self.sends.front().filter(|o| o.written > 0) {
            // SAFETY: the isend contract keeps the payload valid until abort returns.
            let payload = unsafe { std::slice::from_raw_parts(out.data, out.len) };
            let mut stream = &self.lanes[out.lane].stream;
            stream.set_write_timeout(Some(left()))?;
            if out.written < HEADER_LEN {
                stream.write_all(&out.header[out.written..])?;
            }
            stream.write_all(&payload[out.written.saturating_sub(HEADER_LEN)..])?;
        }
        let reason = &reason.as_bytes()[..reason.len().min(wire::MAX_REASON_LEN)];
        let header = wire::encode_header(Frame::Abort {
            reason_len: reason.len(),
        });
        for lane in &self.lanes {
            let mut stream = &lane.stream;
            stream.set_write_timeout(Some(left()))?;
            stream.write_all(&header)?;
            stream.write_all(reason)?;
            stream.shutdown(Shutdown::Write)?;
        }
        Ok(())
    }
}

/// One non-blocking read: `Some(n)` with n > 0, `None` if nothing is there.
fn read_some(stream: &mut TcpStream, buf: &mut [u8], peer: Rank) -> Result<Option<usize>> {
    match stream.read(buf) {
        Ok(0) => Err(Error::Closed { peer }),
        Ok(n) => Ok(Some(n)),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => Ok(None),
        Err(e) => Err(io_error(peer, "receive", &e)),
    }
}

fn io_error(peer: Rank, what: &'static str, e: &std::io::Error) -> Error {
    match e.kind() {
        ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => {
            Error::Closed { peer }
        }
        _ => Error::io(Some(peer), what, e),
    }
}

fn send_nosignal(stream: &TcpStream, iov: &[IoSlice<'_>]) -> std::io::Result<usize> {
    // MSG_NOSIGNAL: a peer that died must give EPIPE, not kill us with SIGPIPE.
    sendmsg(
        stream,
        iov,
        &mut SendAncillaryBuffer::default(),
        SendFlags::NOSIGNAL,
    )
    .map_err(Into::into)
}

impl Connection for TcpConnection {
    fn peer(&self) -> Rank {
        self.peer
    }

    unsafe fn isend(
        &mut self,
        region: &MemRegion,
        offset: usize,
        len: usize,
        tag: Tag,
    ) -> Result<Request> {
        self.check_usable()?;
        let data = region.slice_ptr(offset, len)?;
        let seq = self.next_send;
        self.next_send = seq.wrapping_add(1);
        self.sends.push_back(Outgoing {
            header: wire::encode_header(Frame::Data { tag, len, seq }),
            data,
            len,
            written: 0,
            lane: self.lane_for(len, true),
        });
        Ok(self.requests.post(Direction::Send))
    }

    unsafe fn irecv(
        &mut self,
        region: &MemRegion,
        offset: usize,
        len: usize,
        tag: Tag,
    ) -> Result<Request> {
        self.check_usable()?;
        let data = region.slice_ptr(offset, len)?;
        self.recvs.push_back(Incoming { data, len, tag });
        Ok(self.requests.post(Direction::Recv))
    }

    fn progress(&mut self) -> Result<bool> {
        self.check_usable()?;
        let result = self
            .progress_sends()
            .and_then(|sent| Ok(self.progress_recvs()? | sent));
        if let Err(e) = &result {
            self.failed = Some(e.clone());
        }
        result
    }

    fn is_done(&self, request: Request) -> bool {
        self.requests.is_done(request)
    }

    fn pending(&self) -> usize {
        self.sends.len() + self.recvs.len()
    }

    fn wake_source(&mut self) -> Wake<'_> {
        let writing = self.sends.front().map(|o| o.lane);
        if writing.is_none() && self.recvs.is_empty() {
            return Wake::Idle;
        }
        // A lane holding a later message's header stays readable: not a
        // reason to wake (the lane the first receive needs brings it).
        let waiting_on = |lane: usize| {
            !self.recvs.is_empty()
                && (self.lanes[lane].header_have < HEADER_LEN
                    || self.reading.is_some_and(|(l, _)| l == lane))
        };
        let want = |lane| Interest {
            readable: waiting_on(lane),
            writable: writing == Some(lane),
        };
        Wake::Either([
            (self.lanes[0].stream.as_fd(), want(0)),
            (self.lanes[1].stream.as_fd(), want(1)),
        ])
    }

    fn abort(&mut self, reason: &str) {
        // Tell the peer unless the failure says it is gone or already knows.
        let peer_listening = matches!(
            self.failed,
            None | Some(Error::Mismatch { .. } | Error::Invalid(_))
        );
        if peer_listening {
            if let Err(e) = self.send_abort(reason) {
                tracing::debug!(peer = self.peer, "could not tell the peer we abort: {e}");
            }
        }
        self.sends.clear();
        self.recvs.clear();
        if self.failed.is_none() {
            self.failed = Some(Error::Aborted {
                peer: self.peer,
                reason: reason.to_string(),
            });
        }
    }
}
