//! A caching allocator: one [`Pool`] per (device, storage mode), over a [`RawAllocator`] that a
//! backend implements (the "driver": `std::alloc` on the CPU, `cuMemAlloc` and friends on CUDA).
//!
//! | step | what the pool does |
//! | --- | --- |
//! | request of `n` bytes | rounds `n` up to a block size ([`round_size`], then the backend's own rounding) |
//! | allocate | takes a cached block of exactly that size if one is free and safe to use on the request's stream (a *hit*); else asks the driver (a *miss*) |
//! | driver failure | releases every cached block of the pool to the driver and tries once more; then [`Error::OutOfMemory`] with the pool's figures |
//! | drop of the [`PooledBlock`] | the block goes back to the cache, fenced if work queued on its stream may still use it |
//! | cache over its limit | the least recently released blocks go back to the driver |
//!
//! # Size rounding and reuse
//! A request of `n` bytes gets a block of [`round_size`]`(n)` bytes:
//! - up to 8 KiB: the next multiple of [`GRANULE`] (512 B);
//! - above: eight size classes per power of two. For `n` in `(2^k, 2^(k+1)]` the block is the
//!   next multiple of `2^k / 8`.
//!
//! The padding is under 512 B, and under `n / 8` for every `n` above 4 KiB (so at most 1/8 of the
//! request, as promised for requests above 1 MiB). The backend may round further
//! ([`RawAllocator::round_size`]; the CPU pads blocks of 64 KiB and more to whole pages, which
//! changes nothing above 1 MiB, where classes are multiples of 128 KiB).
//!
//! A cached block is reused only for a request that rounds to **the same block size**: blocks are
//! never split or merged, so a freed block serves any later request of its size class and nothing
//! else. Among blocks of that size, the most recently released one that is ready is taken.
//!
//! # Streams and fences
//! Requests carry an optional stream key (a CUDA stream handle, say). A block is released with a
//! [`Fence`] when the backend reports that work queued on the block's stream may still use it
//! ([`RawAllocator::fence`]). A fenced block is handed to a request
//! - on the fence's own stream at once (stream order keeps the old work first);
//! - on another stream when the fence is complete, or else after [`Fence::order_before`] made that
//!   stream wait for the fenced work (the blocks of the size are scanned for a ready one first,
//!   and the oldest fenced one is taken when none is ready);
//! - with no stream only when the fence is complete (there is no stream to make wait).
//!
//! A fence may say that no stream orders its block ([`Fence::stream_ordered`] is `false`): memory
//! the host touches as soon as it is handed out (Metal's shared and managed buffers) is reused
//! only once its fence is complete, on any stream; a request that finds no such block gets a new
//! one from the driver.
//!
//! Before a block whose fence is not complete goes back to the driver, [`Fence::synchronize`]
//! waits for the fenced work. Fence methods run with the pool's lock held: they must be quick and
//! must not call into the pool.
//!
//! # Limits and statistics
//! A memory limit bounds the bytes of active blocks (handed out and not yet released); an
//! allocation that would pass it fails with [`Error::OutOfMemory`] without calling the driver. A
//! cache limit bounds the bytes of cached blocks; blocks beyond it go back to the driver, least
//! recently released first. Statistics ([`MemoryStats`]) are kept under the pool's one lock, so
//! they are exact however many threads allocate: every figure is a count of completed
//! operations.
//!
//! Memory of foreign producers never enters a pool: [`Buffer::from_foreign`](crate::Buffer::from_foreign)
//! keeps it apart, and only a [`PooledBlock`] returns memory here.

use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use crate::buffer::{Allocation, StorageMode};
use crate::device::Device;
use crate::error::{Error, ErrorKind, Result};

/// The smallest block, and the step of block sizes up to 8 KiB.
pub const GRANULE: usize = 512;

/// Sizes up to this many bytes round to a multiple of [`GRANULE`]; above, to one of eight classes
/// per power of two (the two rules meet here: `(4 KiB, 8 KiB]` has classes 512 B apart).
const GRANULE_LIMIT: usize = 8 * 1024;

