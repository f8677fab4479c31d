//! The producer's side: our views handed out as DLPack descriptors that keep their buffer alive.
//! Strides are always emitted. For addressable memory (host and CUDA pointers) `data` points at
//! the first element and `byte_offset` is 0, the form every consumer understands; for opaque
//! handles (`id<MTLBuffer>`) `data` is the handle itself and the view's offset goes in
//! `byte_offset`. The deleter releases exactly the buffer reference, from any thread, and never
//! unwinds.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

use super::ffi::{
    DLManagedTensor, DLManagedTensorVersioned, DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED, DLPACK_FLAG_BITMASK_READ_ONLY, DLPackVersion,
    DLTensor,
};

impl Tensor {
    /// The `data` and `byte_offset` DLPack hands out for this view.
    fn dlpack_address(&self) -> (*mut c_void, u64) {
        let handle = self.buffer().handle();
        if crate::backend::addressable(self.device().kind()) {
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
        let mut exported = boxed_export(
            self,
            DLManagedTensorVersioned {
                version,
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned),
                flags,
                dl_tensor: self.empty_descriptor(),
            },
        );
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
        if !self.exports_without_read_only_flag() {
            return Err(Error::ReadOnly(
                "a read-only array cannot be exported as a legacy (unversioned) DLPack capsule, \
                 which has no read-only flag; ask for max_version >= (1, 0)"
                    .into(),
            ));
        }
        let mut exported = boxed_export(
            self,
            DLManagedTensor {
                dl_tensor: self.empty_descriptor(),
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy),
            },
        );
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

/// Shape then strides of an export, as `i64`: in the exported struct itself up to
/// [`INLINE_DIMS`] axes (of which only the first `ndim` of each half are written), else on the
/// heap.
struct Dims {
    inline: [MaybeUninit<i64>; 2 * INLINE_DIMS],
    heap: Option<Box<[i64]>>,
}

impl Dims {
    /// Pointers to the shape and strides; non-NULL even for `ndim == 0`. They stay valid while
    /// `self` is neither moved nor dropped (it lives in the boxed export).
    fn pointers(&mut self, ndim: usize) -> (*mut i64, *mut i64) {
        match &mut self.heap {
            Some(b) => {
                let (shape, strides) = b.split_at_mut(ndim);
                (shape.as_mut_ptr(), strides.as_mut_ptr())
            }
            None => {
                let (shape, strides) = self.inline.split_at_mut(INLINE_DIMS);
                (shape.as_mut_ptr().cast(), strides.as_mut_ptr().cast())
            }
        }
    }
}

/// What an export allocates: the struct handed out (`M`, versioned or legacy), its dims, and the
/// buffer it keeps alive (the descriptor already says everything else about the view).
#[repr(C)]
struct ExportedOf<M> {
    managed: M,
    dims: Dims,
    buffer: Buffer,
}

/// A versioned export.
type Exported = ExportedOf<DLManagedTensorVersioned>;

/// A legacy export.
type ExportedLegacy = ExportedOf<DLManagedTensor>;

/// `managed` with `t`'s dims and buffer, boxed. The inline dims start uninitialised (nothing to
/// zero or copy for the axes a view does not have) and are written in the allocation.
#[inline]
fn boxed_export<M>(t: &Tensor, managed: M) -> Box<ExportedOf<M>> {
    let (shape, strides) = (t.shape(), t.strides());
    let heap = (shape.len() > INLINE_DIMS).then(|| {
        let all = shape.iter().map(|&d| d as i64);
        all.chain(strides.iter().map(|&s| s as i64)).collect()
    });
    let mut exported = Box::new(ExportedOf {
        managed,
        dims: Dims {
            inline: [MaybeUninit::uninit(); 2 * INLINE_DIMS],
            heap,
        },
        buffer: t.buffer().clone(),
    });
    if exported.dims.heap.is_none() {
        let (inline_shape, inline_strides) = exported.dims.inline.split_at_mut(INLINE_DIMS);
        for (slot, &d) in inline_shape.iter_mut().zip(shape) {
            slot.write(d as i64);
        }
        for (slot, &s) in inline_strides.iter_mut().zip(strides) {
            slot.write(s as i64);
        }
    }
    exported
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
