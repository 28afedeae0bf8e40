//! The flight recorder: every communicator keeps its last calls (2000, or
//! `COLL_TRACE_BUFFER`) in a fixed ring of plain records, updated where a
//! call starts, begins running and finishes: a few stores per call, no
//! allocation, always on. Dumped as JSON, one file per rank, when a call
//! fails (a timeout, a dead or disagreeing peer), on SIGUSR1, and on request
//! ([`Communicator::dump_trace`]); `collbench trace DIR` merges the dumps
//! and names the rank at fault.
//!
//! Besides the calls, counters: bytes and messages per peer each way, calls
//! per collective, time spent waiting, failures ([`Stats`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::Serialize;
use transport::Rank;

use crate::call::descriptor::{CallDesc, Collective};
use crate::observe::waiting::Waiting;
use crate::sys::clock::ticks;

/// Calls kept when `COLL_TRACE_BUFFER` does not say.
pub const DEFAULT_CALLS: usize = 2000;

/// Where a recorded call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Started, waiting for the collective before it.
    Queued,
    Running,
    Done,
    Failed,
}

/// One call, as the ring keeps it (plain data: recording costs stores).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    pub desc: CallDesc,
    /// Point-to-point: the peer, and whether this rank sends.
    pub peer: Option<(Rank, bool)>,
    pub algorithm: &'static str,
    pub chunk: usize,
    pub bytes: usize,
    pub phase: Phase,
    /// [`ticks`] at start and end (0: not yet; both 0 for a call done at
    /// its first poll, which is not timed: see `finished_at_once`).
    pub started: u64,
    pub ended: u64,
}

/// The ring of recent calls and the counters of one communicator.
pub(crate) struct Recorder {
    ring: Vec<Entry>,
    capacity: usize,
    /// Calls recorded so far (the ring holds the last `capacity`).
    recorded: u64,
    /// Where the next call goes in the ring.
    next: usize,
    /// When the recorder was made, by the clock and in [`ticks`].
    born: Instant,
    born_ticks: u64,
    pub stats: Stats,
    /// SIGUSR1s this communicator has dumped for.
    pub dumps_seen: u64,
    /// Spans for `COLL_TRACE`, when it is set.
    pub timeline: Option<crate::observe::timeline::Timeline>,
    /// The wall clock when the recorder was made (traces of ranks line up).
    born_unix_us: f64,
    /// Where this rank is, for the others to ask (see [`crate::observe::status`]).
    pub board: std::sync::Arc<crate::observe::status::Board>,
}

/// A call's place in the ring, while it can still be updated: its number
/// on the communicator and its index in the ring.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot(u64, usize);

impl Slot {
    /// Of a call not recorded (it had nothing to move).
    const NONE: Slot = Slot(u64::MAX, usize::MAX);

    /// The call's number on its communicator (`CallRecord::number`).
    pub fn number(self) -> u64 {
        self.0
    }
}

