//! How a request runs on Metal, decided without Metal: which kernel variant it needs, the
//! parameter block the kernel reads (laid out exactly as the MSL struct in [`super::msl`]), where
//! each tensor is bound, and how many threadgroups of how many threads to dispatch.
//!
//! Every kernel loops over its work with a grid stride, so a dispatch never needs more than
//! [`MAX_GROUPS`] threadgroups per axis, whatever the size.
//!
//! Tensors are bound at the byte offset of the lowest element they address (the first element,
//! unless some stride is negative), and the parameter block gives each one's `first`: the element
//! index, from there, of its element `[0, 0, ...]`. Every index the kernel forms is then
//! non-negative and inside the bound range.

use super::msl::Elem;
use crate::compute::plan::Split;
use crate::compute::{
    MapOp, MapPlan, MatmulRequest, MatrixLayout, Operand, ReduceOp, ReduceRequest, Scalar,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The most collapsed axes a strided kernel takes; views with more are made compact first.
pub(crate) const MAX_DIMS: usize = 8;

/// Threads per threadgroup the kernels ask for (less where a pipeline allows less).
pub(crate) const GROUP_THREADS: usize = 256;

/// The most threadgroups one dispatch has along one axis (the kernels loop beyond it).
pub(crate) const MAX_GROUPS: usize = 65_535;

/// The buffer index of an element-wise kernel's parameter block (the output is at 0, the inputs
/// at 1 and 2).
pub(crate) const MAP_PARAMS_INDEX: usize = 3;

/// Output rows and columns of one matmul threadgroup's tile.
pub(crate) const MATMUL_TILE: usize = 64;

/// The contracted extent staged in threadgroup memory per step.
pub(crate) const MATMUL_K_TILE: usize = 16;

/// Threads of one matmul threadgroup, `[x, y]` (x along the output's columns).
pub(crate) const MATMUL_THREADS: [usize; 2] = [16, 16];

/// Reductions of at most this many elements per output run one thread per output.
const SHORT_REDUCTION: usize = 32;

/// With at least this many outputs, a reduction over non-contiguous elements runs one thread per
/// output (neighbouring threads then read neighbouring memory).
const MANY_OUTPUTS: usize = 4096;

/// A reduction aims at this many threadgroups in all; fewer outputs are split over several.
const TARGET_GROUPS: usize = 512;

/// A split of a reduction covers at least this many elements.
const MIN_SPLIT: usize = 4096;

/// Threads per threadgroup for a pipeline that allows `max_total` and runs SIMD groups of
/// `width`: [`GROUP_THREADS`] or less, a whole number of SIMD groups (the reductions rely on it).
pub(crate) fn group_size(max_total: usize, width: usize) -> usize {
    let width = width.max(1);
    let t = GROUP_THREADS.min(max_total.max(1));
    if t >= width { t / width * width } else { t }
}

/// Threadgroups for `items` units of work at `per_group` units per threadgroup.
pub(crate) fn groups_for(items: u64, per_group: usize) -> usize {
    let groups = items.div_ceil(per_group.max(1) as u64);
    groups.clamp(1, MAX_GROUPS as u64) as usize
}

/// Where a tensor is bound: its byte offset for `setBuffer:offset:atIndex:`, and the element
/// index of its element `[0, ...]` from there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Binding {
    /// Bytes from the start of the buffer.
    pub(crate) offset: usize,
    /// Elements from the bound address to the view's first element.
    pub(crate) first: i64,
}

/// Whether a kernel can address `t` with typed pointers: its first element is aligned to its
/// element size (else the runtime makes it compact first).
pub(crate) fn is_aligned(t: &Tensor) -> bool {
    t.byte_offset() % t.dtype().itemsize().max(1) == 0
}

/// The binding of a non-empty tensor.
pub(crate) fn binding(t: &Tensor) -> Result<Binding> {
    let itemsize = t.dtype().itemsize().max(1);
    if !is_aligned(t) {
        return Err(Error::Misaligned(format!(
            "a {} view at byte offset {} is not aligned to its {itemsize}-byte elements",
            t.dtype(),
            t.byte_offset()
        )));
    }
    let offset = t.byte_range().start;
    Ok(Binding {
        offset,
        first: ((t.byte_offset() - offset) / itemsize) as i64,
    })
}

/// The bits of `s` converted to `elem` (the request's dtype), zero-extended to 64 bits: what a
/// kernel reinterprets as the scalar operand.
pub(crate) fn scalar_bits(elem: Elem, s: Scalar) -> u64 {
    match elem {
        Elem::F16 => u64::from(half::f16::from_f64(s.as_f64()).to_bits()),
        Elem::BF16 => u64::from(half::bf16::from_f64(s.as_f64()).to_bits()),
        Elem::F32 => u64::from((s.as_f64() as f32).to_bits()),
        Elem::Bool => u64::from(s.as_f64() != 0.0),
        // Integers wrap: the kernel keeps the low bytes.
        _ => s.as_i64() as u64,
    }
}

/// The largest element index reached from `first` over `shape` with `strides` (negative strides
/// only lower it).
fn reach(first: i64, shape: &[usize], strides: &[isize]) -> u128 {
    let up: u128 = shape
        .iter()
        .zip(strides)
        .map(|(&n, &s)| (n.saturating_sub(1) as u128) * (s.max(0) as u128))
        .sum();
    first.max(0) as u128 + up
}

/// Whether indices up to `max` fit the kernels' 32-bit index type.
fn fits_32(max: u128) -> bool {
    max <= i32::MAX as u128
}

// ---------------------------------------------------------------------------------- element-wise

/// How an element-wise kernel walks its operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum MapLayout {
    /// One axis, every operand compact: element `i` of each is at `i`.
    Flat,
    /// Up to [`MAX_DIMS`] axes with per-operand strides; `wide`: 64-bit indices.
    Strided {
        /// Indices or offsets exceed 32 bits.
        wide: bool,
    },
}

