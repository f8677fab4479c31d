//! Reductions: `sum`, `mean`, `max`, `min`, `prod`, `argmax`, `argmin`, `var`, `std` over a
//! [`ReducePlan`].
//!
//! | layout | mode | how |
//! | --- | --- | --- |
//! | reduced axes innermost (or any other layout) | per output | the output's reduced elements as runs; each block of 1024 folded in 32 lanes (16 for `max` / `min` of 8-byte types), the block result absorbed into a running total |
//! | a kept axis innermost and contiguous (e.g. `sum(axis=0)` of a row-major matrix) | by rows | tiles of up to 4096 outputs advanced together one reduced index at a time, so memory is read in order; lanes absorbed every 32 rows |
//!
//! Sums of floats absorb their `f32` (or `f64`) block results into a compensated `f64` total, so
//! a `float32` sum of 2^28 elements is as accurate as NumPy's pairwise sum or better. Integer sums
//! wrap in 64 bits; `mean` divides the total by the count. Products fold like sums, in the
//! input's type (`float32` for the 16-bit floats) or, for integers, wrapping in 64 bits.
//!
//! `max` and `min` keep the plain extreme in their lanes (a compare and a select, which NaN never
//! enters) beside a sum of the elements, which turns NaN once a NaN went in; only then is the
//! block searched for it, so NaN propagates at the cost of one addition per vector. `argmax` /
//! `argmin` walk each output's elements in the reduced axes' row-major order 2048 at a time (in
//! the L1 cache): the chunk's extreme by that fold, then, where it beats the best so far, the first
//! element equal to it (or the first NaN, which ends the search).
//!
//! `var` and `std` are one pass over memory: each block's mean, then its deviations from that
//! mean rounded to the computing type (`f32` for `float32` and the 16-bit floats, `f64`
//! otherwise) and their squares, summed in lanes while the block is in the L1 cache; the blocks'
//! counts, means and squared deviations are merged in `f64` by Chan, Golub and LeVeque's formula
//! (Welford's update, element by element, in the by-rows mode). The result is good to about
//! `eps(f64) * |mean| / std` of its value.
//!
//! A reduced range longer than [`SPLIT`] is folded in pieces of that size merged in order, in
//! parallel where there are few outputs: the result does not depend on the number of threads.

use std::marker::PhantomData;

use half::{bf16, f16};

use super::{BLOCK, Input, SharedPtr, Storage, for_chunks, output, unsupported, walk};
use crate::compute::{MapPlan, ReduceOp, ReduceRequest};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// Lanes a block is folded in (independent accumulators, vectorised).
const LANES: usize = 32;

/// Reduced elements per piece of one output folded on one thread.
const SPLIT: usize = 256 << 10;

/// Outputs the row mode advances together: at most (their accumulators stay in the L2 cache),
/// and at least when a row is split between threads.
const MAX_TILE: usize = 4096;
const MIN_TILE: usize = 256;

/// A reduction: lane accumulators (`Acc`) folded over elements (`In`), absorbed into a running
/// `Total`.
trait Fold: Sized + 'static {
    /// Lanes a block is folded in (at most [`LANES`]); fewer where the step has more
    /// instructions, so that the lanes stay in registers.
    const WIDTH: usize = LANES;
    type In: Copy + Send + Sync;
    type Acc: Copy + Send + Sync;
    type Total: Copy + Send + Sync;
    fn identity() -> Self::Acc;
    fn step(acc: Self::Acc, x: Self::In) -> Self::Acc;
    fn combine(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn zero() -> Self::Total;
    fn absorb(total: Self::Total, acc: Self::Acc) -> Self::Total;
    fn merge(a: Self::Total, b: Self::Total) -> Self::Total;
    /// Folds a block of at most [`BLOCK`] elements (at least `2 * LANES`) into `total`: by
    /// default in [`Fold::WIDTH`] lanes of [`Fold::step`].
    #[inline(always)]
    fn block(total: Self::Total, xs: &[Self::In]) -> Self::Total {
        lanes_block::<Self>(total, xs)
    }
}

/// A Neumaier-compensated `f64` sum.
#[derive(Clone, Copy, Debug, Default)]
struct Sum64 {
    sum: f64,
    comp: f64,
}

impl Sum64 {
    #[inline(always)]
    fn add(self, x: f64) -> Sum64 {
        let sum = self.sum + x;
        let lost = if self.sum.abs() >= x.abs() {
            (self.sum - sum) + x
        } else {
            (x - sum) + self.sum
        };
        Sum64 {
            sum,
            comp: self.comp + lost,
        }
    }

    fn value(self) -> f64 {
        self.sum + self.comp
    }
}

/// Sums of `f32` (and of the 16-bit floats, widened): `f32` lanes, `f64` totals.
struct SumF32;

impl Fold for SumF32 {
    type In = f32;
    type Acc = f32;
    type Total = Sum64;
    #[inline(always)]
    fn identity() -> f32 {
        0.0
    }
    #[inline(always)]
    fn step(acc: f32, x: f32) -> f32 {
        acc + x
    }
    #[inline(always)]
    fn combine(a: f32, b: f32) -> f32 {
        a + b
    }
    fn zero() -> Sum64 {
        Sum64::default()
    }
    #[inline(always)]
    fn absorb(total: Sum64, acc: f32) -> Sum64 {
        total.add(acc as f64)
    }
    fn merge(a: Sum64, b: Sum64) -> Sum64 {
        let s = a.add(b.sum);
        Sum64 {
            comp: s.comp + b.comp,
            ..s
        }
    }
}

