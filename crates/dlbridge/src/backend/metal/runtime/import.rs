//! Executes [`plan_import`] for a foreign `kDLMetal` tensor.

use objc2_metal::MTLBuffer;

use super::buffer::{registry_id_of, storage_of};
use super::context::ResidencyGuard;
use super::objc::MetalBuffer;
use super::{check_metal, context_by_registry_id};
use crate::backend::metal::import::{ImportPlan, plan_import};
use crate::backend::metal::{ImportOptions, copy_to, storage};
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// What a shared foreign buffer keeps alive: the retained `id<MTLBuffer>`, its residency
/// registration (when asked for), and the producer (through the imported buffer).
struct SharedForeign {
    _buffer: MetalBuffer,
    _residency: Option<ResidencyGuard>,
    _producer: Buffer,
}

/// See [`crate::backend::metal::import_foreign`].
pub(crate) fn import_foreign(tensor: Tensor, options: ImportOptions) -> Result<Tensor> {
    check_metal(tensor.device(), "import_foreign")?;
    if tensor.buffer().handle().is_null() {
        // A zero-size tensor without a buffer: nothing to share or copy.
        let plan = plan_import(
            StorageMode::Shared,
            options.copy,
            tensor.dtype(),
            options.dtype,
        )?;
        return match plan {
            ImportPlan::Share => Ok(tensor),
            _ => Tensor::allocate(
                tensor.shape(),
                options.dtype.unwrap_or(tensor.dtype()),
                tensor.device(),
                Some(StorageMode::Shared),
                false,
            ),
        };
    }
    // SAFETY: DLPack's `data` for kDLMetal is an `id<MTLBuffer>` that the producer keeps alive
    // while the imported tensor (which owns the producer) lives.
    let mtl = unsafe { MetalBuffer::retain_handle(tensor.buffer().handle()) }?;
    let context = context_by_registry_id(registry_id_of(&mtl))?;
    let device = context.info().device;
    if device != tensor.device() {
        return Err(Error::MalformedTensor(format!(
            "the DLPack device is {} but its id<MTLBuffer> belongs to {device}",
            tensor.device()
        )));
    }
    let length = mtl.length();
    let range = tensor.byte_range();
    if range.end > length {
        return Err(Error::OutOfBounds(format!(
            "the view addresses bytes {}..{} but the id<MTLBuffer> holds {length}",
            range.start, range.end
        )));
    }
    let storage_mode = storage_of(&mtl)?;
    let plan = plan_import(storage_mode, options.copy, tensor.dtype(), options.dtype)?;
    let register = options.residency && plan == ImportPlan::Share;
    let guard = if register {
        context.register(&mtl)
    } else {
        None
    };
    let host = if storage::is_host_visible(storage_mode) {
        mtl.contents().as_ptr().cast::<u8>()
    } else {
        std::ptr::null_mut()
    };
    let handle = mtl.handle();
    let keep = SharedForeign {
        _buffer: mtl,
        _residency: guard,
        _producer: tensor.buffer().clone(),
    };
    // SAFETY: `handle` is the producer's `id<MTLBuffer>`, `length` bytes long (Metal's own figure),
    // retained by `keep`, which also keeps the producer alive; `host` is its `contents()`, set
    // only for shared and managed storage, which the host may address.
    let buffer = unsafe {
        Buffer::from_foreign(
            handle,
            host,
            length,
            device,
            storage_mode,
            tensor.buffer().is_read_only(),
            Box::new(keep),
        )
    };
    let mut shared = Tensor::with_packing(
        buffer,
        tensor.dtype(),
        tensor.layout().clone(),
        tensor.is_packed(),
    )?;
    if tensor.is_read_only() {
        shared = shared.into_read_only();
    }
    drop(tensor);
    match plan {
        ImportPlan::Share => Ok(shared),
        ImportPlan::Copy => {
            let out = copy_to(&shared, device, Some(StorageMode::Shared))?;
            // Complete before returning: once the import returns, the producer may reuse its memory.
            context.synchronize()?;
            Ok(out)
        }
        ImportPlan::Convert { .. } => {
            // The host converts; `copy_to` a CPU device stages private memory on the GPU first
            // and waits for it.
            let target = options.dtype.unwrap_or(shared.dtype());
            let host = copy_to(&shared, Device::CPU, None)?;
            let converted = host.cast(target)?;
            copy_to(&converted, device, Some(StorageMode::Shared))
        }
    }
}
