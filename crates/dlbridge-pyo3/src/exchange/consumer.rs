//! The consumer: any Python array (a producer's C exchange table, its `__dlpack__`, a DLPack
//! capsule, NumPy's documented array struct, the buffer protocol) turned into one call of the
//! core's [`ImportRequest`], which decides device, storage mode and copy; and the producers'
//! contracts a descriptor does not state, kept here for every import: tensor states DLPack
//! cannot express are refused ([`refuse_inexpressible`]), and the arrays of producers that are
//! immutable by contract are imported read-only ([`import_from_producer`]).

use dlbridge::dlpack::{ImportRequest, Imported, ManagedTensor};
use dlbridge::{Device, Tensor};
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::error::IntoPyResult;
use crate::exchange::kind::{States, TypeInfo, refuse_inexpressible, type_info};

/// What every import asks of the core: the memory where it is (`copy=False`), so the core
/// refuses anything that would need a copy (a private Metal buffer, say).
pub(crate) const REQUEST: ImportRequest = ImportRequest {
    device: None,
    storage: None,
    copy: Some(false),
};

/// Imports `x` through its type's exchange table or its `__dlpack__`, or else the buffer
/// protocol (for NumPy arrays the struct path does not take).
pub(crate) fn import_via_dlpack(x: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    from_producer(x, type_info(x))
}

/// Imports `x` (of type `info`) through its type's exchange table or its `__dlpack__`, or else the
/// buffer protocol.
pub(crate) fn from_producer(x: &Bound<'_, PyAny>, info: TypeInfo) -> PyResult<Tensor> {
    import_from_producer(x, info, &REQUEST, || {
        from_buffer(x).map(|tensor| Imported {
            tensor,
            copied: false,
        })
    })
    .map(|i| i.tensor)
}

/// Imports the producer `x`'s tensor with `request`, taken through its type's exchange table or
/// its `__dlpack__` as [`take_from_producer`] takes it (`info` is `x`'s
/// [`type_info`]); `otherwise` answers when its type has
/// neither.
///
/// What the producer's contract says and its descriptor does not is kept here, for every caller:
/// the memory of a producer whose arrays are immutable by contract (JAX's, the one list of them
/// kept in this module) is imported read-only, still without a copy, so a write through the
/// import is refused instead of changing an array its framework holds constant; a copy the import
/// made (`copy=True`, another device) is new memory and writable. A NumPy array of an
/// `ml_dtypes` type, which NumPy's own export refuses, is imported through its bytes
/// ([`crate::exchange::ml_dtypes::import_numpy`]).
#[inline]
pub fn import_from_producer(
    x: &Bound<'_, PyAny>,
    info: TypeInfo,
    request: &ImportRequest,
    otherwise: impl FnOnce() -> PyResult<Imported>,
) -> PyResult<Imported> {
    let managed = match take_from_producer(x, info, request.device, request.copy) {
        Ok(Some(managed)) => managed,
        Ok(None) => return otherwise(),
        Err(err) => return ml_dtypes_or(x, request, err),
    };
    // SAFETY: the table or capsule handed over a live tensor whose ownership is now ours.
    let mut imported = unsafe { request.import(managed) }.py()?;
    if info.immutable && !imported.copied {
        imported.tensor = imported.tensor.into_immutable();
    }
    Ok(imported)
}

/// A NumPy array of an `ml_dtypes` type imported through its bytes with `request`, where the
/// producer's own export failed with `err` (which is the answer for anything else).
#[cold]
#[inline(never)]
fn ml_dtypes_or(x: &Bound<'_, PyAny>, request: &ImportRequest, err: PyErr) -> PyResult<Imported> {
    match crate::exchange::ml_dtypes::import_numpy(x)? {
        Some(tensor) => finish(request, tensor),
        None => Err(err),
    }
}

/// The producer `x`'s tensor, handed over through its type's exchange table (`info`, from
/// [`type_info`]) or else its `__dlpack__` (asked for
/// `device` and `copy` as [`call_dlpack`] does); `None` when its type has neither. A tensor in a
/// state DLPack cannot express is refused ([`refuse_inexpressible`]): through the table, once
/// the exported descriptor has told the element type (the conjugate bit exists only on complex
/// tensors; a refused export goes straight back to its producer), and before any other path.
#[inline]
pub fn take_from_producer(
    x: &Bound<'_, PyAny>,
    info: TypeInfo,
    device: Option<Device>,
    copy: Option<bool>,
) -> PyResult<Option<ManagedTensor>> {
    match crate::exchange::c_api::take_via_table(x, info) {
        Some(Ok(managed)) => {
            let states = if is_complex(&managed) {
                States::Values
            } else {
                States::RealValues
            };
            match refuse_inexpressible(x, info, states) {
                Ok(()) => Ok(Some(managed)),
                Err(err) => {
                    managed.release();
                    Err(err)
                }
            }
        }
        Some(Err(err)) => {
            refuse_inexpressible(x, info, States::All)?;
            Err(err)
        }
        None if info.has_dlpack => {
            refuse_inexpressible(x, info, States::All)?;
            crate::exchange::capsule::take(&call_dlpack(x.py(), x, device, copy)?).map(Some)
        }
        None => {
            refuse_inexpressible(x, info, States::Values)?;
            Ok(None)
        }
    }
}

