//! What the consumer knows of a producer's type before it takes an array from it, looked up once
//! per type ([`type_info`]): its DLPack 1.3 C exchange table, whether it is exactly
//! `numpy.ndarray`, whether its arrays are immutable by contract, and whether its instances can be
//! in states a DLPack descriptor cannot express, which every import path refuses
//! ([`refuse_inexpressible`]). Plain facts of types: this module calls no import path, so the
//! consumer, the C exchange table and the NumPy reader all build on it.

use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, OnceLock};

use dlbridge::dlpack::ffi::{DLPackExchangeAPI, DLPackExchangeAPIHeader};
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyType};
use pyo3::{ffi, intern};

/// The capsule name of a DLPack 1.3 C exchange table.
pub(crate) const API_NAME: &CStr = c"dlpack_exchange_api";

/// What the consumer knows of a producer's type: its exchange table (if any), whether its
/// instances can be in states a DLPack descriptor cannot express or are immutable by contract,
/// and which path its instances take.
#[derive(Clone, Copy)]
pub struct TypeInfo {
    table: Option<TableRef>,
    /// The type has PyTorch's tensor-state API (`requires_grad`, `is_conj`, `is_neg`), so its
    /// instances can require grad or carry lazy bits: [`refuse_inexpressible`]
    /// asks each one.
    pub(crate) has_tensor_state: bool,
    /// The type has `__dlpack__`.
    pub(crate) has_dlpack: bool,
    /// The type is exactly `numpy.ndarray`, whose instance struct NumPy documents
    /// ([`crate::numpy`]).
    pub(crate) is_numpy: bool,
    /// The type's arrays are immutable by contract (JAX's), so their memory is imported
    /// read-only ([`immutable_by_contract`]).
    pub(crate) immutable: bool,
}

impl TypeInfo {
    /// The type's DLPack 1.3 C exchange table, if it publishes one.
    #[inline]
    pub(crate) fn table(self) -> Option<&'static DLPackExchangeAPI> {
        self.table.map(|t| t.0)
    }
}

/// Types seen by the consumer (by the address of the type object), with what is known of them:
/// read without a lock (each slot is set once), appended under [`HELD`].
static TYPES: [OnceLock<(usize, TypeInfo)>; CACHE_LIMIT] = [const { OnceLock::new() }; CACHE_LIMIT];

/// The type objects in [`TYPES`], held so that an address there can never be reused by a
/// different type; its lock orders the appends.
static HELD: Mutex<Vec<Py<PyType>>> = Mutex::new(Vec::new());

/// A producer's exchange table, which the protocol requires to be immutable and alive for the
/// whole process.
#[derive(Clone, Copy)]
struct TableRef(&'static DLPackExchangeAPI);

// SAFETY: the table is immutable for the life of the process (DLPack 1.3 requires it); its raw
// pointers (the chain) are only read.
unsafe impl Send for TableRef {}
// SAFETY: as above.
unsafe impl Sync for TableRef {}

/// At most this many types are remembered; more are looked up each time.
const CACHE_LIMIT: usize = 32;

/// What is known of `type(x)`, looked up once per type.
#[inline]
pub fn type_info(x: &Bound<'_, PyAny>) -> TypeInfo {
    // SAFETY: `x` is a live object, whose type pointer is readable.
    let key = unsafe { ffi::Py_TYPE(x.as_ptr()) } as usize;
    for slot in &TYPES {
        match slot.get() {
            Some((ty, info)) if *ty == key => return *info,
            Some(_) => {}
            None => break,
        }
    }
    learn(x.get_type())
}

/// Looks up what [`type_info`] knows of `ty` and remembers it, while there is room.
#[cold]
fn learn(ty: Bound<'_, PyType>) -> TypeInfo {
    let py = ty.py();
    let has = |name| ty.hasattr(name).unwrap_or(false);
    let info = TypeInfo {
        table: lookup(&ty).map(TableRef),
        has_tensor_state: has(intern!(py, "requires_grad"))
            && has(intern!(py, "is_conj"))
            && has(intern!(py, "is_neg")),
        has_dlpack: has(intern!(py, "__dlpack__")),
        is_numpy: is_ndarray_type(&ty),
        immutable: immutable_by_contract(&ty),
    };
    let key = ty.as_ptr() as usize;
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    if TYPES
        .iter()
        .any(|s| s.get().is_some_and(|(t, _)| *t == key))
    {
        return info;
    }
    if let Some(slot) = TYPES.iter().find(|s| s.get().is_none()) {
        held.push(ty.unbind());
        // The lock is held, so no other thread sets this slot.
        let _ = slot.set((key, info));
    }
    info
}

fn lookup(ty: &Bound<'_, PyType>) -> Option<&'static DLPackExchangeAPI> {
    let py = ty.py();
    let capsule = ty.getattr(intern!(py, "__dlpack_c_exchange_api__")).ok()?;
    let capsule = capsule.cast::<PyCapsule>().ok()?;
    // SAFETY: a live capsule; `IsValid` only compares the name and never raises.
    if unsafe { ffi::PyCapsule_IsValid(capsule.as_ptr(), API_NAME.as_ptr()) } != 1 {
        return None;
    }
    // SAFETY: the name matched, so this returns the stored pointer without raising.
    let header = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), API_NAME.as_ptr()) }
        .cast::<DLPackExchangeAPIHeader>();
    // SAFETY: the DLPack 1.3 protocol requires the table and its chain to live, unchanged, for the
    // whole process.
    unsafe { dlbridge::dlpack::exchange_table_v1(header) }
}

