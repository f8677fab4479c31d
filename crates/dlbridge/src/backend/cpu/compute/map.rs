//! Element-wise kernels: `out[i] = f(a[i], b[i])` over a collapsed [`MapPlan`].
//!
//! The plan's index space is cut into chunks (threads), each chunk into runs along the innermost
//! axis ([`walk`]). `out` is compact, so each run writes consecutive elements. An input whose run
//! is contiguous is read as a slice, one whose run has stride 0 (broadcast) or that is a scalar
//! is one value; then the whole run is a single loop the compiler vectorises ([`zip`], built a
//! second time for AVX2). Inputs with other strides are gathered in blocks first.
//!
//! `float16` and `bfloat16` runs are widened to `f32` in blocks, computed in `f32` and rounded
//! once when stored ([`halves`]). Comparisons write `bool` bytes from operands of any of the
//! kernels' dtypes ([`compare`]; `bool` operands are read as bytes).

use half::{bf16, f16};

use super::{
    BLOCK, Half, Input, SharedPtr, Storage, for_chunks, math, output, unsupported, walk,
    with_storage,
};
use crate::compute::{BinaryOp, CompareOp, MapOp, MapRequest, Operand, UnaryOp};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Where one input's elements of a run come from.
#[derive(Clone, Copy)]
pub(super) enum Src<'a, T> {
    /// One element per output element.
    Slice(&'a [T]),
    /// One value for all of them (a scalar, or a broadcast axis).
    Splat(T),
}

/// A kernel over one run: `out[i] = f(a[i], b[i])` (`b` ignored by unary functions); `O` is the
/// output's element type (`u8` for comparisons, else the operands' `S`).
type Kernel<S, O = S> = fn(&mut [O], Src<'_, S>, Src<'_, S>);

/// Arithmetic every dtype has (wrapping for integers, as NumPy).
trait Num: Copy + Default + Send + Sync + 'static {
    fn add(self, y: Self) -> Self;
    fn sub(self, y: Self) -> Self;
    fn mul(self, y: Self) -> Self;
    fn neg(self) -> Self;
    fn abs(self) -> Self;
    /// NumPy's `floor_divide` (integers: 0 for a zero divisor, as NumPy's values).
    fn floor_div(self, y: Self) -> Self;
    /// NumPy's `remainder`: the divisor's sign (integers: 0 for a zero divisor).
    fn modulo(self, y: Self) -> Self;
    /// NumPy's `power` (integers wrap; a negative integer exponent never reaches a kernel: the
    /// front refuses it, and it gives 0 here).
    fn pow(self, y: Self) -> Self;
}

/// `base ** exponent` wrapping in `u64` (square and multiply): the low bits are those of the
/// exact power for every integer type of at most 64 bits.
#[inline(always)]
fn wrapping_pow_u64(base: u64, mut exponent: u64) -> u64 {
    let (mut result, mut square) = (1u64, base);
    while exponent != 0 {
        if exponent & 1 == 1 {
            result = result.wrapping_mul(square);
        }
        square = square.wrapping_mul(square);
        exponent >>= 1;
    }
    result
}