impl Recorder {
    pub fn new(rank: Rank, size: usize) -> Self {
        let capacity = std::env::var("COLL_TRACE_BUFFER")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_CALLS)
            .max(1);
        let mut ring = Vec::with_capacity(capacity.min(1 << 16));
        // Fault the ring's pages in now: the first calls would otherwise
        // take a page fault every ~40 records (2-rank 8 B Broadcast, 1000
        // calls after 100 warmup: 0.19 -> 0.14 us a call).
        for e in ring.spare_capacity_mut() {
            *e = std::mem::MaybeUninit::zeroed();
        }
        Recorder {
            ring,
            capacity,
            recorded: 0,
            next: 0,
            born: Instant::now(),
            born_ticks: ticks(),
            stats: Stats::new(size),
            dumps_seen: dump_requests(),
            timeline: crate::observe::timeline::path_for(rank).map(|_| Default::default()),
            born_unix_us: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64() * 1e6),
            board: Default::default(),
        }
    }

    /// Records a call that just started.
    pub fn start(&mut self, desc: CallDesc, peer: Option<(Rank, bool)>, bytes: usize) -> Slot {
        let entry = Entry {
            desc,
            peer,
            algorithm: "",
            chunk: 0,
            bytes,
            phase: Phase::Queued,
            // Read when the call turns out to wait (`waits`), unless a
            // timeline wants every span.
            started: self.timeline.as_ref().map_or(0, |_| ticks()),
            ended: 0,
        };
        let at = self.next;
        match self.ring.len() < self.capacity {
            true => self.ring.push(entry),
            false => self.ring[at] = entry,
        }
        self.next = if at + 1 == self.capacity { 0 } else { at + 1 };
        let slot = Slot(self.recorded, at);
        self.recorded += 1;
        self.stats.by_kind[desc.collective as usize] += 1;
        self.board.call(&desc, 1);
        slot
    }

    /// Counts a call with nothing to move, finished as it started, without
    /// an entry: it cannot hang (its sequence number is used up all the
    /// same, so a record's numbers skip it), and an entry with its clock
    /// readings and status-board writes made such a call cost twice as much
    /// (4 ranks: 0.07 against 0.03 us).
    pub fn skipped(&mut self, collective: Collective) -> Slot {
        self.stats.by_kind[collective as usize] += 1;
        Slot::NONE
    }

    /// The entry of `slot`, unless the ring has moved past it (or it has none).
    pub fn entry(&mut self, slot: Slot) -> Option<&mut Entry> {
        let age = self.recorded.checked_sub(slot.0)?;
        if age > self.capacity as u64 {
            return None;
        }
        self.ring.get_mut(slot.1)
    }

    /// The call of `slot` was not done at its first poll (or was queued):
    /// its start is stamped now, a fraction of a microsecond late.
    pub fn waits(&mut self, slot: Slot) {
        if let Some(e) = self.entry(slot).filter(|e| e.started == 0) {
            e.started = ticks();
        }
    }

    pub fn running(&mut self, slot: Slot, algorithm: &'static str, chunk: usize) {
        if let Some(e) = self.entry(slot) {
            e.phase = Phase::Running;
            e.algorithm = algorithm;
            e.chunk = chunk;
            let desc = e.desc;
            self.board.call(&desc, 2);
        }
    }

    pub fn finished(&mut self, slot: Slot, ok: bool) {
        self.finish(slot, ok, false)
    }

    /// Records a call done at its first poll, a fraction of a microsecond
    /// after it started, without a time (unless a timeline is kept): it
    /// lies between its timed neighbours. A clock reading costs ~10 ns in
    /// this VM, a tenth of such a call: skipping the one at its end made
    /// 2-rank 8 B Broadcasts 0.93x the time, the one at its start too
    /// 0.94-0.95x again, idle or beside a busy loop (`ci/ab.py broadcast 2
    /// 8`).
    pub fn finished_at_once(&mut self, slot: Slot) {
        self.finish(slot, true, self.timeline.is_none())
    }

    fn finish(&mut self, slot: Slot, ok: bool, at_start: bool) {
        let mut span = None;
        if let Some(e) = self.entry(slot) {
            e.phase = if ok { Phase::Done } else { Phase::Failed };
            e.ended = if at_start { e.started } else { ticks() };
            if e.started == 0 {
                e.started = e.ended; // not stamped by `waits`: ends as it starts
            }
            span = Some((e.desc, e.started, e.ended, e.bytes));
        }
        if let Some((desc, ..)) = span {
            self.board.call(&desc, if ok { 3 } else { 4 });
        }
        if let (Some(t), Some((desc, start, end, bytes))) = (&mut self.timeline, span) {
            t.call(desc.to_string(), start, end, bytes);
        }
        if !ok {
            self.stats.failures += 1;
        }
    }

    /// Microseconds since the Unix epoch of a [`ticks`] reading.
    pub fn unix_us(&self, t: u64) -> f64 {
        let elapsed_us = self.born.elapsed().as_secs_f64() * 1e6;
        let per_us = (ticks().wrapping_sub(self.born_ticks) as f64 / elapsed_us.max(1.0)).max(1e-9);
        self.born_unix_us + t.wrapping_sub(self.born_ticks) as f64 / per_us
    }

    /// The recorded calls, oldest first, as a dump shows them; `waiting`
    /// says what an unfinished call waits on.
    pub fn calls(&self, waiting: impl Fn(u64) -> Option<Waiting>) -> Vec<CallRecord> {
        let first = self.recorded.saturating_sub(self.ring.len() as u64);
        // Ticks per microsecond, measured over the recorder's life.
        let elapsed_us = self.born.elapsed().as_secs_f64() * 1e6;
        let per_us = (ticks().wrapping_sub(self.born_ticks) as f64 / elapsed_us.max(1.0)).max(1e-9);
        let at = |t: u64| t.wrapping_sub(self.born_ticks) as f64 / per_us;
        (first..self.recorded)
            .map(|n| {
                let e = &self.ring[(n % self.capacity as u64) as usize];
                CallRecord {
                    number: n,
                    call: e.desc.to_string(),
                    collective: e.desc.collective.name(),
                    seq: e.desc.seq,
                    count: e.desc.count,
                    dtype: e.desc.dtype.name(),
                    op: e.desc.op.map(|o| o.name()),
                    root: e.desc.root,
                    peer: e.peer.map(|(p, _)| p),
                    direction: e.peer.map(|(_, send)| if send { "send" } else { "recv" }),
                    algorithm: e.algorithm,
                    chunk: e.chunk,
                    bytes: e.bytes,
                    state: match e.phase {
                        Phase::Queued => "queued",
                        Phase::Running => "running",
                        Phase::Done => "done",
                        Phase::Failed => "failed",
                    },
                    waiting_on: (matches!(e.phase, Phase::Running))
                        .then(|| waiting(n))
                        .flatten()
                        .map(WaitRecord::from),
                    start_us: (e.started != 0).then(|| at(e.started)),
                    end_us: (e.ended != 0).then(|| at(e.ended)),
                }
            })
            .collect()
    }
}

