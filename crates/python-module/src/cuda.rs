//! `dlbridge.cuda`: devices, streams and events, and the stream rules of DLPack exchange.
//!
//! The Python module `dlbridge.cuda` (python/dlbridge/cuda.py) wraps these natives and adds the
//! `stream(...)` context manager.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use dlbridge::backend::cuda;

use crate::errors::IntoPyResult;

/// Whether a CUDA driver and at least one device are present.
#[pyfunction]
pub(crate) fn _cuda_is_available() -> bool {
    cuda::is_available()
}

/// Why CUDA is unavailable (empty when it is available): the driver library missing, its
/// initialization failing (with the driver's error), or a driver with no devices.
#[pyfunction]
pub(crate) fn _cuda_unavailable_reason() -> String {
    match cuda::device_count() {
        Ok(0) => match cuda::driver_version() {
            Ok((major, minor)) => {
                format!("the CUDA driver (CUDA {major}.{minor}) loaded but found no devices")
            }
            Err(_) => "the CUDA driver loaded but found no devices".into(),
        },
        Ok(_) => String::new(),
        // The reason alone: callers put it after their own "CUDA backend not available: ".
        Err(dlbridge::Error::BackendUnavailable { reason, .. }) => reason,
        Err(e) => e.to_string(),
    }
}

/// The driver's CUDA version as `(major, minor)`; `RuntimeError` where the driver does not load.
#[pyfunction]
pub(crate) fn _cuda_driver_version() -> PyResult<(i32, i32)> {
    cuda::driver_version().py()
}

/// The number of CUDA devices (0 without a driver).
#[pyfunction]
pub(crate) fn _cuda_device_count() -> usize {
    cuda::device_count().unwrap_or(0)
}

fn ordinal(device: Option<&Bound<'_, PyAny>>) -> PyResult<i32> {
    let Some(device) = device.filter(|d| !d.is_none()) else {
        return Ok(0);
    };
    if let Ok(i) = device.extract::<i64>() {
        return i32::try_from(i)
            .ok()
            .filter(|i| *i >= 0)
            .ok_or_else(|| PyValueError::new_err(format!("CUDA device {i} does not exist")));
    }
    let d = crate::device::parse(device)?;
    if !d.kind().is_cuda() {
        return Err(PyValueError::new_err(format!("{d} is not a CUDA device")));
    }
    Ok(d.index() as i32)
}

/// Waits for all work on a CUDA device.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn _cuda_synchronize(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let ordinal = ordinal(device)?;
    py.detach(|| cuda::synchronize(ordinal)).py()
}

/// The name of a CUDA device.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn _cuda_device_name(device: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    let ordinal = ordinal(device)?;
    cuda::device_name(ordinal).py()
}

/// `(free, total)` bytes of a CUDA device's memory.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn _cuda_mem_get_info(device: Option<&Bound<'_, PyAny>>) -> PyResult<(usize, usize)> {
    let ordinal = ordinal(device)?;
    cuda::mem_info(ordinal).py()
}

/// The calling thread's current stream handle on a device (0: the legacy default stream).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub(crate) fn _cuda_current_stream(device: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    let ordinal = ordinal(device)?;
    Ok(cuda::current_stream(ordinal))
}

/// Sets the calling thread's current stream on a device; returns the previous handle.
#[pyfunction]
#[pyo3(signature = (handle, device=None))]
pub(crate) fn _cuda_set_stream(
    handle: usize,
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<usize> {
    let ordinal = ordinal(device)?;
    // The driver must load and the device exist before a handle is accepted for it.
    let count = cuda::device_count().py()?;
    if ordinal as usize >= count {
        return Err(PyValueError::new_err(format!(
            "CUDA device {ordinal} does not exist: this machine has {count} CUDA device(s)"
        )));
    }
    Ok(cuda::set_current_stream(ordinal, handle))
}

/// A CUDA stream: one dlbridge created, or another library's handle.
#[pyclass(frozen, module = "dlbridge.cuda", name = "Stream")]
pub(crate) struct PyStream {
    inner: cuda::Stream,
}

#[pymethods]
impl PyStream {
    /// A new stream on `device`; non-blocking streams do not synchronise with the legacy default
    /// stream.
    #[new]
    #[pyo3(signature = (device=None, *, non_blocking=true))]
    fn py_new(device: Option<&Bound<'_, PyAny>>, non_blocking: bool) -> PyResult<Self> {
        let ordinal = ordinal(device)?;
        Ok(PyStream {
            inner: cuda::Stream::new(ordinal, non_blocking).py()?,
        })
    }

    /// Wraps another library's stream handle (e.g. `torch.cuda.current_stream().cuda_stream`).
    /// The handle must stay valid while dlbridge uses it; dlbridge never destroys it. `0` is
    /// refused as ambiguous: use `1` for the legacy default stream, `2` for the per-thread one.
    #[staticmethod]
    #[pyo3(signature = (handle, device=None))]
    fn from_handle(handle: i64, device: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let ordinal = ordinal(device)?;
        if handle <= 0 {
            return Err(PyValueError::new_err(format!(
                "stream handle {handle} is not valid: pass 1 for the legacy default stream, 2 for \
                 the per-thread default stream, or a CUstream handle"
            )));
        }
        // SAFETY: the caller vouches for the handle, as documented; dlbridge never destroys
        // it.
        let inner = unsafe { cuda::Stream::from_raw(ordinal, handle as usize) }.py()?;
        Ok(PyStream { inner })
    }

    /// The raw `CUstream` handle (0 for the legacy default stream).
    #[getter]
    fn handle(&self) -> usize {
        self.inner.handle()
    }

    /// The same handle, under PyTorch's name.
    #[getter]
    fn cuda_stream(&self) -> usize {
        self.handle()
    }

    /// The device ordinal.
    #[getter]
    fn device(&self) -> i32 {
        self.inner.device()
    }

    /// Waits for all work on the stream.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.synchronize()).py()
    }

    /// Whether all work on the stream has finished.
    fn query(&self) -> PyResult<bool> {
        self.inner.query().py()
    }

    /// Makes later work on this stream wait for `event`.
    fn wait_event(&self, event: &Bound<'_, PyEvent>) -> PyResult<()> {
        self.inner.wait_event(&event.get().inner).py()
    }

    /// Records a new event on this stream and returns it.
    fn record_event(&self) -> PyResult<PyEvent> {
        let event = cuda::Event::new(self.inner.device(), false).py()?;
        event.record(self.inner.handle()).py()?;
        Ok(PyEvent { inner: event })
    }

    fn __repr__(&self) -> String {
        format!(
            "dlbridge.cuda.Stream(device={}, handle={:#x})",
            self.device(),
            self.handle()
        )
    }
}

