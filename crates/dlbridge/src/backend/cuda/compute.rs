//! The built-in kernels on CUDA: element-wise maps and reductions from the sources in
//! [`codegen`](super::codegen), compiled by NVRTC on first use and cached per device; matrix
//! products through cuBLAS ([`blas`](super::blas)).
//!
//! Everything is enqueued on the calling thread's current stream of the output's device and
//! returns without waiting. Operands are addressed as buffer handle plus byte offset, so views
//! (strided, transposed, reversed, broadcast) are read in place.
//!
//! | request | kernel |
//! | --- | --- |
//! | map, every operand one run (or stride 0) | flat: 16-byte vectors when every operand is aligned for them |
//! | map, otherwise | strided, over ≤ 6 collapsed axes (more: inputs are made compact first) |
//! | reduce (every op, `argmax` / `argmin` and `var` / `std` included: one pass), reduced axes innermost (or everything) | a warp or block per output (16-byte vectors when the rows are contiguous and aligned) |
//! | reduce, kept axes innermost | a thread per output walking the reduced axes (neighbouring threads read neighbouring elements) |
//! | either, too few outputs to fill the GPU | the reduced range split over blocks, partial results combined by a second kernel (no atomics: the result does not depend on timing) |

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::result::{self, occupancy};

use super::codegen::{
    self, MAX_MAP_DIMS, MAX_REDUCE_DIMS, MapArgs, MapKey, MapShape, Mode, ReduceArgs, ReduceKey,
    ReduceKind, THREADS, UNROLL,
};
use super::driver::Named;
use super::nvrtc::{self, Function};
use super::stream::{current_stream, raw};
use super::{BACKEND, Bound, context, first_address};
use crate::compute::plan::MapPlan;
use crate::compute::{Elem, MapRequest, MatmulRequest, Operand, ReduceRequest, Scalar};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Threads that fill one GPU's multiprocessors (2048 resident per SM on every architecture since
/// Volta but Turing's 1024; a reduction that fills fewer splits its work).
const THREADS_PER_SM: usize = 2048;
/// The most splits of one output's reduced range.
const MAX_SPLITS: usize = 1024;

/// What one built-in kernel's source depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    Map(MapKey),
    Reduce(ReduceKey),
}

/// A loaded built-in kernel and how many of its blocks fit on one multiprocessor.
#[derive(Clone, Copy)]
struct Loaded {
    function: Function,
    blocks_per_sm: u32,
}

/// The kernel for `key` on the bound device, compiled and loaded on first use.
fn kernel(ctx: &Bound, ordinal: i32, key: Key) -> Result<Loaded> {
    static CACHE: OnceLock<Mutex<HashMap<(i32, Key), Loaded>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(found) = cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(ordinal, key))
    {
        return Ok(*found);
    }
    // Compiled outside the lock: another thread may compile the same kernel meanwhile, and the
    // first to finish is kept (the modules are identical).
    let source = match &key {
        Key::Map(k) => codegen::map_source(k),
        Key::Reduce(k) => codegen::reduce_source(k),
    };
    let options = [nvrtc::arch_option(ctx.arch)?];
    let image = nvrtc::compile(&source, "dlbridge_builtin", &options, &[]).map_err(|e| match e {
        Error::Compile { log, .. } => Error::Driver {
            backend: BACKEND,
            message: format!(
                "dlbridge's built-in kernel for {key:?} did not compile (a dlbridge bug):\n{log}"
            ),
        },
        e => e,
    })?;
    let module = nvrtc::load(&image)?;
    let function = module.function("k")?.ok_or_else(|| Error::Driver {
        backend: BACKEND,
        message: "a built-in kernel lost its entry point".into(),
    })?;
    // SAFETY: a loaded kernel; the device's context is current.
    let blocks =
        unsafe { occupancy::max_active_block_per_multiprocessor(function.0, THREADS as i32, 0) }
            .named("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
    let loaded = Loaded {
        function,
        blocks_per_sm: blocks.max(1) as u32,
    };
    Ok(*cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry((ordinal, key))
        .or_insert(loaded))
}

