//! Batched matrix products through the `gemm` crate, which reads any row and column strides and
//! splits large products over rayon's threads itself.
//!
//! | dtype | how |
//! | --- | --- |
//! | `float32`, `float64` | `gemm` on the operands in place |
//! | `float16` | `gemm`'s `f16` kernels (products accumulated in `f32`, rounded once) |
//! | `bfloat16` | `gemm` has no `bf16` kernels: the operands are widened to compact `f32` copies, multiplied in `f32`, and the result rounded once into `bfloat16` |
//!
//! Batches of small matrices run one matrix per task on rayon's pool instead.

use half::{bf16, f16};

use super::{Input, SharedPtr, output, unsupported};
use crate::compute::{MatmulRequest, MatrixLayout};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// Below this many multiply-adds per matrix, a batch is split over threads by matrix.
const SMALL: usize = 64 * 64 * 64;

/// The element types `gemm` multiplies.
trait Gemm: Element + Default {
    const ZERO: Self;
    const ONE: Self;
}

impl Gemm for f16 {
    const ZERO: Self = f16::ZERO;
    const ONE: Self = f16::ONE;
}

impl Gemm for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

impl Gemm for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

/// Runs a matmul request.
pub(super) fn run(req: &MatmulRequest<'_>) -> Result<()> {
    let dtype = req.out.dtype();
    if req.a.dtype() != dtype || req.b.dtype() != dtype {
        return Err(Error::DTypeMismatch(format!(
            "matmul on the CPU multiplies one dtype, got {} @ {} into {dtype}",
            req.a.dtype(),
            req.b.dtype()
        )));
    }
    if req.out.numel() != req.batch * req.m * req.n {
        return Err(Error::InvalidArgument(
            "a matmul request's output must hold batch × m × n elements".into(),
        ));
    }
    match dtype {
        DType::F16 => typed::<f16>(req),
        DType::F32 => typed::<f32>(req),
        DType::F64 => typed::<f64>(req),
        DType::BF16 => through_f32(req),
        _ => Err(unsupported("matmul", dtype)),
    }
}

/// One operand: its first element and layout.
#[derive(Clone, Copy)]
struct Operand<T> {
    first: SharedPtr<T>,
    layout: MatrixLayout,
}

impl<T> Operand<T> {
    /// Matrix `i` of the batch.
    fn matrix(self, i: usize) -> *const T {
        self.first
            .get()
            .wrapping_offset(i as isize * self.layout.batch_stride)
    }
}

fn typed<T: Gemm>(req: &MatmulRequest<'_>) -> Result<()> {
    let (a, b) = (
        Input::new(req.a, "multiplying it")?,
        Input::new(req.b, "multiplying it")?,
    );
    let out = output::<T>(req.out)?;
    // SAFETY: `a` and `b` address the request's matrices by their layouts (inside their live
    // buffers, which the `Input`s keep alive or copy); `out` is the request's fresh compact
    // `batch × m × n` result, disjoint from both.
    unsafe {
        product(
            Operand {
                first: SharedPtr(a.ptr::<T>().cast_mut()),
                layout: req.a_layout,
            },
            Operand {
                first: SharedPtr(b.ptr::<T>().cast_mut()),
                layout: req.b_layout,
            },
            out,
            req,
        )
    };
    Ok(())
}