/// Arithmetic only floats have.
trait Float: Num {
    fn div(self, y: Self) -> Self;
    fn sqrt(self) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    /// Recomputes the elements of a `sin` (or `cos`) run whose arguments the fast path does not
    /// cover.
    fn fix_trig(_out: &mut [Self], _x: Src<'_, Self>, _cos: bool) {}
}

macro_rules! signed {
    ($($t:ty),*) => {$(
        impl Num for $t {
            #[inline(always)] fn add(self, y: Self) -> Self { self.wrapping_add(y) }
            #[inline(always)] fn sub(self, y: Self) -> Self { self.wrapping_sub(y) }
            #[inline(always)] fn mul(self, y: Self) -> Self { self.wrapping_mul(y) }
            #[inline(always)] fn neg(self) -> Self { self.wrapping_neg() }
            // abs of the most negative value wraps to itself, as NumPy's.
            #[inline(always)] fn abs(self) -> Self { self.wrapping_abs() }
            #[inline(always)]
            fn floor_div(self, y: Self) -> Self {
                match y {
                    0 => 0,
                    // The most negative value divided by -1 wraps to itself, as NumPy's.
                    -1 => self.wrapping_neg(),
                    _ => {
                        let q = self / y;
                        if self % y != 0 && ((self < 0) != (y < 0)) { q - 1 } else { q }
                    }
                }
            }
            #[inline(always)]
            fn modulo(self, y: Self) -> Self {
                if y == 0 || y == -1 {
                    return 0;
                }
                let r = self % y;
                if r != 0 && ((r < 0) != (y < 0)) { r + y } else { r }
            }
            #[inline(always)]
            fn pow(self, y: Self) -> Self {
                if y < 0 {
                    return 0;
                }
                wrapping_pow_u64(self as i64 as u64, y as u64) as Self
            }
        }
    )*};
}

macro_rules! unsigned {
    ($($t:ty),*) => {$(
        impl Num for $t {
            #[inline(always)] fn add(self, y: Self) -> Self { self.wrapping_add(y) }
            #[inline(always)] fn sub(self, y: Self) -> Self { self.wrapping_sub(y) }
            #[inline(always)] fn mul(self, y: Self) -> Self { self.wrapping_mul(y) }
            #[inline(always)] fn neg(self) -> Self { self.wrapping_neg() }
            #[inline(always)] fn abs(self) -> Self { self }
            #[inline(always)] fn floor_div(self, y: Self) -> Self { self.checked_div(y).unwrap_or(0) }
            #[inline(always)] fn modulo(self, y: Self) -> Self { self.checked_rem(y).unwrap_or(0) }
            #[inline(always)]
            fn pow(self, y: Self) -> Self {
                wrapping_pow_u64(self as u64, y as u64) as Self
            }
        }
    )*};
}

signed!(i8, i16, i32, i64);
unsigned!(u8, u16, u32, u64);

macro_rules! float {
    ($t:ty, $exp:path, $ln:path, $sin:path, $cos:path, { $($fix:tt)* }) => {
        impl Num for $t {
            #[inline(always)]
            fn add(self, y: Self) -> Self {
                self + y
            }
            #[inline(always)]
            fn sub(self, y: Self) -> Self {
                self - y
            }
            #[inline(always)]
            fn mul(self, y: Self) -> Self {
                self * y
            }
            #[inline(always)]
            fn neg(self) -> Self {
                -self
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn floor_div(self, y: Self) -> Self {
                if y == 0.0 {
                    return self / y;
                }
                float_divmod(self, y).0
            }
            #[inline(always)]
            fn modulo(self, y: Self) -> Self {
                if y == 0.0 {
                    return self % y;
                }
                float_divmod(self, y).1
            }
            #[inline(always)]
            fn pow(self, y: Self) -> Self {
                self.powf(y)
            }
        }

        impl Float for $t {
            #[inline(always)]
            fn div(self, y: Self) -> Self {
                self / y
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                $exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                $ln(self)
            }
            #[inline(always)]
            fn sin(self) -> Self {
                $sin(self)
            }
            #[inline(always)]
            fn cos(self) -> Self {
                $cos(self)
            }
            $($fix)*
        }
    };
}

/// NumPy's `divmod` of floats (`npy_divmod`) for a non-zero divisor: the floored quotient and
/// the remainder with the divisor's sign, from `fmod` (Rust's `%`, exact), so that
/// `a == q * b + r` as nearly as floats allow; zeros keep the signs NumPy gives them.
#[inline(always)]
fn float_divmod<T>(a: T, b: T) -> (T, T)
where
    T: Copy
        + PartialOrd
        + std::ops::Add<Output = T>
        + std::ops::Sub<Output = T>
        + std::ops::Div<Output = T>
        + std::ops::Rem<Output = T>
        + FloatBits,
{
    let (zero, one, half) = (T::ZERO, T::ONE, T::HALF);
    let mut m = a % b;
    // `a - m` is very nearly a multiple of `b`.
    let mut div = (a - m) / b;
    if m != zero {
        if (b < zero) != (m < zero) {
            m = m + b;
            div = div - one;
        }
    } else {
        m = T::copysign(zero, b);
    }
    let q = if div != zero {
        // Snap to the nearest integral value.
        let f = T::floor(div);
        if div - f > half { f + one } else { f }
    } else {
        T::copysign(zero, a / b)
    };
    (q, m)
}

/// The float operations [`float_divmod`] needs from `f32` and `f64`.
trait FloatBits: Sized {
    const ZERO: Self;
    const ONE: Self;
    const HALF: Self;
    fn floor(x: Self) -> Self;
    fn copysign(x: Self, sign: Self) -> Self;
}

macro_rules! float_bits {
    ($($t:ty),*) => {$(
        impl FloatBits for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const HALF: Self = 0.5;
            #[inline(always)]
            fn floor(x: Self) -> Self {
                x.floor()
            }
            #[inline(always)]
            fn copysign(x: Self, sign: Self) -> Self {
                x.copysign(sign)
            }
        }
    )*};
}

float_bits!(f32, f64);

float!(
    f32,
    math::exp_f32,
    math::ln_f32,
    math::sin_f32,
    math::cos_f32,
    {
        fn fix_trig(out: &mut [f32], x: Src<'_, f32>, cos: bool) {
            let slow = |x: f32| if cos { x.cos() } else { x.sin() };
            match x {
                Src::Slice(xs) => {
                    // One vectorised pass finds whether any argument is out of range (rare).
                    let far = xs
                        .iter()
                        .fold(false, |far, x| far | (x.abs() > math::TRIG_LIMIT));
                    if far {
                        for (o, &x) in out.iter_mut().zip(xs) {
                            if x.abs() > math::TRIG_LIMIT {
                                *o = slow(x);
                            }
                        }
                    }
                }
                Src::Splat(x) if x.abs() > math::TRIG_LIMIT => out.fill(slow(x)),
                Src::Splat(_) => {}
            }
        }
    }
);
float!(f64, f64::exp, f64::ln, f64::sin, f64::cos, {});

/// One element-wise function, as a type, so that each kernel is its own monomorphised loop.
trait Func<C>: Send + Sync + 'static {
    fn call(x: C, y: C) -> C;
    /// Corrects a run after the vectorised pass, where `call` is not accurate for every input.
    #[inline(always)]
    fn fix(_out: &mut [C], _x: Src<'_, C>) {}
}

macro_rules! funcs {
    ($bound:ident: $($name:ident => |$x:ident, $y:ident| $body:expr;)*) => {$(
        struct $name;
        impl<C: $bound> Func<C> for $name {
            #[inline(always)]
            #[allow(unused_variables)]
            fn call($x: C, $y: C) -> C {
                $body
            }
        }
    )*};
}

funcs! { Num:
    Add => |x, y| x.add(y);
    Sub => |x, y| x.sub(y);
    Mul => |x, y| x.mul(y);
    FloorDiv => |x, y| x.floor_div(y);
    Mod => |x, y| x.modulo(y);
    Pow => |x, y| x.pow(y);
    Square => |x, y| x.mul(x);
    Negative => |x, y| x.neg();
    Abs => |x, y| x.abs();
}

funcs! { Float:
    Div => |x, y| x.div(y);
    Sqrt => |x, y| x.sqrt();
    Exp => |x, y| x.exp();
    Log => |x, y| x.ln();
}

struct Sin;
struct Cos;

impl<C: Float> Func<C> for Sin {
    #[inline(always)]
    fn call(x: C, _: C) -> C {
        x.sin()
    }
    fn fix(out: &mut [C], x: Src<'_, C>) {
        C::fix_trig(out, x, false)
    }
}

impl<C: Float> Func<C> for Cos {
    #[inline(always)]
    fn call(x: C, _: C) -> C {
        x.cos()
    }
    fn fix(out: &mut [C], x: Src<'_, C>) {
        C::fix_trig(out, x, true)
    }
}

/// The run loop: one pass per combination of slice and splat inputs.
#[inline(always)]
fn zip<C: Copy, F: Func<C>>(out: &mut [C], a: Src<'_, C>, b: Src<'_, C>) {
    zip_with(out, a, b, F::call)
}

/// `out[i] = f(a[i], b[i])`, one pass per combination of slice and splat inputs (each a loop the
/// compiler vectorises on its own).
#[inline(always)]
fn zip_with<I: Copy, O: Copy>(out: &mut [O], a: Src<'_, I>, b: Src<'_, I>, f: impl Fn(I, I) -> O) {
    match (a, b) {
        (Src::Slice(a), Src::Slice(b)) => {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                *o = f(x, y);
            }
        }
        (Src::Slice(a), Src::Splat(y)) => {
            for (o, &x) in out.iter_mut().zip(a) {
                *o = f(x, y);
            }
        }
        (Src::Splat(x), Src::Slice(b)) => {
            for (o, &y) in out.iter_mut().zip(b) {
                *o = f(x, y);
            }
        }
        (Src::Splat(x), Src::Splat(y)) => out.fill(f(x, y)),
    }
}

