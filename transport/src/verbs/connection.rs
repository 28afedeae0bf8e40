//! One peer over RC queue pairs: the rendezvous (clear-to-send, then
//! RDMA WRITE_WITH_IMM into the posted buffer) and its completions.
//!
//! With several queue pairs per peer (`COLL_IB_QPS_PER_PEER`), message k
//! (its grant and its data) goes over queue pair k mod n: RoCE v2 gives each
//! queue pair its own UDP source port, so ECMP spreads them over paths.
//! Queue pairs complete independently, so grants, writes and receives are
//! matched by sequence number, not by arrival order.
//!
//! A connection dropped in good order tells the peer, on the side channel,
//! how many of its messages arrived: the acknowledgement of the peer's last
//! write may have been lost, and its retry finds no queue pair once we are
//! gone, so the peer settles its writes by that count instead of failing
//! (5% packet loss in `ci/loss.sh` caught it, about one run in five).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::event::epoll;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue, GenericCompletionQueue,
    WorkCompletionOperationType, WorkCompletionStatus,
};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::window::Window;
use super::{device::Port, Registration, Retry, Settings};
use crate::wire::{self, Frame, HEADER_LEN};
use crate::{
    Connection, Direction, Error, Interest, MemRegion, Rank, Request, Requests, Result, Tag, Wake,
};

/// Receive buffers kept posted (each takes a clear-to-send or the immediate
/// of a write): more than the sends and receives either side keeps in flight.
const RECV_SLOTS: usize = 256;
const SLOT_BYTES: usize = 64;
const SQ_DEPTH: u32 = 512;
/// Registered slots the clear-to-send messages are sent from; more than the
/// receives ever in flight (the executor's window is at most 64).
const CTS_SLOTS: usize = 128;
/// Memory windows a connection makes at most (one per receive in flight,
/// bound, or being unbound): past the receives ever in flight.
const WINDOWS_MAX: usize = 2 * CTS_SLOTS;
/// Room for every completion that can be outstanding at once: the posted
/// receive slots, the data writes and grants the send queues hold, and one
/// bind or unbind per window.
const CQ_DEPTH: u32 = (RECV_SLOTS + SQ_DEPTH as usize + WINDOWS_MAX) as u32;
/// Messages up to this many bytes (clear-to-sends, tiny payloads) are sent
/// inline when the device allows.
const INLINE_MAX: u32 = 128;
/// Work request ids carry their kind in the top byte.
const WR_DATA: u64 = 1 << 56;
const WR_CTS: u64 = 2 << 56;
const WR_RECV: u64 = 3 << 56;
const WR_BIND: u64 = 4 << 56;
const WR_UNBIND: u64 = 5 << 56;
const KIND: u64 = 0xff << 56;
/// A data write that ends its message (the others complete nothing).
const WR_LAST: u64 = 1 << 48;
/// Data writes in flight at most: the send queue holds them beside the
/// clear-to-sends.
const WRITES_MAX: usize = SQ_DEPTH as usize - CTS_SLOTS;

/// A receiver's grant: where its posted buffer is and what it expects.
#[derive(Clone, Copy, Debug)]
struct Cts {
    tag: Tag,
    addr: u64,
    len: u64,
    rkey: u32,
    seq: u32,
}

const CTS_LEN: usize = 40;

