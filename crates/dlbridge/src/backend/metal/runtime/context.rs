//! One device's runtime state: its command queue and batched command buffers, its residency set,
//! and its compiled kernels.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use block2::RcBlock;
use objc2::rc::Retained;
use objc2::runtime::{AnyClass, ProtocolObject};
use objc2::sel;
use objc2_foundation::{NSObjectProtocol, NSRange, NSString};
use objc2_metal::{
    MTLBlitCommandEncoder, MTLBuffer, MTLCommandBuffer, MTLCommandBufferStatus, MTLCommandEncoder,
    MTLCommandQueue, MTLComputeCommandEncoder, MTLComputePipelineState, MTLDevice, MTLLibrary,
    MTLResidencySet, MTLResidencySetDescriptor, MTLSize,
};

use super::objc::{CommandBuffer, MetalBuffer, ResidencySet, driver, ns_error};
use crate::backend::metal::batch::{Batch, Completions};
use crate::backend::metal::fence::Progress;
use crate::backend::metal::kernel::{
    MAX_THREADS_PER_DISPATCH, MSL_SOURCE, STRIDED_COPY, StridedCopyParams, StridedCopyPlan,
};
use crate::backend::metal::residency::{Change, Staging, flush_due};
use crate::backend::metal::{DeviceInfo, ResidencyStatus};
use crate::error::{Error, Result};

/// Operations per command buffer before it is committed without waiting for a synchronize.
pub const MAX_OPS_PER_COMMAND_BUFFER: usize = 32;

/// Threads per threadgroup of the copy kernel (capped by what the pipeline allows).
const THREADS_PER_GROUP: usize = 256;

type Pipeline = Retained<ProtocolObject<dyn MTLComputePipelineState>>;

/// Objective-C objects collected under the queue lock and released after it: releasing a buffer
/// or a completed command buffer may free a no-copy buffer, whose deallocator runs arbitrary code
/// (dropping its memory's owner), which must never run with the lock held.
#[derive(Default)]
struct Deferred {
    buffers: Vec<MetalBuffer>,
    command_buffers: Vec<CommandBuffer>,
}

/// A change to the residency set, queued by allocations and releases (which may happen on any
/// thread, even inside a Metal deallocator) and applied under the queue lock.
enum Event {
    Add(u64, MetalBuffer),
    Release(u64, u64),
}

struct Residency {
    set: ResidencySet,
    inbox: Mutex<Inbox>,
}

#[derive(Default)]
struct Inbox {
    events: Vec<Event>,
    /// Bytes released since the last flush.
    released_bytes: usize,
}

/// Command buffers of the device's queue, under one lock.
struct Stream {
    open: Option<CommandBuffer>,
    batch: Batch,
    in_flight: VecDeque<(u64, CommandBuffer)>,
    completions: Completions,
    staging: Staging<MetalBuffer>,
}

