//! DLPack exchange: importing foreign tensors (consumer side) and exporting ours (producer side).
//!
//! # Import
//! A foreign `DLManagedTensor[Versioned]` is trusted for nothing but its deleter. Ownership passes
//! to dlbridge the moment an import function is called: whatever the outcome, the producer's
//! deleter runs exactly once, on the thread that drops the last reference (immediately, when the
//! import fails). The checks, in order:
//!
//! 1. the major version is 1 (versioned tensors);
//! 2. `0 <= ndim <=` [`MAX_NDIM`](crate::layout::MAX_NDIM), `shape` non-NULL when `ndim > 0`, every
//!    extent non-negative, the element count fits in `isize`;
//! 3. `strides` non-NULL when `ndim > 0`, except from producers older than DLPack 1.2, for which
//!    NULL means compact row-major;
//! 4. the dtype and device type are ones DLPack defines (any device is held; only known ones are
//!    used);
//! 5. every addressed byte lies in a range that does not overflow and, for opaque handles (Metal),
//!    does not start before the handle; `data` is NULL only for zero-size tensors;
//! 6. packed sub-byte tensors are compact.
//!
//! The result points at the producer's memory (no copy), keeps the producer alive, and carries
//! `READ_ONLY`, which dlbridge enforces.
//!
//! # Export
//! Strides are always emitted. For addressable memory (host and CUDA pointers) `data` points at
//! the first element and `byte_offset` is 0, the form every consumer understands; for opaque
//! handles (`id<MTLBuffer>`) `data` is the handle itself and the view's offset goes in
//! `byte_offset`. The exported struct holds a reference to the buffer; its deleter releases exactly
//! that, from any thread, and never unwinds.

pub mod ffi;

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;

