//! Operations composed of the built-in kernels, so that every backend has them with no kernel of
//! its own: `all` / `any` (a comparison and a `max` / `min` over bytes), `isnan` / `isinf` /
//! `isfinite` (comparisons); and, on backends whose [`reduce`] has no kernel for them, `argmax` /
//! `argmin` ([`arg_reduce`]) and `var` / `std` ([`moments`]: a mean, a difference, a square and a
//! sum).

use super::{
    BinaryOp, CompareOp, ReduceOp, ReducePlan, Scalar, UnaryOp, binary, binary_scalar, bool_bytes,
    cast, common_device, compare, compare_scalar, promote, reduce, reduce_with, unary, with_dtype,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Whether every element over `axes` is true (non-zero; NaN counts as true), as NumPy's `all`:
/// a `bool` array, `true` over no elements.
pub fn all(x: &Tensor, axes: Option<&[isize]>, keepdims: bool) -> Result<Tensor> {
    logical(false, x, axes, keepdims)
}

/// Whether any element over `axes` is true (non-zero; NaN counts as true), as NumPy's `any`: a
/// `bool` array, `false` over no elements.
pub fn any(x: &Tensor, axes: Option<&[isize]>, keepdims: bool) -> Result<Tensor> {
    logical(true, x, axes, keepdims)
}

fn logical(any: bool, x: &Tensor, axes: Option<&[isize]>, keepdims: bool) -> Result<Tensor> {
    let what = if any { "any" } else { "all" };
    common_device(what, [x])?;
    // One byte per element, non-zero where the element is true.
    let truth = if x.dtype() == DType::BOOL {
        bool_bytes(x)?
    } else {
        promote::require_numeric(x.dtype(), what)?;
        bool_bytes(&compare_scalar(CompareOp::Ne, x, Scalar::Int(0), false)?)?
    };
    let plan = ReducePlan::new(truth.shape(), truth.strides(), axes)?;
    if plan.count == 0 {
        // No elements: `any` is false and `all` true, in the shape a sum (0 each) has.
        let zeros = reduce(ReduceOp::Sum, &truth, axes, keepdims)?;
        let op = if any { CompareOp::Ne } else { CompareOp::Eq };
        return compare_scalar(op, &zeros, Scalar::Int(0), false);
    }
    let op = if any { ReduceOp::Max } else { ReduceOp::Min };
    // Any non-zero byte is true: the cast makes it 1.
    cast(&reduce(op, &truth, axes, keepdims)?, DType::BOOL)
}

/// Where `x` is NaN, a `bool` array (`false` everywhere for integers and `bool`), as NumPy's
/// `isnan`.
pub fn isnan(x: &Tensor) -> Result<Tensor> {
    classify("isnan", x, false, |x| compare(CompareOp::Ne, x, x))
}

/// Where `x` is an infinity of either sign, a `bool` array (`false` everywhere for integers and
/// `bool`), as NumPy's `isinf`.
pub fn isinf(x: &Tensor) -> Result<Tensor> {
    classify("isinf", x, false, |x| {
        let magnitude = unary(UnaryOp::Abs, x)?;
        compare_scalar(
            CompareOp::Eq,
            &magnitude,
            Scalar::Float(f64::INFINITY),
            false,
        )
    })
}

/// Where `x` is neither NaN nor infinite, a `bool` array (`true` everywhere for integers and
/// `bool`), as NumPy's `isfinite`.
pub fn isfinite(x: &Tensor) -> Result<Tensor> {
    classify("isfinite", x, true, |x| {
        // NaN compares false, as it should here.
        let magnitude = unary(UnaryOp::Abs, x)?;
        compare_scalar(
            CompareOp::Lt,
            &magnitude,
            Scalar::Float(f64::INFINITY),
            false,
        )
    })
}

/// A classification of `x`'s elements: `float_test` on floats; on integers and `bool`, `integers`
/// everywhere (each element compared with itself).
fn classify(
    what: &str,
    x: &Tensor,
    integers: bool,
    float_test: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    common_device(what, [x])?;
    if x.dtype() != DType::BOOL {
        promote::require_numeric(x.dtype(), what)?;
    }
    if x.dtype().is_floating() {
        float_test(x)
    } else {
        let op = if integers {
            CompareOp::Eq
        } else {
            CompareOp::Ne
        };
        compare(op, x, x)
    }
}

/// The variance over `axes` with `ddof` delta degrees of freedom, as NumPy's `var`: the mean
/// squared deviation from the mean, divided by `max(n - ddof, 0)` (so `inf` or NaN when that is
/// 0, as NumPy's values). Floating arrays keep their dtype and compute in at least `float32`;
/// integer and `bool` arrays give `float64`. One pass over the data where the backend has a
/// kernel for it ([`ReduceOp::Var`]), else composed of a mean, a difference, a square and a sum.
pub fn var(x: &Tensor, axes: Option<&[isize]>, ddof: f64, keepdims: bool) -> Result<Tensor> {
    deviation(ReduceOp::Var, x, axes, ddof, keepdims)
}

/// The standard deviation: the square root of [`var`].
pub fn std(x: &Tensor, axes: Option<&[isize]>, ddof: f64, keepdims: bool) -> Result<Tensor> {
    deviation(ReduceOp::Std, x, axes, ddof, keepdims)
}

fn deviation(
    op: ReduceOp,
    x: &Tensor,
    axes: Option<&[isize]>,
    ddof: f64,
    keepdims: bool,
) -> Result<Tensor> {
    if !ddof.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "{}: ddof must be a finite number, not {ddof}",
            op.name()
        )));
    }
    reduce_with(op, x, axes, keepdims, ddof)
}

