//! The built-in kernels from Python: `dlbridge.ops.*`, the arithmetic operators and the
//! reduction methods of `dlbridge.Array` ([`dlbridge::compute`]).
//!
//! Operands are dlbridge arrays, any DLPack producer (imported without a copy), or Python
//! `int` / `float` scalars (weak: they take the array's dtype where they can). Work runs with the
//! GIL released.

use dlbridge::Tensor;
use dlbridge::compute::{self, BinaryOp, CompareOp, ReduceOp, Scalar, UnaryOp};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyTuple};
use pyo3::{IntoPyObjectExt, intern};

use crate::array::PyArray;
use crate::errors::IntoPyResult;

/// One operand of an element-wise op.
pub(crate) enum Arg {
    Tensor(Tensor),
    Scalar(Scalar),
}

impl Arg {
    /// The array, where this operand is one.
    fn tensor(&self) -> Option<&Tensor> {
        match self {
            Arg::Tensor(t) => Some(t),
            Arg::Scalar(_) => None,
        }
    }
}

/// Reads an operand; `Ok(None)` for objects that are neither arrays, DLPack producers nor
/// Python numbers (operators answer `NotImplemented` to those).
pub(crate) fn arg(obj: &Bound<'_, PyAny>) -> PyResult<Option<Arg>> {
    if let Ok(a) = obj.cast::<PyArray>() {
        return Ok(Some(Arg::Tensor(a.get().tensor()?.clone())));
    }
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(
            "bool operands are not supported by the arithmetic kernels; use 0 or 1",
        ));
    }
    if obj.is_instance_of::<PyInt>() {
        let v: i64 = obj.extract().map_err(|_| {
            PyValueError::new_err(format!("the integer {obj} does not fit in 64 bits"))
        })?;
        return Ok(Some(Arg::Scalar(Scalar::Int(v))));
    }
    if obj.is_instance_of::<PyFloat>() {
        return Ok(Some(Arg::Scalar(Scalar::Float(obj.extract()?))));
    }
    let py = obj.py();
    if obj.hasattr(intern!(py, "__dlpack__"))? {
        return Ok(Some(Arg::Tensor(
            crate::dlpack::consumer::from_dlpack(obj, None, None, None)?.tensor,
        )));
    }
    Ok(None)
}

/// Reads an operand of a comparison with the array `against` (the other operand, where it is one):
/// as [`arg`], with Python `bool`s as the integers 0 and 1 (`mask == True`), and an integer outside
/// `int64` read so that it compares exactly: beside a `uint64` array that it fits, a 0-d `uint64`
/// array; beside any other integer or bool array, an infinity of its sign (it lies beyond every
/// element, so each comparison has the infinity's answer, with no rounding of the value to a
/// float); elsewhere, a float.
pub(crate) fn compare_operand(
    obj: &Bound<'_, PyAny>,
    against: Option<&Tensor>,
) -> PyResult<Option<Arg>> {
    use dlbridge::{DType, DTypeCode};
    if obj.is_instance_of::<PyBool>() {
        return Ok(Some(Arg::Scalar(Scalar::Int(i64::from(
            obj.extract::<bool>()?,
        )))));
    }
    if !obj.is_instance_of::<PyInt>() || obj.extract::<i64>().is_ok() {
        return arg(obj);
    }
    let integer_array = against.filter(|t| {
        matches!(
            t.dtype().code(),
            DTypeCode::Int | DTypeCode::UInt | DTypeCode::Bool
        )
    });
    let Some(against) = integer_array else {
        return Ok(Some(Arg::Scalar(Scalar::Float(obj.extract()?))));
    };
    if against.dtype() == DType::U64 {
        if let Ok(v) = obj.extract::<u64>() {
            let mut host = Tensor::empty(&[], DType::U64, dlbridge::Device::CPU).py()?;
            host.as_mut_slice::<u64>().py()?[0] = v;
            let t = if against.device().is_cpu() {
                host
            } else {
                host.copy_to(against.device()).py()?
            };
            return Ok(Some(Arg::Tensor(t)));
        }
    }
    let infinity = if obj.gt(0)? {
        f64::INFINITY
    } else {
        f64::NEG_INFINITY
    };
    Ok(Some(Arg::Scalar(Scalar::Float(infinity))))
}

