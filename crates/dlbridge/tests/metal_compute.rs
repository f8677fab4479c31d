//! The built-in kernels and run-time MSL kernels against a real Metal GPU, checked against CPU
//! references computed here. Compiled only for Apple targets with feature `metal`
//! (`cargo test -p dlbridge --features metal` on a Mac); every GPU test is
//! `#[ignore = "needs a Metal device"]`, so run them with `-- --include-ignored` (as
//! `scripts/test.sh` does on macOS).

#![cfg(all(target_vendor = "apple", feature = "metal"))]

use std::sync::{Mutex, MutexGuard};

use dlbridge::backend::metal;
use dlbridge::compute::kernel::{self, KernelArg, LaunchConfig};
use dlbridge::compute::{self, BinaryOp, CompareOp, ReduceOp, Scalar, UnaryOp};
use dlbridge::{DType, Device, Element, Error, SliceArg, StorageMode, Tensor};
use half::{bf16, f16};

/// The first Metal device (panics where there is none: an ignored test asked to run without a
/// device fails rather than passing); GPU tests run one at a time.
fn gpu() -> (Device, MutexGuard<'static, ()>) {
    static SERIAL: Mutex<()> = Mutex::new(());
    assert!(
        metal::is_available(),
        "this test needs a Metal device, and this machine has none"
    );
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    (Device::metal(0), guard)
}

/// A Metal tensor holding `data` in `shape` (in `storage`, default when `None`).
fn upload<T: Element>(
    device: Device,
    data: &[T],
    shape: &[usize],
    storage: Option<StorageMode>,
) -> Tensor {
    let host = Tensor::from_slice(data, shape).unwrap();
    metal::copy_to(&host, device, storage).unwrap()
}

/// The elements of any Metal view, read back through the host (which waits for the GPU).
fn read<T: Element>(t: &Tensor) -> Vec<T> {
    assert_eq!(t.device().kind(), dlbridge::DeviceKind::Metal);
    metal::copy_to(t, Device::CPU, None)
        .unwrap()
        .as_slice::<T>()
        .unwrap()
        .to_vec()
}

/// Deterministic pseudo-random floats in [-scale, scale).
fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
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

/// Whether `got` is `want` within a relative tolerance (NaN matches NaN).
fn close(got: f32, want: f32, rel: f32) -> bool {
    if want.is_nan() {
        return got.is_nan();
    }
    if want.is_infinite() {
        return got == want;
    }
    (got - want).abs() <= rel * want.abs().max(1.0)
}

fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(close(g, w, rel), "{what}: element {i} is {g}, expected {w}");
    }
}

fn unary_ref(op: UnaryOp, x: f32) -> f32 {
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

/// NumPy's `divmod` of floats (`npy_divmod`), in `float`.
fn numpy_divmod(a: f32, b: f32) -> (f32, f32) {
    let m = a % b;
    if b == 0.0 {
        return (a / b, m);
    }
    let (mut m, mut div) = (m, (a - m) / b);
    if m != 0.0 {
        if (b < 0.0) != (m < 0.0) {
            m += b;
            div -= 1.0;
        }
    } else {
        m = 0.0f32.copysign(b);
    }
    let q = if div != 0.0 {
        let f = div.floor();
        if div - f > 0.5 { f + 1.0 } else { f }
    } else {
        0.0f32.copysign(a / b)
    };
    (q, m)
}

fn binary_ref(op: BinaryOp, a: f32, b: f32) -> f32 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::FloorDiv => numpy_divmod(a, b).0,
        BinaryOp::Mod => numpy_divmod(a, b).1,
        BinaryOp::Pow => a.powf(b),
    }
}

