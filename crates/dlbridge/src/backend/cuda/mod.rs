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
//! [`Buffer::from_foreign`] and never freed here.
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
pub(crate) mod launch;
mod memory;
mod nvrtc;
mod stream;

use std::ffi::{CStr, c_int};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;

pub(crate) use copy::copy;
pub use memory::{allocate, pool, validate_foreign};
pub(crate) use stream::record_use;
pub use stream::{
    Event, LEGACY_STREAM, PER_THREAD_STREAM, Stream, current_stream, make_visible, order_streams,
    set_current_stream, stream_from_dlpack,
};

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
    // SAFETY: only tries to open the library by name; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "the CUDA driver library (libcuda) was not found; install an NVIDIA driver \
                    or add its folder to LD_LIBRARY_PATH"
                .into(),
        );
    }
    // SAFETY: cuInit takes flags 0 and may be called any number of times.
    let rc = unsafe { sys::cuInit(0) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuInit failed: {}", describe(rc)));
    }
    let mut count: c_int = 0;
    // SAFETY: `count` is a valid out-pointer.
    let rc = unsafe { sys::cuDeviceGetCount(&mut count) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuDeviceGetCount failed: {}", describe(rc)));
    }
    let mut version: c_int = 0;
    // SAFETY: `version` is a valid out-pointer.
    let _ = unsafe { sys::cuDriverGetVersion(&mut version) };
    Ok(Driver {
        devices: (0..count.max(0)).map(|_| OnceLock::new()).collect(),
        version,
    })
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
            let _ = unsafe { sys::cuCtxSetCurrent(previous) };
        }
    }
}

fn open_device(ordinal: i32) -> std::result::Result<&'static DeviceContext, String> {
    let mut dev: sys::CUdevice = 0;
    check(
        // SAFETY: `dev` is a valid out-pointer; the ordinal was range-checked by the caller.
        unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )
    .map_err(|e| e.to_string())?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    check(
        // SAFETY: `ctx` is a valid out-pointer; the primary context is retained for the process's life
        // (never released: other libraries share it and it lives as long as the process).
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
        "cuDevicePrimaryCtxRetain",
    )
    .map_err(|e| e.to_string())?;
    let mut previous: sys::CUcontext = std::ptr::null_mut();
    check(
        // SAFETY: `previous` is a valid out-pointer.
        unsafe { sys::cuCtxGetCurrent(&mut previous) },
        "cuCtxGetCurrent",
    )
    .map_err(|e| e.to_string())?;
    // SAFETY: `ctx` is the live primary context just retained.
    check(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent").map_err(|e| e.to_string())?;
    let mut event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: `event` is a valid out-pointer; the context is current.
    let created = check(
        unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        },
        "cuEventCreate",
    );
    // SAFETY: re-binds what the thread had before (possibly NULL).
    let _ = unsafe { sys::cuCtxSetCurrent(previous) };
    created.map_err(|e| e.to_string())?;
    let mut sms: c_int = 0;
    // SAFETY: `sms` is a valid out-pointer and `dev` a valid device.
    let _ = unsafe {
        sys::cuDeviceGetAttribute(
            &mut sms,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            dev,
        )
    };
    let attribute = |which: sys::CUdevice_attribute| {
        let mut value: c_int = 0;
        // SAFETY: `value` is a valid out-pointer and `dev` a valid device.
        let rc = unsafe { sys::cuDeviceGetAttribute(&mut value, which, dev) };
        check(rc, "cuDeviceGetAttribute").map(|()| value)
    };
    let arch = (
        attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(|e| e.to_string())?,
        attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(|e| e.to_string())?,
    );
    Ok(Box::leak(Box::new(DeviceContext {
        ctx,
        handoff: Mutex::new(event),
        kernels: OnceLock::new(),
        multiprocessors: sms.max(1) as u32,
        arch,
    })))
}

impl DeviceContext {
    /// Makes this context current on the calling thread until the guard drops.
    pub(crate) fn bind(&'static self) -> Result<Bound> {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: `current` is a valid out-pointer.
            unsafe { sys::cuCtxGetCurrent(&mut current) },
            "cuCtxGetCurrent",
        )?;
        if current == self.ctx {
            return Ok(Bound {
                inner: self,
                previous: None,
            });
        }
        // SAFETY: `ctx` is a primary context retained for the life of the process.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")?;
        Ok(Bound {
            inner: self,
            previous: Some(current),
        })
    }
}

/// The name of device `ordinal`, e.g. `NVIDIA H200`.
pub fn device_name(ordinal: i32) -> Result<String> {
    let _ctx = context(ordinal)?;
    let mut dev: sys::CUdevice = 0;
    check(
        // SAFETY: valid out-pointer; the ordinal was checked by `context`.
        unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )?;
    let mut name = [0 as std::ffi::c_char; 256];
    check(
        // SAFETY: the buffer holds `len` bytes; the driver writes a NUL-terminated name into it.
        unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev) },
        "cuDeviceGetName",
    )?;
    // SAFETY: the driver NUL-terminated the name inside the buffer.
    Ok(unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// `(free, total)` bytes of device memory on `ordinal`, as the driver reports them.
pub fn mem_info(ordinal: i32) -> Result<(usize, usize)> {
    let _ctx = context(ordinal)?;
    let (mut free, mut total) = (0usize, 0usize);
    check(
        // SAFETY: valid out-pointers; the device's context is current.
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
    )?;
    Ok((free, total))
}

/// Waits for all work on device `ordinal` to finish.
pub fn synchronize(ordinal: i32) -> Result<()> {
    let _ctx = context(ordinal)?;
    // SAFETY: the device's context is current.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
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

/// The driver's name and description of a result code.
pub(crate) fn describe(rc: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: valid out-pointers; the driver returns static strings or leaves them NULL.
    let _ = unsafe { sys::cuGetErrorName(rc, &mut name) };
    // SAFETY: as above.
    let _ = unsafe { sys::cuGetErrorString(rc, &mut text) };
    let show = |p: *const std::ffi::c_char| {
        if p.is_null() {
            None
        } else {
            // SAFETY: non-NULL strings from the driver are static and NUL-terminated.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        }
    };
    match (show(name), show(text)) {
        (Some(n), Some(t)) => format!("{n} ({t})"),
        (Some(n), None) => n,
        _ => format!("CUDA error {}", rc as i32),
    }
}

/// Turns a driver result into this crate's error, naming the call.
pub(crate) fn check(rc: sys::CUresult, call: &str) -> Result<()> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver {
            backend: BACKEND,
            message: format!("{call} failed: {}", describe(rc)),
        })
    }
}