/// The largest limit the pools accept, in bytes (larger values cannot describe an allocation).
pub const MAX_LIMIT: usize = isize::MAX as usize;

/// An identifier of a stream (queue) of device work; `None` where a request has none. The CUDA
/// backend uses the `CUstream` handle's address.
pub type StreamKey = u64;

/// The block size a request of `bytes` rounds to, before the backend's own rounding; `None` when
/// it would overflow. See the module documentation for the rule and its waste bound.
///
/// ```
/// use dlbridge::pool::round_size;
/// assert_eq!(round_size(1), Some(512));
/// assert_eq!(round_size(4096), Some(4096));
/// assert_eq!(round_size(5000), Some(5120));
/// assert_eq!(round_size((1 << 20) + 1), Some((1 << 20) + (1 << 17)));
/// ```
pub const fn round_size(bytes: usize) -> Option<usize> {
    if bytes <= GRANULE_LIMIT {
        if bytes == 0 {
            return Some(GRANULE);
        }
        return bytes.checked_next_multiple_of(GRANULE);
    }
    // `bytes - 1` lies in [2^k, 2^(k+1)) with k >= 13, so the step is 2^(k-3) >= 1 KiB.
    let k = usize::BITS - 1 - (bytes - 1).leading_zeros();
    bytes.checked_next_multiple_of(1 << (k - 3))
}

/// Work queued on a stream that may still use a released block, as the backend reports it (a
/// CUDA event recorded on the stream, say).
pub trait Fence: Send + Sync {
    /// The stream the work is queued on.
    fn stream(&self) -> StreamKey;
    /// Whether the work has finished (`cuEventQuery` reports success).
    fn is_complete(&self) -> bool;
    /// Makes work queued on `stream` from now on wait for the fenced work, without blocking the
    /// host (`cuStreamWaitEvent`).
    ///
    /// # Errors
    /// The driver's error; the block then stays in the cache and the allocation fails with it.
    fn order_before(&self, stream: StreamKey) -> Result<()>;
    /// Blocks the host until the fenced work has finished (`cuEventSynchronize`).
    ///
    /// # Errors
    /// The driver's error; the pool records it ([`Pool::take_error`]) and frees the block anyway.
    fn synchronize(&self) -> Result<()>;
    /// Whether stream order protects the block: a request on the fence's own stream may take it
    /// at once, and one on another stream after [`order_before`](Fence::order_before). `false`
    /// where the host may touch the memory as soon as it is handed out, before any stream runs
    /// (Metal's shared and managed buffers): the block is then reused only once the fence is
    /// complete. The default is `true`.
    fn stream_ordered(&self) -> bool {
        true
    }
}

/// What a backend supplies to a [`Pool`]: uncached allocation and release of device memory.
///
/// The pool calls these without holding its lock, except [`fence`](RawAllocator::fence)'s fence
/// methods (see [`Fence`]).
pub trait RawAllocator: Send + Sync + 'static {
    /// The size the driver will really hold for a block of `bytes` (for example padded to whole
    /// pages); at least `bytes`, `None` on overflow. Blocks are cached and counted at this size.
    fn round_size(&self, bytes: usize) -> Option<usize> {
        Some(bytes)
    }

    /// Allocates `bytes` (a size [`round_size`](RawAllocator::round_size) returned), zero-filled
    /// when `zeroed`.
    ///
    /// # Errors
    /// Exhaustion must be [`Error::OutOfMemory`] (the pool then releases its cache and retries
    /// once); any other error is passed on as it is.
    fn allocate(&self, bytes: usize, zeroed: bool) -> Result<NonNull<c_void>>;

    /// Returns a block to the driver.
    ///
    /// The pool calls this once a block's fence is complete or synchronized. When the pool could
    /// not make a fence ([`fence`](RawAllocator::fence) failed) or wait for one
    /// ([`Fence::synchronize`] failed), it records the error and frees the block all the same: a
    /// backend whose free does not itself wait for queued work must not fail those calls.
    ///
    /// # Safety
    /// `ptr` must have come from [`allocate`](RawAllocator::allocate) of this allocator with the
    /// same `bytes`, must not have been freed since, and must not be used after this call.
    unsafe fn free(&self, ptr: NonNull<c_void>, bytes: usize);

    /// Zero-fills `bytes` bytes at `ptr`, ordered on `stream` when there is one.
    ///
    /// # Safety
    /// `ptr` must address at least `bytes` bytes of a live block of this allocator that nothing
    /// else reads or writes until the fill is done (in stream order on `stream`).
    ///
    /// # Errors
    /// The driver's error.
    unsafe fn zero(
        &self,
        ptr: NonNull<c_void>,
        bytes: usize,
        stream: Option<StreamKey>,
    ) -> Result<()>;

    /// A fence for a block released by a user of `stream`: `None` when no queued work can still
    /// use it. The default (for synchronous memory such as the host's) is `None`.
    ///
    /// # Errors
    /// The driver's error; the pool records it and frees the block instead of caching it.
    fn fence(&self, stream: StreamKey) -> Result<Option<Box<dyn Fence>>> {
        let _ = stream;
        Ok(None)
    }
}

