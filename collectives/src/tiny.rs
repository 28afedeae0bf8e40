//! Small collectives among the ranks of one host, without messages
//! (`COLL_TINY=BYTES`): AllReduce, Reduce, ReduceScatter, AllGather,
//! AllToAll and Broadcast whose larger buffer is at most BYTES, and every
//! barrier. Each
//! rank owns a small shared segment of two slots; flag call `k` writes the
//! rank's part (its input; its block of an AllGather; nothing off a
//! Broadcast's root) into slot `k % 2` with the call's tag and publishes
//! `k + 1`, then reads every rank's slot in rank order and takes what it
//! needs: reduces them (every rank's result bitwise the same), copies a
//! block (its own block of every rank's, for an AllToAll), copies the
//! root's. No schedule, no staging, no doorbell: one pass,
//! as Open MPI's coll/sm and NCCL's LL protocol do.
//!
//! A flag call is an ordinary call in flight (`inflight.rs`): blocking and
//! non-blocking callers both take it, it runs in its turn on the collective
//! lane, and a waiting rank polls, then sleeps on a futex the writer wakes.
//!
//! Two slots are enough because every rank waits for every flag, whatever
//! it reads: a rank writes slot `k % 2` again only for flag call `k + 2`,
//! after it saw every rank publish call `k + 1`, which each did only after
//! reading every slot of call `k`. Calls on the general path in between
//! take no flag number.
//!
//! Ranks that disagree on the path (one rank's AllReduce is larger than the
//! threshold, another's is not; a barrier against an AllToAllv) would wait
//! for each other forever: every collective that takes the general path
//! leaves its sequence number and tag in its rank's control line, and a rank
//! waiting on a flag it never gets reads that and fails with a mismatch.
//!
//! Segments are memfds; peers open them through `/proc/PID/fd/FD` (same
//! rules as reading another process's memory), read-only.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};
use rustix::thread::futex;
use transport::{Rank, Tag};

use crate::descriptor::{CallDesc, Collective};
use crate::reduce;
use crate::{Communicator, DataType, ReduceOp, Result};

/// The control line, then each slot, starts with this many bytes of header:
/// a sequence word (at 0), a tag (at 16) and a length (at 32); a slot's
/// header also says on which CPU its writer wrote it (+1, at 8).
const HEADER: usize = 64;
const CPU: usize = 8;
/// A slot's data follows its header in the same cache line: a reader of a
/// small call fetches one line per rank, not two.
const DATA: usize = 40;
/// In the control line: the rank (+1) whose flag this rank sleeps on, and
/// whether it left (its communicator was aborted or dropped).
const SLEEPING_ON: usize = 4;
const LEFT: usize = 12;

/// One rank's segment, mapped: its control line, then two slots.
struct Segment {
    base: NonNull<u8>,
    len: usize,
    _fd: OwnedFd,
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
    fn map(fd: OwnedFd, len: usize, writable: bool) -> std::io::Result<Self> {
        let prot = match writable {
            true => ProtFlags::READ | ProtFlags::WRITE,
            false => ProtFlags::READ,
        };
        // SAFETY: a fresh shared mapping of a file of at least `len` bytes.
        let ptr = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, &fd, 0)? };
        Ok(Segment {
            base: NonNull::new(ptr.cast()).expect("mmap never returns null"),
            len,
            _fd: fd,
        })
    }

    /// The control line: the last general-path collective, who we sleep on.
    fn control(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Slot `k % 2`.
    fn slot(&self, k: u32, slot_bytes: usize) -> *mut u8 {
        // SAFETY: the control line and two slots of `slot_bytes` fill the segment.
        unsafe { (self.base.as_ptr().add(HEADER)).add((k % 2) as usize * slot_bytes) }
    }

    /// The 32-bit word at `at` bytes into the header at `line`.
    fn word<'a>(line: *mut u8, at: usize) -> &'a AtomicU32 {
        // SAFETY: `line` starts a 64-byte header in a live, 64-byte aligned
        // mapping; its words are only accessed atomically.
        unsafe { AtomicU32::from_ptr(line.add(at).cast()) }
    }

    /// The tag and length written in the header at `line`.
    ///
    /// # Safety
    /// Its writer must have published them (its sequence word, read with
    /// acquire, says so).
    unsafe fn label(line: *mut u8) -> (Tag, usize) {
        // SAFETY: the caller's promise; within the header.
        unsafe {
            (
                line.add(16).cast::<u128>().read_unaligned(),
                line.add(32).cast::<u64>().read_unaligned() as usize,
            )
        }
    }

    /// Writes a header's tag and length (publish after).
    ///
    /// # Safety
    /// `line` must be a header of our own segment no reader reads now.
    unsafe fn write_label(line: *mut u8, tag: Tag, len: usize) {
        // SAFETY: the caller's promise; within the header.
        unsafe {
            line.add(16).cast::<u128>().write_unaligned(tag);
            line.add(32).cast::<u64>().write_unaligned(len as u64);
        }
    }
}