/// Values summed in `f64`: `f64` itself, and integers for `mean`.
trait ToF64: Copy + Send + Sync + 'static {
    fn to_f64(self) -> f64;
}

macro_rules! to_f64 {
    ($($t:ty),*) => {$(
        impl ToF64 for $t {
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    )*};
}

to_f64!(i8, i16, i32, i64, u8, u16, u32, u64, f64);

/// Sums in `f64` lanes and totals.
struct SumF64<T>(PhantomData<fn() -> T>);

impl<T: ToF64> Fold for SumF64<T> {
    type In = T;
    type Acc = f64;
    type Total = Sum64;
    #[inline(always)]
    fn identity() -> f64 {
        0.0
    }
    #[inline(always)]
    fn step(acc: f64, x: T) -> f64 {
        acc + x.to_f64()
    }
    #[inline(always)]
    fn combine(a: f64, b: f64) -> f64 {
        a + b
    }
    fn zero() -> Sum64 {
        Sum64::default()
    }
    #[inline(always)]
    fn absorb(total: Sum64, acc: f64) -> Sum64 {
        total.add(acc)
    }
    fn merge(a: Sum64, b: Sum64) -> Sum64 {
        SumF32::merge(a, b)
    }
}

/// Integers widened to 64 bits (sign- or zero-extended), as `u64` bits.
trait Widen: Copy + Send + Sync + 'static {
    fn widen(self) -> u64;
}

macro_rules! widen {
    ($($t:ty => $via:ty),*) => {$(
        impl Widen for $t {
            #[inline(always)]
            fn widen(self) -> u64 {
                self as $via as u64
            }
        }
    )*};
}

widen!(i8 => i64, i16 => i64, i32 => i64, i64 => i64, u8 => u64, u16 => u64, u32 => u64, u64 => u64);

/// Integer sums: wrapping 64-bit arithmetic (two's complement, so one kind serves both signs).
struct SumInt<T>(PhantomData<fn() -> T>);

impl<T: Widen> Fold for SumInt<T> {
    type In = T;
    type Acc = u64;
    type Total = u64;
    #[inline(always)]
    fn identity() -> u64 {
        0
    }
    #[inline(always)]
    fn step(acc: u64, x: T) -> u64 {
        acc.wrapping_add(x.widen())
    }
    #[inline(always)]
    fn combine(a: u64, b: u64) -> u64 {
        a.wrapping_add(b)
    }
    fn zero() -> u64 {
        0
    }
    #[inline(always)]
    fn absorb(total: u64, acc: u64) -> u64 {
        total.wrapping_add(acc)
    }
    fn merge(a: u64, b: u64) -> u64 {
        a.wrapping_add(b)
    }
}

/// Integer products: wrapping 64-bit arithmetic (two's complement: the low bits are right for
/// both signs).
struct ProdInt<T>(PhantomData<fn() -> T>);

impl<T: Widen> Fold for ProdInt<T> {
    type In = T;
    type Acc = u64;
    type Total = u64;
    #[inline(always)]
    fn identity() -> u64 {
        1
    }
    #[inline(always)]
    fn step(acc: u64, x: T) -> u64 {
        acc.wrapping_mul(x.widen())
    }
    #[inline(always)]
    fn combine(a: u64, b: u64) -> u64 {
        a.wrapping_mul(b)
    }
    fn zero() -> u64 {
        1
    }
    #[inline(always)]
    fn absorb(total: u64, acc: u64) -> u64 {
        total.wrapping_mul(acc)
    }
    fn merge(a: u64, b: u64) -> u64 {
        a.wrapping_mul(b)
    }
}

/// Float products in the computing type (`f32` or `f64`), as NumPy's: a product that leaves the
/// type's range is infinite, as there.
struct ProdFloat<T>(PhantomData<fn() -> T>);

impl<T> Fold for ProdFloat<T>
where
    T: Copy + Send + Sync + 'static + std::ops::Mul<Output = T> + From<u8>,
{
    type In = T;
    type Acc = T;
    type Total = T;
    #[inline(always)]
    fn identity() -> T {
        T::from(1)
    }
    #[inline(always)]
    fn step(acc: T, x: T) -> T {
        acc * x
    }
    #[inline(always)]
    fn combine(a: T, b: T) -> T {
        a * b
    }
    fn zero() -> T {
        T::from(1)
    }
    #[inline(always)]
    fn absorb(total: T, acc: T) -> T {
        total * acc
    }
    fn merge(a: T, b: T) -> T {
        a * b
    }
}

/// The floats `var` and `std` compute in.
trait Real:
    Copy
    + Send
    + Sync
    + 'static
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    const ZERO: Self;
    fn of_count(n: u64) -> Self;
    fn of_f64(v: f64) -> Self;
    fn wide(self) -> f64;
}

macro_rules! real {
    ($($t:ty),*) => {$(
        impl Real for $t {
            const ZERO: Self = 0.0;
            #[inline(always)]
            fn of_count(n: u64) -> Self {
                n as $t
            }
            #[inline(always)]
            fn of_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn wide(self) -> f64 {
                self as f64
            }
        }
    )*};
}

real!(f32, f64);

/// Elements whose moments are computed in [`MomentIn::Real`]: `f32` (and the 16-bit floats,
/// widened to it) in `f32`, the others in `f64` (as NumPy computes `var` of integers).
trait MomentIn: Copy + Send + Sync + 'static {
    type Real: Real;
    fn real(self) -> Self::Real;
}

