//! The built-in kernels (element-wise, comparisons, casts, reductions, matmul, NumPy's habits)
//! on every device: each body is written once against a [`Dev`] and instantiated for the CPU,
//! CUDA and Metal by `device_tests!` (`cpu::name`, `cuda::name`, `metal::name`; the GPU ones are
//! ignored unless asked for with `--include-ignored`, as scripts/test.sh does where a device is
//! present). Results are checked against references computed here on the host from the same
//! data: integers exactly in `i128` (wrapped to the result's width), floats in `f64` (rounded once
//! to the result's dtype), within the device's tolerance ([`Dev::tolerance`]).
//!
//! The bodies that check a device against the CPU's result on the same data (`agrees`) run on
//! the GPUs only (`accelerators:`): on the CPU they would compare it with itself; the CPU's
//! results are checked against references in compute_reference.rs. What only one backend has
//! (user kernels, streams, storage modes) is in compute_cuda.rs and metal_compute.rs.

mod common;

use common::Rng;
use common::devices::{Dev, device_tests};
use common::values::*;
use dlbridge::compute::{self, BinaryOp, CompareOp, ReduceOp, Scalar, UnaryOp, promote};
use dlbridge::{DType, Device, Element, Error, SliceArg, Tensor};
use half::{bf16, f16};

device_tests! {
    all: [
    unary_ops_match_the_host_on_every_dtype,
    binary_ops_broadcast_on_every_dtype,
    scalar_operands_are_weak_on_both_sides,
    comparisons_broadcast_with_nan_and_bool_results_on_every_dtype,
    comparisons_with_scalars_and_mixed_dtypes,
    mixed_dtypes_promote_through_casts,
    views_are_read_in_place,
    many_axes_and_odd_sizes,
    reductions_over_all_and_some_axes_on_every_dtype,
    reductions_of_views_large_rows_and_columns,
    reductions_over_many_axes_nan_and_empty,
    matmul_matches_the_host_for_layouts_and_batches,
    casts_follow_astype,
    arg_reductions_find_the_first_extreme_across_blocks,
    moments_are_one_pass_and_match_references
    ],
    accelerators: [
    casts_match_the_host_converter_for_every_pair,
    floor_division_remainder_and_power_follow_numpy_on_the_device,
    numpy_reductions_and_classifications_match_the_cpu,
    advanced_indexing_gathers_and_scatters_device_views,
    arg_reductions_and_moments_of_views_match_the_cpu,
    numpy_habits_match_the_cpu,
    ],
}

// ---------------------------------------------------------------------------------------------
// The reference arithmetic.

fn unary_ref(op: UnaryOp, out: DType, v: V) -> V {
    if is_int(out) {
        let x = v.i();
        return V::I(wrap(
            out,
            match op {
                UnaryOp::Abs => x.abs(),
                UnaryOp::Square => x.wrapping_mul(x),
                UnaryOp::Negative => -x,
                _ => unreachable!("integer results come from abs, square and negative"),
            },
        ));
    }
    let x = v.f();
    V::F(round_to(
        out,
        match op {
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sin => x.sin(),
            UnaryOp::Cos => x.cos(),
            UnaryOp::Abs => x.abs(),
            UnaryOp::Square => x * x,
            UnaryOp::Negative => -x,
        },
    ))
}

/// Whether `pow` computing in integer `out` must refuse exponents `exps` (NumPy refuses negative
/// integer powers).
fn refuses_power(op: BinaryOp, out: DType, exps: impl IntoIterator<Item = V>) -> bool {
    op == BinaryOp::Pow && is_signed(out) && exps.into_iter().any(|e| e.i() < 0)
}

fn binary_ref(op: BinaryOp, out: DType, a: V, b: V) -> V {
    if is_int(out) {
        let (x, y) = (a.i(), b.i());
        return V::I(wrap(
            out,
            match op {
                BinaryOp::Add => x + y,
                BinaryOp::Sub => x - y,
                BinaryOp::Mul => x.wrapping_mul(y),
                BinaryOp::Div => unreachable!("integer division returns float64"),
                // NumPy's values for a zero divisor: 0.
                BinaryOp::FloorDiv | BinaryOp::Mod if y == 0 => 0,
                BinaryOp::FloorDiv => {
                    let q = x / y;
                    if x % y != 0 && ((x < 0) != (y < 0)) {
                        q - 1
                    } else {
                        q
                    }
                }
                BinaryOp::Mod => {
                    let r = x % y;
                    if r != 0 && ((r < 0) != (y < 0)) {
                        r + y
                    } else {
                        r
                    }
                }
                BinaryOp::Pow => {
                    // Square and multiply modulo 2^128 (the exponent's bits as the dtype holds
                    // them: an unsigned one is never negative).
                    let (mut r, mut sq, mut e) = (1u128, x as u128, wrap(out, y) as u128);
                    while e != 0 {
                        if e & 1 == 1 {
                            r = r.wrapping_mul(sq);
                        }
                        sq = sq.wrapping_mul(sq);
                        e >>= 1;
                    }
                    r as i128
                }
            },
        ));
    }
    let (x, y) = (a.f(), b.f());
    let divmod = |x: f64, y: f64| common::numpy_divmod(out, x, y);
    V::F(round_to(
        out,
        match op {
            BinaryOp::Add => x + y,
            BinaryOp::Sub => x - y,
            BinaryOp::Mul => x * y,
            BinaryOp::Div => x / y,
            BinaryOp::FloorDiv => divmod(x, y).0,
            BinaryOp::Mod => divmod(x, y).1,
            BinaryOp::Pow => x.powf(y),
        },
    ))
}

/// [`tolerance`] for `op`: CUDA's `powf` is within a few ulp rather than one.
fn op_tolerance(dev: &Dev, op: BinaryOp, d: DType) -> (f64, f64) {
    let (rtol, atol) = dev.tolerance(d);
    if op == BinaryOp::Pow && !is_int(d) {
        (rtol * 4.0, atol)
    } else {
        (rtol, atol)
    }
}

/// The row-major index of every element of `shape`.
fn indices(shape: &[usize]) -> impl Iterator<Item = Vec<usize>> + '_ {
    let n: usize = shape.iter().product();
    (0..n).map(move |mut flat| {
        let mut idx = vec![0; shape.len()];
        for (i, &d) in idx.iter_mut().zip(shape).rev() {
            *i = flat % d;
            flat /= d;
        }
        idx
    })
}

/// The element of a row-major `shape` array broadcast to `target` at `idx` (of `target`).
fn broadcast_index(shape: &[usize], target: &[usize], idx: &[usize]) -> usize {
    let off = target.len() - shape.len();
    shape.iter().enumerate().fold(0, |acc, (k, &n)| {
        acc * n + if n == 1 { 0 } else { idx[k + off] }
    })
}

// ---------------------------------------------------------------------------------------------
// Element-wise operations.

fn unary_ops_match_the_host_on_every_dtype(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(1);
    for dtype in DTYPES {
        for op in UnaryOp::ALL {
            let n = 4099;
            let vals = match op {
                UnaryOp::Sqrt | UnaryOp::Log if is_int(dtype) => rng.small(dtype, n, 1.0, 100.0),
                UnaryOp::Exp if is_int(dtype) => rng.small(dtype, n, 0.0, 10.0),
                UnaryOp::Sin | UnaryOp::Cos if is_int(dtype) => rng.small(dtype, n, 0.0, 100.0),
                UnaryOp::Sqrt | UnaryOp::Log => rng.values(dtype, n, 0.01, 50.0),
                UnaryOp::Exp => rng.values(dtype, n, -8.0, 8.0),
                _ => rng.values(dtype, n, -30.0, 30.0),
            };
            let x = on(device, dtype, &vals, &[n]);
            let out = promote::unary_result(op, dtype).unwrap();
            let Some(y) = dev.result(&[dtype, out], compute::unary(op, &x)) else {
                continue;
            };
            assert_eq!(y.dtype(), out, "{} of {dtype}", op.name());
            assert_eq!(y.device(), device);
            let want: Vec<V> = vals.iter().map(|&v| unary_ref(op, out, v)).collect();
            let (rtol, atol) = dev.tolerance(out);
            check(
                &format!("{} of {dtype}", op.name()),
                &read(&y),
                &want,
                rtol,
                atol,
            );
        }
    }
    // Hand-picked inputs: specials, the 16-bit floats, wrapping integers.
    unary_ops_of_specials_and_edges(dev);
}

fn binary_ops_broadcast_on_every_dtype(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(2);
    // (a's shape, b's shape): flat, odd sizes, and broadcasting both ways.
    let shapes: [(&[usize], &[usize]); 4] = [
        (&[10_007], &[10_007]),
        (&[3], &[3]),
        (&[37, 1, 5], &[4, 5]),
        (&[1], &[33, 65]),
    ];
    for dtype in DTYPES {
        for op in BinaryOp::ALL {
            for (sa, sb) in shapes {
                let (na, nb) = (sa.iter().product(), sb.iter().product());
                let va = rng.values(dtype, na, -50.0, 50.0);
                let vb = rng.values(dtype, nb, -50.0, 50.0);
                let (a, b) = (on(device, dtype, &va, sa), on(device, dtype, &vb, sb));
                let out = promote::binary_result(op, dtype);
                if refuses_power(op, out, vb.iter().copied()) {
                    let err = compute::binary(op, &a, &b).unwrap_err();
                    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
                    continue;
                }
                let Some(y) = dev.result(&[dtype, out], compute::binary(op, &a, &b)) else {
                    continue;
                };
                assert_eq!(y.dtype(), out);
                let shape = compute::broadcast_shapes(sa, sb).unwrap();
                assert_eq!(y.shape(), &shape[..]);
                let want: Vec<V> = indices(&shape)
                    .map(|idx| {
                        let x = va[broadcast_index(sa, &shape, &idx)];
                        let z = vb[broadcast_index(sb, &shape, &idx)];
                        binary_ref(op, out, x, z)
                    })
                    .collect();
                let (rtol, atol) = op_tolerance(dev, op, out);
                let what = format!("{} of {dtype} {sa:?} {sb:?}", op.name());
                check(&what, &read(&y), &want, rtol, atol);
            }
        }
    }
    // Hand-picked inputs: broadcasting, scalars, wrapping, promotion.
    binary_ops_broadcast_and_take_scalars(dev);
}

fn scalar_operands_are_weak_on_both_sides(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(3);
    let n = 1001;
    for dtype in DTYPES {
        let vals = rng.values(dtype, n, -20.0, 20.0);
        let x = on(device, dtype, &vals, &[n]);
        for op in BinaryOp::ALL {
            for scalar in [Scalar::Int(7), Scalar::Int(-300), Scalar::Float(0.3)] {
                for first in [false, true] {
                    let common = promote::promote_scalar(dtype, scalar).unwrap();
                    let out = promote::binary_result(op, common);
                    let exps: Vec<V> = if first {
                        vals.clone()
                    } else {
                        vec![V::I(scalar.as_i64() as i128)]
                    };
                    if refuses_power(op, out, exps) {
                        let err = compute::binary_scalar(op, &x, scalar, first).unwrap_err();
                        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
                        continue;
                    }
                    let result = compute::binary_scalar(op, &x, scalar, first);
                    let Some(y) = dev.result(&[dtype, common, out], result) else {
                        continue;
                    };
                    assert_eq!(y.dtype(), out);
                    // The scalar takes the dtype the kernel computes in.
                    let s = if is_int(out) {
                        V::I(wrap(out, scalar.as_i64() as i128))
                    } else {
                        V::F(round_to(out, scalar.as_f64()))
                    };
                    let want: Vec<V> = vals
                        .iter()
                        .map(|&v| {
                            let v = if is_int(out) { v } else { V::F(v.f()) };
                            if first {
                                binary_ref(op, out, s, v)
                            } else {
                                binary_ref(op, out, v, s)
                            }
                        })
                        .collect();
                    let (rtol, atol) = op_tolerance(dev, op, out);
                    let what = format!("{} of {dtype} and {scalar:?} (first {first})", op.name());
                    check(&what, &read(&y), &want, rtol, atol);
                }
            }
        }
    }
}

/// `op(a, b)` as a `bool` element (0 or 1): integers exactly, floats by IEEE 754.
fn compare_ref(op: CompareOp, a: V, b: V) -> V {
    let holds = match (a, b) {
        (V::I(x), V::I(y)) => op.holds(x, y),
        _ => op.holds(a.f(), b.f()),
    };
    V::I(i128::from(holds))
}

