//! Shareable host memory: anonymous shared files (`memfd_create` on Linux) mapped into this
//! process, pooled like every other allocation, and mapped again by the processes a handle
//! reaches.
//!
//! | piece | what it is |
//! | --- | --- |
//! | [`pool`] | one caching pool per device (`cpu`, and `cuda_host:N` for pinned shareable memory) over a file allocator |
//! | block | one anonymous file, `ftruncate`d to the block size, sealed at that size (Linux: `F_SEAL_SHRINK`, `F_SEAL_GROW`, `F_SEAL_SEAL`) and mapped `MAP_SHARED`; the pool keeps its descriptor |
//! | [`allocate`] | a [`Buffer`] of a pooled block |
//! | `export` | a duplicate of the descriptor of the block a buffer lies in, and where in the block it starts |
//! | `map` | the receiving side: maps a received descriptor, after checking its seals (a file any holder could truncate is refused); the mapping alone keeps the memory |
//! | `move_in_place` | a block of the ordinary CPU pool moved into a new shared file *at the same addresses* (Linux): what `share_memory` does to host memory dlbridge owns in whole pages |
//!
//! Nothing has a name in the file system, so nothing is left in `/dev/shm` when a process dies:
//! the kernel frees a file when its last descriptor and mapping go. Every process a handle
//! reaches holds a descriptor of the file; the seals are what keeps one of them from cutting the
//! memory from under the others (`ftruncate` fails with `EPERM`).
//!
//! # Reuse of exported blocks
//! A block that was exported must not be handed to a new allocation while another process may
//! still map it. When the buffer of an exported block is dropped, the producer maps a fresh file
//! over the same addresses (`MAP_FIXED`) before the block goes back to the cache: the pool keeps
//! its addresses, the consumers keep the old file, and the old memory is freed by the kernel when
//! the last consumer unmaps it, whichever process goes first. (The fresh file is sealed like
//! every other: nothing resizes a block's file once it is made.)
//!
//! # Moving ordinary memory in place
//! A block of the ordinary CPU pool ([`crate::backend::cpu::pool`]) of at least
//! [`PAGE_ALIGN_THRESHOLD`](crate::backend::cpu::PAGE_ALIGN_THRESHOLD) bytes starts on a page and
//! fills whole pages that no other allocation shares. `move_in_place` writes its bytes into a new
//! sealed shared file and maps the file over the block's own addresses (`MAP_FIXED`, as the reuse
//! above does): every view of the block and every export made of it before (a PyTorch tensor, a
//! NumPy array) keeps its address and now reads and writes the shared memory. The block stays
//! the pool's: when its last buffer goes, the pool asks `release_moved` before caching it, which
//! maps private anonymous pages over it again (the consumers keep the file), so a block that was
//! shared never serves a later allocation. Smaller blocks share pages with other allocations and
//! cannot be moved; nor can memory dlbridge does not own (a foreign producer's).

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use super::Exported;
use super::memfd::{anonymous_file, check_sealed, file_size, map_file, unmap};
#[cfg(target_os = "linux")]
use super::memfd::{map_over, os_error, write_all_at};
use crate::backend::{self, ShareRoute, Sharing};
use crate::buffer::{Allocation, Buffer, StorageMode};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::host::page_size;
use crate::pool::{Pool, PooledBlock, RawAllocator, StreamKey};