impl MomentIn for f32 {
    type Real = f32;
    #[inline(always)]
    fn real(self) -> f32 {
        self
    }
}

macro_rules! moment_in_f64 {
    ($($t:ty),*) => {$(
        impl MomentIn for $t {
            type Real = f64;
            #[inline(always)]
            fn real(self) -> f64 {
                self as f64
            }
        }
    )*};
}

moment_in_f64!(i8, i16, i32, i64, u8, u16, u32, u64, f64);

/// A partial result of `var` / `std`: the count, the mean and the sum of squared deviations from
/// it.
#[derive(Clone, Copy, Debug)]
struct Moment<R> {
    n: u64,
    mean: R,
    m2: R,
}

impl<R: Real> Moment<R> {
    const EMPTY: Moment<R> = Moment {
        n: 0,
        mean: R::ZERO,
        m2: R::ZERO,
    };

    /// One more element (Welford's update).
    #[inline(always)]
    fn push(self, x: R) -> Moment<R> {
        let n = self.n + 1;
        let d = x - self.mean;
        let mean = self.mean + d / R::of_count(n);
        Moment {
            n,
            mean,
            m2: self.m2 + d * (x - mean),
        }
    }

    /// Two partial results merged (Chan, Golub and LeVeque's formula).
    #[inline(always)]
    fn merge(self, b: Moment<R>) -> Moment<R> {
        if b.n == 0 {
            return self;
        }
        if self.n == 0 {
            return b;
        }
        let n = self.n + b.n;
        let w = R::of_count(b.n) / R::of_count(n);
        let d = b.mean - self.mean;
        Moment {
            n,
            mean: self.mean + d * w,
            m2: (self.m2 + b.m2) + d * d * (R::of_count(self.n) * w),
        }
    }

    fn wide(self) -> Moment<f64> {
        Moment {
            n: self.n,
            mean: self.mean.wide(),
            m2: self.m2.wide(),
        }
    }
}

/// `var` and `std`: a block's mean and squared deviations from it in two passes over the block
/// (in the L1 cache), in lanes of the computing type, merged into an `f64` total.
struct Moments<T>(PhantomData<fn() -> T>);

impl<T: MomentIn> Fold for Moments<T> {
    type In = T;
    type Acc = Moment<T::Real>;
    type Total = Moment<f64>;
    #[inline(always)]
    fn identity() -> Self::Acc {
        Moment::EMPTY
    }
    #[inline(always)]
    fn step(acc: Self::Acc, x: T) -> Self::Acc {
        acc.push(x.real())
    }
    #[inline(always)]
    fn combine(a: Self::Acc, b: Self::Acc) -> Self::Acc {
        a.merge(b)
    }
    fn zero() -> Moment<f64> {
        Moment::EMPTY
    }
    #[inline(always)]
    fn absorb(total: Moment<f64>, acc: Self::Acc) -> Moment<f64> {
        total.merge(acc.wide())
    }
    fn merge(a: Moment<f64>, b: Moment<f64>) -> Moment<f64> {
        a.merge(b)
    }
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    fn block(total: Moment<f64>, xs: &[T]) -> Moment<f64> {
        // Fixed-size lanes and index loops, as in `extreme_lanes`.
        let zero = T::Real::ZERO;
        let full = xs.len() / LANES * LANES;
        let mut sums = [zero; LANES];
        let mut at = 0;
        while at < full {
            let c = &xs[at..at + LANES];
            for i in 0..LANES {
                sums[i] = sums[i] + c[i].real();
            }
            at += LANES;
        }
        let mut sum = 0.0f64;
        for i in 0..LANES {
            sum += sums[i].wide();
        }
        for &x in &xs[full..] {
            sum += x.real().wide();
        }
        let n = xs.len() as f64;
        // Deviations from the rounded mean `c`, and their sum to correct for its rounding.
        let c = T::Real::of_f64(sum / n);
        let (mut dev, mut sq) = ([zero; LANES], [zero; LANES]);
        let mut at = 0;
        while at < full {
            let ch = &xs[at..at + LANES];
            for i in 0..LANES {
                let d = ch[i].real() - c;
                dev[i] = dev[i] + d;
                sq[i] = sq[i] + d * d;
            }
            at += LANES;
        }
        let (mut s, mut q) = (0.0f64, 0.0f64);
        for i in 0..LANES {
            s += dev[i].wide();
            q += sq[i].wide();
        }
        for &x in &xs[full..] {
            let d = (x.real() - c).wide();
            s += d;
            q += d * d;
        }
        let m2 = q - s * s / n;
        let block = Moment {
            n: xs.len() as u64,
            mean: c.wide() + s / n,
            // Never below 0 (rounding), and NaN stays NaN.
            m2: if m2 < 0.0 { 0.0 } else { m2 },
        };
        total.merge(block)
    }
}

/// Ordered element types and their extremes (the identities of `max` and `min`).
trait Bounded: Copy + PartialOrd + Send + Sync + 'static {
    const LOWEST: Self;
    const HIGHEST: Self;
    /// Whether the type has NaN.
    const FLOAT: bool;
    /// Zero, where a [`Bounded::probe`] starts.
    const ZERO: Self;
    /// A cheap NaN detector folded beside an extreme: for floats the plain sum, NaN once a NaN
    /// went in (or infinities of both signs: a hit is confirmed by a search), one addition per
    /// vector; nothing for integers.
    fn probe(acc: Self, x: Self) -> Self;
    /// Whether [`Bounded::probe`]'s lanes may have seen a NaN.
    fn probed(lanes: &[Self]) -> bool;
}

