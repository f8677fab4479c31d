//! CUDA C source of the built-in kernels, one small program per (operation, dtypes, shape class).
//!
//! The kernels include no header (NVRTC may not find `cuda_fp16.h`): 16-bit floats are stored as
//! `u16` and converted with the `cvt` instruction (`float16`) or bit arithmetic (`bfloat16`),
//! rounding to nearest even; arithmetic on them runs in `float`. Integer arithmetic runs in the
//! unsigned type of the width (so it wraps, and the compiler may assume nothing about overflow).
//!
//! | kernel | grid | what one thread does |
//! | --- | --- | --- |
//! | flat map | covers the data (grid-stride past 2³¹ blocks) | `UNROLL` 16-byte vectors of every operand, loads first |
//! | strided map | covers the data (grid-stride past 2³¹ blocks) | `UNROLL` elements, each index decoded over ≤ [`MAX_MAP_DIMS`] axes, loads first |
//! | group reduce | a warp or a block per (output, split) | strides over the reduced elements (16-byte vectors when contiguous), then shuffles |
//! | thread reduce | one thread per (output, split) | walks the reduced elements (reduced axes outside the kept ones: neighbours read neighbours) |
//! | finish | a warp per output | combines the splits' partial results |
//!
//! Every reduction is one pass over the input. Its partial results (`acc_t`) are one value for
//! sums, products and extremes; the extreme and its position for `argmax` / `argmin` (merged with
//! the first NaN winning, then the extreme, then the first position among equals, so that any
//! order of merging gives NumPy's answer); the count, the mean and the squared deviations from
//! it in `double` for `var` / `std` (each thread takes 4 to 16 loaded elements as a batch: their
//! mean and deviations in registers, merged by Chan, Golub and LeVeque's formula).
//!
//! The argument blocks ([`MapArgs`], [`ReduceArgs`]) are passed by value and mirror the C structs
//! written into every program.

use std::fmt::Write as _;

use crate::compute::{BinaryOp, Elem, MapOp, ReduceOp, UnaryOp};

/// The most collapsed axes the strided map kernel walks (more: operands are made compact first).
pub(crate) const MAX_MAP_DIMS: usize = 6;
/// The most collapsed kept or reduced axes the reduce kernels walk.
pub(crate) const MAX_REDUCE_DIMS: usize = 4;
/// Threads per block of every built-in kernel.
pub(crate) const THREADS: u32 = 256;
/// Vectors per thread per step of the flat map kernel.
pub(crate) const UNROLL: u32 = 4;

/// How an element type is spelled in the kernels' CUDA C.
trait CudaType {
    /// The C type elements are stored as.
    fn storage(self) -> &'static str;
    /// The C type arithmetic runs in.
    fn compute(self) -> &'static str;
    /// The unsigned type integer arithmetic wraps in.
    fn wrap(self) -> &'static str;
    /// A stored value as a compute value.
    fn load(self, e: &str) -> String;
    /// A compute value as a stored value.
    fn store(self, e: &str) -> String;
}

impl CudaType for Elem {
    fn storage(self) -> &'static str {
        match self {
            Elem::Bool | Elem::U8 => "u8",
            Elem::I8 => "i8",
            Elem::I16 => "i16",
            Elem::I32 => "i32",
            Elem::I64 => "i64",
            Elem::U16 | Elem::F16 | Elem::BF16 => "u16",
            Elem::U32 => "u32",
            Elem::U64 => "u64",
            Elem::F32 => "float",
            Elem::F64 => "double",
        }
    }

    fn compute(self) -> &'static str {
        match self {
            Elem::F16 | Elem::BF16 | Elem::F32 => "float",
            Elem::F64 => "double",
            other => other.storage(),
        }
    }

    fn wrap(self) -> &'static str {
        if self.size() == 8 { "u64" } else { "u32" }
    }

    fn load(self, e: &str) -> String {
        self.convert_half(e, "f16_to_f32", "bf16_to_f32")
            .unwrap_or_else(|| e.to_string())
    }

    fn store(self, e: &str) -> String {
        self.convert_half(e, "f32_to_f16", "f32_to_bf16")
            .unwrap_or_else(|| match self {
                Elem::Bool => format!("(u8)(({e}) != 0)"),
                other => format!("({})({e})", other.storage()),
            })
    }
}

/// Helpers every program starts with.
const PRELUDE: &str = r#"
typedef signed char i8; typedef short i16; typedef int i32; typedef long long i64;
typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32;
typedef unsigned long long u64;
struct alignas(16) raw16 { u64 lo, hi; };
template <int B> struct raw_of;
template <> struct raw_of<1> { typedef u8 t; };
template <> struct raw_of<2> { typedef u16 t; };
template <> struct raw_of<4> { typedef u32 t; };
template <> struct raw_of<8> { typedef u64 t; };
template <> struct raw_of<16> { typedef raw16 t; };
template <typename S, int N> union pack { typename raw_of<sizeof(S) * N>::t raw; S v[N]; };

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
  u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ u16 f64_to_f16(double d) {
  u16 h; asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(d)); return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }
__device__ __forceinline__ u16 bits_to_bf16(u32 u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
  return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ u16 f32_to_bf16(float f) { return bits_to_bf16(__float_as_uint(f)); }
__device__ __forceinline__ u16 f64_to_bf16(double d) {
  // Round to float toward zero, keeping inexactness in the last bit (round to odd), so that the
  // second rounding to bfloat16 is the correct one.
  float f = __double2float_rz(d);
  u32 u = __float_as_uint(f);
  if (d == d && (double)f != d) u |= 1u;
  return bits_to_bf16(u);
}
// NumPy's floor_divide and remainder of floats (npy_divmod): the floored quotient, and the
// remainder with the divisor's sign, from fmod (exact).
__device__ __forceinline__ float dlb_floor_divide(float a, float b) {
  if (b == 0.0f) return a / b;
  const float m = fmodf(a, b);
  float div = (a - m) / b;
  if (m != 0.0f && ((b < 0.0f) != (m < 0.0f))) div -= 1.0f;
  if (div != 0.0f) { const float f = floorf(div); return (div - f > 0.5f) ? f + 1.0f : f; }
  return copysignf(0.0f, a / b);
}
__device__ __forceinline__ double dlb_floor_divide(double a, double b) {
  if (b == 0.0) return a / b;
  const double m = fmod(a, b);
  double div = (a - m) / b;
  if (m != 0.0 && ((b < 0.0) != (m < 0.0))) div -= 1.0;
  if (div != 0.0) { const double f = floor(div); return (div - f > 0.5) ? f + 1.0 : f; }
  return copysign(0.0, a / b);
}
__device__ __forceinline__ float dlb_remainder(float a, float b) {
  float m = fmodf(a, b);
  if (b == 0.0f) return m;
  if (m != 0.0f) { if ((b < 0.0f) != (m < 0.0f)) m += b; } else { m = copysignf(0.0f, b); }
  return m;
}
__device__ __forceinline__ double dlb_remainder(double a, double b) {
  double m = fmod(a, b);
  if (b == 0.0) return m;
  if (m != 0.0) { if ((b < 0.0) != (m < 0.0)) m += b; } else { m = copysign(0.0, b); }
  return m;
}
// Integer floor division and remainder for a divisor other than 0 and (signed) -1: no overflow.
template <typename T> __device__ __forceinline__ T dlb_floor_div_int(T a, T b) {
  const T q = (T)(a / b);
  return ((T)(a % b) != (T)0 && ((a < (T)0) != (b < (T)0))) ? (T)(q - (T)1) : q;
}
template <typename T> __device__ __forceinline__ T dlb_remainder_int(T a, T b) {
  const T r = (T)(a % b);
  return (r != (T)0 && ((r < (T)0) != (b < (T)0))) ? (T)(r + b) : r;
}
// base ** e wrapping in the unsigned type U (square and multiply).
template <typename U> __device__ __forceinline__ U dlb_pow_bits(U base, u64 e) {
  U r = (U)1;
  while (e != 0) { if (e & 1) r *= base; base *= base; e >>= 1; }
  return r;
}
// NumPy's astype: truncate toward zero, NaN to 0; values past int64 go through uint64.
__device__ __forceinline__ u64 f64_to_int_bits(double d) {
  if (d != d) return 0;
  if (d >= 9223372036854775808.0) return __double2ull_rz(d);
  return (u64)__double2ll_rz(d);
}
"#;

/// How one input of a map kernel is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Mode {
    /// Consecutive elements (flat kernels).
    Vector,
    /// One element for all (a stride-0 operand of a flat kernel), read once per thread.
    Uniform,
    /// A kernel parameter.
    Scalar,
    /// Through the plan's strides (strided kernels).
    Strided,
}

