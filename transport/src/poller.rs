//! Waiting for progress on several connections at once, with a deadline.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use crate::{Connection, Error, Interest, Rank, Result, Wake};

/// Decides what an idle progress loop does, in three phases:
///
/// 1. spin a few microseconds (a peer's reply is often that close, and over
///    shared memory a round is a few loads);
/// 2. keep polling but `sched_yield` each round, up to `patience`: an
///    oversubscribed rank (8 on 2 cores) hands its core to a rank with work,
///    while a rank with a core to itself stays awake. Sleeping earlier
///    invites convoys: a wake-up in a VM costs tens of microseconds, longer
///    than a short spin, so both ranks of a ping-pong end up sleeping on
///    every exchange;
/// 3. sleep in `poll(2)` on every connection's wake-up descriptor.
///
/// A thread whose core other work shares (it waited to run for more than a
/// tenth of the last `WINDOW`) polls only `CONTENDED_PATIENCE` before it
/// sleeps: spinning through its share of the core, it loses the core for
/// the other work's whole time slice; asleep, it is woken ahead of that
/// work. Only that thread: its peers on free cores keep spinning, since a
/// wake-up costs them tens of microseconds (every rank sleeping after
/// 20 us made a 2-rank 1 MiB Broadcast 3.8x slower under a busy loop).
/// With a busy loop on one of 2 cores, 2-rank 1 MiB Reduce took 314 ->
/// 130 us a call, ReduceScatter 278 -> 74, 16 MiB Reduce 0.6x; the rest
/// within noise, and nothing changes on idle cores.
///
/// A yield that came back `HOG_GAP` late handed the core to other work
/// for its time slice; where no rank of ours waits for that core (the
/// caller knows), yielding rounds then spin for a `WINDOW`: neither a
/// yield nor a wake-up takes such a core back before the slice ends
/// (EEVDF), and a rank of 4 unbound on 2 cores that the kernel had put
/// beside a busy loop ran once a tick, 4.2 ms a 1 MiB call instead of 0.3.
#[derive(Debug)]
pub struct Poller {
    spin: Duration,
    patience: Duration,
    idle_since: Option<Instant>,
    /// The last idle round slept (the loop is past spinning and yielding).
    asleep: bool,
    /// Idle rounds since the last busy one, and whether the last one that
    /// read the clock was still in the spin phase.
    rounds: u32,
    spinning: bool,
    /// When the current `WINDOW` began and how long the thread had waited
    /// to run by then, and whether it waited a tenth of the last window.
    window: Option<(Instant, Duration)>,
    contended: bool,
    /// When a yield last came back `HOG_GAP` late.
    hogged: Option<Instant>,
    /// Whose waits these are, for the log (see [`with_rank`](Self::with_rank)).
    rank: Option<Rank>,
}

/// An idle round's part in a wait (see [`Poller`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Spin,
    Yield,
    /// Sleep at most this long.
    Sleep(Duration),
    /// Nothing moved for the timeout.
    Expired,
}

/// While spinning, the clock is read every this many idle rounds: a read
/// costs about as much as a whole round over shared memory.
const SPIN_CLOCK_EVERY: u32 = 16;

/// The thread's wait to run is measured over windows this long: on this
/// VM, a core of its own makes it wait well under 1% of a window (brief
/// kernel work), a core shared with a busy loop about half.
const WINDOW: Duration = Duration::from_millis(50);
/// Whether the last poller to measure found its core shared with other
/// work (see [`core_shared`]).
static CORE_SHARED: AtomicBool = AtomicBool::new(false);

/// Whether this process's waiting thread last found its core shared with
/// other work: a shared-memory sender then leaves every copy to its peer
/// (its own copies would run at a fraction of a core, and its peer would
/// wait for them), and a receiver offers its peer every copy it can.
pub fn core_shared() -> bool {
    CORE_SHARED.load(Ordering::Relaxed)
}

