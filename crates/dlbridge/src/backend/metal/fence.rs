//! When a released Metal block may be reused: the [`Fence`] of dlbridge's caching pool for Metal,
//! over the command-buffer serials of [`batch`](super::batch). Platform-free; the Metal runtime
//! feeds [`Progress`] from its completion handlers and makes a [`SerialFence`] for every block a
//! user releases.
//!
//! A device has one queue, so every Metal allocation is made for one stream, [`QUEUE_STREAM`].
//! A block released while command buffer `s` (the last that may hold work encoded so far, which
//! may still be open) has not completed carries a fence on serial `s`:
//!
//! | storage | reused by the next request | why |
//! | --- | --- | --- |
//! | private | at once | only the GPU reaches it, and it runs later work on the queue after the old work (Metal tracks hazards of dlbridge's buffers across command buffers of the queue) |
//! | shared, managed | once serial `s` has completed; a request meanwhile gets a new block | the host may write the block as soon as it is handed out (a zero fill is a `memset`), which no queue orders |
//!
//! A block whose work has completed when it is released carries no fence at all. Giving a fenced
//! block back to Metal needs no wait: command buffers retain the buffers they use, so Metal frees
//! the memory only after them, and the residency set drops the buffer only once they completed
//! ([`residency`](super::residency)).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::batch::Completions;
use crate::buffer::StorageMode;
use crate::error::Result;
use crate::pool::{Fence, StreamKey};

/// The stream key of every Metal allocation: the device's one queue.
pub(crate) const QUEUE_STREAM: StreamKey = 1;

/// The completed command buffers of one queue, readable without the queue's lock: fences read
/// the watermark under a pool's lock, and completion handlers report on Metal's threads.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    completions: Mutex<Completions>,
    watermark: AtomicU64,
}

impl Progress {
    /// Nothing completed yet.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Records that command buffer `serial` finished (reports may come out of order, and twice).
    pub(crate) fn complete(&self, serial: u64) {
        let mut done = self.completions.lock().unwrap_or_else(|e| e.into_inner());
        done.complete(serial, None);
        self.watermark.store(done.watermark(), Ordering::Release);
    }

    /// Every serial up to and including this one has completed.
    pub(crate) fn watermark(&self) -> u64 {
        self.watermark.load(Ordering::Acquire)
    }
}

/// The GPU work that may still use a released Metal block: every command buffer up to `serial`.
#[derive(Debug)]
pub(crate) struct SerialFence {
    serial: u64,
    host_visible: bool,
    progress: Arc<Progress>,
}

impl SerialFence {
    /// The fence of a block in `storage` released when `last_encoded` is the serial of the last
    /// command buffer that may hold work encoded so far (`Batch::last_encoded`); `None` when that
    /// work has already completed.
    pub(crate) fn after(
        last_encoded: u64,
        storage: StorageMode,
        progress: &Arc<Progress>,
    ) -> Option<Self> {
        (last_encoded > progress.watermark()).then(|| SerialFence {
            serial: last_encoded,
            host_visible: storage != StorageMode::Private,
            progress: Arc::clone(progress),
        })
    }

    /// The serial the fence waits for.
    #[cfg(test)]
    pub(crate) fn serial(&self) -> u64 {
        self.serial
    }
}

impl Fence for SerialFence {
    fn stream(&self) -> StreamKey {
        QUEUE_STREAM
    }

    fn is_complete(&self) -> bool {
        self.progress.watermark() >= self.serial
    }

    fn order_before(&self, _stream: StreamKey) -> Result<()> {
        // Metal allocations are all made for the device's one queue, so a private block is never
        // asked for on another stream; and Metal orders the work of one device on its tracked
        // buffers anyway. Host-visible blocks never get here (`stream_ordered` is false).
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        // Nothing to wait for before Metal gets the buffer back: command buffers retain what they
        // use, and residency removal is staged after them (see the module documentation).
        Ok(())
    }