/// Figures of one pool. Byte counts are block sizes (after rounding), except
/// [`requested_bytes`](MemoryStats::requested_bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Bytes in blocks handed out and not yet released.
    pub active_bytes: usize,
    /// Blocks handed out and not yet released.
    pub active_blocks: usize,
    /// Bytes the active blocks' users asked for (`active_bytes` minus rounding).
    pub requested_bytes: usize,
    /// Bytes in released blocks kept for reuse.
    pub cached_bytes: usize,
    /// Released blocks kept for reuse.
    pub cached_blocks: usize,
    /// The largest `active_bytes` since the pool was made or [`Pool::reset_peak`].
    pub peak_active_bytes: usize,
    /// Successful allocations (`cache_hits + cache_misses`).
    pub allocations: u64,
    /// Allocations served from the cache.
    pub cache_hits: u64,
    /// Allocations that needed the driver.
    pub cache_misses: u64,
    /// Successful driver allocations.
    pub driver_allocations: u64,
    /// Blocks returned to the driver.
    pub driver_frees: u64,
    /// The memory limit: the most `active_bytes` may reach (`None`: no limit).
    pub memory_limit: Option<usize>,
    /// The cache limit: the most `cached_bytes` may reach (`None`: no limit).
    pub cache_limit: Option<usize>,
}

/// A released block kept for reuse.
struct CachedBlock {
    ptr: NonNull<c_void>,
    /// When it was released (the pool's release counter), for least-recently-used eviction.
    seq: u64,
    fence: Option<Box<dyn Fence>>,
}

// SAFETY: the pool never dereferences `ptr`; it is an address it hands out or gives back to the
// allocator, which must accept it from any thread (`RawAllocator: Send + Sync`). The fence is
// `Send` by its bound.
unsafe impl Send for CachedBlock {}

/// Hashes a block size with one multiplication (SipHash, the default, is a tenth of a cached
/// allocation's cost). Sizes are the pool's own, not attacker-chosen keys.
#[derive(Default)]
struct SizeHasher(u64);

impl Hasher for SizeHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        // Block sizes are multiples of 512, so the product's low bits are zero; the high half
        // depends on every bit of the size and becomes the low half (the table index).
        self.0.rotate_left(32)
    }
}

/// Everything the pool's lock guards.
#[derive(Default)]
struct State {
    /// Cached blocks by block size, each list in release order (oldest first).
    free: HashMap<usize, Vec<CachedBlock>, BuildHasherDefault<SizeHasher>>,
    /// The release number the next cached block gets.
    next_seq: u64,
    /// Bytes of driver allocations in flight (counted against the memory limit).
    reserved_bytes: usize,
    stats: MemoryStats,
    /// The first error from a release path (which cannot return one), until taken.
    error: Option<Error>,
}

