//! When ranks fail: aborting a communicator from any thread (`abort`) and
//! agreeing on which ranks failed, as ULFM does (`agree`), over the status
//! port rather than the communicator's connections, which a failure broke.
//! Shrinking to the survivors uses both and lives with the communicator
//! (`comm/shrink.rs`).
//!
//! Owns: abort and agreement. May not touch: the communicator, calls in
//! flight, schedules.

pub(crate) mod abort;
pub(crate) mod agree;
