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
    /// Every element type, in declaration order.
    #[cfg(test)]
    pub(crate) const ALL: [Elem; 13] = [
        Elem::Bool,
        Elem::I8,
        Elem::I16,
        Elem::I32,
        Elem::I64,
        Elem::U8,
        Elem::U16,
        Elem::U32,
        Elem::U64,
        Elem::F16,
        Elem::BF16,
        Elem::F32,
        Elem::F64,
    ];

    /// The element type of `dtype`, if the kernels have one (no complex types, no vectors).
    pub(crate) fn from_dtype(dtype: DType) -> Option<Elem> {
        if dtype.lanes() != 1 {
            return None;
        }
        // Which of 8, 16, 32 and 64 bits the dtype has.
        let width = [8, 16, 32, 64].iter().position(|&b| b == dtype.bits())?;
        match dtype.code() {
            DTypeCode::Bool => [Some(Elem::Bool), None, None, None][width],
            DTypeCode::Int => Some([Elem::I8, Elem::I16, Elem::I32, Elem::I64][width]),
            DTypeCode::UInt => Some([Elem::U8, Elem::U16, Elem::U32, Elem::U64][width]),
            DTypeCode::Float => [None, Some(Elem::F16), Some(Elem::F32), Some(Elem::F64)][width],
            DTypeCode::BFloat => [None, Some(Elem::BF16), None, None][width],
            _ => None,
        }
    }

    /// `e` passed to the conversion function a 16-bit float type needs (`f16` for `float16`,
    /// `bf16` for `bfloat16`: each backend names its own); `None` for the other types.
    pub(crate) fn convert_half(self, e: &str, f16: &str, bf16: &str) -> Option<String> {
        match self {
            Elem::F16 => Some(format!("{f16}({e})")),
            Elem::BF16 => Some(format!("{bf16}({e})")),
            _ => None,
        }
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
        let codes = [
            DTypeCode::Bool,
            DTypeCode::Int,
            DTypeCode::UInt,
            DTypeCode::Float,
            DTypeCode::BFloat,
            DTypeCode::Complex,
            DTypeCode::Float8E4M3Fn,
        ];
        let mut found = Vec::new();
        for code in codes {
            for bits in [1, 4, 8, 16, 32, 64, 128] {
                let Ok(dtype) = DType::new(code, bits, 1) else {
                    continue;
                };
                let Some(elem) = Elem::from_dtype(dtype) else {
                    continue;
                };
                assert_eq!(elem.size() * 8, usize::from(bits), "{dtype}");
                assert_eq!(
                    elem.is_float(),
                    matches!(code, DTypeCode::Float | DTypeCode::BFloat),
                    "{dtype}"
                );
                assert_eq!(elem.is_signed(), code == DTypeCode::Int, "{dtype}");
                assert_eq!(elem == Elem::Bool, code == DTypeCode::Bool, "{dtype}");
                assert_eq!(Elem::from_dtype(DType::new(code, bits, 2).unwrap()), None);
                found.push(elem);
            }
        }
        found.sort_by_key(|e| Elem::ALL.iter().position(|a| a == e));
        assert_eq!(
            found,
            Elem::ALL,
            "every element type, from exactly one dtype"
        );
        assert_eq!(Elem::from_dtype(DType::C64), None);
        assert_eq!(
            Elem::BF16.convert_half("x", "h", "b").as_deref(),
            Some("b(x)")
        );
        assert_eq!(Elem::F32.convert_half("x", "h", "b"), None);
    }
}
