//! One rank's flag segment: its layout (a control line, a progress line,
//! `SLOTS` slot headers, then the slots' data), how it is mapped, and the
//! words and labels read and written in its headers.

use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;

use rustix::mm::{madvise, mmap, munmap, Advice, MapFlags, ProtFlags};
use transport::Tag;

/// The control line, then each slot, starts with this many bytes of header:
/// a sequence word (at 0), a tag (at 16), a length (at 32) and the hash of
/// the calls so far (at 36); a slot's header also says on which CPU its
/// writer wrote it (+1, at `CPU`).
pub(super) const HEADER: usize = 64;
/// The progress line (the flag of the rank's latest published call, at 0,
/// and the CPU it published it from, +1, at `CPU`, as in that call's
/// slot: a crowded rank asks where every peer is without touching their
/// slots) follows the control line; it is written every call and read
/// seldom, so it shares a line with nothing read often.
pub(super) const PROGRESS: usize = HEADER;
/// In the progress line, written once before the segment is shared: the
/// MAC under the communicator's session of the owner's rank
/// (`Tiny::create`). A peer's segment is mapped only if it holds the one
/// for the rank it is said to be: what a member names as its segment
/// cannot be another process's memfd, whatever pid and fd it gives.
pub(super) const OWNER: usize = PROGRESS + 16;
/// The slots' headers follow the progress line, one line each, side by
/// side: a run of small calls walks consecutive lines of a few pages, not
/// a page a call (the slots' data is apart, after the last header).
pub(super) const SLOTS_AT: usize = 2 * HEADER;
/// The slots' data follows their headers.
pub(super) const DATA_AT: usize = SLOTS_AT + SLOTS as usize * HEADER;
/// Slots per rank: how far ahead of the slowest rank a rank may run. More
/// ranks than cores want many (a 4-rank Broadcast on 2 cores: 2 slots
/// 4.6-6.0 us, 32 slots 0.8-1.7, 64 slots 10-35% less again; 128 slots,
/// headers side by side, 8 ranks: 0.88 -> 0.69 us, 2 ranks 0.20 -> 0.18;
/// 512: 8 ranks 0.8x the time of 128, and with a busy loop on one core the
/// worst of 10 4-rank runs 1.6 us instead of 12: a root that waits yields
/// its core to that loop for a whole time slice). 4.2 MB a rank at the
/// default `COLL_TINY` (64K), mostly the slots' data, touched only by
/// parts too large to go inline.
pub(super) const SLOTS: u64 = 512;
/// The slots' data takes about this much of a segment at most: with a
/// `COLL_TINY` over 4 KiB there are fewer data slots than headers (never
/// fewer than `MIN_DATA_SLOTS`), and a part that does not fit its header's
/// line waits for its data slot to be free (`Tiny::gate`). Fewer data slots
/// also keep what ranks run ahead with in cache: an 8-rank Reduce of 4 KiB
/// took 8.1 us a call with 512 data slots, 2.5 with 64.
pub(super) const DATA_BUDGET: usize = 2 << 20;
pub(super) const MIN_DATA_SLOTS: u64 = 64;
pub(super) const CPU: usize = 8;
/// How much of a segment is mapped in when it is opened (`Segment::map`).
pub(super) const PREFAULT: usize = 5 << 20;
/// How much of all the host's segments a rank maps in when it opens them:
/// `PREFAULT` each up to 16 ranks, less with more (never less than the
/// headers). Mapping in 5 MiB of each of 127 peers' segments took 128
/// ranks on 2 cores 4 s. Its own segment gets the same share: mapped in
/// whole, the 128 ranks' own segments alone would hold about 512 MiB of
/// the host's shared memory; a call writes only the slots it uses.
pub(super) const PREFAULT_BUDGET: usize = 16 * PREFAULT;

/// What [`Segment::map`] maps in of each segment when `ranks` share them.
pub(super) fn prefault(ranks: usize) -> usize {
    (PREFAULT_BUDGET / ranks.max(1)).clamp(DATA_AT, PREFAULT)
}