macro_rules! bounded {
    ($($t:ty => $lo:expr, $hi:expr;)*) => {$(
        impl Bounded for $t {
            const LOWEST: Self = $lo;
            const HIGHEST: Self = $hi;
            const FLOAT: bool = false;
            const ZERO: Self = 0;
            #[inline(always)]
            fn probe(acc: Self, _: Self) -> Self {
                acc
            }
            #[inline(always)]
            fn probed(_: &[Self]) -> bool {
                false
            }
        }
    )*};
}

bounded! {
    i8 => i8::MIN, i8::MAX; i16 => i16::MIN, i16::MAX; i32 => i32::MIN, i32::MAX;
    i64 => i64::MIN, i64::MAX; u8 => 0, u8::MAX; u16 => 0, u16::MAX; u32 => 0, u32::MAX;
    u64 => 0, u64::MAX;
}

macro_rules! bounded_float {
    ($($t:ty),*) => {$(
        impl Bounded for $t {
            const LOWEST: Self = <$t>::NEG_INFINITY;
            const HIGHEST: Self = <$t>::INFINITY;
            const FLOAT: bool = true;
            const ZERO: Self = 0.0;
            #[inline(always)]
            fn probe(acc: Self, x: Self) -> Self {
                acc + x
            }
            #[inline(always)]
            #[allow(clippy::eq_op)]
            fn probed(lanes: &[Self]) -> bool {
                let s: Self = lanes.iter().sum();
                s != s
            }
        }
    )*};
}

bounded_float!(f32, f64);

/// The larger of two values; NaN once seen stays (`x != x` only holds for NaN, and nothing
/// compares greater than NaN).
#[inline(always)]
#[allow(clippy::eq_op)]
fn max_nan<T: PartialOrd>(m: T, x: T) -> T {
    if (x > m) | (x != x) { x } else { m }
}

/// The smaller of two values, NaN propagating.
#[inline(always)]
#[allow(clippy::eq_op)]
fn min_nan<T: PartialOrd>(m: T, x: T) -> T {
    if (x < m) | (x != x) { x } else { m }
}

/// The largest (`MAX`) or smallest element of `xs`, NaN if it holds one. The lanes keep the
/// plain extreme (a compare and a select, one instruction per vector, which NaN never enters) and
/// a [`Bounded::probe`] beside it; only when the probe fires is the block searched for a NaN.
#[inline(always)]
fn extreme_block<T: Bounded, const MAX: bool>(xs: &[T]) -> T {
    // 32 lanes (16 of 8 bytes), so that the extremes and the probes stay in registers.
    if std::mem::size_of::<T>() == 8 {
        extreme_lanes::<T, MAX, { LANES / 2 }>(xs)
    } else {
        extreme_lanes::<T, MAX, LANES>(xs)
    }
}

/// [`extreme_block`] in `W` lanes. Fixed-size arrays and index loops, no iterator adapters: the
/// release build (one codegen unit, fat LTO) left a `Zip` constructor out of line in this loop.
#[inline(always)]
#[allow(clippy::eq_op, clippy::needless_range_loop)]
fn extreme_lanes<T: Bounded, const MAX: bool, const W: usize>(xs: &[T]) -> T {
    let pick = |m: T, x: T| {
        if MAX {
            if x > m { x } else { m }
        } else if x < m {
            x
        } else {
            m
        }
    };
    let start = if MAX { T::LOWEST } else { T::HIGHEST };
    let mut lanes = [start; W];
    let mut probes = [T::ZERO; W];
    let full = xs.len() / W * W;
    let mut at = 0;
    while at < full {
        let c = &xs[at..at + W];
        for i in 0..W {
            lanes[i] = pick(lanes[i], c[i]);
            probes[i] = T::probe(probes[i], c[i]);
        }
        at += W;
    }
    let mut m = start;
    let mut nan = false;
    for &x in &xs[full..] {
        m = pick(m, x);
        nan |= x != x;
    }
    if T::FLOAT && (nan || T::probed(&probes)) {
        if let Some(&nan) = xs.iter().find(|&&x| x != x) {
            return nan;
        }
    }
    let mut width = W;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] = pick(lanes[i], lanes[i + width]);
        }
    }
    pick(m, lanes[0])
}

struct Max<T>(PhantomData<fn() -> T>);
struct Min<T>(PhantomData<fn() -> T>);

macro_rules! extreme {
    ($name:ident, $pick:ident, $identity:ident, $max:literal) => {
        impl<T: Bounded> Fold for $name<T> {
            const WIDTH: usize = 16;
            type In = T;
            type Acc = T;
            type Total = T;
            #[inline(always)]
            fn identity() -> T {
                T::$identity
            }
            #[inline(always)]
            fn step(acc: T, x: T) -> T {
                $pick(acc, x)
            }
            #[inline(always)]
            fn combine(a: T, b: T) -> T {
                $pick(a, b)
            }
            fn zero() -> T {
                T::$identity
            }
            #[inline(always)]
            fn absorb(total: T, acc: T) -> T {
                $pick(total, acc)
            }
            fn merge(a: T, b: T) -> T {
                $pick(a, b)
            }
            #[inline(always)]
            fn block(total: T, xs: &[T]) -> T {
                $pick(total, extreme_block::<T, $max>(xs))
            }
        }
    };
}

extreme!(Max, max_nan, LOWEST, true);
extreme!(Min, min_nan, HIGHEST, false);

