//! The driver entry points `cudarc`'s `result` layer lacks, written in its style, and the one place
//! a failed driver call becomes this crate's [`Error`].
//!
//! The backend calls the driver through `cudarc::driver::result` where it has the entry point, and
//! through the functions here where it does not (or where its signature does not fit memory we do
//! not own: its copies take Rust slices, which must not cover foreign or uninitialised bytes).
//! Each returns `Result<T, DriverError>`; a call site names the call with [`Named::named`], as in
//! `unsafe { event::record(event, stream) }.named("cuEventRecord")?`.

use std::ffi::{CStr, c_char, c_int, c_void};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

use super::BACKEND;
use crate::error::{Error, Result};

/// A driver result with the name of the call that produced it, as this crate's error.
pub(crate) trait Named<T> {
    /// `Ok` as is; an error becomes [`Error::Driver`] saying "`call` failed: NAME (text)".
    fn named(self, call: &str) -> Result<T>;
}

impl<T> Named<T> for std::result::Result<T, DriverError> {
    fn named(self, call: &str) -> Result<T> {
        self.map_err(|e| Error::Driver {
            backend: BACKEND,
            message: failed(call, e),
        })
    }
}

/// "`call` failed: NAME (text)", the message of every failed driver call.
pub(crate) fn failed(call: &str, e: DriverError) -> String {
    format!("{call} failed: {}", describe(e))
}

/// The driver's name and description of an error, e.g. `CUDA_ERROR_INVALID_VALUE (invalid
/// argument)`; the bare code where the driver does not know it.
pub(crate) fn describe(e: DriverError) -> String {
    let show = |s: std::result::Result<&CStr, DriverError>| {
        s.ok().map(|s| s.to_string_lossy().into_owned())
    };
    match (show(e.error_name()), show(e.error_string())) {
        (Some(n), Some(t)) => format!("{n} ({t})"),
        (Some(n), None) => n,
        _ => format!("CUDA error {}", e.0 as i32),
    }
}

/// Whether the driver library (`libcuda`) can be opened. Calls no driver function.
pub(crate) fn is_present() -> bool {
    // SAFETY: only tries to open the library by its known names; no symbol is called.
    unsafe { sys::is_culib_present() }
}

/// The driver's CUDA version, e.g. `12080` for 12.8 (`cuDriverGetVersion`).
pub(crate) fn version() -> std::result::Result<c_int, DriverError> {
    let mut version: c_int = 0;
    // SAFETY: `version` is a valid out-pointer.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    Ok(version)
}

/// The name of device `dev`, e.g. `NVIDIA H200` (`cuDeviceGetName`, up to 255 bytes; cudarc's
/// `device::get_name` keeps 127).
pub(crate) fn device_name(dev: sys::CUdevice) -> std::result::Result<String, DriverError> {
    let mut name = [0u8; 256];
    // SAFETY: the buffer holds `len` bytes; the driver writes a NUL-terminated name into it.
    unsafe { sys::cuDeviceGetName(name.as_mut_ptr().cast::<c_char>(), name.len() as c_int, dev) }
        .result()?;
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// Whether all work enqueued on `stream` has finished: `Ok` when it has, the error
/// `CUDA_ERROR_NOT_READY` when not (`cuStreamQuery`).
///
/// # Safety
/// `stream` is a live stream of the current context, or a default stream handle.
pub(crate) unsafe fn stream_query(stream: sys::CUstream) -> std::result::Result<(), DriverError> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuStreamQuery(stream) }.result()
}

/// Enqueues a copy of `bytes` bytes from host address `src` to device address `dst` on `stream`
/// (`cuMemcpyHtoDAsync`).
///
/// # Safety
/// `[src, src + bytes)` is readable host memory and `[dst, dst + bytes)` writable device memory,
/// both live until the copy has run (the driver stages pageable sources before returning);
/// `stream` is a live stream of the current context.
pub(crate) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream) }.result()
}

/// Registers `len` bytes of host memory at `p` with the driver for copies (`cuMemHostRegister`
/// with `flags`).
///
/// # Safety
/// `[p, p + len)` is a live host mapping with no page registered yet, and stays mapped until
/// [`host_unregister`]; the context is current.
pub(crate) unsafe fn host_register(
    p: *const c_void,
    len: usize,
    flags: u32,
) -> std::result::Result<(), DriverError> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemHostRegister_v2(p.cast_mut(), len, flags) }.result()
}