use crate::buffer::{Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{self, Layout, MAX_NDIM};
use crate::tensor::Tensor;
use ffi::{
    DLManagedTensor, DLManagedTensorVersioned, DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED, DLPACK_FLAG_BITMASK_READ_ONLY, DLPackVersion,
    DLTensor,
};

/// The DLPack version dlbridge produces.
pub const VERSION: DLPackVersion = DLPackVersion {
    major: ffi::DLPACK_MAJOR_VERSION,
    minor: ffi::DLPACK_MINOR_VERSION,
};

/// The first minor version in which `strides` may not be NULL for `ndim > 0`.
const STRIDES_REQUIRED_SINCE: DLPackVersion = DLPackVersion { major: 1, minor: 2 };

/// A foreign managed tensor of either flavour, owned until dropped; dropping it calls the
/// producer's deleter exactly once.
trait Managed {
    /// # Safety
    /// `this` must be a live managed tensor owned by the caller.
    unsafe fn tensor<'a>(this: NonNull<Self>) -> &'a DLTensor;
    /// # Safety
    /// As [`Managed::tensor`]; the tensor must not be used afterwards.
    unsafe fn delete(this: NonNull<Self>);
}

impl Managed for DLManagedTensorVersioned {
    unsafe fn tensor<'a>(this: NonNull<Self>) -> &'a DLTensor {
        // SAFETY: the caller guarantees `this` is live.
        unsafe { &(*this.as_ptr()).dl_tensor }
    }
    unsafe fn delete(this: NonNull<Self>) {
        // SAFETY: the caller guarantees `this` is live.
        let deleter = unsafe { (*this.as_ptr()).deleter };
        if let Some(deleter) = deleter {
            // SAFETY: the caller owns `this` and gives it up; the deleter is the producer's own.
            unsafe { deleter(this.as_ptr()) };
        }
    }
}

impl Managed for DLManagedTensor {
    unsafe fn tensor<'a>(this: NonNull<Self>) -> &'a DLTensor {
        // SAFETY: the caller guarantees `this` is live.
        unsafe { &(*this.as_ptr()).dl_tensor }
    }
    unsafe fn delete(this: NonNull<Self>) {
        // SAFETY: the caller guarantees `this` is live.
        let deleter = unsafe { (*this.as_ptr()).deleter };
        if let Some(deleter) = deleter {
            // SAFETY: the caller owns `this` and gives it up; the deleter is the producer's own.
            unsafe { deleter(this.as_ptr()) };
        }
    }
}

/// Releases a managed tensor: calls its deleter, if it has one.
///
/// # Safety
/// `managed` must be live and owned by the caller, who gives it up.
pub unsafe fn release_versioned(managed: NonNull<DLManagedTensorVersioned>) {
    // SAFETY: forwarded.
    unsafe { DLManagedTensorVersioned::delete(managed) }
}

/// Releases a legacy managed tensor: calls its deleter, if it has one.
///
/// # Safety
/// `managed` must be live and owned by the caller, who gives it up.
pub unsafe fn release_legacy(managed: NonNull<DLManagedTensor>) {
    // SAFETY: forwarded.
    unsafe { DLManagedTensor::delete(managed) }
}

/// How many tables an exchange-table chain ([`ffi::DLPackExchangeAPIHeader::prev_api`]) is followed
/// through before the walk gives up: a producer publishes one table per DLPack major version, so
/// a longer chain is a broken (or looping) one.
pub const EXCHANGE_CHAIN_LIMIT: usize = 16;

/// The first table of DLPack major version 1 in the exchange-table chain starting at `header`, if
/// it is complete enough to import through (`managed_tensor_from_py_object_no_sync` set). The walk
/// follows at most [`EXCHANGE_CHAIN_LIMIT`] links, so a chain that loops (or is absurdly long)
/// ends it with `None` rather than spinning.
///
/// # Safety
/// `header` is NULL or points to a readable `DLPackExchangeAPIHeader`, each `prev_api` link of
/// which is NULL or points to another, for the first [`EXCHANGE_CHAIN_LIMIT`] links; a header of
/// major version 1 starts a whole [`ffi::DLPackExchangeAPI`]. All of them stay alive and unchanged
/// for `'a` (DLPack 1.3 asks producers to keep their tables for the whole process).
pub unsafe fn exchange_table_v1<'a>(
    header: *const ffi::DLPackExchangeAPIHeader,
) -> Option<&'a ffi::DLPackExchangeAPI> {
    let mut header = header;
    for _ in 0..EXCHANGE_CHAIN_LIMIT {
        // SAFETY: NULL or a live header, by the caller's contract.
        let h = unsafe { header.as_ref() }?;
        if h.version.major == ffi::DLPACK_MAJOR_VERSION {
            // SAFETY: a major-1 header starts a whole table, alive for `'a`.
            let api = unsafe { &*header.cast::<ffi::DLPackExchangeAPI>() };
            return api
                .managed_tensor_from_py_object_no_sync
                .is_some()
                .then_some(api);
        }
        header = h.prev_api;
    }
    None
}

/// Keeps a foreign producer's tensor alive; its drop is the one place the deleter runs.
struct ForeignTensor<M: Managed> {
    managed: NonNull<M>,
}

// SAFETY: DLPack requires a producer's deleter to be callable from any thread (Python producers
// take the GIL inside it), and this value does nothing else with the pointer.
unsafe impl<M: Managed> Send for ForeignTensor<M> {}
// SAFETY: shared references to `ForeignTensor` give no access to the pointer at all.
unsafe impl<M: Managed> Sync for ForeignTensor<M> {}

impl<M: Managed> Drop for ForeignTensor<M> {
    fn drop(&mut self) {
        // SAFETY: this value owns the managed tensor (given up by the producer at import) and
        // drops once, so the deleter runs exactly once.
        unsafe { M::delete(self.managed) };
    }
}

/// Reads `n` values from a foreign array pointer.
///
/// # Safety
/// `ptr` must be valid for `n` reads of `i64` (the caller checked it is non-NULL).
unsafe fn read_i64s(ptr: *const i64, n: usize) -> layout::Dims<i64> {
    (0..n)
        // SAFETY: within the `n` readable values; unaligned because foreign pointers promise
        // nothing.
        .map(|i| unsafe { ptr.wrapping_add(i).read_unaligned() })
        .collect()
}

