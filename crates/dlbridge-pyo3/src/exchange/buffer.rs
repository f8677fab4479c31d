//! The buffer protocol (`memoryview`-able objects: `bytearray`, `array.array`, NumPy arrays,
//! MLX arrays) as a zero-copy source of host arrays.

use std::ffi::{CStr, c_char, c_int, c_void};

use dlbridge::{DType, Device, Layout, StorageMode, Tensor};
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::{ffi, intern};

use crate::error::IntoPyResult;

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
pub fn has_buffer(obj: &Bound<'_, PyAny>) -> bool {
    // `memoryview(obj)` succeeds exactly for buffer exporters; it is cheap and stable-ABI.
    let py = obj.py();
    py.import(intern!(py, "builtins"))
        .and_then(|b| b.getattr(intern!(py, "memoryview")))
        .and_then(|mv| mv.call1((obj,)))
        .is_ok()
}

/// Imports a buffer-protocol object without copying (read-only when the exporter is).
pub fn from_buffer(obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
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
    finish_view(view)
}

/// The tensor over a filled view.
fn finish_view(view: Box<PyBufferView>) -> PyResult<Tensor> {
    let held = HeldView(view);
    let v = &*held.0;
    let format = if v.format.is_null() {
        "B"
    } else {
        // SAFETY: a non-NULL `format` is a NUL-terminated string the exporter owns while the
        // view is held (and `held` is not dropped before `format`'s last use).
        unsafe { CStr::from_ptr(v.format) }
            .to_str()
            .unwrap_or("?invalid")
    };
    let dtype = dtype_of_format(format).ok_or_else(|| {
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
    let read_only = v.readonly != 0;
    let buf = v.buf;
    // SAFETY: the exporter guarantees the elements the view addresses are valid host memory
    // while the view is held, and `held` is the keep-alive.
    unsafe {
        host_tensor(
            buf.cast(),
            dtype,
            &shape,
            &strides,
            read_only,
            Box::new(held),
        )
    }
}

/// A tensor over foreign host memory: `first` is the address of the element at index zero,
/// `strides` are in elements; the buffer covers exactly the bytes the view can address.
///
/// # Safety
/// Every element the shape and strides address from `first` must be valid host memory (writable
/// unless `read_only`) while `keep_alive` lives.
pub(crate) unsafe fn host_tensor(
    first: *mut u8,
    dtype: DType,
    shape: &[usize],
    strides: &[isize],
    read_only: bool,
    keep_alive: Box<dyn std::any::Any + Send + Sync>,
) -> PyResult<Tensor> {
    // The layout checks the shape and strides (rank, overflow); the buffer holds exactly the
    // bytes they address (from the lowest to the highest element, relative to `first`), which
    // `Tensor::new` checks again.
    let layout = Layout::new(shape, strides, 0).py()?;
    let itemsize = dtype.itemsize() as i128;
    let (base, len, offset) = match layout.element_extent() {
        Some((lo, hi)) => (
            first as usize as i128 + lo * itemsize,
            ((hi - lo + 1) * itemsize) as usize,
            (-lo * itemsize) as usize,
        ),
        None => (first as usize as i128, 0, 0),
    };
    let layout = if offset == 0 {
        layout
    } else {
        layout.with_byte_offset(offset)
    };
    let handle = std::ptr::with_exposed_provenance_mut::<c_void>(base.max(1) as usize);
    // SAFETY: the caller guarantees the addressed elements, `[first + lo, first + hi]`, are valid
    // host memory while `keep_alive` lives, and the buffer holds it until it is dropped.
    let buffer = unsafe {
        dlbridge::Buffer::from_foreign(
            handle,
            handle.cast(),
            len,
            Device::CPU,
            StorageMode::Shared,
            read_only,
            keep_alive,
        )
    };
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
