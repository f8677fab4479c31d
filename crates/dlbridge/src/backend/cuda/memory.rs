//! CUDA allocations (device, pinned host, managed) and checks of imported pointers.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::driver::{self, Named, describe};
use super::stream::{
    Event, LEGACY_STREAM, WAIT_DEFAULT, current_stream, handle_of_key, order_streams, pool_key,
    stream_idle, synchronize_stream,
};
use super::{BACKEND, context};
use crate::buffer::{Allocation, Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};
use crate::pool::{Fence, Pool, RawAllocator, StreamKey};

/// Pinned blocks of at least this many bytes are pages of our own registered with the driver
/// ([`registered_pages`]); smaller ones come from `cuMemHostAlloc`.
const REGISTERED_MIN: usize = 2 << 20;

/// The huge page size the kernel backs anonymous memory with where asked (`MADV_HUGEPAGE`).
const HUGE_PAGE: usize = 2 << 20;

/// The advice [`registered_pages`] gives its mapping before registering it: back it with huge
/// pages (Linux; elsewhere none).
#[cfg(target_os = "linux")]
const HINTS: [libc::c_int; 1] = [libc::MADV_HUGEPAGE];
#[cfg(not(target_os = "linux"))]
const HINTS: [libc::c_int; 0] = [];

/// Each thread of [`populate`] faults in at least this many bytes.
const POPULATE_PER_THREAD: usize = 16 << 20;

/// Faults in `len` bytes of a new private mapping at `start` (the kernel zeroing its pages), by
/// several threads for a large one: zeroing is most of what pinning a large block costs, and it
/// scales with threads. Linux (`MADV_POPULATE_WRITE`); elsewhere, and where it is refused, the
/// registration faults the pages in itself.
fn populate(start: *mut c_void, len: usize) {
    #[cfg(target_os = "linux")]
    {
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(len / POPULATE_PER_THREAD)
            .clamp(1, 16);
        let piece = len.div_ceil(threads).next_multiple_of(HUGE_PAGE);
        // The address crosses to the threads as an integer (a pointer is not `Send`).
        let base = start.expose_provenance();
        let advise = move |at: usize| {
            let n = piece.min(len - at);
            let addr = std::ptr::with_exposed_provenance_mut::<c_void>(base + at);
            // SAFETY: `[start + at, start + at + n)` lies inside the caller's mapping, which only
            // the caller knows of; populating changes no content (the pages are new and zero).
            unsafe { libc::madvise(addr, n, libc::MADV_POPULATE_WRITE) };
        };
        if threads == 1 {
            advise(0);
            return;
        }
        std::thread::scope(|scope| {
            for at in (piece..len).step_by(piece) {
                scope.spawn(move || advise(at));
            }
            advise(0);
        });
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, len, POPULATE_PER_THREAD);
}