/// Counters of one communicator (see [`Communicator::stats`](crate::Communicator::stats)).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Stats {
    /// Per peer rank: bytes and messages this rank posted to it and from it.
    pub peers: Vec<PeerStats>,
    /// Calls started, by collective name.
    pub calls: Vec<(String, u64)>,
    /// The same, by `Collective` discriminant (what a call increments).
    #[serde(skip)]
    by_kind: [u64; 16],
    /// Seconds spent idle waiting for a peer (spinning, yielding, sleeping).
    pub wait_seconds: f64,
    /// Calls that failed (timeouts included) and timeouts alone.
    pub failures: u64,
    pub timeouts: u64,
    /// Buffers a call had to register with a transport that needs it (pinned
    /// for verbs; for shared memory, ranges in a `SharedBuffer`, which
    /// receivers map), the registration cache missing; and failed verbs
    /// completions.
    pub registrations: u64,
    pub completion_errors: u64,
    /// Connections to peers this rank holds (each lane of a pair counts),
    /// and the seconds spent making them (when the communicator was made
    /// with `COLL_CONNECT=eager`, else in the first calls to need them).
    pub connections: u64,
    pub connect_seconds: f64,
    /// Seconds from the start of `Communicator::init` (or a split or
    /// shrink) to a communicator ready for calls.
    pub init_seconds: f64,
}

/// Traffic with one peer.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct PeerStats {
    pub bytes_sent: u64,
    pub messages_sent: u64,
    pub bytes_received: u64,
    pub messages_received: u64,
}

impl Stats {
    fn new(size: usize) -> Self {
        Stats {
            peers: vec![PeerStats::default(); size],
            ..Stats::default()
        }
    }

    /// A copy with the calls per collective named.
    pub(crate) fn snapshot(&self) -> Stats {
        let mut s = self.clone();
        s.calls = (Collective::ALL.iter().chain([&Collective::PointToPoint]))
            .map(|c| (c.name().to_string(), self.by_kind[*c as usize]))
            .collect();
        s
    }

