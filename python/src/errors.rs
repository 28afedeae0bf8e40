//! The one place errors cross: the library's error kinds become exception
//! classes, its message their text.

use collectives::ErrorKind;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    collectives,
    Error,
    PyException,
    "A collective call failed; the message names the rank, the peer and the call."
);
create_exception!(
    collectives,
    ArgumentError,
    Error,
    "The call's arguments cannot work; nothing moved and the communicator is still usable."
);
create_exception!(
    collectives,
    MismatchError,
    Error,
    "The ranks disagree on a call: its collective, count, datatype, reduction, root or order."
);
create_exception!(
    collectives,
    PeerError,
    Error,
    "A peer died, closed its connection or aborted."
);
create_exception!(
    collectives,
    TimeoutError,
    Error,
    "Nothing moved for the timeout (COLL_TIMEOUT seconds); the message names the peer waited for."
);
create_exception!(
    collectives,
    AbortedError,
    Error,
    "The communicator was aborted (on request, by an interrupt, or by an earlier failure)."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("ArgumentError", py.get_type::<ArgumentError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add("PeerError", py.get_type::<PeerError>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("AbortedError", py.get_type::<AbortedError>())?;
    Ok(())
}

/// What a failed call left: its kind and message (kept by handles, which
/// may be waited on more than once).
#[derive(Clone, Debug)]
pub struct Failure {
    pub kind: ErrorKind,
    pub message: String,
}

impl From<collectives::Error> for Failure {
    fn from(e: collectives::Error) -> Self {
        Failure {
            kind: e.kind(),
            message: e.to_string(),
        }
    }
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> PyErr {
        let m = f.message;
        match f.kind {
            ErrorKind::InvalidArgument => ArgumentError::new_err(m),
            ErrorKind::Mismatch => MismatchError::new_err(m),
            ErrorKind::Remote => PeerError::new_err(m),
            ErrorKind::Timeout => TimeoutError::new_err(m),
            ErrorKind::Aborted => AbortedError::new_err(m),
            ErrorKind::System => Error::new_err(m),
        }
    }
}

/// A library error as the exception Python sees.
pub fn to_py(e: collectives::Error) -> PyErr {
    Failure::from(e).into()
}

/// A failure outside any call (the rendezvous of a unique id).
pub fn system(message: String) -> PyErr {
    Error::new_err(message)
}