/// The index space of a map kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum MapShape {
    /// One run of elements, `vec` per vector access.
    Flat { vec: u8 },
    /// `ndim` collapsed axes; `wide`: 64-bit indices.
    Strided { ndim: u8, wide: bool },
}

/// Everything a map kernel's source depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MapKey {
    pub(crate) op: MapOp,
    pub(crate) input: Elem,
    pub(crate) out: Elem,
    /// How each input is read (the first `arity`).
    pub(crate) modes: [Mode; 2],
    pub(crate) arity: u8,
    pub(crate) shape: MapShape,
}

impl MapKey {
    fn inputs(&self) -> &[Mode] {
        &self.modes[..self.arity as usize]
    }
}

/// The map kernels' argument block (`struct MapArgs` in the source).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MapArgs {
    pub(crate) out: u64,
    pub(crate) input: [u64; 2],
    /// Scalar operands of float kernels.
    pub(crate) sf: [f64; 2],
    /// Scalar operands of integer kernels (wrapped into the dtype by the kernel).
    pub(crate) si: [i64; 2],
    pub(crate) n: u64,
    pub(crate) shape: [u64; MAX_MAP_DIMS],
    /// Per input, its strides in elements.
    pub(crate) strides: [[i64; MAX_MAP_DIMS]; 2],
}

const MAP_ARGS: &str = "struct MapArgs { u64 out; u64 in[2]; double sf[2]; i64 si[2]; u64 n; \
                        u64 shape[6]; i64 st[2][6]; };\n";

/// Whether the map `op` is defined on `input` → `out` (the front promotes before asking).
pub(crate) fn map_supported(op: MapOp, input: Elem, out: Elem) -> bool {
    match op {
        MapOp::Cast => true,
        MapOp::Unary(u) => {
            input == out && input != Elem::Bool && (input.is_float() || !u.is_transcendental())
        }
        MapOp::Binary(b) => {
            input == out && input != Elem::Bool && (input.is_float() || b != BinaryOp::Div)
        }
        MapOp::Compare(_) => out == Elem::Bool,
    }
}

fn unary_expr(op: UnaryOp, t: Elem, a: &str) -> String {
    let c = t.compute();
    if t.is_float() {
        let f = if c == "float" { "f" } else { "" };
        return match op {
            UnaryOp::Sqrt => format!("sqrt{f}({a})"),
            UnaryOp::Exp => format!("exp{f}({a})"),
            UnaryOp::Log => format!("log{f}({a})"),
            UnaryOp::Sin => format!("sin{f}({a})"),
            UnaryOp::Cos => format!("cos{f}({a})"),
            UnaryOp::Abs => format!("fabs{f}({a})"),
            UnaryOp::Square => format!("({a}) * ({a})"),
            UnaryOp::Negative => format!("-({a})"),
        };
    }
    let w = t.wrap();
    match op {
        UnaryOp::Abs if t.is_signed() => {
            format!("({c})(({a}) < 0 ? ({w})0 - ({w})({a}) : ({w})({a}))")
        }
        UnaryOp::Abs => a.to_string(),
        UnaryOp::Square => format!("({c})(({w})({a}) * ({w})({a}))"),
        UnaryOp::Negative => format!("({c})(({w})0 - ({w})({a}))"),
        // Not reached: the front computes these in a float type.
        _ => format!("({c})0"),
    }
}

fn binary_expr(op: BinaryOp, t: Elem, a: &str, b: &str) -> String {
    let (c, w) = (t.compute(), t.wrap());
    let sym = match op {
        BinaryOp::Add => "+",
        BinaryOp::Sub => "-",
        BinaryOp::Mul => "*",
        BinaryOp::Div => "/",
        BinaryOp::FloorDiv if t.is_float() => return format!("dlb_floor_divide({a}, {b})"),
        BinaryOp::Mod if t.is_float() => return format!("dlb_remainder({a}, {b})"),
        BinaryOp::Pow if c == "float" => return format!("powf({a}, {b})"),
        BinaryOp::Pow if t.is_float() => return format!("pow({a}, {b})"),
        // Integers: 0 for a zero divisor (NumPy's values); the most negative value divided by -1
        // wraps to itself, and its remainder is 0.
        BinaryOp::FloorDiv if t.is_signed() => {
            return format!(
                "(({b}) == 0 ? ({c})0 : ({b}) == ({c})-1 ? ({c})(({w})0 - ({w})({a})) : \
                 dlb_floor_div_int<{c}>({a}, {b}))"
            );
        }
        BinaryOp::FloorDiv => return format!("(({b}) == 0 ? ({c})0 : ({c})(({a}) / ({b})))"),
        BinaryOp::Mod if t.is_signed() => {
            return format!(
                "((({b}) == 0 || ({b}) == ({c})-1) ? ({c})0 : dlb_remainder_int<{c}>({a}, {b}))"
            );
        }
        BinaryOp::Mod => return format!("(({b}) == 0 ? ({c})0 : ({c})(({a}) % ({b})))"),
        BinaryOp::Pow => {
            // A negative exponent never comes (the front refuses it); it would give 0.
            let power = format!("({c})dlb_pow_bits<{w}>(({w})({a}), (u64)({b}))");
            return if t.is_signed() {
                format!("(({b}) < 0 ? ({c})0 : {power})")
            } else {
                power
            };
        }
    };
    if t.is_float() {
        return format!("({a}) {sym} ({b})");
    }
    match op {
        // Not reached: integer division returns float64, computed on float64 operands.
        BinaryOp::Div => format!("({c})(({b}) == 0 ? 0 : ({a}) / ({b}))"),
        _ => format!("({c})(({w})({a}) {sym} ({w})({b}))"),
    }
}

/// `x` (a stored `from`) as a stored `to`, by NumPy's `astype` rules.
fn cast_expr(from: Elem, to: Elem, x: &str) -> String {
    if from == to {
        return x.to_string();
    }
    if to == Elem::Bool {
        return format!("(u8)(({}) != 0)", from.load(x));
    }
    if from == Elem::Bool {
        // Any non-zero byte is true: a choice between the stored 0 and 1 of `to`. (Not through
        // `double`: ptxas 13.0 miscompiled eight such lanes of bool → bfloat16, converting one
        // double built by selecting only its high word for all of them.)
        let one = match to {
            Elem::F16 => "(u16)0x3c00",
            Elem::BF16 => "(u16)0x3f80",
            Elem::F32 => "1.0f",
            Elem::F64 => "1.0",
            _ => "1",
        };
        return format!(
            "(({x}) != 0 ? ({})({one}) : ({})0)",
            to.storage(),
            to.storage()
        );
    }
    match (from.is_float(), to.is_float()) {
        (false, false) => format!("({})({x})", to.storage()),
        // 8- and 16-bit integers are exact in float: one rounding, in float.
        (false, true) if from.size() <= 2 && matches!(to, Elem::F16 | Elem::BF16 | Elem::F32) => {
            to.store(&format!("(float)({x})"))
        }
        (false, true) => {
            let d = format!("(double)({x})");
            match to {
                Elem::F16 => format!("f64_to_f16({d})"),
                Elem::BF16 => format!("f64_to_bf16({d})"),
                Elem::F32 => format!("(float)({d})"),
                _ => d,
            }
        }
        (true, false) => format!(
            "({})f64_to_int_bits((double)({}))",
            to.storage(),
            from.load(x)
        ),
        (true, true) => match (from, to) {
            (Elem::F64, Elem::F16) => format!("f64_to_f16({x})"),
            (Elem::F64, Elem::BF16) => format!("f64_to_bf16({x})"),
            (Elem::F64, Elem::F32) => format!("(float)({x})"),
            (_, Elem::F64) => format!("(double)({})", from.load(x)),
            (_, Elem::F32) => from.load(x),
            (_, Elem::F16) => format!("f32_to_f16({})", from.load(x)),
            (_, _) => format!("f32_to_bf16({})", from.load(x)),
        },
    }
}

