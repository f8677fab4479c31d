//! [`Buffer`]: shared ownership of one allocation, ours or a foreign producer's.

use std::any::Any;
use std::ffi::c_void;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, Result};

/// Where an allocation lives relative to the host, in one vocabulary for every backend.
///
/// | mode | CPU | CUDA | Metal |
/// | --- | --- | --- | --- |
/// | `Private` | (reported as `Shared`) | device memory, `kDLCUDA` | `MTLStorageModePrivate` |
/// | `Shared` | host memory | pinned host memory mapped for the device, `kDLCUDAHost` | `MTLStorageModeShared` |
/// | `Managed` | (reported as `Shared`) | managed memory, `kDLCUDAManaged` | `MTLStorageModeManaged` |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StorageMode {
    /// Device-only memory.
    Private,
    /// One allocation visible to host and device.
    Shared,
    /// Memory the driver migrates between host and device.
    Managed,
}

impl StorageMode {
    /// The lower-case name (`private`, `shared`, `managed`).
    pub const fn name(self) -> &'static str {
        match self {
            StorageMode::Private => "private",
            StorageMode::Shared => "shared",
            StorageMode::Managed => "managed",
        }
    }
}

impl std::str::FromStr for StorageMode {
    type Err = Error;

    /// Parses a mode name, ignoring case and surrounding spaces.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "private" => Ok(StorageMode::Private),
            "shared" => Ok(StorageMode::Shared),
            "managed" => Ok(StorageMode::Managed),
            _ => Err(Error::InvalidArgument(format!(
                "unknown storage mode {s:?}: expected private, shared or managed"
            ))),
        }
    }
}

impl fmt::Display for StorageMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Memory dlbridge allocated. Dropping the value returns the memory (to the driver or a pool).
pub trait Allocation: Send + Sync + 'static {
    /// The stream the memory was allocated for, when its release is ordered on one (a pooled
    /// CUDA block): work on other streams that uses the memory must be made visible to that
    /// stream before the memory is released (see `Buffer::allocation_stream`).
    fn stream(&self) -> Option<crate::pool::StreamKey> {
        None
    }
}

/// Who releases the memory when the last [`Buffer`] handle goes away. The payloads are never read:
/// they are held for what their `Drop` does.
#[allow(dead_code)]
enum Owner {
    /// dlbridge's own allocator.
    Own(Box<dyn Allocation>),
    /// A block of one of dlbridge's pools, held inline (no allocation of its own).
    Pooled(crate::pool::PooledBlock),
    /// A foreign producer, kept alive by this value until it is dropped. Foreign memory never
    /// enters a pool: dropping this value only tells the producer we are done.
    Foreign(Box<dyn Any + Send + Sync>),
}

struct Inner {
    /// The handle DLPack hands on as `data`: a host or device address, or an opaque handle
    /// (`id<MTLBuffer>`) that is never offset or dereferenced.
    handle: *mut c_void,
    /// The host address of byte 0, or NULL where the host cannot address the memory.
    host: *mut u8,
    len: usize,
    device: Device,
    storage: StorageMode,
    read_only: bool,
    owner: Owner,
}

// SAFETY: `Inner` holds raw addresses only as plain values; it never dereferences them itself.
// Whoever reads or writes through them (typed access, copies) goes through `Tensor`, which checks
// bounds and read-only-ness. The owner is `Send + Sync` by its bound. DLPack requires a producer's
// deleter to be callable from any thread, which is what dropping a foreign owner does.
unsafe impl Send for Inner {}
// SAFETY: as above: shared references to `Inner` only read its immutable fields.
unsafe impl Sync for Inner {}

/// Shared ownership of one allocation: its handle, length in bytes, device, storage mode, whether
/// it is read-only, and its owner (dlbridge's allocator, or a foreign producer kept alive until
/// the last clone is dropped).
///
/// Cloning is cheap and shares the allocation; views ([`Tensor`](crate::Tensor)s) hold a clone.
#[derive(Clone)]
pub struct Buffer {
    inner: Arc<Inner>,
}

impl Buffer {
    /// Wraps memory dlbridge allocated.
    ///
    /// # Safety
    /// `handle` (and `host`, when non-NULL) must address `len` bytes on `device` that stay valid
    /// until `allocation` is dropped; `host` must be NULL unless the host may read and write those
    /// bytes through it.
    pub(crate) unsafe fn from_allocation(
        handle: *mut c_void,
        host: *mut u8,
        len: usize,
        device: Device,
        storage: StorageMode,
        allocation: Box<dyn Allocation>,
    ) -> Self {
        Self::owned(handle, host, len, device, storage, Owner::Own(allocation))
    }