/// The state of one Metal device: its queue, batching, residency set and kernels. One per device,
/// created on first use and kept for the life of the process.
pub struct Context {
    device: Retained<ProtocolObject<dyn MTLDevice>>,
    queue: Retained<ProtocolObject<dyn MTLCommandQueue>>,
    info: DeviceInfo,
    stream: Mutex<Stream>,
    /// Mirror of `Batch::last_encoded`, readable without the queue lock (by releases).
    last_encoded: AtomicU64,
    /// Completed serials, fed by completion handlers: what the caching pool's fences read.
    progress: Arc<Progress>,
    residency: Option<Residency>,
    next_id: AtomicU64,
    library: OnceLock<std::result::Result<Retained<ProtocolObject<dyn MTLLibrary>>, String>>,
    pipelines: Mutex<HashMap<(&'static str, usize), Pipeline>>,
}

/// A residency-set registration; dropping it stages the removal.
pub(crate) struct ResidencyGuard {
    context: &'static Context,
    id: u64,
    bytes: usize,
}

impl Drop for ResidencyGuard {
    fn drop(&mut self) {
        self.context.release(self.id, self.bytes);
    }
}

/// Locks a mutex, recovering the data if another thread panicked while holding it (the state
/// stays consistent: every critical section leaves it valid between statements that can panic).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Context {
    /// Creates the queue (and, when enabled and available, the residency set) of `device`.
    pub(crate) fn new(
        device: Retained<ProtocolObject<dyn MTLDevice>>,
        mut info: DeviceInfo,
        residency_wanted: bool,
    ) -> Result<Context> {
        let queue = device
            .newCommandQueue()
            .ok_or_else(|| driver(format!("{} could not create a command queue", info.name)))?;
        queue.setLabel(Some(&NSString::from_str("dlbridge")));
        let (residency, status) = if residency_wanted {
            match create_residency_set(&device, &queue) {
                Ok(Some(set)) => (
                    Some(Residency {
                        set,
                        inbox: Mutex::new(Inbox::default()),
                    }),
                    ResidencyStatus::Enabled,
                ),
                Ok(None) => (None, ResidencyStatus::Unsupported),
                Err(e) => (None, ResidencyStatus::Failed(e.to_string())),
            }
        } else {
            (None, ResidencyStatus::DisabledByEnvironment)
        };
        info.residency = status;
        Ok(Context {
            device,
            queue,
            info,
            stream: Mutex::new(Stream {
                open: None,
                batch: Batch::new(MAX_OPS_PER_COMMAND_BUFFER),
                in_flight: VecDeque::new(),
                completions: Completions::new(),
                staging: Staging::new(),
            }),
            last_encoded: AtomicU64::new(0),
            progress: Arc::new(Progress::new()),
            residency,
            next_id: AtomicU64::new(1),
            library: OnceLock::new(),
            pipelines: Mutex::new(HashMap::new()),
        })
    }

    /// The `MTLDevice`.
    pub fn device(&self) -> &ProtocolObject<dyn MTLDevice> {
        &self.device
    }

    /// The device's one command queue, on which dlbridge encodes all its work.
    pub fn queue(&self) -> &ProtocolObject<dyn MTLCommandQueue> {
        &self.queue
    }

    /// What dlbridge knows about the device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The serial of the last command buffer that may hold work encoded so far (the open one
    /// when it has operations); read without the queue lock.
    pub(crate) fn last_encoded(&self) -> u64 {
        self.last_encoded.load(Ordering::SeqCst)
    }

