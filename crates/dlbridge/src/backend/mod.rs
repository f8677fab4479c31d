//! The seam between device-independent code and the backends.
//!
//! Each backend is a folder; the rest of the crate reaches them only through the functions here,
//! which dispatch on [`DeviceKind`]. A backend that is not compiled in, or that cannot start on this
//! machine, answers with [`Error::BackendUnavailable`], never a panic.

pub mod cpu;
#[cfg(cuda)]
pub mod cuda;
pub mod metal;
pub mod plan;

use std::sync::Arc;

use crate::buffer::{Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};
use crate::pool::{MemoryStats, Pool};
use crate::storage::{self, Resolved};
use crate::tensor::Tensor;

/// Allocates `bytes` on `device`, zero-filled when `zeroed`. `storage` picks where the memory
/// lives; `None` takes the environment's or the device's default ([`storage::resolve`]).
#[inline]
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
        // The storage mode (explicit, else `DLBRIDGE_STORAGE_MODE`, else private) picks the pool
        // and the device kind: private → `cuda:N`, shared → `cuda_host:N`, managed →
        // `cuda_managed:N`. Blocks are keyed by the calling thread's current stream.
        DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged => {
            let storage = match (device.kind(), storage) {
                (DeviceKind::Cuda, None) => Some(storage::resolve(DeviceKind::Cuda, None)?.mode),
                (_, explicit) => explicit,
            };
            let device = cuda_kind_for(device, storage)?;
            #[cfg(cuda)]
            return cuda::allocate(device, bytes, zeroed);
            #[cfg(not(cuda))]
            {
                let _ = (device, bytes, zeroed);
                Err(unavailable("CUDA"))
            }
        }
        DeviceKind::Metal => metal::allocate(device, bytes, storage, zeroed),
        DeviceKind::Other(_) => Err(no_memory_of_ours(device)),
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
/// CUDA kinds (pinned and managed memory) and Metal devices (shared and managed buffers), whose
/// pending device work is waited for.
pub fn host_barrier(device: Device) -> Result<()> {
    if device.kind() == DeviceKind::Metal {
        return metal::synchronize(device);
    }
    #[cfg(cuda)]
    return cuda::host_barrier(device);
    #[cfg(not(cuda))]
    {
        let _ = device;
        Ok(())
    }
}

