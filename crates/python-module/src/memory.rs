//! Memory statistics, cache control, limits and storage modes: `dlbridge.memory_stats`,
//! `empty_cache`, `reset_peak_memory`, `set_memory_limit`, `set_cache_limit`, `storage_mode`.
//!
//! Every function takes a `device` (default `"cpu"`) in any form `dlbridge.Device` accepts. The pool
//! functions also take `storage`, for a pool the device alone does not name (a Metal device's
//! private or managed pool; `None` is the pool of the device's default mode).

use std::sync::Arc;

use std::ffi::CString;

use dlbridge::{Device, DeviceKind, Pool, StorageMode};
use pyo3::exceptions::{PyRuntimeWarning, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyTuple};

use crate::errors::IntoPyResult;

/// Adds this module's functions to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak_memory, m)?)?;
    m.add_function(wrap_pyfunction!(set_memory_limit, m)?)?;
    m.add_function(wrap_pyfunction!(set_cache_limit, m)?)?;
    m.add_function(wrap_pyfunction!(storage_mode, m)?)?;
    Ok(())
}

/// Raises a `RuntimeWarning` about an invalid `DLBRIDGE_STORAGE_MODE`, once per process: the
/// first call after the variable was found invalid warns, every other call does nothing. Reads
/// the variable if nothing has yet. Call it where Python code allocates.
///
/// Fails only when the warning filters turn the warning into an exception.
#[inline]
pub(crate) fn warn_env_once(py: Python<'_>) -> PyResult<()> {
    let Some(message) = dlbridge::storage::take_env_warning() else {
        return Ok(());
    };
    // Environment variables cannot hold NUL, so this never drops a character in practice.
    let message = CString::new(message.replace('\0', "")).unwrap_or_default();
    PyErr::warn(py, &py.get_type::<PyRuntimeWarning>(), &message, 1)
}

fn device_or_cpu(device: Option<&Bound<'_, PyAny>>) -> PyResult<Device> {
    Ok(crate::device::parse_opt(device)?.unwrap_or(Device::CPU))
}

/// The pool of `device` (default CPU) for `storage` (`None`: the device's own).
fn pool_of(
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<&'static Arc<Pool>> {
    let storage = crate::device::parse_storage(storage)?;
    dlbridge::backend::pool_for(device_or_cpu(device)?, storage).py()
}

/// Reads a limit: `None`, or a non-negative integer number of bytes (an `int`, or an object with
/// `__index__` such as a NumPy integer; not a `bool`).
fn parse_limit(limit: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    if limit.is_none() {
        return Ok(None);
    }
    let not_bytes = || {
        PyTypeError::new_err(format!(
            "a limit is a number of bytes (an int) or None, not {}",
            limit
                .get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    };
    if limit.is_instance_of::<PyBool>() {
        return Err(not_bytes());
    }
    let int = if limit.is_instance_of::<PyInt>() {
        limit.clone()
    } else {
        let index = limit.py().import("operator")?.getattr("index")?;
        index.call1((limit,)).map_err(|_| not_bytes())?
    };
    if int.lt(0)? {
        return Err(PyValueError::new_err(format!(
            "a limit cannot be negative (got {int})"
        )));
    }
    match int
        .extract::<u64>()
        .ok()
        .and_then(|v| usize::try_from(v).ok())
    {
        Some(bytes) => Ok(Some(bytes)),
        None => Err(PyValueError::new_err(format!(
            "a limit of {int} bytes is beyond any allocation"
        ))),
    }
}

/// The shareable pool of `device` (that `Array.share` and `open_shared` use) when `storage` names
/// no pool of its own and the device has one (`cpu`, `cuda_host:N`, `cuda:N`).
fn shareable_pool(
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<Option<&'static Arc<Pool>>> {
    if storage.is_some() {
        return Ok(None);
    }
    let device = device_or_cpu(device)?;
    let has_one = matches!(
        device.kind(),
        DeviceKind::Cpu | DeviceKind::CudaHost | DeviceKind::Cuda
    );
    Ok(has_one
        .then(|| dlbridge::share::pool(device).ok())
        .flatten())
}

/// The figures of the device's memory pool, as a dict: `active_bytes`, `active_blocks`,
/// `requested_bytes`, `cached_bytes`, `cached_blocks`, `peak_active_bytes`, `allocations`,
/// `cache_hits`, `cache_misses`, `driver_allocations`, `driver_frees`, `memory_limit` and
/// `cache_limit` (`None`: no limit). With `shareable=True`, the figures of the device's
/// shareable pool (`cpu`, `cuda_host:N`, `cuda:N`): the memory `Array.share`, `to_shareable`
/// and `open_shared` use.
#[pyfunction]
#[pyo3(
    signature = (device=None, *, storage=None, shareable=false),
    text_signature = "(device='cpu', *, storage=None, shareable=False)"
)]
fn memory_stats<'py>(
    py: Python<'py>,
    device: Option<&Bound<'py, PyAny>>,
    storage: Option<&str>,
    shareable: bool,
) -> PyResult<Bound<'py, PyDict>> {
    warn_env_once(py)?;
    let pool = if shareable {
        if storage.is_some() {
            return Err(PyValueError::new_err(
                "shareable=True names the shareable pool: give no storage",
            ));
        }
        shareable_pool(device, None)?.ok_or_else(|| {
            PyValueError::new_err(
                "this device has no shareable pool (cpu, cuda_host:N and cuda:N have one)",
            )
        })?
    } else {
        pool_of(device, storage)?
    };
    let s = pool.stats();
    let d = PyDict::new(py);
    d.set_item("active_bytes", s.active_bytes)?;
    d.set_item("active_blocks", s.active_blocks)?;
    d.set_item("requested_bytes", s.requested_bytes)?;
    d.set_item("cached_bytes", s.cached_bytes)?;
    d.set_item("cached_blocks", s.cached_blocks)?;
    d.set_item("peak_active_bytes", s.peak_active_bytes)?;
    d.set_item("allocations", s.allocations)?;
    d.set_item("cache_hits", s.cache_hits)?;
    d.set_item("cache_misses", s.cache_misses)?;
    d.set_item("driver_allocations", s.driver_allocations)?;
    d.set_item("driver_frees", s.driver_frees)?;
    d.set_item("memory_limit", s.memory_limit)?;
    d.set_item("cache_limit", s.cache_limit)?;
    Ok(d)
}

