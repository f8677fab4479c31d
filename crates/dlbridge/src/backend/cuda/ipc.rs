//! CUDA memory and events across processes: VMM allocations exported as POSIX file descriptors,
//! legacy IPC handles for memory that is not VMM, IPC events, and pinned registration of shared
//! host files. Thin `Result`-returning calls over `cudarc::driver::sys` (its `result` layer has
//! none of these), then the shareable device pool.
//!
//! | call | driver entry points |
//! | --- | --- |
//! | [`allocate`] (pool driver) | `cuMemCreate` (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`), `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess` |
//! | [`export`] / [`import`] | `cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle` + map |
//! | [`export_legacy`] / [`open_legacy`] | `cuIpcGetMemHandle` / `cuIpcOpenMemHandle` |
//! | [`record_event`] / [`wait_event`] | `cuEventCreate(CU_EVENT_INTERPROCESS)`, `cuIpcGetEventHandle` / `cuIpcOpenEventHandle`, `cuStreamWaitEvent` |
//!
//! # Lifetime
//! A VMM allocation lives while any process maps it: when the buffer of an exported block is
//! dropped, the producer waits for the device, unmaps the block's physical memory, releases its
//! handle (importers keep theirs) and maps a fresh allocation at the same addresses before the
//! block goes back to the pool. Legacy IPC memory is valid only while the producer lives: the
//! producer keeps every buffer it exported that way, with a count of its consumers in shared
//! memory, until the count is back to zero (a consumer that never opens its handle, or dies
//! before closing it, holds the buffer until the producer exits), so that the memory is never
//! reused under a consumer.
//!
//! # Re-sharing and caching
//! A process maps each VMM allocation once ([`import`] keys mappings by the allocation's
//! [`BlockKey`], which every handle of it carries) and keeps the descriptor it imported from, so
//! that an opened buffer is shared on as the same physical memory ([`export`] duplicates that
//! descriptor): never a copy. Opened IPC events of other processes are kept and waited on again
//! (each producer re-records one event per stream); a process waits on its own events directly.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

use super::context;
use super::driver::Named;
use super::stream::{current_stream, handle_of_key, raw};
use crate::backend::Sharing;
use crate::buffer::{Allocation, Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};
use crate::pool::{Pool, PooledBlock, RawAllocator, StreamKey};
use crate::share::handle::{BlockKey, Exported, IPC_HANDLE_BYTES, LegacyExported, VmmExported};
use crate::share::memfd::SharedCounter;

type DriverResult<T> = std::result::Result<T, DriverError>;

/// Fails unless CUDA device `ordinal` exists and its context can be made.
pub(crate) fn check_device(ordinal: i32) -> Result<()> {
    context(ordinal).map(drop)
}

/// Registers `len` bytes of host memory at `p` with the driver (mapped for every device).
///
/// # Safety
/// `[p, p + len)` is a live host mapping that is not registered yet.
pub(crate) unsafe fn host_register(p: NonNull<c_void>, len: usize, ordinal: i32) -> Result<()> {
    let _ctx = context(ordinal)?;
    let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: by the caller's contract the range is live, unregistered host memory.
    unsafe { sys::cuMemHostRegister_v2(p.as_ptr(), len, flags) }
        .result()
        .named("cuMemHostRegister")
}

/// Undoes [`host_register`].
///
/// # Safety
/// `p` was registered by [`host_register`] and no device work uses it any more.
pub(crate) unsafe fn host_unregister(p: NonNull<c_void>, ordinal: i32) -> Result<()> {
    let _ctx = context(ordinal)?;
    // SAFETY: by the caller's contract `p` is registered and unused.
    unsafe { sys::cuMemHostUnregister(p.as_ptr()) }
        .result()
        .named("cuMemHostUnregister")
}

/// The allocation properties of shareable device memory on `ordinal`.
fn properties(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero value is valid for this plain C struct (no handle types, no flags).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

/// The driver's allocation granularity for shareable memory (`cuMemGetAllocationGranularity`),
/// asked once per device and cached.
fn granularity(ordinal: i32) -> DriverResult<usize> {
    static CACHE: OnceLock<Mutex<HashMap<i32, usize>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(&g) = cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&ordinal)
    {
        return Ok(g);
    }
    let prop = properties(ordinal);
    let mut g = 0usize;
    let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: valid out-pointer and properties.
    unsafe { sys::cuMemGetAllocationGranularity(&mut g, &prop, option) }.result()?;
    let g = g.max(1);
    cache
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(ordinal, g);
    Ok(g)
}

/// Maps `handle` at a reserved range `ptr` of `len` bytes and gives `ordinal` read-write access.
///
/// # Safety
/// `ptr` is a reserved, unmapped range of `len` bytes; `handle` a live allocation of `len` bytes.
unsafe fn map_at(ptr: u64, len: usize, handle: u64, ordinal: i32) -> Result<()> {
    // SAFETY: by the caller's contract.
    unsafe { sys::cuMemMap(ptr, len, 0, handle, 0) }
        .result()
        .named("cuMemMap")?;
    // SAFETY: an all-zero value is valid for this plain C struct.
    let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    access.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = ordinal;
    access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: the range was just mapped; one valid descriptor.
    let set = unsafe { sys::cuMemSetAccess(ptr, len, &access, 1) }.result();
    if set.is_err() {
        // SAFETY: the range was mapped above and nothing uses it yet.
        let _ = unsafe { sys::cuMemUnmap(ptr, len) };
    }
    set.named("cuMemSetAccess")
}