impl State {
    /// Whether `size` more active bytes stay within the memory limit.
    fn within_limit(&self, size: usize) -> bool {
        let Some(limit) = self.stats.memory_limit else {
            return true;
        };
        self.stats
            .active_bytes
            .checked_add(self.reserved_bytes)
            .and_then(|b| b.checked_add(size))
            .is_some_and(|total| total <= limit)
    }

    /// Takes a cached block of `size` that is safe to use on `stream` (see the module
    /// documentation), or `None`.
    #[inline]
    fn take_cached(
        &mut self,
        size: usize,
        stream: Option<StreamKey>,
    ) -> Result<Option<CachedBlock>> {
        let Some(list) = self.free.get_mut(&size) else {
            return Ok(None);
        };
        // The common case, and the whole of it on the CPU: the newest block has no fence.
        let index = match list.last() {
            Some(block) if block.fence.is_none() => list.len() - 1,
            _ => match ready_block(list, stream)? {
                Some(index) => index,
                None => return Ok(None),
            },
        };
        Ok(Some(detach(&mut self.stats, list, index, size)))
    }

    fn remove_cached(&mut self, size: usize, index: usize) -> Option<CachedBlock> {
        let list = self.free.get_mut(&size)?;
        (index < list.len()).then(|| detach(&mut self.stats, list, index, size))
    }

    fn insert_cached(&mut self, size: usize, ptr: NonNull<c_void>, fence: Option<Box<dyn Fence>>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.free
            .entry(size)
            .or_default()
            .push(CachedBlock { ptr, seq, fence });
        self.stats.cached_bytes += size;
        self.stats.cached_blocks += 1;
    }

    /// Takes the least recently released blocks out until the cache holds at most `limit` bytes;
    /// the caller frees them. Each list is in release order, so the oldest block is the first of
    /// some list: finding it scans one entry per block size (eviction is rare next to reuse,
    /// which this layout keeps cheap).
    fn evict_to(&mut self, limit: usize) -> Vec<(usize, CachedBlock)> {
        let mut out = Vec::new();
        while self.stats.cached_bytes > limit {
            let oldest = self
                .free
                .iter()
                .filter_map(|(&size, list)| list.first().map(|b| (b.seq, size)))
                .min();
            let Some((_, size)) = oldest else {
                break;
            };
            let Some(block) = self.remove_cached(size, 0) else {
                break;
            };
            self.stats.driver_frees += 1;
            out.push((size, block));
        }
        out
    }

    /// Counts a handed-out block.
    #[inline]
    fn commit(&mut self, size: usize, requested: usize, hit: bool) {
        let s = &mut self.stats;
        s.active_bytes += size;
        s.active_blocks += 1;
        s.requested_bytes += requested;
        s.peak_active_bytes = s.peak_active_bytes.max(s.active_bytes);
        s.allocations += 1;
        if hit {
            s.cache_hits += 1;
        } else {
            s.cache_misses += 1;
        }
    }

    fn record(&mut self, err: Error) {
        if self.error.is_none() {
            self.error = Some(err);
        }
    }
}

/// The index of a block of `list` (cached blocks of one size, oldest first) that is safe to use
/// on `stream`: the newest one whose fence lets it be, else the oldest one that stream order
/// protects once `stream` waits for its work (which this makes it do); `None` if there is none.
fn ready_block(list: &[CachedBlock], stream: Option<StreamKey>) -> Result<Option<usize>> {
    let ready = list.iter().rposition(|block| match &block.fence {
        None => true,
        Some(fence) => {
            (stream == Some(fence.stream()) && fence.stream_ordered()) || fence.is_complete()
        }
    });
    let (None, Some(stream)) = (ready, stream) else {
        return Ok(ready);
    };
    let orderable = list
        .iter()
        .position(|b| b.fence.as_ref().is_none_or(|f| f.stream_ordered()));
    if let Some(fence) = orderable.and_then(|index| list[index].fence.as_ref()) {
        fence.order_before(stream)?;
    }
    Ok(orderable)
}

