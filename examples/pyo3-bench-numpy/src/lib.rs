//! The rust-numpy side of `bench/bench_pyo3.py`: the same per-call work as
//! `dlbridge_pyo3_ext.first`, through `numpy::PyReadonlyArray1<f32>`.

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

/// The first element of a 1-D float32 NumPy array (0 when empty).
#[pyfunction]
fn first(x: PyReadonlyArray1<'_, f32>) -> PyResult<f32> {
    Ok(x.as_slice()?.first().copied().unwrap_or(0.0))
}

/// The module.
#[pymodule]
fn pyo3_bench_numpy(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(first, m)?)
}