/// Reserves `len` bytes of addresses and maps `handle` there; releases the reservation on failure.
///
/// # Safety
/// `handle` is a live allocation of `len` bytes of device `ordinal`.
unsafe fn reserve_and_map(len: usize, handle: u64, ordinal: i32) -> Result<u64> {
    let mut ptr = 0u64;
    // SAFETY: valid out-pointer; no fixed address.
    unsafe { sys::cuMemAddressReserve(&mut ptr, len, 0, 0, 0) }
        .result()
        .named("cuMemAddressReserve")?;
    // SAFETY: `ptr` is a fresh reservation; `handle` by the caller's contract.
    if let Err(e) = unsafe { map_at(ptr, len, handle, ordinal) } {
        // SAFETY: the reservation is ours and unmapped.
        let _ = unsafe { sys::cuMemAddressFree(ptr, len) };
        return Err(e);
    }
    Ok(ptr)
}

/// Unmaps and frees a range made by [`reserve_and_map`] (the handle is released separately).
///
/// # Safety
/// No device work uses the range any more.
unsafe fn unmap_and_free(ptr: u64, len: usize) {
    // SAFETY: by the caller's contract.
    if let Err(e) = unsafe { sys::cuMemUnmap(ptr, len) }
        .result()
        .named("cuMemUnmap")
    {
        log::warn!("{e}");
    }
    // SAFETY: the reservation is ours and now unmapped.
    if let Err(e) = unsafe { sys::cuMemAddressFree(ptr, len) }
        .result()
        .named("cuMemAddressFree")
    {
        log::warn!("{e}");
    }
}

/// Releases an allocation handle (the memory goes when no process maps it).
fn release(handle: u64) {
    // SAFETY: `handle` is a live allocation handle we own; releasing it once.
    if let Err(e) = unsafe { sys::cuMemRelease(handle) }
        .result()
        .named("cuMemRelease")
    {
        log::warn!("{e}");
    }
}

/// Creates a shareable physical allocation of `len` bytes on `ordinal`.
fn create(len: usize, ordinal: i32) -> Result<u64> {
    let prop = properties(ordinal);
    let mut handle = 0u64;
    // SAFETY: valid out-pointer and properties; `len` is a multiple of the granularity.
    unsafe { sys::cuMemCreate(&mut handle, len, &prop, 0) }
        .result()
        .named("cuMemCreate")?;
    Ok(handle)
}

/// A number that tells this process from every other one of this boot (a pid may be reused; this
/// is random), carried by handles as the origin of the physical memory they describe.
pub(crate) fn process_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish() | 1
    })
}

/// A new identifier of a physical allocation of this process (never 0, never reused).
fn next_block_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One block of the shareable device pool.
struct VmmBlock {
    /// The number of its current physical allocation ([`next_block_id`]).
    id: u64,
    handle: u64,
    len: usize,
    exported: bool,
    /// The descriptor of its first export, kept while the physical allocation is the same: a
    /// later export duplicates it (a `dup`) instead of asking the driver again.
    fd: Option<OwnedFd>,
}

/// The blocks of one device's shareable pool by address.
struct Blocks {
    ordinal: i32,
    map: Mutex<BTreeMap<u64, VmmBlock>>,
}

impl Blocks {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, VmmBlock>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives the exported block at `ptr` fresh physical memory, leaving the old allocation to
    /// the processes that imported it.
    fn detach(&self, ptr: u64) -> Result<()> {
        let _ctx = context(self.ordinal)?;
        let mut map = self.lock();
        let Some(block) = map.get_mut(&ptr) else {
            return Ok(());
        };
        // Work queued on any stream of ours may still use the block.
        // SAFETY: the device's context is current.
        unsafe { sys::cuCtxSynchronize() }
            .result()
            .named("cuCtxSynchronize")?;
        let fresh = create(block.len, self.ordinal)?;
        // SAFETY: the device is idle and the block's buffer is being dropped.
        if let Err(e) = unsafe { sys::cuMemUnmap(ptr, block.len) }
            .result()
            .named("cuMemUnmap")
        {
            release(fresh);
            return Err(e);
        }
        release(block.handle);
        block.handle = fresh;
        block.id = next_block_id();
        block.exported = false;
        block.fd = None;
        // SAFETY: the range is reserved and now unmapped; `fresh` holds `len` bytes.
        unsafe { map_at(ptr, block.len, fresh, self.ordinal) }
    }
}

/// The driver of a shareable device pool.
struct VmmAllocator {
    blocks: Arc<Blocks>,
    granularity: usize,
}

impl RawAllocator for VmmAllocator {
    fn round_size(&self, bytes: usize) -> Option<usize> {
        bytes.max(1).checked_next_multiple_of(self.granularity)
    }