#[test]
#[ignore = "needs a Metal device"]
fn unary_ops_match_the_cpu() {
    let (device, _serial) = gpu();
    let mut data = noise(1000, 1, 4.0);
    data.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    let n = data.len();
    let x = upload(device, &data, &[n], None);
    for op in UnaryOp::ALL {
        let y = compute::unary(op, &x).unwrap();
        assert_eq!(y.dtype(), DType::F32);
        let want: Vec<f32> = data.iter().map(|&v| unary_ref(op, v)).collect();
        assert_close(&read::<f32>(&y), &want, 1e-5, op.name());
    }
    // 16-bit floats compute in float and round once.
    let halves: Vec<f16> = data.iter().map(|&v| f16::from_f32(v)).collect();
    let brains: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
    let xh = upload(device, &halves, &[n], None);
    let xb = upload(device, &brains, &[n], None);
    for op in [
        UnaryOp::Exp,
        UnaryOp::Sqrt,
        UnaryOp::Square,
        UnaryOp::Negative,
    ] {
        let want: Vec<f32> = halves
            .iter()
            .map(|v| f16::from_f32(unary_ref(op, v.to_f32())).to_f32())
            .collect();
        let got: Vec<f32> = read::<f16>(&compute::unary(op, &xh).unwrap())
            .iter()
            .map(|v| v.to_f32())
            .collect();
        assert_close(&got, &want, 1e-3, op.name());
        let want: Vec<f32> = brains
            .iter()
            .map(|v| bf16::from_f32(unary_ref(op, v.to_f32())).to_f32())
            .collect();
        let got: Vec<f32> = read::<bf16>(&compute::unary(op, &xb).unwrap())
            .iter()
            .map(|v| v.to_f32())
            .collect();
        assert_close(&got, &want, 8e-3, op.name());
    }
    // Integers wrap as NumPy's do.
    let ints: Vec<i8> = vec![-128, -5, 0, 7, 127, 16];
    let xi = upload(device, &ints, &[6], None);
    let abs = read::<i8>(&compute::unary(UnaryOp::Abs, &xi).unwrap());
    assert_eq!(
        abs,
        ints.iter().map(|v| v.wrapping_abs()).collect::<Vec<_>>()
    );
    let neg = read::<i8>(&compute::unary(UnaryOp::Negative, &xi).unwrap());
    assert_eq!(
        neg,
        ints.iter().map(|v| v.wrapping_neg()).collect::<Vec<_>>()
    );
    let sq = read::<i8>(&compute::unary(UnaryOp::Square, &xi).unwrap());
    assert_eq!(
        sq,
        ints.iter().map(|v| v.wrapping_mul(*v)).collect::<Vec<_>>()
    );
    let bytes: Vec<u8> = vec![0, 1, 200, 255];
    let xu = upload(device, &bytes, &[4], None);
    let neg = read::<u8>(&compute::unary(UnaryOp::Negative, &xu).unwrap());
    assert_eq!(neg, vec![0, 255, 56, 1]);
    // sqrt of uint8 is float16 (NumPy's rule).
    let root = compute::unary(UnaryOp::Sqrt, &xu).unwrap();
    assert_eq!(root.dtype(), DType::F16);
    let got: Vec<f32> = read::<f16>(&root).iter().map(|v| v.to_f32()).collect();
    let want: Vec<f32> = bytes
        .iter()
        .map(|&b| f16::from_f32((b as f32).sqrt()).to_f32())
        .collect();
    assert_close(&got, &want, 1e-3, "sqrt(uint8)");
}

#[test]
#[ignore = "needs a Metal device"]
fn binary_ops_broadcast_and_take_scalars() {
    let (device, _serial) = gpu();
    let (a_data, b_data) = (noise(12, 2, 3.0), noise(20, 3, 3.0));
    let a = upload(device, &a_data, &[3, 1, 4], None);
    let b = upload(device, &b_data, &[5, 4], None);
    for op in BinaryOp::ALL {
        let y = compute::binary(op, &a, &b).unwrap();
        assert_eq!(y.shape(), &[3, 5, 4]);
        let mut want = Vec::new();
        for i in 0..3 {
            for j in 0..5 {
                for k in 0..4 {
                    want.push(binary_ref(op, a_data[i * 4 + k], b_data[j * 4 + k]));
                }
            }
        }
        assert_close(&read::<f32>(&y), &want, 1e-6, op.name());
        // Scalars on either side.
        let s = 1.75;
        let right = compute::binary_scalar(op, &b, Scalar::Float(s), false).unwrap();
        let left = compute::binary_scalar(op, &b, Scalar::Float(s), true).unwrap();
        let want_r: Vec<f32> = b_data
            .iter()
            .map(|&v| binary_ref(op, v, s as f32))
            .collect();
        let want_l: Vec<f32> = b_data
            .iter()
            .map(|&v| binary_ref(op, s as f32, v))
            .collect();
        assert_close(&read::<f32>(&right), &want_r, 1e-6, op.name());
        assert_close(&read::<f32>(&left), &want_l, 1e-6, op.name());
    }
    // Integer arithmetic wraps; weak integer scalars keep the array's type and wrap into it.
    let big = upload(device, &[i32::MAX, i32::MIN, -7, 1 << 20], &[4], None);
    let one = upload(device, &[1i32, 1, 3, 1 << 12], &[4], None);
    assert_eq!(
        read::<i32>(&compute::binary(BinaryOp::Add, &big, &one).unwrap()),
        vec![i32::MIN, i32::MIN + 1, -4, (1 << 20) + (1 << 12)]
    );
    assert_eq!(
        read::<i32>(&compute::binary(BinaryOp::Mul, &big, &one).unwrap()),
        vec![i32::MAX, i32::MIN, -21, 0]
    );
    let bytes = upload(device, &[0u8, 10, 250], &[3], None);
    assert_eq!(
        read::<u8>(
            &compute::binary_scalar(BinaryOp::Add, &bytes, Scalar::Int(300), false).unwrap()
        ),
        vec![44, 54, 38]
    );
    assert_eq!(
        read::<u8>(&compute::binary_scalar(BinaryOp::Sub, &bytes, Scalar::Int(1), true).unwrap()),
        vec![1, 247, 7]
    );
    // Mixed dtypes promote: int16 + uint8 → int16; float16 + float32 → float32.
    let shorts = upload(device, &[-300i16, 5, 1000], &[3], None);
    let y = compute::binary(BinaryOp::Sub, &shorts, &bytes).unwrap();
    assert_eq!(y.dtype(), DType::I16);
    assert_eq!(read::<i16>(&y), vec![-300, -5, 750]);
    let halves = upload(
        device,
        &[f16::from_f32(0.5), f16::from_f32(-2.0)],
        &[2],
        None,
    );
    let floats = upload(device, &[0.25f32, 8.0], &[2], None);
    let y = compute::binary(BinaryOp::Mul, &halves, &floats).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    assert_eq!(read::<f32>(&y), vec![0.125, -16.0]);
}

