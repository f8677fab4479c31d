//! The built-in kernels through the public front (`dlbridge::compute`), checked against naive
//! references computed here in `f64` (floats) or `i128` wrapped to the dtype (integers). Each body
//! is written once against a [`Dev`] and instantiated by `device_tests!` for the CPU and CUDA
//! (`cpu::name`, `cuda::name`, the latter ignored unless asked for); the bodies compute in
//! `float64` throughout, so they have no Metal instance yet (compute.rs's bodies run there). The
//! few plain `#[test]`s are the CPU's own: foreign host memory, the host converter, and the
//! accuracy of its summation and one-pass variance.
//!
//! Inputs come from a tiny deterministic xorshift generator (fixed seeds, so a failure
//! reproduces). Float results must be within a relative bound per dtype (a few ulp of the
//! result; for sums and products, of the sum of magnitudes); integer results must be exact.

mod common;

use common::devices::{Dev, device_tests};
use common::{Rng, raw_bytes};
use dlbridge::compute::{self, BinaryOp, CompareOp, ReduceOp, Scalar, UnaryOp};
use dlbridge::{DType, Device, DeviceKind, Error, Layout, SliceArg, Tensor};

device_tests! {
    cpu_and_cuda: [
        unary_ops_on_floats,
        unary_ops_on_integers,
        transcendental_results_of_integers_follow_numpy,
        float_special_values,
        trig_of_large_arguments,
        binary_ops_on_floats_and_integers,
        integer_division_returns_float64,
        integer_arithmetic_wraps,
        mixed_dtypes_promote,
        scalars_on_either_side,
        broadcasting_shapes,
        strided_transposed_and_reversed_views,
        comparisons_on_every_dtype_follow_ieee_and_exact_integers,
        comparisons_with_scalars_mixed_dtypes_and_bool,
        zero_d_and_empty,
        reductions_over_every_dtype,
        reductions_over_outer_axes_and_views,
        max_and_min_propagate_nan,
        empty_reductions,
        integer_sums_widen_and_wrap,
        matmul_shapes_and_dtypes,
        matmul_of_views,
        matmul_with_empty_contraction_is_zero,
        errors_name_what_went_wrong,
        integer_floor_division_and_remainder_edges_follow_numpy,
        powers_wrap_and_negative_integer_exponents_are_refused,
        prod_and_arg_reductions_follow_numpy,
        logical_and_moment_reductions_follow_numpy,
        advanced_indexing_gathers_and_scatters_views,
    ],
}

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

const FLOATS: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];
const INTS: [DType; 8] = [
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
];

fn is_signed(dtype: DType) -> bool {
    matches!(dtype, DType::I8 | DType::I16 | DType::I32 | DType::I64)
}

/// `v` wrapped into `dtype`'s integer range.
fn wrap(v: i128, dtype: DType) -> i128 {
    let bits = dtype.bits() as u32;
    let m = v.rem_euclid(1i128 << bits);
    if is_signed(dtype) && m >= 1i128 << (bits - 1) {
        m - (1i128 << bits)
    } else {
        m
    }
}

/// `n` integers spread over all of `dtype`'s range (edges included).
fn int_values(rng: &mut Rng, n: usize, dtype: DType) -> Vec<i128> {
    let bits = dtype.bits() as u32;
    let (lo, hi) = if is_signed(dtype) {
        (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)
    } else {
        (0, (1i128 << bits) - 1)
    };
    (0..n)
        .map(|i| match i % 7 {
            0 => lo,
            1 => hi,
            2 => (rng.next() % 7) as i128 - 3,
            _ => wrap(rng.next() as i128, dtype),
        })
        .collect()
}

/// A tensor of `dtype` on `dev` holding integers.
fn int_tensor(dev: &Dev, values: &[i128], shape: &[usize], dtype: DType) -> Tensor {
    let host = if is_signed(dtype) {
        let v: Vec<i64> = values.iter().map(|&x| x as i64).collect();
        Tensor::from_slice(&v, shape).unwrap().cast(dtype).unwrap()
    } else {
        let v: Vec<u64> = values.iter().map(|&x| x as u64).collect();
        Tensor::from_slice(&v, shape).unwrap().cast(dtype).unwrap()
    };
    dev.put(&host)
}

/// The integers of a tensor (any layout, any device), row-major.
fn ints(t: &Tensor) -> Vec<i128> {
    let t = t.copy_to(Device::CPU).unwrap();
    if is_signed(t.dtype()) {
        let v = t.cast(DType::I64).unwrap().to_vec::<i64>().unwrap();
        v.into_iter().map(i128::from).collect()
    } else {
        let v = t.cast(DType::U64).unwrap().to_vec::<u64>().unwrap();
        v.into_iter().map(i128::from).collect()
    }
}

/// A host tensor of `dtype` holding `values` (rounded into the dtype).
fn host_tensor(values: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_slice(values, shape)
        .unwrap()
        .cast(dtype)
        .unwrap()
}

/// A tensor of `dtype` on `dev` holding `values` (rounded into the dtype on the host).
fn tensor(dev: &Dev, values: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    dev.put(&host_tensor(values, shape, dtype))
}

/// Random floats in `[lo, hi)`, as stored in `dtype`, on `dev`.
fn float_tensor(
    dev: &Dev,
    rng: &mut Rng,
    shape: &[usize],
    dtype: DType,
    lo: f64,
    hi: f64,
) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
    tensor(dev, &v, shape, dtype)
}

/// The elements of a tensor (any layout, any device) as `f64`, row-major.
fn values(t: &Tensor) -> Vec<f64> {
    let t = t.copy_to(Device::CPU).unwrap();
    t.cast(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// A scalar rounded into `dtype`, as the kernels take it.
fn rounded(v: f64, dtype: DType) -> f64 {
    values(&host_tensor(&[v], &[], dtype))[0]
}

/// Relative bound on element-wise float results.
fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2e-3,
        DType::BF16 => 1.6e-2,
        DType::F32 => 5e-7,
        _ => 1e-14,
    }
}

/// The smallest magnitude `dtype` distinguishes from 0 (an absolute floor for the bounds).
fn floor(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 6e-8,
        DType::BF16 => 9.2e-41,
        DType::F32 => 1.5e-45,
        _ => 5e-324,
    }
}

/// The largest finite value of a float dtype.
fn max_finite(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 65504.0,
        DType::BF16 => 3.3895e38,
        DType::F32 => f32::MAX as f64,
        _ => f64::MAX,
    }
}

/// A compensated (Neumaier) sum, so that the references are more accurate than the kernels.
fn exact_sum(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (mut sum, mut comp) = (0.0f64, 0.0f64);
    for x in xs {
        let t = sum + x;
        comp += if sum.abs() >= x.abs() {
            (sum - t) + x
        } else {
            (x - t) + sum
        };
        sum = t;
    }
    sum + comp
}

/// Each `got[i]` is within `rel * scale[i] + floor` of `want[i]`; NaN matches NaN and
/// infinities must be equal.
fn assert_close_scaled(
    got: &[f64],
    want: &[f64],
    scale: &[f64],
    rel: f64,
    dtype: DType,
    what: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        if w.is_infinite() {
            assert_eq!(g, w, "{what}[{i}]");
            continue;
        }
        if g.is_infinite() {
            // Only a value beyond the dtype's range may become an infinity when stored.
            assert!(
                g.signum() == w.signum() && w.abs() >= max_finite(dtype),
                "{what}[{i}]: got {g}, want {w}"
            );
            continue;
        }
        let bound = rel * scale[i].abs() + floor(dtype);
        assert!(
            (g - w).abs() <= bound,
            "{what}[{i}]: got {g}, want {w} (error {:e}, bound {bound:e})",
            (g - w).abs()
        );
    }
}

/// Whether `t` is on a GPU, whose math libraries are good to a few ulp rather than one, and whose
/// reductions and products accumulate in other orders: the bounds there are those compute.rs
/// holds the GPUs to.
fn on_gpu(t: &Tensor) -> bool {
    t.device().kind() != DeviceKind::Cpu
}

/// `got`'s elements within [`tol`] of `want` (four times that on a GPU: 16 ulp for float32, the
/// bound of CUDA's `powf`).
fn assert_close(got: &Tensor, want: &[f64], what: &str) {
    let rel = tol(got.dtype()) * if on_gpu(got) { 4.0 } else { 1.0 };
    assert_close_scaled(&values(got), want, want, rel, got.dtype(), what);
}

// ---------------------------------------------------------------------------------------------
// References
// ---------------------------------------------------------------------------------------------

fn unary_f64(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Square => x * x,
        UnaryOp::Negative => -x,
    }
}

fn unary_int(op: UnaryOp, x: i128) -> i128 {
    match op {
        UnaryOp::Abs => x.abs(),
        UnaryOp::Square => x.wrapping_mul(x),
        UnaryOp::Negative => -x,
        _ => unreachable!("transcendental ops return floats"),
    }
}

/// The float reference of `op`, for results of `dtype` (floor division and remainder computed
/// in `dtype`'s computing type, as the kernels and NumPy compute them; the rest in `f64`).
fn binary_f64(op: BinaryOp, x: f64, y: f64, dtype: DType) -> f64 {
    let divmod = |x: f64, y: f64| common::numpy_divmod(dtype, x, y);
    match op {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
        BinaryOp::FloorDiv => divmod(x, y).0,
        BinaryOp::Mod => divmod(x, y).1,
        BinaryOp::Pow => x.powf(y),
    }
}

fn binary_int(op: BinaryOp, x: i128, y: i128) -> i128 {
    match op {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x.wrapping_mul(y),
        BinaryOp::Div => unreachable!("integer division returns floats"),
        // NumPy's values for a zero divisor: 0.
        BinaryOp::FloorDiv if y == 0 => 0,
        BinaryOp::FloorDiv => {
            let q = x / y;
            if x % y != 0 && ((x < 0) != (y < 0)) {
                q - 1
            } else {
                q
            }
        }
        BinaryOp::Mod if y == 0 => 0,
        BinaryOp::Mod => {
            let r = x % y;
            if r != 0 && ((r < 0) != (y < 0)) {
                r + y
            } else {
                r
            }
        }
        BinaryOp::Pow => {
            // Square and multiply modulo 2^128: the low bits are those of the exact power.
            assert!(y >= 0, "negative integer exponents are refused");
            let (mut r, mut sq, mut e) = (1u128, x as u128, y as u128);
            while e != 0 {
                if e & 1 == 1 {
                    r = r.wrapping_mul(sq);
                }
                sq = sq.wrapping_mul(sq);
                e >>= 1;
            }
            r as i128
        }
    }
}

