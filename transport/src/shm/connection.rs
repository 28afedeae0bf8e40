//! One peer on the same host: two slot rings in a shared segment, and a Unix
//! socket beside them that is the doorbell (a byte wakes a sleeping peer),
//! the abort channel, and the death detector (it hangs up when the peer's
//! process dies, however it dies).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use super::costs::{self, CopyCosts};
use super::peer_maps::PeerMaps;
use super::segment::{
    Desc, Help, Kind, Segment, EAGER_MAX, EAGER_MAX_ALL_IN_FLIGHT, OBSERVE, PUBLISH, SLOTS,
};
use super::shared_buffer::Region;
use crate::{
    Connection, Direction, Error, Interest, MemRegion, Rank, Request, Requests, Result, Tag, Wake,
};

/// Doorbell byte: "look at the rings".
const RING: u8 = 1;
/// Abort byte, followed by a u32 length and the reason.
const ABORT: u8 = 2;

/// Bytes of a message we read from the sender's memory per
/// [`progress`](Connection::progress) into a receive used as it lands
/// ([`MemRegion::used_as_landed`]): the caller reduces each piece while it
/// is in our cache. Read whole, a 1 MiB chunk and the lines it came from
/// filled a 2 MiB L2 and pushed out the chunk's start before the reduction
/// reached it: two threads modelling a 2-rank AllReduce of 16 MiB
/// (`ci/allreduce_floor.c`) took 1446 us with whole chunks, 1206-1231 in
/// 256 KiB pieces. Ours in 128, 256 and 512 KiB pieces: 0.96x, 0.92x and
/// 0.92x the time of whole chunks at 2 ranks, 0.88x, 0.88x and 0.94x at 4.
const READ_PIECE: usize = 256 << 10;

pub struct ShmConnection {
    seg: Segment,
    ctl: UnixStream,
    peer: Rank,
    peer_pid: i32,
    /// 0 for the side that created the segment, 1 for the other.
    side: usize,
    /// Whether the receiver may read large messages from the sender's memory.
    remote_reads: bool,
    /// Sends up to these sizes go through the slots (`EAGER_MAX`, and
    /// `EAGER_MAX_ALL_IN_FLIGHT` for regions of all-in-flight sends, each
    /// at most a slot): fixed with the segment.
    eager_max: [usize; 2],
    /// The peer's `SharedBuffer`s we read from, mapped.
    maps: PeerMaps,
    sends: VecDeque<Outgoing>,
    /// Index in `sends` of the first message not fully published.
    publishing: usize,
    recvs: VecDeque<Incoming>,
    requests: Requests,
    /// Our cursors: next slot to publish (producer) and to consume (consumer).
    head: u64,
    tail: u64,
    /// Consumer: the next slot to consider offering the sender (see [`Help`]).
    offered: u64,
    /// Consumer: bytes of the remote message in slot `tail` read so far.
    piece_at: usize,
    /// Consumer: whether offers pay (the sender's writes against our reads).
    costs: CopyCosts,
    /// Set when we slept on the socket: drain it on the next progress.
    woke: bool,
    /// The control socket hung up: the peer exited or was killed.
    peer_gone: bool,
    failed: Option<Error>,
}

// SAFETY: raw pointers in the queues point into memory the poster keeps
// valid for the request's lifetime (isend/irecv contract).
unsafe impl Send for ShmConnection {}

struct Outgoing {
    data: *const u8,
    len: usize,
    tag: Tag,
    /// Bytes already placed in slots (or described, for remote reads).
    published: usize,
    /// Slot sequence number of the last fragment, once published.
    last_slot: Option<u64>,
    /// Whether the receiver reads it from our memory (`process_vm_readv`),
    /// decided as it is posted.
    remote: bool,
    /// The `SharedBuffer` it lies in (found at registration), which the
    /// receiver maps.
    region: Option<Region>,
    /// Whether we may write it for the receiver when offered (see
    /// [`MemRegion::declines_help`]).
    helps: bool,
}

struct Incoming {
    data: *mut u8,
    len: usize,
    tag: Tag,
    received: usize,
    /// Whether the sender may write it (see [`MemRegion::allow_peer_writes`]).
    peer_writes: bool,
    /// Whether we read it in pieces (see [`MemRegion::used_as_landed`]).
    in_pieces: bool,
}

