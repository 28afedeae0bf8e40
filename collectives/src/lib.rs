//! Collective communication for distributed training: AllReduce, AllToAll,
//! AllToAllv, ReduceScatter, AllGather, Broadcast, Reduce, Barrier and
//! point-to-point send/recv between processes, blocking ([`Communicator`])
//! or not ([`AsyncCommunicator`]), over the transports of the `transport`
//! crate.
//!
//! ```no_run
//! use collectives::{Communicator, ReduceOp};
//!
//! // Rank, size and rendezvous come from the environment: RANK, WORLD_SIZE,
//! // MASTER_ADDR, MASTER_PORT (torchrun), Open MPI or MPICH variables, or
//! // `collbench -n N`'s launcher.
//! let mut comm = Communicator::from_env()?;
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?;
//! # Ok::<(), collectives::Error>(())
//! ```
//!
//! # How it is built
//!
//! Each folder of `src/` owns one concept; a folder only imports the ones
//! below it (`python3 ci/module_graph.py` prints the layers and fails on a
//! circle), and each folder's `mod.rs` says what it owns and what it may
//! not touch.
//!
//! ```text
//! comm/       Communicator: set-up, typed calls, calls in flight, non-blocking,
//!   |         groups, split, shrink                        (the top: imports all)
//!   +-- select/    which algorithm: COLL_ALGO, measured profile, thresholds
//!   |     +-- simulate/  a call's time on a virtual cluster, same schedules
//!   +-- fault/     abort from any thread; agreement on failed ranks (ULFM)
//!   +-- tiny/      small calls through shared flags, no messages
//!   +-- exec/      the executor (which step next) and transfers (what it does)
//!   |     +-- algo/      one file per algorithm; each builds a Schedule
//!   +-- observe/   flight recorder, timeline, the status port (root causes)
//!   +-- bootstrap/ who we are, where we meet, the mesh of connections
//!   +-- call/      what a call is: arguments, buffers, datatypes, reductions
//!   +-- sys/       clock, doorbell, huge pages, streaming copies, prefetch
//!   config.rs, error.rs, log.rs: settings, errors and logging, for everyone
//! ----------------------------------------------------------------------
//! transport crate: tcp/, shm/, verbs/ behind one Transport trait (bytes
//! between two ranks; it never sees a datatype)
//! ```
//!
//! How a call flows: a typed call (`comm/calls.rs`) builds [`CallArgs`],
//! whose shape rules check it before anything moves; `comm/inflight.rs`
//! gives it a sequence number and its [`CallDesc`] (carried in every
//! message's tag, so ranks that disagree get an error); a small call on
//! one host may take the flag path (`tiny/`); otherwise the selector picks
//! an algorithm (`select/`), the algorithm builds a schedule of sends,
//! receives, reductions and copies (`algo/`), and `comm/progress.rs`
//! steps it with the executor (`exec/executor.rs`), whose effects
//! (`exec/transfers.rs`) post on the transport's connections and reduce
//! into memory, one bounded step at a time, until it is done, times out
//! (the status port then names the rank at fault) or is aborted.
//!
//! The folder map with every file, for newcomers, is `docs/architecture.md`.

pub mod algo;
pub mod bootstrap;
pub mod call;
mod comm;
mod config;
mod error;
mod exec;
mod fault;
#[cfg(test)]
mod fuzz;
pub mod log;
pub mod observe;
pub mod select;
pub mod simulate;
mod sys;
mod tiny;

/// The Rust examples of the README and the docs, compiled by `cargo test
/// --doc` so that they stay true to the API (their other runnable blocks are
/// run by `ci/doc_blocks.py`).
#[cfg(doctest)]
mod doc_examples {
    #[doc = include_str!("../../README.md")]
    struct Readme;
    #[doc = include_str!("../../docs/rust.md")]
    struct RustGuide;
    #[doc = include_str!("../../docs/operating.md")]
    struct Operating;
}

pub use bootstrap::Bootstrap;
pub use call::args::{CallArgs, Peer, VarCounts};
pub use call::buffers::Buffers;
pub use call::datatype::{DataType, Element};
pub use call::descriptor::{CallDesc, Collective};
pub use call::reduce::ReduceOp;
pub use comm::group::{Group, FUSE_MAX_BYTES};
pub use comm::nonblocking::{AsyncCommunicator, Handle, Ticket};
pub use comm::{shared_memory_per_rank, Communicator};
pub use config::{parse_algo, parse_seconds, parse_size, seconds, Config};
pub use error::{Error, ErrorKind, Result};
pub use fault::abort::AbortHandle;
pub use observe::recorder::{CallRecord, Dump, PeerStats, Stats, WaitRecord};
pub use sys::huge_buffer::HugeBuffer;
pub use transport::shm::SharedBuffer;
pub use transport::Rank;
