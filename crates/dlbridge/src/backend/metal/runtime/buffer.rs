//! dlbridge's own Metal allocations: a raw allocator pair, which the caching pool wraps
//! ([`super::pool`]), and the [`Buffer`]s built on it.

use std::ffi::c_void;
use std::ops::Range;
use std::ptr::NonNull;

use objc2_foundation::NSRange;
use objc2_metal::{MTLBuffer, MTLDevice, MTLResource, MTLResourceOptions};

use super::context::{Context, ResidencyGuard};
use super::objc::{MetalBuffer, borrow_buffer};
use crate::backend::metal::kernel::BLIT_ALIGN;
use crate::backend::metal::storage::{self, MANAGED_AVAILABLE};
use crate::buffer::{Allocation, Buffer, StorageMode};
use crate::device::Device;
use crate::error::{Error, Result};

/// Allocation lengths are rounded up to this many bytes (so blit fills and copies of a whole
/// buffer meet the macOS 4-byte rule, and a 0-byte request still gets a real `id<MTLBuffer>`).
pub(crate) const LENGTH_GRANULE: usize = 16;

/// One `id<MTLBuffer>` from `newBufferWithLength:options:`, with its residency registration.
/// Dropping it releases both (the residency removal waits for the GPU work that may use it).
///
/// This is the unit a caching pool recycles: [`MetalAllocator::allocate`] and
/// [`MetalAllocator::free`] are the `allocate(bytes) -> handle` / `free(handle, bytes)` pair, and
/// [`RawBuffer::handle`] is the handle (the `id<MTLBuffer>` pointer).
#[derive(Debug)]
pub struct RawBuffer {
    buffer: MetalBuffer,
    device: Device,
    storage: StorageMode,
    len: usize,
    _residency: Option<ResidencyGuard>,
}

impl std::fmt::Debug for ResidencyGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResidencyGuard")
    }
}

impl Allocation for RawBuffer {}

impl RawBuffer {
    /// The `id<MTLBuffer>` pointer (what DLPack calls `data`). Opaque: never offset it.
    pub fn handle(&self) -> *mut c_void {
        self.buffer.handle()
    }

    /// The host address of byte 0 (`contents()`), unless the storage is private.
    pub fn host_ptr(&self) -> Option<NonNull<u8>> {
        storage::is_host_visible(self.storage).then(|| self.buffer.contents().cast::<u8>())
    }

    /// Usable length in bytes (the request rounded up to 16).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes (never: every raw buffer has at least 16).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The storage mode.
    pub fn storage(&self) -> StorageMode {
        self.storage
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// A [`Buffer`] of the first `len` bytes, owning this allocation.
    pub fn into_buffer(self, len: usize) -> Result<Buffer> {
        if len > self.len {
            return Err(Error::OutOfBounds(format!(
                "a {len}-byte buffer over a {}-byte Metal allocation",
                self.len
            )));
        }
        let handle = self.handle();
        let host = self
            .host_ptr()
            .map_or(std::ptr::null_mut(), NonNull::as_ptr);
        let (device, storage) = (self.device, self.storage);
        // SAFETY: `handle` is the retained `id<MTLBuffer>` this allocation owns, `len` bytes long
        // at least; `host` is its `contents()` and set only for shared/managed storage, which the
        // host may read and write; both stay valid until the boxed allocation is dropped.
        Ok(unsafe { Buffer::from_allocation(handle, host, len, device, storage, Box::new(self)) })
    }
}

/// Allocates raw Metal buffers of one storage mode on one device.
#[derive(Clone, Copy, Debug)]
pub struct MetalAllocator {
    context: &'static Context,
    device: Device,
    storage: StorageMode,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("info", self.info())
            .finish()
    }
}

impl MetalAllocator {
    /// An allocator for `device` in `storage` (`None`: the device default; managed only where the
    /// OS has it).
    pub fn new(device: Device, storage: Option<StorageMode>) -> Result<Self> {
        let context = super::context(device)?;
        let storage = storage::resolve(storage, context.info().default_storage, MANAGED_AVAILABLE)?;
        Ok(MetalAllocator {
            context,
            device,
            storage,
        })
    }

    /// The storage mode of this allocator's buffers.
    pub fn storage(&self) -> StorageMode {
        self.storage
    }

