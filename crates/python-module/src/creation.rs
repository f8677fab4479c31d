//! Creation functions and conversion of arbitrary Python objects to tensors.

use dlbridge::dlpack::{ImportRequest, Imported};
use dlbridge::{DType, Device, StorageMode, Tensor};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PySequence, PyTuple};
use smallvec::SmallVec;

use crate::array::PyArray;
use crate::convert::{self, ScalarKind};
use crate::device;
use crate::dlpack::{buffer, consumer, kind};
use crate::errors::IntoPyResult;
use crate::fastcall::{self, Attach, FastArgs, MethodDef, Signature};

/// A parsed shape (inline up to eight axes: parsing allocates nothing on the common path).
pub(crate) type Shape = SmallVec<[usize; 8]>;

/// Reads a shape: an int or a sequence of non-negative ints.
#[inline]
pub(crate) fn parse_shape(obj: &Bound<'_, PyAny>) -> PyResult<Shape> {
    // Fast paths without a failed conversion (a raised and discarded exception costs more than
    // the whole allocation): an int, or a tuple of ints.
    if obj.is_instance_of::<PyInt>() {
        return Ok(smallvec::smallvec![extent(obj.extract::<i64>()?)?]);
    }
    parse_shape_sequence(obj)
}

/// An extent of a shape: a non-negative int.
#[inline]
fn extent(d: i64) -> PyResult<usize> {
    usize::try_from(d).map_err(|_| PyValueError::new_err(format!("negative extent {d} in shape")))
}

/// [`parse_shape`] of anything but an int.
fn parse_shape_sequence(obj: &Bound<'_, PyAny>) -> PyResult<Shape> {
    if let Ok(t) = obj.cast::<PyTuple>() {
        if t.iter().all(|d| d.is_instance_of::<PyInt>()) {
            return t.iter().map(|d| extent(d.extract::<i64>()?)).collect();
        }
    }
    let dims: Vec<i64> = if let Ok(n) = obj.extract::<i64>() {
        vec![n]
    } else if obj.cast::<PySequence>().is_ok() {
        obj.extract()
            .map_err(|_| PyTypeError::new_err("a shape is a sequence of integers"))?
    } else {
        return Err(PyTypeError::new_err(format!(
            "a shape is an integer or a sequence of integers, not {}",
            obj.get_type().name()?
        )));
    };
    dims.into_iter().map(extent).collect()
}

#[inline]
fn parse_opt_dtype(dtype: Option<&Bound<'_, PyAny>>) -> PyResult<Option<DType>> {
    match dtype {
        Some(d) if !d.is_none() => Ok(Some(crate::dtype::parse(d)?)),
        _ => Ok(None),
    }
}

