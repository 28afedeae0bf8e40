//! The reading side of [`SharedBuffer`](super::SharedBuffer)s: a peer's
//! memfds mapped into our address space, the last few used, so that a
//! large message from one is read with `memcpy` instead of
//! `process_vm_readv`.

use std::collections::VecDeque;
use std::ptr::NonNull;

use rustix::fs::{Mode, OFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::Rank;

/// Mappings kept per peer, at most: a training step's buffers are few.
/// Beyond, the least recently used goes (and is mapped again when used).
const KEEP: usize = 16;

pub(crate) struct PeerMaps {
    /// The peer's rank (for the log) and process.
    peer: Rank,
    pid: i32,
    /// Most recently used first.
    maps: VecDeque<Mapped>,
    /// Inodes that could not be mapped: read with `process_vm_readv`.
    refused: VecDeque<u64>,
}

struct Mapped {
    fd: i32,
    ino: u64,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mappings are read-only views owned by this value; moving it
// to another thread changes nothing.
unsafe impl Send for PeerMaps {}

impl PeerMaps {
    pub fn new(peer: Rank, pid: i32) -> Self {
        PeerMaps {
            peer,
            pid,
            maps: VecDeque::new(),
            refused: VecDeque::new(),
        }
    }

    /// Our address of `len` bytes at `offset` in the peer's memfd numbered
    /// `fd` (inode `ino`), mapped on first use; `None` where it cannot be
    /// mapped or the range does not fit it.
    pub fn locate(&mut self, fd: i32, ino: u64, offset: usize, len: usize) -> Option<*const u8> {
        match self.maps.iter().position(|m| m.ino == ino) {
            Some(0) => {}
            Some(at) => {
                let m = self.maps.remove(at).expect("found above");
                self.maps.push_front(m);
            }
            None if self.refused.contains(&ino) => return None,
            None => match map_peer(self.pid, fd, ino) {
                Ok(m) => {
                    self.forget_freed();
                    self.maps.push_front(m);
                    self.maps.truncate(KEEP);
                }
                Err(e) => {
                    tracing::debug!(
                        peer = self.peer,
                        fd,
                        "cannot map the peer's buffer, reading it with process_vm_readv: {e}"
                    );
                    self.refused.push_front(ino);
                    self.refused.truncate(KEEP);
                    return None;
                }
            },
        }
        let m = &self.maps[0];
        let fits = offset.checked_add(len).is_some_and(|end| end <= m.len);
        // SAFETY: offset < m.len when it fits: inside the mapping.
        fits.then(|| unsafe { m.ptr.as_ptr().add(offset) }.cast_const())
    }

    /// Unmaps the buffers the peer freed (their descriptor is closed or
    /// names another file now): our mapping would keep their memory alive.
    /// Asked as a new buffer is mapped: a freed one stays mapped until then
    /// (or until the connection closes).
    fn forget_freed(&mut self) {
        let pid = self.pid;
        (self.maps).retain(|m| {
            rustix::fs::stat(format!("/proc/{pid}/fd/{}", m.fd)).is_ok_and(|s| s.st_ino == m.ino)
        });
    }
}

/// Maps the peer's memfd `fd` read-only, if it is still the file `ino`.
fn map_peer(pid: i32, fd: i32, ino: u64) -> std::io::Result<Mapped> {
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    let stat = rustix::fs::fstat(&file)?;
    if stat.st_ino != ino || stat.st_size <= 0 {
        return Err(std::io::Error::other(
            "the descriptor names another file now",
        ));
    }
    let len = super::check_sealed(&file, 1)?;
    // SAFETY: a fresh read-only shared mapping of a file we hold; we only
    // read it, at offsets checked against `len`. It is sealed: its owner
    // cannot shrink it under us.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ,
            MapFlags::SHARED,
            &file,
            0,
        )?
    };
    Ok(Mapped {
        fd,
        ino,
        ptr: NonNull::new(ptr.cast()).expect("mmap returned null"),
        len,
    })
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: our mapping; no pointer into it outlives the read that
        // took it (`locate`'s result is used before the next call).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, OwnedFd};

    use proptest::prelude::*;
    use rustix::fs::{fstat, ftruncate, memfd_create, MemfdFlags};

    use super::*;

    const LEN: usize = 4096;

    /// A memfd of `LEN` bytes, each its offset mod 251, sealed or not; its
    /// descriptor number and inode, as a peer would describe it.
    fn buffer(sealed: bool) -> (OwnedFd, i32, u64) {
        let fd = match sealed {
            true => crate::shm::sealed_memfd("test", LEN).unwrap(),
            false => {
                let fd = memfd_create("test", MemfdFlags::CLOEXEC).unwrap();
                ftruncate(&fd, LEN as u64).unwrap();
                fd
            }
        };
        let bytes: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
        rustix::io::pwrite(&fd, &bytes, 0).unwrap();
        let ino = fstat(&fd).unwrap().st_ino;
        let raw = fd.as_raw_fd();
        (fd, raw, ino)
    }

    /// An unsealed file (its owner could shrink it under our mapping) and
    /// a descriptor that names another file are never mapped.
    #[test]
    fn only_a_sealed_file_that_is_the_one_described_is_mapped() {
        let mut maps = PeerMaps::new(1, std::process::id() as i32);
        let (_unsealed, fd, ino) = buffer(false);
        assert!(maps.locate(fd, ino, 0, 1).is_none());
        let (_sealed, fd, ino) = buffer(true);
        assert!(maps.locate(fd, ino + 1, 0, 1).is_none(), "another inode");
        assert!(maps.locate(fd, ino, 0, 1).is_some());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever offset and length a peer writes, a range is given only
        /// if it lies in the file, and then it holds the file's bytes.
        #[test]
        fn a_range_is_given_only_inside_the_file(offset in prop_oneof![0..LEN + 8, Just(usize::MAX), any::<usize>()],
                                                 len in prop_oneof![0..LEN + 8, Just(usize::MAX), any::<usize>()]) {
            let (_file, fd, ino) = buffer(true);
            let mut maps = PeerMaps::new(1, std::process::id() as i32);
            let inside = offset.checked_add(len).is_some_and(|end| end <= LEN);
            let got = maps.locate(fd, ino, offset, len);
            prop_assert_eq!(got.is_some(), inside);
            if let (Some(p), true) = (got, len > 0) {
                // SAFETY: `locate` said these `len` bytes lie in our mapping.
                let bytes = unsafe { std::slice::from_raw_parts(p, len) };
                prop_assert!(bytes.iter().enumerate().all(|(i, b)| *b == ((offset + i) % 251) as u8));
            }
        }
    }
}
