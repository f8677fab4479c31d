//! dlbridge's Metal allocations through the caching pool: one [`Pool`] per (device, storage
//! mode) over [`RawBuffer`]s, fenced by command-buffer serials ([`SerialFence`]).

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use super::buffer::{LENGTH_GRANULE, MetalAllocator, RawBuffer};
use super::context::Context;
use crate::backend::metal::fence::{QUEUE_STREAM, SerialFence};
use crate::backend::metal::kernel::BLIT_ALIGN;
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::error::Result;
use crate::pool::{Fence, MAX_LIMIT, Pool, RawAllocator, StreamKey};

/// The share of a device's recommended working set that each of its pools caches by default
/// (a quarter). Metal memory is seldom refused outright on unified-memory Macs (the system pages
/// instead), so an unbounded cache would only grow; [`Pool::set_cache_limit`] overrides it.
const DEFAULT_CACHE_SHARE: u64 = 4;

/// The driver of one Metal pool. A block's address is a leaked `Box<RawBuffer>` (the
/// `id<MTLBuffer>` with its residency registration), taken back by [`RawAllocator::free`]; a
/// cached block stays allocated and registered.
struct MetalBlocks {
    allocator: MetalAllocator,
    context: &'static Context,
}

impl MetalBlocks {
    /// The raw buffer behind a block address.
    ///
    /// # Safety
    /// `ptr` must be a block of this allocator that has not been freed, and the reference must
    /// not outlive it.
    unsafe fn raw<'a>(ptr: NonNull<c_void>) -> &'a RawBuffer {
        // SAFETY: forwarded: `allocate` made `ptr` from a `Box<RawBuffer>`, live until `free`.
        unsafe { ptr.cast::<RawBuffer>().as_ref() }
    }
}

impl RawAllocator for MetalBlocks {
    fn round_size(&self, bytes: usize) -> Option<usize> {
        bytes.checked_next_multiple_of(LENGTH_GRANULE)
    }

    fn allocate(&self, bytes: usize, zeroed: bool) -> Result<NonNull<c_void>> {
        let raw = self.allocator.allocate(bytes)?;
        if zeroed {
            self.allocator.zero(&raw, 0..raw.len())?;
        }
        Ok(NonNull::from(Box::leak(Box::new(raw))).cast())
    }

    unsafe fn free(&self, ptr: NonNull<c_void>, _bytes: usize) {
        // SAFETY: by the caller's contract `ptr` came from `allocate`, that is from
        // `Box::leak`, and is freed once; dropping the `RawBuffer` releases the `id<MTLBuffer>`
        // (Metal frees the memory after the command buffers that retain it) and stages its
        // residency removal after the work encoded so far.
        drop(unsafe { Box::from_raw(ptr.cast::<RawBuffer>().as_ptr()) });
    }

    unsafe fn zero(
        &self,
        ptr: NonNull<c_void>,
        bytes: usize,
        _stream: Option<StreamKey>,
    ) -> Result<()> {
        // SAFETY: by the caller's contract `ptr` is a live block of this allocator; the borrow
        // ends with this call.
        let raw = unsafe { Self::raw(ptr) };
        // A private fill needs 4-byte boundaries: round the end up (inside the buffer, whose
        // length is a multiple of 16).
        let end = bytes.next_multiple_of(BLIT_ALIGN).min(raw.len());
        // Host-visible blocks come back only once their GPU work completed (`SerialFence`), so
        // the `memset` races nothing; a private block's fill is ordered on the queue after it.
        self.allocator.zero(raw, 0..end)
    }

    fn fence(&self, _stream: StreamKey) -> Result<Option<Box<dyn Fence>>> {
        let fence = SerialFence::after(
            self.context.last_encoded(),
            self.allocator.storage(),
            self.context.progress(),
        );
        Ok(fence.map(|f| Box::new(f) as Box<dyn Fence>))
    }
}

/// The pool of `device` for `storage` (`None`: the device's default), made on first use.
pub(crate) fn pool(device: Device, storage: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
    type Slots = Vec<[OnceLock<Arc<Pool>>; 3]>;
    static POOLS: OnceLock<Slots> = OnceLock::new();
    let allocator = MetalAllocator::new(device, storage)?;
    let storage = allocator.storage();
    let slot = match storage {
        StorageMode::Private => 0,
        StorageMode::Shared => 1,
        StorageMode::Managed => 2,
    };
    let pools = POOLS.get_or_init(|| {
        (0..super::device_count())
            .map(|_| Default::default())
            .collect()
    });
    // `MetalAllocator::new` found the device, so its index is in range.
    Ok(pools[device.index() as usize][slot].get_or_init(|| {
        let context = allocator.context();
        let working_set = context.info().recommended_max_working_set_size;
        let pool = Pool::new(device, storage, MetalBlocks { allocator, context });
        if working_set > 0 {
            let limit = usize::try_from(working_set / DEFAULT_CACHE_SHARE)
                .unwrap_or(MAX_LIMIT)
                .min(MAX_LIMIT);
            // Limits up to `MAX_LIMIT` are always accepted.
            let _ = pool.set_cache_limit(Some(limit));
        }
        pool
    }))
}

/// Allocates a [`Buffer`] of `bytes` from the pool of `device` and `storage` (see
/// [`crate::backend::metal::allocate`]).
pub(crate) fn allocate(
    device: Device,
    bytes: usize,
    storage: Option<StorageMode>,
    zeroed: bool,
) -> Result<Buffer> {
    let pool = pool(device, storage)?;
    let block = pool.allocate_static(bytes, Some(QUEUE_STREAM), zeroed)?;
    // SAFETY: the block is live (we hold it); the borrow ends before the block moves below.
    let raw = unsafe { MetalBlocks::raw(block.as_ptr()) };
    let handle = raw.handle();
    let host = raw.host_ptr().map_or(std::ptr::null_mut(), NonNull::as_ptr);
    let storage = raw.storage();
    // SAFETY: `handle` is the `id<MTLBuffer>` of the block, at least `bytes` long (the block
    // size is), retained by the `RawBuffer` the block owns until it is dropped with the buffer;
    // `host` is its `contents()`, set only for shared and managed storage.
    Ok(unsafe { Buffer::from_pooled(handle, host, bytes, device, storage, block) })
}
