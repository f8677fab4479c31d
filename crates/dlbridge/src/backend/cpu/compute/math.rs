//! `exp`, `log`, `sin` and `cos` of `f32` as branch-free polynomials the compiler vectorises (the
//! C library's `expf` / `logf` / `sinf` are one call per element). Each stays within 2 ulp of the
//! true value (the tests check the ranges that matter, sampled; the ignored `exhaustive` test
//! checks every `f32` and found at most 0.75 ulp for `exp`, 0.68 for `log`, 1.1 for `sin` and
//! `cos`), and treats NaN, infinities, zero and subnormals as IEEE does.
//!
//! The reductions and coefficients of `exp` and `log` are Cody and Waite's, as in the Cephes
//! library's `expf` and `logf` (minimax polynomials on `[-ln 2 / 2, ln 2 / 2]` and
//! `[sqrt(1/2) - 1, sqrt(2) - 1]`). `sin` and `cos` reduce the argument by multiples of `pi / 2`
//! in `f64` with `pi / 2` in two parts (exact enough for `|x| <= TRIG_LIMIT`), then use Cephes'
//! `sinf` / `cosf` polynomials on `[-pi / 4, pi / 4]`; larger arguments need the C library's
//! reduction, and the kernels recompute them with it ([`TRIG_LIMIT`]).
//! No fused multiply-add is used, so every CPU computes the same bits.

/// `ln 2` in two parts: the high part has few enough bits that `n * LN2_HI` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// `1.5 * 2^23`: adding it rounds an `f32` of magnitude below `2^22` to an integer, which then
/// sits in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `e^x`.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    // Beyond these e^x is 0 or infinite in f32 (the scaling below gets that right); clamping keeps
    // the exponent arithmetic in range. NaN passes through the comparisons.
    let x = x.clamp(-104.0, 89.0);
    let t = x * std::f32::consts::LOG2_E + ROUND_MAGIC;
    let n = t - ROUND_MAGIC;
    let n_int = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = x - n * LN2_HI - n * LN2_LO;
    let z = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let p = p * z + r + 1.0;
    // 2^n as two factors, each a normal number for n in -150..=128; the second product rounds
    // once where the result is subnormal, and overflows to infinity where it should.
    let n1 = n_int >> 1;
    let n2 = n_int.wrapping_sub(n1);
    let s1 = f32::from_bits((n1.wrapping_add(127) as u32).wrapping_shl(23));
    let s2 = f32::from_bits((n2.wrapping_add(127) as u32).wrapping_shl(23));
    p * s1 * s2
}

/// `ln x`.
#[inline(always)]
pub(super) fn ln_f32(x: f32) -> f32 {
    const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;
    // Subnormals are scaled into the normal range first.
    let subnormal = x < f32::MIN_POSITIVE;
    let xs = if subnormal { x * 8_388_608.0 } else { x };
    let bits = xs.to_bits();
    let e = ((bits >> 23) & 0xff) as i32 - 126 - if subnormal { 23 } else { 0 };
    // x = m * 2^e with m in [0.5, 1), then m in [sqrt(1/2), sqrt(2)) and f = m - 1.
    let m = f32::from_bits((bits & 0x007f_ffff) | 0x3f00_0000);
    let low = m < SQRT_HALF;
    let e = if low { e - 1 } else { e };
    let f = if low { m + m - 1.0 } else { m - 1.0 };
    let z = f * f;
    let p = ((((((((7.037_683_6e-2 * f - 1.151_461e-1) * f + 1.167_699_9e-1) * f
        - 1.242_014_1e-1)
        * f
        + 1.424_932_3e-1)
        * f
        - 1.666_805_8e-1)
        * f
        + 2.000_071_4e-1)
        * f
        - 2.499_999_4e-1)
        * f
        + 3.333_333e-1)
        * f
        * z;
    let ef = e as f32;
    let y = p + LN2_LO * ef - 0.5 * z;
    let r = f + y + LN2_HI * ef;
    let r = if x == f32::INFINITY { x } else { r };
    let r = if x == 0.0 { f32::NEG_INFINITY } else { r };
    if x < 0.0 || x.is_nan() { f32::NAN } else { r }
}

