//! Element types: [`DType`] and the [`Element`] trait for typed host access.

use std::fmt;
use std::str::FromStr;

use crate::dlpack::ffi::{self, DLDataType};
use crate::error::{Error, Result};

/// The kind of number an element holds: the DLPack type code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DTypeCode {
    /// Signed integer.
    Int,
    /// Unsigned integer.
    UInt,
    /// IEEE float.
    Float,
    /// Opaque pointer-sized handle.
    OpaqueHandle,
    /// Brain float.
    BFloat,
    /// Complex (bits count both parts).
    Complex,
    /// Boolean.
    Bool,
    /// 8-bit float, 3 exponent and 4 mantissa bits.
    Float8E3M4,
    /// 8-bit float, IEEE-like e4m3.
    Float8E4M3,
    /// 8-bit float e4m3, exponent bias 11, finite, no negative zero.
    Float8E4M3B11Fnuz,
    /// 8-bit float e4m3, finite (no infinities), as in the OCP spec.
    Float8E4M3Fn,
    /// 8-bit float e4m3, finite, no negative zero.
    Float8E4M3Fnuz,
    /// 8-bit float e5m2.
    Float8E5M2,
    /// 8-bit float e5m2, finite, no negative zero.
    Float8E5M2Fnuz,
    /// 8-bit exponent-only scale type.
    Float8E8M0Fnu,
    /// 6-bit float e2m3.
    Float6E2M3Fn,
    /// 6-bit float e3m2.
    Float6E3M2Fn,
    /// 4-bit float e2m1.
    Float4E2M1Fn,
}

impl DTypeCode {
    /// Every code, in DLPack order.
    pub const ALL: [DTypeCode; 18] = [
        DTypeCode::Int,
        DTypeCode::UInt,
        DTypeCode::Float,
        DTypeCode::OpaqueHandle,
        DTypeCode::BFloat,
        DTypeCode::Complex,
        DTypeCode::Bool,
        DTypeCode::Float8E3M4,
        DTypeCode::Float8E4M3,
        DTypeCode::Float8E4M3B11Fnuz,
        DTypeCode::Float8E4M3Fn,
        DTypeCode::Float8E4M3Fnuz,
        DTypeCode::Float8E5M2,
        DTypeCode::Float8E5M2Fnuz,
        DTypeCode::Float8E8M0Fnu,
        DTypeCode::Float6E2M3Fn,
        DTypeCode::Float6E3M2Fn,
        DTypeCode::Float4E2M1Fn,
    ];

    /// The DLPack `DLDataTypeCode` value.
    pub const fn to_raw(self) -> u8 {
        match self {
            DTypeCode::Int => ffi::K_DL_INT,
            DTypeCode::UInt => ffi::K_DL_UINT,
            DTypeCode::Float => ffi::K_DL_FLOAT,
            DTypeCode::OpaqueHandle => ffi::K_DL_OPAQUE_HANDLE,
            DTypeCode::BFloat => ffi::K_DL_BFLOAT,
            DTypeCode::Complex => ffi::K_DL_COMPLEX,
            DTypeCode::Bool => ffi::K_DL_BOOL,
            DTypeCode::Float8E3M4 => ffi::K_DL_FLOAT8_E3M4,
            DTypeCode::Float8E4M3 => ffi::K_DL_FLOAT8_E4M3,
            DTypeCode::Float8E4M3B11Fnuz => ffi::K_DL_FLOAT8_E4M3B11FNUZ,
            DTypeCode::Float8E4M3Fn => ffi::K_DL_FLOAT8_E4M3FN,
            DTypeCode::Float8E4M3Fnuz => ffi::K_DL_FLOAT8_E4M3FNUZ,
            DTypeCode::Float8E5M2 => ffi::K_DL_FLOAT8_E5M2,
            DTypeCode::Float8E5M2Fnuz => ffi::K_DL_FLOAT8_E5M2FNUZ,
            DTypeCode::Float8E8M0Fnu => ffi::K_DL_FLOAT8_E8M0FNU,
            DTypeCode::Float6E2M3Fn => ffi::K_DL_FLOAT6_E2M3FN,
            DTypeCode::Float6E3M2Fn => ffi::K_DL_FLOAT6_E3M2FN,
            DTypeCode::Float4E2M1Fn => ffi::K_DL_FLOAT4_E2M1FN,
        }
    }

