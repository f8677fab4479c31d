//! `dlbridge.Array.__dlpack_c_exchange_api__`: the DLPack 1.3 C exchange table, made by
//! `dlbridge-pyo3` for any class holding a tensor ([`TensorClass`]).

use dlbridge::Tensor;
use dlbridge_pyo3::exchange::c_api::{ExchangeTable, TensorClass};
use pyo3::prelude::*;

use crate::array::PyArray;

impl TensorClass for PyArray {
    /// One read of the array's slot, no reference-count traffic: the table's exports are on the
    /// path a consumer takes for every tensor.
    #[inline]
    fn with_tensor<R>(&self, f: impl FnOnce(&Tensor) -> R) -> PyResult<R> {
        Ok(f(&*self.tensor()?))
    }

    fn new_object(py: Python<'_>, tensor: Tensor) -> PyResult<Py<PyAny>> {
        Ok(Py::new(py, PyArray::new(tensor))?.into_any())
    }
}

/// dlbridge's table; static, so it lives for the whole process as the protocol requires.
static TABLE: ExchangeTable = ExchangeTable::new::<PyArray>();

/// The capsule published as `dlbridge.Array.__dlpack_c_exchange_api__`.
pub(crate) fn capsule(py: Python<'_>) -> PyResult<Py<PyAny>> {
    TABLE.capsule(py)
}
