//! The transport contract, and its implementations: [`tcp`] between hosts,
//! [`shm`] (shared memory) between ranks of one host.
//!
//! A transport moves bytes between two ranks. It knows nothing of datatypes or
//! collectives: algorithms above it see peers and registered buffers only through
//! the traits of this crate.
//!
//! # Why the contract looks as it does
//!
//! It is shaped for RDMA verbs first (the hardest transport and the reason the
//! project exists), following NCCL's network-plugin API, so that TCP and shared
//! memory fit it easily and verbs fits it without change:
//!
//! * **Connection setup by exchanged address blobs** ([`Transport::listen`],
//!   [`Listener::address`], [`Transport::connect`], [`Listener::accept`]). A
//!   blob is opaque: `ip:port` for TCP, a QP number, LID/GID and PSN for verbs, a
//!   segment name for shared memory. The bootstrap carries blobs between ranks.
//!   Every connection opens with a [`Hello`] carrying the job token, so a stray
//!   connection is refused and logged instead of corrupting the job.
//! * **Explicit memory registration** ([`Transport::register`] returning a
//!   [`MemRegion`], with a [`RegistrationCache`] in front): a no-op for TCP,
//!   `ibv_reg_mr` for verbs. Data calls name memory by region and byte range so
//!   verbs can find its `lkey`/`rkey` without a lookup.
//! * **Non-blocking send/receive with explicit completion** ([`Connection::isend`],
//!   [`Connection::irecv`] return a [`Request`]; [`Connection::progress`] moves
//!   bytes; [`Connection::is_done`] polls). One thread can keep many transfers
//!   in flight, which is what chunked pipelining needs, and a verbs completion
//!   queue maps onto it directly. Messages on one connection are matched in
//!   order; each carries a caller-chosen [`Tag`] and a length that the receiver
//!   checks, so ranks that disagree on an operation get an error, not garbage.
//! * **Bounded buffering with back-pressure.** A send completes only once its
//!   bytes are in bounded space the receiver has granted: the socket buffer
//!   (TCP's window is the credit), a staging slot granted by a credit (verbs,
//!   shared memory), or the posted receive itself. Posting a receive is what
//!   grants space, so a slow receiver stalls its sender instead of growing memory.
//!   Staging for reductions is owned by the algorithm layer: it registers a fixed
//!   set of chunk-sized slots once and reuses them.
//! * **Every wait has a deadline.** Nothing here blocks without one: a [`Poller`]
//!   spins, yields, then sleeps on the connections' wake-up descriptors (a
//!   socket, a verbs completion channel, a shared-memory doorbell) until
//!   progress or the timeout; [`Connection::wake_source`] lets a connection arm
//!   its descriptor first (verbs must request a completion event, shared
//!   memory raises a "sleeping" flag) and say "do not sleep" if work arrived
//!   meanwhile. A dead peer surfaces as [`Error::Closed`] or
//!   [`Error::Timeout`] naming the peer rank.
//!
//! # How the transports fit it
//!
//! | | connection setup | registration | data path | back-pressure | wake-up |
//! |---|---|---|---|---|---|
//! | [`tcp`] | `ip:port`, hello with token, two streams | none | framed, numbered messages read into the posted buffer; small ones share a stream, large ones take one per direction | socket buffers, TCP window | socket fds |
//! | [`shm`] | abstract Unix socket; segment fd passed with `SCM_RIGHTS` | none | slot rings; large messages read with `process_vm_readv` | ring slots are credits | doorbell byte on the socket |
//! | `verbs` (feature) | QP number, GID, PSN | `ibv_reg_mr`, cached | RDMA WRITE with immediate into posted buffers | receive credits | completion channel fd |
//!
//! # Where things are
//!
//! Each transport is a folder that implements the same three traits, in
//! the same places: `mod.rs` the [`Transport`] (and, for `shm` and
//! `verbs`, the [`Listener`]; `tcp/listener.rs` for TCP's), and
//! `connection.rs` the [`Connection`]. What is particular to one lives
//! beside it: `shm/segment.rs` (the slot rings), `shm/costs.rs` (whether
//! help pays), `shm/shared_buffer.rs` and `shm/peer_maps.rs` (memory peers
//! map), `verbs/device.rs` (device, port and GID). Shared by all:
//! `wire.rs` (the hello and the message header), `memory.rs`
//! (registration and its cache), `poller.rs` (waiting with a deadline),
//! `two_ways.rs` (choosing between two ways by timing both), `error.rs`.
//! Nothing here knows a datatype, a collective or the `collectives` crate.