fn ty(dtype: DType, what: &str) -> Result<Elem> {
    Elem::from_dtype(dtype).ok_or_else(|| {
        Error::UnsupportedDType(format!("{what} on CUDA is not defined for {dtype}"))
    })
}

/// Launches `f` over `blocks` blocks of [`THREADS`] on `stream`, with one by-value argument.
fn launch<A>(f: Function, blocks: u64, stream: usize, args: &A) -> Result<()> {
    let blocks = blocks.clamp(1, i32::MAX as u64) as u32;
    let mut params: [*mut c_void; 1] = [std::ptr::from_ref(args).cast_mut().cast()];
    // SAFETY: `f` is a built-in kernel of the current context taking exactly one parameter, the
    // `#[repr(C)]` struct `A` mirrors (see `codegen`); the driver copies it during the call. The
    // addresses inside point at live views the request holds; the kernel touches only the
    // elements the plan gives it.
    let launched = unsafe {
        result::launch_kernel(
            f.0,
            (blocks, 1, 1),
            (THREADS, 1, 1),
            0,
            raw(stream),
            &mut params,
        )
    };
    launched.named("cuLaunchKernel (built-in kernel)")
}

/// The blocks a grid-stride kernel gets: enough for `work` threads, at most what stays resident.
fn grid(loaded: &Loaded, sms: u32, work: u64) -> u64 {
    work.div_ceil(THREADS as u64)
        .min(loaded.blocks_per_sm as u64 * sms as u64)
        .max(1)
}

/// A scalar as the dtype `t` holds it (a float rounded to `t`; integers wrap in the kernel).
fn scalar_value(t: Elem, s: Scalar) -> f64 {
    let v = s.as_f64();
    match t {
        Elem::F16 => half::f16::from_f64(v).to_f64(),
        Elem::BF16 => half::bf16::from_f64(v).to_f64(),
        Elem::F32 => v as f32 as f64,
        _ => v,
    }
}

pub(crate) fn map(req: &MapRequest<'_>) -> Result<()> {
    let n = req.plan.len();
    if n == 0 {
        return Ok(());
    }
    let out = req.out;
    let input_dtype = req.operand_dtype();
    let what = req.op.name();
    let (inp, outt) = (ty(input_dtype, what)?, ty(out.dtype(), what)?);
    if !codegen::map_supported(req.op, inp, outt) || req.inputs.len() > 2 {
        return Err(Error::UnsupportedDType(format!(
            "{what} from {input_dtype} to {} is not a CUDA kernel",
            out.dtype()
        )));
    }
    if req.plan.shape.len() > MAX_MAP_DIMS {
        // More axes than the strided kernel walks: strided inputs are made compact (the
        // output's layout), after which every operand collapses.
        return match req.staged_inputs(MAX_MAP_DIMS, |_| false)? {
            Some(copies) => map(&req.with_inputs(&copies)),
            None => Err(Error::Shape(format!(
                "{} axes that do not merge, with compact inputs",
                req.plan.shape.len()
            ))),
        };
    }
    let ordinal = out.device().index() as i32;
    let ctx = context(ordinal)?;
    let stream = current_stream(ordinal);
    let plan = &req.plan;
    let flat = plan.shape.len() == 1
        && plan.strides[0][0] == 1
        && plan.strides[1..].iter().all(|s| s[0] == 0 || s[0] == 1);
    let mut args = MapArgs {
        out: first_address(out) as u64,
        n: n as u64,
        ..MapArgs::default()
    };
    for (d, &e) in plan.shape.iter().enumerate() {
        args.shape[d] = e as u64;
    }
    let mut modes = [Mode::Scalar; 2];
    let mut operand = 1;
    for (k, input) in req.inputs.iter().enumerate() {
        match input {
            Operand::Tensor(t) => {
                args.input[k] = first_address(t) as u64;
                let strides = &plan.strides[operand];
                operand += 1;
                modes[k] = if !flat {
                    for (d, &s) in strides.iter().enumerate() {
                        args.strides[k][d] = s as i64;
                    }
                    Mode::Strided
                } else if strides[0] == 0 {
                    Mode::Uniform
                } else {
                    Mode::Vector
                };
            }
            Operand::Scalar(s) => {
                args.sf[k] = scalar_value(inp, *s);
                args.si[k] = s.as_i64();
            }
        }
    }
    let arity = req.inputs.len();
    let shape = if flat {
        let widest = modes[..arity]
            .iter()
            .filter(|m| **m == Mode::Vector)
            .map(|_| inp.size())
            .chain([outt.size()])
            .max()
            .unwrap_or(1);
        let vec = 16 / widest;
        let aligned = |addr: u64, size: usize| addr % (vec * size) as u64 == 0;
        let all_aligned = aligned(args.out, outt.size())
            && (0..arity).all(|k| modes[k] != Mode::Vector || aligned(args.input[k], inp.size()));
        MapShape::Flat {
            vec: if all_aligned { vec as u8 } else { 1 },
        }
    } else {
        MapShape::Strided {
            ndim: plan.shape.len() as u8,
            wide: n > i32::MAX as usize,
        }
    };
    let key = MapKey {
        op: req.op,
        input: inp,
        out: outt,
        modes,
        arity: arity as u8,
        shape,
    };
    let loaded = kernel(&ctx, ordinal, Key::Map(key))?;
    // A grid that covers the data, each thread taking `UNROLL` vectors (or elements): measured
    // faster on an H200 than a grid-stride loop over resident blocks (add 4.35 against 4.08 TB/s).
    let work = match shape {
        MapShape::Flat { vec } => {
            let nvec = n as u64 / vec as u64;
            nvec.max(n as u64 % vec as u64)
        }
        MapShape::Strided { .. } => n as u64,
    };
    let blocks = work.div_ceil(THREADS as u64 * UNROLL as u64);
    launch(loaded.function, blocks, stream, &args)
}

