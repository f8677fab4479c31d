//! The CUDA backend, on the driver API through `cudarc`'s raw bindings, loaded at run time.
//!
//! # Loading
//! `libcuda` is looked up the first time anything here is used. A machine without it (no driver,
//! no GPU) gets [`Error::BackendUnavailable`] from every entry point — never a panic — and
//! [`is_available`] answers `false`. Only driver entry points present since CUDA 11 are called, so
//! a missing symbol cannot abort the process either.
//!
//! # Contexts
//! Every device is used through its *primary context*, the one the CUDA runtime (and so PyTorch,
//! CuPy and JAX) uses, so pointers, streams and events pass freely between them and dlbridge.
//! Each call binds the device's context to the calling thread first.
//!
//! # Memory
//! Device memory (`kDLCUDA`), pinned host memory mapped for the device (`kDLCUDAHost`) and
//! managed memory (`kDLCUDAManaged`), each an [`Allocation`](crate::buffer::Allocation) freed when
//! its last view is dropped. Memory imported from another library is wrapped with
//! `Buffer::from_foreign` and never freed here.
//!
//! # Streams
//! Work is enqueued on the calling thread's *current stream* for the device ([`current_stream`]),
//! the legacy default stream unless set otherwise. Handles use the driver's values: `0` and
//! `CU_STREAM_LEGACY` (`1`) are the legacy default stream, `CU_STREAM_PER_THREAD` (`2`) the
//! per-thread default stream, anything else a `CUstream`. The caching pool files blocks by stream,
//! and files those of the per-thread default stream by thread, since handle `2` is a different
//! stream on every thread (`stream::pool_key`).

mod blas;
mod codegen;
pub(crate) mod compute;
mod copy;
mod driver;
mod gds;
mod hooks;
pub(crate) mod ipc;
pub(crate) mod kinds;
pub(crate) mod launch;
mod memory;
pub mod nccl;
mod nvrtc;
mod stream;
pub(crate) mod upload;

use std::sync::{Mutex, OnceLock};

use cudarc::driver::result::{self, ctx, device, event, primary_ctx};
use cudarc::driver::sys;

pub(crate) use copy::copy;
pub(crate) use hooks::Cuda;
pub(crate) use memory::validate_foreign;
pub use memory::{allocate, pool};
pub use stream::{
    Event, LEGACY_STREAM, PER_THREAD_STREAM, Stream, current_stream, set_current_stream,
};
pub(crate) use stream::{make_visible, order_streams, record_use, stream_from_dlpack};

use self::driver::{Named, failed};
use crate::device::Device;
use crate::error::{Error, Result};

const BACKEND: &str = "CUDA";

/// The driver, once loaded and initialised, with one slot per device.
struct Driver {
    devices: Vec<OnceLock<std::result::Result<&'static DeviceContext, String>>>,
    version: i32,
}

/// A device's primary context and what dlbridge keeps per device.
pub(crate) struct DeviceContext {
    pub(crate) ctx: sys::CUcontext,
    /// The event used to order one stream after another (see [`make_visible`]).
    pub(crate) handoff: Mutex<sys::CUevent>,
    /// The copy kernels, loaded on first use.
    pub(crate) kernels: OnceLock<std::result::Result<copy::Kernels, String>>,
    pub(crate) multiprocessors: u32,
    /// The compute capability `(major, minor)`, which run-time compiled code targets.
    pub(crate) arch: (i32, i32),
}

// SAFETY: the context and event handles are plain driver handles, usable from any thread; the
// event is only used under its mutex.
unsafe impl Send for DeviceContext {}
// SAFETY: as above; shared access never mutates the handles.
unsafe impl Sync for DeviceContext {}

fn driver() -> Result<&'static Driver> {
    /// The driver, and the fork generation of the process that initialised it.
    static DRIVER: OnceLock<(u64, std::result::Result<Driver, String>)> = OnceLock::new();
    let (born, driver) = DRIVER.get_or_init(|| (crate::fork::generation(), load_driver()));
    let driver = driver
        .as_ref()
        .map_err(|reason| Error::BackendUnavailable {
            backend: BACKEND,
            reason: reason.clone(),
        })?;
    if *born != crate::fork::generation() {
        // The driver's state does not survive fork(): calling it here can fail or hang.
        return Err(forked());
    }
    Ok(driver)
}

#[cold]
fn forked() -> Error {
    Error::BackendUnavailable {
        backend: BACKEND,
        reason:
            "CUDA was initialised in the parent process, and the CUDA driver cannot be used in \
                 a child made by fork(): start child processes with multiprocessing's 'spawn' or \
                 'forkserver' method (multiprocessing.get_context(\"spawn\"))"
                .into(),
    }
}

fn load_driver() -> std::result::Result<Driver, String> {
    if !driver::is_present() {
        return Err(
            "the CUDA driver library (libcuda) was not found; install an NVIDIA driver \
                    or add its folder to LD_LIBRARY_PATH"
                .into(),
        );
    }
    result::init().map_err(|e| failed("cuInit", e))?;
    let count = device::get_count().map_err(|e| failed("cuDeviceGetCount", e))?;
    let version = driver::version().unwrap_or(0);
    Ok(Driver {
        devices: (0..count.max(0)).map(|_| OnceLock::new()).collect(),
        version,
    })
}

/// Whether this process can open the CUDA driver library at all (looked for once; no driver
/// function is called, so CUDA is not initialised). Where it cannot, no array in the process is
/// in CUDA memory, whichever library made it: a DLPack consumer need not ask a producer's device
/// to choose a stream.
pub fn driver_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(driver::is_present)
}

/// Whether the CUDA driver loads and at least one device is present.
pub fn is_available() -> bool {
    driver().is_ok_and(|d| !d.devices.is_empty())
}