/// The elements of a `bool` Metal array.
fn read_bools(t: &Tensor) -> Vec<bool> {
    assert_eq!(t.dtype(), DType::BOOL);
    let host = metal::copy_to(t, Device::CPU, None).unwrap();
    let bytes = host.cast(DType::U8).unwrap().to_vec::<u8>().unwrap();
    bytes.into_iter().map(|b| b != 0).collect()
}

#[test]
#[ignore = "needs a Metal device"]
fn comparisons_give_bool_with_nan_scalars_and_broadcasting() {
    let (device, _serial) = gpu();
    let mut a_data = noise(12, 5, 3.0);
    let mut b_data = noise(20, 6, 3.0);
    a_data[1] = f32::NAN;
    b_data[2] = f32::NAN;
    b_data[4] = a_data[0];
    let a = upload(device, &a_data, &[3, 1, 4], None);
    let b = upload(device, &b_data, &[5, 4], None);
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
        assert_eq!(read_bools(&y), want, "{}", op.name());
        // Scalars on either side; NaN compares false but for `!=`.
        let s = 0.5f32;
        let right = compute::compare_scalar(op, &b, Scalar::Float(s.into()), false).unwrap();
        let left = compute::compare_scalar(op, &b, Scalar::Float(s.into()), true).unwrap();
        let want_r: Vec<bool> = b_data.iter().map(|&v| op.holds(v, s)).collect();
        let want_l: Vec<bool> = b_data.iter().map(|&v| op.holds(s, v)).collect();
        assert_eq!(read_bools(&right), want_r, "{}", op.name());
        assert_eq!(read_bools(&left), want_l, "{}", op.name());
    }
    // Every Metal dtype: integers exactly, bfloat16 and float16 through float, bool as bytes.
    let ints = upload(device, &[-5i64, 0, 7, i64::MAX], &[4], None);
    let y = compute::compare_scalar(CompareOp::Ge, &ints, Scalar::Int(7), false).unwrap();
    assert_eq!(read_bools(&y), [false, false, true, true]);
    let bytes = upload(device, &[0u8, 10, 250], &[3], None);
    let y = compute::compare_scalar(CompareOp::Lt, &bytes, Scalar::Int(300), false).unwrap();
    assert_eq!(read_bools(&y), [true; 3]);
    let y = compute::compare_scalar(CompareOp::Eq, &bytes, Scalar::Int(10), true).unwrap();
    assert_eq!(read_bools(&y), [false, true, false]);
    let shorts = upload(device, &[-300i16, 5, 1000], &[3], None);
    let y = compute::compare(CompareOp::Gt, &shorts, &bytes).unwrap();
    assert_eq!(read_bools(&y), [false, false, true]);
    let halves = upload(device, &[f16::from_f32(0.5), f16::NAN], &[2], None);
    let brains = upload(
        device,
        &[bf16::from_f32(0.5), bf16::from_f32(1.0)],
        &[2],
        None,
    );
    let y = compute::compare(CompareOp::Eq, &halves, &brains).unwrap();
    assert_eq!(read_bools(&y), [true, false]);
    let y = compute::compare(CompareOp::Ne, &halves, &halves).unwrap();
    assert_eq!(read_bools(&y), [false, true]);
    let mask = compute::compare_scalar(CompareOp::Gt, &bytes, Scalar::Int(5), false).unwrap();
    let y = compute::compare(CompareOp::Eq, &mask, &mask).unwrap();
    assert_eq!(read_bools(&y), [true; 3]);
    let y = compute::compare_scalar(CompareOp::Lt, &mask, Scalar::Int(1), false).unwrap();
    assert_eq!(read_bools(&y), [true, false, false]);
}

