//! Aborting a communicator from any thread, as `ncclCommAbort` does: a flag
//! the executor checks on every step, the reason, and an eventfd that wakes
//! an executor sleeping in `poll` at once.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::sys::doorbell::Doorbell;

/// Fires an abort of the communicator it came from
/// ([`Communicator::abort_handle`](crate::Communicator::abort_handle)).
/// Cloneable and usable from any thread: a call blocked on the communicator
/// returns [`Error::Aborted`](crate::Error::Aborted) within one wake-up, the
/// connections are closed with the reason, and every peer then fails with
/// "peer rank R aborted: REASON" instead of waiting for its timeout.
#[derive(Clone, Debug)]
pub struct AbortHandle {
    flag: Arc<AbortFlag>,
}

impl AbortHandle {
    /// Aborts with `reason` (the first reason given is kept).
    pub fn abort(&self, reason: &str) {
        self.flag.fire(reason);
    }

    /// Whether the communicator was aborted.
    pub fn is_aborted(&self) -> bool {
        self.flag.reason().is_some()
    }
}

/// The shared state behind [`AbortHandle`].
#[derive(Debug)]
pub(crate) struct AbortFlag {
    set: AtomicBool,
    reason: Mutex<Option<String>>,
    wake: Doorbell,
}

impl AbortFlag {
    pub fn new() -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(AbortFlag {
            set: AtomicBool::new(false),
            reason: Mutex::new(None),
            wake: Doorbell::new()?,
        }))
    }

    pub fn handle(self: &Arc<Self>) -> AbortHandle {
        AbortHandle { flag: self.clone() }
    }

    pub fn fire(&self, reason: &str) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(reason.to_string());
        }
        self.set.store(true, Ordering::Release);
        // The doorbell stays readable from now on: a sleeping poll returns.
        self.wake.ring();
    }

    /// Whether it fired: one atomic load (every call asks).
    #[inline]
    pub fn fired(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// The reason, once fired. One atomic load while it is not (inlined:
    /// every call asks).
    #[inline]
    pub fn reason(&self) -> Option<String> {
        match self.fired() {
            true => self.fired_reason(),
            false => None,
        }
    }

    #[cold]
    fn fired_reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Readable once fired: the poller sleeps on it beside the connections.
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.fd()
    }
}