/// Whether `binary(op, ..)` computing in integer `dtype` must refuse exponents `exps` (NumPy
/// refuses negative integer powers).
fn refuses_power(op: BinaryOp, dtype: DType, exps: &[i128]) -> bool {
    op == BinaryOp::Pow && is_signed(dtype) && exps.iter().any(|&e| e < 0)
}

/// The range each unary op is tested on, per dtype.
fn unary_domain(op: UnaryOp) -> (f64, f64) {
    match op {
        UnaryOp::Exp => (-10.0, 10.0),
        UnaryOp::Log | UnaryOp::Sqrt => (-0.5, 100.0),
        UnaryOp::Sin | UnaryOp::Cos => (-30.0, 30.0),
        _ => (-100.0, 100.0),
    }
}

/// Checks `unary(op, x)` against the reference.
fn check_unary(op: UnaryOp, x: &Tensor, what: &str) {
    let got = compute::unary(op, x).unwrap();
    assert_eq!(got.shape(), x.shape(), "{what}");
    let what = format!("{what} {} {}", op.name(), x.dtype());
    if op.is_transcendental() || x.dtype().is_floating() {
        let want: Vec<f64> = values(x).into_iter().map(|v| unary_f64(op, v)).collect();
        assert_close(&got, &want, &what);
    } else {
        assert_eq!(got.dtype(), x.dtype(), "{what}");
        let want: Vec<i128> = ints(x)
            .into_iter()
            .map(|v| wrap(unary_int(op, v), x.dtype()))
            .collect();
        assert_eq!(ints(&got), want, "{what}");
    }
}

/// Checks `binary(op, a, b)` against the reference (broadcasting `a` and `b` itself).
fn check_binary(op: BinaryOp, a: &Tensor, b: &Tensor, what: &str) {
    let common = compute::promote::promote(a.dtype(), b.dtype()).unwrap();
    if !common.is_floating() && refuses_power(op, common, &ints(b)) {
        let err = compute::binary(op, a, b).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("negative"),
            "{what}: {err}"
        );
        return;
    }
    let got = compute::binary(op, a, b).unwrap();
    let shape = got.shape().to_vec();
    let what = format!("{what} {} {} {}", op.name(), a.dtype(), b.dtype());
    let (a, b) = (
        a.broadcast_to(&shape).unwrap(),
        b.broadcast_to(&shape).unwrap(),
    );
    if got.dtype().is_floating() {
        let (va, vb) = (values(&a), values(&b));
        let want: Vec<f64> = va
            .iter()
            .zip(&vb)
            .map(|(&x, &y)| binary_f64(op, x, y, got.dtype()))
            .collect();
        assert_close(&got, &want, &what);
    } else {
        let want: Vec<i128> = ints(&a)
            .into_iter()
            .zip(ints(&b))
            .map(|(x, y)| wrap(binary_int(op, x, y), got.dtype()))
            .collect();
        assert_eq!(ints(&got), want, "{what}");
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise
// ---------------------------------------------------------------------------------------------

const SIZES: [usize; 6] = [0, 1, 7, 1023, 1024 + 33, 100_003];

fn unary_ops_on_floats(dev: &Dev) {
    let mut rng = Rng::new(1);
    for dtype in FLOATS {
        for op in UnaryOp::ALL {
            let (lo, hi) = unary_domain(op);
            for n in SIZES {
                let x = float_tensor(dev, &mut rng, &[n], dtype, lo, hi);
                check_unary(op, &x, &format!("[{n}]"));
            }
        }
    }
}

fn unary_ops_on_integers(dev: &Dev) {
    let mut rng = Rng::new(2);
    for dtype in INTS {
        for op in UnaryOp::ALL {
            for n in [0, 1, 7, 1023, 70_001] {
                let x = if op.is_transcendental() {
                    // Small non-negative values, so the float results are meaningful.
                    let v: Vec<i128> = (0..n).map(|_| (rng.next() % 100) as i128).collect();
                    int_tensor(dev, &v, &[n], dtype)
                } else {
                    int_tensor(dev, &int_values(&mut rng, n, dtype), &[n], dtype)
                };
                check_unary(op, &x, &format!("[{n}]"));
            }
        }
    }
}

fn transcendental_results_of_integers_follow_numpy(dev: &Dev) {
    let x = int_tensor(dev, &[4, 9], &[2], DType::U8);
    let y = compute::unary(UnaryOp::Sqrt, &x).unwrap();
    assert_eq!(y.dtype(), DType::F16);
    assert_eq!(values(&y), vec![2.0, 3.0]);
    let y = compute::unary(UnaryOp::Exp, &int_tensor(dev, &[0], &[1], DType::I16)).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    let y = compute::unary(UnaryOp::Log, &int_tensor(dev, &[1], &[1], DType::I64)).unwrap();
    assert_eq!((y.dtype(), values(&y)), (DType::F64, vec![0.0]));
}

fn float_special_values(dev: &Dev) {
    let special = [
        0.0,
        -0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        1e-30,
        -1e-30,
        1e30,
        88.0,
        -100.0,
    ];
    for dtype in FLOATS {
        let x = tensor(dev, &special, &[special.len()], dtype);
        for op in UnaryOp::ALL {
            check_unary(op, &x, "special");
        }
        for op in BinaryOp::ALL {
            check_binary(op, &x, &x.slice(0, rev()).unwrap(), "special");
        }
    }
}

fn trig_of_large_arguments(dev: &Dev) {
    // Arguments beyond the vectorised reduction's range, mixed with ordinary ones in one run.
    let mut rng = Rng::new(12);
    let v: Vec<f64> = (0..5000)
        .map(|i| {
            let x = rng.uniform(-1.0, 1.0);
            if i % 3 == 0 { x * 1e7 } else { x * 10.0 }
        })
        .collect();
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let x = tensor(dev, &v, &[v.len()], dtype);
        for op in [UnaryOp::Sin, UnaryOp::Cos] {
            check_unary(op, &x, "large");
            let one = x.slice(0, SliceArg::range(3, 4)).unwrap();
            check_unary(
                op,
                &one.broadcast_to(&[50]).unwrap(),
                "one large, broadcast",
            );
        }
    }
}

fn binary_ops_on_floats_and_integers(dev: &Dev) {
    let mut rng = Rng::new(3);
    for dtype in FLOATS.into_iter().chain(INTS) {
        for n in SIZES {
            let (a, b) = if dtype.is_floating() {
                (
                    float_tensor(dev, &mut rng, &[n], dtype, -50.0, 50.0),
                    float_tensor(dev, &mut rng, &[n], dtype, 0.5, 50.0),
                )
            } else {
                (
                    int_tensor(dev, &int_values(&mut rng, n, dtype), &[n], dtype),
                    int_tensor(dev, &int_values(&mut rng, n, dtype), &[n], dtype),
                )
            };
            for op in BinaryOp::ALL {
                check_binary(op, &a, &b, &format!("[{n}]"));
            }
            // The same tensor twice: inputs may share memory.
            check_binary(BinaryOp::Mul, &a, &a, &format!("[{n}] aliased"));
        }
    }
}

fn integer_division_returns_float64(dev: &Dev) {
    let a = int_tensor(dev, &[7, -7, 1, 0], &[4], DType::I32);
    let b = int_tensor(dev, &[2, 2, 0, 0], &[4], DType::I32);
    let q = compute::binary(BinaryOp::Div, &a, &b).unwrap();
    assert_eq!(q.dtype(), DType::F64);
    let v = values(&q);
    assert_eq!(&v[..3], &[3.5, -3.5, f64::INFINITY]);
    assert!(v[3].is_nan());
}

fn integer_arithmetic_wraps(dev: &Dev) {
    let i8s = |v: &[i128]| int_tensor(dev, v, &[v.len()], DType::I8);
    let r = compute::binary(BinaryOp::Add, &i8s(&[127, -128]), &i8s(&[1, -1])).unwrap();
    assert_eq!(ints(&r), vec![-128, 127]);
    let r = compute::unary(UnaryOp::Abs, &i8s(&[-128, -5])).unwrap();
    assert_eq!(ints(&r), vec![-128, 5]);
    let r = compute::unary(
        UnaryOp::Negative,
        &int_tensor(dev, &[1, 0], &[2], DType::U8),
    )
    .unwrap();
    assert_eq!(ints(&r), vec![255, 0]);
    let r = compute::unary(UnaryOp::Square, &int_tensor(dev, &[300], &[1], DType::I16)).unwrap();
    assert_eq!(ints(&r), vec![wrap(90_000, DType::I16)]);
    let big = int_tensor(dev, &[i64::MIN as i128], &[1], DType::I64);
    assert_eq!(
        ints(&compute::unary(UnaryOp::Abs, &big).unwrap()),
        vec![i64::MIN as i128]
    );
    let r = compute::binary_scalar(
        BinaryOp::Mul,
        &int_tensor(dev, &[u64::MAX as i128], &[1], DType::U64),
        Scalar::Int(2),
        false,
    )
    .unwrap();
    assert_eq!(ints(&r), vec![(u64::MAX - 1) as i128]);
}

fn mixed_dtypes_promote(dev: &Dev) {
    let a = int_tensor(dev, &[-3, 100], &[2], DType::I8);
    let b = int_tensor(dev, &[200, 255], &[2], DType::U8);
    let r = compute::binary(BinaryOp::Add, &a, &b).unwrap();
    assert_eq!((r.dtype(), ints(&r)), (DType::I16, vec![197, 355]));
    let f = tensor(dev, &[0.5, 0.25], &[2], DType::F32);
    let r = compute::binary(BinaryOp::Mul, &a, &f).unwrap();
    assert_eq!((r.dtype(), values(&r)), (DType::F32, vec![-1.5, 25.0]));
    let h = tensor(dev, &[1.5, 2.5], &[2], DType::F16);
    let bh = tensor(dev, &[1.5, 2.5], &[2], DType::BF16);
    let r = compute::binary(BinaryOp::Add, &h, &bh).unwrap();
    assert_eq!((r.dtype(), values(&r)), (DType::F32, vec![3.0, 5.0]));
}