/// One compiled element-wise kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MapVariant {
    /// The function.
    pub(crate) op: MapOp,
    /// The output's element type.
    pub(crate) out: Elem,
    /// The inputs' element type (the output's, except for casts and comparisons).
    pub(crate) input: Elem,
    /// Per input position, whether it is a scalar (in the parameter block) or a tensor.
    pub(crate) scalars: Vec<bool>,
    /// Flat or strided.
    pub(crate) layout: MapLayout,
}

impl MapVariant {
    /// The kernel function's name, unique per variant (it keys the pipeline cache).
    pub(crate) fn name(&self) -> String {
        let op = match self.op {
            MapOp::Unary(u) => u.name().to_string(),
            MapOp::Binary(b) => b.name().to_string(),
            MapOp::Cast => format!("cast_{}", self.input.tag()),
            MapOp::Compare(c) => format!("{}_{}", c.name(), self.input.tag()),
        };
        let kinds: String = self
            .scalars
            .iter()
            .map(|&s| if s { 's' } else { 't' })
            .collect();
        let layout = match self.layout {
            MapLayout::Flat => "flat",
            MapLayout::Strided { wide: false } => "strided32",
            MapLayout::Strided { wide: true } => "strided64",
        };
        format!("dlb_map_{op}_{}_{kinds}_{layout}", self.out.tag())
    }
}

/// The parameter block of an element-wise kernel (MSL `MapParams`). Operand slot 0 is the output,
/// slot `1 + k` input position `k`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MapParams {
    /// Elements.
    pub(crate) count: u64,
    /// Axes in use (strided kernels).
    pub(crate) ndim: u32,
    /// Padding.
    pub(crate) pad: u32,
    /// Per input position, a scalar operand's bits ([`scalar_bits`]).
    pub(crate) scalar: [u64; 2],
    /// Per operand slot, the element index of its first element from its binding.
    pub(crate) first: [i64; 3],
    /// Extents, outermost first.
    pub(crate) shape: [u64; MAX_DIMS],
    /// Per operand slot, strides in elements.
    pub(crate) strides: [[i64; MAX_DIMS]; 3],
}

impl MapParams {
    /// The element index operand `slot` reaches at linear index `i`: the strided kernel's
    /// arithmetic (the flat kernel uses `i` itself). A model for the tests.
    #[cfg(test)]
    pub(crate) fn offset(&self, slot: usize, i: u64) -> i64 {
        let (mut off, mut rest) = (self.first[slot], i);
        for d in (0..self.ndim as usize).rev() {
            let n = self.shape[d];
            off += (rest % n) as i64 * self.strides[slot][d];
            rest /= n;
        }
        off
    }
}

/// One element-wise dispatch.
#[derive(Clone, Debug)]
pub(crate) struct MapLaunch {
    /// The kernel.
    pub(crate) variant: MapVariant,
    /// Its parameter block (bound at [`MAP_PARAMS_INDEX`]).
    pub(crate) params: MapParams,
    /// The tensors to bind: (buffer index, operand: `None` for the output, `Some(k)` for input
    /// position `k`, binding).
    pub(crate) buffers: Vec<(usize, Option<usize>, Binding)>,
}

/// The element types of an element-wise request: (output, inputs). Fails first, before any GPU
/// work, for dtypes Metal lacks (`float64`).
pub(crate) fn map_types(op: MapOp, out: DType, inputs: &[Operand<'_>]) -> Result<(Elem, Elem)> {
    let what = op.name();
    let out_elem = Elem::of(out, what)?;
    let in_elem = match (op, inputs.first()) {
        (MapOp::Cast, Some(Operand::Tensor(t))) => Elem::of(t.dtype(), what)?,
        (MapOp::Cast, _) => {
            return Err(Error::InvalidArgument("a cast takes one array".into()));
        }
        (MapOp::Compare(_), _) => {
            let first = inputs.iter().find_map(|o| match o {
                Operand::Tensor(t) => Some(t.dtype()),
                Operand::Scalar(_) => None,
            });
            match first {
                Some(dtype) if out_elem == Elem::Bool => Elem::of(dtype, what)?,
                Some(_) => {
                    return Err(Error::DTypeMismatch(format!(
                        "{what} writes bool, not {}",
                        out_elem.tag()
                    )));
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "{what} needs an array operand"
                    )));
                }
            }
        }
        _ => out_elem,
    };
    Ok((out_elem, in_elem))
}