/// Takes block `index` of the cached blocks of `size` out of the cache, and out of its figures.
#[inline]
fn detach(
    stats: &mut MemoryStats,
    list: &mut Vec<CachedBlock>,
    index: usize,
    size: usize,
) -> CachedBlock {
    stats.cached_bytes -= size;
    stats.cached_blocks -= 1;
    list.remove(index)
}

/// Asked of every block released to a pool that has one ([`Pool::set_release_check`]), before
/// the block is cached: whether it may be reused (`false` keeps it out of the pool for good).
/// Called with the block's address and size, no lock of the pool held.
pub(crate) type ReleaseCheck = fn(NonNull<c_void>, usize) -> bool;

/// A caching allocator for one device and storage mode; see the module documentation.
pub struct Pool {
    device: Device,
    storage: StorageMode,
    allocator: Box<dyn RawAllocator>,
    state: Mutex<State>,
    release_check: OnceLock<ReleaseCheck>,
}

impl Pool {
    /// A pool with an empty cache and no limits, over `allocator`.
    pub fn new(device: Device, storage: StorageMode, allocator: impl RawAllocator) -> Arc<Self> {
        Arc::new(Pool {
            device,
            storage,
            allocator: Box::new(allocator),
            state: Mutex::new(State::default()),
            release_check: OnceLock::new(),
        })
    }

