//! The one place dlbridge errors become Python exceptions.

use dlbridge::{Error, ErrorKind};
use pyo3::PyErr;
use pyo3::exceptions::{
    PyBufferError, PyIndexError, PyMemoryError, PyRuntimeError, PyTypeError, PyValueError,
};

/// Maps a core error to the exception type its [`ErrorKind`] calls for.
pub(crate) fn to_py(err: Error) -> PyErr {
    if let Error::Io { path, source } = err {
        // The OSError subclass the system's error calls for (FileNotFoundError,
        // IsADirectoryError, PermissionError, ...), with the file named.
        let kind = source.kind();
        return PyErr::from(std::io::Error::new(
            kind,
            format!("{}: {source}", path.display()),
        ));
    }
    let msg = err.to_string();
    match err.kind() {
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

/// The name of the Python exception type `kind` maps to, for C callers that set errors by name
/// (the DLPack exchange table's allocator): the same mapping as [`to_py`].
pub(crate) fn exception_name(kind: ErrorKind) -> &'static std::ffi::CStr {
    match kind {
        ErrorKind::Buffer => c"BufferError",
        ErrorKind::Value => c"ValueError",
        ErrorKind::Type => c"TypeError",
        ErrorKind::Index => c"IndexError",
        ErrorKind::Memory => c"MemoryError",
        ErrorKind::Runtime => c"RuntimeError",
        #[allow(unreachable_patterns)]
        _ => c"RuntimeError",
    }
}

/// `?`-friendly conversion of core results.
pub(crate) trait IntoPyResult<T> {
    fn py(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPyResult<T> for dlbridge::Result<T> {
    fn py(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}
