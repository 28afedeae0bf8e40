//! Memory peers on the host map (`collectives::SharedBuffer`), for numpy
//! through `__array_interface__`: `numpy.asarray` makes an array over it
//! that keeps it alive (`collectives.shared_empty` wraps this).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use collectives::SharedBuffer;

/// `nbytes` zeroed bytes that peers on the host map: a large message sent
/// from them is read without a system call. Use through
/// `collectives.shared_empty(shape, dtype)`.
#[pyclass(frozen)]
pub struct SharedMemory {
    buffer: SharedBuffer,
}

#[pymethods]
impl SharedMemory {
    #[new]
    fn new(nbytes: usize) -> PyResult<Self> {
        let buffer = SharedBuffer::new(nbytes).map_err(|e| {
            pyo3::exceptions::PyMemoryError::new_err(format!(
                "cannot allocate {nbytes} bytes of shared memory: {e}"
            ))
        })?;
        Ok(SharedMemory { buffer })
    }

    fn __len__(&self) -> usize {
        self.buffer.len()
    }

    /// The bytes as a writable one-dimensional uint8 array (numpy's
    /// array interface, version 3).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.buffer.len(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.buffer.as_ptr() as usize, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }
}
