//! Copies that involve CUDA memory: host↔device, device↔device (same device and peer), and any
//! layout to any other through the planner in [`super::plan`] and the kernels in
//! `kernels/copy.cu`.
//!
//! Everything is enqueued on the current stream of the device doing the work. A copy into
//! pageable host memory (a CPU tensor) waits for that stream before returning, since the host
//! reads the result next; every other copy returns as soon as it is enqueued, after recording
//! its use of pooled blocks of other streams ([`record_use_on`]), so that such a block freed
//! next is not reused on its own stream before the copy is done.

use std::ffi::{CString, c_void};

use cudarc::driver::result::{self, module};
use cudarc::driver::sys;

use super::driver::{self, Named, describe};
use super::stream::{current_stream, order_across, raw as raw_stream, record_use_on};
use super::{BACKEND, DeviceContext, context, first_address};
use crate::backend::plan::{Axis, CopyPlan, plan_copy};
use crate::device::DeviceKind;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The copy kernels as PTX, built ahead by `scripts/build-ptx.sh` from `kernels/copy.cu`.
const PTX: &str = concat!(include_str!("kernels/copy.ptx"), "\0");

const WORDS: [usize; 5] = [1, 2, 4, 8, 16];
const TILE: u64 = 32;
const TILE_ROWS: u32 = 8;
const THREADS: u32 = 256;

/// The loaded copy kernels of one device, indexed by word size (1, 2, 4, 8, 16 bytes).
pub(crate) struct Kernels {
    strided: [sys::CUfunction; 5],
    tiled: [sys::CUfunction; 5],
}

// SAFETY: function handles of a loaded module may be used from any thread.
unsafe impl Send for Kernels {}
// SAFETY: as above; they are never mutated.
unsafe impl Sync for Kernels {}