impl ShmConnection {
    pub(crate) fn new(
        seg: Segment,
        ctl: UnixStream,
        peer: Rank,
        peer_pid: i32,
        side: usize,
        remote_reads: bool,
    ) -> Result<Self> {
        ctl.set_nonblocking(true)
            .map_err(|e| Error::io(Some(peer), "configure socket", &e))?;
        let eager_max = [EAGER_MAX, EAGER_MAX_ALL_IN_FLIGHT].map(|m| m.min(seg.slot_bytes()));
        Ok(ShmConnection {
            seg,
            ctl,
            peer,
            peer_pid,
            side,
            remote_reads,
            eager_max,
            maps: PeerMaps::new(peer, peer_pid),
            sends: VecDeque::new(),
            publishing: 0,
            recvs: VecDeque::new(),
            requests: Requests::default(),
            head: 0,
            tail: 0,
            offered: 0,
            piece_at: 0,
            costs: CopyCosts::default(),
            woke: false,
            peer_gone: false,
            failed: None,
        })
    }

    /// The direction we produce on, and the one we consume.
    fn out_dir(&self) -> usize {
        self.side
    }

    fn in_dir(&self) -> usize {
        1 - self.side
    }

    fn check_usable(&self) -> Result<()> {
        self.failed.clone().map_or(Ok(()), Err)
    }

    /// Publishes fragments while there are free slots, then retires sends
    /// whose last slot the peer has handed back.
    fn progress_sends(&mut self) -> Result<bool> {
        let dir = self.out_dir();
        let mut moved = false;
        let mut freed = self.seg.tail(dir).load(OBSERVE);
        while self.publishing < self.sends.len() && self.head - freed < SLOTS {
            self.publish_fragment(self.publishing);
            moved = true;
            if self.sends[self.publishing].last_slot.is_some() {
                self.publishing += 1;
            }
            if self.head - freed == SLOTS {
                freed = self.seg.tail(dir).load(OBSERVE);
            }
        }
        if moved {
            self.seg.head(dir).store(self.head, PUBLISH);
        }
        moved |= self.give_help(freed);
        // A message copied into the slots is done once published: the
        // caller's buffer is free. One the peer reads from our memory is
        // done when the peer hands its slot back.
        while let Some(out) = self.sends.front() {
            match out.last_slot {
                Some(last) if !out.remote || last < freed => {}
                _ => break,
            }
            self.sends.pop_front();
            self.publishing -= 1;
            self.requests.complete(Direction::Send);
            moved = true;
        }
        Ok(moved)
    }

