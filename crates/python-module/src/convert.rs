//! Python values ↔ element bytes, and nested sequences ↔ arrays.

use dlbridge::{DType, DTypeCode};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyComplex, PyFloat, PyInt, PyList, PySequence, PyString, PyTuple};

/// The kind of Python scalar found in a nested sequence, for dtype inference. Ordered so that the
/// widest kind wins (`bool < int < float < complex`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum ScalarKind {
    Bool,
    Int,
    Float,
    Complex,
}

impl ScalarKind {
    /// The dtype a value of this kind gets when none is given: `bool`, `int64`, and the default
    /// floating types `float32` / `complex64` (as in PyTorch, JAX and MLX).
    pub(crate) fn default_dtype(self) -> DType {
        match self {
            ScalarKind::Bool => DType::BOOL,
            ScalarKind::Int => DType::I64,
            ScalarKind::Float => DType::F32,
            ScalarKind::Complex => DType::C64,
        }
    }
}

/// The kind of a Python scalar, or `None` for anything else. NumPy scalars count by what they
/// convert to.
pub(crate) fn scalar_kind(obj: &Bound<'_, PyAny>) -> Option<ScalarKind> {
    if obj.is_instance_of::<PyBool>() {
        Some(ScalarKind::Bool)
    } else if obj.is_instance_of::<PyInt>() {
        Some(ScalarKind::Int)
    } else if obj.is_instance_of::<PyFloat>() {
        Some(ScalarKind::Float)
    } else if obj.is_instance_of::<PyComplex>() {
        Some(ScalarKind::Complex)
    } else {
        let py = obj.py();
        // Arrays (anything with DLPack or a length) are not scalars, even when they convert to one.
        let has = |name: &Bound<'_, pyo3::types::PyString>| obj.hasattr(name).unwrap_or(false);
        if has(pyo3::intern!(py, "__dlpack__")) || has(pyo3::intern!(py, "__len__")) {
            return None;
        }
        // NumPy scalars are neither, and convert by their kind.
        if obj.hasattr(pyo3::intern!(py, "__index__")).unwrap_or(false) {
            Some(ScalarKind::Int)
        } else if obj.hasattr(pyo3::intern!(py, "__float__")).unwrap_or(false) {
            Some(ScalarKind::Float)
        } else if obj
            .hasattr(pyo3::intern!(py, "__complex__"))
            .unwrap_or(false)
        {
            Some(ScalarKind::Complex)
        } else {
            None
        }
    }
}

/// Encodes one Python value as an element of `dtype` (native byte order) into `out`.
pub(crate) fn write_element(
    dtype: DType,
    obj: &Bound<'_, PyAny>,
    out: &mut Vec<u8>,
) -> PyResult<()> {
    macro_rules! int {
        ($t:ty) => {{
            let v: i128 = extract_int(obj, dtype)?;
            let v = <$t>::try_from(v).map_err(|_| {
                PyOverflowError::new_err(format!("{v} is out of range for {dtype}"))
            })?;
            out.extend_from_slice(&v.to_ne_bytes());
        }};
    }
    match (dtype.code(), dtype.bits(), dtype.lanes()) {
        (DTypeCode::Bool, 8, 1) => out.push(obj.is_truthy()? as u8),
        (DTypeCode::Int, 8, 1) => int!(i8),
        (DTypeCode::Int, 16, 1) => int!(i16),
        (DTypeCode::Int, 32, 1) => int!(i32),
        (DTypeCode::Int, 64, 1) => int!(i64),
        (DTypeCode::UInt, 8, 1) => int!(u8),
        (DTypeCode::UInt, 16, 1) => int!(u16),
        (DTypeCode::UInt, 32, 1) => int!(u32),
        (DTypeCode::UInt, 64, 1) => int!(u64),
        (DTypeCode::Float, 16, 1) => {
            out.extend_from_slice(&half::f16::from_f64(extract_real(obj, dtype)?).to_ne_bytes())
        }
        (DTypeCode::BFloat, 16, 1) => {
            out.extend_from_slice(&half::bf16::from_f64(extract_real(obj, dtype)?).to_ne_bytes())
        }
        (DTypeCode::Float, 32, 1) => {
            out.extend_from_slice(&(extract_real(obj, dtype)? as f32).to_ne_bytes())
        }
        (DTypeCode::Float, 64, 1) => {
            out.extend_from_slice(&extract_real(obj, dtype)?.to_ne_bytes())
        }
        (DTypeCode::Complex, 64, 1) => {
            let (re, im) = extract_complex(obj)?;
            out.extend_from_slice(&(re as f32).to_ne_bytes());
            out.extend_from_slice(&(im as f32).to_ne_bytes());
        }
        (DTypeCode::Complex, 128, 1) => {
            let (re, im) = extract_complex(obj)?;
            out.extend_from_slice(&re.to_ne_bytes());
            out.extend_from_slice(&im.to_ne_bytes());
        }
        _ => match dlbridge::dtype::f64_to_minifloat(dtype, extract_real(obj, dtype)?) {
            Some(code) => out.push(code),
            None => {
                return Err(PyTypeError::new_err(format!(
                    "converting Python values to {dtype} is not supported"
                )));
            }
        },
    }
    Ok(())
}