/// Where a new array goes: `device` (default CPU) with `storage` applied.
pub(crate) fn placement(
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<(Device, Option<StorageMode>)> {
    let device = device::parse_opt(device)?.unwrap_or(Device::CPU);
    let storage = device::parse_storage(storage)?;
    Ok((dlbridge::backend::placement(device, storage).py()?, storage))
}

/// A new compact array; the dtype defaults to float32 and the device to the CPU. Unless `zeroed`,
/// the contents are undefined.
#[inline(always)]
fn allocate(
    shape: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
    zeroed: bool,
) -> PyResult<Tensor> {
    let dtype = parse_opt_dtype(dtype)?.unwrap_or(DType::F32);
    let (device, storage) = match (device, storage) {
        // The common call needs no parsing: the CPU in its default storage.
        (None, None) => (Device::CPU, None),
        _ => placement(device, storage)?,
    };
    let extents = parse_shape(shape)?;
    // Before the allocation, which reads `DLBRIDGE_STORAGE_MODE` if nothing has yet: reading it
    // here instead changes nothing, and the tensor then moves straight to the caller.
    crate::memory::warn_env_once(shape.py())?;
    Tensor::allocate(&extents, dtype, device, storage, zeroed).map_err(crate::errors::to_py)
}

/// The parameters of `dlbridge.empty`.
static EMPTY_SIGNATURE: Signature<4> =
    Signature::new("empty", ["shape", "dtype", "device", "storage"], 0, 2, 1);

/// `dlbridge.empty`, registered by hand as a fastcall function (see [`crate::fastcall`]): the
/// allocation benchmark's subject, 0.214 µs an allocation and free from the pool against 0.272 µs
/// through PyO3 (`python bench/bench_pool.py --devices cpu`; `numpy.empty`'s: 0.188 µs).
pub(crate) static EMPTY: MethodDef = MethodDef::new(
    c"empty",
    c"empty(shape, dtype=None, *, device=None, storage=None)\n--\n\n\
      A new array with undefined contents. The default dtype is float32 (NumPy's is float64), \
      the default device the CPU, the default storage the device's (or DLBRIDGE_STORAGE_MODE's).",
    empty_fastcall,
);

unsafe extern "C" fn empty_fastcall(
    _module: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargsf: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    // SAFETY: CPython is calling this function with these arguments.
    let args = unsafe { FastArgs::new(args, nargsf, kwnames) };
    // The body releases only objects it made (`Attach::Assumed`).
    EMPTY_SIGNATURE.call(
        args,
        Attach::Assumed,
        |py, [shape, dtype, device, storage]| {
            let shape = shape.expect("`shape` is required, so parse checked it was given");
            let storage = fastcall::opt_str(storage, "storage")?;
            let t = allocate(
                shape,
                dtype,
                fastcall::opt(device),
                storage.as_deref(),
                false,
            )?;
            Ok(Bound::new(py, PyArray::new(t))?.into_any())
        },
    )
}

/// A new zero-filled array. The default dtype is float32 (NumPy's is float64); the default device
/// is the CPU.
#[pyfunction]
#[pyo3(signature = (shape, dtype=None, *, device=None, storage=None))]
pub(crate) fn zeros(
    shape: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    allocate(shape, dtype, device, storage, true).map(PyArray::new)
}

/// A new array filled with `fill_value`; the dtype defaults to the value's kind: bool, int64,
/// float32 for a float (NumPy gives float64) and complex64.
#[pyfunction]
#[pyo3(signature = (shape, fill_value, dtype=None, *, device=None, storage=None))]
pub(crate) fn full(
    shape: &Bound<'_, PyAny>,
    fill_value: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    let kind = convert::scalar_kind(fill_value)
        .ok_or_else(|| PyTypeError::new_err("fill_value must be a number or a bool"))?;
    let dtype = parse_opt_dtype(dtype)?.unwrap_or(kind.default_dtype());
    let (device, storage) = placement(device, storage)?;
    let mut element = Vec::with_capacity(dtype.itemsize());
    convert::write_element(dtype, fill_value, &mut element)?;
    let t = Tensor::allocate(&parse_shape(shape)?, dtype, device, storage, false).py()?;
    crate::memory::warn_env_once(shape.py())?;
    // SAFETY: `t` is new memory that nothing else references.
    unsafe { t.fill_bytes_unchecked(&element) }.py()?;
    Ok(PyArray::new(t))
}

/// Evenly spaced values in `[start, stop)`. Integers give int64 unless `dtype` says otherwise;
/// any float gives float32 (NumPy gives float64).
#[pyfunction]
#[pyo3(signature = (start, stop=None, step=None, *, dtype=None, device=None, storage=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn arange(
    py: Python<'_>,
    start: &Bound<'_, PyAny>,
    stop: Option<&Bound<'_, PyAny>>,
    step: Option<&Bound<'_, PyAny>>,
    dtype: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    let (start, stop) = match stop.filter(|s| !s.is_none()) {
        Some(stop) => (start.clone(), stop.clone()),
        None => (0i64.into_pyobject(py)?.into_any(), start.clone()),
    };
    let step = match step.filter(|s| !s.is_none()) {
        Some(s) => s.clone(),
        None => 1i64.into_pyobject(py)?.into_any(),
    };
    let all_int = [&start, &stop, &step].iter().all(|v| {
        matches!(
            convert::scalar_kind(v),
            Some(ScalarKind::Int | ScalarKind::Bool)
        )
    });
    let dtype = parse_opt_dtype(dtype)?.unwrap_or(if all_int { DType::I64 } else { DType::F32 });
    let (device, storage) = placement(device, storage)?;
    if all_int {
        let (a, b, s): (i128, i128, i128) = (start.extract()?, stop.extract()?, step.extract()?);
        if s == 0 {
            return Err(PyValueError::new_err("arange step cannot be zero"));
        }
        let span = b
            .checked_sub(a)
            .ok_or_else(|| PyOverflowError::new_err("arange bounds are too far apart"))?;
        // Values between the bounds fit in `i128`, so no step below overflows.
        let count = if span != 0 && (span > 0) == (s > 0) {
            (span.unsigned_abs() - 1) / s.unsigned_abs() + 1
        } else {
            0
        };
        let count = arange_length(count, dtype)?;
        let t = build_compact(&[count], dtype, device, storage, |i, out| {
            let v = (a + i as i128 * s).into_pyobject(py)?;
            convert::write_element(dtype, v.as_any(), out)
        })?;
        Ok(PyArray::new(t))
    } else {
        let (a, b, s): (f64, f64, f64) = (start.extract()?, stop.extract()?, step.extract()?);
        if s == 0.0 || !s.is_finite() || !a.is_finite() || !b.is_finite() {
            return Err(PyValueError::new_err(
                "arange needs finite bounds and a non-zero step",
            ));
        }
        let n = ((b - a) / s).ceil();
        // `as` saturates: a length beyond `u128` is refused below like any other too-long one.
        let count = arange_length(if n > 0.0 { n as u128 } else { 0 }, dtype)?;
        let t = build_compact(&[count], dtype, device, storage, |i, out| {
            let v = (a + i as f64 * s).into_pyobject(py)?;
            convert::write_element(dtype, v.as_any(), out)
        })?;
        Ok(PyArray::new(t))
    }
}