/// The pinned blocks [`registered_pages`] made: start address → length of the mapping.
static REGISTERED: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// `bytes` of page-locked host memory that every device may copy from and to, made as anonymous
/// memory backed by huge pages where the kernel has them, populated by several threads
/// ([`populate`]), then registered with the
/// driver (`cuMemHostRegister`, portable and device-mapped); `None` where any step is refused (the
/// caller falls back to `cuMemHostAlloc`).
///
/// Why not `cuMemHostAlloc`: pinning is what a process's first large load waits for. On the H200
/// machine `cuMemHostAlloc` pinned 128 MiB of staging in 50–69 ms (2–2.7 GB/s), and populated huge
/// pages registered in one call took 22–28 ms, with the same copy bandwidth out of them
/// (54.7 GB/s). A forked child reads the pages as the parent left them, as it reads
/// `cuMemHostAlloc`'s (checked on the H200 machine): the kernel copies pinned private pages into
/// the child at `fork()` instead of sharing them copy-on-write.
fn registered_pages(bytes: usize) -> Option<NonNull<c_void>> {
    if bytes < REGISTERED_MIN {
        return None;
    }
    let len = bytes.checked_next_multiple_of(HUGE_PAGE)?;
    let span = len.checked_add(HUGE_PAGE)?;
    // SAFETY: a new private anonymous mapping; no existing memory is affected.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    // Keep the huge-page-aligned `len` bytes inside the span, so that the kernel can back all of
    // them with huge pages, and give the ends back.
    let head = raw.addr().next_multiple_of(HUGE_PAGE) - raw.addr();
    let start = raw.wrapping_byte_add(head);
    let tail = HUGE_PAGE - head;
    if head > 0 {
        // SAFETY: the head lies inside the mapping just made, before `start`; nothing refers to it.
        unsafe { libc::munmap(raw, head) };
    }
    if tail > 0 {
        // SAFETY: the tail lies inside the mapping just made, after `start + len`; nothing refers
        // to it.
        unsafe { libc::munmap(start.wrapping_byte_add(len), tail) };
    }
    // Hints, on the mapping above that only this function knows of: refusals (an older kernel,
    // huge pages off) leave ordinary pages, faulted in by the registration below.
    for advice in HINTS {
        // SAFETY: as above.
        unsafe { libc::madvise(start, len, advice) };
    }
    populate(start, len);
    let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: `[start, start + len)` is the live mapping made above, registered nowhere yet, and
    // stays mapped until `release_registered`; the caller made the context current.
    let registered = unsafe { driver::host_register(start, len, flags) };
    // The device must address the pages at their host address, as it does `cuMemHostAlloc`'s on
    // every 64-bit system with unified addressing: the pool hands out one pointer for both.
    let mut device = 0;
    // SAFETY: `device` is a valid out-pointer; `start` is registered when the call is made.
    let same_address = registered.is_ok()
        && unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, start, 0) }
            .result()
            .is_ok()
        && device as usize == start.addr();
    if !same_address {
        log::debug!("dlbridge: pinning {bytes} bytes by registration was refused; cuMemHostAlloc");
        if registered.is_ok() {
            // SAFETY: registered above, used by nobody.
            let _ = unsafe { driver::host_unregister(start) };
        }
        // SAFETY: the mapping made above, used by nobody.
        unsafe { libc::munmap(start, len) };
        return None;
    }
    registered_blocks().insert(start.addr(), len);
    NonNull::new(start)
}

/// The record of [`REGISTERED`] blocks (a panic elsewhere while it was held leaves it usable: every
/// change to it is one insert or remove).
fn registered_blocks() -> std::sync::MutexGuard<'static, BTreeMap<usize, usize>> {
    REGISTERED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Unregisters and unmaps a block of [`registered_pages`].
///
/// # Safety
/// `start` and `len` are a block `registered_pages` made and recorded (removed from the record
/// now), that no queued device work uses and nothing refers to; the context is current.
unsafe fn release_registered(start: *mut c_void, len: usize) -> Result<(), DriverError> {
    // SAFETY: the caller's contract.
    let unregistered = unsafe { driver::host_unregister(start) };
    // SAFETY: the caller's contract; the pages are no longer registered (or the driver refused,
    // and the mapping goes all the same: nothing may use it any more).
    unsafe { libc::munmap(start, len) };
    unregistered
}

/// Which driver allocator makes a pool's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Device,
    Pinned,
    Managed,
}

/// The driver allocator behind one pool: one kind of memory on one device.
struct CudaAllocator {
    kind: Kind,
    ordinal: i32,
    device: Device,
    /// Events of fences that completed their job, kept for the next release (creating an event
    /// costs more than recording one).
    spare_events: Arc<Mutex<Vec<Event>>>,
}

/// The driver's handle for the stream of pool key `key` (see [`handle_of_key`]).
fn raw_stream(key: StreamKey) -> sys::CUstream {
    super::stream::raw(handle_of_key(key))
}

