//! CUDA allocations (device, pinned host, managed) and checks of imported pointers.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::stream::current_stream;
use super::{BACKEND, check, context, describe};
use crate::buffer::{Allocation, Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};

/// Which driver allocator made a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Device,
    Pinned,
    Managed,
}

/// One allocation from the driver, freed when dropped.
struct CudaAllocation {
    ptr: u64,
    kind: Kind,
    ordinal: i32,
}

impl Allocation for CudaAllocation {}

impl Drop for CudaAllocation {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // Whatever fails here (a driver already shut down at process exit) cannot be reported
        // from Drop; the memory goes with the process then anyway.
        let Ok(_ctx) = context(self.ordinal) else {
            return;
        };
        let _ = match self.kind {
            // SAFETY: `ptr` came from cuMemAlloc / cuMemAllocManaged and is freed only here. The
            // free waits for work still using the memory.
            Kind::Device | Kind::Managed => unsafe { sys::cuMemFree_v2(self.ptr) },
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed only here.
            Kind::Pinned => unsafe {
                sys::cuMemFreeHost(std::ptr::with_exposed_provenance_mut(self.ptr as usize))
            },
        };
    }
}

/// Allocates `bytes` of CUDA memory of `device`'s kind (device, pinned host or managed),
/// zero-filled on the current stream when `zeroed`.
pub fn allocate(device: Device, bytes: usize, zeroed: bool) -> Result<Buffer> {
    let (kind, storage) = match device.kind() {
        DeviceKind::Cuda => (Kind::Device, StorageMode::Private),
        DeviceKind::CudaHost => (Kind::Pinned, StorageMode::Shared),
        DeviceKind::CudaManaged => (Kind::Managed, StorageMode::Managed),
        _ => {
            return Err(Error::UnsupportedDevice(format!(
                "the CUDA backend cannot allocate on {device}"
            )));
        }
    };
    let ordinal = device.index() as i32;
    let ctx = context(ordinal)?;
    let mut ptr: u64 = 0;
    if bytes > 0 {
        let rc = match kind {
            // SAFETY: valid out-pointer; the device's context is current.
            Kind::Device => unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) },
            Kind::Pinned => {
                let mut host: *mut c_void = std::ptr::null_mut();
                let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
                // SAFETY: valid out-pointer; the context is current.
                let rc = unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) };
                ptr = host.expose_provenance() as u64;
                rc
            }
            // SAFETY: valid out-pointer; the context is current.
            Kind::Managed => unsafe {
                sys::cuMemAllocManaged(
                    &mut ptr,
                    bytes,
                    sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32,
                )
            },
        };
        match rc {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                let (free, total) = super::mem_info(ordinal).unwrap_or((0, 0));
                return Err(Error::OutOfMemory {
                    bytes,
                    device,
                    detail: format!(
                        " ({}; the device has {free} of {total} bytes free)",
                        describe(rc)
                    ),
                });
            }
            rc => {
                return Err(Error::Driver {
                    backend: BACKEND,
                    message: format!("allocating {bytes} bytes on {device}: {}", describe(rc)),
                });
            }
        }
    }
    let allocation = CudaAllocation { ptr, kind, ordinal };
    if zeroed && bytes > 0 {
        check(
            // SAFETY: `ptr` addresses `bytes` bytes just allocated; the memset is ordered on the
            // current stream before any later work there (and other streams are ordered after it by
            // the DLPack handoff or by `make_visible`).
            unsafe {
                sys::cuMemsetD8Async(
                    ptr,
                    0,
                    bytes,
                    std::ptr::with_exposed_provenance_mut(current_stream(ordinal)),
                )
            },
            "cuMemsetD8Async",
        )?;
    }
    drop(ctx);
    let handle = std::ptr::with_exposed_provenance_mut::<c_void>(ptr as usize);
    let host = match kind {
        Kind::Device => std::ptr::null_mut(),
        Kind::Pinned | Kind::Managed => handle.cast::<u8>(),
    };
    // SAFETY: the driver returned `bytes` bytes at `ptr`, valid until `allocation` frees them;
    // pinned and managed memory is host-addressable at the same address (unified addressing).
    Ok(unsafe {
        Buffer::from_allocation(handle, host, bytes, device, storage, Box::new(allocation))
    })
}

/// Checks that `[addr, addr + len)` is memory the CUDA driver knows, of the kind and device that a
/// DLPack producer claimed. A pointer the driver does not know is a [`Error::MalformedTensor`].
pub fn validate_foreign(device: Device, addr: usize, len: usize) -> Result<()> {
    let ordinal = device.index() as i32;
    let _ctx = context(ordinal)?;
    let mut memory_type: u32 = 0;
    let mut ordinal_found: i32 = -1;
    let mut start: u64 = 0;
    let mut size: usize = 0;
    let mut attrs = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let mut data: [*mut c_void; 4] = [
        (&raw mut memory_type).cast(),
        (&raw mut ordinal_found).cast(),
        (&raw mut start).cast(),
        (&raw mut size).cast(),
    ];
    // SAFETY: four attributes, each with an out-pointer of the size the driver writes for it.
    let rc = unsafe {
        sys::cuPointerGetAttributes(
            attrs.len() as u32,
            attrs.as_mut_ptr(),
            data.as_mut_ptr(),
            addr as u64,
        )
    };
    let unknown = || {
        Error::MalformedTensor(format!(
            "{addr:#x} is not memory the CUDA driver knows, but the producer said it is on {device}"
        ))
    };
    if rc != sys::CUresult::CUDA_SUCCESS || memory_type == 0 {
        return Err(unknown());
    }
    let expect_device = device.kind() == DeviceKind::Cuda;
    let is_device = memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    if device.kind() != DeviceKind::CudaHost && ordinal_found >= 0 && ordinal_found != ordinal {
        return Err(Error::MalformedTensor(format!(
            "{addr:#x} is memory of cuda:{ordinal_found}, but the producer said {device}"
        )));
    }
    if expect_device && !is_device {
        return Err(Error::MalformedTensor(format!(
            "{addr:#x} is host memory, but the producer said {device}"
        )));
    }
    if start != 0 && size != 0 {
        let end = addr as u128 + len as u128;
        if (addr as u64) < start || end > start as u128 + size as u128 {
            return Err(Error::MalformedTensor(format!(
                "the tensor's bytes {addr:#x}..{end:#x} run outside the CUDA allocation \
                 {start:#x}..{:#x}",
                start as u128 + size as u128
            )));
        }
    }
    Ok(())
}