/// Waits until dlbridge's pending work on `device` has finished: the CUDA device's work (all its
/// streams), or the Metal device's command buffers (committing the open one first). A no-op on the
/// CPU.
///
/// # Errors
/// [`Error::BackendUnavailable`] for a backend not in this build or without devices; the
/// driver's error (for Metal, GPU errors recorded since the last synchronization);
/// [`Error::UnsupportedDevice`] for devices dlbridge has no backend for.
pub fn synchronize(device: Device) -> Result<()> {
    match device.kind() {
        DeviceKind::Cpu => Ok(()),
        DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged => {
            #[cfg(cuda)]
            return cuda::synchronize(device.index() as i32);
            #[cfg(not(cuda))]
            return Err(unavailable("CUDA"));
        }
        DeviceKind::Metal => metal::synchronize(device),
        DeviceKind::Other(_) => Err(Error::UnsupportedDevice(format!(
            "dlbridge has no work on {device} to wait for"
        ))),
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

/// Resolves a producer's tensor whose memory is named by an opaque handle (`kDLMetal`: an
/// `id<MTLBuffer>`) into one dlbridge can use: a view of a shared or managed buffer, a copy of a
/// private one (refused for `copy=Some(false)`), or a copy for `copy=Some(true)`. Tensors of other
/// devices, and Metal tensors where the backend is not available (held opaquely), pass through.
pub(crate) fn resolve_import(tensor: Tensor, copy: Option<bool>) -> Result<Tensor> {
    if tensor.device().kind() != DeviceKind::Metal || !metal::is_available() {
        return Ok(tensor);
    }
    let options = metal::ImportOptions {
        copy,
        ..metal::ImportOptions::default()
    };
    metal::import_foreign(tensor, options)
}

/// Before a tensor on `device` leaves for a consumer: makes dlbridge's pending work visible to it.
/// CUDA orders it before the consumer's `stream` (as the array API standard spells streams);
/// Metal, which has no stream in DLPack, waits for it (a no-op where the backend is not
/// available: a foreign Metal tensor, held opaquely, is handed on as it came). Other devices have
/// no streams, so a stream there is an error.
pub fn export_handoff(device: Device, stream: Option<i64>) -> Result<()> {
    match device.kind() {
        kind if kind.is_cuda() => {
            #[cfg(cuda)]
            return cuda::make_visible(device.index() as i32, cuda::stream_from_dlpack(stream)?);
            #[cfg(not(cuda))]
            {
                let _ = stream;
                Ok(())
            }
        }
        _ if stream.is_some() => Err(Error::InvalidArgument(format!(
            "stream must be None for arrays on {device} (got {})",
            stream.unwrap_or_default()
        ))),
        DeviceKind::Metal if metal::is_available() => metal::synchronize(device),
        _ => Ok(()),
    }
}

/// A host view of `tensor`'s memory where its backend has one to give without a copy (shared
/// Metal buffers); `None` for devices whose memory needs no view or cannot have one; an error
/// saying why for Metal memory that cannot be viewed (private or managed storage).
pub(crate) fn host_view(tensor: &Tensor) -> Result<Option<Tensor>> {
    if tensor.device().kind() != DeviceKind::Metal || !metal::is_available() {
        return Ok(None);
    }
    metal::host_view(tensor).map(Some)
}

/// The stream a consumer on `device` names to its producer (array API `__dlpack__(stream=)`):
/// the calling thread's current CUDA stream, with the legacy default stream spelled `1`; `None`
/// for devices without streams.
pub fn consumer_stream(device: Device) -> Option<i64> {
    if !device.kind().is_cuda() {
        return None;
    }
    #[cfg(cuda)]
    return Some(match cuda::current_stream(device.index() as i32) {
        0 => 1,
        s => s as i64,
    });
    #[cfg(not(cuda))]
    Some(1)
}

/// The calling thread's current stream on a CUDA `device` as a raw handle (`0`: the legacy
/// default stream); `0` for devices without streams.
pub fn current_stream(device: Device) -> usize {
    if !device.kind().is_cuda() {
        return 0;
    }
    #[cfg(cuda)]
    return cuda::current_stream(device.index() as i32);
    #[cfg(not(cuda))]
    0
}

/// As a consumer of a producer that named its work stream instead of ordering it for us (the C
/// exchange table's "NoSync" exports): makes our current stream on `device` wait for the
/// producer's stream `producer`. A no-op for devices without streams.
pub fn order_after_producer(device: Device, producer: usize) -> Result<()> {
    if !device.kind().is_cuda() {
        return Ok(());
    }
    #[cfg(cuda)]
    return cuda::order_streams(device.index() as i32, producer, current_stream(device));
    #[cfg(not(cuda))]
    {
        let _ = producer;
        Err(unavailable("CUDA"))
    }
}

/// Copies between two views of one shape and dtype where at least one is not CPU memory.
///
/// # Safety
/// As [`Tensor::copy_from_unchecked`](crate::Tensor::copy_from_unchecked).
pub(crate) unsafe fn copy_device(dst: &crate::Tensor, src: &crate::Tensor) -> Result<()> {
    let (sk, dk) = (src.device().kind(), dst.device().kind());
    let cuda_ok =
        (sk.is_cuda() || sk == DeviceKind::Cpu) && (dk.is_cuda() || dk == DeviceKind::Cpu);
    if cuda_ok && (sk.is_cuda() || dk.is_cuda()) {
        #[cfg(cuda)]
        // SAFETY: forwarded contract.
        return unsafe { cuda::copy(dst, src) };
        #[cfg(not(cuda))]
        return Err(unavailable("CUDA"));
    }
    #[cfg(metal)]
    if (sk == DeviceKind::Metal || dk == DeviceKind::Metal)
        && matches!(sk, DeviceKind::Metal | DeviceKind::Cpu)
        && matches!(dk, DeviceKind::Metal | DeviceKind::Cpu)
    {
        // SAFETY: forwarded contract.
        return unsafe { metal::copy_unchecked(src, dst) };
    }
    // No backend here reaches the memory: name the side the host cannot address.
    let (device, what) = if !src.device().kind().is_host_accessible() {
        (src.device(), format!("copying from it to {}", dst.device()))
    } else {
        (
            dst.device(),
            format!("copying into it from {}", src.device()),
        )
    };
    Err(Error::NotHostAccessible { device, what })
}

/// Runs an element-wise kernel on the request's device ([`crate::compute`]).
pub(crate) fn map(req: &crate::compute::MapRequest<'_>) -> Result<()> {
    match req.out.device().kind() {
        DeviceKind::Cpu => cpu::compute::map(req),
        #[cfg(cuda)]
        kind if kind.is_cuda() => {
            // Recorded also after a failure part-way: what was enqueued may still run.
            let enqueued = cuda::compute::map(req);
            enqueued.and(cuda::record_use(req.tensor_inputs().chain([req.out])))
        }
        DeviceKind::Metal => metal::compute::map(req),
        _ => Err(no_compute(req.out.device())),
    }
}

/// Runs a reduction on the request's device ([`crate::compute`]).
pub(crate) fn reduce(req: &crate::compute::ReduceRequest<'_>) -> Result<()> {
    match req.out.device().kind() {
        DeviceKind::Cpu => cpu::compute::reduce(req),
        #[cfg(cuda)]
        kind if kind.is_cuda() => {
            let enqueued = cuda::compute::reduce(req);
            enqueued.and(cuda::record_use([req.input, req.out]))
        }
        DeviceKind::Metal => metal::compute::reduce(req),
        _ => Err(no_compute(req.out.device())),
    }
}

/// Runs a batched matrix product on the request's device ([`crate::compute`]).
pub(crate) fn matmul(req: &crate::compute::MatmulRequest<'_>) -> Result<()> {
    match req.out.device().kind() {
        DeviceKind::Cpu => cpu::compute::matmul(req),
        #[cfg(cuda)]
        kind if kind.is_cuda() => {
            let enqueued = cuda::compute::matmul(req);
            enqueued.and(cuda::record_use([req.a, req.b, req.out]))
        }
        DeviceKind::Metal => metal::compute::matmul(req),
        _ => Err(no_compute(req.out.device())),
    }
}

/// Compiles a CUDA C kernel with NVRTC ([`crate::compute::kernel::compile`]).
pub(crate) fn compile_cuda_kernel(
    device: Device,
    source: &str,
    name: &str,
    options: &[String],
) -> Result<crate::compute::kernel::Kernel> {
    #[cfg(cuda)]
    return cuda::launch::compile(device, source, name, options);
    #[cfg(not(cuda))]
    {
        let _ = (device, source, name, options);
        Err(unavailable("CUDA"))
    }
}

/// Launches a compiled CUDA kernel ([`crate::compute::kernel::launch`]).
pub(crate) fn launch_cuda_kernel(
    kernel: &crate::compute::kernel::Kernel,
    config: crate::compute::kernel::LaunchConfig,
    args: &[crate::compute::kernel::KernelArg],
) -> Result<crate::compute::kernel::LaunchTiming> {
    #[cfg(cuda)]
    return cuda::launch::launch(kernel, config, args);
    #[cfg(not(cuda))]
    {
        let _ = (kernel, config, args);
        Err(unavailable("CUDA"))
    }
}

fn no_compute(device: Device) -> Error {
    #[cfg(not(cuda))]
    if device.kind().is_cuda() {
        return unavailable("CUDA");
    }
    Error::UnsupportedDevice(format!("dlbridge does not compute on {device}"))
}

/// The pool that serves allocations on `device` when nothing asks for a storage mode. CUDA device
/// kinds name a mode each, so `cuda:N`, `cuda_host:N` and `cuda_managed:N` will name the private,
/// shared and managed pools of device `N`; `metal:N` names the pool of the device's default mode
/// ([`metal::resolve_storage`]).
fn pool(device: Device) -> Result<&'static Arc<Pool>> {
    match device.kind() {
        DeviceKind::Cpu => Ok(cpu::pool()),
        // One pool per (device index, storage mode): `Cuda` → private, `CudaHost` → shared
        // (pinned), `CudaManaged` → managed.
        #[cfg(cuda)]
        DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged => cuda::pool(device),
        #[cfg(not(cuda))]
        DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged => {
            Err(unavailable("CUDA"))
        }
        // One pool per (device index, storage mode), as for CUDA; the device names no mode.
        DeviceKind::Metal => metal::pool(device, None),
        DeviceKind::Other(_) => Err(no_memory_of_ours(device)),
    }
}

/// The pool that serves allocations on `device` in `storage`: `None` gives the pool
/// [`memory_stats`] and friends use for `device`; a mode picks the CUDA kind as [`placement`]
/// does, or one of a Metal device's pools (the CPU has one pool, whatever the mode). Use it for
/// the figures and limits of a pool the device alone does not name, such as a Metal device's
/// private pool.
///
/// # Errors
/// As [`memory_stats`], and [`Error::InvalidArgument`] for a mode that conflicts with the device
/// or that the OS lacks (managed Metal storage outside macOS).
pub fn pool_for(device: Device, storage: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
    match (device.kind(), storage) {
        (_, None) => pool(device),
        (DeviceKind::Metal, storage) => metal::pool(device, storage),
        (DeviceKind::Cpu, storage) => {
            storage::resolve(DeviceKind::Cpu, storage)?;
            pool(device)
        }
        (_, storage) => pool(placement(device, storage)?),
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
    if device.kind() == DeviceKind::Metal {
        // The default depends on the device (unified memory or not) and on its own variable.
        return metal::resolve_storage(device, requested);
    }
    pool(device)?;
    storage::resolve(device.kind(), requested)
}

#[cfg(not(cuda))]
pub(crate) fn unavailable(backend: &'static str) -> Error {
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
