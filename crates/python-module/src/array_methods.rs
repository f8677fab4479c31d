//! `dlbridge.Array`'s Python methods (`#[pymethods]`, and `__dlpack__` registered by hand): each
//! turns its arguments into a call of the file that does the work ([`crate::creation`],
//! [`crate::ops`], [`crate::views`], [`crate::indexing`], [`crate::share`], [`crate::dlpack`]).
//! The type itself is [`crate::array`].

use dlbridge::Device;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::{IntoPyObjectExt, intern};

use crate::array::PyArray;
use crate::convert;
use crate::device::{self, PyDevice};
use crate::dtype::PyDType;
use crate::errors::IntoPyResult;
use crate::fastcall::{self, Attach, FastArgs, MethodDef, Signature};
use crate::ops::{self, Reduction};
use dlbridge::compute::{BinaryOp, CompareOp, ReduceOp, UnaryOp};

impl PyArray {
    fn to_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let t = self.tensor()?;
        let host = if t.is_packed() {
            t.unpacked().py()?
        } else if t.device().is_cpu() && t.is_contiguous() {
            t.clone()
        } else {
            t.copy_to(Device::CPU).py()?
        };
        let itemsize = host.dtype().itemsize();
        let base = host
            .buffer()
            .host_ptr()
            .expect("a CPU tensor is host-accessible");
        let bytes: &[u8] = if host.numel() == 0 {
            &[]
        } else {
            let first = base.as_ptr().wrapping_add(host.byte_offset());
            // SAFETY: `host` is compact host memory of `numel * itemsize` bytes from its byte
            // offset, kept alive by `host` for the duration of this borrow; nothing writes to it
            // while the GIL is held by this call.
            unsafe { std::slice::from_raw_parts(first, host.numel() * itemsize) }
        };
        fn build<'py>(
            py: Python<'py>,
            shape: &[usize],
            bytes: &[u8],
            itemsize: usize,
            dtype: dlbridge::DType,
        ) -> PyResult<Bound<'py, PyAny>> {
            match shape.split_first() {
                None => convert::read_element(py, dtype, &bytes[..itemsize]),
                Some((&n, rest)) => {
                    let chunk = rest.iter().product::<usize>() * itemsize;
                    let list = PyList::empty(py);
                    for i in 0..n {
                        list.append(build(
                            py,
                            rest,
                            &bytes[i * chunk..(i + 1) * chunk],
                            itemsize,
                            dtype,
                        )?)?;
                    }
                    Ok(list.into_any())
                }
            }
        }
        build(py, host.shape(), bytes, itemsize, host.dtype())
    }

    fn scalar<'py>(&self, py: Python<'py>, what: &str) -> PyResult<Bound<'py, PyAny>> {
        let t = self.tensor()?;
        if t.numel() != 1 {
            return Err(PyTypeError::new_err(format!(
                "only arrays of one element can be converted to {what} (this one has {})",
                t.numel()
            )));
        }
        let one = t
            .reshape(&[])
            .or_else(|_| t.copy().and_then(|c| c.reshape(&[])))
            .py()?;
        PyArray::new(one).to_list(py)
    }

    /// `Array.__dlpack__`: exports the array as a DLPack capsule (array API standard semantics).
    /// Called by [`DLPACK`], which parses the arguments.
    fn dlpack<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tensor = self.tensor()?;
        let dl_device = dl_device.map(crate::device::parse).transpose()?;
        crate::dlpack::producer::export(py, &tensor, stream, max_version, dl_device, copy)
    }
}

/// The parameters of `Array.__dlpack__` (all keyword-only).
static DLPACK_SIGNATURE: Signature<4> = Signature::new(
    "__dlpack__",
    ["stream", "max_version", "dl_device", "copy"],
    0,
    0,
    0,
);