impl RawAllocator for CudaAllocator {
    fn allocate(&self, bytes: usize, zeroed: bool) -> Result<NonNull<c_void>> {
        let _ctx = context(self.ordinal)?;
        let allocated = match self.kind {
            // SAFETY: the new block is only ever used as raw bytes, which may be uninitialised; the
            // device's context is current.
            Kind::Device => unsafe { result::malloc_sync(bytes) },
            Kind::Pinned => match registered_pages(bytes) {
                Some(pages) => Ok(pages.as_ptr().expose_provenance() as u64),
                None => {
                    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
                    // SAFETY: as above.
                    let host = unsafe { result::malloc_host(bytes, flags) };
                    host.map(|host| host.expose_provenance() as u64)
                }
            },
            Kind::Managed => {
                let flags = sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL;
                // SAFETY: as above.
                unsafe { result::malloc_managed(bytes, flags) }
            }
        };
        let ptr = match allocated {
            Ok(ptr) => ptr,
            Err(
                e @ DriverError(
                    sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
                    | sys::CUresult::CUDA_ERROR_INVALID_VALUE,
                ),
            ) => {
                let (free, total) = super::mem_info(self.ordinal).unwrap_or((0, 0));
                return Err(Error::OutOfMemory {
                    bytes,
                    device: self.device,
                    detail: format!(
                        " ({}; the device has {free} of {total} bytes free)",
                        describe(e)
                    ),
                });
            }
            Err(e) => {
                return Err(Error::Driver {
                    backend: BACKEND,
                    message: format!(
                        "allocating {bytes} bytes on {}: {}",
                        self.device,
                        describe(e)
                    ),
                });
            }
        };
        let ptr = NonNull::new(std::ptr::with_exposed_provenance_mut::<c_void>(
            ptr as usize,
        ))
        .ok_or_else(|| Error::Driver {
            backend: BACKEND,
            message: "the driver returned NULL for a non-empty allocation".into(),
        })?;
        if zeroed {
            let stream = pool_key(current_stream(self.ordinal));
            // SAFETY: the block was just allocated with `bytes` bytes and nobody else has it.
            if let Err(err) = unsafe { self.zero(ptr, bytes, Some(stream)) } {
                // SAFETY: allocated just above and handed to nobody: freed once, here.
                unsafe { self.free(ptr, bytes) };
                return Err(err);
            }
        }
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: NonNull<c_void>, _bytes: usize) {
        // A driver already shut down at process exit cannot be told; the memory goes with the
        // process then anyway.
        let Ok(_ctx) = context(self.ordinal) else {
            return;
        };
        let _ = match self.kind {
            // SAFETY: `ptr` came from cuMemAlloc / cuMemAllocManaged and is freed once, by the
            // pool; the free waits for work still using the memory.
            Kind::Device | Kind::Managed => unsafe {
                result::memory_free(ptr.as_ptr().expose_provenance() as u64)
            },
            Kind::Pinned => match registered_blocks().remove(&ptr.addr().get()) {
                // SAFETY: `ptr` starts a mapping of `len` bytes that `registered_pages` made and
                // registered; the pool frees it once, after the work that used it.
                Some(len) => unsafe { release_registered(ptr.as_ptr(), len) },
                // SAFETY: `ptr` came from cuMemHostAlloc and is freed once, by the pool.
                _ => unsafe { result::free_host(ptr.as_ptr()) },
            },
        };
    }

    unsafe fn zero(
        &self,
        ptr: NonNull<c_void>,
        bytes: usize,
        stream: Option<StreamKey>,
    ) -> Result<()> {
        let _ctx = context(self.ordinal)?;
        let stream = stream.unwrap_or_else(|| pool_key(current_stream(self.ordinal)));
        // SAFETY: the caller guarantees `bytes` bytes of a live block nobody else uses; the fill
        // is ordered on `stream` before later work there.
        unsafe {
            result::memset_d8_async(
                ptr.as_ptr().expose_provenance() as u64,
                0,
                bytes,
                raw_stream(stream),
            )
        }
        .named("cuMemsetD8Async")
    }

    fn fence(&self, stream: StreamKey) -> Result<Option<Box<dyn Fence>>> {
        if stream as usize == 0 || stream as usize == LEGACY_STREAM {
            // The common case, and the one where a free makes no driver call (as in PyTorch's
            // allocator): see `LegacyStreamFence`.
            return Ok(Some(Box::new(LegacyStreamFence {
                ordinal: self.ordinal,
                host_visible: self.kind != Kind::Device,
            })));
        }
        let spare = self
            .spare_events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let event = match spare {
            Some(event) => event,
            None => Event::new(self.ordinal, false)?,
        };
        // A block of another thread's per-thread default stream is fenced on the legacy default
        // stream, whose event follows the work of every blocking stream (see `handle_of_key`).
        event.record(handle_of_key(stream))?;
        Ok(Some(Box::new(CudaFence {
            event: Some(event),
            stream,
            host_visible: self.kind != Kind::Device,
            spare_events: Arc::clone(&self.spare_events),
        })))
    }
}

/// At most this many spare events are kept per pool.
const SPARE_EVENTS: usize = 64;

