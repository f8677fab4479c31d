//! Metal's side of the backend seam ([`Backend`]). Where the backend is not available (not an
//! Apple platform, or no device), a `kDLMetal` tensor is held opaquely: it is handed on as it came,
//! and anything that would touch its memory is refused.

use std::ops::Range;
use std::sync::Arc;

use crate::backend::{
    Backend, FileRead, KindFacts, ReadOptions, ShareRoute, Storage, no_stream_here, read_to_host,
    unreachable_copy,
};
use crate::buffer::{Buffer, StorageMode};
use crate::compute::kernel::{Kernel, KernelArg, LaunchConfig, LaunchTiming};
use crate::compute::{MapRequest, MatmulRequest, ReduceRequest};
use crate::device::{Device, DeviceKind};
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::Layout;
use crate::pool::Pool;
use crate::storage::Resolved;
use crate::tensor::Tensor;

/// The Metal backend.
pub(crate) struct Metal;

/// Metal memory: an opaque `id<MTLBuffer>` in DLPack, its storage mode a property of each buffer
/// (shared by default; the backend refines the default per device at run time).
const KINDS: &[KindFacts] = &[KindFacts {
    kind: DeviceKind::Metal,
    addressable: false,
    host_accessible: false,
    storage: Storage::PerBuffer {
        default: StorageMode::Shared,
    },
    foreign_storage: StorageMode::Private,
    sharing: ShareRoute::None,
    streams: false,
    faults_on_misaligned: false,
    reads_into: false,
}];

impl Backend for Metal {
    fn name(&self) -> &'static str {
        "Metal"
    }

    fn kinds(&self) -> &'static [KindFacts] {
        KINDS
    }

    fn device_count(&self) -> Result<usize> {
        match super::device_count() {
            // Why there is none (not compiled in, no Apple GPU) says more than a count.
            0 => super::devices().map(|d| d.len()),
            n => Ok(n),
        }
    }

    fn compile_kernel(
        &self,
        device: Device,
        source: &str,
        name: &str,
        options: &[String],
    ) -> Result<Kernel> {
        super::compute::compile(device, source, name, options)
    }

    fn launch_kernel(
        &self,
        kernel: &Kernel,
        config: LaunchConfig,
        args: &[KernelArg],
    ) -> Result<LaunchTiming> {
        super::compute::launch(kernel, config, args)
    }

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

    fn read_file(
        &self,
        device: Device,
        reads: &[FileRead<'_>],
        options: &ReadOptions<'_>,
    ) -> Result<()> {
        // The host reads into shared and managed buffers in place (and tells Metal of its writes
        // into managed ones); a private buffer, which the host cannot address, gets its ranges
        // through a shared staging buffer and a blit, a piece at a time.
        let private = |r: &&FileRead<'_>| r.dst.storage_mode() == StorageMode::Private;
        let visible: Vec<FileRead<'_>> = reads.iter().filter(|r| !private(r)).copied().collect();
        read_to_host(&visible, options)?;
        for r in &visible {
            super::host_wrote(r.dst, r.dst_offset..r.dst_offset + r.len)?;
        }
        let piece = options.chunk.max(1).saturating_mul(options.threads.max(1));
        for r in reads.iter().filter(private) {
            for start in (0..r.len).step_by(piece) {
                let len = piece.min(r.len - start);
                let staging = super::allocate(device, len, Some(StorageMode::Shared), false)?;
                let staged = FileRead {
                    offset: r.offset + start as u64,
                    len,
                    dst: &staging,
                    dst_offset: 0,
                    ..*r
                };
                read_to_host(&[staged], options)?;
                let src = Tensor::new(staging, DType::U8, Layout::contiguous(&[len])?)?;
                let dst = Tensor::new(
                    r.dst.clone(),
                    DType::U8,
                    Layout::contiguous_at(&[len], r.dst_offset + start)?,
                )?;
                // SAFETY: the loader's destination, private memory the host cannot reference;
                // nothing else uses it until the load returns.
                unsafe { super::copy_unchecked(&src, &dst)? };
            }
        }
        Ok(())
    }

    fn wrap_host(
        &self,
        device: Device,
        host: &Buffer,
        items: &[Range<usize>],
    ) -> Option<Result<Vec<(Buffer, usize)>>> {
        if !super::is_available() {
            return None;
        }
        // `newBufferWithBytesNoCopy:`: the GPU reads the host's pages in place.
        Some(super::wrap_buffer(device, host, items))
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