/// How long a thread on a shared core polls before it sleeps.
const CONTENDED_PATIENCE: Duration = Duration::from_micros(20);
/// A yield that takes this long handed the core to other work for its
/// time slice: a peer of ours yields back sooner.
const HOG_GAP: Duration = Duration::from_millis(1);

impl Default for Poller {
    fn default() -> Self {
        Self::new(Self::DEFAULT_SPIN, Self::DEFAULT_PATIENCE)
    }
}

impl Poller {
    /// How long an idle loop spins before it starts yielding: when every
    /// rank has a core; when ranks outnumber cores, yield at once.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(5);
    /// How long an idle loop polls (spinning, then yielding) before it sleeps.
    pub const DEFAULT_PATIENCE: Duration = Duration::from_millis(1);
    /// The longest single sleep: a waiting thread comes back this often to
    /// look at what a descriptor cannot tell it (a pending Ctrl-C, say).
    pub const MAX_SLEEP: Duration = Duration::from_millis(100);

    pub fn new(spin: Duration, patience: Duration) -> Self {
        Poller {
            spin,
            patience,
            idle_since: None,
            asleep: false,
            rounds: 0,
            spinning: false,
            window: None,
            contended: false,
            hogged: None,
            rank: None,
        }
    }

    /// Names the rank whose waits these are in what the poller logs.
    pub fn with_rank(self, rank: Rank) -> Self {
        Poller {
            rank: Some(rank),
            ..self
        }
    }

    /// Call after a round in which something moved.
    pub fn busy(&mut self) {
        self.idle_since = None;
        self.asleep = false;
        self.rounds = 0;
        self.spinning = false;
    }

    /// The cheap part of an idle round, to call before preparing
    /// [`idle`](Self::idle)'s arguments: while spinning, most rounds only
    /// spin (without reading the clock). Returns whether the round is done.
    pub fn spin(&mut self) -> bool {
        self.rounds = self.rounds.wrapping_add(1);
        if self.spinning && self.rounds % SPIN_CLOCK_EVERY != 0 {
            std::hint::spin_loop();
            return true;
        }
        false
    }

    /// Whether the last idle round slept: the wait is a long one.
    pub fn asleep(&self) -> bool {
        self.asleep
    }

    /// Call after a round in which nothing moved. Returns `Ok(false)` once
    /// nothing has moved for `timeout`, `Ok(true)` otherwise (after spinning,
    /// yielding or sleeping). Busy rounds read no clock: only idle ones do.
    /// A sleep also ends when `extra` (an abort or new-work eventfd) is readable.
    /// `alone`: whether no thread of ours waits for this core, asked only
    /// once a yield came back `HOG_GAP` late: other work holds the core
    /// then, and yielding rounds spin instead for a `WINDOW` (see
    /// [`Poller`]).
    pub fn idle<'a, 'e>(
        &mut self,
        conns: impl Iterator<Item = &'a mut Box<dyn Connection>>,
        extra: impl IntoIterator<Item = BorrowedFd<'e>>,
        timeout: Duration,
        alone: impl FnOnce() -> bool,
    ) -> Result<bool> {
        match self.phase(timeout) {
            Phase::Expired => return Ok(false),
            Phase::Spin => std::hint::spin_loop(),
            Phase::Yield if self.hogged() && alone() => std::hint::spin_loop(),
            Phase::Yield => {
                let yielded = Instant::now();
                std::thread::yield_now();
                let back = Instant::now();
                if back - yielded >= HOG_GAP {
                    self.hogged = Some(back);
                }
            }
            Phase::Sleep(most) => sleep_until_ready(conns, extra, most)?,
        }
        Ok(true)
    }