    /// Writes the next fragment of send `i` into slot `self.head`.
    fn publish_fragment(&mut self, i: usize) {
        let (dir, seq) = (self.out_dir(), self.head);
        let out = &mut self.sends[i];
        let remote = out.remote;
        let len = if remote {
            out.len
        } else {
            (out.len - out.published).min(self.seg.slot_bytes())
        };
        let desc = Desc {
            tag: out.tag,
            msg_len: out.len as u64,
            offset: out.published as u64,
            len: len as u64,
            remote: if remote { out.data as u64 } else { 0 },
            kind: if remote { Kind::Remote } else { Kind::Eager } as u32,
            region_fd: out.region.map_or(-1, |r| r.fd),
            region_ino: out.region.map_or(0, |r| r.ino),
            region_offset: out
                .region
                .map_or(0, |r| (out.data as usize - r.start) as u64),
        };
        if remote {
            // The slot was handed back: the receiver no longer looks at it.
            self.seg
                .help(dir, seq)
                .0
                .store(Help::NONE, Ordering::Relaxed);
        } else {
            // SAFETY: the isend contract keeps data..data+len readable; the
            // slot is unpublished, so the peer does not read it yet.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    out.data.add(out.published),
                    self.seg.slot_data(dir, seq),
                    len,
                )
            };
        }
        self.seg.write_desc(dir, seq, desc);
        out.published += len;
        if out.published == out.len {
            out.last_slot = Some(seq);
        }
        self.head += 1;
    }

    /// Consumes published slots into posted receives.
    fn progress_recvs(&mut self) -> Result<bool> {
        let dir = self.in_dir();
        let mut moved = false;
        let mut available = self.seg.head(dir).load(OBSERVE);
        while !self.recvs.is_empty() && self.tail < available {
            moved |= self.offer_help(available);
            let desc = self.seg.read_desc(dir, self.tail);
            let read = match self.take_fragment(desc)? {
                Take::Writing => break,
                Take::Piece => return Ok(true), // let the caller work on it
                Take::Whole { read } => read,
            };
            self.tail += 1;
            self.seg.tail(dir).store(self.tail, PUBLISH);
            moved = true;
            if read && self.tail < self.offered && self.offer_open(self.tail) {
                // We read one and offered the next: return, so the caller
                // works on what landed (reduces it) while the sender takes
                // up the offer, rather than take that one back at once.
                break;
            }
            if self.tail == available {
                available = self.seg.head(dir).load(OBSERVE);
            }
        }
        Ok(moved)
    }

    /// Offers the sender the copy of the remote message behind the one we
    /// take next, if its receive's memory lets peers write: it copies that
    /// one while we read or reduce this one. One at a time while we have a
    /// core: a sender given several writes them in turn while we wait for
    /// the first, where we could have read the second. While our core is
    /// shared with other work, we copy at a fraction of its speed, and not
    /// at all while the other work runs: the sender gets every message
    /// posted behind ours, and we read those it has not started when we
    /// reach them (2-rank Broadcast of 16 MiB beside a busy loop: one
    /// behind 1.01x the time of no help, two 0.90x, all 0.73x). With remote
    /// reads every message takes one slot, so slot `tail + k` is the
    /// receive `k` behind the front's. `available`: the slots published, as
    /// the caller last read them. Our own state is checked first: a small
    /// message's path reads no shared line for this.
    fn offer_help(&mut self, available: u64) -> bool {
        if !self.remote_reads {
            return false;
        }
        let ahead = match crate::poller::core_shared() {
            true => self.recvs.len().saturating_sub(1),
            false => 1,
        };
        let mut offered = false;
        for k in 1..=ahead {
            offered |= self.offer_slot(k, available);
        }
        offered
    }

    /// Offers the copy of the message `k` slots behind the one we take
    /// next (see [`offer_help`](Self::offer_help)), unless considered before.
    fn offer_slot(&mut self, k: usize, available: u64) -> bool {
        let (dir, next) = (self.in_dir(), self.tail + k as u64);
        if self.offered > next || next >= available {
            return false;
        }
        let Some(inc) = self.recvs.get(k) else {
            return false; // not posted yet: consider it when it is
        };
        self.offered = next + 1;
        let peer_busy = || self.seg.core_shared(1 - self.side).load(Ordering::Relaxed) != 0;
        if !inc.peer_writes || peer_busy() {
            return false;
        }
        // A remote message takes one slot, whole. Only such a candidate
        // counts towards the costs' probes.
        let desc = self.seg.read_desc(dir, next);
        let fits = desc.tag == inc.tag && desc.msg_len as usize == inc.len;
        let remote = desc.kind == Kind::Remote as u32;
        if !(remote && fits && self.costs.worth_offering(inc.len)) {
            return false;
        }
        let (word, addr) = self.seg.help(dir, next);
        addr.store(inc.data as u64, Ordering::Relaxed);
        word.store(Help::OFFERED, PUBLISH);
        true
    }

    /// Sender: writes the messages the receiver offered us (see [`Help`]),
    /// unless we expect messages from it too: then both sides have their
    /// own receives to work on, and one writing for the other only makes
    /// it wait (2-rank AllReduce of 16 MiB took 1.7x as long).
    fn give_help(&mut self, freed: u64) -> bool {
        if !self.recvs.is_empty() {
            return false;
        }
        let (dir, pid) = (self.out_dir(), self.peer_pid);
        let mut wrote = false;
        for out in self.sends.iter().take(self.publishing) {
            let Some(seq) = self.offered_slot(out, freed) else {
                continue;
            };
            let (word, addr) = self.seg.help(dir, seq);
            let cas =
                word.compare_exchange(Help::OFFERED, Help::WRITING, OBSERVE, Ordering::Relaxed);
            if cas.is_err() {
                continue; // the receiver took it back
            }
            let start = costs::timer(out.len);
            let done = match write_remote(
                pid,
                addr.load(Ordering::Relaxed) as usize,
                out.data,
                out.len,
            ) {
                Ok(()) => {
                    // The receiver is done with the address: it learns
                    // from this word how long the write took.
                    addr.store(costs::elapsed_ns(start), Ordering::Relaxed);
                    Help::WRITTEN
                }
                Err(e) => {
                    tracing::debug!(
                        peer = self.peer,
                        "process_vm_writev failed ({e}); the peer reads"
                    );
                    Help::DECLINED
                }
            };
            word.store(done, PUBLISH);
            wrote = true;
        }
        wrote
    }

    /// Whether the receiver offered us a copy we would take up.
    fn help_wanted(&self, freed: u64) -> bool {
        self.recvs.is_empty()
            && (self.sends.iter().take(self.publishing))
                .any(|out| self.offered_slot(out, freed).is_some())
    }

    /// Sender: the slot of published send `out`, if the receiver has not
    /// handed it back (`freed`) and offers us its copy.
    fn offered_slot(&self, out: &Outgoing, freed: u64) -> Option<u64> {
        let seq = out
            .last_slot
            .filter(|seq| out.remote && out.helps && *seq >= freed)?;
        let word = self.seg.help(self.out_dir(), seq).0;
        (word.load(Ordering::Relaxed) == Help::OFFERED).then_some(seq)
    }

    /// Tells the peer whether our core is shared with other work: a copy
    /// we took up would run slowly there, and the peer would wait for it
    /// (2-rank Reduce of 4-16 MiB under a busy loop took 1.2-1.5x as long).
    fn tell_core_shared(&self) {
        let (flag, shared) = (
            self.seg.core_shared(self.side),
            crate::poller::core_shared(),
        );
        if (flag.load(Ordering::Relaxed) != 0) != shared {
            flag.store(shared as u32, Ordering::Relaxed);
        }
    }

    /// Receiver: whether our offer of slot `seq` awaits the sender.
    fn offer_open(&self, seq: u64) -> bool {
        self.seg.help(self.in_dir(), seq).0.load(Ordering::Relaxed) == Help::OFFERED
    }

    /// Receiver: who copies remote slot `seq`: `Some(true)` us,
    /// `Some(false)` nobody (the sender wrote it), `None` not known yet
    /// (the sender is writing it).
    fn claim_copy(&self, seq: u64) -> Option<bool> {
        let word = self.seg.help(self.in_dir(), seq).0;
        let mut state = word.load(OBSERVE);
        if state == Help::OFFERED {
            state = match word.compare_exchange(Help::OFFERED, Help::DECLINED, OBSERVE, OBSERVE) {
                Ok(_) => Help::DECLINED,
                Err(now) => now,
            };
        }
        match state {
            Help::WRITING => None,
            Help::WRITTEN => Some(false),
            _ => Some(true),
        }
    }

    /// Takes back the offers the sender has not taken up and waits (up to a
    /// second: a stopped sender must not hang an abort) for a write it did
    /// take up, so nothing lands in our memory after an abort or drop. A
    /// sender whose process is gone (its socket hung up) writes no more.
    fn revoke_offers(&mut self) {
        let dir = self.in_dir();
        for seq in self.tail..self.offered {
            let word = self.seg.help(dir, seq).0;
            let cas = word.compare_exchange(Help::OFFERED, Help::DECLINED, OBSERVE, OBSERVE);
            let start = Instant::now();
            while cas.is_err() && !self.peer_gone && word.load(OBSERVE) == Help::WRITING {
                if start.elapsed() > Duration::from_secs(1) {
                    tracing::warn!(peer = self.peer, "gave up waiting for the peer's write");
                    break;
                }
                std::thread::yield_now();
            }
        }
        self.offered = self.tail;
    }

    /// Copies (or reads remotely) one fragment into the front receive; a
    /// remote one we read a [`READ_PIECE`] per call if its receive is used
    /// as it lands.
    fn take_fragment(&mut self, desc: Desc) -> Result<Take> {
        let (seq, peer, at) = (self.tail, self.peer, self.piece_at);
        let inc = self.recvs.front_mut().expect("a receive is posted");
        if at == 0 {
            check_fragment(peer, &desc, inc, self.remote_reads, self.seg.slot_bytes())?;
        }
        let (offset, len) = (desc.offset as usize, desc.len as usize);
        // SAFETY: the irecv contract makes data..data+len ours to write, and
        // the range was checked against it.
        let dst = unsafe { inc.data.add(offset) };
        let piece = match inc.in_pieces {
            true => READ_PIECE,
            false => len,
        };
        let remote = desc.kind == Kind::Remote as u32;
        // Whether we read it from the sender's memory (else the sender
        // wrote it, or it is in the slot).
        let read = match remote {
            true => match self.claim_copy(seq) {
                Some(ours) => ours,
                None => return Ok(Take::Writing),
            },
            false => false,
        };
        let took = match read {
            true => {
                let took = (len - at).min(piece);
                self.read_piece(&desc, dst, took)?;
                took
            }
            false => {
                self.copy_fragment(seq, remote, dst, len);
                len
            }
        };
        self.piece_at += took;
        let inc = self.recvs.front_mut().expect("a receive is posted");
        inc.received += took;
        if self.piece_at < len {
            return Ok(Take::Piece);
        }
        self.piece_at = 0;
        if inc.received == inc.len {
            self.recvs.pop_front();
            self.requests.complete(Direction::Recv);
        }
        Ok(Take::Whole { read })
    }

    /// Reads `len` bytes of the remote message `desc` describes into the
    /// fragment at `dst`, both from byte `piece_at` on: from our mapping of
    /// its `SharedBuffer` if it lies in one we can map, else with
    /// `process_vm_readv`.
    fn read_piece(&mut self, desc: &Desc, dst: *mut u8, len: usize) -> Result<()> {
        let start = costs::timer(len);
        // SAFETY: piece_at + len stays inside the fragment, which was
        // checked against the receive (the caller counts len from piece_at).
        let dst = unsafe { dst.add(self.piece_at) };
        let mapped = (desc.region_fd >= 0)
            .then(|| {
                let offset = desc.region_offset as usize + self.piece_at;
                (self.maps).locate(desc.region_fd, desc.region_ino, offset, len)
            })
            .flatten();
        match mapped {
            // SAFETY: `src..src + len` lies in our mapping of the sender's
            // buffer, which the sender leaves unchanged until we hand the
            // slot back (isend contract); `dst` is ours to write (irecv
            // contract) and not in that mapping.
            Some(src) => unsafe { std::ptr::copy_nonoverlapping(src, dst, len) },
            None => {
                let addr = desc.remote as usize + self.piece_at;
                read_remote(self.peer_pid, addr, dst, len).map_err(|e| match e.raw_os_error() {
                    Some(libc::ESRCH) => Error::Closed { peer: self.peer },
                    _ => Error::io(Some(self.peer), "process_vm_readv", &e),
                })?
            }
        }
        self.costs.note_read(len, start);
        Ok(())
    }

    /// Takes a fragment we do not read: one the sender wrote into our
    /// memory (`remote`), else one in slot `seq`.
    fn copy_fragment(&mut self, seq: u64, remote: bool, dst: *mut u8, len: usize) {
        let dir = self.in_dir();
        if remote {
            // Written by the sender, who left the time it took (see `give_help`).
            let took = self.seg.help(dir, seq).1.load(Ordering::Relaxed);
            self.costs.note_write(len, took);
        } else {
            // SAFETY: the slot is published to us and holds len bytes.
            unsafe { std::ptr::copy_nonoverlapping(self.seg.slot_data(dir, seq), dst, len) };
        }
    }

    /// Wakes the peer if it sleeps. The fence pairs with the one in
    /// `wake_source`: either the peer sees our ring update before it sleeps,
    /// or we see its flag here.
    fn ring_peer(&mut self) -> Result<()> {
        fence(Ordering::SeqCst);
        let flag = self.seg.sleeping(1 - self.side);
        if flag.load(Ordering::Relaxed) == 1 && flag.swap(0, Ordering::SeqCst) == 1 {
            match self.ctl.write(&[RING]) {
                // A full socket already holds a wake-up.
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(e) => return Err(self.socket_error("ring the doorbell", &e)),
            }
        }
        Ok(())
    }

    /// Reads doorbells and control messages after a sleep, or when the peer
    /// flagged an abort: a hang-up means the peer process is gone.
    fn drain_socket(&mut self) -> Result<()> {
        let mut buf = [0u8; 64];
        loop {
            match self.ctl.read(&mut buf) {
                Ok(0) => {
                    // The peer's process is gone (or closed us). What it
                    // published stays readable in our mapping: only a wait
                    // for something more is an error (see `progress`).
                    self.peer_gone = true;
                    return Ok(());
                }
                Ok(n) => {
                    if let Some(at) = buf[..n].iter().position(|b| *b == ABORT) {
                        return Err(Error::PeerAborted {
                            peer: self.peer,
                            reason: self.read_reason(&buf[at + 1..n]),
                        });
                    }
                }
                // A peer that exits with our doorbell unread resets the
                // socket instead of closing it: gone all the same, and what
                // it published before is still ours to read (a barrier's
                // last message was lost to this once in CI).
                Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                    self.peer_gone = true;
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.socket_error("read the control socket", &e)),
            }
        }
    }

    /// The abort text after its marker byte; `have` is what was read already.
    fn read_reason(&mut self, have: &[u8]) -> String {
        let mut msg = have.to_vec();
        let _ = self.ctl.set_nonblocking(false);
        let _ = self.ctl.set_read_timeout(Some(Duration::from_secs(1)));
        let mut chunk = [0u8; 512];
        while msg.len() < 4
            || msg.len() < 4 + u32::from_le_bytes(msg[..4].try_into().unwrap()) as usize
        {
            match self.ctl.read(&mut chunk) {
                Ok(n) if n > 0 => msg.extend_from_slice(&chunk[..n]),
                _ => return "(reason lost)".into(),
            }
        }
        let len = u32::from_le_bytes(msg[..4].try_into().unwrap()) as usize;
        String::from_utf8_lossy(&msg[4..4 + len]).into_owned()
    }

    fn socket_error(&self, what: &'static str, e: &std::io::Error) -> Error {
        match e.kind() {
            ErrorKind::BrokenPipe | ErrorKind::ConnectionReset => Error::Closed { peer: self.peer },
            _ => Error::io(Some(self.peer), what, e),
        }
    }

    /// Whether progress could move now (checked after raising our flag).
    fn can_progress(&self) -> bool {
        // A slot the sender is writing will ring us when written.
        let incoming = !self.recvs.is_empty()
            && self.seg.head(self.in_dir()).load(Ordering::Relaxed) > self.tail
            && self
                .seg
                .help(self.in_dir(), self.tail)
                .0
                .load(Ordering::Relaxed)
                != Help::WRITING;
        let freed = self.seg.tail(self.out_dir()).load(Ordering::Relaxed);
        let can_publish = self.publishing < self.sends.len() && self.head - freed < SLOTS;
        let retire = self
            .sends
            .front()
            .is_some_and(|s| s.last_slot.is_some_and(|last| !s.remote || last < freed));
        incoming
            || can_publish
            || retire
            || self.help_wanted(freed)
            || self.seg.aborted().load(Ordering::Relaxed) != 0
    }
}

