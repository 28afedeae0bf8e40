//! What a call is, before anything runs: its arguments and the shape
//! rules every binding asks (`args`), the caller's buffers, the element
//! types (`datatype`), the reductions and their kernels ([`reduce`]), and
//! the descriptor every message of a call carries so that ranks that
//! disagree get an error instead of a wrong result (`descriptor`).
//!
//! Owns: the meaning of a call. May not touch: connections, schedules,
//! the communicator; nothing here moves a byte between ranks.

pub(crate) mod args;
pub(crate) mod buffers;
pub(crate) mod datatype;
pub(crate) mod descriptor;
pub mod reduce;
