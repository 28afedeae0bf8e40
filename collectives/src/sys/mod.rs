//! What the machine gives, wrapped once: a cheap clock, an eventfd
//! doorbell, buffers on huge pages, streaming copies, prefetch hints and
//! listeners with a long queue.
//!
//! Owns: small, self-contained wrappers of the CPU and the kernel. May not
//! touch: anything else in the crate (it imports nothing from it).

pub(crate) mod clock;
pub(crate) mod doorbell;
pub(crate) mod huge_buffer;
pub(crate) mod listener;
pub(crate) mod prefetch;
pub(crate) mod stream_copy;
