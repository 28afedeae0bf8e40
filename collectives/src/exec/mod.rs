//! Running one schedule: the [`executor`] (which step may be posted or
//! retired next: pipelining, staging windows, ordering, one bounded step
//! at a time) and [`transfers`] (what posting and retiring do: sends and
//! receives on transport connections, reductions and copies in memory).
//! The communicator, the non-blocking engine and the simulator all drive
//! this same executor; `replay` tests it on every algorithm's schedules.
//!
//! Owns: the execution of a schedule. May not touch: the communicator
//! (calls in flight live in [`crate::comm`]), algorithm choice, faults.

pub(crate) mod executor;
#[cfg(test)]
mod replay;
pub(crate) mod transfers;