    fn allocate(&self, bytes: usize, zeroed: bool) -> Result<NonNull<c_void>> {
        let ordinal = self.blocks.ordinal;
        let _ctx = context(ordinal)?;
        let len = self
            .round_size(bytes)
            .ok_or_else(|| crate::error::overflow("block size"))?;
        let handle = create(len, ordinal)?;
        // SAFETY: `handle` was just created with `len` bytes.
        let ptr = match unsafe { reserve_and_map(len, handle, ordinal) } {
            Ok(ptr) => ptr,
            Err(e) => {
                release(handle);
                return Err(e);
            }
        };
        if zeroed {
            // SAFETY: `len` bytes were just mapped read-write for this device.
            unsafe { sys::cuMemsetD8_v2(ptr, 0, len) }
                .result()
                .named("cuMemsetD8")?;
        }
        let block = VmmBlock {
            id: next_block_id(),
            handle,
            len,
            exported: false,
            fd: None,
        };
        self.blocks.lock().insert(ptr, block);
        NonNull::new(std::ptr::with_exposed_provenance_mut(ptr as usize))
            .ok_or_else(|| Error::InvalidArgument("the driver mapped NULL".into()))
    }

    unsafe fn free(&self, ptr: NonNull<c_void>, _bytes: usize) {
        let addr = ptr.as_ptr().expose_provenance() as u64;
        let Some(block) = self.blocks.lock().remove(&addr) else {
            return;
        };
        let Ok(_ctx) = context(self.blocks.ordinal) else {
            return;
        };
        // SAFETY: by the caller's contract the block is no longer used.
        unsafe { unmap_and_free(addr, block.len) };
        release(block.handle);
    }

    unsafe fn zero(
        &self,
        ptr: NonNull<c_void>,
        bytes: usize,
        stream: Option<StreamKey>,
    ) -> Result<()> {
        let _ctx = context(self.blocks.ordinal)?;
        let stream = raw(stream.map_or(0, handle_of_key));
        let addr = ptr.as_ptr().expose_provenance() as u64;
        // SAFETY: by the caller's contract `bytes` bytes of a live block, in stream order.
        unsafe { sys::cuMemsetD8Async(addr, 0, bytes, stream) }
            .result()
            .named("cuMemsetD8Async")
    }
}

/// A device's shareable pool and its blocks.
struct Shareable {
    pool: Arc<Pool>,
    blocks: Arc<Blocks>,
}

/// The shareable pool of CUDA device `device` (made on first use).
fn shareable(device: Device) -> Result<&'static Shareable> {
    static POOLS: OnceLock<Mutex<HashMap<u32, &'static Shareable>>> = OnceLock::new();
    if device.kind() != DeviceKind::Cuda {
        return Err(Error::UnsupportedDevice(format!(
            "shareable CUDA device memory lives on cuda:N, not {device}"
        )));
    }
    let ordinal = device.index() as i32;
    let _ctx = context(ordinal)?;
    let mut pools = POOLS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(s) = pools.get(&device.index()) {
        return Ok(s);
    }
    let granularity = granularity(ordinal).named("cuMemGetAllocationGranularity")?;
    let blocks = Arc::new(Blocks {
        ordinal,
        map: Mutex::default(),
    });
    let allocator = VmmAllocator {
        blocks: blocks.clone(),
        granularity,
    };
    let pool = Pool::new(device, StorageMode::Private, allocator);
    let s: &'static Shareable = Box::leak(Box::new(Shareable { pool, blocks }));
    pools.insert(device.index(), s);
    Ok(s)
}

/// The caching pool of shareable device memory on `device` (`cuda:N`).
pub(crate) fn pool(device: Device) -> Result<&'static Arc<Pool>> {
    Ok(&shareable(device)?.pool)
}

/// A pooled block whose release first detaches it from importers if it was exported.
struct SharedBlock {
    block: Option<PooledBlock>,
    blocks: Arc<Blocks>,
}

impl Allocation for SharedBlock {
    fn stream(&self) -> Option<StreamKey> {
        self.block.as_ref().and_then(PooledBlock::stream)
    }
}

impl Drop for SharedBlock {
    fn drop(&mut self) {
        let Some(block) = self.block.take() else {
            return;
        };
        let ptr = block.as_ptr().as_ptr().expose_provenance() as u64;
        let exported = self.blocks.lock().get(&ptr).is_some_and(|b| b.exported);
        if exported && let Err(e) = self.blocks.detach(ptr) {
            log::warn!("a shared CUDA block could not be detached and is kept: {e}");
            std::mem::forget(block);
            return;
        }
        drop(block);
    }
}

/// Allocates `bytes` of shareable device memory on `device` from its pool, for the calling
/// thread's current stream.
pub(crate) fn allocate(device: Device, bytes: usize, zeroed: bool) -> Result<Buffer> {
    let shared = shareable(device)?;
    let stream = super::stream::pool_key(current_stream(device.index() as i32));
    let block = shared
        .pool
        .allocate_static(bytes.max(1), Some(stream), zeroed)?;
    let ptr = block.as_ptr().as_ptr();
    let boxed = Box::new(SharedBlock {
        block: Some(block),
        blocks: shared.blocks.clone(),
    });
    // SAFETY: the block maps at least `bytes` device bytes at `ptr` until it is dropped.
    Ok(unsafe {
        Buffer::from_allocation(
            ptr,
            std::ptr::null_mut(),
            bytes,
            device,
            StorageMode::Private,
            boxed,
        )
    })
}