    /// What an idle round does now, for a caller that waits its own way
    /// (on a futex, say): [`idle`](Self::idle)'s decision without the wait.
    pub fn phase(&mut self, timeout: Duration) -> Phase {
        if self.rounds == 1 && self.idle_since.is_none() && !self.spin.is_zero() {
            // The first idle round spins without reading the clock: a small
            // call's wait often ends before the next reading, and a reading
            // costs a tenth of such a call. The idle time counts from there.
            self.spinning = true;
            return Phase::Spin;
        }
        let now = Instant::now();
        let idle = now - *self.idle_since.get_or_insert(now);
        if idle >= timeout {
            return Phase::Expired;
        }
        let (spin, patience) = match self.shares_core(now) {
            true => (
                self.spin.min(CONTENDED_PATIENCE),
                self.patience.min(CONTENDED_PATIENCE),
            ),
            false => (self.spin, self.patience),
        };
        self.spinning = idle < spin;
        if self.spinning {
            Phase::Spin
        } else if idle < patience {
            Phase::Yield
        } else {
            self.asleep = true;
            Phase::Sleep((timeout - idle).min(Self::MAX_SLEEP))
        }
    }

    /// Whether other work shares this thread's core, as of the last full
    /// `WINDOW` (see [`Poller`]). Not asked when ranks outnumber cores
    /// (`spin` zero): they share cores with each other, and yield already.
    fn shares_core(&mut self, now: Instant) -> bool {
        if self.spin.is_zero() {
            return false;
        }
        if self.window.is_some_and(|(start, _)| now - start < WINDOW) {
            return self.contended;
        }
        let Some(waited) = waited_to_run() else {
            return false;
        };
        if let Some((start, before)) = self.window {
            let queued = waited.saturating_sub(before);
            self.contended = queued * 10 > now - start;
            if CORE_SHARED.swap(self.contended, Ordering::Relaxed) != self.contended {
                let share = 100.0 * queued.as_secs_f64() / (now - start).as_secs_f64();
                let who = self.rank.map_or(String::new(), |r| format!("rank {r}: "));
                let what = "waits poll less, peers take the copies";
                match self.contended {
                    true => tracing::info!(
                        "{who}this core is shared with other work ({share:.0}% of {WINDOW:?} waiting to run): {what}"
                    ),
                    false => tracing::info!("{who}this core is no longer shared with other work"),
                }
            }
        }
        self.window = Some((now, waited));
        self.contended
    }

    /// Whether a yield came back `HOG_GAP` late within the last `WINDOW`.
    fn hogged(&self) -> bool {
        self.hogged.is_some_and(|t| t.elapsed() < WINDOW)
    }

    /// How long the loop has been idle (zero while busy).
    pub fn idle_for(&self) -> Duration {
        self.idle_since.map_or(Duration::ZERO, |t| t.elapsed())
    }
}

/// How long the calling thread has waited on a run queue since it started
/// (`/proc/thread-self/schedstat`'s second field), where the kernel says.
fn waited_to_run() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns = stat.split_whitespace().nth(1)?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// Blocks until one connection's descriptor (or one of `extra`) is ready
/// or `timeout` passes; returns at once if a connection can progress already.
fn sleep_until_ready<'a, 'e>(
    conns: impl Iterator<Item = &'a mut Box<dyn Connection>>,
    extra: impl IntoIterator<Item = BorrowedFd<'e>>,
    timeout: Duration,
) -> Result<()> {
    let mut fds: Vec<PollFd<'_>> = (extra.into_iter())
        .map(|fd| PollFd::from_borrowed_fd(fd, PollFlags::IN))
        .collect();
    let extras = fds.len();
    for conn in conns {
        match conn.wake_source() {
            Wake::Idle => {}
            Wake::Now => return Ok(()),
            Wake::On(fd, want) => fds.push(poll_fd(fd, want)),
            Wake::Either(both) => fds.extend(both.map(|(fd, want)| poll_fd(fd, want))),
        }
    }
    let timeout = if fds.len() == extras {
        // No connection can wake us: the caller waits on itself. Sleep
        // briefly instead of spinning; its deadline still bounds the wait.
        timeout.min(Duration::from_millis(1))
    } else {
        timeout
    };
    let ts = Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    match poll(&mut fds, Some(&ts)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(Error::io(None, "poll", &e.into())),
    }
}

