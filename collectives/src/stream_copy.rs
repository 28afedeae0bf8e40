//! Copies of calls too large for the caches, with non-temporal stores.
//!
//! A plain store to a line not in the cache first reads the line from
//! memory (to own it), then writes it back: three bytes of memory traffic
//! per byte copied. A streaming store writes whole lines without reading
//! them: two. On the AMD VM, copying 64 MiB in 256 KiB pieces (as the
//! executor copies a rank's own block) ran 11-15 GB/s with `memcpy` and
//! 18-22 with streaming stores; glibc streams only above its own threshold,
//! which it derives from a cache size VMs often misreport (240 MiB here).
//! Below a few MiB the data stays in cache and `memcpy` is faster (1-8 MiB:
//! 36-44 GB/s against 24-26), hence [`STREAM_FROM`].
//!
//! In collbench, new over old (`python3 ci/ab.py alltoall 2 64M 6 OLD NEW
//! mpi`): 2-rank AllToAll of 64 MiB 0.90x the time, of 256 MiB 0.88x (a
//! rank's own block is half the data), 4-rank Broadcast of 16 MiB 0.96x
//! (the root's copy), 4-rank AllGather of 16 MiB 0.94x; 2-rank AllToAll of
//! 8 and 16 MiB 0.97-1.02x (noise): about where streaming stops costing.
//!
//! Smaller staged copies land where a peer has just read, and there time
//! decides between the two (`copy_staged`).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A call whose output has at least this many bytes streams its local
/// copies: its buffers are larger than the caches can keep for it.
const STREAM_FROM: usize = 16 << 20;

/// Staged copies of at least this many bytes choose between a plain and a
/// streamed copy by measuring both (`copy_staged`); smaller ones are plain.
const TIMED_FROM: usize = 32 << 10;
/// One staged copy in this many takes the method that measured slower, so
/// that its figure follows the machine.
const RETRY_EVERY: u32 = 64;
/// What a timed staged copy cost, in ns per KiB, by method (plain,
/// streamed); 0 until measured. For the whole process: it is the machine
/// that changes, not the call.
static STAGED_COST: [AtomicU32; 2] = [AtomicU32::new(0), AtomicU32::new(0)];
static STAGED_COPIES: AtomicU32 = AtomicU32::new(0);

