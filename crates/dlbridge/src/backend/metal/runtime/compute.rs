//! Runs the built-in kernels and run-time MSL kernels (see [`crate::backend::metal::compute`]):
//! compiles and caches compute pipelines, binds buffers, and encodes what
//! [`crate::backend::metal::compute::dispatch`] planned.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use block2::RcBlock;
use objc2::msg_send;
use objc2::rc::Retained;
use objc2::runtime::ProtocolObject;
use objc2::sel;
use objc2_foundation::{NSDictionary, NSObject, NSObjectProtocol, NSString};
use objc2_metal::{
    MTLBlitCommandEncoder, MTLCommandBuffer, MTLCommandBufferStatus, MTLCommandEncoder,
    MTLCommandQueue, MTLCompileOptions, MTLComputeCommandEncoder, MTLComputePipelineState,
    MTLDevice, MTLFunction, MTLFunctionType, MTLLanguageVersion, MTLLibrary, MTLMathMode, MTLSize,
};

use super::context::Context;
use super::copy::resolve;
use super::objc::{MetalBuffer, driver};
use crate::backend::metal::compute::dispatch::{
    self, Binding, MAP_PARAMS_INDEX, MATMUL_THREADS, MAX_DIMS, Place, group_size, groups_for,
    is_aligned,
};
use crate::backend::metal::compute::msl;
use crate::backend::metal::compute::options::{self, CompileOptions};
use crate::buffer::{Buffer, StorageMode};
use crate::compute::kernel::{Kernel, KernelArg, LaunchConfig, LaunchTiming};
use crate::compute::plan::matrix_layout;
use crate::compute::{MapRequest, MatmulRequest, MatrixLayout, Operand, ReduceRequest};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

type Pipeline = Retained<ProtocolObject<dyn MTLComputePipelineState>>;

type Encoder = Retained<ProtocolObject<dyn MTLComputeCommandEncoder>>;

/// Locks a mutex, recovering the data if another thread panicked while holding it (the caches
/// are valid between statements).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ------------------------------------------------------------------------------- compilation

/// An `MTLCompileOptions` for `opts`.
fn compile_options(opts: &CompileOptions) -> Retained<MTLCompileOptions> {
    let options = MTLCompileOptions::new();
    if let Some(fast) = opts.fast_math {
        if options.respondsToSelector(sel!(setMathMode:)) {
            options.setMathMode(if fast {
                MTLMathMode::Fast
            } else {
                MTLMathMode::Safe
            });
        } else {
            // Before macOS 15 / iOS 18 only the older switch exists.
            #[allow(deprecated)]
            options.setFastMathEnabled(fast);
        }
    }
    if let Some(version) = opts.language_version {
        options.setLanguageVersion(MTLLanguageVersion(version as usize));
    }
    if !opts.macros.is_empty() {
        let names: Vec<Retained<NSString>> = opts
            .macros
            .iter()
            .map(|(n, _)| NSString::from_str(n))
            .collect();
        let values: Vec<Retained<NSString>> = opts
            .macros
            .iter()
            .map(|(_, v)| NSString::from_str(v))
            .collect();
        let name_refs: Vec<&NSString> = names.iter().map(|n| &**n).collect();
        let value_refs: Vec<&NSObject> = values.iter().map(|v| &***v).collect();
        let macros = NSDictionary::from_slices(&name_refs, &value_refs);
        // SAFETY: Metal takes a dictionary of NSString keys and NSString or NSNumber values;
        // every value here is an NSString (viewed as its NSObject superclass).
        unsafe { options.setPreprocessorMacros(Some(&macros)) };
    }
    options
}

