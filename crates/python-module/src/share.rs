//! Arrays across processes: `dlbridge.SharedHandle`, `Array.share`, `dlbridge.open_shared`, and
//! the natives `Array.__reduce_ex__` pickles with. The rules live in `dlbridge::share`; this
//! module turns Python objects into its calls.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;
use std::time::Duration;

use dlbridge::share::broker::{self, Wait};
use dlbridge::share::{self, SharedHandle};
use dlbridge::{DType, Layout, Tensor};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::array::PyArray;
use crate::device::{self, PyDevice};
use crate::dtype::{self, PyDType};
use crate::errors::IntoPyResult;

/// A picklable description of an array in shareable memory, made by `Array.share()` and opened
/// by `dlbridge.open_shared()` in this or another process.
///
/// A handle holds one file descriptor until it is opened (the memory's; for a legacy CUDA IPC
/// handle, the count of its consumers); it opens once. Pickled (plainly or by
/// `dlbridge.multiprocessing`), it travels as bytes with a ticket: the producer lends the
/// descriptor, and the receiver claims it when it opens the handle, which must be while the
/// producer lives.
#[pyclass(frozen, module = "dlbridge._dlbridge", name = "SharedHandle")]
pub(crate) struct PySharedHandle {
    /// The handle; `None` once opened.
    inner: Mutex<Option<SharedHandle>>,
}

impl PySharedHandle {
    fn new(handle: SharedHandle) -> Self {
        PySharedHandle {
            inner: Mutex::new(Some(handle)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<SharedHandle>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the unopened handle; `ValueError` once it was opened.
    fn with<T>(&self, f: impl FnOnce(&mut SharedHandle) -> T) -> PyResult<T> {
        self.lock().as_mut().map(f).ok_or_else(already_opened)
    }

    /// Takes the handle to open it; `ValueError` once it was opened.
    fn take(&self) -> PyResult<SharedHandle> {
        self.lock().take().ok_or_else(already_opened)
    }
}

/// Runs `f` with the GIL released and a [`Wait`] of `timeout` seconds (`None`: the default,
/// `DLBRIDGE_SHARE_TIMEOUT` or 30 s) that answers signals: every 50 ms of waiting for a producer,
/// Python's signal handlers run (`KeyboardInterrupt` on Ctrl-C), and an exception one raises
/// ends the wait and is what the call raises.
pub(crate) fn waiting<T: Send>(
    py: Python<'_>,
    timeout: Option<f64>,
    f: impl FnOnce(&Wait<'_>) -> dlbridge::Result<T> + Send,
) -> PyResult<T> {
    let timeout = timeout_of(timeout)?.unwrap_or_else(broker::default_timeout);
    let raised: Mutex<Option<PyErr>> = Mutex::new(None);
    let check = || -> dlbridge::Result<()> {
        Python::attach(|py| py.check_signals()).map_err(|e| {
            *raised.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            dlbridge::Error::Driver {
                backend: "share",
                message: "interrupted by a signal".into(),
            }
        })
    };
    let wait = Wait {
        timeout,
        interrupt: Some(&check),
    };
    let result = py.detach(|| f(&wait));
    if let Some(e) = raised.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    result.py()
}

fn already_opened() -> PyErr {
    PyValueError::new_err(
        "this handle was already opened: a handle opens once (share the array again for another)",
    )
}

/// Takes ownership of a descriptor number a Python caller handed over.
fn own_fd(fd: Option<i32>) -> PyResult<Option<OwnedFd>> {
    // SAFETY: the Python caller hands the descriptor over (`_rebuild` documents it).
    fd.map(|fd| unsafe { share::adopt_fd(fd) }).transpose().py()
}

#[pymethods]
impl PySharedHandle {
    /// Where the memory lives.
    #[getter]
    fn device(&self) -> PyResult<PyDevice> {
        self.with(|h| PyDevice(h.device()))
    }

    /// How the memory is reached: `host_file`, `cuda_vmm` or `cuda_ipc`.
    #[getter]
    fn kind(&self) -> PyResult<&'static str> {
        self.with(|h| h.kind().name())
    }

    /// The element type.
    #[getter]
    fn dtype(&self) -> PyResult<PyDType> {
        self.with(|h| PyDType(h.dtype()))
    }

    /// The view's shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.with(|h| h.layout().shape().to_vec())?)
    }

    /// The view's strides, in elements.
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.with(|h| h.layout().strides().to_vec())?)
    }

    /// The view's byte offset in the shared allocation.
    #[getter]
    fn byte_offset(&self) -> PyResult<usize> {
        self.with(|h| h.layout().byte_offset())
    }

    /// The size of the shared allocation in bytes.
    #[getter]
    fn allocation_nbytes(&self) -> PyResult<usize> {
        self.with(|h| h.allocation_len())
    }

