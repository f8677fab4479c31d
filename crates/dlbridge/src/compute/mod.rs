//! Built-in kernels over [`Tensor`]s on any backend: element-wise arithmetic with NumPy
//! broadcasting, reductions, (batched) matrix products and dtype casts; operations composed of
//! them (`all`, `any`, `var`, `std`, `isnan`, ...); advanced indexing ([`index`]); and user kernels
//! compiled at run time ([`kernel`]).
//!
//! | layer | here | what it decides |
//! | --- | --- | --- |
//! | device | [`Backend`] | one device's allocation, copies, synchronization, memory figures and run-time kernels |
//! | front | [`unary`], [`binary`], [`binary_scalar`], [`compare`], [`compare_scalar`], [`reduce`], [`matmul`], [`cast`] | checks devices, dtypes ([`promote`]) and shapes ([`broadcast_shapes`], [`MapPlan`]); allocates the result on the operands' device; casts mixed operands first |
//! | composed | [`all`], [`any`], [`isnan`], [`isinf`], [`isfinite`]; `argmax` / `argmin`, [`var`] and [`std()`] where a backend has no kernel for them | the front's operations in sequence, so every backend has them |
//! | indexing | [`index::take`], [`index::put`], [`index::take_mask`], [`index::put_mask`], [`index::nonzero`] | NumPy's advanced indexing: index arrays checked and turned into block offsets on the host, blocks moved by the CPU (a device's view staged through host memory) |
//! | request | `MapRequest`, `ReduceRequest`, `MatmulRequest` (crate-internal) | what a backend executes: every tensor operand already has the dtype the kernel computes on, and the shape of the output |
//! | backend | `backend::{cpu,cuda,metal}::compute` | how: Rust loops and `gemm` on the CPU; NVRTC kernels and cuBLAS on CUDA; MSL kernels on Metal |
//!
//! Results are new compact arrays on the operands' device (the caching pool makes that cheap).
//! On CUDA the work is enqueued on the calling thread's current stream and this returns without
//! waiting; on Metal it is encoded in dlbridge's queue; on the CPU it is done on return.
//!
//! # Numbers
//! `float16` and `bfloat16` are computed in `float32` and rounded once when stored. Integer
//! arithmetic wraps, as NumPy's does; `div` of integers returns `float64`; `floor_divide` and
//! `remainder` of integers by zero give 0 (NumPy's values, without its warning), and the most
//! negative integer divided by -1 wraps to itself; integers to negative integer powers are an
//! error, as in NumPy. `max` and `min` propagate NaN; `argmax` / `argmin` find the first NaN.
//! `var` and `std` are one pass over the data where the backend has a kernel for them (CPU,
//! CUDA): batches' means and squared deviations (in the computing type) merged by Chan's formula
//! in `float64`, good to the computing type's rounding plus about `eps(float64) * |mean| / std`.
//! A `sum` of nothing is 0, a `prod` 1, a `mean` NaN, and `max` / `min` / `argmax` / `argmin` of
//! nothing are errors. Comparisons return `bool` and follow IEEE 754 as NumPy does: NaN is unequal to everything, itself included, so `!=` is its
//! only true comparison. An integer scalar outside the array's dtype compares by its value (`int8`
//! values are all `< 1000`), not wrapped into the dtype.

mod compose;
mod device;
mod elem;
pub mod index;
pub mod kernel;
pub(crate) mod plan;
pub mod promote;

use crate::backend;
use crate::device::Device;
use crate::dtype::{DType, DTypeCode};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub use compose::{all, any, isfinite, isinf, isnan, std, var};
pub use device::{Backend, BackendType};
pub(crate) use elem::Elem;
pub use plan::{MapPlan, broadcast_shapes};
pub(crate) use plan::{MatmulShape, MatrixLayout, ReducePlan};

/// Element-wise functions of one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// Square root.
    Sqrt,
    /// `e` to the power.
    Exp,
    /// Natural logarithm.
    Log,
    /// Sine (radians).
    Sin,
    /// Cosine (radians).
    Cos,
    /// Absolute value.
    Abs,
    /// `x * x`.
    Square,
    /// `-x` (wrapping for unsigned integers, as NumPy).
    Negative,
}

impl UnaryOp {
    /// Every unary op.
    pub const ALL: [UnaryOp; 8] = [
        UnaryOp::Sqrt,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Abs,
        UnaryOp::Square,
        UnaryOp::Negative,
    ];