/// [`zip`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn zip_avx2<C: Copy, F: Func<C>>(out: &mut [C], a: Src<'_, C>, b: Src<'_, C>) {
    zip::<C, F>(out, a, b)
}

/// The kernel of `F` on a type that computes in itself.
fn native<C: Copy, F: Func<C>>(out: &mut [C], a: Src<'_, C>, b: Src<'_, C>) {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        unsafe { zip_avx2::<C, F>(out, a, b) };
    } else {
        zip::<C, F>(out, a, b);
    }
    #[cfg(not(target_arch = "x86_64"))]
    zip::<C, F>(out, a, b);
    F::fix(out, a);
}

/// The kernel of `F` on a 16-bit float: blocks widened to `f32`, computed, rounded once.
fn halves<H: Half, F: Func<f32>>(out: &mut [H], a: Src<'_, H>, b: Src<'_, H>) {
    const N: usize = 256;
    fn widen<'b, H: Half>(src: Src<'_, H>, at: usize, buf: &'b mut [f32]) -> Src<'b, f32> {
        match src {
            Src::Slice(s) => {
                H::widen_slice(&s[at..at + buf.len()], buf);
                Src::Slice(buf)
            }
            Src::Splat(v) => Src::Splat(v.widen()),
        }
    }
    let (mut xa, mut xb, mut xo) = ([0f32; N], [0f32; N], [0f32; N]);
    let mut done = 0;
    while done < out.len() {
        let n = (out.len() - done).min(N);
        let wa = widen(a, done, &mut xa[..n]);
        let wb = widen(b, done, &mut xb[..n]);
        native::<f32, F>(&mut xo[..n], wa, wb);
        H::narrow_slice(&xo[..n], &mut out[done..done + n]);
        done += n;
    }
}

