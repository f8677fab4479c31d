//! The Metal backend: buffers in private, shared or managed storage, DLPack `kDLMetal` import and
//! export, zero-copy wrapping of host pages, residency sets, and GPU copies.
//!
//! | concept | here | Metal |
//! | --- | --- | --- |
//! | device | [`Device::metal`]`(i)`, [`devices`] | `id<MTLDevice>`: index 0 is the system default, then the rest of `MTLCopyAllDevices()` |
//! | allocation | [`allocate`] → [`Buffer`] (handle = `id<MTLBuffer>`, host = `contents()` unless private) | `newBufferWithLength:options:` |
//! | caching pool | [`pool`]: one [`Pool`] per (device, storage mode) over `runtime::MetalAllocator` / `runtime::RawBuffer`, fenced by command-buffer serials (`fence`) | buffers kept allocated (and resident) for reuse |
//! | storage mode | [`StorageMode`], [`resolve_storage`], `DLBRIDGE_METAL_STORAGE_MODE` ([`storage`]) | `MTLStorageMode{Private,Shared,Managed}` |
//! | foreign tensor in | [`import_foreign`], decided by `import::plan_import` | share a retained `id<MTLBuffer>`, or blit it |
//! | our tensor out | [`Tensor::to_dlpack_versioned`]: `data` = `id<MTLBuffer>`, offset in `byte_offset` (after [`synchronize`]) | — |
//! | host view of shared memory | [`host_view`]: a CPU tensor over `contents()` | — |
//! | host pages, no copy | [`wrap_host`] → [`HostRegion`], arithmetic in `pages` | `newBufferWithBytesNoCopy:length:options:deallocator:` |
//! | checkpoints | [`Checkpoint::load_to`](crate::safetensors::Checkpoint::load_to): each file's read-only mapping wrapped (the backend seam's `wrap_host`), tensors as read-only views with a byte offset in shared storage, blitted into private or managed storage; files Metal declines are read, into private memory through shared staging buffers | no-copy buffers over the mapped pages, blits |
//! | copies | [`copy_to`], [`copy_from`]: blits, or the strided-copy kernel (`kernel`) | blit and compute encoders |
//! | ordering | [`synchronize`]; batching in `batch`; completion in `fence::Progress` | one `MTLCommandQueue` per device, command buffers committed in batches, completion handlers |
//! | residency | automatic for dlbridge's allocations; staging in [`residency`] | `MTLResidencySet` (macOS 15+), attached to the queue |
//!
//! # What is platform-free
//! The decisions — storage-mode resolution, import plans, residency staging, command-buffer serials,
//! when a pooled block may be reused, page rounding and splitting, the copy kernel's plan and index
//! arithmetic — live in plain Rust
//! modules that compile and are unit-tested on every host. Only `runtime` (compiled with feature
//! `metal` on Apple targets, `cfg(metal)`) talks to Metal, and executes those decisions. Elsewhere
//! the functions below keep their signatures and answer [`Error::BackendUnavailable`].
//!
//! # Synchronization
//! dlbridge batches GPU work on its own queue. Before the host reads memory the GPU may still be
//! writing, and before another framework is handed a buffer (DLPack has no stream for Metal), call
//! [`synchronize`]; copies that end on the host ([`copy_to`] a CPU device, imports that copy) do so
//! themselves. Symmetrically, a producer must have finished its own GPU work before its tensor is
//! imported (`torch.mps.synchronize()`, `mx.eval(...)`). dlbridge's own host access waits by
//! itself: [`Tensor::as_slice`] and friends call [`synchronize`] first (through
//! [`backend::host_barrier`](crate::backend::host_barrier)), and so do [`host_view`] and the copies.
//!
//! # The caching pool
//! [`allocate`] takes its memory from [`pool`]`(device, storage)`, one [`Pool`] per device and
//! storage mode ([`crate::pool`] describes rounding, limits and statistics;
//! [`crate::backend::memory_stats`] and friends reach the pool of the device's default mode,
//! [`crate::backend::pool_for`] any of them). Released buffers stay allocated, and resident, in the
//! cache. A block released while dlbridge's GPU work may still use it is fenced with the serial
//! of the last command buffer encoded so far (`fence`): a private block is reused at once (the
//! queue runs the old work first), a shared or managed one only after that serial completed (the
//! host may write it as soon as it is handed out). Requests for zero-filled memory are zeroed also
//! when the block comes from the cache (`memset`, or a GPU fill for private storage). Each pool
//! caches at most a quarter of the device's recommended working set unless told otherwise. Foreign
//! buffers ([`import_foreign`], [`wrap_host`]) never enter a pool.
//!
//! # Python
//! The `dlbridge` package wires this up (crates/python-module): `device="metal"` / `"metal:N"` and
//! `storage=` in the creation functions and `Array.to`; `Array.storage`; `from_dlpack` of a
//! `kDLMetal` tensor (PyTorch MPS, MLX) through [`import_foreign`]; `Array.__dlpack__`
//! synchronizes first and, asked for `dl_device=(kDLCPU, 0)`, hands out a [`host_view`] of shared
//! memory or else a host copy; `dlbridge.synchronize("metal")`; the `dlbridge.metal` module
//! (availability, devices, residency); `memory_stats(..., storage=)` and friends. Without the
//! backend each of these raises `RuntimeError("Metal backend not available: ...")`.

