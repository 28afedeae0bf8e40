//! A wake-up a thread sleeping in `poll` answers: an eventfd that any
//! thread rings. The executor sleeps on it beside its connections, so an
//! abort or a newly started call wakes it at once.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::{eventfd, EventfdFlags};

#[derive(Debug)]
pub(crate) struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    pub fn new() -> std::io::Result<Self> {
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Doorbell { fd })
    }

    /// Makes the descriptor readable until [`drain`](Self::drain).
    pub fn ring(&self) {
        // Only fails when the counter would overflow: it is readable then.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Makes the descriptor unreadable again (until the next ring).
    pub fn drain(&self) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut b);
    }

    /// Sleeps until rung (or `timeout`).
    pub fn wait(&self, timeout: std::time::Duration) {
        let mut fds = [rustix::event::PollFd::new(
            &self.fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: timeout.subsec_nanos() as i64,
        };
        // An interrupted or failed poll only ends the sleep early.
        let _ = rustix::event::poll(&mut fds, Some(&ts));
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
