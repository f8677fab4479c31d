//! DLPack capsules in and out, and the buffer protocol.
//!
//! This is where capsules get renamed: a consumed `dltensor[_versioned]` capsule becomes
//! `used_dltensor[_versioned]` before its contents are imported, so its own destructor never frees
//! what dlbridge now owns.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr::NonNull;

use dlbridge::dlpack::ffi::{
    DLManagedTensor, DLManagedTensorVersioned, DLPACK_FLAG_BITMASK_IS_COPIED, DLPackVersion,
};
use dlbridge::{DType, Device, Layout, StorageMode, Tensor};
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};
use pyo3::{ffi, intern};

use crate::errors::IntoPyResult;

const VERSIONED: &CStr = c"dltensor_versioned";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";
const LEGACY: &CStr = c"dltensor";
const USED_LEGACY: &CStr = c"used_dltensor";

/// A tensor taken from a capsule, and whether its producer says it copied the data.
pub(crate) struct Taken {
    pub(crate) tensor: Tensor,
    pub(crate) is_copied: bool,
}

/// Takes ownership of the DLPack tensor in `capsule` and imports it without copying.
pub(crate) fn take_capsule(capsule: &Bound<'_, PyAny>) -> PyResult<Taken> {
    let Ok(capsule) = capsule.cast::<PyCapsule>() else {
        return Err(PyTypeError::new_err(format!(
            "expected a DLPack capsule or an object with __dlpack__, got {}",
            capsule.get_type().name()?
        )));
    };
    let raw = capsule.as_ptr();
    // SAFETY: `raw` is a live capsule (we hold a reference); `PyCapsule_IsValid` only compares its
    // name and never sets an exception.
    if unsafe { ffi::PyCapsule_IsValid(raw, VERSIONED.as_ptr()) } == 1 {
        // SAFETY: the name matched, so this returns the stored non-NULL pointer without error.
        let ptr = unsafe { ffi::PyCapsule_GetPointer(raw, VERSIONED.as_ptr()) };
        let managed = NonNull::new(ptr.cast::<DLManagedTensorVersioned>())
            .ok_or_else(|| PyBufferError::new_err("the DLPack capsule holds NULL"))?;
        rename(raw, USED_VERSIONED)?;
        // SAFETY: the producer stored a live `DLManagedTensorVersioned` in the capsule and, by the
        // capsule protocol, ownership passes to whoever renames it, which we just did.
        let is_copied = unsafe { (*managed.as_ptr()).flags } & DLPACK_FLAG_BITMASK_IS_COPIED != 0;
        // SAFETY: as above; ownership is ours and is handed to the importer.
        let tensor = unsafe { Tensor::from_dlpack_versioned(managed) }.py()?;
        return Ok(Taken { tensor, is_copied });
    }
    // SAFETY: as above.
    if unsafe { ffi::PyCapsule_IsValid(raw, LEGACY.as_ptr()) } == 1 {
        // SAFETY: the name matched.
        let ptr = unsafe { ffi::PyCapsule_GetPointer(raw, LEGACY.as_ptr()) };
        let managed = NonNull::new(ptr.cast::<DLManagedTensor>())
            .ok_or_else(|| PyBufferError::new_err("the DLPack capsule holds NULL"))?;
        rename(raw, USED_LEGACY)?;
        // SAFETY: a live legacy tensor whose ownership passed to us with the rename.
        let tensor = unsafe { Tensor::from_dlpack_legacy(managed) }.py()?;
        return Ok(Taken {
            tensor,
            is_copied: false,
        });
    }
    let name = capsule.name()?.map(|n| {
        // SAFETY: a capsule's name, when set, is a NUL-terminated string that lives as long as
        // the capsule, which we hold.
        unsafe { n.as_cstr() }.to_string_lossy().into_owned()
    });
    match name.as_deref() {
        Some("used_dltensor" | "used_dltensor_versioned") => Err(PyBufferError::new_err(
            "this DLPack capsule was already consumed: a capsule can be imported only once",
        )),
        other => Err(PyTypeError::new_err(format!(
            "capsule {other:?} is not a DLPack capsule (expected 'dltensor' or \
             'dltensor_versioned')"
        ))),
    }
}