fn comparisons_broadcast_with_nan_and_bool_results_on_every_dtype(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(21);
    let shapes: [(&[usize], &[usize]); 4] = [
        (&[10_007], &[10_007]),
        (&[3], &[3]),
        (&[37, 1, 5], &[4, 5]),
        (&[1], &[33, 65]),
    ];
    for dtype in DTYPES.into_iter().chain([DType::BOOL]) {
        for (sa, sb) in shapes {
            let (na, nb): (usize, usize) = (sa.iter().product(), sb.iter().product());
            let draw = |rng: &mut Rng, n: usize| -> Vec<V> {
                match dtype {
                    DType::BOOL => (0..n).map(|_| V::I((rng.next() % 2) as i128)).collect(),
                    _ => rng.values(dtype, n, -4.0, 4.0),
                }
            };
            let mut va: Vec<V> = draw(&mut rng, na);
            let mut vb: Vec<V> = draw(&mut rng, nb);
            // Equal pairs (every third element) and NaN on either side.
            for i in (0..nb).step_by(3) {
                vb[i] = va[i % na];
            }
            if dtype.is_floating() && na > 2 && nb > 2 {
                va[1] = V::F(f64::NAN);
                vb[1] = V::F(f64::NAN);
                vb[2] = V::F(f64::NAN);
            }
            let (a, b) = (on(device, dtype, &va, sa), on(device, dtype, &vb, sb));
            let shape = compute::broadcast_shapes(sa, sb).unwrap();
            for op in CompareOp::ALL {
                let Some(y) = dev.result(&[dtype], compute::compare(op, &a, &b)) else {
                    continue;
                };
                assert_eq!((y.dtype(), y.device()), (DType::BOOL, device));
                assert_eq!(y.shape(), &shape[..]);
                let want: Vec<V> = indices(&shape)
                    .map(|idx| {
                        let x = va[broadcast_index(sa, &shape, &idx)];
                        let z = vb[broadcast_index(sb, &shape, &idx)];
                        compare_ref(op, x, z)
                    })
                    .collect();
                let what = format!("{} of {dtype} {sa:?} {sb:?}", op.name());
                check(&what, &read(&y), &want, 0.0, 0.0);
            }
        }
    }
    // Hand-picked inputs: NaN, scalars, every dtype, bool operands.
    comparisons_give_bool_with_nan_scalars_and_broadcasting(dev);
}

fn comparisons_with_scalars_and_mixed_dtypes(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(22);
    let n = 1001;
    for dtype in DTYPES {
        let mut vals = rng.values(dtype, n, -3.0, 3.0);
        vals[0] = value_of(dtype, 2.0);
        if dtype.is_floating() {
            vals[1] = V::F(f64::NAN);
        }
        let x = on(device, dtype, &vals, &[n]);
        // In range, outside every integer dtype (compared by value, not wrapped), and a float.
        for scalar in [
            Scalar::Int(2),
            Scalar::Int(1 << 40),
            Scalar::Int(-(1 << 40)),
            Scalar::Float(0.5),
        ] {
            for first in [false, true] {
                for op in CompareOp::ALL {
                    let common = promote::compare_scalar_type(dtype, scalar).unwrap();
                    let result = compute::compare_scalar(op, &x, scalar, first);
                    let Some(y) = dev.result(&[dtype, common], result) else {
                        continue;
                    };
                    assert_eq!((y.dtype(), y.device()), (DType::BOOL, device));
                    let s = match scalar {
                        Scalar::Int(i) if is_int(common) => V::I(i128::from(i)),
                        _ => V::F(round_to(common, scalar.as_f64())),
                    };
                    let want: Vec<V> = vals
                        .iter()
                        .map(|&v| {
                            let v = if is_int(common) { v } else { V::F(v.f()) };
                            if first {
                                compare_ref(op, s, v)
                            } else {
                                compare_ref(op, v, s)
                            }
                        })
                        .collect();
                    let what = format!("{} of {dtype} and {scalar:?} (first {first})", op.name());
                    check(&what, &read(&y), &want, 0.0, 0.0);
                }
            }
        }
    }
    // Mixed dtypes compare in their common type; a bool array with a numeric one in the numeric.
    let a = on(device, DType::I8, &[V::I(-1), V::I(3), V::I(100)], &[3]);
    let b = on(device, DType::U8, &[V::I(255), V::I(3), V::I(99)], &[3]);
    let y = compute::compare(CompareOp::Lt, &a, &b).unwrap();
    assert_eq!(read(&y), [V::I(1), V::I(0), V::I(0)]);
    let m = on(device, DType::BOOL, &[V::I(1), V::I(0), V::I(1)], &[3]);
    let f = on(device, DType::F32, &[V::F(1.0), V::F(0.5), V::F(2.0)], &[3]);
    let y = compute::compare(CompareOp::Eq, &m, &f).unwrap();
    assert_eq!(read(&y), [V::I(1), V::I(0), V::I(0)]);
    // A strided, reversed view is read in place.
    let vals = rng.values(DType::F32, 64, -1.0, 1.0);
    let t = on(device, DType::F32, &vals, &[8, 8]);
    let view = t
        .slice(
            1,
            SliceArg {
                start: None,
                stop: None,
                step: -2,
            },
        )
        .unwrap()
        .transpose()
        .unwrap();
    let y = compute::compare(CompareOp::Ge, &view, &view.copy().unwrap()).unwrap();
    assert!(read(&y).iter().all(|&v| v == V::I(1)));
}

fn mixed_dtypes_promote_through_casts(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(4);
    let pairs = [
        (DType::I8, DType::U8, DType::I16),
        (DType::U32, DType::I32, DType::I64),
        (DType::I32, DType::F16, DType::F16),
        (DType::F16, DType::BF16, DType::F32),
        (DType::U64, DType::F64, DType::F64),
        (DType::F32, DType::F64, DType::F64),
    ];
    for (da, db, common) in pairs {
        let va = rng.small(da, 777, -100.0, 100.0);
        let vb = rng.small(db, 777, -100.0, 100.0);
        let result = compute::binary(
            BinaryOp::Mul,
            &on(device, da, &va, &[777]),
            &on(device, db, &vb, &[777]),
        );
        let Some(y) = dev.result(&[da, db, common], result) else {
            continue;
        };
        assert_eq!(y.dtype(), common);
        let want: Vec<V> = va
            .iter()
            .zip(&vb)
            .map(|(&a, &b)| {
                let conv = |v: V| if is_int(common) { v } else { V::F(v.f()) };
                binary_ref(BinaryOp::Mul, common, conv(a), conv(b))
            })
            .collect();
        let (rtol, atol) = dev.tolerance(common);
        check(&format!("{da} * {db}"), &read(&y), &want, rtol, atol);
    }
}

fn casts_match_the_host_converter_for_every_pair(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(5);
    let all: Vec<DType> = DTYPES.iter().copied().chain([DType::BOOL]).collect();
    for &from in &all {
        // Fractions, negatives, values out of the narrow types' ranges, zeros; NaN and infinity
        // for floats (into floats and bool only: NumPy leaves float→int of those undefined).
        let n = 3003;
        let mut vals = match from {
            DType::BOOL => rng.small(DType::I8, n, 0.0, 2.0),
            d if is_int(d) => rng.values(d, n, 0.0, 0.0),
            // Past float16's range, but not to -inf (float→int of -inf differs by width).
            DType::F16 => rng.values(DType::F16, n, -60_000.0, 60_000.0),
            d => rng.values(d, n, -70_000.0, 70_000.0),
        };
        vals[0] = V::I(0);
        if from == DType::BOOL {
            vals = vals.into_iter().map(|v| V::I(v.i().clamp(0, 1))).collect();
        }
        let x = on(device, from, &vals, &[n]);
        let x_host = host(from, &vals, &[n]);
        for &to in &all {
            // A same-dtype cast is a plain copy, on any device.
            let involved: &[DType] = if from == to { &[] } else { &[from, to] };
            let Some(y) = dev.result(involved, compute::cast(&x, to)) else {
                continue;
            };
            assert_eq!((y.dtype(), y.device()), (to, device));
            let want = read(&x_host.cast(to).unwrap());
            // The host rounds a float64 into the 16-bit floats from its upper 32 bits only, so
            // it may miss a tie-break the kernels get right: one unit in the last place.
            let rtol = if matches!(to, DType::F16 | DType::BF16) {
                eps(to)
            } else {
                0.0
            };
            let got = read(&y);
            let bad = mismatches(&got, &want, rtol, 0.0);
            if !bad.is_empty() {
                // Tell a kernel error from memory that changed under the test.
                let input = read(&x);
                let again = read(&compute::cast(&x, to).unwrap());
                let again_bad = mismatches(&again, &want, rtol, 0.0);
                let input_bad = input.iter().zip(&vals).filter(|(a, b)| a != b).count();
                eprintln!(
                    "{from} -> {to}: {} bad at {:?}; input now differs at {input_bad} places; \
                     a second cast differs at {} places; y is at {:#x}, x at {:#x}",
                    bad.len(),
                    &bad[..bad.len().min(16)],
                    again_bad.len(),
                    y.buffer().handle() as usize + y.byte_offset(),
                    x.buffer().handle() as usize + x.byte_offset(),
                );
            }
            check(&format!("{from} -> {to}"), &got, &want, rtol, 0.0);
        }
        if !is_int(from) {
            let special = [f64::NAN, f64::INFINITY, -0.0, 1e30, -2.5, 2.5, 0.5, -0.5];
            let vals: Vec<V> = special.iter().map(|&f| V::F(round_to(from, f))).collect();
            let x = on(device, from, &vals, &[special.len()]);
            for to in [DType::F16, DType::BF16, DType::F32, DType::F64, DType::BOOL] {
                let want = read(&host(from, &vals, &[vals.len()]).cast(to).unwrap());
                let involved: &[DType] = if from == to { &[] } else { &[from, to] };
                let Some(got) = dev.result(involved, compute::cast(&x, to)) else {
                    continue;
                };
                let got = read(&got);
                let rtol = if matches!(to, DType::F16 | DType::BF16) {
                    eps(to)
                } else {
                    0.0
                };
                check(
                    &format!("{from} -> {to} (specials)"),
                    &got,
                    &want,
                    rtol,
                    0.0,
                );
            }
        }
    }
}

fn views_are_read_in_place(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(6);
    for dtype in [DType::F32, DType::BF16, DType::I64, DType::U8] {
        let va = rng.values(dtype, 37 * 53, -9.0, 9.0);
        let vb = rng.values(dtype, 37 * 53, -9.0, 9.0);
        let a = on(device, dtype, &va, &[37, 53]);
        let b = on(device, dtype, &vb, &[37, 53]);
        let step = |s: isize| SliceArg {
            start: None,
            stop: None,
            step: s,
        };
        // Transposed, reversed, every other column backwards, offset by one element (misaligned
        // for vector loads), and a broadcast row.
        let views: Vec<(&str, Tensor, Tensor)> = vec![
            ("transposed", a.transpose().unwrap(), b.transpose().unwrap()),
            (
                "reversed",
                a.slice(0, step(-1)).unwrap(),
                b.slice(1, step(-1)).unwrap(),
            ),
            (
                "strided",
                a.slice(1, step(-2)).unwrap(),
                b.slice(1, step(2)).unwrap(),
            ),
            (
                "offset",
                a.slice(0, SliceArg::range(1, 37)).unwrap(),
                b.slice(0, SliceArg::range(0, 36)).unwrap(),
            ),
            ("broadcast", a, b.slice(0, SliceArg::range(3, 4)).unwrap()),
        ];
        for (name, x, y) in views {
            let (hx, hy) = (read(&x), read(&y));
            let shape = compute::broadcast_shapes(x.shape(), y.shape()).unwrap();
            for op in [BinaryOp::Add, BinaryOp::Mul] {
                let z = compute::binary(op, &x, &y).unwrap();
                let want: Vec<V> = indices(&shape)
                    .map(|idx| {
                        binary_ref(
                            op,
                            dtype,
                            hx[broadcast_index(x.shape(), &shape, &idx)],
                            hy[broadcast_index(y.shape(), &shape, &idx)],
                        )
                    })
                    .collect();
                let (rtol, atol) = dev.tolerance(dtype);
                check(&format!("{name} {dtype}"), &read(&z), &want, rtol, atol);
            }
            let z = compute::unary(UnaryOp::Negative, &x).unwrap();
            let want: Vec<V> = hx
                .iter()
                .map(|&v| unary_ref(UnaryOp::Negative, dtype, v))
                .collect();
            check(
                &format!("{name} {dtype} negative"),
                &read(&z),
                &want,
                0.0,
                0.0,
            );
        }
    }
    // In each storage mode, and ten axes that do not merge.
    strided_views_and_storage_modes(dev);
}