/// The work queued on a block's stream when it was released.
struct CudaFence {
    /// Always `Some` until dropped.
    event: Option<Event>,
    stream: StreamKey,
    /// Pinned and managed blocks can be touched by the host at once, so another stream's reuse
    /// waits on the host rather than in stream order.
    host_visible: bool,
    spare_events: Arc<Mutex<Vec<Event>>>,
}

impl CudaFence {
    fn event(&self) -> &Event {
        self.event.as_ref().expect("present until drop")
    }
}

impl Drop for CudaFence {
    fn drop(&mut self) {
        // Re-recording a reused event later does not disturb waits already enqueued on it.
        if let Some(event) = self.event.take() {
            let mut spare = self.spare_events.lock().unwrap_or_else(|e| e.into_inner());
            if spare.len() < SPARE_EVENTS {
                spare.push(event);
            }
        }
    }
}

impl Fence for CudaFence {
    fn stream(&self) -> StreamKey {
        self.stream
    }

    fn is_complete(&self) -> bool {
        self.event().query().unwrap_or(false)
    }

    fn order_before(&self, stream: StreamKey) -> Result<()> {
        if self.host_visible {
            return self.event().synchronize();
        }
        let _ctx = context(self.event().device())?;
        // SAFETY: a live event and a stream of the device whose context is current.
        unsafe {
            result::stream::wait_event(
                raw_stream(stream),
                std::ptr::with_exposed_provenance_mut(self.event().handle()),
                WAIT_DEFAULT,
            )
        }
        .named("cuStreamWaitEvent")
    }

    fn synchronize(&self) -> Result<()> {
        self.event().synchronize()
    }
}

/// The fence of a block released on the legacy default stream, which lives as long as the
/// device's context: instead of an event recorded at every release, it stands for "all work
/// enqueued on that stream so far" and is resolved only when the block is wanted elsewhere. That
/// is a superset of the work queued before the release, so every answer is safe, if at times
/// conservative: another stream waits for an event recorded on the legacy stream at that moment;
/// a request without a stream waits until the legacy stream is idle.
///
/// Other streams (user streams may be destroyed, and the per-thread default stream names a
/// different stream on every thread) keep an event recorded at release ([`CudaFence`]).
struct LegacyStreamFence {
    ordinal: i32,
    /// As in [`CudaFence`]: another stream's reuse of host-visible memory waits on the host.
    host_visible: bool,
}

impl Fence for LegacyStreamFence {
    fn stream(&self) -> StreamKey {
        0
    }

    fn is_complete(&self) -> bool {
        stream_idle(self.ordinal, 0).unwrap_or(false)
    }

    fn order_before(&self, stream: StreamKey) -> Result<()> {
        if self.host_visible {
            return synchronize_stream(self.ordinal, 0);
        }
        order_streams(self.ordinal, 0, handle_of_key(stream))
    }

    fn synchronize(&self) -> Result<()> {
        synchronize_stream(self.ordinal, 0)
    }
}

/// The pool of one kind of memory on one device (made on first use).
pub fn pool(device: Device) -> Result<&'static Arc<Pool>> {
    type Slots = Vec<[OnceLock<Arc<Pool>>; 3]>;
    static POOLS: OnceLock<Slots> = OnceLock::new();
    let count = super::device_count()?;
    let ordinal = device.index() as i32;
    if device.index() as usize >= count {
        return Err(Error::InvalidArgument(format!(
            "CUDA device {ordinal} does not exist: this machine has {count} CUDA device(s)"
        )));
    }
    let (kind, storage, slot) = match device.kind() {
        DeviceKind::Cuda => (Kind::Device, StorageMode::Private, 0),
        DeviceKind::CudaHost => (Kind::Pinned, StorageMode::Shared, 1),
        DeviceKind::CudaManaged => (Kind::Managed, StorageMode::Managed, 2),
        _ => {
            return Err(Error::UnsupportedDevice(format!(
                "the CUDA backend has no memory on {device}"
            )));
        }
    };
    let pools = POOLS.get_or_init(|| (0..count).map(|_| Default::default()).collect());
    Ok(pools[device.index() as usize][slot].get_or_init(|| {
        Pool::new(
            device,
            storage,
            CudaAllocator {
                kind,
                ordinal,
                device,
                spare_events: Arc::default(),
            },
        )
    }))
}

