//! Collective communication for distributed training: AllReduce, AllToAll,
//! ReduceScatter, AllGather, Broadcast, Reduce and Barrier between processes,
//! blocking ([`Communicator`]) or not ([`AsyncCommunicator`]), over the
//! transports of the `transport` crate.
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
//! Layers, top to bottom: [`Communicator`] (validation, algorithm choice,
//! abort on failure) → [`algo`] (each algorithm builds a schedule of sends and
//! receives) → `schedule` (one executor: pipelining, staging, reduction,
//! deadlines) → `transport` (bytes between two ranks).

pub mod algo;
pub mod bootstrap;
mod communicator;
mod config;
mod datatype;
mod descriptor;
mod error;
pub mod log;
mod mesh;
mod nonblocking;
pub mod reduce;
mod schedule;
pub mod tuning;

pub use bootstrap::Bootstrap;
pub use communicator::{Buffers, Communicator};
pub use config::{parse_algo, parse_seconds, parse_size, Config};
pub use datatype::{DataType, Element};
pub use descriptor::{Collective, OpDesc};
pub use error::{Error, Result};
pub use nonblocking::{AsyncCommunicator, Handle};
pub use reduce::ReduceOp;
pub use transport::Rank;