/// The source of the map kernel `key`, entry point `k`.
pub(crate) fn map_source(key: &MapKey) -> String {
    let (inp, out) = (key.input, key.out);
    let cast = key.op == MapOp::Cast;
    // The type operands reach `op` in: stored for casts, computed otherwise.
    let arg_t = if cast { inp.storage() } else { inp.compute() };
    let read = |e: &str| if cast { e.to_string() } else { inp.load(e) };
    let mut s = String::from(PRELUDE);
    s.push_str(MAP_ARGS);
    // The element function.
    let params: Vec<String> = (0..key.inputs().len())
        .map(|k| format!("{arg_t} x{k}"))
        .collect();
    let body = match key.op {
        MapOp::Cast => cast_expr(inp, out, "x0"),
        MapOp::Unary(u) => out.store(&unary_expr(u, inp, "x0")),
        MapOp::Binary(b) => out.store(&binary_expr(b, inp, "x0", "x1")),
        // C's comparisons on the computed values are IEEE 754's: NaN is unequal to everything.
        MapOp::Compare(c) => format!("(u8)((x0) {} (x1))", c.symbol()),
    };
    let _ = writeln!(
        s,
        "__device__ __forceinline__ {} op({}) {{ return {body}; }}",
        out.storage(),
        params.join(", ")
    );
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void __launch_bounds__({THREADS}) k(const MapArgs a) {{"
    );
    let _ = writeln!(s, "  {0}* __restrict__ out = ({0}*)a.out;", out.storage());
    for (k, mode) in key.inputs().iter().enumerate() {
        match mode {
            Mode::Vector | Mode::Strided => {
                let _ = writeln!(
                    s,
                    "  const {0}* __restrict__ in{k} = (const {0}*)a.in[{k}];",
                    inp.storage()
                );
            }
            Mode::Uniform => {
                let _ = writeln!(
                    s,
                    "  const {arg_t} u{k} = {};",
                    read(&format!("((const {}*)a.in[{k}])[0]", inp.storage()))
                );
            }
            Mode::Scalar => {
                let v = if inp.is_float() {
                    format!("({arg_t})a.sf[{k}]")
                } else {
                    format!("({arg_t})a.si[{k}]")
                };
                let _ = writeln!(s, "  const {arg_t} u{k} = {v};");
            }
        }
    }
    match key.shape {
        MapShape::Flat { vec } => flat_body(&mut s, key, vec, &read),
        MapShape::Strided { ndim, wide } => strided_body(&mut s, key, arg_t, ndim, wide, &read),
    }
    s.push_str("}\n");
    s
}

fn flat_body(s: &mut String, key: &MapKey, vec: u8, read: &dyn Fn(&str) -> String) {
    let (inp, out) = (key.input.storage(), key.out.storage());
    let n = vec;
    let operand = |k: usize, m: &Mode, elem: &str| match m {
        Mode::Vector => read(&elem.replace('#', &k.to_string())),
        _ => format!("u{k}"),
    };
    let _ = writeln!(s, "  const u64 n = a.n, nvec = n / {n};");
    let _ = writeln!(
        s,
        "  const u64 step = (u64)gridDim.x * (blockDim.x * {UNROLL});"
    );
    let _ = writeln!(
        s,
        "  for (u64 base = (u64)blockIdx.x * (blockDim.x * {UNROLL}) + threadIdx.x; base < nvec; \
         base += step) {{"
    );
    for (k, m) in key.inputs().iter().enumerate() {
        if *m == Mode::Vector {
            let _ = writeln!(s, "    pack<{inp}, {n}> p{k}[{UNROLL}];");
        }
    }
    let _ = writeln!(s, "    #pragma unroll");
    let _ = writeln!(s, "    for (int u = 0; u < {UNROLL}; u++) {{");
    let _ = writeln!(s, "      const u64 v = base + (u64)u * blockDim.x;");
    let _ = writeln!(s, "      if (v < nvec) {{");
    for (k, m) in key.inputs().iter().enumerate() {
        if *m == Mode::Vector {
            let _ = writeln!(
                s,
                "        p{k}[u].raw = ((const raw_of<sizeof({inp}) * {n}>::t*)in{k})[v];"
            );
        }
    }
    let _ = writeln!(s, "      }}\n    }}");
    let _ = writeln!(s, "    #pragma unroll");
    let _ = writeln!(s, "    for (int u = 0; u < {UNROLL}; u++) {{");
    let _ = writeln!(s, "      const u64 v = base + (u64)u * blockDim.x;");
    let _ = writeln!(s, "      if (v < nvec) {{");
    let _ = writeln!(s, "        pack<{out}, {n}> r;");
    let _ = writeln!(s, "        #pragma unroll");
    let args: Vec<String> = key
        .inputs()
        .iter()
        .enumerate()
        .map(|(k, m)| operand(k, m, "p#[u].v[j]"))
        .collect();
    let _ = writeln!(
        s,
        "        for (int j = 0; j < {n}; j++) r.v[j] = op({});",
        args.join(", ")
    );
    let _ = writeln!(
        s,
        "        ((raw_of<sizeof({out}) * {n}>::t*)out)[v] = r.raw;"
    );
    let _ = writeln!(s, "      }}\n    }}\n  }}");
    // The tail that does not fill a vector.
    let args: Vec<String> = key
        .inputs()
        .iter()
        .enumerate()
        .map(|(k, m)| operand(k, m, "in#[i]"))
        .collect();
    let _ = writeln!(
        s,
        "  for (u64 i = nvec * {n} + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; \
         i += (u64)gridDim.x * blockDim.x) out[i] = op({});",
        args.join(", ")
    );
}

fn strided_body(
    s: &mut String,
    key: &MapKey,
    arg_t: &str,
    ndim: u8,
    wide: bool,
    read: &dyn Fn(&str) -> String,
) {
    let idx = if wide { "u64" } else { "u32" };
    let strided: Vec<usize> = (0..key.inputs().len())
        .filter(|&k| key.inputs()[k] == Mode::Strided)
        .collect();
    let _ = writeln!(s, "  const {idx} n = ({idx})a.n;");
    let _ = writeln!(
        s,
        "  const {idx} step = ({idx})gridDim.x * (blockDim.x * {UNROLL});"
    );
    let _ = writeln!(
        s,
        "  for ({idx} base = ({idx})blockIdx.x * (blockDim.x * {UNROLL}) + threadIdx.x; \
         base < n; base += step) {{"
    );
    // Every element's loads first, so that `UNROLL` of them are in flight per thread.
    for &k in &strided {
        let _ = writeln!(s, "    {arg_t} x{k}[{UNROLL}];");
    }
    let _ = writeln!(s, "    #pragma unroll");
    let _ = writeln!(s, "    for (int u = 0; u < {UNROLL}; u++) {{");
    let _ = writeln!(s, "      const {idx} i = base + ({idx})u * blockDim.x;");
    let _ = writeln!(s, "      if (i < n) {{");
    let _ = writeln!(s, "        {idx} rem = i;");
    for &k in &strided {
        let _ = writeln!(s, "        i64 o{k} = 0;");
    }
    let _ = writeln!(s, "        #pragma unroll");
    let _ = writeln!(s, "        for (int d = {ndim} - 1; d > 0; d--) {{");
    let _ = writeln!(
        s,
        "          const {idx} ext = ({idx})a.shape[d]; const {idx} q = rem / ext; \
         const {idx} c = rem - q * ext; rem = q;"
    );
    for &k in &strided {
        let _ = writeln!(s, "          o{k} += (i64)c * a.st[{k}][d];");
    }
    let _ = writeln!(s, "        }}");
    for &k in &strided {
        let _ = writeln!(s, "        o{k} += (i64)rem * a.st[{k}][0];");
        let _ = writeln!(s, "        x{k}[u] = {};", read(&format!("in{k}[o{k}]")));
    }
    let _ = writeln!(s, "      }}\n    }}");
    let args: Vec<String> = key
        .inputs()
        .iter()
        .enumerate()
        .map(|(k, m)| match m {
            Mode::Strided => format!("x{k}[u]"),
            _ => format!("u{k}"),
        })
        .collect();
    let _ = writeln!(s, "    #pragma unroll");
    let _ = writeln!(s, "    for (int u = 0; u < {UNROLL}; u++) {{");
    let _ = writeln!(s, "      const {idx} i = base + ({idx})u * blockDim.x;");
    let _ = writeln!(s, "      if (i < n) out[i] = op({});", args.join(", "));
    let _ = writeln!(s, "    }}\n  }}");
}

/// How a reduce kernel spreads the work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ReduceKind {
    /// `threads` (32 or 256) threads per (output, split); `vec` elements per load (1: strided).
    Group { threads: u16, vec: u8 },
    /// One thread per (output, split).
    Thread,
    /// Combines the splits' partial results, a warp per output.
    Finish,
}

