//! Memory files shared with peers, sealed: once sized, neither side can
//! shrink or grow them, so a peer cannot make a rank's mapping of its file
//! fault (SIGBUS past a truncated end) or change what it maps. A file from
//! a peer is mapped only after its seals and size are checked.

use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::SealFlags;
use rustix::fs::{fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, memfd_create, MemfdFlags};

/// The seals every shared file carries.
const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// A new memory file of `len` bytes, sealed at that size.
pub fn sealed_memfd(name: &str, len: usize) -> std::io::Result<OwnedFd> {
    let fd = memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    ftruncate(&fd, len as u64)?;
    fcntl_add_seals(&fd, SEALS)?;
    Ok(fd)
}

/// The size of a peer's memory file, once it is known to be sealed against
/// shrinking and growing and at least `at_least` bytes long.
pub fn check_sealed(fd: impl AsFd, at_least: usize) -> std::io::Result<usize> {
    let seals = fcntl_get_seals(&fd)?;
    if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the peer's shared memory is not sealed against resizing",
        ));
    }
    let size = usize::try_from(fstat(&fd)?.st_size).unwrap_or(0);
    if size < at_least {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the peer's shared memory is {size} bytes, below {at_least}"),
        ));
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_file_cannot_be_resized_and_an_unsealed_one_is_refused() {
        let fd = sealed_memfd("test", 4096).unwrap();
        assert!(ftruncate(&fd, 0).is_err(), "shrunk a sealed file");
        assert!(ftruncate(&fd, 8192).is_err(), "grew a sealed file");
        assert_eq!(check_sealed(&fd, 4096).unwrap(), 4096);
        assert!(check_sealed(&fd, 4097).is_err());
        let open = memfd_create("test", MemfdFlags::CLOEXEC).unwrap();
        ftruncate(&open, 4096).unwrap();
        assert!(check_sealed(&open, 1).is_err());
    }
}