/// What [`ShmConnection::take_fragment`] did with the front slot.
enum Take {
    /// Nothing: the sender is writing it.
    Writing,
    /// Read a piece of it from the sender; more to read.
    Piece,
    /// Took it all, and whether we read it from the sender's memory.
    Whole { read: bool },
}

/// Checks a fragment the peer described against the receive it lands in
/// and the mode both sides agreed on, before a byte moves: the peer writes
/// the descriptor, so every field is untrusted (and sums are checked, since
/// a wrapped `offset + len` would pass a plain comparison in release).
fn check_fragment(
    peer: Rank,
    desc: &Desc,
    inc: &Incoming,
    remote_reads: bool,
    slot_bytes: usize,
) -> Result<()> {
    if desc.offset == 0 && (desc.tag != inc.tag || desc.msg_len as usize != inc.len) {
        return Err(Error::Mismatch {
            peer,
            expected_tag: inc.tag,
            expected_len: inc.len,
            got_tag: desc.tag,
            got_len: desc.msg_len as usize,
        });
    }
    let bad = |what: String| Err(Error::Invalid(format!("peer rank {peer} sent {what}")));
    let (Ok(offset), Ok(len)) = (usize::try_from(desc.offset), usize::try_from(desc.len)) else {
        return bad("a fragment whose offset or length does not fit in memory".into());
    };
    if offset != inc.received || offset.checked_add(len).is_none_or(|end| end > inc.len) {
        return bad(format!(
            "a fragment out of order or past the receive: bytes {offset}+{len} of a {}-byte \
             message, {} received",
            inc.len, inc.received
        ));
    }
    match desc.kind {
        k if k == Kind::Eager as u32 && len > slot_bytes => bad(format!(
            "an eager fragment of {len} bytes, more than a slot's {slot_bytes}"
        )),
        k if k == Kind::Eager as u32 => Ok(()),
        k if k == Kind::Remote as u32 && remote_reads => Ok(()),
        k if k == Kind::Remote as u32 => {
            bad("a fragment to read from its memory, a mode the two ranks did not agree on".into())
        }
        k => bad(format!("a fragment of unknown kind {k}")),
    }
}

