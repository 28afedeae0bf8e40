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
//! Which way is cheaper depends on the CPU (on an Intel Xeon VM plain
//! copies won some large calls), so large calls time both ways too
//! (`LARGE`).
//!
//! Smaller staged copies often land on lines a peer has just read: an
//! in-place AllToAll's staged block lands on the block its peer read from
//! it. A plain store to such a line waits for the peer's core to give it
//! up; a streaming store only has the peer's copy dropped. On the AMD VM 1
//! MiB copied over lines the other core just read takes `memcpy` 130 or
//! 550 us as the minute goes, streaming 47-50 either way
//! (`ci/copyover.c`). But a streamed block goes to memory, not into our
//! cache, where the peer's next read would have found it: in the fast
//! minutes always-streamed calls took 1.3x the time. So staged copies time
//! both ways, for the process (it is the machine that changes, not the
//! call), and stream while that costs under a third of plain
//! ([`transport::TwoWays`]). Not with a core shared with other work: the
//! time then measures the scheduler, and streamed calls took 1.05-2.1x the
//! time of plain ones beside a busy loop (4-rank in-place AllToAll of 1
//! MiB).
//!
//! Reductions land on lines a peer read too (an AllReduce's result block,
//! read in the last call's all-gather), but streaming them through a block
//! on the stack did not pay: its stores cost 5x plain ones in the fast
//! minutes and 0.55x in the slow ones, and chosen this way (streaming when
//! 1.5x cheaper) 2-rank in-place AllReduces of 1 MiB took 0.57-0.73x the
//! time in the slow minutes and 1.04x overall.

use std::time::Instant;

use transport::TwoWays;

/// A call whose output has at least this many bytes streams its local
/// copies (unless plain ones measure cheaper): its buffers are larger than
/// the caches can keep for it.
const STREAM_FROM: usize = 16 << 20;

/// `dst = src`, a local copy of a call whose output has `call_bytes`: a
/// plain copy below [`STREAM_FROM`]; from there streamed, unless plain
/// copies measure cheaper (`LARGE`). A streamed copy ends with a store
/// fence, so a flag published after it covers the copy as a plain copy's
/// would.
pub(crate) fn copy(dst: &mut [u8], src: &[u8], call_bytes: usize) {
    match call_bytes < STREAM_FROM {
        true => dst.copy_from_slice(src),
        false => timed(&LARGE, dst, src),
    }
}

/// `dst = src` for a staged receive, which often lands where its peer has
/// just read: plain or streamed as `STAGED` measures (see the module docs);
/// 2-rank in-place AllToAll of 4 MiB, plain 150 us a call or 800, streamed
/// 260-330 either way, of 256 KiB plain 48-96 us, streamed 27-31. In calls
/// from [`STREAM_FROM`] on, streamed unless plain measures cheaper
/// (`LARGE_STAGED`).
pub(crate) fn copy_staged(dst: &mut [u8], src: &[u8], call_bytes: usize) {
    match call_bytes < STREAM_FROM {
        true => timed(&STAGED, dst, src),
        false => timed(&LARGE_STAGED, dst, src),
    }
}

/// A choice between plain and streamed copies, made by timing both.
struct Choice {
    /// The figures; the "other" way is the one `usual_streams` is not.
    ways: TwoWays,
    /// Whether the usual way streams.
    usual_streams: bool,
}

/// `dst = src` the way `choice` measures cheaper, timing it. Copies too
/// short to time go the usual way, and so does every copy on a core shared
/// with other work, whose time measures the scheduler.
fn timed(choice: &Choice, dst: &mut [u8], src: &[u8]) {
    let timed = dst.len() >= TIMED_FROM && cfg!(target_arch = "x86_64");
    if !timed || transport::core_shared() {
        return copy_way(choice.usual_streams, dst, src);
    }
    let other = choice.ways.other_next();
    let start = Instant::now();
    copy_way(choice.usual_streams != other, dst, src);
    (choice.ways).note(other, dst.len(), start.elapsed().as_nanos() as u64);
}

fn copy_way(streams: bool, dst: &mut [u8], src: &[u8]) {
    match streams {
        true => stream(dst, src),
        false => dst.copy_from_slice(src),
    }
}

/// Copies shorter than this go the usual way: too short to time.
const TIMED_FROM: usize = 32 << 10;

/// Staged copies: plain the usual way, streamed when that costs under a
/// third; one copy in 64 goes the way that measured slower.
static STAGED: Choice = Choice {
    ways: TwoWays::new(3, 64),
    usual_streams: false,
};

/// Large calls' copies (from [`STREAM_FROM`]), local and staged apart:
/// they find their lines in different places. Streamed the usual way, as
/// the AMD VM measured (module docs); plain the other, which wins by any
/// margin: on an Intel Xeon VM a 4-rank in-place AllToAll of 16 MiB took
/// 0.74x the time with plain staged copies, whose block its peers then
/// read from a cache, not from memory. Its out-of-place form times its
/// own block's copy plain there too (about 51 against 120-340 ns a KiB)
/// and took 1.00x; with every copy plain, untimed, 1.06x (unexplained).
static LARGE: Choice = Choice {
    ways: TwoWays::new(1, 64),
    usual_streams: true,
};
static LARGE_STAGED: Choice = Choice {
    ways: TwoWays::new(1, 64),
    usual_streams: true,
};

/// `dst = src` with streaming stores where the target has them, else plain.
pub(crate) fn stream(dst: &mut [u8], src: &[u8]) {
    // The streaming loop's bounds rest on this.
    assert_eq!(dst.len(), src.len(), "a copy between spans of one length");
    #[cfg(target_arch = "x86_64")]
    stream_lines(dst, src);
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
fn stream_lines(dst: &mut [u8], src: &[u8]) {
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
        // (they have one length, asserted by `stream`); `d + at` is 16-byte
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
    use super::{copy, copy_staged, STREAM_FROM};

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
    fn timed_copies_are_whole_whichever_way_they_go() {
        // Either way is taken at least twice in 128 copies (each choice
        // retries the other way one copy in 64).
        let len = (32 << 10) + 13;
        let src: Vec<u8> = (0..len + 64).map(|i| (i * 5 + 1) as u8).collect();
        type CopyFn = fn(&mut [u8], &[u8], usize);
        let ways: [(CopyFn, usize); 3] = [
            (copy_staged, 1 << 20),
            (copy_staged, STREAM_FROM),
            (copy, STREAM_FROM),
        ];
        for (way, call_bytes) in ways {
            for k in 0..128 {
                let at = k % 64;
                let mut dst = vec![0u8; len + 64];
                way(&mut dst[at..at + len], &src[..len], call_bytes);
                assert_eq!(dst[at..at + len], src[..len], "copy {k} of {call_bytes}");
                assert!(dst[..at].iter().chain(&dst[at + len..]).all(|&b| b == 0));
            }
        }
    }
}
