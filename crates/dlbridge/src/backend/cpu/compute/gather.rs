//! Block copies ([`BlockCopy`]): the gathers and scatters of advanced indexing. Each block is a
//! view of the same shape in both tensors, at a listed element offset in each; elements are moved
//! by their size (1, 2, 4, 8 or 16 bytes), without alignment requirements, so any dtype and any
//! foreign address works.
//!
//! Blocks that no two write alike (a gather) are copied on the CPU workers in chunks; a scatter,
//! where repeated indices write one element several times, runs in order on the calling thread,
//! so that the last write wins, as in NumPy.
//!
//! Two selections of single elements skip the block offsets: a mask over every axis
//! ([`compress`]: the true elements counted per chunk, then each chunk copied to its place, in
//! parallel) and one index array into a 1-d view ([`take_positions`]: each position read, checked
//! and its element copied in one pass, in parallel).

use std::sync::Mutex;

use super::{SharedPtr, for_chunks, walk};
use crate::compute::index::{BlockCopy, Offsets};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Runs `req`.
///
/// # Safety
/// Every element the `req.count` blocks address from `req.dst_offsets` and `req.src_offsets` (over the
/// block's strides) lies inside the tensors' views' buffers; no reference into those bytes is
/// alive during the call and no other thread accesses them (as
/// [`crate::Tensor::copy_from_unchecked`]).
pub(crate) unsafe fn copy_blocks(req: &BlockCopy<'_>) -> Result<()> {
    let (dst, src) = (req.dst, req.src);
    if dst.dtype() != src.dtype() || dst.is_packed() || src.is_packed() {
        return Err(Error::DTypeMismatch(format!(
            "a block copy moves elements of one byte-sized dtype ({} into {})",
            src.dtype(),
            dst.dtype()
        )));
    }
    if dst.is_read_only() {
        return Err(Error::ReadOnly("writing an indexed selection".into()));
    }
    let listed = |o: Offsets<'_>| match o {
        Offsets::List(l) => l.len() == req.count,
        Offsets::Step(_) => true,
    };
    if !listed(req.dst_offsets) || !listed(req.src_offsets) || req.block.strides.len() != 2 {
        return Err(Error::InvalidArgument(
            "a block copy needs one offset per block in each tensor and a two-operand plan".into(),
        ));
    }
    let d = dst.buffer().require_host("writing an indexed selection")?;
    let s = src.buffer().require_host("reading an indexed selection")?;
    let d = SharedPtr(d.as_ptr().wrapping_add(dst.byte_offset()));
    let s = SharedPtr(s.as_ptr().wrapping_add(src.byte_offset()));
    macro_rules! by_size {
        ($($n:literal => $t:ty),*) => {
            match dst.dtype().itemsize() {
                // SAFETY: forwarded contract; `$t` has the elements' size.
                $($n => unsafe { run::<$t>(req, d, s) },)*
                other => {
                    return Err(Error::UnsupportedDType(format!(
                        "block copies of {other}-byte elements ({})",
                        dst.dtype()
                    )));
                }
            }
        };
    }
    by_size!(1 => u8, 2 => u16, 4 => u32, 8 => u64, 16 => [u64; 2]);
    Ok(())
}