/// A CUDA event.
#[pyclass(frozen, module = "dlbridge.cuda", name = "Event")]
pub(crate) struct PyEvent {
    inner: cuda::Event,
}

#[pymethods]
impl PyEvent {
    /// A new event on `device`; `enable_timing` allows `elapsed_time`.
    #[new]
    #[pyo3(signature = (device=None, *, enable_timing=false))]
    fn py_new(device: Option<&Bound<'_, PyAny>>, enable_timing: bool) -> PyResult<Self> {
        let ordinal = ordinal(device)?;
        Ok(PyEvent {
            inner: cuda::Event::new(ordinal, enable_timing).py()?,
        })
    }

    /// Records the event on `stream` (a `Stream`, a handle, or the current stream when None).
    #[pyo3(signature = (stream=None))]
    fn record(&self, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let handle = match stream {
            Some(s) if !s.is_none() => match s.cast::<PyStream>() {
                Ok(st) => st.get().inner.handle(),
                Err(_) => s.extract::<usize>()?,
            },
            _ => cuda::current_stream(self.inner.device()),
        };
        self.inner.record(handle).py()
    }

    /// Waits until the recorded work has finished.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.synchronize()).py()
    }

    /// Whether the recorded work has finished.
    fn query(&self) -> PyResult<bool> {
        self.inner.query().py()
    }

    /// Makes later work on `stream` wait for the event, without blocking the host: a `Stream`,
    /// another library's stream object (`torch.cuda.Stream`: its `cuda_stream`; CuPy: `ptr`), a
    /// raw handle, or the current stream of the event's device when None.
    #[pyo3(signature = (stream=None))]
    fn wait(&self, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let ordinal = self.inner.device();
        let handle = match stream {
            Some(s) if !s.is_none() => match s.cast::<PyStream>() {
                Ok(st) => st.get().inner.handle(),
                Err(_) => match s.getattr("cuda_stream").or_else(|_| s.getattr("ptr")) {
                    Ok(h) => h.extract::<usize>()?,
                    Err(_) => s.extract::<usize>()?,
                },
            },
            _ => cuda::current_stream(ordinal),
        };
        // SAFETY: the caller vouches for the stream handle as for `Stream.from_handle`; the
        // wrapper never destroys it and lives only for this call.
        let stream = unsafe { cuda::Stream::from_raw(ordinal, handle) }.py()?;
        stream.wait_event(&self.inner).py()
    }

    /// The raw `CUevent` handle (for `ctypes` or another library's event wait).
    #[getter]
    fn handle(&self) -> usize {
        self.inner.handle()
    }

    /// Milliseconds from this event to `end` (both recorded, completed and timing-enabled).
    fn elapsed_time(&self, end: &Bound<'_, PyEvent>) -> PyResult<f32> {
        self.inner.elapsed_ms(&end.get().inner).py()
    }
}

impl From<cuda::Event> for PyEvent {
    fn from(inner: cuda::Event) -> PyEvent {
        PyEvent { inner }
    }
}

/// Registers the natives on the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_cuda_is_available, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_driver_version, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_device_name, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_mem_get_info, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_current_stream, m)?)?;
    m.add_function(wrap_pyfunction!(_cuda_set_stream, m)?)?;
    m.add_class::<PyStream>()?;
    m.add_class::<PyEvent>()?;
    Ok(())
}