// The runtime's internals: decision logic without Metal calls, compiled (and unit-tested)
// everywhere, used by the runtime only where Metal is compiled in.
#[cfg_attr(not(metal), allow(dead_code))]
pub(crate) mod batch;
pub(crate) mod compute;
#[cfg_attr(not(metal), allow(dead_code))]
pub(crate) mod fence;
mod hooks;
#[cfg_attr(not(metal), allow(dead_code))]
pub(crate) mod import;
#[cfg_attr(not(metal), allow(dead_code))]
pub(crate) mod kernel;
#[cfg_attr(not(metal), allow(dead_code))]
pub(crate) mod pages;
pub mod residency;
pub mod storage;

#[cfg(metal)]
pub mod runtime;
#[cfg(metal)]
use runtime as imp;

#[cfg(not(metal))]
mod unavailable;
#[cfg(not(metal))]
use unavailable as imp;

use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

use crate::buffer::{Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::pool::Pool;
use crate::storage::Resolved;
use crate::tensor::Tensor;

pub(crate) use hooks::Metal;

/// What dlbridge found out about one Metal device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The dlbridge device (`metal:N`).
    pub device: Device,
    /// The vendor's name for the GPU.
    pub name: String,
    /// The IORegistry ID, stable across processes.
    pub registry_id: u64,
    /// Whether the GPU shares the host's memory (every Apple-silicon Mac).
    pub has_unified_memory: bool,
    /// The largest buffer the device allocates (`maxBufferLength`).
    pub max_buffer_length: usize,
    /// How much memory the device can use with good performance.
    pub recommended_max_working_set_size: u64,
    /// The low-power GPU of a dual-GPU Mac.
    pub low_power: bool,
    /// An external (removable) GPU.
    pub removable: bool,
    /// The OS page size, in bytes: the granularity of no-copy wrapping.
    pub page_size: usize,
    /// The storage mode of allocations that name none.
    pub default_storage: StorageMode,
    /// Whether the OS has managed storage (macOS).
    pub managed_storage: bool,
    /// Whether dlbridge registers its allocations in a residency set.
    pub residency: ResidencyStatus,
}

/// Whether residency sets are in use on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResidencyStatus {
    /// dlbridge's allocations join a residency set attached to the device's queue.
    Enabled,
    /// `DLBRIDGE_METAL_RESIDENCY=0` turned them off.
    DisabledByEnvironment,
    /// The OS has no residency sets (before macOS 15 / iOS 18).
    Unsupported,
    /// Metal refused to create the set; the text is its error.
    Failed(String),
}

/// What a consumer asks of [`import_foreign`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// `None`: copy only when needed (a private buffer); `Some(true)`: always copy;
    /// `Some(false)`: never copy (fail instead).
    pub copy: Option<bool>,
    /// The dtype wanted, when it differs from the producer's (a conversion, hence a copy).
    pub dtype: Option<DType>,
    /// Register a shared foreign buffer in dlbridge's residency set (foreign buffers are not
    /// registered by default: their owner manages their residency).
    pub residency: bool,
}

/// Host pages wrapped in Metal buffers without a copy (see [`wrap_host`]).
#[derive(Clone, Debug)]
pub struct HostRegion {
    addr: usize,
    len: usize,
    chunks: Vec<pages::Chunk>,
    buffers: Vec<Buffer>,
}