    /// The op's name (`"sqrt"`, ...), as the Python API spells it.
    pub const fn name(self) -> &'static str {
        match self {
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Abs => "abs",
            UnaryOp::Square => "square",
            UnaryOp::Negative => "negative",
        }
    }

    /// Whether the op's result is floating even for integer input.
    pub const fn is_transcendental(self) -> bool {
        matches!(
            self,
            UnaryOp::Sqrt | UnaryOp::Exp | UnaryOp::Log | UnaryOp::Sin | UnaryOp::Cos
        )
    }
}

/// Element-wise functions of two operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b` (true division).
    Div,
    /// `a // b`: the quotient rounded toward negative infinity (NumPy's `floor_divide`; an
    /// integer divided by zero gives 0, as NumPy's values, and the most negative integer divided
    /// by -1 wraps to itself).
    FloorDiv,
    /// `a % b`: the remainder with the divisor's sign (NumPy's `remainder`, Python's `%`); an
    /// integer modulo zero gives 0, as NumPy's values.
    Mod,
    /// `a ** b` (NumPy's `power`; integers wrap, and a negative integer exponent is refused by
    /// the front, as NumPy refuses it).
    Pow,
}

impl BinaryOp {
    /// Every binary op.
    pub const ALL: [BinaryOp; 7] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::FloorDiv,
        BinaryOp::Mod,
        BinaryOp::Pow,
    ];

    /// The op's name (`"add"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::FloorDiv => "floor_divide",
            BinaryOp::Mod => "remainder",
            BinaryOp::Pow => "pow",
        }
    }
}

/// Element-wise comparisons; their results are `bool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompareOp {
    /// `a == b`.
    Eq,
    /// `a != b`.
    Ne,
    /// `a < b`.
    Lt,
    /// `a <= b`.
    Le,
    /// `a > b`.
    Gt,
    /// `a >= b`.
    Ge,
}

impl CompareOp {
    /// Every comparison.
    pub const ALL: [CompareOp; 6] = [
        CompareOp::Eq,
        CompareOp::Ne,
        CompareOp::Lt,
        CompareOp::Le,
        CompareOp::Gt,
        CompareOp::Ge,
    ];

    /// The op's name (`"equal"`, ...), as NumPy and the Python API spell it.
    pub const fn name(self) -> &'static str {
        match self {
            CompareOp::Eq => "equal",
            CompareOp::Ne => "not_equal",
            CompareOp::Lt => "less",
            CompareOp::Le => "less_equal",
            CompareOp::Gt => "greater",
            CompareOp::Ge => "greater_equal",
        }
    }

    /// The operator (`"=="`, ...), as C, MSL and Python write it.
    pub(crate) const fn symbol(self) -> &'static str {
        match self {
            CompareOp::Eq => "==",
            CompareOp::Ne => "!=",
            CompareOp::Lt => "<",
            CompareOp::Le => "<=",
            CompareOp::Gt => ">",
            CompareOp::Ge => ">=",
        }
    }

    /// The comparison with its operands swapped: `a < b` is `b > a`.
    pub const fn swapped(self) -> CompareOp {
        match self {
            CompareOp::Lt => CompareOp::Gt,
            CompareOp::Le => CompareOp::Ge,
            CompareOp::Gt => CompareOp::Lt,
            CompareOp::Ge => CompareOp::Le,
            other => other,
        }
    }

    /// The comparison applied to two ordered values (what every kernel computes; on floats,
    /// `PartialOrd` is IEEE 754's: NaN compares false but for `!=`).
    #[inline(always)]
    pub fn holds<T: PartialOrd>(self, a: T, b: T) -> bool {
        match self {
            CompareOp::Eq => a == b,
            CompareOp::Ne => a != b,
            CompareOp::Lt => a < b,
            CompareOp::Le => a <= b,
            CompareOp::Gt => a > b,
            CompareOp::Ge => a >= b,
        }
    }
}

/// Reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The arithmetic mean.
    Mean,
    /// The largest element (NaN if any is NaN).
    Max,
    /// The smallest element (NaN if any is NaN).
    Min,
    /// The product (integers wrap in 64 bits, as NumPy's).
    Prod,
    /// The index of the largest element in the reduced axes' row-major order (the first one
    /// among equals; the first NaN if there is one, as NumPy).
    ArgMax,
    /// The index of the smallest element (the first one among equals; the first NaN if there is
    /// one).
    ArgMin,
    /// The variance: the squared deviations from the mean, summed and divided by
    /// `max(count - ddof, 0)` (`ddof`: 0 through [`reduce`], any through
    /// [`var`]), as NumPy's `var`.
    Var,
    /// The standard deviation: the square root of [`ReduceOp::Var`].
    Std,
}

