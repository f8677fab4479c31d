//! Metal's side of the backend seam ([`Backend`]). Where the backend is not available (not an
//! Apple platform, or no device), a `kDLMetal` tensor is held opaquely: it is handed on as it came,
//! and anything that would touch its memory is refused.

use std::sync::Arc;

use crate::backend::{Backend, no_stream_here, unreachable_copy};
use crate::buffer::{Buffer, StorageMode};
use crate::compute::{MapRequest, MatmulRequest, ReduceRequest};
use crate::device::{Device, DeviceKind};
use crate::error::Result;
use crate::pool::Pool;
use crate::storage::Resolved;
use crate::tensor::Tensor;

/// The Metal backend.
pub(crate) struct Metal;

impl Backend for Metal {
    fn allocate(
        &self,
        device: Device,
        bytes: usize,
        storage: Option<StorageMode>,
        zeroed: bool,
    ) -> Result<Buffer> {
        super::allocate(device, bytes, storage, zeroed)
    }

    fn pool(&self, device: Device, storage: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
        // One pool per (device index, storage mode); the device names no mode.
        super::pool(device, storage)
    }

    fn resolve_storage(&self, device: Device, requested: Option<StorageMode>) -> Result<Resolved> {
        // The default depends on the device (unified memory or not) and on its own variable.
        super::resolve_storage(device, requested)
    }

    fn synchronize(&self, device: Device) -> Result<()> {
        super::synchronize(device)
    }

    fn host_barrier(&self, device: Device) -> Result<()> {
        super::synchronize(device)
    }

    unsafe fn copy(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let reachable = |k: DeviceKind| matches!(k, DeviceKind::Metal | DeviceKind::Cpu);
        if !super::is_available()
            || !reachable(dst.device().kind())
            || !reachable(src.device().kind())
        {
            return Err(unreachable_copy(dst, src));
        }
        // SAFETY: forwarded contract.
        unsafe { super::copy_unchecked(src, dst) }
    }

    fn export_handoff(&self, device: Device, stream: Option<i64>) -> Result<()> {
        no_stream_here(device, stream)?;
        if !super::is_available() {
            return Ok(());
        }
        // DLPack has no stream for Metal: our pending GPU work completes before the consumer
        // sees the buffer.
        super::synchronize(device)
    }

    fn resolve_import(&self, tensor: Tensor, copy: Option<bool>) -> Result<Tensor> {
        if !super::is_available() {
            return Ok(tensor);
        }
        let options = super::ImportOptions {
            copy,
            ..super::ImportOptions::default()
        };
        super::import_foreign(tensor, options)
    }

    fn host_view(&self, tensor: &Tensor) -> Result<Option<Tensor>> {
        if !super::is_available() {
            return Ok(None);
        }
        super::host_view(tensor).map(Some)
    }

    fn map(&self, req: &MapRequest<'_>) -> Result<()> {
        super::compute::map(req)
    }

    fn reduce(&self, req: &ReduceRequest<'_>) -> Result<()> {
        super::compute::reduce(req)
    }

    fn matmul(&self, req: &MatmulRequest<'_>) -> Result<()> {
        super::compute::matmul(req)
    }
}
