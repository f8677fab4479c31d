//! The consumer: `dlbridge.from_dlpack(x)` and `asarray` turn a Python producer (its C exchange
//! table, its `__dlpack__`, a capsule) into one call of the core's [`ImportRequest`], which
//! decides device, storage mode and copy. The steps are `dlbridge-pyo3`'s
//! ([`dlbridge_pyo3::exchange`]); what is ours is the shortcut for our own arrays.

use dlbridge::dlpack::{ImportRequest, Imported};
use dlbridge::{Device, StorageMode};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use dlbridge_pyo3::exchange::consumer::{call_dlpack, import_from_producer};

use super::{capsule, kind};
use crate::errors::IntoPyResult;

pub(crate) use dlbridge_pyo3::exchange::consumer::finish;
pub(crate) use dlbridge_pyo3::exchange::kind::{States, refuse_inexpressible};

/// `from_dlpack` per the array API standard: asks the producer for a versioned capsule (falling
/// back to the legacy protocol when it does not take keywords), or takes its tensor through its
/// C exchange table, and imports it with the core's rules for `device`, `storage` and `copy`
/// (a `kDLMetal` tensor is resolved against its `id<MTLBuffer>`, which copies private memory),
/// keeping the producer's contract as every extension on `dlbridge-pyo3` does
/// ([`import_from_producer`]: a JAX array's memory is read-only; a NumPy array of an
/// `ml_dtypes` type crosses through its bytes). A bare capsule names no producer, so it is
/// imported as its descriptor says.
pub(crate) fn from_dlpack(
    x: &Bound<'_, PyAny>,
    device: Option<Device>,
    storage: Option<StorageMode>,
    copy: Option<bool>,
) -> PyResult<Imported> {
    let request = ImportRequest {
        device,
        storage,
        copy,
    };
    if let Ok(array) = x.cast::<crate::array::PyArray>() {
        // One of ours: share the tensor directly.
        return finish(&request, array.get().tensor()?.clone());
    }
    if x.is_instance_of::<PyCapsule>() {
        let managed = capsule::take(x)?;
        // SAFETY: the capsule handed over a live tensor whose ownership is now ours.
        return unsafe { request.import(managed) }.py();
    }
    import_from_producer(x, kind::type_info(x), &request, || {
        // No table and no `__dlpack__` on the type: the instance's own, or the standard's
        // `TypeError`.
        let managed = capsule::take(&call_dlpack(x.py(), x, device, copy)?)?;
        // SAFETY: the capsule handed over a live tensor whose ownership is now ours.
        unsafe { request.import(managed) }.py()
    })
}
