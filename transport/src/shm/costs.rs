//! Whether a receiver's help offers pay: how fast the sender's writes into
//! our memory run against our own reads of its memory.
//!
//! On the CI VM a cache line's round trip between the two CPUs is ~105 ns
//! most minutes and ~520 ns in others (`ci/linepingpong.c`). In the slow
//! minutes the sender's `process_vm_writev` into lines our reductions just
//! wrote ran at a third of its speed (~60 us per MiB against our reads'
//! ~24), and 2-rank Reduce of 4 MiB took 1.2x as long with help as
//! without; in the fast ones help makes it 0.71-0.77x. So the receiver
//! times both ways ([`TwoWays`]: offering is the usual way, reading
//! ourselves the other) and stops offering while writes take more than
//! [`SLOWER`] times as long as reads, reading one candidate in
//! [`PROBE_EVERY`] ourselves while it offers and offering one while it
//! does not, so that both figures follow the machine.

use std::time::Instant;

use crate::TwoWays;

/// Offers stop while the sender's writes take more than this many times
/// as long per byte as our reads.
const SLOWER: u32 = 2;
/// One candidate in this many goes the way the figures did not choose.
const PROBE_EVERY: u32 = 32;
/// Copies smaller than this are not timed: a system call's fixed cost
/// would dominate the figure.
const MIN_TIMED: usize = 64 << 10;

/// A receiver's figures for both ways of copying a remote message.
#[derive(Debug)]
pub(super) struct CopyCosts(TwoWays);

impl Default for CopyCosts {
    fn default() -> Self {
        Self(TwoWays::new(SLOWER, PROBE_EVERY))
    }
}

/// The clock at the start of a copy of `bytes`, if it is one to time: the
/// smaller ones cost two clock reads for nothing.
pub(super) fn timer(bytes: usize) -> Option<Instant> {
    (bytes >= MIN_TIMED).then(Instant::now)
}

/// Nanoseconds since `start` (from [`timer`]); 0 for an untimed copy.
pub(super) fn elapsed_ns(start: Option<Instant>) -> u64 {
    start.map_or(0, |s| s.elapsed().as_nanos() as u64)
}

impl CopyCosts {
    /// We read `bytes` of the sender's memory, started at `start` (from
    /// [`timer`]).
    pub fn note_read(&self, bytes: usize, start: Option<Instant>) {
        self.note(true, bytes, elapsed_ns(start));
    }

    /// The sender wrote `bytes` into our memory in `ns` nanoseconds (0: it
    /// did not time them).
    pub fn note_write(&self, bytes: usize, ns: u64) {
        self.note(false, bytes, ns);
    }

    fn note(&self, read: bool, bytes: usize, ns: u64) {
        if bytes >= MIN_TIMED {
            self.0.note(read, bytes, ns);
        }
    }

    /// Whether to offer the sender the copy of a message of `bytes` (see
    /// the module docs). One too small to time goes by the figures alone:
    /// reading it would not measure reads, nor writing it writes.
    pub fn worth_offering(&self, bytes: usize) -> bool {
        match bytes >= MIN_TIMED {
            true => !self.0.other_next(),
            false => !self.0.other_cheaper(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn costs(read_us: u64, write_us: u64) -> CopyCosts {
        let c = CopyCosts::default();
        c.note(true, MIB, read_us * 1000);
        c.note_write(MIB, write_us * 1000);
        c
    }

    fn offers(c: &CopyCosts, candidates: u32) -> usize {
        (0..candidates).filter(|_| c.worth_offering(MIB)).count()
    }

    #[test]
    fn offers_until_both_speeds_are_known() {
        let c = CopyCosts::default();
        assert!(c.worth_offering(MIB));
        c.note_read(MIB, timer(MIB));
        assert!(c.worth_offering(MIB));
    }

    #[test]
    fn small_messages_are_offered_until_the_figures_say_otherwise() {
        let c = CopyCosts::default();
        c.note_write(MIB, 60_000);
        assert!(!c.worth_offering(MIB), "reads are to be measured");
        assert!(
            c.worth_offering(MIN_TIMED - 1),
            "but not on a message too small to time"
        );
        c.note(true, MIB, 24_000);
        assert!(!c.worth_offering(MIN_TIMED - 1));
    }

    #[test]
    fn offers_while_writes_keep_up_but_for_probes() {
        for write_us in [20, 45] {
            let c = costs(24, write_us);
            assert_eq!(offers(&c, PROBE_EVERY * 3), 3 * (PROBE_EVERY as usize - 1));
        }
    }

    #[test]
    fn slow_writes_stop_offers_but_for_probes() {
        assert_eq!(offers(&costs(24, 60), PROBE_EVERY * 3), 3);
    }

    #[test]
    fn a_recovered_writer_is_offered_again() {
        let c = costs(24, 60);
        assert!(!c.worth_offering(MIB));
        for _ in 0..4 {
            c.note_write(MIB, 18_000);
        }
        assert!(c.worth_offering(MIB));
    }

    #[test]
    fn small_copies_are_not_timed() {
        assert!(timer(MIN_TIMED - 1).is_none() && timer(MIN_TIMED).is_some());
        let c = costs(24, 60);
        for _ in 0..16 {
            c.note_write(4096, 1);
            c.note_read(4096, None);
        }
        assert!(!c.worth_offering(MIB));
    }
}