fn required(obj: &Bound<'_, PyAny>) -> PyResult<Arg> {
    arg(obj)?.ok_or_else(|| {
        PyTypeError::new_err(format!(
            "expected a dlbridge array, a DLPack array or a Python number, got {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })
}

fn tensor_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Tensor> {
    match required(obj)? {
        Arg::Tensor(t) => Ok(t),
        Arg::Scalar(_) => Err(PyTypeError::new_err(format!(
            "{what} needs an array, not a scalar"
        ))),
    }
}

fn unary_op(name: &str) -> PyResult<UnaryOp> {
    UnaryOp::ALL
        .into_iter()
        .find(|op| op.name() == name)
        .ok_or_else(|| PyValueError::new_err(format!("unknown element-wise function {name:?}")))
}

fn binary_op(name: &str) -> PyResult<BinaryOp> {
    BinaryOp::ALL
        .into_iter()
        .find(|op| op.name() == name)
        .ok_or_else(|| PyValueError::new_err(format!("unknown binary function {name:?}")))
}

fn compare_op(name: &str) -> PyResult<CompareOp> {
    CompareOp::ALL
        .into_iter()
        .find(|op| op.name() == name)
        .ok_or_else(|| PyValueError::new_err(format!("unknown comparison {name:?}")))
}

/// A reduction as the methods of `Array` and `dlbridge.ops` name it: a kernel's
/// ([`ReduceOp`]), or one composed of kernels (`all`, `any`, `var`, `std` with their `ddof`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Reduction {
    Op(ReduceOp),
    All,
    Any,
    Var(f64),
    Std(f64),
}

impl Reduction {
    /// The reduction named `name` (`ddof` for `var` and `std`).
    fn parse(name: &str, ddof: f64) -> PyResult<Reduction> {
        Ok(match name {
            "all" => Reduction::All,
            "any" => Reduction::Any,
            "var" => Reduction::Var(ddof),
            "std" => Reduction::Std(ddof),
            _ => Reduction::Op(
                ReduceOp::ALL
                    .into_iter()
                    .find(|op| op.name() == name)
                    .ok_or_else(|| PyValueError::new_err(format!("unknown reduction {name:?}")))?,
            ),
        })
    }

    fn name(self) -> &'static str {
        match self {
            Reduction::Op(op) => op.name(),
            Reduction::All => "all",
            Reduction::Any => "any",
            Reduction::Var(_) => "var",
            Reduction::Std(_) => "std",
        }
    }

    /// Whether the reduction takes one axis at most (`argmax`, `argmin`, as NumPy's).
    fn single_axis(self) -> bool {
        matches!(self, Reduction::Op(op) if op.is_arg())
    }

    /// Runs the reduction (the GIL released by the caller).
    fn run(self, x: &Tensor, axes: Option<&[isize]>, keepdims: bool) -> dlbridge::Result<Tensor> {
        match self {
            Reduction::Op(op) => compute::reduce(op, x, axes, keepdims),
            Reduction::All => compute::all(x, axes, keepdims),
            Reduction::Any => compute::any(x, axes, keepdims),
            Reduction::Var(ddof) => compute::var(x, axes, ddof, keepdims),
            Reduction::Std(ddof) => compute::std(x, axes, ddof, keepdims),
        }
    }
}

/// `op(a, b)` on read operands; `None` when neither is an array.
pub(crate) fn binary_args(py: Python<'_>, op: BinaryOp, a: Arg, b: Arg) -> PyResult<PyArray> {
    let out = match (a, b) {
        (Arg::Tensor(a), Arg::Tensor(b)) => py.detach(|| compute::binary(op, &a, &b)),
        (Arg::Tensor(a), Arg::Scalar(s)) => py.detach(|| compute::binary_scalar(op, &a, s, false)),
        (Arg::Scalar(s), Arg::Tensor(b)) => py.detach(|| compute::binary_scalar(op, &b, s, true)),
        (Arg::Scalar(_), Arg::Scalar(_)) => {
            return Err(PyTypeError::new_err(format!(
                "{} of two Python numbers: at least one operand must be an array",
                op.name()
            )));
        }
    };
    out.py().map(PyArray::new)
}

/// An operator method's body: `NotImplemented` for operands it does not know.
pub(crate) fn operator(
    py: Python<'_>,
    op: BinaryOp,
    this: &Tensor,
    other: &Bound<'_, PyAny>,
    reflected: bool,
) -> PyResult<Py<PyAny>> {
    let Some(other) = arg(other)? else {
        return Ok(py.NotImplemented());
    };
    let this = Arg::Tensor(this.clone());
    let (a, b) = if reflected {
        (other, this)
    } else {
        (this, other)
    };
    binary_args(py, op, a, b)?.into_py_any(py)
}

/// `op(a, b)` on read operands, a `bool` array.
pub(crate) fn compare_args(py: Python<'_>, op: CompareOp, a: Arg, b: Arg) -> PyResult<PyArray> {
    let out = match (a, b) {
        (Arg::Tensor(a), Arg::Tensor(b)) => py.detach(|| compute::compare(op, &a, &b)),
        (Arg::Tensor(a), Arg::Scalar(s)) => py.detach(|| compute::compare_scalar(op, &a, s, false)),
        (Arg::Scalar(s), Arg::Tensor(b)) => py.detach(|| compute::compare_scalar(op, &b, s, true)),
        (Arg::Scalar(_), Arg::Scalar(_)) => {
            return Err(PyTypeError::new_err(format!(
                "{} of two Python numbers: at least one operand must be an array",
                op.name()
            )));
        }
    };
    out.py().map(PyArray::new)
}

/// A comparison operator's body (`a == b`, ...): `NotImplemented` for operands it does not know,
/// so that Python tries the other operand and, for `==` and `!=`, falls back to identity.
/// Python itself swaps the operands of reflected comparisons (`1 < a` calls `a > 1`).
pub(crate) fn compare_operator(
    py: Python<'_>,
    op: CompareOp,
    this: &Tensor,
    other: &Bound<'_, PyAny>,
) -> PyResult<Py<PyAny>> {
    let Some(other) = compare_operand(other, Some(this))? else {
        return Ok(py.NotImplemented());
    };
    compare_args(py, op, Arg::Tensor(this.clone()), other)?.into_py_any(py)
}

/// `op(x)` element-wise.
pub(crate) fn unary_tensor(py: Python<'_>, op: UnaryOp, x: &Tensor) -> PyResult<PyArray> {
    py.detach(|| compute::unary(op, x)).py().map(PyArray::new)
}

/// Reads `axis` for `red`: None, an int, or (but for `argmax` and `argmin`, which take one axis
/// as NumPy's) a tuple of ints.
fn parse_axes(red: Reduction, axis: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<isize>>> {
    match axis {
        None => Ok(None),
        Some(a) if a.is_none() => Ok(None),
        Some(a) => {
            if a.is_instance_of::<PyBool>() {
                return Err(PyTypeError::new_err("axis must be an integer, not a bool"));
            }
            if let Ok(i) = a.extract::<isize>() {
                Ok(Some(vec![i]))
            } else if red.single_axis() {
                Err(PyTypeError::new_err(format!(
                    "{}: axis must be None or an int (one axis), not {}",
                    red.name(),
                    a.get_type().name()?
                )))
            } else if let Ok(t) = a.cast::<PyTuple>() {
                Ok(Some(t.extract().map_err(|_| {
                    PyTypeError::new_err("axis must be None, an int or a tuple of ints")
                })?))
            } else {
                Err(PyTypeError::new_err(
                    "axis must be None, an int or a tuple of ints",
                ))
            }
        }
    }
}

/// A reduction of `x` over `axis`.
pub(crate) fn reduce_tensor(
    py: Python<'_>,
    red: Reduction,
    x: &Tensor,
    axis: Option<&Bound<'_, PyAny>>,
    keepdims: bool,
) -> PyResult<PyArray> {
    let axes = parse_axes(red, axis)?;
    py.detach(|| red.run(x, axes.as_deref(), keepdims))
        .py()
        .map(PyArray::new)
}

/// A reduction as NumPy's functions call the method (`np.sum(a)` calls
/// `a.sum(axis=None, out=None)`): `dtype` converts the input first and the result to it (NumPy's
/// `dtype=` of `sum` and `mean`); `out` (a writable dlbridge or DLPack array of the result's
/// shape) receives the result, converted to its dtype, and is returned.
pub(crate) fn reduce_method(
    py: Python<'_>,
    red: Reduction,
    x: &Tensor,
    axis: Option<&Bound<'_, PyAny>>,
    keepdims: bool,
    dtype: Option<&Bound<'_, PyAny>>,
    out: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let dtype = match dtype.filter(|d| !d.is_none()) {
        Some(d) => Some(crate::dtype::parse(d)?),
        None => None,
    };
    let axes = parse_axes(red, axis)?;
    let x = x.clone();
    let result = py
        .detach(|| {
            let x = match dtype {
                Some(d) if d != x.dtype() => compute::cast(&x, d)?,
                _ => x,
            };
            let r = red.run(&x, axes.as_deref(), keepdims)?;
            match dtype {
                Some(d) if d != r.dtype() => compute::cast(&r, d),
                _ => Ok(r),
            }
        })
        .py()?;
    match out.filter(|o| !o.is_none()) {
        None => PyArray::new(result).into_py_any(py),
        Some(target) => {
            write_out(py, target, &result, red.name())?;
            Ok(target.clone().unbind())
        }
    }
}

/// Writes `result` into the `out=` array `target`, converted to its dtype.
fn write_out(
    py: Python<'_>,
    target: &Bound<'_, PyAny>,
    result: &Tensor,
    what: &str,
) -> PyResult<()> {
    let Some(Arg::Tensor(dst)) = arg(target)? else {
        return Err(PyTypeError::new_err(format!(
            "{what}: out must be a dlbridge array or a writable DLPack array (a NumPy array, a \
             PyTorch tensor), not {}",
            target.get_type().name()?
        )));
    };
    if dst.shape() != result.shape() {
        return Err(PyValueError::new_err(format!(
            "{what}: out has shape {} but the result has shape {}",
            dlbridge::layout::shape_text(dst.shape()),
            dlbridge::layout::shape_text(result.shape())
        )));
    }
    let value = if dst.dtype() == result.dtype() {
        result.clone()
    } else {
        let d = dst.dtype();
        py.detach(|| compute::cast(result, d)).py()?
    };
    // SAFETY: no Rust reference into `dst`'s memory outlives a Python call, and the GIL is held
    // for the whole write (as for `Array.__setitem__`).
    unsafe { dst.copy_from_unchecked(&value) }.py()
}

/// `dlbridge.ops` element-wise function of one operand, by name: a kernel's ([`UnaryOp`]) or a
/// classification (`isnan`, `isinf`, `isfinite`, `bool` results).
#[pyfunction]
pub(crate) fn _unary(py: Python<'_>, op: &str, x: &Bound<'_, PyAny>) -> PyResult<PyArray> {
    let classify = match op {
        "isnan" => Some(compute::isnan as fn(&Tensor) -> dlbridge::Result<Tensor>),
        "isinf" => Some(compute::isinf as fn(&Tensor) -> dlbridge::Result<Tensor>),
        "isfinite" => Some(compute::isfinite as fn(&Tensor) -> dlbridge::Result<Tensor>),
        _ => None,
    };
    if let Some(f) = classify {
        let x = tensor_arg(x, op)?;
        return py.detach(|| f(&x)).py().map(PyArray::new);
    }
    let op = unary_op(op)?;
    let x = tensor_arg(x, op.name())?;
    unary_tensor(py, op, &x)
}

/// `dlbridge.ops` element-wise function of two operands, by name.
#[pyfunction]
pub(crate) fn _binary(
    py: Python<'_>,
    op: &str,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
) -> PyResult<PyArray> {
    let op = binary_op(op)?;
    binary_args(py, op, required(a)?, required(b)?)
}

/// `dlbridge.ops` comparison, by name.
#[pyfunction]
pub(crate) fn _compare(
    py: Python<'_>,
    op: &str,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
) -> PyResult<PyArray> {
    let op = compare_op(op)?;
    let operand = |obj: &Bound<'_, PyAny>, against: Option<&Tensor>| {
        compare_operand(obj, against)?.ok_or_else(|| match required(obj) {
            Err(e) => e,
            Ok(_) => PyTypeError::new_err("unreadable operand"),
        })
    };
    // Each operand is read beside the other where that is an array (a scalar first is read again
    // once the array is known).
    let x = operand(a, None)?;
    let y = operand(b, x.tensor())?;
    let x = match (&x, y.tensor()) {
        (Arg::Scalar(_), Some(t)) => operand(a, Some(t))?,
        _ => x,
    };
    compare_args(py, op, x, y)
}

/// `dlbridge.ops` reduction, by name (`ddof` for `var` and `std`).
#[pyfunction]
#[pyo3(signature = (op, x, axis=None, keepdims=false, ddof=0.0))]
pub(crate) fn _reduce(
    py: Python<'_>,
    op: &str,
    x: &Bound<'_, PyAny>,
    axis: Option<&Bound<'_, PyAny>>,
    keepdims: bool,
    ddof: f64,
) -> PyResult<PyArray> {
    let red = Reduction::parse(op, ddof)?;
    let x = tensor_arg(x, red.name())?;
    reduce_tensor(py, red, &x, axis, keepdims)
}

/// The body of `Array.__pow__` / `__rpow__`: NumPy's arrays take no modulo (`pow(a, b, m)`
/// answers `NotImplemented`, so Python raises its `TypeError`).
pub(crate) fn power_operator(
    py: Python<'_>,
    this: &Tensor,
    other: &Bound<'_, PyAny>,
    modulo: Option<&Bound<'_, PyAny>>,
    reflected: bool,
) -> PyResult<Py<PyAny>> {
    if modulo.is_some_and(|m| !m.is_none()) {
        return Ok(py.NotImplemented());
    }
    operator(py, BinaryOp::Pow, this, other, reflected)
}

/// Reads the `ddof` of `var` / `std`, or the array API's `correction` (the same number; at most
/// one of them).
pub(crate) fn degrees_of_freedom(
    ddof: Option<&Bound<'_, PyAny>>,
    correction: Option<&Bound<'_, PyAny>>,
) -> PyResult<f64> {
    let ddof = ddof.filter(|v| !v.is_none());
    let correction = correction.filter(|v| !v.is_none());
    match (ddof, correction) {
        (Some(_), Some(_)) => Err(PyValueError::new_err(
            "ddof and correction are the same number: give one of them",
        )),
        (Some(v), None) | (None, Some(v)) => v.extract::<f64>(),
        (None, None) => Ok(0.0),
    }
}

/// The matrix product (`dlbridge.ops.matmul`).
#[pyfunction]
pub(crate) fn _matmul(
    py: Python<'_>,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
) -> PyResult<PyArray> {
    let a = tensor_arg(a, "matmul")?;
    let b = tensor_arg(b, "matmul")?;
    py.detach(|| compute::matmul(&a, &b)).py().map(PyArray::new)
}

/// Registers the functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_unary, m)?)?;
    m.add_function(wrap_pyfunction!(_binary, m)?)?;
    m.add_function(wrap_pyfunction!(_compare, m)?)?;
    m.add_function(wrap_pyfunction!(_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(_matmul, m)?)?;
    Ok(())
}