/// Faults in every page of `buffer`'s host memory now, in one call (`MADV_POPULATE_WRITE`), for
/// memory about to be written in many small pieces: one fault per page costs microseconds each
/// on a shared file. A hint: kernels before 5.14 refuse it, and the pages then fault as written.
pub(crate) fn prefault(buffer: &Buffer) {
    #[cfg(target_os = "linux")]
    if let Some(ptr) = buffer.host_ptr() {
        let page = page_size();
        let start = ptr.as_ptr().expose_provenance();
        let aligned = start & !(page - 1);
        let len = buffer.len() + (start - aligned);
        // SAFETY: the range lies in this buffer's mapping (rounded down to its page); the advice
        // only populates pages, it never changes their contents.
        let _ = unsafe {
            libc::madvise(
                std::ptr::with_exposed_provenance_mut(aligned),
                len,
                libc::MADV_POPULATE_WRITE,
            )
        };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buffer;
}

/// One pooled block: its file and size, and whether a handle to it was made.
struct Block {
    fd: OwnedFd,
    len: usize,
    exported: bool,
}

/// The blocks of one pool by start address, shared by its allocator and by [`export`].
struct Files {
    /// The device pinned memory is registered with (`cuda_host:N`), if any.
    registered: Option<Registered>,
    blocks: Mutex<BTreeMap<usize, Block>>,
}

impl Files {
    fn blocks(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Block>> {
        self.blocks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a fresh mapping with the CUDA device, for pinned shareable memory.
    fn register(&self, ptr: NonNull<c_void>, len: usize) -> Result<()> {
        match self.registered {
            // SAFETY: `ptr` is a live mapping of `len` bytes of ours, not yet registered.
            Some(r) => unsafe { r.sharing.host_register(r.device, ptr, len) },
            None => Ok(()),
        }
    }

    /// Undoes [`Files::register`].
    fn unregister(&self, ptr: NonNull<c_void>) {
        if let Some(r) = self.registered {
            // SAFETY: `ptr` was registered by `register` and nothing uses it now.
            if let Err(e) = unsafe { r.sharing.host_unregister(r.device, ptr) } {
                log::warn!("{e}");
            }
        }
    }

    /// Gives the block at `addr` a fresh file, leaving the old one to the processes that mapped
    /// it (the module documentation says why).
    fn detach(&self, addr: usize) -> Result<()> {
        let mut blocks = self.blocks();
        let Some(block) = blocks.get_mut(&addr) else {
            return Ok(());
        };
        let fresh = anonymous_file(block.len)?;
        let ptr = NonNull::new(std::ptr::with_exposed_provenance_mut::<c_void>(addr))
            .ok_or_else(|| Error::InvalidArgument("a NULL block".into()))?;
        self.unregister(ptr);
        // SAFETY: the range is the block's mapping; its buffer is being dropped, so nothing
        // reads or writes it.
        unsafe { map_file(&fresh, block.len, Some(ptr)) }?;
        self.register(ptr, block.len)?;
        block.fd = fresh;
        block.exported = false;
        Ok(())
    }
}

/// The driver of a shareable pool: one anonymous file per block.
struct FileAllocator(Arc<Files>);

impl RawAllocator for FileAllocator {
    fn round_size(&self, bytes: usize) -> Option<usize> {
        bytes.max(1).checked_next_multiple_of(page_size())
    }

    fn allocate(&self, bytes: usize, _zeroed: bool) -> Result<NonNull<c_void>> {
        let len = self
            .round_size(bytes)
            .ok_or_else(|| crate::error::overflow("block size"))?;
        if len > crate::backend::cpu::host_memory_bytes() {
            return Err(Error::OutOfMemory {
                bytes,
                device: Device::CPU,
                detail: ": more than this machine's memory and swap".into(),
            });
        }
        // A new file reads as zeros: `zeroed` needs nothing more.
        let fd = anonymous_file(len)?;
        // SAFETY: no fixed address.
        let ptr = unsafe { map_file(&fd, len, None) }?;
        if let Err(e) = self.0.register(ptr, len) {
            // SAFETY: the mapping was just made and is not handed out.
            unsafe { unmap(ptr, len) };
            return Err(e);
        }
        let block = Block {
            fd,
            len,
            exported: false,
        };
        self.0
            .blocks()
            .insert(ptr.as_ptr().expose_provenance(), block);
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: NonNull<c_void>, _bytes: usize) {
        let Some(block) = self.0.blocks().remove(&ptr.as_ptr().expose_provenance()) else {
            return;
        };
        self.0.unregister(ptr);
        // SAFETY: by the caller's contract the block is no longer used; it is our mapping of
        // `block.len` bytes. The descriptor closes when `block` drops.
        unsafe { unmap(ptr, block.len) };
    }

    unsafe fn zero(
        &self,
        ptr: NonNull<c_void>,
        bytes: usize,
        _stream: Option<StreamKey>,
    ) -> Result<()> {
        // SAFETY: by the caller's contract `ptr` addresses `bytes` bytes of a live block nobody
        // else touches during the fill.
        unsafe { ptr.cast::<u8>().write_bytes(0, bytes) };
        Ok(())
    }
}

/// The device a shared file's mappings are registered with (pinned memory, `cuda_host:N`) and
/// its backend's sharing capability, which registers them.
#[derive(Clone, Copy)]
struct Registered {
    device: Device,
    sharing: &'static dyn Sharing,
}

/// How shared files of `device` are mapped: `None` for plain host memory, the registration for a
/// kind whose facts say its files are registered with the device (which must exist); an error for
/// kinds without shareable host memory.
fn registration(device: Device) -> Result<Option<Registered>> {
    match backend::facts(device.kind()).map(|f| f.sharing) {
        Some(ShareRoute::HostFile { registered: false }) => Ok(None),
        Some(ShareRoute::HostFile { registered: true }) => {
            let sharing = backend::sharing(device)?;
            sharing.check_device(device)?;
            Ok(Some(Registered { device, sharing }))
        }
        _ => Err(Error::UnsupportedDevice(format!(
            "shareable host memory lives on cpu or cuda_host, not {device}"
        ))),
    }
}

/// A pool and its blocks.
struct Shareable {
    pool: Arc<Pool>,
    files: Arc<Files>,
}

/// The shareable pool of `device` (`cpu`, or `cuda_host:N` for pinned shareable memory).
fn shareable(device: Device) -> Result<&'static Shareable> {
    static POOLS: OnceLock<Mutex<HashMap<Device, &'static Shareable>>> = OnceLock::new();
    // Fails with a clear error where CUDA is missing or the device does not exist.
    let registered = registration(device)?;
    let pools = POOLS.get_or_init(Mutex::default);
    let mut pools = pools.lock().unwrap_or_else(PoisonError::into_inner);
    Ok(*pools.entry(device).or_insert_with(|| {
        let files = Arc::new(Files {
            registered,
            blocks: Mutex::default(),
        });
        let pool = Pool::new(device, StorageMode::Shared, FileAllocator(files.clone()));
        Box::leak(Box::new(Shareable { pool, files }))
    }))
}

/// The caching pool of shareable memory on `device` (`cpu` or `cuda_host:N`).
pub(crate) fn pool(device: Device) -> Result<&'static Arc<Pool>> {
    Ok(&shareable(device)?.pool)
}

/// A pooled block whose release first detaches it from other processes if it was exported.
struct SharedBlock {
    block: Option<PooledBlock>,
    files: Arc<Files>,
}

impl Allocation for SharedBlock {}

impl Drop for SharedBlock {
    fn drop(&mut self) {
        let Some(block) = self.block.take() else {
            return;
        };
        let addr = block.as_ptr().as_ptr().expose_provenance();
        let exported = self.files.blocks().get(&addr).is_some_and(|b| b.exported);
        if exported && let Err(e) = self.files.detach(addr) {
            // Another process may still map this memory: it must not be reused. Keeping it
            // out of the pool for the rest of the process is the safe answer.
            log::warn!("a shared block could not be detached and is kept: {e}");
            std::mem::forget(block);
            return;
        }
        drop(block);
    }
}

/// Allocates `bytes` of shareable host memory on `device` (`cpu` or `cuda_host:N`) from its
/// pool; the memory reads as zeros when `zeroed`.
pub(crate) fn allocate(device: Device, bytes: usize, zeroed: bool) -> Result<Buffer> {
    let shared = shareable(device)?;
    let block = shared.pool.allocate_static(bytes.max(1), None, zeroed)?;
    let ptr = block.as_ptr().as_ptr();
    let boxed = Box::new(SharedBlock {
        block: Some(block),
        files: shared.files.clone(),
    });
    // SAFETY: the block holds at least `bytes` bytes of host memory mapped read-write at `ptr`
    // until the boxed block is dropped; pinned blocks are registered with the device, so the
    // same address serves both.
    Ok(unsafe {
        Buffer::from_allocation(
            ptr,
            ptr.cast::<u8>(),
            bytes,
            device,
            StorageMode::Shared,
            boxed,
        )
    })
}

/// The files this process mapped with [`map`], by address: a received array can be shared on
/// (to a third process) without a copy.
fn mappings() -> std::sync::MutexGuard<'static, BTreeMap<usize, (usize, OwnedFd)>> {
    static MAPPINGS: OnceLock<Mutex<BTreeMap<usize, (usize, OwnedFd)>>> = OnceLock::new();
    MAPPINGS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The one lookup of every registry: the `(start, len, fd)` of the file range that holds
/// `[addr, addr + len)`, if any.
fn find<'a>(
    mut map: impl DoubleEndedIterator<Item = (&'a usize, usize, &'a OwnedFd)>,
    addr: usize,
    len: usize,
) -> Option<(usize, usize, &'a OwnedFd)> {
    let (&start, size, fd) = map.next_back()?;
    (addr - start).checked_add(len).filter(|&end| end <= size)?;
    Some((start, size, fd))
}