/// The VMM allocation `buffer` lies in, as a new POSIX descriptor, with its key: a block of this
/// process's shareable pool (marked exported) or a mapping this process imported (whose kept
/// descriptor is duplicated: the same physical memory, never a copy). `None` when the buffer is
/// in neither.
pub(crate) fn export(buffer: &Buffer) -> Result<Option<VmmExported>> {
    if buffer.device().kind() != DeviceKind::Cuda {
        return Ok(None);
    }
    let addr = buffer.handle().expose_provenance() as u64;
    if let Some(found) = export_imported(addr, buffer.len())? {
        return Ok(Some(found));
    }
    let Ok(shared) = shareable(buffer.device()) else {
        return Ok(None);
    };
    let mut map = shared.blocks.lock();
    let Some((&start, block)) = map.range_mut(..=addr).next_back() else {
        return Ok(None);
    };
    let offset = (addr - start) as usize;
    if offset.saturating_add(buffer.len()) > block.len {
        return Ok(None);
    }
    if block.fd.is_none() {
        let _ctx = context(shared.blocks.ordinal)?;
        let mut fd: c_int = -1;
        let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for a POSIX descriptor the driver writes an `int` at the pointer.
        unsafe { sys::cuMemExportToShareableHandle((&raw mut fd).cast(), block.handle, kind, 0) }
            .result()
            .named("cuMemExportToShareableHandle")?;
        // SAFETY: the driver opened this descriptor for us.
        block.fd = Some(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    let fd = block
        .fd
        .as_ref()
        .map(OwnedFd::try_clone)
        .transpose()
        .map_err(|e| Error::Driver {
            backend: super::BACKEND,
            message: format!("dup of a VMM allocation's descriptor failed: {e}"),
        })?
        .ok_or_else(|| Error::Driver {
            backend: super::BACKEND,
            message: "a VMM allocation's descriptor was not kept".into(),
        })?;
    block.exported = true;
    Ok(Some(VmmExported {
        exported: Exported {
            fd,
            len: block.len,
            offset,
        },
        key: BlockKey {
            origin: process_token(),
            block: block.id,
        },
    }))
}

/// Whether another process can open `buffer`'s memory as it is, without a copy: a block of the
/// shareable pool, a VMM allocation this process imported, or memory the driver gives a legacy
/// IPC handle for (`CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`: `cuMemAlloc` memory, as
/// dlbridge's and PyTorch's pools use; not the memory of stream-ordered pools). Nothing is
/// exported.
pub(crate) fn is_shared(buffer: &Buffer) -> bool {
    let device = buffer.device();
    if device.kind() != DeviceKind::Cuda {
        return false;
    }
    let addr = buffer.handle().expose_provenance() as u64;
    let len = buffer.len();
    let within = |start: u64, size: usize| {
        addr >= start && ((addr - start) as usize).saturating_add(len) <= size
    };
    let imported = imports()
        .by_addr
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .range(..=addr)
        .next_back()
        .and_then(|(_, weak)| weak.upgrade())
        .is_some_and(|m| within(m.ptr, m.len));
    if imported {
        return true;
    }
    if let Ok(shared) = shareable(device)
        && let Some((&start, block)) = shared.blocks.lock().range(..=addr).next_back()
        && within(start, block.len)
    {
        return true;
    }
    let Ok(_ctx) = context(device.index() as i32) else {
        return false;
    };
    let mut capable: u32 = 0;
    let attribute = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE;
    // SAFETY: the driver writes a boolean (at most an `unsigned int`) at the out-pointer; any
    // address may be asked about.
    let asked = unsafe { sys::cuPointerGetAttribute((&raw mut capable).cast(), attribute, addr) };
    asked.result().is_ok() && capable != 0
}

/// [`export`] of a buffer that lies in a mapping this process imported.
fn export_imported(addr: u64, len: usize) -> Result<Option<VmmExported>> {
    let mapping = {
        let by_addr = imports()
            .by_addr
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        by_addr
            .range(..=addr)
            .next_back()
            .and_then(|(_, weak)| weak.upgrade())
    };
    let Some(mapping) = mapping else {
        return Ok(None);
    };
    let offset = addr.wrapping_sub(mapping.ptr) as usize;
    if addr < mapping.ptr || offset.saturating_add(len) > mapping.len {
        return Ok(None);
    }
    // The kept descriptor names the same physical allocation as the exporter's: a duplicate of it
    // imports that memory again, in this process or any other.
    let fd = mapping.fd.try_clone().map_err(|e| Error::Driver {
        backend: super::BACKEND,
        message: format!("dup of a VMM allocation's descriptor failed: {e}"),
    })?;
    Ok(Some(VmmExported {
        exported: Exported {
            fd,
            len: mapping.len,
            offset,
        },
        key: mapping.key,
    }))
}

/// An imported VMM allocation mapped in this process, shared by every buffer opened from a handle
/// of the same allocation while any of them lives.
struct Mapping {
    ptr: u64,
    len: usize,
    handle: u64,
    ordinal: i32,
    key: BlockKey,
    /// The descriptor it was imported from, kept to share the allocation on (see
    /// [`export_imported`]).
    fd: OwnedFd,
}

/// The mappings this process imported: by allocation (to map an allocation once however often it
/// is received) and by address (to share a buffer of one on without a copy). Entries are weak:
/// a mapping goes when its last buffer does.
struct Imports {
    by_key: Mutex<HashMap<(i32, BlockKey), std::sync::Weak<Mapping>>>,
    by_addr: Mutex<BTreeMap<u64, std::sync::Weak<Mapping>>>,
    /// The most recently received small mappings, kept past their last buffer (see [`keep`]).
    kept: Mutex<std::collections::VecDeque<Arc<Mapping>>>,
}

fn imports() -> &'static Imports {
    static IMPORTS: OnceLock<Imports> = OnceLock::new();
    IMPORTS.get_or_init(|| Imports {
        by_key: Mutex::default(),
        by_addr: Mutex::default(),
        kept: Mutex::default(),
    })
}

/// How many received mappings stay mapped after their last buffer went.
const KEPT_MAPPINGS: usize = 64;

/// The most bytes of received mappings kept so, unless `DLBRIDGE_SHARE_KEEP_MIB` says otherwise
/// (`0` keeps none).
const KEPT_BYTES: usize = 256 << 20;

fn kept_bytes_limit() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("DLBRIDGE_SHARE_KEEP_MIB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map_or(KEPT_BYTES, |mib| mib.saturating_mul(1 << 20))
    })
}