/// Validates `dl` and builds a tensor over the producer's memory, owned by `owner`.
///
/// # Safety
/// `dl` must be the descriptor of the live tensor `owner` keeps alive.
unsafe fn import<M: Managed + 'static>(
    dl: &DLTensor,
    owner: ForeignTensor<M>,
    version: Option<DLPackVersion>,
    flags: u64,
) -> Result<Tensor> {
    let ndim = usize::try_from(dl.ndim)
        .ok()
        .filter(|&n| n <= MAX_NDIM)
        .ok_or_else(|| {
            Error::MalformedTensor(format!("ndim {} is outside 0..={MAX_NDIM}", dl.ndim))
        })?;
    let device = Device::from_dlpack(dl.device)?;
    if let DeviceKind::Other(raw) = device.kind() {
        if !(1..=ffi::K_DL_TRN).contains(&raw) || matches!(raw, 5 | 6) {
            return Err(Error::UnsupportedDevice(format!(
                "DLPack device type {raw} is not defined by DLPack {}.{}",
                VERSION.major, VERSION.minor
            )));
        }
    }
    let dtype = DType::from_dlpack(dl.dtype)?;
    if ndim > 0 && dl.shape.is_null() {
        return Err(Error::MalformedTensor(format!(
            "shape is NULL with ndim {ndim}"
        )));
    }
    let raw_shape = if ndim > 0 {
        // SAFETY: non-NULL (checked) and, by the DLPack contract, `ndim` entries long.
        unsafe { read_i64s(dl.shape, ndim) }
    } else {
        layout::Dims::new()
    };
    let mut shape = layout::Dims::<usize>::with_capacity(ndim);
    for (axis, &d) in raw_shape.iter().enumerate() {
        let d = usize::try_from(d).map_err(|_| {
            Error::MalformedTensor(format!("extent {d} of axis {axis} is negative"))
        })?;
        shape.push(d);
    }
    let strides: layout::Dims<isize> = if dl.strides.is_null() {
        if ndim > 0 && version.is_some_and(|v| v >= STRIDES_REQUIRED_SINCE) {
            let v = version.unwrap_or(VERSION);
            return Err(Error::MalformedTensor(format!(
                "strides is NULL, which DLPack {}.{} no longer allows for ndim > 0",
                v.major, v.minor
            )));
        }
        layout::Dims::from_slice(Layout::contiguous(&shape)?.strides())
    } else {
        let raw = if ndim > 0 {
            // SAFETY: non-NULL and, by the DLPack contract, `ndim` entries long.
            unsafe { read_i64s(dl.strides, ndim) }
        } else {
            layout::Dims::new()
        };
        raw.into_iter()
            .map(|s| isize::try_from(s).map_err(|_| crate::error::overflow("stride")))
            .collect::<Result<_>>()?
    };
    let offset = usize::try_from(dl.byte_offset)
        .ok()
        .filter(|&o| o <= isize::MAX as usize)
        .ok_or_else(|| crate::error::overflow(format!("byte_offset {}", dl.byte_offset)))?;
    let packed = dtype.is_sub_byte() && flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED == 0;
    let read_only = flags & DLPACK_FLAG_BITMASK_READ_ONLY != 0;
    let layout = Layout::new(&shape, &strides, offset)?;
    let numel = layout.numel();
    if numel > 0 && dl.data.is_null() {
        return Err(Error::MalformedTensor(format!(
            "data is NULL for a tensor of {numel} elements"
        )));
    }
    // The addressed range relative to `data`; this may start below `data + byte_offset` (negative
    // strides) and, for addressable memory, even below `data`.
    let (lo, hi) = match layout.element_extent() {
        None => (0i128, 0i128),
        Some(_) if packed => {
            if !layout.is_contiguous() {
                return Err(Error::MalformedTensor(format!(
                    "packed sub-byte {dtype} tensor with non-compact strides {:?}",
                    layout.strides()
                )));
            }
            (0, (numel as i128 * dtype.bits() as i128 + 7) / 8)
        }
        Some((lo, hi)) => layout::extent_bytes(lo, hi, dtype.itemsize()).ok_or_else(|| {
            crate::error::overflow(format!(
                "extent of shape {:?} with strides {:?}",
                layout.shape(),
                layout.strides()
            ))
        })?,
    };
    if hi - lo > isize::MAX as i128 {
        return Err(crate::error::overflow(format!(
            "extent of shape {:?} with strides {:?}",
            layout.shape(),
            layout.strides()
        )));
    }
    let first = offset as i128;
    let storage = match device.kind() {
        DeviceKind::Cpu | DeviceKind::CudaHost => StorageMode::Shared,
        DeviceKind::CudaManaged => StorageMode::Managed,
        _ => StorageMode::Private,
    };
    let keep_alive: Box<dyn std::any::Any + Send + Sync> = Box::new(owner);
    let (buffer, layout) = if device.kind().is_addressable() {
        // Rebase onto the lowest addressed byte, so the buffer is exactly the addressed range.
        let base = dl.data as usize as i128 + first + lo;
        let end = dl.data as usize as i128 + first + hi;
        // User-space pointers (host and CUDA alike) lie in the lower half of the address space;
        // a range reaching past `isize::MAX` wrapped or names kernel addresses.
        if numel > 0 && (base <= 0 || end > isize::MAX as i128) {
            return Err(Error::MalformedTensor(format!(
                "data {:p} with byte_offset {offset} and strides {:?} addresses memory outside \
                 the user address space",
                dl.data,
                layout.strides()
            )));
        }
        let (base, len) = if numel == 0 {
            let first = (dl.data as usize)
                .checked_add(offset)
                .filter(|&a| a <= isize::MAX as usize)
                .ok_or_else(|| {
                    Error::MalformedTensor(format!(
                        "data {:p} with byte_offset {offset} lies outside the user address space",
                        dl.data
                    ))
                })?;
            (first, 0)
        } else {
            (base as usize, (hi - lo) as usize)
        };
        if len > 0 {
            crate::backend::validate_foreign(device, base, len)?;
        }
        let handle = std::ptr::with_exposed_provenance_mut::<c_void>(base);
        let host = match device.kind().is_host_accessible() {
            false => std::ptr::null_mut(),
            // A zero-size tensor may have a NULL `data`; no byte is ever read through it, but host
            // access should still succeed (with no elements), so give it a non-NULL address.
            true if handle.is_null() => std::ptr::without_provenance_mut::<u8>(64),
            true => handle.cast::<u8>(),
        };
        // SAFETY: the producer guarantees the tensor's elements are valid memory on `device` while
        // its managed tensor lives, which `keep_alive` ensures; `[base, base + len)` is exactly
        // the bytes the elements occupy; `host` is set only for host-accessible device kinds.
        let buffer = unsafe {
            Buffer::from_foreign(handle, host, len, device, storage, read_only, keep_alive)
        };
        let first_elem = (-lo) as usize;
        (
            buffer,
            layout.with_byte_offset(if numel == 0 { 0 } else { first_elem }),
        )
    } else {
        // An opaque handle: never offset it; offsets stay relative to the handle.
        if first + lo < 0 {
            return Err(Error::OutOfBounds(format!(
                "byte_offset {offset} with strides {:?} reaches before the start of the {device} \
                 buffer",
                layout.strides()
            )));
        }
        let len = usize::try_from(first + hi).map_err(|_| crate::error::overflow("extent"))?;
        // SAFETY: the handle is only ever handed back out, never dereferenced by generic code;
        // `host` is NULL; the producer keeps the handle valid while `keep_alive` lives.
        let buffer = unsafe {
            Buffer::from_foreign(
                dl.data,
                std::ptr::null_mut(),
                len,
                device,
                storage,
                read_only,
                keep_alive,
            )
        };
        (buffer, layout)
    };
    Tensor::with_packing(buffer, dtype, layout, packed)
}

