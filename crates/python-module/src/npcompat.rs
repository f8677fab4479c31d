//! What dlbridge reads from NumPy to behave as NumPy users expect: the NumPy dtype of a dlbridge
//! dtype (`numpy.dtype(a.dtype)`), and NumPy's print options for `repr` / `str`.

use dlbridge::{DType, DTypeCode};
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;

/// The NumPy dtype of `dtype`: NumPy's own, or `ml_dtypes`'s for `bfloat16` and the minifloats.
/// `TypeError` saying what to install where NumPy (or `ml_dtypes`) is missing.
pub(crate) fn numpy_dtype<'py>(py: Python<'py>, dtype: DType) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import(intern!(py, "numpy")).map_err(|_| {
        PyTypeError::new_err("NumPy is not installed: a NumPy dtype needs it (pip install numpy)")
    })?;
    let name = dtype.name();
    let native = dtype.lanes() == 1
        && matches!(
            dtype.code(),
            DTypeCode::Bool
                | DTypeCode::Int
                | DTypeCode::UInt
                | DTypeCode::Float
                | DTypeCode::Complex
        );
    if native {
        return np.call_method1(intern!(py, "dtype"), (name,));
    }
    let ml = py.import(intern!(py, "ml_dtypes")).map_err(|_| {
        PyTypeError::new_err(format!(
            "NumPy has no {name} type: install ml_dtypes (pip install ml_dtypes), which adds it"
        ))
    })?;
    let scalar = ml.getattr(name.as_str()).map_err(|_| {
        PyTypeError::new_err(format!(
            "neither NumPy nor this ml_dtypes has a {name} type"
        ))
    })?;
    np.call_method1(intern!(py, "dtype"), (scalar,))
}

/// NumPy's print options (`numpy.get_printoptions()`), or NumPy's defaults without NumPy.
#[derive(Clone, Debug)]
pub(crate) struct PrintOptions {
    pub(crate) precision: usize,
    pub(crate) threshold: usize,
    pub(crate) edgeitems: usize,
    pub(crate) linewidth: usize,
    pub(crate) suppress: bool,
    pub(crate) nanstr: String,
    pub(crate) infstr: String,
    /// `'-'`, `'+'` or `' '`.
    pub(crate) sign: char,
    /// `maxprec`, `fixed`, `unique` or `maxprec_equal`.
    pub(crate) floatmode: String,
}

impl Default for PrintOptions {
    fn default() -> Self {
        PrintOptions {
            precision: 8,
            threshold: 1000,
            edgeitems: 3,
            linewidth: 75,
            suppress: false,
            nanstr: "nan".into(),
            infstr: "inf".into(),
            sign: '-',
            floatmode: "maxprec".into(),
        }
    }
}

impl PrintOptions {
    /// The options NumPy prints with now (the defaults where NumPy is not installed or an option
    /// is not readable).
    pub(crate) fn current(py: Python<'_>) -> PrintOptions {
        let mut o = PrintOptions::default();
        let Ok(np) = py.import(intern!(py, "numpy")) else {
            return o;
        };
        let Ok(options) = np.call_method0(intern!(py, "get_printoptions")) else {
            return o;
        };
        let get = |k: &str| options.get_item(k).ok();
        if let Some(v) = get("precision").and_then(|v| v.extract().ok()) {
            o.precision = v;
        }
        if let Some(v) = get("threshold").and_then(|v| v.extract::<f64>().ok()) {
            // `sys.maxsize` or `inf` mean "never summarise".
            o.threshold = if v >= usize::MAX as f64 {
                usize::MAX
            } else {
                v as usize
            };
        }
        if let Some(v) = get("edgeitems").and_then(|v| v.extract().ok()) {
            o.edgeitems = v;
        }
        if let Some(v) = get("linewidth").and_then(|v| v.extract().ok()) {
            o.linewidth = v;
        }
        if let Some(v) = get("suppress").and_then(|v| v.extract().ok()) {
            o.suppress = v;
        }
        if let Some(v) = get("nanstr").and_then(|v| v.extract().ok()) {
            o.nanstr = v;
        }
        if let Some(v) = get("infstr").and_then(|v| v.extract().ok()) {
            o.infstr = v;
        }
        if let Some(v) = get("sign").and_then(|v| v.extract::<String>().ok()) {
            o.sign = v.chars().next().unwrap_or('-');
        }
        if let Some(v) = get("floatmode").and_then(|v| v.extract().ok()) {
            o.floatmode = v;
        }
        o
    }
}