/// Compiles `source` and builds the compute pipeline of its kernel function `name`.
fn build_pipeline(
    device: &ProtocolObject<dyn MTLDevice>,
    source: &str,
    name: &str,
    opts: &CompileOptions,
) -> Result<Pipeline> {
    let compile_error = |log: String| Error::Compile {
        backend: "Metal",
        name: name.to_string(),
        log,
    };
    let library = device
        .newLibraryWithSource_options_error(
            &NSString::from_str(source),
            Some(&compile_options(opts)),
        )
        .map_err(|e| compile_error(e.localizedDescription().to_string()))?;
    let function = library
        .newFunctionWithName(&NSString::from_str(name))
        .ok_or_else(|| {
            let defined: Vec<String> = library
                .functionNames()
                .to_vec()
                .iter()
                .map(|n| n.to_string())
                .collect();
            Error::InvalidArgument(format!(
                "the MSL source has no function `{name}` (it defines: {})",
                if defined.is_empty() {
                    "nothing".to_string()
                } else {
                    defined.join(", ")
                }
            ))
        })?;
    if function.functionType() != MTLFunctionType::Kernel {
        return Err(Error::InvalidArgument(format!(
            "`{name}` is not a `kernel` function"
        )));
    }
    device
        .newComputePipelineStateWithFunction_error(&function)
        .map_err(|e| {
            compile_error(format!(
                "building the compute pipeline: {}",
                e.localizedDescription()
            ))
        })
}

/// The pipeline of built-in kernel `name` on `context`'s device, compiled from `source()` the
/// first time (fast math off: NaN and infinities follow IEEE 754).
fn builtin(
    context: &Context,
    name: String,
    source: impl FnOnce() -> Result<String>,
) -> Result<Pipeline> {
    static CACHE: OnceLock<Mutex<HashMap<(Device, String), Pipeline>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (context.info().device, name);
    if let Some(p) = lock(cache).get(&key) {
        return Ok(p.clone());
    }
    // Compiled without the lock (it takes a while); a race compiles twice and keeps one.
    let opts = CompileOptions {
        fast_math: Some(false),
        ..CompileOptions::default()
    };
    let pipeline = build_pipeline(context.device(), &source()?, &key.1, &opts)?;
    Ok(lock(cache).entry(key).or_insert(pipeline).clone())
}

// ---------------------------------------------------------------------------------- encoding

fn size(width: usize, height: usize, depth: usize) -> MTLSize {
    MTLSize {
        width,
        height,
        depth,
    }
}

fn compute_encoder(cb: &ProtocolObject<dyn MTLCommandBuffer>) -> Result<Encoder> {
    cb.computeCommandEncoder()
        .ok_or_else(|| driver("no compute encoder"))
}

/// Binds `buffer` at `offset` bytes to buffer index `index`.
///
/// # Safety
/// The kernel's accesses through that index must stay inside the buffer (the dispatch plan
/// addresses exactly the views' elements, which were bounds-checked against their buffers).
unsafe fn bind(encoder: &Encoder, buffer: &MetalBuffer, offset: usize, index: usize) {
    // SAFETY: the command buffer retains the buffer until it completes; bounds by the caller's
    // contract.
    unsafe { encoder.setBuffer_offset_atIndex(Some(buffer), offset, index) };
}

/// Copies a parameter block into the encoder at buffer index `index`.
fn set_params<P: Copy>(encoder: &Encoder, params: &P, index: usize) {
    let bytes = NonNull::from(params).cast::<c_void>();
    // SAFETY: `params` is a live `#[repr(C)]` block without implicit padding, laid out as the
    // kernel's MSL struct at `index` (checked by the dispatch tests); Metal copies the bytes
    // while encoding.
    unsafe { encoder.setBytes_length_atIndex(bytes, size_of::<P>(), index) };
}

/// After the kernels, makes a managed output's GPU writes visible to the host (once the work
/// completes).
fn sync_managed(cb: &ProtocolObject<dyn MTLCommandBuffer>, managed: &[&MetalBuffer]) -> Result<()> {
    if managed.is_empty() {
        return Ok(());
    }
    let blit = cb
        .blitCommandEncoder()
        .ok_or_else(|| driver("no blit encoder"))?;
    for buffer in managed {
        blit.synchronizeResource(ProtocolObject::from_ref(&***buffer));
    }
    blit.endEncoding();
    Ok(())
}