/// Plans `out = op(inputs)` over `plan` (operand 0 `out`, then the tensor inputs in order).
/// `plan` must have at most [`MAX_DIMS`] axes and every tensor must be aligned ([`is_aligned`]);
/// the runtime makes operands compact first where not.
pub(crate) fn plan_map(
    op: MapOp,
    out: &Tensor,
    inputs: &[Operand<'_>],
    plan: &MapPlan,
) -> Result<MapLaunch> {
    let (out_elem, in_elem) = map_types(op, out.dtype(), inputs)?;
    let arity = op.arity();
    if inputs.len() != arity {
        return Err(Error::InvalidArgument(format!(
            "{op:?} takes {arity} operands, not {}",
            inputs.len()
        )));
    }
    if plan.shape.len() > MAX_DIMS {
        return Err(Error::Shape(format!(
            "the Metal element-wise kernels take at most {MAX_DIMS} axes that cannot be merged; \
             this operation has {}",
            plan.shape.len()
        )));
    }
    let count = plan.len() as u64;
    let mut params = MapParams {
        count,
        ndim: plan.shape.len() as u32,
        pad: 0,
        scalar: [0; 2],
        first: [0; 3],
        shape: [1; MAX_DIMS],
        strides: [[0; MAX_DIMS]; 3],
    };
    for (d, &n) in plan.shape.iter().enumerate() {
        params.shape[d] = n as u64;
    }
    let mut buffers = Vec::with_capacity(arity + 1);
    let mut scalars = Vec::with_capacity(arity);
    // (slot, tensor) pairs in plan order: the output, then each tensor input.
    let mut tensors: Vec<(usize, Option<usize>, &Tensor)> = vec![(0, None, out)];
    for (k, input) in inputs.iter().enumerate() {
        match input {
            Operand::Tensor(t) => {
                scalars.push(false);
                tensors.push((k + 1, Some(k), t));
            }
            Operand::Scalar(s) => {
                scalars.push(true);
                params.scalar[k] = scalar_bits(in_elem, *s);
            }
        }
    }
    if tensors.len() != plan.strides.len() {
        return Err(Error::InvalidArgument(format!(
            "the plan addresses {} operands but the request has {} arrays",
            plan.strides.len(),
            tensors.len()
        )));
    }
    let mut wide = !fits_32(count as u128);
    for (j, &(slot, operand, t)) in tensors.iter().enumerate() {
        let b = binding(t)?;
        params.first[slot] = b.first;
        for (d, &s) in plan.strides[j].iter().enumerate() {
            params.strides[slot][d] = s as i64;
        }
        wide |= !fits_32(reach(b.first, &plan.shape, &plan.strides[j]));
        buffers.push((slot, operand, b));
    }
    let layout = if plan.is_flat() {
        MapLayout::Flat
    } else {
        MapLayout::Strided { wide }
    };
    Ok(MapLaunch {
        variant: MapVariant {
            op,
            out: out_elem,
            input: in_elem,
            scalars,
            layout,
        },
        params,
        buffers,
    })
}

// ------------------------------------------------------------------------------------ reductions

/// The MSL type a reduction accumulates in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Work {
    /// `float` (every floating input).
    Float,
    /// `int` (`max`/`min` of signed integers up to 32 bits).
    Int,
    /// `uint` (`max`/`min` of unsigned integers up to 32 bits).
    UInt,
    /// `long` (`sum` of signed integers, `max`/`min` of `int64`).
    Long,
    /// `ulong` (`sum` of unsigned integers, `max`/`min` of `uint64`).
    ULong,
}

impl Work {
    /// Bytes per value (the size of a partial result).
    pub(crate) const fn size(self) -> usize {
        match self {
            Work::Float | Work::Int | Work::UInt => 4,
            Work::Long | Work::ULong => 8,
        }
    }
}

/// What a reduction kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ReduceInput {
    /// The input tensor, of this element type.
    Tensor(Elem),
    /// Partial results of the first pass, in the work type.
    Partials,
}

/// What a reduction kernel writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ReduceOutput {
    /// The result, of this element type (`mean` divided by the count).
    Final(Elem),
    /// Partial results, in the work type.
    Partials,
}

/// How a reduction kernel spreads its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ReduceKind {
    /// One thread per output, looping over its elements.
    Thread,
    /// One threadgroup per output (or per split of one): threads stride over the elements, then
    /// combine through SIMD-group reductions and threadgroup memory.
    Group,
}

/// One compiled reduction kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ReduceVariant {
    /// The reduction.
    pub(crate) op: ReduceOp,
    /// What it reads.
    pub(crate) input: ReduceInput,
    /// The accumulator type.
    pub(crate) work: Work,
    /// What it writes.
    pub(crate) output: ReduceOutput,
    /// Thread or threadgroup per output.
    pub(crate) kind: ReduceKind,
    /// 64-bit indices.
    pub(crate) wide: bool,
}

impl ReduceVariant {
    /// The kernel function's name, unique per variant.
    pub(crate) fn name(&self) -> String {
        let input = match self.input {
            ReduceInput::Tensor(e) => e.tag(),
            ReduceInput::Partials => "partials",
        };
        let output = match self.output {
            ReduceOutput::Final(e) => e.tag(),
            ReduceOutput::Partials => "partials",
        };
        let kind = match self.kind {
            ReduceKind::Thread => "thread",
            ReduceKind::Group => "group",
        };
        let bits = if self.wide { 64 } else { 32 };
        format!(
            "dlb_reduce_{}_{input}_{}_{output}_{kind}{bits}",
            self.op.name(),
            self.work.msl_name()
        )
    }
}

impl Work {
    /// The accumulator's name in kernel names.
    const fn msl_name(self) -> &'static str {
        match self {
            Work::Float => "float",
            Work::Int => "int",
            Work::UInt => "uint",
            Work::Long => "long",
            Work::ULong => "ulong",
        }
    }
}

/// The parameter block of a reduction kernel (MSL `ReduceParams`, bound at index 2).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ReduceParams {
    /// Output elements.
    pub(crate) outputs: u64,
    /// Elements each output reduces (in this pass).
    pub(crate) count: u64,
    /// Threadgroups per output (the first pass of a split reduction); else 1.
    pub(crate) splits: u64,
    /// Elements per split.
    pub(crate) chunk: u64,
    /// The input's first element, from its binding.
    pub(crate) in_first: i64,
    /// The output's first element, from its binding.
    pub(crate) out_first: i64,
    /// Kept axes in use.
    pub(crate) kept_ndim: u32,
    /// Reduced axes in use.
    pub(crate) red_ndim: u32,
    /// What `mean` divides by: the number of elements reduced (as `float`).
    pub(crate) divisor: f32,
    /// Padding.
    pub(crate) pad: u32,
    /// Extents of the kept axes (the output, row-major).
    pub(crate) kept_shape: [u64; MAX_DIMS],
    /// The input's strides over the kept axes.
    pub(crate) kept_strides: [i64; MAX_DIMS],
    /// Extents of the reduced axes.
    pub(crate) red_shape: [u64; MAX_DIMS],
    /// The input's strides over the reduced axes.
    pub(crate) red_strides: [i64; MAX_DIMS],
}

