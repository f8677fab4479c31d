//! Element-type conversion on the host, with NumPy's `astype` semantics (unsafe casting):
//! floats to integers truncate toward zero (saturating at the integer's range, NaN to 0), complex
//! to real drops the imaginary part, anything to bool is "non-zero".

use crate::device::Device;
use crate::dtype::{DType, DTypeCode, f64_to_minifloat, minifloat_to_f64};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A compact copy of `x` with elements converted to `dtype`, made on the host and placed back on
/// `x`'s device: the converter for every dtype (complex and the minifloats included), used for
/// CPU tensors and for the conversions a device's kernels do not make. A same-dtype cast is a
/// plain copy.
pub(crate) fn cast_tensor(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if dtype == x.dtype() {
        return x.copy();
    }
    // A compact host view is read in place; anything else is made compact on the host first.
    let compact = if x.device().is_cpu() && x.is_contiguous() && !x.is_packed() {
        x.clone()
    } else {
        x.copy_to(Device::CPU)?
    };
    let mut out = Tensor::empty(x.shape(), dtype, Device::CPU)?;
    let src = compact.host_bytes()?;
    let dst = out.host_bytes_mut()?;
    cast_bytes(src, x.dtype(), dst, dtype)?;
    if x.device().is_cpu() {
        Ok(out)
    } else {
        out.copy_to(x.device())
    }
}

/// One element, widened.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Scalar {
    /// A boolean.
    Bool(bool),
    /// A signed integer.
    Int(i64),
    /// An unsigned integer.
    UInt(u64),
    /// A real number.
    Float(f64),
    /// A complex number.
    Complex(f64, f64),
}

impl Scalar {
    fn as_f64(self) -> f64 {
        match self {
            Scalar::Bool(b) => b as u8 as f64,
            Scalar::Int(i) => i as f64,
            Scalar::UInt(u) => u as f64,
            Scalar::Float(f) | Scalar::Complex(f, _) => f,
        }
    }

    fn as_i128(self) -> i128 {
        match self {
            Scalar::Bool(b) => b as i128,
            Scalar::Int(i) => i as i128,
            Scalar::UInt(u) => u as i128,
            // `as` truncates toward zero, saturates, and maps NaN to 0.
            Scalar::Float(f) | Scalar::Complex(f, _) => f as i128,
        }
    }

    fn is_nonzero(self) -> bool {
        match self {
            Scalar::Bool(b) => b,
            Scalar::Int(i) => i != 0,
            Scalar::UInt(u) => u != 0,
            Scalar::Float(f) => f != 0.0,
            Scalar::Complex(re, im) => re != 0.0 || im != 0.0,
        }
    }
}

fn bytes<const N: usize>(b: &[u8]) -> [u8; N] {
    b[..N].try_into().expect("itemsize checked by the caller")
}

/// Reads one element of `dtype` from native-order bytes; `None` for dtypes with no numeric value
/// (opaque handles, vector types).
pub(crate) fn read_scalar(dtype: DType, b: &[u8]) -> Option<Scalar> {
    if dtype.lanes() != 1 {
        return None;
    }
    Some(match (dtype.code(), dtype.bits()) {
        (DTypeCode::Bool, 8) => Scalar::Bool(b[0] != 0),
        (DTypeCode::Int, 8) => Scalar::Int(b[0] as i8 as i64),
        (DTypeCode::Int, 16) => Scalar::Int(i16::from_ne_bytes(bytes(b)) as i64),
        (DTypeCode::Int, 32) => Scalar::Int(i32::from_ne_bytes(bytes(b)) as i64),
        (DTypeCode::Int, 64) => Scalar::Int(i64::from_ne_bytes(bytes(b))),
        (DTypeCode::UInt, 8) => Scalar::UInt(b[0] as u64),
        (DTypeCode::UInt, 16) => Scalar::UInt(u16::from_ne_bytes(bytes(b)) as u64),
        (DTypeCode::UInt, 32) => Scalar::UInt(u32::from_ne_bytes(bytes(b)) as u64),
        (DTypeCode::UInt, 64) => Scalar::UInt(u64::from_ne_bytes(bytes(b))),
        (DTypeCode::Float, 16) => Scalar::Float(half::f16::from_ne_bytes(bytes(b)).to_f64()),
        (DTypeCode::BFloat, 16) => Scalar::Float(half::bf16::from_ne_bytes(bytes(b)).to_f64()),
        (DTypeCode::Float, 32) => Scalar::Float(f32::from_ne_bytes(bytes(b)) as f64),
        (DTypeCode::Float, 64) => Scalar::Float(f64::from_ne_bytes(bytes(b))),
        (DTypeCode::Complex, 64) => Scalar::Complex(
            f32::from_ne_bytes(bytes(b)) as f64,
            f32::from_ne_bytes(bytes(&b[4..])) as f64,
        ),
        (DTypeCode::Complex, 128) => Scalar::Complex(
            f64::from_ne_bytes(bytes(b)),
            f64::from_ne_bytes(bytes(&b[8..])),
        ),
        _ => Scalar::Float(minifloat_to_f64(dtype, b[0])?),
    })
}