/// The kernel for `op` among the named functions, built by `$wrap` (`None` for the rest).
macro_rules! pick {
    ($op:expr, $wrap:ident, $c:ty, binary [$($b:ident),*], unary [$($u:ident),*]) => {
        match $op {
            $(MapOp::Binary(BinaryOp::$b) => Some($wrap::<$c, $b> as Kernel<$c>),)*
            $(MapOp::Unary(UnaryOp::$u) => Some($wrap::<$c, $u> as Kernel<$c>),)*
            _ => None,
        }
    };
}

/// The integer kernels (no true division, no transcendental functions: the front computes those
/// in floats).
fn int_kernel<C: Num>(op: MapOp) -> Option<Kernel<C>> {
    pick!(
        op, native, C,
        binary [Add, Sub, Mul, FloorDiv, Mod, Pow],
        unary [Square, Negative, Abs]
    )
}

/// The float kernels.
#[allow(unreachable_patterns)]
fn float_kernel<C: Float>(op: MapOp) -> Option<Kernel<C>> {
    pick!(
        op, native, C,
        binary [Add, Sub, Mul, Div, FloorDiv, Mod, Pow],
        unary [Square, Negative, Abs, Sqrt, Exp, Log, Sin, Cos]
    )
}

/// The 16-bit float kernels.
#[allow(unreachable_patterns)]
fn half_kernel<H: Half>(op: MapOp) -> Option<Kernel<H>> {
    pick!(
        op, halves, H,
        binary [Add, Sub, Mul, Div, FloorDiv, Mod, Pow],
        unary [Square, Negative, Abs, Sqrt, Exp, Log, Sin, Cos]
    )
}

/// One comparison, as a type, so that each is its own monomorphised loop.
trait Cmp: Send + Sync + 'static {
    const OP: CompareOp;
}

macro_rules! cmps {
    ($($name:ident),*) => {$(
        struct $name;
        impl Cmp for $name {
            const OP: CompareOp = CompareOp::$name;
        }
    )*};
}

cmps!(Eq, Ne, Lt, Le, Gt, Ge);

/// The comparison kernel of `F`: `out[i] = a[i] F b[i]` as a `bool` byte (IEEE 754 on floats, the
/// 16-bit floats included, as `half` compares them).
fn compare<S: Copy + PartialOrd, F: Cmp>(out: &mut [u8], a: Src<'_, S>, b: Src<'_, S>) {
    zip_with(out, a, b, |x, y| u8::from(F::OP.holds(x, y)))
}