    /// The code for a raw DLPack value, if it names one.
    pub fn from_raw(raw: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.to_raw() == raw)
    }

    /// The bit widths a lane of this code may have (`None`: any multiple of 8 up to 64).
    fn fixed_bits(self) -> &'static [u8] {
        match self {
            DTypeCode::Int | DTypeCode::UInt => &[1, 2, 4, 8, 16, 32, 64],
            DTypeCode::Float => &[16, 32, 64],
            DTypeCode::OpaqueHandle => &[64, 32],
            DTypeCode::BFloat => &[16],
            DTypeCode::Complex => &[64, 128],
            DTypeCode::Bool => &[8],
            DTypeCode::Float6E2M3Fn | DTypeCode::Float6E3M2Fn => &[6],
            DTypeCode::Float4E2M1Fn => &[4],
            _ => &[8],
        }
    }

    /// The name stem used for this code (`"int"`, `"float8_e4m3fn"`, ...).
    fn stem(self) -> &'static str {
        match self {
            DTypeCode::Int => "int",
            DTypeCode::UInt => "uint",
            DTypeCode::Float => "float",
            DTypeCode::OpaqueHandle => "handle",
            DTypeCode::BFloat => "bfloat",
            DTypeCode::Complex => "complex",
            DTypeCode::Bool => "bool",
            DTypeCode::Float8E3M4 => "float8_e3m4",
            DTypeCode::Float8E4M3 => "float8_e4m3",
            DTypeCode::Float8E4M3B11Fnuz => "float8_e4m3b11fnuz",
            DTypeCode::Float8E4M3Fn => "float8_e4m3fn",
            DTypeCode::Float8E4M3Fnuz => "float8_e4m3fnuz",
            DTypeCode::Float8E5M2 => "float8_e5m2",
            DTypeCode::Float8E5M2Fnuz => "float8_e5m2fnuz",
            DTypeCode::Float8E8M0Fnu => "float8_e8m0fnu",
            DTypeCode::Float6E2M3Fn => "float6_e2m3fn",
            DTypeCode::Float6E3M2Fn => "float6_e3m2fn",
            DTypeCode::Float4E2M1Fn => "float4_e2m1fn",
        }
    }

    /// Whether the stem already says the width (so no bit count is appended to the name).
    fn name_has_width(self) -> bool {
        !matches!(
            self,
            DTypeCode::Int
                | DTypeCode::UInt
                | DTypeCode::Float
                | DTypeCode::BFloat
                | DTypeCode::Complex
                | DTypeCode::OpaqueHandle
        )
    }
}

/// An element type: a DLPack type code, bits per lane and lanes per element.
///
/// Names follow NumPy and PyTorch: `float32`, `bfloat16`, `complex64`, `bool`, `float8_e4m3fn`;
/// vector types append the lane count (`float32x4`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DType {
    code: DTypeCode,
    bits: u8,
    lanes: u16,
}

