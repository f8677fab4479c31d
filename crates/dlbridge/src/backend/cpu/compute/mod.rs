//! The CPU kernels of [`crate::compute`]: element-wise maps, reductions and matrix products,
//! run on the calling thread for small work and on rayon's pool for large work.
//!
//! | request | module | how |
//! | --- | --- | --- |
//! | [`MapRequest`] | [`map`] | the plan's innermost axis as runs; a run whose operands are contiguous or broadcast is one vectorised loop, others are gathered in blocks; `float16` / `bfloat16` converted to `float32` in blocks and rounded once when stored |
//! | [`ReduceRequest`] | [`reduce`] | blocks of 1024 elements folded in 32 lanes, block results kept in `float64` (sums, and the moments of `var` / `std`, one pass); `argmax` / `argmin` search a chunk for its extreme only where it beats the best so far; reductions over outer axes accumulate whole rows, so memory is read in order |
//! | [`MatmulRequest`] | [`matmul`] | the `gemm` crate (`float16`, `float32`, `float64`); `bfloat16` through `float32` |
//!
//! Work is split into chunks of a fixed size ([`for_chunks`]), so results do not depend on the
//! number of threads.
//!
//! # Memory
//! Every kernel writes only `out`, a fresh compact tensor the front allocated for it and that no
//! one else references yet; inputs are only read and may share memory with each other, never with
//! `out`. Inputs are addressed from their first element with the plan's strides in elements
//! (negative and zero strides included). A foreign input whose address is not aligned for its
//! dtype is read from an aligned copy of the bytes it spans ([`Input`]).

mod gather;
mod map;
mod math;
mod matmul;
mod reduce;

use half::{bf16, f16};

use crate::compute::{MapRequest, MatmulRequest, ReduceRequest, Scalar};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Runs an element-wise kernel ([`MapRequest`]).
pub(crate) fn map(req: &MapRequest<'_>) -> Result<()> {
    map::run(req)
}

/// Runs a reduction ([`ReduceRequest`]).
pub(crate) fn reduce(req: &ReduceRequest<'_>) -> Result<()> {
    reduce::run(req)
}

pub(crate) use gather::{compress, copy_blocks, take_positions};

/// Runs a batched matrix product ([`MatmulRequest`]).
pub(crate) fn matmul(req: &MatmulRequest<'_>) -> Result<()> {
    matmul::run(req)
}

/// A type elements are stored in: the integers, the 16-bit floats, `f32` and `f64`.
pub(super) trait Storage: Copy + Default + PartialEq + Send + Sync + 'static {
    /// The type arithmetic runs in: the type itself, or `f32` for the 16-bit floats.
    type Wide: Copy + Default + Send + Sync + 'static;

    /// A Python scalar taking this type ([`Scalar::as_i64`] wrapping for integers, rounded once
    /// for floats).
    fn from_scalar(s: Scalar) -> Self;

    /// A `f64` result rounded (floats) or truncated (integers) into this type.
    fn from_f64(v: f64) -> Self;

    /// A computed value stored (rounded once for the 16-bit floats).
    fn narrow(w: Self::Wide) -> Self;

    /// Hands `f` the `len` elements at `ptr` with `stride`, widened, in slices of at most
    /// [`BLOCK`] elements (a contiguous run of a type that needs no widening in one slice).
    ///
    /// # Safety
    /// `ptr.offset(i * stride)` must be valid for reads for every `i < len`, and nothing may write
    /// those elements during the call.
    unsafe fn read_run(ptr: *const Self, stride: isize, len: usize, f: impl FnMut(&[Self::Wide]));
}

/// Elements per block where kernels widen or gather into a scratch buffer on the stack.
pub(super) const BLOCK: usize = 1024;

/// Copies the `len` strided elements at `ptr` into `dst`, converted by `conv`.
///
/// # Safety
/// As [`Storage::read_run`], for `len <= dst.len()` elements.
#[inline(always)]
unsafe fn gather<S: Copy, W>(ptr: *const S, stride: isize, dst: &mut [W], conv: impl Fn(S) -> W) {
    for (i, d) in dst.iter_mut().enumerate() {
        let at = ptr.wrapping_offset(i as isize * stride);
        // SAFETY: element `i < len` of the caller's run, readable by its contract.
        *d = conv(unsafe { *at });
    }
}