fn scalars_on_either_side(dev: &Dev) {
    let mut rng = Rng::new(4);
    let scalars = [
        Scalar::Int(3),
        Scalar::Int(-300),
        Scalar::Float(0.1),
        Scalar::Float(-2.5),
    ];
    for dtype in FLOATS.into_iter().chain(INTS) {
        let x = if dtype.is_floating() {
            float_tensor(dev, &mut rng, &[3, 37], dtype, 0.5, 10.0)
        } else {
            int_tensor(dev, &int_values(&mut rng, 111, dtype), &[3, 37], dtype)
        };
        for s in scalars {
            for op in BinaryOp::ALL {
                for first in [false, true] {
                    let what = format!("{} {dtype} {s:?} first={first}", op.name());
                    let int_compute = !dtype.is_floating() && matches!(s, Scalar::Int(_));
                    let exps = if first {
                        ints(&x)
                    } else {
                        vec![s.as_i64() as i128]
                    };
                    if int_compute && refuses_power(op, dtype, &exps) {
                        let err = compute::binary_scalar(op, &x, s, first).unwrap_err();
                        assert!(matches!(err, Error::InvalidArgument(_)), "{what}: {err}");
                        continue;
                    }
                    let got = compute::binary_scalar(op, &x, s, first).unwrap();
                    let out = got.dtype();
                    let f = |v: f64, sv: f64| {
                        if first {
                            binary_f64(op, sv, v, out)
                        } else {
                            binary_f64(op, v, sv, out)
                        }
                    };
                    if got.dtype().is_floating() {
                        // A weak scalar takes the array's float dtype (rounded once into it).
                        let sv = if dtype.is_floating() {
                            rounded(s.as_f64(), dtype)
                        } else {
                            s.as_f64()
                        };
                        let want: Vec<f64> = values(&x).into_iter().map(|v| f(v, sv)).collect();
                        assert_close(&got, &want, &what);
                    } else {
                        let sv = wrap(s.as_i64() as i128, dtype);
                        let want: Vec<i128> = ints(&x)
                            .into_iter()
                            .map(|v| {
                                let (p, q) = if first { (sv, v) } else { (v, sv) };
                                wrap(binary_int(op, p, q), dtype)
                            })
                            .collect();
                        assert_eq!(ints(&got), want, "{what}");
                    }
                }
            }
        }
    }
}

fn rev() -> SliceArg {
    SliceArg {
        start: None,
        stop: None,
        step: -1,
    }
}

fn broadcasting_shapes(dev: &Dev) {
    let mut rng = Rng::new(5);
    let cases: [(&[usize], &[usize]); 7] = [
        (&[3, 1, 5], &[4, 1]),
        (&[1], &[1000]),
        (&[2000, 1], &[1, 3]),
        (&[7, 9], &[9]),
        (&[5, 1, 300], &[1, 4, 300]),
        (&[], &[6]),
        (&[300, 1], &[300, 257]),
    ];
    for dtype in [DType::F32, DType::F16, DType::I16, DType::F64] {
        for (sa, sb) in cases {
            let a = float_tensor(dev, &mut rng, sa, DType::F64, -9.0, 9.0)
                .cast(dtype)
                .unwrap();
            let b = float_tensor(dev, &mut rng, sb, DType::F64, 1.0, 9.0)
                .cast(dtype)
                .unwrap();
            for op in BinaryOp::ALL {
                check_binary(op, &a, &b, &format!("{sa:?} with {sb:?}"));
                check_binary(op, &b, &a, &format!("{sb:?} with {sa:?}"));
            }
        }
    }
}

fn strided_transposed_and_reversed_views(dev: &Dev) {
    let mut rng = Rng::new(6);
    for dtype in [DType::F32, DType::BF16, DType::I64, DType::U8, DType::F64] {
        let base = float_tensor(dev, &mut rng, &[37, 41], DType::F64, -20.0, 20.0)
            .cast(dtype)
            .unwrap();
        let other = float_tensor(dev, &mut rng, &[41, 37], DType::F64, 1.0, 20.0)
            .cast(dtype)
            .unwrap();
        // 37 × 82, every other column of which is a 37 × 41 view with column stride 2.
        let wide = float_tensor(dev, &mut rng, &[37, 82], DType::F64, -20.0, 20.0)
            .cast(dtype)
            .unwrap();
        let step2 = SliceArg {
            start: Some(1),
            stop: None,
            step: 2,
        };
        let views = [
            ("transposed", base.transpose().unwrap()),
            (
                "reversed rows",
                base.slice(0, rev()).unwrap().transpose().unwrap(),
            ),
            (
                "reversed both",
                base.slice(0, rev())
                    .unwrap()
                    .slice(1, rev())
                    .unwrap()
                    .transpose()
                    .unwrap(),
            ),
            (
                "every other column",
                wide.slice(1, step2).unwrap().transpose().unwrap(),
            ),
        ];
        for (name, v) in &views {
            assert_eq!(v.shape(), &[41, 37]);
            for op in [UnaryOp::Negative, UnaryOp::Abs, UnaryOp::Square] {
                check_unary(op, v, name);
            }
            if dtype.is_floating() {
                check_unary(UnaryOp::Sin, v, name);
            }
            for op in BinaryOp::ALL {
                check_binary(op, v, &other, name);
                check_binary(op, &other.slice(1, rev()).unwrap(), v, name);
            }
        }
    }
    // A long reversed 1-d view runs the threaded strided path.
    let x = float_tensor(dev, &mut rng, &[200_001], DType::F32, -1.0, 1.0);
    let r = x.slice(0, rev()).unwrap();
    check_binary(BinaryOp::Add, &r, &x, "reversed 1-d");
    let every3 = x
        .slice(
            0,
            SliceArg {
                start: None,
                stop: None,
                step: 3,
            },
        )
        .unwrap();
    check_unary(UnaryOp::Exp, &every3, "step 3");
}

/// Asserts two bool vectors are equal, naming the first difference (not the whole vectors).
fn same_bools(got: &[bool], want: &[bool], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let bad = (0..got.len()).filter(|&i| got[i] != want[i]).count();
        panic!(
            "{what}: {bad} elements differ, first at {i}: got {}",
            got[i]
        );
    }
}

/// The bool elements of a comparison's result.
fn bools(t: &Tensor) -> Vec<bool> {
    assert_eq!(t.dtype(), DType::BOOL);
    t.copy_to(Device::CPU)
        .unwrap()
        .cast(DType::U8)
        .unwrap()
        .to_vec::<u8>()
        .unwrap()
        .into_iter()
        .map(|b| b != 0)
        .collect()
}

fn comparisons_on_every_dtype_follow_ieee_and_exact_integers(dev: &Dev) {
    let mut rng = Rng::new(31);
    let (sa, sb): (&[usize], &[usize]) = (&[3, 1, 700], &[4, 700]);
    let shape = compute::broadcast_shapes(sa, sb).unwrap();
    let (na, nb): (usize, usize) = (sa.iter().product(), sb.iter().product());
    for dtype in INTS {
        // As stored (the generator's small values are negative for unsigned types too).
        let stored =
            |v: Vec<i128>| -> Vec<i128> { v.into_iter().map(|x| wrap(x, dtype)).collect() };
        let va = stored(int_values(&mut rng, na, dtype));
        let mut vb = stored(int_values(&mut rng, nb, dtype));
        for i in (0..nb).step_by(3) {
            vb[i] = va[i % na];
        }
        let (a, b) = (
            int_tensor(dev, &va, sa, dtype),
            int_tensor(dev, &vb, sb, dtype),
        );
        for op in CompareOp::ALL {
            let got = bools(&compute::compare(op, &a, &b).unwrap());
            let want: Vec<bool> = (0..got.len())
                .map(|i| {
                    let (r, c) = (i / 700, i % 700);
                    let (x, y) = (va[(r / 4) * 700 + c], vb[(r % 4) * 700 + c]);
                    op.holds(x, y)
                })
                .collect();
            same_bools(&got, &want, &format!("{} of {dtype}", op.name()));
        }
    }
    for dtype in FLOATS {
        let mut va: Vec<f64> = (0..na)
            .map(|_| rounded(rng.uniform(-3.0, 3.0), dtype))
            .collect();
        let mut vb: Vec<f64> = (0..nb)
            .map(|_| rounded(rng.uniform(-3.0, 3.0), dtype))
            .collect();
        for i in (0..nb).step_by(3) {
            vb[i] = va[i % na];
        }
        va[1] = f64::NAN;
        vb[1] = f64::NAN;
        vb[2] = f64::NAN;
        va[5] = f64::INFINITY;
        vb[5] = f64::INFINITY;
        va[6] = -0.0;
        vb[6] = 0.0;
        let (a, b) = (tensor(dev, &va, sa, dtype), tensor(dev, &vb, sb, dtype));
        for op in CompareOp::ALL {
            let y = compute::compare(op, &a, &b).unwrap();
            assert_eq!(y.shape(), &shape[..]);
            let got = bools(&y);
            let want: Vec<bool> = (0..got.len())
                .map(|i| {
                    let (r, c) = (i / 700, i % 700);
                    op.holds(va[(r / 4) * 700 + c], vb[(r % 4) * 700 + c])
                })
                .collect();
            same_bools(&got, &want, &format!("{} of {dtype}", op.name()));
        }
        // NaN: only `!=` holds, also against itself.
        let nan = tensor(dev, &[f64::NAN], &[1], dtype);
        for op in CompareOp::ALL {
            let got = bools(&compute::compare(op, &nan, &nan).unwrap());
            assert_eq!(got, [op == CompareOp::Ne], "{} of NaN {dtype}", op.name());
        }
    }
}