impl ReduceOp {
    /// Every reduction.
    pub const ALL: [ReduceOp; 9] = [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Prod,
        ReduceOp::ArgMax,
        ReduceOp::ArgMin,
        ReduceOp::Var,
        ReduceOp::Std,
    ];

    /// The op's name (`"sum"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Prod => "prod",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
            ReduceOp::Var => "var",
            ReduceOp::Std => "std",
        }
    }

    /// Whether the op returns an index (`argmax`, `argmin`) rather than a value.
    pub const fn is_arg(self) -> bool {
        matches!(self, ReduceOp::ArgMax | ReduceOp::ArgMin)
    }

    /// Whether the front can compose the op of the other reductions where a backend has no
    /// kernel for it: the arg reductions, `var` and `std`.
    pub(crate) const fn has_fallback(self) -> bool {
        matches!(
            self,
            ReduceOp::ArgMax | ReduceOp::ArgMin | ReduceOp::Var | ReduceOp::Std
        )
    }

    /// Whether the op has no value over no elements (`max`, `min` and the arg reductions: they
    /// have no identity).
    pub(crate) const fn needs_elements(self) -> bool {
        matches!(
            self,
            ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax | ReduceOp::ArgMin
        )
    }
}

/// A Python-style scalar operand: "weak", it takes the array's dtype where it can.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
}

impl Scalar {
    /// The value as `f64` (what float kernels compute with).
    pub fn as_f64(self) -> f64 {
        match self {
            Scalar::Int(i) => i as f64,
            Scalar::Float(f) => f,
        }
    }

    /// The value as a wrapping `i64` (what integer kernels compute with; floats truncate toward
    /// zero).
    pub fn as_i64(self) -> i64 {
        match self {
            Scalar::Int(i) => i,
            Scalar::Float(f) => f as i64,
        }
    }
}

/// What an element-wise kernel computes per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum MapOp {
    /// `out = op(in0)`; every operand in the request's dtype.
    Unary(UnaryOp),
    /// `out = op(in0, in1)`; every operand in the request's dtype.
    Binary(BinaryOp),
    /// `out = in0` converted from the input's dtype to the output's (NumPy's `astype` rules:
    /// floats truncate toward zero into integers, out-of-range values wrap for integers).
    Cast,
    /// `out = op(in0, in1)`, a `bool` (stored as 0 or 1); both operands in the request's operand
    /// dtype ([`MapRequest::operand_dtype`]), which may be `bool` too.
    Compare(CompareOp),
}

impl MapOp {
    /// The operation's name in messages (`exp`, `add`, `cast`).
    pub(crate) const fn name(self) -> &'static str {
        match self {
            MapOp::Unary(op) => op.name(),
            MapOp::Binary(op) => op.name(),
            MapOp::Cast => "cast",
            MapOp::Compare(op) => op.name(),
        }
    }

    /// How many operands the function takes.
    pub(crate) const fn arity(self) -> usize {
        match self {
            MapOp::Binary(_) | MapOp::Compare(_) => 2,
            MapOp::Unary(_) | MapOp::Cast => 1,
        }
    }
}

/// One input of an element-wise kernel.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Operand<'a> {
    /// An array, viewed with the output's shape (broadcast axes have stride 0).
    Tensor(&'a Tensor),
    /// A scalar, converted to the request's dtype by the kernel ([`Scalar::as_f64`] for floats,
    /// [`Scalar::as_i64`] wrapping for integers).
    Scalar(Scalar),
}

/// An element-wise kernel to run: `out[i] = op(inputs[0][i], inputs[1][i])`.
///
/// Contract: `out` is a new compact array the backend may write; every tensor input has `out`'s
/// shape and lives on `out`'s device; for [`MapOp::Unary`] and [`MapOp::Binary`] every tensor
/// input has `out`'s dtype (`dtype`); for [`MapOp::Cast`] the one input may have any numeric
/// dtype; for [`MapOp::Compare`] `out` is `bool` and the tensor inputs share one dtype
/// ([`MapRequest::operand_dtype`]), with at least one tensor among the inputs. `plan` is the collapsed loop nest with `out` as operand 0, then the tensor inputs in
/// order (scalars have no entry).
#[derive(Debug)]
pub(crate) struct MapRequest<'a> {
    /// The function.
    pub op: MapOp,
    /// One operand (unary, cast) or two (binary).
    pub inputs: Vec<Operand<'a>>,
    /// The result, compact, written by the backend.
    pub out: &'a Tensor,
    /// The collapsed index space: operand 0 is `out`, then each tensor input.
    pub plan: MapPlan,
}

