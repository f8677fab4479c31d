//! `dlbridge.load_npy` / `load_npz` natives: NumPy files through the loading engine
//! ([`dlbridge::npy`]). The Python module (python/dlbridge/npy.py) wraps them.

use std::path::PathBuf;

use dlbridge::engine::LoadOptions;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::array::PyArray;
use crate::errors::IntoPyResult;

/// The loader's options for `device` and `copy` (the reader's defaults otherwise).
fn options(device: &Bound<'_, PyAny>, copy: bool) -> PyResult<LoadOptions> {
    Ok(LoadOptions {
        copy,
        ..LoadOptions::new(crate::device::parse(device)?)
    })
}

/// The array of the `.npy` file at `path`, on `device`.
#[pyfunction]
#[pyo3(signature = (path, device, copy))]
fn _npy_load(
    py: Python<'_>,
    path: PathBuf,
    device: &Bound<'_, PyAny>,
    copy: bool,
) -> PyResult<PyArray> {
    let options = options(device, copy)?;
    let tensor = py
        .detach(|| dlbridge::npy::load_npy(&path, &options))
        .py()?;
    Ok(PyArray::new(tensor))
}

/// The arrays of the `.npz` archive at `path`, on `device`, by key.
#[pyfunction]
#[pyo3(signature = (path, device, copy))]
fn _npz_load<'py>(
    py: Python<'py>,
    path: PathBuf,
    device: &Bound<'py, PyAny>,
    copy: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let options = options(device, copy)?;
    let arrays = py
        .detach(|| dlbridge::npy::load_npz(&path, &options))
        .py()?;
    let out = PyDict::new(py);
    for (key, tensor) in arrays {
        out.set_item(key, Bound::new(py, PyArray::new(tensor))?)?;
    }
    Ok(out)
}

/// Registers the natives on the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_npy_load, m)?)?;
    m.add_function(wrap_pyfunction!(_npz_load, m)?)?;
    Ok(())
}