/// `dst = src`, a local copy of a call whose output has `call_bytes`:
/// streaming whole lines of `dst` past the caches from [`STREAM_FROM`] on,
/// else a plain copy. A streamed copy ends with a store fence, so a flag
/// published after it covers the copy as a plain copy's would.
pub(crate) fn copy(dst: &mut [u8], src: &[u8], call_bytes: usize) {
    // The streaming loop's bounds rest on this.
    assert_eq!(dst.len(), src.len(), "a copy between spans of one length");
    if call_bytes < STREAM_FROM {
        return dst.copy_from_slice(src);
    }
    #[cfg(target_arch = "x86_64")]
    stream(dst, src);
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// `dst = src` for a staged receive: the staging slot into the output,
/// where the peer has often just read the lines being overwritten (an
/// in-place AllToAll's block goes out, then the peer's block lands on it).
/// A plain store to a line in another core's cache waits for that line;
/// a streaming store only has it dropped. Which is faster depends on how
/// slowly lines move between the cores, which on the AMD VM changes from
/// one minute to the next (~100 or ~500 ns a round trip): 2-rank in-place
/// AllToAll of 4 MiB, plain 150 us or 800, streamed 260-330 either way;
/// of 256 KiB plain 48-96 us, streamed 27-31. So both are timed, and the
/// faster goes on, the other retried now and then. Streaming must win by
/// 3x: it leaves the block in memory, not in our cache, where the peer's
/// next read finds it (its copy measured 0.7-0.85x of a plain one's time
/// in the fast minutes, yet calls took 1.3x). Not with a core shared with
/// other work: a copy's time then measures the scheduler, and streamed
/// calls took 1.05-2.1x the time of plain ones (4-rank, 1 MiB).
pub(crate) fn copy_staged(dst: &mut [u8], src: &[u8], call_bytes: usize) {
    let timed = call_bytes < STREAM_FROM && dst.len() >= TIMED_FROM && !transport::core_shared();
    if !timed || cfg!(not(target_arch = "x86_64")) {
        return copy(dst, src, call_bytes);
    }
    let streams = streams_next();
    let start = Instant::now();
    match streams {
        #[cfg(target_arch = "x86_64")]
        true => stream(dst, src),
        _ => dst.copy_from_slice(src),
    }
    record(streams, dst.len(), start.elapsed());
}

/// Whether the next timed staged copy streams: the first is plain, the
/// second streams, then the one that costs less, 1 in `RETRY_EVERY` the other.
fn streams_next() -> bool {
    let [plain, streamed] = STAGED_COST.each_ref().map(|c| c.load(Ordering::Relaxed));
    let retry = STAGED_COPIES.fetch_add(1, Ordering::Relaxed) % RETRY_EVERY == 0;
    match (plain, streamed) {
        (0, _) => false,
        (_, 0) => true,
        _ => (3 * streamed < plain) != retry,
    }
}

/// Takes a timed copy's `len` bytes in `took` into its way's cost: halfway
/// to it, and at most double (a preempted copy).
fn record(streams: bool, len: usize, took: Duration) {
    let sample = (took.as_nanos() * 1024 / len as u128).clamp(1, 1 << 30) as u32;
    let cost = &STAGED_COST[usize::from(streams)];
    let old = cost.load(Ordering::Relaxed);
    let new = match old {
        0 => sample,
        _ => (old + sample.min(2 * old)) / 2,
    };
    cost.store(new, Ordering::Relaxed);
}

#[cfg(target_arch = "x86_64")]
fn stream(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    const LINE: usize = 64;
    // Plain copies up to the first whole line of `dst` and after the last.
    let head = dst.as_ptr().align_offset(LINE).min(dst.len());
    let lines = (dst.len() - head) / LINE;
    let tail = head + lines * LINE;
    dst[..head].copy_from_slice(&src[..head]);
    dst[tail..].copy_from_slice(&src[tail..]);
    let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
    for at in (0..lines * LINE).step_by(16) {
        // SAFETY: `at + 16 <= lines * LINE`, within both slices past `head`
        // (they have one length, asserted by `copy`); `d + at` is 16-byte
        // aligned (`head` aligns `d` to a line); SSE2 is part of x86_64;
        // the load is unaligned.
        unsafe {
            let v = _mm_loadu_si128(s.add(at).cast::<__m128i>());
            _mm_stream_si128(d.add(at).cast::<__m128i>(), v);
        }
    }
    // SAFETY: SSE is part of x86_64. Streaming stores are weakly ordered:
    // the fence puts them before whatever the caller stores next.
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use super::{copy, copy_staged, RETRY_EVERY, STREAM_FROM, TIMED_FROM};

    #[test]
    fn copies_every_byte_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        for at in [0, 1, 15, 16, 63, 64, 65] {
            for len in [0, 1, 17, 63, 64, 65, 128, 1000, 4096 - 65] {
                let mut dst = vec![0u8; 4096];
                copy(
                    &mut dst[at..at + len],
                    &src[65 - at % 65..][..len],
                    STREAM_FROM,
                );
                assert_eq!(
                    dst[at..at + len],
                    src[65 - at % 65..][..len],
                    "at {at} len {len}"
                );
                assert!(dst[..at].iter().chain(&dst[at + len..]).all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn staged_copies_are_whole_whichever_way_they_go() {
        // Either way is taken at least twice in 2 x RETRY_EVERY copies.
        let len = TIMED_FROM + 13;
        let src: Vec<u8> = (0..len + 64).map(|i| (i * 5 + 1) as u8).collect();
        for k in 0..2 * RETRY_EVERY as usize {
            let at = k % 64;
            let mut dst = vec![0u8; len + 64];
            copy_staged(&mut dst[at..at + len], &src[..len], 1 << 20);
            assert_eq!(dst[at..at + len], src[..len], "copy {k}");
            assert!(dst[..at].iter().chain(&dst[at + len..]).all(|&b| b == 0));
        }
    }
}