#[test]
#[ignore = "needs a Metal device"]
fn strided_views_and_storage_modes() {
    let (device, _serial) = gpu();
    let data = noise(6 * 7 * 5, 4, 10.0);
    let mut modes = vec![StorageMode::Shared, StorageMode::Private];
    if metal::storage::MANAGED_AVAILABLE {
        modes.push(StorageMode::Managed);
    }
    for mode in modes {
        let base = upload(device, &data, &[6, 7, 5], Some(mode));
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
            assert_close(&read::<f32>(&y), &want, 1e-6, "square of a view");
            let z = compute::binary(BinaryOp::Sub, v, &y).unwrap();
            let want: Vec<f32> = elems.iter().map(|x| x - x * x).collect();
            assert_close(&read::<f32>(&z), &want, 1e-5, "view minus compact");
        }
    }
    // Ten axes that do not merge: the input is made compact first.
    let shape = [2usize; 10];
    let n = 1 << 10;
    let data: Vec<i32> = (0..n as i32).collect();
    let x = upload(device, &data, &shape, None);
    let axes: Vec<usize> = (0..10).rev().collect();
    let xt = x.permute(&axes).unwrap();
    let y = compute::binary_scalar(BinaryOp::Add, &xt, Scalar::Int(1), false).unwrap();
    let want: Vec<i32> = (0..n)
        .map(|i| data[strided_index(i, xt.shape(), xt.strides(), 0)] + 1)
        .collect();
    assert_eq!(read::<i32>(&y), want);
}