/// A zero-byte allocation: no memory, nothing to return.
struct NoMemory;

impl Allocation for NoMemory {}

/// Allocates `bytes` of CUDA memory of `device`'s kind (device, pinned host or managed) from its
/// pool, for the calling thread's current stream; zero-filled in stream order when `zeroed`.
pub fn allocate(device: Device, bytes: usize, zeroed: bool) -> Result<Buffer> {
    let pool = pool(device)?;
    let storage = pool.storage_mode();
    if bytes == 0 {
        // SAFETY: no bytes: the NULL handle is never dereferenced.
        return Ok(unsafe {
            Buffer::from_allocation(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                device,
                storage,
                Box::new(NoMemory),
            )
        });
    }
    let stream = pool_key(current_stream(device.index() as i32));
    let block = pool.allocate_static(bytes, Some(stream), zeroed)?;
    let handle = block.as_ptr().as_ptr();
    let host = match device.kind() {
        DeviceKind::Cuda => std::ptr::null_mut(),
        _ => handle.cast::<u8>(),
    };
    // SAFETY: the block holds at least `bytes` bytes at `handle` until it is dropped with the
    // buffer; pinned and managed memory is host-addressable at the same address (unified
    // addressing).
    Ok(unsafe { Buffer::from_pooled(handle, host, bytes, device, storage, block) })
}

/// Checks that `[addr, addr + len)` is memory the CUDA driver knows, of the kind and device that a
/// DLPack producer claimed. A pointer the driver does not know is a [`Error::MalformedTensor`].
pub(crate) fn validate_foreign(device: Device, addr: usize, len: usize) -> Result<()> {
    let ordinal = device.index() as i32;
    let _ctx = context(ordinal)?;
    let unknown = || {
        Error::MalformedTensor(format!(
            "{addr:#x} is not memory the CUDA driver knows, but the producer said it is on {device}"
        ))
    };
    let driver::PointerInfo {
        memory_type,
        ordinal: ordinal_found,
        start,
        size,
    } = driver::pointer_info(addr as u64)
        .ok()
        .filter(|info| info.memory_type != 0)
        .ok_or_else(unknown)?;
    let expect_device = device.kind() == DeviceKind::Cuda;
    let is_device = memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    if device.kind() != DeviceKind::CudaHost && ordinal_found >= 0 && ordinal_found != ordinal {
        return Err(Error::MalformedTensor(format!(
            "{addr:#x} is memory of cuda:{ordinal_found}, but the producer said {device}"
        )));
    }
    if expect_device && !is_device {
        return Err(Error::MalformedTensor(format!(
            "{addr:#x} is host memory, but the producer said {device}"
        )));
    }
    if start != 0 && size != 0 {
        let end = addr as u128 + len as u128;
        if (addr as u64) < start || end > start as u128 + size as u128 {
            return Err(Error::MalformedTensor(format!(
                "the tensor's bytes {addr:#x}..{end:#x} run outside the CUDA allocation \
                 {start:#x}..{:#x}",
                start as u128 + size as u128
            )));
        }
    }
    Ok(())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Every page of a mapping [`populate`] covered (by one thread and by several, a length
    /// that does not divide evenly) is resident afterwards, and zero.
    #[test]
    fn populate_faults_in_every_page_of_the_mapping() {
        for len in [4 << 20, 100 << 20] {
            // SAFETY: a new private anonymous mapping, unmapped below.
            let start = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(start, libc::MAP_FAILED);
            populate(start, len);
            let page = crate::host::page_size();
            let mut resident = vec![0u8; len.div_ceil(page)];
            // SAFETY: the mapping above; `resident` has one byte per page.
            let status = unsafe { libc::mincore(start, len, resident.as_mut_ptr()) };
            assert_eq!(status, 0);
            assert!(
                resident.iter().all(|r| r & 1 == 1),
                "{len}: a page not faulted in"
            );
            // SAFETY: `len` readable bytes of the mapping above.
            let bytes = unsafe { std::slice::from_raw_parts(start.cast::<u8>(), len) };
            assert!(bytes.iter().all(|&b| b == 0));
            // SAFETY: the mapping above, used by nothing else.
            unsafe { libc::munmap(start, len) };
        }
    }
}
