//! Run-time user kernels from Python (`Backend.compile_kernel` / `Backend.execute_kernel`):
//! [`dlbridge::compute::kernel`].

use dlbridge::DType;
use dlbridge::compute::kernel::{self, Kernel, KernelArg, LaunchConfig};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyTuple};

use crate::array::PyArray;
use crate::device::PyDevice;
use crate::errors::IntoPyResult;

/// A kernel compiled for one device (`Backend.compile_kernel`).
#[pyclass(frozen, module = "dlbridge", name = "Kernel")]
pub(crate) struct PyKernel {
    inner: Kernel,
}

#[pymethods]
impl PyKernel {
    /// The entry point's name.
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// The device the kernel runs on.
    #[getter]
    fn device(&self) -> PyDevice {
        PyDevice(self.inner.device())
    }

    /// The byte size of each parameter, when the driver reports them (else None).
    #[getter]
    fn param_sizes(&self) -> Option<Vec<usize>> {
        self.inner.param_sizes().map(<[usize]>::to_vec)
    }

    fn __repr__(&self) -> String {
        format!(
            "dlbridge.Kernel({:?}, device='{}')",
            self.inner.name(),
            self.inner.device()
        )
    }
}

/// Compiles `source` for `device` (cached by device, source, name and options).
#[pyfunction]
#[pyo3(signature = (device, source, name, options=None))]
fn _compile_kernel(
    py: Python<'_>,
    device: &Bound<'_, PyAny>,
    source: &str,
    name: &str,
    options: Option<Vec<String>>,
) -> PyResult<PyKernel> {
    let device = crate::device::parse(device)?;
    let options = options.unwrap_or_default();
    let inner = py
        .detach(|| kernel::compile(device, source, name, &options))
        .py()?;
    Ok(PyKernel { inner })
}

/// Reads a grid or block: an int or a tuple of 1 to 3 positive ints.
fn dims(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<[u32; 3]> {
    let values: Vec<i64> = if let Ok(n) = obj.extract::<i64>() {
        vec![n]
    } else {
        obj.extract().map_err(|_| {
            PyTypeError::new_err(format!("{what} must be an int or a tuple of up to 3 ints"))
        })?
    };
    if values.is_empty() || values.len() > 3 {
        return Err(PyValueError::new_err(format!(
            "{what} must have 1 to 3 dimensions, got {}",
            values.len()
        )));
    }
    let mut out = [1u32; 3];
    for (slot, v) in out.iter_mut().zip(&values) {
        *slot = u32::try_from(*v).ok().filter(|&v| v > 0).ok_or_else(|| {
            PyValueError::new_err(format!(
                "{what} {values:?} must be positive in every dimension (and fit 32 bits)"
            ))
        })?;
    }
    Ok(out)
}

/// Reads one launch argument.
fn kernel_arg(i: usize, obj: &Bound<'_, PyAny>) -> PyResult<KernelArg> {
    let py = obj.py();
    if let Ok(a) = obj.cast::<PyArray>() {
        return Ok(KernelArg::Tensor(a.get().tensor()?.clone()));
    }
    if obj.is_instance_of::<PyBool>() {
        let mut bytes = [0u8; 8];
        bytes[0] = u8::from(obj.extract::<bool>()?);
        return Ok(KernelArg::Typed {
            dtype: DType::BOOL,
            bytes,
        });
    }
    if obj.is_instance_of::<PyInt>() {
        let v: i64 = obj.extract().map_err(|_| {
            PyValueError::new_err(format!("argument {i}: {obj} does not fit in 64 bits"))
        })?;
        return Ok(KernelArg::Int(v));
    }
    if obj.is_instance_of::<PyFloat>() {
        return Ok(KernelArg::Float(obj.extract()?));
    }
    if is_numpy_scalar(obj)? {
        return typed_scalar(i, obj);
    }
    if obj.hasattr(pyo3::intern!(py, "__dlpack__"))? {
        return Ok(KernelArg::Tensor(
            crate::dlpack::consumer::from_dlpack(obj, None, None, None)?.tensor,
        ));
    }
    Err(PyTypeError::new_err(format!(
        "argument {i}: a kernel takes arrays (dlbridge or DLPack) and numbers, not {}",
        obj.get_type().name()?
    )))
}

/// A NumPy-style scalar (`np.float32(1)`, a 0-d array): passed by value in its own dtype.
fn is_numpy_scalar(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = obj.py();
    Ok(obj.hasattr(pyo3::intern!(py, "dtype"))?
        && obj.hasattr(pyo3::intern!(py, "tobytes"))?
        && obj
            .getattr(pyo3::intern!(py, "ndim"))
            .and_then(|n| n.extract::<usize>())
            .is_ok_and(|n| n == 0))
}

/// The exact bytes of a NumPy-style scalar (native order, little-endian on every target here).
fn typed_scalar(i: usize, obj: &Bound<'_, PyAny>) -> PyResult<KernelArg> {
    let dtype = crate::dtype::parse(&obj.getattr("dtype")?)
        .map_err(|e| PyTypeError::new_err(format!("argument {i}: {e}")))?;
    let raw: Vec<u8> = obj.call_method0("tobytes")?.extract()?;
    if raw.len() > 8 || raw.len() != dtype.itemsize() {
        return Err(PyTypeError::new_err(format!(
            "argument {i}: a {dtype} scalar cannot be passed to a kernel by value"
        )));
    }
    let mut bytes = [0u8; 8];
    bytes[..raw.len()].copy_from_slice(&raw);
    Ok(KernelArg::Typed { dtype, bytes })
}

/// Launches `kernel` and waits for it; returns its device time in milliseconds.
#[pyfunction]
#[pyo3(signature = (kernel, grid, block, args, shared_mem=0))]
fn _launch_kernel(
    py: Python<'_>,
    kernel: &Bound<'_, PyKernel>,
    grid: &Bound<'_, PyAny>,
    block: &Bound<'_, PyAny>,
    args: &Bound<'_, PyTuple>,
    shared_mem: u32,
) -> PyResult<f64> {
    let config = LaunchConfig {
        grid: dims(grid, "grid")?,
        block: dims(block, "block")?,
        shared_mem,
    };
    let args: Vec<KernelArg> = args
        .iter()
        .enumerate()
        .map(|(i, a)| kernel_arg(i, &a))
        .collect::<PyResult<_>>()?;
    let kernel = kernel.get().inner.clone();
    let timing = py.detach(|| kernel::launch(&kernel, config, &args)).py()?;
    Ok(timing.elapsed_ms)
}

/// Registers the class and functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKernel>()?;
    m.add_function(wrap_pyfunction!(_compile_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(_launch_kernel, m)?)?;
    Ok(())
}
