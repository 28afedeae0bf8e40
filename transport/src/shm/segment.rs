//! The shared segment of one connection: a header, then per direction an SPSC
//! ring of slot descriptors and slot data. Side 0 (the connecting rank)
//! produces on direction 0 and consumes direction 1; side 1 the reverse.
//!
//! The producer writes a descriptor (and, for eager messages, the bytes)
//! into slot `head % SLOTS` and publishes it by storing `head + 1` with
//! release ordering; the consumer reads it after an acquire load of `head`
//! and hands the slot back by storing `tail + 1`. `head - tail` never
//! exceeds `SLOTS`: the free slots are the producer's credits.
//!
//! Beside each descriptor, a help word lets the two sides share the copying
//! of [`Kind::Remote`] messages (see [`Help`]).

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

use crate::Tag;

/// Slots per direction.
pub(crate) const SLOTS: u64 = 16;
/// Bytes of data per slot, at most: with few peers on the host. A segment
/// is made for each connection and every page of it touched, so with many
/// ranks on a host (an AllToAll connects them all) its slots shrink
/// ([`slot_bytes_for`]).
pub(crate) const SLOT_BYTES: usize = 64 << 10;
/// Bytes of data per slot, at least.
pub(crate) const MIN_SLOT_BYTES: usize = 2 << 10;
/// Messages up to this size (or a slot's, if smaller) are copied through
/// the slots; larger ones are read by the receiver straight from the
/// sender's memory (CMA) when both sides can, which saves a copy.
pub(crate) const EAGER_MAX: usize = 32 << 10;
/// `EAGER_MAX` for sends from a region whose messages are all in flight at
/// once (`MemRegion::all_in_flight`): 8-rank AllToAll of 256 KiB (32 KiB
/// blocks) 0.53x the time, of 128 KiB 1.01x (4 KiB: 0.68x and 0.84x). Not
/// for every message: AllGathers of 128 KiB took 1.55x (8 ranks) and 1.96x
/// (4 ranks) the time with 8 KiB, a ring's blocks waiting on each read.
pub(crate) const EAGER_MAX_ALL_IN_FLIGHT: usize = 8 << 10;

const MAGIC: u64 = u64::from_le_bytes(*b"COLLSHM3");
const LINE: usize = 128;
const HEADER_BYTES: usize = 4096;
/// A descriptor's line, then the help word's.
const DESC_BYTES: usize = 128;
const HELP_AT: usize = 96;
/// In the header after the magic: the slots' size, set by the creator.
const SLOT_BYTES_AT: usize = 8;

/// Bytes of one direction's ring with slots of `slot_bytes`.
const fn dir_bytes(slot_bytes: usize) -> usize {
    SLOTS as usize * (DESC_BYTES + slot_bytes)
}

/// Bytes of a whole segment with slots of `slot_bytes`.
pub(crate) const fn segment_bytes(slot_bytes: usize) -> usize {
    HEADER_BYTES + 2 * dir_bytes(slot_bytes)
}

/// The slot size for a rank that connects to up to `peers` ranks of its
/// host: 64 KiB up to 16 (2.1 MiB a connection), then less, so that a
/// host's segments stay near half a GiB when every pair of 128 ranks is
/// connected (2 KiB slots, 72 KiB a connection). Larger messages do not
/// go through the slots where `process_vm_readv` works.
pub fn slot_bytes_for(peers: usize) -> usize {
    match peers {
        0..=16 => SLOT_BYTES,
        17..=32 => 16 << 10,
        33..=64 => 8 << 10,
        _ => MIN_SLOT_BYTES,
    }
}

/// How a slot carries its fragment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Kind {
    /// The bytes are in the slot.
    Eager = 1,
    /// The bytes stay in the sender's memory at `remote`; the receiver reads
    /// them with `process_vm_readv` before handing the slot back.
    Remote = 2,
}

/// One slot's description of the fragment it carries.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct Desc {
    pub tag: Tag,
    /// Length of the whole message.
    pub msg_len: u64,
    /// Where this fragment starts in the message.
    pub offset: u64,
    pub len: u64,
    /// Sender's address of the bytes, for [`Kind::Remote`].
    pub remote: u64,
    pub kind: u32,
    /// For a [`Kind::Remote`] message in a registered `SharedBuffer`: the
    /// sender's descriptor number of its memfd (else -1), the memfd's inode
    /// and where the message starts in it.
    pub region_fd: i32,
    pub region_ino: u64,
    pub region_offset: u64,
}

