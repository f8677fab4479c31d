//! An example extension on `dlbridge-pyo3`: functions that take and return any framework's
//! arrays. Built by `scripts/test.sh`; tested by `tests/python/test_pyo3_ext.py`.

use dlbridge_pyo3::dlbridge::compute::{
    self,
    kernel::{self, KernelArg, LaunchConfig},
};
use dlbridge_pyo3::dlbridge::{DType, DeviceKind, Tensor};
use dlbridge_pyo3::{ArrayArg, to_py};
use ndarray::{Ix1, Ix2, IxDyn};
use pyo3::prelude::*;

/// Sum of a float32 array of any shape and layout on the host (an `ndarray` view).
#[pyfunction]
fn total(py: Python<'_>, x: ArrayArg) -> PyResult<f64> {
    let x = x.expect("x").cpu().read::<f32>(py)?;
    Ok(x.as_array::<IxDyn>()?.iter().map(|&v| f64::from(v)).sum())
}

/// Sum of the first element of a small float32 vector: the benchmark's per-call work.
#[pyfunction]
fn first(py: Python<'_>, x: ArrayArg) -> PyResult<f32> {
    let x = x.expect("x").ndim(1).c_contiguous().read::<f32>(py)?;
    Ok(x.as_slice()?.first().copied().unwrap_or(0.0))
}

/// Takes any object and returns `0.0`: the floor of a PyO3 call, for the benchmark.
#[pyfunction]
fn noop(_x: &Bound<'_, PyAny>) -> f32 {
    0.0
}

/// PyTorch's own share of a tensor argument, with no dlbridge code, for the benchmark's floor:
/// the type's DLPack exchange table describes the tensor (`dltensor_from_py_object_no_sync`),
/// and the two states a consumer must ask because the table hands such tensors out unchanged,
/// `requires_grad` and `is_neg()`. Returns `0.0`.
#[pyfunction]
fn torch_floor(x: &Bound<'_, PyAny>) -> PyResult<f32> {
    use dlbridge_pyo3::dlbridge::dlpack::ffi::{DLPackExchangeAPI, DLTensor};
    use std::sync::OnceLock;
    static TABLE: OnceLock<usize> = OnceLock::new();
    let py = x.py();
    let table = match TABLE.get() {
        Some(&t) => t,
        None => {
            let capsule = x.get_type().getattr("__dlpack_c_exchange_api__")?;
            // SAFETY: a live object; a wrong name returns NULL with an exception set.
            let ptr = unsafe {
                pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dlpack_exchange_api".as_ptr())
            };
            if ptr.is_null() {
                return Err(PyErr::fetch(py));
            }
            *TABLE.get_or_init(|| ptr as usize)
        }
    };
    // SAFETY: DLPack 1.3 tables live, unchanged, for the whole process.
    let api = unsafe { &*(table as *const DLPackExchangeAPI) };
    let describe = api.dltensor_from_py_object_no_sync.ok_or_else(|| {
        pyo3::exceptions::PyTypeError::new_err("no dltensor_from_py_object_no_sync")
    })?;
    let mut dl = std::mem::MaybeUninit::<DLTensor>::zeroed();
    // SAFETY: an object of the table's type, the GIL held, a valid place for the descriptor.
    if unsafe { describe(x.as_ptr().cast(), dl.as_mut_ptr()) } != 0 {
        return Err(PyErr::fetch(py));
    }
    let grad = x.getattr(pyo3::intern!(py, "requires_grad"))?.is_truthy()?;
    let neg = x.call_method0(pyo3::intern!(py, "is_neg"))?.is_truthy()?;
    Ok(if grad || neg { 1.0 } else { 0.0 })
}

/// `y += a * x` in place, for 1-D float32 host arrays of one length (`ndarray` views).
#[pyfunction]
fn axpy(py: Python<'_>, a: f32, x: ArrayArg, y: ArrayArg) -> PyResult<()> {
    let x = x.expect("x").ndim(1).cpu().read::<f32>(py)?;
    let mut y = y.expect("y").ndim(1).cpu().write::<f32>(py)?;
    let xv = x.as_array::<Ix1>()?;
    let mut yv = y.as_array_mut::<Ix1>()?;
    if xv.len() != yv.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "x and y differ in length ({} and {})",
            xv.len(),
            yv.len()
        )));
    }
    yv.scaled_add(a, &xv);
    Ok(())
}

/// Row sums of a C-contiguous 2-D float64 matrix with 3 columns, as a new array.
#[pyfunction]
#[pyo3(signature = (m, framework = "dlpack"))]
fn row_sums<'py>(py: Python<'py>, m: ArrayArg, framework: &str) -> PyResult<Bound<'py, PyAny>> {
    let m = m
        .expect("m")
        .shape(&[None, Some(3)])
        .c_contiguous()
        .cpu()
        .read::<f64>(py)?;
    let sums: Vec<f64> = m
        .as_array::<Ix2>()?
        .rows()
        .into_iter()
        .map(|r| r.sum())
        .collect();
    let out = Tensor::from_slice(&sums, &[sums.len()]).map_err(to_py)?;
    dlbridge_pyo3::to_framework(py, out, framework)
}

/// A new float32 array `0, 1, ..., n-1` from dlbridge's pool, returned as a DLPack tensor or
/// converted to `framework` ("numpy", "torch", "jax", "cupy", "dlbridge").
#[pyfunction]
#[pyo3(signature = (n, framework = "dlpack"))]
fn arange<'py>(py: Python<'py>, n: usize, framework: &str) -> PyResult<Bound<'py, PyAny>> {
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let out = Tensor::from_slice(&values, &[n]).map_err(to_py)?;
    dlbridge_pyo3::to_framework(py, out, framework)
}

