//! `bfloat16` and the `float8` types in NumPy, through the `ml_dtypes` package: the one
//! implementation, used by every extension on this crate ([`ArrayArg`](crate::ArrayArg),
//! [`to_framework`](crate::to_framework)) and by dlbridge's own (`dlbridge.from_dlpack`,
//! `Array.__array__`).
//!
//! NumPy has no such types, and its DLPack export and import refuse them. `ml_dtypes` registers
//! them as NumPy dtypes of the same names and sizes (user-defined dtypes), so:
//!
//! * an exact `numpy.ndarray` of one is read from NumPy's array struct like any other (its
//!   user-defined type number is looked up once);
//! * any other NumPy array of one (a subclass, a layout the struct path leaves to DLPack) crosses
//!   as unsigned integers of the same width (a NumPy view, through DLPack, zero-copy) whose
//!   elements are then read as the `ml_dtypes` type ([`import_numpy`]);
//! * a tensor of one goes to NumPy the other way round ([`to_numpy`]).

use std::ffi::c_int;
use std::sync::{Mutex, OnceLock};

use dlbridge::dlpack::ImportRequest;
use dlbridge::{DType, DTypeCode, Tensor};
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;

use crate::error::IntoPyResult;
use crate::exchange::c_api::TensorClass;

/// The unsigned integer dtype that carries `dtype`'s bytes, when `dtype` is one `ml_dtypes`
/// names (`bfloat16`, the 8-bit floats) and NumPy has not.
fn carrier(dtype: DType) -> Option<DType> {
    if dtype.lanes() != 1 {
        return None;
    }
    match (dtype.code(), dtype.bits()) {
        (DTypeCode::BFloat, 16) => Some(DType::U16),
        (
            DTypeCode::Float8E3M4
            | DTypeCode::Float8E4M3
            | DTypeCode::Float8E4M3B11Fnuz
            | DTypeCode::Float8E4M3Fn
            | DTypeCode::Float8E4M3Fnuz
            | DTypeCode::Float8E5M2
            | DTypeCode::Float8E5M2Fnuz
            | DTypeCode::Float8E8M0Fnu,
            8,
        ) => Some(DType::U8),
        _ => None,
    }
}

/// The dtype of the NumPy dtype object `np_dtype` when it is one `ml_dtypes` registers (a name
/// dlbridge knows for a type NumPy lacks, the same item size); `None` otherwise. The kind is not
/// asked: `ml_dtypes` gives most of its types kind `'V'`, but `float8_e5m2` kind `'f'`.
fn of_numpy_dtype(np_dtype: &Bound<'_, PyAny>) -> PyResult<Option<DType>> {
    let py = np_dtype.py();
    let name: String = np_dtype.getattr(intern!(py, "name"))?.extract()?;
    let Ok(dtype) = name.parse::<DType>() else {
        return Ok(None);
    };
    let Some(bits) = carrier(dtype) else {
        return Ok(None);
    };
    let itemsize: usize = np_dtype.getattr(intern!(py, "itemsize"))?.extract()?;
    Ok((itemsize == bits.itemsize()).then_some(dtype))
}

/// NumPy's first type number of user-defined dtypes (`NPY_USERDEF`), which `ml_dtypes`' are.
pub(crate) const NPY_USERDEF: c_int = 256;

/// User-defined type numbers seen by [`user_dtype`], with their dtype (`None`: not an
/// `ml_dtypes` type): read without a lock (each slot is set once), appended under [`LEARNING`].
/// A type number names one registered type for the life of the process.
static USER_TYPES: [OnceLock<(c_int, Option<DType>)>; USER_TYPE_LIMIT] =
    [const { OnceLock::new() }; USER_TYPE_LIMIT];

/// Orders the appends to [`USER_TYPES`].
static LEARNING: Mutex<()> = Mutex::new(());

/// At most this many user-defined types are remembered; more are looked up each time.
const USER_TYPE_LIMIT: usize = 32;

