//! [`Tensor`]: a typed, strided view of a [`Buffer`].

use std::fmt;

use crate::backend;
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::{Layout, SliceArg};

/// A strided array: a shared [`Buffer`], a [`DType`] and a [`Layout`].
///
/// Views (slices, transposes, reshapes, broadcasts) share the buffer, so they are cheap and see
/// each other's writes. Cloning a `Tensor` makes another view of the same memory; use
/// [`Tensor::copy`] for independent memory.
#[derive(Clone)]
pub struct Tensor {
    buffer: Buffer,
    dtype: DType,
    layout: Layout,
    /// Sub-byte elements packed densely (DLPack without `IS_SUBBYTE_TYPE_PADDED`); such tensors
    /// can be held and handed on, but not sliced or read element by element.
    packed: bool,
    /// Whether writes through this view are forbidden where the buffer allows them, and why.
    access: Access,
}

/// Why a view of writable memory may or may not be written through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    /// Writes are allowed (where the buffer allows them).
    Writable,
    /// A read-only view: writes are refused, and so is every export that cannot say read-only.
    ReadOnly,
    /// The memory of a producer that holds its arrays immutable by contract (JAX's): writes are
    /// refused as for a read-only view, but a legacy (unversioned) DLPack export, which cannot say
    /// read-only, is allowed, since the producer hands the same memory out that way itself.
    Immutable,
}

impl Tensor {
    /// A view of `buffer`; fails when the layout addresses bytes outside it.
    pub fn new(buffer: Buffer, dtype: DType, layout: Layout) -> Result<Self> {
        Self::with_packing(buffer, dtype, layout, false)
    }

    /// As [`Tensor::new`], with sub-byte elements packed (`packed` only matters for sub-byte
    /// dtypes, whose packed layouts must be compact).
    pub(crate) fn with_packing(
        buffer: Buffer,
        dtype: DType,
        layout: Layout,
        packed: bool,
    ) -> Result<Self> {
        let packed = packed && dtype.is_sub_byte();
        let range = byte_range(&layout, dtype, packed)?;
        if range.end > buffer.len() {
            return Err(Error::OutOfBounds(format!(
                "the view addresses bytes {}..{} but the buffer holds {}",
                range.start,
                range.end,
                buffer.len()
            )));
        }
        Ok(Tensor {
            buffer,
            dtype,
            layout,
            packed,
            access: Access::Writable,
        })
    }

    /// An uninitialised tensor in compact row-major order on `device`, in the device's default
    /// storage mode.
    pub fn empty(shape: &[usize], dtype: DType, device: Device) -> Result<Self> {
        Self::allocate(shape, dtype, device, None, false)
    }

    /// A zero-filled tensor.
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Self> {
        Self::allocate(shape, dtype, device, None, true)
    }