    fn stream_ordered(&self) -> bool {
        !self.host_visible
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::c_void;
    use std::ptr::NonNull;

    use super::*;
    use crate::backend::cpu::HostAllocator;
    use crate::backend::metal::batch::Batch;
    use crate::device::Device;
    use crate::pool::{Pool, RawAllocator};

    #[test]
    fn progress_is_a_watermark() {
        let p = Progress::new();
        p.complete(2);
        assert_eq!(p.watermark(), 0, "serial 1 is still running");
        p.complete(1);
        p.complete(1);
        assert_eq!(p.watermark(), 2);
    }

    #[test]
    fn fences_only_while_work_may_run() {
        let p = Arc::new(Progress::new());
        assert!(
            SerialFence::after(0, StorageMode::Shared, &p).is_none(),
            "no work yet"
        );
        let f = SerialFence::after(3, StorageMode::Private, &p).unwrap();
        assert_eq!(f.serial(), 3);
        assert!(!f.is_complete() && f.stream_ordered());
        assert_eq!(f.stream(), QUEUE_STREAM);
        let g = SerialFence::after(3, StorageMode::Managed, &p).unwrap();
        assert!(!g.stream_ordered(), "the host may touch managed memory");
        for s in 1..=3 {
            p.complete(s);
        }
        assert!(f.is_complete() && g.is_complete());
        assert!(SerialFence::after(3, StorageMode::Shared, &p).is_none());
    }

    /// Host memory standing in for Metal buffers; fences come from a modelled queue.
    struct Queue {
        batch: Mutex<Batch>,
        progress: Arc<Progress>,
        storage: StorageMode,
    }

    struct Blocks(Arc<Queue>);

    impl RawAllocator for Blocks {
        fn allocate(&self, bytes: usize, zeroed: bool) -> Result<NonNull<c_void>> {
            HostAllocator.allocate(bytes, zeroed)
        }

        unsafe fn free(&self, ptr: NonNull<c_void>, bytes: usize) {
            // SAFETY: forwarded: the pool frees what `allocate` gave, once, with its size.
            unsafe { HostAllocator.free(ptr, bytes) }
        }

        unsafe fn zero(
            &self,
            ptr: NonNull<c_void>,
            bytes: usize,
            stream: Option<StreamKey>,
        ) -> Result<()> {
            // SAFETY: forwarded contract.
            unsafe { HostAllocator.zero(ptr, bytes, stream) }
        }

        fn fence(&self, _stream: StreamKey) -> Result<Option<Box<dyn Fence>>> {
            let last = self.0.batch.lock().unwrap().last_encoded();
            Ok(SerialFence::after(last, self.0.storage, &self.0.progress)
                .map(|f| Box::new(f) as Box<dyn Fence>))
        }
    }

    fn pool(storage: StorageMode) -> (Arc<Pool>, Arc<Queue>) {
        let queue = Arc::new(Queue {
            batch: Mutex::new(Batch::new(4)),
            progress: Arc::new(Progress::new()),
            storage,
        });
        let pool = Pool::new(Device::metal(0), storage, Blocks(Arc::clone(&queue)));
        (pool, queue)
    }

    fn addr(b: &crate::pool::PooledBlock) -> usize {
        b.as_ptr().as_ptr() as usize
    }

    #[test]
    fn shared_blocks_wait_for_the_gpu_before_reuse() {
        let (pool, queue) = pool(StorageMode::Shared);
        let block = pool.allocate(4096, Some(QUEUE_STREAM), false).unwrap();
        let first = addr(&block);
        // A GPU copy that reads the block is encoded, not yet committed; the user lets go.
        queue.batch.lock().unwrap().record();
        drop(block);
        let other = pool.allocate(4096, Some(QUEUE_STREAM), true).unwrap();
        assert_ne!(addr(&other), first, "its work may still run: a new block");
        // The batch is committed and completes: the block is reused, without a driver call.
        let serial = queue.batch.lock().unwrap().commit().unwrap();
        queue.progress.complete(serial);
        let before = pool.stats();
        let again = pool.allocate(4096, Some(QUEUE_STREAM), true).unwrap();
        assert_eq!(addr(&again), first);
        assert_eq!(pool.stats().cache_hits, before.cache_hits + 1);
        drop((other, again));
    }

    #[test]
    fn private_blocks_are_reused_in_queue_order() {
        let (pool, queue) = pool(StorageMode::Private);
        let block = pool.allocate(4096, Some(QUEUE_STREAM), false).unwrap();
        let first = addr(&block);
        queue.batch.lock().unwrap().record();
        drop(block);
        let again = pool.allocate(4096, Some(QUEUE_STREAM), false).unwrap();
        assert_eq!(addr(&again), first, "the queue runs the old work first");
        assert_eq!(pool.stats().cache_hits, 1);
    }

    #[test]
    fn idle_queues_release_without_a_fence() {
        let (pool, queue) = pool(StorageMode::Managed);
        {
            let mut batch = queue.batch.lock().unwrap();
            batch.record();
            let serial = batch.commit().unwrap();
            queue.progress.complete(serial);
        }
        let block = pool.allocate(100, Some(QUEUE_STREAM), false).unwrap();
        let first = addr(&block);
        drop(block);
        assert_eq!(
            addr(&pool.allocate(100, Some(QUEUE_STREAM), false).unwrap()),
            first
        );
        pool.clear_cache();
        assert!(pool.take_error().is_none());
    }
}