/// [`copy_blocks`] for elements of type `T` (only its size matters).
///
/// # Safety
/// As [`copy_blocks`]; `dst` and `src` are the tensors' first elements.
unsafe fn run<T: Copy + Send + Sync>(req: &BlockCopy<'_>, dst: SharedPtr<u8>, src: SharedPtr<u8>) {
    let plan = &req.block;
    let len = plan.len();
    let (ds, ss) = (plan.strides[0].as_slice(), plan.strides[1].as_slice());
    let nd = plan.shape.len();
    let (d_inner, s_inner) = (ds[nd - 1], ss[nd - 1]);
    let size = std::mem::size_of::<T>() as isize;
    let blocks = |start: usize, end: usize| {
        for b in start..end {
            let d = dst
                .get()
                .wrapping_offset(req.dst_offsets.of(b) * size)
                .cast::<T>();
            let s = src
                .get()
                .wrapping_offset(req.src_offsets.of(b) * size)
                .cast::<T>();
            if len == 1 {
                // SAFETY: one element of `src`, inside its buffer (the caller's contract); an
                // unaligned read, so any address is fine.
                let x = unsafe { s.read_unaligned() };
                // SAFETY: one element of `dst`, inside its buffer, written by this block alone.
                unsafe { d.write_unaligned(x) };
                continue;
            }
            walk(&plan.shape, [ds, ss], 0, len, |off, run| {
                let (d, s) = (d.wrapping_offset(off[0]), s.wrapping_offset(off[1]));
                for i in 0..run as isize {
                    // SAFETY: element `i` of a run of the block, inside `src`'s buffer by the
                    // caller's contract; an unaligned read.
                    let x = unsafe { s.wrapping_offset(i * s_inner).read_unaligned() };
                    // SAFETY: the same element of `dst`'s block, inside its buffer.
                    unsafe { d.wrapping_offset(i * d_inner).write_unaligned(x) };
                }
            });
        }
    };
    let count = req.count;
    if req.disjoint {
        // Enough blocks per chunk that a chunk moves at least 32 Ki elements.
        for_chunks(count, (32usize << 10).div_ceil(len.max(1)), blocks);
    } else {
        blocks(0, count);
    }
}

/// Elements per chunk of the single-element selections (a multiple of 64).
const CHUNK: usize = 64 << 10;

/// Calls `$body` with `$t` a type of the elements' size (1, 2, 4, 8 or 16 bytes: only the size
/// matters to a copy), else returns the error.
macro_rules! by_size {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype.itemsize() {
            1 => {
                type $t = u8;
                $body
            }
            2 => {
                type $t = u16;
                $body
            }
            4 => {
                type $t = u32;
                $body
            }
            8 => {
                type $t = u64;
                $body
            }
            16 => {
                type $t = [u64; 2];
                $body
            }
            other => {
                return Err(Error::UnsupportedDType(format!(
                    "selections of {other}-byte elements ({})",
                    $dtype
                )));
            }
        }
    };
}

/// The elements of the host view `src` where `mask` (one byte per element, row-major over
/// `src`'s shape, non-zero for true) is true, in row-major order: a new 1-d host array (NumPy's
/// `a[mask]` with a mask of `a`'s shape).
///
/// # Errors
/// [`Error::InvalidArgument`] when `mask` does not have one byte per element; the allocation's.
pub(crate) fn compress(src: &Tensor, mask: &[u8]) -> Result<Tensor> {
    let n = src.numel();
    if mask.len() != n || src.is_packed() {
        return Err(Error::InvalidArgument(format!(
            "a mask of {} bytes for {n} elements of {}",
            mask.len(),
            src.dtype()
        )));
    }
    let chunks = n.div_ceil(CHUNK);
    let counts: Vec<usize> = {
        let counts = Mutex::new(vec![0usize; chunks]);
        for_chunks(chunks, 4, |start, end| {
            let mine: Vec<usize> = (start..end)
                .map(|c| {
                    let m = &mask[c * CHUNK..((c + 1) * CHUNK).min(n)];
                    m.iter().map(|&b| usize::from(b != 0)).sum()
                })
                .collect();
            counts.lock().unwrap_or_else(|e| e.into_inner())[start..end].copy_from_slice(&mine);
        });
        counts.into_inner().unwrap_or_else(|e| e.into_inner())
    };
    let total: usize = counts.iter().sum();
    let out = Tensor::empty(&[total], src.dtype(), Device::CPU)?;
    if total == 0 {
        return Ok(out);
    }
    let mut starts = Vec::with_capacity(chunks);
    let mut at = 0;
    for c in &counts {
        starts.push(at);
        at += c;
    }
    let s = src.buffer().require_host("reading a masked selection")?;
    let s = SharedPtr(s.as_ptr().wrapping_add(src.byte_offset()));
    let d = out.buffer().require_host("writing a masked selection")?;
    let d = SharedPtr(d.as_ptr().wrapping_add(out.byte_offset()));
    // SAFETY: `src` is a live host view whose elements (over its own strides) lie inside its
    // buffer; `out` is new host memory of `total` elements that nothing else references; each
    // chunk writes its own `counts[c]` elements from `starts[c]`.
    by_size!(src.dtype(), T => unsafe { compress_as::<T>(src, mask, s, d, &starts) });
    Ok(out)
}

