//! DLPack capsules: where a capsule gets renamed. A consumed `dltensor[_versioned]` capsule
//! becomes `used_dltensor[_versioned]` before its contents are imported, so its own destructor
//! never frees what dlbridge now owns; a capsule we produce frees its tensor unless a consumer
//! took it.

use std::ffi::{CStr, c_void};
use std::ptr::NonNull;

use dlbridge::dlpack::ManagedTensor;
use dlbridge::dlpack::ffi::{DLManagedTensor, DLManagedTensorVersioned};
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

const VERSIONED: &CStr = c"dltensor_versioned";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";
const LEGACY: &CStr = c"dltensor";
const USED_LEGACY: &CStr = c"used_dltensor";

/// Takes ownership of the DLPack tensor in `capsule` (renaming it used), for the caller to import.
pub fn take(capsule: &Bound<'_, PyAny>) -> PyResult<ManagedTensor> {
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
        // By the capsule protocol, ownership passes to whoever renames it.
        rename(raw, USED_VERSIONED)?;
        return Ok(ManagedTensor::Versioned(managed));
    }
    // SAFETY: as above.
    if unsafe { ffi::PyCapsule_IsValid(raw, LEGACY.as_ptr()) } == 1 {
        // SAFETY: the name matched.
        let ptr = unsafe { ffi::PyCapsule_GetPointer(raw, LEGACY.as_ptr()) };
        let managed = NonNull::new(ptr.cast::<DLManagedTensor>())
            .ok_or_else(|| PyBufferError::new_err("the DLPack capsule holds NULL"))?;
        rename(raw, USED_LEGACY)?;
        return Ok(ManagedTensor::Legacy(managed));
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

/// Wraps an exported tensor in a capsule (versioned or legacy by its flavour) that frees it if no
/// consumer takes it.
pub fn wrap<'py>(py: Python<'py>, managed: ManagedTensor) -> PyResult<Bound<'py, PyAny>> {
    match managed {
        ManagedTensor::Versioned(m) => new_capsule(
            py,
            m.as_ptr().cast(),
            VERSIONED,
            drop_versioned_capsule,
            || managed_release(ManagedTensor::Versioned(m)),
        ),
        ManagedTensor::Legacy(m) => {
            new_capsule(py, m.as_ptr().cast(), LEGACY, drop_legacy_capsule, || {
                managed_release(ManagedTensor::Legacy(m))
            })
        }
    }
}

/// The capsule was not created, so the export is still ours to free.
fn managed_release(managed: ManagedTensor) {
    managed.release();
}
