//! The DLPack 1.3 C exchange API (`__dlpack_c_exchange_api__`): tensors cross between libraries
//! through a table of C functions on the type, with no Python method call.
//!
//! * Consumer: an [`ArrayArg`](crate::ArrayArg) or `dlbridge.from_dlpack` looks the table up on
//!   `type(x)` ([`kind::type_info`](crate::exchange::kind::type_info), cached per type with the
//!   other facts the consumer needs of a type) and, when present, takes the tensor through
//!   `managed_tensor_from_py_object_no_sync` ([`take_via_table`]).
//! * Producer: any class holding a tensor ([`TensorClass`]: `dlbridge_pyo3::PyTensor`,
//!   `dlbridge.Array`) publishes an [`ExchangeTable`] of its own as `__dlpack_c_exchange_api__`.

use std::ffi::{c_char, c_int, c_void};
use std::ptr::NonNull;

use dlbridge::dlpack::ManagedTensor;
use dlbridge::dlpack::ffi::{
    DLDeviceType, DLManagedTensorVersioned, DLPackExchangeAPI, DLPackExchangeAPIHeader, DLTensor,
};
use dlbridge::{DType, Device, Tensor};
use pyo3::PyClass;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::error::{exception_name, to_py};
use crate::exchange::kind::{API_NAME, TypeInfo};

// ---------------------------------------------------------------------------------------------
// Consumer side.

/// Takes `x`'s tensor through its type's exchange table; `None` when the type has none.
///
/// The caller has refused tensors whose memory does not hold their values
/// ([`States::Values`](crate::exchange::kind::States::Values)): PyTorch's table hands out a
/// conjugated or negated view's raw memory without its lazy bit, and a tensor that requires grad
/// without complaint.
#[inline]
pub fn take_via_table(x: &Bound<'_, PyAny>, info: TypeInfo) -> Option<PyResult<ManagedTensor>> {
    let api = info.table()?;
    let export = api.managed_tensor_from_py_object_no_sync?;
    let mut out: *mut DLManagedTensorVersioned = std::ptr::null_mut();
    // SAFETY: `x` is an object of the type the table was found on, as the protocol requires; the
    // GIL is held; `out` is a valid place for the result.
    let rc = unsafe { export(x.as_ptr().cast(), &mut out) };
    let py = x.py();
    if rc != 0 {
        // The table skips checks the producer's `__dlpack__` makes (PyTorch's raises BufferError
        // for sparse, meta and quantized tensors, where the table raises RuntimeError): let that
        // path give the answer the array API standard specifies.
        drop(PyErr::take(py));
        return None;
    }
    let Some(managed) = NonNull::new(out) else {
        return Some(Err(PyBufferError::new_err(
            "the producer's DLPack exchange API returned NULL",
        )));
    };
    // The "NoSync" export does not order the producer's pending device work before ours: make
    // our current stream wait for the producer's (`current_work_stream`), as the protocol asks.
    // SAFETY: `managed` is a live, owned tensor the producer just handed us.
    let dl_device = unsafe { (*managed.as_ptr()).dl_tensor.device };
    if let Err(fallback) = order_after_producer(api, dl_device) {
        // SAFETY: owned and unused; give it back to its producer.
        unsafe { dlbridge::dlpack::release_versioned(managed) };
        // `None`: no way to synchronise here; `__dlpack__` (with `stream=`) does it.
        return fallback.map(Err);
    }
    Some(Ok(ManagedTensor::Versioned(managed)))
}

/// A producer's tensor known by its descriptor alone (DLPack 1.3's
/// `dltensor_from_py_object_no_sync`: nothing exported, nothing to release), with the object
/// whose life keeps the memory valid. A tensor is made only when one is asked for
/// ([`TableView::into_tensor`]), so the common argument call allocates nothing.
#[derive(Debug)]
pub(crate) struct TableView {
    obj: Py<PyAny>,
    /// Boxed: an argument's source is moved several times on its way to the function, and NumPy
    /// arrays (the most common source) should not pay for copying the larger descriptor.
    pub(crate) described: Box<dlbridge::dlpack::Described>,
}