impl ReduceParams {
    /// The input element index of reduced element `j` of output `o`: the kernel's arithmetic. A
    /// model for the tests.
    #[cfg(test)]
    pub(crate) fn input_offset(&self, o: u64, j: u64) -> i64 {
        let walk = |mut i: u64, ndim: u32, shape: &[u64], strides: &[i64]| {
            let mut off = 0i64;
            for d in (0..ndim as usize).rev() {
                off += (i % shape[d]) as i64 * strides[d];
                i /= shape[d];
            }
            off
        };
        self.in_first
            + walk(o, self.kept_ndim, &self.kept_shape, &self.kept_strides)
            + walk(j, self.red_ndim, &self.red_shape, &self.red_strides)
    }
}

/// Where a reduction pass reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// The request's input (reads) or output (writes), at this binding.
    Tensor(Binding),
    /// The scratch buffer of partial results, from byte 0.
    Scratch,
}

/// One dispatch of a reduction.
#[derive(Clone, Debug)]
pub(crate) struct ReducePass {
    /// The kernel.
    pub(crate) variant: ReduceVariant,
    /// Its parameter block.
    pub(crate) params: ReduceParams,
    /// What it reads (buffer index 0).
    pub(crate) input: Place,
    /// What it writes (buffer index 1).
    pub(crate) output: Place,
}

impl ReducePass {
    /// Threadgroups to dispatch with `threads` threads each.
    pub(crate) fn groups(&self, threads: usize) -> usize {
        match self.variant.kind {
            ReduceKind::Thread => groups_for(self.params.outputs, threads),
            ReduceKind::Group => groups_for(self.params.outputs * self.params.splits, 1),
        }
    }
}

/// A reduction: one pass, or two with partial results in between.
#[derive(Clone, Debug)]
pub(crate) struct ReduceLaunch {
    /// The passes, in order.
    pub(crate) passes: Vec<ReducePass>,
    /// Bytes of scratch memory the passes need (0: none).
    pub(crate) scratch_bytes: usize,
}

/// The accumulator type of `op` with accumulator dtype `acc` (as the front chose it).
pub(crate) fn work_type(op: ReduceOp, acc: DType) -> Result<Work> {
    let elem = Elem::of(acc, op.name())?;
    if op.has_fallback() {
        return Err(Error::UnsupportedOperand(format!(
            "{} has no Metal kernel (the front composes it of other reductions)",
            op.name()
        )));
    }
    Ok(match (op, elem) {
        (_, Elem::F16 | Elem::BF16 | Elem::F32) => Work::Float,
        (ReduceOp::Max | ReduceOp::Min, Elem::I8 | Elem::I16 | Elem::I32) => Work::Int,
        (ReduceOp::Max | ReduceOp::Min, Elem::U8 | Elem::U16 | Elem::U32) => Work::UInt,
        (_, Elem::I64) => Work::Long,
        (_, Elem::U64) => Work::ULong,
        _ => {
            return Err(Error::UnsupportedDType(format!(
                "{} accumulated in {acc} has no Metal kernel",
                op.name()
            )));
        }
    })
}

/// How a reduction of `outputs` outputs of `count` elements each spreads its work: the kind,
/// and the threadgroups per output (1 unless few outputs reduce many elements).
pub(crate) fn reduce_strategy(
    outputs: usize,
    count: usize,
    contiguous: bool,
) -> (ReduceKind, usize) {
    if count <= SHORT_REDUCTION || (outputs >= MANY_OUTPUTS && !contiguous) {
        return (ReduceKind::Thread, 1);
    }
    let splits = if outputs >= TARGET_GROUPS {
        1
    } else {
        TARGET_GROUPS
            .div_ceil(outputs.max(1))
            .min(count.div_ceil(MIN_SPLIT))
            .max(1)
    };
    (ReduceKind::Group, splits)
}