fn comparisons_with_scalars_mixed_dtypes_and_bool(dev: &Dev) {
    let x = int_tensor(dev, &[-128, -1, 0, 5, 127], &[5], DType::I8);
    let cmp = |op, s, first| bools(&compute::compare_scalar(op, &x, s, first).unwrap());
    use CompareOp::*;
    assert_eq!(
        cmp(Lt, Scalar::Int(5), false),
        [true, true, true, false, false]
    );
    assert_eq!(
        cmp(Lt, Scalar::Int(5), true),
        [false, false, false, false, true]
    );
    assert_eq!(
        cmp(Eq, Scalar::Int(5), true),
        [false, false, false, true, false]
    );
    // Outside int8: compared by value, never wrapped (1000 wraps to -24, 256 + 5 to 5).
    assert_eq!(cmp(Eq, Scalar::Int(261), false), [false; 5]);
    assert_eq!(cmp(Ne, Scalar::Int(261), false), [true; 5]);
    assert_eq!(cmp(Lt, Scalar::Int(1000), false), [true; 5]);
    assert_eq!(cmp(Ge, Scalar::Int(1000), false), [false; 5]);
    assert_eq!(cmp(Gt, Scalar::Int(-1000), false), [true; 5]);
    assert_eq!(cmp(Gt, Scalar::Int(-1000), true), [false; 5]);
    assert_eq!(cmp(Le, Scalar::Int(1000), true), [false; 5]);
    // A float scalar compares an integer array in float64.
    assert_eq!(
        cmp(Gt, Scalar::Float(-0.5), false),
        [false, false, true, true, true]
    );
    let u = int_tensor(dev, &[0, 7, u64::MAX as i128], &[3], DType::U64);
    let got = bools(&compute::compare_scalar(Gt, &u, Scalar::Int(-1), false).unwrap());
    assert_eq!(got, [true; 3]);
    // float32: the weak scalar is rounded to float32 first (NumPy 2's rule).
    let f = tensor(dev, &[0.1, f64::NAN], &[2], DType::F32);
    let got = bools(&compute::compare_scalar(Eq, &f, Scalar::Float(0.1), false).unwrap());
    assert_eq!(got, [true, false]);
    let got = bools(&compute::compare_scalar(Ne, &f, Scalar::Float(0.1), true).unwrap());
    assert_eq!(got, [false, true]);
    // Mixed dtypes promote; bool compares as bool, or in the other operand's type.
    let a = int_tensor(dev, &[-1, 3, 100], &[3], DType::I8);
    let b = int_tensor(dev, &[255, 3, 99], &[3], DType::U8);
    assert_eq!(
        bools(&compute::compare(Lt, &a, &b).unwrap()),
        [true, false, false]
    );
    let m = tensor(dev, &[1.0, 0.0, 1.0], &[3], DType::BOOL);
    let n = tensor(dev, &[1.0, 1.0, 0.0], &[3], DType::BOOL);
    assert_eq!(
        bools(&compute::compare(Eq, &m, &n).unwrap()),
        [true, false, false]
    );
    assert_eq!(
        bools(&compute::compare(Gt, &m, &n).unwrap()),
        [false, false, true]
    );
    let h = tensor(dev, &[1.0, 0.5, 2.0], &[3], DType::F16);
    assert_eq!(
        bools(&compute::compare(Eq, &m, &h).unwrap()),
        [true, false, false]
    );
    let got = bools(&compute::compare_scalar(Eq, &m, Scalar::Int(1), false).unwrap());
    assert_eq!(got, [true, false, true]);
    let got = bools(&compute::compare_scalar(Lt, &m, Scalar::Int(2), false).unwrap());
    assert_eq!(got, [true; 3]);
    let got = bools(&compute::compare_scalar(Lt, &m, Scalar::Float(0.5), false).unwrap());
    assert_eq!(got, [false, true, false]);
    // Views are read in place; 0-d and empty operands.
    let t = tensor(
        dev,
        &(0..12).map(f64::from).collect::<Vec<_>>(),
        &[3, 4],
        DType::F32,
    );
    let r = t.slice(1, rev()).unwrap().transpose().unwrap();
    let got = bools(&compute::compare_scalar(Ge, &r, Scalar::Int(6), false).unwrap());
    assert_eq!(
        got,
        values(&r).iter().map(|&v| v >= 6.0).collect::<Vec<_>>()
    );
    let zero_d = tensor(dev, &[2.0], &[], DType::F64);
    let y = compute::compare(Le, &zero_d, &t).unwrap();
    assert_eq!(y.shape(), &[3, 4]);
    assert_eq!(bools(&y).iter().filter(|&&b| b).count(), 10);
    let empty = tensor(dev, &[], &[0, 4], DType::I32);
    assert_eq!(
        compute::compare(
            Eq,
            &empty,
            &t.cast(DType::I32)
                .unwrap()
                .slice(
                    0,
                    SliceArg {
                        start: Some(0),
                        stop: Some(0),
                        step: 1
                    }
                )
                .unwrap()
        )
        .unwrap()
        .shape(),
        &[0, 4]
    );
    // Complex operands are refused with a typed error.
    let c = tensor(dev, &[1.0], &[1], DType::C64);
    assert!(matches!(
        compute::compare(Eq, &c, &c),
        Err(Error::UnsupportedOperand(_))
    ));
}

fn zero_d_and_empty(dev: &Dev) {
    for dtype in [DType::F32, DType::F16, DType::I32] {
        let s = tensor(dev, &[2.0], &[], dtype);
        let r = compute::unary(UnaryOp::Square, &s).unwrap();
        assert_eq!((r.shape(), values(&r)), (&[][..], vec![4.0]));
        let r = compute::binary_scalar(BinaryOp::Sub, &s, Scalar::Int(5), true).unwrap();
        assert_eq!(values(&r), vec![3.0]);
        let v = tensor(dev, &[1.0, 2.0, 3.0], &[3], dtype);
        check_binary(BinaryOp::Mul, &s, &v, "0-d with 1-d");
        for shape in [&[0][..], &[3, 0], &[0, 5]] {
            let e = tensor(dev, &[], shape, dtype);
            let r = compute::unary(UnaryOp::Negative, &e).unwrap();
            assert_eq!(r.shape(), shape);
            let r = compute::binary(BinaryOp::Add, &e, &s).unwrap();
            assert_eq!(r.shape(), shape);
        }
    }
}

#[test]
fn misaligned_foreign_memory_is_read_correctly() {
    // A float32 view one byte into a byte buffer, as a foreign producer might hand over.
    let n = 1000;
    let bytes = Tensor::zeros(&[4 * n + 8], DType::U8, dlbridge::Device::CPU).unwrap();
    let view = Tensor::new(
        bytes.buffer().clone(),
        DType::F32,
        Layout::new(&[n], &[1], 1).unwrap(),
    )
    .unwrap();
    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    // SAFETY: `view` addresses `4n` bytes inside `bytes`; nothing else reads or writes them now.
    unsafe {
        view.copy_from_unchecked(&Tensor::from_slice(&data, &[n]).unwrap())
            .unwrap()
    };
    let r = compute::binary_scalar(BinaryOp::Add, &view, Scalar::Float(1.0), false).unwrap();
    let want: Vec<f64> = data.iter().map(|&x| x as f64 + 1.0).collect();
    assert_eq!(values(&r), want);
    let s = compute::reduce(ReduceOp::Sum, &view, None, false).unwrap();
    assert_eq!(
        values(&s),
        vec![data.iter().map(|&x| x as f64).sum::<f64>()]
    );
    let m = compute::matmul(&view, &view).unwrap();
    let dot: f64 = data.iter().map(|&x| (x as f64) * (x as f64)).sum();
    assert!((values(&m)[0] - dot).abs() <= 1e-6 * dot);
}

// ---------------------------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------------------------

/// For each output (kept axes row-major), the input linear indices it reduces.
fn groups(shape: &[usize], axes: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = shape.iter().product();
    let kept: Vec<usize> = (0..shape.len()).filter(|a| !axes.contains(a)).collect();
    let outputs: usize = kept.iter().map(|&a| shape[a]).product();
    let mut out = vec![Vec::new(); outputs];
    for i in 0..n {
        let mut rest = i;
        let mut index = vec![0; shape.len()];
        for a in (0..shape.len()).rev() {
            index[a] = rest % shape[a];
            rest /= shape[a];
        }
        let o = kept.iter().fold(0, |acc, &a| acc * shape[a] + index[a]);
        out[o].push(i);
    }
    out
}

fn normalise(axes: Option<&[isize]>, ndim: usize) -> Vec<usize> {
    match axes {
        None => (0..ndim).collect(),
        Some(a) => a
            .iter()
            .map(|&x| if x < 0 { x + ndim as isize } else { x } as usize)
            .collect(),
    }
}