impl MapRequest<'_> {
    /// The dtype arithmetic operands have (`out`'s).
    #[cfg_attr(not(metal), allow(dead_code))] // read by the Metal backend
    pub(crate) fn dtype(&self) -> DType {
        self.out.dtype()
    }

    /// The dtype the inputs are read in: the first tensor input's for casts and comparisons,
    /// else `out`'s ([`MapRequest::dtype`]).
    pub(crate) fn operand_dtype(&self) -> DType {
        match self.op {
            MapOp::Cast | MapOp::Compare(_) => self
                .tensor_inputs()
                .next()
                .map_or(self.out.dtype(), Tensor::dtype),
            MapOp::Unary(_) | MapOp::Binary(_) => self.out.dtype(),
        }
    }

    /// The tensor inputs, in order.
    pub(crate) fn tensor_inputs(&self) -> impl Iterator<Item = &Tensor> {
        self.inputs.iter().filter_map(|o| match o {
            Operand::Tensor(t) => Some(*t),
            Operand::Scalar(_) => None,
        })
    }
}

impl<'a> MapRequest<'a> {
    /// Compact copies of the tensor inputs a backend's kernels cannot read in place: those
    /// `must_copy` names, and, when the index space has more than `max_axes` axes, every input
    /// that is not contiguous (`out` is compact, so compact inputs collapse with it into one
    /// axis). One entry per input (`None`: used as it is); `None` when no input needs a copy.
    ///
    /// # Errors
    /// The copy's (memory, mostly).
    #[cfg_attr(not(any(cuda, metal)), allow(dead_code))] // the device backends use it
    pub(crate) fn staged_inputs(
        &self,
        max_axes: usize,
        must_copy: impl Fn(&Tensor) -> bool,
    ) -> Result<Option<Vec<Option<Tensor>>>> {
        let too_many = self.plan.shape.len() > max_axes;
        let copies = self
            .inputs
            .iter()
            .map(|o| match o {
                Operand::Tensor(t) if must_copy(t) || (too_many && !t.is_contiguous()) => {
                    t.copy().map(Some)
                }
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(copies.iter().any(Option::is_some).then_some(copies))
    }

    /// This request with its inputs replaced by `copies` where there is one (from
    /// [`MapRequest::staged_inputs`]), and planned again.
    #[cfg_attr(not(any(cuda, metal)), allow(dead_code))] // the device backends use it
    pub(crate) fn with_inputs<'b>(&self, copies: &'b [Option<Tensor>]) -> MapRequest<'b>
    where
        'a: 'b,
    {
        let inputs: Vec<Operand<'b>> = self
            .inputs
            .iter()
            .zip(copies)
            .map(|(o, c)| c.as_ref().map_or(*o, Operand::Tensor))
            .collect();
        let mut strides: Vec<&[isize]> = vec![self.out.strides()];
        strides.extend(inputs.iter().filter_map(|o| match *o {
            Operand::Tensor(t) => Some(t.strides()),
            Operand::Scalar(_) => None,
        }));
        let plan = MapPlan::new(self.out.shape(), &strides);
        MapRequest {
            op: self.op,
            inputs,
            out: self.out,
            plan,
        }
    }
}

/// A reduction to run: for each output element, `op` over the input elements the plan assigns to
/// it, accumulated in `acc`, the result converted to `out`'s dtype. `mean` divides the
/// accumulated sum, `var` and `std` the sum of squared deviations, by
/// [`ReduceRequest::divisor`]; the arg reductions write `int64` positions in the reduced axes'
/// row-major order. The request is never empty on the output side; an empty reduced side
/// (`plan.count == 0`) reaches a backend only for `sum` (write 0), `prod` (1), `mean` (NaN) and
/// `var` / `std` (0 divided by the divisor).
#[derive(Debug)]
pub(crate) struct ReduceRequest<'a> {
    /// The reduction.
    pub op: ReduceOp,
    /// The input (any layout).
    pub input: &'a Tensor,
    /// The dtype partial results are kept in (for `var` and `std`: their count, mean and sum of
    /// squared deviations; for the arg reductions: the extreme so far, beside its position).
    pub acc: DType,
    /// The result, compact, of shape `plan.out_shape`.
    pub out: &'a Tensor,
    /// The index space: `plan.kept` addresses the output (operand 0) and the input (operand 1);
    /// `plan.reduced` the input's reduced axes.
    pub plan: ReducePlan,
    /// `var` and `std`'s delta degrees of freedom (0 for the other reductions).
    pub ddof: f64,
}