/// Reads `len` bytes at `addr` in process `pid` into `dst` (CMA).
pub(crate) fn read_remote(pid: i32, addr: usize, dst: *mut u8, len: usize) -> std::io::Result<()> {
    // SAFETY: `local` is writable memory of ours (caller's contract); the
    // kernel checks `remote` against the peer's address space.
    cma(addr, dst, len, |l, r| unsafe {
        libc::process_vm_readv(pid, l, 1, r, 1, 0)
    })
}

/// Writes `len` bytes at `src` into process `pid` at `addr` (CMA).
fn write_remote(pid: i32, addr: usize, src: *const u8, len: usize) -> std::io::Result<()> {
    // SAFETY: `local` is readable memory of ours (isend contract); the
    // kernel checks `remote` against the peer's address space, and the
    // peer's offer made it ours to write (see `Help`).
    cma(addr, src.cast_mut(), len, |l, r| unsafe {
        libc::process_vm_writev(pid, l, 1, r, 1, 0)
    })
}

/// Moves `len` bytes between our `local` and the peer's `addr` by `call`,
/// resuming after partial transfers.
fn cma(
    addr: usize,
    local: *mut u8,
    len: usize,
    call: impl Fn(&libc::iovec, &libc::iovec) -> isize,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        let ours = libc::iovec {
            // SAFETY: done < len: inside the caller's range.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (addr + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let n = call(&ours, &remote);
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                "the peer's memory ended",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

impl Connection for ShmConnection {
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
        // Larger messages are read from our memory where the peer can.
        let eager_max = self.eager_max[region.is_all_in_flight() as usize];
        let remote = self.remote_reads && len > eager_max;
        self.sends.push_back(Outgoing {
            data,
            len,
            tag,
            published: 0,
            last_slot: None,
            remote,
            region: remote.then(|| region.key::<Region>().copied()).flatten(),
            helps: !region.is_declining_help(),
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
        self.recvs.push_back(Incoming {
            data,
            len,
            tag,
            received: 0,
            peer_writes: region.peer_writes(),
            in_pieces: region.is_used_as_landed(),
        });
        Ok(self.requests.post(Direction::Recv))
    }

    fn progress(&mut self) -> Result<bool> {
        self.check_usable()?;
        let result = (|| -> Result<bool> {
            if (self.woke || self.seg.aborted().load(Ordering::Relaxed) != 0) && !self.peer_gone {
                self.woke = false;
                self.seg.sleeping(self.side).store(0, Ordering::Relaxed);
                self.drain_socket()?;
            }
            self.tell_core_shared();
            let moved = self.progress_sends()? | self.progress_recvs()?;
            if self.peer_gone {
                // Nothing more will come, and nothing we send will be taken.
                if !moved && self.pending() > 0 {
                    return Err(Error::Closed { peer: self.peer });
                }
            } else if moved {
                // One doorbell check for both rings: it costs a full fence.
                self.ring_peer()?;
            }
            Ok(moved)
        })();
        if let Err(e) = &result {
            self.failed = Some(e.clone());
        }
        result
    }

    fn is_done(&self, request: Request) -> bool {
        self.requests.is_done(request)
    }

    fn landed(&self, request: Request) -> usize {
        match (request.dir, self.recvs.front()) {
            (Direction::Recv, Some(inc)) if self.requests.is_next(request) => inc.received,
            _ => 0,
        }
    }

    fn pending(&self) -> usize {
        self.sends.len() + self.recvs.len()
    }

    fn wake_source(&mut self) -> Wake<'_> {
        if self.pending() == 0 {
            return Wake::Idle;
        }
        if self.peer_gone {
            return Wake::Now;
        }
        self.seg.sleeping(self.side).store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if self.can_progress() {
            self.seg.sleeping(self.side).store(0, Ordering::Relaxed);
            return Wake::Now;
        }
        self.woke = true;
        Wake::On(
            self.ctl.as_fd(),
            Interest {
                readable: true,
                writable: false,
            },
        )
    }

    fn abort(&mut self, reason: &str) {
        let peer_listening = matches!(
            self.failed,
            None | Some(Error::Mismatch { .. } | Error::Invalid(_))
        );
        if peer_listening {
            let reason = &reason.as_bytes()[..reason.len().min(4096)];
            let mut msg = vec![ABORT];
            msg.extend_from_slice(&(reason.len() as u32).to_le_bytes());
            msg.extend_from_slice(reason);
            let sent = self.ctl.set_nonblocking(false).is_ok()
                && self
                    .ctl
                    .set_write_timeout(Some(Duration::from_secs(1)))
                    .is_ok()
                && self.ctl.write_all(&msg).is_ok();
            if !sent {
                tracing::debug!(peer = self.peer, "could not tell the peer we abort");
            }
            self.seg.aborted().store(1, Ordering::SeqCst);
        }
        let _ = self.ctl.shutdown(std::net::Shutdown::Write);
        self.revoke_offers();
        self.sends.clear();
        self.recvs.clear();
        self.publishing = 0;
        if self.failed.is_none() {
            self.failed = Some(Error::Aborted {
                peer: self.peer,
                reason: reason.to_string(),
            });
        }
    }
}

/// What a hostile peer can do with its side of a connection, for the tests
/// that attack ([`super::hostile`]): publish any descriptor, and try to
/// shrink the segment under the receiver.
#[cfg(test)]
impl ShmConnection {
    pub(super) fn publish_raw(&mut self, desc: Desc) -> Result<()> {
        let dir = self.out_dir();
        self.seg.write_desc(dir, self.head, desc);
        self.head += 1;
        self.seg.head(dir).store(self.head, PUBLISH);
        self.ring_peer()
    }

    pub(super) fn truncate_segment(&self) -> std::io::Result<()> {
        rustix::fs::ftruncate(self.seg.fd(), 0).map_err(Into::into)
    }
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        self.revoke_offers();
    }
}

#[cfg(test)]
mod fragment_checks {
    use proptest::prelude::*;

    use crate::shm::segment::SLOT_BYTES;

    use super::*;

    fn receive(len: usize, received: usize) -> Incoming {
        Incoming {
            data: std::ptr::null_mut(),
            len,
            tag: 7,
            received,
            peer_writes: false,
            in_pieces: false,
        }
    }

    fn fragment(offset: u64, len: u64, msg_len: u64, kind: u32) -> Desc {
        Desc {
            tag: 7,
            msg_len,
            offset,
            len,
            remote: 0,
            kind,
            region_fd: -1,
            region_ino: 0,
            region_offset: 0,
        }
    }

    #[test]
    fn a_fragment_past_the_receive_is_refused_even_when_its_end_wraps() {
        // What a hostile peer sent: 1 byte at 0, then 2^64 - 1 bytes at 1.
        let inc = receive(8, 1);
        let eager = Kind::Eager as u32;
        let e = check_fragment(3, &fragment(1, u64::MAX, 8, eager), &inc, true, SLOT_BYTES)
            .unwrap_err();
        assert!(e.to_string().contains("peer rank 3"), "{e}");
        let slot = SLOT_BYTES as u64;
        let big = receive(4 * SLOT_BYTES, 0);
        let msg = 4 * slot;
        assert!(check_fragment(
            3,
            &fragment(0, slot + 1, msg, eager),
            &big,
            true,
            SLOT_BYTES
        )
        .is_err());
        assert!(check_fragment(3, &fragment(0, slot, msg, eager), &big, true, SLOT_BYTES).is_ok());
        let remote = Kind::Remote as u32;
        assert!(
            check_fragment(3, &fragment(0, msg, msg, remote), &big, false, SLOT_BYTES).is_err()
        );
        assert!(check_fragment(3, &fragment(0, msg, msg, remote), &big, true, SLOT_BYTES).is_ok());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// Whatever a peer writes in a descriptor, an accepted fragment lies
        /// inside the posted receive, right after what was received, within a
        /// slot if the bytes are in one, and read remotely only if agreed.
        #[test]
        fn an_accepted_fragment_lies_inside_the_receive(
            offset in prop_oneof![0u64..64, any::<u64>()],
            len in prop_oneof![0u64..(2 * SLOT_BYTES as u64), any::<u64>()],
            kind in 0u32..4,
            inc_len in 0usize..(4 * SLOT_BYTES),
            received in 0usize..64,
            remote_reads in any::<bool>(),
        ) {
            let inc = receive(inc_len, received.min(inc_len));
            let desc = fragment(offset, len, inc_len as u64, kind);
            if check_fragment(1, &desc, &inc, remote_reads, SLOT_BYTES).is_ok() {
                prop_assert_eq!(offset as usize, inc.received);
                prop_assert!(u128::from(offset) + u128::from(len) <= inc_len as u128);
                match kind {
                    k if k == Kind::Eager as u32 => prop_assert!(len as usize <= SLOT_BYTES),
                    k if k == Kind::Remote as u32 => prop_assert!(remote_reads),
                    _ => prop_assert!(false, "unknown kind accepted"),
                }
            }
        }
    }
}