/// Folds one block in [`Fold::WIDTH`] lanes: what [`Fold::block`] does unless a fold says
/// otherwise.
#[inline(always)]
fn lanes_block<F: Fold>(total: F::Total, block: &[F::In]) -> F::Total {
    let mut lanes = [F::identity(); LANES];
    let lanes = &mut lanes[..F::WIDTH];
    let mut chunks = block.chunks_exact(F::WIDTH);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = F::step(*l, x);
        }
    }
    for (l, &x) in lanes.iter_mut().zip(chunks.remainder()) {
        *l = F::step(*l, x);
    }
    let mut width = F::WIDTH;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] = F::combine(lanes[i], lanes[i + width]);
        }
    }
    F::absorb(total, lanes[0])
}

/// Folds `xs` into `total`: blocks of [`BLOCK`] elements ([`Fold::block`]).
#[inline(always)]
fn fold_slice<F: Fold>(mut total: F::Total, xs: &[F::In]) -> F::Total {
    if xs.len() < 2 * LANES {
        let mut acc = F::identity();
        for &x in xs {
            acc = F::step(acc, x);
        }
        return F::absorb(total, acc);
    }
    for block in xs.chunks(BLOCK) {
        total = F::block(total, block);
    }
    total
}

/// [`fold_slice`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fold_slice_avx2<F: Fold>(total: F::Total, xs: &[F::In]) -> F::Total {
    fold_slice::<F>(total, xs)
}

fn feed<F: Fold>(total: F::Total, xs: &[F::In]) -> F::Total {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { fold_slice_avx2::<F>(total, xs) };
    }
    fold_slice::<F>(total, xs)
}

/// One reduced index for a tile of outputs: `acc[j] = step(acc[j], xs[j])`.
#[inline(always)]
fn step_row_generic<F: Fold>(acc: &mut [F::Acc], xs: &[F::In]) {
    for (a, &x) in acc.iter_mut().zip(xs) {
        *a = F::step(*a, x);
    }
}

/// [`step_row_generic`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn step_row_avx2<F: Fold>(acc: &mut [F::Acc], xs: &[F::In]) {
    step_row_generic::<F>(acc, xs)
}

/// Absorbs a tile's lanes into its totals and restarts the lanes.
fn absorb_row<F: Fold>(totals: &mut [F::Total], acc: &mut [F::Acc]) {
    for (t, a) in totals.iter_mut().zip(acc.iter_mut()) {
        *t = F::absorb(*t, *a);
        *a = F::identity();
    }
}

fn step_row<F: Fold>(acc: &mut [F::Acc], xs: &[F::In]) {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { step_row_avx2::<F>(acc, xs) };
    }
    step_row_generic::<F>(acc, xs)
}

/// Runs a reduction request.
pub(super) fn run(req: &ReduceRequest<'_>) -> Result<()> {
    use ReduceOp::{ArgMax, ArgMin, Max as OpMax, Mean, Min as OpMin, Prod, Std, Sum, Var};
    let dtype = req.input.dtype();
    let divisor = req.divisor();
    macro_rules! float_case {
        ($s:ty, $sum:ty) => {
            match req.op {
                Sum => {
                    execute::<$s, $sum, $s>(req, |t: Sum64| <$s as Storage>::from_f64(t.value()))
                }
                Mean => execute::<$s, $sum, $s>(req, |t: Sum64| {
                    <$s as Storage>::from_f64(t.value() / divisor)
                }),
                Var => execute::<$s, Moments<<$s as Storage>::Wide>, $s>(req, |t: Moment<f64>| {
                    <$s as Storage>::from_f64(t.m2 / divisor)
                }),
                Std => execute::<$s, Moments<<$s as Storage>::Wide>, $s>(req, |t: Moment<f64>| {
                    <$s as Storage>::from_f64((t.m2 / divisor).sqrt())
                }),
                OpMax => {
                    execute::<$s, Max<<$s as Storage>::Wide>, $s>(req, <$s as Storage>::narrow)
                }
                OpMin => {
                    execute::<$s, Min<<$s as Storage>::Wide>, $s>(req, <$s as Storage>::narrow)
                }
                Prod => execute::<$s, ProdFloat<<$s as Storage>::Wide>, $s>(
                    req,
                    <$s as Storage>::narrow,
                ),
                ArgMax => execute_arg::<$s>(req, true),
                ArgMin => execute_arg::<$s>(req, false),
            }
        };
    }
    macro_rules! int_case {
        ($s:ty, $sum:ty) => {
            match req.op {
                Sum => execute::<$s, SumInt<$s>, $sum>(req, |t: u64| t as $sum),
                Mean => execute::<$s, SumF64<$s>, f64>(req, |t: Sum64| t.value() / divisor),
                Var => execute::<$s, Moments<$s>, f64>(req, |t: Moment<f64>| t.m2 / divisor),
                Std => {
                    execute::<$s, Moments<$s>, f64>(req, |t: Moment<f64>| (t.m2 / divisor).sqrt())
                }
                OpMax => execute::<$s, Max<$s>, $s>(req, |t: $s| t),
                OpMin => execute::<$s, Min<$s>, $s>(req, |t: $s| t),
                Prod => execute::<$s, ProdInt<$s>, $sum>(req, |t: u64| t as $sum),
                ArgMax => execute_arg::<$s>(req, true),
                ArgMin => execute_arg::<$s>(req, false),
            }
        };
    }
    match dtype {
        DType::F16 => float_case!(f16, SumF32),
        DType::BF16 => float_case!(bf16, SumF32),
        DType::F32 => float_case!(f32, SumF32),
        DType::F64 => float_case!(f64, SumF64<f64>),
        DType::I8 => int_case!(i8, i64),
        DType::I16 => int_case!(i16, i64),
        DType::I32 => int_case!(i32, i64),
        DType::I64 => int_case!(i64, i64),
        DType::U8 => int_case!(u8, u64),
        DType::U16 => int_case!(u16, u64),
        DType::U32 => int_case!(u32, u64),
        DType::U64 => int_case!(u64, u64),
        _ => Err(unsupported(req.op.name(), dtype)),
    }
}