impl TableView {
    /// Another handle to the same memory.
    pub(crate) fn clone_ref(&self, py: Python<'_>) -> TableView {
        TableView {
            obj: self.obj.clone_ref(py),
            described: self.described.clone(),
        }
    }

    /// The address of element zero (host or CUDA device memory: the only kinds this path takes).
    pub(crate) fn first(&self) -> usize {
        self.described.first_address().unwrap_or(0)
    }

    /// A tensor over the memory, which keeps the producer's object alive.
    pub(crate) fn into_tensor(self) -> PyResult<Tensor> {
        // SAFETY: the producer's object owns the described memory while it lives unchanged, and
        // the tensor holds it.
        unsafe { (*self.described).into_tensor(Box::new(self.obj)) }.map_err(to_py)
    }
}

/// `x`'s memory described through its type's exchange table, with dlbridge's current stream
/// ordered after the producer's. `None` where this path does not apply and the owning export
/// ([`take_via_table`]) should answer instead: a table without
/// `dltensor_from_py_object_no_sync`, a type whose instances may be read-only (a descriptor
/// carries no flags, so only types with PyTorch's tensor-state API, which DLPack never marks
/// read-only, and not immutable by contract, take this path), memory that is not host or CUDA device memory, a producer
/// that refused, or streams the table cannot order.
///
/// This is the argument path ([`crate::ArrayArg`]): the memory stays valid while `x` lives
/// unchanged, which holds for a call's arguments as it does for NumPy's own struct. The
/// producer's tensor states are checked here, once the descriptor has told the element type
/// (the conjugate bit exists only on complex tensors).
pub(crate) fn borrow_via_table(
    x: &Bound<'_, PyAny>,
    info: TypeInfo,
) -> Option<PyResult<TableView>> {
    use crate::exchange::kind::{States, refuse_inexpressible};
    use dlbridge::dlpack::ffi::{K_DL_COMPLEX, K_DL_CPU, K_DL_CUDA};
    if !info.has_tensor_state || info.immutable {
        return None;
    }
    let api = info.table()?;
    let describe = api.dltensor_from_py_object_no_sync?;
    let mut dl = std::mem::MaybeUninit::<DLTensor>::zeroed();
    // SAFETY: `x` is an object of the type the table was found on, as the protocol requires; the
    // GIL is held; `dl` is a valid place for the descriptor.
    let rc = unsafe { describe(x.as_ptr().cast(), dl.as_mut_ptr()) };
    if rc != 0 {
        // The owning export, then `__dlpack__`, give the answer the standard specifies.
        drop(PyErr::take(x.py()));
        return None;
    }
    // SAFETY: the producer filled it (rc 0).
    let dl = unsafe { dl.assume_init() };
    if !matches!(dl.device.device_type, K_DL_CPU | K_DL_CUDA) {
        return None;
    }
    // Read (and copied) at once: `shape` and `strides` point into the producer's tensor, and the
    // state checks below call into Python, which could change it.
    // SAFETY: the producer just filled the descriptor, and nothing has run since.
    let described = unsafe { dlbridge::dlpack::describe_borrowed(&dl, api.header.version) };
    let states = if dl.dtype.code == K_DL_COMPLEX {
        States::Values
    } else {
        States::RealValues
    };
    if let Err(err) = refuse_inexpressible(x, info, states) {
        return Some(Err(err));
    }
    let described = match described {
        Ok(described) => described,
        Err(err) => return Some(Err(to_py(err))),
    };
    match order_after_producer(api, dl.device) {
        Ok(()) => {}
        // No way to order the streams through the table: `__dlpack__` (with `stream=`) does it.
        Err(None) => return None,
        Err(Some(err)) => return Some(Err(err)),
    }
    // The memory is used without a tensor (a device pointer, a slice): ask the backend now
    // whether it is what the descriptor says, as making a tensor would.
    if let Err(err) = described.validate() {
        return Some(Err(to_py(err)));
    }
    Some(Ok(TableView {
        obj: x.clone().unbind(),
        described: Box::new(described),
    }))
}