/// Keeps `mapping` mapped after its last buffer goes, among the [`KEPT_MAPPINGS`] most recently
/// received ones of at most [`kept_bytes_limit`] bytes in all: memory sent again and again (a
/// pool block of small arrays, weights synchronised each step) is then mapped once, where each
/// new mapping costs an import, a claim of its descriptor from the producer, and a device
/// synchronize when it goes. The memory stays allocated while it is kept (the producer's release
/// does not free it); [`release_kept`] (through `empty_cache`) lets go of them.
fn keep(mapping: &Arc<Mapping>) {
    let limit = kept_bytes_limit();
    if mapping.len > limit {
        return;
    }
    let evicted = {
        let mut kept = imports()
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(at) = kept.iter().position(|m| Arc::ptr_eq(m, mapping)) {
            if let Some(m) = kept.remove(at) {
                kept.push_back(m);
            }
            return;
        }
        kept.push_back(mapping.clone());
        let mut evicted = Vec::new();
        let mut bytes: usize = kept.iter().map(|m| m.len).sum();
        while kept.len() > KEPT_MAPPINGS || bytes > limit {
            let Some(old) = kept.pop_front() else { break };
            bytes -= old.len;
            evicted.push(old);
        }
        evicted
    };
    // Dropped unlocked: a mapping's drop takes the other tables' locks.
    drop(evicted);
}

/// Lets go of the received mappings kept on device `ordinal` past their last buffer (those still
/// in use stay mapped until their buffers go).
pub(crate) fn release_kept(ordinal: i32) {
    let released: std::collections::VecDeque<Arc<Mapping>> = {
        let mut kept = imports()
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (gone, stay) = kept.drain(..).partition(|m| m.ordinal == ordinal);
        *kept = stay;
        gone
    };
    drop(released);
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let table = imports();
        // A mapping of the same allocation made since this one's last buffer went stays listed.
        {
            let mut by_key = table.by_key.lock().unwrap_or_else(PoisonError::into_inner);
            let key = (self.ordinal, self.key);
            if by_key.get(&key).is_some_and(|w| w.strong_count() == 0) {
                by_key.remove(&key);
            }
        }
        table
            .by_addr
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.ptr);
        let Ok(_ctx) = context(self.ordinal) else {
            return;
        };
        // SAFETY: the last buffer of the mapping is gone; work that used it was ordered before
        // its release by the buffer's users.
        unsafe { sys::cuCtxSynchronize() }
            .result()
            .named("cuCtxSynchronize")
            .unwrap_or_else(|e| log::warn!("{e}"));
        // SAFETY: as above.
        unsafe { unmap_and_free(self.ptr, self.len) };
        release(self.handle);
    }
}

