//! The `dlbridge._dlbridge` extension module (not a library: extension authors want `dlbridge-pyo3`).
//!
//! The crate `dlbridge-python-module` (`crates/python-module`, never published) is what maturin
//! builds into the `dlbridge` wheel: the Python bindings of the `dlbridge` crate. Its modules are
//! private; `dlbridge-pyo3` (`crates/dlbridge-pyo3`, published) is the crate to depend on for a
//! PyO3 extension of one's own that takes and returns dlbridge arrays.
//!
//! | Python | Rust |
//! | --- | --- |
//! | `dlbridge.Array` | [`array::PyArray`] over [`dlbridge::Tensor`]; its methods in [`array_methods`] |
//! | `dlbridge.from_dlpack`, `Array.__dlpack__` | [`dlpack`]: Python objects into the core's exchange requests (capsules are renamed in [`dlpack::capsule`]) |
//! | `dlbridge.load_file`, `safe_open`, `save_file` | [`safetensors`] over [`dlbridge::safetensors`] |
//! | `dlbridge.load_npy`, `load_npz` | [`npy`] over [`dlbridge::npy`] |
//! | exceptions | [`errors`] (the one mapping) |
//! | `dlbridge.Backend` | [`backend::PyBackend`] over [`dlbridge::compute::Backend`] |
//! | `dlbridge.float32`, ... | [`dtype::names`] (the core's `DType::named`), the one list of them (the module's `__all__`) |
//! | `dlbridge.cuda`, `dlbridge.metal` | [`cuda`], [`metal`] (natives the Python modules wrap) |
//! | `Array.__getitem__` / `__setitem__` | [`indexing`]: basic indices as views, integer arrays and masks through [`dlbridge::compute::index`] |
//! | `repr(a)`, `str(a)` | [`format`]: NumPy's printing, with NumPy's print options ([`npcompat`]) |
//! | operators, reductions, `dlbridge.ops` | [`ops`] over [`dlbridge::compute`]; shape methods in [`views`] |
//! | `dlbridge.ones`, `zeros_like`, ... | [`creation`] |

// The extension's modules are its own (the Python package is its public face): its docs are
// for the people who work on it, and link to them.
#![allow(rustdoc::private_intra_doc_links)]

mod array;
mod array_methods;
mod backend;
mod convert;
mod creation;
mod cuda;
mod device;
mod dlpack;
mod dtype;
mod errors;
mod fastcall;
mod format;
mod indexing;
mod kernel;
mod memory;
mod metal;
mod ml_dtypes;
mod nccl;
mod npcompat;
mod npy;
mod ops;
mod safetensors;
mod save;
mod share;
mod stream;
mod views;

use pyo3::prelude::*;

/// Version, backends compiled in, and devices found, as a dict (`python -m dlbridge info`).
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("dlpack_version", {
        let v = dlbridge::dlpack::VERSION;
        (v.major, v.minor)
    })?;
    d.set_item("backends", dlbridge::backend::compiled_backends())?;
    let mut devices = vec![dlbridge::Device::CPU.to_string()];
    for i in 0..cuda::_cuda_device_count() {
        devices.push(dlbridge::Device::cuda(i as u32).to_string());
    }
    for i in 0..dlbridge::backend::metal::device_count() {
        devices.push(dlbridge::Device::metal(i as u32).to_string());
    }
    d.set_item("devices", devices)?;
    Ok(d)
}

/// Releases an array's memory now (`Backend.free`); see [`array::PyArray::free`].
#[pyfunction]
fn _free(array: &Bound<'_, array::PyArray>) -> PyResult<()> {
    array.get().free()
}

/// Waits until dlbridge's pending work on `device` has finished (a CUDA device's streams, a Metal
/// device's command buffers; nothing on the CPU). Raises `RuntimeError` when the device's backend
/// is not available.
#[pyfunction]
fn synchronize(py: Python<'_>, device: &Bound<'_, PyAny>) -> PyResult<()> {
    let device = device::parse(device)?;
    py.detach(|| dlbridge::backend::synchronize(device))
        .map_err(errors::to_py)
}

#[pymodule]
fn _dlbridge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<array::PyArray>()?;
    array_methods::DLPACK.add_to_class::<array::PyArray>(m.py())?;
    dtype::register(m)?;
    m.add_class::<device::PyDevice>()?;
    creation::FROM_DLPACK.add_to_module(m)?;
    m.add_function(wrap_pyfunction!(creation::asarray, m)?)?;
    creation::EMPTY.add_to_module(m)?;
    m.add_function(wrap_pyfunction!(creation::zeros, m)?)?;
    m.add_function(wrap_pyfunction!(creation::full, m)?)?;
    m.add_function(wrap_pyfunction!(creation::arange, m)?)?;
    m.add_function(wrap_pyfunction!(creation::ones, m)?)?;
    m.add_function(wrap_pyfunction!(creation::zeros_like, m)?)?;
    m.add_function(wrap_pyfunction!(creation::ones_like, m)?)?;
    m.add_function(wrap_pyfunction!(creation::empty_like, m)?)?;
    m.add_function(wrap_pyfunction!(creation::full_like, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(_free, m)?)?;
    m.add_function(wrap_pyfunction!(synchronize, m)?)?;
    cuda::register(m)?;
    memory::register(m)?;
    metal::register(m)?;
    ops::register(m)?;
    share::register(m)?;
    nccl::register(m)?;
    kernel::register(m)?;
    safetensors::register(m)?;
    save::register(m)?;
    stream::register(m)?;
    npy::register(m)?;
    m.add_class::<backend::PyBackend>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    dtype::set_all(m)?;
    Ok(())
}
