//! `dlbridge.safetensors` natives: opening checkpoints, loading onto any device, saving. The
//! Python package (python/dlbridge/safetensors/) wraps them with `load_file`, `safe_open`,
//! `save_file` and the progress bar.

use std::collections::BTreeMap;
use std::path::PathBuf;

use dlbridge::safetensors::{
    Allocation, Checkpoint, LoadOptions, WriteOptions, deserialize, dtype_name, save_file_with,
    save_sharded, serialize,
};
use dlbridge::{Device, Layout, Tensor};
use pyo3::exceptions::{PyIndexError, PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyEllipsis, PyList, PySlice, PyString, PyTuple};

use crate::array::PyArray;
use crate::errors::IntoPyResult;

/// An opened checkpoint: one file, a list of shards, or an index.
#[pyclass(frozen, module = "dlbridge._dlbridge", name = "_Checkpoint")]
pub(crate) struct PyCheckpoint {
    inner: Checkpoint,
}

pub(crate) fn paths(obj: &Bound<'_, PyAny>) -> PyResult<Vec<PathBuf>> {
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
        let options = load_options(
            device,
            copy,
            dtype,
            threads,
            chunk_bytes,
            direct_io,
            storage,
            allocation,
            gds,
        )?;
        if let Some(keys) = &keys {
            if let Some(missing) = keys.iter().find(|k| self.inner.info(k).is_none()) {
                return Err(PyKeyError::new_err(format!(
                    "no tensor named {missing:?} in the checkpoint"
                )));
            }
        }
        let wanted: Option<std::collections::BTreeSet<String>> =
            keys.map(|k| k.into_iter().collect());
        let select = |name: &str| wanted.as_ref().is_none_or(|w| w.contains(name));
        let mut progress = Progress::new(progress);
        let loaded = py.detach(|| {
            self.inner.load_to(select, &options, &mut |done, total| {
                progress.report(done, total)
            })
        });
        progress.finish()?;
        let loaded = loaded.py()?;
        let out = PyDict::new(py);
        for (name, tensor) in loaded {
            out.set_item(name, Bound::new(py, PyArray::new(tensor))?)?;
        }
        Ok(out)
    }

    /// The element type of tensor `name`, as a `dlbridge.DType`.
    fn dtype(&self, name: &str) -> PyResult<crate::dtype::PyDType> {
        let (_, info) = self
            .inner
            .info(name)
            .ok_or_else(|| PyKeyError::new_err(format!("no tensor named {name:?}")))?;
        Ok(crate::dtype::PyDType(info.dtype()))
    }

    /// The part of tensor `name` that `key` selects (basic indexing: integers, slices with a
    /// positive step, `...`, `None`, as `Array.__getitem__` takes them), on `device`, reading only
    /// the bytes it needs (`Checkpoint::load_part`): on the CPU a view of the mapped file unless
    /// `copy`.
    #[pyo3(signature = (name, key, device, copy))]
    fn load_part(
        &self,
        py: Python<'_>,
        name: &str,
        key: &Bound<'_, PyAny>,
        device: &Bound<'_, PyAny>,
        copy: bool,
    ) -> PyResult<PyArray> {
        let options = load_options(device, copy, None, None, None, None, None, None, None)?;
        let part = self.part(py, name, key)?;
        let tensor = py
            .detach(|| self.inner.load_part(name, &part, &options))
            .py()?;
        Ok(PyArray::new(tensor))
    }

    /// Reads each `(name, key, target)` of `items` (the part of tensor `name` that `key` selects,
    /// as `load_part` takes it) into `target`, an existing writable array of the part's shape (a
    /// dlbridge array or any DLPack producer: a PyTorch parameter, a CuPy or NumPy array), on its
    /// device (`Checkpoint::load_parts_into`: the compact targets of one device by one run of the
    /// reader); returns the bytes of the files the parts need. `progress(done, total)` (bytes) is
    /// called about ten times a second while it reads. Every item is checked before anything is
    /// read. `wait=False`: the work queued on the targets' devices is not waited for first (the
    /// caller did: the later steps of a load in steps).
    #[pyo3(signature = (items, threads=None, direct_io=None, progress=None, wait=true))]
    fn load_parts_into(
        &self,
        py: Python<'_>,
        items: Vec<(String, Bound<'_, PyAny>, Bound<'_, PyAny>)>,
        threads: Option<usize>,
        direct_io: Option<bool>,
        progress: Option<Py<PyAny>>,
        wait: bool,
    ) -> PyResult<u64> {
        let mut parts: Vec<(String, Layout, Tensor)> = Vec::with_capacity(items.len());
        for (name, key, target) in &items {
            let part = self.part(py, name, key)?;
            // The target's own memory: never a copy.
            let dst = crate::creation::tensor_from(target, None, None, None, Some(false))?;
            parts.push((name.clone(), part, dst));
        }
        check_disjoint(&parts)?;
        let options = LoadOptions {
            threads,
            direct_io,
            wait_for_targets: wait,
            ..LoadOptions::new(Device::CPU)
        };
        let refs: Vec<(&str, Layout, &Tensor)> = parts
            .iter()
            .map(|(n, l, t)| (n.as_str(), l.clone(), t))
            .collect();
        let mut progress = Progress::new(progress);
        // The read runs without the GIL, as PyTorch's `copy_` runs without it.
        let read = py.detach(|| {
            let mut report = |done, total| progress.report(done, total);
            // SAFETY: no Rust reference into the targets' memory outlives a Python call; the
            // caller handed the targets to this read (another thread writing them meanwhile would
            // race as it would with PyTorch's own `copy_`, as `dlbridge.load_into` documents);
            // `check_disjoint` refused targets that overlap.
            unsafe { self.inner.load_parts_into(&refs, &options, &mut report) }
        });
        progress.finish()?;
        read.py()
    }
}