/// Orders dlbridge's current stream after the producer's current work stream for a tensor on
/// `device`. `Err(None)` means this cannot be done here and the caller should fall back to
/// `__dlpack__`; `Err(Some(e))` is a real failure.
fn order_after_producer(
    api: &DLPackExchangeAPI,
    device: dlbridge::dlpack::ffi::DLDevice,
) -> Result<(), Option<PyErr>> {
    use dlbridge::dlpack::ffi::{K_DL_CPU, K_DL_CUDA, K_DL_CUDA_HOST, K_DL_CUDA_MANAGED};
    match device.device_type {
        K_DL_CPU => Ok(()),
        K_DL_CUDA | K_DL_CUDA_HOST | K_DL_CUDA_MANAGED => {
            let Some(current_work_stream) = api.current_work_stream else {
                return Err(None);
            };
            let mut producer: *mut c_void = std::ptr::null_mut();
            // SAFETY: the table's function, called with the GIL held and a valid out-pointer.
            let rc =
                unsafe { current_work_stream(device.device_type, device.device_id, &mut producer) };
            if rc != 0 {
                // SAFETY: the GIL is held (we are inside a Python call).
                let py = unsafe { Python::assume_attached() };
                drop(PyErr::take(py));
                return Err(None);
            }
            let device = Device::from_dlpack(device).map_err(|e| Some(to_py(e)))?;
            dlbridge::backend::order_after_producer(device, producer.expose_provenance())
                .map_err(|e| Some(to_py(e)))
        }
        _ => Err(None),
    }
}

// ---------------------------------------------------------------------------------------------
// Producer side.

/// Restores `err` as the current Python exception and returns -1, as the protocol asks.
fn fail(py: Python<'_>, err: PyErr) -> c_int {
    err.restore(py);
    -1
}

unsafe extern "C" fn allocator(
    prototype: *mut DLTensor,
    out: *mut *mut DLManagedTensorVersioned,
    error_ctx: *mut c_void,
    set_error: Option<unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char)>,
) -> c_int {
    let result =
        std::panic::catch_unwind(|| -> dlbridge::Result<NonNull<DLManagedTensorVersioned>> {
            // SAFETY: the caller passes a readable prototype whose `shape` has `ndim` entries.
            let proto = unsafe { &*prototype };
            let ndim = usize::try_from(proto.ndim)
                .map_err(|_| dlbridge::Error::MalformedTensor(format!("ndim {}", proto.ndim)))?;
            let shape = (0..ndim)
                // SAFETY: `ndim` entries, per the protocol.
                .map(|i| usize::try_from(unsafe { proto.shape.wrapping_add(i).read() }))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| dlbridge::Error::MalformedTensor("negative extent".into()))?;
            let dtype = DType::from_dlpack(proto.dtype)?;
            let device = Device::from_dlpack(proto.device)?;
            let tensor = Tensor::empty(&shape, dtype, device)?;
            Ok(tensor.to_dlpack_versioned(dlbridge::dlpack::VERSION, false))
        });
    let message = match result {
        Ok(Ok(managed)) => {
            // SAFETY: `out` is a valid place for the result, per the protocol.
            unsafe { *out = managed.as_ptr() };
            return 0;
        }
        Ok(Err(e)) => (e.kind(), e.to_string()),
        Err(_) => (
            dlbridge::ErrorKind::Runtime,
            "dlbridge panicked while allocating".to_owned(),
        ),
    };
    let kind = exception_name(message.0);
    let text = std::ffi::CString::new(message.1.replace('\0', " ")).unwrap_or_default();
    if let Some(set_error) = set_error {
        // SAFETY: the caller's error callback, with its context and NUL-terminated strings that
        // live across the call.
        unsafe { set_error(error_ctx, kind.as_ptr(), text.as_ptr()) };
    }
    -1
}