fn kernels(ctx: &'static DeviceContext) -> Result<&'static Kernels> {
    ctx.kernels
        .get_or_init(|| load_kernels().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|message| Error::Driver {
            backend: BACKEND,
            message: message.clone(),
        })
}

fn load_kernels() -> Result<Kernels> {
    // SAFETY: `PTX` is NUL-terminated PTX text; the device's context is current (the caller bound
    // it). The module stays loaded for the life of the process.
    let loaded = unsafe { module::load_data(PTX.as_ptr().cast()) };
    let module = loaded.map_err(|e| Error::Driver {
        backend: BACKEND,
        message: format!(
            "loading dlbridge's copy kernels failed: {} (they are PTX 9.0 for compute_75 and \
             need a CUDA 13 driver)",
            describe(e)
        ),
    })?;
    let get = |name: String| -> Result<sys::CUfunction> {
        let cname = CString::new(name.clone()).expect("kernel names have no NUL");
        // SAFETY: `module` is loaded and never unloaded.
        unsafe { module::get_function(module, cname) }
            .named(&format!("cuModuleGetFunction({name})"))
    };
    let mut strided = [std::ptr::null_mut(); 5];
    let mut tiled = [std::ptr::null_mut(); 5];
    for (k, w) in WORDS.iter().enumerate() {
        strided[k] = get(format!("dlbridge_strided_copy_{w}"))?;
        tiled[k] = get(format!("dlbridge_tiled_copy_{w}"))?;
    }
    Ok(Kernels { strided, tiled })
}

/// The kernels' argument blocks, laid out as the C structs in `kernels/copy.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
struct StridedArgs {
    numel: i64,
    ndim: i32,
    shape: [i64; 8],
    src: [i64; 8],
    dst: [i64; 8],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct TiledArgs {
    nx: i64,
    ny: i64,
    src_sx: i64,
    dst_sy: i64,
    batch: i64,
    nb: i32,
    bshape: [i64; 8],
    bsrc: [i64; 8],
    bdst: [i64; 8],
}

fn byte_strides(t: &Tensor) -> Vec<isize> {
    let item = t.dtype().itemsize() as isize;
    t.strides().iter().map(|s| s * item).collect()
}

/// Copies `src` into `dst` (same shape and dtype, not packed, at least one of them CUDA memory).
///
/// # Safety
/// As [`Tensor::copy_from_unchecked`]: nothing else reads or writes `dst`'s bytes meanwhile, and
/// the two views do not overlap.
pub(crate) unsafe fn copy(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.numel() == 0 {
        return Ok(());
    }
    let (sk, dk) = (src.device().kind(), dst.device().kind());
    if sk.is_cuda() && dk.is_cuda() {
        let s_ord = src.device().index() as i32;
        let d_ord = dst.device().index() as i32;
        let peer = sk == DeviceKind::Cuda && dk == DeviceKind::Cuda && s_ord != d_ord;
        if !peer {
            // One device does the work: the side holding device memory, else the destination.
            let ordinal = if sk == DeviceKind::Cuda { s_ord } else { d_ord };
            return recorded(ordinal, [dst, src], run_plan(ordinal, dst, src));
        }
        if !src.is_contiguous() {
            // SAFETY: forwarded; the staged copy is new memory.
            return unsafe { copy(dst, &src.copy()?) };
        }
        if !dst.is_contiguous() {
            // Across compactly, then scatter on the destination's device.
            let staged = Tensor::empty(dst.shape(), dst.dtype(), dst.device())?;
            // SAFETY: `staged` is new memory nothing else uses.
            unsafe { copy(&staged, src)? };
            // SAFETY: forwarded.
            return unsafe { dst.copy_from_unchecked(&staged) };
        }
        return recorded(d_ord, [dst, src], peer_copy(dst, src));
    }
    // One side is pageable host memory: move compact bytes, making either side compact first.
    if !src.is_contiguous() {
        let staged = src.copy()?;
        // SAFETY: forwarded; `staged` is new memory.
        return unsafe { copy(dst, &staged) };
    }
    if !dst.is_contiguous() {
        // Move compact bytes to the destination's side, then scatter there.
        let staged = Tensor::empty(dst.shape(), dst.dtype(), dst.device())?;
        // SAFETY: `staged` is new memory nothing else uses.
        unsafe { copy(&staged, src)? };
        // SAFETY: forwarded.
        return unsafe { dst.copy_from_unchecked(&staged) };
    }
    let bytes = dst.nbytes();
    if dk.is_cuda() {
        let ordinal = dst.device().index() as i32;
        let _ctx = context(ordinal)?;
        let stream = raw_stream(current_stream(ordinal));
        // SAFETY: `bytes` compact bytes at both addresses, inside live allocations; pageable
        // sources are staged by the driver before the call returns, so `src` may go right after.
        let enqueued = unsafe {
            driver::memcpy_htod_async(
                first_address(dst) as u64,
                std::ptr::with_exposed_provenance(first_address(src)),
                bytes,
                stream,
            )
        }
        .named("cuMemcpyHtoDAsync");
        recorded(ordinal, [dst], enqueued)
    } else {
        let ordinal = src.device().index() as i32;
        let _ctx = context(ordinal)?;
        let stream = raw_stream(current_stream(ordinal));
        // SAFETY: as above; the host buffer is written by the copy, which the synchronize below
        // waits for before anyone reads it.
        unsafe {
            driver::memcpy_dtoh_async(
                std::ptr::with_exposed_provenance_mut(first_address(dst)),
                first_address(src) as u64,
                bytes,
                stream,
            )
        }
        .named("cuMemcpyDtoHAsync")?;
        // SAFETY: a valid stream of the current context.
        unsafe { result::stream::synchronize(stream) }.named("cuStreamSynchronize")
    }
}

/// `result`, the outcome of enqueuing a copy on the current stream of device `ordinal`, after
/// recording that stream's use of the pooled blocks of `tensors` ([`record_use_on`]), also when
/// enqueuing failed part-way: what was enqueued may still run.
fn recorded<'a>(
    ordinal: i32,
    tensors: impl IntoIterator<Item = &'a Tensor>,
    result: Result<()>,
) -> Result<()> {
    let recorded = record_use_on(ordinal, current_stream(ordinal), tensors);
    result.and(recorded)
}

/// Compact device memory of one device to compact device memory of another.
fn peer_copy(dst: &Tensor, src: &Tensor) -> Result<()> {
    let (s_ord, d_ord) = (src.device().index() as i32, dst.device().index() as i32);
    let s_ctx = context(s_ord)?;
    let s_ctx_raw = s_ctx.ctx;
    drop(s_ctx);
    let d_ctx = context(d_ord)?;
    let stream = current_stream(d_ord);
    // The source's pending writes (on its device's current stream) come first.
    order_across(s_ord, current_stream(s_ord), d_ord, stream)?;
    // SAFETY: compact byte ranges inside live allocations on two devices; both contexts are
    // primary contexts retained for the process; the stream belongs to the destination device.
    unsafe {
        result::memcpy_peer_async(
            d_ctx.ctx,
            first_address(dst) as u64,
            s_ctx_raw,
            first_address(src) as u64,
            dst.nbytes(),
            raw_stream(stream),
        )
    }
    .named("cuMemcpyPeerAsync")
}

/// A copy both of whose sides device `ordinal` can address, on its current stream.
fn run_plan(ordinal: i32, dst: &Tensor, src: &Tensor) -> Result<()> {
    let ctx = context(ordinal)?;
    let stream = raw_stream(current_stream(ordinal));
    let (src_addr, dst_addr) = (first_address(src), first_address(dst));
    let plan = plan_copy(
        dst.shape(),
        &byte_strides(src),
        &byte_strides(dst),
        dst.dtype().itemsize(),
        src_addr,
        dst_addr,
    )?;
    match plan {
        CopyPlan::Empty => Ok(()),
        CopyPlan::Linear { bytes } => {
            // SAFETY: the planned bytes lie inside the two live views, which the caller guarantees
            // do not overlap and are not used by anything else meanwhile; unified addressing lets
            // the driver find each side's memory from its address.
            unsafe { driver::memcpy_async(dst_addr as u64, src_addr as u64, bytes, stream) }
                .named("cuMemcpyAsync")
        }
        CopyPlan::Pitched {
            width,
            height,
            src_pitch,
            dst_pitch,
        } => {
            let p = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                srcHost: std::ptr::null(),
                srcDevice: src_addr as u64,
                srcArray: std::ptr::null_mut(),
                srcPitch: src_pitch,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                dstHost: std::ptr::null_mut(),
                dstDevice: dst_addr as u64,
                dstArray: std::ptr::null_mut(),
                dstPitch: dst_pitch,
                WidthInBytes: width,
                Height: height,
            };
            // SAFETY: as for the linear copy above.
            unsafe { driver::memcpy_2d_async(&p, stream) }.named("cuMemcpy2DAsync")
        }
        CopyPlan::Kernel {
            word,
            axes,
            outer,
            tiled,
        } => {
            let kernels = kernels(ctx.state())?;
            let k = WORDS
                .iter()
                .position(|&w| w == word)
                .expect("planned words");
            // Walk the host-side axes (rarely any), launching one kernel per position.
            let positions: u64 = outer.iter().map(|a| a.extent).product();
            for pos in 0..positions {
                let (mut so, mut d, mut rem) = (0i64, 0i64, pos);
                for a in outer.iter().rev() {
                    let i = (rem % a.extent) as i64;
                    rem /= a.extent;
                    so += i * a.src;
                    d += i * a.dst;
                }
                let s = (src_addr as i64 + so * word as i64) as u64;
                let dd = (dst_addr as i64 + d * word as i64) as u64;
                match tiled {
                    Some((x, y)) => launch_tiled(kernels.tiled[k], dd, s, &axes, x, y, stream)?,
                    None => launch_strided(&ctx, kernels.strided[k], dd, s, &axes, stream)?,
                }
            }
            Ok(())
        }
    }
}