/// Keeps `buffers` (scratch memory, compact copies) alive until `cb` has completed, whatever
/// recycles them when they are dropped.
fn keep_until_completed(cb: &ProtocolObject<dyn MTLCommandBuffer>, buffers: Vec<Buffer>) {
    if buffers.is_empty() {
        return;
    }
    let held = Mutex::new(Some(buffers));
    let handler = RcBlock::new(move |_: NonNull<ProtocolObject<dyn MTLCommandBuffer>>| {
        let taken = held.lock().map(|mut h| h.take()).unwrap_or(None);
        drop(taken);
    });
    // SAFETY: `handler` is a live block of the handler's signature; Metal copies it and calls the
    // copy once, on a thread of its own, after the command buffer completed: it captures only
    // `Send` state (`Buffer`s), and dropping a `Buffer` never waits for the queue lock.
    unsafe { cb.addCompletedHandler(RcBlock::as_ptr(&handler)) };
}

/// The Metal buffer of a tensor operand, on `context`'s device.
fn buffer_on(context: &'static Context, t: &Tensor) -> Result<(MetalBuffer, StorageMode)> {
    let r = resolve(t.buffer())?;
    if !std::ptr::eq(r.context, context) {
        return Err(Error::InvalidArgument(format!(
            "a Metal kernel on {} with an operand on {}",
            context.info().device,
            r.context.info().device
        )));
    }
    Ok((r.buffer, r.storage))
}

// ------------------------------------------------------------------------------ element-wise

/// Encodes an element-wise request into the device's queue.
pub(crate) fn map(req: &MapRequest<'_>) -> Result<()> {
    // Dtypes first: float64 fails before any GPU work.
    dispatch::map_types(req.op, req.dtype(), &req.inputs)?;
    // Operands the kernels cannot address in place are made compact on the GPU first: views
    // misaligned for their element type, and every strided input when the index space has too
    // many axes (the output is compact, so compact inputs merge into one axis).
    let compacted = req
        .staged_inputs(MAX_DIMS, |t| !is_aligned(t))?
        .unwrap_or_default();
    let staged;
    let req = if compacted.is_empty() {
        req
    } else {
        staged = req.with_inputs(&compacted);
        &staged
    };
    let inputs = &req.inputs;
    let launch = dispatch::plan_map(req.op, req.out, inputs, &req.plan)?;
    let out = resolve(req.out.buffer())?;
    let context = out.context;
    let mut bound = Vec::with_capacity(launch.buffers.len());
    for &(index, operand, Binding { offset, .. }) in &launch.buffers {
        let t = match operand.map(|k| &inputs[k]) {
            None => req.out,
            Some(Operand::Tensor(t)) => t,
            Some(Operand::Scalar(_)) => unreachable!("scalars are not bound as buffers"),
        };
        bound.push((buffer_on(context, t)?.0, offset, index));
    }
    let variant = &launch.variant;
    let pipeline = builtin(context, variant.name(), || msl::map_source(variant))?;
    let threads = group_size(
        pipeline.maxTotalThreadsPerThreadgroup(),
        pipeline.threadExecutionWidth(),
    );
    let groups = groups_for(launch.params.count, threads);
    let managed: Vec<&MetalBuffer> = (out.storage == StorageMode::Managed)
        .then_some(&out.buffer)
        .into_iter()
        .collect();
    let keep: Vec<Buffer> = compacted
        .iter()
        .flatten()
        .map(|t| t.buffer().clone())
        .collect();
    context.encode(|cb| {
        let encoder = compute_encoder(cb)?;
        encoder.setComputePipelineState(&pipeline);
        for (buffer, offset, index) in &bound {
            // SAFETY: the plan addresses exactly the elements of the output and input views,
            // bounds-checked against their buffers.
            unsafe { bind(&encoder, buffer, *offset, *index) };
        }
        set_params(&encoder, &launch.params, MAP_PARAMS_INDEX);
        encoder.dispatchThreadgroups_threadsPerThreadgroup(size(groups, 1, 1), size(threads, 1, 1));
        encoder.endEncoding();
        keep_until_completed(cb, keep);
        sync_managed(cb, &managed)
    })
}

// -------------------------------------------------------------------------------- reductions