/// A frozen Python class whose instances hold a dlbridge tensor, and whose type publishes an
/// [`ExchangeTable`] of its own: `dlbridge_pyo3::PyTensor`, `dlbridge.Array`.
pub trait TensorClass: PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync {
    /// Runs `f` on the instance's tensor, or fails (an array whose memory was freed, say).
    fn with_tensor<R>(&self, f: impl FnOnce(&Tensor) -> R) -> PyResult<R>;

    /// A new instance holding `tensor`.
    fn new_object(py: Python<'_>, tensor: Tensor) -> PyResult<Py<PyAny>>;
}

/// Runs `f` on the tensor of the `P` instance `py_object`, after the "NoSync" handoff (no stream
/// is named: the consumer orders itself after [`current_work_stream`]; Metal, which has no
/// stream, still waits for our work). One read of the object, no reference-count traffic: the
/// table's exports are on the path a consumer takes for every tensor.
///
/// # Safety
/// The GIL must be held and `py_object` must be a live object the caller keeps alive for the call.
unsafe fn with_tensor<P: TensorClass>(py_object: *mut c_void, f: impl FnOnce(&Tensor)) -> c_int {
    // SAFETY: the protocol calls the table with the GIL held.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: a live object the caller holds for the whole call; borrowed, not owned.
    let obj = unsafe { pyo3::Borrowed::from_ptr(py, py_object.cast::<ffi::PyObject>()) };
    let object = match obj.cast::<P>() {
        Ok(object) => object,
        Err(e) => return fail(py, e.into()),
    };
    let done = object.get().with_tensor(|tensor| {
        let device = tensor.device();
        if device.kind() == dlbridge::DeviceKind::Metal {
            py.detach(|| dlbridge::backend::export_handoff(device, None))
                .map_err(to_py)?;
        }
        f(tensor);
        Ok(())
    });
    match done.and_then(|r| r) {
        Ok(()) => 0,
        Err(e) => fail(py, e),
    }
}

unsafe extern "C" fn from_py_object<P: TensorClass>(
    py_object: *mut c_void,
    out: *mut *mut DLManagedTensorVersioned,
) -> c_int {
    let write = |t: &Tensor| {
        let managed = t.to_dlpack_versioned(dlbridge::dlpack::VERSION, false);
        // SAFETY: `out` is a valid place for the result, per the protocol.
        unsafe { *out = managed.as_ptr() };
    };
    // SAFETY: the caller passes a live object with the GIL held (the protocol's contract).
    unsafe { with_tensor::<P>(py_object, write) }
}

unsafe extern "C" fn dltensor_from_py_object<P: TensorClass>(
    py_object: *mut c_void,
    out: *mut DLTensor,
) -> c_int {
    // The object is alive while the caller holds `py_object`, and its view never changes (a
    // `dlbridge.Array` is ended only by `Backend.free`, which the caller must not race with its
    // own use), so the shape and strides its layout owns stay put, as the protocol asks.
    let write = |t: &Tensor| {
        // SAFETY: `out` is a valid, writable `DLTensor`, per the protocol.
        unsafe { *out = t.borrowed_descriptor() };
    };
    // SAFETY: the caller passes a live object with the GIL held (the protocol's contract).
    unsafe { with_tensor::<P>(py_object, write) }
}

unsafe extern "C" fn to_py_object<P: TensorClass>(
    tensor: *mut DLManagedTensorVersioned,
    out_py_object: *mut *mut c_void,
) -> c_int {
    // SAFETY: the protocol calls this with the GIL held.
    let py = unsafe { Python::assume_attached() };
    let Some(managed) = NonNull::new(tensor) else {
        return fail(py, PyBufferError::new_err("NULL tensor"));
    };
    // SAFETY: the caller hands over ownership of a live tensor.
    let imported = unsafe { Tensor::from_dlpack_versioned(managed) };
    match imported.map_err(to_py).and_then(|t| P::new_object(py, t)) {
        Ok(obj) => {
            // SAFETY: `out_py_object` is a valid place; the new reference goes to the caller.
            unsafe { *out_py_object = obj.into_ptr().cast() };
            0
        }
        Err(e) => fail(py, e),
    }
}

unsafe extern "C" fn current_work_stream(
    device_type: DLDeviceType,
    device_id: i32,
    out: *mut *mut c_void,
) -> c_int {
    // The calling thread's current dlbridge stream on a CUDA device (NULL is the legacy default
    // stream); devices without streams have none.
    let stream = Device::from_dlpack(dlbridge::dlpack::ffi::DLDevice {
        device_type,
        device_id,
    })
    .map_or(0, dlbridge::backend::current_stream);
    // SAFETY: `out` is a valid place for the result.
    unsafe { *out = std::ptr::with_exposed_provenance_mut(stream) };
    0
}

/// The DLPack 1.3 C exchange table of a [`TensorClass`]: keep it in a `static`, so it lives for
/// the whole process as the protocol requires, and publish [`ExchangeTable::capsule`] as the
/// class's `__dlpack_c_exchange_api__`.
///
/// ```
/// use dlbridge::Tensor;
/// use dlbridge_pyo3::exchange::c_api::{ExchangeTable, TensorClass};
/// use pyo3::prelude::*;
///
/// #[pyclass(frozen)]
/// struct MyArray(Tensor);
///
/// impl TensorClass for MyArray {
///     fn with_tensor<R>(&self, f: impl FnOnce(&Tensor) -> R) -> PyResult<R> {
///         Ok(f(&self.0))
///     }
///     fn new_object(py: Python<'_>, tensor: Tensor) -> PyResult<Py<PyAny>> {
///         Ok(Py::new(py, MyArray(tensor))?.into_any())
///     }
/// }
///
/// static TABLE: ExchangeTable = ExchangeTable::new::<MyArray>();
///
/// #[pymethods]
/// impl MyArray {
///     #[classattr]
///     fn __dlpack_c_exchange_api__(py: Python<'_>) -> PyResult<Py<PyAny>> {
///         TABLE.capsule(py)
///     }
/// }
/// # Python::attach(|py| {
/// #     let ty = py.get_type::<MyArray>();
/// #     assert!(ty.getattr("__dlpack_c_exchange_api__").is_ok());
/// # });
/// ```
pub struct ExchangeTable(DLPackExchangeAPI);

// SAFETY: the table is immutable and holds only function pointers and a NULL chain pointer.
unsafe impl Sync for ExchangeTable {}

impl ExchangeTable {
    /// The table whose exports take `P` instances and whose imports make them.
    pub const fn new<P: TensorClass>() -> Self {
        ExchangeTable(DLPackExchangeAPI {
            header: DLPackExchangeAPIHeader {
                version: dlbridge::dlpack::VERSION,
                prev_api: std::ptr::null_mut(),
            },
            managed_tensor_allocator: Some(allocator),
            managed_tensor_from_py_object_no_sync: Some(from_py_object::<P>),
            managed_tensor_to_py_object_no_sync: Some(to_py_object::<P>),
            dltensor_from_py_object_no_sync: Some(dltensor_from_py_object::<P>),
            current_work_stream: Some(current_work_stream),
        })
    }

    /// The capsule (named `dlpack_exchange_api`) to publish as `__dlpack_c_exchange_api__`.
    pub fn capsule(&'static self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let ptr = (&raw const self.0).cast_mut().cast::<c_void>();
        // SAFETY: the pointer is to a static that outlives every capsule; the name is static; no
        // destructor is needed.
        let raw = unsafe { ffi::PyCapsule_New(ptr, API_NAME.as_ptr(), None) };
        if raw.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: a new, owned reference.
        Ok(unsafe { Bound::from_owned_ptr(py, raw) }.unbind())
    }
}