/// Checks `reduce(op, x, axes, keepdims)` against the reference.
fn check_reduce(op: ReduceOp, x: &Tensor, axes: Option<&[isize]>, keepdims: bool, what: &str) {
    let got = compute::reduce(op, x, axes, keepdims).unwrap();
    let axes_u = normalise(axes, x.ndim());
    let what = format!("{what} {} {} axes {axes:?}", op.name(), x.dtype());
    let want_shape: Vec<usize> = (0..x.ndim())
        .filter_map(|a| {
            if !axes_u.contains(&a) {
                Some(x.shape()[a])
            } else if keepdims {
                Some(1)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(got.shape(), want_shape.as_slice(), "{what}");
    let groups = groups(x.shape(), &axes_u);
    let dtype = x.dtype();
    if op.is_arg() {
        // The first extreme of each group (its elements are in the reduced axes' row-major
        // order), or its first NaN.
        let v = values(x);
        let want: Vec<i128> = groups
            .iter()
            .map(|g| {
                let xs: Vec<f64> = g.iter().map(|&i| v[i]).collect();
                if let Some(p) = xs.iter().position(|x| x.is_nan()) {
                    return p as i128;
                }
                let mut best = 0;
                for (j, &x) in xs.iter().enumerate() {
                    let beyond = if op == ReduceOp::ArgMax {
                        x > xs[best]
                    } else {
                        x < xs[best]
                    };
                    if beyond {
                        best = j;
                    }
                }
                best as i128
            })
            .collect();
        // Integer values compared exactly (int64 and uint64 are not all exact in f64).
        let want = if dtype.is_floating() {
            want
        } else {
            let v = ints(x);
            groups
                .iter()
                .map(|g| {
                    let xs: Vec<i128> = g.iter().map(|&i| v[i]).collect();
                    let m = if op == ReduceOp::ArgMax {
                        *xs.iter().max().unwrap()
                    } else {
                        *xs.iter().min().unwrap()
                    };
                    xs.iter().position(|&x| x == m).unwrap() as i128
                })
                .collect()
        };
        assert_eq!(got.dtype(), DType::I64, "{what}");
        assert_eq!(ints(&got), want, "{what}");
        return;
    }
    if !dtype.is_floating() && op == ReduceOp::Prod {
        let v = ints(x);
        let want: Vec<i128> = groups
            .iter()
            .map(|g| {
                let p = g.iter().fold(1u64, |p, &i| p.wrapping_mul(v[i] as u64));
                wrap(p as i128, got.dtype())
            })
            .collect();
        let want_dtype = if is_signed(dtype) {
            DType::I64
        } else {
            DType::U64
        };
        assert_eq!(got.dtype(), want_dtype, "{what}");
        assert_eq!(ints(&got), want, "{what}");
        return;
    }
    if !dtype.is_floating() && matches!(op, ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min) {
        let v = ints(x);
        let want: Vec<i128> = groups
            .iter()
            .map(|g| {
                let it = g.iter().map(|&i| v[i]);
                match op {
                    ReduceOp::Sum => wrap(it.sum(), got.dtype()),
                    ReduceOp::Max => it.max().unwrap(),
                    _ => it.min().unwrap(),
                }
            })
            .collect();
        let want_dtype = match op {
            ReduceOp::Sum if is_signed(dtype) => DType::I64,
            ReduceOp::Sum => DType::U64,
            _ => dtype,
        };
        assert_eq!(got.dtype(), want_dtype, "{what}");
        assert_eq!(ints(&got), want, "{what}");
        return;
    }
    let v = values(x);
    let got_values = values(&got);
    let mut want = Vec::new();
    let mut scale = Vec::new();
    for g in &groups {
        let xs: Vec<f64> = g.iter().map(|&i| v[i]).collect();
        let abs: f64 = xs.iter().map(|x| x.abs()).sum();
        let n = xs.len() as f64;
        match op {
            ReduceOp::Sum => {
                want.push(exact_sum(xs.iter().copied()));
                scale.push(abs);
            }
            ReduceOp::Mean => {
                want.push(exact_sum(xs.iter().copied()) / n);
                scale.push(abs / n);
            }
            ReduceOp::Max | ReduceOp::Min => {
                let pick = if op == ReduceOp::Max {
                    f64::max
                } else {
                    f64::min
                };
                let m = if xs.iter().any(|x| x.is_nan()) {
                    f64::NAN
                } else {
                    xs.iter().copied().fold(xs[0], pick)
                };
                want.push(m);
                scale.push(0.0);
            }
            ReduceOp::Prod => {
                // Products round once per factor, in the computing type: a bound of n + 1
                // roundings of it, relative to the product. Partial products may leave the
                // computing type's range before the whole does (as NumPy's, which multiply in
                // it too): near either end of the range, an infinity or a zero of the right
                // sign also passes.
                let p = xs.iter().product::<f64>();
                let (eps, lo, hi) = if dtype == DType::F64 {
                    (1.2e-16, 1e-290, 1e290)
                } else {
                    (6e-8, 1e-30, 1e30)
                };
                let g = got_values[want.len()];
                let edge = (p.abs() > hi && g.is_infinite() || p.abs() < lo && g == 0.0)
                    && (g.is_sign_negative() == p.is_sign_negative() || g == 0.0);
                want.push(if edge { g } else { p });
                scale.push(p.abs() * (1.0 + (n + 1.0) * eps / tol(got.dtype())));
            }
            ReduceOp::Var | ReduceOp::Std => {
                // Two passes in f64; the kernel's error is bounded relative to the mean square
                // (its blocks compute in the input's floating type).
                let mean = exact_sum(xs.iter().copied()) / n;
                let var = exact_sum(xs.iter().map(|x| (x - mean) * (x - mean))) / n;
                let square = exact_sum(xs.iter().map(|x| x * x)) / n;
                if op == ReduceOp::Var {
                    want.push(var);
                    scale.push(square);
                } else {
                    want.push(var.sqrt());
                    scale.push(square.sqrt());
                }
            }
            ReduceOp::ArgMax | ReduceOp::ArgMin => unreachable!("checked above"),
        }
    }
    let out_dtype = got.dtype();
    // Sums are bounded relative to the sum of magnitudes: rounding into the output, plus the
    // accumulation error (tiny: blocks of f32 lanes, totals in f64).
    let rel = match out_dtype {
        DType::F64 => 1e-13,
        d if on_gpu(&got) => tol(d) + 1e-5,
        d => tol(d) + 1e-6,
    };
    assert_close_scaled(&values(&got), &want, &scale, rel, out_dtype, &what);
}

fn reductions_over_every_dtype(dev: &Dev) {
    let mut rng = Rng::new(7);
    for dtype in FLOATS.into_iter().chain(INTS) {
        for shape in [
            &[1][..],
            &[7],
            &[1023],
            &[100_003],
            &[5, 7, 9],
            &[],
            &[300, 257],
        ] {
            let n: usize = shape.iter().product();
            let x = if dtype.is_floating() {
                float_tensor(dev, &mut rng, shape, dtype, -3.0, 5.0)
            } else {
                int_tensor(dev, &int_values(&mut rng, n, dtype), shape, dtype)
            };
            for op in ReduceOp::ALL {
                check_reduce(op, &x, None, false, &format!("{shape:?}"));
                if shape.len() >= 2 {
                    check_reduce(op, &x, Some(&[0]), false, &format!("{shape:?}"));
                    check_reduce(op, &x, Some(&[-1]), true, &format!("{shape:?}"));
                }
                if shape.len() == 3 {
                    check_reduce(op, &x, Some(&[0, 2]), false, "[5, 7, 9]");
                    check_reduce(op, &x, Some(&[1]), true, "[5, 7, 9]");
                    check_reduce(op, &x, Some(&[-2, 0]), false, "[5, 7, 9]");
                }
            }
        }
    }
}

fn reductions_over_outer_axes_and_views(dev: &Dev) {
    let mut rng = Rng::new(8);
    for dtype in [DType::F32, DType::F16, DType::I32, DType::F64, DType::U16] {
        let x = float_tensor(dev, &mut rng, &[24, 20, 33], DType::F64, -100.0, 100.0)
            .cast(dtype)
            .unwrap();
        let views = [
            ("compact", x.clone()),
            ("transposed", x.permute(&[2, 1, 0]).unwrap()),
            (
                "reversed",
                x.slice(0, rev()).unwrap().slice(2, rev()).unwrap(),
            ),
            (
                "broadcast",
                x.slice(1, SliceArg::range(0, 1))
                    .unwrap()
                    .broadcast_to(&[24, 4, 33])
                    .unwrap(),
            ),
        ];
        for (name, v) in &views {
            for op in ReduceOp::ALL {
                for axes in [
                    &[0][..],
                    &[0, 1],
                    &[1],
                    &[2],
                    &[0, 2],
                    &[1, 2],
                    &[-3, -2, -1],
                ] {
                    check_reduce(op, v, Some(axes), false, name);
                }
            }
        }
    }
    // Many rows of a wide matrix: the by-rows mode with several tiles and threads.
    let wide = float_tensor(dev, &mut rng, &[600, 700], DType::F32, -1.0, 1.0);
    for op in ReduceOp::ALL {
        check_reduce(op, &wide, Some(&[0]), false, "wide");
        check_reduce(op, &wide, Some(&[1]), false, "wide");
    }
}

fn max_and_min_propagate_nan(dev: &Dev) {
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for n in [1, 5, 64, 1000, 5000] {
            for at in [0, n / 2, n - 1] {
                let mut v: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin()).collect();
                v[at] = f64::NAN;
                let x = tensor(dev, &v, &[n], dtype);
                for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Sum, ReduceOp::Mean] {
                    let r = compute::reduce(op, &x, None, false).unwrap();
                    assert!(
                        values(&r)[0].is_nan(),
                        "{} {dtype} n={n} NaN at {at}",
                        op.name()
                    );
                }
            }
        }
        // NaN in one column of a by-rows reduction stays in that column.
        let mut v = vec![1.0; 40 * 64];
        v[17 * 64 + 5] = f64::NAN;
        let x = tensor(dev, &v, &[40, 64], dtype);
        for op in [ReduceOp::Max, ReduceOp::Min] {
            let r = values(&compute::reduce(op, &x, Some(&[0]), false).unwrap());
            assert!(r[5].is_nan());
            assert!(r.iter().enumerate().all(|(i, x)| i == 5 || *x == 1.0));
        }
        let inf = tensor(dev, &[f64::NEG_INFINITY, -1.0], &[2], dtype);
        let r = compute::reduce(ReduceOp::Max, &inf, None, false).unwrap();
        assert_eq!(values(&r), vec![-1.0]);
    }
}

fn empty_reductions(dev: &Dev) {
    let e = tensor(dev, &[], &[0, 3], DType::F32);
    let s = compute::reduce(ReduceOp::Sum, &e, Some(&[0]), false).unwrap();
    assert_eq!(values(&s), vec![0.0; 3]);
    let m = compute::reduce(ReduceOp::Mean, &e, Some(&[0]), false).unwrap();
    assert!(values(&m).iter().all(|x| x.is_nan()));
    let s = compute::reduce(ReduceOp::Sum, &e, Some(&[1]), false).unwrap();
    assert_eq!(s.shape(), &[0]);
    let i = int_tensor(dev, &[], &[0], DType::I8);
    let s = compute::reduce(ReduceOp::Sum, &i, None, false).unwrap();
    assert_eq!((s.dtype(), ints(&s)), (DType::I64, vec![0]));
    let err = compute::reduce(ReduceOp::Max, &e, Some(&[0]), false).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

fn integer_sums_widen_and_wrap(dev: &Dev) {
    let x = int_tensor(dev, &vec![127; 1000], &[1000], DType::I8);
    let s = compute::reduce(ReduceOp::Sum, &x, None, false).unwrap();
    assert_eq!((s.dtype(), ints(&s)), (DType::I64, vec![127_000]));
    let m = compute::reduce(ReduceOp::Mean, &x, None, false).unwrap();
    assert_eq!((m.dtype(), values(&m)), (DType::F64, vec![127.0]));
    let big = int_tensor(dev, &[u64::MAX as i128, 2], &[2], DType::U64);
    let s = compute::reduce(ReduceOp::Sum, &big, None, false).unwrap();
    assert_eq!((s.dtype(), ints(&s)), (DType::U64, vec![1]));
}

#[test]
fn long_float32_sums_are_accurate() {
    // 2^22 values near 0.1: a naive f32 running sum is off by about 1e-3 relative.
    let n = 1 << 22;
    let mut rng = Rng::new(9);
    let v: Vec<f32> = (0..n)
        .map(|_| 0.1 + rng.uniform(0.0, 1e-3) as f32)
        .collect();
    let x = Tensor::from_slice(&v, &[n]).unwrap();
    let exact = exact_sum(v.iter().map(|&x| x as f64));
    let s = values(&compute::reduce(ReduceOp::Sum, &x, None, false).unwrap())[0];
    assert!((s - exact).abs() <= 1e-7 * exact, "{s} vs {exact}");
    let m = values(&compute::reduce(ReduceOp::Mean, &x, None, false).unwrap())[0];
    assert!((m - exact / n as f64).abs() <= 1e-7 * m);
    // Two outputs, each over 2^21 elements (reduced in pieces on threads), and the transposed
    // layout (by rows).
    let two = x.reshape(&[Some(2), None]).unwrap();
    check_reduce(ReduceOp::Sum, &two, Some(&[1]), false, "halves");
    let cols = x.reshape(&[Some(1 << 16), None]).unwrap();
    check_reduce(ReduceOp::Sum, &cols, Some(&[0]), false, "columns");
}

// ---------------------------------------------------------------------------------------------
// Matrix products
// ---------------------------------------------------------------------------------------------

/// The reference product by NumPy's rules, and for each element the sum of magnitudes.
fn matmul_reference(a: &Tensor, b: &Tensor) -> (Vec<usize>, Vec<f64>, Vec<f64>) {
    let (a_vec, b_vec) = (a.ndim() == 1, b.ndim() == 1);
    let a2 = if a_vec {
        a.expand_dims(0).unwrap()
    } else {
        a.clone()
    };
    let b2 = if b_vec {
        b.expand_dims(1).unwrap()
    } else {
        b.clone()
    };
    let (m, k) = (a2.shape()[a2.ndim() - 2], a2.shape()[a2.ndim() - 1]);
    let n = b2.shape()[b2.ndim() - 1];
    let (ba, bb) = (&a2.shape()[..a2.ndim() - 2], &b2.shape()[..b2.ndim() - 2]);
    let batch = compute::broadcast_shapes(ba, bb).unwrap();
    let full = |t: &Tensor, r: usize, c: usize| {
        let mut s = batch.clone();
        s.extend([r, c]);
        values(&t.broadcast_to(&s).unwrap())
    };
    let (va, vb) = (full(&a2, m, k), full(&b2, k, n));
    let count: usize = batch.iter().product();
    let (mut want, mut scale) = (Vec::new(), Vec::new());
    for p in 0..count {
        for i in 0..m {
            for j in 0..n {
                let terms = (0..k).map(|l| va[p * m * k + i * k + l] * vb[p * k * n + l * n + j]);
                let abs: f64 = terms.clone().map(f64::abs).sum();
                want.push(exact_sum(terms));
                scale.push(abs);
            }
        }
    }
    let mut shape = batch;
    if !a_vec {
        shape.push(m);
    }
    if !b_vec {
        shape.push(n);
    }
    (shape, want, scale)
}

fn check_matmul(a: &Tensor, b: &Tensor, what: &str) {
    let got = compute::matmul(a, b).unwrap();
    let (shape, want, scale) = matmul_reference(a, b);
    let what = format!("{what} {:?} @ {:?} {}", a.shape(), b.shape(), got.dtype());
    assert_eq!(got.shape(), shape.as_slice(), "{what}");
    let rel = match got.dtype() {
        DType::F64 if on_gpu(&got) => 1e-12,
        DType::F64 => 1e-13,
        DType::F32 => 1e-5,
        DType::F16 if on_gpu(&got) => 4e-3,
        DType::BF16 if on_gpu(&got) => 2e-2,
        d => tol(d) + 1e-5,
    };
    assert_close_scaled(&values(&got), &want, &scale, rel, got.dtype(), &what);
}

fn matmul_shapes_and_dtypes(dev: &Dev) {
    let mut rng = Rng::new(10);
    let cases: [(&[usize], &[usize]); 11] = [
        (&[3, 4], &[4, 5]),
        (&[1, 1], &[1, 1]),
        (&[65, 33], &[33, 70]),
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 1, 3, 4], &[5, 4, 6]),
        (&[7, 4], &[3, 4, 2]),
        (&[4], &[4, 6]),
        (&[6, 4], &[4]),
        (&[9], &[9]),
        (&[3, 5, 4], &[4]),
        (&[130, 200], &[200, 90]),
    ];
    for dtype in FLOATS {
        for (sa, sb) in cases {
            let a = float_tensor(dev, &mut rng, sa, dtype, -1.0, 1.0);
            let b = float_tensor(dev, &mut rng, sb, dtype, -1.0, 1.0);
            check_matmul(&a, &b, "");
        }
    }
}