impl<'a> ReduceRequest<'a> {
    /// What `mean` divides its sum by (the count), and `var` and `std` their sum of squared
    /// deviations (`max(count - ddof, 0)`, as NumPy: a divisor of 0 gives `inf` or NaN).
    pub(crate) fn divisor(&self) -> f64 {
        let count = self.plan.count as f64;
        match self.op {
            ReduceOp::Var | ReduceOp::Std => (count - self.ddof).max(0.0),
            _ => count,
        }
    }

    /// The input copied with its kept axes first and its reduced axes last, so that each side
    /// collapses to one axis, and the plan over the copy: for kernels that walk a bounded number
    /// of axes (or need an aligned, compact input). Axes of extent 1 count as reduced, which
    /// changes neither the outputs nor their order.
    ///
    /// # Errors
    /// The copy's (memory, mostly).
    #[cfg_attr(not(any(cuda, metal)), allow(dead_code))] // the device backends use it
    pub(crate) fn staged_input(&self) -> Result<(Tensor, ReducePlan)> {
        let ndim = self.input.ndim();
        let reduced = |a: &usize| self.plan.keepdims_shape[*a] == 1;
        let kept: Vec<usize> = (0..ndim).filter(|a| !reduced(a)).collect();
        let perm: Vec<usize> = kept
            .iter()
            .copied()
            .chain((0..ndim).filter(reduced))
            .collect();
        let input = self.input.permute(&perm)?.copy()?;
        let axes: Vec<isize> = (kept.len() as isize..ndim as isize).collect();
        let plan = ReducePlan::new(input.shape(), input.strides(), Some(&axes))?;
        Ok((input, plan))
    }

    /// This request over `input` and `plan` (from [`ReduceRequest::staged_input`]).
    #[cfg_attr(not(any(cuda, metal)), allow(dead_code))] // the device backends use it
    pub(crate) fn with_input<'b>(&self, input: &'b Tensor, plan: ReducePlan) -> ReduceRequest<'b>
    where
        'a: 'b,
    {
        ReduceRequest {
            op: self.op,
            input,
            acc: self.acc,
            out: self.out,
            plan,
            ddof: self.ddof,
        }
    }
}

/// A batched matrix product to run: `out[b] = a[b] @ b[b]` for `b` in `0..batch`.
///
/// Contract: `a`, `b` and `out` share one floating dtype and device; their layouts are given by
/// `a_layout`, `b_layout` (relative to each tensor's first element) and are BLAS-compatible
/// ([`MatrixLayout::blas_compatible`]); `out` is compact, shape `[batch, m, n]` row-major. `k`
/// may be 0 (the product is zeros).
#[derive(Debug)]
pub(crate) struct MatmulRequest<'a> {
    /// The left operands (`batch × m × k`).
    pub a: &'a Tensor,
    /// The right operands (`batch × k × n`).
    pub b: &'a Tensor,
    /// The result (`batch × m × n`, compact).
    pub out: &'a Tensor,
    /// How `a` is laid out.
    pub a_layout: MatrixLayout,
    /// How `b` is laid out.
    pub b_layout: MatrixLayout,
    /// Matrices in the batch.
    pub batch: usize,
    /// Rows of `a` and `out`.
    pub m: usize,
    /// The contracted extent.
    pub k: usize,
    /// Columns of `b` and `out`.
    pub n: usize,
}

/// The device all `tensors` live on, or an error naming the two that differ.
fn common_device<'a>(what: &str, tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<Device> {
    let mut found: Option<Device> = None;
    for t in tensors {
        if backend::facts(t.device().kind()).is_some_and(|f| f.faults_on_misaligned) {
            // A misaligned element address makes a CUDA kernel fault, and the driver keeps that
            // fault for the rest of the process: refuse such a (foreign) view up front.
            let address = (t.buffer().handle() as usize).wrapping_add(t.byte_offset());
            let align = t.dtype().itemsize().max(1);
            if t.numel() > 0 && address % align != 0 {
                return Err(Error::Misaligned(format!(
                    "{what}: the {} array at {address:#x} is not aligned to its {align}-byte \
                     elements; copy it first (Array.copy())",
                    t.dtype()
                )));
            }
        }
        match found {
            None => found = Some(t.device()),
            Some(d) if d == t.device() => {}
            Some(d) => {
                return Err(Error::InvalidArgument(format!(
                    "{what}: the arrays are on different devices ({d} and {}); move one with \
                     copy_to / Array.to first",
                    t.device()
                )));
            }
        }
    }
    let device = found.expect("at least one tensor");
    if backend::facts(device.kind()).is_none() {
        return Err(Error::UnsupportedDevice(format!(
            "{what} on {device}: dlbridge computes on cpu, cuda and metal devices"
        )));
    }
    Ok(device)
}

