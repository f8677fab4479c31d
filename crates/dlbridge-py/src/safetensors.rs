//! `dlbridge.safetensors` natives: opening checkpoints, loading onto any device, saving. The
//! Python module (python/dlbridge/safetensors.py) wraps them with `load_file`, `safe_open`,
//! `save_file` and the progress bar.

use std::collections::BTreeMap;
use std::path::PathBuf;

use dlbridge::safetensors::{Allocation, Checkpoint, LoadOptions, dtype_name, save_file};
use dlbridge::{Device, Tensor};
use pyo3::exceptions::{PyKeyError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::array::PyArray;
use crate::errors::IntoPyResult;

/// An opened checkpoint: one file, a list of shards, or an index.
#[pyclass(frozen, module = "dlbridge._dlbridge", name = "_Checkpoint")]
pub(crate) struct PyCheckpoint {
    inner: Checkpoint,
}

fn paths(obj: &Bound<'_, PyAny>) -> PyResult<Vec<PathBuf>> {
    if obj.is_instance_of::<PyString>() || obj.hasattr("__fspath__")? {
        return Ok(vec![obj.extract::<PathBuf>()?]);
    }
    if let Ok(list) = obj.try_iter() {
        return list.map(|p| p?.extract::<PathBuf>()).collect();
    }
    Err(PyTypeError::new_err(format!(
        "expected a path or a list of paths, got {}",
        obj.get_type().name()?
    )))
}

#[pymethods]
impl PyCheckpoint {
    /// Opens `path` (a file, or a `.json` index) or a list of shard files.
    #[new]
    fn py_new(py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<Self> {
        let paths = paths(path)?;
        let inner = py
            .detach(|| match paths.as_slice() {
                [one] => Checkpoint::open(one),
                many => Checkpoint::open_files(many),
            })
            .py()?;
        Ok(PyCheckpoint { inner })
    }

    /// The tensor names, sorted.
    fn keys(&self) -> Vec<String> {
        self.inner.keys().map(str::to_owned).collect()
    }

    /// The tensor names in the order their bytes lie: shard by shard, by offset in each.
    fn offset_keys(&self) -> Vec<String> {
        self.inner
            .plan(|_| true)
            .into_iter()
            .map(|l| l.name)
            .collect()
    }

    /// The `__metadata__` strings (an index's `metadata`), `None` where there are none.
    fn metadata(&self) -> Option<BTreeMap<String, String>> {
        self.inner.metadata().cloned()
    }

    /// `(dtype name, shape, (begin, end) byte range in its file, file)` of one tensor.
    #[allow(clippy::type_complexity)]
    fn info(&self, name: &str) -> PyResult<(String, Vec<usize>, (u64, u64), PathBuf)> {
        let (shard, info) = self
            .inner
            .info(name)
            .ok_or_else(|| PyKeyError::new_err(format!("no tensor named {name:?}")))?;
        let range = info.byte_range();
        Ok((
            dtype_name(info.dtype()).unwrap_or("?").to_owned(),
            info.shape().to_vec(),
            (range.start, range.end),
            shard.path().to_path_buf(),
        ))
    }

    /// Loads the tensors named in `keys` (all when `None`) onto `device`; `progress(done, total)`
    /// is called about ten times a second while a device load runs.
    #[pyo3(signature = (
        keys, device, copy, dtype, threads, chunk_bytes, direct_io, progress,
        storage=None, allocation=None, gds=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn load<'py>(
        &self,
        py: Python<'py>,
        keys: Option<Vec<String>>,
        device: &Bound<'py, PyAny>,
        copy: bool,
        dtype: Option<&Bound<'py, PyAny>>,
        threads: Option<usize>,
        chunk_bytes: Option<usize>,
        direct_io: Option<bool>,
        progress: Option<Py<PyAny>>,
        storage: Option<&str>,
        allocation: Option<&str>,
        gds: Option<bool>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let device: Device = crate::device::parse(device)?;
        let storage = crate::creation::parse_storage(storage)?;
        let allocation = allocation.map(str::parse::<Allocation>).transpose().py()?;
        let dtype = match dtype.filter(|d| !d.is_none()) {
            Some(d) => Some(crate::dtype::parse(d)?),
            None => None,
        };
        if let Some(keys) = &keys {
            if let Some(missing) = keys.iter().find(|k| self.inner.info(k).is_none()) {
                return Err(PyKeyError::new_err(format!(
                    "no tensor named {missing:?} in the checkpoint"
                )));
            }
        }
        let options = LoadOptions {
            device,
            copy,
            // Else the environment's storage mode, else the device's default.
            storage,
            dtype,
            threads,
            chunk_bytes,
            direct_io,
            // The environment's `DLBRIDGE_LOAD_REGISTER`, else staging buffers.
            register_pages: None,
            // Else the environment's `DLBRIDGE_LOAD_GDS`, else cuFile where it reads without a
            // copy.
            gds,
            // Else the environment's `DLBRIDGE_LOAD_ALLOCATION`, else one allocation per file.
            allocation,
        };
        let wanted: Option<std::collections::BTreeSet<String>> =
            keys.map(|k| k.into_iter().collect());
        let select = |name: &str| wanted.as_ref().is_none_or(|w| w.contains(name));
        let mut callback_error: Option<PyErr> = None;
        let loaded = py.detach(|| {
            let mut report = |done: u64, total: u64| {
                let Some(progress) = &progress else {
                    return;
                };
                if callback_error.is_some() {
                    return;
                }
                Python::attach(|py| {
                    if let Err(e) = progress.call1(py, (done, total)) {
                        callback_error = Some(e);
                    }
                });
            };
            self.inner.load_to(select, &options, &mut report)
        });
        if let Some(e) = callback_error {
            return Err(e);
        }
        let loaded = loaded.py()?;
        let out = PyDict::new(py);
        for (name, tensor) in loaded {
            out.set_item(name, Bound::new(py, PyArray::new(tensor))?)?;
        }
        Ok(out)
    }
}

/// Writes `tensors` (name → any array dlbridge can import) with `metadata` to `path`.
#[pyfunction]
#[pyo3(signature = (tensors, path, metadata=None))]
fn _st_save(
    py: Python<'_>,
    tensors: &Bound<'_, PyDict>,
    path: PathBuf,
    metadata: Option<BTreeMap<String, String>>,
) -> PyResult<()> {
    let mut owned: Vec<(String, Tensor)> = Vec::with_capacity(tensors.len());
    for (name, value) in tensors.iter() {
        let name: String = name
            .extract()
            .map_err(|_| PyTypeError::new_err("safetensors names must be str".to_owned()))?;
        let tensor = crate::creation::tensor_from(&value, None, None, None, None)?;
        owned.push((name, tensor));
    }
    let refs: Vec<(&str, &Tensor)> = owned.iter().map(|(n, t)| (n.as_str(), t)).collect();
    py.detach(|| save_file(&refs, metadata.as_ref(), &path))
        .py()
}

/// The safetensors dtype names dlbridge reads, in the order safetensors lists them.
#[pyfunction]
fn _st_dtype_names(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    PyList::new(py, dlbridge::safetensors::dtype_names())
}

/// Registers the natives on the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCheckpoint>()?;
    m.add_function(wrap_pyfunction!(_st_save, m)?)?;
    m.add_function(wrap_pyfunction!(_st_dtype_names, m)?)?;
    Ok(())
}
