//! Test data of any dtype, exactly: [`V`] holds an element as `i128` (integers) or `f64` (floats);
//! [`host`] / [`on`] make tensors of it, [`read`] reads any view back, and [`check`] compares
//! integers exactly and floats within a tolerance. Used by the compute tests.

use dlbridge::{DType, Device, Tensor};
use half::{bf16, f16};

use super::Rng;

pub(crate) const DTYPES: [DType; 12] = [
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
];

/// One element, exactly: integers as `i128`, floats as `f64`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum V {
    I(i128),
    F(f64),
}

impl V {
    pub(crate) fn f(self) -> f64 {
        match self {
            V::I(i) => i as f64,
            V::F(f) => f,
        }
    }

    pub(crate) fn i(self) -> i128 {
        match self {
            V::I(i) => i,
            V::F(f) => f as i128,
        }
    }
}

/// Test data drawn from the shared generator.
pub(crate) trait Draw {
    /// `n` elements of `d`: integers over the whole range (so arithmetic wraps), floats in
    /// `[lo, hi)` rounded to `d`.
    fn values(&mut self, d: DType, n: usize, lo: f64, hi: f64) -> Vec<V>;
    /// `n` elements of `d` in `[lo, hi)` (integers truncated).
    fn small(&mut self, d: DType, n: usize, lo: f64, hi: f64) -> Vec<V>;
}

impl Draw for Rng {
    fn values(&mut self, d: DType, n: usize, lo: f64, hi: f64) -> Vec<V> {
        (0..n)
            .map(|_| {
                if is_int(d) {
                    V::I(wrap(d, self.next() as i128))
                } else {
                    V::F(round_to(d, self.uniform(lo, hi)))
                }
            })
            .collect()
    }

    fn small(&mut self, d: DType, n: usize, lo: f64, hi: f64) -> Vec<V> {
        (0..n).map(|_| value_of(d, self.uniform(lo, hi))).collect()
    }
}

pub(crate) fn is_int(d: DType) -> bool {
    !d.is_floating()
}

pub(crate) fn is_signed(d: DType) -> bool {
    matches!(d, DType::I8 | DType::I16 | DType::I32 | DType::I64)
}

/// `v` wrapped into integer dtype `d` (two's complement), as NumPy's integers wrap.
pub(crate) fn wrap(d: DType, v: i128) -> i128 {
    let m = 1i128 << d.bits();
    let r = v.rem_euclid(m);
    if is_signed(d) && r >= m / 2 { r - m } else { r }
}

/// `x` rounded to float dtype `d`.
pub(crate) fn round_to(d: DType, x: f64) -> f64 {
    match d {
        DType::F16 => f16::from_f64(x).to_f64(),
        DType::BF16 => bf16::from_f64(x).to_f64(),
        DType::F32 => x as f32 as f64,
        _ => x,
    }
}

/// `x` as an element of `d` (floats rounded, integers truncated and wrapped).
pub(crate) fn value_of(d: DType, x: f64) -> V {
    if is_int(d) {
        V::I(wrap(d, x as i128))
    } else {
        V::F(round_to(d, x))
    }
}

/// The relative precision of float dtype `d` (one unit in the last place at 1).
pub(crate) fn eps(d: DType) -> f64 {
    match d {
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        DType::F32 => 2f64.powi(-23),
        _ => 2f64.powi(-52),
    }
}