/// `Array.__dlpack__`, registered by hand as a fastcall method (see [`crate::fastcall`]): 0.140 µs
/// a call with `max_version=` against 0.261 µs through PyO3 (`python bench/bench_cpu.py`).
pub(crate) static DLPACK: MethodDef = MethodDef::new(
    c"__dlpack__",
    c"__dlpack__($self, /, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n\
      Exports the array as a DLPack capsule (array API standard semantics): a versioned capsule \
      when max_version's major is 1 or more, a legacy one otherwise; dl_device and copy=True \
      ask for a copy (IS_COPIED is then set), copy=False refuses one.",
    dlpack_fastcall,
);

unsafe extern "C" fn dlpack_fastcall(
    slf: *mut pyo3::ffi::PyObject,
    args: *const *mut pyo3::ffi::PyObject,
    nargsf: pyo3::ffi::Py_ssize_t,
    kwnames: *mut pyo3::ffi::PyObject,
) -> *mut pyo3::ffi::PyObject {
    // SAFETY: CPython is calling this function with these arguments.
    let args = unsafe { FastArgs::new(args, nargsf, kwnames) };
    // The body releases no last reference (`Attach::Assumed`): the array keeps its buffer, and
    // any producer behind it, alive.
    DLPACK_SIGNATURE.call(
        args,
        Attach::Assumed,
        |py, [stream, max_version, dl_device, copy]| {
            // SAFETY: the method descriptor passes a live object as `self` (an instance of `Array`,
            // which `cast` checks again).
            let slf = unsafe { Bound::ref_from_ptr(py, &slf) }.cast::<PyArray>()?;
            slf.get().dlpack(
                py,
                fastcall::opt(stream),
                fastcall::opt_version(max_version, "max_version")?,
                fastcall::opt(dl_device),
                fastcall::opt_bool(copy, "copy")?,
            )
        },
    )
}

#[pymethods]
impl PyArray {
    /// dlbridge's DLPack 1.3 C exchange table (a capsule named `dlpack_exchange_api`), for
    /// consumers that exchange tensors without Python calls.
    #[classattr]
    fn __dlpack_c_exchange_api__(py: Python<'_>) -> PyResult<Py<PyAny>> {
        crate::dlpack::table::capsule(py)
    }

