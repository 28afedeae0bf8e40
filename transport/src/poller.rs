//! Waiting for progress on several connections at once, with a deadline.

use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use crate::{Connection, Error, Result, Wake};

/// Decides what an idle progress loop does: spin for a while (a peer's
/// reply is often microseconds away, and over shared memory a spin round is
/// a few loads), then sleep in `poll(2)` on every connection's wake-up
/// descriptor, so oversubscribed ranks (8 on 2 cores) give their core to the
/// rank that has work instead of burning it.
#[derive(Debug)]
pub struct Poller {
    spin: Duration,
    idle_since: Option<Instant>,
}

impl Default for Poller {
    fn default() -> Self {
        Self::new(Self::DEFAULT_SPIN)
    }
}

impl Poller {
    /// How long an idle loop spins before it sleeps.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);

    pub fn new(spin: Duration) -> Self {
        Poller {
            spin,
            idle_since: None,
        }
    }

    /// Call after a round in which something moved.
    pub fn busy(&mut self) {
        self.idle_since = None;
    }

    /// Call after a round in which nothing moved. Returns `Ok(false)` once
    /// `deadline` has passed, `Ok(true)` otherwise (after spinning or waking up).
    pub fn idle<'a>(
        &mut self,
        conns: impl Iterator<Item = &'a mut Box<dyn Connection>>,
        deadline: Instant,
    ) -> Result<bool> {
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        let since = *self.idle_since.get_or_insert(now);
        if now - since < self.spin {
            std::hint::spin_loop();
            return Ok(true);
        }
        sleep_until_ready(conns, deadline - now)?;
        Ok(Instant::now() < deadline)
    }
}

/// Blocks until one connection's descriptor is ready or `timeout` passes;
/// returns at once if a connection can progress already.
fn sleep_until_ready<'a>(
    conns: impl Iterator<Item = &'a mut Box<dyn Connection>>,
    timeout: Duration,
) -> Result<()> {
    let mut fds: Vec<PollFd<'_>> = Vec::new();
    for conn in conns {
        match conn.wake_source() {
            Wake::Idle => {}
            Wake::Now => return Ok(()),
            Wake::On(fd, want) => {
                let mut flags = PollFlags::empty();
                flags.set(PollFlags::IN, want.readable);
                flags.set(PollFlags::OUT, want.writable);
                fds.push(PollFd::from_borrowed_fd(fd, flags));
            }
        }
    }
    if fds.is_empty() {
        // Nothing to wake us: the caller waits on itself. Sleep briefly instead
        // of spinning; its deadline still bounds the wait.
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
        return Ok(());
    }
    let ts = Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    match poll(&mut fds, Some(&ts)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(Error::io(None, "poll", &e.into())),
    }
}