/// A communicator's small-call path.
pub(crate) struct Tiny {
    me: Rank,
    /// Every rank's segment, by rank (ours writable).
    segments: Vec<Segment>,
    pids: Vec<i32>,
    /// Largest data per call.
    pub max_bytes: usize,
    /// Flag calls made: every rank makes the same ones.
    calls: u32,
    /// The host's ranks outnumber its cores: a waiting rank yields.
    pub crowded: bool,
}

/// A flag call in flight.
pub(crate) struct FlagCall {
    /// Its flag number, and the collective sequence number it has.
    k: u32,
    seq: u32,
    tag: Tag,
    collective: Collective,
    /// Its larger buffer, in bytes.
    bytes: usize,
    root: Rank,
    in_place: bool,
    /// The ranks of the communicator.
    n: usize,
    /// Ranks below this one were taken (reduced, copied) into the output.
    next: Rank,
}

/// Whether `got` (a sequence word) has reached `want`, modulo 2^32.
fn reached(got: u32, want: u32) -> bool {
    got.wrapping_sub(want) as i32 >= 0
}

impl Tiny {
    fn slot_bytes(max_bytes: usize) -> usize {
        (DATA + max_bytes).next_multiple_of(64)
    }

    fn segment_bytes(max_bytes: usize) -> usize {
        HEADER + 2 * Self::slot_bytes(max_bytes)
    }

    /// This rank's segment, and what peers need to open it: (pid, fd).
    pub fn create(max_bytes: usize) -> std::io::Result<(OwnedFd, [u64; 2])> {
        let fd = rustix::fs::memfd_create("coll-tiny", rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, Self::segment_bytes(max_bytes) as u64)?;
        let id = [u64::from(std::process::id()), fd.as_raw_fd() as u64];
        Ok((fd, id))
    }

