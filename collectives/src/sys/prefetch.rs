//! Hints that load a cache line before it is needed.

/// Asks the CPU to load the line at `p` (any address: a prefetch never
/// faults).
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults or changes memory.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
}

/// Asks the CPU to take the line at `p` for writing (`prefetchw`): a
/// line a peer's core holds is then ours before we store to it, and the
/// store does not wait in the store buffer, holding up every store after
/// it, for the peer to give it up.
pub(crate) fn prefetch_for_write<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults or changes memory
    // (`prefetchw` is a no-op where the CPU lacks it).
    unsafe {
        std::arch::asm!("prefetchw [{}]", in(reg) p, options(nostack, preserves_flags, readonly));
    }
}