    /// The DLPack `(device_type, device_id)` of the array.
    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        let dl = self.tensor()?.device().to_dlpack();
        Ok((dl.device_type, dl.device_id))
    }

    /// How many views (and exports) share this array's memory: a testing aid.
    #[getter]
    fn _buffer_ref_count(&self) -> PyResult<usize> {
        Ok(self.tensor()?.buffer().ref_count())
    }

    /// Extents.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.tensor()?.shape())
    }

    /// Strides in elements (not bytes).
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.tensor()?.strides())
    }

    /// The element type.
    #[getter]
    fn dtype(&self) -> PyResult<PyDType> {
        Ok(PyDType(self.tensor()?.dtype()))
    }

    /// Where the memory lives.
    #[getter]
    fn device(&self) -> PyResult<PyDevice> {
        Ok(PyDevice(self.tensor()?.device()))
    }

    /// The buffer's storage mode: `"private"` (device only), `"shared"` (host and device; all
    /// host memory) or `"managed"`. Whether other processes can map the memory is another
    /// property: `is_shared()`.
    #[getter]
    fn storage(&self) -> PyResult<&'static str> {
        Ok(self.tensor()?.buffer().storage_mode().name())
    }

    /// Number of dimensions.
    #[getter]
    fn ndim(&self) -> PyResult<usize> {
        Ok(self.tensor()?.ndim())
    }

    /// Number of elements.
    #[getter]
    fn size(&self) -> PyResult<usize> {
        Ok(self.tensor()?.numel())
    }

    /// Bytes the elements occupy.
    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        Ok(self.tensor()?.nbytes())
    }

    /// Bytes per element.
    #[getter]
    fn itemsize(&self) -> PyResult<usize> {
        Ok(self.tensor()?.dtype().itemsize())
    }

    /// Offset in bytes of the first element from the start of the underlying buffer.
    #[getter]
    fn byte_offset(&self) -> PyResult<usize> {
        Ok(self.tensor()?.byte_offset())
    }

    /// Whether writes are forbidden (for example, a read-only NumPy or JAX array imported without
    /// a copy).
    #[getter]
    fn readonly(&self) -> PyResult<bool> {
        Ok(self.tensor()?.is_read_only())
    }

    /// Whether the memory belongs to another library (imported without a copy).
    #[getter]
    fn is_foreign(&self) -> PyResult<bool> {
        Ok(self.tensor()?.buffer().is_foreign())
    }

    /// The address of the first element (a device address for device memory; for Metal, the
    /// `id<MTLBuffer>` handle, with the offset in `byte_offset`).
    #[getter]
    fn data_ptr(&self) -> PyResult<usize> {
        let t = self.tensor()?;
        let handle = t.buffer().handle() as usize;
        Ok(if t.device().kind().is_addressable() {
            handle + t.byte_offset()
        } else {
            handle
        })
    }

    /// Whether the view is compact and row-major.
    #[getter]
    fn is_contiguous(&self) -> PyResult<bool> {
        Ok(self.tensor()?.is_contiguous())
    }

    /// The transpose (axes reversed), a view.
    #[getter(T)]
    fn t(&self) -> PyResult<PyArray> {
        Ok(PyArray::new(self.tensor()?.transpose().py()?))
    }

    /// Axes reordered, a view.
    #[pyo3(signature = (*axes))]
    fn permute(&self, axes: Vec<usize>) -> PyResult<PyArray> {
        Ok(PyArray::new(self.tensor()?.permute(&axes).py()?))
    }

    /// A view with a new shape (one extent may be -1); raises `ValueError` when the strides cannot
    /// express it without a copy.
    #[pyo3(signature = (*shape))]
    fn reshape(&self, shape: &Bound<'_, PyTuple>) -> PyResult<PyArray> {
        let nested = shape.len() == 1
            && (shape.get_item(0)?.cast::<PyTuple>().is_ok()
                || shape.get_item(0)?.cast::<PyList>().is_ok());
        let dims: Vec<i64> = if nested {
            shape.get_item(0)?.extract()?
        } else {
            shape.extract()?
        };
        let dims: Vec<Option<usize>> = dims
            .into_iter()
            .map(|d| match d {
                -1 => Ok(None),
                d if d >= 0 => Ok(Some(d as usize)),
                d => Err(PyValueError::new_err(format!(
                    "invalid extent {d} in reshape"
                ))),
            })
            .collect::<PyResult<_>>()?;
        Ok(PyArray::new(self.tensor()?.reshape(&dims).py()?))
    }

    /// A view broadcast to `shape` (NumPy's rules).
    fn broadcast_to(&self, shape: Vec<usize>) -> PyResult<PyArray> {
        Ok(PyArray::new(self.tensor()?.broadcast_to(&shape).py()?))
    }

    /// A compact copy in new memory on the same device (in the same storage mode).
    fn copy(&self) -> PyResult<PyArray> {
        let t = &*self.tensor()?;
        Ok(PyArray::new(t.copy_to_storage(t.device(), None).py()?))
    }

    /// A compact copy on `device`, in `storage` for Metal (the array itself when it is already
    /// there, in that storage, and `copy` is not True).
    #[pyo3(signature = (device, /, *, copy=None, storage=None))]
    fn to(
        &self,
        device: &Bound<'_, PyAny>,
        copy: Option<bool>,
        storage: Option<&str>,
    ) -> PyResult<PyArray> {
        let storage = crate::device::parse_storage(storage)?;
        let target = dlbridge::backend::placement(device::parse(device)?, storage).py()?;
        let t = &*self.tensor()?;
        let same_storage = storage.is_none_or(|s| {
            target.kind() != dlbridge::DeviceKind::Metal || s == t.buffer().storage_mode()
        });
        if target == t.device() && same_storage && copy != Some(true) {
            return Ok(PyArray::new(t.clone()));
        }
        Ok(PyArray::new(t.copy_to_storage(target, storage).py()?))
    }

    /// A picklable handle to this array's memory for another process (`dlbridge.open_shared`
    /// opens it there without a copy). An array that is not in process-shareable memory
    /// (`is_shared()`) is copied once into shareable memory of its device, the array itself left
    /// as it is (`share_memory_()` moves it instead); `copy=False` refuses that with
    /// `BufferError`.
    #[pyo3(signature = (*, copy=None))]
    fn share(&self, py: Python<'_>, copy: Option<bool>) -> PyResult<crate::share::PySharedHandle> {
        crate::share::share_array(py, &self.tensor()?.clone(), copy)
    }

    /// Moves the array into process-shareable memory, in place, and returns it (PyTorch's
    /// `Tensor.share_memory_`); `dlbridge.multiprocessing` calls it on every array it sends.
    fn share_memory_<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, Self>> {
        crate::share::share_memory(slf.py(), slf.get())?;
        Ok(slf.clone())
    }

    /// Whether another process can map the array's memory as it is (PyTorch's
    /// `Tensor.is_shared`): not the storage mode.
    fn is_shared(&self) -> PyResult<bool> {
        Ok(dlbridge::share::is_shared(&*self.tensor()?))
    }

    /// This array when its memory is shareable already (dlbridge's shareable pool, or memory
    /// opened from a handle), else a copy there: keep this one where an array is shared many
    /// times (`share`, `dlbridge.multiprocessing`, `dlbridge.ray`) and none of them copies it.
    fn to_shareable(&self, py: Python<'_>) -> PyResult<PyArray> {
        let t = self.tensor()?.clone();
        Ok(PyArray::new(
            py.detach(|| dlbridge::share::into_shareable(&t)).py()?,
        ))
    }

    /// Pickling: CPU arrays out of band under protocol 5 (no copy into the pickle), other
    /// devices by value.
    fn __reduce_ex__<'py>(slf: &Bound<'py, Self>, protocol: i32) -> PyResult<Bound<'py, PyTuple>> {
        crate::share::reduce_array(slf, protocol)
    }

    /// A copy with elements converted to `dtype` (NumPy's `astype` rules).
    fn astype(&self, py: Python<'_>, dtype: &Bound<'_, PyAny>) -> PyResult<PyArray> {
        let dtype = crate::dtype::parse(dtype)?;
        // Converted on the array's own device (no round trip through the host for GPU arrays).
        let src = self.tensor()?.clone();
        let out = py.detach(|| dlbridge::compute::cast(&src, dtype)).py()?;
        Ok(PyArray::new(out))
    }

    /// The elements as nested Python lists (a Python scalar for 0-d arrays).
    fn tolist<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.to_list(py)
    }

    /// The one element as a Python scalar.
    fn item<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.scalar(py, "a Python scalar")
    }

    fn __float__(&self, py: Python<'_>) -> PyResult<f64> {
        self.scalar(py, "float")?.extract()
    }

    fn __int__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let v = self.scalar(py, "int")?;
        py.import(intern!(py, "builtins"))?
            .getattr(intern!(py, "int"))?
            .call1((v,))
    }

    fn __index__(&self, py: Python<'_>) -> PyResult<i128> {
        let dtype = self.tensor()?.dtype();
        if dtype.is_floating() || dtype == dlbridge::DType::BOOL {
            return Err(PyTypeError::new_err(format!(
                "{dtype} arrays cannot be used as indices"
            )));
        }
        self.scalar(py, "an index")?.extract()
    }

    fn __complex__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let v = self.scalar(py, "complex")?;
        py.import(intern!(py, "builtins"))?
            .getattr(intern!(py, "complex"))?
            .call1((v,))
    }

    fn __bool__(&self, py: Python<'_>) -> PyResult<bool> {
        self.scalar(py, "bool")?.is_truthy()
    }

    fn __len__(&self) -> PyResult<usize> {
        self.tensor()?
            .shape()
            .first()
            .copied()
            .ok_or_else(|| PyTypeError::new_err("len() of a 0-d array"))
    }

    fn __getitem__(&self, key: &Bound<'_, PyAny>) -> PyResult<PyArray> {
        crate::indexing::get(&*self.tensor()?, key).map(PyArray::new)
    }

    fn __setitem__(&self, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        crate::indexing::set(&*self.tensor()?, key, value)
    }

    /// NumPy's conversion hook: a zero-copy NumPy view (through DLPack), or a copy when asked.
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let np = py.import(intern!(py, "numpy"))?;
        let tensor = &slf.get().tensor()?;
        let device = tensor.device();
        let mut copied = false;
        let source: Bound<'py, PyAny> = if device.is_cpu() {
            slf.clone().into_any()
        } else if device.kind().is_host_accessible() {
            // Pinned or managed memory: NumPy reads it in place once the device is done with it.
            dlbridge::backend::host_barrier(device).py()?;
            slf.clone().into_any()
        } else if let Some(view) = crate::metal::host_view(tensor)? {
            // Shared Metal memory: NumPy reads it in place, after the GPU work on it.
            Bound::new(py, PyArray::new(view))?.into_any()
        } else {
            if copy == Some(false) {
                return Err(PyValueError::new_err(format!(
                    "the array is on {device}: NumPy needs a host copy, but copy=False"
                )));
            }
            copied = true;
            Bound::new(py, PyArray::new(tensor.copy_to(Device::CPU).py()?))?.into_any()
        };
        // bfloat16 and the float8 types: through ml_dtypes (NumPy's DLPack import refuses them).
        let minifloat = {
            let t = source.cast::<PyArray>()?.get().tensor()?.clone();
            crate::ml_dtypes::to_numpy(py, &t)?
        };
        let out = match minifloat {
            Some(view) => view,
            None => np.call_method1(intern!(py, "from_dlpack"), (source,))?,
        };
        let wanted = match dtype.filter(|d| !d.is_none()) {
            Some(d) => Some(np.call_method1(intern!(py, "dtype"), (d,))?),
            None => None,
        };
        let converts = match &wanted {
            Some(w) => !out.getattr(intern!(py, "dtype"))?.eq(w)?,
            None => false,
        };
        if converts && copy == Some(false) {
            return Err(PyValueError::new_err(
                "converting the dtype needs a copy, but copy=False",
            ));
        }
        match wanted {
            Some(w) if converts => out.call_method1(intern!(py, "astype"), (w,)),
            _ if copy == Some(true) && !copied => out.call_method0(intern!(py, "copy")),
            _ => Ok(out),
        }
    }

    /// NumPy's `repr`, with `Array(` and, off the CPU, `device='...'` ([`crate::format`]).
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        crate::format::repr(py, &self.tensor()?.clone())
    }

    /// NumPy's `str` ([`crate::format`]).
    fn __str__(&self, py: Python<'_>) -> PyResult<String> {
        crate::format::str(py, &self.tensor()?.clone())
    }

    fn __add__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Add, &*self.tensor()?, other, false)
    }

    fn __radd__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Add, &*self.tensor()?, other, true)
    }

    fn __sub__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Sub, &*self.tensor()?, other, false)
    }

    fn __rsub__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Sub, &*self.tensor()?, other, true)
    }

    fn __mul__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Mul, &*self.tensor()?, other, false)
    }

    fn __rmul__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Mul, &*self.tensor()?, other, true)
    }

    fn __truediv__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Div, &*self.tensor()?, other, false)
    }

    fn __rtruediv__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Div, &*self.tensor()?, other, true)
    }

    fn __matmul__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        match ops::arg(other)? {
            Some(ops::Arg::Tensor(b)) => {
                let a = self.tensor()?.clone();
                let out = py.detach(|| dlbridge::compute::matmul(&a, &b)).py()?;
                PyArray::new(out).into_py_any(py)
            }
            _ => Ok(py.NotImplemented()),
        }
    }

    fn __rmatmul__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        match ops::arg(other)? {
            Some(ops::Arg::Tensor(a)) => {
                let b = self.tensor()?.clone();
                let out = py.detach(|| dlbridge::compute::matmul(&a, &b)).py()?;
                PyArray::new(out).into_py_any(py)
            }
            _ => Ok(py.NotImplemented()),
        }
    }

    fn __neg__(&self, py: Python<'_>) -> PyResult<PyArray> {
        ops::unary_tensor(py, UnaryOp::Negative, &*self.tensor()?)
    }

    fn __abs__(&self, py: Python<'_>) -> PyResult<PyArray> {
        ops::unary_tensor(py, UnaryOp::Abs, &*self.tensor()?)
    }

    /// The sum over `axis` (None: all elements). `dtype` computes in and returns that dtype;
    /// `out` (a writable array of the result's shape) receives the result and is returned, as
    /// NumPy's `np.sum(a, ...)` asks.
    #[pyo3(signature = (axis=None, dtype=None, out=None, keepdims=false))]
    fn sum(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
    ) -> PyResult<Py<PyAny>> {
        let x = &*self.tensor()?;
        ops::reduce_method(
            py,
            Reduction::Op(ReduceOp::Sum),
            x,
            axis,
            keepdims,
            dtype,
            out,
        )
    }

    /// The mean over `axis` (None: all elements); `dtype` and `out` as for [`sum`].
    #[pyo3(signature = (axis=None, dtype=None, out=None, keepdims=false))]
    fn mean(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
    ) -> PyResult<Py<PyAny>> {
        let x = &*self.tensor()?;
        ops::reduce_method(
            py,
            Reduction::Op(ReduceOp::Mean),
            x,
            axis,
            keepdims,
            dtype,
            out,
        )
    }

    /// The largest element over `axis` (None: all elements); NaN if any is NaN. `out` as for
    /// `sum`.
    #[pyo3(signature = (axis=None, out=None, keepdims=false))]
    fn max(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
    ) -> PyResult<Py<PyAny>> {
        let x = &*self.tensor()?;
        ops::reduce_method(
            py,
            Reduction::Op(ReduceOp::Max),
            x,
            axis,
            keepdims,
            None,
            out,
        )
    }

    /// The smallest element over `axis` (None: all elements); NaN if any is NaN. `out` as for
    /// `sum`.
    #[pyo3(signature = (axis=None, out=None, keepdims=false))]
    fn min(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
    ) -> PyResult<Py<PyAny>> {
        let x = &*self.tensor()?;
        ops::reduce_method(
            py,
            Reduction::Op(ReduceOp::Min),
            x,
            axis,
            keepdims,
            None,
            out,
        )
    }

    /// The product over `axis` (None: all elements); integers wrap in 64 bits, as NumPy's.
    /// `dtype` and `out` as for `sum`.
    #[pyo3(signature = (axis=None, dtype=None, out=None, keepdims=false))]
    fn prod(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
    ) -> PyResult<Py<PyAny>> {
        let x = &*self.tensor()?;
        ops::reduce_method(
            py,
            Reduction::Op(ReduceOp::Prod),
            x,
            axis,
            keepdims,
            dtype,
            out,
        )
    }

    /// Whether every element over `axis` is true (non-zero; NaN is true), a bool array.
    #[pyo3(signature = (axis=None, out=None, keepdims=false))]
    fn all(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
    ) -> PyResult<Py<PyAny>> {
        let x = &*self.tensor()?;
        ops::reduce_method(py, Reduction::All, x, axis, keepdims, None, out)
    }

    /// Whether any element over `axis` is true (non-zero; NaN is true), a bool array.
    #[pyo3(signature = (axis=None, out=None, keepdims=false))]
    fn any(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
    ) -> PyResult<Py<PyAny>> {
        let x = &*self.tensor()?;
        ops::reduce_method(py, Reduction::Any, x, axis, keepdims, None, out)
    }

    /// The index of the largest element along `axis` (None: of the flattened array), int64;
    /// the first among equals, the first NaN if any.
    #[pyo3(signature = (axis=None, out=None, *, keepdims=false))]
    fn argmax(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
    ) -> PyResult<Py<PyAny>> {
        let x = &*self.tensor()?;
        ops::reduce_method(
            py,
            Reduction::Op(ReduceOp::ArgMax),
            x,
            axis,
            keepdims,
            None,
            out,
        )
    }

    /// The index of the smallest element along `axis` (None: of the flattened array), int64;
    /// the first among equals, the first NaN if any.
    #[pyo3(signature = (axis=None, out=None, *, keepdims=false))]
    fn argmin(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
    ) -> PyResult<Py<PyAny>> {
        let x = &*self.tensor()?;
        ops::reduce_method(
            py,
            Reduction::Op(ReduceOp::ArgMin),
            x,
            axis,
            keepdims,
            None,
            out,
        )
    }

    /// The variance over `axis`, divided by `n - ddof` (the array API's `correction` is the same
    /// number); `dtype` and `out` as for `sum`.
    #[pyo3(signature = (axis=None, dtype=None, out=None, ddof=None, keepdims=false, *, correction=None))]
    #[allow(clippy::too_many_arguments)]
    fn var(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        ddof: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
        correction: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let red = Reduction::Var(ops::degrees_of_freedom(ddof, correction)?);
        let x = &*self.tensor()?;
        ops::reduce_method(py, red, x, axis, keepdims, dtype, out)
    }

    /// The standard deviation over `axis` (the square root of `var`, same arguments).
    #[pyo3(signature = (axis=None, dtype=None, out=None, ddof=None, keepdims=false, *, correction=None))]
    #[allow(clippy::too_many_arguments)]
    fn std(
        &self,
        py: Python<'_>,
        axis: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        out: Option<&Bound<'_, PyAny>>,
        ddof: Option<&Bound<'_, PyAny>>,
        keepdims: bool,
        correction: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let red = Reduction::Std(ops::degrees_of_freedom(ddof, correction)?);
        let x = &*self.tensor()?;
        ops::reduce_method(py, red, x, axis, keepdims, dtype, out)
    }

    /// The axes permuted: reversed with no argument, else as given (`a.transpose(1, 0)` or
    /// `a.transpose((1, 0))`; negative axes count from the end), a view.
    #[pyo3(signature = (*axes))]
    fn transpose(&self, axes: &Bound<'_, PyTuple>) -> PyResult<PyArray> {
        crate::views::transpose(&*self.tensor()?, axes).map(PyArray::new)
    }

    /// The elements in one axis, row-major: a view when the layout allows, else a copy.
    #[pyo3(signature = (order="C"))]
    fn ravel(&self, order: &str) -> PyResult<PyArray> {
        crate::views::ravel(&*self.tensor()?, order, false).map(PyArray::new)
    }

    /// A compact copy of the elements in one axis, row-major.
    #[pyo3(signature = (order="C"))]
    fn flatten(&self, order: &str) -> PyResult<PyArray> {
        crate::views::ravel(&*self.tensor()?, order, true).map(PyArray::new)
    }

    fn __floordiv__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::FloorDiv, &*self.tensor()?, other, false)
    }

    fn __rfloordiv__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::FloorDiv, &*self.tensor()?, other, true)
    }

    fn __mod__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Mod, &*self.tensor()?, other, false)
    }

    fn __rmod__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::operator(py, BinaryOp::Mod, &*self.tensor()?, other, true)
    }

    fn __pow__(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        modulo: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        ops::power_operator(py, &*self.tensor()?, other, modulo, false)
    }

    fn __rpow__(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
        modulo: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        ops::power_operator(py, &*self.tensor()?, other, modulo, true)
    }

    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::compare_operator(py, CompareOp::Eq, &*self.tensor()?, other)
    }

    fn __ne__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::compare_operator(py, CompareOp::Ne, &*self.tensor()?, other)
    }

    fn __lt__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::compare_operator(py, CompareOp::Lt, &*self.tensor()?, other)
    }

    fn __le__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::compare_operator(py, CompareOp::Le, &*self.tensor()?, other)
    }

    fn __gt__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::compare_operator(py, CompareOp::Gt, &*self.tensor()?, other)
    }

    fn __ge__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        ops::compare_operator(py, CompareOp::Ge, &*self.tensor()?, other)
    }

    fn __iter__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let n = slf.get().__len__()?;
        let items: Vec<PyArray> = (0..n)
            .map(|i| {
                slf.get()
                    .tensor()?
                    .index(0, i as isize)
                    .py()
                    .map(PyArray::new)
            })
            .collect::<PyResult<_>>()?;
        let list = PyList::new(py, items)?;
        list.try_iter()?.into_py_any(py)
    }
}