fn many_axes_and_odd_sizes(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(7);
    // Seven axes that do not collapse (a permuted compact array) go through compact copies.
    let shape = [2, 3, 2, 3, 2, 3, 2];
    let n: usize = shape.iter().product();
    let va = rng.values(DType::F32, n, -1.0, 1.0);
    let vb = rng.values(DType::F32, n, -1.0, 1.0);
    let a = on(device, DType::F32, &va, &shape)
        .permute(&[6, 0, 5, 1, 4, 2, 3])
        .unwrap();
    let bb = on(device, DType::F32, &vb, &[3, 2, 2, 3, 3, 2, 2])
        .permute(&[6, 5, 4, 3, 2, 1, 0])
        .unwrap();
    assert_eq!(a.shape(), bb.shape());
    let z = compute::binary(BinaryOp::Sub, &a, &bb).unwrap();
    let (ha, hb) = (read(&a), read(&bb));
    let want: Vec<V> = ha
        .iter()
        .zip(&hb)
        .map(|(&x, &y)| binary_ref(BinaryOp::Sub, DType::F32, x, y))
        .collect();
    check("7-d sub", &read(&z), &want, 4.0 * eps(DType::F32), 1e-6);
    // Sizes around the vector width and the unrolled block.
    for n in [
        1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 1023, 1024, 1025, 4097, 262_147,
    ] {
        for dtype in dev.computable(&[DType::F32, DType::F16, DType::U8, DType::F64]) {
            let v = rng.values(dtype, n, -3.0, 3.0);
            let x = on(device, dtype, &v, &[n]);
            let z = compute::binary(BinaryOp::Add, &x, &x).unwrap();
            let want: Vec<V> = v
                .iter()
                .map(|&a| binary_ref(BinaryOp::Add, dtype, a, a))
                .collect();
            let (rtol, atol) = dev.tolerance(dtype);
            check(&format!("{n} x {dtype}"), &read(&z), &want, rtol, atol);
        }
    }
    // Empty arrays and 0-d arrays.
    let e = on(device, DType::F32, &[], &[0, 5]);
    assert_eq!(compute::unary(UnaryOp::Exp, &e).unwrap().shape(), &[0, 5]);
    let s = on(device, DType::F32, &[V::F(2.0)], &[]);
    let z = compute::binary_scalar(BinaryOp::Mul, &s, Scalar::Float(1.5), false).unwrap();
    check("0-d", &read(&z), &[V::F(3.0)], 0.0, 0.0);
}

// ---------------------------------------------------------------------------------------------
// Reductions.

/// The host reduction of `vals` (row-major `shape`) over `axes` (`None`: all), with each
/// output's sum of absolute values (for the float tolerance).
fn reduce_ref(
    op: ReduceOp,
    dtype: DType,
    vals: &[V],
    shape: &[usize],
    axes: Option<&[usize]>,
) -> (Vec<V>, Vec<f64>, usize) {
    let reduced: Vec<bool> = (0..shape.len())
        .map(|a| axes.is_none_or(|ax| ax.contains(&a)))
        .collect();
    let out_shape: Vec<usize> = (0..shape.len())
        .filter(|&a| !reduced[a])
        .map(|a| shape[a])
        .collect();
    let outputs: usize = out_shape.iter().product();
    let count: usize = (0..shape.len())
        .filter(|&a| reduced[a])
        .map(|a| shape[a])
        .product();
    let mut ints = vec![0i128; outputs];
    let mut floats = vec![0f64; outputs];
    let mut squares = vec![0f64; outputs];
    let mut abs = vec![0f64; outputs];
    let mut prods = vec![1u64; outputs];
    let mut float_prods = vec![1f64; outputs];
    let mut best: Vec<Option<V>> = vec![None; outputs];
    // Each output's elements come in the reduced axes' row-major order: `seen` counts them, and
    // `best_at` is the position of the first extreme (or first NaN).
    let mut seen = vec![0usize; outputs];
    let mut best_at = vec![0usize; outputs];
    let mut idx = vec![0usize; shape.len()];
    let extreme = match op {
        ReduceOp::Max | ReduceOp::ArgMax => ReduceOp::Max,
        _ => ReduceOp::Min,
    };
    for &v in vals {
        let o = (0..shape.len())
            .filter(|&a| !reduced[a])
            .fold(0, |acc, a| acc * shape[a] + idx[a]);
        prods[o] = prods[o].wrapping_mul(v.i() as u64);
        float_prods[o] *= v.f();
        for a in (0..shape.len()).rev() {
            idx[a] += 1;
            if idx[a] < shape[a] {
                break;
            }
            idx[a] = 0;
        }
        ints[o] += v.i();
        floats[o] += v.f();
        squares[o] += v.f() * v.f();
        abs[o] += v.f().abs();
        best[o] = Some(match best[o] {
            None => v,
            Some(b) => {
                let (x, y) = (b.f(), v.f());
                let take_new = if x.is_nan() {
                    false
                } else if y.is_nan() {
                    true
                } else if is_int(dtype) {
                    match extreme {
                        ReduceOp::Max => v.i() > b.i(),
                        _ => v.i() < b.i(),
                    }
                } else {
                    match extreme {
                        ReduceOp::Max => y > x,
                        _ => y < x,
                    }
                };
                if take_new {
                    best_at[o] = seen[o];
                    v
                } else {
                    b
                }
            }
        });
        seen[o] += 1;
    }
    let (_, out_dtype) = promote::reduce_types(op, dtype).unwrap();
    let want = (0..outputs)
        .map(|o| match op {
            ReduceOp::Sum if is_int(dtype) => V::I(wrap(out_dtype, ints[o])),
            ReduceOp::Sum => V::F(round_to(out_dtype, floats[o])),
            ReduceOp::Mean => V::F(round_to(out_dtype, floats[o] / count as f64)),
            ReduceOp::Prod if is_int(dtype) => V::I(wrap(out_dtype, prods[o] as i128)),
            ReduceOp::Prod => V::F(round_to(out_dtype, float_prods[o])),
            ReduceOp::ArgMax | ReduceOp::ArgMin => V::I(best_at[o] as i128),
            ReduceOp::Var | ReduceOp::Std => {
                let n = count as f64;
                let mean = floats[o] / n;
                let var = (squares[o] / n - mean * mean).max(0.0);
                let v = if op == ReduceOp::Var { var } else { var.sqrt() };
                V::F(round_to(out_dtype, v))
            }
            ReduceOp::Max | ReduceOp::Min => best[o].expect("max and min of something"),
        })
        .collect();
    let abs = abs
        .into_iter()
        .zip(&float_prods)
        .zip(&squares)
        .map(|((s, p), q)| match op {
            ReduceOp::Mean => s / count.max(1) as f64,
            // Each factor rounds once: a bound relative to the product.
            ReduceOp::Prod => p.abs() * count as f64,
            // The moments' errors are relative to the mean square.
            ReduceOp::Var => q / count.max(1) as f64,
            ReduceOp::Std => (q / count.max(1) as f64).sqrt(),
            _ => s,
        })
        .collect();
    (want, abs, count)
}

/// `reduce(op, x, axes, keepdims)` on `x`'s device, or `None` where the device lacks the result's
/// dtype (Metal: an integer mean, var or std is float64), after checking that it refused.
fn reduced(
    dev: &Dev,
    op: ReduceOp,
    x: &Tensor,
    axes: Option<&[isize]>,
    keepdims: bool,
) -> Option<Tensor> {
    let (_, out) = promote::reduce_types(op, x.dtype()).unwrap();
    dev.result(&[x.dtype(), out], compute::reduce(op, x, axes, keepdims))
}

/// Checks a reduction's result against the host, with a float tolerance scaled by the sum of
/// absolute values (the accumulator is float32 for the 16- and 32-bit floats).
fn check_reduce(what: &str, op: ReduceOp, dtype: DType, got: &Tensor, want: &[V], abs: &[f64]) {
    let got = read(got);
    assert_eq!(got.len(), want.len(), "{what}");
    let (_, out_dtype) = promote::reduce_types(op, dtype).unwrap();
    let wide_acc = matches!(op, ReduceOp::Mean | ReduceOp::Var | ReduceOp::Std);
    let acc_eps = if dtype == DType::F64 || (is_int(dtype) && wide_acc) {
        1e-13
    } else {
        1e-5
    };
    for (i, ((g, w), s)) in got.iter().zip(want).zip(abs).enumerate() {
        match (g, w) {
            (V::I(a), V::I(b)) => assert_eq!(a, b, "{what}: output {i}"),
            _ => {
                let (a, b) = (g.f(), w.f());
                // Partial products may leave float's range before the whole does (NumPy's
                // products multiply in the dtype too): near either end an infinity or a zero of
                // the product's sign passes.
                let (lo, hi) = if dtype == DType::F64 {
                    (1e-290, 1e290)
                } else {
                    (1e-30, 1e30)
                };
                let edge = op == ReduceOp::Prod
                    && (b.abs() > hi && a.is_infinite() || b.abs() < lo && a == 0.0)
                    && (a == 0.0 || a.is_sign_negative() == b.is_sign_negative());
                let ok = if b.is_nan() {
                    a.is_nan()
                } else if b.is_infinite() || edge {
                    a == b || edge
                } else {
                    let tol = acc_eps * s + 2.0 * eps(out_dtype) * b.abs() + 1e-30;
                    (a - b).abs() <= tol
                };
                assert!(ok, "{what}: output {i}: got {a}, want {b}");
            }
        }
    }
}

fn reductions_over_all_and_some_axes_on_every_dtype(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(8);
    let shape = [5, 7, 301];
    let n: usize = shape.iter().product();
    let axes_list: [Option<&[usize]>; 6] = [
        None,
        Some(&[2]),
        Some(&[0]),
        Some(&[1]),
        Some(&[0, 2]),
        Some(&[0, 1, 2]),
    ];
    for dtype in dev.computable(&DTYPES) {
        // Small integers for sums that stay exact in float32 partials of the means, but the
        // whole range for max / min.
        let vals = if is_int(dtype) {
            rng.values(dtype, n, 0.0, 0.0)
        } else {
            rng.values(dtype, n, -4.0, 4.0)
        };
        let x = on(device, dtype, &vals, &shape);
        for op in ReduceOp::ALL {
            for axes in axes_list {
                let signed: Option<Vec<isize>> =
                    axes.map(|a| a.iter().map(|&i| i as isize).collect());
                let Some(y) = reduced(dev, op, &x, signed.as_deref(), false) else {
                    continue;
                };
                let (want, abs, _) = reduce_ref(op, dtype, &vals, &shape, axes);
                let what = format!("{} of {dtype} over {axes:?}", op.name());
                check_reduce(&what, op, dtype, &y, &want, &abs);
            }
        }
        // keepdims keeps the reduced axes as 1.
        let y = compute::reduce(ReduceOp::Max, &x, Some(&[-1, 0]), true).unwrap();
        assert_eq!(y.shape(), &[1, 7, 1]);
    }
    // Hand-picked data: every axis set, a long row, NaN, empty, wide integer sums.
    reductions_of_hand_picked_data(dev);
}

fn reductions_of_views_large_rows_and_columns(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(9);
    for dtype in dev.computable(&[DType::F32, DType::F16, DType::I32, DType::F64]) {
        // Few long rows (split over blocks), and few long columns (thread per output, split).
        for (shape, axis) in [
            ([3usize, 1 << 20], 1usize),
            ([1 << 20, 3], 0),
            ([4099, 33], 1),
            ([33, 4099], 0),
        ] {
            let n = shape[0] * shape[1];
            let vals = rng.small(dtype, n, -8.0, 8.0);
            let x = on(device, dtype, &vals, &shape);
            for op in ReduceOp::ALL {
                let Some(y) = reduced(dev, op, &x, Some(&[axis as isize]), false) else {
                    continue;
                };
                let (want, abs, _) = reduce_ref(op, dtype, &vals, &shape, Some(&[axis]));
                let what = format!("{} of {dtype} {shape:?} axis {axis}", op.name());
                check_reduce(&what, op, dtype, &y, &want, &abs);
            }
        }
        // A transposed, reversed view reduced along each axis and over everything.
        let vals = rng.small(dtype, 257 * 129, -8.0, 8.0);
        let base = on(device, dtype, &vals, &[257, 129]);
        let view = base
            .transpose()
            .unwrap()
            .slice(
                1,
                SliceArg {
                    start: None,
                    stop: None,
                    step: -1,
                },
            )
            .unwrap();
        let hv = read(&view);
        let vshape = view.shape().to_vec();
        for axes in [None, Some(&[0usize][..]), Some(&[1usize][..])] {
            for op in ReduceOp::ALL {
                let signed: Option<Vec<isize>> =
                    axes.map(|a| a.iter().map(|&i| i as isize).collect());
                let Some(y) = reduced(dev, op, &view, signed.as_deref(), false) else {
                    continue;
                };
                let (want, abs, _) = reduce_ref(op, dtype, &hv, &vshape, axes);
                check_reduce(
                    &format!("{} of a view {axes:?}", op.name()),
                    op,
                    dtype,
                    &y,
                    &want,
                    &abs,
                );
            }
        }
    }
    // A sum over 2^24 + 3 float32 elements: the two-pass full reduction.
    let n = (1 << 24) + 3;
    let vals = rng.values(DType::F32, n, 0.0, 1.0);
    let x = on(device, DType::F32, &vals, &[n]);
    let y = compute::reduce(ReduceOp::Sum, &x, None, false).unwrap();
    let (want, abs, _) = reduce_ref(ReduceOp::Sum, DType::F32, &vals, &[n], None);
    check_reduce("large sum", ReduceOp::Sum, DType::F32, &y, &want, &abs);
}

