//! The Metal backend: buffers in private, shared or managed storage, DLPack `kDLMetal` import and
//! export, zero-copy wrapping of host pages, residency sets, and GPU copies.
//!
//! | concept | here | Metal |
//! | --- | --- | --- |
//! | device | [`Device::metal`]`(i)`, [`devices`] | `id<MTLDevice>`: index 0 is the system default, then the rest of `MTLCopyAllDevices()` |
//! | allocation | [`allocate`] → [`Buffer`] (handle = `id<MTLBuffer>`, host = `contents()` unless private) | `newBufferWithLength:options:` |
//! | raw allocation (for a caching pool) | `runtime::MetalAllocator` / `runtime::RawBuffer` | the same, without a [`Buffer`] around it |
//! | storage mode | [`StorageMode`], `DLBRIDGE_METAL_STORAGE_MODE` ([`storage`]) | `MTLStorageMode{Private,Shared,Managed}` |
//! | foreign tensor in | [`import_foreign`], decided by [`import::plan_import`] | share a retained `id<MTLBuffer>`, or blit it |
//! | our tensor out | [`Tensor::to_dlpack_versioned`]: `data` = `id<MTLBuffer>`, offset in `byte_offset` | — |
//! | host pages, no copy | [`wrap_host`] → [`HostRegion`], arithmetic in [`pages`] | `newBufferWithBytesNoCopy:length:options:deallocator:` |
//! | copies | [`copy_to`], [`copy_from`]: blits, or the strided-copy kernel ([`kernel`]) | blit and compute encoders |
//! | ordering | [`synchronize`]; batching in [`batch`] | one `MTLCommandQueue` per device, command buffers committed in batches |
//! | residency | automatic for dlbridge's allocations; staging in [`residency`] | `MTLResidencySet` (macOS 15+), attached to the queue |
//!
//! # What is platform-free
//! The decisions — storage-mode resolution, import plans, residency staging, command-buffer serials,
//! page rounding and splitting, the copy kernel's plan and index arithmetic — live in plain Rust
//! modules that compile and are unit-tested on every host. Only `runtime` (compiled with feature
//! `metal` on Apple targets, `cfg(metal)`) talks to Metal, and executes those decisions. Elsewhere
//! the functions below keep their signatures and answer [`Error::BackendUnavailable`].
//!
//! # Synchronization
//! dlbridge batches GPU work on its own queue. Before the host reads memory the GPU may still be
//! writing, and before another framework is handed a buffer (DLPack has no stream for Metal), call
//! [`synchronize`]; copies that end on the host ([`copy_to`] a CPU device, imports that copy) do so
//! themselves. Symmetrically, a producer must have finished its own GPU work before its tensor is
//! imported (`torch.mps.synchronize()`, `mx.eval(...)`).

pub mod batch;
pub(crate) mod compute;
pub mod import;
pub mod kernel;
pub mod pages;
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
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

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
        let (i, offset) = pages::locate(&self.chunks, self.addr, start..end).ok_or_else(|| {
            Error::OutOfBounds(format!(
                "region bytes {start}..{end} straddle two Metal buffers; name them as an item \
                 when wrapping the region"
            ))
        })?;
        let buffer = self.buffers[i].clone();
        Tensor::new(buffer, dtype, Layout::contiguous_at(shape, offset)?)
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

/// Allocates `bytes` on a Metal device in `storage` (`None`: the device default), zero-filled when
/// `zeroed`: by `memset` for shared and managed buffers (then `didModifyRange:` for managed), by a
/// GPU blit fill for private ones. (Apple's reference page for `newBufferWithLength:options:` says
/// it clears new buffers; dlbridge zeroes explicitly anyway, so that zeroing does not depend on
/// which allocator — Metal's, or a caching pool's recycled buffers — answered.)
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

/// Resolves a foreign `kDLMetal` tensor, as [`Tensor::from_dlpack_versioned`] imported it
/// (an opaque handle), against the real `id<MTLBuffer>`: checks that the handle is a Metal buffer
/// of a known device and that the view fits in its length, then shares it, copies it on the GPU or
/// refuses, as [`import::plan_import`] decides for its storage mode and `options`.
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
/// see [`pages`]. `keep_alive` (the mapping's owner) is released once Metal has released every
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