/// One buffer's share of a [`Mapping`].
struct Imported(#[allow(dead_code)] Arc<Mapping>);

impl Allocation for Imported {}

/// A buffer over all of `mapping`.
fn buffer_of(device: Device, mapping: Arc<Mapping>) -> Buffer {
    let addr = std::ptr::with_exposed_provenance_mut::<c_void>(mapping.ptr as usize);
    let len = mapping.len;
    // SAFETY: `len` device bytes are mapped read-write at `addr` until the last `Imported` of
    // the mapping is dropped; this buffer holds one.
    unsafe {
        Buffer::from_allocation(
            addr,
            std::ptr::null_mut(),
            len,
            device,
            StorageMode::Private,
            Box::new(Imported(mapping)),
        )
    }
}

/// Maps the VMM allocation `key` of `len` bytes on `device`: the mapping this process already has
/// of that allocation when one lives, else a new import of it from its POSIX descriptor, which
/// `fd` gives (asked only then, with no lock held: a claim from another process waits for it, and
/// its wait may run Python's signal handlers). Two threads that import one allocation at once
/// map it once: the second to finish uses the first one's mapping.
pub(crate) fn import(
    device: Device,
    fd: impl FnOnce() -> Result<OwnedFd>,
    len: usize,
    key: BlockKey,
) -> Result<Buffer> {
    if device.kind() != DeviceKind::Cuda {
        return Err(Error::UnsupportedDevice(format!(
            "a VMM handle of {device}"
        )));
    }
    let ordinal = device.index() as i32;
    let table = imports();
    let mapped = |by_key: &HashMap<(i32, BlockKey), std::sync::Weak<Mapping>>| {
        by_key
            .get(&(ordinal, key))
            .and_then(std::sync::Weak::upgrade)
    };
    let existing = mapped(&table.by_key.lock().unwrap_or_else(PoisonError::into_inner));
    if let Some(mapping) = existing {
        return serve(device, mapping, len);
    }
    let _ctx = context(ordinal)?;
    let g = granularity(ordinal).named("cuMemGetAllocationGranularity")?;
    if len == 0 || len % g != 0 {
        return Err(Error::InvalidArgument(format!(
            "a VMM allocation of {len} bytes is not a multiple of the granularity {g}"
        )));
    }
    let fd = fd()?;
    let mut handle = 0u64;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    let os_handle = std::ptr::without_provenance_mut::<c_void>(fd.as_raw_fd() as usize);
    // SAFETY: for a POSIX descriptor the OS handle is the descriptor's value; `fd` is open.
    unsafe { sys::cuMemImportFromShareableHandle(&mut handle, os_handle, kind) }
        .result()
        .named("cuMemImportFromShareableHandle")?;
    // SAFETY: `handle` is a live allocation of `len` bytes (the exporter's block size).
    let ptr = match unsafe { reserve_and_map(len, handle, ordinal) } {
        Ok(ptr) => ptr,
        Err(e) => {
            release(handle);
            return Err(e);
        }
    };
    let mapping = Arc::new(Mapping {
        ptr,
        len,
        handle,
        ordinal,
        key,
        fd,
    });
    let mut by_key = table.by_key.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(first) = mapped(&by_key) {
        // Another thread mapped the allocation meanwhile: its mapping serves, this one goes
        // (dropped unlocked: a mapping's drop takes the lock).
        drop(by_key);
        drop(mapping);
        return serve(device, first, len);
    }
    by_key.insert((ordinal, key), Arc::downgrade(&mapping));
    // Entries of mappings whose last buffer went while this lock was held elsewhere.
    by_key.retain(|_, w| w.strong_count() > 0);
    drop(by_key);
    table
        .by_addr
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(ptr, Arc::downgrade(&mapping));
    keep(&mapping);
    Ok(buffer_of(device, mapping))
}

/// A buffer over `mapping`, an existing mapping of the allocation a handle of `len` bytes names
/// (called with no lock held: dropping `mapping` on a mismatch may drop the mapping).
fn serve(device: Device, mapping: Arc<Mapping>, len: usize) -> Result<Buffer> {
    if mapping.len != len {
        return Err(Error::InvalidArgument(format!(
            "the handle says its VMM allocation has {len} bytes; this process maps it with {}",
            mapping.len
        )));
    }
    keep(&mapping);
    Ok(buffer_of(device, mapping))
}

/// A buffer exported through a legacy IPC handle, the count of its consumers, and where the
/// buffer starts in the driver's allocation the handle names.
struct Kept {
    buffer: Buffer,
    users: SharedCounter,
    offset: usize,
}

/// Buffers exported through legacy IPC handles: the memory must be neither freed nor reused while
/// a consumer may have it open. Each is kept until its count of consumers is back to zero.
fn legacy_exports() -> std::sync::MutexGuard<'static, Vec<Kept>> {
    static KEPT: OnceLock<Mutex<Vec<Kept>>> = OnceLock::new();
    KEPT.get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// A legacy IPC handle of the driver allocation `buffer` lies in (`cuIpcGetMemHandle`), with the
/// buffer's place in it and a count of consumers set to one. The buffer is kept until the
/// consumer that opens the handle closes it (the count is back to zero): forever, if the handle
/// is never opened or its consumer dies first.
pub(crate) fn export_legacy(buffer: &Buffer) -> Result<LegacyExported> {
    let device = buffer.device();
    let ordinal = device.index() as i32;
    let _ctx = context(ordinal)?;
    // Let go of memory that every consumer has closed.
    legacy_exports().retain(|kept| kept.users.get() > 0);
    let addr = buffer.handle().expose_provenance() as u64;
    let (base, size) = super::driver::address_range(addr).named("cuMemGetAddressRange")?;
    // SAFETY: an all-zero handle is a valid value of this plain C struct.
    let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; `base` is the start of a driver allocation.
    unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }
        .result()
        .map_err(|e| {
            Error::CopyRequired(format!(
                "the driver refuses a legacy IPC handle for this memory ({}); share it with a \
                 copy into shareable memory",
                super::driver::describe(e)
            ))
        })?;
    let users = SharedCounter::new()?;
    users.add(1);
    let users_fd = users.share()?;
    let offset = (addr - base) as usize;
    legacy_exports().push(Kept {
        buffer: buffer.clone(),
        users,
        offset,
    });
    Ok(LegacyExported {
        handle: handle.reserved.map(|b| b as u8),
        users: users_fd,
        len: size,
        offset,
    })
}

/// Opens, in the process that made it, a legacy IPC handle whose count of consumers is `users`
/// (the driver opens such handles only in other processes): the buffer it was made of, and where
/// that buffer starts in the allocation the handle names. The handle's consumer is counted off at
/// once, as this buffer holds the memory itself.
pub(crate) fn open_own_legacy(users: OwnedFd) -> Result<(Buffer, usize)> {
    let users = SharedCounter::open(users)?;
    let inode = users.inode()?;
    let kept = legacy_exports();
    let found = kept
        .iter()
        .find(|k| k.users.get() > 0 && k.users.inode().is_ok_and(|i| i == inode))
        .ok_or_else(|| {
            Error::InvalidArgument(
                "this process made the legacy CUDA IPC handle, but no longer holds its memory \
                 (its consumer count says it was opened and closed already)"
                    .into(),
            )
        })?;
    let out = (found.buffer.clone(), found.offset);
    found.users.add(-1);
    Ok(out)
}

