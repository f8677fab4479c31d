//! The consumer: `dlbridge.from_dlpack(x)` and `asarray` turn a Python producer (its C exchange
//! table, its `__dlpack__`, a capsule, the buffer protocol) into one call of the core's
//! [`ImportRequest`], which decides device, storage mode and copy.

use dlbridge::dlpack::{ImportRequest, Imported};
use dlbridge::{Device, StorageMode, Tensor};
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};

use crate::errors::IntoPyResult;

/// `from_dlpack` per the array API standard: asks the producer for a versioned capsule (falling
/// back to the legacy protocol when it does not take keywords), or takes its tensor through its
/// C exchange table, and imports it with the core's rules for `device`, `storage` and `copy`
/// (a `kDLMetal` tensor is resolved against its `id<MTLBuffer>`, which copies private memory).
pub(crate) fn from_dlpack(
    x: &Bound<'_, PyAny>,
    device: Option<Device>,
    storage: Option<StorageMode>,
    copy: Option<bool>,
) -> PyResult<Imported> {
    let py = x.py();
    let request = ImportRequest {
        device,
        storage,
        copy,
    };
    if let Ok(array) = x.cast::<crate::array::PyArray>() {
        // One of ours: share the tensor directly.
        return finish(&request, array.get().tensor()?.clone());
    }
    let managed = if x.is_instance_of::<PyCapsule>() {
        super::capsule::take(x)?
    } else {
        let info = super::c_api::type_info(x);
        refuse_inexpressible(x, info, States::Values)?;
        match super::c_api::take_via_table(x, info) {
            Some(Ok(managed)) => managed,
            Some(Err(err)) => {
                refuse_inexpressible(x, info, States::Storage)?;
                return Err(err);
            }
            None => {
                refuse_inexpressible(x, info, States::Storage)?;
                super::capsule::take(&call_dlpack(py, x, device, copy)?)?
            }
        }
    };
    // SAFETY: the capsule or table handed over a live tensor whose ownership is now ours.
    unsafe { request.import(managed) }.py()
}

/// Applies `request` to memory dlbridge can use as it is (one of its arrays, a buffer-protocol
/// view).
pub(crate) fn finish(request: &ImportRequest, tensor: Tensor) -> PyResult<Imported> {
    request
        .finish(Imported {
            tensor,
            copied: false,
        })
        .py()
}

/// Which tensor states [`refuse_inexpressible`] asks about.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum States {
    /// States in which the memory does not hold the tensor's values, or must not be written
    /// behind its framework's back: requires grad, a lazy conjugate or negative bit. A producer's
    /// exporter may hand such a tensor out without complaint (PyTorch's C exchange table does, and
    /// its `__dlpack__` does for negated views), so these are asked before every import.
    Values,
    /// States with no strided memory at all: sparse, quantized, nested, MKL-DNN, meta, lazy zero
    /// tensors. No exporter can hand those out as a descriptor (PyTorch's table fails for them),
    /// so these are asked where an import would otherwise go on without the table: before
    /// `__dlpack__` and the buffer protocol, and to explain a failed table export.
    Storage,
    /// Both.
    All,
}

/// Refuses, with the `BufferError` the array API standard calls for, a producer's tensor in a
/// state a DLPack descriptor cannot express ([`States`]); the one check every import path (the C
/// exchange table, `__dlpack__`, the buffer protocol) makes. Only types with PyTorch's
/// tensor-state API are asked ([`super::c_api::TypeInfo`]), and each question is one
/// attribute read or method call, in the order of how common the state is.
pub(crate) fn refuse_inexpressible(
    x: &Bound<'_, PyAny>,
    info: super::c_api::TypeInfo,
    states: States,
) -> PyResult<()> {
    if !info.has_tensor_state {
        return Ok(());
    }
    let py = x.py();
    // A state the running version does not have (an attribute it lacks) is not set.
    let flag = |name: &Bound<'_, pyo3::types::PyString>| {
        x.getattr(name).and_then(|v| v.is_truthy()).unwrap_or(false)
    };
    let method = |name: &Bound<'_, pyo3::types::PyString>| {
        x.call_method0(name)
            .and_then(|v| v.is_truthy())
            .unwrap_or(false)
    };
    let values = states != States::Storage;
    let storage = states != States::Values;
    let refusal = if values && flag(intern!(py, "requires_grad")) {
        "it requires grad, and a DLPack consumer could write to it behind autograd's back; \
         export x.detach()"
    } else if values && method(intern!(py, "is_conj")) {
        "its conjugate bit is set, so its memory does not hold its values; export \
         x.resolve_conj()"
    } else if values && method(intern!(py, "is_neg")) {
        "its negative bit is set, so its memory does not hold its values; export x.resolve_neg()"
    } else if storage && (flag(intern!(py, "is_sparse")) || flag(intern!(py, "is_sparse_csr"))) {
        "it is sparse, and DLPack describes only strided memory; export x.to_dense()"
    } else if storage && flag(intern!(py, "is_quantized")) {
        "it is quantized, which DLPack cannot describe; export x.dequantize()"
    } else if storage && flag(intern!(py, "is_nested")) {
        "it is a nested tensor, which DLPack cannot describe"
    } else if storage && flag(intern!(py, "is_mkldnn")) {
        "it is in MKL-DNN layout, which DLPack cannot describe; export x.to_dense()"
    } else if storage && flag(intern!(py, "is_meta")) {
        "it is on the meta device and has no memory"
    } else if storage && method(intern!(py, "_is_zerotensor")) {
        "it is a lazy zero tensor with no memory of its own; export x.clone()"
    } else {
        return Ok(());
    };
    Err(PyBufferError::new_err(format!(
        "cannot import this {} through DLPack: {refusal}",
        x.get_type().name()?
    )))
}

