//! Which dtype an operation computes in and returns: the type rules, platform-free.
//!
//! | operands | result |
//! | --- | --- |
//! | two arrays of one kind (signed, unsigned, or floating) | the wider type; `float16` with `bfloat16` gives `float32` |
//! | signed with unsigned | the smallest signed type holding both (`uint64` with any signed type has none: an error) |
//! | integer with floating | the floating type (PyTorch's rule; NumPy would widen `int32 + float32` to `float64`) |
//! | array with a Python `int` | the array's type (the scalar is "weak", as in the array API and NEP 50) |
//! | array with a Python `float` | the array's type if floating, else `float64` |
//! | `div` of integers | `float64` (NumPy's true division) |
//! | `sqrt exp log sin cos` of integers | NumPy's choice: 8-bit → `float16`, 16-bit → `float32`, wider → `float64` |
//! | `bool` and complex operands | refused: no arithmetic rule is defined for them here |
//! | comparisons | as arithmetic, and `bool` too: two `bool` arrays compare as `bool`, a `bool` array with a numeric one in the numeric type, a `bool` array with a Python `int` as `bool` (0 and 1; others compare by value), with a `float` in `float64` |
//!
//! | `floor_divide remainder pow` | as arithmetic (integers stay integers) |
//!
//! Reductions: `sum` and `prod` of an integer array accumulate and return in 64 bits (`int64` /
//! `uint64`); `mean` of integers returns `float64`; `max` / `min` keep the dtype; floating sums and
//! products keep the dtype and accumulate in at least `float32`; `argmax` / `argmin` return
//! `int64` indices.

use crate::dtype::{DType, DTypeCode};
use crate::error::{Error, Result};

use super::{BinaryOp, ReduceOp, Scalar, UnaryOp};

/// The kinds of dtype arithmetic is defined on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Signed,
    Unsigned,
    Float,
}

fn kind(dtype: DType) -> Option<Kind> {
    if dtype.lanes() != 1 {
        return None;
    }
    match (dtype.code(), dtype.bits()) {
        (DTypeCode::Int, 8 | 16 | 32 | 64) => Some(Kind::Signed),
        (DTypeCode::UInt, 8 | 16 | 32 | 64) => Some(Kind::Unsigned),
        (DTypeCode::Float, 16 | 32 | 64) | (DTypeCode::BFloat, 16) => Some(Kind::Float),
        _ => None,
    }
}

/// Whether the built-in kernels compute on `dtype` (the integer types, `float16`, `bfloat16`,
/// `float32`, `float64`).
pub fn is_numeric(dtype: DType) -> bool {
    kind(dtype).is_some()
}

/// Fails unless `dtype` is one the kernels compute on, naming the operation.
pub fn require_numeric(dtype: DType, what: &str) -> Result<()> {
    if is_numeric(dtype) {
        Ok(())
    } else {
        Err(Error::UnsupportedOperand(format!(
            "{what} is not defined for {dtype}: the kernels take int8..int64, uint8..uint64, \
             float16, bfloat16, float32 and float64"
        )))
    }
}

fn signed(bits: u8) -> Option<DType> {
    match bits {
        8 => Some(DType::I8),
        16 => Some(DType::I16),
        32 => Some(DType::I32),
        64 => Some(DType::I64),
        _ => None,
    }
}

/// The common dtype of two arrays (see the module's table).
pub fn promote(a: DType, b: DType) -> Result<DType> {
    let (ka, kb) = match (kind(a), kind(b)) {
        (Some(ka), Some(kb)) => (ka, kb),
        _ => {
            let bad = if kind(a).is_none() { a } else { b };
            return Err(Error::UnsupportedOperand(format!(
                "no arithmetic rule for {bad} (operands {a} and {b})"
            )));
        }
    };
    if a == b {
        return Ok(a);
    }
    let wider = |x: DType, y: DType| if x.bits() >= y.bits() { x } else { y };
    Ok(match (ka, kb) {
        (Kind::Float, Kind::Float) => {
            if a.bits() == 16 && b.bits() == 16 {
                // float16 with bfloat16: neither holds the other.
                DType::F32
            } else {
                wider(a, b)
            }
        }
        (Kind::Float, _) => a,
        (_, Kind::Float) => b,
        (Kind::Signed, Kind::Signed) | (Kind::Unsigned, Kind::Unsigned) => wider(a, b),
        (Kind::Signed, Kind::Unsigned) | (Kind::Unsigned, Kind::Signed) => {
            let (s, u) = if ka == Kind::Signed { (a, b) } else { (b, a) };
            let need = if u.bits() >= s.bits() {
                u.bits() * 2
            } else {
                s.bits()
            };
            signed(need).ok_or_else(|| {
                Error::UnsupportedOperand(format!(
                    "no integer type holds both {a} and {b}; cast one with astype()"
                ))
            })?
        }
    })
}

