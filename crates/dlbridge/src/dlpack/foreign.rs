//! The consumer's border: a producer's `DLManagedTensor[Versioned]` validated once and wrapped
//! as a [`Tensor`] over the producer's memory, with no copy and no exchange rule applied (those
//! are [`super::exchange`]'s). A foreign descriptor is trusted for nothing but its deleter.

use std::ffi::c_void;
use std::ptr::NonNull;

use crate::backend;
use crate::buffer::{Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{self, Layout, MAX_NDIM};
use crate::tensor::Tensor;

use super::VERSION;
use super::ffi::{
    self, DLManagedTensor, DLManagedTensorVersioned, DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED, DLPACK_FLAG_BITMASK_READ_ONLY, DLPackVersion,
    DLTensor,
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

/// Reads value `i` of a foreign array of `i64`.
///
/// # Safety
/// `ptr` must be valid for reads of `i + 1` values of `i64` (the caller checked it is non-NULL).
unsafe fn read_i64(ptr: *const i64, i: usize) -> i64 {
    // SAFETY: the caller's `i` is within the readable values; unaligned because foreign pointers
    // promise nothing.
    unsafe { ptr.wrapping_add(i).read_unaligned() }
}

/// Validates `dl` and builds a tensor over the producer's memory, kept alive by `keep_alive`.
///
/// # Safety
/// `dl` must describe memory that `keep_alive` keeps valid while it lives.
unsafe fn import(
    dl: &DLTensor,
    keep_alive: Box<dyn std::any::Any + Send + Sync>,
    version: Option<DLPackVersion>,
    flags: u64,
) -> Result<Tensor> {
    // SAFETY: forwarded contract.
    let described = unsafe { describe(dl, version, flags) }?;
    // SAFETY: forwarded contract.
    unsafe { described.into_tensor(keep_alive) }
}

/// The host address given to a tensor of no elements whose `data` is NULL: non-NULL and aligned
/// for every element type, and never read through.
const EMPTY_STAND_IN: usize = 64;

/// A producer's descriptor, validated, before any buffer is made of it: what a consumer checks
/// an argument against (device, element type, layout, writability) and where its first element
/// is. [`Described::into_tensor`] makes the tensor.
#[derive(Clone, Debug)]
pub struct Described {
    device: Device,
    dtype: DType,
    /// Extents and strides in elements, with the descriptor's `byte_offset`.
    layout: Layout,
    /// The descriptor's `data`, as an address.
    data: usize,
    /// Sub-byte elements packed (not padded to a byte each).
    packed: bool,
    read_only: bool,
    /// The addressed bytes relative to `data + byte_offset`: `[lo, hi)`.
    lo: i128,
    hi: i128,
}

/// Validates `dl` (of a producer following `version`, `None` for a legacy tensor, with `flags`).
///
/// # Safety
/// `dl` must be readable as DLPack specifies during this call.
unsafe fn describe(dl: &DLTensor, version: Option<DLPackVersion>, flags: u64) -> Result<Described> {
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
    let mut shape = layout::Dims::<usize>::with_capacity(ndim);
    for axis in 0..ndim {
        // SAFETY: non-NULL (checked above for `ndim > 0`) and, by the DLPack contract, `ndim`
        // entries long.
        let d = unsafe { read_i64(dl.shape, axis) };
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
        let mut strides = layout::Dims::<isize>::with_capacity(ndim);
        for axis in 0..ndim {
            // SAFETY: non-NULL and, by the DLPack contract, `ndim` entries long.
            let s = unsafe { read_i64(dl.strides, axis) };
            strides.push(isize::try_from(s).map_err(|_| crate::error::overflow("stride"))?);
        }
        strides
    };
    let offset = usize::try_from(dl.byte_offset)
        .ok()
        .filter(|&o| o <= isize::MAX as usize)
        .ok_or_else(|| crate::error::overflow(format!("byte_offset {}", dl.byte_offset)))?;
    let packed = dtype.is_sub_byte() && flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED == 0;
    let read_only = flags & DLPACK_FLAG_BITMASK_READ_ONLY != 0;
    let layout = Layout::from_dims(shape, strides, offset)?;
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
    if backend::addressable(device.kind()) && numel > 0 {
        // User-space pointers (host and CUDA alike) lie in the lower half of the address space;
        // a range reaching past `isize::MAX` wrapped or names kernel addresses.
        let base = dl.data as usize as i128 + first + lo;
        let end = dl.data as usize as i128 + first + hi;
        if base <= 0 || end > isize::MAX as i128 {
            return Err(Error::MalformedTensor(format!(
                "data {:p} with byte_offset {offset} and strides {:?} addresses memory outside \
                 the user address space",
                dl.data,
                layout.strides()
            )));
        }
    } else if backend::addressable(device.kind()) {
        (dl.data as usize)
            .checked_add(offset)
            .filter(|&a| a <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::MalformedTensor(format!(
                    "data {:p} with byte_offset {offset} lies outside the user address space",
                    dl.data
                ))
            })?;
    } else if first + lo < 0 {
        // An opaque handle is never offset: offsets stay relative to it.
        return Err(Error::OutOfBounds(format!(
            "byte_offset {offset} with strides {:?} reaches before the start of the {device} \
             buffer",
            layout.strides()
        )));
    }
    Ok(Described {
        device,
        dtype,
        layout,
        data: dl.data as usize,
        packed,
        read_only,
        lo,
        hi,
    })
}

impl Described {
    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Extents and strides (in elements); its byte offset is the descriptor's.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether the producer marked the memory read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The address of element zero (`data + byte_offset`) of memory on an addressable device
    /// (host or CUDA); `None` for an opaque handle (Metal). Never 0: a tensor of no elements may
    /// have a NULL `data`, and gets the non-NULL stand-in its tensor would have (no byte is read
    /// through it).
    pub fn first_address(&self) -> Option<usize> {
        if !backend::addressable(self.device.kind()) {
            return None;
        }
        match self.data.wrapping_add(self.layout.byte_offset()) {
            0 => Some(EMPTY_STAND_IN),
            first => Some(first),
        }
    }

    /// The addressed bytes as `(lowest address, length)` on an addressable device (`None` for an
    /// opaque handle, and for no elements).
    fn addressed(&self) -> Option<(usize, usize)> {
        let numel = self.layout.numel();
        (backend::addressable(self.device.kind()) && numel > 0).then(|| {
            let first = self.layout.byte_offset() as i128;
            // `describe` checked that this range lies in the user address space.
            (
                (self.data as i128 + first + self.lo) as usize,
                (self.hi - self.lo) as usize,
            )
        })
    }

    /// Asks the device's backend whether the described memory is what the descriptor says
    /// (CUDA: memory of that device, the whole range inside one allocation). [`Self::into_tensor`]
    /// asks too; a consumer that uses the memory without a tensor asks this first.
    pub fn validate(&self) -> Result<()> {
        match self.addressed() {
            Some((base, len)) => crate::backend::validate_foreign(self.device, base, len),
            None => Ok(()),
        }
    }

    /// A tensor over the described memory, kept alive by `keep_alive`.
    ///
    /// # Safety
    /// The memory the descriptor described must stay valid while `keep_alive` lives.
    pub unsafe fn into_tensor(
        self,
        keep_alive: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Tensor> {
        self.validate()?;
        let addressed = self.addressed();
        let Described {
            device,
            dtype,
            layout,
            data,
            packed,
            read_only,
            lo,
            hi,
        } = self;
        let numel = layout.numel();
        let offset = layout.byte_offset();
        let first = offset as i128;
        let storage =
            backend::facts(device.kind()).map_or(StorageMode::Private, |f| f.foreign_storage);
        let (buffer, layout) = if backend::addressable(device.kind()) {
            // Rebase onto the lowest addressed byte, so the buffer is exactly the addressed
            // range (validated above).
            let (base, len) = addressed.unwrap_or((data + offset, 0));
            let handle = std::ptr::with_exposed_provenance_mut::<c_void>(base);
            let host = match backend::host_accessible(device.kind()) {
                false => std::ptr::null_mut(),
                // A zero-size tensor may have a NULL `data`; no byte is ever read through it, but
                // host access should still succeed (with no elements), so give it a non-NULL
                // address.
                true if handle.is_null() => std::ptr::without_provenance_mut::<u8>(EMPTY_STAND_IN),
                true => handle.cast::<u8>(),
            };
            // SAFETY: the caller guarantees the described elements are valid memory on `device`
            // while `keep_alive` lives; `[base, base + len)` is exactly the bytes the elements
            // occupy; `host` is set only for host-accessible device kinds.
            let buffer = unsafe {
                Buffer::from_foreign(handle, host, len, device, storage, read_only, keep_alive)
            };
            let first_elem = (-lo) as usize;
            (
                buffer,
                layout.with_byte_offset(if numel == 0 { 0 } else { first_elem }),
            )
        } else {
            let len = usize::try_from(first + hi).map_err(|_| crate::error::overflow("extent"))?;
            // SAFETY: the handle is only ever handed back out, never dereferenced by generic
            // code; `host` is NULL; the producer keeps the handle valid while `keep_alive` lives.
            let buffer = unsafe {
                Buffer::from_foreign(
                    std::ptr::with_exposed_provenance_mut::<c_void>(data),
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
}

/// Takes ownership of a versioned producer tensor and validates it: the tensor over the
/// producer's memory, and whether the producer marked it `IS_COPIED`. On failure the producer's
/// deleter has already run.
///
/// # Safety
/// `managed` must point to a live `DLManagedTensorVersioned` whose ownership the caller gives
/// up, and whose descriptor is readable as DLPack specifies (the descriptor's *values* are
/// checked; its pointers cannot be).
pub(crate) unsafe fn take_versioned(
    managed: NonNull<DLManagedTensorVersioned>,
) -> Result<(Tensor, bool)> {
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
    let tensor = unsafe { import(dl, Box::new(owner), Some(version), flags) }?;
    Ok((tensor, flags & DLPACK_FLAG_BITMASK_IS_COPIED != 0))
}

/// As [`take_versioned`], for a legacy (unversioned) tensor, which cannot be marked copied.
///
/// # Safety
/// As [`take_versioned`], for a `DLManagedTensor`.
pub(crate) unsafe fn take_legacy(managed: NonNull<DLManagedTensor>) -> Result<Tensor> {
    let owner = ForeignTensor { managed };
    // SAFETY: `managed` is live while `owner` lives, and `owner` moves into the tensor.
    let dl = unsafe { DLManagedTensor::tensor(managed) };
    // SAFETY: `dl` belongs to the tensor `owner` keeps alive.
    unsafe { import(dl, Box::new(owner), None, 0) }
}

/// Validates a non-owning descriptor (DLPack 1.3's `DLTensorFromPyObjectNoSync` form, of a
/// producer following `version`). A descriptor carries no flags: the memory counts as writable,
/// and as not copied. [`Described::into_tensor`] makes a tensor over it, with the owner that
/// keeps the memory alive (such as the producer's object).
///
/// # Safety
/// `dl` must be readable as DLPack specifies during this call.
pub unsafe fn describe_borrowed(dl: &DLTensor, version: DLPackVersion) -> Result<Described> {
    if version.major != ffi::DLPACK_MAJOR_VERSION {
        return Err(Error::UnsupportedVersion {
            major: version.major,
            minor: version.minor,
        });
    }
    // SAFETY: forwarded contract.
    unsafe { describe(dl, Some(version), 0) }
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
        let result = unsafe { take_versioned(NonNull::from(&mut managed)) };
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
        let result = unsafe { take_versioned(NonNull::from(&mut managed)) };
        assert!(
            matches!(result, Err(Error::MalformedTensor(_))),
            "{:?}",
            result.err()
        );
        assert_eq!(DELETED.load(Ordering::SeqCst), 2);
    }

    /// A borrowed descriptor is validated as an owned one is, tells where its element zero is
    /// without making a buffer, and becomes a tensor over the same memory that holds its owner.
    #[test]
    fn borrowed_descriptor() {
        let mut values = [0f32, 1., 2., 3., 4., 5.];
        // Column 1 of a 3 x 2 row-major matrix, reached through `byte_offset`.
        let mut shape = [3i64];
        let mut strides = [2i64];
        let v12 = DLPackVersion { major: 1, minor: 3 };
        let dl = DLTensor {
            data: values.as_mut_ptr().cast(),
            device: Device::CPU.to_dlpack(),
            ndim: 1,
            dtype: DType::F32.to_dlpack(),
            shape: shape.as_mut_ptr(),
            strides: strides.as_mut_ptr(),
            byte_offset: 4,
        };
        let dl = || DLTensor { ..dl };
        // SAFETY: the descriptor's pointers are valid for `ndim` entries.
        let described = unsafe { describe_borrowed(&dl(), v12) }.expect("a valid descriptor");
        assert_eq!(described.dtype(), DType::F32);
        assert_eq!(described.layout().shape(), &[3]);
        assert_eq!(described.layout().strides(), &[2]);
        assert!(!described.is_read_only());
        assert_eq!(
            described.first_address(),
            Some(values.as_ptr() as usize + 4)
        );
        let owner = std::sync::Arc::new(());
        // SAFETY: `values` outlives the tensor, which is dropped below.
        let tensor = unsafe { described.into_tensor(Box::new(owner.clone())) }.expect("a tensor");
        assert_eq!(std::sync::Arc::strong_count(&owner), 2);
        assert_eq!(
            tensor.to_vec::<f32>().expect("host values"),
            vec![1., 3., 5.]
        );
        drop(tensor);
        assert_eq!(std::sync::Arc::strong_count(&owner), 1);

        // No elements and a NULL `data`: element zero still has a non-NULL (never read) address.
        let mut none = [0i64];
        let empty = DLTensor {
            data: std::ptr::null_mut(),
            shape: none.as_mut_ptr(),
            byte_offset: 0,
            ..dl()
        };
        // SAFETY: as above.
        let described = unsafe { describe_borrowed(&empty, v12) }.expect("an empty descriptor");
        assert_eq!(described.first_address(), Some(EMPTY_STAND_IN));
        described.validate().expect("nothing to validate");
        // SAFETY: no element is ever read.
        let tensor = unsafe { described.into_tensor(Box::new(())) }.expect("an empty tensor");
        assert_eq!(tensor.numel(), 0);

        // What an owned descriptor gets refused for, a borrowed one is too.
        let mut negative = [-1i64];
        let bad = DLTensor {
            shape: negative.as_mut_ptr(),
            ..dl()
        };
        // SAFETY: as above.
        let result = unsafe { describe_borrowed(&bad, v12) };
        assert!(
            matches!(result, Err(Error::MalformedTensor(_))),
            "{result:?}"
        );
        let bad = DLTensor {
            strides: std::ptr::null_mut(),
            ..dl()
        };
        // SAFETY: as above.
        let result = unsafe { describe_borrowed(&bad, v12) };
        assert!(
            matches!(result, Err(Error::MalformedTensor(_))),
            "{result:?}"
        );
        // SAFETY: as above.
        let result = unsafe { describe_borrowed(&dl(), DLPackVersion { major: 2, minor: 0 }) };
        assert!(
            matches!(result, Err(Error::UnsupportedVersion { major: 2, .. })),
            "{result:?}"
        );
    }
}
