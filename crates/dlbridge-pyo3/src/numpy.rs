//! NumPy arrays read from the instance struct NumPy documents as public C API
//! (`PyArrayObject_fields` and `PyArray_Descr` in `numpy/ndarraytypes.h`): no Python call, no
//! capsule, which is what makes a NumPy argument as cheap as a NumPy-only binding's.
//!
//! Only exact `numpy.ndarray` instances take this path (subclasses may give their data another
//! meaning, such as a mask), and only for the dtypes below and `ml_dtypes`' user-defined ones
//! ([`crate::exchange::ml_dtypes`]) in native byte order; anything else goes through
//! `__dlpack__`, which gives NumPy's own answer.

use std::ffi::{c_char, c_int};

use dlbridge::{DType, Tensor};
use pyo3::ffi;
use pyo3::prelude::*;

/// The leading fields of NumPy's array struct (NumPy 1.x and 2.x alike; the object header is
/// this build's, free-threaded or not).
#[repr(C)]
struct ArrayFields {
    ob_base: ffi::PyObject,
    data: *mut c_char,
    nd: c_int,
    dimensions: *const ffi::Py_ssize_t,
    strides: *const ffi::Py_ssize_t,
    base: *mut ffi::PyObject,
    descr: *const DescrFields,
    flags: c_int,
}

/// The leading fields of NumPy's dtype struct (NumPy 1.x and 2.x alike: the 2.0 changes come
/// after `type_num`).
#[repr(C)]
struct DescrFields {
    ob_base: ffi::PyObject,
    typeobj: *mut ffi::PyObject,
    kind: c_char,
    type_: c_char,
    byteorder: c_char,
    former_flags: c_char,
    type_num: c_int,
}

/// `NPY_ARRAY_WRITEABLE`.
const WRITEABLE: c_int = 0x0400;

/// The dtype of NumPy type number `num`, for those with a DLPack equivalent.
fn dtype_of(num: c_int) -> Option<DType> {
    let long = if std::mem::size_of::<std::ffi::c_long>() == 8 {
        (DType::I64, DType::U64)
    } else {
        (DType::I32, DType::U32)
    };
    Some(match num {
        0 => DType::BOOL,
        1 => DType::I8,
        2 => DType::U8,
        3 => DType::I16,
        4 => DType::U16,
        5 => DType::I32,
        6 => DType::U32,
        7 => long.0,
        8 => long.1,
        9 => DType::I64,
        10 => DType::U64,
        11 => DType::F32,
        12 => DType::F64,
        14 => DType::C64,
        15 => DType::C128,
        23 => DType::F16,
        _ => return None,
    })
}

/// A NumPy array read from its struct, not yet wrapped in a [`Tensor`]: the checks and typed
/// access of an argument need only these facts, so the common call allocates nothing; a tensor
/// is built when one is asked for ([`NumPyArray::into_tensor`]).
#[derive(Debug)]
pub(crate) struct NumPyArray {
    /// The array, which owns (or keeps alive) the memory.
    obj: Py<PyAny>,
    /// The address of the element at index zero.
    first: *mut u8,
    /// The element type.
    pub(crate) dtype: DType,
    /// Extents and strides in elements (byte offset zero: relative to `first`).
    pub(crate) layout: dlbridge::Layout,
    /// NumPy's WRITEABLE flag is clear.
    pub(crate) read_only: bool,
}

// SAFETY: the raw pointer addresses memory that `obj` (a strong reference, which is `Send`)
// keeps alive; nothing here is tied to the creating thread.
unsafe impl Send for NumPyArray {}
// SAFETY: shared references only read the plain fields.
unsafe impl Sync for NumPyArray {}

impl NumPyArray {
    /// The address of the element at index zero.
    pub(crate) fn first(&self) -> *mut u8 {
        self.first
    }

    /// Another handle to the same array.
    pub(crate) fn clone_ref(&self, py: Python<'_>) -> NumPyArray {
        NumPyArray {
            obj: self.obj.clone_ref(py),
            first: self.first,
            dtype: self.dtype,
            layout: self.layout.clone(),
            read_only: self.read_only,
        }
    }

    /// The array as a tensor over its memory, which keeps it alive.
    pub(crate) fn into_tensor(self) -> PyResult<Tensor> {
        // SAFETY: NumPy guarantees the elements its shape and strides address from `first` are
        // valid (writable unless read-only) while the array lives, and `obj` keeps it alive.
        unsafe {
            crate::exchange::buffer::host_tensor(
                self.first,
                self.dtype,
                self.layout.shape(),
                self.layout.strides(),
                self.read_only,
                Box::new(self.obj),
            )
        }
    }
}

