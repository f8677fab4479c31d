//! The native base of `dlbridge.Backend`: [`dlbridge::compute::Backend`] for Python.
//!
//! `python/dlbridge/backend.py` subclasses it and adds only what has to be Python: running Python
//! callables as kernels (and timing them), and the `KernelExecutionResult` it reports.

use dlbridge::compute::{Backend, BackendType};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use crate::array::PyArray;
use crate::device::PyDevice;
use crate::errors::IntoPyResult;
use crate::kernel::PyKernel;

/// One device's compute backend (`dlbridge.Backend`, which subclasses this).
#[pyclass(frozen, subclass, module = "dlbridge._dlbridge", name = "_Backend")]
pub(crate) struct PyBackend {
    inner: Backend,
}

#[pymethods]
impl PyBackend {
    /// The backend of `device` (`"cpu"`, `"cuda[:N]"`, `"metal[:N]"`); with none, the best
    /// available: CUDA, then Metal, then the CPU. A backend that cannot run here raises
    /// `RuntimeError` (`dlbridge.Backend` raises its subclass `BackendUnavailableError`).
    #[new]
    #[pyo3(signature = (device=None))]
    fn py_new(device: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let inner = match device.filter(|d| !d.is_none()) {
            None => Backend::best(),
            Some(d) => Backend::new(crate::device::parse(d)?).py()?,
        };
        Ok(PyBackend { inner })
    }

    /// The device this backend computes on.
    #[getter]
    fn device(&self) -> PyDevice {
        PyDevice(self.inner.device())
    }