/// Encodes a reduction (one or two passes) into the device's queue.
pub(crate) fn reduce(req: &ReduceRequest<'_>) -> Result<()> {
    let what = req.op.name();
    msl::Elem::of(req.input.dtype(), what)?;
    msl::Elem::of(req.out.dtype(), what)?;
    dispatch::work_type(req.op, req.acc)?;
    // An input the kernels cannot address in place (misaligned for its element type, or with
    // more axes on a side than they walk) is copied on the GPU with its reduced axes last, after
    // which each side is one axis.
    let too_many = req.plan.kept.shape.len() > MAX_DIMS || req.plan.reduced.shape.len() > MAX_DIMS;
    let staged = (too_many || !is_aligned(req.input))
        .then(|| req.staged_input())
        .transpose()?;
    let replanned;
    let req = match &staged {
        // The plan is cloned on this path only, next to a copy of the whole input.
        Some((input, plan)) => {
            replanned = req.with_input(input, plan.clone());
            &replanned
        }
        None => req,
    };
    let launch = dispatch::plan_reduce(req)?;
    let out = resolve(req.out.buffer())?;
    let context = out.context;
    let (input, _) = buffer_on(context, req.input)?;
    let mut keep: Vec<Buffer> = staged.iter().map(|(t, _)| t.buffer().clone()).collect();
    let scratch = if launch.scratch_bytes > 0 {
        let buffer = crate::backend::metal::allocate(
            context.info().device,
            launch.scratch_bytes,
            Some(StorageMode::Private),
            false,
        )?;
        let mtl = resolve(&buffer)?.buffer;
        keep.push(buffer);
        Some(mtl)
    } else {
        None
    };
    let place = |p: Place, tensor: &MetalBuffer| -> (MetalBuffer, usize) {
        match p {
            Place::Tensor(b) => (tensor.clone(), b.offset),
            Place::Scratch => (
                scratch
                    .clone()
                    .expect("a split reduction has scratch memory"),
                0,
            ),
        }
    };
    let mut passes = Vec::with_capacity(launch.passes.len());
    for pass in &launch.passes {
        let variant = &pass.variant;
        let pipeline = builtin(context, variant.name(), || msl::reduce_source(variant))?;
        let threads = group_size(
            pipeline.maxTotalThreadsPerThreadgroup(),
            pipeline.threadExecutionWidth(),
        );
        passes.push((
            pipeline,
            place(pass.input, &input),
            place(pass.output, &out.buffer),
            pass.params,
            pass.groups(threads),
            threads,
        ));
    }
    let managed: Vec<&MetalBuffer> = (out.storage == StorageMode::Managed)
        .then_some(&out.buffer)
        .into_iter()
        .collect();
    context.encode(|cb| {
        // One encoder per pass: the second reads what the first wrote.
        for (pipeline, (src, src_offset), (dst, dst_offset), params, groups, threads) in &passes {
            let encoder = compute_encoder(cb)?;
            encoder.setComputePipelineState(pipeline);
            // SAFETY: the plan addresses exactly the input view's elements and the output's
            // (bounds-checked against their buffers), or the scratch buffer's `outputs * splits`
            // partial results, which it was sized for.
            unsafe { bind(&encoder, src, *src_offset, 0) };
            // SAFETY: as above.
            unsafe { bind(&encoder, dst, *dst_offset, 1) };
            set_params(&encoder, params, 2);
            encoder.dispatchThreadgroups_threadsPerThreadgroup(
                size(*groups, 1, 1),
                size(*threads, 1, 1),
            );
            encoder.endEncoding();
        }
        keep_until_completed(cb, keep);
        sync_managed(cb, &managed)
    })
}

// ------------------------------------------------------------------------------------ matmul

/// The compact copy `c` of an operand with its layout, or the operand `t` itself with `l`.
fn pick<'a>(c: &'a Option<Tensor>, t: &'a Tensor, l: MatrixLayout) -> (&'a Tensor, MatrixLayout) {
    match c {
        Some(c) => (
            c,
            matrix_layout(c.shape(), c.strides()).expect("a compact array's batch axes collapse"),
        ),
        None => (t, l),
    }
}

