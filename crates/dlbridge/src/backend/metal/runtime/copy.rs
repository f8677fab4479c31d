//! Copies between Metal views, and between Metal and host views: blits, the strided-copy kernel,
//! and shared staging buffers for private memory.

use objc2_metal::MTLBuffer;

use super::buffer::{registry_id_of, storage_of};
use super::context::Context;
use super::objc::MetalBuffer;
use super::{context, context_by_registry_id};
use crate::backend::metal::host_alias;
use crate::backend::metal::kernel::{CopyMethod, plan_copy};
use crate::buffer::{Buffer, StorageMode};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A Metal buffer ready for GPU work: its device's context, the retained `id<MTLBuffer>`, and the
/// storage mode Metal reports.
pub(super) struct Resolved {
    pub(super) context: &'static Context,
    pub(super) buffer: MetalBuffer,
    pub(super) storage: StorageMode,
}

/// Finds the `id<MTLBuffer>` behind a Metal [`Buffer`]. dlbridge's own are trusted; foreign ones
/// (imported, not yet resolved by `import_foreign`) are checked: an `MTLBuffer` of a device that
/// dlbridge knows, the one the tensor claims, and at least as long as the views need.
pub(super) fn resolve(buffer: &Buffer) -> Result<Resolved> {
    // SAFETY: a Metal `Buffer`'s handle is an `id<MTLBuffer>` kept alive by the buffer: dlbridge's
    // own by construction, a foreign one by the DLPack contract (and checked below).
    let mtl = unsafe { MetalBuffer::retain_handle(buffer.handle()) }?;
    if !buffer.is_foreign() {
        return Ok(Resolved {
            context: context(buffer.device())?,
            storage: buffer.storage_mode(),
            buffer: mtl,
        });
    }
    let context = context_by_registry_id(registry_id_of(&mtl))?;
    if context.info().device != buffer.device() {
        return Err(Error::MalformedTensor(format!(
            "the tensor says {} but its id<MTLBuffer> belongs to {}",
            buffer.device(),
            context.info().device
        )));
    }
    if mtl.length() < buffer.len() {
        return Err(Error::OutOfBounds(format!(
            "the view addresses {} bytes but the id<MTLBuffer> holds {}",
            buffer.len(),
            mtl.length()
        )));
    }
    Ok(Resolved {
        context,
        storage: storage_of(&mtl)?,
        buffer: mtl,
    })
}

/// Copies `src` into `dst` (see [`crate::backend::metal::copy_unchecked`]).
///
/// # Safety
/// No host reference into `dst`'s bytes may be alive, and no other thread may access them.
pub(crate) unsafe fn copy_unchecked(src: &Tensor, dst: &Tensor) -> Result<()> {
    if dst.is_read_only() {
        return Err(Error::ReadOnly("copying into a read-only view".into()));
    }
    if src.dtype() != dst.dtype() {
        return Err(Error::DTypeMismatch(format!(
            "copying {} elements into a {} view",
            src.dtype(),
            dst.dtype()
        )));
    }
    if src.is_packed() || dst.is_packed() {
        return Err(Error::UnsupportedDType(format!(
            "copies of packed sub-byte {} elements",
            dst.dtype()
        )));
    }
    let src = if src.shape() == dst.shape() {
        src.clone()
    } else {
        src.broadcast_to(dst.shape())?
    };
    if dst.numel() == 0 {
        return Ok(());
    }
    let on_metal = |t: &Tensor| t.device().kind() == DeviceKind::Metal;
    match (on_metal(&src), on_metal(dst)) {
        (true, true) if src.device() == dst.device() => gpu_copy(&src, dst),
        (true, true) => {
            let host = Tensor::empty(src.shape(), src.dtype(), Device::CPU)?;
            // SAFETY: `host` is new memory; the caller's contract covers `dst`.
            unsafe { download(&src, &host)? };
            // SAFETY: forwarded contract.
            unsafe { upload(&host, dst) }
        }
        // SAFETY: forwarded contract.
        (true, false) => unsafe { download(&src, dst) },
        // SAFETY: forwarded contract.
        (false, true) => unsafe { upload(&src, dst) },
        (false, false) => Err(Error::InvalidArgument(format!(
            "a Metal copy from {} to {}: neither is a Metal device",
            src.device(),
            dst.device()
        ))),
    }
}

