//! Small collectives among the ranks of one host, without messages
//! (`COLL_TINY=BYTES`): AllReduce, Reduce, ReduceScatter, AllGather,
//! AllToAll and Broadcast whose larger buffer is at most BYTES, and every
//! barrier. Each rank owns a small shared segment of `SLOTS` slots; flag
//! call `k` writes the rank's part (its input; its block of an AllGather;
//! nothing off a Broadcast's root) into slot `k % SLOTS` with the call's
//! tag and publishes `k + 1`, then reads the slots it needs in rank order
//! and takes what it needs: reduces them (every rank's result bitwise the
//! same), copies a block (its own block of every rank's, for an AllToAll),
//! copies the root's. No schedule, no staging, no doorbell: one pass, as
//! Open MPI's coll/sm and NCCL's LL protocol do.
//!
//! A flag call is an ordinary call in flight (`inflight.rs`): blocking and
//! non-blocking callers both take it, it runs in its turn on the collective
//! lane, and a waiting rank polls, then sleeps on a futex the writer wakes.
//!
//! Most calls read every rank's part (an AllReduce, a barrier); those wait
//! for every rank and so keep every rank in step. A Broadcast reads only
//! the root's part and a Reduce off the root none: such a rank goes on at
//! once, up to `SLOTS - 1` calls ahead of the slowest rank (a root
//! broadcasting in a loop, as Open MPI's does). A rank writes slot
//! `k % SLOTS` for call `k` only once every rank published call
//! `k + 1 - SLOTS`, which each did only after it finished the call that
//! slot held before. Calls on the general path in between take no flag
//! number. Each rank also keeps the number of its latest publication in a
//! line of its own, so that one look at it frees up to `SLOTS - 1` calls:
//! a rank that runs ahead reads a peer's line once per batch, not once a
//! call, and the peer's writes to its slots find them still its own (8 B
//! Broadcasts: 0.30 -> 0.27 us a call on 2 ranks, 0.87 -> 0.66 on 4).
//!
//! Every slot's label carries a hash of all the rank's flag calls so far,
//! and every part read is checked against it: ranks that disagreed on an
//! earlier call nobody read (two ranks each taking itself for a
//! broadcast's root) fail at the next call that reads, or when posting
//! waits on them, naming the first call that differs.
//!
//! Ranks that disagree on the path (one rank's AllReduce is larger than the
//! threshold, another's is not; a barrier against an AllToAllv) would wait
//! for each other forever: every collective that takes the general path
//! leaves its sequence number and tag in its rank's control line, and a rank
//! waiting on a flag it never gets reads that and fails with a mismatch.
//!
//! Segments are sealed memfds; peers open them through `/proc/PID/fd/FD`
//! (same rules as reading another process's memory), read-only, and map
//! one only if it carries the MAC under the session of the rank it is said
//! to be (the pid and fd are a member's word, the MAC is not forgeable by
//! anyone outside the communicator).
//!
//! Owns: the flag segments and their protocol. May not touch: the executor
//! or the communicator (which decides when a call takes this path, in
//! `comm/inflight.rs`, and sets it up, in `comm/flags.rs`).

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{fence, Ordering};
use std::time::Duration;

use rustix::thread::{futex, membarrier, MembarrierCommand};
use transport::{Rank, Tag};

use crate::call::descriptor::{CallDesc, Collective};
use crate::call::reduce;
use crate::{DataType, ReduceOp};

mod call;
mod segment;

pub(crate) use call::FlagCall;
use segment::*;

/// A communicator's small-call path.
pub(crate) struct Tiny {
    me: Rank,
    /// Every rank's segment, by rank (ours writable).
    segments: Vec<Segment>,
    pids: Vec<i32>,
    /// A pidfd per peer (`None` for ourselves, or where the kernel has
    /// none): readable once the process has exited, even before its parent
    /// reaps it. A killed rank stays a zombie while its launcher waits for
    /// another rank, and `kill(pid, 0)` still finds a zombie.
    pidfds: Vec<Option<OwnedFd>>,
    /// Largest data per call.
    pub max_bytes: usize,
    /// Flag calls made: every rank makes the same ones.
    calls: u64,
    /// Every rank published the flag calls below this one.
    published: u64,
    /// Our last `SLOTS` calls' tags and chains, by slot.
    history: [(Tag, u32); SLOTS as usize],
    /// The host's ranks outnumber its cores (`yields_core`).
    crowded: bool,
    /// Which side of the handshake with a sleeping peer fences (`Fence`).
    fence: Fence,
}

