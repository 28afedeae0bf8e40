//! Arrays as the library sees them: numpy arrays (any object with
//! `__dlpack__`, a torch CPU tensor say, goes through `numpy.from_dlpack`,
//! zero-copy), checked before any rank moves a byte: C-contiguous,
//! writable where the call writes, of a datatype the library has.

use collectives::DataType;
use numpy::npyffi::NPY_ARRAY_WRITEABLE;
use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// An array's memory, and the object that keeps it alive.
pub struct Array {
    pub ptr: *mut u8,
    pub len: usize,
    pub dtype: DataType,
    pub owner: Py<PyAny>,
}

// SAFETY: the pointer is only dereferenced by the library while `owner`
// (kept with the call until it finished) holds the memory.
unsafe impl Send for Array {}

impl Array {
    /// The memory as the library's byte buffer (read-only use).
    ///
    /// # Safety
    /// `owner` must be alive, and nobody else writing the memory.
    pub unsafe fn bytes<'a>(&self) -> &'a [u8] {
        // SAFETY: the caller's promise; an empty array's pointer is never read.
        unsafe { std::slice::from_raw_parts(self.non_null(), self.len) }
    }

    /// # Safety
    /// As [`bytes`](Self::bytes), and nobody else reading it either.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut<'a>(&self) -> &'a mut [u8] {
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.non_null(), self.len) }
    }

    fn non_null(&self) -> *mut u8 {
        if self.len == 0 {
            std::ptr::dangling_mut()
        } else {
            self.ptr
        }
    }
}

/// `obj` as an [`Array`]; `what` names it in errors ("send", "recv", "a").
pub fn array(obj: &Bound<'_, PyAny>, what: &str, writable: bool) -> PyResult<Array> {
    let obj = match obj.cast::<PyUntypedArray>() {
        Ok(a) => a.clone(),
        Err(_) if obj.hasattr("__dlpack__")? => {
            let numpy = obj.py().import("numpy")?;
            let a = numpy.call_method1("from_dlpack", (obj,)).map_err(|e| {
                PyTypeError::new_err(format!("{what}: its __dlpack__ export is unusable ({e}); a torch bfloat16 tensor goes as t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)"))
            })?;
            a.cast::<PyUntypedArray>()?.clone()
        }
        Err(_) => {
            return Err(PyTypeError::new_err(format!(
                "{what}: expected a numpy array or a tensor with __dlpack__, got {}",
                obj.get_type().name()?
            )))
        }
    };
    let name = obj.dtype().getattr("name")?.extract::<String>()?;
    let dtype = dtype(&name).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "{what}: dtype {name} is not one the library carries (float16, bfloat16, float32, float64, int8, uint8, int32, uint32, int64, uint64)"
        ))
    })?;
    if !obj.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what}: the array is not C-contiguous (use numpy.ascontiguousarray, or .contiguous() on a tensor)"
        )));
    }
    // SAFETY: `obj` is a live numpy array (checked by the cast).
    let (ptr, flags) = unsafe {
        let raw = obj.as_array_ptr();
        ((*raw).data as *mut u8, (*raw).flags)
    };
    if writable && flags & NPY_ARRAY_WRITEABLE == 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: the array is read-only and this call writes it"
        )));
    }
    Ok(Array {
        ptr,
        len: obj.len() * dtype.size(),
        dtype,
        owner: obj.into_any().unbind(),
    })
}

fn dtype(numpy_name: &str) -> Option<DataType> {
    Some(match numpy_name {
        "float16" => DataType::F16,
        "bfloat16" => DataType::Bf16,
        "float32" => DataType::F32,
        "float64" => DataType::F64,
        "int8" => DataType::I8,
        "uint8" => DataType::U8,
        "int32" => DataType::I32,
        "uint32" => DataType::U32,
        "int64" => DataType::I64,
        "uint64" => DataType::U64,
        _ => return None,
    })
}