fn reductions_over_many_axes_nan_and_empty(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(10);
    // Nine axes, five reduced, alternating: compacted with kept axes first.
    let shape = [2, 3, 2, 3, 2, 3, 2, 3, 2];
    let n: usize = shape.iter().product();
    let vals = rng.values(DType::F32, n, -1.0, 1.0);
    let x = on(device, DType::F32, &vals, &shape);
    let axes = [0usize, 2, 4, 6, 8];
    let signed: Vec<isize> = axes.iter().map(|&a| a as isize).collect();
    for op in ReduceOp::ALL {
        let Some(y) = reduced(dev, op, &x, Some(&signed), false) else {
            continue;
        };
        assert_eq!(y.shape(), &[3, 3, 3, 3]);
        let (want, abs, _) = reduce_ref(op, DType::F32, &vals, &shape, Some(&axes));
        check_reduce(
            &format!("{} over 5 of 9 axes", op.name()),
            op,
            DType::F32,
            &y,
            &want,
            &abs,
        );
    }
    // NaN propagates through max, min and sum.
    for dtype in dev.computable(&[DType::F32, DType::F16, DType::BF16, DType::F64]) {
        let mut vals = rng.values(dtype, 10_000, -1.0, 1.0);
        vals[7777] = V::F(f64::NAN);
        let x = on(device, dtype, &vals, &[10_000]);
        for op in ReduceOp::ALL {
            let Some(y) = reduced(dev, op, &x, None, false) else {
                continue;
            };
            let y = read(&y);
            if op.is_arg() {
                // The (first) NaN is the extreme.
                assert_eq!(y[0], V::I(7777), "{} of {dtype} with a NaN", op.name());
                continue;
            }
            assert!(
                y[0].f().is_nan(),
                "{} of {dtype} with a NaN: {:?}",
                op.name(),
                y[0]
            );
        }
        let x2 = on(device, dtype, &vals, &[100, 100]);
        let y = read(&compute::reduce(ReduceOp::Max, &x2, Some(&[1]), false).unwrap());
        assert!(y[77].f().is_nan() && !y[76].f().is_nan(), "{dtype} row max");
    }
    // Empty reductions: sums are 0, means NaN, max / min are errors.
    for dtype in [DType::F32, DType::I16, DType::BF16] {
        let x = on(device, dtype, &[], &[0, 4]);
        let s = read(&compute::reduce(ReduceOp::Sum, &x, Some(&[0]), false).unwrap());
        assert_eq!(s.len(), 4);
        assert!(s.iter().all(|v| v.f() == 0.0), "{dtype} empty sum {s:?}");
        // (An integer mean is float64, which Metal lacks.)
        if let Some(m) = reduced(dev, ReduceOp::Mean, &x, Some(&[0]), false) {
            let m = read(&m);
            assert!(m.iter().all(|v| v.f().is_nan()), "{dtype} empty mean {m:?}");
        }
        let all = read(&compute::reduce(ReduceOp::Sum, &x, None, false).unwrap());
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].f(), 0.0);
        let err = compute::reduce(ReduceOp::Max, &x, Some(&[0]), false).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // Nothing to write: an empty output.
        let y = compute::reduce(ReduceOp::Max, &x, Some(&[1]), false).unwrap();
        assert_eq!(y.shape(), &[0]);
    }
}

// ---------------------------------------------------------------------------------------------
// Matrix products.

/// The host product of row-major `a` (`[.., m, k]`) and `b` (`[.., k, n]`) with broadcast batch
/// axes, in f64.
fn matmul_ref(a: &[V], sa: &[usize], b: &[V], sb: &[usize]) -> (Vec<f64>, Vec<usize>) {
    let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    let batch = compute::broadcast_shapes(&sa[..sa.len() - 2], &sb[..sb.len() - 2]).unwrap();
    let mut out_shape = batch.clone();
    out_shape.extend([m, n]);
    let mut out = Vec::new();
    let bat_a = &sa[..sa.len() - 2];
    let bat_b = &sb[..sb.len() - 2];
    for idx in indices(&batch) {
        let oa = broadcast_index(bat_a, &batch, &idx) * m * k;
        let ob = broadcast_index(bat_b, &batch, &idx) * k * n;
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| a[oa + i * k + p].f() * b[ob + p * n + j].f())
                    .sum();
                out.push(s);
            }
        }
    }
    (out, out_shape)
}

fn relative_error(got: &[V], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g.f() - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(1e-300)).sqrt()
}

fn matmul_matches_the_host_for_layouts_and_batches(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(11);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        if !dev.computes(dtype) {
            let a = on(device, dtype, &[V::F(1.0)], &[1, 1]);
            assert!(dev.result(&[dtype], compute::matmul(&a, &a)).is_none());
            continue;
        }
        let tol = match dtype {
            DType::F32 => 1e-5,
            DType::F64 => 1e-12,
            DType::F16 => 4e-3,
            _ => 2e-2,
        };
        let cases: [(&[usize], &[usize]); 6] = [
            (&[65, 33], &[33, 17]),
            (&[1, 8, 5], &[4, 5, 7]),
            (&[3, 65, 33], &[3, 33, 17]),
            (&[2, 1, 8, 5], &[3, 5, 7]),
            (&[1, 1], &[1, 300]),
            (&[128, 256], &[256, 96]),
        ];
        for (sa, sb) in cases {
            let va = rng.values(dtype, sa.iter().product(), -1.0, 1.0);
            let vb = rng.values(dtype, sb.iter().product(), -1.0, 1.0);
            let a = on(device, dtype, &va, sa);
            let b = on(device, dtype, &vb, sb);
            let y = compute::matmul(&a, &b).unwrap();
            let (want, shape) = matmul_ref(&va, sa, &vb, sb);
            assert_eq!(y.shape(), &shape[..]);
            let err = relative_error(&read(&y), &want);
            assert!(err < tol, "{dtype} {sa:?} @ {sb:?}: relative error {err}");
        }
        // Transposed operands (column-major for cuBLAS) and a strided one (copied first).
        let (m, k, n) = (40, 24, 56);
        let va = rng.values(dtype, k * m, -1.0, 1.0);
        let vb = rng.values(dtype, n * k, -1.0, 1.0);
        let at = on(device, dtype, &va, &[k, m]).transpose().unwrap();
        let bt = on(device, dtype, &vb, &[n, k]).transpose().unwrap();
        let (ha, hb) = (read(&at), read(&bt));
        let (want, _) = matmul_ref(&ha, &[m, k], &hb, &[k, n]);
        let err = relative_error(&read(&compute::matmul(&at, &bt).unwrap()), &want);
        assert!(err < tol, "{dtype} transposed: {err}");
        let vs = rng.values(dtype, m * 2 * k, -1.0, 1.0);
        let strided = on(device, dtype, &vs, &[m, 2 * k])
            .slice(
                1,
                SliceArg {
                    start: None,
                    stop: None,
                    step: 2,
                },
            )
            .unwrap();
        let hs = read(&strided);
        let (want, _) = matmul_ref(&hs, &[m, k], &hb, &[k, n]);
        let err = relative_error(&read(&compute::matmul(&strided, &bt).unwrap()), &want);
        assert!(err < tol, "{dtype} strided: {err}");
        // Vectors: (k) @ (k, n) and (m, k) @ (k).
        let v = rng.values(dtype, k, -1.0, 1.0);
        let vt = on(device, dtype, &v, &[k]);
        let y = compute::matmul(&vt, &bt).unwrap();
        assert_eq!(y.shape(), &[n]);
        let (want, _) = matmul_ref(&v, &[1, k], &hb, &[k, n]);
        assert!(relative_error(&read(&y), &want) < tol);
        let y = compute::matmul(&at, &vt).unwrap();
        assert_eq!(y.shape(), &[m]);
        let (want, _) = matmul_ref(&ha, &[m, k], &v, &[k, 1]);
        assert!(relative_error(&read(&y), &want) < tol);
        // k = 0: zeros.
        let e1 = on(device, dtype, &[], &[3, 0]);
        let e2 = on(device, dtype, &[], &[0, 4]);
        let y = read(&compute::matmul(&e1, &e2).unwrap());
        assert_eq!(y.len(), 12);
        assert!(y.iter().all(|v| v.f() == 0.0));
    }
    // Batches, a column-major operand, vectors, float16.
    matmul_of_batches_vectors_and_float16(dev);
}

// ---------------------------------------------------------------------------------------------
// NumPy habits: floor division, remainder and power edges, bool reductions, all / any,
// var / std and argmax / argmin (one-pass kernels), isnan / isinf / isfinite, advanced indexing.
// Each result is checked against the CPU's on the same data (the CPU's are checked against NumPy
// and against references in compute_reference.rs), or against the positions and values the test put
// there.

/// `f` on the device and on the host copy of the same inputs agree: exactly for integers and
/// bool, within a few ulp of the dtype for floats.
fn agrees(what: &str, dev: &Dev, f: impl Fn(Device) -> dlbridge::Result<Tensor>) {
    agrees_within(what, dev, 8.0, f)
}

/// `f` run on `dev` and on the CPU: the two results, checked to be on their devices with the
/// same shape and dtype; `None` where `dev` lacks the result's dtype (Metal: an integer var is
/// float64), after checking that it refused.
fn on_both(
    what: &str,
    dev: &Dev,
    f: impl Fn(Device) -> dlbridge::Result<Tensor>,
) -> Option<(Tensor, Tensor)> {
    let device = dev.device;
    let want = f(Device::CPU).unwrap_or_else(|e| panic!("{what} on the CPU: {e}"));
    let got = dev.result(&[want.dtype()], f(device))?;
    assert_eq!(got.device(), device, "{what}");
    assert_eq!(
        (got.shape(), got.dtype()),
        (want.shape(), want.dtype()),
        "{what}"
    );
    Some((got, want))
}

/// [`agrees`] with floats within `ulps` times the dtype's element-wise tolerance.
fn agrees_within(what: &str, dev: &Dev, ulps: f64, f: impl Fn(Device) -> dlbridge::Result<Tensor>) {
    let Some((got, want)) = on_both(what, dev, f) else {
        return;
    };
    let (rtol, atol) = if is_int(got.dtype()) || got.dtype() == DType::BOOL {
        (0.0, 0.0)
    } else {
        let (r, a) = dev.tolerance(got.dtype());
        (r * ulps, a)
    };
    check(what, &read(&got), &read(&want), rtol, atol);
}

fn floor_division_remainder_and_power_follow_numpy_on_the_device(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(21);
    for dtype in dev.computable(&DTYPES) {
        let n = 2048;
        let mut va = rng.values(dtype, n, -50.0, 50.0);
        let mut vb = rng.values(dtype, n, -9.0, 9.0);
        // Zero divisors, -1 against the most negative value, special floats.
        for (k, b) in vb.iter_mut().enumerate().take(64) {
            *b = value_of(dtype, [0.0, -1.0, 1.0, 3.0][k % 4]);
        }
        if is_signed(dtype) {
            for a in va.iter_mut().take(32) {
                *a = V::I(-(1i128 << (dtype.bits() - 1)));
            }
        }
        if !is_int(dtype) {
            let special = [f64::INFINITY, f64::NEG_INFINITY, f64::NAN, -0.0, 0.0, 7.0];
            for (k, a) in va.iter_mut().skip(64).take(36).enumerate() {
                *a = V::F(special[k % 6]);
            }
            for (k, b) in vb.iter_mut().skip(64).take(36).enumerate() {
                *b = V::F(special[(k / 6) % 6]);
            }
        }
        let a = |d: Device| on(d, dtype, &va, &[n]);
        let b = |d: Device| on(d, dtype, &vb, &[n]);
        for op in [BinaryOp::FloorDiv, BinaryOp::Mod] {
            agrees(&format!("{} of {dtype}", op.name()), dev, |d| {
                compute::binary(op, &a(d), &b(d))
            });
            agrees(&format!("{} of {dtype} by 3", op.name()), dev, |d| {
                compute::binary_scalar(op, &a(d), Scalar::Int(3), false)
            });
            agrees(&format!("7 {} {dtype}", op.name()), dev, |d| {
                compute::binary_scalar(op, &b(d), Scalar::Int(7), true)
            });
        }
        // Powers: non-negative small exponents for integers (negative ones are refused).
        let ve = rng.small(dtype, n, 0.0, if is_int(dtype) { 70.0 } else { 4.0 });
        let e = |d: Device| on(d, dtype, &ve, &[n]);
        agrees(&format!("pow of {dtype}"), dev, |d| {
            compute::binary(BinaryOp::Pow, &a(d), &e(d))
        });
        if is_signed(dtype) {
            let err = compute::binary_scalar(BinaryOp::Pow, &a(device), Scalar::Int(-2), false)
                .unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
            let err = compute::binary(BinaryOp::Pow, &e(device), &a(device)).unwrap_err();
            assert!(err.to_string().contains("negative integer powers"), "{err}");
        }
    }
}