macro_rules! native_storage {
    ($($t:ty => $scalar:expr, $from:expr;)*) => {$(
        impl Storage for $t {
            type Wide = $t;

            fn from_scalar(s: Scalar) -> Self {
                #[allow(clippy::redundant_closure_call)]
                ($scalar)(s)
            }

            fn from_f64(v: f64) -> Self {
                #[allow(clippy::redundant_closure_call)]
                ($from)(v)
            }

            #[inline(always)]
            fn narrow(w: Self) -> Self {
                w
            }

            #[inline(always)]
            unsafe fn read_run(
                ptr: *const Self,
                stride: isize,
                len: usize,
                mut f: impl FnMut(&[Self]),
            ) {
                if stride == 1 {
                    // SAFETY: `len` consecutive elements the caller vouches for, not written
                    // during the call.
                    f(unsafe { std::slice::from_raw_parts(ptr, len) });
                    return;
                }
                let mut scratch = [<$t>::default(); BLOCK];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(BLOCK);
                    let from = ptr.wrapping_offset(done as isize * stride);
                    // SAFETY: elements `done..done + n` of the caller's run.
                    unsafe { gather(from, stride, &mut scratch[..n], |x| x) };
                    f(&scratch[..n]);
                    done += n;
                }
            }
        }
    )*};
}

native_storage! {
    i8 => |s: Scalar| s.as_i64() as i8, |v: f64| v as i8;
    i16 => |s: Scalar| s.as_i64() as i16, |v: f64| v as i16;
    i32 => |s: Scalar| s.as_i64() as i32, |v: f64| v as i32;
    i64 => |s: Scalar| s.as_i64(), |v: f64| v as i64;
    u8 => |s: Scalar| s.as_i64() as u8, |v: f64| v as u8;
    u16 => |s: Scalar| s.as_i64() as u16, |v: f64| v as u16;
    u32 => |s: Scalar| s.as_i64() as u32, |v: f64| v as u32;
    u64 => |s: Scalar| s.as_i64() as u64, |v: f64| v as u64;
    f32 => |s: Scalar| s.as_f64() as f32, |v: f64| v as f32;
    f64 => |s: Scalar| s.as_f64(), |v: f64| v;
}

/// The 16-bit floats: stored narrow, computed in `f32`.
pub(super) trait Half: Storage<Wide = f32> {
    /// Widens a slice (`src.len() == dst.len()`), with the CPU's conversion instructions where
    /// it has them.
    fn widen_slice(src: &[Self], dst: &mut [f32]);
    /// Rounds a slice once (`src.len() == dst.len()`).
    fn narrow_slice(src: &[f32], dst: &mut [Self]);
    /// Widens one value.
    fn widen(self) -> f32;
}

macro_rules! half_storage {
    ($($t:ty),*) => {$(
        impl Storage for $t {
            type Wide = f32;

            fn from_scalar(s: Scalar) -> Self {
                // One rounding from the scalar's f64 value, as NumPy's weak scalars.
                <$t>::from_f64(s.as_f64())
            }

            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }

            #[inline(always)]
            fn narrow(w: f32) -> Self {
                <$t>::from_f32(w)
            }

            #[inline(always)]
            unsafe fn read_run(
                ptr: *const Self,
                stride: isize,
                len: usize,
                mut f: impl FnMut(&[f32]),
            ) {
                let mut scratch = [0f32; BLOCK];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(BLOCK);
                    let from = ptr.wrapping_offset(done as isize * stride);
                    if stride == 1 {
                        // SAFETY: elements `done..done + n` of the caller's run, consecutive.
                        let src = unsafe { std::slice::from_raw_parts(from, n) };
                        Self::widen_slice(src, &mut scratch[..n]);
                    } else {
                        // SAFETY: elements `done..done + n` of the caller's run.
                        unsafe { gather(from, stride, &mut scratch[..n], <$t>::to_f32) };
                    }
                    f(&scratch[..n]);
                    done += n;
                }
            }
        }

        impl Half for $t {
            fn widen_slice(src: &[Self], dst: &mut [f32]) {
                use half::slice::HalfFloatSliceExt;
                src.convert_to_f32_slice(dst);
            }

            fn narrow_slice(src: &[f32], dst: &mut [Self]) {
                use half::slice::HalfFloatSliceExt;
                dst.convert_from_f32_slice(src);
            }

            #[inline(always)]
            fn widen(self) -> f32 {
                self.to_f32()
            }
        }
    )*};
}