/// The length of an `arange` as an extent; longer than an address space holds is the `ValueError`
/// `empty` gives for such sizes.
fn arange_length(count: u128, dtype: DType) -> PyResult<usize> {
    usize::try_from(count)
        .map_err(|_| dlbridge::Error::Overflow(format!("size of an arange of {count} {dtype}")))
        .py()
}

/// A compact tensor of `shape` and `dtype` on `device` (in `storage`), its elements written one by
/// one in row-major order by `element(index, out)`, which appends one element's native-order
/// bytes to `out`. The elements are written into dlbridge memory on the host (taken from the pool,
/// so an impossible size is a `MemoryError` naming the size, never an abort; a size beyond the
/// address space is the `ValueError` of `empty`) and then copied to
/// `device` when that is not the host.
fn build_compact(
    shape: &[usize],
    dtype: DType,
    device: Device,
    storage: Option<StorageMode>,
    mut element: impl FnMut(usize, &mut Vec<u8>) -> PyResult<()>,
) -> PyResult<Tensor> {
    let count = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let itemsize = dtype.itemsize();
    let nbytes = count
        .and_then(|n| n.checked_mul(itemsize))
        .ok_or_else(|| dlbridge::Error::Overflow(format!("size of {shape:?} {dtype}")))
        .py()?;
    let mut host = Tensor::empty(&[nbytes], DType::U8, Device::CPU).py()?;
    // SAFETY: creation functions run inside Python calls, with the GIL held.
    crate::memory::warn_env_once(unsafe { Python::assume_attached() })?;
    let bytes = host.as_mut_slice::<u8>().py()?;
    let mut scratch = Vec::with_capacity(16);
    for (i, slot) in bytes.chunks_exact_mut(itemsize).enumerate() {
        scratch.clear();
        element(i, &mut scratch)?;
        slot.copy_from_slice(&scratch);
    }
    let typed = Tensor::new(
        host.buffer().clone(),
        dtype,
        dlbridge::Layout::contiguous(shape).py()?,
    )
    .py()?;
    if device.is_cpu() {
        Ok(typed)
    } else {
        typed.copy_to_storage(device, storage).py()
    }
}

/// Imports a DLPack producer or capsule, then applies `device`, `storage` and `copy`.
///
/// A copy asked for of a producer is made here, by dlbridge, after a zero-copy import: a copy the
/// producer made (`__dlpack__(copy=True)`) would be the producer's memory, marked foreign, which
/// `Backend.free` refuses although the caller asked for new memory. (A capsule handed over
/// already marked `IS_COPIED` is trusted and not copied again.)
fn import_dlpack(
    obj: &Bound<'_, PyAny>,
    device: Option<Device>,
    storage: Option<StorageMode>,
    copy: Option<bool>,
) -> PyResult<Tensor> {
    let request = ImportRequest {
        device,
        storage,
        copy,
    };
    let producer = !obj.is_instance_of::<pyo3::types::PyCapsule>();
    let copy_here = copy == Some(true) && producer;
    if !copy_here {
        return consumer::from_dlpack(obj, device, storage, copy).map(|i| i.tensor);
    }
    // The producer's memory, shared: the copy asked for is made here.
    let imported = consumer::from_dlpack(obj, None, None, None)?;
    request
        .finish(Imported {
            tensor: imported.tensor,
            copied: false,
        })
        .py()
        .map(|i| i.tensor)
}