fn extract_int(obj: &Bound<'_, PyAny>, dtype: DType) -> PyResult<i128> {
    if obj.is_instance_of::<PyFloat>() || obj.is_instance_of::<PyComplex>() {
        return Err(PyTypeError::new_err(format!(
            "cannot store the non-integer {} in a {dtype} array",
            obj.repr()?
        )));
    }
    obj.extract::<i128>()
        .map_err(|_| match obj.extract::<f64>() {
            Ok(_) => PyOverflowError::new_err(format!(
                "{} is out of range for {dtype}",
                obj.repr().map(|r| r.to_string()).unwrap_or_default()
            )),
            Err(_) => PyTypeError::new_err(format!(
                "cannot store {} in a {dtype} array",
                obj.repr().map(|r| r.to_string()).unwrap_or_default()
            )),
        })
}

fn extract_real(obj: &Bound<'_, PyAny>, dtype: DType) -> PyResult<f64> {
    if obj.is_instance_of::<PyComplex>() {
        return Err(PyTypeError::new_err(format!(
            "cannot store the complex {} in a {dtype} array",
            obj.repr()?
        )));
    }
    obj.extract::<f64>()
}

fn extract_complex(obj: &Bound<'_, PyAny>) -> PyResult<(f64, f64)> {
    if let Ok(c) = obj.cast::<PyComplex>() {
        return Ok((c.real(), c.imag()));
    }
    Ok((obj.extract::<f64>()?, 0.0))
}