/// A Python `progress(done, total)` callable, called from a load or save that runs without the
/// GIL: each call attaches; the first exception it raises is kept and later calls are skipped;
/// [`finish`](Progress::finish) (with the GIL held, so the callable is released there) raises it.
pub(crate) struct Progress {
    callable: Option<Py<PyAny>>,
    error: Option<PyErr>,
}

impl Progress {
    pub(crate) fn new(callable: Option<Py<PyAny>>) -> Progress {
        Progress {
            callable,
            error: None,
        }
    }

    /// Tells the callable, unless there is none or it raised before.
    pub(crate) fn report(&mut self, done: u64, total: u64) {
        let Some(callable) = &self.callable else {
            return;
        };
        if self.error.is_some() {
            return;
        }
        Python::attach(|py| {
            if let Err(e) = callable.call1(py, (done, total)) {
                self.error = Some(e);
            }
        });
    }

    /// The exception the callable raised, if it did.
    pub(crate) fn finish(self) -> PyResult<()> {
        self.error.map_or(Ok(()), Err)
    }
}

/// Refuses targets whose bytes overlap (two names given one tensor's memory, a tied weight
/// listed twice): each would be written while the other is.
fn check_disjoint(parts: &[(String, Layout, Tensor)]) -> PyResult<()> {
    let mut spans: Vec<(usize, usize, &str)> = parts
        .iter()
        .filter(|(_, _, t)| t.numel() > 0)
        .map(|(n, _, t)| {
            let r = t.byte_range();
            let base = t.buffer().handle() as usize;
            (base + r.start, base + r.end, n.as_str())
        })
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(PyValueError::new_err(format!(
                "the targets of {:?} and {:?} share memory: give each tensor its own target",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(())
}

impl PyCheckpoint {
    /// The layout over tensor `name`'s elements that `key` selects (its byte offset counted from
    /// the tensor's first byte), as a part for `Checkpoint::load_part`.
    fn part(&self, py: Python<'_>, name: &str, key: &Bound<'_, PyAny>) -> PyResult<Layout> {
        let (shard, info) = self
            .inner
            .info(name)
            .ok_or_else(|| PyKeyError::new_err(format!("no tensor named {name:?}")))?;
        check_part_key(key)?;
        let whole = Layout::contiguous(info.shape()).py()?;
        if info.is_packed() {
            // The loader says why a part of packed elements cannot be read.
            return Ok(whole);
        }
        // The key applied as an array applies it, to a view of the tensor in the mapped file
        // that goes nowhere else: its layout is the part (no byte is read for it).
        let start = info.byte_range().start as usize;
        let at = whole.with_byte_offset(start);
        let view = Tensor::new(shard.buffer().clone(), info.dtype(), at).py()?;
        let selected = Bound::new(py, PyArray::new(view))?.get_item(key)?;
        let selected = selected.cast::<PyArray>()?.get().tensor()?.clone();
        if !selected.buffer().same_allocation(shard.buffer()) {
            return Err(PyIndexError::new_err(
                "get_slice takes basic indexing (integers, slices, '...', None) only",
            ));
        }
        // An empty view keeps its offset, so every view begins at or after the tensor.
        let offset = selected.byte_offset().saturating_sub(start);
        Ok(selected.layout().with_byte_offset(offset))
    }
}

/// The loader's options from `load`'s and `load_part`'s arguments.
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_options(
    device: &Bound<'_, PyAny>,
    copy: bool,
    dtype: Option<&Bound<'_, PyAny>>,
    threads: Option<usize>,
    chunk_bytes: Option<usize>,
    direct_io: Option<bool>,
    storage: Option<&str>,
    allocation: Option<&str>,
    gds: Option<bool>,
) -> PyResult<LoadOptions> {
    let device: Device = crate::device::parse(device)?;
    let storage = crate::device::parse_storage(storage)?;
    let allocation = allocation.map(str::parse::<Allocation>).transpose().py()?;
    let dtype = match dtype.filter(|d| !d.is_none()) {
        Some(d) => Some(crate::dtype::parse(d)?),
        None => None,
    };
    Ok(LoadOptions {
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
        // Else the environment's `DLBRIDGE_LOAD_GDS`, else cuFile where it reads without a copy.
        gds,
        // Else the environment's `DLBRIDGE_LOAD_ALLOCATION`, else one allocation per file.
        allocation,
        wait_for_targets: true,
    })
}

/// Refuses what a part of a file cannot be selected by, before the key is applied: anything but
/// basic indexing (integers, slices, `...`, `None`), and slices that step backwards.
fn check_part_key(key: &Bound<'_, PyAny>) -> PyResult<()> {
    let items: Vec<Bound<'_, PyAny>> = match key.cast::<PyTuple>() {
        Ok(t) => t.iter().collect(),
        Err(_) => vec![key.clone()],
    };
    for item in &items {
        if item.is_none() || item.is_instance_of::<PyEllipsis>() {
            continue;
        }
        if let Ok(slice) = item.cast::<PySlice>() {
            let step = slice.getattr("step")?;
            if !step.is_none() && step.lt(0)? {
                return Err(PyValueError::new_err(format!(
                    "slice step must be positive, got {}: a part of a file is read forwards \
                     (reverse it once loaded)",
                    step.str()?
                )));
            }
            continue;
        }
        let integer = !item.is_instance_of::<PyBool>() && item.hasattr("__index__")?;
        if !integer {
            return Err(PyIndexError::new_err(format!(
                "get_slice takes integers, slices, '...' and None (got {}): for a gather, load \
                 the tensor and index it",
                item.get_type().name()?
            )));
        }
    }
    Ok(())
}

/// The tensors of a Python mapping (name → any array dlbridge can import), in its order.
pub(crate) fn named_tensors(tensors: &Bound<'_, PyDict>) -> PyResult<Vec<(String, Tensor)>> {
    let mut owned: Vec<(String, Tensor)> = Vec::with_capacity(tensors.len());
    for (name, value) in tensors.iter() {
        let name: String = name
            .extract()
            .map_err(|_| PyTypeError::new_err("safetensors names must be str".to_owned()))?;
        let tensor = crate::creation::tensor_from(&value, None, None, None, None)?;
        owned.push((name, tensor));
    }
    Ok(owned)
}

/// Writes `tensors` (name → any array dlbridge can import) with `metadata` to `path`, or, with
/// `max_shard_size`, as shards and their index into the folder `path`; returns the path written
/// (the file, or the index or one file of a sharded save). `progress(done, total)` (bytes) is
/// called about ten times a second while it writes; `threads`, `chunk_bytes` and `direct_io` set
/// the engine's writers (`None`: its defaults).
#[pyfunction]
#[pyo3(signature = (
    tensors, path, metadata=None, max_shard_size=None, progress=None, threads=None,
    chunk_bytes=None, direct_io=None
))]
#[allow(clippy::too_many_arguments)]
fn _st_save(
    py: Python<'_>,
    tensors: &Bound<'_, PyDict>,
    path: PathBuf,
    metadata: Option<BTreeMap<String, String>>,
    max_shard_size: Option<u64>,
    progress: Option<Py<PyAny>>,
    threads: Option<usize>,
    chunk_bytes: Option<usize>,
    direct_io: Option<bool>,
) -> PyResult<PathBuf> {
    let owned = named_tensors(tensors)?;
    let refs: Vec<(&str, &Tensor)> = owned.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let options = write_options(threads, chunk_bytes, direct_io);
    let mut progress = Progress::new(progress);
    let saved = py.detach(|| {
        let mut report = |done, total| progress.report(done, total);
        match max_shard_size {
            Some(max) => save_sharded(&refs, metadata.as_ref(), &path, max, &options, &mut report),
            None => save_file_with(&refs, metadata.as_ref(), &path, &options, &mut report)
                .map(|()| path.clone()),
        }
    });
    progress.finish()?;
    saved.py()
}