fn rename(capsule: *mut ffi::PyObject, name: &'static CStr) -> PyResult<()> {
    // SAFETY: `capsule` is live; `name` is static, so it outlives the capsule as the API requires.
    if unsafe { ffi::PyCapsule_SetName(capsule, name.as_ptr()) } != 0 {
        // SAFETY: `PyCapsule_SetName` set an exception when it failed.
        return Err(PyErr::fetch(unsafe { Python::assume_attached() }));
    }
    Ok(())
}

/// Runs `f` with the current exception (if any) set aside and restored afterwards: capsule
/// destructors run while consumers are failing, and must neither lose nor trip on their error.
///
/// # Safety
/// The GIL must be held.
unsafe fn preserving_exception(f: impl FnOnce()) {
    let (mut ty, mut value, mut tb) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: the GIL is held; the three out-pointers are valid.
    unsafe { ffi::PyErr_Fetch(&mut ty, &mut value, &mut tb) };
    f();
    // SAFETY: hands back exactly the references `PyErr_Fetch` gave us.
    unsafe { ffi::PyErr_Restore(ty, value, tb) };
}

/// Destructor of versioned capsules we produce: frees the tensor unless a consumer took it.
unsafe extern "C" fn drop_versioned_capsule(capsule: *mut ffi::PyObject) {
    let release = || {
        // SAFETY: CPython passes a live capsule.
        unsafe { drop_versioned_capsule_inner(capsule) }
    };
    // SAFETY: CPython calls destructors with the GIL held.
    unsafe { preserving_exception(release) }
}

unsafe fn drop_versioned_capsule_inner(capsule: *mut ffi::PyObject) {
    // SAFETY: called by CPython with a live capsule (and the GIL held); `IsValid` never raises.
    if unsafe { ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) } == 1 {
        // SAFETY: the name matched, so the stored pointer comes back without an exception.
        let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr()) };
        if let Some(managed) = NonNull::new(managed.cast::<DLManagedTensorVersioned>()) {
            // SAFETY: an unconsumed capsule still owns the tensor we exported into it; its
            // deleter is ours and never unwinds.
            unsafe { dlbridge::dlpack::release_versioned(managed) };
        }
    }
}

/// Destructor of legacy capsules we produce.
unsafe extern "C" fn drop_legacy_capsule(capsule: *mut ffi::PyObject) {
    let release = || {
        // SAFETY: CPython passes a live capsule.
        unsafe { drop_legacy_capsule_inner(capsule) }
    };
    // SAFETY: CPython calls destructors with the GIL held.
    unsafe { preserving_exception(release) }
}

unsafe fn drop_legacy_capsule_inner(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `drop_versioned_capsule_inner`.
    if unsafe { ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) } == 1 {
        // SAFETY: the name matched.
        let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()) };
        if let Some(managed) = NonNull::new(managed.cast::<DLManagedTensor>()) {
            // SAFETY: as in `drop_versioned_capsule_inner`.
            unsafe { dlbridge::dlpack::release_legacy(managed) };
        }
    }
}

/// Wraps an exported tensor in a capsule that frees it if never consumed.
fn new_capsule<'py>(
    py: Python<'py>,
    ptr: *mut c_void,
    name: &'static CStr,
    destructor: unsafe extern "C" fn(*mut ffi::PyObject),
    on_error: impl FnOnce(),
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `ptr` is non-NULL (an exported tensor), `name` is static, `destructor` matches the
    // capsule protocol.
    let raw = unsafe { ffi::PyCapsule_New(ptr, name.as_ptr(), Some(destructor)) };
    if raw.is_null() {
        on_error();
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `raw` is a new, owned reference.
    Ok(unsafe { Bound::from_owned_ptr(py, raw) })
}

/// The arguments of `__dlpack__` as the array API standard defines them.
pub(crate) struct ExportRequest {
    pub(crate) max_version: Option<(u32, u32)>,
    pub(crate) dl_device: Option<Device>,
    pub(crate) copy: Option<bool>,
}