    /// Maps our segment and opens every peer's (`ids` by rank).
    pub fn open(
        me: Rank,
        own: OwnedFd,
        ids: &[[u64; 2]],
        max_bytes: usize,
    ) -> std::io::Result<Self> {
        let len = Self::segment_bytes(max_bytes);
        let mut own = Some(own);
        let segments = (ids.iter().enumerate())
            .map(|(r, [pid, fd])| match r == me {
                true => Segment::map(own.take().expect("once"), len, true),
                false => {
                    let f = File::open(format!("/proc/{pid}/fd/{fd}"))?;
                    Segment::map(f.into(), len, false)
                }
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Tiny {
            me,
            segments,
            pids: ids.iter().map(|[pid, _]| *pid as i32).collect(),
            max_bytes,
            calls: 0,
            crowded: crate::cpus::oversubscribed(ids.len()),
        })
    }

    /// Whether a call of `collective` whose larger buffer has `bytes`
    /// takes the flag path.
    pub fn takes(&self, collective: Collective, bytes: usize) -> bool {
        use Collective::*;
        match collective {
            AllReduce | Reduce | ReduceScatter | AllGather | Broadcast | AllToAll => {
                (1..=self.max_bytes).contains(&bytes)
            }
            Barrier => true,
            AllToAllV | PointToPoint => false,
        }
    }

    /// Starts a flag call: writes our part into our slot and publishes it.
    pub fn post(&mut self, desc: &CallDesc, input: Option<&[u8]>, output: &[u8]) -> FlagCall {
        let k = self.calls;
        self.calls = k.wrapping_add(1);
        let call = FlagCall {
            k,
            seq: desc.seq,
            tag: desc.tag(),
            collective: desc.collective,
            bytes: input.map_or(0, <[u8]>::len).max(output.len()),
            root: desc.root.map_or(0, usize::from),
            in_place: input.is_none(),
            n: self.segments.len(),
            next: 0,
        };
        let part = call.own_part(self.me, input, output);
        let sb = Self::slot_bytes(self.max_bytes);
        let mine = self.segments[self.me].slot(k, sb);
        // SAFETY: our own slot: no reader looks at slot k % 2 until we
        // publish k + 1 below, and none still reads it (module doc).
        unsafe {
            std::ptr::copy_nonoverlapping(part.as_ptr(), mine.add(DATA), part.len());
            Segment::write_label(mine, call.tag, part.len());
        }
        // SAFETY: no arguments; glibc reads it from the thread's rseq area.
        let cpu = unsafe { libc::sched_getcpu() };
        Segment::word(mine, CPU).store(cpu.wrapping_add(1) as u32, Ordering::Relaxed);
        Segment::word(mine, 0).store(k.wrapping_add(1), Ordering::SeqCst);
        self.wake_sleepers(&[mine]);
        call
    }

    /// A collective of ours takes the general path: says so in our control
    /// line, for a peer that waits on a flag for it.
    pub fn mark_general(&mut self, desc: &CallDesc, bytes: usize) {
        let line = self.segments[self.me].control();
        // SAFETY: our own control line; a reader that sees the old number
        // with new label bytes only misreports the other call's size.
        unsafe { Segment::write_label(line, desc.tag(), bytes) };
        Segment::word(line, 0).store(desc.seq.wrapping_add(1), Ordering::SeqCst);
        let sb = Self::slot_bytes(self.max_bytes);
        let own = &self.segments[self.me];
        self.wake_sleepers(&[own.slot(0, sb), own.slot(1, sb)]);
    }

    /// Wakes every peer asleep on one of our `words` (after a SeqCst store:
    /// a peer either saw it or said it sleeps before we look).
    fn wake_sleepers(&self, words: &[*mut u8]) {
        let me = self.me as u32 + 1;
        let asleep = (self.segments.iter())
            .any(|s| Segment::word(s.control(), SLEEPING_ON).load(Ordering::SeqCst) == me);
        if asleep {
            for w in words {
                let _ = futex::wake(Segment::word(*w, 0), futex::Flags::empty(), i32::MAX as u32);
            }
        }
    }

    /// Takes into `output` every rank's part that has arrived, in rank
    /// order; returns whether the call is done. A peer whose part does not
    /// match ours is a mismatch.
    pub fn poll(
        &self,
        call: &mut FlagCall,
        output: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> transport::Result<bool> {
        let sb = Self::slot_bytes(self.max_bytes);
        while call.next < call.n {
            let r = call.next;
            let slot = self.segments[r].slot(call.k, sb);
            if !reached(
                Segment::word(slot, 0).load(Ordering::Acquire),
                call.k.wrapping_add(1),
            ) {
                return Ok(false);
            }
            // SAFETY: rank r published call k: its header and data are
            // written and stay so until we publish call k + 1.
            let (tag, len) = unsafe { Segment::label(slot) };
            if (tag, len) != (call.tag, call.part_len(r)) {
                return Err(call.mismatch(r, tag, len));
            }
            // SAFETY: as above; `len` bytes of data follow the header.
            let data = unsafe { std::slice::from_raw_parts(slot.add(DATA), len) };
            call.take(self.me, r, data, output, dtype, op);
            call.next += 1;
        }
        if let Some(result) = call.reduced(self.me, output) {
            reduce::finalize(dtype, op, result, call.n);
        }
        Ok(true)
    }

    /// Whether the rank `call` waits on last wrote on the CPU we run on: it
    /// then needs our core to go on, and we should yield it.
    pub fn shares_our_core(&self, call: &FlagCall) -> bool {
        let sb = Self::slot_bytes(self.max_bytes);
        let last = self.segments[call.next].slot(call.k.wrapping_sub(1), sb);
        let theirs = Segment::word(last, CPU).load(Ordering::Relaxed);
        // SAFETY: as in `post`.
        let ours = unsafe { libc::sched_getcpu() };
        theirs == ours.wrapping_add(1) as u32
    }

    /// What can be known of the rank `call` waits on without its flag: gone
    /// (its process ended), or on the general path for this call.
    pub fn check(&self, call: &FlagCall) -> transport::Result<()> {
        let r = call.next;
        let pid = rustix::process::Pid::from_raw(self.pids[r]);
        let dead = pid
            .is_some_and(|p| rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH));
        let line = self.segments[r].control();
        let left = Segment::word(line, LEFT).load(Ordering::Acquire) != 0;
        let general = Segment::word(line, 0).load(Ordering::Acquire);
        let general = general != 0 && reached(general.wrapping_sub(1), call.seq);
        // The peer may have published this call, finished it and gone on
        // (or away) since we last looked: its flag, written before, is
        // visible now if so.
        let sb = Self::slot_bytes(self.max_bytes);
        let flag = Segment::word(self.segments[r].slot(call.k, sb), 0);
        if reached(flag.load(Ordering::Acquire), call.k.wrapping_add(1)) {
            return Ok(());
        }
        if dead || left {
            return Err(transport::Error::Closed { peer: r });
        }
        if general {
            // SAFETY: published with the sequence word read above.
            let (tag, len) = unsafe { Segment::label(line) };
            return Err(call.mismatch(r, tag, len));
        }
        Ok(())
    }

    /// Tells the peers we publish nothing more (our communicator was
    /// aborted or dropped), waking any asleep on us.
    pub fn leave(&self) {
        let own = &self.segments[self.me];
        Segment::word(own.control(), LEFT).store(1, Ordering::SeqCst);
        let sb = Self::slot_bytes(self.max_bytes);
        self.wake_sleepers(&[own.slot(0, sb), own.slot(1, sb)]);
    }

    /// Sleeps until the rank `call` waits on publishes (or writes its
    /// control line), at most `max`.
    pub fn sleep(&self, call: &FlagCall, max: Duration) {
        let r = call.next;
        let mine = Segment::word(self.segments[self.me].control(), SLEEPING_ON);
        mine.store(r as u32 + 1, Ordering::SeqCst);
        let word = Segment::word(
            self.segments[r].slot(call.k, Self::slot_bytes(self.max_bytes)),
            0,
        );
        let seen = word.load(Ordering::SeqCst);
        if !reached(seen, call.k.wrapping_add(1)) && self.check(call).is_ok() {
            let max = rustix::time::Timespec::try_from(max).unwrap_or(rustix::time::Timespec {
                tv_sec: 1,
                tv_nsec: 0,
            });
            // Woken, timed out or interrupted: the caller looks again.
            let _ = futex::wait(word, futex::Flags::empty(), seen, Some(&max));
        }
        mine.store(0, Ordering::SeqCst);
    }
}

impl Drop for Tiny {
    fn drop(&mut self) {
        self.leave();
    }
}

impl FlagCall {
    /// The rank whose flag the call waits on.
    pub fn peer(&self) -> Rank {
        self.next
    }

