//! The simulation's event queue: at most one wake-up per rank (its
//! earliest), in time order, the next few of them known exactly, so that
//! the engine can load each rank's state a few wake-ups before it runs
//! (with thousands of ranks none of it is in cache, and a heap's layout
//! only hints at what comes after its first).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// A wake-up: when (f64 bits; times are non-negative, so their bits order
/// as they do) and whom.
type WakeUp = (u64, u32);

pub(super) struct Agenda {
    /// The earliest wake-ups, in order: none later than any in `later`.
    soon: VecDeque<WakeUp>,
    later: BinaryHeap<Reverse<WakeUp>>,
    /// Per rank, the time of its one live wake-up (infinite: none); queued
    /// ones at other times were superseded and are skipped.
    armed: Vec<f64>,
}

/// How many wake-ups [`Agenda::soon`] shows.
pub(super) const LOOKAHEAD: usize = 8;

impl Agenda {
    /// Every rank of `ranks` woken at time 0.
    pub fn new(ranks: u32) -> Self {
        Agenda {
            soon: VecDeque::with_capacity(LOOKAHEAD + 1),
            later: (0..ranks).map(|r| Reverse((0, r))).collect(),
            armed: vec![0.0; ranks as usize],
        }
    }

    /// Wakes `rank` at `at` unless it is woken by then anyway.
    pub fn wake(&mut self, rank: u32, at: f64) {
        let armed = &mut self.armed[rank as usize];
        if at < *armed {
            *armed = at;
            self.push((at.to_bits(), rank));
        }
    }

    fn push(&mut self, w: WakeUp) {
        match self.soon.back() {
            Some(&last) if w < last => {
                let i = self.soon.partition_point(|&s| s <= w);
                self.soon.insert(i, w);
                if self.soon.len() > LOOKAHEAD {
                    let last = self.soon.pop_back().expect("over the lookahead");
                    self.later.push(Reverse(last));
                }
            }
            _ => self.later.push(Reverse(w)),
        }
    }

    /// The earliest live wake-up; the rank has none after it until woken
    /// again.
    pub fn pop(&mut self) -> Option<(f64, u32)> {
        loop {
            while self.soon.len() <= LOOKAHEAD {
                let Some(Reverse(w)) = self.later.pop() else {
                    break;
                };
                self.soon.push_back(w);
            }
            let (at, rank) = self.soon.pop_front()?;
            let at = f64::from_bits(at);
            if self.armed[rank as usize] == at {
                self.armed[rank as usize] = f64::INFINITY;
                return Some((at, rank));
            }
        }
    }

    /// The ranks of the next wake-ups after the one [`pop`](Self::pop) just
    /// returned, in order (up to [`LOOKAHEAD`]; later wakes may come first,
    /// and a superseded one is skipped when its turn comes).
    pub fn soon(&self) -> impl Iterator<Item = u32> + '_ {
        self.soon.iter().map(|&(_, rank)| rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agenda of `ranks` whose start-up wake-ups are all taken.
    fn idle(ranks: u32) -> Agenda {
        let mut a = Agenda::new(ranks);
        while a.pop().is_some() {}
        a
    }

    #[test]
    fn pops_in_time_order_whatever_the_order_of_wakes() {
        let mut a = Agenda::new(3);
        let mut got = vec![];
        for _ in 0..3 {
            got.push(a.pop().unwrap());
        }
        assert_eq!(got, [(0.0, 0), (0.0, 1), (0.0, 2)]);
        let mut a = idle(40);
        let times: Vec<f64> = (0..40).map(|i| ((i * 7919) % 41) as f64).collect();
        for (r, &t) in times.iter().enumerate() {
            a.wake(r as u32, t);
            if r % 5 == 4 {
                // Pops interleaved with wakes never go back in time here,
                // as in a simulation: none is earlier than the last pop.
                let (at, rank) = a.pop().unwrap();
                a.wake(rank, at);
            }
        }
        let mut popped = vec![];
        while let Some(w) = a.pop() {
            popped.push(w);
        }
        let mut want: Vec<(f64, u32)> = (times.iter().enumerate())
            .map(|(r, &t)| (t, r as u32))
            .collect();
        want.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        assert_eq!(popped, want);
    }

    #[test]
    fn a_rank_is_woken_once_at_its_earliest() {
        let mut a = idle(2);
        a.wake(0, 5.0);
        a.wake(0, 3.0);
        a.wake(0, 4.0);
        a.wake(1, 4.0);
        assert_eq!(a.pop(), Some((3.0, 0)));
        assert_eq!(a.pop(), Some((4.0, 1)));
        assert_eq!(a.pop(), None);
    }
}