    /// A message of `bytes` posted to (`send`) or from `peer`.
    pub(crate) fn count_message(&mut self, peer: Rank, send: bool, bytes: usize) {
        if let Some(p) = self.peers.get_mut(peer) {
            match send {
                true => {
                    (p.bytes_sent, p.messages_sent) =
                        (p.bytes_sent + bytes as u64, p.messages_sent + 1)
                }
                false => {
                    (p.bytes_received, p.messages_received) =
                        (p.bytes_received + bytes as u64, p.messages_received + 1)
                }
            }
        }
    }
}

/// A call in a dump.
#[derive(Clone, Debug, Serialize)]
pub struct CallRecord {
    /// Calls this communicator started before this one (all kinds).
    pub number: u64,
    /// As errors print it: `allreduce #57 (1024 x f32, sum)`.
    pub call: String,
    pub collective: &'static str,
    pub seq: u32,
    pub count: u64,
    pub dtype: &'static str,
    pub op: Option<&'static str>,
    pub root: Option<u16>,
    pub peer: Option<Rank>,
    pub direction: Option<&'static str>,
    pub algorithm: &'static str,
    pub chunk: usize,
    pub bytes: usize,
    /// queued, running, done or failed.
    pub state: &'static str,
    pub waiting_on: Option<WaitRecord>,
    /// Microseconds since the communicator was made; none for a call done
    /// at its first poll (under a microsecond, not timed).
    pub start_us: Option<f64>,
    pub end_us: Option<f64>,
}

/// What a running call waits for.
#[derive(Clone, Debug, Serialize)]
pub struct WaitRecord {
    pub peer: Rank,
    /// "send" or "receive".
    pub kind: &'static str,
    /// 1-based message number on that peer's queue, and the queue's length.
    pub message: usize,
    pub of: usize,
    pub bytes: usize,
}

impl From<Waiting> for WaitRecord {
    fn from(w: Waiting) -> Self {
        WaitRecord {
            peer: w.peer,
            kind: if w.send { "send" } else { "receive" },
            message: w.index,
            of: w.of,
            bytes: w.bytes,
        }
    }
}

/// A whole dump: one rank's view.
#[derive(Clone, Debug, Serialize)]
pub struct Dump {
    pub rank: Rank,
    pub size: usize,
    pub host: String,
    pub pid: u32,
    /// Why it was written: the failure, "SIGUSR1" or "on request".
    pub reason: String,
    /// Seconds since the Unix epoch.
    pub time: f64,
    pub calls: Vec<CallRecord>,
    pub stats: Stats,
}

/// Counts SIGUSR1s: a communicator that has seen fewer dumps on its next step.
static DUMP_REQUESTS: AtomicU64 = AtomicU64::new(0);
static SIGNAL_INSTALLED: std::sync::Once = std::sync::Once::new();

/// Installs the SIGUSR1 handler (once per process). It only sets a flag:
/// the communicators dump on their next step.
pub(crate) fn install_signal() {
    SIGNAL_INSTALLED.call_once(|| {
        extern "C" fn on_usr1(_: libc::c_int) {
            DUMP_REQUESTS.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: the handler only stores to an atomic (async-signal-safe);
        // SA_RESTART keeps interrupted system calls going.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut());
        }
    });
}

/// SIGUSR1s received so far (a communicator dumps when it has seen fewer).
pub(crate) fn dump_requests() -> u64 {
    DUMP_REQUESTS.load(Ordering::Relaxed)
}

