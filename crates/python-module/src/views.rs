//! The shape methods of `dlbridge.Array` that NumPy users reach for: `transpose(*axes)`,
//! `ravel` (a view when the layout allows) and `flatten` (always a copy).

use dlbridge::Tensor;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::errors::IntoPyResult;

/// `t` with its axes permuted by `axes` (the positional arguments of `Array.transpose`): reversed
/// when empty, else one sequence or several ints, each axis once, negative ones counted from the
/// end.
pub(crate) fn transpose(t: &Tensor, axes: &Bound<'_, PyTuple>) -> PyResult<Tensor> {
    if axes.is_empty() {
        return t.transpose().py();
    }
    let nested = axes.len() == 1
        && (axes.get_item(0)?.cast::<PyTuple>().is_ok()
            || axes.get_item(0)?.cast::<PyList>().is_ok());
    let given: Vec<isize> = if nested {
        axes.get_item(0)?.extract()
    } else {
        axes.extract()
    }
    .map_err(|_| PyTypeError::new_err("transpose takes axes as ints, or one tuple of ints"))?;
    let ndim = t.ndim();
    if given.len() != ndim {
        return Err(PyValueError::new_err(format!(
            "axes don't match array: {} axes given for an array of {ndim} dimensions",
            given.len()
        )));
    }
    let mut perm = Vec::with_capacity(ndim);
    for &a in &given {
        let axis = if a < 0 { a + ndim as isize } else { a };
        if !(0..ndim as isize).contains(&axis) {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "axis {a} is out of bounds for array of dimension {ndim}"
            )));
        }
        perm.push(axis as usize);
    }
    t.permute(&perm).py()
}

/// The elements of `t` in one axis, row-major: a view when its layout allows and `copy` is
/// false (NumPy's `ravel`), else a compact copy (`flatten`). Only order 'C' (row-major).
pub(crate) fn ravel(t: &Tensor, order: &str, copy: bool) -> PyResult<Tensor> {
    if order != "C" {
        return Err(PyValueError::new_err(format!(
            "order {order:?} is not supported: dlbridge ravels row-major ('C') only"
        )));
    }
    let flat = [Some(t.numel())];
    if !copy && let Ok(view) = t.reshape(&flat) {
        return Ok(view);
    }
    t.copy_to_storage(t.device(), None)
        .and_then(|c| c.reshape(&flat))
        .py()
}