/// `var` / `std` (`op`) of `x` (not `bool`) composed of the built-in kernels, for backends
/// without a kernel for them: a mean, a difference, a square, a sum and a division.
pub(super) fn moments(
    op: ReduceOp,
    x: &Tensor,
    axes: Option<&[isize]>,
    ddof: f64,
    keepdims: bool,
) -> Result<Tensor> {
    let (work, out) = promote::reduce_types(op, x.dtype())?;
    let plan = ReducePlan::new(x.shape(), x.strides(), axes)?;
    let x = with_dtype(x, work)?;
    let mean = reduce(ReduceOp::Mean, &x, axes, true)?;
    let deviation = binary(BinaryOp::Sub, &x, &mean)?;
    let squares = unary(UnaryOp::Square, &deviation)?;
    let total = reduce(ReduceOp::Sum, &squares, axes, keepdims)?;
    let divisor = (plan.count as f64 - ddof).max(0.0);
    let v = binary_scalar(BinaryOp::Div, &total, Scalar::Float(divisor), false)?;
    let v = if op == ReduceOp::Std {
        unary(UnaryOp::Sqrt, &v)?
    } else {
        v
    };
    with_dtype(&v, out)
}

/// `argmax` / `argmin` of `x` over the plan's reduced axes, of the built-in kernels:
///
/// 1. `m`: the `max` (`min`) with the reduced axes kept, NaN where a NaN is;
/// 2. `hit`: 1 where `x == m`, or where `x` is NaN (both never hold at once: where `m` is a
///    number there is no NaN, and where it is NaN nothing equals it);
/// 3. `key = hit * (n - j)`, `j` the element's row-major index over the reduced axes and `n`
///    their element count, so that the first hit has the largest key and misses have 0;
/// 4. the result is `n - max(key)`.
///
/// The index keys `n - j` are the sum of one small vector per reduced axis, broadcast on the
/// device. The plan has at least one element per output (the front checks).
pub(super) fn arg_reduce(
    op: ReduceOp,
    x: &Tensor,
    plan: &ReducePlan,
    keepdims: bool,
) -> Result<Tensor> {
    let extreme = match op {
        ReduceOp::ArgMax => ReduceOp::Max,
        ReduceOp::ArgMin => ReduceOp::Min,
        other => {
            return Err(Error::InvalidArgument(format!(
                "{} is not an arg reduction",
                other.name()
            )));
        }
    };
    let ndim = x.ndim();
    let reduced: Vec<usize> = (0..ndim).filter(|&a| plan.keepdims_shape[a] == 1).collect();
    // Axes of extent 1 may be kept or reduced: either way their index is 0, so counting them as
    // reduced changes neither the keys nor the result (the shapes come from `plan`).
    let axes: Vec<isize> = reduced.iter().map(|&a| a as isize).collect();
    let m = reduce(extreme, x, Some(&axes), true)?;
    let hit = bool_bytes(&compare(CompareOp::Eq, x, &m)?)?;
    let hit = if x.dtype().is_floating() {
        let nan = bool_bytes(&compare(CompareOp::Ne, x, x)?)?;
        binary(BinaryOp::Add, &hit, &nan)?
    } else {
        hit
    };
    let n = plan.count as i64;
    let keys = index_keys(x, &reduced, n)?;
    let keyed = binary(BinaryOp::Mul, &hit, &keys)?;
    let best = reduce(ReduceOp::Max, &keyed, Some(&axes), false)?;
    let index = binary_scalar(BinaryOp::Sub, &best, Scalar::Int(n), true)?;
    let shape: Vec<Option<usize>> = if keepdims {
        plan.keepdims_shape.iter().copied().map(Some).collect()
    } else {
        plan.out_shape.iter().copied().map(Some).collect()
    };
    index.reshape(&shape)
}