/// The dtype an array of `dtype` combined with a Python scalar computes in.
pub fn promote_scalar(dtype: DType, scalar: Scalar) -> Result<DType> {
    require_numeric(dtype, "arithmetic")?;
    Ok(match (scalar, kind(dtype)) {
        (Scalar::Float(_), Some(Kind::Signed | Kind::Unsigned)) => DType::F64,
        _ => dtype,
    })
}

/// The dtype two arrays are compared in: [`promote`]'s, and for `bool` (which has no arithmetic
/// rule) `bool` with `bool`, or the other operand's numeric type.
pub fn compare_type(a: DType, b: DType) -> Result<DType> {
    match (a == DType::BOOL, b == DType::BOOL) {
        (true, true) => Ok(DType::BOOL),
        (true, false) => require_numeric(b, "comparison").map(|()| b),
        (false, true) => require_numeric(a, "comparison").map(|()| a),
        (false, false) => promote(a, b),
    }
}

/// The dtype an array of `dtype` is compared with a Python scalar in: [`promote_scalar`]'s, and
/// for a `bool` array `bool` with an `int` (see [`int_scalar_outside`]), `float64` with a `float`.
pub fn compare_scalar_type(dtype: DType, scalar: Scalar) -> Result<DType> {
    if dtype == DType::BOOL {
        return Ok(match scalar {
            Scalar::Int(_) => DType::BOOL,
            Scalar::Float(_) => DType::F64,
        });
    }
    promote_scalar(dtype, scalar)
}

/// Where an integer scalar lies when it is outside the range of the integer (or `bool`: 0 and 1)
/// dtype `dtype`, from the elements' side: `Less` (every element is below it) or `Greater`.
/// `None` when it is inside, or either is not an integer.
pub fn int_scalar_outside(dtype: DType, scalar: Scalar) -> Option<std::cmp::Ordering> {
    let Scalar::Int(v) = scalar else {
        return None;
    };
    let (lo, hi): (i128, i128) = if dtype == DType::BOOL {
        (0, 1)
    } else {
        let bits = u32::from(dtype.bits());
        match kind(dtype)? {
            Kind::Signed => (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1),
            Kind::Unsigned => (0, (1i128 << bits) - 1),
            Kind::Float => return None,
        }
    };
    let v = i128::from(v);
    if v > hi {
        Some(std::cmp::Ordering::Less)
    } else if v < lo {
        Some(std::cmp::Ordering::Greater)
    } else {
        None
    }
}

/// The dtype a binary op returns, given the operands' common dtype.
pub fn binary_result(op: BinaryOp, common: DType) -> DType {
    match (op, kind(common)) {
        (BinaryOp::Div, Some(Kind::Signed | Kind::Unsigned)) => DType::F64,
        _ => common,
    }
}

/// The dtype a unary op returns on `dtype`.
pub fn unary_result(op: UnaryOp, dtype: DType) -> Result<DType> {
    require_numeric(dtype, op.name())?;
    if op.is_transcendental() && !dtype.is_floating() {
        return Ok(match dtype.bits() {
            8 => DType::F16,
            16 => DType::F32,
            _ => DType::F64,
        });
    }
    // Everything else keeps its dtype; negating an unsigned integer wraps, as in NumPy (-1 as
    // uint8 is 255), and the kernels do the same.
    Ok(dtype)
}

