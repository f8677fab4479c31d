//! The element types the built-in GPU kernels read and write: one enum for every backend that
//! generates kernel source. Each backend spells the types in its own language (CUDA C in
//! `backend::cuda::codegen`, MSL in `backend::metal::compute::msl`) and says which it supports.

use crate::dtype::{DType, DTypeCode};

/// An element type of the built-in kernels: the one-lane dtypes they compute on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Elem {
    /// `bool`, one byte holding 0 or 1.
    Bool,
    /// `int8`.
    I8,
    /// `int16`.
    I16,
    /// `int32`.
    I32,
    /// `int64`.
    I64,
    /// `uint8`.
    U8,
    /// `uint16`.
    U16,
    /// `uint32`.
    U32,
    /// `uint64`.
    U64,
    /// `float16`.
    F16,
    /// `bfloat16`.
    BF16,
    /// `float32`.
    F32,
    /// `float64` (not on Metal GPUs).
    F64,
}

impl Elem {
    /// The element type of `dtype`, if the kernels have one (no complex types, no vectors).
    pub(crate) fn from_dtype(dtype: DType) -> Option<Elem> {
        if dtype.lanes() != 1 {
            return None;
        }
        Some(match (dtype.code(), dtype.bits()) {
            (DTypeCode::Bool, 8) => Elem::Bool,
            (DTypeCode::Int, 8) => Elem::I8,
            (DTypeCode::Int, 16) => Elem::I16,
            (DTypeCode::Int, 32) => Elem::I32,
            (DTypeCode::Int, 64) => Elem::I64,
            (DTypeCode::UInt, 8) => Elem::U8,
            (DTypeCode::UInt, 16) => Elem::U16,
            (DTypeCode::UInt, 32) => Elem::U32,
            (DTypeCode::UInt, 64) => Elem::U64,
            (DTypeCode::Float, 16) => Elem::F16,
            (DTypeCode::BFloat, 16) => Elem::BF16,
            (DTypeCode::Float, 32) => Elem::F32,
            (DTypeCode::Float, 64) => Elem::F64,
            _ => return None,
        })
    }

    /// A short name for kernel names (`"f32"`, `"bf16"`, ...).
    pub(crate) const fn tag(self) -> &'static str {
        match self {
            Elem::Bool => "bool",
            Elem::I8 => "i8",
            Elem::I16 => "i16",
            Elem::I32 => "i32",
            Elem::I64 => "i64",
            Elem::U8 => "u8",
            Elem::U16 => "u16",
            Elem::U32 => "u32",
            Elem::U64 => "u64",
            Elem::F16 => "f16",
            Elem::BF16 => "bf16",
            Elem::F32 => "f32",
            Elem::F64 => "f64",
        }
    }

    /// Bytes per element.
    pub(crate) const fn size(self) -> usize {
        match self {
            Elem::Bool | Elem::I8 | Elem::U8 => 1,
            Elem::I16 | Elem::U16 | Elem::F16 | Elem::BF16 => 2,
            Elem::I32 | Elem::U32 | Elem::F32 => 4,
            Elem::I64 | Elem::U64 | Elem::F64 => 8,
        }
    }

    /// Whether the type is floating.
    pub(crate) const fn is_float(self) -> bool {
        matches!(self, Elem::F16 | Elem::BF16 | Elem::F32 | Elem::F64)
    }

    /// Whether the type is a signed integer.
    pub(crate) const fn is_signed(self) -> bool {
        matches!(self, Elem::I8 | Elem::I16 | Elem::I32 | Elem::I64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_lane_dtypes_map_to_elements() {
        assert_eq!(Elem::from_dtype(DType::F64), Some(Elem::F64));
        assert_eq!(Elem::from_dtype(DType::BF16).map(Elem::size), Some(2));
        assert_eq!(Elem::from_dtype(DType::BOOL), Some(Elem::Bool));
        assert_eq!(Elem::from_dtype(DType::C64), None);
        assert!(Elem::F16.is_float() && !Elem::I8.is_float());
        assert!(Elem::I64.is_signed() && !Elem::U64.is_signed() && !Elem::F32.is_signed());
    }
}