const SCALE: &str = r#"
extern "C" __global__ void scale(float* x, float a, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"#;

/// Multiplies a contiguous float32 CUDA array by `a` in place, with an NVRTC kernel launched on
/// the caller's memory and this thread's current stream (the one the producer's pending work
/// was ordered before).
#[pyfunction]
fn scale_cuda(py: Python<'_>, x: ArrayArg, a: f32) -> PyResult<()> {
    let x = x
        .expect("x")
        .device(DeviceKind::Cuda)
        .c_contiguous()
        .write::<f32>(py)?;
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let k = kernel::compile(x.device(), SCALE, "scale", &[]).map_err(to_py)?;
    let blocks = u32::try_from(n.div_ceil(256)).unwrap_or(u32::MAX);
    let config = LaunchConfig {
        grid: [blocks, 1, 1],
        block: [256, 1, 1],
        shared_mem: 0,
    };
    let args = [
        KernelArg::Tensor(x.tensor()?.clone()),
        KernelArg::Float(f64::from(a)),
        KernelArg::Int(n as i64),
    ];
    py.detach(|| kernel::launch(&k, config, &args))
        .map_err(to_py)?;
    Ok(())
}

/// Holds a read borrow of an array until `release` (tests the lifetime and the borrow rules).
#[pyclass]
struct Held {
    view: Option<dlbridge_pyo3::ReadArray<f32>>,
}

#[pymethods]
impl Held {
    /// The held array's sum.
    fn total(&self) -> PyResult<f64> {
        let Some(view) = &self.view else {
            return Err(pyo3::exceptions::PyValueError::new_err("released"));
        };
        Ok(view
            .as_array::<IxDyn>()?
            .iter()
            .map(|&v| f64::from(v))
            .sum())
    }

    /// Ends the borrow.
    fn release(&mut self) {
        self.view = None;
    }
}

/// Borrows `x` for reading and keeps the borrow (and `x`'s memory) in the returned object.
#[pyfunction]
fn hold(py: Python<'_>, x: ArrayArg) -> PyResult<Held> {
    let view = x.expect("x").cpu().read::<f32>(py)?;
    Ok(Held { view: Some(view) })
}

/// The shape and the dtype's name of any array, unchecked (no element type needed).
#[pyfunction]
fn describe(x: ArrayArg) -> (Vec<usize>, String) {
    (x.shape().to_vec(), x.dtype().name())
}

/// A float32 copy of a host array of any dtype dlbridge can convert (`bfloat16`, the 8-bit
/// floats, ...), as `framework`'s array.
#[pyfunction]
#[pyo3(signature = (x, framework = "numpy"))]
fn to_float32<'py>(py: Python<'py>, x: ArrayArg, framework: &str) -> PyResult<Bound<'py, PyAny>> {
    cast(py, x, "float32", framework)
}

/// A copy of a host array converted to `dtype` (a dtype name), as `framework`'s array.
#[pyfunction]
#[pyo3(signature = (x, dtype, framework = "numpy"))]
fn cast<'py>(
    py: Python<'py>,
    x: ArrayArg,
    dtype: &str,
    framework: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let dtype: DType = dtype.parse().map_err(to_py)?;
    let x = x.expect("x").cpu().check()?;
    let out = compute::cast(&x, dtype).map_err(to_py)?;
    dlbridge_pyo3::to_framework(py, out, framework)
}

/// Multiplies a bfloat16 host array (a NumPy array of `ml_dtypes.bfloat16`, say) by `a` in place,
/// in any strided layout.
#[pyfunction]
fn scale_bf16(py: Python<'_>, x: ArrayArg, a: f32) -> PyResult<()> {
    let mut x = x.expect("x").cpu().write::<half::bf16>(py)?;
    x.as_array_mut::<IxDyn>()?
        .mapv_inplace(|v| half::bf16::from_f32(v.to_f32() * a));
    Ok(())
}

/// The data pointer dlbridge sees for `x` (zero-copy checks).
#[pyfunction]
fn data_ptr(x: ArrayArg) -> PyResult<usize> {
    let t = x.into_tensor()?;
    Ok(t.buffer().handle() as usize + t.byte_offset())
}

/// The module.
#[pymodule]
fn dlbridge_pyo3_ext(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(total, m)?)?;
    m.add_function(wrap_pyfunction!(first, m)?)?;
    m.add_function(wrap_pyfunction!(noop, m)?)?;
    m.add_function(wrap_pyfunction!(torch_floor, m)?)?;
    m.add_function(wrap_pyfunction!(axpy, m)?)?;
    m.add_function(wrap_pyfunction!(row_sums, m)?)?;
    m.add_function(wrap_pyfunction!(arange, m)?)?;
    m.add_function(wrap_pyfunction!(scale_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(hold, m)?)?;
    m.add_function(wrap_pyfunction!(data_ptr, m)?)?;
    m.add_function(wrap_pyfunction!(describe, m)?)?;
    m.add_function(wrap_pyfunction!(to_float32, m)?)?;
    m.add_function(wrap_pyfunction!(cast, m)?)?;
    m.add_function(wrap_pyfunction!(scale_bf16, m)?)?;
    m.add_class::<Held>()?;
    Ok(())
}