/// The smallest absolute stride over the axes of `plan` operand `k` that have more than one
/// element (`isize::MAX` when none has).
fn smallest_stride(plan: &MapPlan, k: usize) -> isize {
    plan.shape
        .iter()
        .zip(&plan.strides[k])
        .filter(|(n, _)| **n > 1)
        .map(|(_, s)| s.abs())
        .min()
        .unwrap_or(isize::MAX)
}

/// How one reduction runs: the kernel, its arguments (all but the workspace's address), and the
/// splits of each output's reduced range (more than one: a finishing kernel combines them).
#[derive(Clone, Copy, Debug)]
struct ReduceLaunch {
    key: ReduceKey,
    args: ReduceArgs,
    splits: usize,
    /// Threads the kernel has work for.
    threads: u64,
}

/// Plans `req` (its sides of at most [`MAX_REDUCE_DIMS`] axes, at least one output) for a GPU
/// of `sms` multiprocessors. Pure: no device is touched.
fn plan_reduce(req: &ReduceRequest<'_>, sms: usize) -> Result<ReduceLaunch> {
    let plan = &req.plan;
    let outputs = plan.outputs();
    let op = req.op;
    let input = ty(req.input.dtype(), op.name())?;
    let acc = ty(req.acc, op.name())?;
    let out = ty(req.out.dtype(), op.name())?;
    if input == Elem::Bool {
        return Err(Error::UnsupportedDType(format!(
            "{} on CUDA is not defined for bool",
            op.name()
        )));
    }
    let count = plan.count;
    let mut args = ReduceArgs {
        input: first_address(req.input) as u64,
        out: first_address(req.out) as u64,
        outputs: outputs as u64,
        count: count as u64,
        divisor: req.divisor(),
        ..ReduceArgs::default()
    };
    let axes = plan
        .kernel_axes::<MAX_REDUCE_DIMS>()
        .ok_or_else(|| Error::Shape("a reduction of more axes than its kernel walks".into()))?;
    args.kshape = axes.kept_shape;
    args.kstride = axes.kept_strides;
    args.rshape = axes.reduced_shape;
    args.rstride = axes.reduced_strides;
    let target = sms * THREADS_PER_SM;
    // Reduced elements lie closer together than kept ones: a group of threads shares a row.
    let inner = count >= 32
        && (outputs == 1 || smallest_stride(&plan.reduced, 0) < smallest_stride(&plan.kept, 1));
    let (kind, splits, chunk) = if inner {
        let threads = if count >= 2048 { 256 } else { 32 };
        let size = input.size();
        let contiguous_rows = plan.reduced_contiguous()
            && args.input % 16 == 0
            && plan
                .kept
                .shape
                .iter()
                .zip(&plan.kept.strides[1])
                .all(|(&n, &s)| n <= 1 || (s * size as isize) % 16 == 0);
        let vec = if contiguous_rows { 16 / size } else { 1 };
        let splits = if outputs * threads >= target {
            1
        } else {
            (target / (outputs * threads))
                .min(count.div_ceil(threads * vec * 4))
                .clamp(1, MAX_SPLITS)
        };
        let split = plan.split(splits, vec);
        (
            ReduceKind::Group {
                threads: threads as u16,
                vec: vec as u8,
            },
            split.splits,
            split.chunk,
        )
    } else {
        let splits = if outputs >= target || count == 0 {
            1
        } else {
            (target / outputs)
                .min(count.div_ceil(64))
                .clamp(1, MAX_SPLITS)
        };
        let split = plan.split(splits, 1);
        (ReduceKind::Thread, split.splits, split.chunk)
    };
    args.splits = splits as u64;
    args.chunk = chunk as u64;
    let key = ReduceKey {
        op,
        input,
        acc,
        out,
        kind,
        kept_dims: plan.kept.shape.len() as u8,
        reduced_dims: plan.reduced.shape.len() as u8,
        wide: count > i32::MAX as usize,
    };
    let threads = match kind {
        ReduceKind::Group { threads, .. } => (outputs * splits * threads as usize) as u64,
        _ => (outputs * splits) as u64,
    };
    Ok(ReduceLaunch {
        key,
        args,
        splits,
        threads,
    })
}

