//! Registered memory and the cache in front of registration.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::{Result, Transport};

/// A byte range known to one or more transports. Cloning is cheap; each
/// transport's registration is released (for verbs: `ibv_dereg_mr`) when the
/// last clone holding its key is dropped. Transports that read and write any
/// memory (sockets, shared memory) register nothing: their regions are
/// plain and cost no allocation.
#[derive(Clone)]
pub struct MemRegion {
    addr: usize,
    len: usize,
    /// One key per transport that registered the range; `None` if none had to.
    keys: Option<Arc<[Key]>>,
    /// Whether a peer may write into receives posted here (see
    /// [`allow_peer_writes`](Self::allow_peer_writes)).
    peer_writes: bool,
    /// Whether sends from here may be read in place from a smaller size
    /// (see [`all_in_flight`](Self::all_in_flight)).
    all_in_flight: bool,
    /// Whether sends from here take up no offer to write (see
    /// [`declines_help`](Self::declines_help)).
    declines_help: bool,
    /// Whether receives here are worked on as they land (see
    /// [`used_as_landed`](Self::used_as_landed)).
    used_as_landed: bool,
}

type Key = Arc<dyn Any + Send + Sync>;

impl MemRegion {
    /// Wraps a transport's registration `key` for `len` bytes at `addr`.
    pub fn new(addr: *const u8, len: usize, key: Box<dyn Any + Send + Sync>) -> Self {
        Self::with_keys(addr, len, Some(Arc::from([Key::from(key)])))
    }

    /// A range that needs no registration.
    pub fn plain(addr: *const u8, len: usize) -> Self {
        Self::with_keys(addr, len, None)
    }

    /// A range with these keys and none of the flags below.
    fn with_keys(addr: *const u8, len: usize, keys: Option<Arc<[Key]>>) -> Self {
        MemRegion {
            addr: addr as usize,
            len,
            keys,
            peer_writes: false,
            all_in_flight: false,
            declines_help: false,
            used_as_landed: false,
        }
    }

    /// Lets a peer on the same host copy a message into a receive posted in
    /// this range itself, while this side is busy (see `shm::connection`),
    /// instead of leaving every copy to the receiver. The owner promises
    /// more than the receive contract: the range stays mapped until every
    /// connection that received into it is aborted or dropped, even after a
    /// failed call (the collectives' call buffers qualify: a failed call
    /// aborts its connections before it returns; so do their staging
    /// slots, which outlive the connections).
    pub fn allow_peer_writes(mut self) -> Self {
        self.peer_writes = true;
        self
    }

    /// Whether [`allow_peer_writes`](Self::allow_peer_writes) was given.
    pub fn peer_writes(&self) -> bool {
        self.peer_writes
    }

    /// Says that sends from this range go out all at once, to many peers
    /// (a pairwise AllToAll's blocks): a shared-memory receiver then reads
    /// them from our memory from a smaller size on, its copies overlapping
    /// each other's, where a message forwarded as it lands (a ring's)
    /// goes faster through the slots (see `shm::segment::EAGER_MAX`).
    pub fn all_in_flight(mut self) -> Self {
        self.all_in_flight = true;
        self
    }

    /// Says that the sender has copies of its own to make while its sends
    /// from this range are read (an out-of-place Broadcast's root copies
    /// its input to its output): it takes up no receiver's offer to write
    /// them itself (see [`allow_peer_writes`](Self::allow_peer_writes)),
    /// which would leave the receiver waiting on a sender with twice its work.
    pub fn declines_help(mut self) -> Self {
        self.declines_help = true;
        self
    }

    /// Says that the receiver works on a receive posted here as it lands
    /// (a reduction reduces each part while it is in cache; see
    /// `Connection::landed`): a shared-memory receiver then reads a
    /// message from the sender's memory a piece per progress. Read in
    /// pieces, a message that is only copied out took longer (2-rank
    /// AllToAll of 16 MiB in place: 1.06x the time).
    pub fn used_as_landed(mut self) -> Self {
        self.used_as_landed = true;
        self
    }