/// Everything a reduce kernel's source depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ReduceKey {
    pub(crate) op: ReduceOp,
    pub(crate) input: Elem,
    /// The accumulator dtype the front chose.
    pub(crate) acc: Elem,
    pub(crate) out: Elem,
    pub(crate) kind: ReduceKind,
    /// Collapsed kept and reduced axes.
    pub(crate) kept_dims: u8,
    pub(crate) reduced_dims: u8,
    /// 64-bit reduced indices (and positions and counts in the partial results of the arg
    /// reductions, `var` and `std`).
    pub(crate) wide: bool,
}

/// The reduce kernels' argument block (`struct RArgs` in the source).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ReduceArgs {
    pub(crate) input: u64,
    pub(crate) out: u64,
    /// Partial results, `outputs × splits` of them (when `splits > 1`).
    pub(crate) ws: u64,
    pub(crate) outputs: u64,
    pub(crate) count: u64,
    /// Reduced elements per split.
    pub(crate) chunk: u64,
    pub(crate) splits: u64,
    /// What `mean`, `var` and `std` divide by (`ReduceRequest::divisor`).
    pub(crate) divisor: f64,
    pub(crate) kshape: [u64; MAX_REDUCE_DIMS],
    pub(crate) kstride: [i64; MAX_REDUCE_DIMS],
    pub(crate) rshape: [u64; MAX_REDUCE_DIMS],
    pub(crate) rstride: [i64; MAX_REDUCE_DIMS],
}

const REDUCE_ARGS: &str = "struct RArgs { u64 in; u64 out; u64 ws; u64 outputs; u64 count; \
                           u64 chunk; u64 splits; double divisor; u64 kshape[4]; i64 kstride[4]; \
                           u64 rshape[4]; i64 rstride[4]; };\n";

/// What a reduce kernel's partial results (`acc_t`) hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Partial {
    /// One value: a sum, a product, an extreme.
    Value,
    /// The extreme so far (`max`: the largest) and its position, `idx_t`.
    Arg { max: bool },
    /// The count (`idx_t`), the mean and the sum of squared deviations from it, in `double`
    /// (`var`, `std`), merged by Chan's formula.
    Moments,
}

impl Partial {
    fn of(op: ReduceOp) -> Partial {
        match op {
            ReduceOp::ArgMax => Partial::Arg { max: true },
            ReduceOp::ArgMin => Partial::Arg { max: false },
            ReduceOp::Var | ReduceOp::Std => Partial::Moments,
            ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Max | ReduceOp::Min | ReduceOp::Prod => {
                Partial::Value
            }
        }
    }
}

impl ReduceKey {
    /// The C type values are accumulated in (`val_t`).
    pub(crate) fn acc_c(&self) -> &'static str {
        match self.op {
            ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod | ReduceOp::Var | ReduceOp::Std => {
                match self.acc {
                    Elem::I64 | Elem::U64 => "u64",
                    Elem::F64 => "double",
                    _ => "float",
                }
            }
            ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax | ReduceOp::ArgMin => match self.input
            {
                Elem::I8 | Elem::I16 | Elem::I32 => "i32",
                Elem::U8 | Elem::U16 | Elem::U32 | Elem::Bool => "u32",
                other => other.compute(),
            },
        }
    }

    /// The C type of positions and counts in partial results (`idx_t`).
    fn index_c(&self) -> &'static str {
        if self.wide { "u64" } else { "u32" }
    }

    /// The kernel that combines this one's partial results (one row of splits per output).
    pub(crate) fn finish(&self) -> ReduceKey {
        ReduceKey {
            kind: ReduceKind::Finish,
            kept_dims: 1,
            reduced_dims: 1,
            // Positions and counts in the partial results keep the width this kernel wrote.
            wide: self.wide && Partial::of(self.op) != Partial::Value,
            ..*self
        }
    }

    /// Bytes per partial result: `sizeof(acc_t)`, which the source asserts.
    pub(crate) fn acc_size(&self) -> usize {
        let value = match self.acc_c() {
            "u64" | "i64" | "double" => 8,
            _ => 4,
        };
        let index = if self.wide { 8 } else { 4 };
        match Partial::of(self.op) {
            Partial::Value => value,
            // `{ val_t v; idx_t i; }`: two fields of the wider size, padding included.
            Partial::Arg { .. } => 2 * value.max(index),
            // `{ double mean, m2; idx_t n; }`, padded to 8 bytes.
            Partial::Moments => (16 + index).next_multiple_of(8),
        }
    }
}

fn identity(op: ReduceOp, c: &str) -> &'static str {
    // The arg reductions start from the extremes' identities.
    let op = match op {
        ReduceOp::ArgMax => ReduceOp::Max,
        ReduceOp::ArgMin => ReduceOp::Min,
        other => other,
    };
    match (op, c) {
        (
            ReduceOp::Sum
            | ReduceOp::Mean
            | ReduceOp::Var
            | ReduceOp::Std
            | ReduceOp::ArgMax
            | ReduceOp::ArgMin,
            _,
        ) => "0",
        (ReduceOp::Prod, _) => "1",
        (ReduceOp::Max, "float") => "__int_as_float(0xff800000)",
        (ReduceOp::Max, "double") => "__longlong_as_double(0xfff0000000000000ll)",
        (ReduceOp::Max, "i32") => "(-2147483647 - 1)",
        (ReduceOp::Max, "i64") => "(-9223372036854775807ll - 1)",
        (ReduceOp::Max, _) => "0",
        (ReduceOp::Min, "float") => "__int_as_float(0x7f800000)",
        (ReduceOp::Min, "double") => "__longlong_as_double(0x7ff0000000000000ll)",
        (ReduceOp::Min, "i32") => "2147483647",
        (ReduceOp::Min, "i64") => "9223372036854775807ll",
        (ReduceOp::Min, "u32") => "0xffffffffu",
        (ReduceOp::Min, _) => "0xffffffffffffffffull",
    }
}

