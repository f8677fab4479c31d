//! Run-time user kernels from Python (`Backend.compile_kernel` / `Backend.execute_kernel`, bound
//! in [`crate::backend`]): the `Kernel` class and the readers of entry points, launch dimensions
//! and arguments for [`dlbridge::compute::kernel`].

use dlbridge::DType;
use dlbridge::compute::kernel::{Kernel, KernelArg};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyTuple};

use crate::array::PyArray;
use crate::device::PyDevice;

/// A kernel compiled for one device (`Backend.compile_kernel`).
#[pyclass(frozen, module = "dlbridge", name = "Kernel")]
pub(crate) struct PyKernel {
    inner: Kernel,
}

impl PyKernel {
    pub(crate) fn new(inner: Kernel) -> Self {
        PyKernel { inner }
    }

    /// The compiled kernel.
    pub(crate) fn kernel(&self) -> &Kernel {
        &self.inner
    }
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

/// The entry point of kernel source that defines exactly one: the name after `__global__ void`
/// (CUDA C, `__launch_bounds__(...)` allowed between) or `kernel void` (MSL).
pub(crate) fn entry_name(source: &str) -> PyResult<String> {
    let words = tokens(source);
    let mut names = Vec::new();
    for (i, &word) in words.iter().enumerate() {
        let mut rest = match word {
            "__global__" | "kernel" => &words[i + 1..],
            _ => continue,
        };
        if word == "__global__" && rest.first() == Some(&"__launch_bounds__") {
            if rest.get(1) != Some(&"(") {
                continue;
            }
            match rest.iter().position(|&t| t == ")") {
                Some(close) => rest = &rest[close + 1..],
                None => continue,
            }
        }
        if let [void, name, "(", ..] = rest {
            let starts_like_name = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_');
            if *void == "void" && starts_like_name {
                names.push(name.to_string());
            }
        }
    }
    match names.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(PyValueError::new_err(format!(
            "name the kernel's entry point: the source defines {} kernels ({})",
            names.len(),
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        ))),
    }
}

/// The words (runs of letters, digits and `_`) and other non-space characters of `source`.
fn tokens(source: &str) -> Vec<&str> {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(c) = rest.chars().next() {
        let len = if is_word(c) {
            rest.find(|c: char| !is_word(c)).unwrap_or(rest.len())
        } else {
            c.len_utf8()
        };
        if !c.is_whitespace() {
            out.push(&rest[..len]);
        }
        rest = &rest[len..];
    }
    out
}

/// Reads a grid or block: an int or a tuple of 1 to 3 positive ints.
pub(crate) fn dims(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<[u32; 3]> {
    let invalid = || -> PyResult<PyErr> {
        Ok(PyTypeError::new_err(format!(
            "{what} must be an int or a tuple of 1 to 3 ints, got {}",
            obj.repr()?
        )))
    };
    let items: Vec<Bound<'_, PyAny>> = if obj.is_instance_of::<PyInt>() {
        vec![obj.clone()]
    } else {
        obj.try_iter()?.collect::<PyResult<_>>()?
    };
    if items.is_empty() || items.len() > 3 || !items.iter().all(|d| d.is_instance_of::<PyInt>()) {
        return Err(invalid()?);
    }
    let values = PyTuple::new(obj.py(), &items)?;
    let mut out = [1u32; 3];
    for (slot, item) in out.iter_mut().zip(&items) {
        let positive = item.extract::<i64>().is_ok_and(|v| v > 0);
        *slot = match item.extract::<u32>() {
            Ok(v) if positive => v,
            _ if !positive => {
                return Err(PyValueError::new_err(format!(
                    "{what} {} must be positive in every dimension",
                    values.repr()?
                )));
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{what} {} must fit 32 bits in every dimension",
                    values.repr()?
                )));
            }
        };
    }
    Ok(out)
}

/// Reads the launch arguments.
pub(crate) fn kernel_args(args: &Bound<'_, PyTuple>) -> PyResult<Vec<KernelArg>> {
    args.iter()
        .enumerate()
        .map(|(i, a)| kernel_arg(i, &a))
        .collect()
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

/// Registers the class.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKernel>()?;
    Ok(())
}