/// Memory opened from a legacy IPC handle, and its producer's count of consumers.
struct LegacyOpened {
    ptr: u64,
    ordinal: i32,
    users: SharedCounter,
}

impl Allocation for LegacyOpened {}

impl Drop for LegacyOpened {
    fn drop(&mut self) {
        let Ok(_ctx) = context(self.ordinal) else {
            return;
        };
        // Work queued on the memory must finish before the producer may reuse it.
        // SAFETY: the device's context is current.
        if let Err(e) = unsafe { sys::cuCtxSynchronize() }
            .result()
            .named("cuCtxSynchronize")
        {
            log::warn!("{e}");
        }
        // SAFETY: `ptr` came from cuIpcOpenMemHandle and the last buffer of it is gone.
        if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.ptr) }
            .result()
            .named("cuIpcCloseMemHandle")
        {
            log::warn!("{e}");
        }
        self.users.add(-1);
    }
}

/// Opens a legacy IPC handle of `len` bytes on `device`. Fails with the driver's error when the
/// producer has exited.
pub(crate) fn open_legacy(
    device: Device,
    handle: &[u8; IPC_HANDLE_BYTES],
    len: usize,
    users: OwnedFd,
) -> Result<Buffer> {
    if device.kind() != DeviceKind::Cuda {
        return Err(Error::UnsupportedDevice(format!(
            "a CUDA IPC handle of {device}"
        )));
    }
    let ordinal = device.index() as i32;
    let _ctx = context(ordinal)?;
    let users = SharedCounter::open(users)?;
    let raw_handle = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut ptr = 0u64;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: valid out-pointer; the driver checks the handle.
    unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, raw_handle, flags) }
        .result()
        .named("cuIpcOpenMemHandle (has the producer exited?)")?;
    let opened = LegacyOpened {
        ptr,
        ordinal,
        users,
    };
    let addr = std::ptr::with_exposed_provenance_mut::<c_void>(ptr as usize);
    // SAFETY: the driver mapped the producer's allocation of `len` bytes at `addr`, valid until
    // `opened` closes it (and while the producer lives, which the module documents).
    Ok(unsafe {
        Buffer::from_allocation(
            addr,
            std::ptr::null_mut(),
            len,
            device,
            StorageMode::Private,
            Box::new(opened),
        )
    })
}

/// An interprocess event (made here or opened from another process), kept while it may be used.
struct IpcEvent(sys::CUevent);

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for IpcEvent {}

/// An IPC event handle's bytes.
type EventHandle = [u8; IPC_HANDLE_BYTES];

/// This process's interprocess events by (device ordinal, stream), with the IPC handle last given
/// for each.
type OwnEvents = HashMap<(i32, usize), (IpcEvent, EventHandle)>;

/// Events of other processes opened here, by (device ordinal, handle).
type OpenedEvents = HashMap<(i32, EventHandle), IpcEvent>;

/// This process's interprocess events, one per (device, stream).
fn own_events() -> std::sync::MutexGuard<'static, OwnEvents> {
    static EVENTS: OnceLock<Mutex<OwnEvents>> = OnceLock::new();
    EVENTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// Records an interprocess event on the calling thread's current stream of `device` and returns
/// its IPC handle. One event per (device, stream) is re-recorded: a consumer that waits on a
/// later record of the same stream waits at least as long as it must, never less.
pub(crate) fn record_event(device: Device) -> Result<[u8; IPC_HANDLE_BYTES]> {
    let ordinal = device.index() as i32;
    let _ctx = context(ordinal)?;
    let stream = current_stream(ordinal);
    let mut events = own_events();
    let entry = match events.entry((ordinal, stream)) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let mut e: sys::CUevent = std::ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
                | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            // SAFETY: valid out-pointer; the context is current.
            unsafe { sys::cuEventCreate(&mut e, flags) }
                .result()
                .named("cuEventCreate")?;
            // The event's IPC handle names the event, not one recording: asked once.
            // SAFETY: an all-zero handle is a valid value of this plain C struct.
            let mut handle: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
            // SAFETY: valid out-pointer; an interprocess event.
            if let Err(err) = unsafe { sys::cuIpcGetEventHandle(&mut handle, e) }
                .result()
                .named("cuIpcGetEventHandle")
            {
                // SAFETY: `e` was just created and is used nowhere else.
                let _ = unsafe { sys::cuEventDestroy_v2(e) };
                return Err(err);
            }
            v.insert((IpcEvent(e), handle.reserved.map(|b| b as u8)))
        }
    };
    let event = entry.0.0;
    // SAFETY: `event` is live (never destroyed); the stream is the thread's current one.
    unsafe { sys::cuEventRecord(event, raw(stream)) }
        .result()
        .named("cuEventRecord")?;
    Ok(entry.1)
}

/// The most events of other processes kept open; past it, all are closed and opened again as
/// needed.
const MAX_OPEN_EVENTS: usize = 256;