    /// The runtime state of the allocator's device.
    pub(crate) fn context(&self) -> &'static Context {
        self.context
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// A new buffer of at least `bytes` bytes (contents unspecified), registered in the device's
    /// residency set when residency sets are on.
    pub fn allocate(&self, bytes: usize) -> Result<RawBuffer> {
        let info = self.context.info();
        let len = bytes
            .max(1)
            .checked_next_multiple_of(LENGTH_GRANULE)
            .filter(|&l| l <= info.max_buffer_length)
            .ok_or_else(|| Error::OutOfMemory {
                bytes,
                device: self.device,
                detail: format!(
                    ": more than the device's maxBufferLength ({} bytes)",
                    info.max_buffer_length
                ),
            })?;
        let options = resource_options(self.storage);
        let device = self.context.device();
        let buffer = device
            .newBufferWithLength_options(len, options)
            .ok_or_else(|| Error::OutOfMemory {
                bytes,
                device: self.device,
                detail: format!(
                    " ({} storage; the device has {} bytes allocated, recommended working set {} \
                     bytes)",
                    self.storage,
                    device.currentAllocatedSize(),
                    info.recommended_max_working_set_size
                ),
            })?;
        let buffer = MetalBuffer(buffer);
        let residency = self.context.register(&buffer);
        Ok(RawBuffer {
            buffer,
            device: self.device,
            storage: self.storage,
            len,
            _residency: residency,
        })
    }

    /// Returns a buffer (to Metal, once the GPU work that may use it has completed).
    pub fn free(&self, raw: RawBuffer) {
        drop(raw);
    }

    /// Zeroes bytes `range` of `raw`: `memset` for shared and managed storage (then
    /// `didModifyRange:` for managed), a GPU blit fill for private storage (ordered before any
    /// later work on the device's queue). A private fill needs `range` on 4-byte boundaries (or
    /// ending at the buffer's end).
    pub fn zero(&self, raw: &RawBuffer, range: Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > raw.len {
            return Err(Error::OutOfBounds(format!(
                "zeroing bytes {}..{} of a {}-byte Metal buffer",
                range.start, range.end, raw.len
            )));
        }
        if range.is_empty() {
            return Ok(());
        }
        match raw.host_ptr() {
            Some(host) => {
                let first = host.as_ptr().wrapping_add(range.start);
                // SAFETY: `range` lies inside the buffer (checked), whose `contents()` the host
                // may write for shared and managed storage; nothing else references a buffer
                // that is being zeroed by its owner.
                unsafe { std::ptr::write_bytes(first, 0, range.len()) };
                if raw.storage == StorageMode::Managed {
                    raw.buffer
                        .didModifyRange(NSRange::new(range.start, range.len()));
                }
                Ok(())
            }
            None => {
                if range.start % BLIT_ALIGN != 0
                    || (range.end % BLIT_ALIGN != 0 && range.end != raw.len)
                {
                    return Err(Error::Misaligned(format!(
                        "a GPU fill of bytes {}..{} of a private Metal buffer needs 4-byte \
                         boundaries",
                        range.start, range.end
                    )));
                }
                self.context.fill(&raw.buffer, range, 0)
            }
        }
    }
}

/// The resource options of a buffer in `storage` (default CPU cache mode and hazard tracking).
pub(crate) fn resource_options(storage: StorageMode) -> MTLResourceOptions {
    let mode = match storage {
        StorageMode::Shared => MTLResourceOptions::StorageModeShared,
        StorageMode::Managed => MTLResourceOptions::StorageModeManaged,
        StorageMode::Private => MTLResourceOptions::StorageModePrivate,
    };
    mode | MTLResourceOptions::CPUCacheModeDefaultCache
        | MTLResourceOptions::HazardTrackingModeDefault
}

/// `didModifyRange:` for a managed buffer the host wrote.
pub(crate) fn host_wrote(buffer: &Buffer, range: Range<usize>) -> Result<()> {
    super::check_metal(buffer.device(), "host_wrote")?;
    if range.start > range.end || range.end > buffer.len() {
        return Err(Error::OutOfBounds(format!(
            "bytes {}..{} of a {}-byte buffer",
            range.start,
            range.end,
            buffer.len()
        )));
    }
    match buffer.storage_mode() {
        StorageMode::Shared => Ok(()),
        StorageMode::Private => Err(Error::NotHostAccessible {
            device: buffer.device(),
            what: "the host cannot have written private storage".into(),
        }),
        StorageMode::Managed => {
            if range.is_empty() {
                return Ok(());
            }
            // SAFETY: a managed Metal `Buffer` is one dlbridge allocated or resolved through
            // `import_foreign` (only those carry the managed mode), whose handle is a live
            // `id<MTLBuffer>` kept alive by `buffer`.
            let mtl = unsafe { borrow_buffer(buffer.handle()) };
            mtl.didModifyRange(NSRange::new(range.start, range.len()));
            Ok(())
        }
    }
}

/// The `MTLStorageMode` a Metal buffer reports, as a dlbridge mode.
pub(crate) fn storage_of(
    buffer: &objc2::runtime::ProtocolObject<dyn MTLBuffer>,
) -> Result<StorageMode> {
    storage::from_raw(buffer.storageMode().0 as u64)
}

/// The registry ID of the device that owns `buffer`.
pub(crate) fn registry_id_of(buffer: &objc2::runtime::ProtocolObject<dyn MTLBuffer>) -> u64 {
    buffer.device().registryID()
}
