//! CUDA's side of the backend seam ([`Backend`]).

use std::sync::Arc;

use crate::backend::{
    Backend, DeviceReader, Event, FileRead, HostReader, KindFacts, Queue, ReadOptions, Sharing,
    placement, read_to_host, unreachable_copy,
};
use crate::buffer::{Buffer, StorageMode};
use crate::compute::kernel::{Kernel, KernelArg, LaunchConfig, LaunchTiming};
use crate::compute::{MapRequest, MatmulRequest, ReduceOp, ReduceRequest};
use crate::device::{Device, DeviceKind};
use crate::error::Result;
use crate::pool::Pool;
use crate::storage;
use crate::tensor::Tensor;

/// The CUDA backend: device (`cuda:N`), pinned (`cuda_host:N`) and managed (`cuda_managed:N`)
/// memory of device `N`.
pub(crate) struct Cuda;

fn ordinal(device: Device) -> i32 {
    device.index() as i32
}

impl Backend for Cuda {
    fn name(&self) -> &'static str {
        "CUDA"
    }

    fn kinds(&self) -> &'static [KindFacts] {
        super::kinds::KINDS
    }

    fn device_count(&self) -> Result<usize> {
        super::device_count()
    }

    fn compile_kernel(
        &self,
        device: Device,
        source: &str,
        name: &str,
        options: &[String],
    ) -> Result<Kernel> {
        super::launch::compile(device, source, name, options)
    }

    fn launch_kernel(
        &self,
        kernel: &Kernel,
        config: LaunchConfig,
        args: &[KernelArg],
    ) -> Result<LaunchTiming> {
        super::launch::launch(kernel, config, args)
    }

    fn sharing(&self) -> Result<&'static dyn Sharing> {
        Ok(&super::ipc::CudaSharing)
    }

    fn allocate(
        &self,
        device: Device,
        bytes: usize,
        storage: Option<StorageMode>,
        zeroed: bool,
    ) -> Result<Buffer> {
        // The storage mode (explicit, else `DLBRIDGE_STORAGE_MODE`, else private) picks the pool
        // and the device kind: private → `cuda:N`, shared → `cuda_host:N`, managed →
        // `cuda_managed:N`. Blocks are keyed by the calling thread's current stream.
        let storage = match (device.kind(), storage) {
            (DeviceKind::Cuda, None) => Some(storage::resolve(&super::kinds::KINDS[0], None)?.mode),
            (_, explicit) => explicit,
        };
        super::allocate(placement(device, storage)?, bytes, zeroed)
    }

    fn pool(&self, device: Device, storage: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
        // One pool per (device index, storage mode), named by the device kind.
        super::pool(placement(device, storage)?)
    }

    fn synchronize(&self, device: Device) -> Result<()> {
        super::synchronize(ordinal(device))
    }

    fn host_barrier(&self, device: Device) -> Result<()> {
        super::host_barrier(device)
    }

    fn validate_foreign(&self, device: Device, addr: usize, len: usize) -> Result<()> {
        // Without a driver nothing can be checked, and nothing here will touch the memory either.
        if super::device_count().is_err() {
            return Ok(());
        }
        super::validate_foreign(device, addr, len)
    }

    unsafe fn copy(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let reachable = |k: DeviceKind| k.is_cuda() || k == DeviceKind::Cpu;
        if !reachable(dst.device().kind()) || !reachable(src.device().kind()) {
            return Err(unreachable_copy(dst, src));
        }
        // SAFETY: forwarded contract.
        unsafe { super::copy(dst, src) }
    }

    fn export_handoff(&self, device: Device, stream: Option<i64>) -> Result<()> {
        super::make_visible(ordinal(device), super::stream_from_dlpack(stream)?)
    }

    fn current_stream(&self, device: Device) -> usize {
        super::current_stream(ordinal(device))
    }

    fn order_after_producer(&self, device: Device, producer: usize) -> Result<()> {
        let ordinal = ordinal(device);
        super::order_streams(ordinal, producer, super::current_stream(ordinal))
    }

    fn queue_after_current(&self, device: Device) -> Result<Option<Queue>> {
        let ordinal = ordinal(device);
        let stream = super::Stream::new(ordinal, true)?;
        super::order_streams(ordinal, super::current_stream(ordinal), stream.handle())?;
        Ok(Some(Queue::new(
            Device::cuda(ordinal as u32),
            Box::new(stream),
        )))
    }

    fn record_event(&self, device: Device) -> Result<Option<Event>> {
        let ordinal = ordinal(device);
        let event = super::Event::new(ordinal, false)?;
        event.record(super::current_stream(ordinal))?;
        Ok(Some(Event::new(
            Device::cuda(ordinal as u32),
            Box::new(event),
        )))
    }

    fn map(&self, req: &MapRequest<'_>) -> Result<()> {
        // Recorded also after a failure part-way: what was enqueued may still run.
        let enqueued = super::compute::map(req);
        enqueued.and(super::record_use(req.tensor_inputs().chain([req.out])))
    }

    fn reduce(&self, req: &ReduceRequest<'_>) -> Result<()> {
        let enqueued = super::compute::reduce(req);
        enqueued.and(super::record_use([req.input, req.out]))
    }

    fn reduces(&self, _: ReduceOp) -> bool {
        true
    }

    fn matmul(&self, req: &MatmulRequest<'_>) -> Result<()> {
        let enqueued = super::compute::matmul(req);
        enqueued.and(super::record_use([req.a, req.b, req.out]))
    }

    fn read_file(
        &self,
        device: Device,
        reads: &[FileRead<'_>],
        options: &ReadOptions<'_>,
    ) -> Result<()> {
        match device.kind() {
            // Device memory: through pinned staging buffers.
            DeviceKind::Cuda => super::upload::read_to_device(ordinal(device), reads, options),
            // Pinned and managed memory: the host reads straight into it.
            _ => read_to_host(reads, options),
        }
    }

    fn read_in(
        &self,
        device: Device,
        reader: &mut Option<Box<dyn DeviceReader>>,
        reads: &[FileRead<'_>],
        options: &ReadOptions<'_>,
    ) -> Result<()> {
        match device.kind() {
            // Device memory: the staging reader, kept across the session's reads.
            DeviceKind::Cuda => super::upload::read_in(ordinal(device), reader, reads, options),
            _ => HostReader::of(reader, options)?.read(reads, options),
        }
    }
}