/// [`compress`] for elements of type `T` (only its size matters).
///
/// # Safety
/// `src` is `src`'s first element and `dst` that of a compact array with room for every true
/// element; `starts[c]` is where chunk `c`'s true elements go, the count of those before it.
unsafe fn compress_as<T: Copy + Default + Send + Sync>(
    src: &Tensor,
    mask: &[u8],
    first: SharedPtr<u8>,
    dst: SharedPtr<u8>,
    starts: &[usize],
) {
    const GROUP: usize = 64;
    let n = mask.len();
    let strides = src.strides();
    let shape = src.shape();
    let (shape, strides): (&[usize], &[isize]) = if shape.is_empty() {
        (&[1], &[0])
    } else {
        (shape, strides)
    };
    let inner = strides[strides.len() - 1];
    let size = std::mem::size_of::<T>() as isize;
    for_chunks(starts.len(), 1, |start, end| {
        for (c, &first_out) in starts.iter().enumerate().take(end).skip(start) {
            let mut w = dst.get().cast::<T>().wrapping_add(first_out);
            let mut pos = c * CHUNK;
            walk(
                shape,
                [strides],
                c * CHUNK,
                ((c + 1) * CHUNK).min(n),
                |off, len| {
                    let run = first.get().wrapping_offset(off[0] * size).cast::<T>();
                    let m = &mask[pos..pos + len];
                    let mut j = 0;
                    while j < len {
                        let g = (len - j).min(GROUP);
                        // Every element goes to `buf[k]`, `k` advancing past the true ones (no
                        // branch): `k <= t < GROUP`.
                        let mut buf = [T::default(); GROUP];
                        let mut k = 0usize;
                        for t in 0..g {
                            let at = run.wrapping_offset((j + t) as isize * inner);
                            // SAFETY: an element of the view, inside its buffer (the caller's
                            // contract); an unaligned read, so any address is fine.
                            buf[k % GROUP] = unsafe { at.read_unaligned() };
                            k += usize::from(m[j + t] != 0);
                        }
                        // SAFETY: `k` of this chunk's true elements, at their place in `dst`
                        // (the caller's contract), which no other chunk writes.
                        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), w, k) };
                        w = w.wrapping_add(k);
                        j += g;
                    }
                    pos += len;
                },
            );
        }
    });
}

/// Integer positions as `i64` (a `uint64` past `i64::MAX` saturates: it is out of bounds anyway).
trait Position: Copy + Send + Sync + 'static {
    fn position(self) -> i64;
}

macro_rules! position {
    ($($t:ty),*) => {$(
        impl Position for $t {
            #[inline(always)]
            fn position(self) -> i64 {
                i64::try_from(self).unwrap_or(i64::MAX)
            }
        }
    )*};
}

position!(i8, i16, i32, i64, u8, u16, u32, u64);