impl Tensor {
    /// Imports a versioned DLPack tensor without copying, taking ownership of it.
    ///
    /// On success the tensor keeps the producer alive until the last view is dropped; on failure the
    /// producer's deleter has already run. See the [module documentation](self) for the checks.
    ///
    /// # Safety
    /// `managed` must point to a live `DLManagedTensorVersioned` whose ownership the caller gives
    /// up, and whose descriptor is readable as DLPack specifies (the descriptor's *values* are
    /// checked; its pointers cannot be).
    pub unsafe fn from_dlpack_versioned(
        managed: NonNull<DLManagedTensorVersioned>,
    ) -> Result<Tensor> {
        let owner = ForeignTensor { managed };
        // SAFETY: live, owned by `owner` from here on.
        let header = unsafe { &*managed.as_ptr() };
        let (version, flags) = (header.version, header.flags);
        if version.major != ffi::DLPACK_MAJOR_VERSION {
            return Err(Error::UnsupportedVersion {
                major: version.major,
                minor: version.minor,
            });
        }
        // SAFETY: `managed` is live while `owner` lives, and `owner` moves into the tensor.
        let dl = unsafe { DLManagedTensorVersioned::tensor(managed) };
        // SAFETY: `dl` belongs to the tensor `owner` keeps alive.
        unsafe { import(dl, owner, Some(version), flags) }
    }