/// A GPU copy between two views on one Metal device: a blit when both are compact and aligned,
/// else the strided-copy kernel. Batched on the device's queue.
fn gpu_copy(src: &Tensor, dst: &Tensor) -> Result<()> {
    let s = resolve(src.buffer())?;
    let d = resolve(dst.buffer())?;
    if !std::ptr::eq(s.context, d.context) {
        return Err(Error::InvalidArgument(
            "a GPU copy between two Metal devices".into(),
        ));
    }
    if s.buffer.handle() == d.buffer.handle() {
        let (a, b) = (src.byte_range(), dst.byte_range());
        if a.start < b.end && b.start < a.end {
            // Overlapping bytes of one buffer: go through a temporary.
            let staged = Tensor::allocate(src.shape(), src.dtype(), src.device(), None, false)?;
            gpu_copy(src, &staged)?;
            return gpu_copy(&staged, dst);
        }
    }
    let method = plan_copy(
        dst.shape(),
        src.strides(),
        src.byte_offset(),
        dst.strides(),
        dst.byte_offset(),
        dst.dtype().itemsize(),
    )?;
    let sync_dst = d.storage == StorageMode::Managed;
    match method {
        CopyMethod::Nothing => Ok(()),
        CopyMethod::Blit {
            src_offset,
            dst_offset,
            size,
        } => {
            // SAFETY: both views were bounds-checked against their buffers, which are no longer
            // than the Metal buffers (`resolve`); `plan_copy` chose a blit only for 4-byte
            // multiples.
            unsafe {
                s.context
                    .blit_copy(&s.buffer, src_offset, &d.buffer, dst_offset, size, sync_dst)
            }
        }
        CopyMethod::Kernel(plan) => {
            // SAFETY: the plan addresses exactly the elements of the two views, which were
            // bounds-checked against their buffers (no longer than the Metal buffers).
            unsafe {
                s.context
                    .strided_copy(&s.buffer, &d.buffer, &plan, sync_dst)
            }
        }
    }
}

/// Metal view → host view. Complete when it returns. Host-visible Metal memory is read through a
/// CPU alias of its `contents()` ([`host_alias`]), so that the copy is the CPU's strided copy
/// (and does not come back here).
///
/// # Safety
/// As [`copy_unchecked`], for `dst`.
unsafe fn download(src: &Tensor, dst: &Tensor) -> Result<()> {
    let s = resolve(src.buffer())?;
    if src.buffer().host_ptr().is_some() {
        // The GPU may still write the source: wait, then read it in place.
        s.context.synchronize()?;
        // SAFETY: forwarded contract.
        return unsafe { dst.copy_from_unchecked(&host_alias(src)?) };
    }
    let staging = Tensor::allocate(
        src.shape(),
        src.dtype(),
        src.device(),
        Some(StorageMode::Shared),
        false,
    )?;
    gpu_copy(src, &staging)?;
    s.context.synchronize()?;
    // SAFETY: forwarded contract; `staging` is complete (synchronized) and disjoint from `dst`.
    unsafe { dst.copy_from_unchecked(&host_alias(&staging)?) }
}

/// Host view → Metal view. A host-visible destination is written in place (after the GPU work
/// that may use it completes); a private one through a shared staging buffer and a GPU copy,
/// ordered on the device's queue.
///
/// # Safety
/// As [`copy_unchecked`], for `dst`.
unsafe fn upload(src: &Tensor, dst: &Tensor) -> Result<()> {
    let d = resolve(dst.buffer())?;
    if dst.buffer().host_ptr().is_some() {
        d.context.synchronize()?;
        // SAFETY: forwarded contract: the alias addresses exactly `dst`'s bytes.
        unsafe { host_alias(dst)?.copy_from_unchecked(src)? };
        if d.storage == StorageMode::Managed {
            super::host_wrote(dst.buffer(), dst.byte_range())?;
        }
        return Ok(());
    }
    let staging = Tensor::allocate(
        dst.shape(),
        dst.dtype(),
        dst.device(),
        Some(StorageMode::Shared),
        false,
    )?;
    // SAFETY: `staging` is new memory no other view references.
    unsafe { host_alias(&staging)?.copy_from_unchecked(src)? };
    gpu_copy(&staging, dst)
}