/// Exports `tensor` into a new capsule, honouring `dl_device`, `copy` and `max_version`.
pub(crate) fn export<'py>(
    py: Python<'py>,
    tensor: &Tensor,
    req: ExportRequest,
) -> PyResult<Bound<'py, PyAny>> {
    let mut copied: Option<Tensor> = None;
    let mut viewed: Option<Tensor> = None;
    if let Some(target) = req.dl_device {
        // Metal: a host view of shared memory, where no copy is asked for.
        viewed = crate::metal::export_to_host(tensor, target, req.copy)?;
        if target != tensor.device() && viewed.is_none() {
            if req.copy == Some(false) {
                return Err(PyBufferError::new_err(format!(
                    "exporting to {target} needs a copy from {}, but copy=False",
                    tensor.device()
                )));
            }
            copied = Some(tensor.copy_to(target).map_err(exchange_error)?);
        }
    }
    if req.copy == Some(true) && copied.is_none() {
        copied = Some(tensor.copy().py()?);
    }
    let is_copied = copied.is_some();
    let tensor = copied.as_ref().or(viewed.as_ref()).unwrap_or(tensor);
    match req.max_version {
        Some((major, minor)) if major >= 1 => {
            let version = if major == 1 {
                DLPackVersion {
                    major: 1,
                    minor: minor.min(dlbridge::dlpack::VERSION.minor),
                }
            } else {
                dlbridge::dlpack::VERSION
            };
            let managed = tensor.to_dlpack_versioned(version, is_copied);
            new_capsule(
                py,
                managed.as_ptr().cast(),
                VERSIONED,
                drop_versioned_capsule,
                || {
                    // SAFETY: the capsule was not created, so we still own the export.
                    unsafe { dlbridge::dlpack::release_versioned(managed) }
                },
            )
        }
        _ => {
            let managed = tensor.to_dlpack_legacy().py()?;
            new_capsule(
                py,
                managed.as_ptr().cast(),
                LEGACY,
                drop_legacy_capsule,
                || {
                    // SAFETY: the capsule was not created, so we still own the export.
                    unsafe { dlbridge::dlpack::release_legacy(managed) }
                },
            )
        }
    }
}