/// Writes `value` as one element of `dtype` into `out` (exactly `itemsize` bytes); `None` for
/// dtypes with no numeric value.
pub(crate) fn write_scalar(dtype: DType, value: Scalar, out: &mut [u8]) -> Option<()> {
    if dtype.lanes() != 1 {
        return None;
    }
    macro_rules! int {
        ($t:ty) => {{
            let v = value.as_i128();
            // Wrap like NumPy's integer casts do (e.g. int64 -> uint8 keeps the low byte).
            out.copy_from_slice(&(v as $t).to_ne_bytes());
        }};
    }
    match (dtype.code(), dtype.bits()) {
        (DTypeCode::Bool, 8) => out[0] = value.is_nonzero() as u8,
        (DTypeCode::Int, 8) => int!(i8),
        (DTypeCode::Int, 16) => int!(i16),
        (DTypeCode::Int, 32) => int!(i32),
        (DTypeCode::Int, 64) => int!(i64),
        (DTypeCode::UInt, 8) => int!(u8),
        (DTypeCode::UInt, 16) => int!(u16),
        (DTypeCode::UInt, 32) => int!(u32),
        (DTypeCode::UInt, 64) => int!(u64),
        (DTypeCode::Float, 16) => {
            out.copy_from_slice(&half::f16::from_f64(value.as_f64()).to_ne_bytes())
        }
        (DTypeCode::BFloat, 16) => {
            out.copy_from_slice(&half::bf16::from_f64(value.as_f64()).to_ne_bytes())
        }
        (DTypeCode::Float, 32) => out.copy_from_slice(&(value.as_f64() as f32).to_ne_bytes()),
        (DTypeCode::Float, 64) => out.copy_from_slice(&value.as_f64().to_ne_bytes()),
        (DTypeCode::Complex, 64) | (DTypeCode::Complex, 128) => {
            let (re, im) = match value {
                Scalar::Complex(re, im) => (re, im),
                other => (other.as_f64(), 0.0),
            };
            if dtype.bits() == 64 {
                out[..4].copy_from_slice(&(re as f32).to_ne_bytes());
                out[4..].copy_from_slice(&(im as f32).to_ne_bytes());
            } else {
                out[..8].copy_from_slice(&re.to_ne_bytes());
                out[8..].copy_from_slice(&im.to_ne_bytes());
            }
        }
        _ => out[0] = f64_to_minifloat(dtype, value.as_f64())?,
    }
    Some(())
}

/// Converts a compact host tensor's bytes from `from` to `to`, element by element.
pub(crate) fn cast_bytes(src: &[u8], from: DType, dst: &mut [u8], to: DType) -> Result<()> {
    let (a, b) = (from.itemsize(), to.itemsize());
    let unsupported = || Error::UnsupportedDType(format!("casting {from} to {to}"));
    for (s, d) in src.chunks_exact(a).zip(dst.chunks_exact_mut(b)) {
        let v = read_scalar(from, s).ok_or_else(unsupported)?;
        write_scalar(to, v, d).ok_or_else(unsupported)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cast(v: Scalar, to: DType) -> Scalar {
        let mut out = vec![0u8; to.itemsize()];
        write_scalar(to, v, &mut out).unwrap();
        read_scalar(to, &out).unwrap()
    }

    #[test]
    fn numpy_astype_semantics() {
        assert_eq!(cast(Scalar::Float(-2.7), DType::I32), Scalar::Int(-2));
        assert_eq!(cast(Scalar::Float(f64::NAN), DType::I64), Scalar::Int(0));
        assert_eq!(cast(Scalar::Int(300), DType::U8), Scalar::UInt(44));
        assert_eq!(cast(Scalar::Int(-1), DType::U16), Scalar::UInt(65535));
        assert_eq!(
            cast(Scalar::Complex(1.5, 2.0), DType::F64),
            Scalar::Float(1.5)
        );
        assert_eq!(cast(Scalar::Float(0.1), DType::BOOL), Scalar::Bool(true));
        assert_eq!(
            cast(Scalar::Bool(true), DType::C64),
            Scalar::Complex(1.0, 0.0)
        );
        assert_eq!(
            cast(Scalar::Float(1.0 / 3.0), DType::BF16),
            Scalar::Float(0.333984375)
        );
        let e4m3: DType = "float8_e4m3fn".parse().unwrap();
        assert_eq!(cast(Scalar::Float(3.3), e4m3), Scalar::Float(3.25));
    }
}