/// Where dumps go: `COLL_TRACE_DUMP_DIR`, else `coll-traces-<uid>` in the
/// temp dir, a directory of this user's alone (another user on the host
/// can neither read the records nor plant a link where one will be written).
pub(crate) fn dump_dir() -> PathBuf {
    std::env::var_os("COLL_TRACE_DUMP_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(format!("coll-traces-{}", uid())))
}

fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// Writes `dump` as `coll-trace-rank<R>-pid<P>.json` in `dir`, mode 0600:
/// into a file created anew (never through an existing file or link), then
/// renamed into place, in a directory made private (0700) if it is new and
/// refused unless it is a real directory of this user's.
pub(crate) fn write(dump: &Dump, dir: &Path) -> std::io::Result<PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", dir.display()),
            ));
        }
        _ => {}
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() || meta.uid() != uid() {
        return Err(std::io::Error::other(format!(
            "{} is not a directory of this user's (uid {}): no flight record is written there",
            dir.display(),
            uid()
        )));
    }
    let name = format!("coll-trace-rank{}-pid{}.json", dump.rank, dump.pid);
    let (path, part) = (
        dir.join(&name),
        dir.join(format!(".{name}.{:x}", crate::bootstrap::random_token())),
    );
    let text = serde_json::to_string_pretty(dump).map_err(std::io::Error::other)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&part)?;
    let written =
        (file.write_all((text + "\n").as_bytes())).and_then(|()| std::fs::rename(&part, &path));
    if written.is_err() {
        // A full disk, say: no hidden part left behind.
        let _ = std::fs::remove_file(&part);
    }
    written.map(|()| path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Collective, DataType};

    fn desc(count: u64, seq: u32) -> CallDesc {
        CallDesc {
            collective: Collective::AllGather,
            dtype: DataType::F32,
            op: None,
            count,
            root: None,
            seq,
            comm: 0,
        }
    }

    #[test]
    fn a_call_with_nothing_to_move_is_counted_not_recorded() {
        let mut r = Recorder::new(0, 4);
        let skipped = r.skipped(desc(0, 0).collective);
        r.finished(skipped, true); // no entry to finish: touches nothing
        let slot = r.start(desc(8, 1), None, 32);
        r.finished(slot, true);
        let calls = r.calls(|_| None);
        assert_eq!(
            calls.len(),
            1,
            "only the call that moved bytes has an entry"
        );
        assert_eq!((calls[0].seq, calls[0].state), (1, "done"));
        let counted = r.stats.snapshot().calls;
        assert!(
            counted.contains(&("allgather".to_string(), 2)),
            "{counted:?}"
        );
    }

    #[test]
    fn a_call_done_at_once_is_not_timed_one_that_waited_is() {
        let mut r = Recorder::new(0, 4);
        let at_once = r.start(desc(8, 0), None, 32);
        r.finished_at_once(at_once);
        let waited = r.start(desc(8, 1), None, 32);
        r.waits(waited);
        std::thread::sleep(std::time::Duration::from_millis(2));
        r.finished(waited, true);
        let calls = r.calls(|_| None);
        assert_eq!((calls[0].state, calls[1].state), ("done", "done"));
        assert_eq!((calls[0].start_us, calls[0].end_us), (None, None));
        let took = calls[1].end_us.unwrap() - calls[1].start_us.unwrap();
        assert!(took >= 1000.0, "the waiting call took {took} us");
    }

    #[test]
    fn dumps_follow_no_link_and_only_this_users_directory() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let r = Recorder::new(3, 4);
        let dump = Dump {
            rank: 3,
            size: 4,
            host: "h".into(),
            pid: 42,
            reason: "test".into(),
            time: 0.0,
            calls: r.calls(|_| None),
            stats: r.stats.snapshot(),
        };
        let base = std::env::temp_dir().join(format!("coll-dump-test-{}", std::process::id()));
        let dir = base.join("private");
        // A link planted where the dump goes, at a file someone else owns.
        std::fs::create_dir_all(&dir).unwrap();
        let victim = base.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let planted = dir.join("coll-trace-rank3-pid42.json");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        let path = write(&dump, &dir).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(
            meta.is_file() && meta.mode() & 0o777 == 0o600,
            "{:o}",
            meta.mode()
        );
        // A new directory is private; a link in place of one is refused.
        let fresh = base.join("fresh");
        write(&dump, &fresh).unwrap();
        let mode = std::fs::metadata(&fresh).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let linked = base.join("linked");
        std::os::unix::fs::symlink(&fresh, &linked).unwrap();
        assert!(write(&dump, &linked).is_err());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