/// How a published flag and a peer going to sleep on it see each other:
/// the writer stores its flag, then reads whether anyone sleeps; a sleeper
/// says it sleeps, then reads the flag. Each must see the other's store,
/// so one side needs a full fence between its store and its load.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fence {
    /// The writer: every flag store waits for the store buffer to drain,
    /// behind the slot's line a reader holds (2-rank 8 B calls: 4-13% of
    /// their time).
    Writer,
    /// The sleeper: `membarrier` makes every CPU running a rank of ours
    /// fence at once, a few microseconds on a path that goes to sleep.
    /// Needs every rank registered (a kernel since 4.16); when ranks
    /// outnumber cores they sleep in most calls, so not then.
    Sleeper,
}

/// Whether `got` (a sequence word) has reached `want`, modulo 2^32.
fn reached(got: u32, want: u32) -> bool {
    got.wrapping_sub(want) as i32 >= 0
}

/// The sequence word that says call `k` is published.
fn flag(k: u64) -> u32 {
    (k as u32).wrapping_add(1)
}

/// The hash of a rank's flag calls, one more call in.
fn extend(chain: u32, tag: Tag) -> u32 {
    let mut x = u64::from(chain) ^ (tag as u64) ^ ((tag >> 64) as u64).rotate_left(29);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)) as u32
}

impl Tiny {
    /// Bytes of a rank's segment for calls up to `max_bytes`.
    pub fn segment_bytes(max_bytes: usize) -> usize {
        Segment::bytes(max_bytes)
    }

    /// This rank's segment, and what peers need to open it: (pid, fd).
    /// It carries the proof that it is rank `me`'s of `session` before
    /// any peer can see it.
    pub fn create(
        max_bytes: usize,
        session: u128,
        me: Rank,
    ) -> std::io::Result<(OwnedFd, [u64; 2])> {
        let fd = transport::shm::sealed_memfd("coll-tiny", Segment::bytes(max_bytes))?;
        File::from(fd.try_clone()?).write_all_at(&owner(session, me), OWNER as u64)?;
        let id = [u64::from(std::process::id()), fd.as_raw_fd() as u64];
        Ok((fd, id))
    }

