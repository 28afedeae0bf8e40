//! Timestamps cheap enough to take twice per call.

#[cfg(not(target_arch = "x86_64"))]
use std::time::Instant;

/// A cheap timestamp: the time-stamp counter where there is one (a clock
/// read costs tens of nanoseconds in a VM, twice per call), converted to
/// microseconds only when a dump is written.
pub(crate) fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: rdtsc exists on every x86_64 and has no preconditions.
    return unsafe { core::arch::x86_64::_rdtsc() };
    #[cfg(not(target_arch = "x86_64"))]
    {
        static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}
