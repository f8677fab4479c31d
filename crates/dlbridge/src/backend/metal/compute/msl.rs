//! The Metal Shading Language source of the built-in kernels, generated per kernel variant
//! ([`MapVariant`], [`ReduceVariant`], [`MatmulVariant`]). Each variant is one small library with
//! one `kernel` function, compiled once per device by the runtime.
//!
//! | dtype | stored as | computed in |
//! | --- | --- | --- |
//! | `int8` .. `int64`, `uint8` .. `uint64` | `char` .. `long`, `uchar` .. `ulong` | itself; `+ - *` in the unsigned type of the same width, so that overflow wraps (signed overflow is undefined in MSL's C++) |
//! | `float16` | `half` | `float` |
//! | `bfloat16` | `ushort` (bits), converted by hand | `float` |
//! | `float32` | `float` | `float` |
//! | `bool` (casts only) | `uchar` 0 / 1 | — |
//!
//! `bfloat16` is kept as `ushort` with a hand-written conversion (widening is a shift; narrowing
//! rounds to nearest-even, NaN stays NaN) rather than MSL's `bfloat`, which needs MSL 3.1
//! (macOS 14): the kernels then run on every Metal GPU. The libraries are compiled with fast math
//! off, so NaN and infinities follow IEEE 754 (`max`/`min` propagate NaN; `0/0` is NaN).

use std::fmt::Write as _;

use super::dispatch::{
    MAP_PARAMS_INDEX, MATMUL_K_TILE, MATMUL_THREADS, MATMUL_TILE, MAX_DIMS, MapLayout, MapVariant,
    MatmulVariant, ReduceInput, ReduceKind, ReduceOutput, ReduceVariant, Work,
};
use crate::compute::{BinaryOp, MapOp, ReduceOp, UnaryOp};
use crate::dtype::DType;
use crate::error::{Error, Result};

pub(crate) use crate::compute::Elem;

impl Elem {
    /// The element type of `dtype` on Metal, or an error naming the dtype and the operation
    /// `what`: `float64` in particular, which Metal GPUs do not have.
    pub(crate) fn of(dtype: DType, what: &str) -> Result<Elem> {
        match Elem::from_dtype(dtype) {
            Some(Elem::F64) => Err(Error::UnsupportedDType(format!(
                "{what} on Metal: float64 is not supported by Metal GPUs (they have no 64-bit \
                 floating point); cast to float32 with astype() first (integer division, integer \
                 means and transcendental functions of wide integers produce float64)"
            ))),
            Some(elem) => Ok(elem),
            None => Err(Error::UnsupportedDType(format!(
                "{what} on Metal is not defined for {dtype}: the Metal kernels take int8..int64, \
                 uint8..uint64, float16, bfloat16 and float32"
            ))),
        }
    }
}

/// How an element type is spelled in MSL. `float64` never reaches a Metal kernel
/// ([`Elem::of`] refuses it); it is spelled `double` only to keep the matches whole.
pub(crate) trait MslType {
    /// The MSL type elements are stored as.
    fn storage(self) -> &'static str;
    /// The unsigned MSL type of the same size (for bit patterns and wrapping arithmetic).
    fn bits_type(self) -> &'static str;
    /// The unsigned type integer arithmetic is carried out in: wide enough that the operation
    /// itself cannot overflow a signed `int` after C++'s integral promotions.
    fn wide_unsigned(self) -> &'static str;
    /// The MSL type values are computed in.
    fn compute(self) -> &'static str;
    /// `e` (of the storage type) as the compute type.
    fn load(self, e: &str) -> String;
    /// `e` (of the compute type) as the storage type.
    fn store(self, e: &str) -> String;
    /// `a OP b` for integers, wrapping: computed in the wide unsigned type, truncated to the
    /// element's width, reinterpreted as the element type.
    fn wrapping(self, a: &str, op: char, b: &str) -> String;
}

impl MslType for Elem {
    fn storage(self) -> &'static str {
        match self {
            Elem::Bool | Elem::U8 => "uchar",
            Elem::I8 => "char",
            Elem::I16 => "short",
            Elem::U16 | Elem::BF16 => "ushort",
            Elem::I32 => "int",
            Elem::U32 => "uint",
            Elem::I64 => "long",
            Elem::U64 => "ulong",
            Elem::F16 => "half",
            Elem::F32 => "float",
            Elem::F64 => "double",
        }
    }

    fn bits_type(self) -> &'static str {
        match self.size() {
            1 => "uchar",
            2 => "ushort",
            4 => "uint",
            _ => "ulong",
        }
    }

    fn wide_unsigned(self) -> &'static str {
        if self.size() == 8 { "ulong" } else { "uint" }
    }

    fn compute(self) -> &'static str {
        if self.is_float() {
            "float"
        } else {
            self.storage()
        }
    }

    fn load(self, e: &str) -> String {
        self.convert_half(e, "float", "dlb_bf16_to_float")
            .unwrap_or_else(|| e.to_string())
    }

    fn store(self, e: &str) -> String {
        self.convert_half(e, "half", "dlb_float_to_bf16")
            .unwrap_or_else(|| e.to_string())
    }

    fn wrapping(self, a: &str, op: char, b: &str) -> String {
        let w = self.wide_unsigned();
        format!(
            "as_type<{t}>({u}({w}({a}) {op} {w}({b})))",
            t = self.storage(),
            u = self.bits_type()
        )
    }
}

/// The head of every library: the standard library and the conversion helpers.
const PRELUDE: &str = r#"#include <metal_stdlib>
using namespace metal;