macro_rules! scalar_dtypes {
    ($($(#[$doc:meta])* $name:ident = ($code:ident, $bits:expr);)*) => {
        impl DType {
            $($(#[$doc])* pub const $name: DType = DType { code: DTypeCode::$code, bits: $bits, lanes: 1 };)*

            /// The constants above, in order.
            const SCALARS: &'static [DType] = &[$(DType::$name),*];
        }
    };
}

scalar_dtypes! {
    /// `bool`.
    BOOL = (Bool, 8);
    /// `int8`.
    I8 = (Int, 8);
    /// `int16`.
    I16 = (Int, 16);
    /// `int32`.
    I32 = (Int, 32);
    /// `int64`.
    I64 = (Int, 64);
    /// `uint8`.
    U8 = (UInt, 8);
    /// `uint16`.
    U16 = (UInt, 16);
    /// `uint32`.
    U32 = (UInt, 32);
    /// `uint64`.
    U64 = (UInt, 64);
    /// `float16`.
    F16 = (Float, 16);
    /// `bfloat16`.
    BF16 = (BFloat, 16);
    /// `float32`.
    F32 = (Float, 32);
    /// `float64`.
    F64 = (Float, 64);
    /// `complex64` (two float32).
    C64 = (Complex, 64);
    /// `complex128` (two float64).
    C128 = (Complex, 128);
}

impl DType {
    /// Every element type with a name of its own, one lane: `bool`, the integers, floats and
    /// complex types of the constants above, then each minifloat code in DLPack order. The Python
    /// package makes each an attribute (`dlbridge.float32`), and its stub lists them
    /// (`tests/python/test_stub_dtypes.py` holds the two together).
    pub fn named() -> Vec<DType> {
        let minifloats = DTypeCode::ALL
            .into_iter()
            .filter(|&code| code.name_has_width() && code != DTypeCode::Bool)
            .map(|code| DType {
                code,
                bits: code.fixed_bits()[0],
                lanes: 1,
            });
        Self::SCALARS.iter().copied().chain(minifloats).collect()
    }

    /// A checked dtype: the code must allow `bits`, and `lanes` must be at least 1. Sub-byte
    /// widths are allowed only with one lane.
    pub fn new(code: DTypeCode, bits: u8, lanes: u16) -> Result<Self> {
        if lanes == 0 {
            return Err(Error::UnsupportedDType(format!(
                "{} with 0 lanes",
                code.stem()
            )));
        }
        if !code.fixed_bits().contains(&bits) {
            return Err(Error::UnsupportedDType(format!(
                "{} cannot have {bits} bits (allowed: {:?})",
                code.stem(),
                code.fixed_bits()
            )));
        }
        if bits < 8 && lanes != 1 {
            return Err(Error::UnsupportedDType(format!(
                "sub-byte type {}{bits} with {lanes} lanes",
                code.stem()
            )));
        }
        Ok(DType { code, bits, lanes })
    }

    /// The type code.
    pub const fn code(self) -> DTypeCode {
        self.code
    }

    /// Bits per lane.
    pub const fn bits(self) -> u8 {
        self.bits
    }

    /// Lanes per element.
    pub const fn lanes(self) -> u16 {
        self.lanes
    }

    /// Bits per element (`bits * lanes`).
    pub(crate) const fn element_bits(self) -> usize {
        self.bits as usize * self.lanes as usize
    }

    /// Whether elements are narrower than a byte (4- and 6-bit floats, sub-byte integers).
    pub const fn is_sub_byte(self) -> bool {
        self.bits < 8
    }

    /// Bytes per element as stored in memory. Sub-byte types count one byte per element here, which
    /// is their size when padded (DLPack's `IS_SUBBYTE_TYPE_PADDED`); packed sub-byte storage is
    /// described by [`Layout`](crate::Layout) separately.
    pub const fn itemsize(self) -> usize {
        if self.is_sub_byte() {
            1
        } else {
            self.element_bits() / 8
        }
    }

    /// Whether this is a floating-point type of any width (including complex).
    pub fn is_floating(self) -> bool {
        !matches!(
            self.code,
            DTypeCode::Int | DTypeCode::UInt | DTypeCode::Bool | DTypeCode::OpaqueHandle
        )
    }

    /// The canonical name (`float32`, `bfloat16`, `float8_e4m3fn`, `float32x4`, ...).
    pub fn name(self) -> String {
        let mut name = if self.code == DTypeCode::Bool && self.bits == 8 {
            "bool".to_owned()
        } else if self.code.name_has_width() {
            self.code.stem().to_owned()
        } else {
            format!("{}{}", self.code.stem(), self.bits)
        };
        if self.lanes != 1 {
            name.push_str(&format!("x{}", self.lanes));
        }
        name
    }

    /// The DLPack descriptor of this dtype.
    pub const fn to_dlpack(self) -> DLDataType {
        DLDataType {
            code: self.code.to_raw(),
            bits: self.bits,
            lanes: self.lanes,
        }
    }

    /// Validates a DLPack descriptor read from a foreign tensor.
    pub fn from_dlpack(raw: DLDataType) -> Result<Self> {
        let code = DTypeCode::from_raw(raw.code).ok_or_else(|| {
            Error::UnsupportedDType(format!(
                "DLPack type code {} (bits {}, lanes {}) is unknown",
                raw.code, raw.bits, raw.lanes
            ))
        })?;
        DType::new(code, raw.bits, raw.lanes)
    }
}

impl FromStr for DType {
    type Err = Error;

    /// Parses a canonical name, or a common alias (`float` = float64, `int` = int64, `half`,
    /// `double`, `bf16`, `f32`, `i64`, `u8`, `c64`, NumPy's `<f4`-style codes are not accepted).
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let alias = match lower.as_str() {
            "bool" | "bool_" | "b1" => Some(DType::BOOL),
            "float" | "double" | "f64" | "f8" => Some(DType::F64),
            "half" | "f16" | "f2" => Some(DType::F16),
            "f32" | "f4" | "single" => Some(DType::F32),
            "bf16" => Some(DType::BF16),
            "int" | "i64" | "i8" | "long" => Some(DType::I64),
            "i32" | "i4" => Some(DType::I32),
            "i16" | "i2" | "short" => Some(DType::I16),
            "i1" => Some(DType::I8),
            "u64" => Some(DType::U64),
            "u32" => Some(DType::U32),
            "u16" => Some(DType::U16),
            "u8" | "u1" | "byte" => Some(DType::U8),
            "c64" | "cfloat" => Some(DType::C64),
            "c128" | "cdouble" | "complex" => Some(DType::C128),
            _ => None,
        };
        if let Some(dtype) = alias {
            return Ok(dtype);
        }
        let (base, lanes) = match lower.rsplit_once('x') {
            // `float32x4`: a lane count follows a width ("complex64" has an `x` but no lanes).
            Some((base, lanes))
                if base.ends_with(|c: char| c.is_ascii_digit())
                    && !lanes.is_empty()
                    && lanes.bytes().all(|b| b.is_ascii_digit()) =>
            {
                let lanes: u16 = lanes
                    .parse()
                    .map_err(|_| Error::InvalidDType(format!("{s:?}: bad lane count")))?;
                (base, lanes)
            }
            _ => (lower.as_str(), 1),
        };
        let invalid = |e: Error| Error::InvalidDType(format!("{s:?}: {e}"));
        for code in DTypeCode::ALL {
            if code.name_has_width() {
                if base == code.stem() {
                    return DType::new(code, code.fixed_bits()[0], lanes).map_err(invalid);
                }
            } else if let Some(bits) = base.strip_prefix(code.stem()) {
                if let Ok(bits) = bits.parse::<u8>() {
                    return DType::new(code, bits, lanes).map_err(invalid);
                }
            }
        }
        Err(Error::InvalidDType(format!("{s:?} names no data type")))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl fmt::Debug for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DType({})", self.name())
    }
}

/// A Rust type that is exactly one element of a [`DType`], for typed host access.
///
/// # Safety
/// `Self` must have the size of `DTYPE.itemsize()`, no padding, and every bit pattern of that size
/// must be a valid value of `Self` (so that foreign memory can be read as `Self`).
pub unsafe trait Element: Copy + Send + Sync + 'static {
    /// The dtype whose elements are `Self`.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:expr),* $(,)?) => {$(
        // SAFETY: a primitive of exactly `itemsize` bytes with no padding for which every bit
        // pattern is a valid value.
        unsafe impl Element for $t { const DTYPE: DType = $d; }
    )*};
}