/// Runs `f` on the shared file `buffer` lies in: a file this process mapped from a handle, a CPU
/// pool block moved into a file in place, or a block of this process's shareable pool (then with
/// that block's `exported` mark, for `f` to set). `f` gets the descriptor and the start address
/// and size of the file's mapping. `None` when the buffer lies in no shared file.
fn locate<R>(
    buffer: &Buffer,
    f: impl FnOnce(&OwnedFd, usize, usize, Option<&mut bool>) -> R,
) -> Option<R> {
    let addr = buffer.handle().expose_provenance();
    let len = buffer.len();
    {
        let mapped = mappings();
        let range = mapped.range(..=addr).map(|(k, (len, fd))| (k, *len, fd));
        if let Some((start, size, fd)) = find(range, addr, len) {
            return Some(f(fd, start, size, None));
        }
    }
    if buffer.device().is_cpu() && MOVED_BLOCKS.load(Ordering::Acquire) > 0 {
        let moved = moved();
        let range = moved.range(..=addr).map(|(k, b)| (k, b.len, &b.fd));
        if let Some((start, size, fd)) = find(range, addr, len) {
            return Some(f(fd, start, size, None));
        }
    }
    let shared = shareable(buffer.device()).ok()?;
    let mut blocks = shared.files.blocks();
    let range = blocks.range(..=addr).map(|(k, b)| (k, b.len, &b.fd));
    let (start, size, _) = find(range, addr, len)?;
    let block = blocks.get_mut(&start)?;
    Some(f(&block.fd, start, size, Some(&mut block.exported)))
}