    /// A new compact tensor; `storage` overrides the device's default mode.
    #[inline(always)]
    pub fn allocate(
        shape: &[usize],
        dtype: DType,
        device: Device,
        storage: Option<StorageMode>,
        zeroed: bool,
    ) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let bytes = layout
            .numel()
            .checked_mul(dtype.itemsize())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| crate::error::overflow(format!("size of {shape:?} {dtype}")))?;
        let buffer = backend::allocate(device, bytes, storage, zeroed)?;
        // The layout is compact and addresses exactly the buffer's `bytes`: nothing to check.
        Ok(Tensor {
            buffer,
            dtype,
            layout,
            packed: false,
            access: Access::Writable,
        })
    }

    /// A CPU tensor holding a copy of `data` in `shape`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Self> {
        let mut out = Tensor::empty(shape, T::DTYPE, Device::CPU)?;
        if out.numel() != data.len() {
            return Err(Error::Shape(format!(
                "{} elements do not fill shape {shape:?}",
                data.len()
            )));
        }
        out.as_mut_slice::<T>()?.copy_from_slice(data);
        Ok(out)
    }

    /// The shared buffer.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Extents.
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[isize] {
        self.layout.strides()
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.layout.ndim()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Bytes the elements occupy (`numel * itemsize`, or the packed size for packed sub-byte
    /// types).
    pub fn nbytes(&self) -> usize {
        if self.packed {
            (self.numel() * self.dtype.bits() as usize).div_ceil(8)
        } else {
            self.numel() * self.dtype.itemsize()
        }
    }

    /// Byte offset of the first element from the start of the buffer.
    pub fn byte_offset(&self) -> usize {
        self.layout.byte_offset()
    }

    /// Where the memory lives.
    pub fn device(&self) -> Device {
        self.buffer.device()
    }

    /// Whether the view is compact and row-major.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// Whether sub-byte elements are packed densely.
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    /// Whether writes through this view are forbidden (the view or its buffer is read-only).
    pub fn is_read_only(&self) -> bool {
        self.access != Access::Writable || self.buffer.is_read_only()
    }

    /// The same view, read-only.
    pub fn into_read_only(mut self) -> Self {
        self.access = Access::ReadOnly;
        self
    }

    /// The same view, read-only because the memory's producer holds its arrays immutable by
    /// contract (JAX does; XLA may share or donate their buffers): writes through dlbridge are
    /// refused as for [`Tensor::into_read_only`], but a legacy (unversioned) DLPack export, which
    /// has no read-only flag, is still allowed, because the producer itself hands the same memory
    /// out in that form (JAX asks for it, so its arrays go back to JAX without a copy). A view
    /// already read-only stays so.
    pub fn into_immutable(mut self) -> Self {
        if self.access == Access::Writable {
            self.access = Access::Immutable;
        }
        self
    }

    /// Whether the view may go out in a form that cannot say read-only (a legacy DLPack capsule):
    /// writable memory, or memory read-only only by its producer's contract.
    pub(crate) fn exports_without_read_only_flag(&self) -> bool {
        self.access != Access::ReadOnly && !self.buffer.is_read_only()
    }

    /// The byte range of the buffer the view addresses.
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        byte_range(&self.layout, self.dtype, self.packed)
            .expect("validated when the view was built")
    }

    fn view(&self, layout: Layout) -> Result<Self> {
        if self.packed {
            return Err(Error::UnsupportedDType(format!(
                "views of packed sub-byte {} elements are not supported",
                self.dtype
            )));
        }
        let mut out = Tensor::new(self.buffer.clone(), self.dtype, layout)?;
        out.access = self.access;
        Ok(out)
    }

    /// The elements `arg` selects along `axis` (Python slice semantics, any step).
    pub fn slice(&self, axis: isize, arg: SliceArg) -> Result<Self> {
        self.view(self.layout.slice(axis, arg, self.dtype.itemsize())?)
    }

    /// Index `index` along `axis`, dropping the axis.
    pub fn index(&self, axis: isize, index: isize) -> Result<Self> {
        self.view(self.layout.index(axis, index, self.dtype.itemsize())?)
    }

    /// A new axis of length 1 before position `axis`.
    pub fn expand_dims(&self, axis: usize) -> Result<Self> {
        self.view(self.layout.expand_dims(axis)?)
    }

    /// Axes reordered: axis `i` of the result is axis `axes[i]` of `self`.
    pub fn permute(&self, axes: &[usize]) -> Result<Self> {
        self.view(self.layout.permute(axes)?)
    }

    /// Axes reversed.
    pub fn transpose(&self) -> Result<Self> {
        self.view(self.layout.transpose())
    }

    /// A view with a new shape (one extent may be `None`, to be inferred); fails when the strides
    /// cannot express it without a copy.
    pub fn reshape(&self, shape: &[Option<usize>]) -> Result<Self> {
        self.view(self.layout.reshape(shape)?)
    }

    /// Broadcast to `shape` by NumPy's rules (stride 0 on stretched axes).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Self> {
        self.view(self.layout.broadcast_to(shape)?)
    }

    /// A 1-d view of `len` elements starting `byte_offset` bytes after this view's first element.
    /// The view must be contiguous; the offset must keep elements aligned to the dtype's size.
    pub fn slice_view(&self, byte_offset: usize, len: usize) -> Result<Self> {
        if !self.is_contiguous() {
            return Err(Error::Shape("slice_view needs a contiguous view".into()));
        }
        let itemsize = self.dtype.itemsize();
        if byte_offset % itemsize != 0 {
            return Err(Error::Misaligned(format!(
                "byte offset {byte_offset} is not a multiple of the {itemsize}-byte {} element",
                self.dtype
            )));
        }
        let end = len
            .checked_mul(itemsize)
            .and_then(|b| b.checked_add(byte_offset))
            .ok_or_else(|| crate::error::overflow("slice_view extent"))?;
        if end > self.nbytes() {
            return Err(Error::OutOfBounds(format!(
                "slice_view of bytes {byte_offset}..{end} exceeds the view's {} bytes",
                self.nbytes()
            )));
        }
        let start = self.byte_offset() + byte_offset;
        self.view(Layout::contiguous_at(&[len], start)?)
    }

    /// Checks that host code may read the view as `T` and returns the address of its first
    /// element.
    fn host_first_element<T: Element>(&self, what: &str) -> Result<*mut T> {
        if self.dtype != T::DTYPE {
            return Err(Error::DTypeMismatch(format!(
                "{what} as {} but the elements are {}",
                T::DTYPE,
                self.dtype
            )));
        }
        if !self.is_contiguous() {
            return Err(Error::Shape(format!(
                "{what} needs a contiguous view (shape {:?}, strides {:?}); copy it first",
                self.shape(),
                self.strides()
            )));
        }
        let base = self.buffer.require_host(what)?;
        backend::host_barrier(self.device())?;
        // The view is in bounds of the buffer (checked at construction), so this stays inside it.
        let first = base.as_ptr().wrapping_add(self.byte_offset());
        if (first as usize) % std::mem::align_of::<T>() != 0 {
            return Err(Error::Misaligned(format!(
                "{what}: address {first:p} is not aligned for {}",
                T::DTYPE
            )));
        }
        Ok(first.cast::<T>())
    }

    /// The elements as a slice, honouring the view's byte offset and length. The view must be
    /// contiguous, host-accessible and of dtype `T`.
    ///
    /// Memory that a foreign producer also holds can change under the slice if the producer writes
    /// to it; dlbridge cannot prevent that, as no DLPack consumer can.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let first = self.host_first_element::<T>("reading elements")?;
        if self.numel() == 0 {
            return Ok(&[]);
        }
        // SAFETY: `first` is aligned for T and starts `numel` contiguous elements of T inside the
        // buffer (bounds checked when the view was built); the buffer is kept alive by `self` for
        // the lifetime of the slice; `Element` guarantees every bit pattern is a valid T.
        Ok(unsafe { std::slice::from_raw_parts(first, self.numel()) })
    }

    /// The elements as a mutable slice. Besides what [`Tensor::as_slice`] needs, the view must be
    /// writable and must hold the only reference to its buffer (clones share memory, so `&mut self`
    /// alone would not rule out aliasing); otherwise [`Error::Aliased`].
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        if self.is_read_only() {
            return Err(Error::ReadOnly("mutable access to a read-only view".into()));
        }
        let count = self.buffer.ref_count();
        if count != 1 {
            return Err(Error::Aliased { count });
        }
        let first = self.host_first_element::<T>("writing elements")?;
        if self.numel() == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `as_slice`; in addition this is the only handle to the buffer and it is
        // borrowed mutably for the slice's lifetime, so no other reference to these bytes exists.
        Ok(unsafe { std::slice::from_raw_parts_mut(first, self.numel()) })
    }

    /// The elements in row-major order, copied into a `Vec`, for any host-accessible layout.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.dtype != T::DTYPE {
            return Err(Error::DTypeMismatch(format!(
                "reading {} elements as {}",
                self.dtype,
                T::DTYPE
            )));
        }
        let compact = self.copy_to(Device::CPU)?;
        let elements = compact.as_slice::<T>()?;
        let mut v = crate::error::host_vec(elements.len())?;
        v.extend_from_slice(elements);
        Ok(v)
    }

    /// A compact copy of this view on `device`, in new memory.
    pub fn copy_to(&self, device: Device) -> Result<Tensor> {
        let out = Tensor::empty(self.shape(), self.dtype, device)?;
        // SAFETY: `out` is new memory that nothing else references.
        unsafe { out.copy_from_unchecked(self)? };
        Ok(out)
    }

    /// A compact copy of this view on its own device.
    pub fn copy(&self) -> Result<Tensor> {
        self.copy_to(self.device())
    }

    /// A compact copy on `device` in `storage` (`None`: the device's default; for a copy within
    /// one Metal device, this view's mode), as [`crate::dlpack::ImportRequest`] makes when an
    /// import must move or copy.
    ///
    /// # Errors
    /// As [`Tensor::allocate`] and [`Tensor::copy_to`].
    pub fn copy_to_storage(&self, device: Device, storage: Option<StorageMode>) -> Result<Tensor> {
        crate::dlpack::copy_to(self, device, storage)
    }

    /// A compact host copy with sub-byte elements one per byte (DLPack's padded form); for other
    /// dtypes, the same as `copy_to(Device::CPU)`. Packed elements are read in DLPack's order:
    /// little bit-endian, element `i` starting at bit `i * bits`.
    pub fn unpacked(&self) -> Result<Tensor> {
        if !self.packed {
            return self.copy_to(Device::CPU);
        }
        let base = self.buffer.require_host("unpacking sub-byte elements")?;
        let nbytes = self.nbytes();
        let packed: &[u8] = if nbytes == 0 {
            &[]
        } else {
            let first = base.as_ptr().wrapping_add(self.byte_offset());
            // SAFETY: a packed view is compact, and its `nbytes` bytes from the offset lie inside
            // the live buffer (checked at construction); `self` keeps the buffer alive.
            unsafe { std::slice::from_raw_parts(first, nbytes) }
        };
        let mut out = Tensor::empty(self.shape(), self.dtype, Device::CPU)?;
        let bits = self.dtype.bits() as usize;
        let mask = (1u16 << bits) - 1;
        let dst = out.host_bytes_mut()?;
        for (i, slot) in dst.iter_mut().enumerate() {
            let (byte, shift) = ((i * bits) / 8, (i * bits) % 8);
            let lo = u16::from(packed[byte]);
            let hi = u16::from(packed.get(byte + 1).copied().unwrap_or(0));
            *slot = (((hi << 8) | lo) >> shift & mask) as u8;
        }
        Ok(out)
    }

    /// A compact copy with elements converted to `dtype` (NumPy's `astype` rules: floats truncate
    /// toward zero into integers, complex drops the imaginary part into reals). A same-dtype cast
    /// is a plain copy.
    pub fn cast(&self, dtype: DType) -> Result<Tensor> {
        crate::compute::cast(self, dtype)
    }

    /// The bytes of a compact host view.
    pub(crate) fn host_bytes(&self) -> Result<&[u8]> {
        if self.packed || !self.is_contiguous() {
            return Err(Error::Shape("raw bytes of a non-compact view".into()));
        }
        let base = self.buffer.require_host("reading bytes")?;
        if self.nbytes() == 0 {
            return Ok(&[]);
        }
        let first = base.as_ptr().wrapping_add(self.byte_offset());
        // SAFETY: a compact view's `nbytes` bytes from its offset lie inside the live buffer
        // (checked at construction); u8 has no alignment or validity requirements.
        Ok(unsafe { std::slice::from_raw_parts(first, self.nbytes()) })
    }

    /// The bytes of a compact host view this handle alone owns.
    pub(crate) fn host_bytes_mut(&mut self) -> Result<&mut [u8]> {
        let count = self.buffer.ref_count();
        if count != 1 {
            return Err(Error::Aliased { count });
        }
        if self.is_read_only() {
            return Err(Error::ReadOnly("writing bytes".into()));
        }
        let base = self.buffer.require_host("writing bytes")?;
        if self.nbytes() == 0 {
            return Ok(&mut []);
        }
        let first = base.as_ptr().wrapping_add(self.byte_offset());
        // SAFETY: as in `host_bytes`; the buffer has no other handle and `self` is borrowed
        // mutably for the slice's lifetime.
        Ok(unsafe { std::slice::from_raw_parts_mut(first, self.nbytes()) })
    }

    /// Copies `src` into this view element by element (shapes equal, or `src` broadcastable to
    /// this view's shape). Needs the only reference to the buffer, as
    /// [`Tensor::as_mut_slice`] does.
    pub fn copy_from(&mut self, src: &Tensor) -> Result<()> {
        let count = self.buffer.ref_count();
        if count != 1 {
            return Err(Error::Aliased { count });
        }
        // SAFETY: this is the only handle to the destination buffer, borrowed mutably.
        unsafe { self.copy_from_unchecked(src) }
    }

    /// As [`Tensor::copy_from`], for a destination other views may share.
    ///
    /// # Safety
    /// No reference (`&[T]` from [`Tensor::as_slice`] or `&mut [T]`) into the bytes this view
    /// addresses may be alive during the call, and no other thread may access them.
    pub unsafe fn copy_from_unchecked(&self, src: &Tensor) -> Result<()> {
        if self.is_read_only() {
            return Err(Error::ReadOnly("copying into a read-only view".into()));
        }
        if src.dtype != self.dtype {
            return Err(Error::DTypeMismatch(format!(
                "copying {} elements into a {} view",
                src.dtype, self.dtype
            )));
        }
        if src.packed || self.packed {
            return Err(Error::UnsupportedDType(format!(
                "copies of packed sub-byte {} elements",
                self.dtype
            )));
        }
        let src = if src.shape() == self.shape() {
            src.clone()
        } else {
            src.broadcast_to(self.shape())?
        };
        if self.numel() == 0 {
            return Ok(());
        }
        // Overlapping bytes in one allocation: go through a temporary.
        if src.buffer.same_allocation(&self.buffer) {
            let (a, b) = (src.byte_range(), self.byte_range());
            if a.start < b.end && b.start < a.end {
                let staged = src.copy_to(src.device())?;
                // SAFETY: forwarded contract; `staged` is new memory disjoint from `self`.
                return unsafe { self.copy_from_unchecked(&staged) };
            }
        }
        // SAFETY: forwarded contract; the views do not overlap (checked above).
        unsafe { backend::copy(self, &src) }
    }

    /// Fills the view with copies of one element given as raw bytes (`itemsize` of them).
    ///
    /// # Safety
    /// As [`Tensor::copy_from_unchecked`].
    pub unsafe fn fill_bytes_unchecked(&self, element: &[u8]) -> Result<()> {
        if element.len() != self.dtype.itemsize() || self.packed {
            return Err(Error::DTypeMismatch(format!(
                "a {}-byte value cannot fill {} elements",
                element.len(),
                self.dtype
            )));
        }
        let one = Tensor::empty(&[], self.dtype, Device::CPU)?;
        let ptr = one.buffer.require_host("filling")?;
        // SAFETY: `one` is a fresh 0-d host tensor of exactly `itemsize` bytes.
        unsafe { std::ptr::copy_nonoverlapping(element.as_ptr(), ptr.as_ptr(), element.len()) };
        // SAFETY: forwarded contract.
        unsafe { self.copy_from_unchecked(&one) }
    }
}

/// The bytes a layout addresses, for packed sub-byte elements too (which must be compact).
fn byte_range(layout: &Layout, dtype: DType, packed: bool) -> Result<std::ops::Range<usize>> {
    if !packed {
        return layout.byte_range(dtype.itemsize());
    }
    if !layout.is_contiguous() {
        return Err(Error::UnsupportedDType(format!(
            "packed sub-byte {dtype} elements must be compact (strides {:?})",
            layout.strides()
        )));
    }
    let bytes = (layout.numel() as u128 * dtype.bits() as u128).div_ceil(8);
    let end = layout.byte_offset() as u128 + bytes;
    if end > isize::MAX as u128 {
        return Err(crate::error::overflow("packed extent"));
    }
    Ok(layout.byte_offset()..end as usize)
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape())
            .field("strides", &self.strides())
            .field("byte_offset", &self.byte_offset())
            .field("device", &self.device())
            .field("read_only", &self.is_read_only())
            .finish()
    }
}
