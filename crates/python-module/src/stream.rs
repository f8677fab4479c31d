//! Streaming loads from Python: `dlbridge.stream_file` iterates over a native
//! [`PyLoadStream`], which hands out `(group name, {name: array}, ready event or None)` as the
//! engine's loading thread delivers each group. A stream into a model's parameters runs the
//! loader's steps on a Python thread inside a [`PyLoadSession`], which keeps one reader for all
//! its steps.

use std::path::PathBuf;
use std::sync::Mutex;

use dlbridge::engine::{LoadSession, LoadStream};
use dlbridge::safetensors::Checkpoint;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::array::PyArray;
use crate::cuda::PyEvent;
use crate::errors::IntoPyResult;

/// A streaming load in progress (`dlbridge.stream_file`).
#[pyclass(frozen, module = "dlbridge._dlbridge", name = "_LoadStream")]
pub(crate) struct PyLoadStream {
    /// `None` once closed or ended.
    inner: Mutex<Option<LoadStream>>,
}

impl PyLoadStream {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<LoadStream>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyLoadStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next group, waiting for it with the GIL released (woken as soon as it is loaded;
    /// signals answered every 50 ms).
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let next = loop {
            let polled = py.detach(|| {
                let mut guard = self.lock();
                let Some(stream) = guard.as_mut() else {
                    return Some(None);
                };
                let next = stream
                    .next_within(std::time::Duration::from_millis(50))
                    .ok()?;
                if !matches!(next, Some(Ok(_))) {
                    // The end or an error: the stream and its thread go.
                    *guard = None;
                }
                Some(next)
            });
            match polled {
                Some(next) => break next,
                None => py.check_signals()?,
            }
        };
        let Some(group) = next else { return Ok(None) };
        let group = group.py()?;
        let tensors = PyDict::new(py);
        for (name, tensor) in group.tensors {
            tensors.set_item(name, Bound::new(py, PyArray::new(tensor))?)?;
        }
        // A CUDA event as `dlbridge.cuda.Event`; a backend's event of another type is waited
        // for here, so that its group is ready when handed out.
        let ready = match group
            .ready
            .map(|e| e.downcast::<dlbridge::backend::cuda::Event>())
        {
            Some(Ok(event)) => Bound::new(py, PyEvent::from(event))?.into_any(),
            Some(Err(event)) => {
                py.detach(|| event.synchronize()).py()?;
                py.None().into_bound(py)
            }
            None => py.None().into_bound(py),
        };
        Ok(Some(PyTuple::new(
            py,
            [
                group.name.into_pyobject(py)?.into_any(),
                tensors.into_any(),
                ready,
            ],
        )?))
    }

    /// Stops the load: the group being read finishes, then everything not handed out is freed.
    fn close(&self, py: Python<'_>) {
        let stream = self.lock().take();
        py.detach(move || drop(stream));
    }
}

/// A load session on the calling thread (`with _dlbridge._LoadSession():`,
/// [`dlbridge::engine::LoadSession`]): the thread's `_Checkpoint.load_parts_into` calls inside it
/// share one reader (its threads, CUDA streams, events and pinned staging), read without a
/// progress thread, and return with the thread's current stream ordered after their copies to the
/// device instead of waiting for them. Leaving it waits for the copies still running and frees the
/// reader. Entered and left on one thread.
#[pyclass(unsendable, module = "dlbridge._dlbridge", name = "_LoadSession")]
pub(crate) struct PyLoadSession {
    /// `Some` while entered.
    inner: Option<LoadSession>,
}

#[pymethods]
impl PyLoadSession {
    #[new]
    fn new() -> PyLoadSession {
        PyLoadSession { inner: None }
    }

    fn __enter__(mut slf: PyRefMut<'_, Self>) -> PyRefMut<'_, Self> {
        if slf.inner.is_none() {
            slf.inner = Some(LoadSession::enter());
        }
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&mut self, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        if self.inner.as_ref().is_some_and(|s| !s.is_innermost()) {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "a load session was left while a session entered after it on this thread is still \
                 entered: leave them in the reverse order of entering",
            ));
        }
        self.inner = None;
        Ok(false)
    }
}

/// Starts streaming `groups` (`[(name, [tensor names])]`, in order) of the checkpoint at `path`
/// onto `device`, at most `ahead` loaded groups waiting; the other arguments as `load`'s.
#[pyfunction]
#[pyo3(signature = (
    path, groups, device, ahead, copy, dtype, threads, chunk_bytes, direct_io
))]
#[allow(clippy::too_many_arguments)]
fn _st_stream(
    py: Python<'_>,
    path: &Bound<'_, PyAny>,
    groups: Vec<(String, Vec<String>)>,
    device: &Bound<'_, PyAny>,
    ahead: usize,
    copy: bool,
    dtype: Option<&Bound<'_, PyAny>>,
    threads: Option<usize>,
    chunk_bytes: Option<usize>,
    direct_io: Option<bool>,
) -> PyResult<PyLoadStream> {
    let options = crate::safetensors::load_options(
        device,
        copy,
        dtype,
        threads,
        chunk_bytes,
        direct_io,
        None,
        None,
        None,
    )?;
    let paths: Vec<PathBuf> = crate::safetensors::paths(path)?;
    let stream = py
        .detach(|| {
            let checkpoint = match paths.as_slice() {
                [one] => Checkpoint::open(one),
                many => Checkpoint::open_files(many),
            }?;
            checkpoint.stream(&groups, options, ahead)
        })
        .py()?;
    Ok(PyLoadStream {
        inner: Mutex::new(Some(stream)),
    })
}

/// Registers the natives on the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLoadStream>()?;
    m.add_class::<PyLoadSession>()?;
    m.add_function(wrap_pyfunction!(_st_stream, m)?)?;
    Ok(())
}