/// Whether `buffer` lies in a shared file (see `locate`): memory another process can map.
pub(crate) fn is_shared(buffer: &Buffer) -> bool {
    locate(buffer, |_, _, _, _| ()).is_some()
}

/// A new descriptor of the shared file `buffer` lies in (see `locate`), with the buffer's place
/// in it; a block of the shareable pool is marked exported. `None` when the buffer is not in a
/// shared file.
pub(crate) fn export(buffer: &Buffer) -> Result<Option<Exported>> {
    let addr = buffer.handle().expose_provenance();
    locate(buffer, |fd, start, len, exported| {
        let fd = fd.try_clone().map_err(|e| Error::Driver {
            backend: "CPU",
            message: format!("dup of a shared file failed: {e}"),
        })?;
        if let Some(exported) = exported {
            *exported = true;
        }
        Ok(Exported {
            fd,
            len,
            offset: addr - start,
        })
    })
    .transpose()
}

/// CPU pool blocks moved into a shared file in place (`move_in_place`), by address: the file
/// mapped over each block's pages, kept to share the block and closed when the block goes back to
/// the pool (the consumers keep their own descriptors and mappings).
fn moved() -> std::sync::MutexGuard<'static, BTreeMap<usize, Block>> {
    static MOVED: OnceLock<Mutex<BTreeMap<usize, Block>>> = OnceLock::new();
    MOVED
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// How many blocks `moved` holds: while it is zero, the lookups skip `moved`'s lock (every
/// release of a large CPU pool block asks `release_moved`).
static MOVED_BLOCKS: AtomicUsize = AtomicUsize::new(0);

/// Moves the CPU pool block `buffer` owns into a new sealed shared file *in place* (see the
/// module documentation): its bytes are written to the file and the file is mapped over the
/// block's own pages, so that every view and export of the buffer, made before or after, sees the
/// shared memory at the same address. `Ok(false)`, with nothing done, for memory that cannot be
/// moved so: not a block of the CPU pool (foreign memory, a mapped file, another device), a block
/// smaller than [`PAGE_ALIGN_THRESHOLD`](crate::backend::cpu::PAGE_ALIGN_THRESHOLD) (it shares
/// pages with other allocations), or a system other than Linux. `Ok(true)` also when the block
/// was moved already.
///
/// Writes made to the block by other threads while it moves may be lost (between the copy and
/// the remap): safe Rust cannot make them (mutable access needs the only handle of a buffer, and
/// the caller holds one); writers through raw pointers must not run meanwhile.
pub(crate) fn move_in_place(buffer: &Buffer) -> Result<bool> {
    #[cfg(target_os = "linux")]
    {
        let Some(block) = buffer.pooled_block() else {
            return Ok(false);
        };
        let pool = crate::backend::cpu::pool();
        let page = page_size();
        let start = block.as_ptr();
        let len = block.block_size();
        let addr = start.as_ptr().expose_provenance();
        let ours = std::ptr::eq(block.pool(), &**pool)
            && buffer.device() == Device::CPU
            && buffer.host_ptr().map(|p| p.as_ptr().cast::<c_void>()) == Some(start.as_ptr())
            && len >= crate::backend::cpu::PAGE_ALIGN_THRESHOLD
            && len % page == 0
            && addr % page == 0;
        if !ours {
            return Ok(false);
        }
        let mut moved = moved();
        if moved.contains_key(&addr) {
            return Ok(true);
        }
        let fd = anonymous_file(len)?;
        // SAFETY: the buffer's `len()` bytes from `start` are its live host memory (the caller's
        // handle keeps them), readable for the copy; nothing writes them meanwhile (see above).
        let bytes =
            unsafe { std::slice::from_raw_parts(start.as_ptr().cast::<u8>(), buffer.len()) };
        write_all_at(&fd, bytes)?;
        // From the first block moved on, the pool asks each released block whether it was moved.
        pool.set_release_check(release_moved);
        // SAFETY: `[start, start + len)` is the whole of a CPU pool block (page-aligned, whole
        // pages no other allocation shares: see `allocation_layout`), owned by `buffer`, which
        // the caller holds, so it stays allocated; its bytes are in the file now, so the mapping
        // that replaces the old pages holds the same contents.
        unsafe { map_over(&fd, start, len) }?;
        moved.insert(
            addr,
            Block {
                fd,
                len,
                exported: false,
            },
        );
        MOVED_BLOCKS.fetch_add(1, Ordering::Release);
        Ok(true)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = buffer;
        Ok(false)
    }
}