/// Runs a reduction whose input is stored as `S`, folded by `F`, written as `O` by `finish`.
fn execute<S, F, O>(req: &ReduceRequest<'_>, finish: impl Fn(F::Total) -> O + Sync) -> Result<()>
where
    S: Storage,
    F: Fold<In = S::Wide>,
    O: Element,
{
    let plan = &req.plan;
    if req.out.dtype() != O::DTYPE {
        return Err(Error::DTypeMismatch(format!(
            "{} of {} writes {}, the request's output is {}",
            req.op.name(),
            req.input.dtype(),
            O::DTYPE,
            req.out.dtype()
        )));
    }
    let outputs = plan.outputs();
    if req.out.numel() != outputs || plan.kept.strides.len() != 2 {
        return Err(Error::InvalidArgument(
            "a reduction request's output must match its plan".into(),
        ));
    }
    let input = Input::new(req.input, "reducing it")?;
    let first = SharedPtr(input.ptr::<S>().cast_mut());
    let out = SharedPtr(output::<O>(req.out)?);
    let write = |o: isize, v: O| {
        // `o` is an output element offset the plan produces, inside the compact `out`; each
        // output is written by exactly one task.
        let at = out.get().wrapping_offset(o);
        // SAFETY: as above.
        unsafe { *at = v };
    };
    if plan.count == 0 {
        // Only `sum` (0), `prod` (1) and `mean` (0 / 0 = NaN) come here.
        for o in 0..outputs {
            write(o as isize, finish(F::zero()));
        }
        return Ok(());
    }
    let (kept, red) = (&plan.kept, &plan.reduced);
    let kn = kept.shape.len();
    let red_inner = red.strides[0][red.shape.len() - 1];
    let rows_mode = outputs > 1 && kept.strides[1][kn - 1] == 1 && red_inner != 1;
    if rows_mode && kept.shape[kn - 1] >= 16 {
        by_rows::<S, F, O>(plan, first, &write, &finish);
    } else {
        per_output::<S, F, O>(plan, first, &write, &finish);
    }
    drop(input);
    Ok(())
}

/// The fold of reduced elements `start..end` of the output whose first input element is at
/// `base`.
///
/// # Safety
/// Every element the reduced plan addresses from `base` must be readable, and not written during
/// the call.
unsafe fn fold_range<S: Storage, F: Fold<In = S::Wide>>(
    base: *const S,
    red: &MapPlan,
    start: usize,
    end: usize,
) -> F::Total {
    let mut total = F::zero();
    let stride = red.strides[0][red.shape.len() - 1];
    walk(
        &red.shape,
        [red.strides[0].as_slice()],
        start,
        end,
        |off, len| {
            let at = base.wrapping_offset(off[0]);
            // SAFETY: `len` elements of the reduced plan from `base`, readable by the caller's
            // contract.
            unsafe { S::read_run(at, stride, len, |xs| total = feed::<F>(total, xs)) };
        },
    );
    total
}

/// Each output folded over its reduced elements: in parallel over outputs when there are many,
/// else over pieces of the reduced range.
fn per_output<S, F, O>(
    plan: &crate::compute::ReducePlan,
    first: SharedPtr<S>,
    write: &(impl Fn(isize, O) + Sync),
    finish: &(impl Fn(F::Total) -> O + Sync),
) where
    S: Storage,
    F: Fold<In = S::Wide>,
    O: Element,
{
    let (kept, red, count) = (&plan.kept, &plan.reduced, plan.count);
    let kn = kept.shape.len();
    let (out_step, in_step) = (kept.strides[0][kn - 1], kept.strides[1][kn - 1]);
    let threads = crate::backend::cpu::workers::threads();
    let pieces = count.div_ceil(SPLIT);
    let split_pieces = pieces > 1 && plan.outputs() < 2 * threads;
    let one = |base: *const S| -> F::Total {
        let base = SharedPtr(base.cast_mut());
        let piece = |p: usize| {
            // SAFETY: the reduced plan from an output's first input element addresses elements
            // of the input (its layout was checked when the view was built), which no one
            // writes during the call.
            unsafe { fold_range::<S, F>(base.get(), red, p * SPLIT, ((p + 1) * SPLIT).min(count)) }
        };
        if split_pieces {
            use rayon::prelude::*;
            // Collected, then merged in order: the result does not depend on the thread count.
            let parts: Vec<F::Total> = crate::backend::cpu::workers::install(|| {
                (0..pieces).into_par_iter().map(piece).collect()
            });
            parts.into_iter().reduce(F::merge).unwrap_or_else(F::zero)
        } else {
            (0..pieces)
                .map(piece)
                .reduce(F::merge)
                .unwrap_or_else(F::zero)
        }
    };
    let min_chunk = if split_pieces {
        usize::MAX
    } else {
        (64usize << 10).div_ceil(count)
    };
    for_chunks(plan.outputs(), min_chunk, |start, end| {
        walk(
            &kept.shape,
            [kept.strides[0].as_slice(), kept.strides[1].as_slice()],
            start,
            end,
            |off, len| {
                for i in 0..len as isize {
                    let base = first.get().wrapping_offset(off[1] + i * in_step);
                    write(off[0] + i * out_step, finish(one(base)));
                }
            },
        );
    });
}

/// Tiles of outputs along a contiguous kept axis, advanced one reduced index at a time.
fn by_rows<S, F, O>(
    plan: &crate::compute::ReducePlan,
    first: SharedPtr<S>,
    write: &(impl Fn(isize, O) + Sync),
    finish: &(impl Fn(F::Total) -> O + Sync),
) where
    S: Storage,
    F: Fold<In = S::Wide>,
    O: Element,
{
    let (kept, red, count) = (&plan.kept, &plan.reduced, plan.count);
    let width = kept.shape[kept.shape.len() - 1];
    let out_step = kept.strides[0][kept.shape.len() - 1];
    let rows_of_outputs = plan.outputs() / width;
    // Whole rows where there are enough of them for every thread; else rows split so that each
    // thread gets a tile. Tiles never change what a column computes, only who computes it.
    let threads = crate::backend::cpu::workers::threads();
    let tile = if rows_of_outputs >= threads || width <= MIN_TILE {
        width.min(MAX_TILE)
    } else {
        width
            .div_ceil(threads)
            .clamp(MIN_TILE, MAX_TILE)
            .next_multiple_of(16)
    };
    let tiles = width.div_ceil(tile);
    let units = rows_of_outputs * tiles;
    let red_inner = red.strides[0][red.shape.len() - 1];
    let min_chunk = (64usize << 10).div_ceil(count * tile);
    for_chunks(units, min_chunk, |start, end| {
        let mut acc = vec![F::identity(); tile];
        let mut totals = vec![F::zero(); tile];
        for unit in start..end {
            let (row, c0) = (unit / tiles, (unit % tiles) * tile);
            let w = tile.min(width - c0);
            let linear = row * width + c0;
            let (out_off, in_off) = (kept.offset(0, linear), kept.offset(1, linear));
            let base = first.get().wrapping_offset(in_off);
            let (acc, totals) = (&mut acc[..w], &mut totals[..w]);
            acc.fill(F::identity());
            totals.fill(F::zero());
            let mut rows = 0;
            walk(
                &red.shape,
                [red.strides[0].as_slice()],
                0,
                count,
                |off, len| {
                    for i in 0..len as isize {
                        let at = base.wrapping_offset(off[0] + i * red_inner);
                        // `read_run` hands the row over in blocks (half types are widened
                        // `BLOCK` at a time): each block folds into its own columns.
                        let mut col = 0;
                        // SAFETY: `w` consecutive elements of the kept axis at one reduced index: the
                        // plan addresses them inside the input, which no one writes during the call.
                        unsafe {
                            S::read_run(at, 1, w, |xs| {
                                step_row::<F>(&mut acc[col..col + xs.len()], xs);
                                col += xs.len();
                            })
                        };
                        rows += 1;
                        if rows == LANES {
                            absorb_row::<F>(totals, acc);
                            rows = 0;
                        }
                    }
                },
            );
            absorb_row::<F>(totals, acc);
            for (j, t) in totals.iter().enumerate() {
                write(out_off + j as isize * out_step, finish(*t));
            }
        }
    });
}

/// Where an arg reduction stands: the extreme so far and its index in the reduced order.
#[derive(Clone, Copy, Debug)]
struct ArgBest<W> {
    value: W,
    index: usize,
    /// Whether any element was seen.
    found: bool,
    /// Whether `value` is NaN (the first NaN wins: the search is over).
    nan: bool,
}

impl<W: Bounded> ArgBest<W> {
    const NONE: ArgBest<W> = ArgBest {
        value: W::LOWEST,
        index: 0,
        found: false,
        nan: false,
    };

    /// `self` (earlier elements) merged with `later`: the later one wins only when strictly
    /// beyond, so that the first among equals stays.
    fn merge(self, later: ArgBest<W>, max: bool) -> ArgBest<W> {
        if self.nan || !later.found {
            return self;
        }
        if !self.found || later.nan || beyond(later.value, self.value, max) {
            later
        } else {
            self
        }
    }
}

#[inline(always)]
fn beyond<W: PartialOrd>(x: W, than: W, max: bool) -> bool {
    if max { x > than } else { x < than }
}

/// Elements an arg reduction searches at a time: few enough to stay in the L1 cache between the
/// extreme and the search for it.
const ARG_CHUNK: usize = 2 * BLOCK;

/// Folds `xs`, whose first element has reduced index `start`, into `best`, a chunk at a time: the
/// chunk's extreme (NaN if it has one) by the vectorised fold, then, only where it beats `best`,
/// the first element equal to it (or the first NaN, which ends the search).
#[inline(always)]
#[allow(clippy::eq_op)]
fn arg_slice<W: Bounded>(best: &mut ArgBest<W>, xs: &[W], start: usize, max: bool) {
    for (c, chunk) in xs.chunks(ARG_CHUNK).enumerate() {
        if best.nan {
            return;
        }
        let at = start + c * ARG_CHUNK;
        let m = if max {
            fold_slice::<Max<W>>(W::LOWEST, chunk)
        } else {
            fold_slice::<Min<W>>(W::HIGHEST, chunk)
        };
        if m != m {
            *best = ArgBest {
                value: m,
                index: at + first_index(chunk, |x| x != x),
                found: true,
                nan: true,
            };
        } else if !best.found || beyond(m, best.value, max) {
            *best = ArgBest {
                value: m,
                index: at + first_index(chunk, |x| x == m),
                found: true,
                nan: false,
            };
        }
    }
}

/// [`arg_slice`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn arg_slice_avx2<W: Bounded>(best: &mut ArgBest<W>, xs: &[W], start: usize, max: bool) {
    arg_slice(best, xs, start, max)
}