    /// `"cpu"`, `"cuda"` or `"metal"`.
    #[getter]
    fn backend_type(&self) -> &'static str {
        match self.inner.backend_type() {
            BackendType::Cpu => "cpu",
            BackendType::Cuda => "cuda",
            BackendType::Metal => "metal",
        }
    }

    /// Whether the backend can run on this machine (always True for a constructed backend
    /// unless the device went away).
    #[getter]
    fn is_available(&self) -> bool {
        self.inner.is_available()
    }

    /// How many devices of this backend's kind exist (1 for the CPU).
    #[getter]
    fn device_count(&self) -> usize {
        self.inner.device_count()
    }

    /// The device's index.
    #[getter]
    fn device_id(&self) -> u32 {
        self.inner.device_id()
    }

    fn __repr__(&self) -> String {
        format!("dlbridge.Backend('{}')", self.inner.device())
    }

    /// An uninitialised array on this device, from the caching pool.
    #[pyo3(signature = (shape, dtype=None), text_signature = "(self, shape, dtype='float32')")]
    fn allocate(
        &self,
        shape: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyArray> {
        let (shape, dtype) = shape_and_dtype(shape, dtype)?;
        self.inner.allocate(&shape, dtype).py().map(PyArray::new)
    }

    /// A zero-filled array on this device.
    #[pyo3(signature = (shape, dtype=None), text_signature = "(self, shape, dtype='float32')")]
    fn allocate_zeros(
        &self,
        shape: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyArray> {
        let (shape, dtype) = shape_and_dtype(shape, dtype)?;
        self.inner
            .allocate_zeros(&shape, dtype)
            .py()
            .map(PyArray::new)
    }

    /// Returns `array`'s memory to the pool now; using `array` afterwards raises `ValueError`.
    /// Refused (`BufferError`) while another view or an export shares the memory, since freeing
    /// it then would leave them dangling.
    fn free(&self, array: &Bound<'_, PyAny>) -> PyResult<()> {
        // A Python array is freed through its handle, which marks it freed for later use; the
        // core's `Backend::free` consumes a Rust tensor, which a Python object cannot give up.
        let array = array.cast::<PyArray>().map_err(|_| {
            PyTypeError::new_err(format!(
                "free() takes a dlbridge.Array, not {}",
                array
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        array.get().free()
    }

    /// A copy of `host_array` (NumPy, any DLPack or buffer-protocol array, or nested sequences)
    /// in new memory on this device.
    fn copy_to_device(&self, host_array: &Bound<'_, PyAny>) -> PyResult<PyArray> {
        let device = Some(self.inner.device());
        crate::creation::tensor_from(host_array, None, device, None, Some(true)).map(PyArray::new)
    }

    /// A NumPy copy of `array` (any device).
    fn copy_to_host<'py>(&self, array: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = array.py();
        let source = match array.cast::<PyArray>() {
            Ok(a) => a.get().tensor()?.clone(),
            Err(_) => crate::creation::tensor_from(array, None, None, None, None)?,
        };
        let host = py.detach(|| self.inner.copy_to_host(&source)).py()?;
        py.import(pyo3::intern!(py, "numpy"))?
            .call_method1(pyo3::intern!(py, "from_dlpack"), (PyArray::new(host),))
    }

    /// Waits until this device has finished the work dlbridge (and, on CUDA, every stream)
    /// enqueued.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.synchronize()).py()
    }

    /// The caching pool's figures (`dlbridge.memory_stats`: the limits are None where unset);
    /// on CUDA also the device's `free_bytes` and `total_bytes` as the driver reports them.
    fn get_memory_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let device = Bound::new(py, PyDevice(self.inner.device()))?.into_any();
        // The one dict of pool figures is `dlbridge.memory_stats`'s.
        let info = py
            .import(pyo3::intern!(py, "dlbridge._dlbridge"))?
            .call_method1(pyo3::intern!(py, "memory_stats"), (&device,))?
            .cast_into::<PyDict>()?;
        if self.inner.backend_type() == BackendType::Cuda {
            let (free, total) = crate::cuda::_cuda_mem_get_info(Some(&device))?;
            info.set_item("free_bytes", free)?;
            info.set_item("total_bytes", total)?;
        }
        Ok(info)
    }

    /// Returns every cached block of this device's pool to the driver.
    fn clear_cache(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.clear_cache()).py()
    }

    /// Compiles kernel source for this device (cached by source, name and options): CUDA C by
    /// NVRTC (`options` are NVRTC options; the device's architecture is added) or MSL. `name` is
    /// the entry point; when omitted, the one kernel the source defines. A compiler error raises
    /// `RuntimeError` carrying the compiler's log.
    #[pyo3(signature = (source, name=None, options=None))]
    fn compile_kernel(
        &self,
        py: Python<'_>,
        source: &Bound<'_, PyAny>,
        name: Option<String>,
        options: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyKernel> {
        let source = source.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "a kernel is source text or a Python callable, not {}",
                source
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        if self.inner.backend_type() == BackendType::Cpu {
            return Err(PyTypeError::new_err(
                "the CPU backend runs Python callables as kernels (they receive NumPy views of \
                 the arrays); source code compiles on CUDA and Metal",
            ));
        }
        let source = source.to_cow()?;
        let name = match name {
            Some(name) => name,
            None => crate::kernel::entry_name(&source)?,
        };
        let options: Vec<String> = match options.filter(|o| o.is_truthy().unwrap_or(true)) {
            None => Vec::new(),
            Some(o) => o
                .try_iter()?
                .map(|s| s.and_then(|s| s.extract::<String>()))
                .collect::<PyResult<_>>()?,
        };
        let kernel = py
            .detach(|| self.inner.compile_kernel(&source, &name, &options))
            .py()?;
        Ok(PyKernel::new(kernel))
    }

    /// The launch behind `dlbridge.Backend.execute_kernel`: checks `grid` and `block` (which
    /// apply to every kind of kernel), then launches a compiled `Kernel` and waits for it,
    /// returning its device time in milliseconds; returns None for a Python callable, which the
    /// caller runs. A launch or kernel failure raises `RuntimeError`.
    #[pyo3(signature = (kernel, grid, block, args, shared_mem))]
    fn _launch(
        &self,
        py: Python<'_>,
        kernel: &Bound<'_, PyAny>,
        grid: &Bound<'_, PyAny>,
        block: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        shared_mem: &Bound<'_, PyAny>,
    ) -> PyResult<Option<f64>> {
        let grid = crate::kernel::dims(grid, "grid")?;
        let block = crate::kernel::dims(block, "block")?;
        let Ok(kernel) = kernel.cast::<PyKernel>() else {
            if kernel.is_callable() {
                return Ok(None);
            }
            return Err(PyTypeError::new_err(format!(
                "a kernel is a compiled Kernel or a Python callable, not {}",
                kernel.get_type().name()?
            )));
        };
        let config = dlbridge::compute::kernel::LaunchConfig {
            grid,
            block,
            shared_mem: shared_mem.extract()?,
        };
        let args = crate::kernel::kernel_args(args)?;
        let kernel = kernel.get().kernel().clone();
        let timing = py
            .detach(|| self.inner.execute_kernel(&kernel, config, &args))
            .py()?;
        Ok(Some(timing.elapsed_ms))
    }
}

/// Reads a shape and an optional dtype (float32 when omitted).
fn shape_and_dtype(
    shape: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<(crate::creation::Shape, dlbridge::DType)> {
    let dtype = match dtype.filter(|d| !d.is_none()) {
        Some(d) => crate::dtype::parse(d)?,
        None => dlbridge::DType::F32,
    };
    let extents = crate::creation::parse_shape(shape)?;
    // As `dlbridge.empty` does before its allocations.
    crate::memory::warn_env_once(shape.py())?;
    Ok((extents, dtype))
}