/// `n - j` on `x`'s device, `int64`, of `x`'s shape with 1 on the axes not in `reduced`: `j` the
/// row-major index of an element over the `reduced` axes.
fn index_keys(x: &Tensor, reduced: &[usize], n: i64) -> Result<Tensor> {
    let ndim = x.ndim();
    let storage = Some(x.buffer().storage_mode());
    let mut stride = 1i64;
    let mut keys: Option<Tensor> = None;
    for &axis in reduced.iter().rev() {
        let len = x.shape()[axis];
        let first = keys.is_none();
        // The last axis folds in `n` itself.
        let values: Vec<i64> = (0..len as i64)
            .map(|i| if first { n } else { 0 } - i * stride)
            .collect();
        let mut shape = vec![1usize; ndim];
        shape[axis] = len;
        let term = Tensor::from_slice(&values, &shape)?.copy_to_storage(x.device(), storage)?;
        keys = Some(match keys {
            None => term,
            Some(k) => binary(BinaryOp::Add, &k, &term)?,
        });
        stride *= len as i64;
    }
    match keys {
        Some(k) => Ok(k),
        // No axis to index (every reduced axis has extent 1): one key, `n` (= 1).
        None => Tensor::from_slice(&[n], &vec![1usize; ndim])?.copy_to_storage(x.device(), storage),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;

    fn host(values: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(values, shape).unwrap()
    }

    /// The composed arg reductions (what CUDA and Metal run) against the CPU kernel, on views
    /// with NaN, ties and every choice of axes.
    #[test]
    fn composed_arg_reductions_match_the_kernel() {
        let mut values: Vec<f32> = (0..60).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        values[17] = f32::NAN;
        values[41] = f32::NAN;
        let x = host(&values, &[3, 4, 5]);
        let views = [
            x.clone(),
            x.permute(&[2, 0, 1]).unwrap(),
            x.slice(
                1,
                crate::layout::SliceArg {
                    start: None,
                    stop: None,
                    step: -1,
                },
            )
            .unwrap(),
        ];
        let axis_sets: [Option<&[isize]>; 6] = [
            None,
            Some(&[0]),
            Some(&[1]),
            Some(&[-1]),
            Some(&[0, 2]),
            Some(&[2, 1]),
        ];
        for v in &views {
            for axes in axis_sets {
                for op in [ReduceOp::ArgMax, ReduceOp::ArgMin] {
                    for keepdims in [false, true] {
                        let want = reduce(op, v, axes, keepdims).unwrap();
                        let plan = ReducePlan::new(v.shape(), v.strides(), axes).unwrap();
                        let got = arg_reduce(op, v, &plan, keepdims).unwrap();
                        assert_eq!(got.shape(), want.shape(), "{op:?} {axes:?}");
                        assert_eq!(
                            got.to_vec::<i64>().unwrap(),
                            want.to_vec::<i64>().unwrap(),
                            "{op:?} over {axes:?} of {:?}",
                            v.strides()
                        );
                    }
                }
            }
        }
        // Integers, and a NaN-free float array with ties.
        let ints = Tensor::from_slice(&[3i16, 9, 9, -2, 9, -2], &[2, 3]).unwrap();
        for op in [ReduceOp::ArgMax, ReduceOp::ArgMin] {
            for axes in [None, Some(&[0isize][..]), Some(&[1][..])] {
                let plan = ReducePlan::new(ints.shape(), ints.strides(), axes).unwrap();
                assert_eq!(
                    arg_reduce(op, &ints, &plan, false)
                        .unwrap()
                        .to_vec::<i64>()
                        .unwrap(),
                    reduce(op, &ints, axes, false)
                        .unwrap()
                        .to_vec::<i64>()
                        .unwrap()
                );
            }
        }
        assert_eq!(x.device(), Device::CPU);
    }
}