/// A new compact array on `like`'s device, in `like`'s storage mode.
fn new_on(like: &Tensor, shape: &[usize], dtype: DType) -> Result<Tensor> {
    Tensor::allocate(
        shape,
        dtype,
        like.device(),
        Some(like.buffer().storage_mode()),
        false,
    )
}

/// `x` with dtype `dtype` (itself when it already has it, else a converted copy on its device).
fn with_dtype(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        Ok(x.clone())
    } else {
        cast(x, dtype)
    }
}

fn run_map(req: &MapRequest<'_>) -> Result<()> {
    if req.plan.is_empty() {
        return Ok(());
    }
    backend::map(req)
}

/// The request for `op` over `inputs` into `out`.
fn map_request<'a>(op: MapOp, inputs: Vec<Operand<'a>>, out: &'a Tensor) -> MapRequest<'a> {
    let mut strides: Vec<&[isize]> = vec![out.strides()];
    for input in &inputs {
        if let Operand::Tensor(t) = input {
            strides.push(t.strides());
        }
    }
    let plan = MapPlan::new(out.shape(), &strides);
    MapRequest {
        op,
        inputs,
        out,
        plan,
    }
}

/// `x` converted to `dtype`, computed on `x`'s device (NumPy's `astype` rules). The kernels
/// convert between the integer and floating types of [`promote::is_numeric`] and `bool`.
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    let device = common_device("cast", [x])?;
    let supported = |d: DType| promote::is_numeric(d) || d == DType::BOOL;
    if !supported(x.dtype()) || !supported(dtype) || device.is_cpu() {
        // The host converter covers every dtype (complex and the minifloats included).
        return backend::cast_on_host(x, dtype);
    }
    let out = new_on(x, x.shape(), dtype)?;
    run_map(&map_request(MapOp::Cast, vec![Operand::Tensor(x)], &out))?;
    Ok(out)
}

/// `op(x)` element-wise; the result dtype follows [`promote::unary_result`].
pub fn unary(op: UnaryOp, x: &Tensor) -> Result<Tensor> {
    common_device(op.name(), [x])?;
    let dtype = promote::unary_result(op, x.dtype())?;
    let x = with_dtype(x, dtype)?;
    let out = new_on(&x, x.shape(), dtype)?;
    run_map(&map_request(
        MapOp::Unary(op),
        vec![Operand::Tensor(&x)],
        &out,
    ))?;
    Ok(out)
}

/// `x` (`bool` elements, bytes of 0 or 1) viewed as `uint8` bytes: what the reductions and
/// arithmetic of `bool` arrays run on.
pub(crate) fn bool_bytes(x: &Tensor) -> Result<Tensor> {
    Tensor::new(x.buffer().clone(), DType::U8, x.layout().clone())
}

/// The error for integers raised to negative integer powers (NumPy's `ValueError`).
fn negative_power() -> Error {
    Error::InvalidArgument("integers to negative integer powers are not allowed".into())
}

/// Fails when the signed integer exponents `exponents` (of a `pow` computed in integers) hold a
/// negative one, as NumPy does; reads their minimum back on the host (a device waits for it).
fn refuse_negative_exponents(exponents: &Tensor) -> Result<()> {
    if exponents.dtype().code() != DTypeCode::Int || exponents.numel() == 0 {
        return Ok(());
    }
    let least = cast(&reduce(ReduceOp::Min, exponents, None, false)?, DType::I64)?;
    let least = least.copy_to(Device::CPU)?.to_vec::<i64>()?;
    if least.first().is_some_and(|&v| v < 0) {
        return Err(negative_power());
    }
    Ok(())
}