/// Errors of a DLPack exchange: a device dlbridge cannot reach is, in the array API standard's
fn call_dlpack<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    device: Option<Device>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    let method = match x.getattr(intern!(py, "__dlpack__")) {
        Ok(m) => m,
        Err(_) => {
            return Err(PyTypeError::new_err(format!(
                "{} does not support DLPack (no __dlpack__ method)",
                x.get_type().name()?
            )));
        }
    };
    // The producer's device decides whether a stream must be named (CUDA) or not (elsewhere).
    let here = producer_device(x)?;
    let on_cuda = here.is_some_and(|d| d.kind().is_cuda());
    if device.is_none() && copy.is_none() && !on_cuda {
        // The common case: a constant `{"max_version": (1, 3)}`. Callees never keep or change
        // the dict they are called with (CPython copies it into `**kwargs` where one is declared).
        return match method.call((), Some(plain_kwargs(py))) {
            Ok(capsule) => Ok(capsule),
            Err(err) if err.is_instance_of::<PyTypeError>(py) => method.call0(),
            Err(err) => Err(err),
        };
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item(intern!(py, "max_version"), max_version_tuple(py))?;
    if let Some(here) = here.filter(|d| d.kind().is_cuda()) {
        // Ask the producer to order its work before our current stream.
        kwargs.set_item(intern!(py, "stream"), consumer_stream(here))?;
    }
    if let Some(target) = device {
        // Only ask the producer to move data to the host, which every producer can do; other
        // moves dlbridge makes itself after importing. A same-device request is a no-op that
        // older producers may not accept.
        if here != Some(target) && target.is_cpu() {
            let dl = target.to_dlpack();
            kwargs.set_item(intern!(py, "dl_device"), (dl.device_type, dl.device_id))?;
        }
    }
    if let Some(copy) = copy {
        kwargs.set_item(intern!(py, "copy"), copy)?;
    }
    match method.call((), Some(&kwargs)) {
        Ok(capsule) => Ok(capsule),
        // Producers older than DLPack 1.0 take no keywords (or not these).
        Err(err) if err.is_instance_of::<PyTypeError>(py) => {
            if on_cuda {
                // Still name the stream: a CUDA producer must order its work before ours.
                let kwargs = PyDict::new(py);
                kwargs.set_item(
                    intern!(py, "stream"),
                    consumer_stream(here.expect("on_cuda")),
                )?;
                return method.call((), Some(&kwargs));
            }
            method.call0()
        }
        Err(err) => Err(err),
    }
}

/// `{"max_version": (1, 3)}`, built once.
fn plain_kwargs(py: Python<'_>) -> &Bound<'_, PyDict> {
    static DICT: pyo3::sync::PyOnceLock<Py<PyDict>> = pyo3::sync::PyOnceLock::new();
    DICT.get_or_init(py, || {
        let d = PyDict::new(py);
        d.set_item(intern!(py, "max_version"), max_version_tuple(py))
            .expect("inserting into a new dict");
        d.unbind()
    })
    .bind(py)
}

/// `(1, 3)`, built once.
fn max_version_tuple(py: Python<'_>) -> &Bound<'_, PyTuple> {
    static TUPLE: pyo3::sync::PyOnceLock<Py<PyTuple>> = pyo3::sync::PyOnceLock::new();
    TUPLE
        .get_or_init(py, || {
            let v = dlbridge::dlpack::VERSION;
            PyTuple::new(py, [v.major, v.minor])
                .expect("a tuple of two ints")
                .unbind()
        })
        .bind(py)
}

/// The producer's `__dlpack_device__`, if it has one.
fn producer_device(x: &Bound<'_, PyAny>) -> PyResult<Option<Device>> {
    let py = x.py();
    match x.call_method0(intern!(py, "__dlpack_device__")) {
        Ok(pair) => {
            let (device_type, device_id): (i32, i32) = pair.extract()?;
            Ok(Device::from_dlpack(dlbridge::dlpack::ffi::DLDevice {
                device_type,
                device_id,
            })
            .ok())
        }
        Err(_) => Ok(None),
    }
}

/// Our current stream on a CUDA `device`, as a consumer names it to a producer.
fn consumer_stream(device: Device) -> i64 {
    dlbridge::backend::consumer_stream(device).unwrap_or(1)
}