/// A host tensor of `d` holding `vals`.
pub(crate) fn host(d: DType, vals: &[V], shape: &[usize]) -> Tensor {
    macro_rules! ints {
        ($t:ty) => {
            Tensor::from_slice(
                &vals.iter().map(|v| v.i() as $t).collect::<Vec<$t>>(),
                shape,
            )
        };
    }
    let t = match d {
        DType::I8 => ints!(i8),
        DType::I16 => ints!(i16),
        DType::I32 => ints!(i32),
        DType::I64 => ints!(i64),
        DType::U8 => ints!(u8),
        DType::U16 => ints!(u16),
        DType::U32 => ints!(u32),
        DType::U64 => ints!(u64),
        DType::F16 => Tensor::from_slice(
            &vals
                .iter()
                .map(|v| f16::from_f64(v.f()))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::BF16 => Tensor::from_slice(
            &vals
                .iter()
                .map(|v| bf16::from_f64(v.f()))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::F32 => Tensor::from_slice(
            &vals.iter().map(|v| v.f() as f32).collect::<Vec<_>>(),
            shape,
        ),
        DType::F64 => Tensor::from_slice(&vals.iter().map(|v| v.f()).collect::<Vec<_>>(), shape),
        DType::BOOL => Tensor::from_slice(
            &vals
                .iter()
                .map(|v| (v.f() != 0.0) as u8)
                .collect::<Vec<_>>(),
            shape,
        )
        .and_then(|t| t.cast(DType::BOOL)),
        other => panic!("no test data for {other}"),
    };
    t.unwrap()
}

pub(crate) fn on(device: Device, d: DType, vals: &[V], shape: &[usize]) -> Tensor {
    host(d, vals, shape).copy_to(device).unwrap()
}

/// The elements of any view, row-major.
pub(crate) fn read(t: &Tensor) -> Vec<V> {
    macro_rules! ints {
        ($t:ty) => {
            t.to_vec::<$t>()
                .unwrap()
                .into_iter()
                .map(|x| V::I(x as i128))
                .collect()
        };
    }
    match t.dtype() {
        DType::I8 => ints!(i8),
        DType::I16 => ints!(i16),
        DType::I32 => ints!(i32),
        DType::I64 => ints!(i64),
        DType::U8 => ints!(u8),
        DType::U16 => ints!(u16),
        DType::U32 => ints!(u32),
        DType::U64 => ints!(u64),
        DType::BOOL => {
            let bytes = t.cast(DType::U8).unwrap();
            bytes
                .to_vec::<u8>()
                .unwrap()
                .into_iter()
                .map(|x| V::I(x as i128))
                .collect()
        }
        DType::F16 => t
            .to_vec::<f16>()
            .unwrap()
            .into_iter()
            .map(|x| V::F(x.to_f64()))
            .collect(),
        DType::BF16 => t
            .to_vec::<bf16>()
            .unwrap()
            .into_iter()
            .map(|x| V::F(x.to_f64()))
            .collect(),
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(|x| V::F(x as f64))
            .collect(),
        DType::F64 => t.to_vec::<f64>().unwrap().into_iter().map(V::F).collect(),
        other => panic!("cannot read {other}"),
    }
}

/// Asserts `got` matches `want` elementwise: integers exactly, floats within
/// `atol + rtol * |want|` (NaN only matches NaN; infinities match exactly).
pub(crate) fn check(what: &str, got: &[V], want: &[V], rtol: f64, atol: f64) {
    let bad = mismatches(got, want, rtol, atol);
    if let Some(&i) = bad.first() {
        let show: Vec<String> = bad
            .iter()
            .take(8)
            .map(|&i| format!("[{i}] got {:?} want {:?}", got[i], want[i]))
            .collect();
        panic!(
            "{what}: {} of {} elements differ, first at {i}: {}",
            bad.len(),
            want.len(),
            show.join(", ")
        );
    }
}

/// The indices where `got` and `want` differ (see [`check`]).
pub(crate) fn mismatches(got: &[V], want: &[V], rtol: f64, atol: f64) -> Vec<usize> {
    assert_eq!(got.len(), want.len(), "element count");
    let mut bad = Vec::new();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = match (g, w) {
            (V::I(a), V::I(b)) => a == b,
            _ => {
                let (a, b) = (g.f(), w.f());
                if b.is_nan() {
                    a.is_nan()
                } else if b.is_infinite() {
                    a == b
                } else {
                    (a - b).abs() <= atol + rtol * b.abs()
                }
            }
        };
        if !ok {
            bad.push(i);
        }
    }
    bad
}

/// Deterministic pseudo-random floats in [-scale, scale).
pub(crate) fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| ((rng.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// Whether `got` is `want` within `rel` relative to `max(|want|, 1)` (NaN matches NaN). The
/// bound is at least 16 float32 ulp: the GPUs' `powf` is good to a few ulp, not one.
pub(crate) fn close(got: f32, want: f32, rel: f32) -> bool {
    if want.is_nan() {
        return got.is_nan();
    }
    if want.is_infinite() {
        return got == want;
    }
    let rel = if rel == 0.0 {
        0.0
    } else {
        rel.max(16.0 * f32::EPSILON)
    };
    (got - want).abs() <= rel * want.abs().max(1.0)
}

/// Asserts [`close`] element by element.
pub(crate) fn assert_close_f32(got: &[f32], want: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(close(g, w, rel), "{what}: element {i} is {g}, expected {w}");
    }
}