fn numpy_reductions_and_classifications_match_the_cpu(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(22);
    let shape = [6usize, 5, 33];
    let n: usize = shape.iter().product();
    for dtype in dev.computable(&[
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I16,
        DType::U8,
    ]) {
        let mut vals = rng.small(dtype, n, -3.0, 3.0);
        if !is_int(dtype) {
            vals[17] = V::F(f64::NAN);
            vals[400] = V::F(f64::INFINITY);
            vals[401] = V::F(f64::NEG_INFINITY);
        }
        vals[5] = vals[6]; // ties
        let x = |d: Device| on(d, dtype, &vals, &shape);
        let views = |d: Device| {
            let t = x(d);
            [
                t.clone(),
                t.permute(&[2, 0, 1]).unwrap(),
                t.slice(
                    0,
                    SliceArg {
                        start: None,
                        stop: None,
                        step: -2,
                    },
                )
                .unwrap(),
            ]
        };
        for v in 0..3 {
            for axes in [
                None,
                Some(&[0isize][..]),
                Some(&[-1][..]),
                Some(&[0, 2][..]),
            ] {
                for keepdims in [false, true] {
                    let what = |name: &str| format!("{name} of {dtype} view {v} over {axes:?}");
                    agrees(&what("all"), dev, |d| {
                        compute::all(&views(d)[v], axes, keepdims)
                    });
                    agrees(&what("any"), dev, |d| {
                        compute::any(&views(d)[v], axes, keepdims)
                    });
                    agrees(&what("var"), dev, |d| {
                        compute::var(&views(d)[v], axes, 1.0, keepdims)
                    });
                    agrees(&what("std"), dev, |d| {
                        compute::std(&views(d)[v], axes, 0.0, keepdims)
                    });
                    for op in [ReduceOp::ArgMax, ReduceOp::ArgMin] {
                        agrees(&what(op.name()), dev, |d| {
                            compute::reduce(op, &views(d)[v], axes, keepdims)
                        });
                    }
                }
            }
            agrees("isnan", dev, |d| compute::isnan(&views(d)[v]));
            agrees("isinf", dev, |d| compute::isinf(&views(d)[v]));
            agrees("isfinite", dev, |d| compute::isfinite(&views(d)[v]));
        }
    }
    // Products: of values near 1 (finite whatever the order), each factor rounding once.
    for dtype in dev.computable(&[DType::F32, DType::F64, DType::F16, DType::I32, DType::U64]) {
        let vals = if is_int(dtype) {
            rng.values(dtype, n, 0.0, 0.0)
        } else {
            rng.small(dtype, n, 0.95, 1.05)
        };
        for axes in [None, Some(&[1isize][..]), Some(&[0, 2][..])] {
            agrees_within(&format!("prod of {dtype} over {axes:?}"), dev, 64.0, |d| {
                compute::reduce(ReduceOp::Prod, &on(d, dtype, &vals, &shape), axes, false)
            });
        }
    }
    // bool arrays reduce as NumPy's: counts in int64, max / min stay bool.
    let flags: Vec<V> = (0..n).map(|i| V::I((i % 3 == 0) as i128)).collect();
    for op in [
        ReduceOp::Sum,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Prod,
        ReduceOp::ArgMax,
    ] {
        agrees(&format!("{} of bool", op.name()), dev, |d| {
            compute::reduce(op, &on(d, DType::BOOL, &flags, &shape), Some(&[1]), false)
        });
    }
    // Empty: all is true, any false, argmax refused.
    let empty = on(device, DType::F32, &[], &[0, 4]);
    assert_eq!(
        read(&compute::all(&empty, Some(&[0]), false).unwrap()),
        vec![V::I(1); 4]
    );
    assert_eq!(
        read(&compute::any(&empty, None, false).unwrap()),
        vec![V::I(0)]
    );
    assert!(compute::reduce(ReduceOp::ArgMax, &empty, Some(&[0]), false).is_err());
}

fn advanced_indexing_gathers_and_scatters_device_views(dev: &Dev) {
    use dlbridge::compute::index;
    let device = dev.device;
    let vals: Vec<V> = (0..120).map(|i| V::F(i as f64)).collect();
    let x = |d: Device| on(d, DType::F32, &vals, &[4, 5, 6]);
    let idx = |d: Device| {
        on(
            d,
            DType::I64,
            &[V::I(2), V::I(-1), V::I(0), V::I(2)],
            &[2, 2],
        )
    };
    let view = |t: &Tensor| {
        t.slice(0, SliceArg::range(1, 4))
            .unwrap()
            .permute(&[2, 0, 1])
            .unwrap()
    };
    agrees("take on one axis", dev, |d| {
        index::take(&view(&x(d)), &[1], &[idx(d)], false)
    });
    agrees("take on two axes (first)", dev, |d| {
        index::take(&x(d), &[0, 2], &[idx(d), idx(d)], true)
    });
    // Scatter a broadcast value through a device view; the rest stays.
    let written = |d: Device| -> dlbridge::Result<Tensor> {
        let t = x(d);
        let value = on(d, DType::F32, &[V::F(-1.0)], &[]);
        // SAFETY: `t` is this closure's own; nothing else references it.
        unsafe { index::put(&view(&t), &[1], &[idx(d)], false, &value)? };
        Ok(t)
    };
    agrees("put through a view", dev, written);
    // A mask read on the host, and the positions it selects.
    let mask: Vec<V> = (0..120).map(|i| V::I((i % 7 == 0) as i128)).collect();
    let nz = index::nonzero(&on(device, DType::BOOL, &mask, &[4, 5, 6])).unwrap();
    let want = index::nonzero(&on(Device::CPU, DType::BOOL, &mask, &[4, 5, 6])).unwrap();
    for (g, w) in nz.iter().zip(&want) {
        assert_eq!(read(g), read(w));
    }
}

// ---------------------------------------------------------------------------------------------
// argmax / argmin and var / std: one pass over the data, partial results of the splits of a long
// row merged by a second kernel. 2^24 + 17 elements split over hundreds of blocks on any GPU, so
// a wrong merge of the splits fails here.

/// Writes `value` (rounded into the dtype) at position `i` of the vector `x`, on its device.
fn poke(x: &Tensor, i: usize, value: f64) {
    let one = Tensor::from_slice(&[value], &[1])
        .unwrap()
        .cast(x.dtype())
        .unwrap();
    let at = x
        .slice(0, SliceArg::range(i as isize, i as isize + 1))
        .unwrap();
    // SAFETY: the test's own tensor; no reference into its memory is alive, and no other thread
    // uses it.
    unsafe { at.copy_from_unchecked(&one).unwrap() };
}

/// The one `int64` an arg reduction over everything gives.
fn position(op: ReduceOp, x: &Tensor) -> i128 {
    read(&compute::reduce(op, x, None, false).unwrap())[0].i()
}