/// The accumulator and result dtypes of a reduction over `dtype`.
pub fn reduce_types(op: ReduceOp, dtype: DType) -> Result<(DType, DType)> {
    require_numeric(dtype, op.name())?;
    let k = kind(dtype).expect("checked numeric");
    Ok(match (op, k) {
        (ReduceOp::Sum | ReduceOp::Prod, Kind::Signed) => (DType::I64, DType::I64),
        (ReduceOp::Sum | ReduceOp::Prod, Kind::Unsigned) => (DType::U64, DType::U64),
        (ReduceOp::Mean | ReduceOp::Var | ReduceOp::Std, Kind::Signed | Kind::Unsigned) => {
            (DType::F64, DType::F64)
        }
        (
            ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod | ReduceOp::Var | ReduceOp::Std,
            Kind::Float,
        ) => (wide_float(dtype), dtype),
        (ReduceOp::Max | ReduceOp::Min, _) => (dtype, dtype),
        (ReduceOp::ArgMax | ReduceOp::ArgMin, _) => (dtype, DType::I64),
    })
}

/// The type float arithmetic on `dtype` runs in: `float32` for the 16-bit floats, else itself.
pub fn wide_float(dtype: DType) -> DType {
    if dtype.bits() == 16 && dtype.is_floating() {
        DType::F32
    } else {
        dtype
    }
}