/// Plans a reduction request. The plan's kept and reduced sides must each have at most
/// [`MAX_DIMS`] axes and the input must be aligned; the runtime makes the input compact first
/// where not.
pub(crate) fn plan_reduce(req: &ReduceRequest<'_>) -> Result<ReduceLaunch> {
    let what = req.op.name();
    let in_elem = Elem::of(req.input.dtype(), what)?;
    let out_elem = Elem::of(req.out.dtype(), what)?;
    let work = work_type(req.op, req.acc)?;
    let plan = &req.plan;
    for (side, p) in [("kept", &plan.kept), ("reduced", &plan.reduced)] {
        if p.shape.len() > MAX_DIMS {
            return Err(Error::Shape(format!(
                "the Metal reduction kernels take at most {MAX_DIMS} {side} axes that cannot be \
                 merged; this reduction has {}",
                p.shape.len()
            )));
        }
    }
    let axes = plan.kernel_axes::<MAX_DIMS>().ok_or_else(|| {
        Error::Shape(format!(
            "the Metal reduction kernels take at most {MAX_DIMS} kept and {MAX_DIMS} reduced axes"
        ))
    })?;
    let outputs = plan.outputs();
    let count = plan.count;
    let input = binding(req.input)?;
    let out = binding(req.out)?;
    let params = ReduceParams {
        outputs: outputs as u64,
        count: count as u64,
        splits: 1,
        chunk: count as u64,
        in_first: input.first,
        out_first: out.first,
        kept_ndim: plan.kept.shape.len() as u32,
        red_ndim: plan.reduced.shape.len() as u32,
        divisor: count as f32,
        pad: 0,
        kept_shape: axes.kept_shape,
        kept_strides: axes.kept_strides,
        red_shape: axes.reduced_shape,
        red_strides: axes.reduced_strides,
    };
    let (kind, splits) = reduce_strategy(outputs, count, plan.reduced_contiguous());
    let reached = reach(input.first, &plan.kept.shape, &plan.kept.strides[1])
        + reach(0, &plan.reduced.shape, &plan.reduced.strides[0]);
    let wide = !fits_32(reached)
        || !fits_32((outputs as u128) * (splits as u128) + out.first as u128)
        || !fits_32(count as u128 + MAX_GROUPS as u128 * GROUP_THREADS as u128);
    let variant = |input, output, kind| ReduceVariant {
        op: req.op,
        input,
        work,
        output,
        kind,
        wide,
    };
    if splits == 1 {
        return Ok(ReduceLaunch {
            passes: vec![ReducePass {
                variant: variant(
                    ReduceInput::Tensor(in_elem),
                    ReduceOutput::Final(out_elem),
                    kind,
                ),
                params,
                input: Place::Tensor(input),
                output: Place::Tensor(out),
            }],
            scratch_bytes: 0,
        });
    }
    // Pass 1: each of `splits` threadgroups per output reduces one chunk into partials laid out
    // [outputs, splits]; pass 2 reduces each output's row of partials.
    let Split { chunk, splits } = plan.split(splits, 1);
    let first = ReduceParams {
        splits: splits as u64,
        chunk: chunk as u64,
        out_first: 0,
        ..params
    };
    let mut second = ReduceParams {
        count: splits as u64,
        chunk: splits as u64,
        in_first: 0,
        kept_ndim: 1,
        red_ndim: 1,
        kept_shape: [1; MAX_DIMS],
        kept_strides: [0; MAX_DIMS],
        red_shape: [1; MAX_DIMS],
        red_strides: [0; MAX_DIMS],
        ..params
    };
    second.kept_shape[0] = outputs as u64;
    second.kept_strides[0] = splits as i64;
    second.red_shape[0] = splits as u64;
    second.red_strides[0] = 1;
    Ok(ReduceLaunch {
        passes: vec![
            ReducePass {
                variant: variant(
                    ReduceInput::Tensor(in_elem),
                    ReduceOutput::Partials,
                    ReduceKind::Group,
                ),
                params: first,
                input: Place::Tensor(input),
                output: Place::Scratch,
            },
            ReducePass {
                variant: variant(
                    ReduceInput::Partials,
                    ReduceOutput::Final(out_elem),
                    ReduceKind::Group,
                ),
                params: second,
                input: Place::Scratch,
                output: Place::Tensor(out),
            },
        ],
        scratch_bytes: outputs * splits * work.size(),
    })
}

// ----------------------------------------------------------------------------------- matmul

/// One compiled matrix-product kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MatmulVariant {
    /// The operands' element type.
    pub(crate) elem: Elem,
}

impl MatmulVariant {
    /// The kernel function's name.
    pub(crate) fn name(&self) -> String {
        format!(
            "dlb_matmul_{}_tile{MATMUL_TILE}x{MATMUL_TILE}x{MATMUL_K_TILE}",
            self.elem.tag()
        )
    }
}

/// The parameter block of the matrix-product kernel (MSL `MatmulParams`, bound at index 3).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatmulParams {
    /// Matrices.
    pub(crate) batch: u64,
    /// Rows of `a` and `out`.
    pub(crate) m: u64,
    /// Columns of `b` and `out`.
    pub(crate) n: u64,
    /// The contracted extent.
    pub(crate) k: u64,
    /// `a`'s batch stride, in elements.
    pub(crate) a_batch: i64,
    /// `a`'s row stride.
    pub(crate) a_row: i64,
    /// `a`'s column stride.
    pub(crate) a_col: i64,
    /// `b`'s batch stride.
    pub(crate) b_batch: i64,
    /// `b`'s row stride.
    pub(crate) b_row: i64,
    /// `b`'s column stride.
    pub(crate) b_col: i64,
    /// 1 when `a`'s columns (the contracted axis) are contiguous: threads then load along k.
    pub(crate) a_k_contiguous: u32,
    /// 1 when `b`'s columns are contiguous: threads then load along n.
    pub(crate) b_n_contiguous: u32,
}

/// One matrix-product dispatch.
#[derive(Clone, Debug)]
pub(crate) struct MatmulLaunch {
    /// The kernel.
    pub(crate) variant: MatmulVariant,
    /// Its parameter block.
    pub(crate) params: MatmulParams,
    /// Byte offsets to bind `a`, `b` and `out` at (buffer indices 0, 1, 2).
    pub(crate) offsets: [usize; 3],
    /// Threadgroups along x (columns), y (rows), z (batch).
    pub(crate) groups: [usize; 3],
}

fn layout_params(l: &MatrixLayout) -> (i64, i64, i64) {
    (
        l.batch_stride as i64,
        l.row_stride as i64,
        l.col_stride as i64,
    )
}