impl HostRegion {
    /// Assembles a region from planned chunks and the buffers that wrap them (one per chunk).
    #[cfg_attr(not(metal), allow(dead_code))]
    pub(crate) fn new(addr: usize, len: usize, chunks: Vec<(pages::Chunk, Buffer)>) -> Self {
        let (chunks, buffers) = chunks.into_iter().unzip();
        HostRegion {
            addr,
            len,
            chunks,
            buffers,
        }
    }

    /// Length of the region in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: empty regions are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The Metal buffers, in address order, with the region bytes each was planned for.
    pub fn chunks(&self) -> impl Iterator<Item = (&Buffer, Range<usize>)> {
        self.buffers
            .iter()
            .zip(&self.chunks)
            .map(|(b, c)| (b, c.covers.clone()))
    }

    /// A compact tensor of `shape` and `dtype` whose first element is at region byte `start`. The
    /// bytes must lie inside one wrapped buffer (always true for the items given to
    /// [`wrap_host`]) and `start` must be aligned for the dtype.
    pub fn tensor(&self, start: usize, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let layout = Layout::contiguous(shape)?;
        let nbytes = layout
            .numel()
            .checked_mul(dtype.itemsize())
            .ok_or_else(|| crate::error::overflow(format!("size of {shape:?} {dtype}")))?;
        let end = start
            .checked_add(nbytes)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                Error::OutOfBounds(format!(
                    "{nbytes} bytes at region offset {start} exceed the {}-byte region",
                    self.len
                ))
            })?;
        pages::check_alignment(self.addr + start, element_align(dtype.itemsize()))?;
        let (buffer, offset) = self.locate(start..end)?;
        Tensor::new(buffer.clone(), dtype, Layout::contiguous_at(shape, offset)?)
    }

    /// The Metal buffer holding region bytes `range`, and the byte offset of `range.start` in
    /// it; an error where no one buffer holds them all.
    pub(crate) fn locate(&self, range: Range<usize>) -> Result<(&Buffer, usize)> {
        let (start, end) = (range.start, range.end);
        let (i, offset) = pages::locate(&self.chunks, self.addr, range).ok_or_else(|| {
            Error::OutOfBounds(format!(
                "region bytes {start}..{end} straddle two Metal buffers; name them as an item \
                 when wrapping the region"
            ))
        })?;
        Ok((&self.buffers[i], offset))
    }
}

/// The alignment the GPU needs for elements of `itemsize` bytes: the largest power of two
/// dividing it, at most 16.
pub fn element_align(itemsize: usize) -> usize {
    let mut align = 16;
    while align > 1 && itemsize % align != 0 {
        align /= 2;
    }
    align
}

/// The order of discovered devices: the system default first (when there is one), then the others
/// as `MTLCopyAllDevices()` lists them. Devices are identified by registry ID; the result indexes
/// `all`.
pub fn order_devices(default: Option<u64>, all: &[u64]) -> Vec<usize> {
    let first = default.and_then(|d| all.iter().position(|&id| id == d));
    first
        .into_iter()
        .chain((0..all.len()).filter(|&i| Some(i) != first))
        .collect()
}

/// Whether the Metal backend is compiled in and found at least one device.
pub fn is_available() -> bool {
    imp::device_count() > 0
}

/// How many Metal devices there are (0 when the backend is not compiled in).
pub fn device_count() -> usize {
    imp::device_count()
}

/// Every Metal device, in dlbridge's order (index 0 is the system default).
pub fn devices() -> Result<Vec<DeviceInfo>> {
    (0..imp::device_count() as u32)
        .map(|i| device_info(Device::metal(i)))
        .collect::<Result<Vec<_>>>()
        .and_then(|v| {
            if v.is_empty() {
                Err(imp::no_device())
            } else {
                Ok(v)
            }
        })
}

/// What dlbridge knows about one device.
pub fn device_info(device: Device) -> Result<DeviceInfo> {
    imp::device_info(device)
}

/// Allocates `bytes` on a Metal device in `storage` (`None`: the device default) from the
/// device's caching [`pool`] for that mode, zero-filled when `zeroed`: by `memset` for shared and
/// managed buffers (then `didModifyRange:` for managed), by a GPU blit fill for private ones.
/// (Apple's reference page for `newBufferWithLength:options:` says it clears new buffers; dlbridge
/// zeroes explicitly anyway, since a recycled buffer holds its last user's bytes.)
pub fn allocate(
    device: Device,
    bytes: usize,
    storage: Option<StorageMode>,
    zeroed: bool,
) -> Result<Buffer> {
    imp::allocate(device, bytes, storage, zeroed)
}

