//! `bfloat16` and the `float8` types in NumPy, through the `ml_dtypes` package: `dlbridge-pyo3`'s
//! implementation ([`dlbridge_pyo3::exchange::ml_dtypes`]), which imports such NumPy arrays for
//! every consumer (`dlbridge.from_dlpack` and extensions alike), made here for `dlbridge.Array`.

use dlbridge::Tensor;
use pyo3::prelude::*;

use crate::array::PyArray;

/// A NumPy view of the host-readable `t` when its dtype is one NumPy lacks and `ml_dtypes`
/// provides (`None` for every other dtype); `TypeError` saying to install `ml_dtypes` when it is
/// missing.
pub(crate) fn to_numpy<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Option<Bound<'py, PyAny>>> {
    dlbridge_pyo3::exchange::ml_dtypes::to_numpy::<PyArray>(py, t)
}