    /// Installs `check`, asked of every block released from now on (the first check installed
    /// stays): shareable memory uses it to give a block moved into a shared file its private
    /// pages back before the block can serve another allocation (`share::cpu`, on Linux).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn set_release_check(&self, check: ReleaseCheck) {
        let _ = self.release_check.set(check);
    }

    /// The device the pool allocates on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The storage mode of the pool's blocks.
    pub fn storage_mode(&self) -> StorageMode {
        self.storage
    }

    /// The block size a request of `bytes` gets: [`round_size`], then the backend's rounding.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the size cannot be described.
    #[inline]
    pub fn block_size(&self, bytes: usize) -> Result<usize> {
        round_size(bytes)
            .and_then(|size| self.allocator.round_size(size))
            .filter(|&size| size >= bytes && size <= MAX_LIMIT)
            .ok_or_else(|| Error::OutOfMemory {
                bytes,
                device: self.device,
                detail: ": the size exceeds what the allocator can describe".into(),
            })
    }

    /// A block of at least `bytes` for use on `stream` (`None`: no stream), zero-filled when
    /// `zeroed` (also when it comes from the cache). Dropping the block returns it to the pool.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the memory limit would be passed, or when the driver refuses
    /// even after the cache was released (the message gives the pool's figures); a fence's or
    /// the driver's error otherwise.
    pub fn allocate(
        self: &Arc<Self>,
        bytes: usize,
        stream: Option<StreamKey>,
        zeroed: bool,
    ) -> Result<PooledBlock> {
        self.take(bytes, stream, zeroed, || Home::Counted(Arc::clone(self)))
    }

    /// [`Pool::allocate`] from a pool that lives as long as the process (a backend's pool): the
    /// block refers to it without counting a reference, which saves two atomic operations per
    /// allocate + free.
    ///
    /// # Errors
    /// As [`Pool::allocate`].
    #[inline]
    pub fn allocate_static(
        &'static self,
        bytes: usize,
        stream: Option<StreamKey>,
        zeroed: bool,
    ) -> Result<PooledBlock> {
        self.take(bytes, stream, zeroed, || Home::Static(self))
    }

    /// The body of both allocation methods; `home` says how the block refers to the pool.
    #[inline]
    fn take(
        &self,
        bytes: usize,
        stream: Option<StreamKey>,
        zeroed: bool,
        home: impl FnOnce() -> Home,
    ) -> Result<PooledBlock> {
        let size = self.block_size(bytes)?;
        let cached = {
            let mut state = self.lock();
            if !state.within_limit(size) {
                return Err(self.out_of_memory(
                    &state,
                    bytes,
                    size,
                    "it would pass the memory limit",
                ));
            }
            let cached = state.take_cached(size, stream)?;
            match &cached {
                Some(_) => state.commit(size, bytes, true),
                None => state.reserved_bytes += size,
            }
            cached
        };
        if let Some(CachedBlock { ptr, fence, .. }) = cached {
            // The fence (an event, say) is released outside the lock.
            drop(fence);
            if zeroed {
                // SAFETY: the block is live and `bytes <= size`; it is handed to nobody until this
                // returns, and the fill is ordered on the stream it is handed out for.
                if let Err(err) = unsafe { self.allocator.zero(ptr, bytes, stream) } {
                    // Not an allocation after all; the block goes back to the cache as a dropped
                    // one does.
                    {
                        let mut state = self.lock();
                        state.stats.allocations -= 1;
                        state.stats.cache_hits -= 1;
                    }
                    self.release(ptr, size, bytes, stream);
                    return Err(err);
                }
            }
            return Ok(PooledBlock {
                home: home(),
                ptr,
                size,
                requested: bytes,
                stream,
            });
        }
        let ptr = self.allocate_from_driver(bytes, size, zeroed)?;
        Ok(PooledBlock {
            home: home(),
            ptr,
            size,
            requested: bytes,
            stream,
        })
    }

    /// A new block of `size` bytes from the driver, for a request of `bytes` whose `size` the
    /// caller has already reserved (a miss): on exhaustion the cache is released and the driver
    /// asked once more.
    #[cold]
    fn allocate_from_driver(
        &self,
        bytes: usize,
        size: usize,
        zeroed: bool,
    ) -> Result<NonNull<c_void>> {
        let reservation = Reservation {
            pool: self,
            size,
            done: false,
        };
        let ptr = match self.allocator.allocate(size, zeroed) {
            Ok(ptr) => ptr,
            Err(err) if err.kind() == ErrorKind::Memory => {
                self.clear_cache();
                match self.allocator.allocate(size, zeroed) {
                    Ok(ptr) => ptr,
                    Err(err) if err.kind() == ErrorKind::Memory => {
                        drop(reservation);
                        let state = self.lock();
                        return Err(self.out_of_memory(
                            &state,
                            bytes,
                            size,
                            "the driver refused it, also after the cache was released",
                        ));
                    }
                    Err(err) => return Err(err),
                }
            }
            Err(err) => return Err(err),
        };
        reservation.commit(bytes);
        Ok(ptr)
    }

    /// Takes a released block back: into the cache, then trims the cache to its limit.
    fn release(
        &self,
        ptr: NonNull<c_void>,
        size: usize,
        requested: usize,
        stream: Option<StreamKey>,
    ) {
        if let Some(check) = self.release_check.get()
            && !check(ptr, size)
        {
            // Kept out of the pool: neither cached nor freed (its memory is not ours to reuse).
            let mut state = self.lock();
            state.stats.active_bytes -= size;
            state.stats.active_blocks -= 1;
            state.stats.requested_bytes -= requested;
            return;
        }
        let fence = match stream.map(|s| self.allocator.fence(s)).transpose() {
            Ok(fence) => fence.flatten(),
            Err(err) => {
                {
                    let mut state = self.lock();
                    state.stats.active_bytes -= size;
                    state.stats.active_blocks -= 1;
                    state.stats.requested_bytes -= requested;
                    state.stats.driver_frees += 1;
                    state.record(err);
                }
                // SAFETY: the block came from this allocator at `size`, its user is gone, and it
                // is not cached, so nothing uses it after this (see `RawAllocator::free` on
                // blocks freed without a fence).
                unsafe { self.allocator.free(ptr, size) };
                return;
            }
        };
        let evicted = {
            let mut state = self.lock();
            state.stats.active_bytes -= size;
            state.stats.active_blocks -= 1;
            state.stats.requested_bytes -= requested;
            state.insert_cached(size, ptr, fence);
            match state.stats.cache_limit {
                Some(limit) if state.stats.cached_bytes > limit => state.evict_to(limit),
                _ => return,
            }
        };
        self.free_to_driver(evicted);
    }

    /// Gives blocks already taken out of the cache (and counted) back to the driver.
    fn free_to_driver(&self, blocks: Vec<(usize, CachedBlock)>) {
        for (size, block) in blocks {
            if let Some(fence) = &block.fence {
                if !fence.is_complete() {
                    if let Err(err) = fence.synchronize() {
                        self.lock().record(err);
                    }
                }
            }
            // SAFETY: the block came from this allocator at `size`; it has left the cache, so it
            // is freed once and used by nobody after; its fenced work is done (or could not be
            // waited for, see `RawAllocator::free`).
            unsafe { self.allocator.free(block.ptr, size) };
        }
    }

    /// Returns every cached block to the driver.
    pub fn clear_cache(&self) {
        let blocks = {
            let mut state = self.lock();
            state.evict_to(0)
        };
        self.free_to_driver(blocks);
    }

    /// The pool's figures, all taken at one instant.
    pub fn stats(&self) -> MemoryStats {
        self.lock().stats
    }

    /// Restarts [`MemoryStats::peak_active_bytes`] from the current active bytes.
    pub fn reset_peak(&self) {
        let mut state = self.lock();
        state.stats.peak_active_bytes = state.stats.active_bytes;
    }

    /// Sets the most bytes active blocks may hold (`None`: no limit). A limit below the current
    /// active bytes is allowed: allocations fail until enough is released.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a limit above [`MAX_LIMIT`].
    pub fn set_memory_limit(&self, limit: Option<usize>) -> Result<()> {
        check_limit("memory", limit)?;
        self.lock().stats.memory_limit = limit;
        Ok(())
    }

    /// Sets the most bytes the cache may hold (`None`: no limit; `Some(0)`: no caching), and
    /// releases the least recently released blocks beyond it at once.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a limit above [`MAX_LIMIT`].
    pub fn set_cache_limit(&self, limit: Option<usize>) -> Result<()> {
        check_limit("cache", limit)?;
        let blocks = {
            let mut state = self.lock();
            state.stats.cache_limit = limit;
            match limit {
                Some(limit) => state.evict_to(limit),
                None => Vec::new(),
            }
        };
        self.free_to_driver(blocks);
        Ok(())
    }

    /// The first error met where none could be returned (releasing a block, evicting one), if
    /// any, and forgets it.
    pub fn take_error(&self) -> Option<Error> {
        self.lock().error.take()
    }

    #[inline]
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; should something, the figures are still whole
        // numbers, so keep going rather than poisoning every later allocation.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn out_of_memory(&self, state: &State, bytes: usize, size: usize, why: &str) -> Error {
        let s = &state.stats;
        let limit =
            |l: Option<usize>| l.map_or_else(|| "none".to_owned(), |l| format!("{l} bytes"));
        Error::OutOfMemory {
            bytes,
            device: self.device,
            detail: format!(
                " ({} storage, a {size}-byte block): {why}; the pool has {} bytes active in {} \
                 blocks, {} bytes cached in {} blocks, memory limit {}, cache limit {}",
                self.storage,
                s.active_bytes,
                s.active_blocks,
                s.cached_bytes,
                s.cached_blocks,
                limit(s.memory_limit),
                limit(s.cache_limit),
            ),
        }
    }
}