element! {
    i8 => DType::I8, i16 => DType::I16, i32 => DType::I32, i64 => DType::I64,
    u8 => DType::U8, u16 => DType::U16, u32 => DType::U32, u64 => DType::U64,
    f32 => DType::F32, f64 => DType::F64,
    half::f16 => DType::F16, half::bf16 => DType::BF16,
}

/// How a narrow float format spends its bits.
struct MiniFloat {
    exponent_bits: u32,
    mantissa_bits: u32,
    bias: i32,
    /// Infinities and NaNs as in IEEE 754 (exponent all ones).
    ieee: bool,
    /// `fn` formats: no infinities; NaN is the all-ones pattern (sign aside).
    nan_all_ones: bool,
    /// `fnuz` formats: no negative zero; NaN is the sign bit alone.
    nan_negative_zero: bool,
    /// Formats without a sign bit (`e8m0fnu`).
    unsigned: bool,
}

fn minifloat_format(dtype: DType) -> Option<MiniFloat> {
    let f = |e, m, bias, ieee, all_ones, nz| MiniFloat {
        exponent_bits: e,
        mantissa_bits: m,
        bias,
        ieee,
        nan_all_ones: all_ones,
        nan_negative_zero: nz,
        unsigned: false,
    };
    if dtype.lanes != 1 {
        return None;
    }
    Some(match dtype.code {
        DTypeCode::Float8E3M4 => f(3, 4, 3, true, false, false),
        DTypeCode::Float8E4M3 => f(4, 3, 7, true, false, false),
        DTypeCode::Float8E4M3B11Fnuz => f(4, 3, 11, false, false, true),
        DTypeCode::Float8E4M3Fn => f(4, 3, 7, false, true, false),
        DTypeCode::Float8E4M3Fnuz => f(4, 3, 8, false, false, true),
        DTypeCode::Float8E5M2 => f(5, 2, 15, true, false, false),
        DTypeCode::Float8E5M2Fnuz => f(5, 2, 16, false, false, true),
        DTypeCode::Float8E8M0Fnu => MiniFloat {
            unsigned: true,
            ..f(8, 0, 127, false, true, false)
        },
        DTypeCode::Float6E2M3Fn => f(2, 3, 1, false, false, false),
        DTypeCode::Float6E3M2Fn => f(3, 2, 3, false, false, false),
        DTypeCode::Float4E2M1Fn => f(2, 1, 1, false, false, false),
        _ => return None,
    })
}