    /// How many bytes rank `r` publishes: the tag fixes every rank's.
    fn part_len(&self, r: Rank) -> usize {
        match self.collective {
            Collective::AllGather => self.bytes / self.n,
            Collective::Broadcast if r == self.root => self.bytes,
            Collective::Broadcast | Collective::Barrier => 0,
            _ => self.bytes,
        }
    }

    /// What rank `me` publishes: its input, its block of an in-place
    /// AllGather, nothing off a broadcast's root.
    fn own_part<'a>(&self, me: Rank, input: Option<&'a [u8]>, output: &'a [u8]) -> &'a [u8] {
        let len = self.part_len(me);
        match (self.collective, input) {
            (Collective::AllGather, None) => &output[me * len..][..len],
            (_, input) => &input.unwrap_or(output)[..len],
        }
    }

    /// Takes rank `r`'s part, `data`, into `output` (ours, `me`'s).
    fn take(&self, me: Rank, r: Rank, data: &[u8], output: &mut [u8], dt: DataType, op: ReduceOp) {
        let block = self.bytes / self.n;
        let combine = |dst: &mut [u8], src: &[u8]| match r {
            0 => dst.copy_from_slice(src),
            _ => reduce::reduce_into(dt, op, dst, src),
        };
        match self.collective {
            Collective::AllReduce => combine(output, data),
            Collective::Reduce if me == self.root => combine(output, data),
            Collective::ReduceScatter => {
                let src = &data[me * block..][..block];
                combine(self.reduced(me, output).expect("reduces"), src)
            }
            Collective::AllGather => output[r * block..][..block].copy_from_slice(data),
            Collective::AllToAll => {
                output[r * block..][..block].copy_from_slice(&data[me * block..][..block])
            }
            Collective::Broadcast if r == self.root => output.copy_from_slice(data),
            _ => {}
        }
    }