/// A part of at most `INLINE` bytes follows its header in the same cache
/// line: a reader of a small call fetches one line per rank, not two.
pub(super) const DATA: usize = 40;
pub(super) const INLINE: usize = HEADER - DATA;
/// In the control line: the rank (+1) whose flag this rank sleeps on, and
/// whether it left (its communicator was aborted or dropped).
pub(super) const SLEEPING_ON: usize = 4;
pub(super) const LEFT: usize = 12;
/// A rank takes the header line of its slot this many calls ahead for
/// writing as it publishes a call (`executor::prefetch_for_write`). Readers
/// read it last `SLOTS` calls ago and may hold it still: a store to such a
/// line waits for their cores to give it up, and every store after it
/// waits too (stores leave in order). In the minutes when a line takes
/// ~500 ns between this VM's cores, that made 2-rank 8 B Broadcasts take
/// 0.17 us a call in most runs instead of 0.06 (Open MPI 0.10), and 1 KiB
/// 0.94x the time. Not the next call's: a reader waiting for it polls that
/// line (0.09 us). Not the data of larger parts: data slots are few (a
/// reader may still be reading those lines) and it cost 1.4x the time at
/// 1-2 KiB when lines move fast (0.57x when slow).
pub(super) const WRITE_AHEAD: u64 = 2;

/// One rank's segment, mapped: its control and progress lines, `SLOTS`
/// slot headers, then `data_slots` slots' data of `data_bytes` each.
pub(super) struct Segment {
    pub(super) base: NonNull<u8>,
    pub(super) len: usize,
    pub(super) data_bytes: usize,
    pub(super) data_slots: u64,
    pub(super) _fd: OwnedFd,
}

// SAFETY: shared memory reached through atomics and copies the slot
// protocol orders; the handle itself may move between threads.
unsafe impl Send for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: mapped by `map` with this length; no reference outlives self.
        let _ = unsafe { munmap(self.base.as_ptr().cast(), self.len) };
    }
}