fn arg_reductions_find_the_first_extreme_across_blocks(dev: &Dev) {
    let device = dev.device;
    let n = (1usize << 24) + 17;
    // Values 1..=40, exact in every dtype.
    let base: Vec<f64> = (0..n).map(|i| ((i * 7919) % 40) as f64 + 1.0).collect();
    for dtype in dev.computable(&[
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I8,
        DType::U8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U64,
    ]) {
        let bottom = if is_int(dtype) && !is_signed(dtype) {
            0.0
        } else {
            -100.0
        };
        let x = Tensor::from_slice(&base, &[n])
            .unwrap()
            .cast(dtype)
            .unwrap()
            .copy_to(device)
            .unwrap();
        // (position, value) pairs written, the argmax and argmin expected.
        type Case = (&'static str, Vec<(usize, f64)>, usize, usize);
        let mut cases: Vec<Case> = vec![
            (
                "at the very end",
                vec![(n - 1, 100.0), (n - 2, bottom)],
                n - 1,
                n - 2,
            ),
            ("at the very start", vec![(0, 100.0), (1, bottom)], 0, 1),
            (
                "ties: the first wins",
                vec![
                    (n - 1, 100.0),
                    (n / 2 + 3, 100.0),
                    (9_000_001, 100.0),
                    (n - 3, bottom),
                    (4_000_000, bottom),
                ],
                n / 2 + 3,
                4_000_000,
            ),
        ];
        if !is_int(dtype) {
            cases.push((
                "the first NaN wins",
                vec![
                    (0, 100.0),
                    (1, bottom),
                    (n - 1, f64::NAN),
                    (12_345_678, f64::NAN),
                    (n - 9, f64::INFINITY),
                ],
                12_345_678,
                12_345_678,
            ));
            cases.push((
                "infinities",
                vec![
                    (n - 9, f64::INFINITY),
                    (77, f64::NEG_INFINITY),
                    (n - 2, f64::INFINITY),
                ],
                n - 9,
                77,
            ));
        }
        for (name, writes, max_at, min_at) in cases {
            for &(i, v) in &writes {
                poke(&x, i, v);
            }
            let what = format!("{dtype}: {name}");
            assert_eq!(
                position(ReduceOp::ArgMax, &x),
                max_at as i128,
                "argmax {what}"
            );
            assert_eq!(
                position(ReduceOp::ArgMin, &x),
                min_at as i128,
                "argmin {what}"
            );
            // keepdims, and the same over a 2-d view of the same memory (rows of 4097: the
            // flat position).
            let k = compute::reduce(ReduceOp::ArgMax, &x, Some(&[0]), true).unwrap();
            assert_eq!(
                (k.shape(), read(&k)[0].i()),
                (&[1usize][..], max_at as i128),
                "{what}"
            );
            let rows = x
                .slice(0, SliceArg::range(0, 4097 * 4095))
                .unwrap()
                .reshape(&[Some(4095), Some(4097)])
                .unwrap();
            if max_at < 4097 * 4095 {
                assert_eq!(
                    position(ReduceOp::ArgMax, &rows),
                    max_at as i128,
                    "2-d argmax {what}"
                );
            }
            for &(i, _) in &writes {
                poke(&x, i, base[i]);
            }
        }
        // Along rows and columns of the 2-d view, against the CPU.
        let rows = |d: Device| {
            let t = x.copy_to(d)?;
            t.slice(0, SliceArg::range(0, 4097 * 4095))?
                .reshape(&[Some(4095), Some(4097)])
        };
        for op in [ReduceOp::ArgMax, ReduceOp::ArgMin] {
            for axis in [0isize, 1] {
                agrees(
                    &format!("{} of {dtype} rows axis {axis}", op.name()),
                    dev,
                    |d| compute::reduce(op, &rows(d)?, Some(&[axis]), false),
                );
            }
        }
    }
}

fn moments_are_one_pass_and_match_references(dev: &Dev) {
    let device = dev.device;
    let mut rng = Rng::new(32);
    let two_pass = |xs: &[V], ddof: f64| {
        let n = xs.len() as f64;
        let mean = xs.iter().map(|v| v.f()).sum::<f64>() / n;
        xs.iter().map(|v| (v.f() - mean).powi(2)).sum::<f64>() / (n - ddof).max(0.0)
    };
    // Long rows far from 0 (where E[x²] - E[x]² in float32 would lose every digit), split over
    // blocks. A one-pass result is good to about `eps * |mean| / std` of its `double` partial
    // results (4e-12 for the integers here); float32 rounds each batch's mean once more.
    let n = (1usize << 24) + 17;
    for (dtype, offset, rel) in [
        (DType::F32, 1000.0, 1e-5),
        (DType::F64, 1e6, 1e-10),
        (DType::F16, 2.0, 4e-3),
        (DType::BF16, 2.0, 2e-2),
        (DType::I32, 1e6, 1e-10),
        (DType::U8, 100.0, 1e-10),
    ] {
        let vals = rng.small(dtype, n, offset - 50.0, offset + 50.0);
        let x = on(device, dtype, &vals, &[n]);
        // The result's dtype: floats keep theirs, integers give float64 (which Metal lacks).
        let (_, out) = promote::reduce_types(ReduceOp::Var, dtype).unwrap();
        if !dev.computes(dtype) || !dev.computes(out) {
            let var = compute::var(&x, None, 0.0, false);
            assert!(dev.result(&[dtype, out], var).is_none());
            continue;
        }
        for ddof in [0.0, 1.0] {
            let want = two_pass(&vals, ddof);
            let got = read(&compute::var(&x, None, ddof, false).unwrap())[0].f();
            assert!(
                (got - want).abs() <= rel * want,
                "var of {dtype} ddof {ddof}: got {got}, want {want}"
            );
            let got = read(&compute::std(&x, None, ddof, false).unwrap())[0].f();
            assert!(
                (got - want.sqrt()).abs() <= rel * want.sqrt(),
                "std of {dtype} ddof {ddof}: got {got}, want {}",
                want.sqrt()
            );
        }
        assert_eq!(compute::var(&x, None, 0.0, false).unwrap().dtype(), out);
    }
    // NaN and infinities give NaN; ddof at or past the count divides by 0 (inf, or NaN for 0 / 0).
    for dtype in dev.computable(&[DType::F32, DType::F16, DType::BF16, DType::F64]) {
        for special in [f64::NAN, f64::INFINITY] {
            let mut vals = rng.small(dtype, 100_000, -1.0, 1.0);
            vals[99_999] = V::F(special);
            let x = on(device, dtype, &vals, &[100_000]);
            let got = read(&compute::var(&x, None, 0.0, false).unwrap())[0].f();
            assert!(got.is_nan(), "var of {dtype} with {special}: {got}");
        }
        let x = on(device, dtype, &[V::F(1.0), V::F(2.0), V::F(4.0)], &[3]);
        assert_eq!(
            read(&compute::var(&x, None, 3.0, false).unwrap())[0].f(),
            f64::INFINITY
        );
        let c = on(device, dtype, &[V::F(2.0); 3], &[3]);
        assert!(
            read(&compute::var(&c, None, 5.0, false).unwrap())[0]
                .f()
                .is_nan()
        );
        let e = on(device, dtype, &[], &[0, 3]);
        let v = read(&compute::var(&e, Some(&[0]), 0.0, false).unwrap());
        assert!(v.len() == 3 && v.iter().all(|x| x.f().is_nan()), "{v:?}");
    }
}

/// `var` (`root`: `std`) on `device` against the CPU, within what `compute`'s docs promise: 64
/// times the output dtype's element-wise tolerance, plus the one-pass merge's
/// `eps(float64) * |mean| / std` relative to the result (bounded here by the largest magnitude of
/// the input `vals`). Integer values near the top of their range with a small spread (`uint16`
/// values drawn from -9..9 wrap to 65527..65535) need that term: the CPU's and CUDA's batches
/// differ, and both are good to about `1e-12` there where an element-wise tolerance says `2e-13`.
fn moments_agree(
    what: &str,
    dev: &Dev,
    vals: &[V],
    root: bool,
    f: impl Fn(Device) -> dlbridge::Result<Tensor>,
) {
    let Some((got, want)) = on_both(what, dev, f) else {
        return;
    };
    let largest = vals
        .iter()
        .map(|v| v.f().abs())
        .filter(|x| x.is_finite())
        .fold(0.0, f64::max);
    let want = read(&want);
    let spread = want
        .iter()
        .map(|v| v.f())
        .filter(|x| x.is_finite())
        .fold(0.0, f64::max);
    // Absolute error of the merge: `std` ~ eps * |mean|; `var` ~ eps * |mean| * std.
    let merge = 8.0 * eps(DType::F64) * largest * if root { 1.0 } else { spread.sqrt() };
    let (rtol, atol) = dev.tolerance(got.dtype());
    check(what, &read(&got), &want, rtol * 64.0, atol + merge);
}

fn arg_reductions_and_moments_of_views_match_the_cpu(dev: &Dev) {
    let mut rng = Rng::new(33);
    for dtype in dev.computable(&DTYPES) {
        let mut vals = rng.small(dtype, 24 * 20 * 33, -9.0, 9.0);
        if !is_int(dtype) {
            vals[1234] = V::F(f64::NAN);
        }
        let x = |d: Device| on(d, dtype, &vals, &[24, 20, 33]);
        // Row-major, transposed, reversed and strided, broadcast along a reduced axis, and nine
        // axes that do not merge (copied with the reduced axes last first).
        let views = |d: Device| -> dlbridge::Result<Vec<Tensor>> {
            let t = x(d);
            Ok(vec![
                t.clone(),
                t.permute(&[2, 0, 1])?,
                t.slice(
                    0,
                    SliceArg {
                        start: None,
                        stop: None,
                        step: -3,
                    },
                )?
                .slice(
                    2,
                    SliceArg {
                        start: Some(1),
                        stop: None,
                        step: 2,
                    },
                )?,
                t.slice(1, SliceArg::range(3, 4))?
                    .broadcast_to(&[24, 7, 33])?,
            ])
        };
        for v in 0..4 {
            for axes in [
                None,
                Some(&[0isize][..]),
                Some(&[1][..]),
                Some(&[-1][..]),
                Some(&[0, 2][..]),
            ] {
                for keepdims in [false, true] {
                    let what = |name: &str| format!("{name} of {dtype} view {v} over {axes:?}");
                    for op in [ReduceOp::ArgMax, ReduceOp::ArgMin] {
                        if axes.is_some_and(|a| a.len() > 1) {
                            continue;
                        }
                        agrees(&what(op.name()), dev, |d| {
                            compute::reduce(op, &views(d)?[v], axes, keepdims)
                        });
                    }
                    moments_agree(&what("var"), dev, &vals, false, |d| {
                        compute::var(&views(d)?[v], axes, 1.0, keepdims)
                    });
                    moments_agree(&what("std"), dev, &vals, true, |d| {
                        compute::std(&views(d)?[v], axes, 0.0, keepdims)
                    });
                }
            }
        }
        let nine = rng.small(dtype, 2 * 3 * 2 * 3 * 2 * 3 * 2 * 3 * 2, -9.0, 9.0);
        let shape = [2, 3, 2, 3, 2, 3, 2, 3, 2];
        for op in [ReduceOp::ArgMax, ReduceOp::ArgMin] {
            agrees(
                &format!("{} of {dtype} over 5 of 9 axes", op.name()),
                dev,
                |d| {
                    compute::reduce(
                        op,
                        &on(d, dtype, &nine, &shape),
                        Some(&[0, 2, 4, 6, 8]),
                        false,
                    )
                },
            );
        }
        for root in [false, true] {
            let op = if root { ReduceOp::Std } else { ReduceOp::Var };
            moments_agree(
                &format!("{} of {dtype} over 5 of 9 axes", op.name()),
                dev,
                &nine,
                root,
                |d| {
                    compute::reduce(
                        op,
                        &on(d, dtype, &nine, &shape),
                        Some(&[0, 2, 4, 6, 8]),
                        false,
                    )
                },
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-picked cases in `float32` (and a few other dtypes), with references in `f32` / `f64`:
// specials, edges and layouts chosen one by one (first written for Metal).

/// `data` on `device`, compact.
fn up<T: Element>(device: Device, data: &[T], shape: &[usize]) -> Tensor {
    Tensor::from_slice(data, shape)
        .unwrap()
        .copy_to(device)
        .unwrap()
}

/// The elements of any view on any device, row-major.
fn get<T: Element>(t: &Tensor) -> Vec<T> {
    t.to_vec::<T>().unwrap()
}

/// The elements of a `bool` view on any device.
fn bools(t: &Tensor) -> Vec<bool> {
    assert_eq!(t.dtype(), DType::BOOL);
    let host = t.copy_to(Device::CPU).unwrap();
    let bytes = host.cast(DType::U8).unwrap().to_vec::<u8>().unwrap();
    bytes.into_iter().map(|b| b != 0).collect()
}

/// Row-major index → element offset of a view with `shape` and `strides`.
fn strided_index(i: usize, shape: &[usize], strides: &[isize], first: isize) -> usize {
    let (mut rest, mut off) = (i, first);
    for k in (0..shape.len()).rev() {
        off += (rest % shape[k]) as isize * strides[k];
        rest /= shape[k];
    }
    off as usize
}

fn unary_f32(op: UnaryOp, x: f32) -> f32 {
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

fn binary_f32(op: BinaryOp, a: f32, b: f32) -> f32 {
    let divmod = || common::numpy_divmod(DType::F32, a as f64, b as f64);
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::FloorDiv => divmod().0 as f32,
        BinaryOp::Mod => divmod().1 as f32,
        BinaryOp::Pow => a.powf(b),
    }
}

/// `a @ b` for row-major `[batch?, m, k]` and `[k, n]` data, in f64.
fn matmul_f32(a: &[f32], b: &[f32], batch: usize, m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; batch * m * n];
    for z in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    s += a[(z * m + i) * k + p] as f64 * b[p * n + j] as f64;
                }
                out[(z * m + i) * n + j] = s as f32;
            }
        }
    }
    out
}

fn unary_ops_of_specials_and_edges(dev: &Dev) {
    let device = dev.device;
    let mut data = noise(1000, 1, 4.0);
    data.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    let n = data.len();
    let x = up(device, &data, &[n]);
    for op in UnaryOp::ALL {
        let y = compute::unary(op, &x).unwrap();
        assert_eq!(y.dtype(), DType::F32);
        let want: Vec<f32> = data.iter().map(|&v| unary_f32(op, v)).collect();
        assert_close_f32(&get::<f32>(&y), &want, 1e-5, op.name());
    }
    // 16-bit floats compute in float and round once.
    let halves: Vec<f16> = data.iter().map(|&v| f16::from_f32(v)).collect();
    let brains: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
    let xh = up(device, &halves, &[n]);
    let xb = up(device, &brains, &[n]);
    for op in [
        UnaryOp::Exp,
        UnaryOp::Sqrt,
        UnaryOp::Square,
        UnaryOp::Negative,
    ] {
        let want: Vec<f32> = halves
            .iter()
            .map(|v| f16::from_f32(unary_f32(op, v.to_f32())).to_f32())
            .collect();
        let got: Vec<f32> = get::<f16>(&compute::unary(op, &xh).unwrap())
            .iter()
            .map(|v| v.to_f32())
            .collect();
        assert_close_f32(&got, &want, 1e-3, op.name());
        let want: Vec<f32> = brains
            .iter()
            .map(|v| bf16::from_f32(unary_f32(op, v.to_f32())).to_f32())
            .collect();
        let got: Vec<f32> = get::<bf16>(&compute::unary(op, &xb).unwrap())
            .iter()
            .map(|v| v.to_f32())
            .collect();
        assert_close_f32(&got, &want, 8e-3, op.name());
    }
    // Integers wrap as NumPy's do.
    let ints: Vec<i8> = vec![-128, -5, 0, 7, 127, 16];
    let xi = up(device, &ints, &[6]);
    let abs = get::<i8>(&compute::unary(UnaryOp::Abs, &xi).unwrap());
    assert_eq!(
        abs,
        ints.iter().map(|v| v.wrapping_abs()).collect::<Vec<_>>()
    );
    let neg = get::<i8>(&compute::unary(UnaryOp::Negative, &xi).unwrap());
    assert_eq!(
        neg,
        ints.iter().map(|v| v.wrapping_neg()).collect::<Vec<_>>()
    );
    let sq = get::<i8>(&compute::unary(UnaryOp::Square, &xi).unwrap());
    assert_eq!(
        sq,
        ints.iter().map(|v| v.wrapping_mul(*v)).collect::<Vec<_>>()
    );
    let bytes: Vec<u8> = vec![0, 1, 200, 255];
    let xu = up(device, &bytes, &[4]);
    let neg = get::<u8>(&compute::unary(UnaryOp::Negative, &xu).unwrap());
    assert_eq!(neg, vec![0, 255, 56, 1]);
    // sqrt of uint8 is float16 (NumPy's rule).
    let root = compute::unary(UnaryOp::Sqrt, &xu).unwrap();
    assert_eq!(root.dtype(), DType::F16);
    let got: Vec<f32> = get::<f16>(&root).iter().map(|v| v.to_f32()).collect();
    let want: Vec<f32> = bytes
        .iter()
        .map(|&b| f16::from_f32((b as f32).sqrt()).to_f32())
        .collect();
    assert_close_f32(&got, &want, 1e-3, "sqrt(uint8)");
}