fn launch_strided(
    ctx: &DeviceContext,
    f: sys::CUfunction,
    dst: u64,
    src: u64,
    axes: &[Axis],
    stream: sys::CUstream,
) -> Result<()> {
    let mut args = StridedArgs {
        numel: axes.iter().map(|a| a.extent as i64).product(),
        ndim: axes.len() as i32,
        shape: [0; 8],
        src: [0; 8],
        dst: [0; 8],
    };
    for (k, a) in axes.iter().enumerate() {
        args.shape[k] = a.extent as i64;
        args.src[k] = a.src;
        args.dst[k] = a.dst;
    }
    let blocks = (args.numel as u64)
        .div_ceil(THREADS as u64)
        .min(ctx.multiprocessors as u64 * 32) as u32;
    launch(
        f,
        (blocks, 1, 1),
        (THREADS, 1, 1),
        dst,
        src,
        &mut args,
        stream,
    )
}

#[allow(clippy::too_many_arguments)]
fn launch_tiled(
    f: sys::CUfunction,
    dst: u64,
    src: u64,
    axes: &[Axis],
    x: usize,
    y: usize,
    stream: sys::CUstream,
) -> Result<()> {
    let mut args = TiledArgs {
        nx: axes[x].extent as i64,
        ny: axes[y].extent as i64,
        src_sx: axes[x].src,
        dst_sy: axes[y].dst,
        batch: 1,
        nb: 0,
        bshape: [0; 8],
        bsrc: [0; 8],
        bdst: [0; 8],
    };
    for (_, a) in axes.iter().enumerate().filter(|(k, _)| *k != x && *k != y) {
        let n = args.nb as usize;
        args.bshape[n] = a.extent as i64;
        args.bsrc[n] = a.src;
        args.bdst[n] = a.dst;
        args.nb += 1;
        args.batch *= a.extent as i64;
    }
    let gx = axes[x].extent.div_ceil(TILE).min(i32::MAX as u64) as u32;
    let gy = axes[y].extent.div_ceil(TILE).min(65_535) as u32;
    let gz = (args.batch as u64).min(65_535) as u32;
    launch(
        f,
        (gx, gy, gz),
        (TILE as u32, TILE_ROWS, 1),
        dst,
        src,
        &mut args,
        stream,
    )
}

fn launch<A>(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    mut dst: u64,
    mut src: u64,
    args: &mut A,
    stream: sys::CUstream,
) -> Result<()> {
    let mut params: [*mut c_void; 3] = [
        (&raw mut dst).cast(),
        (&raw mut src).cast(),
        (args as *mut A).cast(),
    ];
    // SAFETY: `f` is a kernel of the current context taking (pointer, pointer, struct by value)
    // exactly as laid out in `params`; the grid stays within the driver's limits; the kernel only
    // touches the planned words of the two views.
    unsafe { result::launch_kernel(f, grid, block, 0, stream, &mut params) }.named("cuLaunchKernel")
}