half_storage!(f16, bf16);

/// Calls `$body` with `$t` bound to the Rust type of `$dtype` (one of the kernels' 12 dtypes),
/// else evaluates `$other`.
macro_rules! with_storage {
    ($dtype:expr, $t:ident => $body:expr, _ => $other:expr) => {{
        use $crate::dtype::DType as D;
        match $dtype {
            D::I8 => {
                type $t = i8;
                $body
            }
            D::I16 => {
                type $t = i16;
                $body
            }
            D::I32 => {
                type $t = i32;
                $body
            }
            D::I64 => {
                type $t = i64;
                $body
            }
            D::U8 => {
                type $t = u8;
                $body
            }
            D::U16 => {
                type $t = u16;
                $body
            }
            D::U32 => {
                type $t = u32;
                $body
            }
            D::U64 => {
                type $t = u64;
                $body
            }
            D::F16 => {
                type $t = half::f16;
                $body
            }
            D::BF16 => {
                type $t = half::bf16;
                $body
            }
            D::F32 => {
                type $t = f32;
                $body
            }
            D::F64 => {
                type $t = f64;
                $body
            }
            _ => $other,
        }
    }};
}
pub(super) use with_storage;

/// The host address of an input tensor's first element, aligned for its dtype.
///
/// Tensors dlbridge allocated are aligned to 64 bytes; a foreign producer may hand over any byte
/// address, and such an input is read from an aligned copy of the bytes it spans (the element
/// offsets relative to the first element stay the same).
pub(super) struct Input {
    first: *const u8,
    /// The aligned copy, when one was needed (kept alive for `first`).
    _copy: Option<Vec<u64>>,
}

impl Input {
    /// The first element of `t`, which must be host memory of a dtype at most 8 bytes wide.
    pub(super) fn new(t: &Tensor, what: &str) -> Result<Input> {
        let base = t.buffer().require_host(what)?;
        // In bounds of the live buffer: the view was checked when it was built.
        let first = base.as_ptr().wrapping_add(t.byte_offset());
        let align = t.dtype().itemsize().max(1);
        if (first as usize) % align == 0 || t.numel() == 0 {
            return Ok(Input { first, _copy: None });
        }
        let range = t.byte_range();
        let mut copy = vec![0u64; range.len().div_ceil(8)];
        // SAFETY: `range` is the span of buffer bytes the view addresses, inside the live buffer;
        // `copy` is a new allocation of at least `range.len()` bytes, so the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                base.as_ptr().wrapping_add(range.start),
                copy.as_mut_ptr().cast::<u8>(),
                range.len(),
            )
        };
        // The first element's distance from the span's start is a multiple of the item size, so
        // it is aligned in the 8-byte aligned copy.
        let first = copy
            .as_ptr()
            .cast::<u8>()
            .wrapping_add(t.byte_offset() - range.start);
        Ok(Input {
            first,
            _copy: Some(copy),
        })
    }

    /// The first element as a `T` pointer.
    pub(super) fn ptr<T>(&self) -> *const T {
        self.first.cast()
    }
}

/// The host address of `out`'s first element: a fresh compact tensor the kernel may write.
pub(super) fn output<T>(out: &Tensor) -> Result<*mut T> {
    if out.is_read_only() {
        return Err(Error::ReadOnly("writing a kernel's result".into()));
    }
    let base = out.buffer().require_host("writing a kernel's result")?;
    let first = base.as_ptr().wrapping_add(out.byte_offset());
    if (first as usize) % std::mem::align_of::<T>() != 0 {
        return Err(Error::Misaligned(format!(
            "a kernel's result at {first:p} is not aligned for {}",
            out.dtype()
        )));
    }
    Ok(first.cast())
}

/// A raw pointer handed to rayon's tasks.
#[derive(Clone, Copy)]
pub(super) struct SharedPtr<T>(pub(super) *mut T);