fn binary_ops_broadcast_and_take_scalars(dev: &Dev) {
    let device = dev.device;
    let (a_data, b_data) = (noise(12, 2, 3.0), noise(20, 3, 3.0));
    let a = up(device, &a_data, &[3, 1, 4]);
    let b = up(device, &b_data, &[5, 4]);
    for op in BinaryOp::ALL {
        let y = compute::binary(op, &a, &b).unwrap();
        assert_eq!(y.shape(), &[3, 5, 4]);
        let mut want = Vec::new();
        for i in 0..3 {
            for j in 0..5 {
                for k in 0..4 {
                    want.push(binary_f32(op, a_data[i * 4 + k], b_data[j * 4 + k]));
                }
            }
        }
        assert_close_f32(&get::<f32>(&y), &want, 1e-6, op.name());
        // Scalars on either side.
        let s = 1.75;
        let right = compute::binary_scalar(op, &b, Scalar::Float(s), false).unwrap();
        let left = compute::binary_scalar(op, &b, Scalar::Float(s), true).unwrap();
        let want_r: Vec<f32> = b_data
            .iter()
            .map(|&v| binary_f32(op, v, s as f32))
            .collect();
        let want_l: Vec<f32> = b_data
            .iter()
            .map(|&v| binary_f32(op, s as f32, v))
            .collect();
        assert_close_f32(&get::<f32>(&right), &want_r, 1e-6, op.name());
        assert_close_f32(&get::<f32>(&left), &want_l, 1e-6, op.name());
    }
    // Integer arithmetic wraps; weak integer scalars keep the array's type and wrap into it.
    let big = up(device, &[i32::MAX, i32::MIN, -7, 1 << 20], &[4]);
    let one = up(device, &[1i32, 1, 3, 1 << 12], &[4]);
    assert_eq!(
        get::<i32>(&compute::binary(BinaryOp::Add, &big, &one).unwrap()),
        vec![i32::MIN, i32::MIN + 1, -4, (1 << 20) + (1 << 12)]
    );
    assert_eq!(
        get::<i32>(&compute::binary(BinaryOp::Mul, &big, &one).unwrap()),
        vec![i32::MAX, i32::MIN, -21, 0]
    );
    let bytes = up(device, &[0u8, 10, 250], &[3]);
    assert_eq!(
        get::<u8>(&compute::binary_scalar(BinaryOp::Add, &bytes, Scalar::Int(300), false).unwrap()),
        vec![44, 54, 38]
    );
    assert_eq!(
        get::<u8>(&compute::binary_scalar(BinaryOp::Sub, &bytes, Scalar::Int(1), true).unwrap()),
        vec![1, 247, 7]
    );
    // Mixed dtypes promote: int16 + uint8 → int16; float16 + float32 → float32.
    let shorts = up(device, &[-300i16, 5, 1000], &[3]);
    let y = compute::binary(BinaryOp::Sub, &shorts, &bytes).unwrap();
    assert_eq!(y.dtype(), DType::I16);
    assert_eq!(get::<i16>(&y), vec![-300, -5, 750]);
    let halves = up(device, &[f16::from_f32(0.5), f16::from_f32(-2.0)], &[2]);
    let floats = up(device, &[0.25f32, 8.0], &[2]);
    let y = compute::binary(BinaryOp::Mul, &halves, &floats).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    assert_eq!(get::<f32>(&y), vec![0.125, -16.0]);
}

fn comparisons_give_bool_with_nan_scalars_and_broadcasting(dev: &Dev) {
    let device = dev.device;
    let mut a_data = noise(12, 5, 3.0);
    let mut b_data = noise(20, 6, 3.0);
    a_data[1] = f32::NAN;
    b_data[2] = f32::NAN;
    b_data[4] = a_data[0];
    let a = up(device, &a_data, &[3, 1, 4]);
    let b = up(device, &b_data, &[5, 4]);
    for op in CompareOp::ALL {
        let y = compute::compare(op, &a, &b).unwrap();
        assert_eq!((y.shape(), y.dtype()), (&[3, 5, 4][..], DType::BOOL));
        let mut want = Vec::new();
        for i in 0..3 {
            for j in 0..5 {
                for k in 0..4 {
                    want.push(op.holds(a_data[i * 4 + k], b_data[j * 4 + k]));
                }
            }
        }
        assert_eq!(bools(&y), want, "{}", op.name());
        // Scalars on either side; NaN compares false but for `!=`.
        let s = 0.5f32;
        let right = compute::compare_scalar(op, &b, Scalar::Float(s.into()), false).unwrap();
        let left = compute::compare_scalar(op, &b, Scalar::Float(s.into()), true).unwrap();
        let want_r: Vec<bool> = b_data.iter().map(|&v| op.holds(v, s)).collect();
        let want_l: Vec<bool> = b_data.iter().map(|&v| op.holds(s, v)).collect();
        assert_eq!(bools(&right), want_r, "{}", op.name());
        assert_eq!(bools(&left), want_l, "{}", op.name());
    }
    // Every Metal dtype: integers exactly, bfloat16 and float16 through float, bool as bytes.
    let ints = up(device, &[-5i64, 0, 7, i64::MAX], &[4]);
    let y = compute::compare_scalar(CompareOp::Ge, &ints, Scalar::Int(7), false).unwrap();
    assert_eq!(bools(&y), [false, false, true, true]);
    let bytes = up(device, &[0u8, 10, 250], &[3]);
    let y = compute::compare_scalar(CompareOp::Lt, &bytes, Scalar::Int(300), false).unwrap();
    assert_eq!(bools(&y), [true; 3]);
    let y = compute::compare_scalar(CompareOp::Eq, &bytes, Scalar::Int(10), true).unwrap();
    assert_eq!(bools(&y), [false, true, false]);
    let shorts = up(device, &[-300i16, 5, 1000], &[3]);
    let y = compute::compare(CompareOp::Gt, &shorts, &bytes).unwrap();
    assert_eq!(bools(&y), [false, false, true]);
    let halves = up(device, &[f16::from_f32(0.5), f16::NAN], &[2]);
    let brains = up(device, &[bf16::from_f32(0.5), bf16::from_f32(1.0)], &[2]);
    let y = compute::compare(CompareOp::Eq, &halves, &brains).unwrap();
    assert_eq!(bools(&y), [true, false]);
    let y = compute::compare(CompareOp::Ne, &halves, &halves).unwrap();
    assert_eq!(bools(&y), [false, true]);
    let mask = compute::compare_scalar(CompareOp::Gt, &bytes, Scalar::Int(5), false).unwrap();
    let y = compute::compare(CompareOp::Eq, &mask, &mask).unwrap();
    assert_eq!(bools(&y), [true; 3]);
    let y = compute::compare_scalar(CompareOp::Lt, &mask, Scalar::Int(1), false).unwrap();
    assert_eq!(bools(&y), [true, false, false]);
}

fn strided_views_and_storage_modes(dev: &Dev) {
    let device = dev.device;
    let data = noise(6 * 7 * 5, 4, 10.0);
    for mode in dev.storage_modes() {
        let base = dev.put_in(&Tensor::from_slice(&data, &[6, 7, 5]).unwrap(), mode);
        let mode = base.buffer().storage_mode();
        let views = [
            base.transpose().unwrap(),
            base.permute(&[1, 0, 2]).unwrap(),
            base.slice(
                1,
                SliceArg {
                    start: Some(6),
                    stop: None,
                    step: -2,
                },
            )
            .unwrap(),
            base.slice(0, SliceArg::range(1, 5))
                .unwrap()
                .index(2, 3)
                .unwrap(),
        ];
        for v in &views {
            let first = (v.byte_offset() / 4) as isize;
            let elems: Vec<f32> = (0..v.numel())
                .map(|i| data[strided_index(i, v.shape(), v.strides(), first)])
                .collect();
            // A strided unary input, and a strided binary with a transposed partner.
            let y = compute::unary(UnaryOp::Square, v).unwrap();
            assert_eq!(y.buffer().storage_mode(), mode);
            let want: Vec<f32> = elems.iter().map(|x| x * x).collect();
            assert_close_f32(&get::<f32>(&y), &want, 1e-6, "square of a view");
            let z = compute::binary(BinaryOp::Sub, v, &y).unwrap();
            let want: Vec<f32> = elems.iter().map(|x| x - x * x).collect();
            assert_close_f32(&get::<f32>(&z), &want, 1e-5, "view minus compact");
        }
    }
    // Ten axes that do not merge: the input is made compact first.
    let shape = [2usize; 10];
    let n = 1 << 10;
    let data: Vec<i32> = (0..n as i32).collect();
    let x = up(device, &data, &shape);
    let axes: Vec<usize> = (0..10).rev().collect();
    let xt = x.permute(&axes).unwrap();
    let y = compute::binary_scalar(BinaryOp::Add, &xt, Scalar::Int(1), false).unwrap();
    let want: Vec<i32> = (0..n)
        .map(|i| data[strided_index(i, xt.shape(), xt.strides(), 0)] + 1)
        .collect();
    assert_eq!(get::<i32>(&y), want);
}

