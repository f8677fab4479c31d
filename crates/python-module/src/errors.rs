//! Where dlbridge errors become Python exceptions: the one mapping is `dlbridge-pyo3`'s
//! ([`dlbridge_pyo3::to_py`]; a file error is the `OSError` subclass the system's error calls
//! for), shared with every extension built on it.

pub(crate) use dlbridge_pyo3::exchange::IntoPyResult;
pub(crate) use dlbridge_pyo3::to_py;