/// Whether a managed tensor's elements are complex.
fn is_complex(managed: &ManagedTensor) -> bool {
    use dlbridge::dlpack::ffi::K_DL_COMPLEX;
    let code = match managed {
        // SAFETY: a `ManagedTensor` is live and owned until it is imported or released.
        ManagedTensor::Versioned(m) => unsafe { (*m.as_ptr()).dl_tensor.dtype.code },
        // SAFETY: as above.
        ManagedTensor::Legacy(m) => unsafe { (*m.as_ptr()).dl_tensor.dtype.code },
    };
    code == K_DL_COMPLEX
}

/// A buffer-protocol object, or a `TypeError` saying what an array argument accepts.
fn from_buffer(x: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let tensor = crate::exchange::buffer::from_buffer(x).map_err(|err| {
        if err.is_instance_of::<PyTypeError>(x.py()) {
            let name = x
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default();
            PyTypeError::new_err(format!(
                "expected an array (an object with __dlpack__, a DLPack capsule or a buffer), \
                 got {name}"
            ))
        } else {
            err
        }
    })?;
    finish(&REQUEST, tensor).map(|i| i.tensor)
}

/// Applies `request` to memory dlbridge can use as it is (a buffer-protocol view, a tensor of
/// the binding's own).
#[inline]
pub fn finish(request: &ImportRequest, tensor: Tensor) -> PyResult<Imported> {
    request
        .finish(Imported {
            tensor,
            copied: false,
        })
        .py()
}

/// Calls the producer's `__dlpack__` as the array API standard lets a consumer: `max_version=(1,
/// 3)`; for a CUDA producer (known by `__dlpack_device__`, asked where this process can load the
/// CUDA driver or where a device was asked for) the consumer's stream (the thread's current
/// dlbridge stream on that device, the legacy default stream unless the extension set another
/// with [`dlbridge::backend::cuda::set_current_stream`]); `dl_device` only for a move to the
/// host (other moves the core makes after importing); `copy` as given. Producers older than
/// DLPack 1.0 that take no keywords are asked again without them (but still with the stream).
/// An object without `__dlpack__` is a `TypeError`.
pub fn call_dlpack<'py>(
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
    // A process that cannot even open the CUDA driver holds no CUDA memory: unless a device was
    // asked for, there is nothing to learn from `__dlpack_device__` (1 us for a JAX array).
    let here = if device.is_none() && !dlbridge::backend::cuda::driver_library_present() {
        None
    } else {
        producer_device(x)?
    };
    let cuda = here.filter(|d| d.kind().is_cuda());
    if device.is_none() && copy.is_none() && cuda.is_none() {
        // The common case: a constant `{"max_version": (1, 3)}`. Callees never keep or change
        // the dict they are called with (CPython copies it into `**kwargs` where one is declared).
        return match method.call((), Some(plain_kwargs(py))) {
            Ok(capsule) => Ok(capsule),
            Err(err) if err.is_instance_of::<PyTypeError>(py) => method.call0(),
            Err(err) => Err(err),
        };
    }
    // Ask a CUDA producer to order its work before our current stream.
    let stream = cuda.map(|d| dlbridge::backend::consumer_stream(d).unwrap_or(1));
    let kwargs = PyDict::new(py);
    kwargs.set_item(intern!(py, "max_version"), max_version_tuple(py))?;
    if let Some(stream) = stream {
        kwargs.set_item(intern!(py, "stream"), stream)?;
    }
    if let Some(target) = device {
        // Only ask the producer to move data to the host, which every producer can do. A
        // same-device request is a no-op that older producers may not accept.
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
        Err(err) if err.is_instance_of::<PyTypeError>(py) => match stream {
            // Still name the stream: a CUDA producer must order its work before ours.
            Some(stream) => {
                let kwargs = PyDict::new(py);
                kwargs.set_item(intern!(py, "stream"), stream)?;
                method.call((), Some(&kwargs))
            }
            None => method.call0(),
        },
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

/// The producer's `__dlpack_device__`, if it has one (and it names a device dlbridge knows).
pub fn producer_device(x: &Bound<'_, PyAny>) -> PyResult<Option<Device>> {
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