/// The partial result's type and its functions: `ident()`, `comb(a, b)` (associative and
/// commutative: the loops and shuffles merge partial results in any order), `step` (one element
/// into a partial result, for the arg reductions and the moments), `shfl_down` and `save` (a
/// store to the workspace).
fn partial_source(s: &mut String, key: &ReduceKey, float: bool) {
    let c = key.acc_c();
    let ident = identity(key.op, c);
    let full = "0xffffffffu";
    match Partial::of(key.op) {
        Partial::Value => {
            s.push_str("typedef val_t acc_t;\n");
            let _ = writeln!(
                s,
                "__device__ __forceinline__ acc_t ident() {{ return (acc_t){ident}; }}"
            );
            let comb = match (key.op, float) {
                (ReduceOp::Sum | ReduceOp::Mean, _) => "a + b",
                // Unsigned for integers: the product wraps.
                (ReduceOp::Prod, _) => "a * b",
                // NaN wins: `a` when it is NaN, `b` when it is (the comparison fails).
                (ReduceOp::Max, true) => "(a > b || a != a) ? a : b",
                (ReduceOp::Min, true) => "(a < b || a != a) ? a : b",
                (ReduceOp::Max, false) => "a > b ? a : b",
                (ReduceOp::Min, false) => "a < b ? a : b",
                _ => unreachable!("value reductions only"),
            };
            let _ = writeln!(
                s,
                "__device__ __forceinline__ acc_t comb(acc_t a, acc_t b) {{ return {comb}; }}\n\
                 __device__ __forceinline__ acc_t shfl_down(acc_t v, int off) {{ \
                 return __shfl_down_sync({full}, v, off); }}\n\
                 __device__ __forceinline__ void save(acc_t* p, acc_t v) {{ *p = v; }}"
            );
        }
        Partial::Arg { max } => {
            let beyond = if max { ">" } else { "<" };
            let _ = writeln!(
                s,
                "typedef {} idx_t;\nstruct acc_t {{ val_t v; idx_t i; }};",
                key.index_c()
            );
            // Position 0 beside the identity: where it is still there at the end, every element
            // equals the identity (say the lowest value, for `argmax`), and the first is at 0.
            let _ = writeln!(
                s,
                "__device__ __forceinline__ acc_t ident() {{ acc_t r; r.v = (val_t){ident}; \
                 r.i = 0; return r; }}"
            );
            // The first NaN wins, else the extreme; among equals, the first.
            let (take, later) = if float {
                (
                    format!(
                        "const bool an = a.v != a.v, bn = b.v != b.v;\n  \
                         const bool take = bn ? (!an || b.i < a.i) : \
                         (!an && (b.v {beyond} a.v || (b.v == a.v && b.i < a.i)));"
                    ),
                    format!("x {beyond} c.v || (x != x && c.v == c.v)"),
                )
            } else {
                (
                    format!("const bool take = b.v {beyond} a.v || (b.v == a.v && b.i < a.i);"),
                    format!("x {beyond} c.v"),
                )
            };
            let _ = writeln!(
                s,
                "__device__ __forceinline__ acc_t comb(acc_t a, acc_t b) {{\n  {take}\n  \
                 return take ? b : a;\n}}\n\
                 // `x` at position `i`, after every element `c` has taken: it replaces a value it \
                 is strictly beyond, or a number when it is the first NaN.\n\
                 __device__ __forceinline__ acc_t step(acc_t c, val_t x, idx_t i) {{\n  \
                 if ({later}) {{ c.v = x; c.i = i; }}\n  return c;\n}}\n\
                 __device__ __forceinline__ acc_t shfl_down(acc_t v, int off) {{\n  acc_t r;\n  \
                 r.v = __shfl_down_sync({full}, v.v, off);\n  \
                 r.i = __shfl_down_sync({full}, v.i, off);\n  return r;\n}}\n\
                 // Field by field: a whole-struct store makes the compiler give up on reading the \
                 input through the read-only path.\n\
                 __device__ __forceinline__ void save(acc_t* p, acc_t v) {{ p->v = v.v; p->i = v.i; }}"
            );
        }
        Partial::Moments => {
            // The mean and the squared deviations in `double` whatever the input: a merge
            // subtracts means, which loses `eps * |mean| / std` of the result in their type.
            let _ = writeln!(
                s,
                "typedef {} idx_t;\nstruct acc_t {{ double mean, m2; idx_t n; }};",
                key.index_c()
            );
            s.push_str(
                "__device__ __forceinline__ acc_t ident() { acc_t r; r.mean = 0; r.m2 = 0; r.n = 0; \
                 return r; }\n\
                 // Chan, Golub and LeVeque's merge of two partial results.\n\
                 __device__ __forceinline__ acc_t comb(acc_t a, acc_t b) {\n  \
                 if (b.n == 0) return a;\n  if (a.n == 0) return b;\n  \
                 const idx_t n = a.n + b.n;\n  \
                 const double w = (double)b.n / (double)n, d = b.mean - a.mean;\n  \
                 acc_t r;\n  r.mean = a.mean + d * w;\n  \
                 r.m2 = (a.m2 + b.m2) + d * d * ((double)a.n * w);\n  r.n = n;\n  return r;\n}\n\
                 // One element: Welford's update.\n\
                 __device__ __forceinline__ acc_t step(acc_t c, val_t x) {\n  \
                 const double y = (double)x;\n  c.n += 1;\n  const double d = y - c.mean;\n  \
                 c.mean += d / (double)c.n;\n  c.m2 += d * (y - c.mean);\n  return c;\n}\n\
                 // K elements as a partial result, from their deviations from `m` (their mean \
                 rounded to `val_t`): `s` their sum, `q` the sum of their squares.\n\
                 __device__ __forceinline__ acc_t batch(idx_t k, val_t m, val_t s, val_t q) {\n  \
                 const double sd = (double)s, m2 = (double)q - sd * sd / (double)k;\n  \
                 acc_t b;\n  b.mean = (double)m + sd / (double)k;\n  \
                 // Never below 0 (rounding); NaN stays NaN.\n  \
                 b.m2 = m2 < 0.0 ? 0.0 : m2;\n  b.n = k;\n  return b;\n}\n",
            );
            let _ = writeln!(
                s,
                "__device__ __forceinline__ acc_t shfl_down(acc_t v, int off) {{\n  acc_t r;\n  \
                 r.mean = __shfl_down_sync({full}, v.mean, off);\n  \
                 r.m2 = __shfl_down_sync({full}, v.m2, off);\n  \
                 r.n = __shfl_down_sync({full}, v.n, off);\n  return r;\n}}\n\
                 __device__ __forceinline__ void save(acc_t* p, acc_t v) {{ \
                 p->mean = v.mean; p->m2 = v.m2; p->n = v.n; }}"
            );
        }
    }
    if Partial::of(key.op) != Partial::Value {
        s.push_str(
            "__device__ __forceinline__ raw16 ldg16(const raw16* p) {\n  \
             const ulonglong2 v = __ldg((const ulonglong2*)p);\n  raw16 r;\n  r.lo = v.x;\n  \
             r.hi = v.y;\n  return r;\n}\n",
        );
    }
    let _ = writeln!(
        s,
        "static_assert(sizeof(acc_t) == {}, \"the host allocates {} bytes per partial result\");",
        key.acc_size(),
        key.acc_size()
    );
}

