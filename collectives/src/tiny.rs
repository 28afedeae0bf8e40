//! Small AllReduces and barriers among the ranks of one host, without the
//! executor (experimental, `COLL_TINY=BYTES`; off by default): each rank
//! owns a small shared segment of two slots; a call writes the rank's input
//! into slot `k % 2` with the call's tag and publishes `k + 1`, then reads
//! every rank's slot and reduces them in rank order (every rank's result
//! bitwise the same). No message, no doorbell: one pass, as Open MPI's
//! coll/sm and NCCL's LL protocol do, where the general path pays a
//! schedule, staging slots and a ring protocol per message.
//!
//! Two slots are enough: a rank writes slot `k % 2` again only for call
//! `k + 2`, after it saw every rank publish call `k + 1`, which each did
//! only after reading every slot of call `k`.
//!
//! Segments are memfds; peers open them through `/proc/PID/fd/FD` (same
//! rules as reading another process's memory), read-only.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};
use transport::{Rank, Tag};

use crate::args::CallArgs;
use crate::descriptor::Collective;
use crate::reduce;
use crate::{Communicator, DataType, Error, ReduceOp, Result};

/// Bytes before a slot's data: its sequence word, then its tag and length.
const HEADER: usize = 64;

/// One rank's segment, mapped.
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

    fn slot(&self, k: u64, slot_bytes: usize) -> *mut u8 {
        // SAFETY: two slots of `slot_bytes` fill the segment.
        unsafe { self.base.as_ptr().add((k % 2) as usize * slot_bytes) }
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
    /// Calls made: every rank makes the same ones.
    calls: u64,
    /// Rounds a wait spins before it yields: none when the host's ranks
    /// outnumber its cores (a spinning rank then holds the core its peer needs).
    spins: u32,
}

impl Tiny {
    fn slot_bytes(max_bytes: usize) -> usize {
        (HEADER + max_bytes).next_multiple_of(64)
    }

    /// This rank's segment, and what peers need to open it: (pid, fd).
    pub fn create(max_bytes: usize) -> std::io::Result<(OwnedFd, [u64; 2])> {
        let fd = rustix::fs::memfd_create("coll-tiny", rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, 2 * Self::slot_bytes(max_bytes) as u64)?;
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
        let len = 2 * Self::slot_bytes(max_bytes);
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
            spins: match crate::communicator::oversubscribed(ids.len()) {
                true => 0,
                false => 2048,
            },
        })
    }

    /// An AllReduce of `input` into `output` (equal lengths, at most
    /// `max_bytes`; `None`: in place, `output` holds the input), or a
    /// barrier with empty buffers. `tag` names the call for mismatch
    /// errors; `check` is called while waiting, to give up (on abort, a
    /// dead or departed peer, the timeout) with the error it returns.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &mut self,
        input: Option<&[u8]>,
        output: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
        tag: Tag,
        timeout: Duration,
        check: &mut dyn FnMut(Rank) -> transport::Result<()>,
    ) -> transport::Result<()> {
        let k = self.calls;
        self.calls += 1;
        let sb = Self::slot_bytes(self.max_bytes);
        let mine = self.segments[self.me].slot(k, sb);
        let len = output.len();
        let from = input.unwrap_or(output).as_ptr();
        // SAFETY: our own slot: no reader looks at slot k % 2 until we
        // publish k + 1 below, and none still reads it (module doc); `from`
        // holds `len` bytes (the input is as long as the output).
        unsafe {
            std::ptr::copy_nonoverlapping(from, mine.add(HEADER), len);
            mine.add(16).cast::<u128>().write_unaligned(tag);
            mine.add(32).cast::<u64>().write_unaligned(len as u64);
            seq(mine).store(k + 1, Ordering::Release);
        }
        for r in 0..self.segments.len() {
            let slot = self.segments[r].slot(k, sb);
            self.wait(r, slot, k + 1, timeout, check)?;
            // SAFETY: rank r published call k: its header and data are
            // written and stay so until we publish k + 1.
            let (got_tag, got_len) = unsafe {
                (
                    slot.add(16).cast::<u128>().read_unaligned(),
                    slot.add(32).cast::<u64>().read_unaligned() as usize,
                )
            };
            if (got_tag, got_len) != (tag, len) {
                return Err(transport::Error::Mismatch {
                    peer: r,
                    expected_tag: tag,
                    expected_len: len,
                    got_tag,
                    got_len,
                });
            }
            // SAFETY: as above; `got_len` bytes of data follow the header.
            let data = unsafe { std::slice::from_raw_parts(slot.add(HEADER), got_len) };
            match r {
                0 => output.copy_from_slice(data),
                _ => reduce::reduce_into(dtype, op, output, data),
            }
        }
        reduce::finalize(dtype, op, output, self.segments.len());
        Ok(())
    }

    /// Waits for rank `r`'s slot to show `want`: spinning, then yielding,
    /// then short sleeps, asking `check` now and then.
    fn wait(
        &self,
        r: Rank,
        slot: *mut u8,
        want: u64,
        timeout: Duration,
        check: &mut dyn FnMut(Rank) -> transport::Result<()>,
    ) -> transport::Result<()> {
        // SAFETY: the slot's first word, in a live mapping.
        let seq = unsafe { seq(slot) };
        let mut spins = 0u32;
        let mut since: Option<Instant> = None;
        while seq.load(Ordering::Acquire) < want {
            spins += 1;
            if spins < self.spins {
                std::hint::spin_loop();
                continue;
            }
            let since = *since.get_or_insert_with(Instant::now);
            let waited = since.elapsed();
            if spins % 64 == 0 {
                check(r)?;
                let pid = rustix::process::Pid::from_raw(self.pids[r]);
                let gone = pid.is_some_and(|p| {
                    rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH)
                });
                if gone {
                    return Err(transport::Error::Closed { peer: r });
                }
                if waited >= timeout {
                    return Err(transport::Error::Timeout {
                        peer: r,
                        waited,
                        waiting_for: format!("its part of small call {}", want - 1),
                    });
                }
            }
            match waited < Duration::from_millis(1) {
                true => std::thread::yield_now(),
                false => std::thread::sleep(Duration::from_micros(50)),
            }
        }
        Ok(())
    }
}