/// Makes the calling thread's current stream of `device` wait for an IPC event recorded by
/// [`record_event`] (`cuStreamWaitEvent`, no host synchronize): this process's own event when the
/// handle is one of ours, else the other process's event, opened once and kept (the producer
/// re-records one event per stream, so its handle comes again), which is first queried: one that
/// has completed needs no wait. `same_process`: the handle was made here; if its event is no
/// longer known the device is synchronized instead (the driver does not open a process's own IPC
/// event).
pub(crate) fn wait_event(
    device: Device,
    event: &[u8; IPC_HANDLE_BYTES],
    same_process: bool,
) -> Result<()> {
    static OPENED: OnceLock<Mutex<OpenedEvents>> = OnceLock::new();
    let ordinal = device.index() as i32;
    let _ctx = context(ordinal)?;
    let stream = raw(current_stream(ordinal));
    let own = own_events()
        .iter()
        .find(|((o, _), (_, bytes))| *o == ordinal && bytes == event)
        .map(|(_, (e, _))| e.0);
    if let Some(e) = own {
        // SAFETY: our events are never destroyed; the stream is the thread's current one.
        return unsafe { sys::cuStreamWaitEvent(stream, e, 0) }
            .result()
            .named("cuStreamWaitEvent");
    }
    if same_process {
        return super::super::synchronize(device);
    }
    let mut opened = OPENED
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let e = match opened.get(&(ordinal, *event)) {
        Some(e) => e.0,
        None => {
            if opened.len() >= MAX_OPEN_EVENTS {
                for (_, old) in opened.drain() {
                    // SAFETY: destroying an event after queueing waits on it is allowed; the
                    // waits keep their snapshot. Nothing else holds these events.
                    let _ = unsafe { sys::cuEventDestroy_v2(old.0) };
                }
            }
            let raw_handle = sys::CUipcEventHandle {
                reserved: event.map(|b| b as std::ffi::c_char),
            };
            let mut e: sys::CUevent = std::ptr::null_mut();
            // SAFETY: valid out-pointer; the driver checks the handle.
            let result = unsafe { sys::cuIpcOpenEventHandle(&mut e, raw_handle) }.result();
            if let Err(err) = result {
                return Err(Error::Driver {
                    backend: super::BACKEND,
                    message: super::driver::failed("cuIpcOpenEventHandle", err),
                });
            }
            opened.insert((ordinal, *event), IpcEvent(e));
            e
        }
    };
    // An event that has completed (the producer's work on the memory is done, as it mostly is
    // by the time a handle arrives) needs no wait: a stream's wait on another process's event
    // costs about 0.2 ms even then (H100, CUDA 13), its query a few microseconds. Completion of
    // the event's latest record implies that of the one the handle was made after (one event
    // per producer stream, re-recorded in stream order).
    // SAFETY: `e` is open (kept in `opened`, whose lock is held).
    let done = unsafe { cudarc::driver::result::event::query(e) };
    if super::stream::ready(done, "cuEventQuery")? {
        return Ok(());
    }
    // SAFETY: `e` is open (kept in `opened`, whose lock is held); the stream is the thread's
    // current one.
    unsafe { sys::cuStreamWaitEvent(stream, e, 0) }
        .result()
        .named("cuStreamWaitEvent")
}

/// CUDA's sharing capability ([`Sharing`]): this module's functions behind the backend seam.
pub(crate) struct CudaSharing;

impl Sharing for CudaSharing {
    fn check_device(&self, device: Device) -> Result<()> {
        check_device(device.index() as i32)
    }

    unsafe fn host_register(&self, device: Device, ptr: NonNull<c_void>, len: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { host_register(ptr, len, device.index() as i32) }
    }

    unsafe fn host_unregister(&self, device: Device, ptr: NonNull<c_void>) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { host_unregister(ptr, device.index() as i32) }
    }

    fn pool(&self, device: Device) -> Result<&'static Arc<Pool>> {
        pool(device)
    }

    fn allocate(&self, device: Device, bytes: usize, zeroed: bool) -> Result<Buffer> {
        allocate(device, bytes, zeroed)
    }

    fn is_shared(&self, buffer: &Buffer) -> bool {
        is_shared(buffer)
    }

    fn export(&self, buffer: &Buffer) -> Result<Option<VmmExported>> {
        export(buffer)
    }

    fn export_legacy(&self, buffer: &Buffer) -> Result<LegacyExported> {
        export_legacy(buffer)
    }

    fn import(
        &self,
        device: Device,
        fd: &mut dyn FnMut() -> Result<OwnedFd>,
        len: usize,
        key: BlockKey,
    ) -> Result<Buffer> {
        import(device, fd, len, key)
    }

    fn open_own_legacy(&self, users: OwnedFd) -> Result<(Buffer, usize)> {
        open_own_legacy(users)
    }

    fn open_legacy(
        &self,
        device: Device,
        handle: &[u8; IPC_HANDLE_BYTES],
        len: usize,
        users: OwnedFd,
    ) -> Result<Buffer> {
        open_legacy(device, handle, len, users)
    }

    fn record_event(&self, device: Device) -> Result<[u8; IPC_HANDLE_BYTES]> {
        record_event(device)
    }

    fn wait_event(
        &self,
        device: Device,
        event: &[u8; IPC_HANDLE_BYTES],
        same_process: bool,
    ) -> Result<()> {
        wait_event(device, event, same_process)
    }

    fn release_kept(&self, device: Device) {
        release_kept(device.index() as i32);
    }
}