/// Decodes one element of a float8 / float6 / float4 dtype (sub-byte values in the low bits of
/// `code`); `None` for other dtypes.
pub fn minifloat_to_f64(dtype: DType, code: u8) -> Option<f64> {
    let fmt = minifloat_format(dtype)?;
    let (e_bits, m_bits) = (fmt.exponent_bits, fmt.mantissa_bits);
    let width = e_bits + m_bits + u32::from(!fmt.unsigned);
    let code = u32::from(code) & ((1u32 << width) - 1);
    let sign_bit = if fmt.unsigned { 0 } else { 1u32 << (width - 1) };
    let negative = code & sign_bit != 0;
    let exponent = (code >> m_bits) & ((1 << e_bits) - 1);
    let mantissa = code & ((1 << m_bits) - 1);
    let e_max = (1u32 << e_bits) - 1;
    if fmt.nan_negative_zero && code == sign_bit {
        return Some(f64::NAN);
    }
    if fmt.ieee && exponent == e_max {
        return Some(if mantissa != 0 {
            f64::NAN
        } else if negative {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        });
    }
    if fmt.nan_all_ones && exponent == e_max && mantissa == (1 << m_bits) - 1 {
        return Some(f64::NAN);
    }
    let scale = 2f64.powi(-(m_bits as i32));
    let magnitude = if exponent == 0 && !fmt.unsigned {
        mantissa as f64 * scale * 2f64.powi(1 - fmt.bias)
    } else {
        (1.0 + mantissa as f64 * scale) * 2f64.powi(exponent as i32 - fmt.bias)
    };
    Some(if negative { -magnitude } else { magnitude })
}