    /// Whether the view is read-only.
    #[getter]
    fn readonly(&self) -> PyResult<bool> {
        self.with(|h| h.is_read_only())
    }

    /// The producer's process id.
    #[getter]
    fn pid(&self) -> PyResult<u32> {
        self.with(|h| h.pid())
    }

    /// The handle's file descriptor in this process (owned by the handle): the memory's, or a
    /// legacy CUDA IPC handle's count of consumers.
    #[getter]
    fn fd(&self) -> PyResult<Option<i32>> {
        self.with(|h| h.fd().map(|fd| fd.as_raw_fd()))
    }

    /// Whether the handle was opened (it opens once).
    #[getter]
    fn opened(&self) -> bool {
        self.lock().is_none()
    }

    /// Everything but the descriptor, as bytes.
    fn _state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.with(|h| h.to_bytes())?))
    }

    /// A handle from `_state()` bytes and a descriptor, which the handle then owns (the caller
    /// must not close it).
    #[staticmethod]
    #[pyo3(signature = (state, fd=None))]
    fn _rebuild(state: &[u8], fd: Option<i32>) -> PyResult<Self> {
        let fd = own_fd(fd)?;
        Ok(Self::new(SharedHandle::from_bytes(state, fd).py()?))
    }

    /// The handle's bytes with a ticket for its descriptor, lent by this process: they travel
    /// alone (by any means) to another process of this user on this machine, which opens them
    /// while this process lives (within `DLBRIDGE_SHARE_TICKET_TTL` seconds, 600 by default).
    /// Each call lends anew. A handle received as bytes first claims its descriptor.
    fn _lend<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        // A handle with its descriptor lends at once, under its lock.
        if let Some(lent) = self.with(|h| h.fd().is_some().then(|| h.to_bytes_lent()))? {
            return Ok(PyBytes::new(py, &lent.py()?));
        }
        // One received as bytes claims its descriptor first, which waits for its producer: out
        // of the lock (a thread holding the GIL could wait on the lock while the claim waits
        // for the GIL to check signals), and back in afterwards.
        let mut handle = self.take()?;
        let lent = waiting(py, None, |wait| handle.to_bytes_lent_with(wait));
        *self.lock() = Some(handle);
        Ok(PyBytes::new(py, &lent?))
    }

    /// Plain pickling: the handle's bytes with a ticket for its descriptor (see `_lend`).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let state = slf.get()._lend(py)?;
        let ctor = py.get_type::<Self>().getattr("_rebuild")?;
        let args = PyTuple::new(py, [state.into_any(), py.None().into_bound(py)])?;
        PyTuple::new(py, [ctor, args.into_any()])
    }

    fn __repr__(&self) -> String {
        match &*self.lock() {
            None => "SharedHandle(opened)".into(),
            Some(h) => format!(
                "SharedHandle(device={}, kind={}, dtype={}, shape={:?}, strides={:?}, byte_offset={})",
                h.device(),
                h.kind().name(),
                h.dtype(),
                h.layout().shape(),
                h.layout().strides(),
                h.layout().byte_offset()
            ),
        }
    }
}

/// `Array.share`: a handle to the array's memory (see `dlbridge::share::share`).
pub(crate) fn share_array(
    py: Python<'_>,
    t: &Tensor,
    copy: Option<bool>,
) -> PyResult<PySharedHandle> {
    let t = t.clone();
    let handle = py.detach(|| share::share(&t, copy != Some(false))).py()?;
    Ok(PySharedHandle::new(handle))
}

/// `Array.share_memory_`: the array's memory moved into process-shareable memory in place where
/// it can be, else the array's tensor replaced by a shareable copy (see
/// `dlbridge::share::share_memory`). The GIL is held throughout, so that no Python thread writes
/// the array through dlbridge while its bytes move.
pub(crate) fn share_memory(py: Python<'_>, array: &PyArray) -> PyResult<()> {
    // Shareable already, or moved in place: nothing to replace, no write lock needed.
    let t = array.tensor()?.clone();
    if share::share_memory_in_place(&t).py()? {
        return Ok(());
    }
    array.replace(py, |t| {
        let moved = share::share_memory(t).py()?;
        Ok((!moved.buffer().same_allocation(t.buffer())).then_some(moved))
    })
}

/// Opens a handle made by `Array.share()` (in this or another process): an array over the same
/// memory. The handle opens once. A handle received as bytes claims its descriptor from its
/// producer, waiting at most `timeout` seconds (default `DLBRIDGE_SHARE_TIMEOUT`, or 30) and
/// answering Ctrl-C meanwhile.
#[pyfunction]
#[pyo3(signature = (handle, *, timeout=None))]
fn open_shared(
    py: Python<'_>,
    handle: &Bound<'_, PySharedHandle>,
    timeout: Option<f64>,
) -> PyResult<PyArray> {
    let h = handle.get().take()?;
    Ok(PyArray::new(waiting(py, timeout, |wait| {
        share::open_with(h, wait)
    })?))
}