impl Cts {
    fn encode(&self) -> [u8; CTS_LEN] {
        let mut b = [0u8; CTS_LEN];
        b[0..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..36].copy_from_slice(&self.rkey.to_le_bytes());
        b[36..40].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Self {
        Cts {
            tag: u128::from_le_bytes(b[0..16].try_into().unwrap()),
            addr: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            len: u64::from_le_bytes(b[24..32].try_into().unwrap()),
            rkey: u32::from_le_bytes(b[32..36].try_into().unwrap()),
            seq: u32::from_le_bytes(b[36..40].try_into().unwrap()),
        }
    }
}

/// How far past our first send still waiting for its grant a grant may
/// be: more than any caller keeps in flight, and a bound on the grants a
/// peer can make us hold.
const GRANTS_AHEAD: u32 = 1 << 16;

/// Keeps a peer's grant for a send of ours, if it could be one. `first` is
/// our first send whose grant we have not taken: a grant before it (for a
/// send whose grant we took), one twice for the same send, or one far ahead
/// is a peer not following the protocol (a hostile one could make us hold
/// grants without end; every grant kept is one we will take).
fn keep_grant(grants: &mut Vec<Cts>, grant: Cts, first: u32, peer: Rank) -> Result<()> {
    let ahead = grant.seq.wrapping_sub(first);
    if ahead >= GRANTS_AHEAD || grants.iter().any(|g| g.seq == grant.seq) {
        return Err(Error::Invalid(format!(
            "peer rank {peer} granted a receive for our send {} (the first still waiting for \
             its grant is {first}): twice, or not one we can have posted",
            grant.seq
        )));
    }
    grants.push(grant);
    Ok(())
}

/// A posted send: what to write where its grant says.
struct Outgoing {
    addr: u64,
    len: u64,
    lkey: u32,
    tag: Tag,
    /// Its write completed (possibly before an earlier one's, on another queue pair).
    done: bool,
}

/// A posted receive whose grant is out.
struct Incoming {
    seq: u32,
    done: bool,
    /// The window its grant opened (none for 0 bytes), until it completes.
    window: Option<Opened>,
}

/// A window bound over a receive's bytes; the registration it lies in is
/// held until the window is unbound (a window still bound makes
/// deregistration fail).
struct Opened {
    window: Window,
    mr: Arc<MemoryRegion>,
}

/// One completion, copied out of the completion queue.
#[derive(Clone, Copy, Default)]
struct Completion {
    wr_id: u64,
    status: u32,
    opcode: u32,
    imm: u32,
}

pub struct VerbsConnection {
    // Field order is drop order: the queue pair before its completion queue,
    // the receive slots' registration before their memory.
    qps: Vec<BasicQueuePair>,
    /// Binds and unbinds the windows, and carries nothing to the peer: a
    /// local operation among a data queue pair's sends is replayed by the
    /// device's retransmission with them (soft-RoCE lost a grant behind one
    /// under packet loss).
    binder: BasicQueuePair,
    /// Unbound windows.
    windows: Vec<Window>,
    /// Windows made (at most `WINDOWS_MAX`).
    windows_made: usize,
    /// Grants whose window's bind has not completed yet, in the order the
    /// binds were posted (the binder completes them in that order).
    awaiting_bind: VecDeque<Cts>,
    /// Completed receives' windows whose unbind has not completed yet, in
    /// order: each holds its registration until then.
    unbinding: VecDeque<Opened>,
    /// Whether grants go through windows (the device has them).
    windows_on: bool,
    pd: Arc<ProtectionDomain>,
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    slots_mr: Arc<MemoryRegion>,
    slots: Vec<u64>,
    cts_mr: Arc<MemoryRegion>,
    cts_slots: Vec<u64>,
    /// Clear-to-send messages posted, and completed (both in order).
    cts_posted: u64,
    /// Send slots whose clear-to-send is in flight.
    cts_busy: Vec<bool>,
    /// Largest message sent inline (0: the device has no inline sends).
    inline_max: usize,
    port: Arc<Port>,
    peer: Rank,
    /// The TCP side channel (aborts, liveness) and one epoll fd over it and
    /// the completion channel, to sleep on both.
    side: Option<TcpStream>,
    side_buf: Vec<u8>,
    epoll: Option<OwnedFd>,
    sends: VecDeque<Outgoing>,
    /// How many of `sends` have their (last) write posted.
    written: usize,
    /// The grant of `sends[written]` and how many of its bytes are posted,
    /// when the send queue's room cut its writes short.
    partial: Option<(Cts, u64)>,
    /// Data writes posted and not yet completed.
    writes_posted: usize,
    /// The longest write; longer messages go as several.
    max_write: u64,
    /// The sequence number of `sends[0]` (sends completed so far).
    send_base: u32,
    /// Grants not yet used, in any order.
    grants: Vec<Cts>,
    recvs: VecDeque<Incoming>,
    next_seq: u32,
    requests: Requests,
    woke: bool,
    peer_gone: bool,
    /// The peer closed in good order having received our first this many
    /// messages ([`Frame::Bye`]).
    peer_received: Option<u32>,
    failed: Option<Error>,
    /// The RC retry settings, for their error.
    retry: Retry,
}

impl Drop for VerbsConnection {
    fn drop(&mut self) {
        if self.failed.is_none() {
            self.say_goodbye();
        }
    }
}

// SAFETY: the queue pair, completion queue and channel are only used from
// the thread that owns the connection; raw addresses in the queues point
// into memory the poster keeps valid (isend/irecv contract).
unsafe impl Send for VerbsConnection {}

impl VerbsConnection {
    /// `settings.qps` queue pairs in INIT with every receive slot posted.
    pub(crate) fn new(
        port: Arc<Port>,
        pd: &Arc<ProtectionDomain>,
        peer: Rank,
        settings: Settings,
    ) -> Result<Self> {
        let nqps = settings.qps;
        let verb = |what: &'static str| {
            move |e: &dyn std::fmt::Display| {
                Error::Invalid(format!("{what} (peer rank {peer}): {e}"))
            }
        };
        let channel = CompletionChannel::new(&port.context)
            .map_err(|e| verb("ibv_create_comp_channel")(&e))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| verb("ibv_create_comp_channel")(&e))?;
        let cq = port
            .context
            .create_cq_builder()
            .setup_cqe(CQ_DEPTH)
            .setup_comp_channel(&channel, 0)
            // The classic ibv_poll_cq: rxe's ibv_next_poll (extended CQs)
            // kept reporting entries once the queue was drained.
            .build()
            .map_err(|e| verb("ibv_create_cq")(&e))?;
        let create = |inline: u32| {
            pd.create_qp_builder()
                .setup_send_cq(GenericCompletionQueue::from(Arc::clone(&cq)))
                .setup_recv_cq(GenericCompletionQueue::from(Arc::clone(&cq)))
                .setup_max_send_wr(SQ_DEPTH)
                .setup_max_recv_wr(RECV_SLOTS as u32)
                .setup_max_send_sge(1)
                .setup_max_recv_sge(1)
                .setup_max_inline_data(inline)
                // The classic ibv_post_send: rxe failed work requests posted
                // through the extended (ibv_wr_*) API with LOC_QP_OP_ERR.
                .build()
        };
        // Inline sends where the device has them: the bytes travel in the
        // work request, sparing the adapter a DMA read of the buffer.
        let mut inline_max = INLINE_MAX as usize;
        // The data queue pairs, then the binder (see `binder`).
        let mut qps = Vec::with_capacity(nqps + 1);
        for _ in 0..=nqps {
            let mut qp = match create(inline_max as u32) {
                Ok(qp) => qp,
                Err(_) if inline_max > 0 => {
                    inline_max = 0;
                    create(0).map_err(|e| verb("ibv_create_qp")(&e))?
                }
                Err(e) => return Err(verb("ibv_create_qp")(&e)),
            };
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(port.port)
                // Peers write into what we granted; nothing reads remotely.
                .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
            qp.modify(&attr)
                .map_err(|e| verb("ibv_modify_qp to INIT")(&e))?;
            qps.push(qp);
        }
        let binder = qps.pop().expect("nqps + 1 queue pairs");
        // (One queue pair without inline sends makes the rest go without.)
        tracing::debug!(peer, nqps, inline_max, "queue pairs created");
        let (slots, slots_mr) = registered_slots(pd, RECV_SLOTS)
            .map_err(|e| verb("ibv_reg_mr of the receive slots")(&e))?;
        let (cts_slots, cts_mr) = registered_slots(pd, CTS_SLOTS)
            .map_err(|e| verb("ibv_reg_mr of the clear-to-send slots")(&e))?;
        let mut conn = VerbsConnection {
            windows: Vec::new(),
            windows_made: 0,
            awaiting_bind: VecDeque::new(),
            unbinding: VecDeque::new(),
            binder,
            windows_on: settings.windows,
            pd: Arc::clone(pd),
            qps,
            cq,
            channel,
            slots_mr,
            slots,
            cts_mr,
            cts_slots,
            cts_posted: 0,
            cts_busy: vec![false; CTS_SLOTS],
            inline_max,
            port,
            peer,
            side: None,
            side_buf: Vec::new(),
            epoll: None,
            sends: VecDeque::new(),
            written: 0,
            partial: None,
            writes_posted: 0,
            max_write: settings.max_write,
            send_base: 0,
            grants: Vec::new(),
            recvs: VecDeque::new(),
            next_seq: 0,
            requests: Requests::default(),
            woke: false,
            peer_gone: false,
            peer_received: None,
            failed: None,
            retry: settings.retry,
        };
        for slot in 0..RECV_SLOTS {
            conn.post_slot(slot)?;
        }
        Ok(conn)
    }

    /// The data queue pairs' numbers, then the binder's.
    pub(crate) fn qp_numbers(&self) -> Vec<u32> {
        let qps = self.qps.iter().chain([&self.binder]);
        qps.map(|qp| qp.qp_number()).collect()
    }

    /// INIT → RTR → RTS, queue pair i towards the peer's queue pair i.
    pub(crate) fn connect(
        &mut self,
        peer_qpns: &[u32],
        my_psn: u32,
        peer_psn: u32,
        peer_gid: Gid,
        mtu: u32,
    ) -> Result<()> {
        let peer = self.peer;
        let verb = |what: &'static str| {
            move |e: &dyn std::fmt::Display| {
                Error::Invalid(format!("{what} (peer rank {peer}): {e}"))
            }
        };
        let mtu = match mtu {
            256 => Mtu::Mtu256,
            512 => Mtu::Mtu512,
            1024 => Mtu::Mtu1024,
            2048 => Mtu::Mtu2048,
            _ => Mtu::Mtu4096,
        };
        let qps = self.qps.iter_mut().chain([&mut self.binder]);
        for (qp, &peer_qpn) in qps.zip(peer_qpns) {
            Self::connect_one(
                qp,
                self.port.as_ref(),
                peer_qpn,
                (my_psn, peer_psn),
                &peer_gid,
                mtu,
                self.retry,
            )
            .map_err(|(what, e)| verb(what)(&e))?;
        }
        Ok(())
    }

    fn connect_one(
        qp: &mut BasicQueuePair,
        port: &Port,
        peer_qpn: u32,
        (my_psn, peer_psn): (u32, u32),
        peer_gid: &Gid,
        mtu: Mtu,
        retry: Retry,
    ) -> std::result::Result<(), (&'static str, String)> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(peer_qpn)
            .setup_rq_psn(peer_psn)
            .setup_max_dest_read_atomic(1)
            .setup_min_rnr_timer(12);
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(0)
            .setup_port(port.port)
            .setup_service_level(0)
            .setup_grh_src_gid_index(port.gid_index as u8)
            .setup_grh_dest_gid(peer_gid)
            .setup_grh_hop_limit(64);
        attr.setup_address_vector(&ah);
        qp.modify(&attr)
            .map_err(|e| ("ibv_modify_qp to RTR", e.to_string()))?;
        let mut attr = QueuePairAttribute::new();
        // Then the completion fails with RETRY_EXC_ERR (see `Retry`).
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(my_psn)
            .setup_timeout(retry.timeout)
            .setup_retry_cnt(retry.count)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(1);
        qp.modify(&attr)
            .map_err(|e| ("ibv_modify_qp to RTS", e.to_string()))
    }

    /// Keeps the side channel for aborts and liveness; one epoll fd waits on
    /// it and on the completion channel.
    pub(crate) fn attach_side_channel(&mut self, side: TcpStream) -> Result<()> {
        let io =
            |e: std::io::Error| Error::io(Some(self.peer), "set up the wake-up descriptor", &e);
        side.set_nonblocking(true).map_err(io)?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| io(e.into()))?;
        for fd in [self.channel.as_raw_fd(), side.as_raw_fd()] {
            // SAFETY: both descriptors belong to this connection and outlive the epoll fd's use.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            epoll::add(&ep, fd, epoll::EventData::new_u64(0), epoll::EventFlags::IN)
                .map_err(|e| io(e.into()))?;
        }
        self.side = Some(side);
        self.epoll = Some(ep);
        Ok(())
    }

    fn slot_addr(&self, slot: usize) -> u64 {
        self.slots.as_ptr() as u64 + (slot * SLOT_BYTES) as u64
    }

    /// The queue pair that carries message `seq` (and receive slot `seq`).
    fn qp_for(&self, seq: usize) -> usize {
        seq % self.qps.len()
    }

    fn post_slot(&mut self, slot: usize) -> Result<()> {
        let (lkey, addr) = (self.slots_mr.lkey(), self.slot_addr(slot));
        let q = self.qp_for(slot);
        let mut guard = self.qps[q].start_post_recv();
        let wr = guard.construct_wr(WR_RECV | slot as u64);
        // SAFETY: the slot lies in the registered `slots`, which outlive the queue pair.
        unsafe { wr.setup_sge(lkey, addr, SLOT_BYTES as u32) };
        guard.post().map_err(|e| {
            self.verb_error(
                "ibv_post_recv",
                &format!("{e} (queue pair in state {:?})", self.qps[q].state()),
            )
        })
    }

    /// Binds a window over a receive's `len` bytes at `addr` of `mr`,
    /// through the binder, signaled: its grant goes when it completes.
    fn open_window(&mut self, mr: &Arc<MemoryRegion>, addr: u64, len: u64) -> Result<Opened> {
        let mut window = match self.windows.pop() {
            Some(w) => w,
            None if self.windows_made < WINDOWS_MAX => {
                let w = Window::alloc(&self.pd).map_err(|e| self.verb_error("ibv_alloc_mw", &e))?;
                self.windows_made += 1;
                w
            }
            None => {
                let why = format!("more than {WINDOWS_MAX} receives in flight or being closed");
                return Err(self.verb_error("irecv", &why));
            }
        };
        // SAFETY: `addr..addr + len` is the posted receive, inside `mr`
        // (`slice_ptr` checked it against the region), which `Opened` holds.
        unsafe { window.bind(&self.binder, mr, addr, len, WR_BIND) }
            .map_err(|e| self.verb_error("ibv_bind_mw", &e))?;
        Ok(Opened {
            window,
            mr: Arc::clone(mr),
        })
    }

    /// Unbinds a completed receive's window: its key writes nothing more.
    /// Signaled: the window is reused, and its registration let go (a
    /// registration with a window bound cannot be deregistered), only once
    /// the unbind has completed.
    fn close_window(&mut self, mut o: Opened) -> Result<()> {
        let start = o.mr.get_ptr() as u64;
        // SAFETY: an unbind (length 0) touches no memory.
        unsafe { o.window.bind(&self.binder, &o.mr, start, 0, WR_UNBIND) }
            .map_err(|e| self.verb_error("ibv_bind_mw (unbind)", &e))?;
        self.unbinding.push_back(o);
        Ok(())
    }

    /// Grants the next receive, `len` bytes at `addr` of registration
    /// `r`: now, or, through a window over them, once it is bound.
    fn grant(&mut self, r: Option<&Registration>, addr: u64, len: u64, tag: Tag) -> Result<()> {
        let seq = self.next_seq;
        let (window, rkey) = match r {
            Some(r) if len > 0 && self.windows_on => {
                let o = self.open_window(&r.0, addr, len)?;
                let rkey = o.window.rkey();
                (Some(o), rkey)
            }
            r => (None, r.map_or(0, |r| r.0.rkey())),
        };
        let cts = Cts {
            tag,
            addr,
            len,
            rkey,
            seq,
        };
        match window {
            Some(_) => self.awaiting_bind.push_back(cts),
            None => self.send_cts(cts)?,
        }
        self.next_seq = self.next_seq.wrapping_add(1);
        self.recvs.push_back(Incoming {
            seq,
            done: false,
            window,
        });
        Ok(())
    }

    fn verb_error(&self, verb: &str, e: &dyn std::fmt::Display) -> Error {
        Error::Invalid(format!("{verb} to peer rank {} failed: {e}", self.peer))
    }

    /// Signaled, and inline for a message that fits.
    fn send_flags(&self, len: usize) -> WorkRequestFlags {
        match len > 0 && len <= self.inline_max {
            true => WorkRequestFlags::Signaled | WorkRequestFlags::Inline,
            false => WorkRequestFlags::Signaled,
        }
    }

    /// Sends a grant for a posted receive, from the next send slot.
    fn send_cts(&mut self, cts: Cts) -> Result<()> {
        let slot = (self.cts_posted % CTS_SLOTS as u64) as usize;
        if self.cts_busy[slot] {
            return Err(
                self.verb_error("clear-to-send", &"more receives in flight than send slots")
            );
        }
        let words = &mut self.cts_slots[slot * SLOT_BYTES / 8..][..CTS_LEN / 8];
        words.copy_from_slice(&bytemuck_words(&cts.encode()));
        let (lkey, addr) = (self.cts_mr.lkey(), words.as_ptr() as u64);
        let flags = self.send_flags(CTS_LEN);
        let q = self.qp_for(cts.seq as usize);
        let mut guard = self.qps[q].start_post_send();
        let wr = guard.construct_wr(WR_CTS | slot as u64, flags).setup_send();
        // SAFETY: the slot is registered and not reused until this send completes.
        unsafe { wr.setup_sge(lkey, addr, CTS_LEN as u32) };
        guard
            .post()
            .map_err(|e| self.verb_error("ibv_post_send (clear-to-send)", &e))?;
        self.cts_posted += 1;
        self.cts_busy[slot] = true;
        Ok(())
    }

    /// Whether the next send's grant is here.
    fn can_write(&self) -> bool {
        let seq = self.send_base.wrapping_add(self.written as u32);
        self.written < self.sends.len() && self.grants.iter().any(|g| g.seq == seq)
    }

    /// Writes every send that has its grant, checking that both ends agree.
    /// A message longer than `max_write` goes as several writes, the last
    /// with the immediate; a full send queue may leave a message partly
    /// posted, resumed at the next call.
    fn post_writes(&mut self) -> Result<bool> {
        let mut moved = false;
        while self.written < self.sends.len() {
            let (grant, mut at) = match self.partial.take() {
                Some(partial) => partial,
                None => match self.take_grant()? {
                    Some(grant) => (grant, 0),
                    None => break,
                },
            };
            let len = self.sends[self.written].len;
            loop {
                if self.writes_posted == WRITES_MAX {
                    self.partial = Some((grant, at));
                    return Ok(moved);
                }
                let part = (len - at).min(self.max_write);
                self.post_write(&grant, at, part)?;
                (at, moved) = (at + part, true);
                if at == len {
                    break;
                }
            }
            self.written += 1;
        }
        Ok(moved)
    }

    /// The grant for the next unwritten send, if here, checked against it.
    fn take_grant(&mut self) -> Result<Option<Cts>> {
        let seq = self.send_base.wrapping_add(self.written as u32);
        let Some(at) = self.grants.iter().position(|g| g.seq == seq) else {
            return Ok(None);
        };
        let grant = self.grants.swap_remove(at);
        let out = &self.sends[self.written];
        if grant.tag != out.tag || grant.len != out.len {
            // The receiver's grant is the message it expects.
            return Err(Error::Mismatch {
                peer: self.peer,
                expected_tag: out.tag,
                expected_len: out.len as usize,
                got_tag: grant.tag,
                got_len: grant.len as usize,
            });
        }
        Ok(Some(grant))
    }

    /// Posts bytes `at..at + len` of the next unwritten send; the write
    /// that ends the message carries the immediate that completes its receive.
    fn post_write(&mut self, grant: &Cts, at: u64, len: u64) -> Result<()> {
        let out = &self.sends[self.written];
        let last = at + len == out.len;
        let (addr, lkey) = (out.addr + at, out.lkey);
        let flags = self.send_flags(len as usize);
        let q = self.qp_for(grant.seq as usize);
        let id = WR_DATA | if last { WR_LAST } else { 0 } | grant.seq as u64;
        let mut guard = self.qps[q].start_post_send();
        let wr = guard.construct_wr(id, flags);
        let (rkey, raddr) = (grant.rkey, grant.addr + at);
        let wr = match last {
            true => wr.setup_write_imm(rkey, raddr, grant.seq),
            false => wr.setup_write(rkey, raddr),
        };
        // SAFETY: addr..addr+len is registered (lkey) and kept valid by the
        // isend contract; len is at most max_write, within 32 bits.
        unsafe {
            if len == 0 {
                wr.setup_sge_list(&[]);
            } else {
                wr.setup_sge(lkey, addr, len as u32);
            }
        }
        let verb = match last {
            true => "ibv_post_send (RDMA WRITE_WITH_IMM)",
            false => "ibv_post_send (RDMA WRITE)",
        };
        guard.post().map_err(|e| self.verb_error(verb, &e))?;
        self.writes_posted += 1;
        Ok(())
    }

    /// Takes up to a batch of completions and applies them.
    fn poll_cq(&mut self) -> Result<bool> {
        let mut batch = [Completion::default(); 32];
        let mut n = 0;
        if let Ok(mut poller) = self.cq.start_poll() {
            for wc in poller.by_ref() {
                let ok = wc.status() == WorkCompletionStatus::Success as u32;
                batch[n] = Completion {
                    wr_id: wc.wr_id(),
                    status: wc.status(),
                    opcode: if ok { wc.opcode() } else { 0 },
                    imm: if ok
                        && wc.opcode() == WorkCompletionOperationType::ReceiveWithImmediate as u32
                    {
                        wc.imm_data()
                    } else {
                        0
                    },
                };
                n += 1;
                if n == batch.len() {
                    break;
                }
            }
        }
        let ok = |c: &Completion| c.status == WorkCompletionStatus::Success as u32;
        // An error completion explains the others (a queue pair in error
        // flushes everything after it): report it before applying any. The
        // side channel may explain it better: the peer's abort reason, its
        // exit, or its goodbye. After a goodbye the peer's queue pair is
        // gone and our retries fail: what it received was settled, and what
        // it did not shows as pending when its side channel closes.
        if let Some(bad) = batch[..n].iter().find(|c| !ok(c)) {
            self.drain_side()?;
            if self.peer_received.is_none() {
                return Err(self.failed_completion(*bad));
            }
        }
        for c in batch[..n].iter().filter(|c| ok(c)) {
            self.complete(*c)?;
        }
        Ok(n > 0)
    }

    /// Applies a successful completion.
    fn complete(&mut self, c: Completion) -> Result<()> {
        match c.wr_id & KIND {
            // Writes complete in order per queue pair, not across them:
            // requests complete in order, so the front waits for its own.
            WR_DATA => {
                self.writes_posted = self.writes_posted.saturating_sub(1);
                if c.wr_id & WR_LAST == 0 {
                    return Ok(());
                }
                let at = (c.wr_id as u32).wrapping_sub(self.send_base) as usize;
                match self.sends.get_mut(at) {
                    Some(out) if at < self.written => out.done = true,
                    // Its acknowledgement came after the goodbye settled it.
                    _ if self.peer_received.is_some() && (at as u32 as i32) < 0 => {}
                    _ => {
                        return Err(self
                            .verb_error("RDMA WRITE_WITH_IMM", &"completion of no posted write"))
                    }
                }
                self.retire_sends();
            }
            WR_CTS => self.cts_busy[(c.wr_id & 0xffff) as usize] = false,
            // A window is bound: its grant may go now.
            WR_BIND => {
                let Some(cts) = self.awaiting_bind.pop_front() else {
                    return Err(self.verb_error("BIND_MW", &"completion of no posted bind"));
                };
                self.send_cts(cts)?;
            }
            // A window is unbound: it may serve another receive.
            WR_UNBIND => {
                let Some(o) = self.unbinding.pop_front() else {
                    return Err(self.verb_error("BIND_MW", &"completion of no posted unbind"));
                };
                self.windows.push(o.window);
            }
            _ => {
                let slot = (c.wr_id & 0xffff) as usize;
                if c.opcode == WorkCompletionOperationType::ReceiveWithImmediate as u32 {
                    let first = self.recvs.front().map_or(0, |r| r.seq);
                    let at = c.imm.wrapping_sub(first) as usize;
                    match self.recvs.get_mut(at) {
                        Some(inc) if inc.seq == c.imm => inc.done = true,
                        _ => {
                            return Err(self.verb_error(
                                "RDMA WRITE_WITH_IMM",
                                &format!("data for receive {} matches no posted receive", c.imm),
                            ))
                        }
                    }
                    while self.recvs.front().is_some_and(|r| r.done) {
                        let inc = self.recvs.pop_front().expect("a receive at the front");
                        if let Some(opened) = inc.window {
                            self.close_window(opened)?;
                        }
                        self.requests.complete(Direction::Recv);
                    }
                } else {
                    let at = slot * SLOT_BYTES;
                    let bytes: &[u8] = &bytemuck_bytes(&self.slots)[at..at + CTS_LEN];
                    let grant = Cts::decode(bytes);
                    // The grant of the send `partial` resumes is taken.
                    let taken = self.written + usize::from(self.partial.is_some());
                    let first = self.send_base.wrapping_add(taken as u32);
                    keep_grant(&mut self.grants, grant, first, self.peer)?;
                }
                self.post_slot(slot)?;
            }
        }
        Ok(())
    }

    /// Retires the sends at the front that are done: requests complete in
    /// order.
    fn retire_sends(&mut self) {
        while self.sends.front().is_some_and(|o| o.done) {
            self.sends.pop_front();
            self.written -= 1;
            self.send_base = self.send_base.wrapping_add(1);
            self.requests.complete(Direction::Send);
        }
    }

    /// An error completion, named by verb and status (the caller read the
    /// side channel first: an abort reason there explains it better).
    fn failed_completion(&self, c: Completion) -> Error {
        let verb = match c.wr_id & KIND {
            WR_DATA if c.wr_id & WR_LAST == 0 => "RDMA WRITE",
            WR_DATA => "RDMA WRITE_WITH_IMM",
            WR_CTS => "SEND (clear-to-send)",
            WR_BIND => "BIND_MW",
            WR_UNBIND => "BIND_MW (unbind)",
            _ => "RECV",
        };
        let status = WorkCompletionStatus::from(c.status);
        if self.peer_gone {
            return Error::Closed { peer: self.peer };
        }
        let why = match status {
            WorkCompletionStatus::RetryCounterExceededError => {
                format!(": retries exhausted: {}", self.retry.explain(self.peer))
            }
            _ => String::new(),
        };
        Error::Io {
            peer: Some(self.peer),
            what: "completion",
            kind: ErrorKind::Other,
            message: format!("{verb} failed with status {status:?} ({}){why}", c.status),
        }
    }

    /// Acknowledges completion events after a sleep.
    fn drain_events(&mut self) {
        let mut n = 0;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: the channel is ours and non-blocking: this returns -1 when empty.
            let r = unsafe {
                rdma_mummy_sys::ibv_get_cq_event(
                    self.channel.comp_channel().as_ptr(),
                    &mut cq,
                    &mut ctx,
                )
            };
            if r != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges the events just taken from our own CQ.
            unsafe { rdma_mummy_sys::ibv_ack_cq_events(self.cq.cq().as_ptr(), n) };
        }
    }

    /// Reads the side channel: an abort frame is the peer's reason, EOF
    /// means its process is gone.
    fn drain_side(&mut self) -> Result<()> {
        let Some(side) = self.side.as_mut() else {
            return Ok(());
        };
        let mut buf = [0u8; 512];
        loop {
            match side.read(&mut buf) {
                Ok(0) => {
                    self.peer_gone = true;
                    break;
                }
                Ok(n) => self.side_buf.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.peer_gone = true;
                    break;
                }
            }
        }
        if self.side_buf.len() >= HEADER_LEN {
            match wire::decode_header(self.side_buf[..HEADER_LEN].try_into().unwrap()) {
                Some(Frame::Abort { reason_len }) => {
                    let end = (HEADER_LEN + reason_len).min(self.side_buf.len());
                    let reason =
                        String::from_utf8_lossy(&self.side_buf[HEADER_LEN..end]).into_owned();
                    return Err(Error::PeerAborted {
                        peer: self.peer,
                        reason,
                    });
                }
                Some(Frame::Bye { received }) if self.peer_received.is_none() => {
                    self.settle(received)
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The peer closed in good order having received our first `received`
    /// messages: those of our writes are done, even if their
    /// acknowledgement was lost and its retry can no longer reach it.
    fn settle(&mut self, received: u32) {
        self.peer_received = Some(received);
        let arrived = (received.wrapping_sub(self.send_base) as i32).max(0) as usize;
        let written = self.written;
        (self.sends.iter_mut().take(arrived.min(written))).for_each(|o| o.done = true);
        self.retire_sends();
    }

    /// Tells the peer we close in good order and what we received (see
    /// [`settle`](Self::settle)): called when the connection is dropped
    /// with nothing failed.
    fn say_goodbye(&mut self) {
        let received = self.next_seq.wrapping_sub(self.recvs.len() as u32);
        let Some(side) = self.side.as_mut() else {
            return;
        };
        let bye = wire::encode_header(Frame::Bye { received });
        let sent = side.set_nonblocking(false).is_ok()
            && side.set_write_timeout(Some(Duration::from_secs(1))).is_ok()
            && side.write_all(&bye).is_ok();
        if !sent {
            tracing::debug!(peer = self.peer, "could not say goodbye to the peer");
        }
    }

    fn enter_error_state(&mut self) {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        for qp in self.qps.iter_mut().chain([&mut self.binder]) {
            if let Err(e) = qp.modify(&attr) {
                tracing::debug!(peer = self.peer, "ibv_modify_qp to ERR: {e}");
            }
        }
    }
}

/// `count` zeroed slots of SLOT_BYTES and their registration. The caller
/// keeps both and drops the registration first (field order).
fn registered_slots(
    pd: &Arc<ProtectionDomain>,
    count: usize,
) -> std::result::Result<(Vec<u64>, Arc<MemoryRegion>), String> {
    let mut slots = vec![0u64; count * SLOT_BYTES / 8];
    // SAFETY: the registration covers exactly `slots`' heap buffer, which
    // never moves (the Vec is not resized) and outlives it (see above).
    let mr = unsafe {
        pd.reg_mr(
            slots.as_mut_ptr() as usize,
            count * SLOT_BYTES,
            AccessFlags::LocalWrite,
        )
    }
    .map_err(|e| e.to_string())?;
    Ok((slots, mr))
}

fn bytemuck_words(bytes: &[u8; CTS_LEN]) -> [u64; CTS_LEN / 8] {
    std::array::from_fn(|i| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap()))
}

fn bytemuck_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding; a byte view of it is always valid.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), words.len() * 8) }
}

