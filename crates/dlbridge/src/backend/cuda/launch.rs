//! Run-time user kernels on CUDA: CUDA C compiled by NVRTC for the device's architecture, loaded
//! into its primary context, launched on the calling thread's current stream and timed by events.
//!
//! The entry point is registered with NVRTC as a name expression, so `extern "C"` kernels and C++
//! ones (templates included: `"scale<float>"`) are both found by the name written in the source.
//! Compiled kernels are cached by (device, source, name, options) for the life of the process.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result::{self, DriverError, event, function};
use cudarc::driver::sys;

use super::driver::{self, describe};
use super::first_address;
use super::nvrtc::{self, Function};
use super::stream::{Event, current_stream, raw};
use super::{BACKEND, context, driver_version};
use crate::compute::kernel::{Kernel, KernelArg, LaunchConfig, LaunchTiming};
use crate::device::Device;
use crate::error::{Error, Result};

/// Above this much dynamic shared memory a kernel must opt in (`cuFuncSetAttribute`).
const DEFAULT_SHARED_LIMIT: u32 = 48 << 10;

/// The CUDA side of a [`Kernel`].
struct CudaKernel {
    function: Function,
    ordinal: i32,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    /// The device as asked for (its kind too: the kernel reports it, and launches check it).
    device: Device,
    source: String,
    name: String,
    options: Vec<String>,
}

fn cache() -> &'static Mutex<HashMap<CacheKey, Kernel>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, Kernel>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

pub(crate) fn compile(
    device: Device,
    source: &str,
    name: &str,
    options: &[String],
) -> Result<Kernel> {
    let ordinal = device.index() as i32;
    let ctx = context(ordinal)?;
    let key = CacheKey {
        device,
        source: source.to_string(),
        name: name.to_string(),
        options: options.to_vec(),
    };
    if let Some(k) = cache().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(k.clone());
    }
    let mut full = options.to_vec();
    if !nvrtc::names_arch(options) {
        full.push(nvrtc::arch_option(ctx.arch)?);
    }
    let image = match nvrtc::compile(source, name, &full, &[name]) {
        Ok(image) => image,
        Err(Error::Compile { log, .. }) => {
            // Did the source fail, or only the name? Compile it again without the name.
            return match nvrtc::compile(source, name, &full, &[]) {
                Ok(_) => Err(no_entry(name, &log)),
                Err(e) => Err(e),
            };
        }
        Err(e) => return Err(e),
    };
    let module = nvrtc::load(&image)?;
    let lowered = image.lowered.first().map_or(name, String::as_str);
    let function = module.function(lowered)?.ok_or_else(|| {
        Error::InvalidArgument(format!(
            "`{name}` is in the program but is not a kernel (a `__global__` function)"
        ))
    })?;
    let params = param_sizes(function);
    let kernel = Kernel::new(
        device,
        name.to_string(),
        params,
        Arc::new(CudaKernel { function, ordinal }),
    );
    Ok(cache()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_insert(kernel)
        .clone())
}

fn no_entry(name: &str, log: &str) -> Error {
    let detail = log
        .lines()
        .find(|l| l.contains("error"))
        .map(|l| format!(" (NVRTC: {})", l.trim()))
        .unwrap_or_default();
    Error::InvalidArgument(format!("the program has no kernel named `{name}`{detail}"))
}

/// The byte size of each parameter of `f`, where the driver can tell (CUDA 12.4 and newer).
fn param_sizes(f: Function) -> Option<Vec<usize>> {
    if driver_version().ok()? < (12, 4) {
        return None;
    }
    let mut sizes = Vec::new();
    loop {
        // SAFETY: a loaded kernel; the driver has the entry point (12.4+, checked above) and
        // answers CUDA_ERROR_INVALID_VALUE past the last parameter.
        match unsafe { driver::func_param_info(f.0, sizes.len()) } {
            Ok((_, size)) => sizes.push(size),
            Err(DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE)) => return Some(sizes),
            Err(_) => return None,
        }
    }
}