/// The engine's write options from `_st_save`'s arguments (`None`: its defaults).
pub(crate) fn write_options(
    threads: Option<usize>,
    chunk_bytes: Option<usize>,
    direct_io: Option<bool>,
) -> WriteOptions {
    let defaults = WriteOptions::default();
    WriteOptions {
        threads: threads.unwrap_or(defaults.threads).max(1),
        chunk: chunk_bytes.unwrap_or(defaults.chunk),
        direct_io: direct_io.unwrap_or(defaults.direct_io),
        whole: false,
    }
}

/// `tensors` with `metadata` in the safetensors format, as bytes.
#[pyfunction]
#[pyo3(signature = (tensors, metadata=None))]
fn _st_serialize<'py>(
    py: Python<'py>,
    tensors: &Bound<'py, PyDict>,
    metadata: Option<BTreeMap<String, String>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let owned = named_tensors(tensors)?;
    let refs: Vec<(&str, &Tensor)> = owned.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let bytes = py.detach(|| serialize(&refs, metadata.as_ref())).py()?;
    Ok(PyBytes::new(py, &bytes))
}

/// The metadata and tensors (each in CPU memory of its own) of safetensors bytes.
#[pyfunction]
#[allow(clippy::type_complexity)] // (metadata, tensors), as `_st_serialize` takes them
fn _st_deserialize<'py>(
    py: Python<'py>,
    data: &[u8],
) -> PyResult<(Option<BTreeMap<String, String>>, Bound<'py, PyDict>)> {
    let (metadata, tensors) = py.detach(|| deserialize(data)).py()?;
    let out = PyDict::new(py);
    for (name, tensor) in tensors {
        out.set_item(name, Bound::new(py, PyArray::new(tensor))?)?;
    }
    Ok((metadata, out))
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
    m.add_function(wrap_pyfunction!(_st_serialize, m)?)?;
    m.add_function(wrap_pyfunction!(_st_deserialize, m)?)?;
    m.add_function(wrap_pyfunction!(_st_dtype_names, m)?)?;
    Ok(())
}