pub(crate) fn reduce(req: &ReduceRequest<'_>) -> Result<()> {
    let plan = &req.plan;
    let outputs = plan.outputs();
    if outputs == 0 {
        return Ok(());
    }
    if plan.kept.shape.len() > MAX_REDUCE_DIMS || plan.reduced.shape.len() > MAX_REDUCE_DIMS {
        // More axes than the kernels walk: a copy with the reduced axes last collapses each side
        // to one axis.
        let (input, plan) = req.staged_input()?;
        return reduce(&req.with_input(&input, plan));
    }
    let ordinal = req.out.device().index() as i32;
    let ctx = context(ordinal)?;
    let stream = current_stream(ordinal);
    let ReduceLaunch {
        key,
        mut args,
        splits,
        threads,
    } = plan_reduce(req, ctx.multiprocessors as usize)?;
    // Partial results live until the finishing kernel has read them: the pool fences the block
    // on this stream when it is dropped at the end of this function.
    let workspace = if splits > 1 {
        let bytes = outputs
            .checked_mul(splits * key.acc_size())
            .ok_or_else(|| Error::Overflow("reduction workspace".into()))?;
        let buffer = super::allocate(Device::cuda(ordinal as u32), bytes, false)?;
        args.ws = buffer.handle().expose_provenance() as u64;
        Some(buffer)
    } else {
        None
    };
    let loaded = kernel(&ctx, ordinal, Key::Reduce(key))?;
    launch(
        loaded.function,
        grid(&loaded, ctx.multiprocessors, threads),
        stream,
        &args,
    )?;
    if splits > 1 {
        let loaded = kernel(&ctx, ordinal, Key::Reduce(key.finish()))?;
        launch(
            loaded.function,
            grid(&loaded, ctx.multiprocessors, outputs as u64 * 32),
            stream,
            &args,
        )?;
    }
    drop(workspace);
    Ok(())
}

pub(crate) fn matmul(req: &MatmulRequest<'_>) -> Result<()> {
    super::blas::matmul(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_round_to_the_dtype() {
        assert_eq!(
            scalar_value(Elem::F16, Scalar::Float(0.1)),
            half::f16::from_f64(0.1).to_f64()
        );
        assert_eq!(scalar_value(Elem::F32, Scalar::Int(3)), 3.0);
        assert_eq!(scalar_value(Elem::F64, Scalar::Float(0.1)), 0.1);
    }
}