/// Plans a matrix-product request (BLAS-compatible layouts: no negative strides, so each operand
/// is bound at its first element).
pub(crate) fn plan_matmul(req: &MatmulRequest<'_>) -> Result<MatmulLaunch> {
    let elem = Elem::of(req.out.dtype(), "matmul")?;
    if !elem.is_float() {
        return Err(Error::UnsupportedDType(format!(
            "matmul on Metal takes float16, bfloat16 and float32, not {}",
            req.out.dtype()
        )));
    }
    for (t, l) in [(req.a, &req.a_layout), (req.b, &req.b_layout)] {
        if t.dtype() != req.out.dtype() {
            return Err(Error::DTypeMismatch(format!(
                "matmul operands of {} and {}",
                t.dtype(),
                req.out.dtype()
            )));
        }
        if l.row_stride < 0 || l.col_stride < 0 || l.batch_stride < 0 {
            return Err(Error::InvalidArgument(format!(
                "matmul operand layout {l:?} has negative strides"
            )));
        }
    }
    for t in [req.a, req.b, req.out] {
        if !is_aligned(t) {
            return Err(Error::Misaligned(format!(
                "a matmul operand at byte offset {} is not aligned to its {}",
                t.byte_offset(),
                t.dtype()
            )));
        }
    }
    let (a_batch, a_row, a_col) = layout_params(&req.a_layout);
    let (b_batch, b_row, b_col) = layout_params(&req.b_layout);
    let params = MatmulParams {
        batch: req.batch as u64,
        m: req.m as u64,
        n: req.n as u64,
        k: req.k as u64,
        a_batch,
        a_row,
        a_col,
        b_batch,
        b_row,
        b_col,
        a_k_contiguous: u32::from(a_col == 1),
        b_n_contiguous: u32::from(b_col == 1),
    };
    let tiles = |extent: usize| groups_for(extent as u64, MATMUL_TILE);
    Ok(MatmulLaunch {
        variant: MatmulVariant { elem },
        params,
        offsets: [
            req.a.byte_offset(),
            req.b.byte_offset(),
            req.out.byte_offset(),
        ],
        groups: [tiles(req.n), tiles(req.m), groups_for(req.batch as u64, 1)],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::{BinaryOp, ReducePlan, UnaryOp, plan::matrix_layout};
    use crate::device::Device;
    use crate::layout::SliceArg;
    use std::mem::{align_of, offset_of, size_of};

    fn cpu(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::zeros(shape, dtype, Device::CPU).unwrap()
    }

    fn map_plan(out: &Tensor, inputs: &[Operand<'_>]) -> MapPlan {
        let mut strides: Vec<&[isize]> = vec![out.strides()];
        for i in inputs {
            if let Operand::Tensor(t) = i {
                strides.push(t.strides());
            }
        }
        MapPlan::new(out.shape(), &strides)
    }

    #[test]
    fn parameter_blocks_match_the_msl_structs() {
        // MapParams: ulong count; uint ndim, pad; ulong scalar[2]; long first[3];
        // ulong shape[8]; long strides[3][8].
        assert_eq!(offset_of!(MapParams, ndim), 8);
        assert_eq!(offset_of!(MapParams, scalar), 16);
        assert_eq!(offset_of!(MapParams, first), 32);
        assert_eq!(offset_of!(MapParams, shape), 56);
        assert_eq!(offset_of!(MapParams, strides), 56 + 8 * MAX_DIMS);
        assert_eq!(size_of::<MapParams>(), 56 + 4 * 8 * MAX_DIMS);
        assert_eq!(align_of::<MapParams>(), 8);
        // ReduceParams: six 8-byte fields, two uints, a float, a pad, four arrays.
        assert_eq!(offset_of!(ReduceParams, kept_ndim), 48);
        assert_eq!(offset_of!(ReduceParams, divisor), 56);
        assert_eq!(offset_of!(ReduceParams, kept_shape), 64);
        assert_eq!(offset_of!(ReduceParams, red_strides), 64 + 3 * 8 * MAX_DIMS);
        assert_eq!(size_of::<ReduceParams>(), 64 + 4 * 8 * MAX_DIMS);
        // MatmulParams: ten 8-byte fields and two uints.
        assert_eq!(offset_of!(MatmulParams, a_k_contiguous), 80);
        assert_eq!(size_of::<MatmulParams>(), 88);
        // Every block fits setBytes (at most 4 KiB).
        assert!(size_of::<MapParams>() <= 4096 && size_of::<ReduceParams>() <= 4096);
    }

    #[test]
    fn group_sizes_are_whole_simd_groups() {
        assert_eq!(group_size(1024, 32), 256);
        assert_eq!(group_size(200, 32), 192);
        assert_eq!(group_size(1024, 64), 256);
        assert_eq!(group_size(16, 32), 16);
        assert_eq!(group_size(0, 0), 1);
        assert_eq!(groups_for(1000, 256), 4);
        assert_eq!(groups_for(0, 256), 1);
        assert_eq!(groups_for(u64::MAX, 256), MAX_GROUPS);
    }

    #[test]
    fn scalars_are_converted_to_the_dtype() {
        assert_eq!(
            scalar_bits(Elem::F32, Scalar::Float(1.5)),
            1.5f32.to_bits() as u64
        );
        assert_eq!(scalar_bits(Elem::F16, Scalar::Int(2)), 0x4000);
        assert_eq!(scalar_bits(Elem::BF16, Scalar::Float(1.0)), 0x3f80);
        // Integers wrap (the kernel keeps the low bytes) and floats truncate toward zero.
        assert_eq!(scalar_bits(Elem::U8, Scalar::Int(-1)) as u8, 255);
        assert_eq!(scalar_bits(Elem::I32, Scalar::Float(-2.7)) as i64, -2);
    }

    #[test]
    fn compact_operands_take_the_flat_kernel() {
        let out = cpu(&[4, 5], DType::F32);
        let a = cpu(&[4, 5], DType::F32);
        let inputs = [Operand::Tensor(&a), Operand::Scalar(Scalar::Float(2.0))];
        let plan = map_plan(&out, &inputs);
        let l = plan_map(MapOp::Binary(BinaryOp::Mul), &out, &inputs, &plan).unwrap();
        assert_eq!(l.variant.layout, MapLayout::Flat);
        assert_eq!(l.variant.scalars, vec![false, true]);
        assert_eq!(l.variant.name(), "dlb_map_mul_f32_ts_flat");
        assert_eq!(l.params.count, 20);
        assert_eq!(l.params.scalar[1], 2.0f32.to_bits() as u64);
        let indices: Vec<_> = l.buffers.iter().map(|b| (b.0, b.1)).collect();
        assert_eq!(indices, vec![(0, None), (1, Some(0))]);
    }

    #[test]
    fn strided_operands_model_the_layout() {
        // out [3, 4] = a.T (a is [4, 3]) + b[::-1] broadcast over rows (b is [4]).
        let out = cpu(&[3, 4], DType::I16);
        let a = cpu(&[4, 3], DType::I16).transpose().unwrap();
        let b = cpu(&[4], DType::I16)
            .slice(
                0,
                SliceArg {
                    start: None,
                    stop: None,
                    step: -1,
                },
            )
            .unwrap()
            .broadcast_to(&[3, 4])
            .unwrap();
        let inputs = [Operand::Tensor(&a), Operand::Tensor(&b)];
        let plan = map_plan(&out, &inputs);
        let l = plan_map(MapOp::Binary(BinaryOp::Add), &out, &inputs, &plan).unwrap();
        assert_eq!(l.variant.layout, MapLayout::Strided { wide: false });
        assert_eq!(l.variant.name(), "dlb_map_add_i16_tt_strided32");
        // b is bound at its lowest element (its last, 6 bytes in): element [0] is 3 further.
        assert_eq!(
            l.buffers[2].2,
            Binding {
                offset: 0,
                first: 3
            }
        );
        assert_eq!(b.byte_offset(), 6);
        for i in 0..12u64 {
            let (r, c) = (i / 4, i % 4);
            assert_eq!(l.params.offset(0, i), i as i64);
            assert_eq!(l.params.offset(1, i), (c * 3 + r) as i64, "a at {i}");
            assert_eq!(l.params.offset(2, i), 3 - c as i64, "b at {i}");
        }
    }

    #[test]
    fn casts_and_unsupported_dtypes() {
        let out = cpu(&[6], DType::U8);
        let x = cpu(&[6], DType::F16);
        let inputs = [Operand::Tensor(&x)];
        let plan = map_plan(&out, &inputs);
        let l = plan_map(MapOp::Cast, &out, &inputs, &plan).unwrap();
        assert_eq!(l.variant.input, Elem::F16);
        assert_eq!(l.variant.name(), "dlb_map_cast_f16_u8_t_flat");

        let wide = cpu(&[6], DType::F64);
        let inputs = [Operand::Tensor(&wide)];
        let plan = map_plan(&wide, &inputs);
        let err = plan_map(MapOp::Unary(UnaryOp::Exp), &wide, &inputs, &plan).unwrap_err();
        assert!(matches!(err, Error::UnsupportedDType(_)), "{err}");
        assert!(err.to_string().contains("float64"), "{err}");
    }

    #[test]
    fn too_many_axes_and_misalignment_are_refused() {
        let shape = [2usize; 9];
        let out = cpu(&shape, DType::F32);
        let strides: Vec<isize> = (0..9).map(|k| 3isize.pow(9 - k as u32)).collect();
        let plan = MapPlan::new(&shape, &[out.strides(), &strides]);
        assert_eq!(plan.shape.len(), 9);
        let inputs = [Operand::Tensor(&out)];
        let err = plan_map(MapOp::Unary(UnaryOp::Abs), &out, &inputs, &plan).unwrap_err();
        assert!(matches!(err, Error::Shape(_)), "{err}");

        let bytes = cpu(&[9], DType::U8);
        let odd = Tensor::new(
            bytes.buffer().clone(),
            DType::U16,
            crate::layout::Layout::contiguous_at(&[4], 1).unwrap(),
        )
        .unwrap();
        assert!(!is_aligned(&odd));
        assert!(matches!(binding(&odd), Err(Error::Misaligned(_))));
    }

    #[test]
    fn wide_indices_when_offsets_pass_32_bits() {
        let out = cpu(&[2, 3], DType::F32);
        let plan = MapPlan::new(&[2, 3], &[out.strides(), &[1 << 31, 1]]);
        let fake = cpu(&[2, 3], DType::F32);
        let inputs = [Operand::Tensor(&fake)];
        let l = plan_map(MapOp::Unary(UnaryOp::Abs), &out, &inputs, &plan).unwrap();
        assert_eq!(l.variant.layout, MapLayout::Strided { wide: true });
    }

    fn reduce_req<'a>(
        op: ReduceOp,
        input: &'a Tensor,
        out: &'a Tensor,
        acc: DType,
        axes: Option<&[isize]>,
    ) -> ReduceRequest<'a> {
        ReduceRequest {
            op,
            input,
            acc,
            out,
            plan: ReducePlan::new(input.shape(), input.strides(), axes).unwrap(),
            ddof: 0.0,
        }
    }

    #[test]
    fn strategies() {
        assert_eq!(reduce_strategy(10, 0, true), (ReduceKind::Thread, 1));
        assert_eq!(reduce_strategy(1000, 20, true), (ReduceKind::Thread, 1));
        assert_eq!(
            reduce_strategy(10_000, 1000, false),
            (ReduceKind::Thread, 1)
        );
        assert_eq!(reduce_strategy(10_000, 1000, true), (ReduceKind::Group, 1));
        assert_eq!(reduce_strategy(600, 100_000, false), (ReduceKind::Group, 1));
        // One output of a million elements: 245 splits of 4096 or more.
        assert_eq!(
            reduce_strategy(1, 1_000_000, true),
            (ReduceKind::Group, 245)
        );
        // Four outputs: 128 groups each.
        assert_eq!(
            reduce_strategy(4, 10_000_000, true),
            (ReduceKind::Group, 128)
        );
        assert_eq!(reduce_strategy(4, 5000, true), (ReduceKind::Group, 2));
    }

    #[test]
    fn axis_reductions_model_the_plan() {
        // Sum over axis 1 of a transposed [5, 40] view (the input is [40, 5] compact).
        let base = cpu(&[40, 5], DType::I8);
        let x = base.transpose().unwrap();
        let out = cpu(&[5], DType::I64);
        let req = reduce_req(ReduceOp::Sum, &x, &out, DType::I64, Some(&[1]));
        let launch = plan_reduce(&req).unwrap();
        assert_eq!(launch.passes.len(), 1);
        assert_eq!(launch.scratch_bytes, 0);
        let pass = &launch.passes[0];
        assert_eq!(pass.variant.work, Work::Long);
        assert_eq!(pass.variant.kind, ReduceKind::Group);
        assert_eq!(pass.variant.name(), "dlb_reduce_sum_i8_long_i64_group32");
        for o in 0..5u64 {
            for j in 0..40u64 {
                assert_eq!(pass.params.input_offset(o, j), (j * 5 + o) as i64);
            }
        }
        assert_eq!(pass.groups(256), 5);
    }

    #[test]
    fn long_reductions_split_into_two_passes() {
        let x = cpu(&[3, 100_000], DType::F16);
        let out = cpu(&[3], DType::F16);
        let req = reduce_req(ReduceOp::Mean, &x, &out, DType::F32, Some(&[-1]));
        let launch = plan_reduce(&req).unwrap();
        assert_eq!(launch.passes.len(), 2);
        let (p1, p2) = (&launch.passes[0], &launch.passes[1]);
        let splits = p1.params.splits;
        assert_eq!(splits, 25); // min(512 / 3 rounded up, 100000 / 4096 rounded up)
        assert_eq!(launch.scratch_bytes, 3 * 25 * 4);
        assert_eq!(p1.output, Place::Scratch);
        assert_eq!(p1.variant.output, ReduceOutput::Partials);
        assert_eq!(p1.groups(256), 75);
        // Every element lands in exactly one split.
        assert!(p1.params.chunk * splits >= 100_000);
        assert!(p1.params.chunk * (splits - 1) < 100_000);
        assert_eq!(p2.input, Place::Scratch);
        assert_eq!(p2.variant.input, ReduceInput::Partials);
        assert_eq!(p2.variant.output, ReduceOutput::Final(Elem::F16));
        assert_eq!(p2.params.count, splits);
        assert_eq!(p2.params.divisor, 100_000.0);
        // Pass 2 reads partial [o, s] at o * splits + s.
        assert_eq!(p2.params.input_offset(2, 7), (2 * splits + 7) as i64);
        assert_eq!(p1.params.input_offset(1, 99_999), 199_999);
    }

    #[test]
    fn empty_and_full_reductions() {
        let x = cpu(&[0, 4], DType::F32);
        let out = cpu(&[4], DType::F32);
        let req = reduce_req(ReduceOp::Mean, &x, &out, DType::F32, Some(&[0]));
        let launch = plan_reduce(&req).unwrap();
        let pass = &launch.passes[0];
        assert_eq!(pass.variant.kind, ReduceKind::Thread);
        assert_eq!((pass.params.count, pass.params.outputs), (0, 4));
        assert_eq!(pass.params.divisor, 0.0);

        let y = cpu(&[6, 7], DType::U32);
        let one = cpu(&[], DType::U32);
        let req = reduce_req(ReduceOp::Max, &y, &one, DType::U32, None);
        let pass = &plan_reduce(&req).unwrap().passes[0];
        assert_eq!(pass.variant.work, Work::UInt);
        assert_eq!(pass.params.outputs, 1);
        assert_eq!(pass.params.input_offset(0, 41), 41);

        let z = cpu(&[5], DType::I32);
        let mean = cpu(&[], DType::F64);
        let req = reduce_req(ReduceOp::Mean, &z, &mean, DType::F64, None);
        let err = plan_reduce(&req).unwrap_err();
        assert!(err.to_string().contains("float64"), "{err}");
    }

    #[test]
    fn matmul_plans() {
        let a = cpu(&[2, 100, 30], DType::F32);
        let b = cpu(&[30, 70], DType::F32).transpose().unwrap(); // [70, 30] viewed
        let b = b.transpose().unwrap(); // back to [30, 70]
        let bt = cpu(&[70, 30], DType::F32).transpose().unwrap(); // [30, 70], column-major
        let out = cpu(&[2, 100, 70], DType::F32);
        for (rhs, n_contiguous) in [(&b, 1), (&bt, 0)] {
            let a_layout = matrix_layout(a.shape(), a.strides()).unwrap();
            let rb = rhs
                .expand_dims(0)
                .unwrap()
                .broadcast_to(&[2, 30, 70])
                .unwrap();
            let b_layout = matrix_layout(rb.shape(), rb.strides()).unwrap();
            let req = MatmulRequest {
                a: &a,
                b: &rb,
                out: &out,
                a_layout,
                b_layout,
                batch: 2,
                m: 100,
                k: 30,
                n: 70,
            };
            let l = plan_matmul(&req).unwrap();
            assert_eq!(l.groups, [2, 2, 2]);
            assert_eq!(l.params.a_batch, 3000);
            assert_eq!(l.params.b_batch, 0);
            assert_eq!(l.params.a_k_contiguous, 1);
            assert_eq!(l.params.b_n_contiguous, n_contiguous);
            assert_eq!(l.variant.name(), "dlb_matmul_f32_tile64x64x16");
        }
        let h = cpu(&[2, 2], DType::F64);
        let layout = matrix_layout(h.shape(), h.strides()).unwrap();
        let req = MatmulRequest {
            a: &h,
            b: &h,
            out: &h,
            a_layout: layout,
            b_layout: layout,
            batch: 1,
            m: 2,
            k: 2,
            n: 2,
        };
        let err = plan_matmul(&req).unwrap_err();
        assert!(err.to_string().contains("float64"), "{err}");
    }
}