/// The source of the reduce kernel `key`, entry point `k`.
pub(crate) fn reduce_source(key: &ReduceKey) -> String {
    let c = key.acc_c();
    let (inp, out) = (key.input, key.out);
    let float = c == "float" || c == "double";
    let part = Partial::of(key.op);
    let mut s = String::from(PRELUDE);
    s.push_str(REDUCE_ARGS);
    let _ = writeln!(s, "typedef {c} val_t;");
    partial_source(&mut s, key, float);
    let conv = match c {
        "u64" if inp.is_signed() => "(u64)(i64)(x)".to_string(),
        "float" | "double" if inp.is_float() => format!("(val_t)({})", inp.load("x")),
        _ => "(val_t)(x)".to_string(),
    };
    let _ = writeln!(
        s,
        "__device__ __forceinline__ val_t conv({} x) {{ return {conv}; }}",
        inp.storage()
    );
    let result = match key.op {
        ReduceOp::Mean => "a / (acc_t)divisor",
        ReduceOp::ArgMax | ReduceOp::ArgMin => "a.i",
        // In `double`, rounded once into the output.
        ReduceOp::Var => "a.m2 / divisor",
        ReduceOp::Std => "sqrt(a.m2 / divisor)",
        ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min | ReduceOp::Prod => "a",
    };
    let stored = match part {
        Partial::Moments => cast_expr(Elem::F64, out, result),
        _ => out.store(result),
    };
    let _ = writeln!(
        s,
        "__device__ __forceinline__ {} finish(acc_t a, double divisor) {{ return {stored}; }}",
        out.storage(),
    );
    s.push_str(
        "__device__ __forceinline__ acc_t warp_reduce(acc_t v) {\n\
         #pragma unroll\n\
         for (int off = 16; off > 0; off >>= 1) v = comb(v, shfl_down(v, off));\n\
         return v;\n}\n",
    );
    decode_fn(
        &mut s,
        "kept_offset",
        "kshape",
        "kstride",
        key.kept_dims,
        "u64",
    );
    let ridx = if key.wide { "u64" } else { "u32" };
    decode_fn(
        &mut s,
        "red_offset",
        "rshape",
        "rstride",
        key.reduced_dims,
        ridx,
    );
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void __launch_bounds__({THREADS}) k(const RArgs a) {{"
    );
    let _ = writeln!(
        s,
        "  const {0}* __restrict__ in = (const {0}*)a.in;",
        inp.storage()
    );
    let _ = writeln!(s, "  {0}* __restrict__ out = ({0}*)a.out;", out.storage());
    s.push_str("  acc_t* __restrict__ ws = (acc_t*)a.ws;\n");
    let fold = Fold { part };
    match key.kind {
        ReduceKind::Group { threads, vec } => {
            group_body(&mut s, &fold, threads, vec, ridx, inp.storage())
        }
        ReduceKind::Thread => thread_body(&mut s, &fold, ridx),
        ReduceKind::Finish => finish_body(&mut s),
    }
    s.push_str("}\n");
    s
}

/// `name(a, i)`: the offset in elements of index `i` decoded over `dims` axes.
fn decode_fn(s: &mut String, name: &str, shape: &str, stride: &str, dims: u8, idx: &str) {
    let dims = dims.max(1);
    let _ = writeln!(
        s,
        "__device__ __forceinline__ i64 {name}(const RArgs& a, {idx} i) {{"
    );
    if dims == 1 {
        let _ = writeln!(s, "  return (i64)i * a.{stride}[0];\n}}");
        return;
    }
    let _ = writeln!(s, "  i64 off = 0;");
    let _ = writeln!(s, "  #pragma unroll");
    let _ = writeln!(s, "  for (int d = {dims} - 1; d > 0; d--) {{");
    let _ = writeln!(
        s,
        "    const {idx} ext = ({idx})a.{shape}[d]; const {idx} q = i / ext; \
         off += (i64)(i - q * ext) * a.{stride}[d]; i = q;"
    );
    let _ = writeln!(s, "  }}");
    let _ = writeln!(s, "  return off + (i64)i * a.{stride}[0];\n}}");
}

/// How the loops fold loaded elements into the accumulators `c0`..`c3`. Each accumulator takes
/// its elements in increasing reduced position (what the arg reductions' `step` relies on).
struct Fold {
    part: Partial,
}

impl Fold {
    /// The stored element at `base + off`: through the read-only data cache (`__ldg`) for the
    /// partial results that are structs, whose stores to the workspace otherwise make the
    /// compiler read the input the ordinary way (the value kernels get it without asking).
    fn at(&self, base: &str, off: &str) -> String {
        match self.part {
            Partial::Value => format!("{base}[{off}]"),
            _ => format!("__ldg({base} + {off})"),
        }
    }

    /// The 16-byte vector at `vp + j` (as [`Fold::at`]).
    fn vector(&self, j: &str) -> String {
        match self.part {
            Partial::Value => format!("vp[{j}]"),
            _ => format!("ldg16(vp + {j})"),
        }
    }

    /// Stored element `x`, at reduced position `i`, into accumulator `c`.
    fn one(&self, c: &str, x: &str, i: &str) -> String {
        match self.part {
            Partial::Value => format!("{c} = comb({c}, conv({x}));"),
            Partial::Arg { .. } => format!("{c} = step({c}, conv({x}), (idx_t)({i}));"),
            Partial::Moments => format!("{c} = step({c}, conv({x}));"),
        }
    }

    /// Stored elements `xs` (a power of two of them) as one batch into accumulator `c`: their
    /// mean rounded to `val_t`, and their deviations from it and the squares of those, summed
    /// pairwise in scalar registers, merged as one partial result (the moments).
    fn batch(c: &str, xs: &[String]) -> String {
        fn pairwise(terms: &[String]) -> String {
            match terms {
                [one] => one.clone(),
                _ => {
                    let (a, b) = terms.split_at(terms.len() / 2);
                    format!("({} + {})", pairwise(a), pairwise(b))
                }
            }
        }
        let k = xs.len();
        debug_assert!(k.is_power_of_two());
        let loads: Vec<String> = xs
            .iter()
            .enumerate()
            .map(|(n, x)| format!("y{n} = conv({x})"))
            .collect();
        let ys: Vec<String> = (0..k).map(|n| format!("y{n}")).collect();
        let devs: Vec<String> = (0..k).map(|n| format!("d{n} = y{n} - m")).collect();
        let ds: Vec<String> = (0..k).map(|n| format!("d{n}")).collect();
        let squares: Vec<String> = (0..k).map(|n| format!("d{n} * d{n}")).collect();
        format!(
            "{{ const val_t {};\n        const val_t m = {} * ((val_t)1 / (val_t){k});\n        \
             const val_t {};\n        {c} = comb({c}, batch({k}, m, {}, {})); }}",
            loads.join(", "),
            pairwise(&ys),
            devs.join(", "),
            pairwise(&ds),
            pairwise(&squares)
        )
    }

    /// Four stored elements `x0`..`x3`, at positions `r`, `r + step`, ..., one per accumulator
    /// (the moments: one batch, into `c0`).
    fn four(&self, r: &str, step: &str) -> String {
        if self.part == Partial::Moments {
            let xs: Vec<String> = (0..4).map(|k| format!("x{k}")).collect();
            return Self::batch("c0", &xs);
        }
        (0..4)
            .map(|k| {
                let i = match k {
                    0 => r.to_string(),
                    1 => format!("{r} + {step}"),
                    _ => format!("{r} + {k} * {step}"),
                };
                self.one(&format!("c{k}"), &format!("x{k}"), &i)
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Four packs `x0`..`x3` of `vec` stored elements, pack `k`'s first at position
    /// `i0 + k * stride`, pack `k` into accumulator `ck` (the moments: batches of at least 8
    /// elements where the packs allow, at most 16).
    fn four_packs(&self, vec: u8, stride: u32) -> String {
        let elems =
            |k: usize| -> Vec<String> { (0..vec).map(|e| format!("x{k}.v[{e}]")).collect() };
        match self.part {
            Partial::Moments if vec >= 8 => (0..4)
                .map(|k| format!("      {}\n", Self::batch(&format!("c{k}"), &elems(k))))
                .collect(),
            Partial::Moments => {
                let all: Vec<String> = (0..4).flat_map(elems).collect();
                format!("      {}\n", Self::batch("c0", &all))
            }
            _ => {
                let folds: Vec<String> = (0..4)
                    .map(|k| {
                        let i = match k {
                            0 => "i0 + e".to_string(),
                            _ => format!("i0 + {} + e", k as u32 * stride),
                        };
                        self.one(&format!("c{k}"), &format!("x{k}.v[e]"), &i)
                    })
                    .collect();
                format!(
                    "      #pragma unroll\n      for (int e = 0; e < {vec}; e++) {{ {} }}\n",
                    folds.join(" ")
                )
            }
        }
    }

    /// One pack `x0` of `vec` stored elements, the first at position `i0`, into `c0`.
    fn pack(&self, vec: u8) -> String {
        if self.part == Partial::Moments {
            let xs: Vec<String> = (0..vec).map(|e| format!("x0.v[{e}]")).collect();
            return format!("      {}\n", Self::batch("c0", &xs));
        }
        format!(
            "      #pragma unroll\n      for (int e = 0; e < {vec}; e++) {}\n",
            self.one("c0", "x0.v[e]", "i0 + e")
        )
    }
}

fn group_body(s: &mut String, fold: &Fold, threads: u16, vec: u8, ridx: &str, elem: &str) {
    let g = threads as u32;
    let per_block = THREADS / g;
    let _ = writeln!(s, "  const u32 lane = threadIdx.x % {g};");
    let _ = writeln!(s, "  const u64 total = a.outputs * a.splits;");
    if g == THREADS {
        s.push_str("  __shared__ acc_t partial[32];\n");
    }
    let _ = writeln!(
        s,
        "  for (u64 g = (u64)blockIdx.x * {per_block} + threadIdx.x / {g}; g < total; \
         g += (u64)gridDim.x * {per_block}) {{"
    );
    s.push_str(
        "    const u64 o = g / a.splits, sp = g - o * a.splits;\n\
         \x20   const u64 begin = sp * a.chunk;\n\
         \x20   const u64 end = begin + a.chunk < a.count ? begin + a.chunk : a.count;\n\
         \x20   const auto* base = in + kept_offset(a, o);\n\
         \x20   acc_t c0 = ident(), c1 = ident(), c2 = ident(), c3 = ident();\n",
    );
    let positions = matches!(fold.part, Partial::Arg { .. });
    if vec > 1 {
        let _ = writeln!(
            s,
            "    typedef raw_of<sizeof({elem}) * {vec}>::t raw_t;\n    typedef pack<{elem}, {vec}> pack_t;"
        );
        let _ = writeln!(s, "    const u64 nv = (end - begin) / {vec};");
        s.push_str("    const raw_t* vp = (const raw_t*)(base + begin);\n");
        let _ = writeln!(s, "    u64 j = lane;");
        let _ = writeln!(s, "    for (; j + 3 * {g} < nv; j += 4 * {g}) {{");
        let _ = writeln!(
            s,
            "      pack_t x0, x1, x2, x3;\n\
             \x20     x0.raw = {}; x1.raw = {}; x2.raw = {}; x3.raw = {};",
            fold.vector("j"),
            fold.vector(&format!("j + {g}")),
            fold.vector(&format!("j + 2 * {g}")),
            fold.vector(&format!("j + 3 * {g}")),
        );
        if positions {
            let _ = writeln!(s, "      const u64 i0 = begin + j * {vec};");
        }
        s.push_str(&fold.four_packs(vec, g * vec as u32));
        s.push_str("    }\n");
        let _ = writeln!(s, "    for (; j < nv; j += {g}) {{");
        let _ = writeln!(s, "      pack_t x0; x0.raw = {};", fold.vector("j"));
        if positions {
            let _ = writeln!(s, "      const u64 i0 = begin + j * {vec};");
        }
        s.push_str(&fold.pack(vec));
        s.push_str("    }\n");
        let _ = writeln!(
            s,
            "    for (u64 r = begin + nv * {vec} + lane; r < end; r += {g}) {}",
            fold.one("c1", &fold.at("base", "r"), "r")
        );
    } else {
        let _ = writeln!(s, "    u64 r = begin + lane;");
        let _ = writeln!(s, "    for (; r + 3 * {g} < end; r += 4 * {g}) {{");
        let x = |r: String| fold.at("base", &format!("red_offset(a, ({ridx})({r}))"));
        let _ = writeln!(
            s,
            "      const auto x0 = {}, x1 = {}, x2 = {}, x3 = {};",
            fold.at("base", &format!("red_offset(a, ({ridx})r)")),
            x(format!("r + {g}")),
            x(format!("r + 2 * {g}")),
            x(format!("r + 3 * {g}")),
        );
        let _ = writeln!(s, "      {}\n    }}", fold.four("r", &g.to_string()));
        let _ = writeln!(
            s,
            "    for (; r < end; r += {g}) {}",
            fold.one(
                "c0",
                &fold.at("base", &format!("red_offset(a, ({ridx})r)")),
                "r"
            )
        );
    }
    s.push_str("    acc_t acc = warp_reduce(comb(comb(c0, c1), comb(c2, c3)));\n");
    if g == THREADS {
        let _ = writeln!(
            s,
            "    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;\n\
             \x20   __syncthreads();\n\
             \x20   if (threadIdx.x < 32) acc = warp_reduce(threadIdx.x < {} ? partial[threadIdx.x] : ident());\n\
             \x20   __syncthreads();",
            THREADS / 32
        );
    }
    s.push_str(
        "    if (lane == 0) {\n\
         \x20     if (a.splits == 1) out[o] = finish(acc, a.divisor);\n\
         \x20     else save(ws + o * a.splits + sp, acc);\n    }\n  }\n",
    );
}

fn thread_body(s: &mut String, fold: &Fold, ridx: &str) {
    s.push_str(
        "  const u64 total = a.outputs * a.splits;\n\
         \x20 for (u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x; t < total; \
         t += (u64)gridDim.x * blockDim.x) {\n\
         \x20   const u64 sp = t / a.outputs, o = t - sp * a.outputs;\n\
         \x20   const u64 begin = sp * a.chunk;\n\
         \x20   const u64 end = begin + a.chunk < a.count ? begin + a.chunk : a.count;\n\
         \x20   const auto* base = in + kept_offset(a, o);\n\
         \x20   acc_t c0 = ident(), c1 = ident(), c2 = ident(), c3 = ident();\n\
         \x20   u64 r = begin;\n\
         \x20   for (; r + 3 < end; r += 4) {\n",
    );
    let x = |r: &str| fold.at("base", &format!("red_offset(a, ({ridx}){r})"));
    let _ = writeln!(
        s,
        "      const auto x0 = {}, x1 = {}, x2 = {}, x3 = {};",
        x("r"),
        x("(r + 1)"),
        x("(r + 2)"),
        x("(r + 3)")
    );
    let _ = writeln!(
        s,
        "      {}\n    }}\n    for (; r < end; r++) {}",
        fold.four("r", "1"),
        fold.one("c0", &x("r"), "r")
    );
    s.push_str(
        "    const acc_t acc = comb(comb(c0, c1), comb(c2, c3));\n\
         \x20   if (a.splits == 1) out[o] = finish(acc, a.divisor);\n\
         \x20   else save(ws + o * a.splits + sp, acc);\n  }\n",
    );
}

fn finish_body(s: &mut String) {
    s.push_str(
        "  (void)in;\n\
         \x20 const u32 lane = threadIdx.x & 31;\n\
         \x20 const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;\n\
         \x20 for (u64 w = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < a.outputs; \
         w += warps) {\n\
         \x20   acc_t acc = ident();\n\
         \x20   for (u64 sp = lane; sp < a.splits; sp += 32) acc = comb(acc, ws[w * a.splits + sp]);\n\
         \x20   acc = warp_reduce(acc);\n\
         \x20   if (lane == 0) out[w] = finish(acc, a.divisor);\n  }\n",
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::CompareOp;

    /// Every element type the CUDA kernels compute on (`bool` only casts).
    fn all() -> impl Iterator<Item = Elem> {
        Elem::ALL.into_iter().filter(|&t| t != Elem::Bool)
    }

    /// Compiles `sources` with NVRTC for sm_90 (no GPU needed); panics, saying why, where NVRTC
    /// is not installed, so the tests that call it are ignored unless asked for.
    fn compiles(sources: impl Iterator<Item = (String, String)>) {
        let arch = super::super::nvrtc::arch_option((9, 0))
            .unwrap_or_else(|e| panic!("this test needs NVRTC: {e}"));
        for (what, src) in sources {
            if let Err(e) =
                super::super::nvrtc::compile(&src, "k", std::slice::from_ref(&arch), &[])
            {
                panic!("{what}: {e}\n{src}");
            }
        }
    }

    fn reduce_keys(input: Elem) -> Vec<ReduceKey> {
        let mut keys = Vec::new();
        for op in ReduceOp::ALL {
            let acc = match (op, input) {
                (ReduceOp::Sum | ReduceOp::Prod, t) if t.is_signed() => Elem::I64,
                (ReduceOp::Sum | ReduceOp::Prod, t) if !t.is_float() => Elem::U64,
                (ReduceOp::Mean | ReduceOp::Var | ReduceOp::Std, t) if !t.is_float() => Elem::F64,
                (
                    ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod | ReduceOp::Var | ReduceOp::Std,
                    Elem::F64,
                ) => Elem::F64,
                (
                    ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod | ReduceOp::Var | ReduceOp::Std,
                    _,
                ) => Elem::F32,
                _ => input,
            };
            let out = match op {
                ReduceOp::ArgMax | ReduceOp::ArgMin => Elem::I64,
                ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod | ReduceOp::Var | ReduceOp::Std
                    if !input.is_float() =>
                {
                    acc
                }
                _ => input,
            };
            for kind in [
                ReduceKind::Group {
                    threads: 256,
                    vec: (16 / input.size()) as u8,
                },
                ReduceKind::Group {
                    threads: 32,
                    vec: 1,
                },
                ReduceKind::Thread,
            ] {
                // Positions and counts of both widths where partial results hold them.
                for wide in [false, true] {
                    let key = ReduceKey {
                        op,
                        input,
                        acc,
                        out,
                        kind,
                        kept_dims: 2,
                        reduced_dims: 3,
                        wide,
                    };
                    if wide && Partial::of(op) == Partial::Value && kind != ReduceKind::Thread {
                        continue;
                    }
                    keys.push(key);
                    if kind == ReduceKind::Thread && !keys.contains(&key.finish()) {
                        keys.push(key.finish());
                    }
                }
            }
        }
        keys
    }

    fn map_keys(t: Elem) -> Vec<MapKey> {
        let mut keys = Vec::new();
        let flat = MapShape::Flat {
            vec: (16 / t.size()) as u8,
        };
        let strided = MapShape::Strided {
            ndim: 3,
            wide: true,
        };
        for op in UnaryOp::ALL {
            let op = MapOp::Unary(op);
            if map_supported(op, t, t) {
                for shape in [flat, strided] {
                    let mode = if shape == flat {
                        Mode::Vector
                    } else {
                        Mode::Strided
                    };
                    keys.push(MapKey {
                        op,
                        input: t,
                        out: t,
                        modes: [mode, mode],
                        arity: 1,
                        shape,
                    });
                }
            }
        }
        for op in BinaryOp::ALL {
            let op = MapOp::Binary(op);
            if map_supported(op, t, t) {
                for (shape, modes) in [
                    (flat, [Mode::Vector, Mode::Vector]),
                    (flat, [Mode::Scalar, Mode::Uniform]),
                    (strided, [Mode::Strided, Mode::Scalar]),
                ] {
                    keys.push(MapKey {
                        op,
                        input: t,
                        out: t,
                        modes,
                        arity: 2,
                        shape,
                    });
                }
            }
        }
        for op in CompareOp::ALL {
            let op = MapOp::Compare(op);
            assert!(map_supported(op, t, Elem::Bool));
            for (shape, modes) in [
                (
                    MapShape::Flat {
                        vec: (16 / t.size()) as u8,
                    },
                    [Mode::Vector, Mode::Vector],
                ),
                (flat, [Mode::Vector, Mode::Scalar]),
                (strided, [Mode::Strided, Mode::Uniform]),
            ] {
                keys.push(MapKey {
                    op,
                    input: t,
                    out: Elem::Bool,
                    modes,
                    arity: 2,
                    shape,
                });
            }
        }
        for to in all().chain([Elem::Bool]) {
            keys.push(MapKey {
                op: MapOp::Cast,
                input: t,
                out: to,
                modes: [Mode::Vector; 2],
                arity: 1,
                shape: MapShape::Flat {
                    vec: (16 / t.size().max(to.size())) as u8,
                },
            });
        }
        keys
    }

    #[test]
    #[ignore = "needs NVRTC (libnvrtc, as on a CUDA machine)"]
    fn representative_sources_compile() {
        let from_bool = all().map(|to| {
            let key = MapKey {
                op: MapOp::Cast,
                input: Elem::Bool,
                out: to,
                modes: [Mode::Vector; 2],
                arity: 1,
                shape: MapShape::Flat {
                    vec: (16 / to.size()) as u8,
                },
            };
            (format!("{key:?}"), map_source(&key))
        });
        compiles(from_bool);
        let bool_compares = CompareOp::ALL.into_iter().map(|op| {
            let key = MapKey {
                op: MapOp::Compare(op),
                input: Elem::Bool,
                out: Elem::Bool,
                modes: [Mode::Vector, Mode::Scalar],
                arity: 2,
                shape: MapShape::Flat { vec: 16 },
            };
            (format!("{key:?}"), map_source(&key))
        });
        compiles(bool_compares);
        compiles([Elem::F32, Elem::BF16, Elem::I8].into_iter().flat_map(|t| {
            let m = map_keys(t)
                .into_iter()
                .map(|k| (format!("{k:?}"), map_source(&k)));
            let r = reduce_keys(t)
                .into_iter()
                .map(|k| (format!("{k:?}"), reduce_source(&k)));
            m.chain(r).collect::<Vec<_>>()
        }));
    }

    /// Every dtype (slow: `scripts/test.sh` skips it; run it with `--ignored` where NVRTC is
    /// installed).
    #[test]
    #[ignore = "slow, and needs NVRTC: run with --ignored"]
    fn every_source_compiles() {
        compiles(all().flat_map(|t| {
            let m = map_keys(t)
                .into_iter()
                .map(|k| (format!("{k:?}"), map_source(&k)));
            let r = reduce_keys(t)
                .into_iter()
                .map(|k| (format!("{k:?}"), reduce_source(&k)));
            m.chain(r).collect::<Vec<_>>()
        }));
    }

    #[test]
    fn casts_follow_numpy_paths() {
        assert_eq!(cast_expr(Elem::F32, Elem::F32, "x"), "x");
        assert_eq!(cast_expr(Elem::I64, Elem::U8, "x"), "(u8)(x)");
        assert!(cast_expr(Elem::F16, Elem::I32, "x").contains("f64_to_int_bits"));
        assert!(cast_expr(Elem::F64, Elem::BF16, "x").starts_with("f64_to_bf16"));
        assert!(cast_expr(Elem::Bool, Elem::BF16, "x").contains("0x3f80"));
        assert_eq!(
            cast_expr(Elem::I16, Elem::F16, "x"),
            "f32_to_f16((float)(x))"
        );
    }

    #[test]
    fn comparisons_write_bool_from_computed_operands() {
        let key = MapKey {
            op: MapOp::Compare(CompareOp::Le),
            input: Elem::BF16,
            out: Elem::Bool,
            modes: [Mode::Vector, Mode::Scalar],
            arity: 2,
            shape: MapShape::Flat { vec: 8 },
        };
        let src = map_source(&key);
        assert!(
            src.contains("u8 op(float x0, float x1) { return (u8)((x0) <= (x1)); }"),
            "{src}"
        );
        assert!(src.contains("bf16_to_f32("), "{src}");
        assert!(!map_supported(
            MapOp::Compare(CompareOp::Eq),
            Elem::F32,
            Elem::F32
        ));
        assert!(map_supported(
            MapOp::Compare(CompareOp::Eq),
            Elem::Bool,
            Elem::Bool
        ));
    }

    #[test]
    fn sources_name_their_entry() {
        let key = MapKey {
            op: MapOp::Binary(BinaryOp::Add),
            input: Elem::F32,
            out: Elem::F32,
            modes: [Mode::Vector, Mode::Scalar],
            arity: 2,
            shape: MapShape::Flat { vec: 4 },
        };
        assert!(map_source(&key).contains("__global__ void __launch_bounds__(256) k("));
        let key = ReduceKey {
            op: ReduceOp::Max,
            input: Elem::BF16,
            acc: Elem::BF16,
            out: Elem::BF16,
            kind: ReduceKind::Group {
                threads: 256,
                vec: 8,
            },
            kept_dims: 1,
            reduced_dims: 1,
            wide: false,
        };
        let src = reduce_source(&key);
        assert!(src.contains("typedef float val_t;"), "{src}");
        assert!(src.contains("typedef val_t acc_t;"), "{src}");
    }

    #[test]
    fn partial_results_are_sized_for_the_host() {
        let key = |op, input, acc, out, wide| ReduceKey {
            op,
            input,
            acc,
            out,
            kind: ReduceKind::Thread,
            kept_dims: 1,
            reduced_dims: 1,
            wide,
        };
        let arg = key(ReduceOp::ArgMax, Elem::F16, Elem::F16, Elem::I64, false);
        assert_eq!(arg.acc_c(), "float");
        assert_eq!(arg.acc_size(), 8);
        assert_eq!(arg.finish().kind, ReduceKind::Finish);
        let wide_arg = key(ReduceOp::ArgMin, Elem::I8, Elem::I8, Elem::I64, true);
        assert_eq!((wide_arg.acc_c(), wide_arg.acc_size()), ("i32", 16));
        assert!(
            wide_arg.finish().wide,
            "the finishing kernel reads 64-bit positions"
        );
        let var = key(ReduceOp::Var, Elem::BF16, Elem::F32, Elem::BF16, false);
        assert_eq!(var.acc_size(), 24);
        assert_eq!(
            key(ReduceOp::Std, Elem::I32, Elem::F64, Elem::F64, true).acc_size(),
            24
        );
        assert_eq!(
            key(ReduceOp::Var, Elem::F32, Elem::F32, Elem::F32, true).acc_size(),
            24
        );
        assert!(
            !key(ReduceOp::Sum, Elem::F32, Elem::F32, Elem::F32, true)
                .finish()
                .wide
        );
        // Each source asserts the size the host allocates.
        let src = reduce_source(&var);
        assert!(src.contains("static_assert(sizeof(acc_t) == 24"), "{src}");
        assert!(src.contains("f64_to_bf16(a.m2 / divisor)"), "{src}");
        let src = reduce_source(&key(ReduceOp::Std, Elem::F32, Elem::F32, Elem::F32, false));
        assert!(src.contains("(float)(sqrt(a.m2 / divisor))"), "{src}");
        let src = reduce_source(&arg);
        assert!(src.contains("struct acc_t { val_t v; idx_t i; };"), "{src}");
        assert!(src.contains("return (i64)(a.i);"), "{src}");
    }
}
