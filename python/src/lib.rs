//! `collectives._native`: the Python binding. It translates and nothing
//! more: each method extracts its arrays, releases the GIL, calls the
//! library, converts the result; shapes, counts and in-place rules are the
//! library's (`CallArgs`), errors cross in one place (`errors.rs`).

mod buffers;
mod comm;
mod errors;
mod group;
mod handle;
mod memory;

// The C ABI, exported from this module for the torch backend's C++.
use collectives_c as _;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A new unique id (128 bytes): make it on one rank, give it to the others
/// (a torch store, MPI, a file), and each calls `Communicator.init(rank,
/// size, id)`. This process serves the rendezvous until the job has met (or
/// COLL_TIMEOUT seconds).
#[pyfunction]
fn unique_id(py: Python<'_>) -> PyResult<Py<PyBytes>> {
    let id = collectives::bootstrap::UniqueId::new().map_err(errors::system)?;
    Ok(PyBytes::new(py, id.as_bytes()).unbind())
}

/// RANK, WORLD_SIZE and LOCAL_RANK as the library reads them from whatever
/// launched this process (torchrun, Open MPI, MPICH, Slurm), for tools that
/// only read torchrun's variables (torch's env:// rendezvous).
#[pyfunction]
fn launcher_env() -> PyResult<std::collections::HashMap<String, String>> {
    let boot =
        collectives::Bootstrap::from_env().map_err(pyo3::exceptions::PyValueError::new_err)?;
    let mut env = std::collections::HashMap::from([
        ("RANK".to_string(), boot.rank.to_string()),
        ("WORLD_SIZE".to_string(), boot.size.to_string()),
    ]);
    if let Some(local) = boot.local_rank {
        env.insert("LOCAL_RANK".into(), local.to_string());
    }
    Ok(env)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<comm::Communicator>()?;
    m.add_class::<handle::Handle>()?;
    m.add_class::<group::Group>()?;
    m.add_class::<memory::SharedMemory>()?;
    m.add_function(wrap_pyfunction!(unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(launcher_env, m)?)?;
    let at_exit = wrap_pyfunction!(handle::_at_exit, m)?;
    m.py()
        .import("atexit")?
        .call_method1("register", (at_exit,))?;
    errors::register(m)
}
