//! Buffers on transparent huge pages, for memory a peer copies into or out
//! of with single-copy system calls (`process_vm_readv`/`writev`).

/// A zeroed buffer of at least the bytes asked for. One of a huge page or
/// more starts on a huge-page boundary and is advised, whole, into
/// transparent huge pages where the kernel allows (`madvise` mode). A
/// peer's single-copy read or write walks and pins the pages it touches:
/// 4 KiB ones one by one. Aligned, because where `malloc`'s mapping happens
/// to start decides otherwise how much of the first megabytes is left on
/// 4 KiB pages: up to 2 MiB, from run to run (4-rank AllGather of 1 MiB out
/// of place, whose peers read each rank's input at offset 0: 58-141 us a
/// call over runs, 55-64 aligned; 2-rank Reduce of 4-16 MiB in place, whose
/// sender writes into the root's staging slots: 1.3-1.8x slower than the
/// root reading them itself on 4 KiB pages, 0.71x on huge ones). First
/// touch of 4 KiB pages also runs at only about 2 GB/s here.
/// `ci/mpibench.c` allocates Open MPI's buffers the same way.
pub struct HugeBuffer {
    raw: Vec<u64>,
    /// Bytes from the start of `raw` to the buffer's.
    skip: usize,
}

impl HugeBuffer {
    const HUGE_PAGE: usize = 2 << 20;

    pub fn new(bytes: usize) -> Self {
        if bytes < Self::HUGE_PAGE {
            return HugeBuffer {
                raw: vec![0u64; bytes.div_ceil(8)],
                skip: 0,
            };
        }
        let len = bytes.next_multiple_of(Self::HUGE_PAGE);
        let raw = vec![0u64; (len + Self::HUGE_PAGE) / 8];
        let start = raw.as_ptr() as usize;
        let skip = start.next_multiple_of(Self::HUGE_PAGE) - start;
        // SAFETY: [start + skip, start + skip + len) lies inside `raw`'s
        // allocation; MADV_HUGEPAGE only changes how the kernel backs it,
        // not its contents.
        let _ = unsafe {
            rustix::mm::madvise(
                (start + skip) as *mut _,
                len,
                rustix::mm::Advice::LinuxHugepage,
            )
        };
        HugeBuffer { raw, skip }
    }

    /// The buffer, 8-byte aligned (at least the bytes asked for).
    #[inline]
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.raw)[self.skip..]
    }

    #[inline]
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.raw)[self.skip..]
    }
}

#[cfg(test)]
mod tests {
    use super::HugeBuffer;

    #[test]
    fn large_buffers_start_on_a_huge_page() {
        for bytes in [0, 1, 4097, HugeBuffer::HUGE_PAGE, 3 << 20] {
            let b = HugeBuffer::new(bytes);
            assert!(b.bytes().len() >= bytes);
            assert_eq!(b.bytes().as_ptr() as usize % 8, 0);
            if bytes >= HugeBuffer::HUGE_PAGE {
                assert_eq!(b.bytes().as_ptr() as usize % HugeBuffer::HUGE_PAGE, 0);
            }
        }
    }
}
