//! Memory windows: a peer writes into a receive's bytes only while that
//! receive is posted. Registrations allow no remote access of their own
//! (`MW_BIND` only); each receive's grant carries the key of a type 1
//! window bound over exactly its bytes, and the window is unbound when the
//! receive completes, which kills the key. Without them a grant's key was
//! the registration's: kept valid by the registration cache after the
//! receive, over the whole registered buffer.
//!
//! Binds and unbinds go on a queue pair of their own per connection (the
//! connection's binder), never among the data's sends: a grant goes once
//! its window's bind has completed, so the peer cannot know a key before
//! it works; a window serves another receive, and its registration is let
//! go, once its unbind has completed. sideway has no window API; its raw
//! pd, mr and qp pointers go to libibverbs.
//!
//! (Soft-RoCE's rxe, at least in Linux 6.1, kills a window's key on
//! unbinding but checks a write's range against the registration, not the
//! window: `ci/mwprobe.c`. Real adapters check both.)

use std::ptr::NonNull;

use rdma_mummy_sys::{ibv_access_flags, ibv_mw, ibv_mw_bind, ibv_mw_bind_info, ibv_mw_type};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{BasicQueuePair, QueuePair};

/// A type 1 memory window of a protection domain.
pub(super) struct Window {
    mw: NonNull<ibv_mw>,
}

// SAFETY: a window is a handle the verbs library lets any thread use; the
// connection that owns it uses it from one thread at a time.
unsafe impl Send for Window {}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc`, deallocated once; a bound window may
        // be deallocated (that unbinds it).
        unsafe { rdma_mummy_sys::ibv_dealloc_mw(self.mw.as_ptr()) };
    }
}

impl Window {
    /// Whether `device` (`pd`'s) has memory windows: one allocated and
    /// dropped. Without, a warning says what a peer can then do.
    pub(super) fn supported(pd: &ProtectionDomain, device: &str) -> bool {
        let has = Self::alloc(pd).is_ok();
        if !has {
            tracing::warn!(
                device,
                "no memory windows on this device: a peer holding a grant's key can write into that registered buffer of ours between receives"
            );
        }
        has
    }

    /// A new window of `pd`.
    pub(super) fn alloc(pd: &ProtectionDomain) -> std::io::Result<Self> {
        // SAFETY: `pd` is a live protection domain.
        let mw =
            unsafe { rdma_mummy_sys::ibv_alloc_mw(pd.pd().as_ptr(), ibv_mw_type::IBV_MW_TYPE_1) };
        NonNull::new(mw)
            .map(|mw| Window { mw })
            .ok_or_else(std::io::Error::last_os_error)
    }

    /// Posts, on `qp`'s send queue, a signaled bind of the window over
    /// `len` bytes at `addr` of `mr` with remote write (`len` 0: an
    /// unbind), as `wr_id`. Its key is then `rkey()`.
    ///
    /// # Safety
    /// `addr..addr + len` lies in `mr`, which outlives the binding (the
    /// receive's contract keeps its buffer registered until it completes).
    pub(super) unsafe fn bind(
        &mut self,
        qp: &BasicQueuePair,
        mr: &MemoryRegion,
        addr: u64,
        len: u64,
        wr_id: u64,
    ) -> std::io::Result<()> {
        let access = match len {
            0 => ibv_access_flags(0),
            _ => ibv_access_flags::IBV_ACCESS_REMOTE_WRITE,
        };
        let mut bind = ibv_mw_bind {
            wr_id,
            send_flags: rdma_mummy_sys::ibv_send_flags::IBV_SEND_SIGNALED.0,
            bind_info: ibv_mw_bind_info {
                // SAFETY: the registration's own handle, live while `mr` is.
                mr: unsafe { mr.mr().as_ptr() },
                addr,
                length: len,
                mw_access_flags: access.0,
            },
        };
        // SAFETY: the queue pair, window and registration are live; the
        // library copies `bind` into a work request before returning.
        let r =
            unsafe { rdma_mummy_sys::ibv_bind_mw(qp.qp().as_ptr(), self.mw.as_ptr(), &mut bind) };
        match r {
            0 => Ok(()),
            e => Err(std::io::Error::from_raw_os_error(e)),
        }
    }

    /// The key of the window's current binding.
    pub(super) fn rkey(&self) -> u32 {
        // SAFETY: a live window; `ibv_bind_mw` sets the key as it posts.
        unsafe { self.mw.as_ref().rkey }
    }
}
