//! Return values: [`PyTensor`], a Rust-allocated (or imported) tensor as a Python object every
//! framework can import, and [`to_framework`], which hands it to a framework by name.

use dlbridge::Tensor;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::{IntoPyObjectExt, intern};

use crate::error::IntoPyResult;
use crate::exchange::c_api::{ExchangeTable, TensorClass};

/// A tensor returned to Python: `__dlpack__`, `__dlpack_device__` and the DLPack 1.3 C exchange
/// table (`__dlpack_c_exchange_api__`), so `numpy.from_dlpack`, `torch.from_dlpack`,
/// `jax.numpy.from_dlpack`, `cupy.from_dlpack` and `dlbridge.from_dlpack` all take it without a
/// copy. Return it from a `#[pyfunction]` as it is, or hand it to the caller's framework with
/// [`to_framework`].
#[pyclass(name = "Tensor", module = "dlbridge_pyo3", frozen)]
#[derive(Debug)]
pub struct PyTensor {
    tensor: Tensor,
}

impl PyTensor {
    /// Wraps `tensor` (any device; typically from [`Tensor::empty`] and friends, which take it
    /// from dlbridge's pool).
    pub fn new(tensor: Tensor) -> Self {
        PyTensor { tensor }
    }

    /// The tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }
}

#[pymethods]
impl PyTensor {
    /// `__dlpack__(stream=None, max_version=None, dl_device=None, copy=None)` per the array API
    /// standard; the rules (stream handoff, copy, version) are the core's [`ExportRequest`].
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let dl_device = dl_device
            .map(|(device_type, device_id)| {
                dlbridge::Device::from_dlpack(dlbridge::dlpack::ffi::DLDevice {
                    device_type,
                    device_id,
                })
            })
            .transpose()
            .py()?;
        crate::exchange::producer::export(py, &self.tensor, stream, max_version, dl_device, copy)
    }

    /// The DLPack `(device_type, device_id)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        let dl = self.tensor.device().to_dlpack();
        (dl.device_type, dl.device_id)
    }

    /// This crate's DLPack 1.3 C exchange table.
    #[classattr]
    fn __dlpack_c_exchange_api__(py: Python<'_>) -> PyResult<Py<PyAny>> {
        TABLE.capsule(py)
    }

    /// Extents.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.tensor.shape().to_vec()
    }

    /// The element type's name (`"float32"`, ...).
    #[getter]
    fn dtype(&self) -> String {
        self.tensor.dtype().name()
    }

    /// The device (`"cpu"`, `"cuda:0"`, ...).
    #[getter]
    fn device(&self) -> String {
        self.tensor.device().to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "dlbridge_pyo3.Tensor(shape={}, dtype={}, device={})",
            dlbridge::layout::shape_text(self.tensor.shape()),
            self.tensor.dtype(),
            self.tensor.device()
        )
    }
}

/// `tensor` as an array of `framework`, without a copy: `"numpy"`, `"torch"`, `"jax"`,
/// `"cupy"` or `"dlbridge"` (each framework's own `from_dlpack`; for NumPy, a `bfloat16` or
/// 8-bit float tensor becomes an array of the `ml_dtypes` type), or `"dlpack"` for the
/// [`PyTensor`] itself. An unknown name is a `ValueError`; a framework that is not installed,
/// an `ImportError`.
pub fn to_framework<'py>(
    py: Python<'py>,
    tensor: Tensor,
    framework: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let module = match framework {
        "dlpack" => return PyTensor::new(tensor).into_bound_py_any(py),
        "numpy" => "numpy",
        "torch" => "torch",
        "jax" => "jax.numpy",
        "cupy" => "cupy",
        "dlbridge" => "dlbridge",
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown framework {other:?}: expected \"numpy\", \"torch\", \"jax\", \"cupy\", \
                 \"dlbridge\" or \"dlpack\""
            )));
        }
    };
    if module == "numpy"
        && let Some(array) = crate::exchange::ml_dtypes::to_numpy::<PyTensor>(py, &tensor)?
    {
        // bfloat16 and the 8-bit floats, which NumPy's own from_dlpack refuses.
        return Ok(array);
    }
    let from_dlpack = py.import(module)?.getattr(intern!(py, "from_dlpack"))?;
    from_dlpack.call1((PyTensor::new(tensor),))
}

impl TensorClass for PyTensor {
    #[inline]
    fn with_tensor<R>(&self, f: impl FnOnce(&Tensor) -> R) -> PyResult<R> {
        Ok(f(self.tensor()))
    }

    fn new_object(py: Python<'_>, tensor: Tensor) -> PyResult<Py<PyAny>> {
        Ok(Py::new(py, PyTensor::new(tensor))?.into_any())
    }
}

/// [`PyTensor`]'s table (one per extension that links this crate).
pub(crate) static TABLE: ExchangeTable = ExchangeTable::new::<PyTensor>();
