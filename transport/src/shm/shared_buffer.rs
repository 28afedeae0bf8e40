//! Buffers that peers on the same host can map, as NCCL's `ncclMemAlloc`
//! memory. A [`SharedBuffer`] lives in a memfd. A peer reading a large
//! message from one maps the memfd once (through `/proc/PID/fd/N`, which
//! the kernel allows on the same terms as `process_vm_readv`) and then
//! copies with `memcpy`. `process_vm_readv` pins the pages of every piece
//! and copies in the kernel, without vector instructions: two threads
//! modelling a 2-rank AllReduce (`ci/allreduce_floor.c`) take 1214 us for
//! 16 MiB with `memcpy` from the peer's memory, 1415 with single-copy
//! reads; 122 against 141 us for 1 MiB.
//!
//! Every buffer is listed in a process-wide registry. Registering memory
//! with the transport (`ShmTransport::register`, once per call buffer)
//! looks it up, so that its sends tell the receiver where their bytes lie
//! in which memfd.

use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::RwLock;

use rustix::mm::{MapFlags, ProtFlags};

/// Zeroed memory that peers on the host can map (see the module's doc).
pub struct SharedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// Held open while the buffer lives: peers open it by its number.
    fd: Option<OwnedFd>,
}

// SAFETY: the buffer owns its mapping; `&`/`&mut` access follows Rust's
// rules like a `Vec<u8>`'s.
unsafe impl Send for SharedBuffer {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for SharedBuffer {}

/// Where a registered buffer lies: our address range and the memfd behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    pub start: usize,
    pub len: usize,
    /// The memfd's descriptor number in our process.
    pub fd: i32,
    /// The memfd's inode: a peer checks it after opening the number, which
    /// could name another file by then.
    pub ino: u64,
}

static REGIONS: RwLock<Vec<Region>> = RwLock::new(Vec::new());

impl SharedBuffer {
    /// A zeroed buffer of `len` bytes, advised into transparent huge pages
    /// (which shared memory gets only where the administrator set
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` to `advise`).
    pub fn new(len: usize) -> std::io::Result<Self> {
        if len == 0 {
            return Ok(SharedBuffer {
                ptr: NonNull::dangling(),
                len,
                fd: None,
            });
        }
        let fd = super::sealed_memfd("coll-buffer", len)?;
        let ino = rustix::fs::fstat(&fd)?.st_ino;
        // SAFETY: a fresh shared mapping of a file we just sized; nothing
        // else in this process aliases it.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )?
        };
        // SAFETY: the range is the mapping just made; advice changes only
        // how the kernel backs it. Refused advice leaves 4 KiB pages.
        let _ = unsafe { rustix::mm::madvise(ptr, len, rustix::mm::Advice::LinuxHugepage) };
        let region = Region {
            start: ptr as usize,
            len,
            fd: fd.as_raw_fd(),
            ino,
        };
        lock_regions().push(region);
        Ok(SharedBuffer {
            ptr: NonNull::new(ptr.cast()).expect("mmap returned null"),
            len,
            fd: Some(fd),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is our mapping (or empty), initialised
        // (zero-filled by the kernel).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        if self.fd.is_none() {
            return;
        }
        let start = self.ptr.as_ptr() as usize;
        lock_regions().retain(|r| r.start != start);
        // SAFETY: our mapping, unlisted above, so no send looks it up; no
        // borrow of it outlives `self`. A peer's own mapping of the memfd
        // stays valid: the pages live until its last mapping goes.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn lock_regions() -> std::sync::RwLockWriteGuard<'static, Vec<Region>> {
    REGIONS.write().unwrap_or_else(|e| e.into_inner())
}

/// The registered buffer holding all of `addr..addr + len`, if any.
pub(crate) fn region_of(addr: usize, len: usize) -> Option<Region> {
    let regions = REGIONS.read().unwrap_or_else(|e| e.into_inner());
    (regions.iter())
        .find(|r| r.start <= addr && addr + len <= r.start + r.len)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_registered_while_they_live() {
        let mut b = SharedBuffer::new(3 << 20).unwrap();
        assert!(b.bytes().iter().all(|x| *x == 0));
        b.bytes_mut()[5] = 7;
        let start = b.as_ptr() as usize;
        let r = region_of(start + 4096, 100).expect("registered");
        assert_eq!((r.start, r.len), (start, 3 << 20));
        assert!(
            region_of(start + (3 << 20) - 10, 11).is_none(),
            "past the end"
        );
        drop(b);
        assert!(region_of(start + 4096, 100).is_none());
        let empty = SharedBuffer::new(0).unwrap();
        assert!(empty.is_empty() && empty.bytes().is_empty());
    }
}
