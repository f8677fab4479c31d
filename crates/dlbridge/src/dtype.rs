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
    pub const fn element_bits(self) -> usize {
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
        for code in DTypeCode::ALL {
            if code.name_has_width() {
                if base == code.stem() {
                    return DType::new(code, code.fixed_bits()[0], lanes);
                }
            } else if let Some(bits) = base.strip_prefix(code.stem()) {
                if let Ok(bits) = bits.parse::<u8>() {
                    return DType::new(code, bits, lanes);
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
    fn every_code_has_a_raw_value() {
        for (i, code) in DTypeCode::ALL.into_iter().enumerate() {
            assert_eq!(code.to_raw() as usize, i);
            assert_eq!(DTypeCode::from_raw(i as u8), Some(code));
        }
    }
}