/// Decodes one element of `dtype` from native-order bytes.
pub(crate) fn read_element<'py>(
    py: Python<'py>,
    dtype: DType,
    bytes: &[u8],
) -> PyResult<Bound<'py, PyAny>> {
    macro_rules! num {
        ($t:ty) => {{
            let v = <$t>::from_ne_bytes(bytes.try_into().expect("itemsize checked"));
            v.into_pyobject(py)?.into_any()
        }};
    }
    Ok(match (dtype.code(), dtype.bits(), dtype.lanes()) {
        (DTypeCode::Bool, 8, 1) => PyBool::new(py, bytes[0] != 0).to_owned().into_any(),
        (DTypeCode::Int, 8, 1) => num!(i8),
        (DTypeCode::Int, 16, 1) => num!(i16),
        (DTypeCode::Int, 32, 1) => num!(i32),
        (DTypeCode::Int, 64, 1) => num!(i64),
        (DTypeCode::UInt, 8, 1) => num!(u8),
        (DTypeCode::UInt, 16, 1) => num!(u16),
        (DTypeCode::UInt, 32, 1) => num!(u32),
        (DTypeCode::UInt, 64, 1) => num!(u64),
        (DTypeCode::Float, 16, 1) => half::f16::from_ne_bytes([bytes[0], bytes[1]])
            .to_f64()
            .into_pyobject(py)?
            .into_any(),
        (DTypeCode::BFloat, 16, 1) => half::bf16::from_ne_bytes([bytes[0], bytes[1]])
            .to_f64()
            .into_pyobject(py)?
            .into_any(),
        (DTypeCode::Float, 32, 1) => (num_f32(bytes) as f64).into_pyobject(py)?.into_any(),
        (DTypeCode::Float, 64, 1) => num!(f64),
        (DTypeCode::Complex, 64, 1) => {
            PyComplex::from_doubles(py, num_f32(&bytes[..4]) as f64, num_f32(&bytes[4..]) as f64)
                .into_any()
        }
        (DTypeCode::Complex, 128, 1) => PyComplex::from_doubles(
            py,
            f64::from_ne_bytes(bytes[..8].try_into().expect("16 bytes")),
            f64::from_ne_bytes(bytes[8..].try_into().expect("16 bytes")),
        )
        .into_any(),
        _ => match dlbridge::dtype::minifloat_to_f64(dtype, bytes[0]) {
            Some(v) => v.into_pyobject(py)?.into_any(),
            None => {
                return Err(PyTypeError::new_err(format!(
                    "converting {dtype} elements to Python values is not supported"
                )));
            }
        },
    })
}

fn num_f32(bytes: &[u8]) -> f32 {
    f32::from_ne_bytes(bytes[..4].try_into().expect("4 bytes"))
}

/// A nested sequence of scalars flattened: its shape, its leaves, and the widest scalar kind.
pub(crate) struct Nested<'py> {
    pub(crate) shape: Vec<usize>,
    pub(crate) leaves: Vec<Bound<'py, PyAny>>,
    pub(crate) kind: ScalarKind,
}

/// Flattens nested lists/tuples of Python scalars, checking that they are rectangular.
pub(crate) fn flatten<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Nested<'py>> {
    let mut out = Nested {
        shape: vec![],
        leaves: vec![],
        kind: ScalarKind::Bool,
    };
    let mut shape_known = false;
    walk(obj, 0, &mut out, &mut shape_known)?;
    if out.leaves.is_empty() {
        // No values to look at: empty sequences take the default floating type, as in NumPy.
        out.kind = ScalarKind::Float;
    }
    Ok(out)
}

fn walk<'py>(
    obj: &Bound<'py, PyAny>,
    depth: usize,
    out: &mut Nested<'py>,
    shape_known: &mut bool,
) -> PyResult<()> {
    if let Some(kind) = scalar_kind(obj) {
        if !*shape_known {
            out.shape.truncate(depth);
            *shape_known = true;
        } else if depth != out.shape.len() {
            return Err(ragged());
        }
        out.kind = out.kind.max(kind);
        out.leaves.push(obj.clone());
        return Ok(());
    }
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err("strings cannot be array elements"));
    }
    let seq = if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        obj.cast::<PySequence>()?.clone()
    } else {
        return Err(PyTypeError::new_err(format!(
            "cannot make an array element of {}",
            obj.get_type().name()?
        )));
    };
    if depth >= dlbridge::MAX_NDIM {
        return Err(PyValueError::new_err(format!(
            "nesting deeper than {} levels",
            dlbridge::MAX_NDIM
        )));
    }
    let len = seq.len()?;
    if *shape_known {
        if depth >= out.shape.len() || out.shape[depth] != len {
            return Err(ragged());
        }
    } else if depth == out.shape.len() {
        out.shape.push(len);
    } else if out.shape[depth] != len {
        return Err(ragged());
    }
    if len == 0 {
        if !*shape_known {
            *shape_known = true;
        } else if depth + 1 != out.shape.len() {
            return Err(ragged());
        }
        return Ok(());
    }
    for item in seq.try_iter()? {
        walk(&item?, depth + 1, out, shape_known)?;
    }
    Ok(())
}

fn ragged() -> PyErr {
    PyValueError::new_err("the nested sequence is ragged: every row must have the same length")
}