fn matmul_of_views(dev: &Dev) {
    let mut rng = Rng::new(11);
    for dtype in FLOATS {
        let a = float_tensor(dev, &mut rng, &[40, 30], dtype, -1.0, 1.0);
        let b = float_tensor(dev, &mut rng, &[50, 40], dtype, -1.0, 1.0);
        // Transposed operands (column-major for the BLAS).
        check_matmul(
            &a.transpose().unwrap(),
            &b.transpose().unwrap(),
            "transposed",
        );
        // Strided and reversed operands (copied compact by the front).
        let rows = SliceArg {
            start: None,
            stop: None,
            step: 2,
        };
        check_matmul(
            &a.slice(0, rows).unwrap().transpose().unwrap(),
            &a.slice(0, rows).unwrap(),
            "strided",
        );
        check_matmul(&b.slice(0, rev()).unwrap(), &a, "reversed");
        // A batch broadcast from one matrix (batch stride 0).
        let batch = a
            .expand_dims(0)
            .unwrap()
            .broadcast_to(&[3, 40, 30])
            .unwrap();
        check_matmul(&b, &batch, "broadcast batch");
        // A batch of many small matrices (split over threads by matrix).
        let many_a = float_tensor(dev, &mut rng, &[300, 3, 5], dtype, -1.0, 1.0);
        let many_b = float_tensor(dev, &mut rng, &[300, 5, 2], dtype, -1.0, 1.0);
        check_matmul(&many_a, &many_b, "many");
    }
}

fn matmul_with_empty_contraction_is_zero(dev: &Dev) {
    for dtype in FLOATS {
        let a = tensor(dev, &[], &[3, 0], dtype);
        let b = tensor(dev, &[], &[0, 4], dtype);
        let r = compute::matmul(&a, &b).unwrap();
        assert_eq!((r.shape(), values(&r)), (&[3, 4][..], vec![0.0; 12]));
        let e = compute::matmul(
            &tensor(dev, &[], &[0, 2], dtype),
            &tensor(dev, &[1.0, 2.0], &[2, 1], dtype),
        )
        .unwrap();
        assert_eq!(e.shape(), &[0, 1]);
    }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

fn errors_name_what_went_wrong(dev: &Dev) {
    let a = tensor(dev, &[1.0, 2.0, 3.0], &[3], DType::F32);
    let b = tensor(dev, &[1.0; 4], &[4], DType::F32);
    assert!(matches!(
        compute::binary(BinaryOp::Add, &a, &b),
        Err(Error::Shape(_))
    ));
    let u = int_tensor(dev, &[1], &[1], DType::U64);
    let i = int_tensor(dev, &[1], &[1], DType::I8);
    assert!(matches!(
        compute::binary(BinaryOp::Add, &u, &i),
        Err(Error::UnsupportedOperand(_))
    ));
    let flags = dev.put(
        &Tensor::from_slice(&[1u8, 0], &[2])
            .unwrap()
            .cast(DType::BOOL)
            .unwrap(),
    );
    assert!(matches!(
        compute::unary(UnaryOp::Negative, &flags),
        Err(Error::UnsupportedOperand(_))
    ));
    // bool arrays reduce as NumPy's: sums count in int64.
    let count = compute::reduce(ReduceOp::Sum, &flags, None, false).unwrap();
    assert_eq!((count.dtype(), ints(&count)), (DType::I64, vec![1]));
    assert!(matches!(
        compute::binary(
            BinaryOp::Add,
            &a,
            &flags.slice(0, SliceArg::range(0, 1)).unwrap()
        ),
        Err(Error::UnsupportedOperand(_))
    ));
    let m = int_tensor(dev, &[1, 2, 3, 4], &[2, 2], DType::I32);
    assert!(matches!(
        compute::matmul(&m, &m),
        Err(Error::UnsupportedOperand(_))
    ));
    assert!(matches!(
        compute::matmul(&a, &tensor(dev, &[1.0; 4], &[4], DType::F32)),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        compute::reduce(ReduceOp::Sum, &a, Some(&[1]), false),
        Err(Error::OutOfBounds(_))
    ));
}

#[test]
fn casts_on_the_cpu_use_the_host_converter() {
    let dev = &Dev::cpu();
    let x = tensor(dev, &[-2.7, 300.0, 1.5], &[3], DType::F32);
    let r = compute::cast(&x, DType::I32).unwrap();
    assert_eq!(ints(&r), vec![-2, 300, 1]);
    let r = compute::cast(&x.slice(0, rev()).unwrap(), DType::U8).unwrap();
    assert_eq!(ints(&r), vec![1, 44, 254]);
}

// ---------------------------------------------------------------------------------------------
// NumPy's floor division, remainder and power; prod, argmax / argmin, all / any, var / std;
// advanced indexing
// ---------------------------------------------------------------------------------------------

fn integer_floor_division_and_remainder_edges_follow_numpy(dev: &Dev) {
    let i8s = |v: &[i128]| int_tensor(dev, v, &[v.len()], DType::I8);
    let a = i8s(&[7, -7, 7, -7, 0, -128, -128, 5]);
    let b = i8s(&[2, 2, -2, -2, 0, -1, 0, 0]);
    let q = compute::binary(BinaryOp::FloorDiv, &a, &b).unwrap();
    let r = compute::binary(BinaryOp::Mod, &a, &b).unwrap();
    // NumPy's values: a zero divisor gives 0; -128 // -1 wraps to -128 and its remainder is 0.
    assert_eq!(ints(&q), vec![3, -4, -4, 3, 0, -128, 0, 0]);
    assert_eq!(ints(&r), vec![1, 1, -1, -1, 0, 0, 0, 0]);
    assert_eq!((q.dtype(), r.dtype()), (DType::I8, DType::I8));
    let u = int_tensor(dev, &[7, 200, 3], &[3], DType::U8);
    let z = compute::binary_scalar(BinaryOp::FloorDiv, &u, Scalar::Int(0), false).unwrap();
    assert_eq!(ints(&z), vec![0, 0, 0]);
    let m = compute::binary_scalar(BinaryOp::Mod, &u, Scalar::Int(7), true).unwrap();
    assert_eq!(ints(&m), vec![0, 7, 1]);
}

fn powers_wrap_and_negative_integer_exponents_are_refused(dev: &Dev) {
    let x = int_tensor(dev, &[3, -2, 0, 7], &[4], DType::I64);
    let p = compute::binary_scalar(BinaryOp::Pow, &x, Scalar::Int(41), false).unwrap();
    let want: Vec<i128> = [3i64, -2, 0, 7]
        .iter()
        .map(|&v| v.wrapping_pow(41) as i128)
        .collect();
    assert_eq!(ints(&p), want);
    let zero = compute::binary_scalar(BinaryOp::Pow, &x, Scalar::Int(0), false).unwrap();
    assert_eq!(ints(&zero), vec![1; 4]);
    for err in [
        compute::binary_scalar(BinaryOp::Pow, &x, Scalar::Int(-1), false).unwrap_err(),
        compute::binary_scalar(BinaryOp::Pow, &x, Scalar::Int(2), true).unwrap_err(),
        compute::binary(BinaryOp::Pow, &x, &x).unwrap_err(),
    ] {
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("negative integer powers"), "{err}");
    }
    // Unsigned exponents are never negative; a float scalar computes in float64.
    let u = int_tensor(dev, &[2, 3], &[2], DType::U8);
    let p = compute::binary(
        BinaryOp::Pow,
        &u,
        &int_tensor(dev, &[8, 5], &[2], DType::U8),
    )
    .unwrap();
    assert_eq!(ints(&p), vec![0, 243]);
    let f = compute::binary_scalar(BinaryOp::Pow, &x, Scalar::Float(0.5), true).unwrap();
    assert_eq!(f.dtype(), DType::F64);
}