/// The dtype of NumPy's user-defined type number `type_num` (at least [`NPY_USERDEF`]), whose
/// dtype object is `descr`, when it is an `ml_dtypes` type; asked of Python once per type number.
pub(crate) fn user_dtype(descr: &Bound<'_, PyAny>, type_num: c_int) -> Option<DType> {
    for slot in &USER_TYPES {
        match slot.get() {
            Some((num, dtype)) if *num == type_num => return *dtype,
            Some(_) => {}
            None => break,
        }
    }
    learn_user_dtype(descr, type_num)
}

#[cold]
fn learn_user_dtype(descr: &Bound<'_, PyAny>, type_num: c_int) -> Option<DType> {
    let dtype = of_numpy_dtype(descr).ok().flatten();
    let _order = LEARNING.lock().unwrap_or_else(|e| e.into_inner());
    if USER_TYPES
        .iter()
        .any(|s| s.get().is_some_and(|(n, _)| *n == type_num))
    {
        return dtype;
    }
    if let Some(slot) = USER_TYPES.iter().find(|s| s.get().is_none()) {
        // The lock is held, so no other thread sets this slot.
        let _ = slot.set((type_num, dtype));
    }
    dtype
}

/// The same view of the same memory with its elements read as `dtype` (of the same size).
fn reinterpret(t: &Tensor, dtype: DType) -> PyResult<Tensor> {
    let view = Tensor::new(t.buffer().clone(), dtype, t.layout().clone()).py()?;
    Ok(if t.is_read_only() {
        view.into_read_only()
    } else {
        view
    })
}

/// A zero-copy import of a NumPy array (or subclass) of an `ml_dtypes` type (`bfloat16`, the
/// 8-bit floats), which NumPy cannot export through DLPack itself: its bytes cross as unsigned
/// integers of the same width and are read as the `ml_dtypes` type (read-only where the array
/// is). `None` for anything else.
pub fn import_numpy(obj: &Bound<'_, PyAny>) -> PyResult<Option<Tensor>> {
    let py = obj.py();
    // Only NumPy arrays (and subclasses): where NumPy is not loaded, there are none (and it is
    // not loaded for the asking).
    let modules = py
        .import(intern!(py, "sys"))?
        .getattr(intern!(py, "modules"))?;
    let Ok(np) = modules.get_item(intern!(py, "numpy")) else {
        return Ok(None);
    };
    if !obj.is_instance(&np.getattr(intern!(py, "ndarray"))?)? {
        return Ok(None);
    }
    let Some(dtype) = of_numpy_dtype(&obj.getattr(intern!(py, "dtype"))?)? else {
        return Ok(None);
    };
    let bits = carrier(dtype).expect("of_numpy_dtype answers only dtypes with a carrier");
    let carried = obj.call_method1(intern!(py, "view"), (bits.name(),))?;
    let info = crate::exchange::kind::type_info(&carried);
    let imported = crate::exchange::consumer::import_from_producer(
        &carried,
        info,
        &ImportRequest::default(),
        || {
            Err(PyTypeError::new_err(
                "numpy.ndarray.view gave an array without __dlpack__",
            ))
        },
    )?;
    reinterpret(&imported.tensor, dtype).map(Some)
}

/// A NumPy view of the host-readable `t` when its dtype is one NumPy lacks and `ml_dtypes`
/// provides (`None` for every other dtype): the bytes go to NumPy as unsigned integers (a `P`
/// instance holding them, through `numpy.from_dlpack`) and are viewed as the `ml_dtypes` type.
/// A `TypeError` says to install `ml_dtypes` when it is missing.
pub fn to_numpy<'py, P: TensorClass>(
    py: Python<'py>,
    t: &Tensor,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(bits) = carrier(t.dtype()) else {
        return Ok(None);
    };
    let name = t.dtype().name();
    let ml = py.import(intern!(py, "ml_dtypes")).map_err(|_| {
        PyTypeError::new_err(format!(
            "NumPy has no {name} type: install ml_dtypes (pip install ml_dtypes), which adds it, \
             or convert first with astype('float32')"
        ))
    })?;
    let target = ml.getattr(name.as_str())?;
    let carried = P::new_object(py, reinterpret(t, bits)?)?;
    let np = py.import(intern!(py, "numpy"))?;
    let raw = np.call_method1(intern!(py, "from_dlpack"), (carried,))?;
    Ok(Some(raw.call_method1(intern!(py, "view"), (target,))?))
}
