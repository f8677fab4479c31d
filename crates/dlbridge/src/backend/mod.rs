//! The seam between device-independent code and the backends.
//!
//! Each backend is a folder; the rest of the crate reaches them only through the functions here,
//! which dispatch on [`DeviceKind`]. A backend that is not compiled in, or that cannot start on this
//! machine, answers with [`Error::BackendUnavailable`], never a panic.

pub mod cpu;
pub mod metal;

use crate::buffer::{Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};

/// Allocates `bytes` on `device`, zero-filled when `zeroed`. `storage` picks where the memory
/// lives; `None` takes the device's default.
pub fn allocate(
    device: Device,
    bytes: usize,
    storage: Option<StorageMode>,
    zeroed: bool,
) -> Result<Buffer> {
    match device.kind() {
        DeviceKind::Cpu => {
            // Host memory is shared memory whatever mode was asked for (see `StorageMode`).
            let _ = storage;
            cpu::allocate(bytes, zeroed)
        }
        DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged => {
            Err(unavailable("CUDA"))
        }
        DeviceKind::Metal => metal::allocate(device, bytes, storage, zeroed),
        DeviceKind::Other(_) => Err(Error::UnsupportedDevice(format!(
            "dlbridge cannot allocate on {device}"
        ))),
    }
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