/// The comparison kernel for `op` on storage type `S`.
fn compare_kernel<S: Copy + PartialOrd>(op: CompareOp) -> Kernel<S, u8> {
    match op {
        CompareOp::Eq => compare::<S, Eq>,
        CompareOp::Ne => compare::<S, Ne>,
        CompareOp::Lt => compare::<S, Lt>,
        CompareOp::Le => compare::<S, Le>,
        CompareOp::Gt => compare::<S, Gt>,
        CompareOp::Ge => compare::<S, Ge>,
    }
}

/// The kernel for `op` on storage type `S`.
trait Kernels: Storage {
    fn kernel(op: MapOp) -> Option<Kernel<Self>>;
}

macro_rules! kernels {
    ($via:ident: $($t:ty),*) => {$(
        impl Kernels for $t {
            fn kernel(op: MapOp) -> Option<Kernel<Self>> {
                $via::<$t>(op)
            }
        }
    )*};
}

kernels!(int_kernel: i8, i16, i32, i64, u8, u16, u32, u64);
kernels!(float_kernel: f32, f64);
kernels!(half_kernel: f16, bf16);

/// Runs an element-wise request.
pub(super) fn run(req: &MapRequest<'_>) -> Result<()> {
    let dtype = req.operand_dtype();
    if let MapOp::Cast = req.op {
        return Err(Error::InvalidArgument(
            "the CPU backend has no cast kernel: CPU casts go through the host converter \
             (Tensor::cast)"
                .into(),
        ));
    }
    if let Some(t) = req.tensor_inputs().find(|t| t.dtype() != dtype) {
        return Err(Error::DTypeMismatch(format!(
            "an element-wise kernel on {dtype} got a {} input",
            t.dtype()
        )));
    }
    let what = req.op.name();
    match req.op {
        MapOp::Compare(op) => {
            if req.out.dtype() != DType::BOOL {
                return Err(Error::DTypeMismatch(format!(
                    "{what} writes bool, not {}",
                    req.out.dtype()
                )));
            }
            if dtype == DType::BOOL {
                // `bool` elements are bytes of 0 or 1, ordered as `u8`.
                return execute::<u8, u8>(req, compare_kernel::<u8>(op));
            }
            with_storage!(dtype, S => execute::<S, u8>(req, compare_kernel::<S>(op)),
                _ => Err(unsupported(what, dtype)))
        }
        _ => with_storage!(dtype, S => {
            let kernel = S::kernel(req.op).ok_or_else(|| unsupported(what, dtype))?;
            execute::<S, S>(req, kernel)
        }, _ => Err(unsupported("element-wise arithmetic", dtype))),
    }
}

/// How a kernel reaches one input.
#[derive(Clone, Copy)]
enum Arg<S> {
    /// A tensor: its first element and its plan operand index.
    Tensor(SharedPtr<S>, usize),
    /// A scalar.
    Value(S),
}

fn execute<S: Storage, O: Copy + Send + Sync + 'static>(
    req: &MapRequest<'_>,
    kernel: Kernel<S, O>,
) -> Result<()> {
    let what = req.op.name();
    let arity = req.op.arity();
    if req.inputs.len() != arity {
        return Err(Error::InvalidArgument(format!(
            "{what} takes {arity} operand(s), the request has {}",
            req.inputs.len()
        )));
    }
    let plan = &req.plan;
    let nd = plan.shape.len();
    if plan.strides.len() != 1 + req.tensor_inputs().count()
        || plan.strides[0][nd - 1] != 1 && plan.len() > 1
    {
        return Err(Error::InvalidArgument(
            "an element-wise request needs a compact output and one plan operand per tensor".into(),
        ));
    }
    // Keep the (possibly copied) inputs alive for the whole call.
    let mut held = Vec::with_capacity(2);
    let mut args = [Arg::Value(S::default()), Arg::Value(S::default())];
    let mut operand = 1;
    for (slot, input) in args.iter_mut().zip(&req.inputs) {
        *slot = match input {
            Operand::Tensor(t) => {
                let host = Input::new(t, "computing on it")?;
                let arg = Arg::Tensor(SharedPtr(host.ptr::<S>().cast_mut()), operand);
                held.push(host);
                operand += 1;
                arg
            }
            Operand::Scalar(s) => Arg::Value(S::from_scalar(*s)),
        };
    }
    let out = SharedPtr(output::<O>(req.out)?);
    let zeros = vec![0isize; nd];
    let strides_of = |arg: &Arg<S>| match arg {
        Arg::Tensor(_, k) => plan.strides[*k].as_slice(),
        Arg::Value(_) => zeros.as_slice(),
    };
    let strides = [
        plan.strides[0].as_slice(),
        strides_of(&args[0]),
        strides_of(&args[1]),
    ];
    let inner = [strides[1][nd - 1], strides[2][nd - 1]];
    // Chunks of at least this many elements go to one thread: enough work to pay for the hand-off.
    let min_chunk = match req.op {
        MapOp::Unary(op) if op.is_transcendental() => 16 << 10,
        _ if std::mem::size_of::<S::Wide>() != std::mem::size_of::<S>() => 32 << 10,
        _ => 64 << 10,
    };
    for_chunks(plan.len(), min_chunk, |start, end| {
        walk(&plan.shape, strides, start, end, |off, len| {
            let at = |arg: Arg<S>, k: usize| match arg {
                Arg::Tensor(p, _) => Ref::Strided(p.get().wrapping_offset(off[k + 1]), inner[k]),
                Arg::Value(v) => Ref::Value(v),
            };
            // SAFETY: the run's output elements `off[0]..off[0] + len` lie inside `out` (the plan
            // addresses out's shape compactly) and belong to this chunk alone; each input run
            // addresses `len` elements of its tensor by the plan's strides, which lie inside the
            // input's buffer (its layout was checked when the view was built), and nothing
            // writes the inputs during the call.
            unsafe {
                run_one(
                    kernel,
                    out.get().wrapping_offset(off[0]),
                    at(args[0], 0),
                    at(args[1], 1),
                    len,
                )
            };
        });
    });
    drop(held);
    Ok(())
}