const _: () = assert!(std::mem::size_of::<Desc>() <= HELP_AT && HELP_AT + 16 <= DESC_BYTES);

/// The states of a published [`Kind::Remote`] slot's help word. The
/// receiver copies such a message itself (`process_vm_readv`) when it
/// reaches it; while it works on an earlier one (reading it, or reducing
/// what it received) it may offer the sender the copy of a later one, into
/// memory the receive's owner lets peers write. Whoever moves the word on
/// from `OFFERED` first does the copy; nothing is copied twice, and nothing
/// is written into the receiver's memory after it took an offer back.
pub(crate) struct Help;

impl Help {
    /// Published by the sender; the receiver will read it.
    pub const NONE: u32 = 0;
    /// The receiver wrote the destination beside the word and asks for help.
    pub const OFFERED: u32 = 1;
    /// The sender took the offer and is writing (`process_vm_writev`).
    pub const WRITING: u32 = 2;
    /// The sender wrote the whole message, and in place of the destination
    /// left how long that took, in nanoseconds (see `shm::costs`).
    pub const WRITTEN: u32 = 3;
    /// The receiver took the offer back (or the sender could not write):
    /// the receiver reads the message itself.
    pub const DECLINED: u32 = 4;
}

/// Header field offsets: each counter on its own cache line(s) so the
/// producer's and consumer's stores do not fight over a line.
const HEAD: [usize; 2] = [LINE, 2 * LINE];
const TAIL: [usize; 2] = [3 * LINE, 4 * LINE];
const SLEEPING: [usize; 2] = [5 * LINE, 6 * LINE];
const ABORTED: usize = 7 * LINE;
const CORE_SHARED: [usize; 2] = [8 * LINE, 9 * LINE];

/// A mapped segment.
pub(crate) struct Segment {
    base: NonNull<u8>,
    _fd: OwnedFd,
    /// The slots' size (read once: the peer could change the header's),
    /// and so one direction's bytes.
    slot_bytes: usize,
    dir_bytes: usize,
    /// The mapping's length.
    bytes: usize,
}

// SAFETY: the mapping is shared memory accessed through atomics and raw
// copies whose ordering the ring protocol establishes; moving the handle to
// another thread changes nothing.
unsafe impl Send for Segment {}

impl Segment {
    /// Creates an anonymous segment (memfd: it never has a name in
    /// /dev/shm, so a killed job cannot leave it behind) with slots of
    /// `slot_bytes`, and maps it.
    pub fn create(slot_bytes: usize) -> std::io::Result<Self> {
        let bytes = segment_bytes(slot_bytes);
        let seg = Self::map(super::sealed_memfd("coll-shm", bytes)?, bytes, slot_bytes)?;
        // SAFETY: the fresh mapping is `bytes` long and ours alone.
        unsafe {
            // Touch every page now: first touch costs 5-10x a copy here,
            // and the hot path must not pay it.
            std::ptr::write_bytes(seg.base.as_ptr(), 0, bytes);
            (seg.base.as_ptr() as *mut u64).write(MAGIC);
            (seg.base.as_ptr().add(SLOT_BYTES_AT) as *mut u64).write(slot_bytes as u64);
        }
        Ok(seg)
    }

    /// Maps a segment received from the creating peer, once its seals, its
    /// magic and its size (for the slots its header names) are checked.
    /// The header is read from the file before anything is mapped.
    pub fn open(fd: OwnedFd) -> std::io::Result<Self> {
        let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
        // A peer's segment it could shrink under our mapping would fault us.
        let bytes = super::check_sealed(&fd, HEADER_BYTES)?;
        let mut header = [0u8; 16];
        rustix::io::pread(&fd, &mut header, 0)?;
        let word = |at: usize| u64::from_ne_bytes(header[at..at + 8].try_into().unwrap());
        if word(0) != MAGIC {
            return Err(invalid("not a collectives shared-memory segment".into()));
        }
        let slot_bytes = usize::try_from(word(SLOT_BYTES_AT))
            .ok()
            .filter(|b| b.is_power_of_two() && (MIN_SLOT_BYTES..=SLOT_BYTES).contains(b))
            .ok_or_else(|| invalid(format!("slots of {} bytes", word(SLOT_BYTES_AT))))?;
        if bytes != segment_bytes(slot_bytes) {
            return Err(invalid(format!(
                "a segment of {bytes} bytes, not the {} its slots of {slot_bytes} take",
                segment_bytes(slot_bytes)
            )));
        }
        Self::map(fd, bytes, slot_bytes)
    }