/// The registration of `region` with this transport.
fn registration(region: &MemRegion, len: usize) -> Result<Option<&Registration>> {
    match region.key::<Registration>() {
        Some(r) => Ok(Some(r)),
        None if len == 0 => Ok(None),
        None => Err(Error::Invalid(
            "a buffer was not registered with the verbs transport".into(),
        )),
    }
}

impl Connection for VerbsConnection {
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
        self.failed.clone().map_or(Ok(()), Err)?;
        let addr = region.slice_ptr(offset, len)? as u64;
        let lkey = registration(region, len)?.map_or(0, |r| r.0.lkey());
        self.sends.push_back(Outgoing {
            addr,
            len: len as u64,
            lkey,
            tag,
            done: false,
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
        self.failed.clone().map_or(Ok(()), Err)?;
        let addr = region.slice_ptr(offset, len)? as u64;
        if let Err(e) = self.grant(registration(region, len)?, addr, len as u64, tag) {
            self.failed = Some(e.clone());
            return Err(e);
        }
        Ok(self.requests.post(Direction::Recv))
    }

    fn progress(&mut self) -> Result<bool> {
        self.failed.clone().map_or(Ok(()), Err)?;
        let result = (|| -> Result<bool> {
            if self.woke {
                self.woke = false;
                self.drain_events();
                self.drain_side()?;
            }
            let moved = self.poll_cq()? | self.post_writes()?;
            if self.peer_gone && !moved && self.pending() > 0 {
                return Err(Error::Closed { peer: self.peer });
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

    fn pending(&self) -> usize {
        self.sends.len() + self.recvs.len()
    }

    fn wake_source(&mut self) -> Wake<'_> {
        if self.pending() == 0 || self.failed.is_some() {
            return if self.failed.is_some() {
                Wake::Now
            } else {
                Wake::Idle
            };
        }
        // Arm, then look once more: a completion between the last poll and
        // the arming would raise no event.
        // SAFETY: our own CQ.
        unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        match self.poll_cq() {
            Ok(false) if !self.can_write() => {}
            Ok(_) => return Wake::Now,
            Err(e) => {
                self.failed = Some(e);
                return Wake::Now;
            }
        }
        self.woke = true;
        match &self.epoll {
            Some(ep) => Wake::On(
                ep.as_fd(),
                Interest {
                    readable: true,
                    writable: false,
                },
            ),
            None => Wake::Now,
        }
    }

    fn abort(&mut self, reason: &str) {
        let peer_listening = matches!(
            self.failed,
            None | Some(Error::Mismatch { .. } | Error::Invalid(_))
        );
        if let (true, Some(side)) = (peer_listening, self.side.as_mut()) {
            let reason = &reason.as_bytes()[..reason.len().min(wire::MAX_REASON_LEN)];
            let mut msg = wire::encode_header(Frame::Abort {
                reason_len: reason.len(),
            })
            .to_vec();
            msg.extend_from_slice(reason);
            let sent = side.set_nonblocking(false).is_ok()
                && side.set_write_timeout(Some(Duration::from_secs(1))).is_ok()
                && side.write_all(&msg).is_ok();
            if !sent {
                tracing::debug!(peer = self.peer, "could not tell the peer we abort");
            }
        }
        // In the error state the device no longer reads or writes any
        // posted buffer: the contract's promise once abort returns.
        self.enter_error_state();
        self.sends.clear();
        self.recvs.clear();
        self.awaiting_bind.clear();
        self.unbinding.clear();
        self.grants.clear();
        self.written = 0;
        if self.failed.is_none() {
            self.failed = Some(Error::Aborted {
                peer: self.peer,
                reason: reason.to_string(),
            });
        }
    }
}

#[cfg(test)]
mod grant_checks {
    use super::*;

    fn grant(seq: u32) -> Cts {
        Cts {
            tag: 7,
            addr: 0,
            len: 8,
            rkey: 1,
            seq,
        }
    }

    #[test]
    fn a_grant_twice_behind_or_far_ahead_is_refused() {
        let mut grants = Vec::new();
        let base = u32::MAX - 2; // sequence numbers wrap
        keep_grant(&mut grants, grant(base), base, 3).unwrap();
        keep_grant(&mut grants, grant(base.wrapping_add(5)), base, 3).unwrap();
        let twice = keep_grant(&mut grants, grant(base), base, 3).unwrap_err();
        assert!(twice.to_string().contains("peer rank 3"), "{twice}");
        assert!(keep_grant(&mut grants, grant(base - 1), base, 3).is_err());
        assert!(keep_grant(&mut grants, grant(base.wrapping_add(GRANTS_AHEAD)), base, 3).is_err());
        assert_eq!(grants.len(), 2);
    }
}

/// What a grant's key lets a peer do, on a real device (the soft-RoCE VM
/// of ci/rxe.sh; skipped elsewhere unless COLL_REQUIRE_VERBS=1): write the
/// posted bytes while the receive is posted, and nothing once it completed.
#[cfg(test)]
mod windows {
    use std::net::{IpAddr, Ipv4Addr};
    use std::time::Instant;

    use super::*;
    use crate::verbs::VerbsTransport;
    use crate::Transport;

    /// Two connected ends, peers of each other, with no side channel.
    fn pair(t: &VerbsTransport) -> (VerbsConnection, VerbsConnection) {
        let new = |peer| VerbsConnection::new(t.port.clone(), &t.pd, peer, t.settings).unwrap();
        let (mut a, mut b) = (new(1), new(0));
        let (gid, mtu) = (t.port.gid, super::super::device::mtu_bytes(t.port.mtu));
        let (qa, qb) = (a.qp_numbers(), b.qp_numbers());
        a.connect(&qb, 0, 0, gid, mtu).unwrap();
        b.connect(&qa, 0, 0, gid, mtu).unwrap();
        (a, b)
    }

    /// Progresses both until `done`, or an error of either (within 10 s).
    fn drive(
        a: &mut VerbsConnection,
        b: &mut VerbsConnection,
        done: impl Fn(&VerbsConnection) -> bool,
    ) -> Result<()> {
        let by = Instant::now() + Duration::from_secs(10);
        while !done(a) {
            a.progress()?;
            b.progress()?;
            assert!(Instant::now() < by, "no progress in 10 s");
        }
        Ok(())
    }

    /// The device, or `None` (the test skips) where there is none, unless
    /// COLL_REQUIRE_VERBS=1.
    fn device() -> Option<VerbsTransport> {
        match VerbsTransport::open(IpAddr::V4(Ipv4Addr::LOCALHOST)) {
            Ok(t) => Some(t),
            Err(e) => {
                let required = std::env::var("COLL_REQUIRE_VERBS").is_ok_and(|v| v == "1");
                assert!(!required, "no RDMA device ({e}), and COLL_REQUIRE_VERBS=1");
                eprintln!("skipping: {e}");
                None
            }
        }
    }

    #[test]
    fn a_grants_key_writes_the_receive_while_it_is_posted_and_never_after() {
        let Some(t) = device() else { return };
        let (mut a, mut b) = pair(&t);
        let mut dst = vec![0u8; 4096];
        let src = [0x5au8; 64];
        let rdst = t.register(dst.as_mut_ptr(), dst.len()).unwrap();
        let rsrc = t.register(src.as_ptr(), src.len()).unwrap();
        // SAFETY: both buffers outlive the requests, waited for below.
        let received = unsafe { a.irecv(&rdst, 1024, 64, 7) }.unwrap();
        let key = a
            .recvs
            .back()
            .and_then(|r| r.window.as_ref())
            .unwrap()
            .window
            .rkey();
        let region_key = registration(&rdst, 64).unwrap().unwrap().0.rkey();
        // SAFETY: as above.
        unsafe { b.isend(&rsrc, 0, 64, 7) }.unwrap();
        drive(&mut a, &mut b, |a| a.is_done(received)).unwrap();
        assert!(dst[1024..1088].iter().all(|x| *x == 0x5a));
        assert!(dst[..1024].iter().chain(&dst[1088..]).all(|x| *x == 0));
        // The window is unbound and back in the pool, and only the
        // registration itself holds the region (it can be deregistered).
        drive(&mut a, &mut b, |a| a.unbinding.is_empty()).unwrap();
        assert_eq!((a.windows.len(), a.windows_made), (1, 1));
        let mr = &registration(&rdst, 64).unwrap().unwrap().0;
        assert_eq!(Arc::strong_count(mr), 1);

        // The peer writes other bytes with the grant's key, then with the
        // registration's own: the device refuses each, and nothing lands.
        let other = [0xa5u8; 64];
        let rother = t.register(other.as_ptr(), other.len()).unwrap();
        for (what, rkey) in [
            ("the receive's window", key),
            ("the registration", region_key),
        ] {
            let (_a, mut b) = pair(&t);
            let mut guard = b.qps[0].start_post_send();
            let wr = guard
                .construct_wr(WR_DATA | WR_LAST, WorkRequestFlags::Signaled)
                .setup_write(rkey, dst.as_ptr() as u64 + 1024);
            // SAFETY: `other` is registered and outlives the write.
            unsafe { wr.setup_sge(lkey(&rother), other.as_ptr() as u64, 64) };
            guard.post().unwrap();
            let by = Instant::now() + Duration::from_secs(10);
            let e = loop {
                match b.progress() {
                    Err(e) => break e.to_string(),
                    Ok(_) => assert!(Instant::now() < by, "a write through {what}: no completion"),
                }
            };
            assert!(e.contains("RemoteAccess"), "a write through {what}: {e}");
        }
        assert!(
            dst[1024..1088].iter().all(|x| *x == 0x5a),
            "a refused write landed"
        );
    }

    /// Receives past the windows a connection makes are refused by name,
    /// before the completion queue could overflow.
    #[test]
    fn receives_past_the_windows_in_flight_are_refused() {
        let Some(t) = device() else { return };
        let (mut a, _b) = pair(&t);
        let mut dst = vec![0u8; WINDOWS_MAX + 1];
        let rdst = t.register(dst.as_mut_ptr(), dst.len()).unwrap();
        for i in 0..WINDOWS_MAX {
            // SAFETY: `dst` outlives the connection's use of it (the
            // connection is dropped first, at the end).
            unsafe { a.irecv(&rdst, i, 1, 7) }.unwrap();
        }
        // SAFETY: as above.
        let e = unsafe { a.irecv(&rdst, WINDOWS_MAX, 1, 7) }.unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("more than 256 receives") && e.contains("peer rank 1"),
            "{e}"
        );
        drop(a);
    }

    fn lkey(r: &MemRegion) -> u32 {
        registration(r, 1).unwrap().unwrap().0.lkey()
    }
}