/// The largest `|x|` [`sin_f32`] and [`cos_f32`] reduce accurately; beyond it (and for
/// infinities) callers use `f32::sin` / `f32::cos`.
pub(super) const TRIG_LIMIT: f32 = 262_144.0;

/// `sin x` for `|x| <= TRIG_LIMIT` (NaN for NaN).
#[inline(always)]
pub(super) fn sin_f32(x: f32) -> f32 {
    sin_quadrant(x, 0)
}

/// `cos x` for `|x| <= TRIG_LIMIT` (NaN for NaN).
#[inline(always)]
pub(super) fn cos_f32(x: f32) -> f32 {
    sin_quadrant(x, 1)
}

/// `sin(x + shift * pi / 2)`.
#[inline(always)]
fn sin_quadrant(x: f32, shift: u32) -> f32 {
    // pi / 2 = PIO2_HI + PIO2_LO, PIO2_HI with 33 significant bits, so that `n * PIO2_HI` is exact
    // for |n| < 2^20 (fdlibm's pio2_1 and pio2_1t).
    const PIO2_HI: f64 = 1.570_796_326_734_125_6;
    const PIO2_LO: f64 = 6.077_100_506_506_192e-11;
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    let xd = x as f64;
    let t = xd * std::f64::consts::FRAC_2_PI + MAGIC;
    let n = t - MAGIC;
    let quadrant = (t.to_bits() as u32).wrapping_add(shift) & 3;
    let r = ((xd - n * PIO2_HI) - n * PIO2_LO) as f32;
    let z = r * r;
    let sin = r + r * z * ((-1.951_529_6e-4 * z + 8.332_161e-3) * z - 1.666_665_5e-1);
    let cos = 1.0 - 0.5 * z + z * z * ((2.443_315_7e-5 * z - 1.388_731_6e-3) * z + 4.166_664_6e-2);
    let v = if quadrant & 1 == 0 { sin } else { cos };
    if quadrant & 2 == 0 { v } else { -v }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The distance in ulp between `got` and the exact value `want`, both finite or equal.
    fn ulps(got: f32, want: f64) -> f64 {
        if got.is_nan() || want.is_nan() {
            return if got.is_nan() && want.is_nan() {
                0.0
            } else {
                f64::INFINITY
            };
        }
        let rounded = want as f32;
        if rounded.is_infinite() || got.is_infinite() {
            return if got == rounded { 0.0 } else { f64::INFINITY };
        }
        // One ulp of the correctly rounded result (the subnormal spacing at least).
        let ulp = (rounded.abs().max(f32::MIN_POSITIVE) as f64) * f32::EPSILON as f64;
        let ulp = ulp.max(2f64.powi(-149));
        ((got as f64) - want).abs() / ulp
    }

    fn check(f: fn(f32) -> f32, reference: fn(f64) -> f64, xs: impl Iterator<Item = f32>) -> f64 {
        let mut worst: (f64, f32) = (0.0, 0.0);
        for x in xs {
            let e = ulps(f(x), reference(x as f64));
            if e > worst.0 {
                worst = (e, x);
            }
        }
        assert!(worst.0 <= 2.0, "{} ulp at x = {:e}", worst.0, worst.1);
        worst.0
    }

    /// Every `step`-th f32 bit pattern, both signs.
    fn sample(step: u32) -> impl Iterator<Item = f32> {
        (0..=u32::MAX / step).flat_map(move |i| {
            let b = i * step;
            [f32::from_bits(b), -f32::from_bits(b)]
        })
    }

    #[test]
    fn exp_is_within_two_ulp() {
        check(exp_f32, f64::exp, sample(997));
        check(
            exp_f32,
            f64::exp,
            (-2_000_000..2_000_000).map(|i| i as f32 * 5e-5),
        );
        check(
            exp_f32,
            f64::exp,
            (-1000..1000).map(|i| 88.7 + i as f32 * 1e-4),
        );
        check(
            exp_f32,
            f64::exp,
            (-1000..1000).map(|i| -87.3 + i as f32 * 0.017),
        );
    }

    #[test]
    fn exp_special_values() {
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(-110.0), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(-103.0) > 0.0, "subnormal results survive");
    }

    #[test]
    fn ln_is_within_two_ulp() {
        check(ln_f32, f64::ln, sample(997).filter(|x| *x > 0.0));
        check(ln_f32, f64::ln, (1..4_000_000).map(|i| i as f32 * 1e-6));
        check(
            ln_f32,
            f64::ln,
            (0..100_000).map(|i| 1.0 + (i - 50_000) as f32 * 1e-7),
        );
    }

    #[test]
    fn ln_special_values() {
        assert_eq!(ln_f32(1.0), 0.0);
        assert_eq!(ln_f32(0.0), f32::NEG_INFINITY);
        assert_eq!(ln_f32(-0.0), f32::NEG_INFINITY);
        assert_eq!(ln_f32(f32::INFINITY), f32::INFINITY);
        assert!(ln_f32(-1.0).is_nan());
        assert!(ln_f32(f32::NEG_INFINITY).is_nan());
        assert!(ln_f32(f32::NAN).is_nan());
        let tiny = f32::from_bits(1);
        assert!((ln_f32(tiny) as f64 - (tiny as f64).ln()).abs() < 1e-5);
    }

    /// `f` where the fast path applies, the C library beyond, as the kernels do.
    fn with_limit(f: fn(f32) -> f32, slow: fn(f32) -> f32) -> impl Fn(f32) -> f32 {
        move |x| if x.abs() <= TRIG_LIMIT { f(x) } else { slow(x) }
    }

    #[test]
    fn sin_and_cos_are_within_two_ulp() {
        let sin = with_limit(sin_f32, f32::sin);
        let cos = with_limit(cos_f32, f32::cos);
        for (f, r) in [
            (&sin as &dyn Fn(f32) -> f32, f64::sin as fn(f64) -> f64),
            (&cos, f64::cos),
        ] {
            check_dyn(f, r, sample(997).filter(|x| x.abs() <= 1e6));
            check_dyn(f, r, (-2_000_000..2_000_000).map(|i| i as f32 * 1e-4));
            // Near multiples of pi / 2, where the result is tiny.
            check_dyn(
                f,
                r,
                (1..20_000).flat_map(|k| {
                    let c = (k as f64 * std::f64::consts::FRAC_PI_2) as f32;
                    [
                        c,
                        f32::from_bits(c.to_bits() + 1),
                        f32::from_bits(c.to_bits() - 1),
                    ]
                }),
            );
        }
        assert!(sin(f32::NAN).is_nan() && cos(f32::INFINITY).is_nan());
        assert_eq!(sin_f32(0.0), 0.0);
        assert_eq!(cos_f32(0.0), 1.0);
    }

    fn check_dyn(f: &dyn Fn(f32) -> f32, reference: fn(f64) -> f64, xs: impl Iterator<Item = f32>) {
        for x in xs {
            let e = ulps(f(x), reference(x as f64));
            assert!(e <= 2.0, "{e} ulp at x = {x:e}");
        }
    }

    /// Every f32 (minutes in release): `cargo test --release -p dlbridge --lib exhaustive --
    /// --ignored --nocapture`. Last run: exp 0.75 ulp, ln 0.68 ulp, sin 1.09 ulp, cos 1.10 ulp.
    #[test]
    #[ignore = "slow in debug builds; run in release"]
    fn exhaustive() {
        let e = check(exp_f32, f64::exp, sample(1));
        let l = check(ln_f32, f64::ln, sample(1).filter(|x| *x >= 0.0));
        let small = || sample(1).filter(|x| x.abs() <= TRIG_LIMIT);
        let s = check(sin_f32, f64::sin, small());
        let c = check(cos_f32, f64::cos, small());
        println!("worst: exp {e} ulp, ln {l} ulp, sin {s} ulp, cos {c} ulp");
    }
}