/// The sequence word at the start of a slot.
///
/// # Safety
/// `slot` must point into a live mapping, 8-byte aligned.
unsafe fn seq<'a>(slot: *mut u8) -> &'a AtomicU64 {
    // SAFETY: the caller's promise; the word is only accessed atomically.
    unsafe { AtomicU64::from_ptr(slot.cast()) }
}

/// Whether a communicator uses the small-call path.
pub(crate) enum State {
    /// Not (turned off, or some rank is reached otherwise than by shared
    /// memory): every rank of a job decides the same.
    Off,
    /// Set up at the first call it applies to (every rank makes that call).
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
}

impl Communicator {
    /// Runs an AllReduce of at most `COLL_TINY` bytes or a barrier by the
    /// flag path, when the communicator has one; `None`: the general path.
    pub(crate) fn try_tiny(
        &mut self,
        args: &CallArgs,
        input: Option<&[u8]>,
        output: &mut [u8],
    ) -> Option<Result<()>> {
        let max = self.config.tiny_bytes;
        // An empty AllReduce is no call at all (as on the general path).
        let applies = match args.collective {
            Collective::AllReduce => (1..=max).contains(&output.len()),
            Collective::Barrier => true,
            _ => false,
        };
        let applies = applies && !matches!(self.tiny, State::Off);
        if !applies || self.aborted().is_some() {
            return None;
        }
        if matches!(self.tiny, State::Untried) {
            if let Err(e) = self.set_up_tiny(max) {
                return Some(Err(e));
            }
            if matches!(self.tiny, State::Off) {
                return None;
            }
        }
        Some(self.run_tiny(args, input, output))
    }

    /// Every rank creates its segment and opens the others'; on only if all could.
    fn set_up_tiny(&mut self, max: usize) -> Result<()> {
        // The calls below take the general path.
        self.tiny = State::Off;
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
        if let (Ok(t), 1) = (opened, all[0]) {
            tracing::info!(
                rank = self.rank,
                "COLL_TINY: AllReduces up to {max} B and barriers go through shared flags"
            );
            self.tiny = State::On(t);
        }
        Ok(())
    }

    fn run_tiny(&mut self, args: &CallArgs, input: Option<&[u8]>, output: &mut [u8]) -> Result<()> {
        let rank = self.rank;
        let desc = self.describe(args, input, output)?;
        // Earlier collectives finish first: calls keep their order.
        self.finish_collectives();
        let slot = self.recorder.start(desc, None, output.len());
        self.recorder.running(slot, "tiny", output.len());
        let State::On(mut tiny) = std::mem::replace(&mut self.tiny, State::Off) else {
            unreachable!("checked by try_tiny")
        };
        let (timeout, abort) = (self.config.timeout, &self.abort);
        let lane = &mut self.lanes[crate::mesh::Lane::Collective as usize];
        let mut check = |peer: Rank| -> transport::Result<()> {
            if let Some(reason) = abort.reason() {
                return Err(transport::Error::Aborted { peer, reason });
            }
            // A peer's abort or death shows on its connection.
            match lane.get_mut(peer).and_then(|c| c.as_mut()) {
                Some(c) => c.progress().map(|_| ()),
                None => Ok(()),
            }
        };
        let op = args.op.unwrap_or(ReduceOp::Sum);
        let result = tiny.all_reduce(
            input,
            output,
            args.dtype,
            op,
            desc.tag(),
            timeout,
            &mut check,
        );
        self.tiny = State::On(tiny);
        self.recorder.finished(slot, result.is_ok());
        result.map_err(|e| {
            let e = Error::collective(rank, desc, e);
            self.close(&crate::inflight::root_cause(&e));
            e
        })
    }
}
