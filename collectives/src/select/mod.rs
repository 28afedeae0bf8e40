//! Choosing how a call runs: the `selector` (forced by `COLL_ALGO`, else
//! predicted fastest by a measured profile, else thresholds and the
//! simulator) and [`tuning`] (the cost model and the profile
//! `collbench tune` writes).
//!
//! Owns: the choice of algorithm and its settings. May not touch: the
//! communicator or connections; it only reads the algorithm table, the
//! settings and the simulator.

pub(crate) mod selector;
pub use selector::forced_algo;
pub mod tuning;