/// `numpy.ndarray` once seen by [`is_ndarray_type`], so later calls know a NumPy array by one
/// pointer comparison. The type cache holds a reference to it, and the type is static in NumPy's
/// library, so the address is never reused by another type.
static NDARRAY: AtomicPtr<ffi::PyTypeObject> = AtomicPtr::new(std::ptr::null_mut());

/// Whether `x` is exactly a `numpy.ndarray` (after the type cache has seen one).
#[inline]
pub(crate) fn is_ndarray(x: &Bound<'_, PyAny>) -> bool {
    // SAFETY: `x` is a live object, whose type pointer is readable.
    let ty = unsafe { ffi::Py_TYPE(x.as_ptr()) };
    ty == NDARRAY.load(Ordering::Relaxed)
}

/// Whether `ty` is exactly `numpy.ndarray` (asked once per type by the type cache).
pub(crate) fn is_ndarray_type(ty: &Bound<'_, PyType>) -> bool {
    let py = ty.py();
    let Ok(numpy) = py.import(intern!(py, "numpy")) else {
        return false;
    };
    let yes = numpy
        .getattr(intern!(py, "ndarray"))
        .is_ok_and(|nd| nd.as_ptr() == ty.as_ptr());
    if yes {
        NDARRAY.store(ty.as_type_ptr(), Ordering::Relaxed);
    }
    yes
}

/// The top-level packages whose array types are immutable by contract, the one list of them
/// ([`immutable_by_contract`]):
///
/// * `jax`, `jaxlib`: JAX arrays (`jaxlib._jax.ArrayImpl` since JAX 0.7,
///   `jaxlib.xla_extension.ArrayImpl` before, both subclasses of `jax.Array`) are immutable, and
///   XLA may share one buffer between arrays or donate it to a computation; JAX's own buffer
///   protocol export is read-only, but its DLPack export is a legacy capsule, which cannot say so.
///
/// MLX is not listed: its arrays have value semantics, but MLX hands out their memory writable on
/// purpose (its buffer protocol export, which its documentation shows written through a NumPy
/// view), so an import keeps the writability MLX itself gives.
const IMMUTABLE_PACKAGES: [&str; 2] = ["jax", "jaxlib"];

/// Whether arrays of type `ty` are immutable by contract: `ty` or a base class is defined in one
/// of [`IMMUTABLE_PACKAGES`]. Asked once per type (the consumer's type cache,
/// [`type_info`]), from the classes' `__module__` alone: nothing is
/// imported.
pub(crate) fn immutable_by_contract(ty: &Bound<'_, PyType>) -> bool {
    let py = ty.py();
    let Ok(mro) = ty.getattr(intern!(py, "__mro__")) else {
        return false;
    };
    let Ok(classes) = mro.try_iter() else {
        return false;
    };
    classes.flatten().any(|class| {
        class
            .getattr(intern!(py, "__module__"))
            .and_then(|m| m.extract::<String>())
            .is_ok_and(|module| {
                let package = module.split('.').next().unwrap_or_default();
                IMMUTABLE_PACKAGES.contains(&package)
            })
    })
}

/// Which tensor states [`refuse_inexpressible`] asks about.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum States {
    /// States in which the memory does not hold the tensor's values, or must not be written
    /// behind its framework's back: requires grad, a lazy conjugate or negative bit. A producer's
    /// exporter may hand such a tensor out without complaint (PyTorch's C exchange table does, and
    /// its `__dlpack__` does for negated views), so these are asked before every import.
    Values,
    /// [`States::Values`] of a tensor known to be real: the conjugate bit exists only on complex
    /// tensors (a real tensor's `conj()` is itself), so it is not asked.
    RealValues,
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
/// tensor-state API are asked ([`TypeInfo`]), and each question is one
/// attribute read or method call, in the order of how common the state is.
pub fn refuse_inexpressible(x: &Bound<'_, PyAny>, info: TypeInfo, states: States) -> PyResult<()> {
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
    let complex = states != States::RealValues;
    let storage = matches!(states, States::Storage | States::All);
    let refusal = if values && flag(intern!(py, "requires_grad")) {
        "it requires grad, and a DLPack consumer could write to it behind autograd's back; \
         export x.detach()"
    } else if values && complex && method(intern!(py, "is_conj")) {
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
