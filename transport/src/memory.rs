//! Registered memory and the cache in front of registration.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::{Result, Transport};

/// A byte range known to one or more transports. Cloning is cheap; each
/// transport's registration is released (for verbs: `ibv_dereg_mr`) when the
/// last clone holding its key is dropped.
#[derive(Clone)]
pub struct MemRegion(Arc<RegionInner>);

type Key = Arc<dyn Any + Send + Sync>;

struct RegionInner {
    addr: usize,
    len: usize,
    /// One key per transport that registered the range.
    keys: Vec<Key>,
}

impl MemRegion {
    /// Wraps a transport's registration `key` for `len` bytes at `addr`.
    pub fn new(addr: *const u8, len: usize, key: Box<dyn Any + Send + Sync>) -> Self {
        MemRegion(Arc::new(RegionInner {
            addr: addr as usize,
            len,
            keys: vec![Key::from(key)],
        }))
    }

    /// One region carrying the keys of several registrations of the same
    /// range (one per transport), usable on any of their connections.
    pub fn combine(regions: &[MemRegion]) -> Self {
        let first = &regions[0].0;
        assert!(regions
            .iter()
            .all(|r| r.0.addr == first.addr && r.0.len == first.len));
        MemRegion(Arc::new(RegionInner {
            addr: first.addr,
            len: first.len,
            keys: regions
                .iter()
                .flat_map(|r| r.0.keys.iter().cloned())
                .collect(),
        }))
    }

    pub fn addr(&self) -> *const u8 {
        self.0.addr as *const u8
    }

    pub fn len(&self) -> usize {
        self.0.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// A transport's own registration data (an MR for verbs), found by type.
    pub fn key<T: 'static>(&self) -> Option<&T> {
        self.0.keys.iter().find_map(|k| k.downcast_ref())
    }

    /// Whether `[addr, addr + len)` lies inside this region.
    pub fn contains(&self, addr: *const u8, len: usize) -> bool {
        let a = addr as usize;
        a >= self.0.addr && a + len <= self.0.addr + self.0.len
    }

    /// Pointer to `offset` after checking that `offset..offset + len` is inside.
    pub(crate) fn slice_ptr(&self, offset: usize, len: usize) -> Result<*mut u8> {
        match offset.checked_add(len) {
            Some(end) if end <= self.0.len => Ok((self.0.addr + offset) as *mut u8),
            _ => Err(crate::Error::Invalid(format!(
                "range {offset}..{offset}+{len} is outside a registered region of {} bytes",
                self.0.len
            ))),
        }
    }
}

impl fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemRegion({:#x}+{})", self.0.addr, self.0.len)
    }
}

/// Registers the range with every transport, as one region.
pub fn register_all(
    transports: &[&dyn Transport],
    addr: *const u8,
    len: usize,
) -> Result<MemRegion> {
    let regions: Vec<MemRegion> = transports
        .iter()
        .map(|t| t.register(addr, len))
        .collect::<Result<_>>()?;
    Ok(MemRegion::combine(&regions))
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
    pub fn get_or_register(
        &mut self,
        transports: &[&dyn Transport],
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