/// Commits the device's pending GPU work and waits for all of it; reports GPU errors recorded since
/// the last call. Cheap when nothing is pending.
pub fn synchronize(device: Device) -> Result<()> {
    imp::synchronize(device)
}

/// The caching pool that serves allocations on `device` in `storage` (`None`: the device's
/// default mode), made on first use.
///
/// # Errors
/// [`Error::BackendUnavailable`] without the backend or a device; [`Error::UnsupportedDevice`] for
/// a device index beyond the machine's; [`Error::InvalidArgument`] for managed storage where the
/// OS has none.
pub fn pool(device: Device, storage: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
    imp::pool(device, storage)
}

/// The storage mode an allocation on `device` asking for `requested` gets, and where that came
/// from ([`storage::resolve_with_source`]: the request, `DLBRIDGE_METAL_STORAGE_MODE`,
/// `DLBRIDGE_STORAGE_MODE`, else shared on unified memory and private elsewhere).
pub fn resolve_storage(device: Device, requested: Option<StorageMode>) -> Result<Resolved> {
    imp::resolve_storage(device, requested)
}

/// A CPU view of a Metal view in shared storage: the same bytes, through the buffer's
/// `contents()`, for a host consumer (NumPy through DLPack with `dl_device=(kDLCPU, 0)`). The
/// device is synchronized first, so dlbridge's GPU work on the bytes is complete; the view keeps
/// the Metal buffer alive and is as read-only as `t`.
///
/// # Errors
/// [`Error::NotHostAccessible`] for private storage (and for foreign Metal memory not resolved by
/// [`import_foreign`]); [`Error::CopyRequired`] for managed storage, whose host writes Metal must
/// be told of (`didModifyRange:`), which a host consumer does not do: copy those instead
/// ([`copy_to`] the CPU); [`Error::InvalidArgument`] when `t` is not on a Metal device.
pub fn host_view(t: &Tensor) -> Result<Tensor> {
    let device = t.device();
    if device.kind() != DeviceKind::Metal {
        return Err(Error::InvalidArgument(format!(
            "a host view of Metal memory, but the array is on {device}"
        )));
    }
    let buffer = t.buffer();
    match (buffer.storage_mode(), buffer.host_ptr()) {
        (StorageMode::Shared, Some(_)) => {}
        (StorageMode::Managed, Some(_)) => {
            return Err(Error::CopyRequired(format!(
                "the {device} buffer has managed storage, whose host writes Metal must be told of \
                 (didModifyRange:); it reaches the host as a copy"
            )));
        }
        (mode, _) => {
            return Err(Error::NotHostAccessible {
                device,
                what: format!("a host view of {mode} storage (copy it to the CPU instead)"),
            });
        }
    }
    synchronize(device)?;
    host_alias(t)
}

/// The same bytes as `t` (a Metal view of host-visible memory), as a CPU view over the buffer's
/// `contents()`, so that host code copies them with the CPU's strided copy. No synchronization
/// and no storage-mode rules: the caller waits for the GPU, and announces host writes into
/// managed memory ([`host_wrote`]).
pub(crate) fn host_alias(t: &Tensor) -> Result<Tensor> {
    let buffer = t.buffer();
    let host = buffer.require_host("a host view of Metal memory")?;
    // SAFETY: `host` is the `contents()` of the Metal buffer (a Metal `Buffer` has a host address
    // only for shared and managed storage): `buffer.len()` bytes the host may read (and write,
    // unless the buffer is read-only), valid while the Metal buffer lives, which the clone of
    // `buffer` given as the owner ensures.
    let cpu = unsafe {
        Buffer::from_foreign(
            host.as_ptr().cast(),
            host.as_ptr(),
            buffer.len(),
            Device::CPU,
            StorageMode::Shared,
            buffer.is_read_only(),
            Box::new(buffer.clone()),
        )
    };
    let view = Tensor::with_packing(cpu, t.dtype(), t.layout().clone(), t.is_packed())?;
    Ok(if t.is_read_only() {
        view.into_read_only()
    } else {
        view
    })
}

/// Resolves a foreign `kDLMetal` tensor, as [`Tensor::from_dlpack_versioned`] imported it
/// (an opaque handle), against the real `id<MTLBuffer>`: checks that the handle is a Metal buffer
/// of a known device and that the view fits in its length, then shares it, copies it on the GPU or
/// refuses, as `import::plan_import` decides for its storage mode and `options`.
///
/// A shared result has the producer's storage mode and host address (`contents()`), and keeps both
/// the `id<MTLBuffer>` (retained) and the producer alive. A copied result is new shared memory,
/// complete when this returns.
pub fn import_foreign(tensor: Tensor, options: ImportOptions) -> Result<Tensor> {
    imp::import_foreign(tensor, options)
}

