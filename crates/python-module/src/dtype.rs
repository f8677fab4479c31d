//! `dlbridge.DType`: element types, comparable with their names.

use dlbridge::DType;
use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::errors::IntoPyResult;
use crate::fastcall::InternedNames;

/// An element type: DLPack's type code, bits and lanes. Compares equal to its name
/// (`a.dtype == "float32"`), to NumPy dtypes and to PyTorch dtypes of the same type.
#[pyclass(frozen, module = "dlbridge", name = "DType")]
#[derive(Clone, Copy)]
pub(crate) struct PyDType(pub(crate) DType);

#[pymethods]
impl PyDType {
    #[new]
    fn py_new(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        parse(obj).map(PyDType)
    }

    /// The canonical name (`float32`, `bfloat16`, ...).
    #[getter]
    fn name(&self) -> String {
        self.0.name()
    }

    /// The DLPack type code.
    #[getter]
    fn code(&self) -> u8 {
        self.0.code().to_raw()
    }

    /// Bits per lane.
    #[getter]
    fn bits(&self) -> u8 {
        self.0.bits()
    }

    /// Lanes per element.
    #[getter]
    fn lanes(&self) -> u16 {
        self.0.lanes()
    }

    /// Bytes per element.
    #[getter]
    fn itemsize(&self) -> usize {
        self.0.itemsize()
    }

    /// The NumPy dtype (`numpy.dtype(a.dtype)` and `numpy.zeros(n, a.dtype)` read it): NumPy's
    /// own, or `ml_dtypes`'s for `bfloat16` and the minifloats.
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        crate::npcompat::numpy_dtype(py, self.0)
    }

    fn __str__(&self) -> String {
        self.0.name()
    }

    fn __repr__(&self) -> String {
        format!("dlbridge.{}", self.0.name())
    }

    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        // Equal to the hash of the name, since a dtype compares equal to its name.
        PyString::new(py, &self.0.name()).hash()
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> Comparison {
        let equal = parse(other).is_ok_and(|d| d == self.0);
        match op {
            CompareOp::Eq => Comparison::Bool(equal),
            CompareOp::Ne => Comparison::Bool(!equal),
            _ => Comparison::NotImplemented,
        }
    }
}

/// The names of the element types that are attributes of `dlbridge` (`dlbridge.float32`, ...):
/// the core's [`DType::named`], the one list of them. The extension module's `__all__` lists them
/// (all but `bool`, which would shadow the built-in), and `dlbridge/__init__.py` takes its
/// attributes and `__all__` entries from it.
pub(crate) fn names() -> Vec<String> {
    DType::named().into_iter().map(DType::name).collect()
}

/// Registers `DType` and one attribute per name of [`names`].
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDType>()?;
    for dtype in DType::named() {
        m.add(dtype.name(), PyDType(dtype))?;
    }
    Ok(())
}

/// Sets the module's `__all__` to the names of [`names`] but `bool`: what `dlbridge` re-exports
/// wholesale (`from ._dlbridge import *`). Called last, since every `add` appends to `__all__`.
pub(crate) fn set_all(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let exported: Vec<String> = names().into_iter().filter(|n| n != "bool").collect();
    m.setattr("__all__", pyo3::types::PyList::new(m.py(), exported)?)
}

/// The result of a rich comparison.
pub(crate) enum Comparison {
    Bool(bool),
    NotImplemented,
}

impl<'py> IntoPyObject<'py> for Comparison {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = std::convert::Infallible;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        Ok(match self {
            Comparison::Bool(b) => pyo3::types::PyBool::new(py, b).to_owned().into_any(),
            Comparison::NotImplemented => py.NotImplemented().into_bound(py),
        })
    }
}

/// Reads a dtype from a `DType`, a name, a NumPy dtype or scalar type, or a PyTorch dtype.
/// The names of the dtypes most programs use, for a parse without reading the text.
static COMMON: InternedNames<DType, 15> = InternedNames::new([
    ("float32", DType::F32),
    ("float64", DType::F64),
    ("float16", DType::F16),
    ("bfloat16", DType::BF16),
    ("int8", DType::I8),
    ("int16", DType::I16),
    ("int32", DType::I32),
    ("int64", DType::I64),
    ("uint8", DType::U8),
    ("uint16", DType::U16),
    ("uint32", DType::U32),
    ("uint64", DType::U64),
    ("bool", DType::BOOL),
    ("complex64", DType::C64),
    ("complex128", DType::C128),
]);

pub(crate) fn parse(obj: &Bound<'_, PyAny>) -> PyResult<DType> {
    if let Ok(d) = obj.cast::<PyDType>() {
        return Ok(d.get().0);
    }
    if let Ok(s) = obj.cast::<PyString>() {
        // The canonical names go straight through (the common case on hot paths such as
        // `dlbridge.empty(n, "float32")`); anything else takes the general parser's aliases.
        if let Some(&d) = COMMON.get(s) {
            return Ok(d);
        }
        let text = s.to_cow()?;
        return match COMMON.by_text(&text) {
            Some(&d) => Ok(d),
            None => text.parse::<DType>().py(),
        };
    }
    // NumPy dtypes have `.name`; NumPy scalar types have `.__name__`; PyTorch dtypes print as
    // `torch.float32`; JAX and ML dtypes follow NumPy.
    let py = obj.py();
    if let Ok(name) = obj.getattr(pyo3::intern!(py, "name")) {
        if let Ok(name) = name.extract::<String>() {
            if let Ok(d) = name.parse::<DType>() {
                return Ok(d);
            }
        }
    }
    if let Ok(name) = obj.getattr(pyo3::intern!(py, "__name__")) {
        if let Ok(name) = name.extract::<String>() {
            if let Ok(d) = name.parse::<DType>() {
                return Ok(d);
            }
        }
    }
    let text = obj.str()?.to_string();
    if let Some(rest) = text.strip_prefix("torch.") {
        if let Ok(d) = rest.parse::<DType>() {
            return Ok(d);
        }
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "{text:?} names no data type (expected a name such as 'float32', a dlbridge.DType, a \
         NumPy dtype or a PyTorch dtype)"
    )))
}