/// One input of a run.
#[derive(Clone, Copy)]
enum Ref<S> {
    Strided(*const S, isize),
    Value(S),
}

/// Runs `kernel` over one run of `len` elements.
///
/// # Safety
/// `out` must address `len` consecutive writable elements no one else accesses during the call;
/// each `Ref::Strided(p, s)` must address `len` readable elements `p.offset(i * s)` that no one
/// writes during the call.
unsafe fn run_one<S: Storage, O>(
    kernel: Kernel<S, O>,
    out: *mut O,
    a: Ref<S>,
    b: Ref<S>,
    len: usize,
) {
    // SAFETY: by the caller's contract.
    let out = unsafe { std::slice::from_raw_parts_mut(out, len) };
    // A contiguous or broadcast run needs no copy.
    let direct = |r: Ref<S>| {
        match r {
            Ref::Value(v) => Some(Src::Splat(v)),
            // SAFETY: one element the caller vouches for (the run is not empty).
            Ref::Strided(p, 0) => Some(Src::Splat(unsafe { *p })),
            // SAFETY: `len` consecutive readable elements, not written during the call.
            Ref::Strided(p, 1) => Some(Src::Slice(unsafe { std::slice::from_raw_parts(p, len) })),
            Ref::Strided(..) => None,
        }
    };
    if let (Some(x), Some(y)) = (direct(a), direct(b)) {
        kernel(out, x, y);
        return;
    }
    let (mut xa, mut xb) = ([S::default(); BLOCK], [S::default(); BLOCK]);
    let mut done = 0;
    while done < len {
        let n = (len - done).min(BLOCK);
        // SAFETY: elements `done..done + n` of the caller's runs.
        let x = unsafe { block(a, done, &mut xa[..n]) };
        // SAFETY: as above.
        let y = unsafe { block(b, done, &mut xb[..n]) };
        kernel(&mut out[done..done + n], x, y);
        done += n;
    }
}

/// Elements `at..at + buf.len()` of one input's run: a slice of the input, one value, or a copy
/// gathered into `buf`.
///
/// # Safety
/// As [`run_one`], for those elements.
unsafe fn block<'b, S: Storage>(r: Ref<S>, at: usize, buf: &'b mut [S]) -> Src<'b, S> {
    let n = buf.len();
    match r {
        Ref::Value(v) => Src::Splat(v),
        Ref::Strided(p, s) => {
            let first = p.wrapping_offset(at as isize * s);
            match s {
                // SAFETY: an element of the caller's run.
                0 => Src::Splat(unsafe { *first }),
                // SAFETY: `n` consecutive elements of the caller's run, not written meanwhile.
                1 => Src::Slice(unsafe { std::slice::from_raw_parts(first, n) }),
                _ => {
                    // SAFETY: `n` elements of the caller's run.
                    unsafe { super::gather(first, s, buf, |x| x) };
                    Src::Slice(buf)
                }
            }
        }
    }
}
