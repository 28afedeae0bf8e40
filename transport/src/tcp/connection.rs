//! One peer's TCP stream: posted sends and receives, moved by `progress`.

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

pub struct TcpConnection {
    stream: TcpStream,
    peer: Rank,
    sends: VecDeque<Outgoing>,
    recvs: VecDeque<Incoming>,
    /// Requests posted and completed so far, per [`Direction`].
    requests: Requests,
    rx: RxState,
    failed: Option<Error>,
}

// SAFETY: the raw pointers in `Outgoing`/`Incoming` point into memory the
// poster promised (isend/irecv contract) to keep valid for the request's
// lifetime, whichever thread drives progress.
unsafe impl Send for TcpConnection {}

/// A posted send: header then payload; `written` counts both.
struct Outgoing {
    header: [u8; HEADER_LEN],
    data: *const u8,
    len: usize,
    written: usize,
}

/// A posted receive.
struct Incoming {
    data: *mut u8,
    len: usize,
    tag: Tag,
}

/// Where the reader is within the current incoming message.
#[derive(Default)]
struct RxState {
    header: [u8; HEADER_LEN],
    header_have: usize,
    /// Payload bytes received, once the header has been checked.
    payload_have: Option<usize>,
}

impl TcpConnection {
    pub(crate) fn new(stream: TcpStream, peer: Rank) -> Result<Self> {
        stream
            .set_nonblocking(true)
            .map_err(|e| Error::io(Some(peer), "configure socket", &e))?;
        Ok(TcpConnection {
            stream,
            peer,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            requests: Requests::default(),
            rx: RxState::default(),
            failed: None,
        })
    }

    fn check_usable(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Writes queued messages until the socket is full or the queue empty.
    fn progress_sends(&mut self) -> Result<bool> {
        let mut moved = false;
        while let Some(out) = self.sends.front_mut() {
            let total = HEADER_LEN + out.len;
            // SAFETY: `data..data+len` is valid per the isend contract.
            let payload = unsafe { std::slice::from_raw_parts(out.data, out.len) };
            let result = if out.written < HEADER_LEN {
                let iov = [
                    IoSlice::new(&out.header[out.written..]),
                    IoSlice::new(payload),
                ];
                send_nosignal(&self.stream, &iov)
            } else {
                send_nosignal(
                    &self.stream,
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
                Err(e) => return Err(self.io_error("send", &e)),
            }
        }
        Ok(moved)
    }

    /// Reads incoming messages into posted receives. Reads nothing while no
    /// receive is posted: unread bytes stay in the kernel and close the window.
    fn progress_recvs(&mut self) -> Result<bool> {
        let mut moved = false;
        while let Some(inc) = self.recvs.front() {
            let (data, len) = (inc.data, inc.len);
            let have = match self.rx.payload_have {
                Some(have) => have,
                None => {
                    let at = self.rx.header_have;
                    match self.read(|s, rx: &mut RxState| s.read(&mut rx.header[at..]))? {
                        None => break,
                        Some(n) => {
                            moved = true;
                            self.rx.header_have += n;
                        }
                    }
                    if self.rx.header_have < HEADER_LEN {
                        continue;
                    }
                    self.check_header()?;
                    0
                }
            };
            if have < len {
                // SAFETY: `data..data+len` is valid and ours alone per the irecv contract.
                let dst = unsafe { std::slice::from_raw_parts_mut(data.add(have), len - have) };
                match self.read(|s, _| s.read(dst))? {
                    None => break,
                    Some(n) => {
                        moved = true;
                        self.rx.payload_have = Some(have + n);
                        if have + n < len {
                            continue;
                        }
                    }
                }
            }
            self.recvs.pop_front();
            self.rx = RxState::default();
            self.requests.complete(Direction::Recv);
            moved = true;
        }
        Ok(moved)
    }

    /// One non-blocking read: `Some(n)` with n > 0, `None` if nothing is there.
    fn read(
        &mut self,
        f: impl FnOnce(&mut TcpStream, &mut RxState) -> std::io::Result<usize>,
    ) -> Result<Option<usize>> {
        match f(&mut self.stream, &mut self.rx) {
            Ok(0) => Err(Error::Closed { peer: self.peer }),
            Ok(n) => Ok(Some(n)),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                Ok(None)
            }
            Err(e) => Err(self.io_error("receive", &e)),
        }
    }

    /// Checks a complete header against the receive posted for it.
    fn check_header(&mut self) -> Result<()> {
        let inc = self.recvs.front().expect("a receive is posted");
        match wire::decode_header(&self.rx.header) {
            Some(Frame::Data { tag, len }) if tag == inc.tag && len == inc.len => {
                self.rx.payload_have = Some(0);
                Ok(())
            }
            Some(Frame::Data { tag, len }) => Err(Error::Mismatch {
                peer: self.peer,
                expected_tag: inc.tag,
                expected_len: inc.len,
                got_tag: tag,
                got_len: len,
            }),
            Some(Frame::Abort { reason_len }) => Err(Error::PeerAborted {
                peer: self.peer,
                reason: self.read_reason(reason_len),
            }),
            Some(Frame::Bye { .. }) | None => Err(Error::Invalid(format!(
                "peer rank {} sent a corrupt message header",
                self.peer
            ))),
        }
    }

    /// Reads an abort frame's text, waiting at most [`ABORT_PATIENCE`].
    fn read_reason(&mut self, len: usize) -> String {
        let mut buf = vec![0u8; len];
        let ok = self.stream.set_nonblocking(false).is_ok()
            && self.stream.set_read_timeout(Some(ABORT_PATIENCE)).is_ok()
            && self.stream.read_exact(&mut buf).is_ok();
        if ok {
            String::from_utf8_lossy(&buf).into_owned()
        } else {
            "(reason lost)".into()
        }
    }

    fn io_error(&self, what: &'static str, e: &std::io::Error) -> Error {
        match e.kind() {
            ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => {
                Error::Closed { peer: self.peer }
            }
            _ => Error::io(Some(self.peer), what, e),
        }
    }

    /// Best effort: completes a half-written message so the abort frame lands
    /// on a message boundary, then sends the abort frame.
    fn send_abort(&mut self, reason: &str) -> std::io::Result<()> {
        self.stream.set_nonblocking(false)?;
        let deadline = Instant::now() + ABORT_PATIENCE;
        let left = || {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        if let Some(out) = self.sends.front().filter(|o| o.written > 0) {
            // SAFETY: the isend contract keeps the payload valid until abort returns.
            let payload = unsafe { std::slice::from_raw_parts(out.data, out.len) };
            let (header, written) = (out.header, out.written);
            self.stream.set_write_timeout(Some(left()))?;
            if written < HEADER_LEN {
                self.stream.write_all(&header[written..])?;
            }
            self.stream
                .write_all(&payload[written.saturating_sub(HEADER_LEN)..])?;
        }
        let reason = &reason.as_bytes()[..reason.len().min(wire::MAX_REASON_LEN)];
        self.stream.set_write_timeout(Some(left()))?;
        self.stream.write_all(&wire::encode_header(Frame::Abort {
            reason_len: reason.len(),
        }))?;
        self.stream.write_all(reason)?;
        self.stream.shutdown(Shutdown::Write)
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
        self.sends.push_back(Outgoing {
            header: wire::encode_header(Frame::Data { tag, len }),
            data,
            len,
            written: 0,
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
        let want = Interest {
            readable: !self.recvs.is_empty(),
            writable: !self.sends.is_empty(),
        };
        if want.readable || want.writable {
            Wake::On(self.stream.as_fd(), want)
        } else {
            Wake::Idle
        }
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