/// A compact copy of `src` on `device` (CPU or Metal), in `storage` for Metal (`None`: the
/// default). Metal-to-Metal copies run on the GPU (a blit, or the strided-copy kernel); copies that
/// end on the host are complete when this returns; copies into a private buffer are ordered on the
/// device's queue (call [`synchronize`] before another framework reads them).
pub fn copy_to(src: &Tensor, device: Device, storage: Option<StorageMode>) -> Result<Tensor> {
    let dst = Tensor::allocate(src.shape(), src.dtype(), device, storage, false)?;
    // SAFETY: `dst` is new memory that no other view references.
    unsafe { copy_unchecked(src, &dst)? };
    Ok(dst)
}

/// Copies `src` into `dst` (shapes equal, or `src` broadcastable), where at least one of them is
/// on a Metal device. Needs the only reference to `dst`'s buffer, as
/// [`Tensor::copy_from`] does.
pub fn copy_from(dst: &mut Tensor, src: &Tensor) -> Result<()> {
    let count = dst.buffer().ref_count();
    if count != 1 {
        return Err(Error::Aliased { count });
    }
    // SAFETY: `dst` holds the only handle to its buffer and is borrowed mutably.
    unsafe { copy_unchecked(src, dst) }
}

/// As [`copy_from`], for a destination other views may share.
///
/// # Safety
/// No host reference into the bytes `dst` addresses may be alive during the call, and no other
/// thread may access them.
pub unsafe fn copy_unchecked(src: &Tensor, dst: &Tensor) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe { imp::copy_unchecked(src, dst) }
}

/// Tells Metal that the host wrote bytes `range` of a managed buffer (`didModifyRange:`); a no-op
/// for shared buffers, an error for private ones (the host cannot write them). Call it after
/// writing a managed buffer through its host address, before the GPU reads it.
pub fn host_wrote(buffer: &Buffer, range: Range<usize>) -> Result<()> {
    imp::host_wrote(buffer, range)
}

/// Wraps the host memory `[addr, addr + len)` in Metal buffers without copying. The region is
/// widened to whole pages and split where it exceeds `maxBufferLength`, keeping each of `items`
/// (byte ranges relative to `addr`, e.g. the tensors of an `mmap`'d checkpoint) inside one buffer;
/// see `pages`. `keep_alive` (the mapping's owner) is released once Metal has released every
/// buffer, i.e. after the GPU work that used them completed. Read-only memory (a `PROT_READ`
/// mapping) must be wrapped `read_only`.
///
/// # Safety
/// Every page touched by the region must be mapped and stay mapped, readable (and writable unless
/// `read_only`), while `keep_alive` lives; nothing may unmap or remap it meanwhile.
pub unsafe fn wrap_host(
    device: Device,
    addr: *const u8,
    len: usize,
    items: &[Range<usize>],
    read_only: bool,
    keep_alive: Arc<dyn Any + Send + Sync>,
) -> Result<HostRegion> {
    // SAFETY: forwarded contract.
    unsafe { imp::wrap_host(device, addr, len, items, read_only, keep_alive) }
}

/// Byte ranges `items` of `host`, a CPU buffer, in Metal buffers that wrap its pages without a
/// copy ([`wrap_host`]): item by item, the Metal buffer holding it and the byte offset of its
/// start there. The Metal buffers are read-only where `host` is, and keep a clone of it alive
/// until Metal releases them. The checkpoint loader's path onto Metal
/// ([`Checkpoint::load_to`](crate::safetensors::Checkpoint::load_to)).
///
/// # Errors
/// [`Error::InvalidArgument`] when `host` is not CPU memory; as [`wrap_host`] otherwise.
pub(crate) fn wrap_buffer(
    device: Device,
    host: &Buffer,
    items: &[Range<usize>],
) -> Result<Vec<(Buffer, usize)>> {
    if !host.device().is_cpu() {
        return Err(Error::InvalidArgument(format!(
            "wrapping host memory in Metal buffers, but the memory is on {}",
            host.device()
        )));
    }
    let base = host.require_host("wrapping host memory in Metal buffers")?;
    let keep_alive: Arc<dyn Any + Send + Sync> = Arc::new(host.clone());
    // SAFETY: the `host.len()` bytes at `base` are CPU memory that stays mapped and readable
    // (writable unless the buffer is read-only, which is then passed on) while a clone of `host`
    // lives, and `keep_alive` is one. The OS maps and protects memory by whole pages of the size
    // `wrap_host` rounds to, so every page those bytes touch is mapped as they are.
    let region = unsafe {
        wrap_host(
            device,
            base.as_ptr(),
            host.len(),
            items,
            host.is_read_only(),
            keep_alive,
        )
    }?;
    items
        .iter()
        .map(|item| {
            let (buffer, offset) = region.locate(item.clone())?;
            Ok((buffer.clone(), offset))
        })
        .collect()
}