/// `op(a, b)` element-wise with NumPy broadcasting; the dtype follows [`promote::promote`] and
/// [`promote::binary_result`].
pub fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    common_device(op.name(), [a, b])?;
    let shape = broadcast_shapes(a.shape(), b.shape())?;
    let dtype = promote::binary_result(op, promote::promote(a.dtype(), b.dtype())?);
    let a = with_dtype(a, dtype)?.broadcast_to(&shape)?;
    let b = with_dtype(b, dtype)?.broadcast_to(&shape)?;
    if op == BinaryOp::Pow {
        refuse_negative_exponents(&b)?;
    }
    let out = new_on(&a, &shape, dtype)?;
    let inputs = vec![Operand::Tensor(&a), Operand::Tensor(&b)];
    run_map(&map_request(MapOp::Binary(op), inputs, &out))?;
    Ok(out)
}

/// `op(a, s)`, or `op(s, a)` when `scalar_first`; the scalar is weak ([`promote::promote_scalar`]).
pub fn binary_scalar(op: BinaryOp, a: &Tensor, s: Scalar, scalar_first: bool) -> Result<Tensor> {
    common_device(op.name(), [a])?;
    let dtype = promote::binary_result(op, promote::promote_scalar(a.dtype(), s)?);
    let a = with_dtype(a, dtype)?;
    if op == BinaryOp::Pow && dtype.code() == DTypeCode::Int {
        if scalar_first {
            refuse_negative_exponents(&a)?;
        } else if s.as_i64() < 0 {
            return Err(negative_power());
        }
    }
    let out = new_on(&a, a.shape(), dtype)?;
    let inputs = if scalar_first {
        vec![Operand::Scalar(s), Operand::Tensor(&a)]
    } else {
        vec![Operand::Tensor(&a), Operand::Scalar(s)]
    };
    run_map(&map_request(MapOp::Binary(op), inputs, &out))?;
    Ok(out)
}

/// `op(a, b)` element-wise with NumPy broadcasting, a `bool` array. The operands are compared in
/// their common dtype ([`promote::compare_type`]).
pub fn compare(op: CompareOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    common_device(op.name(), [a, b])?;
    let shape = broadcast_shapes(a.shape(), b.shape())?;
    let dtype = promote::compare_type(a.dtype(), b.dtype())?;
    let a = with_dtype(a, dtype)?.broadcast_to(&shape)?;
    let b = with_dtype(b, dtype)?.broadcast_to(&shape)?;
    let out = new_on(&a, &shape, DType::BOOL)?;
    let inputs = vec![Operand::Tensor(&a), Operand::Tensor(&b)];
    run_map(&map_request(MapOp::Compare(op), inputs, &out))?;
    Ok(out)
}

/// `op(a, s)`, or `op(s, a)` when `scalar_first`, a `bool` array. The scalar is weak
/// ([`promote::compare_scalar_type`]), but an integer outside the array's integer dtype is
/// compared by its value: every element is then on the same side of it.
pub fn compare_scalar(op: CompareOp, a: &Tensor, s: Scalar, scalar_first: bool) -> Result<Tensor> {
    common_device(op.name(), [a])?;
    // `s < a` is `a > s`: the array always comes first.
    let op = if scalar_first { op.swapped() } else { op };
    let dtype = promote::compare_scalar_type(a.dtype(), s)?;
    if let Some(side) = promote::int_scalar_outside(dtype, s) {
        // Every element is below (`Less`: the scalar is above the dtype's range) or above it.
        let out = new_on(a, a.shape(), DType::BOOL)?;
        let value = op.holds(side, std::cmp::Ordering::Equal);
        // SAFETY: `out` is new memory no one else references yet.
        unsafe { out.fill_bytes_unchecked(&[u8::from(value)])? };
        return Ok(out);
    }
    let a = with_dtype(a, dtype)?;
    let out = new_on(&a, a.shape(), DType::BOOL)?;
    let inputs = vec![Operand::Tensor(&a), Operand::Scalar(s)];
    run_map(&map_request(MapOp::Compare(op), inputs, &out))?;
    Ok(out)
}

/// `op` over `axes` of `x` (`None`: every axis; negative axes count from the end). With
/// `keepdims` the reduced axes stay, with length 1.
///
/// `bool` arrays reduce as NumPy's: `sum` and `prod` count in `int64`, `mean` gives `float64`,
/// `max` / `min` stay `bool`. `argmax` / `argmin` give `int64` indices into the reduced axes taken
/// in row-major order (over one axis, the position along it); on a backend without an arg kernel
/// they are composed of a `max` (`min`), comparisons and a `max` over index keys. `var` and `std`
/// divide by the count here (NumPy's `ddof=0`; [`var`] and [`std()`] take any); floating arrays
/// keep their dtype (computed in at least `float32`), integer and `bool` arrays give `float64`.
pub fn reduce(op: ReduceOp, x: &Tensor, axes: Option<&[isize]>, keepdims: bool) -> Result<Tensor> {
    reduce_with(op, x, axes, keepdims, 0.0)
}

