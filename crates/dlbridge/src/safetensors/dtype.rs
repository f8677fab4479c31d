//! The safetensors dtype names and the [`DType`] each one is.

use crate::dtype::{DType, DTypeCode};

/// A safetensors dtype name with its [`DType`], or the DLPack code and bits to build one from
/// (the float8, float6 and float4 types have no associated constant).
struct Entry {
    name: &'static str,
    code: DTypeCode,
    bits: u8,
}

/// Every dtype the `safetensors` package (0.8) writes. Sub-byte types (`F4`, `F6_*`) are stored
/// densely packed, element `i` starting at bit `i * bits` (DLPack's packed order).
const TABLE: [Entry; 22] = [
    e("BOOL", DTypeCode::Bool, 8),
    e("U8", DTypeCode::UInt, 8),
    e("I8", DTypeCode::Int, 8),
    e("U16", DTypeCode::UInt, 16),
    e("I16", DTypeCode::Int, 16),
    e("U32", DTypeCode::UInt, 32),
    e("I32", DTypeCode::Int, 32),
    e("U64", DTypeCode::UInt, 64),
    e("I64", DTypeCode::Int, 64),
    e("F16", DTypeCode::Float, 16),
    e("BF16", DTypeCode::BFloat, 16),
    e("F32", DTypeCode::Float, 32),
    e("F64", DTypeCode::Float, 64),
    e("C64", DTypeCode::Complex, 64),
    // PyTorch's float8_e4m3fn is what the package writes as F8_E4M3.
    e("F8_E4M3", DTypeCode::Float8E4M3Fn, 8),
    e("F8_E5M2", DTypeCode::Float8E5M2, 8),
    e("F8_E4M3FNUZ", DTypeCode::Float8E4M3Fnuz, 8),
    e("F8_E5M2FNUZ", DTypeCode::Float8E5M2Fnuz, 8),
    e("F8_E8M0", DTypeCode::Float8E8M0Fnu, 8),
    e("F6_E2M3", DTypeCode::Float6E2M3Fn, 6),
    e("F6_E3M2", DTypeCode::Float6E3M2Fn, 6),
    e("F4", DTypeCode::Float4E2M1Fn, 4),
];

const fn e(name: &'static str, code: DTypeCode, bits: u8) -> Entry {
    Entry { name, code, bits }
}

/// The [`DType`] a safetensors dtype name (`"F32"`, `"BF16"`, `"F8_E4M3"`, ...) stands for;
/// `None` for a name the format does not define.
pub fn dtype_from_name(name: &str) -> Option<DType> {
    let entry = TABLE.iter().find(|entry| entry.name == name)?;
    DType::new(entry.code, entry.bits, 1).ok()
}

/// The safetensors name of `dtype`; `None` for a dtype the format cannot hold (vector types,
/// `complex128`, `float8_e3m4`, sub-byte integers, ...).
pub fn dtype_name(dtype: DType) -> Option<&'static str> {
    if dtype.lanes() != 1 {
        return None;
    }
    TABLE
        .iter()
        .find(|entry| entry.code == dtype.code() && entry.bits == dtype.bits())
        .map(|entry| entry.name)
}

/// Every safetensors dtype name, in the order above.
pub fn dtype_names() -> impl Iterator<Item = &'static str> {
    TABLE.iter().map(|entry| entry.name)
}
