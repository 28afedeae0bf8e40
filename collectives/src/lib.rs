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
//! Layers, top to bottom: [`Communicator`] (checks a call's [`CallArgs`],
//! chooses its algorithm, aborts on failure) → [`algo`] (each algorithm
//! builds a schedule of sends and receives) → `executor` (the rules:
//! pipelining, staging, ordering; one bounded progress step at a time) →
//! `transfers` (its effects: transport connections and memory) →
//! `transport` (bytes between two ranks).

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

pub use bootstrap::Bootstrap;
pub use call::args::{CallArgs, Peer, VarCounts};
pub use call::buffers::Buffers;
pub use call::datatype::{DataType, Element};
pub use call::descriptor::{CallDesc, Collective};
pub use call::reduce::ReduceOp;
pub use comm::group::{Group, FUSE_MAX_BYTES};
pub use comm::nonblocking::{AsyncCommunicator, Handle, Ticket};
pub use comm::Communicator;
pub use config::{parse_algo, parse_seconds, parse_size, Config};
pub use error::{Error, ErrorKind, Result};
pub use fault::abort::AbortHandle;
pub use observe::recorder::{CallRecord, Dump, PeerStats, Stats, WaitRecord};
pub use sys::huge_buffer::HugeBuffer;
pub use transport::shm::SharedBuffer;
pub use transport::Rank;