// bfloat16 is stored as its bits: widening is exact, narrowing rounds to nearest-even and keeps
// NaN a (quiet) NaN.
inline float dlb_bf16_to_float(ushort x) {
    return as_type<float>(uint(x) << 16);
}
inline ushort dlb_float_to_bf16(float f) {
    uint u = as_type<uint>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return ushort((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return ushort(u >> 16);
}

// NumPy's floor_divide and remainder of floats (npy_divmod): the floored quotient, and the
// remainder with the divisor's sign, from fmod.
inline float dlb_floor_divide(float a, float b) {
    if (b == 0.0f) {
        return a / b;
    }
    float m = fmod(a, b);
    float div = (a - m) / b;
    if (m != 0.0f && ((b < 0.0f) != (m < 0.0f))) {
        div -= 1.0f;
    }
    if (div != 0.0f) {
        float f = floor(div);
        return (div - f > 0.5f) ? f + 1.0f : f;
    }
    return copysign(0.0f, a / b);
}
inline float dlb_remainder(float a, float b) {
    float m = fmod(a, b);
    if (b == 0.0f) {
        return m;
    }
    if (m != 0.0f) {
        if ((b < 0.0f) != (m < 0.0f)) {
            m += b;
        }
    } else {
        m = copysign(0.0f, b);
    }
    return m;
}
// Integer floor division and remainder for a divisor other than 0 and -1 (no overflow).
template <typename T> inline T dlb_floor_div_int(T a, T b) {
    T q = T(a / b);
    return (T(a % b) != T(0) && ((a < T(0)) != (b < T(0)))) ? T(q - T(1)) : q;
}
template <typename T> inline T dlb_remainder_int(T a, T b) {
    T r = T(a % b);
    return (r != T(0) && ((r < T(0)) != (b < T(0)))) ? T(r + b) : r;
}
// base ** e wrapping in the unsigned type U (square and multiply).
template <typename U> inline U dlb_pow_bits(U base, ulong e) {
    U r = U(1);
    while (e != 0ul) {
        if ((e & 1ul) != 0ul) {
            r *= base;
        }
        base *= base;
        e >>= 1;
    }
    return r;
}

// The low 64 bits of `f` truncated toward zero into a saturating 128-bit integer (NaN: 0): what
// NumPy's and Rust's float-to-integer casts keep before wrapping to the target width.
inline ulong dlb_float_to_bits(float f) {
    if (isnan(f)) {
        return 0ul;
    }
    float a = fabs(f);
    if (a < 9223372036854775808.0f) {
        return as_type<ulong>(long(f));
    }
    if (a >= 170141183460469231731687303715884105728.0f) {
        return f > 0.0f ? 0xfffffffffffffffful : 0ul;
    }
    // |f| >= 2^63: an integer m * 2^s, m of 24 bits and s from 40 up
    uint u = as_type<uint>(a);
    uint s = (u >> 23) - 150u;
    ulong m = ulong((u & 0x7fffffu) | 0x800000u);
    ulong bits = s < 64u ? (m << s) : 0ul;
    return f < 0.0f ? (0ul - bits) : bits;
}
"#;

/// The MSL declaration of `MapParams` (mirrors [`super::dispatch::MapParams`]).
fn map_params_struct() -> String {
    format!(
        "struct MapParams {{\n    ulong count;\n    uint ndim;\n    uint pad;\n    \
         ulong scalar[2];\n    long first[3];\n    ulong shape[{MAX_DIMS}];\n    \
         long strides[3][{MAX_DIMS}];\n}};\n"
    )
}

/// The MSL declaration of `ReduceParams` (mirrors [`super::dispatch::ReduceParams`]).
fn reduce_params_struct() -> String {
    format!(
        "struct ReduceParams {{\n    ulong outputs;\n    ulong count;\n    ulong splits;\n    \
         ulong chunk;\n    long in_first;\n    long out_first;\n    uint kept_ndim;\n    \
         uint red_ndim;\n    float divisor;\n    uint pad;\n    ulong kept_shape[{MAX_DIMS}];\n    \
         long kept_strides[{MAX_DIMS}];\n    ulong red_shape[{MAX_DIMS}];\n    \
         long red_strides[{MAX_DIMS}];\n}};\n"
    )
}

/// The MSL declaration of `MatmulParams` (mirrors [`super::dispatch::MatmulParams`]).
const MATMUL_PARAMS_STRUCT: &str = "struct MatmulParams {\n    ulong batch;\n    ulong m;\n    \
     ulong n;\n    ulong k;\n    long a_batch;\n    long a_row;\n    long a_col;\n    \
     long b_batch;\n    long b_row;\n    long b_col;\n    uint a_k_contiguous;\n    \
     uint b_n_contiguous;\n};\n";

/// The index and offset types of a strided kernel: 32-bit where every index and offset fits.
fn index_types(wide: bool) -> &'static str {
    if wide {
        "typedef ulong dlb_idx;\ntypedef long dlb_off;\n"
    } else {
        "typedef uint dlb_idx;\ntypedef int dlb_off;\n"
    }
}

/// The expression of an element-wise op on loaded values `args` (of `elem`'s compute type).
fn map_expr(op: MapOp, elem: Elem, args: &[&str]) -> Result<String> {
    let unsupported = |what: &str| {
        Err(Error::UnsupportedDType(format!(
            "{what} of {} has no Metal kernel (the front converts such operands to a floating \
             type first)",
            elem.tag()
        )))
    };
    if elem == Elem::Bool {
        return unsupported("arithmetic");
    }
    let float = elem.is_float();
    Ok(match op {
        MapOp::Unary(u) => {
            let a = args[0];
            match u {
                UnaryOp::Sqrt | UnaryOp::Exp | UnaryOp::Log | UnaryOp::Sin | UnaryOp::Cos
                    if !float =>
                {
                    return unsupported(u.name());
                }
                UnaryOp::Sqrt => format!("precise::sqrt({a})"),
                UnaryOp::Exp => format!("precise::exp({a})"),
                UnaryOp::Log => format!("precise::log({a})"),
                UnaryOp::Sin => format!("precise::sin({a})"),
                UnaryOp::Cos => format!("precise::cos({a})"),
                UnaryOp::Abs if float => format!("fabs({a})"),
                UnaryOp::Abs if elem.is_signed() => {
                    format!("({a} < 0 ? {} : {a})", elem.wrapping("0", '-', a))
                }
                UnaryOp::Abs => a.to_string(),
                UnaryOp::Square if float => format!("({a} * {a})"),
                UnaryOp::Square => elem.wrapping(a, '*', a),
                UnaryOp::Negative if float => format!("(-{a})"),
                UnaryOp::Negative => elem.wrapping("0", '-', a),
            }
        }
        MapOp::Binary(b) => {
            let (x, y) = (args[0], args[1]);
            let t = elem.storage();
            let sym = match b {
                BinaryOp::Add => '+',
                BinaryOp::Sub => '-',
                BinaryOp::Mul => '*',
                BinaryOp::Div => '/',
                BinaryOp::FloorDiv if float => return Ok(format!("dlb_floor_divide({x}, {y})")),
                BinaryOp::Mod if float => return Ok(format!("dlb_remainder({x}, {y})")),
                BinaryOp::Pow if float => return Ok(format!("precise::pow({x}, {y})")),
                // Integers: 0 for a zero divisor (NumPy's values); the most negative value
                // divided by -1 wraps to itself, and its remainder is 0.
                BinaryOp::FloorDiv if elem.is_signed() => {
                    return Ok(format!(
                        "(({y}) == {t}(0) ? {t}(0) : ({y}) == {t}(-1) ? {} : \
                         dlb_floor_div_int({x}, {y}))",
                        elem.wrapping("0", '-', x)
                    ));
                }
                BinaryOp::FloorDiv => {
                    return Ok(format!("(({y}) == {t}(0) ? {t}(0) : {t}(({x}) / ({y})))"));
                }
                BinaryOp::Mod if elem.is_signed() => {
                    return Ok(format!(
                        "((({y}) == {t}(0) || ({y}) == {t}(-1)) ? {t}(0) : \
                         dlb_remainder_int({x}, {y}))"
                    ));
                }
                BinaryOp::Mod => {
                    return Ok(format!("(({y}) == {t}(0) ? {t}(0) : {t}(({x}) % ({y})))"));
                }
                BinaryOp::Pow => {
                    // Square and multiply in the wide unsigned type, truncated to the width (a
                    // negative exponent never comes: the front refuses it).
                    let w = elem.wide_unsigned();
                    let power = format!(
                        "as_type<{t}>({}(dlb_pow_bits({w}({x}), ulong({y}))))",
                        elem.bits_type()
                    );
                    return Ok(if elem.is_signed() {
                        format!("(({y}) < {t}(0) ? {t}(0) : {power})")
                    } else {
                        power
                    });
                }
            };
            if float {
                format!("({x} {sym} {y})")
            } else if b == BinaryOp::Div {
                return unsupported("integer division");
            } else {
                elem.wrapping(x, sym, y)
            }
        }
        MapOp::Cast | MapOp::Compare(_) => {
            return Err(Error::InvalidArgument(format!(
                "{} is not arithmetic",
                op.name()
            )));
        }
    })
}

/// `x` (loaded: of `from`'s compute type) converted to `to`'s storage type, by NumPy's `astype`
/// rules: floats truncate toward zero into integers (NaN to 0), integers wrap, anything non-zero
/// is `true`.
fn cast_expr(from: Elem, to: Elem, x: &str) -> String {
    match to {
        Elem::Bool if from.is_float() => format!("uchar({x} != 0.0f)"),
        Elem::Bool => format!("uchar({x} != 0)"),
        _ if to.is_float() && from.is_float() => to.store(x),
        _ if to.is_float() => to.store(&format!("float({x})")),
        _ => {
            let bits = if from.is_float() {
                format!("dlb_float_to_bits({x})")
            } else {
                format!("ulong({x})")
            };
            format!("as_type<{}>({}({bits}))", to.storage(), to.bits_type())
        }
    }
}

/// The source of an element-wise kernel variant.
pub(crate) fn map_source(v: &MapVariant) -> Result<String> {
    let arity = v.scalars.len();
    let args: Vec<String> = (0..arity).map(|k| format!("a{k}")).collect();
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let value = match v.op {
        MapOp::Cast => cast_expr(v.input, v.out, arg_refs[0]),
        // IEEE 754 on the loaded (float, for the 16-bit floats) values: NaN is unequal to all.
        MapOp::Compare(c) => format!("uchar({} {} {})", arg_refs[0], c.symbol(), arg_refs[1]),
        op => v.out.store(&map_expr(op, v.out, &arg_refs)?),
    };
    let mut s = String::from(PRELUDE);
    s.push('\n');
    s.push_str(&map_params_struct());
    let strided = match v.layout {
        MapLayout::Flat => false,
        MapLayout::Strided { wide } => {
            s.push_str(index_types(wide));
            true
        }
    };
    let name = v.name();
    let _ = write!(
        s,
        "\nkernel void {name}(device {}* out [[buffer(0)]],\n",
        v.out.storage()
    );
    for (k, &scalar) in v.scalars.iter().enumerate() {
        if !scalar {
            let _ = writeln!(
                s,
                "                 device const {}* in{k} [[buffer({})]],",
                v.input.storage(),
                k + 1
            );
        }
    }
    let _ = write!(
        s,
        "                 constant MapParams& p [[buffer({MAP_PARAMS_INDEX})]],\n\
         \x20                uint gid [[thread_position_in_grid]],\n\
         \x20                uint grid [[threads_per_grid]]) {{\n"
    );
    let ct = v.input.compute();
    // Scalars are loaded once, from their bits.
    for (k, &scalar) in v.scalars.iter().enumerate() {
        if scalar {
            let raw = format!(
                "as_type<{}>({}(p.scalar[{k}]))",
                v.input.storage(),
                v.input.bits_type()
            );
            let _ = writeln!(s, "    const {ct} a{k} = {};", v.input.load(&raw));
        }
    }
    if strided {
        s.push_str(
            "    for (dlb_idx i = gid; i < dlb_idx(p.count); i += grid) {\n        \
             dlb_idx rest = i;\n",
        );
        let mut used = vec![0usize];
        used.extend((0..arity).filter(|&k| !v.scalars[k]).map(|k| k + 1));
        for &j in &used {
            let _ = writeln!(s, "        dlb_off o{j} = dlb_off(p.first[{j}]);");
        }
        s.push_str(
            "        for (int d = int(p.ndim) - 1; d >= 0; --d) {\n            \
             dlb_idx n = dlb_idx(p.shape[d]);\n            dlb_idx c = rest % n;\n            \
             rest /= n;\n",
        );
        for &j in &used {
            let _ = writeln!(
                s,
                "            o{j} += dlb_off(c) * dlb_off(p.strides[{j}][d]);"
            );
        }
        s.push_str("        }\n");
        for (k, &scalar) in v.scalars.iter().enumerate() {
            if !scalar {
                let _ = writeln!(
                    s,
                    "        const {ct} a{k} = {};",
                    v.input.load(&format!("in{k}[o{}]", k + 1))
                );
            }
        }
        let _ = writeln!(s, "        out[o0] = {value};\n    }}\n}}");
    } else {
        s.push_str("    for (ulong i = gid; i < p.count; i += grid) {\n");
        for (k, &scalar) in v.scalars.iter().enumerate() {
            if !scalar {
                let _ = writeln!(
                    s,
                    "        const {ct} a{k} = {};",
                    v.input.load(&format!("in{k}[i]"))
                );
            }
        }
        let _ = writeln!(s, "        out[i] = {value};\n    }}\n}}");
    }
    Ok(s)
}

impl Work {
    /// The MSL type.
    pub(crate) const fn msl(self) -> &'static str {
        match self {
            Work::Float => "float",
            Work::Int => "int",
            Work::UInt => "uint",
            Work::Long => "long",
            Work::ULong => "ulong",
        }
    }

    /// The identity of `op` in this type.
    fn identity(self, op: ReduceOp) -> &'static str {
        match (op, self) {
            (ReduceOp::Sum | ReduceOp::Mean, Work::Float) => "0.0f",
            (ReduceOp::Sum | ReduceOp::Mean, Work::Int | Work::Long) => "0",
            (ReduceOp::Sum | ReduceOp::Mean, Work::UInt) => "0u",
            (ReduceOp::Sum | ReduceOp::Mean, Work::ULong) => "0ul",
            (ReduceOp::Max, Work::Float) => "(-INFINITY)",
            (ReduceOp::Max, Work::Int) => "(-2147483647 - 1)",
            (ReduceOp::Max, Work::UInt) => "0u",
            (ReduceOp::Max, Work::Long) => "(-9223372036854775807L - 1L)",
            (ReduceOp::Max, Work::ULong) => "0ul",
            (ReduceOp::Min, Work::Float) => "INFINITY",
            (ReduceOp::Min, Work::Int) => "2147483647",
            (ReduceOp::Min, Work::UInt) => "0xffffffffu",
            (ReduceOp::Min, Work::Long) => "9223372036854775807L",
            (ReduceOp::Min, Work::ULong) => "0xfffffffffffffffful",
            (ReduceOp::Prod, Work::Float) => "1.0f",
            (ReduceOp::Prod, Work::Int | Work::Long) => "1",
            (ReduceOp::Prod, Work::UInt) => "1u",
            (ReduceOp::Prod, Work::ULong) => "1ul",
            // Never compiled: `work_type` refuses the arg reductions, `var` and `std` (the front
            // composes them).
            (ReduceOp::ArgMax | ReduceOp::ArgMin | ReduceOp::Var | ReduceOp::Std, _) => "0",
        }
    }

    /// The body of `combine(a, b)`.
    fn combine(self, op: ReduceOp) -> &'static str {
        match (op, self) {
            (ReduceOp::Sum | ReduceOp::Mean, Work::Long) => {
                "as_type<long>(as_type<ulong>(a) + as_type<ulong>(b))"
            }
            (ReduceOp::Sum | ReduceOp::Mean, Work::Int) => {
                "as_type<int>(as_type<uint>(a) + as_type<uint>(b))"
            }
            (ReduceOp::Sum | ReduceOp::Mean, _) => "a + b",
            (ReduceOp::Max, Work::Float) => "(isnan(a) || a > b) ? a : b",
            (ReduceOp::Min, Work::Float) => "(isnan(a) || a < b) ? a : b",
            (ReduceOp::Max, _) => "a > b ? a : b",
            (ReduceOp::Min, _) => "a < b ? a : b",
            (ReduceOp::Prod, Work::Long) => "as_type<long>(as_type<ulong>(a) * as_type<ulong>(b))",
            (ReduceOp::Prod, Work::Int) => "as_type<int>(as_type<uint>(a) * as_type<uint>(b))",
            (ReduceOp::Prod, _) => "a * b",
            // Never compiled: `work_type` refuses the arg reductions, `var` and `std`.
            (ReduceOp::ArgMax | ReduceOp::ArgMin | ReduceOp::Var | ReduceOp::Std, _) => "a",
        }
    }

    /// The body of `simd_reduce(v, width)`: the SIMD-group intrinsics where their semantics fit,
    /// else a butterfly of `simd_shuffle_xor` over the value's 32-bit halves.
    fn simd_reduce(self, op: ReduceOp) -> &'static str {
        match (op, self) {
            (ReduceOp::Sum | ReduceOp::Mean, Work::Float) => "    return simd_sum(v);\n",
            // simd_max / simd_min ignore NaN; NaN is propagated separately.
            (ReduceOp::Max, Work::Float) => {
                "    float m = simd_max(v);\n    return simd_any(isnan(v)) ? NAN : m;\n"
            }
            (ReduceOp::Min, Work::Float) => {
                "    float m = simd_min(v);\n    return simd_any(isnan(v)) ? NAN : m;\n"
            }
            (ReduceOp::Max, Work::Int | Work::UInt) => "    return simd_max(v);\n",
            (ReduceOp::Min, Work::Int | Work::UInt) => "    return simd_min(v);\n",
            _ => {
                "    for (uint m = width / 2; m > 0; m >>= 1) {\n        \
                 v = dlb_combine(v, dlb_shuffle_xor(v, ushort(m)));\n    }\n    return v;\n"
            }
        }
    }
}

