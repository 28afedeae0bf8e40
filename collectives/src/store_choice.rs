//! Plain or streaming stores, chosen by timing both.
//!
//! Some of our stores land on lines a peer has just read: an in-place
//! AllToAll's staged block lands on the block its peer read from it. A
//! plain store to such a line waits for the peer's core to give it up; a
//! streaming store only has the peer's copy dropped. How long the wait is
//! depends on the machine, and on the AMD VM on the minute: lines take ~100
//! or ~500 ns between its cores and back (`ci/linepingpong.c`), and 1 MiB
//! copied over lines the other core just read takes `memcpy` 130 or 550
//! us, streaming 47-50 either way (`ci/copyover.c`). But a streamed result
//! goes to memory, not into our cache, where the peer's next read would
//! have found it: in the fast minutes streamed calls took 1.3x the time
//! although their stores were faster.
//!
//! So each kind of such work keeps, per process (it is the machine that
//! changes, not the call), what each way cost per KiB, and goes on plain
//! unless streaming costs under a third of it, trying the other way one
//! time in `RETRY_EVERY`. Not with a core shared with other work: the time
//! then measures the scheduler, and streamed calls took 1.05-2.1x the time
//! of plain ones beside a busy loop (4-rank in-place AllToAll of 1 MiB).
//!
//! Reductions land on lines a peer read too (an AllReduce's result block,
//! read in the last call's all-gather), but streaming them through a block
//! on the stack did not pay: its stores cost 5x plain ones in the fast
//! minutes and 0.55x in the slow ones, and chosen this way (streaming when
//! 1.5x cheaper) 2-rank in-place AllReduces of 1 MiB took 0.57-0.73x the
//! time in the slow minutes and 1.04x overall.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Work on fewer bytes than this is plain: too short to time.
const TIMED_FROM: usize = 32 << 10;
/// One timed piece of work in this many goes the way that measured slower,
/// so that its figure follows the machine.
pub(crate) const RETRY_EVERY: u32 = 64;
/// Streaming goes on only while it costs less than plain by this factor.
const STREAM_WINS_BY: u32 = 3;

/// One kind of work's figures: ns per KiB by way (plain, streamed), 0
/// until measured, and how many times it ran timed.
pub(crate) struct StoreChoice {
    cost: [AtomicU32; 2],
    runs: AtomicU32,
}

impl StoreChoice {
    pub(crate) const fn new() -> Self {
        Self {
            cost: [AtomicU32::new(0), AtomicU32::new(0)],
            runs: AtomicU32::new(0),
        }
    }

    /// Runs `work(streams)` on `len` bytes: plain (`false`) when short or
    /// the core is shared, else the way that costs less, timed.
    pub(crate) fn run(&self, len: usize, work: impl FnOnce(bool)) {
        if len < TIMED_FROM || transport::core_shared() || !cfg!(target_arch = "x86_64") {
            return work(false);
        }
        self.timed(len, work)
    }

    fn timed(&self, len: usize, work: impl FnOnce(bool)) {
        let streams = self.streams_next();
        let start = Instant::now();
        work(streams);
        self.record(streams, len, start.elapsed());
    }

    /// The first timed run is plain, the second streams, then the way that
    /// costs less, one run in `RETRY_EVERY` the other.
    fn streams_next(&self) -> bool {
        let [plain, streamed] = self.cost.each_ref().map(|c| c.load(Ordering::Relaxed));
        let retry = self.runs.fetch_add(1, Ordering::Relaxed) % RETRY_EVERY == 0;
        match (plain, streamed) {
            (0, _) => false,
            (_, 0) => true,
            _ => (STREAM_WINS_BY * streamed < plain) != retry,
        }
    }

    /// Takes a run over `len` bytes in `took` into its way's cost: down
    /// halfway to a cheaper run, up a quarter at most: a run preempted
    /// midway (8 ranks on 2 cores) reads several times its cost, and a few
    /// in a row must not make the other way look cheaper; a real change
    /// (plain 80 -> 450 ns a KiB) still shows within a few runs.
    fn record(&self, streams: bool, len: usize, took: Duration) {
        let sample = (took.as_nanos() * 1024 / len as u128).clamp(1, 1 << 30) as u32;
        let cost = &self.cost[usize::from(streams)];
        let old = cost.load(Ordering::Relaxed);
        let new = match old {
            0 => sample,
            _ if sample <= old => (old + sample) / 2,
            _ => old + (sample.min(2 * old) - old) / 4,
        };
        cost.store(new, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::{StoreChoice, RETRY_EVERY, TIMED_FROM};

    #[test]
    fn goes_the_cheaper_way_and_retries_the_other() {
        let choice = StoreChoice::new();
        let mut ways = Vec::new();
        for _ in 0..2 * RETRY_EVERY {
            // Plain work takes 10x as long as streamed.
            choice.timed(TIMED_FROM, |streams| {
                ways.push(streams);
                let spin = std::time::Duration::from_micros(if streams { 100 } else { 1000 });
                let start = std::time::Instant::now();
                while start.elapsed() < spin {}
            });
        }
        assert_eq!(ways[..2], [false, true], "each way is measured first");
        let plain = ways.iter().filter(|s| !**s).count();
        assert!(
            (2..=4).contains(&plain),
            "plain {plain} times in {}",
            ways.len()
        );
    }

    #[test]
    fn short_work_is_plain_and_untimed() {
        let choice = StoreChoice::new();
        for _ in 0..4 {
            choice.run(TIMED_FROM - 1, |streams| assert!(!streams));
        }
        assert_eq!(choice.runs.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
}