    /// Maps `bytes` of `fd`, whose seals and size the caller checked (or
    /// made).
    fn map(fd: OwnedFd, bytes: usize, slot_bytes: usize) -> std::io::Result<Self> {
        // SAFETY: a fresh shared mapping of a file we hold, no longer than
        // the file (sealed against shrinking); nothing in this process
        // aliases it.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                bytes,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd.as_fd(),
                0,
            )?
        };
        Ok(Segment {
            base: NonNull::new(ptr.cast()).expect("mmap never returns null"),
            _fd: fd,
            slot_bytes,
            dir_bytes: dir_bytes(slot_bytes),
            bytes,
        })
    }

    /// Bytes of data a slot holds.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self._fd.as_fd()
    }

    fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offset is a header field or help word, 8-aligned, inside
        // the mapping, which lives as long as &self; AtomicU64 has u64's
        // layout.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: as in atomic_u64.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// Slots published on direction `dir`.
    pub fn head(&self, dir: usize) -> &AtomicU64 {
        self.atomic_u64(HEAD[dir])
    }

    /// Slots handed back on direction `dir`.
    pub fn tail(&self, dir: usize) -> &AtomicU64 {
        self.atomic_u64(TAIL[dir])
    }

    /// Set by `side` before it sleeps; the other side rings its doorbell.
    pub fn sleeping(&self, side: usize) -> &AtomicU32 {
        self.atomic_u32(SLEEPING[side])
    }

    /// Set by a side that aborts, so a spinning peer notices at once.
    pub fn aborted(&self) -> &AtomicU32 {
        self.atomic_u32(ABORTED)
    }

    /// Set by `side` while its core is shared with other work: its peer
    /// then offers it no copies (see [`Help`]).
    pub fn core_shared(&self, side: usize) -> &AtomicU32 {
        self.atomic_u32(CORE_SHARED[side])
    }

    fn dir_base(&self, dir: usize) -> *mut u8 {
        // SAFETY: both directions lie inside the mapping.
        unsafe { (self.base.as_ptr()).add(HEADER_BYTES + dir * self.dir_bytes) }
    }

    /// Writes slot `seq`'s descriptor on `dir` (producer, before publishing).
    pub fn write_desc(&self, dir: usize, seq: u64, desc: Desc) {
        let at = (seq % SLOTS) as usize * DESC_BYTES;
        // SAFETY: in bounds; the producer owns unpublished slots.
        unsafe { (self.dir_base(dir).add(at) as *mut Desc).write_volatile(desc) }
    }

    /// Reads slot `seq`'s descriptor on `dir` (consumer, after an acquire of head).
    pub fn read_desc(&self, dir: usize, seq: u64) -> Desc {
        let at = (seq % SLOTS) as usize * DESC_BYTES;
        // SAFETY: in bounds; the slot is published and not yet handed back.
        unsafe { (self.dir_base(dir).add(at) as *const Desc).read_volatile() }
    }

    /// Slot `seq`'s help word on `dir`, and the destination offered with it
    /// (once `WRITTEN`, the write's duration).
    pub fn help(&self, dir: usize, seq: u64) -> (&AtomicU32, &AtomicU64) {
        let at =
            HEADER_BYTES + dir * self.dir_bytes + (seq % SLOTS) as usize * DESC_BYTES + HELP_AT;
        (self.atomic_u32(at), self.atomic_u64(at + 8))
    }

    /// Slot `seq`'s data area on `dir`.
    pub fn slot_data(&self, dir: usize, seq: u64) -> *mut u8 {
        let at = SLOTS as usize * DESC_BYTES + (seq % SLOTS) as usize * self.slot_bytes;
        // SAFETY: in bounds of the direction's area.
        unsafe { self.dir_base(dir).add(at) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range and hand out no references
        // that outlive self.
        let _ = unsafe { munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}

/// Orderings of the ring protocol, named once.
pub(crate) const PUBLISH: Ordering = Ordering::Release;
pub(crate) const OBSERVE: Ordering = Ordering::Acquire;