    /// Imports a legacy (unversioned) DLPack tensor without copying, taking ownership of it.
    ///
    /// # Safety
    /// As [`Tensor::from_dlpack_versioned`], for a `DLManagedTensor`.
    pub unsafe fn from_dlpack_legacy(managed: NonNull<DLManagedTensor>) -> Result<Tensor> {
        let owner = ForeignTensor { managed };
        // SAFETY: `managed` is live while `owner` lives, and `owner` moves into the tensor.
        let dl = unsafe { DLManagedTensor::tensor(managed) };
        // SAFETY: `dl` belongs to the tensor `owner` keeps alive.
        unsafe { import(dl, owner, None, 0) }
    }

    /// The `data` and `byte_offset` DLPack hands out for this view.
    fn dlpack_address(&self) -> (*mut c_void, u64) {
        let handle = self.buffer().handle();
        if self.device().kind().is_addressable() {
            (
                handle.cast::<u8>().wrapping_add(self.byte_offset()).cast(),
                0,
            )
        } else {
            (handle, self.byte_offset() as u64)
        }
    }

    /// Exports a versioned DLPack tensor that holds a reference to this view's buffer.
    ///
    /// `version` is the version written into the struct (dlbridge's own, or a lower 1.x minor a
    /// consumer asked for). `is_copied` sets `IS_COPIED`. Free the result with its deleter (or
    /// hand it to a consumer, which will).
    pub fn to_dlpack_versioned(
        &self,
        version: DLPackVersion,
        is_copied: bool,
    ) -> NonNull<DLManagedTensorVersioned> {
        let mut flags = 0;
        if self.is_read_only() {
            flags |= DLPACK_FLAG_BITMASK_READ_ONLY;
        }
        if is_copied {
            flags |= DLPACK_FLAG_BITMASK_IS_COPIED;
        }
        if self.dtype().is_sub_byte() && !self.is_packed() {
            flags |= DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED;
        }
        let mut exported = Box::new(Exported {
            managed: DLManagedTensorVersioned {
                version,
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned),
                flags,
                dl_tensor: self.empty_descriptor(),
            },
            dims: Dims::of(self),
            buffer: self.buffer().clone(),
        });
        let ctx = (&raw mut *exported).cast::<c_void>();
        exported.managed.manager_ctx = ctx;
        let (shape, strides) = exported.dims.pointers(self.ndim());
        exported.managed.dl_tensor.shape = shape;
        exported.managed.dl_tensor.strides = strides;
        let raw = Box::into_raw(exported);
        // SAFETY: `Exported` is `repr(C)` with `managed` first, so its address is the managed
        // tensor's; `Box::into_raw` never returns NULL.
        unsafe { NonNull::new_unchecked(raw.cast::<DLManagedTensorVersioned>()) }
    }

    /// Exports a legacy DLPack tensor. Fails for read-only views: the legacy struct cannot say
    /// read-only, and handing out writable access to read-only memory would be wrong.
    pub fn to_dlpack_legacy(&self) -> Result<NonNull<DLManagedTensor>> {
        if self.dtype().is_sub_byte() && !self.is_packed() {
            return Err(Error::UnsupportedDType(format!(
                "padded {} elements cannot be exported as a legacy (unversioned) DLPack capsule, \
                 which has no IS_SUBBYTE_TYPE_PADDED flag and would be read as packed; ask for \
                 max_version >= (1, 0)",
                self.dtype()
            )));
        }
        if self.is_read_only() {
            return Err(Error::ReadOnly(
                "a read-only array cannot be exported as a legacy (unversioned) DLPack capsule, \
                 which has no read-only flag; ask for max_version >= (1, 0)"
                    .into(),
            ));
        }
        let mut exported = Box::new(ExportedLegacy {
            managed: DLManagedTensor {
                dl_tensor: self.empty_descriptor(),
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy),
            },
            dims: Dims::of(self),
            buffer: self.buffer().clone(),
        });
        let ctx = (&raw mut *exported).cast::<c_void>();
        exported.managed.manager_ctx = ctx;
        let (shape, strides) = exported.dims.pointers(self.ndim());
        exported.managed.dl_tensor.shape = shape;
        exported.managed.dl_tensor.strides = strides;
        let raw = Box::into_raw(exported);
        // SAFETY: as in `to_dlpack_versioned`.
        Ok(unsafe { NonNull::new_unchecked(raw.cast::<DLManagedTensor>()) })
    }

    /// A non-owning descriptor of this view (the DLPack 1.3 `DLTensorFromPyObjectNoSync` form):
    /// its shape and strides point into this tensor's layout, so it is valid only while the tensor
    /// lives.
    #[cfg(target_pointer_width = "64")]
    pub fn borrowed_descriptor(&self) -> DLTensor {
        let mut dl = self.empty_descriptor();
        // `usize`/`isize` have the size and alignment of `i64` on 64-bit targets, and extents
        // and strides fit in `i64` (they were checked to fit in `isize`).
        dl.shape = self.layout().shape().as_ptr().cast::<i64>().cast_mut();
        dl.strides = self.layout().strides().as_ptr().cast::<i64>().cast_mut();
        dl
    }

    fn empty_descriptor(&self) -> DLTensor {
        let (data, byte_offset) = self.dlpack_address();
        DLTensor {
            data,
            device: self.device().to_dlpack(),
            ndim: self.ndim() as i32,
            dtype: self.dtype().to_dlpack(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset,
        }
    }
}