    /// The queue's completed serials, as completion handlers report them.
    pub(crate) fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }

    // ------------------------------------------------------------------------------ residency

    /// Registers a buffer in the residency set (staged until the next commit); `None` when
    /// residency sets are off.
    pub(crate) fn register(&'static self, buffer: &MetalBuffer) -> Option<ResidencyGuard> {
        let residency = self.residency.as_ref()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&residency.inbox)
            .events
            .push(Event::Add(id, buffer.clone()));
        Some(ResidencyGuard {
            context: self,
            id,
            bytes: buffer.length(),
        })
    }

    /// Stages the removal of registration `id` (of `bytes`) after the last command buffer
    /// encoded so far.
    fn release(&self, id: u64, bytes: usize) {
        let Some(residency) = self.residency.as_ref() else {
            return;
        };
        let after = self.last_encoded.load(Ordering::SeqCst);
        let due = {
            let mut inbox = lock(&residency.inbox);
            inbox.events.push(Event::Release(id, after));
            inbox.released_bytes = inbox.released_bytes.saturating_add(bytes);
            flush_due(inbox.events.len(), inbox.released_bytes)
        };
        if due {
            // Never wait for the queue lock here: this may run inside a Metal deallocator called
            // while the lock is held. If the lock is busy, its holder flushes soon anyway.
            if let Ok(mut stream) = self.stream.try_lock() {
                let mut deferred = Deferred::default();
                self.poll(&mut stream, &mut deferred);
                self.flush_residency(&mut stream, &mut deferred);
                drop(stream);
                drop(deferred);
            }
        }
    }

    /// Applies queued residency events and commits the set once if it changed. Buffers that left
    /// the set go to `deferred`.
    fn flush_residency(&self, stream: &mut Stream, deferred: &mut Deferred) {
        let Some(residency) = self.residency.as_ref() else {
            return;
        };
        let events = std::mem::take(&mut *lock(&residency.inbox)).events;
        for event in events {
            match event {
                Event::Add(id, buffer) => {
                    stream.staging.add(id, buffer);
                }
                Event::Release(id, after) => {
                    deferred.buffers.extend(stream.staging.release(id, after));
                }
            }
        }
        let watermark = stream.completions.watermark();
        let flushed = stream
            .staging
            .flush(watermark, |change, buffer| match change {
                Change::Add => residency.set.addAllocation(buffer.as_allocation()),
                Change::Remove => residency.set.removeAllocation(buffer.as_allocation()),
            });
        if flushed.changed {
            residency.set.commit();
        }
        deferred.buffers.extend(flushed.released);
    }

    /// How many allocations the committed residency set holds, after flushing staged changes.
    pub(crate) fn residency_allocation_count(&self) -> Option<usize> {
        let residency = self.residency.as_ref()?;
        let mut deferred = Deferred::default();
        let mut stream = lock(&self.stream);
        self.poll(&mut stream, &mut deferred);
        self.flush_residency(&mut stream, &mut deferred);
        let count = residency.set.allocationCount();
        drop(stream);
        drop(deferred);
        Some(count)
    }

    // ------------------------------------------------------------------------ command buffers

    /// Marks committed command buffers that have finished as complete, recording GPU errors;
    /// they go to `deferred`.
    fn poll(&self, stream: &mut Stream, deferred: &mut Deferred) {
        while let Some((serial, cb)) = stream.in_flight.front() {
            let status = cb.status();
            if status != MTLCommandBufferStatus::Completed
                && status != MTLCommandBufferStatus::Error
            {
                break;
            }
            let error = (status == MTLCommandBufferStatus::Error).then(|| {
                cb.error()
                    .map(|e| e.localizedDescription().to_string())
                    .unwrap_or_else(|| "the command buffer failed".into())
            });
            stream.completions.complete(*serial, error);
            self.progress.complete(*serial);
            deferred
                .command_buffers
                .extend(stream.in_flight.pop_front().map(|(_, cb)| cb));
        }
    }

    /// Commits the open command buffer, after flushing the residency set so that the buffer runs
    /// against the committed set.
    fn commit(&self, stream: &mut Stream, deferred: &mut Deferred) {
        self.poll(stream, deferred);
        self.flush_residency(stream, deferred);
        if let Some(serial) = stream.batch.commit() {
            let cb = stream
                .open
                .take()
                .expect("a batch with operations has a command buffer");
            let progress = Arc::clone(&self.progress);
            let handler = RcBlock::new(move |_: NonNull<ProtocolObject<dyn MTLCommandBuffer>>| {
                progress.complete(serial);
            });
            // SAFETY: `handler` is a live block of the signature Metal calls; Metal copies it
            // (`Block_copy`) before this returns, so dropping ours afterwards is fine. It captures
            // only an `Arc<Progress>` (`Send + Sync`), as Metal may call it on any thread.
            unsafe { cb.addCompletedHandler(RcBlock::as_ptr(&handler)) };
            cb.commit();
            stream.in_flight.push_back((serial, cb));
        }
        self.last_encoded
            .store(stream.batch.last_encoded(), Ordering::SeqCst);
    }

    /// Encodes one operation into the open command buffer (creating it if needed), and commits
    /// the buffer when the batch is full.
    pub(crate) fn encode(
        &self,
        f: impl FnOnce(&ProtocolObject<dyn MTLCommandBuffer>) -> Result<()>,
    ) -> Result<()> {
        let mut deferred = Deferred::default();
        let mut stream = lock(&self.stream);
        if stream.open.is_none() {
            let cb = self
                .queue
                .commandBuffer()
                .ok_or_else(|| driver("the queue returned no command buffer"))?;
            stream.open = Some(CommandBuffer(cb));
        }
        // Record the operation even if encoding failed part-way: whatever was encoded must be
        // committed with the batch.
        let result = f(stream.open.as_ref().expect("opened above"));
        let recorded = stream.batch.record();
        self.last_encoded
            .store(stream.batch.last_encoded(), Ordering::SeqCst);
        if recorded.commit_now {
            self.commit(&mut stream, &mut deferred);
        }
        drop(stream);
        drop(deferred);
        result
    }

    /// Commits pending work and waits until every committed command buffer has completed; then
    /// applies residency removals that were waiting for it, and reports GPU errors.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let mut deferred = Deferred::default();
        let waits: Vec<CommandBuffer> = {
            let mut stream = lock(&self.stream);
            self.commit(&mut stream, &mut deferred);
            stream.in_flight.iter().map(|(_, cb)| cb.clone()).collect()
        };
        drop(deferred);
        for cb in &waits {
            cb.waitUntilCompleted();
        }
        let mut deferred = Deferred::default();
        let errors = {
            let mut stream = lock(&self.stream);
            self.poll(&mut stream, &mut deferred);
            self.flush_residency(&mut stream, &mut deferred);
            stream.completions.take_errors()
        };
        drop(deferred);
        drop(waits);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(driver(format!("GPU work failed: {}", errors.join("; "))))
        }
    }

    // ---------------------------------------------------------------------------- operations

    /// Fills bytes `range` of `buffer` with `value` on the GPU.
    pub(crate) fn fill(
        &self,
        buffer: &ProtocolObject<dyn MTLBuffer>,
        range: Range<usize>,
        value: u8,
    ) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        self.encode(|cb| {
            let blit = cb
                .blitCommandEncoder()
                .ok_or_else(|| driver("no blit encoder"))?;
            blit.fillBuffer_range_value(buffer, NSRange::new(range.start, range.len()), value);
            blit.endEncoding();
            Ok(())
        })
    }

    /// Copies `size` bytes between buffers with a blit; `sync_dst` adds `synchronizeResource:` for a
    /// managed destination (so the host sees the GPU's writes once the work completes).
    ///
    /// # Safety
    /// Both byte ranges must lie inside their buffers, and offsets and size must be multiples of 4
    /// (the macOS blit rule).
    pub(crate) unsafe fn blit_copy(
        &self,
        src: &ProtocolObject<dyn MTLBuffer>,
        src_offset: usize,
        dst: &ProtocolObject<dyn MTLBuffer>,
        dst_offset: usize,
        size: usize,
        sync_dst: bool,
    ) -> Result<()> {
        self.encode(|cb| {
            let blit = cb
                .blitCommandEncoder()
                .ok_or_else(|| driver("no blit encoder"))?;
            // SAFETY: in bounds and aligned by the caller's contract; the command buffer retains
            // both buffers until it completes.
            unsafe {
                blit.copyFromBuffer_sourceOffset_toBuffer_destinationOffset_size(
                    src, src_offset, dst, dst_offset, size,
                )
            };
            if sync_dst {
                blit.synchronizeResource(ProtocolObject::from_ref(dst));
            }
            blit.endEncoding();
            Ok(())
        })
    }

    /// Runs the strided-copy kernel for `plan` from `src` to `dst` (both bound at offset 0: the
    /// plan's offsets are from the buffers' starts).
    ///
    /// # Safety
    /// Every unit the plan addresses must lie inside its buffer (the views were bounds-checked
    /// against buffers at least as long as the Metal buffers say).
    pub(crate) unsafe fn strided_copy(
        &self,
        src: &ProtocolObject<dyn MTLBuffer>,
        dst: &ProtocolObject<dyn MTLBuffer>,
        plan: &StridedCopyPlan,
        sync_dst: bool,
    ) -> Result<()> {
        let dispatches = plan.dispatches(MAX_THREADS_PER_DISPATCH);
        if dispatches.is_empty() {
            return Ok(());
        }
        let pipeline = self.pipeline(STRIDED_COPY, plan.unit)?;
        let group = pipeline
            .maxTotalThreadsPerThreadgroup()
            .clamp(1, THREADS_PER_GROUP);
        self.encode(|cb| {
            let encoder = cb
                .computeCommandEncoder()
                .ok_or_else(|| driver("no compute encoder"))?;
            encoder.setComputePipelineState(&pipeline);
            // SAFETY: indices 0 and 1 are the kernel's `src` and `dst` arguments; the command
            // buffer retains both buffers.
            unsafe { encoder.setBuffer_offset_atIndex(Some(src), 0, 0) };
            // SAFETY: as above.
            unsafe { encoder.setBuffer_offset_atIndex(Some(dst), 0, 1) };
            for params in &dispatches {
                let bytes = NonNull::from(params).cast::<c_void>();
                // SAFETY: `params` is a live `StridedCopyParams`, laid out as the kernel's
                // argument 2; Metal copies the bytes at encoding time.
                unsafe {
                    encoder.setBytes_length_atIndex(
                        bytes,
                        std::mem::size_of::<StridedCopyParams>(),
                        2,
                    )
                };
                let groups = (params.count as usize).div_ceil(group);
                encoder.dispatchThreadgroups_threadsPerThreadgroup(
                    MTLSize {
                        width: groups,
                        height: 1,
                        depth: 1,
                    },
                    MTLSize {
                        width: group,
                        height: 1,
                        depth: 1,
                    },
                );
            }
            encoder.endEncoding();
            if sync_dst {
                let blit = cb
                    .blitCommandEncoder()
                    .ok_or_else(|| driver("no blit encoder"))?;
                blit.synchronizeResource(ProtocolObject::from_ref(dst));
                blit.endEncoding();
            }
            Ok(())
        })
    }

    /// The compute pipeline of kernel family `family` for `unit`-byte units, compiled once.
    fn pipeline(&self, family: &'static str, unit: usize) -> Result<Pipeline> {
        let key = (family, unit);
        if let Some(p) = lock(&self.pipelines).get(&key) {
            return Ok(p.clone());
        }
        let library = self
            .library
            .get_or_init(|| {
                self.device
                    .newLibraryWithSource_options_error(&NSString::from_str(MSL_SOURCE), None)
                    .map_err(|e| e.localizedDescription().to_string())
            })
            .as_ref()
            .map_err(|e| driver(format!("compiling dlbridge's Metal kernels: {e}")))?;
        let name = crate::backend::metal::kernel::function_name(unit)?;
        let function = library
            .newFunctionWithName(&NSString::from_str(name))
            .ok_or_else(|| driver(format!("the kernel library has no function {name}")))?;
        let pipeline = self
            .device
            .newComputePipelineStateWithFunction_error(&function)
            .map_err(|e| ns_error(&format!("building the {name} pipeline"), &e))?;
        lock(&self.pipelines).insert(key, pipeline.clone());
        Ok(pipeline)
    }
}

/// Creates a residency set attached to `queue`, or `None` where the OS has none (before macOS 15 /
/// iOS 18: checked at run time by selector and class, since the binary may run on older systems).
fn create_residency_set(
    device: &ProtocolObject<dyn MTLDevice>,
    queue: &ProtocolObject<dyn MTLCommandQueue>,
) -> Result<Option<ResidencySet>, Error> {
    let available = device.respondsToSelector(sel!(newResidencySetWithDescriptor:error:))
        && queue.respondsToSelector(sel!(addResidencySet:))
        && AnyClass::get(c"MTLResidencySetDescriptor").is_some();
    if !available {
        return Ok(None);
    }
    let descriptor = MTLResidencySetDescriptor::new();
    descriptor.setLabel(Some(&NSString::from_str("dlbridge")));
    let set = device
        .newResidencySetWithDescriptor_error(&descriptor)
        .map_err(|e| ns_error("creating a residency set", &e))?;
    queue.addResidencySet(&set);
    Ok(Some(ResidencySet(set)))
}