/// How many allocations the device's committed residency set holds (`allocationCount`), or `None`
/// when residency sets are not in use. Flushes staged changes first.
pub fn residency_allocation_count(device: Device) -> Result<Option<usize>> {
    imp::residency_allocation_count(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_device_comes_first() {
        assert_eq!(order_devices(Some(30), &[10, 20, 30]), vec![2, 0, 1]);
        assert_eq!(order_devices(Some(10), &[10, 20]), vec![0, 1]);
        assert_eq!(order_devices(None, &[10, 20]), vec![0, 1]);
        // A default that MTLCopyAllDevices does not list changes nothing.
        assert_eq!(order_devices(Some(99), &[10, 20]), vec![0, 1]);
        assert!(order_devices(None, &[]).is_empty());
    }

    #[test]
    fn element_alignment() {
        for (itemsize, align) in [
            (1, 1),
            (2, 2),
            (4, 4),
            (8, 8),
            (16, 16),
            (12, 4),
            (32, 16),
            (6, 2),
        ] {
            assert_eq!(element_align(itemsize), align, "{itemsize}");
        }
    }

    /// A Metal tensor as an importer holds it before [`import_foreign`] resolves it: an opaque
    /// handle, no host address.
    fn opaque_metal(storage: StorageMode) -> Tensor {
        // SAFETY: the handle is never dereferenced: no host address is given, and nothing here
        // reaches a Metal runtime.
        let buffer = unsafe {
            Buffer::from_foreign(
                std::ptr::without_provenance_mut(0x1000),
                std::ptr::null_mut(),
                64,
                Device::metal(0),
                storage,
                false,
                Box::new(()),
            )
        };
        Tensor::new(buffer, DType::F32, Layout::contiguous(&[4]).unwrap()).unwrap()
    }

    #[test]
    fn host_views_need_shared_host_visible_memory() {
        let cpu = Tensor::zeros(&[2], DType::F32, Device::CPU).unwrap();
        assert!(matches!(host_view(&cpu), Err(Error::InvalidArgument(_))));
        for storage in [StorageMode::Private, StorageMode::Shared] {
            let err = host_view(&opaque_metal(storage)).unwrap_err();
            assert!(matches!(err, Error::NotHostAccessible { .. }), "{err}");
        }
        let err = host_view(&opaque_metal(StorageMode::Managed)).unwrap_err();
        assert!(matches!(err, Error::NotHostAccessible { .. }), "{err}");
    }

    #[cfg(not(metal))]
    #[test]
    fn compiled_out_backend_answers_unavailable() {
        assert!(!is_available());
        assert_eq!(device_count(), 0);
        for result in [
            allocate(Device::metal(0), 16, None, true).map(|_| ()),
            synchronize(Device::metal(0)),
            devices().map(|_| ()),
            device_info(Device::metal(0)).map(|_| ()),
            residency_allocation_count(Device::metal(0)).map(|_| ()),
        ] {
            let err = result.unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::BackendUnavailable {
                        backend: "Metal",
                        ..
                    }
                ),
                "{err}"
            );
        }
        for result in [
            pool(Device::metal(0), None).map(|_| ()),
            resolve_storage(Device::metal(0), Some(StorageMode::Private)).map(|_| ()),
        ] {
            assert!(matches!(result, Err(Error::BackendUnavailable { .. })));
        }
        // The seam in `backend` answers the same.
        let err = crate::backend::allocate(Device::metal(0), 16, None, false).unwrap_err();
        assert!(matches!(err, Error::BackendUnavailable { .. }), "{err}");
        let t = Tensor::zeros(&[2], DType::F32, Device::CPU).unwrap();
        assert!(matches!(
            copy_to(&t, Device::metal(0), None),
            Err(Error::BackendUnavailable { .. })
        ));
    }
}