/// The seconds a claim of a lent descriptor waits for its producer by default
/// (`DLBRIDGE_SHARE_TIMEOUT`, or 30).
#[pyfunction]
fn _share_timeout() -> f64 {
    broker::default_timeout().as_secs_f64()
}

/// Unpickles an array: `buffer` (bytes or an out-of-band `PickleBuffer`) holds its elements in
/// row-major order; the array is made over it without a copy on the CPU, copied to `device`
/// otherwise.
#[pyfunction]
#[pyo3(signature = (buffer, dtype, shape, readonly, device=None))]
fn _array_from_pickle(
    py: Python<'_>,
    buffer: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    shape: Vec<usize>,
    readonly: bool,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyArray> {
    let dtype = dtype::parse(dtype)?;
    // An out-of-band `PickleBuffer` keeps its exporter's format; `raw()` is its bytes, as `B`.
    let raw;
    let buffer = if buffer.hasattr("raw")? {
        raw = buffer.call_method0("raw")?;
        &raw
    } else {
        buffer
    };
    let bytes = crate::dlpack::buffer::from_buffer(buffer)?;
    let layout = Layout::contiguous_at(&shape, bytes.byte_offset()).py()?;
    let mut t = Tensor::new(bytes.buffer().clone(), dtype, layout).py()?;
    if bytes.is_read_only() || readonly {
        t = t.into_read_only();
    }
    if let Some(device) = device {
        let device = device::parse(device)?;
        if device != t.device() {
            t = py.detach(|| t.copy_to(device)).py()?;
            if readonly {
                t = t.into_read_only();
            }
        }
    }
    Ok(PyArray::new(t))
}

/// `Array.__reduce_ex__`: CPU arrays pickle their bytes, out of band under protocol 5 (a
/// `PickleBuffer` over the array's memory, no copy); other devices pickle by value (device,
/// dtype, shape, bytes).
pub(crate) fn reduce_array<'py>(
    slf: &Bound<'py, PyArray>,
    protocol: i32,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = slf.py();
    let t = slf.get().tensor()?.clone();
    let ctor = py
        .import("dlbridge._dlbridge")?
        .getattr("_array_from_pickle")?;
    let dtype = t.dtype().name().into_pyobject(py)?.into_any();
    let shape = PyTuple::new(py, t.shape())?.into_any();
    let readonly = t.is_read_only().into_pyobject(py)?.to_owned().into_any();
    let on_host = t.device().is_cpu();
    let compact = if on_host && t.is_contiguous() {
        t
    } else {
        py.detach(|| t.copy_to(dlbridge::Device::CPU)).py()?
    };
    let nbytes = compact.nbytes();
    let host = compact
        .buffer()
        .host_ptr()
        .ok_or_else(|| PyValueError::new_err("the array's copy is not host memory"))?;
    let first = host.as_ptr().wrapping_add(compact.byte_offset());
    let data = if on_host && protocol >= 5 && nbytes > 0 {
        // A ctypes array over the elements, owning a new array of the same memory (so that
        // `Backend.free` of the original refuses while the buffer is out).
        let ctypes = py.import("ctypes")?;
        let char_array = ctypes
            .getattr("c_char")?
            .call_method1("__mul__", (nbytes,))?;
        let view = char_array.call_method1("from_address", (first.expose_provenance(),))?;
        view.setattr("_dlbridge_owner", PyArray::new(compact.clone()))?;
        // As plain bytes (format `B`): a ctypes array's own format (`<c`) is one that some
        // consumers of out-of-band buffers (Ray's object store) cannot unpack.
        let bytes = pyo3::types::PyMemoryView::from(&view)?.call_method1("cast", ("B",))?;
        py.import("pickle")?
            .getattr("PickleBuffer")?
            .call1((bytes,))?
    } else {
        // SAFETY: `compact` is a live, contiguous host view of `nbytes` bytes at `first`; no
        // one writes it during this copy (the GIL is held and Python code cannot run).
        let slice = unsafe { std::slice::from_raw_parts(first, nbytes) };
        PyBytes::new(py, slice).into_any()
    };
    let mut args = vec![data, dtype, shape, readonly];
    if !on_host {
        args.push(
            slf.get()
                .tensor()?
                .device()
                .to_string()
                .into_pyobject(py)?
                .into_any(),
        );
    }
    PyTuple::new(py, [ctor, PyTuple::new(py, args)?.into_any()])
}