/// Dimensions up to this count are stored inline in the exported struct (one allocation per
/// export); more go to the heap.
const INLINE_DIMS: usize = 8;

/// Shape then strides of an export, as `i64`.
enum Dims {
    Inline([i64; 2 * INLINE_DIMS]),
    Heap(Box<[i64]>),
}

impl Dims {
    fn of(t: &Tensor) -> Dims {
        if t.ndim() <= INLINE_DIMS {
            let mut inline = [0i64; 2 * INLINE_DIMS];
            for (slot, &d) in inline.iter_mut().zip(t.shape()) {
                *slot = d as i64;
            }
            for (slot, &s) in inline[INLINE_DIMS..].iter_mut().zip(t.strides()) {
                *slot = s as i64;
            }
            Dims::Inline(inline)
        } else {
            let shape = t.shape().iter().map(|&d| d as i64);
            Dims::Heap(shape.chain(t.strides().iter().map(|&s| s as i64)).collect())
        }
    }

    /// Pointers to the shape and strides; non-NULL even for `ndim == 0`. They stay valid while
    /// `self` is neither moved nor dropped (it lives in the boxed export).
    fn pointers(&mut self, ndim: usize) -> (*mut i64, *mut i64) {
        match self {
            Dims::Inline(a) => {
                let (shape, strides) = a.split_at_mut(INLINE_DIMS);
                (shape.as_mut_ptr(), strides.as_mut_ptr())
            }
            Dims::Heap(b) => {
                let (shape, strides) = b.split_at_mut(ndim);
                (shape.as_mut_ptr(), strides.as_mut_ptr())
            }
        }
    }
}