/// The source of a reduction kernel variant.
pub(crate) fn reduce_source(v: &ReduceVariant) -> Result<String> {
    let w = v.work.msl();
    let (in_type, load) = match v.input {
        ReduceInput::Tensor(e) => {
            let loaded = e.load("x");
            let load = if e.is_float() {
                loaded
            } else {
                format!("{w}({loaded})")
            };
            (e.storage(), load)
        }
        ReduceInput::Partials => (w, "x".to_string()),
    };
    let (out_type, finish) = match v.output {
        ReduceOutput::Partials => (w, "r".to_string()),
        ReduceOutput::Final(e) => {
            let value = match (v.op, v.work) {
                (ReduceOp::Mean, Work::Float) => "r / p.divisor".to_string(),
                (ReduceOp::Mean, _) => {
                    return Err(Error::UnsupportedDType(
                        "an integer mean on Metal (its float64 result is not supported)".into(),
                    ));
                }
                _ => "r".to_string(),
            };
            let stored = if e.is_float() {
                e.store(&value)
            } else {
                format!("{}({value})", e.storage())
            };
            (e.storage(), stored)
        }
    };
    let mut s = String::from(PRELUDE);
    s.push('\n');
    s.push_str(&reduce_params_struct());
    s.push_str(index_types(v.wide));
    let identity = v.work.identity(v.op);
    let _ = write!(
        s,
        "\n#define DLB_IDENTITY {identity}\n\
         inline {w} dlb_combine({w} a, {w} b) {{\n    return {};\n}}\n\
         inline {w} dlb_load({in_type} x) {{\n    return {load};\n}}\n\
         inline {w} dlb_shuffle_xor({w} v, ushort m) {{\n",
        v.work.combine(v.op),
    );
    if v.work.msl().ends_with("long") {
        let _ = write!(
            s,
            "    uint2 h = as_type<uint2>(v);\n    h.x = simd_shuffle_xor(h.x, m);\n    \
             h.y = simd_shuffle_xor(h.y, m);\n    return as_type<{w}>(h);\n}}\n"
        );
    } else {
        s.push_str("    return simd_shuffle_xor(v, m);\n}\n");
    }
    let _ = write!(
        s,
        "inline {w} dlb_simd_reduce({w} v, uint width) {{\n{}}}\n",
        v.work.simd_reduce(v.op)
    );
    // Element offsets of an output's first input element, and of reduced element j.
    s.push_str(
        "inline dlb_off dlb_kept_offset(dlb_idx o, constant ReduceParams& p) {\n    \
         dlb_off off = 0;\n    for (int d = int(p.kept_ndim) - 1; d >= 0; --d) {\n        \
         dlb_idx n = dlb_idx(p.kept_shape[d]);\n        \
         off += dlb_off(o % n) * dlb_off(p.kept_strides[d]);\n        o /= n;\n    }\n    \
         return off;\n}\n\
         inline dlb_off dlb_reduced_offset(dlb_idx j, constant ReduceParams& p) {\n    \
         dlb_off off = 0;\n    for (int d = int(p.red_ndim) - 1; d >= 0; --d) {\n        \
         dlb_idx n = dlb_idx(p.red_shape[d]);\n        \
         off += dlb_off(j % n) * dlb_off(p.red_strides[d]);\n        j /= n;\n    }\n    \
         return off;\n}\n",
    );
    let name = v.name();
    let _ = write!(
        s,
        "\nkernel void {name}(device const {in_type}* src [[buffer(0)]],\n\
         \x20                device {out_type}* dst [[buffer(1)]],\n\
         \x20                constant ReduceParams& p [[buffer(2)]],\n"
    );
    match v.kind {
        ReduceKind::Thread => {
            let _ = write!(
                s,
                "                 uint gid [[thread_position_in_grid]],\n\
                 \x20                uint grid [[threads_per_grid]]) {{\n    \
                 for (dlb_idx o = gid; o < dlb_idx(p.outputs); o += grid) {{\n        \
                 dlb_off base = dlb_off(p.in_first) + dlb_kept_offset(o, p);\n        \
                 {w} r = DLB_IDENTITY;\n        \
                 for (dlb_idx j = 0; j < dlb_idx(p.count); ++j) {{\n            \
                 r = dlb_combine(r, dlb_load(src[base + dlb_reduced_offset(j, p)]));\n        \
                 }}\n        dst[dlb_off(p.out_first) + dlb_off(o)] = {finish};\n    }}\n}}\n"
            );
        }
        ReduceKind::Group => {
            let _ = write!(
                s,
                "                 uint tid [[thread_index_in_threadgroup]],\n\
                 \x20                uint tgs [[threads_per_threadgroup]],\n\
                 \x20                uint group [[threadgroup_position_in_grid]],\n\
                 \x20                uint ngroups [[threadgroups_per_grid]],\n\
                 \x20                uint lane [[thread_index_in_simdgroup]],\n\
                 \x20                uint sg [[simdgroup_index_in_threadgroup]],\n\
                 \x20                uint nsg [[simdgroups_per_threadgroup]],\n\
                 \x20                uint width [[threads_per_simdgroup]]) {{\n    \
                 threadgroup {w} scratch[32];\n    \
                 dlb_idx total = dlb_idx(p.outputs) * dlb_idx(p.splits);\n    \
                 for (dlb_idx g = group; g < total; g += ngroups) {{\n        \
                 dlb_idx o = g / dlb_idx(p.splits);\n        \
                 dlb_idx split = g - o * dlb_idx(p.splits);\n        \
                 dlb_off base = dlb_off(p.in_first) + dlb_kept_offset(o, p);\n        \
                 dlb_idx begin = split * dlb_idx(p.chunk);\n        \
                 dlb_idx end = min(begin + dlb_idx(p.chunk), dlb_idx(p.count));\n        \
                 {w} r = DLB_IDENTITY;\n        \
                 for (dlb_idx j = begin + tid; j < end; j += tgs) {{\n            \
                 r = dlb_combine(r, dlb_load(src[base + dlb_reduced_offset(j, p)]));\n        \
                 }}\n        \
                 r = dlb_simd_reduce(r, width);\n        \
                 if (lane == 0) {{\n            scratch[sg] = r;\n        }}\n        \
                 threadgroup_barrier(mem_flags::mem_threadgroup);\n        \
                 if (sg == 0) {{\n            \
                 r = DLB_IDENTITY;\n            \
                 for (uint q = lane; q < nsg; q += width) {{\n                \
                 r = dlb_combine(r, scratch[q]);\n            }}\n            \
                 r = dlb_simd_reduce(r, width);\n            \
                 if (lane == 0) {{\n                \
                 dst[dlb_off(p.out_first) + dlb_off(g)] = {finish};\n            }}\n        \
                 }}\n        \
                 threadgroup_barrier(mem_flags::mem_threadgroup);\n    }}\n}}\n"
            );
        }
    }
    Ok(s)
}