/// `out[i] = a[i] @ b[i]` for the request's batch, `out` compact row-major.
///
/// # Safety
/// `a` and `b` must address readable `batch × m × k` and `batch × k × n` matrices by their
/// layouts, not written during the call; `out` must address `batch × m × n` writable elements
/// that nothing else accesses.
unsafe fn product<T: Gemm>(a: Operand<T>, b: Operand<T>, out: *mut T, req: &MatmulRequest<'_>) {
    let (m, k, n) = (req.m, req.k, req.n);
    if k == 0 {
        // An empty sum: zeros.
        // SAFETY: `batch × m × n` writable elements by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(out, req.batch * m * n) }.fill(T::ZERO);
        return;
    }
    let out = SharedPtr(out);
    let one = |i: usize, parallelism: gemm::Parallelism| {
        let dst = out.get().wrapping_add(i * m * n);
        // SAFETY: matrix `i` of each operand, addressed by its strides inside its buffer (the
        // caller's contract); `dst` is matrix `i` of `out`, `m × n` row-major, which only this
        // call writes. `read_dst` is false, so `dst` is only written (`alpha` is unused).
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst,
                1,
                n as isize,
                false,
                a.matrix(i),
                a.layout.col_stride,
                a.layout.row_stride,
                b.matrix(i),
                b.layout.col_stride,
                b.layout.row_stride,
                T::ZERO,
                T::ONE,
                false,
                false,
                false,
                parallelism,
            )
        };
    };
    let small = m.saturating_mul(n).saturating_mul(k) < SMALL;
    if req.batch == 1 && small {
        // Too little work to share: no hop onto the workers.
        one(0, gemm::Parallelism::None);
        return;
    }
    // gemm's rayon parallelism, like the batch loop, runs on the CPU workers.
    crate::backend::cpu::workers::install(|| {
        if req.batch > 1 && small {
            use rayon::prelude::*;
            (0..req.batch)
                .into_par_iter()
                .for_each(|i| one(i, gemm::Parallelism::None));
        } else {
            for i in 0..req.batch {
                one(i, gemm::Parallelism::Rayon(0));
            }
        }
    });
}

/// A compact `f32` copy of an operand's matrices (one when the batch stride is 0), and its
/// layout.
fn widened(
    t: &crate::Tensor,
    layout: MatrixLayout,
    batch: usize,
) -> Result<(Vec<f32>, MatrixLayout)> {
    let host = Input::new(t, "multiplying it")?;
    let first = host.ptr::<bf16>();
    let count = if layout.batch_stride == 0 { 1 } else { batch };
    let (rows, cols) = (layout.rows, layout.cols);
    let len = count
        .checked_mul(rows)
        .and_then(|n| n.checked_mul(cols))
        .ok_or_else(|| crate::error::overflow("the size of a widened matmul operand"))?;
    let mut dst = crate::error::host_vec(len)?;
    for i in 0..count as isize {
        for r in 0..rows as isize {
            for c in 0..cols as isize {
                let at = i * layout.batch_stride + r * layout.row_stride + c * layout.col_stride;
                // SAFETY: element `[i, r, c]` of the operand by its layout, inside its buffer.
                dst.push(unsafe { *first.wrapping_offset(at) }.to_f32());
            }
        }
    }
    let compact = MatrixLayout {
        rows,
        cols,
        row_stride: cols as isize,
        col_stride: 1,
        batch_stride: if count == 1 {
            0
        } else {
            (rows * cols) as isize
        },
    };
    Ok((dst, compact))
}

/// `bfloat16`: widened to `f32`, multiplied, rounded once.
fn through_f32(req: &MatmulRequest<'_>) -> Result<()> {
    let (a, a_layout) = widened(req.a, req.a_layout, req.batch)?;
    let (b, b_layout) = widened(req.b, req.b_layout, req.batch)?;
    // The output's element count, which its allocation already checked.
    let len = req.batch * req.m * req.n;
    let mut product_f32 = crate::error::host_vec(len)?;
    product_f32.resize(len, 0f32);
    // SAFETY: `a` and `b` are compact copies described by their layouts; `product_f32` holds
    // `batch × m × n` elements and is borrowed by nothing else.
    unsafe {
        product(
            Operand {
                first: SharedPtr(a.as_ptr().cast_mut()),
                layout: a_layout,
            },
            Operand {
                first: SharedPtr(b.as_ptr().cast_mut()),
                layout: b_layout,
            },
            product_f32.as_mut_ptr(),
            req,
        )
    };
    let out = output::<bf16>(req.out)?;
    // SAFETY: `out` is the request's fresh compact result of `len` elements, which nothing else
    // references.
    let out = unsafe { std::slice::from_raw_parts_mut(out, len) };
    use half::slice::HalfFloatSliceExt;
    out.convert_from_f32_slice(&product_f32);
    Ok(())
}