    /// Whether [`used_as_landed`](Self::used_as_landed) was given.
    pub fn is_used_as_landed(&self) -> bool {
        self.used_as_landed
    }

    /// Whether [`all_in_flight`](Self::all_in_flight) was given.
    pub fn is_all_in_flight(&self) -> bool {
        self.all_in_flight
    }

    /// Whether [`declines_help`](Self::declines_help) was given.
    pub fn is_declining_help(&self) -> bool {
        self.declines_help
    }

    pub fn addr(&self) -> *const u8 {
        self.addr as *const u8
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A transport's own registration data (an MR for verbs), found by type.
    /// Whether some transport registered (pinned) this memory.
    pub fn is_registered(&self) -> bool {
        self.keys.is_some()
    }

    pub fn key<T: 'static>(&self) -> Option<&T> {
        self.keys.as_deref()?.iter().find_map(|k| k.downcast_ref())
    }

    /// Whether `[addr, addr + len)` lies inside this region.
    pub fn contains(&self, addr: *const u8, len: usize) -> bool {
        let a = addr as usize;
        a >= self.addr && a + len <= self.addr + self.len
    }

    /// Pointer to `offset` after checking that `offset..offset + len` is inside.
    pub(crate) fn slice_ptr(&self, offset: usize, len: usize) -> Result<*mut u8> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok((self.addr + offset) as *mut u8),
            _ => Err(crate::Error::Invalid(format!(
                "range {offset}..{offset}+{len} is outside a registered region of {} bytes",
                self.len
            ))),
        }
    }
}

impl fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemRegion({:#x}+{})", self.addr, self.len)
    }
}

/// Registers the range with every transport, as one region. Allocates
/// nothing when no transport needs a registration.
pub fn register_all<'a>(
    transports: impl IntoIterator<Item = &'a dyn Transport>,
    addr: *const u8,
    len: usize,
) -> Result<MemRegion> {
    let mut keys: Vec<Key> = Vec::new();
    for t in transports {
        if let Some(k) = t.register(addr, len)?.keys {
            keys.extend(k.iter().cloned());
        }
    }
    Ok(MemRegion::with_keys(
        addr,
        len,
        (!keys.is_empty()).then(|| Arc::from(keys)),
    ))
}

/// Registrations kept for reuse, keyed by address range: a lookup hits when a
/// cached region contains the requested range, so registering a long-lived
/// buffer (staging slots, a user buffer registered once) costs nothing after
/// the first call. Entries live until [`evict`](Self::evict) or drop: callers
/// cache only memory whose lifetime they control.
#[derive(Default)]
pub struct RegistrationCache {
    regions: Vec<MemRegion>,
}

impl RegistrationCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// A cached region containing the range, if any.
    pub fn lookup(&self, addr: *const u8, len: usize) -> Option<MemRegion> {
        self.regions.iter().find(|r| r.contains(addr, len)).cloned()
    }

    /// The cached region containing the range, or a new registration with
    /// every transport, cached.
    pub fn get_or_register<'a>(
        &mut self,
        transports: impl IntoIterator<Item = &'a dyn Transport>,
        addr: *const u8,
        len: usize,
    ) -> Result<MemRegion> {
        if let Some(r) = self.lookup(addr, len) {
            return Ok(r);
        }
        let r = register_all(transports, addr, len)?;
        self.regions.push(r.clone());
        Ok(r)
    }

    /// Drops every cached region that overlaps the range (its memory is about
    /// to be freed or reused).
    pub fn evict(&mut self, addr: *const u8, len: usize) {
        let (a, b) = (addr as usize, addr as usize + len);
        self.regions.retain(|r| {
            let (ra, rb) = (r.addr() as usize, r.addr() as usize + r.len());
            rb <= a || b <= ra
        });
    }

    pub fn len(&self) -> usize {
        self.regions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
}
