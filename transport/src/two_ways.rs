//! Which of two ways to do a kind of work, chosen by timing both.
//!
//! Some work has two ways whose costs change with the machine's minute,
//! not with the call: on the AMD VM a cache line takes ~100 ns between its
//! cores and back most minutes and ~500 ns in others (`ci/linepingpong.c`),
//! and whether a plain or a streaming store, or the sender's write or the
//! receiver's read, is the cheaper way to copy flips with it. So the work
//! keeps each way's cost per KiB, goes the usual way unless the other is
//! cheaper by a given factor, and tries the way it is not going one time
//! in a given number, so that both figures follow the machine.
//!
//! Users: the shared-memory transport's offers of help (`shm::costs`), the
//! collectives' staged copies (`stream_copy::copy_staged`).

use std::sync::atomic::{AtomicU32, Ordering};

/// One kind of work's figures. Atomic so that one can serve a process
/// (`static`); relaxed, as a stale figure only costs one choice.
#[derive(Debug)]
pub struct TwoWays {
    /// Nanoseconds per KiB, usual way then other way; 0 until measured.
    cost: [AtomicU32; 2],
    /// Choices made so far, for the retries.
    choices: AtomicU32,
    other_wins_by: u32,
    retry_every: u32,
}

impl TwoWays {
    /// Goes the other way while it costs less than the usual one by
    /// `other_wins_by`, one choice in `retry_every` the way it would not.
    pub const fn new(other_wins_by: u32, retry_every: u32) -> Self {
        assert!(other_wins_by >= 1 && retry_every >= 2);
        Self {
            cost: [AtomicU32::new(0), AtomicU32::new(0)],
            choices: AtomicU32::new(0),
            other_wins_by,
            retry_every,
        }
    }

    /// Whether the next piece of work goes the other way: the usual way
    /// until it is measured, then the other until it is, then the way that
    /// costs less, the other one choice in `retry_every`.
    pub fn other_next(&self) -> bool {
        let made = self.choices.fetch_add(1, Ordering::Relaxed) + 1;
        let retry = made % self.retry_every == 0;
        match self.costs() {
            [0, _] => false,
            [_, 0] => true,
            costs => self.other_wins(costs) != retry,
        }
    }

    /// Whether both ways are measured and the other costs less by
    /// `other_wins_by`: the choice for work too small to time, which
    /// neither waits for a figure nor counts towards the retries.
    pub fn other_cheaper(&self) -> bool {
        let costs = self.costs();
        costs[1] != 0 && self.other_wins(costs)
    }

    /// Whether `[usual, other]` favour the other way (an unmeasured usual
    /// way, 0, never loses; callers rule out an unmeasured other way).
    fn other_wins(&self, [usual, other]: [u32; 2]) -> bool {
        u64::from(self.other_wins_by) * u64::from(other) < u64::from(usual)
    }

    /// Takes `ns` for `bytes` the given way into its cost: down halfway to
    /// a cheaper sample, up a quarter at most. A run preempted midway (8
    /// ranks on 2 cores) reads several times its cost, and a few in a row
    /// must not make the other way look cheaper; a real change (plain
    /// stores 80 -> 450 ns a KiB) still shows within a few samples.
    pub fn note(&self, other: bool, bytes: usize, ns: u64) {
        if bytes == 0 || ns == 0 {
            return;
        }
        let sample = (u128::from(ns) * 1024 / bytes as u128).clamp(1, 1 << 30) as u32;
        let cost = &self.cost[usize::from(other)];
        let old = cost.load(Ordering::Relaxed);
        let new = match old {
            0 => sample,
            _ if sample <= old => (old + sample) / 2,
            _ => old + (sample.min(2 * old) - old) / 4,
        };
        cost.store(new, Ordering::Relaxed);
    }

    /// Nanoseconds per KiB the usual and the other way cost (0: unmeasured).
    pub fn costs(&self) -> [u32; 2] {
        self.cost.each_ref().map(|c| c.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::TwoWays;

    const MIB: usize = 1 << 20;

    /// Runs `n` choices where the usual way costs `usual` us a MiB and the
    /// other `other`; returns how many went the other way.
    fn run(ways: &TwoWays, n: u32, usual: u64, other: u64) -> usize {
        (0..n)
            .filter(|_| {
                let o = ways.other_next();
                ways.note(o, MIB, if o { other } else { usual } * 1000);
                o
            })
            .count()
    }

    /// How many of `n` choices go the other way, with no new figures.
    fn choices(ways: &TwoWays, n: u32) -> usize {
        (0..n).filter(|_| ways.other_next()).count()
    }

    #[test]
    fn measures_each_way_first() {
        let ways = TwoWays::new(3, 64);
        assert!(!ways.other_next());
        ways.note(false, MIB, 1000);
        assert!(ways.other_next());
        ways.note(true, MIB, 100_000);
        assert!(!ways.other_next());
    }

    #[test]
    fn goes_the_cheaper_way_and_retries_the_other() {
        let ways = TwoWays::new(3, 64);
        let other = run(&ways, 128, 1000, 100);
        assert!(
            (124..=126).contains(&other),
            "other way {other} times in 128"
        );
        let ways = TwoWays::new(3, 64);
        let other = run(&ways, 128, 100, 1000);
        assert!((2..=4).contains(&other), "other way {other} times in 128");
    }

    #[test]
    fn a_small_win_keeps_the_usual_way() {
        let ways = TwoWays::new(2, 32);
        let other = run(&ways, 96, 45, 24);
        assert!(other <= 5, "other way {other} times in 96");
    }

    #[test]
    fn follows_a_change_within_a_few_samples() {
        let ways = TwoWays::new(2, 32);
        run(&ways, 64, 60, 24);
        assert_eq!(choices(&ways, 32), 31);
        for _ in 0..4 {
            ways.note(false, MIB, 18_000);
        }
        assert_eq!(choices(&ways, 32), 1);
    }

    #[test]
    fn one_slow_sample_does_not_flip_the_choice() {
        let ways = TwoWays::new(2, 32);
        ways.note(false, 1024, 20_000);
        ways.note(true, 1024, 30_000);
        ways.note(false, 1024, 400_000); // preempted
        assert_eq!(ways.costs(), [25_000, 30_000]);
        assert_eq!(choices(&ways, 32), 1);
    }

    #[test]
    fn small_work_follows_the_figures_without_measuring() {
        let ways = TwoWays::new(2, 32);
        assert!(!ways.other_cheaper());
        ways.note(false, MIB, 60_000);
        assert!(!ways.other_cheaper(), "the other way is not measured yet");
        ways.note(true, MIB, 24_000);
        assert!(ways.other_cheaper());
        assert_eq!(choices(&ways, 31), 31, "no retry was used up");
    }

    #[test]
    fn the_slowest_figures_do_not_overflow() {
        let ways = TwoWays::new(8, 32);
        ways.note(false, 1, 1 << 40);
        ways.note(true, 1, 1 << 40);
        assert_eq!(ways.costs(), [1 << 30, 1 << 30]);
        assert!(!ways.other_next());
    }
}
