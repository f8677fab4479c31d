//! The producer: a `__dlpack__` method (`dlbridge.Array`'s, [`PyTensor`](crate::PyTensor)'s)
//! turns its Python arguments into the core's [`ExportRequest`] and wraps the export in a capsule.

use dlbridge::Tensor;
use dlbridge::dlpack::ExportRequest;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::error::IntoPyResult;

/// `__dlpack__(stream=, max_version=, dl_device=, copy=)` of `tensor`, as the array API standard
/// defines it: the core decides the handoff, the copy and the version; this reads the Python
/// values and makes the capsule. `dl_device` is already parsed (each binding has its own
/// spellings of a device).
pub fn export<'py>(
    py: Python<'py>,
    tensor: &Tensor,
    stream: Option<&Bound<'py, PyAny>>,
    max_version: Option<(u32, u32)>,
    dl_device: Option<dlbridge::Device>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    let request = ExportRequest {
        stream: stream_arg(tensor, stream)?,
        max_version,
        dl_device,
        copy,
    };
    let managed = if tensor.device().kind() == dlbridge::DeviceKind::Metal {
        // Metal's handoff waits for the GPU: let other Python threads run meanwhile.
        py.detach(|| request.export(tensor))
    } else {
        request.export(tensor)
    };
    let managed = managed.py()?;
    super::capsule::wrap(py, managed)
}

/// Reads a DLPack `stream` argument: `None` or an int (a CUDA stream, as the standard spells
/// streams); on a device without streams any value is refused by the core, and a value that is
/// not even an int is refused here, each in the standard's terms.
fn stream_arg(tensor: &Tensor, stream: Option<&Bound<'_, PyAny>>) -> PyResult<Option<i64>> {
    let Some(stream) = stream.filter(|s| !s.is_none()) else {
        return Ok(None);
    };
    if let Ok(s) = stream.extract::<i64>() {
        return Ok(Some(s));
    }
    let device = tensor.device();
    if device.kind().is_cuda() {
        return Err(PyTypeError::new_err(format!(
            "stream must be None or an int (a CUDA stream handle), got {}",
            stream.get_type().name()?
        )));
    }
    Err(PyValueError::new_err(format!(
        "stream must be None for arrays on {device} (got {})",
        stream.repr()?
    )))
}