/// The NumPy array `x` (an exact `numpy.ndarray`) read from its struct; `None` for arrays this
/// path does not take (an unusual dtype, byte order or stride), which the caller imports through
/// `__dlpack__` instead (NumPy's own answer, or for an `ml_dtypes` type, which it refuses, the
/// array's bytes).
#[inline(always)]
pub(crate) fn view(x: &Bound<'_, PyAny>) -> PyResult<Option<NumPyArray>> {
    let fields = x.as_ptr().cast::<ArrayFields>();
    // SAFETY: `x` is exactly a `numpy.ndarray` (the type cache checked), whose instances start
    // with these fields; the GIL is held, so nothing changes them while they are read.
    let a = unsafe { &*fields };
    // SAFETY: every array has a live dtype, which starts with these fields.
    let descr = unsafe { &*a.descr };
    let dtype = match dtype_of(descr.type_num) {
        None if descr.type_num >= crate::exchange::ml_dtypes::NPY_USERDEF => user_dtype(x, a),
        dtype => dtype,
    };
    let foreign_order = if cfg!(target_endian = "little") {
        b'>'
    } else {
        b'<'
    };
    let ndim = usize::try_from(a.nd).unwrap_or(usize::MAX);
    let (Some(dtype), true, true) = (
        dtype,
        descr.byteorder as u8 != foreign_order,
        ndim <= dlbridge::MAX_NDIM,
    ) else {
        return Ok(None);
    };
    let layout = if ndim <= SMALL_NDIM {
        let mut shape = [0usize; SMALL_NDIM];
        let mut strides = [0isize; SMALL_NDIM];
        // SAFETY: `a` is the live array's struct (see above), with `ndim` axes.
        if !unsafe { read_axes(a, dtype, &mut shape[..ndim], &mut strides[..ndim]) } {
            return Ok(None);
        }
        dlbridge::Layout::new(&shape[..ndim], &strides[..ndim], 0)
    } else {
        let mut shape = vec![0usize; ndim];
        let mut strides = vec![0isize; ndim];
        // SAFETY: as above.
        if !unsafe { read_axes(a, dtype, &mut shape, &mut strides) } {
            return Ok(None);
        }
        dlbridge::Layout::new(&shape, &strides, 0)
    }
    .map_err(crate::error::to_py)?;
    Ok(Some(NumPyArray {
        obj: x.clone().unbind(),
        first: a.data.cast(),
        dtype,
        layout,
        read_only: a.flags & WRITEABLE == 0,
    }))
}

/// The dtype of the array `a` (the struct of `x`) of a user-defined NumPy type, when that is an
/// `ml_dtypes` type (`bfloat16`, the 8-bit floats).
#[cold]
#[inline(never)]
fn user_dtype(x: &Bound<'_, PyAny>, a: &ArrayFields) -> Option<DType> {
    // SAFETY: the array's dtype is a live object (the array holds a reference to it, and the GIL
    // is held); it is borrowed for this call only.
    let descr = unsafe { Borrowed::from_ptr(x.py(), a.descr.cast_mut().cast::<ffi::PyObject>()) };
    // SAFETY: as in `view`: every dtype starts with these fields.
    let type_num = unsafe { (*a.descr).type_num };
    crate::exchange::ml_dtypes::user_dtype(&descr, type_num)
}

/// Arrays of at most this many axes (nearly all) are read through buffers on the stack.
const SMALL_NDIM: usize = 4;

/// Reads the extents and the strides (in elements) of the array `a` into `shape` and `strides`
/// (as long as its axes); `false` if a byte stride is not a multiple of the element size.
///
/// # Safety
/// `a` is a live array's struct with `shape.len()` axes, read with the GIL held.
#[inline(always)]
unsafe fn read_axes(
    a: &ArrayFields,
    dtype: DType,
    shape: &mut [usize],
    strides: &mut [isize],
) -> bool {
    let itemsize = dtype.itemsize() as isize;
    for (i, (d, s)) in shape.iter_mut().zip(strides.iter_mut()).enumerate() {
        // SAFETY: the array has `shape.len()` extents (the caller's promise).
        let extent = unsafe { a.dimensions.wrapping_add(i).read() };
        // SAFETY: and as many byte strides.
        let stride = unsafe { a.strides.wrapping_add(i).read() };
        if stride % itemsize != 0 {
            return false;
        }
        *d = extent as usize;
        *s = stride / itemsize;
    }
    true
}