/// The source of the tiled matrix-product kernel for one element type: each threadgroup of
/// 16 × 16 threads computes a 64 × 64 tile of the output, 4 × 4 elements per thread, staging
/// 64 × 16 slices of both operands in threadgroup memory (as `float`).
pub(crate) fn matmul_source(v: &MatmulVariant) -> String {
    let e = v.elem;
    let t = e.storage();
    let (tile, kt) = (MATMUL_TILE, MATMUL_K_TILE);
    let [tx, ty] = MATMUL_THREADS;
    let per_x = tile / tx;
    let per_y = tile / ty;
    let threads = tx * ty;
    let loads = tile * kt / threads;
    let name = v.name();
    let load_a = e.load("a[abase + dlb_off(gi) * p.a_row + dlb_off(gk) * p.a_col]");
    let load_b = e.load("b[bbase + dlb_off(gk) * p.b_row + dlb_off(gj) * p.b_col]");
    let store = e.store("acc[i][j]");
    let mut s = String::from(PRELUDE);
    s.push('\n');
    s.push_str(MATMUL_PARAMS_STRUCT);
    s.push_str(index_types(true));
    let _ = write!(
        s,
        r#"
kernel void {name}(device const {t}* a [[buffer(0)]],
                 device const {t}* b [[buffer(1)]],
                 device {t}* out [[buffer(2)]],
                 constant MatmulParams& p [[buffer(3)]],
                 uint3 tg [[threadgroup_position_in_grid]],
                 uint3 ntg [[threadgroups_per_grid]],
                 uint3 tid [[thread_position_in_threadgroup]]) {{
    // Operand slices, k-major: a_tile[kk][row], b_tile[kk][col]; padded against bank conflicts.
    threadgroup float a_tile[{kt}][{tile} + 4];
    threadgroup float b_tile[{kt}][{tile} + 4];
    const uint tx = tid.x;
    const uint ty = tid.y;
    const uint t = ty * {tx}u + tx;
    for (ulong z = tg.z; z < p.batch; z += ntg.z) {{
    const dlb_off abase = dlb_off(z) * p.a_batch;
    const dlb_off bbase = dlb_off(z) * p.b_batch;
    for (ulong ti = ulong(tg.y) * {tile}ul; ti < p.m; ti += ulong(ntg.y) * {tile}ul) {{
    for (ulong tj = ulong(tg.x) * {tile}ul; tj < p.n; tj += ulong(ntg.x) * {tile}ul) {{
        float acc[{per_y}][{per_x}];
        for (uint i = 0; i < {per_y}u; ++i) {{
            for (uint j = 0; j < {per_x}u; ++j) {{
                acc[i][j] = 0.0f;
            }}
        }}
        for (ulong k0 = 0; k0 < p.k; k0 += {kt}ul) {{
            for (uint q = 0; q < {loads}u; ++q) {{
                const uint l = t + {threads}u * q;
                // Walk the operand's contiguous axis with consecutive threads.
                uint r = p.a_k_contiguous != 0 ? l / {kt}u : l % {tile}u;
                uint c = p.a_k_contiguous != 0 ? l % {kt}u : l / {tile}u;
                ulong gi = ti + r;
                ulong gk = k0 + c;
                a_tile[c][r] = (gi < p.m && gk < p.k) ? {load_a} : 0.0f;
                uint cn = p.b_n_contiguous != 0 ? l % {tile}u : l / {kt}u;
                uint rk = p.b_n_contiguous != 0 ? l / {tile}u : l % {kt}u;
                ulong gj = tj + cn;
                gk = k0 + rk;
                b_tile[rk][cn] = (gk < p.k && gj < p.n) ? {load_b} : 0.0f;
            }}
            threadgroup_barrier(mem_flags::mem_threadgroup);
            for (uint kk = 0; kk < {kt}u; ++kk) {{
                float av[{per_y}];
                float bv[{per_x}];
                for (uint i = 0; i < {per_y}u; ++i) {{
                    av[i] = a_tile[kk][ty + {ty}u * i];
                }}
                for (uint j = 0; j < {per_x}u; ++j) {{
                    bv[j] = b_tile[kk][tx + {tx}u * j];
                }}
                for (uint i = 0; i < {per_y}u; ++i) {{
                    for (uint j = 0; j < {per_x}u; ++j) {{
                        acc[i][j] = fma(av[i], bv[j], acc[i][j]);
                    }}
                }}
            }}
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }}
        for (uint i = 0; i < {per_y}u; ++i) {{
            ulong gi = ti + ty + {ty}u * i;
            for (uint j = 0; j < {per_x}u; ++j) {{
                ulong gj = tj + tx + {tx}u * j;
                if (gi < p.m && gj < p.n) {{
                    out[(z * p.m + gi) * p.n + gj] = {store};
                }}
            }}
        }}
    }}
    }}
    }}
}}
"#
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_types() {
        assert_eq!(Elem::of(DType::F32, "add").unwrap(), Elem::F32);
        assert_eq!(Elem::of(DType::BF16, "add").unwrap().storage(), "ushort");
        assert_eq!(Elem::of(DType::BOOL, "cast").unwrap().storage(), "uchar");
        let err = Elem::of(DType::F64, "sum").unwrap_err();
        assert!(matches!(err, Error::UnsupportedDType(_)), "{err}");
        assert!(err.to_string().contains("float64"), "{err}");
        assert!(err.to_string().contains("sum"), "{err}");
        assert!(matches!(
            Elem::of(DType::C64, "add"),
            Err(Error::UnsupportedDType(_))
        ));
        for (e, bits) in [
            (Elem::I8, "uchar"),
            (Elem::F16, "ushort"),
            (Elem::F32, "uint"),
        ] {
            assert_eq!(e.bits_type(), bits);
        }
        assert_eq!(Elem::I64.bits_type(), "ulong");
        assert_eq!(Elem::F16.compute(), "float");
        assert_eq!(Elem::I16.compute(), "short");
    }

    #[test]
    fn integer_arithmetic_wraps_through_unsigned() {
        let e = map_expr(MapOp::Binary(BinaryOp::Add), Elem::I32, &["a0", "a1"]).unwrap();
        assert_eq!(e, "as_type<int>(uint(uint(a0) + uint(a1)))");
        let e = map_expr(MapOp::Binary(BinaryOp::Mul), Elem::I8, &["a0", "a1"]).unwrap();
        assert_eq!(e, "as_type<char>(uchar(uint(a0) * uint(a1)))");
        let e = map_expr(MapOp::Unary(UnaryOp::Negative), Elem::U64, &["a0"]).unwrap();
        assert_eq!(e, "as_type<ulong>(ulong(ulong(0) - ulong(a0)))");
        assert!(map_expr(MapOp::Binary(BinaryOp::Div), Elem::I32, &["a", "b"]).is_err());
        assert!(map_expr(MapOp::Unary(UnaryOp::Exp), Elem::I64, &["a"]).is_err());
        assert!(map_expr(MapOp::Unary(UnaryOp::Abs), Elem::Bool, &["a"]).is_err());
        assert_eq!(
            map_expr(MapOp::Unary(UnaryOp::Abs), Elem::U8, &["a0"]).unwrap(),
            "a0"
        );
        assert_eq!(
            map_expr(MapOp::Unary(UnaryOp::Sqrt), Elem::F16, &["a0"]).unwrap(),
            "precise::sqrt(a0)"
        );
    }

    #[test]
    fn casts_follow_astype() {
        assert_eq!(
            cast_expr(Elem::F32, Elem::I8, "a0"),
            "as_type<char>(uchar(dlb_float_to_bits(a0)))"
        );
        assert_eq!(
            cast_expr(Elem::I16, Elem::U64, "a0"),
            "as_type<ulong>(ulong(ulong(a0)))"
        );
        assert_eq!(cast_expr(Elem::I32, Elem::F16, "a0"), "half(float(a0))");
        assert_eq!(
            cast_expr(Elem::F32, Elem::BF16, "a0"),
            "dlb_float_to_bf16(a0)"
        );
        assert_eq!(cast_expr(Elem::BF16, Elem::Bool, "a0"), "uchar(a0 != 0.0f)");
        assert_eq!(cast_expr(Elem::Bool, Elem::F32, "a0"), "float(a0)");
    }

    /// A Rust model of `dlb_float_to_bits`, checked against Rust's own saturating cast.
    fn float_to_bits_model(f: f32) -> u64 {
        if f.is_nan() {
            return 0;
        }
        let a = f.abs();
        if a < 9_223_372_036_854_775_808.0 {
            return f as i64 as u64;
        }
        if a >= 170_141_183_460_469_231_731_687_303_715_884_105_728.0 {
            return if f > 0.0 { u64::MAX } else { 0 };
        }
        let u = a.to_bits();
        let s = (u >> 23) - 150;
        let m = u64::from((u & 0x7f_ffff) | 0x80_0000);
        let bits = if s < 64 { m << s } else { 0 };
        if f < 0.0 { bits.wrapping_neg() } else { bits }
    }

    #[test]
    fn float_to_integer_bits_match_a_128_bit_cast() {
        let values = [
            0.0f32,
            -0.0,
            1.5,
            -1.5,
            255.9,
            -129.0,
            3.0e9,
            -3.0e9,
            9.3e18,
            1.8e19,
            -9.3e18,
            3.0e19,
            -3.0e19,
            1.0e25,
            -1.0e25,
            2.0e38,
            -2.0e38,
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        for f in values {
            assert_eq!(float_to_bits_model(f), f as i128 as u64, "{f}");
        }
    }

    #[test]
    fn comparisons_store_bool_from_loaded_operands() {
        let v = MapVariant {
            op: MapOp::Compare(crate::compute::CompareOp::Ge),
            out: Elem::Bool,
            input: Elem::BF16,
            scalars: vec![false, true],
            layout: MapLayout::Flat,
        };
        let src = map_source(&v).unwrap();
        assert!(
            v.name().starts_with("dlb_map_greater_equal_"),
            "{}",
            v.name()
        );
        assert!(src.contains("device uchar* out [[buffer(0)]]"), "{src}");
        assert!(src.contains("device const ushort* in0"), "{src}");
        assert!(
            src.contains("const float a0 = dlb_bf16_to_float(in0[i]);"),
            "{src}"
        );
        assert!(src.contains("out[i] = uchar(a0 >= a1);"), "{src}");
    }

    #[test]
    fn map_sources_name_their_kernel() {
        let v = MapVariant {
            op: MapOp::Binary(BinaryOp::Sub),
            out: Elem::BF16,
            input: Elem::BF16,
            scalars: vec![true, false],
            layout: MapLayout::Strided { wide: false },
        };
        let src = map_source(&v).unwrap();
        assert!(src.contains(&format!("kernel void {}(", v.name())), "{src}");
        assert!(src.contains("device ushort* out [[buffer(0)]]"), "{src}");
        assert!(
            !src.contains("in0 [[buffer(1)]]"),
            "a scalar is no buffer: {src}"
        );
        assert!(
            src.contains("device const ushort* in1 [[buffer(2)]]"),
            "{src}"
        );
        assert!(src.contains("p.scalar[0]"), "{src}");
        assert!(src.contains("typedef uint dlb_idx;"), "{src}");
        assert!(src.contains("dlb_float_to_bf16((a0 - a1))"), "{src}");
        assert!(
            src.contains("o2 += dlb_off(c) * dlb_off(p.strides[2][d]);"),
            "{src}"
        );
        assert!(!src.contains("o1 +="), "{src}");

        let flat = MapVariant {
            op: MapOp::Unary(UnaryOp::Exp),
            out: Elem::F16,
            input: Elem::F16,
            scalars: vec![false],
            layout: MapLayout::Flat,
        };
        let src = map_source(&flat).unwrap();
        assert!(src.contains("half(precise::exp(a0))"), "{src}");
        assert!(src.contains("float(in0[i])"), "{src}");
        assert!(!src.contains("dlb_idx"), "{src}");

        let cast = MapVariant {
            op: MapOp::Cast,
            out: Elem::U8,
            input: Elem::F32,
            scalars: vec![false],
            layout: MapLayout::Flat,
        };
        let src = map_source(&cast).unwrap();
        assert!(src.contains("device const float* in0"), "{src}");
        assert!(src.contains("device uchar* out"), "{src}");
        assert!(src.contains("dlb_float_to_bits(a0)"), "{src}");
    }

    #[test]
    fn reduce_sources_per_variant() {
        let v = ReduceVariant {
            op: ReduceOp::Max,
            input: ReduceInput::Tensor(Elem::F16),
            work: Work::Float,
            output: ReduceOutput::Final(Elem::F16),
            kind: ReduceKind::Group,
            wide: false,
        };
        let src = reduce_source(&v).unwrap();
        assert!(src.contains(&format!("kernel void {}(", v.name())), "{src}");
        assert!(src.contains("simd_max(v)"), "{src}");
        assert!(src.contains("simd_any(isnan(v))"), "{src}");
        assert!(src.contains("(isnan(a) || a > b) ? a : b"), "{src}");
        assert!(src.contains("#define DLB_IDENTITY (-INFINITY)"), "{src}");
        assert!(src.contains("device half* dst"), "{src}");
        assert!(src.contains("= half(r);"), "{src}");
        assert!(src.contains("threadgroup float scratch[32]"), "{src}");

        let sum = ReduceVariant {
            op: ReduceOp::Sum,
            input: ReduceInput::Tensor(Elem::I8),
            work: Work::Long,
            output: ReduceOutput::Partials,
            kind: ReduceKind::Group,
            wide: true,
        };
        let src = reduce_source(&sum).unwrap();
        assert!(src.contains("simd_shuffle_xor(h.x, m)"), "{src}");
        assert!(src.contains("as_type<long>(as_type<ulong>(a) + as_type<ulong>(b))"));
        assert!(src.contains("return long(x);"), "{src}");
        assert!(src.contains("device long* dst"), "{src}");
        assert!(src.contains("typedef ulong dlb_idx;"), "{src}");

        let mean = ReduceVariant {
            op: ReduceOp::Mean,
            input: ReduceInput::Partials,
            work: Work::Float,
            output: ReduceOutput::Final(Elem::BF16),
            kind: ReduceKind::Thread,
            wide: false,
        };
        let src = reduce_source(&mean).unwrap();
        assert!(src.contains("simd_sum(v)"), "{src}");
        assert!(src.contains("device const float* src"), "{src}");
        assert!(src.contains("dlb_float_to_bf16(r / p.divisor)"), "{src}");
        assert!(src.contains("thread_position_in_grid"), "{src}");

        let int_mean = ReduceVariant {
            work: Work::Long,
            ..mean
        };
        assert!(reduce_source(&int_mean).is_err());
    }

    #[test]
    fn matmul_source_per_dtype() {
        for (elem, load, store) in [
            (Elem::F32, "? a[abase", "= acc[i][j];"),
            (Elem::F16, "? float(a[abase", "= half(acc[i][j]);"),
            (
                Elem::BF16,
                "? dlb_bf16_to_float(a[",
                "= dlb_float_to_bf16(acc[i][j]);",
            ),
        ] {
            let v = MatmulVariant { elem };
            let src = matmul_source(&v);
            assert!(src.contains(&format!("kernel void {}(", v.name())), "{src}");
            assert!(
                src.contains(&format!("device const {}* a [[buffer(0)]]", elem.storage())),
                "{src}"
            );
            assert!(src.contains(load), "{src}");
            assert!(src.contains(store), "{src}");
            assert!(
                src.contains("threadgroup float a_tile[16][64 + 4];"),
                "{src}"
            );
            assert!(src.contains("float acc[4][4];"), "{src}");
        }
    }

    /// Every variant the planners can ask for generates, names its kernel, and uses no `double`
    /// (Metal has none).
    #[test]
    fn every_variant_generates() {
        use super::super::dispatch::work_type;
        // Every element type Metal has (no float64).
        let elems = || Elem::ALL.into_iter().filter(|&e| e != Elem::F64);
        let check = |name: String, src: String| {
            assert!(src.contains(&format!("kernel void {name}(")), "{src}");
            assert_eq!(src.matches('{').count(), src.matches('}').count(), "{src}");
            assert!(!src.contains("double"), "{src}");
            let unsuffixed = src
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '.'))
                .any(|tok| {
                    tok.contains('.')
                        && tok.starts_with(|c: char| c.is_ascii_digit())
                        && !tok.ends_with('f')
                });
            assert!(!unsuffixed, "a double literal in {src}");
        };
        let layouts = [
            MapLayout::Flat,
            MapLayout::Strided { wide: false },
            MapLayout::Strided { wide: true },
        ];
        let mut count = 0;
        for e in elems() {
            for layout in layouts {
                let mut ops: Vec<(MapOp, Vec<bool>)> = UnaryOp::ALL
                    .iter()
                    .map(|&u| (MapOp::Unary(u), vec![false]))
                    .collect();
                for b in BinaryOp::ALL {
                    for scalars in [[false, false], [true, false], [false, true]] {
                        ops.push((MapOp::Binary(b), scalars.to_vec()));
                    }
                }
                for (op, scalars) in ops {
                    let v = MapVariant {
                        op,
                        out: e,
                        input: e,
                        scalars,
                        layout,
                    };
                    // Integer transcendental functions, integer division and bool arithmetic
                    // have no kernel (the front never asks).
                    if let Ok(src) = map_source(&v) {
                        check(v.name(), src);
                        count += 1;
                    }
                }
                for c in crate::compute::CompareOp::ALL {
                    for scalars in [[false, false], [false, true]] {
                        let v = MapVariant {
                            op: MapOp::Compare(c),
                            out: Elem::Bool,
                            input: e,
                            scalars: scalars.to_vec(),
                            layout,
                        };
                        check(v.name(), map_source(&v).unwrap());
                        count += 1;
                    }
                }
                for from in elems() {
                    let v = MapVariant {
                        op: MapOp::Cast,
                        out: e,
                        input: from,
                        scalars: vec![false],
                        layout,
                    };
                    check(v.name(), map_source(&v).unwrap());
                    count += 1;
                }
            }
        }
        let dtypes = [
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
        ];
        for op in ReduceOp::ALL {
            for dtype in dtypes {
                let Ok((acc, out)) = crate::compute::promote::reduce_types(op, dtype) else {
                    continue;
                };
                let (Ok(work), Ok(out), Ok(input)) = (
                    work_type(op, acc),
                    Elem::of(out, "test"),
                    Elem::of(dtype, "test"),
                ) else {
                    continue; // float64 results
                };
                for kind in [ReduceKind::Thread, ReduceKind::Group] {
                    for wide in [false, true] {
                        for (input, output) in [
                            (ReduceInput::Tensor(input), ReduceOutput::Final(out)),
                            (ReduceInput::Tensor(input), ReduceOutput::Partials),
                            (ReduceInput::Partials, ReduceOutput::Final(out)),
                        ] {
                            let v = ReduceVariant {
                                op,
                                input,
                                work,
                                output,
                                kind,
                                wide,
                            };
                            check(v.name(), reduce_source(&v).unwrap());
                            count += 1;
                        }
                    }
                }
            }
        }
        for elem in [Elem::F16, Elem::BF16, Elem::F32] {
            let v = MatmulVariant { elem };
            check(v.name(), matmul_source(&v));
            count += 1;
        }
        assert!(count > 1000, "{count}");
    }
}