fn prod_and_arg_reductions_follow_numpy(dev: &Dev) {
    let x = tensor(
        dev,
        &[1.0, f64::NAN, 3.0, f64::NAN, 5.0, 5.0],
        &[2, 3],
        DType::F32,
    );
    let argmax = |t: &Tensor, axes: Option<&[isize]>| {
        ints(&compute::reduce(ReduceOp::ArgMax, t, axes, false).unwrap())
    };
    // The first NaN wins, over everything and along each axis.
    assert_eq!(argmax(&x, None), vec![1]);
    assert_eq!(argmax(&x, Some(&[1])), vec![1, 0]);
    assert_eq!(argmax(&x, Some(&[0])), vec![1, 0, 1]);
    let ties = int_tensor(dev, &[4, 9, 9, -1, 9], &[5], DType::I16);
    assert_eq!(argmax(&ties, None), vec![1]);
    let argmin = compute::reduce(ReduceOp::ArgMin, &ties, None, true).unwrap();
    assert_eq!((argmin.shape(), ints(&argmin)), (&[1][..], vec![3]));
    let empty = tensor(dev, &[], &[0, 2], DType::F32);
    let err = compute::reduce(ReduceOp::ArgMax, &empty, Some(&[0]), false).unwrap_err();
    assert!(err.to_string().contains("empty sequence"), "{err}");
    assert_eq!(
        compute::reduce(ReduceOp::ArgMax, &empty, Some(&[1]), false)
            .unwrap()
            .shape(),
        &[0]
    );
    // Products: empty is 1; integers wrap in 64 bits.
    let p = compute::reduce(ReduceOp::Prod, &empty, Some(&[0]), false).unwrap();
    assert_eq!(values(&p), vec![1.0, 1.0]);
    let big = int_tensor(dev, &[1 << 40, 1 << 40, 3], &[3], DType::I64);
    let p = compute::reduce(ReduceOp::Prod, &big, None, false).unwrap();
    assert_eq!(
        ints(&p),
        vec![(3i64.wrapping_mul(1i64 << 40).wrapping_mul(1 << 40)) as i128]
    );
}

fn logical_and_moment_reductions_follow_numpy(dev: &Dev) {
    let x = tensor(
        dev,
        &[0.0, f64::NAN, 2.0, 0.0, 0.0, 0.0],
        &[2, 3],
        DType::F16,
    );
    let bools = |t: Tensor| {
        assert_eq!(t.dtype(), DType::BOOL);
        bools(&t)
    };
    // NaN is true.
    assert_eq!(
        bools(compute::any(&x, Some(&[1]), false).unwrap()),
        vec![true, false]
    );
    assert_eq!(
        bools(compute::all(&x, Some(&[0]), true).unwrap()),
        vec![false, false, false]
    );
    let empty = tensor(dev, &[], &[0, 2], DType::F32);
    assert_eq!(
        bools(compute::all(&empty, Some(&[0]), false).unwrap()),
        vec![true, true]
    );
    assert_eq!(
        bools(compute::any(&empty, None, false).unwrap()),
        vec![false]
    );
    let v = tensor(dev, &[1.0, 2.0, 3.0, 4.0], &[4], DType::F32);
    let var = compute::var(&v, None, 1.0, false).unwrap();
    assert_eq!(
        (var.dtype(), values(&var)),
        (DType::F32, vec![(5.0f32 / 3.0) as f64])
    );
    let std = compute::std(
        &int_tensor(dev, &[1, 3], &[2], DType::I32),
        None,
        0.0,
        false,
    )
    .unwrap();
    assert_eq!((std.dtype(), values(&std)), (DType::F64, vec![1.0]));
    // n - ddof <= 0: NumPy's values (inf, or NaN for 0 / 0).
    let too_few = compute::var(&v, None, 4.0, false).unwrap();
    assert!(values(&too_few)[0].is_infinite());
    let nan = compute::var(&empty, None, 0.0, false).unwrap();
    assert!(values(&nan)[0].is_nan());
    let classes = tensor(
        dev,
        &[1.0, f64::NAN, f64::INFINITY, -f64::INFINITY],
        &[4],
        DType::BF16,
    );
    assert_eq!(
        bools(compute::isnan(&classes).unwrap()),
        vec![false, true, false, false]
    );
    assert_eq!(
        bools(compute::isinf(&classes).unwrap()),
        vec![false, false, true, true]
    );
    assert_eq!(
        bools(compute::isfinite(&classes).unwrap()),
        vec![true, false, false, false]
    );
    let i = int_tensor(dev, &[1, 2], &[2], DType::U32);
    assert_eq!(bools(compute::isfinite(&i).unwrap()), vec![true, true]);
    assert_eq!(bools(compute::isnan(&i).unwrap()), vec![false, false]);
}

fn advanced_indexing_gathers_and_scatters_views(dev: &Dev) {
    use dlbridge::compute::index;
    let x = int_tensor(dev, &(0..60).collect::<Vec<_>>(), &[3, 4, 5], DType::I32);
    // A reversed, strided view: x[::-1, :, ::2] has shape (3, 4, 3).
    let view = x.slice(0, rev()).unwrap().slice(
        2,
        SliceArg {
            start: None,
            stop: None,
            step: 2,
        },
    );
    let view = view.unwrap();
    let idx = int_tensor(dev, &[3, -4, 1], &[3], DType::I64);
    let got = index::take(&view, &[1], std::slice::from_ref(&idx), false).unwrap();
    assert_eq!(got.shape(), &[3, 3, 3]);
    let v = ints(&view);
    let at = |i: usize, j: usize, k: usize| v[(i * 4 + j) * 3 + k];
    let mut want = Vec::new();
    for i in 0..3 {
        for j in [3usize, 0, 1] {
            for k in 0..3 {
                want.push(at(i, j, k));
            }
        }
    }
    assert_eq!(ints(&got), want);
    // Scatter through the view into `x`, a scalar broadcast to the selection.
    let zero = int_tensor(dev, &[-1], &[], DType::I32);
    // SAFETY: `x` and its views are this test's own; no reference into them is alive.
    unsafe { index::put(&view, &[1], &[idx], false, &zero).unwrap() };
    let after = ints(&x);
    for (n, &value) in after.iter().enumerate() {
        let (i, j, k) = (n / 20, (n / 5) % 4, n % 5);
        let selected = k % 2 == 0 && [3, 0, 1].contains(&j);
        assert_eq!(
            value,
            if selected { -1 } else { n as i128 },
            "[{i}, {j}, {k}]"
        );
    }
    // Errors: out of bounds (nothing written), indices that are not integers.
    let bad = int_tensor(dev, &[4], &[1], DType::I64);
    assert!(matches!(
        index::take(&view, &[1], &[bad], false),
        Err(Error::OutOfBounds(_))
    ));
    let float_index = tensor(dev, &[0.0], &[1], DType::F32);
    assert!(matches!(
        index::take(&view, &[0], &[float_index], false),
        Err(Error::UnsupportedOperand(_))
    ));
    // nonzero of a 2-d mask, row-major.
    let mask = dev.put(
        &Tensor::from_slice(&[0u8, 1, 1, 0, 0, 1], &[2, 3])
            .unwrap()
            .cast(DType::BOOL)
            .unwrap(),
    );
    let nz = index::nonzero(&mask).unwrap();
    assert_eq!(ints(&nz[0]), vec![0, 0, 1]);
    assert_eq!(ints(&nz[1]), vec![1, 2, 2]);
}

/// `argmax` / `argmin` of `x` over everything, as one `i64`.
fn arg_of(op: ReduceOp, x: &Tensor) -> i128 {
    ints(&compute::reduce(op, x, None, false).unwrap())[0]
}

/// `max` / `min` and the arg reductions over runs long enough for several blocks and several
/// pieces merged in order (more than 2^18 elements): the extreme at the first and the last
/// element, ties across pieces, NaN in the middle of a block and in a block's tail, and the
/// infinities of both signs (which make the NaN probe of `max` / `min` fire with no NaN).
#[test]
fn extremes_of_long_runs_find_the_first_and_propagate_nan() {
    let dev = &Dev::cpu();
    let n = (1 << 20) + 37;
    let base: Vec<f64> = (0..n).map(|i| ((i * 7919) % 40) as f64 + 1.0).collect();
    for dtype in FLOATS.into_iter().chain(INTS) {
        let (top, bottom) = if is_signed(dtype) || dtype.is_floating() {
            (100.0, -100.0)
        } else {
            (100.0, 0.0)
        };
        let at = |pairs: &[(usize, f64)]| {
            let mut v = base.clone();
            for &(i, x) in pairs {
                v[i] = x;
            }
            tensor(dev, &v, &[n], dtype)
        };
        let what = |case: &str| format!("{dtype} {case}");
        // The extremes at the very end, then at the very start.
        let x = at(&[(n - 1, top), (n - 2, bottom)]);
        assert_eq!(
            arg_of(ReduceOp::ArgMax, &x),
            (n - 1) as i128,
            "{}",
            what("last")
        );
        assert_eq!(
            arg_of(ReduceOp::ArgMin, &x),
            (n - 2) as i128,
            "{}",
            what("last")
        );
        assert_eq!(
            values(&compute::reduce(ReduceOp::Max, &x, None, false).unwrap()),
            [top]
        );
        assert_eq!(
            values(&compute::reduce(ReduceOp::Min, &x, None, false).unwrap()),
            [bottom]
        );
        let x = at(&[(0, top), (1, bottom)]);
        assert_eq!(arg_of(ReduceOp::ArgMax, &x), 0, "{}", what("first"));
        assert_eq!(arg_of(ReduceOp::ArgMin, &x), 1, "{}", what("first"));
        // Ties in different pieces (2^18 elements each) and blocks: the first wins.
        let x = at(&[
            (n - 5, top),
            (300_001, top),
            (700_000, top),
            (5_000, bottom),
            (5, bottom),
        ]);
        assert_eq!(arg_of(ReduceOp::ArgMax, &x), 300_001, "{}", what("ties"));
        assert_eq!(arg_of(ReduceOp::ArgMin, &x), 5, "{}", what("ties"));
        if !dtype.is_floating() {
            continue;
        }
        // The first NaN, wherever the extremes are: in a block's body, in a block's tail.
        for (first, second) in [(n - 3, n - 1), (400_000, 9), (1023, 2047), (n - 1, n - 1)] {
            let x = at(&[
                (0, top),
                (n - 2, bottom),
                (first, f64::NAN),
                (second, f64::NAN),
            ]);
            let want = first.min(second) as i128;
            assert_eq!(arg_of(ReduceOp::ArgMax, &x), want, "{}", what("NaN"));
            assert_eq!(arg_of(ReduceOp::ArgMin, &x), want, "{}", what("NaN"));
            for op in [ReduceOp::Max, ReduceOp::Min] {
                let m = values(&compute::reduce(op, &x, None, false).unwrap())[0];
                assert!(m.is_nan(), "{} {}", what("NaN"), op.name());
            }
        }
        // Both infinities and no NaN: the probe fires, the search finds no NaN, the extremes
        // stand.
        let x = at(&[
            (17, f64::INFINITY),
            (3000, f64::NEG_INFINITY),
            (n - 7, f64::INFINITY),
        ]);
        assert_eq!(arg_of(ReduceOp::ArgMax, &x), 17, "{}", what("inf"));
        assert_eq!(arg_of(ReduceOp::ArgMin, &x), 3000, "{}", what("inf"));
        assert_eq!(
            values(&compute::reduce(ReduceOp::Max, &x, None, false).unwrap()),
            [f64::INFINITY]
        );
        assert_eq!(
            values(&compute::reduce(ReduceOp::Min, &x, None, false).unwrap()),
            [f64::NEG_INFINITY]
        );
        // Every element the lowest value: the first.
        let x = tensor(dev, &vec![f64::NEG_INFINITY; 5000], &[5000], dtype);
        assert_eq!(arg_of(ReduceOp::ArgMax, &x), 0, "{}", what("all -inf"));
        // Along rows of a matrix (a NaN in one row only).
        let x = at(&[(3 * 1024 + 7, f64::NAN), (5 * 1024 + 1000, top)])
            .slice(0, SliceArg::range(0, 1024 * 1000))
            .unwrap()
            .reshape(&[Some(1000), Some(1024)])
            .unwrap();
        let am = ints(&compute::reduce(ReduceOp::ArgMax, &x, Some(&[1]), false).unwrap());
        assert_eq!((am[3], am[5]), (7, 1000), "{}", what("rows"));
        let m = values(&compute::reduce(ReduceOp::Max, &x, Some(&[1]), false).unwrap());
        assert!(
            m[3].is_nan() && m[5] == top && m[4] == 40.0,
            "{}",
            what("rows")
        );
    }
}