/// The dtype `matmul` computes in and returns: the operands' common floating type.
pub fn matmul_type(a: DType, b: DType) -> Result<DType> {
    let common = promote(a, b)?;
    if kind(common) != Some(Kind::Float) {
        return Err(Error::UnsupportedOperand(format!(
            "matmul is defined for float16, bfloat16, float32 and float64, not {common}; \
             cast with astype()"
        )));
    }
    Ok(common)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons_take_bool_and_place_outside_scalars() {
        use std::cmp::Ordering;
        assert_eq!(compare_type(DType::BOOL, DType::BOOL).unwrap(), DType::BOOL);
        assert_eq!(compare_type(DType::BOOL, DType::I8).unwrap(), DType::I8);
        assert_eq!(compare_type(DType::F16, DType::BOOL).unwrap(), DType::F16);
        assert_eq!(compare_type(DType::I8, DType::U8).unwrap(), DType::I16);
        assert!(compare_type(DType::BOOL, DType::C64).is_err());
        assert_eq!(
            compare_scalar_type(DType::BOOL, Scalar::Int(1)).unwrap(),
            DType::BOOL
        );
        assert_eq!(
            compare_scalar_type(DType::BOOL, Scalar::Float(0.5)).unwrap(),
            DType::F64
        );
        assert_eq!(
            compare_scalar_type(DType::I32, Scalar::Float(0.5)).unwrap(),
            DType::F64
        );
        let int = |v| Scalar::Int(v);
        assert_eq!(int_scalar_outside(DType::I8, int(127)), None);
        assert_eq!(int_scalar_outside(DType::I8, int(-128)), None);
        assert_eq!(
            int_scalar_outside(DType::I8, int(128)),
            Some(Ordering::Less)
        );
        assert_eq!(
            int_scalar_outside(DType::I8, int(-129)),
            Some(Ordering::Greater)
        );
        assert_eq!(
            int_scalar_outside(DType::U8, int(-1)),
            Some(Ordering::Greater)
        );
        assert_eq!(int_scalar_outside(DType::U64, int(i64::MAX)), None);
        assert_eq!(int_scalar_outside(DType::I64, int(i64::MIN)), None);
        assert_eq!(
            int_scalar_outside(DType::BOOL, int(2)),
            Some(Ordering::Less)
        );
        assert_eq!(int_scalar_outside(DType::F32, int(1 << 40)), None);
        assert_eq!(int_scalar_outside(DType::I8, Scalar::Float(1e9)), None);
    }

    #[test]
    fn same_kind_takes_the_wider() {
        assert_eq!(promote(DType::I8, DType::I32).unwrap(), DType::I32);
        assert_eq!(promote(DType::U16, DType::U8).unwrap(), DType::U16);
        assert_eq!(promote(DType::F32, DType::F64).unwrap(), DType::F64);
        assert_eq!(promote(DType::F16, DType::F32).unwrap(), DType::F32);
        assert_eq!(promote(DType::F16, DType::BF16).unwrap(), DType::F32);
        assert_eq!(promote(DType::BF16, DType::BF16).unwrap(), DType::BF16);
    }

    #[test]
    fn signed_with_unsigned_widens_or_fails() {
        assert_eq!(promote(DType::I8, DType::U8).unwrap(), DType::I16);
        assert_eq!(promote(DType::U8, DType::I16).unwrap(), DType::I16);
        assert_eq!(promote(DType::I64, DType::U32).unwrap(), DType::I64);
        assert_eq!(promote(DType::U32, DType::I32).unwrap(), DType::I64);
        let err = promote(DType::U64, DType::I8).unwrap_err();
        assert!(matches!(err, Error::UnsupportedOperand(_)), "{err}");
    }

    #[test]
    fn integers_with_floats_take_the_float() {
        assert_eq!(promote(DType::I64, DType::F16).unwrap(), DType::F16);
        assert_eq!(promote(DType::BF16, DType::U8).unwrap(), DType::BF16);
    }

    #[test]
    fn bool_and_complex_are_refused() {
        for bad in [DType::BOOL, DType::C64] {
            assert!(matches!(
                promote(bad, DType::F32),
                Err(Error::UnsupportedOperand(_))
            ));
            assert!(matches!(
                promote(DType::F32, bad),
                Err(Error::UnsupportedOperand(_))
            ));
        }
    }

    #[test]
    fn python_scalars_are_weak() {
        assert_eq!(
            promote_scalar(DType::U8, Scalar::Int(1000)).unwrap(),
            DType::U8
        );
        assert_eq!(
            promote_scalar(DType::F16, Scalar::Float(0.5)).unwrap(),
            DType::F16
        );
        assert_eq!(
            promote_scalar(DType::I32, Scalar::Float(0.5)).unwrap(),
            DType::F64
        );
    }

    #[test]
    fn results_follow_numpy() {
        assert_eq!(binary_result(BinaryOp::Div, DType::I32), DType::F64);
        assert_eq!(binary_result(BinaryOp::Div, DType::F16), DType::F16);
        assert_eq!(binary_result(BinaryOp::Add, DType::I8), DType::I8);
        assert_eq!(unary_result(UnaryOp::Sqrt, DType::U8).unwrap(), DType::F16);
        assert_eq!(unary_result(UnaryOp::Exp, DType::I16).unwrap(), DType::F32);
        assert_eq!(unary_result(UnaryOp::Log, DType::I64).unwrap(), DType::F64);
        assert_eq!(unary_result(UnaryOp::Abs, DType::I8).unwrap(), DType::I8);
        assert_eq!(
            unary_result(UnaryOp::Square, DType::BF16).unwrap(),
            DType::BF16
        );
        assert!(unary_result(UnaryOp::Sqrt, DType::BOOL).is_err());
    }

    #[test]
    fn reductions_accumulate_wide() {
        assert_eq!(
            reduce_types(ReduceOp::Sum, DType::I8).unwrap(),
            (DType::I64, DType::I64)
        );
        assert_eq!(
            reduce_types(ReduceOp::Sum, DType::U16).unwrap(),
            (DType::U64, DType::U64)
        );
        assert_eq!(
            reduce_types(ReduceOp::Mean, DType::I32).unwrap(),
            (DType::F64, DType::F64)
        );
        assert_eq!(
            reduce_types(ReduceOp::Sum, DType::F16).unwrap(),
            (DType::F32, DType::F16)
        );
        assert_eq!(
            reduce_types(ReduceOp::Mean, DType::F64).unwrap(),
            (DType::F64, DType::F64)
        );
        assert_eq!(
            reduce_types(ReduceOp::Max, DType::U8).unwrap(),
            (DType::U8, DType::U8)
        );
    }

    #[test]
    fn matmul_needs_floats() {
        assert_eq!(matmul_type(DType::BF16, DType::BF16).unwrap(), DType::BF16);
        assert_eq!(matmul_type(DType::F32, DType::I32).unwrap(), DType::F32);
        assert!(matches!(
            matmul_type(DType::I32, DType::I32),
            Err(Error::UnsupportedOperand(_))
        ));
    }
}
