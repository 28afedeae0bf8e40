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

mod abort;
mod agree;
pub mod algo;
mod args;
pub mod bootstrap;
mod calls;
mod communicator;
mod config;
mod cpus;
mod datatype;
mod descriptor;
mod doorbell;
mod error;
mod executor;
#[cfg(test)]
mod fuzz;
mod group;
mod huge_buffer;
mod inflight;
pub mod log;
mod mesh;
mod nonblocking;
mod recorder;
pub mod reduce;
mod schedule;
mod selector;
mod shrink;
pub mod simulate;
mod split;
pub mod status;
mod stream_copy;
mod timeline;
mod tiny;
mod transfers;
pub mod tuning;

pub use abort::AbortHandle;
pub use args::{CallArgs, Peer, VarCounts};
pub use bootstrap::Bootstrap;
pub use communicator::{Buffers, Communicator};
pub use config::{parse_algo, parse_seconds, parse_size, Config};
pub use datatype::{DataType, Element};
pub use descriptor::{CallDesc, Collective};
pub use error::{Error, ErrorKind, Result};
pub use group::{Group, FUSE_MAX_BYTES};
pub use huge_buffer::HugeBuffer;
pub use nonblocking::{AsyncCommunicator, Handle, Ticket};
pub use recorder::{CallRecord, Dump, PeerStats, Stats, WaitRecord};
pub use reduce::ReduceOp;
pub use transport::shm::SharedBuffer;
pub use transport::Rank;