fn arg_block<W: Bounded>(best: &mut ArgBest<W>, xs: &[W], start: usize, max: bool) {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { arg_slice_avx2(best, xs, start, max) };
    }
    arg_slice(best, xs, start, max)
}

/// The index of the first element of `xs` for which `hit` holds (0 if none): groups of 64 tested
/// at once (a loop the compiler vectorises), then the element within the group.
#[inline(always)]
fn first_index<W: Copy>(xs: &[W], hit: impl Fn(W) -> bool) -> usize {
    const GROUP: usize = 64;
    let mut groups = xs.chunks_exact(GROUP);
    for (g, group) in (&mut groups).enumerate() {
        if group.iter().fold(false, |any, &x| any | hit(x)) {
            return g * GROUP + group.iter().position(|&x| hit(x)).unwrap_or(0);
        }
    }
    let done = xs.len() - groups.remainder().len();
    done + groups.remainder().iter().position(|&x| hit(x)).unwrap_or(0)
}

/// The arg reduction over reduced elements `start..end` of the output whose first input element
/// is at `base`.
///
/// # Safety
/// As [`fold_range`].
unsafe fn arg_range<S: Storage>(
    base: *const S,
    red: &MapPlan,
    start: usize,
    end: usize,
    max: bool,
) -> ArgBest<S::Wide>
where
    S::Wide: Bounded,
{
    let mut best = ArgBest::NONE;
    let stride = red.strides[0][red.shape.len() - 1];
    let mut pos = start;
    walk(
        &red.shape,
        [red.strides[0].as_slice()],
        start,
        end,
        |off, len| {
            let at = base.wrapping_offset(off[0]);
            // SAFETY: `len` elements of the reduced plan from `base`, readable by the caller's
            // contract.
            unsafe {
                S::read_run(at, stride, len, |xs| {
                    arg_block(&mut best, xs, pos, max);
                    pos += xs.len();
                })
            };
        },
    );
    best
}

