//! The CPU's side of the backend seam ([`Backend`]).

use std::sync::Arc;

use crate::backend::{Backend, KindFacts, ShareRoute, Storage, no_stream_here, unreachable_copy};
use crate::buffer::{Buffer, StorageMode};
use crate::compute::kernel::Kernel;
use crate::compute::{MapRequest, MatmulRequest, ReduceOp, ReduceRequest};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::storage;
use crate::tensor::Tensor;

/// The CPU backend.
pub(crate) struct Cpu;

/// The host: memory the CPU addresses, always in shared storage, shared with other processes
/// through anonymous shared files.
const KINDS: &[KindFacts] = &[KindFacts {
    kind: DeviceKind::Cpu,
    addressable: true,
    host_accessible: true,
    storage: Storage::Always(StorageMode::Shared),
    foreign_storage: StorageMode::Shared,
    sharing: ShareRoute::HostFile { registered: false },
    streams: false,
    faults_on_misaligned: false,
    reads_into: true,
}];

impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "CPU"
    }

    fn kinds(&self) -> &'static [KindFacts] {
        KINDS
    }

    fn device_count(&self) -> Result<usize> {
        Ok(1)
    }

    fn compile_kernel(&self, device: Device, _: &str, _: &str, _: &[String]) -> Result<Kernel> {
        Err(Error::UnsupportedDevice(format!(
            "run-time kernels compile for CUDA (NVRTC) and Metal (MSL), not {device}"
        )))
    }

    #[inline]
    fn allocate(
        &self,
        _device: Device,
        bytes: usize,
        storage: Option<StorageMode>,
        zeroed: bool,
    ) -> Result<Buffer> {
        // Resolving reads `DLBRIDGE_STORAGE_MODE` on first use (and warns once if it is invalid);
        // host memory is shared memory whatever the answer (see `StorageMode`).
        storage::resolve(&KINDS[0], storage)?;
        super::allocate(bytes, zeroed)
    }

    fn pool(&self, _device: Device, storage: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
        // One pool, whatever the mode; a mode asked for must still be one the CPU has.
        if storage.is_some() {
            storage::resolve(&KINDS[0], storage)?;
        }
        Ok(super::pool())
    }

    fn synchronize(&self, _device: Device) -> Result<()> {
        Ok(())
    }

    unsafe fn copy(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        if !dst.device().is_cpu() || !src.device().is_cpu() {
            return Err(unreachable_copy(dst, src));
        }
        // SAFETY: forwarded contract.
        unsafe { super::copy_host(dst, src) }
    }

    fn export_handoff(&self, device: Device, stream: Option<i64>) -> Result<()> {
        no_stream_here(device, stream)
    }

    fn map(&self, req: &MapRequest<'_>) -> Result<()> {
        super::compute::map(req)
    }

    fn reduce(&self, req: &ReduceRequest<'_>) -> Result<()> {
        super::compute::reduce(req)
    }

    fn reduces(&self, _: ReduceOp) -> bool {
        true
    }

    fn matmul(&self, req: &MatmulRequest<'_>) -> Result<()> {
        super::compute::matmul(req)
    }
}