/// Errors after which the context cannot run anything again (the driver keeps them).
fn is_sticky(rc: sys::CUresult) -> bool {
    use sys::CUresult as R;
    matches!(
        rc,
        R::CUDA_ERROR_ILLEGAL_ADDRESS
            | R::CUDA_ERROR_LAUNCH_TIMEOUT
            | R::CUDA_ERROR_ASSERT
            | R::CUDA_ERROR_HARDWARE_STACK_ERROR
            | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | R::CUDA_ERROR_MISALIGNED_ADDRESS
            | R::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | R::CUDA_ERROR_INVALID_PC
            | R::CUDA_ERROR_LAUNCH_FAILED
            | R::CUDA_ERROR_ECC_UNCORRECTABLE
    )
}

fn launch_error(kernel: &Kernel, config: &LaunchConfig, what: &str, e: DriverError) -> Error {
    let mut message = format!(
        "{what} kernel `{}` (grid {:?}, block {:?}, {} bytes of dynamic shared memory) failed: {}",
        kernel.name(),
        config.grid,
        config.block,
        config.shared_mem,
        describe(e)
    );
    if is_sticky(e.0) {
        message.push_str(
            "; this error is sticky: the CUDA context of this device is unusable for the rest of \
             the process (every later CUDA call in it fails), and the process must be restarted",
        );
    }
    Error::Driver {
        backend: BACKEND,
        message,
    }
}

pub(crate) fn launch(
    kernel: &Kernel,
    config: LaunchConfig,
    args: &[KernelArg],
) -> Result<LaunchTiming> {
    let inner: &CudaKernel = kernel.inner().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "kernel `{}` was not compiled for CUDA",
            kernel.name()
        ))
    })?;
    let ordinal = inner.ordinal;
    let _ctx = context(ordinal)?;
    let stream = current_stream(ordinal);
    let params = kernel.param_sizes();
    // One 8-byte slot per argument, holding its value's bytes; the driver reads each parameter's
    // size from its slot.
    let mut slots: Vec<u64> = Vec::with_capacity(args.len());
    for (i, arg) in args.iter().enumerate() {
        let size = params.and_then(|p| p.get(i).copied());
        match (arg, arg.scalar_bytes(i, size)?) {
            (KernelArg::Tensor(t), _) => {
                if let Some(s) = size.filter(|&s| s != 8) {
                    return Err(Error::InvalidArgument(format!(
                        "argument {i} is an array (passed as an 8-byte pointer), but parameter \
                         {i} of `{}` takes {s} bytes",
                        kernel.name()
                    )));
                }
                slots.push(first_address(t) as u64);
            }
            (_, Some(bytes)) => {
                let mut b = [0u8; 8];
                b[..bytes.len()].copy_from_slice(&bytes);
                slots.push(u64::from_le_bytes(b));
            }
            (_, None) => unreachable!("only arrays have no scalar bytes"),
        }
    }
    let mut pointers: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| std::ptr::from_mut(s).cast())
        .collect();
    let f = inner.function;
    if config.shared_mem > DEFAULT_SHARED_LIMIT {
        // SAFETY: a loaded kernel of the current context; the driver checks the value.
        let allowed = unsafe {
            function::set_function_attribute(
                f.0,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                config.shared_mem as i32,
            )
        };
        allowed.map_err(|e| {
            launch_error(kernel, &config, "allowing the dynamic shared memory of", e)
        })?;
    }
    let start = Event::new(ordinal, true)?;
    let end = Event::new(ordinal, true)?;
    start.record(stream)?;
    // SAFETY: `f` is a kernel of the current context; `pointers` holds one pointer per argument to
    // an 8-byte slot with the argument's bytes first, which the driver copies during the call
    // (parameter count and sizes were checked against the kernel where the driver reports them).
    // Arrays passed stay alive until the kernel has finished: `args` is borrowed until this
    // function returns, after the end event has completed.
    let launched = unsafe {
        result::launch_kernel(
            f.0,
            config.grid.into(),
            config.block.into(),
            config.shared_mem,
            raw(stream),
            &mut pointers,
        )
    };
    launched.map_err(|e| launch_error(kernel, &config, "launching", e))?;
    end.record(stream)?;
    // SAFETY: a live event of this device, just recorded.
    let ran = unsafe { event::synchronize(std::ptr::with_exposed_provenance_mut(end.handle())) };
    ran.map_err(|e| launch_error(kernel, &config, "running", e))?;
    let elapsed_ms = start.elapsed_ms(&end)? as f64;
    Ok(LaunchTiming { elapsed_ms })
}