mod error;
#[cfg(test)]
mod fuzz;
mod memory;
mod poller;
pub mod proof;
pub mod tcp;
mod two_ways;
mod wire;

use std::os::fd::BorrowedFd;
use std::time::Instant;

pub use error::{Error, Result};
pub use memory::{register_all, MemRegion, RegistrationCache};
pub use poller::{core_shared, Phase, Poller};
pub use two_ways::TwoWays;

#[cfg(target_os = "linux")]
pub mod shm;
#[cfg(feature = "verbs")]
pub mod verbs;

/// How long a connection's handshake may take once the peer has
/// arrived, whatever the wait for it was: a listener that waited a short
/// while for a caller must not cut short the caller it got.
const HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(10);

/// The deadline of a handshake begun now by a side that waited until
/// `waited_until`: the later of the two.
pub(crate) fn handshake_deadline(waited_until: Instant) -> Instant {
    waited_until.max(Instant::now() + HANDSHAKE)
}

/// Index of a process in the job, `0..world_size`.
pub type Rank = usize;

/// Caller-chosen label carried by every message and checked by the receiver.
/// The collectives layer packs the operation, datatype, count and sequence
/// number into it; a transport treats it as opaque.
pub type Tag = u128;

/// What a connection says first: which job it belongs to and who is calling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Per-job secret. It never goes on the wire: the hello carries a proof
    /// of it ([`proof`]), and a listener refuses a hello not proved under
    /// its own; in an accepted hello it is that listener's token.
    pub token: u128,
    /// Rank of the side that sends this hello.
    pub from: Rank,
    /// Rank the sender means to reach (guards against stale addresses).
    pub to: Rank,
    /// Which of the caller's independent connections between these two
    /// ranks this is (the collectives layer's lanes), so a listener can
    /// tell them apart however they arrive.
    pub channel: u8,
}

/// A completion handle returned by [`Connection::isend`] / [`Connection::irecv`].
/// Requests of one direction complete in the order they were posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    dir: Direction,
    seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    Send = 0,
    Recv = 1,
}

/// A connection's request bookkeeping, shared by every transport: requests
/// of a direction are numbered as posted and complete in that order, so a
/// count of completions per direction says which are done.
#[derive(Debug, Default)]
pub(crate) struct Requests {
    posted: [u64; 2],
    done: [u64; 2],
}

impl Requests {
    /// A handle for the next request of `dir`.
    pub fn post(&mut self, dir: Direction) -> Request {
        self.posted[dir as usize] += 1;
        Request {
            dir,
            seq: self.posted[dir as usize],
        }
    }

    /// The oldest outstanding request of `dir` has completed.
    pub fn complete(&mut self, dir: Direction) {
        self.done[dir as usize] += 1;
    }

    pub fn is_done(&self, request: Request) -> bool {
        self.done[request.dir as usize] >= request.seq
    }

    /// Whether `request` is the oldest outstanding one of its direction.
    pub fn is_next(&self, request: Request) -> bool {
        self.done[request.dir as usize] + 1 == request.seq
    }
}

/// Which readiness a connection waits for before it can progress again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interest {
    pub readable: bool,
    pub writable: bool,
}