/// One array of a group, as Python carries it: (index of the piece of memory holding it, dtype
/// name, shape, strides in elements, byte offset, read-only). Groups index handles (`usize`);
/// NCCL transfers index runs, `-1` for none (`isize`).
pub(crate) type ViewTuple<I = usize> = (I, String, Vec<usize>, Vec<isize>, usize, bool);

/// A view as Python carries it.
pub(crate) fn view_tuple<I>(
    index: I,
    dtype: DType,
    layout: &Layout,
    read_only: bool,
) -> ViewTuple<I> {
    (
        index,
        dtype.name().to_string(),
        layout.shape().to_vec(),
        layout.strides().to_vec(),
        layout.byte_offset(),
        read_only,
    )
}

/// The element type and layout of a view tuple, checked.
pub(crate) fn view_of<I>(view: &ViewTuple<I>) -> PyResult<(DType, Layout)> {
    let (_, dtype, shape, strides, offset, _) = view;
    Ok((
        dtype.parse::<DType>().py()?,
        Layout::new(shape, strides, *offset).py()?,
    ))
}

/// The tensors of Python arrays (cheap clones: views of the same memory).
pub(crate) fn tensors_of(arrays: &[PyRef<'_, PyArray>]) -> PyResult<Vec<Tensor>> {
    arrays
        .iter()
        .map(|a| a.tensor().map(|t| t.clone()))
        .collect()
}

/// Many arrays shared together (see `dlbridge::share::share_many`): a list of handles, one per
/// allocation, and a list of view tuples, one per array in order. Arrays not in shareable memory
/// are packed into one new block per device unless `copy` is `False` (`BufferError`).
#[pyfunction]
#[pyo3(signature = (arrays, copy=None))]
fn _share_many(
    py: Python<'_>,
    arrays: Vec<PyRef<'_, PyArray>>,
    copy: Option<bool>,
) -> PyResult<(Vec<PySharedHandle>, Vec<ViewTuple>)> {
    let tensors = tensors_of(&arrays)?;
    let group = py
        .detach(|| share::share_many(&tensors, copy != Some(false)))
        .py()?;
    let views = group
        .views
        .iter()
        .map(|v| view_tuple(v.handle, v.dtype, &v.layout, v.read_only))
        .collect();
    let handles = group.handles.into_iter().map(PySharedHandle::new).collect();
    Ok((handles, views))
}

/// Opens the handles and views of `_share_many` (in this or another process): the arrays, in
/// order, over the same memory. Each handle opens once. `cuda_ordinal` names the producer's GPU
/// as this process numbers it, where the two number GPUs differently (`CUDA_VISIBLE_DEVICES`);
/// `timeout` is `open_shared`'s.
#[pyfunction]
#[pyo3(signature = (handles, views, cuda_ordinal=None, *, timeout=None))]
fn _open_many(
    py: Python<'_>,
    handles: Vec<Bound<'_, PySharedHandle>>,
    views: Vec<ViewTuple>,
    cuda_ordinal: Option<u32>,
    timeout: Option<f64>,
) -> PyResult<Vec<PyArray>> {
    let views = views
        .iter()
        .map(|v| {
            let (dtype, layout) = view_of(v)?;
            Ok(share::SharedView {
                handle: v.0,
                dtype,
                layout,
                read_only: v.5,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let mut taken = Vec::with_capacity(handles.len());
    for h in &handles {
        let mut inner = h.get().take()?;
        if let Some(ordinal) = cuda_ordinal {
            inner.renumber_cuda_device(ordinal);
        }
        taken.push(inner);
    }
    let group = share::SharedGroup {
        handles: taken,
        views,
    };
    let tensors = waiting(py, timeout, |wait| share::open_many_with(group, wait))?;
    Ok(tensors.into_iter().map(PyArray::new).collect())
}

/// Registers the natives.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySharedHandle>()?;
    m.add_function(wrap_pyfunction!(open_shared, m)?)?;
    m.add_function(wrap_pyfunction!(_array_from_pickle, m)?)?;
    m.add_function(wrap_pyfunction!(_share_many, m)?)?;
    m.add_function(wrap_pyfunction!(_open_many, m)?)?;
    m.add_function(wrap_pyfunction!(_share_timeout, m)?)?;
    Ok(())
}

/// A `timeout=` argument in seconds as a duration (`None` stays `None`): `ValueError` for a
/// negative, infinite or NaN number. Shared by every call that takes one.
pub(crate) fn timeout_of(seconds: Option<f64>) -> PyResult<Option<Duration>> {
    seconds
        .map(|s| {
            Duration::try_from_secs_f64(s).map_err(|_| {
                PyValueError::new_err(format!("timeout={s} is not a duration in seconds"))
            })
        })
        .transpose()
}