/// [`reduce`] with `var` and `std`'s delta degrees of freedom.
fn reduce_with(
    op: ReduceOp,
    x: &Tensor,
    axes: Option<&[isize]>,
    keepdims: bool,
    ddof: f64,
) -> Result<Tensor> {
    common_device(op.name(), [x])?;
    if x.dtype() == DType::BOOL {
        let r = reduce_with(op, &bool_bytes(x)?, axes, keepdims, ddof)?;
        return match op {
            ReduceOp::Sum | ReduceOp::Prod => cast(&r, DType::I64),
            // Any non-zero byte is true.
            ReduceOp::Max | ReduceOp::Min => cast(&r, DType::BOOL),
            ReduceOp::Mean
            | ReduceOp::ArgMax
            | ReduceOp::ArgMin
            | ReduceOp::Var
            | ReduceOp::Std => Ok(r),
        };
    }
    let (acc, out_dtype) = promote::reduce_types(op, x.dtype())?;
    let plan = ReducePlan::new(x.shape(), x.strides(), axes)?;
    let keepdims_shape: Vec<Option<usize>> =
        plan.keepdims_shape.iter().copied().map(Some).collect();
    if plan.count == 0 && op.needs_elements() && plan.outputs() > 0 {
        return Err(Error::InvalidArgument(if op.is_arg() {
            format!(
                "attempt to get {} of an empty sequence (shape {:?})",
                op.name(),
                x.shape()
            )
        } else {
            format!(
                "{} of an empty selection (shape {:?}) has no value: the operation has no \
                 identity",
                op.name(),
                x.shape()
            )
        }));
    }
    if op.has_fallback() && plan.outputs() > 0 && !backend::reduces(x.device(), op) {
        return if op.is_arg() {
            compose::arg_reduce(op, x, &plan, keepdims)
        } else {
            compose::moments(op, x, axes, ddof, keepdims)
        };
    }
    let out = new_on(x, &plan.out_shape, out_dtype)?;
    if plan.outputs() > 0 {
        let req = ReduceRequest {
            op,
            input: x,
            acc,
            out: &out,
            plan,
            ddof,
        };
        backend::reduce(&req)?;
    }
    if keepdims {
        out.reshape(&keepdims_shape)
    } else {
        Ok(out)
    }
}

/// The matrix product by NumPy's `matmul` rules (1-d operands, broadcast batch axes); floating
/// dtypes only ([`promote::matmul_type`]).
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    common_device("matmul", [a, b])?;
    let dtype = promote::matmul_type(a.dtype(), b.dtype())?;
    let shape = MatmulShape::new(a.shape(), b.shape())?;
    let as_matrix = |t: &Tensor, full: &[usize]| -> Result<(Tensor, MatrixLayout)> {
        let t = with_dtype(t, dtype)?;
        // A 1-d operand gains its axis, then broadcasts over the batch.
        let t = if t.ndim() == 1 {
            let axis = if full[full.len() - 2] == 1 && full[full.len() - 1] == t.shape()[0] {
                0
            } else {
                1
            };
            t.expand_dims(axis)?
        } else {
            t
        };
        let t = t.broadcast_to(full)?;
        if let Some(layout) = plan::matrix_layout(t.shape(), t.strides())
            && layout.blas_compatible()
        {
            return Ok((t, layout));
        }
        let compact = t.copy()?;
        let layout = plan::matrix_layout(compact.shape(), compact.strides()).ok_or_else(|| {
            Error::Shape(format!(
                "matmul: the batch axes of {:?} do not collapse",
                compact.shape()
            ))
        })?;
        Ok((compact, layout))
    };
    let (ta, a_layout) = as_matrix(a, &shape.a_shape)?;
    let (tb, b_layout) = as_matrix(b, &shape.b_shape)?;
    let batch = shape.batch_count();
    let out = new_on(&ta, &[batch, shape.m, shape.n], dtype)?;
    if batch > 0 && shape.m > 0 && shape.n > 0 {
        let req = MatmulRequest {
            a: &ta,
            b: &tb,
            out: &out,
            a_layout,
            b_layout,
            batch,
            m: shape.m,
            k: shape.k,
            n: shape.n,
        };
        backend::matmul(&req)?;
    }
    let target: Vec<Option<usize>> = shape.out_shape.iter().copied().map(Some).collect();
    out.reshape(&target)
}