/// Converts any supported object to a tensor: a dlbridge array, a DLPack capsule or producer
/// (zero-copy), a buffer-protocol object (zero-copy), or nested sequences of scalars (copied).
/// A `dtype` other than the source's converts (a copy); so does a Metal `storage` mode other than
/// the source's.
pub(crate) fn tensor_from(
    obj: &Bound<'_, PyAny>,
    dtype: Option<DType>,
    device: Option<Device>,
    storage: Option<StorageMode>,
    copy: Option<bool>,
) -> PyResult<Tensor> {
    let py = obj.py();
    let request = ImportRequest {
        device,
        storage,
        copy,
    };
    let zero_copy_source = if let Ok(a) = obj.cast::<PyArray>() {
        Some(consumer::finish(&request, a.get().tensor()?.clone())?.tensor)
    } else if obj.is_instance_of::<pyo3::types::PyCapsule>()
        || obj.hasattr(intern!(py, "__dlpack__"))?
    {
        Some(import_dlpack(obj, device, storage, copy)?)
    } else if !obj.is_instance_of::<PyList>()
        && !obj.is_instance_of::<PyTuple>()
        && buffer::has_buffer(obj)
    {
        let info = kind::type_info(obj);
        consumer::refuse_inexpressible(obj, info, consumer::States::All)?;
        let t = buffer::from_buffer(obj)?;
        Some(consumer::finish(&request, t)?.tensor)
    } else {
        None
    };
    if let Some(t) = zero_copy_source {
        return match dtype {
            Some(d) if d != t.dtype() => {
                if copy == Some(false) {
                    return Err(dlbridge::Error::CopyRequired(format!(
                        "converting {} to {d} needs a copy, but copy=False",
                        t.dtype()
                    )))
                    .py();
                }
                // The one cast, `Array.astype`'s: on the array's own device.
                obj.py().detach(|| dlbridge::compute::cast(&t, d)).py()
            }
            _ => Ok(t),
        };
    }
    if copy == Some(false) {
        return Err(dlbridge::Error::CopyRequired(format!(
            "a {} cannot be shared without a copy, but copy=False",
            obj.get_type().name()?
        )))
        .py();
    }
    let nested = convert::flatten(obj)?;
    let dtype = dtype.unwrap_or(nested.kind.default_dtype());
    build_compact(
        &nested.shape,
        dtype,
        device.unwrap_or(Device::CPU),
        storage,
        |i, out| convert::write_element(dtype, &nested.leaves[i], out),
    )
}

/// Converts `obj` to a dlbridge array, without copying where possible (array API `asarray`).
/// Arrays keep their dtype; nested sequences of Python numbers default to bool, int64, float32
/// (NumPy gives float64) or complex64 by their kind.
#[pyfunction]
#[pyo3(signature = (obj, /, dtype=None, *, device=None, copy=None, storage=None))]
pub(crate) fn asarray(
    obj: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    copy: Option<bool>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    let dtype = parse_opt_dtype(dtype)?;
    let (device, storage) = match storage {
        None => (device::parse_opt(device)?, None),
        Some(_) => {
            let (device, storage) = placement(device, storage)?;
            (Some(device), storage)
        }
    };
    Ok(PyArray::new(tensor_from(
        obj, dtype, device, storage, copy,
    )?))
}

/// The parameters of `dlbridge.from_dlpack`.
static FROM_DLPACK_SIGNATURE: Signature<3> =
    Signature::new("from_dlpack", ["x", "device", "copy"], 1, 1, 1);

/// `dlbridge.from_dlpack`, registered by hand as a fastcall function (see [`crate::fastcall`]):
/// 0.537 µs an import of a PyTorch tensor against 0.581 µs through PyO3 (`python bench/bench_cpu.py`).
pub(crate) static FROM_DLPACK: MethodDef = MethodDef::new(
    c"from_dlpack",
    c"from_dlpack(x, /, *, device=None, copy=None)\n--\n\n\
      Imports any DLPack producer (or capsule) without copying (array API from_dlpack): \
      copy=True gives independent memory, copy=False raises BufferError where a copy is needed, \
      device moves the result (a copy unless it is already there).",
    from_dlpack_fastcall,
);

unsafe extern "C" fn from_dlpack_fastcall(
    _module: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargsf: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    // SAFETY: CPython is calling this function with these arguments.
    let args = unsafe { FastArgs::new(args, nargsf, kwnames) };
    // The body may release a foreign producer, whose deleter must run at once.
    FROM_DLPACK_SIGNATURE.call(args, Attach::Counted, |py, [x, device, copy]| {
        let x = x.expect("`x` is required, so parse checked it was given");
        let device = device::parse_opt(device)?;
        let copy = fastcall::opt_bool(copy, "copy")?;
        let t = import_dlpack(x, device, None, copy)?;
        Ok(Bound::new(py, PyArray::new(t))?.into_any())
    })
}