#[test]
#[ignore = "needs a Metal device"]
fn casts_follow_astype() {
    let (device, _serial) = gpu();
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
    let x = upload(device, &data, &[data.len()], None);
    let i8s = read::<i8>(&compute::cast(&x, DType::I8).unwrap());
    assert_eq!(
        i8s,
        data.iter().map(|&v| v as i128 as i8).collect::<Vec<_>>()
    );
    let u8s = read::<u8>(&compute::cast(&x, DType::U8).unwrap());
    assert_eq!(
        u8s,
        data.iter().map(|&v| v as i128 as u8).collect::<Vec<_>>()
    );
    let i32s = read::<i32>(&compute::cast(&x, DType::I32).unwrap());
    assert_eq!(
        i32s,
        data.iter().map(|&v| v as i128 as i32).collect::<Vec<_>>()
    );
    let u64s = read::<u64>(&compute::cast(&x, DType::U64).unwrap());
    assert_eq!(
        u64s,
        data.iter().map(|&v| v as i128 as u64).collect::<Vec<_>>()
    );
    let halves = read::<f16>(&compute::cast(&x, DType::F16).unwrap());
    for (h, &v) in halves.iter().zip(&data) {
        let want = f16::from_f32(v);
        assert!(
            h.to_bits() == want.to_bits() || (h.is_nan() && want.is_nan()),
            "{v}"
        );
    }
    let brains = read::<bf16>(&compute::cast(&x, DType::BF16).unwrap());
    for (b, &v) in brains.iter().zip(&data) {
        let want = bf16::from_f32(v);
        assert!(
            b.to_bits() == want.to_bits() || (b.is_nan() && want.is_nan()),
            "{v}"
        );
    }
    // To bool: non-zero (NaN included) is true. Read back as bytes.
    let flags = compute::cast(&x, DType::BOOL).unwrap();
    let host = metal::copy_to(&flags, Device::CPU, None).unwrap();
    let bytes = host.cast(DType::U8).unwrap().to_vec::<u8>().unwrap();
    assert_eq!(
        bytes,
        data.iter().map(|&v| u8::from(v != 0.0)).collect::<Vec<_>>()
    );
    // Integers to floats and to narrower integers (wrapping).
    let longs = [i64::MIN, -1, 0, 1 << 40, i64::MAX];
    let l = upload(device, &longs, &[5], None);
    let f = read::<f32>(&compute::cast(&l, DType::F32).unwrap());
    assert_eq!(f, longs.iter().map(|&v| v as f32).collect::<Vec<_>>());
    let u16s = read::<u16>(&compute::cast(&l, DType::U16).unwrap());
    assert_eq!(u16s, longs.iter().map(|&v| v as u16).collect::<Vec<_>>());
    // A strided source.
    let m = upload(
        device,
        &(0..12).map(|i| i as u16).collect::<Vec<_>>(),
        &[3, 4],
        None,
    );
    let t = compute::cast(&m.transpose().unwrap(), DType::I64).unwrap();
    assert_eq!(read::<i64>(&t), vec![0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
}

#[test]
#[ignore = "needs a Metal device"]
fn reductions_match_the_cpu() {
    let (device, _serial) = gpu();
    let (d0, d1, d2) = (4usize, 37, 50);
    let data = noise(d0 * d1 * d2, 5, 2.0);
    let x = upload(device, &data, &[d0, d1, d2], None);
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
                let host = metal::copy_to(&x, Device::CPU, None).unwrap();
                let want = compute::reduce(op, &host, axes.as_deref(), false).unwrap();
                assert_eq!(y.shape(), want.shape(), "{op:?} {axes:?}");
                assert_eq!(
                    read::<i64>(&y),
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
            assert_close(
                &read::<f32>(&y),
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
    assert_close(&read::<f32>(&y), &want, 0.0, "max over a transposed view");

    // A long reduction: split over threadgroups, then combined.
    let n = 3_000_017;
    let long: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32) * 0.001).collect();
    let xl = upload(device, &long, &[n], None);
    let want: f64 = long.iter().map(|&v| v as f64).sum();
    let got = read::<f32>(&compute::reduce(ReduceOp::Sum, &xl, None, false).unwrap())[0];
    assert!(close(got, want as f32, 1e-4), "{got} vs {want}");
    let got = read::<f32>(&compute::reduce(ReduceOp::Mean, &xl, None, false).unwrap())[0];
    assert!(close(got, (want / n as f64) as f32, 1e-4), "{got}");
    let got = read::<f32>(&compute::reduce(ReduceOp::Max, &xl, None, false).unwrap())[0];
    assert_eq!(got, long.iter().cloned().fold(f32::MIN, f32::max));

    // NaN propagates through max and min; empty sums are 0 and empty means NaN.
    let mut with_nan = noise(5000, 6, 1.0);
    with_nan[4321] = f32::NAN;
    let xn = upload(device, &with_nan, &[5000], None);
    for op in [ReduceOp::Max, ReduceOp::Min] {
        let got = read::<f32>(&compute::reduce(op, &xn, None, false).unwrap())[0];
        assert!(got.is_nan(), "{op:?} of data with a NaN is {got}");
    }
    let empty = upload(device, &[0.0f32; 0], &[0, 3], None);
    assert_eq!(
        read::<f32>(&compute::reduce(ReduceOp::Sum, &empty, Some(&[0]), false).unwrap()),
        vec![0.0; 3]
    );
    let means = read::<f32>(&compute::reduce(ReduceOp::Mean, &empty, Some(&[0]), false).unwrap());
    assert!(means.iter().all(|m| m.is_nan()), "{means:?}");

    // Integer sums accumulate in 64 bits (wrapping); max/min keep the dtype.
    let ints: Vec<i32> = (0..10_000).map(|i| i * 200_000 - 7).collect();
    let xi = upload(device, &ints, &[100, 100], None);
    let sums = read::<i64>(&compute::reduce(ReduceOp::Sum, &xi, Some(&[1]), false).unwrap());
    let want: Vec<i64> = ints
        .chunks(100)
        .map(|c| c.iter().map(|&v| v as i64).sum())
        .collect();
    assert_eq!(sums, want);
    let bytes: Vec<u8> = (0..1000).map(|i| (i * 37 % 251) as u8).collect();
    let xb = upload(device, &bytes, &[1000], None);
    let total = read::<u64>(&compute::reduce(ReduceOp::Sum, &xb, None, false).unwrap());
    assert_eq!(total, vec![bytes.iter().map(|&b| b as u64).sum::<u64>()]);
    let mn = read::<u8>(&compute::reduce(ReduceOp::Min, &xb, None, false).unwrap());
    assert_eq!(mn, vec![*bytes.iter().min().unwrap()]);
    let longs: Vec<i64> = vec![i64::MIN + 5, 3, i64::MAX - 1, -9];
    let xl = upload(device, &longs, &[4], None);
    assert_eq!(
        read::<i64>(&compute::reduce(ReduceOp::Max, &xl, None, false).unwrap()),
        vec![i64::MAX - 1]
    );
    // float16 sums accumulate in float32.
    let halves: Vec<f16> = (0..4096).map(|_| f16::from_f32(0.5)).collect();
    let xh = upload(device, &halves, &[4096], None);
    let sum = read::<f16>(&compute::reduce(ReduceOp::Sum, &xh, None, false).unwrap());
    assert_eq!(sum[0].to_f32(), 2048.0);
}

/// `a @ b` for row-major `[batch?, m, k]` and `[k, n]` data, in f64.
fn matmul_ref(a: &[f32], b: &[f32], batch: usize, m: usize, k: usize, n: usize) -> Vec<f32> {
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

#[test]
#[ignore = "needs a Metal device"]
fn matmul_matches_the_cpu() {
    let (device, _serial) = gpu();
    let (batch, m, k, n) = (2usize, 67, 45, 130);
    let a_data = noise(batch * m * k, 7, 1.0);
    let b_data = noise(k * n, 8, 1.0);
    let a = upload(device, &a_data, &[batch, m, k], None);
    let b = upload(device, &b_data, &[k, n], None);
    let want = matmul_ref(&a_data, &b_data, batch, m, k, n);
    let y = compute::matmul(&a, &b).unwrap();
    assert_eq!(y.shape(), &[batch, m, n]);
    assert_close(&read::<f32>(&y), &want, 1e-4, "batched matmul");
    // A transposed right operand (column-major), from data laid out [n, k].
    let mut bt_data = vec![0.0f32; k * n];
    for p in 0..k {
        for j in 0..n {
            bt_data[j * k + p] = b_data[p * n + j];
        }
    }
    let bt = upload(device, &bt_data, &[n, k], None).transpose().unwrap();
    assert_close(
        &read::<f32>(&compute::matmul(&a, &bt).unwrap()),
        &want,
        1e-4,
        "matmul with a column-major operand",
    );
    // Vectors: (k,) @ (k, n) → (n,); (m, k) @ (k,) → (m,).
    let v = upload(device, &b_data[..k], &[k], None);
    let row = compute::matmul(&v, &b).unwrap();
    assert_eq!(row.shape(), &[n]);
    assert_close(
        &read::<f32>(&row),
        &matmul_ref(&b_data[..k], &b_data, 1, 1, k, n),
        1e-4,
        "vector @ matrix",
    );
    let a0 = a.index(0, 0).unwrap();
    let col = compute::matmul(&a0, &v).unwrap();
    assert_eq!(col.shape(), &[m]);
    assert_close(
        &read::<f32>(&col),
        &matmul_ref(&a_data[..m * k], &b_data[..k], 1, m, k, 1),
        1e-4,
        "matrix @ vector",
    );
    // float16 operands compute in float and round once; k = 0 gives zeros.
    let ah: Vec<f16> = a_data[..m * k].iter().map(|&v| f16::from_f32(v)).collect();
    let bh: Vec<f16> = b_data.iter().map(|&v| f16::from_f32(v)).collect();
    let yh = compute::matmul(
        &upload(device, &ah, &[m, k], None),
        &upload(device, &bh, &[k, n], None),
    )
    .unwrap();
    let a32: Vec<f32> = ah.iter().map(|v| v.to_f32()).collect();
    let b32: Vec<f32> = bh.iter().map(|v| v.to_f32()).collect();
    let got: Vec<f32> = read::<f16>(&yh).iter().map(|v| v.to_f32()).collect();
    assert_close(
        &got,
        &matmul_ref(&a32, &b32, 1, m, k, n),
        2e-3,
        "float16 matmul",
    );
    let e1 = upload(device, &[0.0f32; 0], &[3, 0], None);
    let e2 = upload(device, &[0.0f32; 0], &[0, 4], None);
    assert_eq!(
        read::<f32>(&compute::matmul(&e1, &e2).unwrap()),
        vec![0.0; 12]
    );
}

#[test]
#[ignore = "needs a Metal device"]
fn float64_is_refused() {
    let (device, _serial) = gpu();
    let x = upload(device, &[1.0f64, 2.0], &[2], None);
    for result in [
        compute::unary(UnaryOp::Exp, &x).map(|_| ()),
        compute::binary(BinaryOp::Add, &x, &x).map(|_| ()),
        compute::reduce(ReduceOp::Sum, &x, None, false).map(|_| ()),
        compute::matmul(&x.expand_dims(0).unwrap(), &x.expand_dims(1).unwrap()).map(|_| ()),
    ] {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::UnsupportedDType(_)), "{err}");
        assert!(err.to_string().contains("float64"), "{err}");
    }
    // Integer division and integer means produce float64 (NumPy's rules): refused too.
    let i = upload(device, &[4i32, 6], &[2], None);
    let err = compute::binary(BinaryOp::Div, &i, &i).unwrap_err();
    assert!(err.to_string().contains("float64"), "{err}");
    let err = compute::reduce(ReduceOp::Mean, &i, None, false).unwrap_err();
    assert!(err.to_string().contains("float64"), "{err}");
}

const VECTOR_ADD: &str = r#"
#include <metal_stdlib>
using namespace metal;

kernel void vector_add(device const float* a [[buffer(0)]],
                       device const float* b [[buffer(1)]],
                       device float* out [[buffer(2)]],
                       constant uint& n [[buffer(3)]],
                       constant float& scale [[buffer(4)]],
                       uint i [[thread_position_in_grid]]) {
    if (i < n) {
        out[i] = (a[i] + b[i]) * scale * SCALE2;
    }
}

// Reverses each threadgroup's block through threadgroup memory (index 0).
kernel void reverse_blocks(device float* x [[buffer(0)]],
                           threadgroup float* tmp [[threadgroup(0)]],
                           uint i [[thread_position_in_grid]],
                           uint t [[thread_position_in_threadgroup]],
                           uint size [[threads_per_threadgroup]]) {
    tmp[t] = x[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    x[i] = tmp[size - 1 - t];
}
"#;

#[test]
#[ignore = "needs a Metal device"]
fn user_kernels_compile_and_launch() {
    let (device, _serial) = gpu();
    let n = 1000usize;
    let (a_data, b_data) = (noise(n, 9, 1.0), noise(n, 10, 1.0));
    let a = upload(device, &a_data, &[n], None);
    let b = upload(device, &b_data, &[n], None);
    let out = Tensor::zeros(&[n], DType::F32, device).unwrap();
    let options = vec!["-DSCALE2=2.0f".to_string(), "-fno-fast-math".to_string()];
    let k = kernel::compile(device, VECTOR_ADD, "vector_add", &options).unwrap();
    assert_eq!(k.name(), "vector_add");
    assert_eq!(k.device(), device);
    // Cached: compiling again gives the same kernel at once.
    kernel::compile(device, VECTOR_ADD, "vector_add", &options).unwrap();
    let config = LaunchConfig {
        grid: [(n as u32).div_ceil(64), 1, 1],
        block: [64, 1, 1],
        shared_mem: 0,
    };
    let args = [
        KernelArg::Tensor(a.clone()),
        KernelArg::Tensor(b.clone()),
        KernelArg::Tensor(out.clone()),
        KernelArg::Int(n as i64),
        KernelArg::Float(0.5),
    ];
    let timing = kernel::launch(&k, config, &args).unwrap();
    assert!(
        timing.elapsed_ms >= 0.0 && timing.elapsed_ms < 10_000.0,
        "{timing:?}"
    );
    let want: Vec<f32> = a_data
        .iter()
        .zip(&b_data)
        .map(|(x, y)| (x + y) * 0.5 * 2.0)
        .collect();
    assert_close(&read::<f32>(&out), &want, 1e-6, "vector_add");
    // A view's byte offset is honoured: add the second halves into the first half of `out`.
    let half_a = a.slice(0, SliceArg::range(500, 1000)).unwrap();
    let half_b = b.slice(0, SliceArg::range(500, 1000)).unwrap();
    let args = [
        KernelArg::Tensor(half_a),
        KernelArg::Tensor(half_b),
        KernelArg::Tensor(out.clone()),
        KernelArg::Int(500),
        KernelArg::Float(1.0),
    ];
    kernel::launch(&k, config, &args).unwrap();
    let got = read::<f32>(&out);
    for i in 0..500 {
        let w = (a_data[500 + i] + b_data[500 + i]) * 2.0;
        assert!(close(got[i], w, 1e-6), "{i}: {} vs {w}", got[i]);
    }
    // Threadgroup memory at index 0.
    let data: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let x = upload(device, &data, &[256], None);
    let rev =
        kernel::compile(device, VECTOR_ADD, "reverse_blocks", &["-DSCALE2=1".into()]).unwrap();
    let config = LaunchConfig {
        grid: [4, 1, 1],
        block: [64, 1, 1],
        shared_mem: 64 * 4,
    };
    kernel::launch(&rev, config, &[KernelArg::Tensor(x.clone())]).unwrap();
    let want: Vec<f32> = (0..256)
        .map(|i| ((i / 64) * 64 + 63 - i % 64) as f32)
        .collect();
    assert_eq!(read::<f32>(&x), want);
    // Too many threads per threadgroup are refused before launching.
    let too_big = LaunchConfig {
        grid: [1, 1, 1],
        block: [4096, 1, 1],
        shared_mem: 0,
    };
    let err = kernel::launch(&rev, too_big, &[KernelArg::Tensor(x)]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
#[ignore = "needs a Metal device"]
fn compile_errors_carry_the_log() {
    let (device, _serial) = gpu();
    let broken = "#include <metal_stdlib>\nkernel void broken(device float* x [[buffer(0)]]) {\n    x[0] = undefined_name;\n}\n";
    match kernel::compile(device, broken, "broken", &[]).unwrap_err() {
        Error::Compile { backend, name, log } => {
            assert_eq!(backend, "Metal");
            assert_eq!(name, "broken");
            assert!(log.contains("undefined_name"), "{log}");
        }
        other => panic!("expected a compile error, got {other}"),
    }
    // Without the macro, the vector-add source does not compile either.
    assert!(matches!(
        kernel::compile(device, VECTOR_ADD, "vector_add", &[]),
        Err(Error::Compile { .. })
    ));
    let err =
        kernel::compile(device, VECTOR_ADD, "no_such_kernel", &["-DSCALE2=1".into()]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(
        err.to_string().contains("vector_add"),
        "lists the functions: {err}"
    );
    let err = kernel::compile(device, VECTOR_ADD, "vector_add", &["-O3".into()]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

/// The elements of a tensor on any device, as `f64` (bool as 0 / 1).
fn as_f64(t: &Tensor) -> Vec<f64> {
    let host = if t.device() == Device::CPU {
        t.clone()
    } else {
        metal::copy_to(t, Device::CPU, None).unwrap()
    };
    let host = if host.dtype() == DType::BOOL {
        host.cast(DType::U8).unwrap()
    } else {
        host
    };
    host.cast(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// `host` on `device` (itself for the CPU).
fn place(host: Tensor, device: Device) -> dlbridge::Result<Tensor> {
    if device == Device::CPU {
        Ok(host)
    } else {
        metal::copy_to(&host, device, None)
    }
}

/// `f` on the Metal device and on the CPU agree on the same inputs (floats within `rel`).
fn agrees(what: &str, device: Device, rel: f32, f: impl Fn(Device) -> dlbridge::Result<Tensor>) {
    let got = f(device).unwrap_or_else(|e| panic!("{what} on Metal: {e}"));
    let want = f(Device::CPU).unwrap_or_else(|e| panic!("{what} on the CPU: {e}"));
    assert_eq!(
        (got.shape(), got.dtype()),
        (want.shape(), want.dtype()),
        "{what}"
    );
    let (g, w) = (as_f64(&got), as_f64(&want));
    let g: Vec<f32> = g.iter().map(|&v| v as f32).collect();
    let w: Vec<f32> = w.iter().map(|&v| v as f32).collect();
    assert_close(&g, &w, rel, what);
}

#[test]
#[ignore = "needs a Metal device"]
fn numpy_habits_match_the_cpu() {
    use dlbridge::compute::index;
    let (device, _serial) = gpu();
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
    let x = |d: Device| place(Tensor::from_slice(&data, &[6, 100]).unwrap(), d);
    let y = |d: Device| place(Tensor::from_slice(&divisors, &[6, 100]).unwrap(), d);
    let i = |d: Device| place(Tensor::from_slice(&ints, &[6, 100]).unwrap(), d);
    let small = |d: Device| {
        let e: Vec<i32> = (0..600).map(|k| (k % 9) as i32).collect();
        place(Tensor::from_slice(&e, &[6, 100]).unwrap(), d)
    };
    for op in [BinaryOp::FloorDiv, BinaryOp::Mod, BinaryOp::Pow] {
        agrees(op.name(), device, 1e-5, |d| {
            compute::binary(op, &x(d)?, &y(d)?)
        });
        agrees(&format!("{} of int32", op.name()), device, 0.0, |d| {
            let b = if op == BinaryOp::Pow {
                small(d)?
            } else {
                i(d)?.transpose()?.transpose()?
            };
            compute::binary(op, &i(d)?, &b)
        });
        agrees(&format!("{} by 3", op.name()), device, 1e-5, |d| {
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
                agrees(&what(op.name()), device, 0.0, |d| {
                    compute::reduce(op, &x(d)?, axes, keepdims)
                });
                agrees(&what(op.name()), device, 0.0, |d| {
                    compute::reduce(op, &x(d)?.transpose()?, axes, keepdims)
                });
            }
            agrees(&what("all"), device, 0.0, |d| {
                compute::all(&x(d)?, axes, keepdims)
            });
            agrees(&what("any"), device, 0.0, |d| {
                compute::any(&i(d)?, axes, keepdims)
            });
            agrees(&what("var"), device, 1e-4, |d| {
                compute::var(&y(d)?, axes, 1.0, keepdims)
            });
            agrees(&what("std"), device, 1e-4, |d| {
                compute::std(&y(d)?, axes, 0.0, keepdims)
            });
            agrees(&what("prod"), device, 0.0, |d| {
                compute::reduce(ReduceOp::Prod, &small(d)?, axes, keepdims)
            });
        }
    }
    agrees("isnan", device, 0.0, |d| compute::isnan(&x(d)?));
    agrees("isfinite", device, 0.0, |d| compute::isfinite(&x(d)?));
    // Advanced indexing of a Metal view (staged through the host).
    let idx = |d: Device| place(Tensor::from_slice(&[5i64, -1, 0], &[3]).unwrap(), d);
    agrees("take", device, 0.0, |d| {
        index::take(&x(d)?.transpose()?, &[0], &[idx(d)?], false)
    });
    agrees("put", device, 0.0, |d| {
        let t = x(d)?;
        let value = place(Tensor::from_slice(&[-2.0f32], &[]).unwrap(), d)?;
        // SAFETY: `t` is this closure's own; nothing else references it.
        unsafe { index::put(&t, &[1], &[idx(d)?], false, &value)? };
        Ok(t)
    });
}