/// How a connection that made no progress wants its caller to wait.
#[derive(Debug)]
pub enum Wake<'a> {
    /// Nothing is pending: no reason to wait on this connection.
    Idle,
    /// Progress became possible while preparing to sleep: do not sleep.
    Now,
    /// Sleep until this descriptor has this readiness (or the deadline).
    On(BorrowedFd<'a>, Interest),
    /// Sleep until either descriptor has its readiness (a connection with a
    /// socket per direction).
    Either([(BorrowedFd<'a>, Interest); 2]),
}

/// A way of moving bytes between ranks (TCP, shared memory, verbs).
pub trait Transport: Send + Sync {
    /// Short name for logs and flags: `tcp`, `shm`, `verbs`.
    fn name(&self) -> &'static str;

    /// Starts listening; the returned listener's address blob goes to peers.
    fn listen(&self) -> Result<Box<dyn Listener>>;

    /// Connects to the listener whose blob is `address`, introducing ourselves
    /// with `hello` and waiting for the peer's acknowledgement until `deadline`.
    fn connect(
        &self,
        address: &[u8],
        hello: Hello,
        deadline: Instant,
    ) -> Result<Box<dyn Connection>>;

    /// Says this process may connect to up to `peers` ranks over this
    /// transport, so it can size what each connection holds (shared memory
    /// shrinks its rings when many ranks share a host). Only ever grows.
    fn expect_peers(&self, peers: usize) {
        let _ = peers;
    }

    /// Makes `len` bytes at `addr` usable by this transport's data calls.
    /// Registration only records (or pins) the range; the lifetime obligations
    /// fall on [`Connection::isend`] and [`Connection::irecv`].
    fn register(&self, addr: *const u8, len: usize) -> Result<MemRegion>;
}

/// The passive side of connection setup.
pub trait Listener: Send {
    /// Opaque address blob for peers' [`Transport::connect`].
    fn address(&self) -> Vec<u8>;

    /// Waits until `deadline` for the next peer that presents `token` and is
    /// addressed to `me`; connections with another token are refused, logged,
    /// and waiting goes on. Returns the peer's hello (its rank and channel)
    /// and the connection.
    fn accept(
        &mut self,
        token: u128,
        me: Rank,
        deadline: Instant,
    ) -> Result<(Hello, Box<dyn Connection>)>;
}

/// A reliable, ordered, bidirectional message connection to one peer.
pub trait Connection: Send {
    /// The peer's rank.
    fn peer(&self) -> Rank;

    /// Posts a send of `region[offset..offset + len]` tagged `tag`.
    ///
    /// # Safety
    /// The bytes must stay valid and unmodified until the request completes,
    /// the connection is aborted, or it is dropped.
    unsafe fn isend(
        &mut self,
        region: &MemRegion,
        offset: usize,
        len: usize,
        tag: Tag,
    ) -> Result<Request>;

    /// Posts a receive of exactly `len` bytes tagged `tag` into
    /// `region[offset..offset + len]`. A message with another tag or length is
    /// an [`Error::Mismatch`].
    ///
    /// # Safety
    /// The bytes must stay valid and must not be read or written by anyone else
    /// until the request completes, the connection is aborted, or it is dropped.
    unsafe fn irecv(
        &mut self,
        region: &MemRegion,
        offset: usize,
        len: usize,
        tag: Tag,
    ) -> Result<Request>;

    /// Moves as many bytes as possible without blocking. Returns whether
    /// anything moved. Errors are sticky: once failed, always failed.
    fn progress(&mut self) -> Result<bool>;

    /// Whether `request` has completed (as of the last [`progress`](Self::progress)).
    fn is_done(&self, request: Request) -> bool;

    /// Of receive `request`, not yet done, the bytes from its start that
    /// have landed (as of the last [`progress`](Self::progress)), so the
    /// caller can work on them while the rest arrives. A transport that
    /// only knows whole messages says 0.
    fn landed(&self, request: Request) -> usize {
        let _ = request;
        0
    }

    /// Number of posted requests not yet complete.
    fn pending(&self) -> usize;

    /// Prepares to sleep: what would let [`progress`](Self::progress) move
    /// again. Called only after a `progress` that moved nothing; verbs arms
    /// its completion channel here, shared memory raises its "sleeping" flag
    /// so the peer rings the doorbell, and either may find work meanwhile.
    fn wake_source(&mut self) -> Wake<'_>;

    /// Gives up on the connection: tells the peer why (best effort, bounded
    /// time), forgets all posted requests and fails every later call. After it
    /// returns, the transport no longer touches any posted buffer.
    fn abort(&mut self, reason: &str);
}