/// The number of CUDA devices (0 where the driver loads but finds none).
pub fn device_count() -> Result<usize> {
    Ok(driver()?.devices.len())
}

/// The driver's CUDA version as `(major, minor)`.
pub fn driver_version() -> Result<(i32, i32)> {
    let v = driver()?.version;
    Ok((v / 1000, (v % 1000) / 10))
}

/// The address of a view's first element (a device address, or a host address of pinned or
/// managed memory).
pub(super) fn first_address(t: &crate::Tensor) -> usize {
    t.buffer().handle().expose_provenance() + t.byte_offset()
}

/// The context of device `ordinal`, retained on first use and bound to the calling thread until
/// the returned guard drops (which restores whatever context the thread had before, so that
/// another library's idea of the current device never changes under it).
pub(crate) fn context(ordinal: i32) -> Result<Bound> {
    let d = driver()?;
    let slot = usize::try_from(ordinal)
        .ok()
        .and_then(|i| d.devices.get(i))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist: this machine has {} CUDA device(s)",
                d.devices.len()
            ))
        })?;
    let ctx = slot
        .get_or_init(|| open_device(ordinal))
        .as_ref()
        .map_err(|message| Error::Driver {
            backend: BACKEND,
            message: message.clone(),
        })?;
    ctx.bind()
}

/// A device context bound to the calling thread; dropping it restores the previous binding.
pub(crate) struct Bound {
    inner: &'static DeviceContext,
    previous: Option<sys::CUcontext>,
}

impl std::ops::Deref for Bound {
    type Target = DeviceContext;

    fn deref(&self) -> &DeviceContext {
        self.inner
    }
}

impl Bound {
    /// The device's state, outliving the binding.
    pub(crate) fn state(&self) -> &'static DeviceContext {
        self.inner
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: `previous` was the thread's current context (or NULL) when the guard was
            // made; re-binding it is what its owner expects. A failure leaves ours bound, which
            // is harmless, and Drop cannot report it.
            let _ = unsafe { ctx::set_current(previous) };
        }
    }
}

fn open_device(ordinal: i32) -> std::result::Result<&'static DeviceContext, String> {
    let text = |e: Error| e.to_string();
    let dev = device::get(ordinal).named("cuDeviceGet").map_err(text)?;
    // SAFETY: `dev` came from `cuDeviceGet`. The primary context is retained for the process's
    // life (never released: other libraries share it and it lives as long as the process).
    let ctx = unsafe { primary_ctx::retain(dev) }
        .named("cuDevicePrimaryCtxRetain")
        .map_err(text)?;
    let previous = current_context().map_err(text)?;
    // SAFETY: `ctx` is the live primary context just retained.
    unsafe { ctx::set_current(ctx) }
        .named("cuCtxSetCurrent")
        .map_err(text)?;
    let created = event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
    // SAFETY: re-binds what the thread had before (possibly NULL).
    let _ = unsafe { ctx::set_current(previous) };
    let event = created.named("cuEventCreate").map_err(text)?;
    let attribute = |which: sys::CUdevice_attribute| {
        // SAFETY: `dev` came from `cuDeviceGet`.
        unsafe { device::get_attribute(dev, which) }
    };
    let sms =
        attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap_or(0);
    let arch = (
        attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .named("cuDeviceGetAttribute")
            .map_err(text)?,
        attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .named("cuDeviceGetAttribute")
            .map_err(text)?,
    );
    Ok(Box::leak(Box::new(DeviceContext {
        ctx,
        handoff: Mutex::new(event),
        kernels: OnceLock::new(),
        multiprocessors: sms.max(1) as u32,
        arch,
    })))
}

/// The context current on the calling thread, NULL where none is.
fn current_context() -> Result<sys::CUcontext> {
    let current = ctx::get_current().named("cuCtxGetCurrent")?;
    Ok(current.unwrap_or(std::ptr::null_mut()))
}

impl DeviceContext {
    /// Makes this context current on the calling thread until the guard drops.
    pub(crate) fn bind(&'static self) -> Result<Bound> {
        let current = current_context()?;
        if current == self.ctx {
            return Ok(Bound {
                inner: self,
                previous: None,
            });
        }
        // SAFETY: `ctx` is a primary context retained for the life of the process.
        unsafe { ctx::set_current(self.ctx) }.named("cuCtxSetCurrent")?;
        Ok(Bound {
            inner: self,
            previous: Some(current),
        })
    }
}

/// The name of device `ordinal`, e.g. `NVIDIA H200`.
pub fn device_name(ordinal: i32) -> Result<String> {
    let _ctx = context(ordinal)?;
    let dev = device::get(ordinal).named("cuDeviceGet")?;
    driver::device_name(dev).named("cuDeviceGetName")
}

/// `(free, total)` bytes of device memory on `ordinal`, as the driver reports them.
pub fn mem_info(ordinal: i32) -> Result<(usize, usize)> {
    let _ctx = context(ordinal)?;
    result::mem_get_info().named("cuMemGetInfo")
}

/// Waits for all work on device `ordinal` to finish.
pub fn synchronize(ordinal: i32) -> Result<()> {
    let _ctx = context(ordinal)?;
    ctx::synchronize().named("cuCtxSynchronize")
}

/// Makes host access to `device`'s memory safe: for the host-visible CUDA kinds (pinned and
/// managed memory), waits for the device's pending work. Other devices need nothing.
pub fn host_barrier(device: Device) -> Result<()> {
    use crate::device::DeviceKind;
    match device.kind() {
        // Without a driver no device work can be pending.
        DeviceKind::CudaHost | DeviceKind::CudaManaged if driver().is_ok() => {
            synchronize(device.index() as i32)
        }
        _ => Ok(()),
    }
}
