//! The seam between device-independent code and the backends.
//!
//! Each backend is a folder; the rest of the crate reaches them only through the functions here,
//! which dispatch on [`DeviceKind`]. A backend that is not compiled in, or that cannot start on this
//! machine, answers with [`Error::BackendUnavailable`], never a panic.

pub mod cpu;

use std::sync::Arc;

use crate::buffer::{Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};
use crate::pool::{MemoryStats, Pool};
use crate::storage::{self, Resolved};

/// Allocates `bytes` on `device`, zero-filled when `zeroed`. `storage` picks where the memory
/// lives; `None` takes the environment's or the device's default ([`storage::resolve`]).
pub fn allocate(
    device: Device,
    bytes: usize,
    storage: Option<StorageMode>,
    zeroed: bool,
) -> Result<Buffer> {
    match device.kind() {
        DeviceKind::Cpu => {
            // Resolving reads `DLBRIDGE_STORAGE_MODE` on first use (and warns once if it is
            // invalid); host memory is shared memory whatever the answer (see `StorageMode`).
            storage::resolve(DeviceKind::Cpu, storage)?;
            cpu::allocate(bytes, zeroed)
        }
        // CUDA: `let resolved = storage::resolve(device.kind(), storage)?;` then allocate from
        // the pool of (device, resolved.mode) with the current stream as the stream key; the
        // buffer's device kind follows the mode (private: Cuda, shared: CudaHost, managed:
        // CudaManaged).
        DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged => {
            Err(unavailable("CUDA"))
        }
        DeviceKind::Metal => Err(unavailable("Metal")),
        DeviceKind::Other(_) => Err(no_memory_of_ours(device)),
    }
}

/// The pool that serves allocations on `device` when nothing asks for a storage mode. CUDA device
/// kinds name a mode each, so `cuda:N`, `cuda_host:N` and `cuda_managed:N` will name the private,
/// shared and managed pools of device `N`.
fn pool(device: Device) -> Result<&'static Arc<Pool>> {
    match device.kind() {
        DeviceKind::Cpu => Ok(cpu::pool()),
        // CUDA: one pool per (device index, storage mode): `Cuda` → private, `CudaHost` →
        // shared (pinned), `CudaManaged` → managed.
        DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged => {
            Err(unavailable("CUDA"))
        }
        DeviceKind::Metal => Err(unavailable("Metal")),
        DeviceKind::Other(_) => Err(no_memory_of_ours(device)),
    }
}

fn no_memory_of_ours(device: Device) -> Error {
    Error::UnsupportedDevice(format!("dlbridge cannot allocate on {device}"))
}

/// The figures of `device`'s memory pool: active, cached and peak bytes, hits, misses, driver
/// calls and limits (see [`MemoryStats`]).
///
/// # Errors
/// [`Error::BackendUnavailable`] for a backend not in this build; [`Error::UnsupportedDevice`]
/// for devices dlbridge does not allocate on.
pub fn memory_stats(device: Device) -> Result<MemoryStats> {
    Ok(pool(device)?.stats())
}

/// Returns every cached block of `device`'s pool to the driver (memory in use is untouched).
///
/// # Errors
/// As [`memory_stats`].
pub fn empty_cache(device: Device) -> Result<()> {
    pool(device)?.clear_cache();
    Ok(())
}

/// Restarts the peak of `device`'s active bytes from the current active bytes.
///
/// # Errors
/// As [`memory_stats`].
pub fn reset_peak_memory(device: Device) -> Result<()> {
    pool(device)?.reset_peak();
    Ok(())
}

/// Limits the bytes of memory in use on `device` (`None`: no limit); an allocation that would
/// pass the limit fails with [`Error::OutOfMemory`].
///
/// # Errors
/// [`Error::InvalidArgument`] for a limit above [`pool::MAX_LIMIT`](crate::pool::MAX_LIMIT);
/// otherwise as [`memory_stats`].
pub fn set_memory_limit(device: Device, limit: Option<usize>) -> Result<()> {
    pool(device)?.set_memory_limit(limit)
}

/// Limits the bytes `device`'s pool keeps cached (`None`: no limit, `Some(0)`: no caching);
/// blocks beyond the limit go back to the driver, least recently released first.
///
/// # Errors
/// As [`set_memory_limit`].
pub fn set_cache_limit(device: Device, limit: Option<usize>) -> Result<()> {
    pool(device)?.set_cache_limit(limit)
}

/// The storage mode allocations on `device` get when they do not ask for one, and where that
/// came from.
///
/// # Errors
/// As [`memory_stats`].
pub fn storage_mode(device: Device) -> Result<Resolved> {
    resolve_storage(device, None)
}

/// The storage mode an allocation on `device` asking for `requested` gets ([`storage::resolve`]),
/// for devices whose backend is in this build.
///
/// # Errors
/// As [`memory_stats`], and as [`storage::resolve`].
pub fn resolve_storage(device: Device, requested: Option<StorageMode>) -> Result<Resolved> {
    // CUDA: once the backend is in, resolve for CUDA kinds too (the answer needs no driver).
    pool(device)?;
    storage::resolve(device.kind(), requested)
}

fn unavailable(backend: &'static str) -> Error {
    Error::BackendUnavailable {
        backend,
        reason: "this build of dlbridge does not include it".into(),
    }
}

/// The names of the backends compiled into this build.
pub fn compiled_backends() -> Vec<&'static str> {
    let mut out = vec!["cpu"];
    if cfg!(cuda) {
        out.push("cuda");
    }
    if cfg!(metal) {
        out.push("metal");
    }
    out
}