/// `from_dlpack` per the array API standard: ask the producer for a versioned capsule (falling back
/// to the legacy protocol when it does not take keywords), import it zero-copy (a `kDLMetal` tensor
/// is resolved against its `id<MTLBuffer>`, which copies private memory), then apply `device` and
/// `copy`.
pub(crate) fn from_dlpack(
    x: &Bound<'_, PyAny>,
    device: Option<Device>,
    copy: Option<bool>,
) -> PyResult<Tensor> {
    let py = x.py();
    let taken = if let Ok(array) = x.cast::<crate::array::PyArray>() {
        // One of ours: share the tensor directly.
        Taken {
            tensor: array.get().tensor()?.clone(),
            is_copied: false,
        }
    } else {
        let taken = if x.is_instance_of::<PyCapsule>() {
            take_capsule(x)?
        } else {
            let info = crate::exchange_api::type_info(x);
            refuse_inexpressible(x, info, States::Values)?;
            match crate::exchange_api::take_via_table(x, info) {
                Some(Ok(taken)) => taken,
                Some(Err(err)) => {
                    refuse_inexpressible(x, info, States::Storage)?;
                    return Err(err);
                }
                None => {
                    refuse_inexpressible(x, info, States::Storage)?;
                    take_capsule(&call_dlpack(py, x, device, copy)?)?
                }
            }
        };
        // Another device is reached by a copy below, which needs no resolution first.
        if device.is_some_and(|d| d != taken.tensor.device()) {
            taken
        } else {
            crate::metal::resolve_import(taken, copy)?
        }
    };
    finish_import(taken, device, None, copy)
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
/// tensor-state API are asked ([`crate::exchange_api::TypeInfo`]), and each question is one
/// attribute read or method call, in the order of how common the state is.
pub(crate) fn refuse_inexpressible(
    x: &Bound<'_, PyAny>,
    info: crate::exchange_api::TypeInfo,
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
/// words, a device the exchange "cannot handle", which is a `BufferError`.
fn exchange_error(err: dlbridge::Error) -> PyErr {
    match err {
        dlbridge::Error::BackendUnavailable { .. } => PyBufferError::new_err(err.to_string()),
        other => crate::errors::to_py(other),
    }
}

/// Applies the consumer's `device`, `storage` (a Metal storage mode; other devices name theirs in
/// the device) and `copy` to an imported tensor.
pub(crate) fn finish_import(
    taken: Taken,
    device: Option<Device>,
    storage: Option<StorageMode>,
    copy: Option<bool>,
) -> PyResult<Tensor> {
    let Taken { tensor, is_copied } = taken;
    let target = device.unwrap_or_else(|| tensor.device());
    let other_storage = target.kind() == dlbridge::DeviceKind::Metal
        && storage.is_some_and(|s| s != tensor.buffer().storage_mode());
    if target != tensor.device() || other_storage {
        if copy == Some(false) {
            let (have, wanted) = match storage {
                Some(s) if other_storage => (
                    format!(
                        "in {} storage on {}",
                        tensor.buffer().storage_mode(),
                        tensor.device()
                    ),
                    format!("{s} storage on {target}"),
                ),
                _ => (format!("on {}", tensor.device()), target.to_string()),
            };
            return Err(PyBufferError::new_err(format!(
                "the array is {have} and {wanted} was asked for, which needs a copy, but \
                 copy=False"
            )));
        }
        return crate::creation::copy_to(&tensor, target, storage).map_err(exchange_error);
    }
    if copy == Some(true) && !is_copied {
        return crate::creation::copy_to(&tensor, target, storage).py();
    }
    Ok(tensor)
}

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
        kwargs.set_item(intern!(py, "stream"), crate::cuda::consumer_stream(here))?;
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
                    crate::cuda::consumer_stream(here.expect("on_cuda")),
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

// ---------------------------------------------------------------------------------------------
// The buffer protocol.
//
// `Py_buffer` and `PyObject_GetBuffer` belong to the stable ABI only from Python 3.11, but this
// extension is built for the 3.9 stable ABI. The struct's layout and both functions are unchanged
// since Python 3.3 and exported by every CPython 3 library, so we declare them here.

#[repr(C)]
struct PyBufferView {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut PyBufferView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferView);
}

const PYBUF_WRITABLE: c_int = 0x0001;
const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;

/// A buffer-protocol export kept alive for as long as dlbridge uses its memory.
struct HeldView(Box<PyBufferView>);

// SAFETY: the view is only released (in `Drop`), and that is done with the GIL attached, from
// whichever thread drops it.
unsafe impl Send for HeldView {}
// SAFETY: shared references give no access to the view.
unsafe impl Sync for HeldView {}

impl Drop for HeldView {
    fn drop(&mut self) {
        // The last reference can drop on any thread, even during interpreter shutdown (a DLPack
        // consumer's deleter, say): with no interpreter left, leaking is the only safe choice.
        // SAFETY: `Py_IsInitialized` may be called at any time, with or without the GIL.
        if unsafe { ffi::Py_IsInitialized() } == 0 {
            return;
        }
        Python::attach(|_py| {
            // SAFETY: the view was filled by a successful `PyObject_GetBuffer` and is released
            // exactly once, here, with the GIL attached.
            unsafe { PyBuffer_Release(&mut *self.0) };
        });
    }
}

/// Whether `obj` exports the buffer protocol.
pub(crate) fn has_buffer(obj: &Bound<'_, PyAny>) -> bool {
    // `memoryview(obj)` succeeds exactly for buffer exporters; it is cheap and stable-ABI.
    let py = obj.py();
    py.import(intern!(py, "builtins"))
        .and_then(|b| b.getattr(intern!(py, "memoryview")))
        .and_then(|mv| mv.call1((obj,)))
        .is_ok()
}

/// Imports a buffer-protocol object without copying (read-only when the exporter is).
pub(crate) fn from_buffer(obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let py = obj.py();
    let mut view = Box::new(PyBufferView {
        buf: std::ptr::null_mut(),
        obj: std::ptr::null_mut(),
        len: 0,
        itemsize: 0,
        readonly: 0,
        ndim: 0,
        format: std::ptr::null_mut(),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        suboffsets: std::ptr::null_mut(),
        internal: std::ptr::null_mut(),
    });
    let flags = PYBUF_STRIDES | PYBUF_FORMAT;
    // SAFETY: `obj` is live and `view` points to writable storage for a `Py_buffer`.
    let mut rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags | PYBUF_WRITABLE) };
    if rc != 0 {
        // Read-only exporters refuse PYBUF_WRITABLE: ask again for read-only access.
        drop(PyErr::take(py));
        // SAFETY: as above.
        rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
    }
    if rc != 0 {
        return Err(PyErr::fetch(py));
    }
    let held = HeldView(view);
    let v = &*held.0;
    let format = if v.format.is_null() {
        "B".to_owned()
    } else {
        // SAFETY: a non-NULL `format` is a NUL-terminated string the exporter owns while the
        // view is held.
        unsafe { CStr::from_ptr(v.format) }
            .to_string_lossy()
            .into_owned()
    };
    let dtype = dtype_of_format(&format).ok_or_else(|| {
        PyBufferError::new_err(format!("buffer format {format:?} has no DLPack dtype"))
    })?;
    if v.itemsize as usize != dtype.itemsize() {
        return Err(PyBufferError::new_err(format!(
            "buffer format {format:?} has itemsize {} but {dtype} needs {}",
            v.itemsize,
            dtype.itemsize()
        )));
    }
    if !v.suboffsets.is_null() {
        return Err(PyBufferError::new_err(
            "buffers with suboffsets (PIL-style) are not supported",
        ));
    }
    // The exporter's counts are trusted for nothing: bounded before anything is sized by them.
    let ndim = usize::try_from(v.ndim)
        .ok()
        .filter(|&n| n <= dlbridge::MAX_NDIM)
        .ok_or_else(|| {
            PyBufferError::new_err(format!(
                "the buffer's ndim {} is outside 0..={}",
                v.ndim,
                dlbridge::MAX_NDIM
            ))
        })?;
    if ndim > 0 && (v.shape.is_null() || v.strides.is_null()) {
        return Err(PyBufferError::new_err(
            "the buffer exporter gave no shape or strides although they were asked for",
        ));
    }
    let (mut shape, mut strides) = (Vec::with_capacity(ndim), Vec::with_capacity(ndim));
    for i in 0..ndim {
        // SAFETY: with PYBUF_STRIDES the exporter fills `ndim` extents and byte strides.
        let d = unsafe { v.shape.wrapping_add(i).read() };
        // SAFETY: as above.
        let s = unsafe { v.strides.wrapping_add(i).read() };
        if s % v.itemsize != 0 {
            return Err(PyBufferError::new_err(format!(
                "byte stride {s} is not a multiple of the item size {}",
                v.itemsize
            )));
        }
        let d = usize::try_from(d).map_err(|_| {
            PyBufferError::new_err(format!("the buffer's extent {d} of axis {i} is negative"))
        })?;
        shape.push(d);
        strides.push(s / v.itemsize);
    }
    let layout = Layout::new(&shape, &strides, 0).py()?;
    let itemsize = dtype.itemsize();
    let (lo, hi) = layout.element_extent().unwrap_or((0, -1));
    let base = v.buf as usize as i128 + lo * itemsize as i128;
    let len = ((hi - lo + 1) * itemsize as i128).max(0) as usize;
    let first = (-lo) as usize * itemsize;
    let read_only = v.readonly != 0;
    let handle = std::ptr::with_exposed_provenance_mut::<c_void>(base.max(1) as usize);
    // SAFETY: the exporter guarantees `[buf + lo, buf + hi]` (in elements) is valid host memory
    // while the view is held, and `held` keeps the view until the buffer is dropped.
    let buffer = unsafe {
        dlbridge::Buffer::from_foreign(
            handle,
            handle.cast(),
            len,
            Device::CPU,
            StorageMode::Shared,
            read_only,
            Box::new(held),
        )
    };
    let layout = layout.with_byte_offset(if len == 0 { 0 } else { first });
    Tensor::new(buffer, dtype, layout).py()
}

/// The dtype of a `struct`-module format string (native or little-endian only).
fn dtype_of_format(format: &str) -> Option<DType> {
    let body = match format.as_bytes().first() {
        Some(b'@' | b'=' | b'<') => &format[1..],
        Some(b'>' | b'!') if cfg!(target_endian = "big") => &format[1..],
        Some(b'>' | b'!') => return None,
        _ => format,
    };
    Some(match body {
        "?" => DType::BOOL,
        "b" => DType::I8,
        "B" | "c" => DType::U8,
        "h" => DType::I16,
        "H" => DType::U16,
        "i" => DType::I32,
        "I" => DType::U32,
        "l" | "q" | "n" if std::mem::size_of::<std::ffi::c_long>() == 8 || body != "l" => {
            DType::I64
        }
        "l" => DType::I32,
        "L" | "Q" | "N" if std::mem::size_of::<std::ffi::c_ulong>() == 8 || body != "L" => {
            DType::U64
        }
        "L" => DType::U32,
        "e" => DType::F16,
        "f" => DType::F32,
        "d" => DType::F64,
        "Zf" => DType::C64,
        "Zd" => DType::C128,
        _ => return None,
    })
}