fn casts_follow_astype(dev: &Dev) {
    let device = dev.device;
    let data = [
        0.0f32,
        -0.0,
        1.9,
        -1.9,
        127.5,
        300.7,
        -1.5,
        -129.0,
        3.0e9,
        f32::NAN,
        65504.0,
    ];
    let x = up(device, &data, &[data.len()]);
    let i8s = get::<i8>(&compute::cast(&x, DType::I8).unwrap());
    assert_eq!(
        i8s,
        data.iter().map(|&v| v as i128 as i8).collect::<Vec<_>>()
    );
    let u8s = get::<u8>(&compute::cast(&x, DType::U8).unwrap());
    assert_eq!(
        u8s,
        data.iter().map(|&v| v as i128 as u8).collect::<Vec<_>>()
    );
    let i32s = get::<i32>(&compute::cast(&x, DType::I32).unwrap());
    assert_eq!(
        i32s,
        data.iter().map(|&v| v as i128 as i32).collect::<Vec<_>>()
    );
    let u64s = get::<u64>(&compute::cast(&x, DType::U64).unwrap());
    assert_eq!(
        u64s,
        data.iter().map(|&v| v as i128 as u64).collect::<Vec<_>>()
    );
    let halves = get::<f16>(&compute::cast(&x, DType::F16).unwrap());
    for (h, &v) in halves.iter().zip(&data) {
        let want = f16::from_f32(v);
        assert!(
            h.to_bits() == want.to_bits() || (h.is_nan() && want.is_nan()),
            "{v}"
        );
    }
    let brains = get::<bf16>(&compute::cast(&x, DType::BF16).unwrap());
    for (b, &v) in brains.iter().zip(&data) {
        let want = bf16::from_f32(v);
        assert!(
            b.to_bits() == want.to_bits() || (b.is_nan() && want.is_nan()),
            "{v}"
        );
    }
    // To bool: non-zero (NaN included) is true. Read back as bytes.
    let flags = compute::cast(&x, DType::BOOL).unwrap();
    let host = flags.copy_to(Device::CPU).unwrap();
    let bytes = host.cast(DType::U8).unwrap().to_vec::<u8>().unwrap();
    assert_eq!(
        bytes,
        data.iter().map(|&v| u8::from(v != 0.0)).collect::<Vec<_>>()
    );
    // Integers to floats and to narrower integers (wrapping).
    let longs = [i64::MIN, -1, 0, 1 << 40, i64::MAX];
    let l = up(device, &longs, &[5]);
    let f = get::<f32>(&compute::cast(&l, DType::F32).unwrap());
    assert_eq!(f, longs.iter().map(|&v| v as f32).collect::<Vec<_>>());
    let u16s = get::<u16>(&compute::cast(&l, DType::U16).unwrap());
    assert_eq!(u16s, longs.iter().map(|&v| v as u16).collect::<Vec<_>>());
    // A strided source.
    let m = up(
        device,
        &(0..12).map(|i| i as u16).collect::<Vec<_>>(),
        &[3, 4],
    );
    let t = compute::cast(&m.transpose().unwrap(), DType::I64).unwrap();
    assert_eq!(get::<i64>(&t), vec![0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
}

fn reductions_of_hand_picked_data(dev: &Dev) {
    let device = dev.device;
    let (d0, d1, d2) = (4usize, 37, 50);
    let data = noise(d0 * d1 * d2, 5, 2.0);
    let x = up(device, &data, &[d0, d1, d2]);
    let at = |i: usize, j: usize, k: usize| data[(i * d1 + j) * d2 + k] as f64;
    // Every axis set, each reduction.
    let cases: Vec<(Option<Vec<isize>>, Vec<usize>)> = vec![
        (None, vec![]),
        (Some(vec![0]), vec![d1, d2]),
        (Some(vec![1]), vec![d0, d2]),
        (Some(vec![-1]), vec![d0, d1]),
        (Some(vec![0, 2]), vec![d1]),
    ];
    for op in ReduceOp::ALL {
        for (axes, out_shape) in &cases {
            let y = compute::reduce(op, &x, axes.as_deref(), false).unwrap();
            if op.is_arg() {
                // Composed of max / min, comparisons and a max over index keys; checked against
                // the CPU's kernel.
                let host = x.copy_to(Device::CPU).unwrap();
                let want = compute::reduce(op, &host, axes.as_deref(), false).unwrap();
                assert_eq!(y.shape(), want.shape(), "{op:?} {axes:?}");
                assert_eq!(
                    get::<i64>(&y),
                    want.to_vec::<i64>().unwrap(),
                    "{op:?} over {axes:?}"
                );
                continue;
            }
            assert_eq!(y.shape(), out_shape.as_slice(), "{op:?} {axes:?}");
            let reduced = |a: usize| match axes {
                None => true,
                Some(v) => v.iter().any(|&r| (r + 3) as usize % 3 == a),
            };
            let mut want = Vec::new();
            let ranges = |a: usize, n: usize| {
                if reduced(a) {
                    vec![None]
                } else {
                    (0..n).map(Some).collect()
                }
            };
            for oi in ranges(0, d0) {
                for oj in ranges(1, d1) {
                    for ok in ranges(2, d2) {
                        let mut vals = Vec::new();
                        for i in oi.map_or(0..d0, |i| i..i + 1) {
                            for j in oj.map_or(0..d1, |j| j..j + 1) {
                                for k in ok.map_or(0..d2, |k| k..k + 1) {
                                    vals.push(at(i, j, k));
                                }
                            }
                        }
                        want.push(match op {
                            ReduceOp::Sum => vals.iter().sum::<f64>() as f32,
                            ReduceOp::Mean => (vals.iter().sum::<f64>() / vals.len() as f64) as f32,
                            ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max) as f32,
                            ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min) as f32,
                            ReduceOp::Prod => vals.iter().product::<f64>() as f32,
                            ReduceOp::Var | ReduceOp::Std => {
                                let n = vals.len() as f64;
                                let mean = vals.iter().sum::<f64>() / n;
                                let var =
                                    vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
                                (if op == ReduceOp::Var { var } else { var.sqrt() }) as f32
                            }
                            ReduceOp::ArgMax | ReduceOp::ArgMin => unreachable!("checked above"),
                        });
                    }
                }
            }
            assert_close_f32(
                &get::<f32>(&y),
                &want,
                1e-4,
                &format!("{op:?} over {axes:?}"),
            );
        }
    }
    // keepdims, and a strided input.
    let k = compute::reduce(ReduceOp::Sum, &x, Some(&[1]), true).unwrap();
    assert_eq!(k.shape(), &[d0, 1, d2]);
    let xt = x.transpose().unwrap(); // [d2, d1, d0]
    let y = compute::reduce(ReduceOp::Max, &xt, Some(&[0]), false).unwrap();
    let mut want = Vec::new();
    for j in 0..d1 {
        for i in 0..d0 {
            want.push((0..d2).map(|k| at(i, j, k)).fold(f64::MIN, f64::max) as f32);
        }
    }
    assert_close_f32(&get::<f32>(&y), &want, 0.0, "max over a transposed view");

    // A long reduction: split over threadgroups, then combined.
    let n = 3_000_017;
    let long: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32) * 0.001).collect();
    let xl = up(device, &long, &[n]);
    let want: f64 = long.iter().map(|&v| v as f64).sum();
    let got = get::<f32>(&compute::reduce(ReduceOp::Sum, &xl, None, false).unwrap())[0];
    assert!(close(got, want as f32, 1e-4), "{got} vs {want}");
    let got = get::<f32>(&compute::reduce(ReduceOp::Mean, &xl, None, false).unwrap())[0];
    assert!(close(got, (want / n as f64) as f32, 1e-4), "{got}");
    let got = get::<f32>(&compute::reduce(ReduceOp::Max, &xl, None, false).unwrap())[0];
    assert_eq!(got, long.iter().cloned().fold(f32::MIN, f32::max));

    // NaN propagates through max and min; empty sums are 0 and empty means NaN.
    let mut with_nan = noise(5000, 6, 1.0);
    with_nan[4321] = f32::NAN;
    let xn = up(device, &with_nan, &[5000]);
    for op in [ReduceOp::Max, ReduceOp::Min] {
        let got = get::<f32>(&compute::reduce(op, &xn, None, false).unwrap())[0];
        assert!(got.is_nan(), "{op:?} of data with a NaN is {got}");
    }
    let empty = up(device, &[0.0f32; 0], &[0, 3]);
    assert_eq!(
        get::<f32>(&compute::reduce(ReduceOp::Sum, &empty, Some(&[0]), false).unwrap()),
        vec![0.0; 3]
    );
    let means = get::<f32>(&compute::reduce(ReduceOp::Mean, &empty, Some(&[0]), false).unwrap());
    assert!(means.iter().all(|m| m.is_nan()), "{means:?}");

    // Integer sums accumulate in 64 bits (wrapping); max/min keep the dtype.
    let ints: Vec<i32> = (0..10_000).map(|i| i * 200_000 - 7).collect();
    let xi = up(device, &ints, &[100, 100]);
    let sums = get::<i64>(&compute::reduce(ReduceOp::Sum, &xi, Some(&[1]), false).unwrap());
    let want: Vec<i64> = ints
        .chunks(100)
        .map(|c| c.iter().map(|&v| v as i64).sum())
        .collect();
    assert_eq!(sums, want);
    let bytes: Vec<u8> = (0..1000).map(|i| (i * 37 % 251) as u8).collect();
    let xb = up(device, &bytes, &[1000]);
    let total = get::<u64>(&compute::reduce(ReduceOp::Sum, &xb, None, false).unwrap());
    assert_eq!(total, vec![bytes.iter().map(|&b| b as u64).sum::<u64>()]);
    let mn = get::<u8>(&compute::reduce(ReduceOp::Min, &xb, None, false).unwrap());
    assert_eq!(mn, vec![*bytes.iter().min().unwrap()]);
    let longs: Vec<i64> = vec![i64::MIN + 5, 3, i64::MAX - 1, -9];
    let xl = up(device, &longs, &[4]);
    assert_eq!(
        get::<i64>(&compute::reduce(ReduceOp::Max, &xl, None, false).unwrap()),
        vec![i64::MAX - 1]
    );
    // float16 sums accumulate in float32.
    let halves: Vec<f16> = (0..4096).map(|_| f16::from_f32(0.5)).collect();
    let xh = up(device, &halves, &[4096]);
    let sum = get::<f16>(&compute::reduce(ReduceOp::Sum, &xh, None, false).unwrap());
    assert_eq!(sum[0].to_f32(), 2048.0);
}

fn matmul_of_batches_vectors_and_float16(dev: &Dev) {
    let device = dev.device;
    let (batch, m, k, n) = (2usize, 67, 45, 130);
    let a_data = noise(batch * m * k, 7, 1.0);
    let b_data = noise(k * n, 8, 1.0);
    let a = up(device, &a_data, &[batch, m, k]);
    let b = up(device, &b_data, &[k, n]);
    let want = matmul_f32(&a_data, &b_data, batch, m, k, n);
    let y = compute::matmul(&a, &b).unwrap();
    assert_eq!(y.shape(), &[batch, m, n]);
    assert_close_f32(&get::<f32>(&y), &want, 1e-4, "batched matmul");
    // A transposed right operand (column-major), from data laid out [n, k].
    let mut bt_data = vec![0.0f32; k * n];
    for p in 0..k {
        for j in 0..n {
            bt_data[j * k + p] = b_data[p * n + j];
        }
    }
    let bt = up(device, &bt_data, &[n, k]).transpose().unwrap();
    assert_close_f32(
        &get::<f32>(&compute::matmul(&a, &bt).unwrap()),
        &want,
        1e-4,
        "matmul with a column-major operand",
    );
    // Vectors: (k,) @ (k, n) → (n,); (m, k) @ (k,) → (m,).
    let v = up(device, &b_data[..k], &[k]);
    let row = compute::matmul(&v, &b).unwrap();
    assert_eq!(row.shape(), &[n]);
    assert_close_f32(
        &get::<f32>(&row),
        &matmul_f32(&b_data[..k], &b_data, 1, 1, k, n),
        1e-4,
        "vector @ matrix",
    );
    let a0 = a.index(0, 0).unwrap();
    let col = compute::matmul(&a0, &v).unwrap();
    assert_eq!(col.shape(), &[m]);
    assert_close_f32(
        &get::<f32>(&col),
        &matmul_f32(&a_data[..m * k], &b_data[..k], 1, m, k, 1),
        1e-4,
        "matrix @ vector",
    );
    // float16 operands compute in float and round once; k = 0 gives zeros.
    let ah: Vec<f16> = a_data[..m * k].iter().map(|&v| f16::from_f32(v)).collect();
    let bh: Vec<f16> = b_data.iter().map(|&v| f16::from_f32(v)).collect();
    let yh = compute::matmul(&up(device, &ah, &[m, k]), &up(device, &bh, &[k, n])).unwrap();
    let a32: Vec<f32> = ah.iter().map(|v| v.to_f32()).collect();
    let b32: Vec<f32> = bh.iter().map(|v| v.to_f32()).collect();
    let got: Vec<f32> = get::<f16>(&yh).iter().map(|v| v.to_f32()).collect();
    assert_close_f32(
        &got,
        &matmul_f32(&a32, &b32, 1, m, k, n),
        2e-3,
        "float16 matmul",
    );
    let e1 = up(device, &[0.0f32; 0], &[3, 0]);
    let e2 = up(device, &[0.0f32; 0], &[0, 4]);
    assert_eq!(
        get::<f32>(&compute::matmul(&e1, &e2).unwrap()),
        vec![0.0; 12]
    );
}

fn numpy_habits_match_the_cpu(dev: &Dev) {
    use dlbridge::compute::index;
    let device = dev.device;
    let mut data = noise(600, 11, 6.0);
    data[7] = f32::NAN;
    data[8] = f32::INFINITY;
    data[9] = 0.0;
    data[10] = data[11]; // ties
    let divisors = noise(600, 12, 4.0);
    let ints: Vec<i32> = data
        .iter()
        .map(|&v| if v.is_finite() { (v * 20.0) as i32 } else { 0 })
        .collect();
    let x = |d: Device| Tensor::from_slice(&data, &[6, 100]).unwrap().copy_to(d);
    let y = |d: Device| Tensor::from_slice(&divisors, &[6, 100]).unwrap().copy_to(d);
    let i = |d: Device| Tensor::from_slice(&ints, &[6, 100]).unwrap().copy_to(d);
    let small = |d: Device| {
        let e: Vec<i32> = (0..600).map(|k| k % 9).collect();
        Tensor::from_slice(&e, &[6, 100]).unwrap().copy_to(d)
    };
    for op in [BinaryOp::FloorDiv, BinaryOp::Mod, BinaryOp::Pow] {
        agrees(op.name(), dev, |d| compute::binary(op, &x(d)?, &y(d)?));
        agrees(&format!("{} of int32", op.name()), dev, |d| {
            let b = if op == BinaryOp::Pow {
                small(d)?
            } else {
                i(d)?.transpose()?.transpose()?
            };
            compute::binary(op, &i(d)?, &b)
        });
        agrees(&format!("{} by 3", op.name()), dev, |d| {
            compute::binary_scalar(op, &i(d)?, Scalar::Int(3), false)
        });
    }
    let err = compute::binary_scalar(BinaryOp::Pow, &i(device).unwrap(), Scalar::Int(-1), false)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    for axes in [None, Some(&[0isize][..]), Some(&[-1][..])] {
        for keepdims in [false, true] {
            let what = |name: &str| format!("{name} over {axes:?}");
            for op in [ReduceOp::ArgMax, ReduceOp::ArgMin] {
                agrees(&what(op.name()), dev, |d| {
                    compute::reduce(op, &x(d)?, axes, keepdims)
                });
                agrees(&what(op.name()), dev, |d| {
                    compute::reduce(op, &x(d)?.transpose()?, axes, keepdims)
                });
            }
            agrees(&what("all"), dev, |d| compute::all(&x(d)?, axes, keepdims));
            agrees(&what("any"), dev, |d| compute::any(&i(d)?, axes, keepdims));
            agrees_within(&what("var"), dev, 16.0, |d| {
                compute::var(&y(d)?, axes, 1.0, keepdims)
            });
            agrees_within(&what("std"), dev, 16.0, |d| {
                compute::std(&y(d)?, axes, 0.0, keepdims)
            });
            agrees(&what("prod"), dev, |d| {
                compute::reduce(ReduceOp::Prod, &small(d)?, axes, keepdims)
            });
        }
    }
    agrees("isnan", dev, |d| compute::isnan(&x(d)?));
    agrees("isfinite", dev, |d| compute::isfinite(&x(d)?));
    // Advanced indexing of a Metal view (staged through the host).
    let idx = |d: Device| Tensor::from_slice(&[5i64, -1, 0], &[3]).unwrap().copy_to(d);
    agrees("take", dev, |d| {
        index::take(&x(d)?.transpose()?, &[0], &[idx(d)?], false)
    });
    agrees("put", dev, |d| {
        let t = x(d)?;
        let value = Tensor::from_slice(&[-2.0f32], &[]).unwrap().copy_to(d)?;
        // SAFETY: `t` is this closure's own; nothing else references it.
        unsafe { index::put(&t, &[1], &[idx(d)?], false, &value)? };
        Ok(t)
    });
}