fn poll_fd(fd: BorrowedFd<'_>, want: Interest) -> PollFd<'_> {
    let mut flags = PollFlags::empty();
    flags.set(PollFlags::IN, want.readable);
    flags.set(PollFlags::OUT, want.writable);
    PollFd::from_borrowed_fd(fd, flags)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Pins the calling thread to `cpu`.
    fn pin(cpu: usize) {
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        rustix::thread::sched_setaffinity(None, &set).expect("pin");
    }

    /// A busy loop on the calling thread's CPU (the first it may use), both
    /// pinned there; stopped when dropped.
    struct BusyNeighbour {
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl BusyNeighbour {
        fn start() -> Self {
            let allowed = rustix::thread::sched_getaffinity(None).expect("affinity");
            let cpu = (0..rustix::thread::CpuSet::MAX_CPU)
                .find(|c| allowed.is_set(*c))
                .expect("a CPU");
            pin(cpu);
            let stop = Arc::new(AtomicBool::new(false));
            let spinning = stop.clone();
            let thread = std::thread::spawn(move || {
                pin(cpu);
                while !spinning.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
            BusyNeighbour {
                stop,
                thread: Some(thread),
            }
        }
    }

    impl Drop for BusyNeighbour {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            if let Some(t) = self.thread.take() {
                t.join().expect("the busy loop ends");
            }
        }
    }

    /// A waiting thread that shares its core with a busy loop finds out,
    /// and then sleeps after `CONTENDED_PATIENCE` rather than spinning.
    #[test]
    fn a_core_shared_with_a_busy_loop_is_noticed() {
        if waited_to_run().is_none() {
            eprintln!("this kernel keeps no schedstat: nothing to notice with");
            return;
        }
        let busy = BusyNeighbour::start();
        let mut poller = Poller::new(Duration::from_millis(1), Duration::from_millis(1));
        let started = Instant::now();
        while !poller.contended && started.elapsed() < Duration::from_secs(10) {
            poller.phase(Duration::from_secs(60));
        }
        drop(busy);
        assert!(poller.contended, "a core shared for 10 s was not noticed");
        poller.busy();
        assert_eq!(poller.phase(Duration::from_secs(60)), Phase::Spin);
        std::thread::sleep(CONTENDED_PATIENCE);
        assert!(matches!(
            poller.phase(Duration::from_secs(60)),
            Phase::Sleep(_)
        ));
    }

    /// A yield to a busy loop on the same core comes back a time slice
    /// later; from then on a waiting thread that no peer waits behind
    /// spins instead of yielding, and only then is asked whether it is
    /// alone.
    #[test]
    fn a_yield_to_a_busy_loop_is_noticed() {
        let busy = BusyNeighbour::start();
        // Ranks that outnumber cores: no spin, a long patience of yields.
        let mut poller = Poller::new(Duration::ZERO, Duration::from_secs(60));
        let asked = std::cell::Cell::new(0);
        let round = |poller: &mut Poller| {
            let none = std::iter::empty::<&mut Box<dyn Connection>>();
            let alone = || {
                asked.set(asked.get() + 1);
                true
            };
            poller
                .idle(none, None, Duration::from_secs(60), alone)
                .unwrap()
        };
        let started = Instant::now();
        while !poller.hogged() && started.elapsed() < Duration::from_secs(10) {
            assert!(round(&mut poller));
        }
        let hogged = poller.hogged();
        round(&mut poller);
        drop(busy);
        assert!(
            hogged,
            "no yield came back {HOG_GAP:?} late in 10 s beside a busy loop"
        );
        assert_eq!(asked.get(), 1, "asked whether alone before any late yield");
    }
}