impl<T> SharedPtr<T> {
    /// The pointer (a method, so that closures capture the whole `SharedPtr`, not the field).
    #[inline(always)]
    pub(super) fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: the kernels use a `SharedPtr` either to read inputs that no one writes during the call,
// or to write `out`, where every task writes a range of elements no other task touches (the
// chunks of `for_chunks`). `T` is a plain number type, `Send` and `Sync` itself.
unsafe impl<T: Send> Send for SharedPtr<T> {}
// SAFETY: as for `Send`.
unsafe impl<T: Sync> Sync for SharedPtr<T> {}

/// Splits `0..len` into chunks of at least `min_chunk` items (a multiple of 64 when that many, so
/// that chunks of `out` do not share cache lines) and calls `f(start, end)` for each: on the calling thread when
/// there is one chunk, else on the CPU workers ([`super::workers`]).
pub(super) fn for_chunks(len: usize, min_chunk: usize, f: impl Fn(usize, usize) + Sync) {
    let threads = super::workers::threads();
    if len <= min_chunk || threads <= 1 {
        f(0, len);
        return;
    }
    let chunk = min_chunk.max(len.div_ceil(threads * 4));
    // Chunks of many cheap items (elements) stay apart by whole cache lines of `out`; chunks of
    // a few expensive items (outputs of long reductions) stay small, so that every thread works.
    let chunk = if chunk >= 64 {
        chunk.next_multiple_of(64)
    } else {
        chunk
    };
    let count = len.div_ceil(chunk);
    super::workers::install(|| {
        use rayon::prelude::*;
        (0..count)
            .into_par_iter()
            .for_each(|c| f(c * chunk, ((c + 1) * chunk).min(len)));
    });
}

/// Walks items `start..end` of the row-major index space of `shape` as runs along its innermost
/// axis: `f(offsets, len)` gets each run's first element offset per operand (over `strides`, one
/// slice of `shape.len()` strides per operand) and its length. `shape` is non-empty.
pub(super) fn walk<const K: usize>(
    shape: &[usize],
    strides: [&[isize]; K],
    start: usize,
    end: usize,
    mut f: impl FnMut([isize; K], usize),
) {
    if start >= end {
        return;
    }
    let nd = shape.len();
    let inner = shape[nd - 1];
    // On the stack: reductions walk once per output.
    let mut index = [0usize; crate::layout::MAX_NDIM];
    let mut rest = start;
    for axis in (0..nd).rev() {
        index[axis] = rest % shape[axis];
        rest /= shape[axis];
    }
    let mut off = [0isize; K];
    for (k, o) in off.iter_mut().enumerate() {
        *o = (0..nd).map(|a| index[a] as isize * strides[k][a]).sum();
    }
    let mut pos = start;
    loop {
        let run = (inner - index[nd - 1]).min(end - pos);
        f(off, run);
        pos += run;
        if pos >= end {
            return;
        }
        // The run reached the end of the innermost axis: carry like an odometer.
        for (k, o) in off.iter_mut().enumerate() {
            *o += run as isize * strides[k][nd - 1];
        }
        index[nd - 1] += run;
        let mut axis = nd - 1;
        while index[axis] == shape[axis] {
            for (k, o) in off.iter_mut().enumerate() {
                *o -= shape[axis] as isize * strides[k][axis];
            }
            index[axis] = 0;
            axis -= 1;
            index[axis] += 1;
            for (k, o) in off.iter_mut().enumerate() {
                *o += strides[k][axis];
            }
        }
    }
}

/// Whether the CPU runs the AVX2 variants of the hot loops.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(super) fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// The error for a request whose dtype the CPU kernels do not compute on.
pub(super) fn unsupported(what: &str, dtype: DType) -> Error {
    Error::UnsupportedDType(format!("{what} on the CPU is not defined for {dtype}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_visits_runs_in_order() {
        // shape [2, 3], operand 0 row-major, operand 1 transposed.
        let mut seen = Vec::new();
        walk(&[2, 3], [&[3, 1], &[1, 2]], 1, 6, |off, len| {
            seen.push((off, len))
        });
        assert_eq!(seen, vec![([1, 2], 2), ([3, 1], 3)]);
        let mut seen = Vec::new();
        walk(&[2, 2, 2], [&[4, 2, 1]], 3, 7, |off, len| {
            seen.push((off, len))
        });
        assert_eq!(seen, vec![([3], 1), ([4], 2), ([6], 1)]);
    }

    #[test]
    fn chunks_cover_the_range_once() {
        let hits = std::sync::Mutex::new(vec![0u8; 100_003]);
        for_chunks(100_003, 1000, |s, e| {
            let mut h = hits.lock().unwrap();
            h[s..e].iter_mut().for_each(|x| *x += 1);
        });
        assert!(hits.into_inner().unwrap().iter().all(|&x| x == 1));
    }
}