/// The CPU pool's release check (`Pool::set_release_check`): a released block that was moved
/// into a shared file gets private anonymous pages at its addresses again before the pool may
/// hand it to another allocation (other processes may still map the file: they keep it, this
/// process lets go of it). `false`, keeping the block out of the pool, where that mapping fails.
#[cfg(target_os = "linux")]
fn release_moved(ptr: NonNull<c_void>, size: usize) -> bool {
    if size < crate::backend::cpu::PAGE_ALIGN_THRESHOLD || MOVED_BLOCKS.load(Ordering::Acquire) == 0
    {
        return true;
    }
    let addr = ptr.as_ptr().expose_provenance();
    let Some(block) = moved().remove(&addr) else {
        return true;
    };
    MOVED_BLOCKS.fetch_sub(1, Ordering::Release);
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: the range is the whole block the pool is taking back: its last buffer is gone, so
    // nothing in this process reads or writes it; fresh private pages replace the file's.
    let back = unsafe { libc::mmap(ptr.as_ptr(), block.len, prot, flags, -1, 0) };
    if back == libc::MAP_FAILED {
        log::warn!(
            "{}: a CPU block that was shared with other processes is kept out of the pool",
            os_error("mmap of private pages over a shared block")
        );
        return false;
    }
    true
}

/// A mapping of a received file; unmapping it is this process's release of the memory.
struct Mapping {
    ptr: NonNull<c_void>,
    len: usize,
    registered: Option<Registered>,
}

// SAFETY: the mapping is plain shared memory; the address is only a value here, and munmap may
// be called from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared references read nothing through the address.
unsafe impl Sync for Mapping {}

impl Allocation for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        mappings().remove(&self.ptr.as_ptr().expose_provenance());
        if let Some(r) = self.registered {
            // SAFETY: registered by `map`; the last buffer handle is gone.
            if let Err(e) = unsafe { r.sharing.host_unregister(r.device, self.ptr) } {
                log::warn!("{e}");
            }
        }
        // SAFETY: `map` made this mapping of `len` bytes, and the last buffer of it is gone.
        unsafe { unmap(self.ptr, self.len) };
    }
}

/// Maps `len` bytes of a received shareable file on `device` (`cpu` or `cuda_host:N`). The
/// mapping keeps the memory; the descriptor is kept beside it so that the array can be shared on,
/// and closed when the mapping goes.
pub(crate) fn map(fd: OwnedFd, len: usize, device: Device) -> Result<Buffer> {
    let registered = registration(device)?;
    // Sealed first: then the size read next is the size for good.
    check_sealed(&fd)?;
    let size = file_size(&fd)?;
    if size < len || len == 0 {
        return Err(Error::InvalidArgument(format!(
            "the shared file holds {size} bytes but the handle describes {len}"
        )));
    }
    // SAFETY: no fixed address.
    let ptr = unsafe { map_file(&fd, len, None) }?;
    let mapping = Mapping {
        ptr,
        len,
        registered,
    };
    if let Some(r) = registered {
        // SAFETY: a fresh mapping of `len` bytes; dropping `mapping` on failure unmaps it, and
        // unregistering memory that was never registered only reports an error.
        unsafe { r.sharing.host_register(r.device, ptr, len) }?;
    }
    mappings().insert(ptr.as_ptr().expose_provenance(), (len, fd));
    let storage = StorageMode::Shared;
    let host = ptr.as_ptr().cast::<u8>();
    // SAFETY: `len` bytes are mapped read-write at `ptr` until `mapping` is dropped with the
    // last buffer handle.
    Ok(unsafe {
        Buffer::from_allocation(ptr.as_ptr(), host, len, device, storage, Box::new(mapping))
    })
}