/// Undoes [`host_register`] (`cuMemHostUnregister`).
///
/// # Safety
/// `p` starts a registered range that no queued device work reads any more; the context is
/// current.
pub(crate) unsafe fn host_unregister(p: *const c_void) -> std::result::Result<(), DriverError> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemHostUnregister(p.cast_mut()) }.result()
}

/// Enqueues a copy of `bytes` bytes from device address `src` to host address `dst` on `stream`
/// (`cuMemcpyDtoHAsync`).
///
/// # Safety
/// `[src, src + bytes)` is readable device memory and `[dst, dst + bytes)` writable host memory
/// nothing else touches, both live until the copy has run; `stream` is a live stream of the
/// current context.
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: *mut c_void,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream) }.result()
}

/// Enqueues a copy of `bytes` bytes between two unified addresses on `stream` (`cuMemcpyAsync`).
///
/// # Safety
/// `[src, src + bytes)` is readable and `[dst, dst + bytes)` writable memory that the current
/// context can address, not overlapping, live until the copy has run and written by nothing else
/// meanwhile; `stream` is a live stream of the current context.
pub(crate) unsafe fn memcpy_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream) }.result()
}

/// Enqueues the pitched copy `copy` describes on `stream` (`cuMemcpy2DAsync`).
///
/// # Safety
/// Every row `copy` names lies inside live memory the current context can address, readable on
/// the source side and writable on the destination side, the two not overlapping and written by
/// nothing else until the copy has run; `stream` is a live stream of the current context.
pub(crate) unsafe fn memcpy_2d_async(
    copy: &sys::CUDA_MEMCPY2D,
    stream: sys::CUstream,
) -> std::result::Result<(), DriverError> {
    // SAFETY: the caller's contract; `copy` is a valid descriptor for the duration of the call.
    unsafe { sys::cuMemcpy2DAsync_v2(copy, stream) }.result()
}

/// What the driver knows of an address (`cuPointerGetAttributes`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PointerInfo {
    /// A `CUmemorytype`, `0` where the driver does not know the address.
    pub(crate) memory_type: u32,
    /// The device the memory belongs to, `-1` where none was reported.
    pub(crate) ordinal: i32,
    /// The start of the allocation holding the address, `0` where not reported.
    pub(crate) start: u64,
    /// The size of that allocation, `0` where not reported.
    pub(crate) size: usize,
}

/// The memory type, device ordinal and allocation range of address `addr`. Any address may be
/// asked about: the driver only looks it up.
pub(crate) fn pointer_info(
    addr: sys::CUdeviceptr,
) -> std::result::Result<PointerInfo, DriverError> {
    let mut info = PointerInfo {
        memory_type: 0,
        ordinal: -1,
        start: 0,
        size: 0,
    };
    let mut attrs = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let mut data: [*mut c_void; 4] = [
        (&raw mut info.memory_type).cast(),
        (&raw mut info.ordinal).cast(),
        (&raw mut info.start).cast(),
        (&raw mut info.size).cast(),
    ];
    // SAFETY: four attributes, each with an out-pointer of the size the driver writes for it
    // (`unsigned int`, `int`, `CUdeviceptr`, `size_t`).
    unsafe {
        sys::cuPointerGetAttributes(
            attrs.len() as u32,
            attrs.as_mut_ptr(),
            data.as_mut_ptr(),
            addr,
        )
    }
    .result()?;
    Ok(info)
}

/// The `(offset, size)` in bytes of parameter `index` of kernel `f`; the error
/// `CUDA_ERROR_INVALID_VALUE` past the last parameter (`cuFuncGetParamInfo`).
///
/// # Safety
/// `f` is a kernel of a loaded module, and the driver is CUDA 12.4 or newer (older ones lack the
/// entry point, and calling it would abort).
pub(crate) unsafe fn func_param_info(
    f: sys::CUfunction,
    index: usize,
) -> std::result::Result<(usize, usize), DriverError> {
    let (mut offset, mut size) = (0usize, 0usize);
    // SAFETY: the caller's contract; `offset` and `size` are valid out-pointers.
    unsafe { sys::cuFuncGetParamInfo(f, index, &mut offset, &mut size) }.result()?;
    Ok((offset, size))
}

/// The driver allocation holding device address `addr`: its base and size
/// (`cuMemGetAddressRange`); an error for an address the driver did not allocate.
pub(crate) fn address_range(
    addr: sys::CUdeviceptr,
) -> std::result::Result<(sys::CUdeviceptr, usize), DriverError> {
    let (mut base, mut size) = (0, 0usize);
    // SAFETY: valid out-pointers; an unknown address makes the call fail.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) }.result()?;
    Ok((base, size))
}
