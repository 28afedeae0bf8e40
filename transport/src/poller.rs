//! Waiting for progress on several connections at once, with a deadline.

use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use crate::{Connection, Error, Result};

/// Decides what an idle progress loop does: spin a little (a peer's reply is
/// often microseconds away), then sleep in `poll(2)` on every connection's
/// wake-up descriptor, so oversubscribed ranks (8 on 2 cores) give their core
/// to the rank that has work instead of burning it.
#[derive(Debug)]
pub struct Poller {
    spin_rounds: u32,
    idle_rounds: u32,
}

impl Default for Poller {
    fn default() -> Self {
        Self::new(Self::DEFAULT_SPIN_ROUNDS)
    }
}

impl Poller {
    /// Idle rounds before sleeping: about 10 us of non-blocking retries.
    pub const DEFAULT_SPIN_ROUNDS: u32 = 16;

    pub fn new(spin_rounds: u32) -> Self {
        Poller {
            spin_rounds,
            idle_rounds: 0,
        }
    }

    /// Call after a round in which something moved.
    pub fn busy(&mut self) {
        self.idle_rounds = 0;
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
        self.idle_rounds += 1;
        if self.idle_rounds <= self.spin_rounds {
            std::hint::spin_loop();
            return Ok(true);
        }
        sleep_until_ready(conns, deadline - now)?;
        Ok(Instant::now() < deadline)
    }
}

/// Blocks until one connection's descriptor is ready or `timeout` passes.
fn sleep_until_ready<'a>(
    conns: impl Iterator<Item = &'a mut Box<dyn Connection>>,
    timeout: Duration,
) -> Result<()> {
    let mut fds: Vec<PollFd<'_>> = conns
        .filter_map(|c| c.wake_source())
        .map(|(fd, want)| {
            let mut flags = PollFlags::empty();
            flags.set(PollFlags::IN, want.readable);
            flags.set(PollFlags::OUT, want.writable);
            PollFd::from_borrowed_fd(fd, flags)
        })
        .collect();
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