fn check_limit(which: &str, limit: Option<usize>) -> Result<()> {
    match limit {
        Some(l) if l > MAX_LIMIT => Err(Error::InvalidArgument(format!(
            "a {which} limit of {l} bytes is beyond any allocation (the most is {MAX_LIMIT})"
        ))),
        _ => Ok(()),
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Every block handed out holds the pool, so all that is left is the cache.
        self.clear_cache();
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("device", &self.device)
            .field("storage", &self.storage)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// A driver allocation in flight, counted against the memory limit until it is committed or
/// abandoned.
struct Reservation<'a> {
    pool: &'a Pool,
    size: usize,
    done: bool,
}

impl Reservation<'_> {
    fn commit(mut self, requested: usize) {
        let mut state = self.pool.lock();
        state.reserved_bytes -= self.size;
        state.commit(self.size, requested, false);
        state.stats.driver_allocations += 1;
        self.done = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.pool.lock().reserved_bytes -= self.size;
        }
    }
}

/// How a block refers to its pool.
enum Home {
    /// A pool that is never dropped (made by a backend for the whole process).
    Static(&'static Pool),
    /// A pool that lives while blocks or other handles refer to it.
    Counted(Arc<Pool>),
}

/// A block handed out by a [`Pool`]; dropping it returns the block to the pool (fenced on its
/// stream where the backend says queued work may still use it).
pub struct PooledBlock {
    home: Home,
    ptr: NonNull<c_void>,
    size: usize,
    requested: usize,
    stream: Option<StreamKey>,
}

// SAFETY: the block is memory owned by this value until it is dropped; nothing in it is bound to
// a thread (the pool and its allocator are `Send + Sync`), and it is given back exactly once, by
// `Drop`, from whichever thread drops it.
unsafe impl Send for PooledBlock {}
// SAFETY: shared references only read the block's address and sizes.
unsafe impl Sync for PooledBlock {}

impl PooledBlock {
    /// The block's address (a host or device address, or an opaque handle, as the backend
    /// allocates).
    pub fn as_ptr(&self) -> NonNull<c_void> {
        self.ptr
    }