/// What a versioned export allocates: the struct handed out, its dims, and the buffer it keeps
/// alive (the descriptor already says everything else about the view).
#[repr(C)]
struct Exported {
    managed: DLManagedTensorVersioned,
    dims: Dims,
    buffer: Buffer,
}

/// The legacy counterpart of [`Exported`].
#[repr(C)]
struct ExportedLegacy {
    managed: DLManagedTensor,
    dims: Dims,
    buffer: Buffer,
}

/// Runs `f`, containing any panic: deleters are called from C and must never unwind.
fn no_unwind(what: &str, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        log::error!("dlbridge: a panic in {what} was contained; the memory may have leaked");
    }
}

unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    if managed.is_null() {
        return;
    }
    no_unwind("the DLPack deleter", || {
        // SAFETY: non-NULL, and only ever produced by `to_dlpack_versioned`, which boxed an
        // `Exported` at this address; DLPack consumers call the deleter once.
        drop(unsafe { Box::from_raw(managed.cast::<Exported>()) });
    });
}

unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    no_unwind("the DLPack deleter", || {
        // SAFETY: as in `delete_versioned`, for `ExportedLegacy`.
        drop(unsafe { Box::from_raw(managed.cast::<ExportedLegacy>()) });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static DELETED: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn count_deletion(_: *mut DLManagedTensorVersioned) {
        DELETED.fetch_add(1, Ordering::SeqCst);
    }

    /// Found with the `layout` fuzz target (the same product in `Layout::byte_range`): the importer
    /// multiplied an element extent of about -2^125 by the item size in `i128`, which overflowed
    /// (a panic with overflow checks; without them the wrapped product passed validation as an
    /// 8-byte range).
    #[test]
    fn address_overflow_is_refused() {
        let mut shape = [1i64 << 62];
        let mut strides = [i64::MIN];
        let mut element = [0f64; 1];
        let mut managed = DLManagedTensorVersioned {
            version: VERSION,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(count_deletion),
            flags: 0,
            dl_tensor: DLTensor {
                data: element.as_mut_ptr().cast(),
                device: Device::CPU.to_dlpack(),
                ndim: 1,
                dtype: DType::F64.to_dlpack(),
                shape: shape.as_mut_ptr(),
                strides: strides.as_mut_ptr(),
                byte_offset: 0,
            },
        };
        // SAFETY: a live descriptor whose pointers are valid for `ndim` entries; its deleter
        // only counts.
        let result = unsafe { Tensor::from_dlpack_versioned(NonNull::from(&mut managed)) };
        assert!(
            matches!(result, Err(Error::Overflow(_))),
            "{:?}",
            result.err()
        );
        assert_eq!(DELETED.load(Ordering::SeqCst), 1);

        // Found by the `dlpack_import` fuzz target: `data + byte_offset` of an empty tensor was
        // added unchecked.
        let mut shape = [0i64];
        let mut strides = [1i64];
        managed.dl_tensor.data = std::ptr::without_provenance_mut(usize::MAX - 8);
        managed.dl_tensor.shape = shape.as_mut_ptr();
        managed.dl_tensor.strides = strides.as_mut_ptr();
        managed.dl_tensor.byte_offset = 64;
        // SAFETY: as above.
        let result = unsafe { Tensor::from_dlpack_versioned(NonNull::from(&mut managed)) };
        assert!(
            matches!(result, Err(Error::MalformedTensor(_))),
            "{:?}",
            result.err()
        );
        assert_eq!(DELETED.load(Ordering::SeqCst), 2);
    }
}
