//! The one place errors become Python exceptions: this crate's and dlbridge's own extension's.

use dlbridge::{Error, ErrorKind};
use pyo3::PyErr;
use pyo3::exceptions::{
    PyBufferError, PyIndexError, PyMemoryError, PyOSError, PyRuntimeError, PyTypeError,
    PyValueError,
};

/// Maps a core error to the exception its [`ErrorKind`] calls for (`BufferError`, `ValueError`,
/// `TypeError`, `IndexError`, `MemoryError`, `RuntimeError`); a file error is the `OSError`
/// subclass the system's error calls for (`FileNotFoundError`, `PermissionError`, ...), with the
/// file named; where the system gave an error number, with `errno`, `strerror` and `filename` set.
pub fn to_py(err: Error) -> PyErr {
    if let Error::Io { path, source } = err {
        if let Some(code) = source.raw_os_error() {
            // `OSError(errno, strerror, filename)`: Python picks the subclass by the number
            // (`FileNotFoundError`, `IsADirectoryError`, ...) and sets `errno`, `strerror` and
            // `filename`, as `open()` does.
            let text = source.to_string();
            let strerror = text
                .strip_suffix(&format!(" (os error {code})"))
                .unwrap_or(&text)
                .to_owned();
            return PyOSError::new_err((code, strerror, path.to_string_lossy().into_owned()));
        }
        let kind = source.kind();
        return PyErr::from(std::io::Error::new(
            kind,
            format!("{}: {source}", path.display()),
        ));
    }
    exception(err.kind(), err.to_string())
}

/// The name of the Python exception type `kind` maps to, for C callers that set errors by name
/// (the DLPack exchange table's allocator): the same mapping as [`to_py`].
pub fn exception_name(kind: ErrorKind) -> &'static std::ffi::CStr {
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

/// `?`-friendly conversion of core results: `result.py()?`.
pub trait IntoPyResult<T> {
    /// The result with the error mapped by [`to_py`].
    fn py(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPyResult<T> for dlbridge::Result<T> {
    fn py(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}