impl Segment {
    pub(super) fn map(
        fd: OwnedFd,
        max_bytes: usize,
        writable: bool,
        prefault: usize,
    ) -> std::io::Result<Self> {
        let len = Self::bytes(max_bytes);
        let prot = match writable {
            true => ProtFlags::READ | ProtFlags::WRITE,
            false => ProtFlags::READ,
        };
        // SAFETY: a fresh shared mapping of a file of at least `len` bytes.
        let ptr = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, &fd, 0)? };
        // Pages mapped now, not at their first use: each rank would
        // otherwise fault on every page of every peer's segment it reads,
        // in the first calls (8-rank 8 B Broadcast, 1000 calls: 1.13 ->
        // 0.79 us a call). Up to `prefault` bytes: the headers and, at the
        // default `COLL_TINY` and up to 16 ranks, all the data; the rest
        // faults in as it is used, rather than every rank mapping it all at
        // once.
        let advice = match writable {
            true => Advice::LinuxPopulateWrite,
            false => Advice::LinuxPopulateRead,
        };
        // SAFETY: advice on our own fresh mapping. An old kernel refuses
        // it; the pages then fault in as they are used.
        let _ = unsafe { madvise(ptr, len.min(prefault), advice) };
        Ok(Segment {
            base: NonNull::new(ptr.cast()).expect("mmap never returns null"),
            len,
            data_bytes: Self::data_bytes(max_bytes),
            data_slots: Self::data_slots(max_bytes),
            _fd: fd,
        })
    }

    /// Each slot's room for a part too large to go inline.
    pub(super) fn data_bytes(max_bytes: usize) -> usize {
        match max_bytes > INLINE {
            true => max_bytes.next_multiple_of(64),
            false => 0,
        }
    }

    /// How many slots have room for a part too large to go inline.
    pub(super) fn data_slots(max_bytes: usize) -> u64 {
        match Self::data_bytes(max_bytes) {
            0 => SLOTS,
            d => ((DATA_BUDGET / d) as u64).clamp(MIN_DATA_SLOTS, SLOTS),
        }
    }

    /// A segment's length for parts of up to `max_bytes`.
    pub(super) fn bytes(max_bytes: usize) -> usize {
        let data = Self::data_slots(max_bytes) as usize * Self::data_bytes(max_bytes);
        DATA_AT + data
    }

    /// The control line: the last general-path collective, who we sleep on.
    pub(super) fn control(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// The progress line: the flag of our latest published call.
    pub(super) fn progress(&self) -> *mut u8 {
        // SAFETY: the segment begins with the control and progress lines.
        unsafe { self.base.as_ptr().add(PROGRESS) }
    }

    /// The slot header of flag call `k`.
    pub(super) fn slot(&self, k: u64) -> *mut u8 {
        // SAFETY: the segment holds SLOTS headers from SLOTS_AT (`bytes`).
        unsafe { (self.base.as_ptr().add(SLOTS_AT)).add((k % SLOTS) as usize * HEADER) }
    }

    /// Where flag call `k`'s part of `len` bytes lies: inline, or in the
    /// slot's data.
    pub(super) fn data(&self, k: u64, len: usize) -> *mut u8 {
        if len <= INLINE {
            // SAFETY: within the slot's header line.
            return unsafe { self.slot(k).add(DATA) };
        }
        let at = DATA_AT + (k % self.data_slots) as usize * self.data_bytes;
        // SAFETY: the segment holds `data_slots` slots' data after the
        // headers, each `data_bytes` long, and parts are at most that.
        unsafe { self.base.as_ptr().add(at) }
    }

    /// The 32-bit word at `at` bytes into the header at `line`.
    pub(super) fn word<'a>(line: *mut u8, at: usize) -> &'a AtomicU32 {
        // SAFETY: `line` starts a 64-byte header in a live, 64-byte aligned
        // mapping; its words are only accessed atomically.
        unsafe { AtomicU32::from_ptr(line.add(at).cast()) }
    }

    /// The label written in the header at `line`.
    ///
    /// # Safety
    /// Its writer must have published it (its sequence word, read with
    /// acquire, says so), or the caller checks that word again after.
    pub(super) unsafe fn label(line: *mut u8) -> Label {
        // SAFETY: the caller's promise; within the header.
        unsafe {
            Label {
                tag: line.add(16).cast::<u128>().read_volatile(),
                len: line.add(32).cast::<u32>().read_volatile() as usize,
                chain: line.add(36).cast::<u32>().read_volatile(),
            }
        }
    }

    /// Writes a header's label (publish after).
    ///
    /// # Safety
    /// `line` must be a header of our own segment no reader relies on now.
    pub(super) unsafe fn write_label(line: *mut u8, l: Label) {
        // SAFETY: the caller's promise; within the header.
        unsafe {
            line.add(16).cast::<u128>().write_volatile(l.tag);
            line.add(32).cast::<u32>().write_volatile(l.len as u32);
            line.add(36).cast::<u32>().write_volatile(l.chain);
        }
    }
}

/// A slot's (or the control line's) label: what the call is, its part's
/// length, and the hash of the writer's flag calls up to it.
#[derive(Clone, Copy)]
pub(super) struct Label {
    pub(super) tag: Tag,
    pub(super) len: usize,
    pub(super) chain: u32,
}

#[cfg(test)]
mod prefault_budget {
    use super::*;

    #[test]
    fn peers_share_the_budget_and_each_keeps_its_header() {
        assert_eq!(prefault(2), PREFAULT);
        assert_eq!(prefault(16), PREFAULT);
        assert_eq!(prefault(32), PREFAULT / 2);
        assert_eq!(prefault(1 << 20), DATA_AT);
        assert!((1..=4096).all(|n| prefault(n) * n <= PREFAULT_BUDGET.max(n * DATA_AT)));
    }
}