    /// Maps our segment and opens every peer's (`ids` by rank), each only
    /// if it is sealed, large enough and rank's own of `session`.
    pub fn open(
        me: Rank,
        own: OwnedFd,
        ids: &[[u64; 2]],
        max_bytes: usize,
        session: u128,
    ) -> std::io::Result<Self> {
        let mut own = Some(own);
        let prefault = segment::prefault(ids.len());
        let segments = (ids.iter().enumerate())
            .map(|(r, &[pid, fd])| match r == me {
                true => Segment::map(own.take().expect("once"), max_bytes, true, prefault),
                false => {
                    let f = open_peer(r, pid, fd, max_bytes, session)?;
                    Segment::map(f.into(), max_bytes, false, prefault)
                }
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        let crowded = crate::bootstrap::cpus::oversubscribed(ids.len());
        Ok(Tiny {
            me,
            segments,
            pids: ids.iter().map(|[pid, _]| *pid as i32).collect(),
            pidfds: (ids.iter().enumerate())
                .map(|(r, [pid, _])| (r != me).then(|| pidfd(*pid as i32)).flatten())
                .collect(),
            max_bytes,
            calls: 0,
            published: 0,
            history: [(0, 0); SLOTS as usize],
            crowded,
            fence: Fence::choose(crowded),
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

    /// Numbers a flag call, posted next by [`try_post`](Self::try_post).
    /// `bytes` is the call's larger buffer. Apart from the post so that the
    /// call is built where it stays: written by the post, then moved, its
    /// copy read fields still in the store buffer and waited for them to
    /// drain, behind the slot's line that a peer held (2-rank 8 B Broadcast
    /// and Reduce took 0.86-0.92 of the time apart, AllReduce 0.93).
    #[inline(always)]
    pub fn number(&mut self, desc: &CallDesc, bytes: usize, in_place: bool) -> FlagCall {
        let k = self.calls;
        self.calls += 1;
        let tag = desc.tag();
        let before = k
            .checked_sub(1)
            .map_or(0, |p| self.history[(p % SLOTS) as usize].1);
        let chain = extend(before, tag);
        self.history[(k % SLOTS) as usize] = (tag, chain);
        FlagCall {
            k,
            tag,
            chain,
            collective: desc.collective,
            bytes,
            root: desc.root.map_or(0, usize::from),
            in_place,
            n: self.segments.len(),
            posted: false,
            next: 0,
            reach: k.saturating_sub(1),
        }
    }

    /// The flag call whose publication by every rank `call` waits to see
    /// before it writes its slot, if it must look: call `k + 1 - window`
    /// frees the slot (`window`: `SLOTS`, or the data slots for a part
    /// that does not go inline), but a rank that must look waits for a
    /// quarter of the window more. Else a rank held back by a slower one
    /// looked again at every call, and each look at the slower rank's
    /// lines cost it their ownership back, in every call it made. It only
    /// ever waits for calls it made already.
    fn gate(&self, call: &FlagCall) -> Option<u64> {
        let window = match call.part_len(self.me) > INLINE {
            true => self.segments[self.me].data_slots,
            false => SLOTS,
        };
        (call.k + 1)
            .checked_sub(window)
            .filter(|&j| j >= self.published)
            .map(|j| j + window / 4)
    }

    /// Posts a numbered `call` (our part) once every rank published the
    /// call its `gate` names, i.e. is done with the slot it goes into;
    /// returns whether it is posted, else [`poll`](Self::poll) posts it
    /// later. Inlined into the caller's flag path (see
    /// `Communicator::alone`).
    #[inline(always)]
    pub fn try_post(
        &mut self,
        call: &mut FlagCall,
        input: Option<&[u8]>,
        output: &[u8],
    ) -> transport::Result<bool> {
        if let Some(j) = self.gate(call) {
            while call.next < call.n {
                let r = call.next;
                if r != self.me {
                    // Its slot of call j first, a line it writes once.
                    // Its progress line it writes at every call: looked at
                    // on every poll while we wait, that line would leave
                    // its core at every call it makes (without those
                    // looks, 8 B Broadcasts: 2 ranks 0.94-0.97x the time
                    // by median, 4 ranks 0.80x and 0.97x in two runs).
                    if !self.published(r, j) {
                        return Ok(false);
                    }
                    let latest = Segment::word(self.segments[r].progress(), 0);
                    let ahead = latest.load(Ordering::Acquire).wrapping_sub(flag(j)) as i32;
                    let Ok(ahead) = u64::try_from(ahead) else {
                        return Ok(false);
                    };
                    // Its chain to its latest call we know checks all before.
                    self.verify(r, (j + ahead).min(call.k))?;
                    call.reach = call.reach.min(j + ahead);
                }
                call.next += 1;
            }
            self.published = call.reach + 1;
        }
        let part = call.own_part(self.me, input, output);
        let own = &self.segments[self.me];
        let mine = own.slot(call.k);
        let word = Segment::word(mine, 0);
        // Readers checking this slot's old label (`verify`) see it change.
        word.store(flag(call.k).wrapping_sub(1 << 31), Ordering::Relaxed);
        fence(Ordering::Release);
        let label = Label {
            tag: call.tag,
            len: part.len(),
            chain: call.chain,
        };
        let data = own.data(call.k, part.len());
        for (at, len) in call.published_ranges(self.me) {
            // SAFETY: our own slot: every rank is done with the call it held
            // (module doc), and none reads it for this call before we publish;
            // the ranges lie within the part.
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr().add(at), data.add(at), len) };
        }
        // SAFETY: as above.
        unsafe { Segment::write_label(mine, label) };
        let cpu = current_cpu();
        Segment::word(mine, CPU).store(cpu, Ordering::Relaxed);
        match self.fence {
            Fence::Writer => word.store(flag(call.k), Ordering::SeqCst),
            Fence::Sleeper => word.store(flag(call.k), Ordering::Release),
        }
        let progress = own.progress();
        Segment::word(progress, CPU).store(cpu, Ordering::Relaxed);
        Segment::word(progress, 0).store(flag(call.k), Ordering::Release);
        crate::sys::prefetch::prefetch_for_write(own.slot(call.k + WRITE_AHEAD));
        self.wake_sleepers([mine]);
        (call.posted, call.next) = (true, 0);
        Ok(true)
    }

    /// Whether rank `r` published flag call `j` (its slot holds that call
    /// or a later one): what posting, polling and `check` wait to see.
    #[inline(always)]
    fn published(&self, r: Rank, j: u64) -> bool {
        let word = Segment::word(self.segments[r].slot(j), 0);
        reached(word.load(Ordering::Acquire), flag(j))
    }

    /// Checks rank `r`'s label of call `j` against ours, if its slot still
    /// holds that call (it may have gone on since).
    fn verify(&self, r: Rank, j: u64) -> transport::Result<()> {
        match self.label_of(r, j) {
            Some(l) if l.chain != self.history[(j % SLOTS) as usize].1 => Err(self.diverged(r, j)),
            _ => Ok(()),
        }
    }

    /// Rank `r`'s label of call `j`, if its slot holds that call now.
    fn label_of(&self, r: Rank, j: u64) -> Option<Label> {
        let slot = self.segments[r].slot(j);
        let word = Segment::word(slot, 0);
        let before = word.load(Ordering::Acquire);
        // SAFETY: read, then the word read again: a writer that started on
        // the slot in between changed it first (`try_post`).
        let label = unsafe { Segment::label(slot) };
        fence(Ordering::Acquire);
        (before == flag(j) && word.load(Ordering::Relaxed) == before).then_some(label)
    }

    /// Rank `r`'s flag calls up to `upto` differ from ours: the error
    /// names the first that differs while its slot and our history still
    /// show it.
    fn diverged(&self, r: Rank, upto: u64) -> transport::Error {
        for j in self.calls.saturating_sub(SLOTS)..=upto {
            let (tag, _) = self.history[(j % SLOTS) as usize];
            if let Some(l) = self.label_of(r, j).filter(|l| l.tag != tag) {
                return transport::Error::Mismatch {
                    peer: r,
                    expected_tag: tag,
                    expected_len: 0,
                    got_tag: l.tag,
                    got_len: l.len,
                };
            }
        }
        let desc = CallDesc::from_tag(self.history[(upto % SLOTS) as usize].0);
        transport::Error::Invalid(format!(
            "peer rank {r} made other small calls than ours before {}: the ranks disagree on an \
             earlier call (a broadcast's or reduce's root, say) or on the order of calls",
            desc.map_or("this call".into(), |d| d.to_string())
        ))
    }

    /// A collective of ours takes the general path: says so in our control
    /// line, for a peer that waits on a flag for it.
    pub fn mark_general(&mut self, desc: &CallDesc, bytes: usize) {
        let line = self.segments[self.me].control();
        let label = Label {
            tag: desc.tag(),
            len: bytes,
            chain: 0,
        };
        // SAFETY: our own control line; a reader that sees the old number
        // with new label bytes only misreports the other call's size.
        unsafe { Segment::write_label(line, label) };
        Segment::word(line, 0).store(desc.seq.wrapping_add(1), Ordering::SeqCst);
        self.wake_all_slots();
    }

    /// Wakes any peer asleep on one of our slots.
    fn wake_all_slots(&self) {
        let own = &self.segments[self.me];
        self.wake_sleepers((0..SLOTS).map(|k| own.slot(k)));
    }

    /// Wakes every peer asleep on one of our `words` (after a SeqCst store,
    /// or a Release one with `Fence::Sleeper`: a peer either saw it or said
    /// it sleeps before we look).
    fn wake_sleepers(&self, words: impl IntoIterator<Item = *mut u8>) {
        let me = self.me as u32 + 1;
        let asleep = (self.segments.iter())
            .any(|s| Segment::word(s.control(), SLEEPING_ON).load(Ordering::SeqCst) == me);
        if asleep {
            for w in words {
                let _ = futex::wake(Segment::word(w, 0), futex::Flags::empty(), i32::MAX as u32);
            }
        }
    }

    /// Posts `call` if it waits to, then takes into `output` every part
    /// it reads that has arrived, in rank order; returns whether the call
    /// is done. A peer whose part or history does not match ours is a
    /// mismatch.
    pub fn poll(
        &mut self,
        call: &mut FlagCall,
        input: Option<&[u8]>,
        output: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> transport::Result<bool> {
        if !call.posted && !self.try_post(call, input, output)? {
            return Ok(false);
        }
        while call.next < call.n {
            let r = call.next;
            if !call.reads(self.me, r) {
                call.next += 1;
                continue;
            }
            if r == self.me && call.keeps_own_block() {
                call.keep_own_block(self.me, input, output);
                call.next += 1;
                continue;
            }
            if !self.published(r, call.k) {
                return Ok(false);
            }
            let slot = self.segments[r].slot(call.k);
            // SAFETY: rank r published call k: its header and data are
            // written and stay so until we publish call k + 1.
            let l = unsafe { Segment::label(slot) };
            if (l.tag, l.len) != (call.tag, call.part_len(r)) {
                return Err(call.mismatch_with(call.tag, r, l));
            }
            if l.chain != call.chain {
                return Err(self.diverged(r, call.k));
            }
            // SAFETY: as above; `len` bytes of data follow the header.
            let data =
                unsafe { std::slice::from_raw_parts(self.segments[r].data(call.k, l.len), l.len) };
            call.take(self.me, r, data, output, dtype, op);
            // Its next part, on its way while we return (a 2-rank Reduce's
            // root reads each call's part a call early: 0.26 -> 0.19 us).
            crate::sys::prefetch::prefetch(self.segments[r].slot(call.k + 1));
            call.next += 1;
        }
        if call.reads_all(self.me) {
            self.published = self.published.max(call.k + 1);
        }
        if let Some(result) = call.reduced(self.me, output) {
            reduce::finalize(dtype, op, result, call.n);
        }
        Ok(true)
    }

    /// The rank `call` waits on, and the flag call it waits for it to publish.
    fn awaited(&self, call: &FlagCall) -> (Rank, u64) {
        match call.posted {
            true => (call.next, call.k),
            false => (call.next, self.gate(call).expect("an unposted call waits")),
        }
    }

    /// Whether a rank waiting on `call` should yield its core: when the
    /// rank it waits on last published from our CPU (it needs the core to
    /// go on), or, on a host whose ranks outnumber its cores, when any peer
    /// did (it may be waiting there for it). Else a yield only hands the
    /// core to other work (a busy loop, another job) for a whole time
    /// slice, while every rank waits for us.
    pub fn yields_core(&self, call: &FlagCall) -> bool {
        let ours = current_cpu();
        // The awaited rank's previous slot, a line we read lately, not its
        // progress line, which it writes at every call.
        let (r, j) = self.awaited(call);
        let slot = self.segments[r].slot(j.wrapping_sub(1));
        Segment::word(slot, CPU).load(Ordering::Relaxed) == ours
            || (self.crowded && self.a_peer_ran_on(ours))
    }

    /// Whether no peer last ran on our CPU (a general-path rank whose
    /// yields hand its core to other work asks: see `Poller`). Writes our
    /// CPU where peers look for it first, as a flag call does.
    pub fn alone_on_cpu(&self) -> bool {
        let ours = current_cpu();
        Segment::word(self.segments[self.me].progress(), CPU).store(ours, Ordering::Relaxed);
        !self.a_peer_ran_on(ours)
    }

    /// Whether a peer's progress line says it last ran on `cpu` (+1).
    fn a_peer_ran_on(&self, cpu: u32) -> bool {
        let mut peers = (self.segments.iter().enumerate()).filter(|&(p, _)| p != self.me);
        peers.any(|(_, s)| Segment::word(s.progress(), CPU).load(Ordering::Relaxed) == cpu)
    }

    /// What can be known of the rank `call` waits on: it published the
    /// call awaited after all (`Ok(true)`: look again, whatever became of
    /// it since), else whether it is gone (its process ended) or on the
    /// general path for that call.
    pub fn check(&self, call: &FlagCall) -> transport::Result<bool> {
        let (r, j) = self.awaited(call);
        let tag = self.history[(j % SLOTS) as usize].0;
        let seq = CallDesc::from_tag(tag).map_or(0, |d| d.seq);
        let dead = match &self.pidfds[r] {
            Some(fd) => exited(fd),
            None => rustix::process::Pid::from_raw(self.pids[r]).is_some_and(|p| {
                rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH)
            }),
        };
        let line = self.segments[r].control();
        let left = Segment::word(line, LEFT).load(Ordering::Acquire) != 0;
        let general = Segment::word(line, 0).load(Ordering::Acquire);
        let general = general != 0 && reached(general.wrapping_sub(1), seq);
        // The peer may have published the call, finished it and gone on
        // (or away) since we last looked: its flag, written before, is
        // visible now if so.
        if self.published(r, j) {
            return Ok(true);
        }
        if dead || left {
            return Err(transport::Error::Closed { peer: r });
        }
        if general {
            // SAFETY: published with the sequence word read above.
            let l = unsafe { Segment::label(line) };
            return Err(call.mismatch_with(tag, r, l));
        }
        Ok(false)
    }

    /// Tells the peers we publish nothing more (our communicator was
    /// aborted or dropped), waking any asleep on us.
    pub fn leave(&self) {
        let own = &self.segments[self.me];
        Segment::word(own.control(), LEFT).store(1, Ordering::SeqCst);
        self.wake_all_slots();
    }

    /// Sleeps until the rank `call` waits on publishes (or writes its
    /// control line), at most `max`.
    pub fn sleep(&self, call: &FlagCall, max: Duration) {
        let (r, j) = self.awaited(call);
        let mine = Segment::word(self.segments[self.me].control(), SLEEPING_ON);
        mine.store(r as u32 + 1, Ordering::SeqCst);
        if self.fence == Fence::Sleeper {
            // Registered in `choose`: it only fails if memory runs out,
            // and then a wake-up may be missed for one `max`.
            let _ = membarrier(MembarrierCommand::GlobalExpedited);
        }
        let word = Segment::word(self.segments[r].slot(j), 0);
        let seen = word.load(Ordering::SeqCst);
        if !reached(seen, flag(j)) && matches!(self.check(call), Ok(false)) {
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

impl Fence {
    /// `Sleeper` when ranks do not outnumber cores (not `crowded`) and this
    /// rank could register for other ranks' fences. Every rank of the host
    /// decides alike (same kernel, same cores); one that did not would only
    /// miss a wake-up now and then, and sleep `FLAG_SLEEP` for it.
    fn choose(crowded: bool) -> Self {
        let fenced = !crowded && membarrier(MembarrierCommand::RegisterGlobalExpedited).is_ok();
        match fenced {
            true => Fence::Sleeper,
            false => Fence::Writer,
        }
    }
}

impl Drop for Tiny {
    fn drop(&mut self) {
        self.leave();
    }
}

/// The label of a segment's proof that it is rank r's of a session: the
/// MAC under the session of r (`create` writes it, `open_peer` checks it).
const OWNER_LABEL: &str = "flag segment";

/// The proof a segment carries that it is rank `r`'s of `session`.
fn owner(session: u128, r: Rank) -> [u8; 16] {
    transport::proof::mac(session, OWNER_LABEL, &[&(r as u64).to_le_bytes()])
}

/// Rank `r`'s segment, said to be fd `fd` of process `pid`: opened, and
/// checked before it is mapped. A peer's segment it could shrink under our
/// mapping would fault us; one without rank `r`'s proof under `session`
/// is not this communicator's (another job's, another process's).
fn open_peer(r: Rank, pid: u64, fd: u64, max_bytes: usize, session: u128) -> std::io::Result<File> {
    let named = |e: std::io::Error| {
        std::io::Error::new(
            e.kind(),
            format!("rank {r}'s segment (pid {pid}, fd {fd}): {e}"),
        )
    };
    let f = File::open(format!("/proc/{pid}/fd/{fd}")).map_err(named)?;
    transport::shm::check_sealed(&f, Segment::bytes(max_bytes)).map_err(named)?;
    let mut proof = [0u8; 16];
    f.read_exact_at(&mut proof, OWNER as u64).map_err(named)?;
    let rank = (r as u64).to_le_bytes();
    if !transport::proof::verify(session, OWNER_LABEL, &[&rank], &proof) {
        return Err(named(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "it does not carry this communicator's proof for that rank",
        )));
    }
    Ok(f)
}

/// A pidfd of process `pid`, if the kernel gives one (Linux 5.3 and later).
fn pidfd(pid: i32) -> Option<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid)?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
}

/// Whether the process behind `pidfd` has exited (a zombie included).
fn exited(pidfd: &OwnedFd) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    poll(&mut fds, Some(&now)).is_ok_and(|n| n > 0)
}

/// The CPU this thread runs on, plus one, as the CPU words hold it (0 is
/// never written).
fn current_cpu() -> u32 {
    // SAFETY: no arguments; glibc reads it from the thread's rseq area.
    unsafe { libc::sched_getcpu() }.wrapping_add(1) as u32
}

/// Whether a communicator uses the small-call path.
pub(crate) enum State {
    /// Not (turned off, or some rank is reached otherwise than by shared
    /// memory): every rank of a job decides the same.
    Off,
    /// Set up when the communicator is made.
    Untried,
    On(Box<Tiny>),
}

impl State {
    pub fn initial(max_bytes: usize, via: &[Option<&'static str>]) -> Self {
        match max_bytes > 0 && crate::bootstrap::mesh::all_shared_memory(via) && via.len() > 1 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_segment_is_mapped_in_whole_when_opened() {
        let default = crate::Config::default().tiny_bytes;
        assert!(
            Segment::bytes(default) <= PREFAULT,
            "raise PREFAULT with COLL_TINY's default"
        );
    }

    /// What a member who lies about its segment can name instead: another
    /// communicator's, another rank's of ours, an unsealed file. Each is
    /// refused, naming the rank, before anything is mapped.
    #[test]
    fn a_peer_segment_is_opened_only_with_its_ranks_proof() {
        let (max, session) = (256, 0x5e55_1011);
        let open = |ids: &[[u64; 2]]| {
            let (own, _) = Tiny::create(max, session, 0).unwrap();
            Tiny::open(0, own, ids, max, session).map(|_| ())
        };
        let (_mine, zero) = Tiny::create(max, session, 0).unwrap();
        let (_peer, one) = Tiny::create(max, session, 1).unwrap();
        let (_other, other_job) = Tiny::create(max, session + 1, 1).unwrap();
        let plain = rustix::fs::memfd_create("plain", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, Segment::bytes(max) as u64).unwrap();
        let unsealed = [u64::from(std::process::id()), plain.as_raw_fd() as u64];

        open(&[zero, one]).unwrap();
        for (lie, why) in [
            (other_job, "proof"),
            (zero, "proof"),
            (unsealed, "not sealed"),
        ] {
            let e = open(&[zero, lie]).unwrap_err().to_string();
            assert!(e.starts_with("rank 1's segment") && e.contains(why), "{e}");
        }
    }
}
