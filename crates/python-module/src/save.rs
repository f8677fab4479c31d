//! The asynchronous save: `dlbridge.save_file(..., wait=False)` runs the save on a thread of its
//! own and hands back a [`PySaveHandle`] that tells when the arrays may change again (every byte
//! in host memory) and when the file is durable.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dlbridge::Tensor;
use dlbridge::safetensors::{CopyStreams, save_file_staged, save_sharded_staged};
use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;
use crate::safetensors::Progress;

/// What the saving thread has told so far.
#[derive(Default)]
struct State {
    /// Every byte is in host memory.
    copied: bool,
    /// The save's end: the path written, or its error.
    result: Option<PyResult<PathBuf>>,
    /// An exception the progress callable raised (raised by `wait` after the save).
    callback_error: Option<PyErr>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.lock());
        self.changed.notify_all();
    }

    /// Waits, the GIL released and signals answered every 50 ms, until `ready(state)` or the
    /// timeout (`TimeoutError`).
    fn wait_for(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        what: &str,
        ready: impl Fn(&State) -> bool + Sync,
    ) -> PyResult<()> {
        let deadline = match timeout {
            Some(t) if !(t >= 0.0 && t.is_finite()) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout must be a finite number of seconds, at least 0 (got {t})"
                )));
            }
            Some(t) => Some(Instant::now() + Duration::from_secs_f64(t)),
            None => None,
        };
        loop {
            let done = py.detach(|| {
                let state = self.lock();
                let step = Duration::from_millis(50);
                let step = deadline.map_or(step, |d| {
                    step.min(d.saturating_duration_since(Instant::now()))
                });
                let (state, _) = self
                    .changed
                    .wait_timeout_while(state, step, |s| !ready(s))
                    .unwrap_or_else(|p| p.into_inner());
                ready(&state)
            });
            if done {
                return Ok(());
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(PyTimeoutError::new_err(format!(
                    "the save was not {what} within {} s",
                    timeout.unwrap_or_default()
                )));
            }
        }
    }
}

/// A save running on a thread of its own (`dlbridge.save_file(..., wait=False)`).
#[pyclass(name = "SaveHandle", module = "dlbridge._dlbridge", frozen)]
pub(crate) struct PySaveHandle {
    shared: Arc<Shared>,
    path: PathBuf,
}

#[pymethods]
impl PySaveHandle {
    /// Whether every byte is in host memory: the arrays saved may be written or freed.
    #[getter]
    fn copied(&self) -> bool {
        let state = self.shared.lock();
        state.copied || state.result.is_some()
    }

    /// Whether the save has ended (durable, or failed: `wait()` tells which).
    fn done(&self) -> bool {
        self.shared.lock().result.is_some()
    }

    /// Waits until the arrays may be written or freed (every byte in host memory, or the save
    /// ended); a save that failed before raises its error. `TimeoutError` after `timeout` s.
    #[pyo3(signature = (timeout=None))]
    fn wait_copied(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        self.shared
            .wait_for(py, timeout, "copied", |s| s.copied || s.result.is_some())?;
        let state = self.shared.lock();
        match &state.result {
            Some(Err(e)) if !state.copied => Err(e.clone_ref(py)),
            _ => Ok(()),
        }
    }

    /// Waits until the file is durable (synced and renamed into place) and returns its path (the
    /// index's for a sharded save); raises the save's error (a full disk: `OSError`, nothing
    /// partial left), then an exception the progress callable raised. `TimeoutError` after
    /// `timeout` s (the save goes on).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<String> {
        self.shared
            .wait_for(py, timeout, "durable", |s| s.result.is_some())?;
        let mut state = self.shared.lock();
        let written = match &state.result {
            Some(Ok(path)) => path.to_string_lossy().into_owned(),
            Some(Err(e)) => return Err(e.clone_ref(py)),
            None => String::new(),
        };
        if let Some(e) = state.callback_error.take() {
            return Err(e);
        }
        Ok(written)
    }

    fn __repr__(&self) -> String {
        let state = self.shared.lock();
        let status = match &state.result {
            Some(Ok(_)) => "durable",
            Some(Err(_)) => "failed",
            None if state.copied => "copied, writing",
            None => "copying",
        };
        format!("<SaveHandle {} ({status})>", self.path.display())
    }
}

/// Starts a save of `tensors` on a thread of its own and returns its handle; the arguments are
/// `_st_save`'s. The tensors are imported, and the copy streams ordered after this thread's
/// current streams, before it returns: the save sees every write enqueued before the call.
#[pyfunction]
#[pyo3(signature = (
    tensors, path, metadata=None, max_shard_size=None, progress=None, threads=None,
    chunk_bytes=None, direct_io=None
))]
#[allow(clippy::too_many_arguments)]
fn _st_save_async(
    tensors: &Bound<'_, PyDict>,
    path: PathBuf,
    metadata: Option<BTreeMap<String, String>>,
    max_shard_size: Option<u64>,
    progress: Option<Py<PyAny>>,
    threads: Option<usize>,
    chunk_bytes: Option<usize>,
    direct_io: Option<bool>,
) -> PyResult<PySaveHandle> {
    let owned: Vec<(String, Tensor)> = crate::safetensors::named_tensors(tensors)?;
    let mut options = crate::safetensors::write_options(threads, chunk_bytes, direct_io);
    options.whole = true;
    let streams = CopyStreams::after_current(owned.iter().map(|(_, t)| t)).map_err(to_py)?;
    let shared = Arc::new(Shared::default());
    let thread_shared = Arc::clone(&shared);
    let thread_path = path.clone();
    std::thread::Builder::new()
        .name("dlbridge-save".into())
        .spawn(move || {
            let shared = thread_shared;
            let refs: Vec<(&str, &Tensor)> = owned.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let copied = || shared.update(|s| s.copied = true);
            let mut progress = Progress::new(progress);
            let mut report = |done, total| progress.report(done, total);
            let result = match max_shard_size {
                Some(max) => save_sharded_staged(
                    &refs,
                    metadata.as_ref(),
                    &thread_path,
                    max,
                    &options,
                    &streams,
                    &copied,
                    &mut report,
                ),
                None => save_file_staged(
                    &refs,
                    metadata.as_ref(),
                    &thread_path,
                    &options,
                    &streams,
                    &copied,
                    &mut report,
                )
                .map(|()| thread_path.clone()),
            };
            // The arrays go before the end is told: a caller that waited may free them.
            drop(refs);
            drop(owned);
            // The callable goes with the GIL held; its exception is raised by `wait`.
            let raised = Python::attach(|_| progress.finish().err());
            shared.update(|s| {
                s.callback_error = raised;
                s.result = Some(result.map_err(to_py));
            });
        })
        .map_err(|e| {
            to_py(dlbridge::Error::Io {
                path: path.clone(),
                source: e,
            })
        })?;
    Ok(PySaveHandle { shared, path })
}

/// Registers the natives on the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySaveHandle>()?;
    m.add_function(wrap_pyfunction!(_st_save_async, m)?)?;
    Ok(())
}