/// Returns every cached block of the device's pool to the driver; memory in use is untouched.
/// Without `storage`, the cached blocks of the device's shareable pool go too, and on a CUDA
/// device the memory received from other processes that is kept mapped after its last array went.
#[pyfunction]
#[pyo3(signature = (device=None, *, storage=None), text_signature = "(device='cpu', *, storage=None)")]
fn empty_cache(
    py: Python<'_>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<()> {
    let pool = pool_of(device, storage)?;
    let shareable = shareable_pool(device, storage)?;
    let device = device_or_cpu(device)?;
    // Large blocks take a while to unmap; let other threads run meanwhile.
    py.detach(|| {
        pool.clear_cache();
        if shareable.is_some() {
            dlbridge::share::empty_cache(device);
        } else {
            dlbridge::share::release_kept(device);
        }
    });
    Ok(())
}

/// Restarts `peak_active_bytes` from the current `active_bytes` (without `storage`, the
/// shareable pool's too: `memory_stats(shareable=True)`).
#[pyfunction]
#[pyo3(signature = (device=None, *, storage=None), text_signature = "(device='cpu', *, storage=None)")]
fn reset_peak_memory(device: Option<&Bound<'_, PyAny>>, storage: Option<&str>) -> PyResult<()> {
    pool_of(device, storage)?.reset_peak();
    if let Some(pool) = shareable_pool(device, storage)? {
        pool.reset_peak();
    }
    Ok(())
}

/// Limits the bytes in use on the device (`None`: no limit). An allocation that would pass it
/// raises `MemoryError`; a negative or impossibly large limit raises `ValueError`.
#[pyfunction]
#[pyo3(
    signature = (limit, /, device=None, *, storage=None),
    text_signature = "(limit, /, device='cpu', *, storage=None)"
)]
fn set_memory_limit(
    limit: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<()> {
    let limit = parse_limit(limit)?;
    pool_of(device, storage)?.set_memory_limit(limit).py()
}

/// Limits the bytes the device's pool keeps cached (`None`: no limit, `0`: no caching); cached
/// blocks beyond it go back to the driver, least recently used first.
#[pyfunction]
#[pyo3(
    signature = (limit, /, device=None, *, storage=None),
    text_signature = "(limit, /, device='cpu', *, storage=None)"
)]
fn set_cache_limit(
    py: Python<'_>,
    limit: &Bound<'_, PyAny>,
    device: Option<&Bound<'_, PyAny>>,
    storage: Option<&str>,
) -> PyResult<()> {
    let limit = parse_limit(limit)?;
    let pool = pool_of(device, storage)?;
    py.detach(|| pool.set_cache_limit(limit)).py()
}

/// `(mode, source)`: the storage mode (`"private"`, `"shared"`, `"managed"`) allocations on the
/// device get, and where it came from (`"default"`, `"environment"` for `DLBRIDGE_STORAGE_MODE`
/// or, on Metal devices, `DLBRIDGE_METAL_STORAGE_MODE`, `"explicit"`). With `requested`, the answer for an allocation that
/// asks for that mode. On the CPU the mode is always `"shared"`.
#[pyfunction]
#[pyo3(signature = (device=None, requested=None), text_signature = "(device='cpu', requested=None)")]
fn storage_mode<'py>(
    py: Python<'py>,
    device: Option<&Bound<'py, PyAny>>,
    requested: Option<&str>,
) -> PyResult<Bound<'py, PyTuple>> {
    warn_env_once(py)?;
    let requested = requested.map(str::parse::<StorageMode>).transpose().py()?;
    let resolved = dlbridge::backend::resolve_storage(device_or_cpu(device)?, requested).py()?;
    PyTuple::new(py, [resolved.mode.name(), resolved.source.name()])
}