    /// Wraps a block of one of dlbridge's pools (the common case of [`Buffer::from_allocation`],
    /// without boxing the block).
    ///
    /// # Safety
    /// As for [`Buffer::from_allocation`], with `block` as the allocation.
    #[inline]
    pub(crate) unsafe fn from_pooled(
        handle: *mut c_void,
        host: *mut u8,
        len: usize,
        device: Device,
        storage: StorageMode,
        block: crate::pool::PooledBlock,
    ) -> Self {
        Self::owned(handle, host, len, device, storage, Owner::Pooled(block))
    }

    /// A writable buffer of dlbridge's own memory (the constructors above state its contract).
    #[inline]
    fn owned(
        handle: *mut c_void,
        host: *mut u8,
        len: usize,
        device: Device,
        storage: StorageMode,
        owner: Owner,
    ) -> Self {
        Buffer {
            inner: Arc::new(Inner {
                handle,
                host,
                len,
                device,
                storage,
                read_only: false,
                owner,
            }),
        }
    }

    /// Wraps memory that another library owns. `keep_alive` is dropped (exactly once, on the thread
    /// that drops the last clone) when dlbridge no longer uses the memory.
    ///
    /// # Safety
    /// `handle` (and `host`, when non-NULL) must address `len` bytes on `device` that stay valid
    /// while `keep_alive` lives; `host` must be NULL unless the host may read those bytes through
    /// it (and write them, unless `read_only`).
    pub unsafe fn from_foreign(
        handle: *mut c_void,
        host: *mut u8,
        len: usize,
        device: Device,
        storage: StorageMode,
        read_only: bool,
        keep_alive: Box<dyn Any + Send + Sync>,
    ) -> Self {
        Buffer {
            inner: Arc::new(Inner {
                handle,
                host,
                len,
                device,
                storage,
                read_only,
                owner: Owner::Foreign(keep_alive),
            }),
        }
    }

    /// The handle DLPack exchanges as `data`.
    pub fn handle(&self) -> *mut c_void {
        self.inner.handle
    }

    /// The host address of byte 0, when the host can address the memory.
    pub fn host_ptr(&self) -> Option<NonNull<u8>> {
        NonNull::new(self.inner.host)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Where the memory lives.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// How the memory is shared with the host.
    pub fn storage_mode(&self) -> StorageMode {
        self.inner.storage
    }

    /// Whether writes are forbidden.
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
    }

    /// Whether another library owns the memory.
    pub fn is_foreign(&self) -> bool {
        matches!(self.inner.owner, Owner::Foreign(_))
    }

    /// The stream dlbridge's pool will order this allocation's release on (the stream it was
    /// allocated for), when it has one; `None` for foreign memory and host memory.
    #[cfg_attr(not(cuda), allow(dead_code))] // read by the CUDA backend
    pub(crate) fn allocation_stream(&self) -> Option<crate::pool::StreamKey> {
        match &self.inner.owner {
            Owner::Own(allocation) => allocation.stream(),
            Owner::Pooled(block) => block.stream(),
            Owner::Foreign(_) => None,
        }
    }

    /// The pool block this buffer owns, when it is one (`share::cpu` moves such a block into a
    /// shared file in place; on Linux only).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(crate) fn pooled_block(&self) -> Option<&crate::pool::PooledBlock> {
        match &self.inner.owner {
            Owner::Pooled(block) => Some(block),
            _ => None,
        }
    }

    /// How many handles share this allocation.
    pub fn ref_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// Whether two handles share one allocation.
    pub fn same_allocation(&self, other: &Buffer) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The host address of byte 0, or an error naming `what` when the host cannot address it.
    pub(crate) fn require_host(&self, what: &str) -> Result<NonNull<u8>> {
        self.host_ptr().ok_or_else(|| Error::NotHostAccessible {
            device: self.device(),
            what: what.to_owned(),
        })
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("handle", &self.inner.handle)
            .field("len", &self.inner.len)
            .field("device", &self.inner.device)
            .field("storage", &self.inner.storage)
            .field("read_only", &self.inner.read_only)
            .field("foreign", &self.is_foreign())
            .finish()
    }
}
