//! The one place this crate turns errors into Python exceptions.

use dlbridge::{Error, ErrorKind};
use pyo3::PyErr;
use pyo3::exceptions::{
    PyBufferError, PyIndexError, PyMemoryError, PyRuntimeError, PyTypeError, PyValueError,
};

/// Maps a core error to the exception its [`ErrorKind`] calls for (`BufferError`, `ValueError`,
/// `TypeError`, `IndexError`, `MemoryError`, `RuntimeError`).
pub fn to_py(err: Error) -> PyErr {
    exception(err.kind(), err.to_string())
}

/// A core error about the argument `name`, its message prefixed with the argument's name.
pub(crate) fn named(name: &str, err: Error) -> PyErr {
    exception(err.kind(), format!("argument '{name}': {err}"))
}

/// The exception of `kind` with `msg`.
pub(crate) fn exception(kind: ErrorKind, msg: String) -> PyErr {
    match kind {
        ErrorKind::Buffer => PyBufferError::new_err(msg),
        ErrorKind::Value => PyValueError::new_err(msg),
        ErrorKind::Type => PyTypeError::new_err(msg),
        ErrorKind::Index => PyIndexError::new_err(msg),
        ErrorKind::Memory => PyMemoryError::new_err(msg),
        ErrorKind::Runtime => PyRuntimeError::new_err(msg),
        // `ErrorKind` is exhaustive today; a future kind is a runtime failure until mapped.
        #[allow(unreachable_patterns)]
        _ => PyRuntimeError::new_err(msg),
    }
}

/// `?`-friendly conversion of core results.
pub(crate) trait IntoPyResult<T> {
    /// The result with the error mapped by [`to_py`].
    fn py(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPyResult<T> for dlbridge::Result<T> {
    fn py(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}