/// Encodes a batched matrix product into the device's queue.
pub(crate) fn matmul(req: &MatmulRequest<'_>) -> Result<()> {
    msl::Elem::of(req.out.dtype(), "matmul")?;
    // An operand whose first element is misaligned for its type is made compact first.
    let realign = |t: &Tensor| -> Result<Option<Tensor>> {
        if is_aligned(t) {
            Ok(None)
        } else {
            t.copy().map(Some)
        }
    };
    let (ca, cb) = (realign(req.a)?, realign(req.b)?);
    let relaid;
    let req = if ca.is_some() || cb.is_some() {
        let (a, a_layout) = pick(&ca, req.a, req.a_layout);
        let (b, b_layout) = pick(&cb, req.b, req.b_layout);
        relaid = MatmulRequest {
            a,
            b,
            a_layout,
            b_layout,
            ..*req
        };
        &relaid
    } else {
        req
    };
    let launch = dispatch::plan_matmul(req)?;
    let out = resolve(req.out.buffer())?;
    let context = out.context;
    let (a, _) = buffer_on(context, req.a)?;
    let (b, _) = buffer_on(context, req.b)?;
    let variant = launch.variant;
    let pipeline = builtin(context, variant.name(), || Ok(msl::matmul_source(&variant)))?;
    let [tx, ty] = MATMUL_THREADS;
    if pipeline.maxTotalThreadsPerThreadgroup() < tx * ty {
        return Err(driver(format!(
            "the {} pipeline allows {} threads per threadgroup; the kernel needs {}",
            variant.name(),
            pipeline.maxTotalThreadsPerThreadgroup(),
            tx * ty
        )));
    }
    let [gx, gy, gz] = launch.groups;
    let [a_offset, b_offset, out_offset] = launch.offsets;
    let managed: Vec<&MetalBuffer> = (out.storage == StorageMode::Managed)
        .then_some(&out.buffer)
        .into_iter()
        .collect();
    let keep: Vec<Buffer> = ca
        .iter()
        .chain(cb.iter())
        .map(|t| t.buffer().clone())
        .collect();
    context.encode(|cmd| {
        let encoder = compute_encoder(cmd)?;
        encoder.setComputePipelineState(&pipeline);
        // SAFETY: the kernel reads `batch × m × k` and `batch × k × n` elements through the
        // operands' layouts (views bounds-checked against their buffers) and writes the compact
        // `batch × m × n` output.
        unsafe { bind(&encoder, &a, a_offset, 0) };
        // SAFETY: as above.
        unsafe { bind(&encoder, &b, b_offset, 1) };
        // SAFETY: as above.
        unsafe { bind(&encoder, &out.buffer, out_offset, 2) };
        set_params(&encoder, &launch.params, 3);
        encoder.dispatchThreadgroups_threadsPerThreadgroup(size(gx, gy, gz), size(tx, ty, 1));
        encoder.endEncoding();
        keep_until_completed(cmd, keep);
        sync_managed(cmd, &managed)
    })
}

// ------------------------------------------------------------------------------ user kernels

/// A compiled user kernel: its pipeline.
struct UserKernel {
    pipeline: Pipeline,
}

/// The user-kernel cache key: device, source, entry name, options.
type UserKey = (Device, String, String, Vec<String>);

/// Compiles a user kernel, or returns the cached one.
pub(crate) fn compile(
    device: Device,
    source: &str,
    name: &str,
    options: &[String],
) -> Result<Kernel> {
    static CACHE: OnceLock<Mutex<HashMap<UserKey, Kernel>>> = OnceLock::new();
    let opts = options::parse(options)?;
    let context = super::context(device)?;
    let cache = CACHE.get_or_init(Default::default);
    let key = (
        device,
        source.to_string(),
        name.to_string(),
        options.to_vec(),
    );
    if let Some(k) = lock(cache).get(&key) {
        return Ok(k.clone());
    }
    let pipeline = build_pipeline(context.device(), source, name, &opts)?;
    let kernel = Kernel::new(
        device,
        name.to_string(),
        None,
        Arc::new(UserKernel { pipeline }),
    );
    Ok(lock(cache).entry(key).or_insert(kernel).clone())
}

/// A launch argument, ready to bind.
enum Bound {
    Buffer {
        buffer: MetalBuffer,
        offset: usize,
        managed: bool,
    },
    Bytes(Vec<u8>),
}

