//! `dlbridge.metal`: Apple GPUs through the Metal backend, and the Metal side of DLPack exchange
//! (synchronizing before export, resolving `kDLMetal` imports, host views of shared memory).
//!
//! The Python module `dlbridge.metal` (python/dlbridge/metal.py) wraps these natives. Where the
//! backend is not available (not an Apple platform, or no device), every call that needs a device
//! raises the core's `BackendUnavailable` error, a `RuntimeError` that starts "Metal backend not
//! available: ".

use dlbridge::backend::metal::{self, DeviceInfo, ResidencyStatus};
use dlbridge::{Device, DeviceKind, StorageMode, Tensor};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::IntoPyResult;

/// Reads a Metal device argument: `None` is `metal:0`, an int `N` is `metal:N`, and any other
/// device form must name a Metal device.
fn metal_device(device: Option<&Bound<'_, PyAny>>) -> PyResult<Device> {
    let Some(device) = device.filter(|d| !d.is_none()) else {
        return Ok(Device::metal(0));
    };
    if let Ok(i) = device.extract::<i64>() {
        return u32::try_from(i)
            .map(Device::metal)
            .map_err(|_| PyValueError::new_err(format!("Metal device {i} does not exist")));
    }
    let d = crate::device::parse(device)?;
    if d.kind() != DeviceKind::Metal {
        return Err(PyValueError::new_err(format!("{d} is not a Metal device")));
    }
    Ok(d)
}

/// Whether the Metal backend is compiled in and found a device.
#[pyfunction]
fn _metal_is_available() -> bool {
    metal::is_available()
}

/// Why Metal cannot be used here (empty when it can).
#[pyfunction]
fn _metal_unavailable_reason() -> String {
    if metal::is_available() {
        return String::new();
    }
    metal::devices()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
}

/// The number of Metal devices (0 without the backend).
#[pyfunction]
fn _metal_device_count() -> usize {
    metal::device_count()
}

fn info_dict<'py>(py: Python<'py>, info: &DeviceInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("device", info.device.to_string())?;
    d.set_item("name", &info.name)?;
    d.set_item("registry_id", info.registry_id)?;
    d.set_item("has_unified_memory", info.has_unified_memory)?;
    d.set_item("max_buffer_length", info.max_buffer_length)?;
    d.set_item(
        "recommended_max_working_set_size",
        info.recommended_max_working_set_size,
    )?;
    d.set_item("low_power", info.low_power)?;
    d.set_item("removable", info.removable)?;
    d.set_item("page_size", info.page_size)?;
    d.set_item("default_storage", info.default_storage.name())?;
    d.set_item("managed_storage", info.managed_storage)?;
    let (residency, error) = match &info.residency {
        ResidencyStatus::Enabled => ("enabled", None),
        ResidencyStatus::DisabledByEnvironment => ("disabled", None),
        ResidencyStatus::Unsupported => ("unsupported", None),
        ResidencyStatus::Failed(e) => ("failed", Some(e.as_str())),
    };
    d.set_item("residency", residency)?;
    d.set_item("residency_error", error)?;
    Ok(d)
}

/// What dlbridge knows about a Metal device, as a dict.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn _metal_device_info<'py>(
    py: Python<'py>,
    device: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let info = metal::device_info(metal_device(device)?).py()?;
    info_dict(py, &info)
}

/// Every Metal device, in dlbridge's order, as dicts.
#[pyfunction]
fn _metal_devices(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    metal::devices()
        .py()?
        .iter()
        .map(|info| info_dict(py, info))
        .collect()
}

/// Commits and waits for dlbridge's pending work on a Metal device.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn _metal_synchronize(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let device = metal_device(device)?;
    py.detach(|| metal::synchronize(device)).py()
}

/// How many allocations the device's residency set holds (`None`: residency sets are off).
#[pyfunction]
#[pyo3(signature = (device=None))]
fn _metal_residency_allocation_count(device: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    metal::residency_allocation_count(metal_device(device)?).py()
}

/// Registers the natives on the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_metal_is_available, m)?)?;
    m.add_function(wrap_pyfunction!(_metal_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(_metal_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(_metal_device_info, m)?)?;
    m.add_function(wrap_pyfunction!(_metal_devices, m)?)?;
    m.add_function(wrap_pyfunction!(_metal_synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(_metal_residency_allocation_count, m)?)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// NumPy conversion.

/// A CPU view of a Metal array's shared memory (for NumPy), or `None` where there is none to give
/// (another device, private or managed storage, or memory the host cannot address).
pub(crate) fn host_view(tensor: &Tensor) -> PyResult<Option<Tensor>> {
    let buffer = tensor.buffer();
    let shared = tensor.device().kind() == DeviceKind::Metal
        && buffer.storage_mode() == StorageMode::Shared
        && buffer.host_ptr().is_some();
    if !shared {
        return Ok(None);
    }
    metal::host_view(tensor).py().map(Some)
}