/// `out[i] = src[index[i]]` for the 1-d host view `src` (negative positions count from the end)
/// and the compact host integer array `index`, `out` a new compact host array of `index`'s shape
/// and `src`'s dtype: NumPy's `a[index]` of a 1-d array, in one parallel pass.
///
/// # Errors
/// [`Error::OutOfBounds`] naming the first position outside the axis (NumPy's message);
/// [`Error::UnsupportedOperand`] for an index array that is not of an integer dtype.
pub(crate) fn take_positions(src: &Tensor, index: &Tensor, out: &Tensor) -> Result<()> {
    if src.ndim() != 1
        || !index.device().is_cpu()
        || !index.is_contiguous()
        || out.shape() != index.shape()
        || out.dtype() != src.dtype()
        || !out.is_contiguous()
        || src.is_packed()
    {
        return Err(Error::InvalidArgument(
            "a 1-d gather reads a 1-d view at a compact host index array".into(),
        ));
    }
    let len = src.shape()[0];
    let stride = src.strides()[0];
    let s = src.buffer().require_host("reading an indexed selection")?;
    let s = SharedPtr(s.as_ptr().wrapping_add(src.byte_offset()));
    let d = out.buffer().require_host("writing an indexed selection")?;
    let d = SharedPtr(d.as_ptr().wrapping_add(out.byte_offset()));
    let i = index.buffer().require_host("reading an index array")?;
    let i = SharedPtr(i.as_ptr().wrapping_add(index.byte_offset()));
    let count = index.numel();
    macro_rules! by_index {
        ($($d:ident => $p:ty),*) => {
            match index.dtype() {
                // SAFETY: `i` is the first of `count` compact positions of type `$p`; `s` the
                // first element of the 1-d view of `len` elements at `stride`; `d` the first of
                // `count` compact elements of new memory that nothing else references.
                $(DType::$d => by_size!(src.dtype(), T => unsafe {
                    gather_as::<T, $p>(s, stride, len, i, d, count)
                }),)*
                other => Err(Error::UnsupportedOperand(format!(
                    "arrays used as indices must be of integer (or boolean) type, not {other}"
                ))),
            }
        };
    }
    by_index!(I8 => i8, I16 => i16, I32 => i32, I64 => i64, U8 => u8, U16 => u16, U32 => u32, U64 => u64)
}

/// [`take_positions`] for elements of type `T` at positions of type `P`.
///
/// # Safety
/// As the call in [`take_positions`] says.
unsafe fn gather_as<T: Copy + Send + Sync, P: Position>(
    src: SharedPtr<u8>,
    stride: isize,
    len: usize,
    index: SharedPtr<u8>,
    dst: SharedPtr<u8>,
    count: usize,
) -> Result<()> {
    let first_bad: Mutex<Option<(usize, i64)>> = Mutex::new(None);
    let n = len as i64;
    let size = std::mem::size_of::<T>() as isize;
    for_chunks(count, CHUNK, |start, end| {
        let (positions, out) = (index.get().cast::<P>(), dst.get().cast::<T>());
        for k in start..end {
            let p = positions.wrapping_add(k);
            // SAFETY: position `k < count` of the compact index array (the caller's contract);
            // an unaligned read, so any address is fine.
            let v = unsafe { p.read_unaligned() }.position();
            let at = if v < 0 { v.wrapping_add(n) } else { v };
            if !(0..n).contains(&at) {
                let mut bad = first_bad.lock().unwrap_or_else(|e| e.into_inner());
                if bad.is_none_or(|(b, _)| k < b) {
                    *bad = Some((k, v));
                }
                // The rest of this chunk comes later in order than this one.
                return;
            }
            let from = src
                .get()
                .wrapping_offset(at as isize * stride * size)
                .cast::<T>();
            // SAFETY: element `at < len` of the view (checked just above), inside its buffer; an
            // unaligned read, so any address is fine.
            let x = unsafe { from.read_unaligned() };
            let to = out.wrapping_add(k);
            // SAFETY: element `k` of the new output, written by this chunk alone; unaligned.
            unsafe { to.write_unaligned(x) };
        }
    });
    match first_bad.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some((_, v)) => Err(Error::OutOfBounds(format!(
            "index {v} is out of bounds for axis 0 with size {len}"
        ))),
        None => Ok(()),
    }
}