/// Runs `argmax` (`max`) or `argmin` over input stored as `S`, writing `int64` indices.
fn execute_arg<S: Storage>(req: &ReduceRequest<'_>, max: bool) -> Result<()>
where
    S::Wide: Bounded,
{
    let plan = &req.plan;
    let outputs = plan.outputs();
    if req.out.dtype() != DType::I64 || req.out.numel() != outputs || plan.kept.strides.len() != 2 {
        return Err(Error::InvalidArgument(format!(
            "{} writes one int64 per output of its plan",
            req.op.name()
        )));
    }
    if plan.count == 0 {
        return Err(Error::InvalidArgument(format!(
            "attempt to get {} of an empty sequence",
            req.op.name()
        )));
    }
    let input = Input::new(req.input, "reducing it")?;
    let first = SharedPtr(input.ptr::<S>().cast_mut());
    let out = SharedPtr(output::<i64>(req.out)?);
    let (kept, red, count) = (&plan.kept, &plan.reduced, plan.count);
    let kn = kept.shape.len();
    let (out_step, in_step) = (kept.strides[0][kn - 1], kept.strides[1][kn - 1]);
    let threads = crate::backend::cpu::workers::threads();
    let pieces = count.div_ceil(SPLIT);
    let split_pieces = pieces > 1 && outputs < 2 * threads;
    let one = |base: *const S| -> ArgBest<S::Wide> {
        let base = SharedPtr(base.cast_mut());
        let piece = |p: usize| {
            // SAFETY: the reduced plan from an output's first input element addresses elements
            // of the input (its layout was checked when the view was built), which no one writes
            // during the call.
            unsafe {
                arg_range::<S>(
                    base.get(),
                    red,
                    p * SPLIT,
                    ((p + 1) * SPLIT).min(count),
                    max,
                )
            }
        };
        let parts: Vec<ArgBest<S::Wide>> = if split_pieces {
            use rayon::prelude::*;
            crate::backend::cpu::workers::install(|| {
                (0..pieces).into_par_iter().map(piece).collect()
            })
        } else {
            (0..pieces).map(piece).collect()
        };
        // Merged in order: the first among equals wins whatever the number of threads.
        parts
            .into_iter()
            .fold(ArgBest::NONE, |a, b| a.merge(b, max))
    };
    let min_chunk = if split_pieces {
        usize::MAX
    } else {
        (64usize << 10).div_ceil(count)
    };
    for_chunks(outputs, min_chunk, |start, end| {
        walk(
            &kept.shape,
            [kept.strides[0].as_slice(), kept.strides[1].as_slice()],
            start,
            end,
            |off, len| {
                for i in 0..len as isize {
                    let base = first.get().wrapping_offset(off[1] + i * in_step);
                    let at = out.get().wrapping_offset(off[0] + i * out_step);
                    // SAFETY: `at` is an output element the plan addresses inside the compact
                    // `out`, written by this task alone.
                    unsafe { *at = one(base).index as i64 };
                }
            },
        );
    });
    drop(input);
    Ok(())
}
