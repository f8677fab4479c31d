//! Block copies ([`BlockCopy`]): the gathers and scatters of advanced indexing. Each block is a
//! view of the same shape in both tensors, at a listed element offset in each; elements are moved
//! by their size (1, 2, 4, 8 or 16 bytes), without alignment requirements, so any dtype and any
//! foreign address works.
//!
//! Blocks that no two write alike (a gather) are copied on the CPU workers in chunks; a scatter,
//! where repeated indices write one element several times, runs in order on the calling thread,
//! so that the last write wins, as in NumPy.

use super::{SharedPtr, for_chunks, walk};
use crate::compute::index::{BlockCopy, Offsets};
use crate::error::{Error, Result};

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