    /// Where `me`'s reduction result lies in `output`, if it has one.
    fn reduced<'a>(&self, me: Rank, output: &'a mut [u8]) -> Option<&'a mut [u8]> {
        let block = self.bytes / self.n;
        match self.collective {
            Collective::AllReduce => Some(output),
            Collective::Reduce if me == self.root => Some(output),
            Collective::ReduceScatter if self.in_place => Some(&mut output[me * block..][..block]),
            Collective::ReduceScatter => Some(output),
            _ => None,
        }
    }

    /// What the call waits on, for the status board: the flag of the rank
    /// it reads next.
    pub fn waiting(&self) -> crate::executor::Waiting {
        crate::executor::Waiting {
            peer: self.next,
            send: false,
            index: 1,
            of: 1,
            bytes: self.bytes,
        }
    }

    fn mismatch(&self, peer: Rank, got_tag: Tag, got_len: usize) -> transport::Error {
        transport::Error::Mismatch {
            peer,
            expected_tag: self.tag,
            expected_len: self.part_len(peer),
            got_tag,
            got_len,
        }
    }
}

/// Whether a communicator uses the small-call path.
pub(crate) enum State {
    /// Not (turned off, or some rank is reached otherwise than by shared
    /// memory): every rank of a job decides the same.
    Off,
    /// Set up when the communicator is made.
    Untried,
    On(Tiny),
}

impl State {
    pub fn initial(max_bytes: usize, via: &[Option<&'static str>]) -> Self {
        let all_shm = via.iter().all(|v| v.is_none_or(|t| t == "shm"));
        match max_bytes > 0 && all_shm && via.len() > 1 {
            true => State::Untried,
            false => State::Off,
        }
    }

    pub fn on(&self) -> Option<&Tiny> {
        match self {
            State::On(t) => Some(t),
            _ => None,
        }
    }

    pub fn on_mut(&mut self) -> Option<&mut Tiny> {
        match self {
            State::On(t) => Some(t),
            _ => None,
        }
    }
}

impl Communicator {
    /// Every rank creates its segment and opens the others'; on only if
    /// all could. Every rank calls this once, when the communicator is made.
    pub(crate) fn set_up_tiny(&mut self) -> Result<()> {
        if !matches!(self.tiny, State::Untried) {
            return Ok(());
        }
        let max = self.config.tiny_bytes;
        // The calls below take the general path, and leave the numbering of
        // the caller's calls alone (every rank makes both, and each
        // connection delivers in order: no message of theirs can be taken
        // for one of a later call #0 or #1).
        self.tiny = State::Off;
        let seq = self.seq;
        let created = Tiny::create(max);
        let mine = created.as_ref().map_or([0, 0], |(_, id)| *id);
        let mut ids = vec![0u64; 2 * self.size];
        self.all_gather(&mine, &mut ids)?;
        let ids: Vec<[u64; 2]> = ids.chunks(2).map(|c| [c[0], c[1]]).collect();
        let opened = created.and_then(|(fd, _)| Tiny::open(self.rank, fd, &ids, max));
        if let Err(e) = &opened {
            tracing::info!(rank = self.rank, "COLL_TINY: no flag path: {e}");
        }
        let mut all = [u64::from(opened.is_ok())];
        self.all_reduce_in_place(&mut all, ReduceOp::Min)?;
        self.seq = seq;
        if let (Ok(t), 1) = (opened, all[0]) {
            tracing::debug!(
                rank = self.rank,
                "COLL_TINY: collectives up to {max} B and barriers go through shared flags"
            );
            self.tiny = State::On(t);
        }
        Ok(())
    }
}
