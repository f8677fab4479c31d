//! `bfloat16` and the `float8` types in NumPy, through the `ml_dtypes` package.
//!
//! NumPy has no such types and its DLPack import refuses them. `ml_dtypes` registers them as NumPy
//! dtypes of the same names and sizes, so the bytes cross as unsigned integers of the same width
//! (zero-copy, through DLPack) and are then viewed with the `ml_dtypes` type, in either direction.

use dlbridge::{DType, DTypeCode, Tensor};
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;

use crate::array::PyArray;
use crate::errors::IntoPyResult;

/// The unsigned integer dtype that carries `dtype`'s bytes, when `dtype` is one `ml_dtypes`
/// names (`bfloat16`, the 8-bit floats) and NumPy has not.
fn carrier(dtype: DType) -> Option<DType> {
    if dtype.lanes() != 1 {
        return None;
    }
    match (dtype.code(), dtype.bits()) {
        (DTypeCode::BFloat, 16) => Some(DType::U16),
        (
            DTypeCode::Float8E3M4
            | DTypeCode::Float8E4M3
            | DTypeCode::Float8E4M3B11Fnuz
            | DTypeCode::Float8E4M3Fn
            | DTypeCode::Float8E4M3Fnuz
            | DTypeCode::Float8E5M2
            | DTypeCode::Float8E5M2Fnuz
            | DTypeCode::Float8E8M0Fnu,
            8,
        ) => Some(DType::U8),
        _ => None,
    }
}

/// The same view of the same memory with its elements read as `dtype` (of the same size).
fn reinterpret(t: &Tensor, dtype: DType) -> PyResult<Tensor> {
    let view = Tensor::new(t.buffer().clone(), dtype, t.layout().clone()).py()?;
    Ok(if t.is_read_only() {
        view.into_read_only()
    } else {
        view
    })
}

/// A NumPy view of the host-readable `t` when its dtype is one NumPy lacks and `ml_dtypes`
/// provides (`None` for every other dtype); `TypeError` saying to install `ml_dtypes` when it is
/// missing.
pub(crate) fn to_numpy<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(bits) = carrier(t.dtype()) else {
        return Ok(None);
    };
    let name = t.dtype().name();
    let ml = py.import(intern!(py, "ml_dtypes")).map_err(|_| {
        PyTypeError::new_err(format!(
            "NumPy has no {name} type: install ml_dtypes (pip install ml_dtypes), which adds it, \
             or convert first with astype('float32')"
        ))
    })?;
    let target = ml.getattr(name.as_str())?;
    let carried = Bound::new(py, PyArray::new(reinterpret(t, bits)?))?;
    let np = py.import(intern!(py, "numpy"))?;
    let raw = np.call_method1(intern!(py, "from_dlpack"), (carried,))?;
    Ok(Some(raw.call_method1(intern!(py, "view"), (target,))?))
}

/// A zero-copy import of a NumPy array of an `ml_dtypes` type (`bfloat16`, the 8-bit floats),
/// which NumPy cannot export through DLPack itself; `None` for anything else.
pub(crate) fn from_numpy(obj: &Bound<'_, PyAny>) -> PyResult<Option<Tensor>> {
    let py = obj.py();
    // Only NumPy arrays (and subclasses) of a void-kind dtype: `ml_dtypes` types are kind 'V'.
    let Ok(np) = py.import(intern!(py, "numpy")) else {
        return Ok(None);
    };
    if !obj.is_instance(&np.getattr(intern!(py, "ndarray"))?)? {
        return Ok(None);
    }
    let np_dtype = obj.getattr(intern!(py, "dtype"))?;
    if np_dtype.getattr(intern!(py, "kind"))?.extract::<String>()? != "V" {
        return Ok(None);
    }
    let name: String = np_dtype.getattr(intern!(py, "name"))?.extract()?;
    let Ok(dtype) = name.parse::<DType>() else {
        return Ok(None);
    };
    let Some(bits) = carrier(dtype) else {
        return Ok(None);
    };
    if np_dtype
        .getattr(intern!(py, "itemsize"))?
        .extract::<usize>()?
        != bits.itemsize()
    {
        return Ok(None);
    }
    let carried = obj.call_method1(intern!(py, "view"), (bits.name(),))?;
    let t = crate::dlpack::consumer::from_dlpack(&carried, None, None, None)?.tensor;
    reinterpret(&t, dtype).map(Some)
}