/// A new array filled with ones. The default dtype is float32 (NumPy's is float64); the default
/// device is the CPU.
#[pyfunction]
#[pyo3(signature = (shape, dtype=None, *, device=None, storage=None))]
pub(crate) fn ones(
    shape: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    let dtype = parse_opt_dtype(dtype)?.unwrap_or(DType::F32);
    let (device, storage) = placement(device, storage)?;
    let one = 1i64.into_pyobject(shape.py())?;
    filled(
        &parse_shape(shape)?,
        dtype,
        device,
        storage,
        Some(one.as_any()),
    )
    .map(PyArray::new)
}

/// A new array of `shape` on `device`, filled with `value` converted to `dtype` (`None`: zeros).
fn filled(
    shape: &[usize],
    dtype: DType,
    device: Device,
    storage: Option<StorageMode>,
    value: Option<&Bound<'_, PyAny>>,
) -> PyResult<Tensor> {
    let Some(value) = value else {
        return Tensor::allocate(shape, dtype, device, storage, true).py();
    };
    let mut element = Vec::with_capacity(dtype.itemsize());
    convert::write_element(dtype, value, &mut element)?;
    let t = Tensor::allocate(shape, dtype, device, storage, false).py()?;
    // SAFETY: `t` is new memory that nothing else references.
    unsafe { t.fill_bytes_unchecked(&element) }.py()?;
    Ok(t)
}

/// How a `*_like` function fills its new array.
enum Fill<'a, 'py> {
    Empty,
    Zeros,
    Value(&'a Bound<'py, PyAny>),
}

/// A new array like `a` (any array `asarray` takes): `a`'s shape, dtype, device and storage mode
/// unless `shape`, `dtype`, `device` or `storage` say otherwise, filled as `fill` says.
fn like(
    a: &Bound<'_, PyAny>,
    fill: Fill<'_, '_>,
    dtype: Option<&Bound<'_, PyAny>>,
    shape: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    let source = tensor_from(a, None, None, None, None)?;
    let dtype = parse_opt_dtype(dtype)?.unwrap_or(source.dtype());
    let shape: Shape = match shape.filter(|s| !s.is_none()) {
        Some(s) => parse_shape(s)?,
        None => source.shape().iter().copied().collect(),
    };
    let (device, storage) = if device.is_none_or(|d| d.is_none()) && storage.is_none() {
        // Where `a` is, in its storage mode.
        (source.device(), Some(source.buffer().storage_mode()))
    } else {
        let device = device::parse_opt(device)?.unwrap_or(source.device());
        let storage = device::parse_storage(storage)?;
        (dlbridge::backend::placement(device, storage).py()?, storage)
    };
    crate::memory::warn_env_once(a.py())?;
    let t = match fill {
        Fill::Empty => Tensor::allocate(&shape, dtype, device, storage, false).py()?,
        Fill::Zeros => filled(&shape, dtype, device, storage, None)?,
        Fill::Value(v) => filled(&shape, dtype, device, storage, Some(v))?,
    };
    Ok(PyArray::new(t))
}

/// A zero-filled array with `a`'s shape, dtype, device and storage mode (each may be overridden).
#[pyfunction]
#[pyo3(signature = (a, dtype=None, *, shape=None, device=None, storage=None))]
pub(crate) fn zeros_like(
    a: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    shape: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    like(a, Fill::Zeros, dtype, shape, device, storage)
}

/// An array of ones with `a`'s shape, dtype, device and storage mode (each may be overridden).
#[pyfunction]
#[pyo3(signature = (a, dtype=None, *, shape=None, device=None, storage=None))]
pub(crate) fn ones_like(
    a: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    shape: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    let one = 1i64.into_pyobject(a.py())?;
    like(a, Fill::Value(one.as_any()), dtype, shape, device, storage)
}

/// An array with undefined contents and `a`'s shape, dtype, device and storage mode (each may be
/// overridden).
#[pyfunction]
#[pyo3(signature = (a, dtype=None, *, shape=None, device=None, storage=None))]
pub(crate) fn empty_like(
    a: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    shape: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    like(a, Fill::Empty, dtype, shape, device, storage)
}

/// An array filled with `fill_value` (converted to the dtype as `full` converts it) with `a`'s
/// shape, dtype, device and storage mode (each may be overridden).
#[pyfunction]
#[pyo3(signature = (a, fill_value, dtype=None, *, shape=None, device=None, storage=None))]
pub(crate) fn full_like(
    a: &Bound<'_, PyAny>,
    fill_value: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    shape: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<PyArray> {
    if convert::scalar_kind(fill_value).is_none() {
        return Err(PyTypeError::new_err(
            "fill_value must be a number or a bool",
        ));
    }
    like(a, Fill::Value(fill_value), dtype, shape, device, storage)
}