    /// The bytes asked for.
    pub fn len(&self) -> usize {
        self.requested
    }

    /// Whether zero bytes were asked for (the block still holds at least [`GRANULE`]).
    pub fn is_empty(&self) -> bool {
        self.requested == 0
    }

    /// The bytes the block holds (after rounding).
    pub fn block_size(&self) -> usize {
        self.size
    }

    /// The stream the block was handed out for.
    pub fn stream(&self) -> Option<StreamKey> {
        self.stream
    }

    /// The pool the block returns to.
    pub fn pool(&self) -> &Pool {
        match &self.home {
            Home::Static(pool) => pool,
            Home::Counted(pool) => pool,
        }
    }
}

impl Allocation for PooledBlock {
    fn stream(&self) -> Option<StreamKey> {
        self.stream
    }
}

impl Drop for PooledBlock {
    fn drop(&mut self) {
        self.pool()
            .release(self.ptr, self.size, self.requested, self.stream);
    }
}

impl fmt::Debug for PooledBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledBlock")
            .field("ptr", &self.ptr)
            .field("len", &self.requested)
            .field("block_size", &self.size)
            .field("stream", &self.stream)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_rule_and_waste_bound() {
        assert_eq!(round_size(0), Some(GRANULE));
        assert_eq!(round_size(512), Some(512));
        assert_eq!(round_size(513), Some(1024));
        assert_eq!(round_size(8192), Some(8192));
        assert_eq!(round_size(8193), Some(9216));
        assert_eq!(round_size(usize::MAX), None);
        let mut n = 1usize;
        while n < (1 << 40) {
            for bytes in [n - 1, n, n + 1, n + n / 3, n + n / 2 + 7] {
                if bytes == 0 {
                    continue;
                }
                let r = round_size(bytes).unwrap();
                assert!(r >= bytes && r % GRANULE == 0, "{bytes} -> {r}");
                let waste = r - bytes;
                assert!(waste < GRANULE.max(bytes / 8 + 1), "{bytes} -> {r}");
                if bytes > 1 << 20 {
                    assert!(waste * 8 <= bytes, "{bytes} -> {r}");
                }
                assert_eq!(round_size(r), Some(r), "classes are fixed points");
            }
            n *= 2;
        }
        // Eight classes per power of two above 8 KiB.
        for k in 13..30 {
            let classes: std::collections::BTreeSet<usize> = ((1usize << k) + 1..=(1 << (k + 1)))
                .step_by(1 << (k - 6))
                .map(|b| round_size(b).unwrap())
                .collect();
            assert_eq!(classes.len(), 8, "k = {k}");
        }
    }
}