/// Runs a user kernel in a command buffer of its own, waits, and reports its GPU time.
pub(crate) fn launch(
    kernel: &Kernel,
    config: LaunchConfig,
    args: &[KernelArg],
) -> Result<LaunchTiming> {
    let user = kernel.inner::<UserKernel>().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "kernel `{}` was not compiled by the Metal backend",
            kernel.name()
        ))
    })?;
    let context = super::context(kernel.device())?;
    let pipeline = &user.pipeline;
    options::check_launch(
        config.block,
        pipeline.maxTotalThreadsPerThreadgroup(),
        args.len(),
    )?;
    let limit = context
        .device()
        .maxThreadgroupMemoryLength()
        .saturating_sub(pipeline.staticThreadgroupMemoryLength());
    let threadgroup_memory = options::threadgroup_memory(config.shared_mem, limit)?;
    let mut bound = Vec::with_capacity(args.len());
    for (i, arg) in args.iter().enumerate() {
        bound.push(match arg {
            KernelArg::Tensor(t) => {
                let (buffer, storage) = buffer_on(context, t)?;
                Bound::Buffer {
                    buffer,
                    offset: t.byte_offset(),
                    managed: storage == StorageMode::Managed,
                }
            }
            scalar => Bound::Bytes(
                scalar
                    .scalar_bytes(i, None)?
                    .ok_or_else(|| Error::InvalidArgument(format!("argument {i} has no value")))?,
            ),
        });
    }
    // Work encoded earlier (the copies that filled the arguments) must run first, and earlier GPU
    // failures are reported here rather than blamed on this kernel.
    context.synchronize()?;
    let cb = context
        .queue()
        .commandBuffer()
        .ok_or_else(|| driver("the queue returned no command buffer"))?;
    cb.setLabel(Some(&NSString::from_str(&format!(
        "dlbridge kernel {}",
        kernel.name()
    ))));
    let encoder = compute_encoder(&cb)?;
    encoder.setComputePipelineState(pipeline);
    let mut managed = Vec::new();
    for (index, arg) in bound.iter().enumerate() {
        match arg {
            Bound::Buffer {
                buffer,
                offset,
                managed: m,
            } => {
                // SAFETY: the user's kernel decides what it addresses; dlbridge binds a live
                // buffer (retained by the command buffer) at the view's first element. Reading or
                // writing outside the view is the kernel author's contract, as in CUDA.
                unsafe { bind(&encoder, buffer, *offset, index) };
                if *m {
                    managed.push(buffer);
                }
            }
            Bound::Bytes(bytes) => {
                let ptr = NonNull::new(bytes.as_ptr().cast_mut().cast::<c_void>())
                    .ok_or_else(|| driver("an empty scalar argument"))?;
                // SAFETY: `bytes` is live for the call and `bytes.len()` long; Metal copies them.
                unsafe { encoder.setBytes_length_atIndex(ptr, bytes.len(), index) };
            }
        }
    }
    if threadgroup_memory > 0 {
        // SAFETY: the length is a multiple of 16 within the device's limit (checked above).
        unsafe { encoder.setThreadgroupMemoryLength_atIndex(threadgroup_memory, 0) };
    }
    let [gx, gy, gz] = config.grid.map(|g| g as usize);
    let [bx, by, bz] = config.block.map(|b| b as usize);
    encoder.dispatchThreadgroups_threadsPerThreadgroup(size(gx, gy, gz), size(bx, by, bz));
    encoder.endEncoding();
    sync_managed(&cb, &managed)?;
    cb.commit();
    cb.waitUntilCompleted();
    if cb.status() == MTLCommandBufferStatus::Error {
        let why = cb
            .error()
            .map(|e| e.localizedDescription().to_string())
            .unwrap_or_else(|| "the command buffer failed".into());
        return Err(driver(format!("kernel `{}` failed: {why}", kernel.name())));
    }
    // SAFETY: `GPUStartTime` and `GPUEndTime` are `CFTimeInterval` (double) properties of every
    // command buffer, valid once it has completed.
    let start: f64 = unsafe { msg_send![&*cb, GPUStartTime] };
    // SAFETY: as above.
    let end: f64 = unsafe { msg_send![&*cb, GPUEndTime] };
    Ok(LaunchTiming {
        elapsed_ms: ((end - start) * 1e3).max(0.0),
    })
}
