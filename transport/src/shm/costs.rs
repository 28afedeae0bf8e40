//! Whether a receiver's help offers pay: how fast the sender's writes into
//! our memory run against our own reads of its memory.
//!
//! On the CI VM a cache line's round trip between the two CPUs is ~105 ns
//! most minutes and ~520 ns in others (`ci/linepingpong.c`). In the slow
//! minutes the sender's `process_vm_writev` into lines our reductions just
//! wrote ran at a third of its speed (~60 us per MiB against our reads'
//! ~24), and 2-rank Reduce of 4 MiB took 1.2x as long with help as
//! without; in the fast ones help makes it 0.71-0.77x. So the receiver
//! keeps both speeds and stops offering while writes are much the slower,
//! offering one message in [`PROBE_EVERY`] meanwhile to see them recover.

use std::time::Instant;

/// Offers stop while the sender's writes take more than this many times
/// as long per byte as our reads.
const SLOWER: f32 = 2.0;
/// While offers are stopped, one candidate in this many is still offered,
/// so that a write measures whether the sender has sped up again.
const PROBE_EVERY: u32 = 32;
/// Copies smaller than this are not timed: a system call's fixed cost
/// would dominate the figure.
const MIN_TIMED: usize = 64 << 10;

/// Nanoseconds per KiB, smoothed; zero until the first sample.
#[derive(Default, Clone, Copy, Debug)]
struct Rate(f32);

impl Rate {
    fn note(&mut self, bytes: usize, ns: u64) {
        let sample = ns as f32 * 1024.0 / bytes as f32;
        self.0 = match self.0 {
            0.0 => sample,
            r => r + (sample - r) / 8.0,
        };
    }
}

/// A receiver's view of both copy speeds (see the module docs).
#[derive(Default, Debug)]
pub(super) struct CopyCosts {
    read: Rate,
    write: Rate,
    /// Candidates passed over since offers stopped.
    passed: u32,
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
    pub fn note_read(&mut self, bytes: usize, start: Option<Instant>) {
        self.note(bytes, elapsed_ns(start), |c| &mut c.read);
    }

    /// The sender wrote `bytes` into our memory in `ns` nanoseconds (0: it
    /// did not time them).
    pub fn note_write(&mut self, bytes: usize, ns: u64) {
        self.note(bytes, ns, |c| &mut c.write);
    }

    fn note(&mut self, bytes: usize, ns: u64, rate: fn(&mut Self) -> &mut Rate) {
        if bytes >= MIN_TIMED && ns > 0 {
            rate(self).note(bytes, ns);
        }
    }

    /// Whether to offer the sender the next copy: yes until both speeds are
    /// known, then while its writes are not [`SLOWER`] than our reads, and
    /// otherwise one candidate in [`PROBE_EVERY`].
    pub fn worth_offering(&mut self) -> bool {
        let (read, write) = (self.read.0, self.write.0);
        if read == 0.0 || write == 0.0 || write <= SLOWER * read {
            self.passed = 0;
            return true;
        }
        self.passed += 1;
        self.passed % PROBE_EVERY == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn costs(read_us: u64, write_us: u64) -> CopyCosts {
        let mut c = CopyCosts::default();
        c.note(MIB, read_us * 1000, |c| &mut c.read);
        c.note_write(MIB, write_us * 1000);
        c
    }

    #[test]
    fn offers_until_both_speeds_are_known() {
        let mut c = CopyCosts::default();
        assert!(c.worth_offering());
        c.note_read(MIB, timer(MIB));
        assert!(c.worth_offering());
    }

    #[test]
    fn offers_while_writes_keep_up() {
        assert!(costs(24, 20).worth_offering());
        assert!(costs(24, 45).worth_offering());
    }

    #[test]
    fn slow_writes_stop_offers_but_for_probes() {
        let mut c = costs(24, 60);
        let offered = (0..PROBE_EVERY * 3).filter(|_| c.worth_offering()).count();
        assert_eq!(offered, 3);
    }

    #[test]
    fn a_recovered_writer_is_offered_again() {
        let mut c = costs(24, 60);
        assert!(!c.worth_offering());
        for _ in 0..16 {
            c.note_write(MIB, 18_000);
        }
        assert!(c.worth_offering());
    }

    #[test]
    fn small_copies_are_not_timed() {
        assert!(timer(MIN_TIMED - 1).is_none() && timer(MIN_TIMED).is_some());
        let mut c = costs(24, 60);
        for _ in 0..16 {
            c.note_write(4096, 1);
            c.note_read(4096, None);
        }
        assert!(!c.worth_offering());
    }
}