/// `var` / `std` in one pass: against two-pass `f64` references, on data whose mean is far from
/// 0 (where `E[x²] - E[x]²` in `float32` loses every digit), with `ddof`, NaN, infinities,
/// empty reductions, the by-rows mode and integers past `f64`'s exact range.
#[test]
fn variance_is_one_pass_and_numerically_sound() {
    let dev = &Dev::cpu();
    let reference = |xs: &[f64], ddof: f64| {
        let n = xs.len() as f64;
        let mean = exact_sum(xs.iter().copied()) / n;
        exact_sum(xs.iter().map(|x| (x - mean) * (x - mean))) / (n - ddof).max(0.0)
    };
    let mut rng = Rng::new(40);
    // 1e4 + noise of 1 in float32: NumPy's float32 var keeps about 4 digits here.
    let n = 3_000_017;
    for (dtype, offset, rel) in [
        (DType::F32, 1e4, 1e-4),
        (DType::F64, 1e8, 1e-8),
        (DType::F16, 100.0, 2e-2),
        (DType::BF16, 1.0, 2e-2),
    ] {
        let v: Vec<f64> = (0..n).map(|_| offset + rng.uniform(-1.0, 1.0)).collect();
        let x = tensor(dev, &v, &[n], dtype);
        let stored = values(&x);
        for ddof in [0.0, 1.0, 2.5] {
            let want = reference(&stored, ddof);
            let got = values(&compute::var(&x, None, ddof, false).unwrap())[0];
            assert!(
                (got - want).abs() <= rel * want,
                "var of {dtype} ddof {ddof}: got {got}, want {want}"
            );
            let got = values(&compute::std(&x, None, ddof, false).unwrap())[0];
            assert!(
                (got - want.sqrt()).abs() <= rel * want.sqrt(),
                "std of {dtype} ddof {ddof}: got {got}, want {}",
                want.sqrt()
            );
        }
    }
    // NaN and infinities give NaN; ddof past the count divides by 0.
    for dtype in FLOATS {
        for special in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let mut v = vec![1.5; 5000];
            v[4321] = special;
            let got =
                values(&compute::var(&tensor(dev, &v, &[5000], dtype), None, 0.0, false).unwrap());
            assert!(got[0].is_nan(), "var of {dtype} with {special}: {got:?}");
        }
        let x = tensor(dev, &[1.0, 2.0, 4.0], &[3], dtype);
        assert_eq!(
            values(&compute::var(&x, None, 3.0, false).unwrap()),
            [f64::INFINITY]
        );
        let c = tensor(dev, &[2.0; 3], &[3], dtype);
        assert!(values(&compute::var(&c, None, 5.0, false).unwrap())[0].is_nan());
        let e = tensor(dev, &[], &[0, 3], dtype);
        let v = values(&compute::var(&e, Some(&[0]), 0.0, false).unwrap());
        assert!(v.len() == 3 && v.iter().all(|x| x.is_nan()), "{v:?}");
        assert_eq!(
            values(&compute::var(&e, Some(&[0]), -1.0, false).unwrap()),
            [0.0; 3]
        );
    }
    // Columns of a wide matrix (the by-rows mode), against each column's reference.
    let (rows, cols) = (517, 300);
    let v: Vec<f64> = (0..rows * cols)
        .map(|i| 50.0 + rng.uniform(-1.0, 1.0) * (1 + i % cols) as f64)
        .collect();
    let x = tensor(dev, &v, &[rows, cols], DType::F32);
    let stored = values(&x);
    let got = values(&compute::var(&x, Some(&[0]), 1.0, false).unwrap());
    for c in 0..cols {
        let col: Vec<f64> = (0..rows).map(|r| stored[r * cols + c]).collect();
        let want = reference(&col, 1.0);
        assert!(
            (got[c] - want).abs() <= 1e-5 * want,
            "column {c}: {} vs {want}",
            got[c]
        );
    }
    // int64 past 2^53 (NumPy converts to float64 too), and unsigned values near the top: a
    // one-pass result keeps about `eps * |mean| / std` of its `f64` totals (here 4e-8: the mean is
    // 4e8 times the spread).
    let big: Vec<i128> = (0..10_001).map(|i| (1i128 << 60) + i * 1_000_003).collect();
    for dtype in [DType::I64, DType::U64] {
        let x = int_tensor(dev, &big, &[big.len()], dtype);
        let as_f64: Vec<f64> = big.iter().map(|&b| b as f64).collect();
        let got = values(&compute::var(&x, None, 0.0, false).unwrap())[0];
        let want = reference(&as_f64, 0.0);
        assert!(
            (got - want).abs() <= 1e-7 * want,
            "{dtype}: {got} vs {want}"
        );
        assert_eq!(
            compute::var(&x, None, 0.0, false).unwrap().dtype(),
            DType::F64
        );
    }
}

/// The single-element selections (a mask over every axis, one index array into a 1-d view)
/// against the block copier they bypass (the same selection through `nonzero`'s arrays, and
/// through a 2-d view), over strided views, every element size, several chunks, and errors.
#[test]
fn single_element_selections_match_the_block_copier() {
    let dev = &Dev::cpu();
    use dlbridge::compute::index;
    let mut rng = Rng::new(41);
    let n = 200_003;
    for dtype in [
        DType::I8,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::C64,
        DType::C128,
    ] {
        let x = tensor(
            dev,
            &(0..2 * n).map(|i| i as f64).collect::<Vec<_>>(),
            &[2 * n],
            DType::F64,
        )
        .cast(dtype)
        .unwrap();
        // A reversed, strided 1-d view and a 2-d one.
        let views = [
            x.slice(0, rev())
                .unwrap()
                .slice(
                    0,
                    SliceArg {
                        start: None,
                        stop: None,
                        step: 2,
                    },
                )
                .unwrap(),
            x.reshape(&[Some(2), Some(n)]).unwrap().transpose().unwrap(),
        ];
        for view in &views {
            for density in [0.0, 0.3, 1.0] {
                let bits: Vec<u8> = (0..view.numel())
                    .map(|_| u8::from(rng.uniform(0.0, 1.0) < density))
                    .collect();
                let mask = Tensor::from_slice(&bits, view.shape())
                    .unwrap()
                    .cast(DType::BOOL)
                    .unwrap();
                let got = index::take_mask(view, 0, &mask).unwrap();
                let arrays = index::nonzero(&mask).unwrap();
                let axes: Vec<usize> = (0..view.ndim()).collect();
                let want = index::take(view, &axes, &arrays, false).unwrap();
                assert_eq!(got.shape(), want.shape(), "{dtype} mask {density}");
                assert_eq!(
                    raw_bytes(&got),
                    raw_bytes(&want),
                    "{dtype} mask {density} of {:?}",
                    view.strides()
                );
            }
        }
        // Positions of every integer dtype, negative ones, a 2-d index array.
        let view = &views[0];
        let len = view.shape()[0] as i128;
        let picks: Vec<i128> = (0..150_000)
            .map(|i| ((i * 7919) % (2 * len)) - len)
            .collect();
        let as_2d = view.reshape(&[Some(1), None]).unwrap();
        for index_dtype in [DType::I64, DType::I32, DType::U32, DType::I16] {
            let fits: Vec<i128> = picks
                .iter()
                .map(|&p| {
                    if index_dtype.bits() < 32 || !is_signed(index_dtype) {
                        p.rem_euclid(len.min(30_000))
                    } else {
                        p
                    }
                })
                .collect();
            let idx = int_tensor(dev, &fits, &[300, 500], index_dtype);
            let got = index::take(view, &[0], std::slice::from_ref(&idx), false).unwrap();
            assert_eq!(got.shape(), &[300, 500]);
            // The same positions through the block copier: a 2-d view's last axis.
            let want = index::take(&as_2d, &[1], std::slice::from_ref(&idx), false).unwrap();
            assert_eq!(
                raw_bytes(&got),
                raw_bytes(&want),
                "{dtype} at {index_dtype}"
            );
        }
        // The first position out of bounds is named, wherever the chunks run.
        let mut bad = picks.clone();
        bad[140_000] = len + 5;
        bad[90_000] = -len - 1;
        let idx = int_tensor(dev, &bad, &[bad.len()], DType::I64);
        let err = index::take(view, &[0], &[idx], false).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds(_)), "{err}");
        assert!(
            err.to_string().contains(&format!(
                "index {} is out of bounds for axis 0 with size {len}",
                -len - 1
            )),
            "{err}"
        );
    }
}
