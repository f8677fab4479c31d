//! The seam between device-independent code and the backends.
//!
//! Each backend is a folder; the rest of the crate reaches them only through the functions here,
//! which dispatch on [`DeviceKind`]. A backend that is not compiled in, or that cannot start on this
//! machine, answers with [`Error::BackendUnavailable`], never a panic.

pub mod cpu;
#[cfg(cuda)]
pub mod cuda;
pub mod plan;

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
            let device = cuda_kind_for(device, storage)?;
            #[cfg(cuda)]
            return cuda::allocate(device, bytes, zeroed);
            #[cfg(not(cuda))]
            {
                let _ = (device, bytes, zeroed);
                Err(unavailable("CUDA"))
            }
        }
        DeviceKind::Metal => Err(unavailable("Metal")),
        DeviceKind::Other(_) => Err(Error::UnsupportedDevice(format!(
            "dlbridge cannot allocate on {device}"
        ))),
    }
}

/// The device an allocation on `device` in `storage` lands on. For CUDA the storage mode picks the
/// kind (`private`: device memory `cuda:N`, `shared`: pinned host memory `cuda_host:N`,
/// `managed`: `cuda_managed:N`); a device that already names a host or managed kind must agree
/// with an explicit mode. Other devices are returned as they are.
pub fn placement(device: Device, storage: Option<StorageMode>) -> Result<Device> {
    match device.kind() {
        DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged => {
            cuda_kind_for(device, storage)
        }
        _ => Ok(device),
    }
}

fn cuda_kind_for(device: Device, storage: Option<StorageMode>) -> Result<Device> {
    let index = device.index();
    let wanted = match storage {
        None => return Ok(device),
        Some(StorageMode::Private) => Device::cuda(index),
        Some(StorageMode::Shared) => Device::cuda_host(index),
        Some(StorageMode::Managed) => Device::cuda_managed(index),
    };
    if device.kind() == DeviceKind::Cuda || device == wanted {
        Ok(wanted)
    } else {
        Err(Error::InvalidArgument(format!(
            "storage mode {} conflicts with device {device}",
            storage.map_or("default", StorageMode::name)
        )))
    }
}

/// Waits until the host may read or write `device`'s memory: a no-op except for the host-visible
/// CUDA kinds (pinned and managed memory), whose pending device work is waited for.
pub fn host_barrier(device: Device) -> Result<()> {
    #[cfg(cuda)]
    return cuda::host_barrier(device);
    #[cfg(not(cuda))]
    {
        let _ = device;
        Ok(())
    }
}

/// Checks memory a DLPack producer handed over, where the backend can: a CUDA pointer must be
/// one the driver knows, on the claimed device, with the whole addressed range inside one
/// allocation. Backends that are not compiled in (or have no driver) accept the producer's word.
pub(crate) fn validate_foreign(device: Device, addr: usize, len: usize) -> Result<()> {
    match device.kind() {
        // Without a driver nothing can be checked, and nothing here will touch the memory either:
        // the tensor is held and handed on as it came.
        #[cfg(cuda)]
        DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged
            if cuda::device_count().is_ok() =>
        {
            cuda::validate_foreign(device, addr, len)
        }
        _ => {
            let _ = (addr, len);
            Ok(())
        }
    }
}

/// Copies between two views of one shape and dtype where at least one is not CPU memory.
///
/// # Safety
/// As [`Tensor::copy_from_unchecked`](crate::Tensor::copy_from_unchecked).
pub(crate) unsafe fn copy_device(dst: &crate::Tensor, src: &crate::Tensor) -> Result<()> {
    let cuda_kind = |k: DeviceKind| {
        matches!(
            k,
            DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged
        )
    };
    let (sk, dk) = (src.device().kind(), dst.device().kind());
    let cuda_ok =
        (cuda_kind(sk) || sk == DeviceKind::Cpu) && (cuda_kind(dk) || dk == DeviceKind::Cpu);
    if cuda_ok && (cuda_kind(sk) || cuda_kind(dk)) {
        #[cfg(cuda)]
        // SAFETY: forwarded contract.
        return unsafe { cuda::copy(dst, src) };
        #[cfg(not(cuda))]
        return Err(unavailable("CUDA"));
    }
    // No backend here reaches the memory: name the side the host cannot address.
    let (device, what) = if !src.device().kind().is_host_accessible() {
        (src.device(), format!("copying from it to {}", dst.device()))
    } else {
        (dst.device(), format!("copying into it from {}", src.device()))
    };
    Err(Error::NotHostAccessible { device, what })
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