/// Encodes a value in a float8 / float6 / float4 dtype, rounding to the nearest representable
/// value (ties to the even code); values beyond the largest finite one saturate in formats
/// without infinities. `None` for other dtypes.
pub fn f64_to_minifloat(dtype: DType, value: f64) -> Option<u8> {
    let fmt = minifloat_format(dtype)?;
    let width = fmt.exponent_bits + fmt.mantissa_bits + u32::from(!fmt.unsigned);
    let codes = 0..(1u16 << width);
    if value.is_nan() {
        return codes
            .map(|c| c as u8)
            .find(|&c| minifloat_to_f64(dtype, c).is_some_and(f64::is_nan));
    }
    let mut best: Option<(u8, f64)> = None;
    for c in codes.map(|c| c as u8) {
        let v = minifloat_to_f64(dtype, c).expect("a minifloat dtype");
        if v.is_nan() {
            continue;
        }
        let err = if v == value { 0.0 } else { (v - value).abs() };
        let better = match best {
            None => true,
            Some((bc, be)) => err < be || (err == be && c % 2 == 0 && bc % 2 == 1),
        };
        if better {
            best = Some((c, err));
        }
    }
    best.map(|(c, _)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in [
            "bool",
            "int8",
            "int64",
            "uint16",
            "float16",
            "float32",
            "float64",
            "bfloat16",
            "complex64",
            "complex128",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e8m0fnu",
            "float6_e2m3fn",
            "float4_e2m1fn",
            "float32x4",
            "int4",
        ] {
            let dtype: DType = name.parse().unwrap();
            assert_eq!(dtype.name(), name);
            assert_eq!(DType::from_dlpack(dtype.to_dlpack()).unwrap(), dtype);
        }
    }

    #[test]
    fn itemsizes() {
        assert_eq!(DType::F32.itemsize(), 4);
        assert_eq!(DType::C128.itemsize(), 16);
        assert_eq!(DType::BOOL.itemsize(), 1);
        assert_eq!("float32x4".parse::<DType>().unwrap().itemsize(), 16);
        assert_eq!("float4_e2m1fn".parse::<DType>().unwrap().itemsize(), 1);
    }

    #[test]
    fn rejects_bad_descriptors() {
        let bad = [
            DLDataType {
                code: 99,
                bits: 32,
                lanes: 1,
            },
            DLDataType {
                code: ffi::K_DL_FLOAT,
                bits: 24,
                lanes: 1,
            },
            DLDataType {
                code: ffi::K_DL_FLOAT,
                bits: 32,
                lanes: 0,
            },
            DLDataType {
                code: ffi::K_DL_BOOL,
                bits: 1,
                lanes: 1,
            },
            DLDataType {
                code: ffi::K_DL_FLOAT4_E2M1FN,
                bits: 4,
                lanes: 2,
            },
            DLDataType {
                code: ffi::K_DL_FLOAT8_E4M3FN,
                bits: 16,
                lanes: 1,
            },
        ];
        for raw in bad {
            assert!(
                matches!(DType::from_dlpack(raw), Err(Error::UnsupportedDType(_))),
                "{raw:?}"
            );
        }
        assert!(matches!(
            "floot32".parse::<DType>(),
            Err(Error::InvalidDType(_))
        ));
    }

    #[test]
    fn minifloats_decode_known_values() {
        let e4m3fn: DType = "float8_e4m3fn".parse().unwrap();
        assert_eq!(minifloat_to_f64(e4m3fn, 0x7e), Some(448.0));
        assert!(minifloat_to_f64(e4m3fn, 0x7f).unwrap().is_nan());
        assert_eq!(minifloat_to_f64(e4m3fn, 0x01), Some(2f64.powi(-9)));
        let e5m2: DType = "float8_e5m2".parse().unwrap();
        assert_eq!(minifloat_to_f64(e5m2, 0x7c), Some(f64::INFINITY));
        assert_eq!(minifloat_to_f64(e5m2, 0x7b), Some(57344.0));
        let fnuz: DType = "float8_e4m3fnuz".parse().unwrap();
        assert!(minifloat_to_f64(fnuz, 0x80).unwrap().is_nan());
        assert_eq!(minifloat_to_f64(fnuz, 0x7f), Some(240.0));
        let e8m0: DType = "float8_e8m0fnu".parse().unwrap();
        assert_eq!(minifloat_to_f64(e8m0, 127), Some(1.0));
        assert!(minifloat_to_f64(e8m0, 255).unwrap().is_nan());
        let e2m1: DType = "float4_e2m1fn".parse().unwrap();
        let all: Vec<f64> = (0..8).map(|c| minifloat_to_f64(e2m1, c).unwrap()).collect();
        assert_eq!(all, vec![0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
        assert_eq!(minifloat_to_f64(DType::F32, 0), None);
    }

    #[test]
    fn minifloats_round_trip_and_round() {
        let e4m3fn: DType = "float8_e4m3fn".parse().unwrap();
        for code in 0..=255u8 {
            let v = minifloat_to_f64(e4m3fn, code).unwrap();
            if !(v.is_nan() || v == 0.0 && code == 0x80) {
                assert_eq!(f64_to_minifloat(e4m3fn, v), Some(code), "code {code:#x}");
            }
        }
        assert_eq!(f64_to_minifloat(e4m3fn, 1e9), Some(0x7e)); // saturates at 448
        let e2m1: DType = "float4_e2m1fn".parse().unwrap();
        assert_eq!(f64_to_minifloat(e2m1, 2.4), Some(4)); // 2.0
        assert_eq!(f64_to_minifloat(e2m1, 2.5), Some(4)); // tie between 2.0 (even) and 3.0
    }

    #[test]
    fn every_code_has_a_raw_value() {
        for (i, code) in DTypeCode::ALL.into_iter().enumerate() {
            assert_eq!(code.to_raw() as usize, i);
            assert_eq!(DTypeCode::from_raw(i as u8), Some(code));
        }
    }

    #[test]
    fn every_code_but_handles_has_a_named_dtype() {
        let named = DType::named();
        for code in DTypeCode::ALL {
            assert_eq!(
                named.iter().any(|d| d.code() == code),
                code != DTypeCode::OpaqueHandle,
                "{code:?}"
            );
        }
        for d in &named {
            assert_eq!(d.name().parse::<DType>().unwrap(), *d);
        }
        let mut names: Vec<String> = named.iter().map(|d| d.name()).collect();
        names.dedup();
        assert_eq!(names.len(), named.len());
    }
}
