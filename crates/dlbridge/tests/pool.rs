//! The caching pool: exact statistics, reuse, limits, the out-of-memory retry, concurrency, and
//! the stream-ordering rules for fenced blocks.
//!
//! Most tests build their own [`Pool`] over [`TestDriver`], a test double of dlbridge's own
//! [`RawAllocator`] trait: it hands out real host memory (through the CPU backend's
//! [`HostAllocator`]) and keeps its own count of what it holds, can refuse allocations beyond a
//! budget, and hands out [`TestFence`]s whose completion the test controls. The tests at the end
//! use the process-wide CPU pool through `Tensor`, one at a time.

use std::collections::HashSet;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use dlbridge::backend::cpu::HostAllocator;
use dlbridge::pool::{Fence, GRANULE, MAX_LIMIT, PooledBlock, RawAllocator, StreamKey};
use dlbridge::{
    Buffer, DType, Device, DeviceKind, Error, ErrorKind, MemoryStats, Pool, StorageMode, Tensor,
};

// ---------------------------------------------------------------------------------------------
// The test driver and fence.

/// What the driver and its fences did, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Event {
    Alloc(usize),
    Free(usize),
    /// `order_before`: (the fence's stream, the stream made to wait).
    Order(StreamKey, StreamKey),
    /// `synchronize` of a fence on this stream.
    Sync(StreamKey),
}

/// A fence's state, shared with the test.
#[derive(Default)]
struct FenceState {
    complete: AtomicBool,
    fail_order: AtomicBool,
    /// The host may touch the block at once: no stream orders its reuse.
    unordered: AtomicBool,
}

#[derive(Default)]
struct Shared {
    /// Bytes the driver has handed out and not had back.
    outstanding: AtomicUsize,
    /// Refuse allocations that would take `outstanding` beyond this.
    budget: Mutex<Option<usize>>,
    /// The fence state the next releases get (`None`: no fence).
    pending: Mutex<Option<Arc<FenceState>>>,
    /// Fail every zero fill.
    fail_zero: AtomicBool,
    log: Mutex<Vec<Event>>,
}

impl Shared {
    fn log(&self) -> Vec<Event> {
        self.log.lock().unwrap().clone()
    }

    fn clear_log(&self) {
        self.log.lock().unwrap().clear();
    }
}

struct TestDriver(Arc<Shared>);

impl RawAllocator for TestDriver {
    fn round_size(&self, bytes: usize) -> Option<usize> {
        HostAllocator.round_size(bytes)
    }

    fn allocate(&self, bytes: usize, zeroed: bool) -> dlbridge::Result<NonNull<c_void>> {
        let s = &self.0;
        if let Some(budget) = *s.budget.lock().unwrap() {
            if s.outstanding.load(Ordering::SeqCst) + bytes > budget {
                return Err(Error::OutOfMemory {
                    bytes,
                    device: Device::CPU,
                    detail: ": the test driver's budget is spent".into(),
                });
            }
        }
        let ptr = HostAllocator.allocate(bytes, zeroed)?;
        s.outstanding.fetch_add(bytes, Ordering::SeqCst);
        s.log.lock().unwrap().push(Event::Alloc(bytes));
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: NonNull<c_void>, bytes: usize) {
        self.0.outstanding.fetch_sub(bytes, Ordering::SeqCst);
        self.0
            .log
            .lock()
            .unwrap()
            .push(Event::Free(ptr.as_ptr() as usize));
        // SAFETY: the pool hands back what `allocate` gave, with the same size, once.
        unsafe { HostAllocator.free(ptr, bytes) };
    }

    unsafe fn zero(
        &self,
        ptr: NonNull<c_void>,
        bytes: usize,
        stream: Option<StreamKey>,
    ) -> dlbridge::Result<()> {
        if self.0.fail_zero.load(Ordering::SeqCst) {
            return Err(Error::Driver {
                backend: "test",
                message: "the fill could not be queued".into(),
            });
        }
        // SAFETY: the pool's contract for `zero` is the host allocator's.
        unsafe { HostAllocator.zero(ptr, bytes, stream) }
    }

    fn fence(&self, stream: StreamKey) -> dlbridge::Result<Option<Box<dyn Fence>>> {
        Ok(self.0.pending.lock().unwrap().clone().map(|state| {
            Box::new(TestFence {
                stream,
                state,
                shared: Arc::clone(&self.0),
            }) as Box<dyn Fence>
        }))
    }
}

struct TestFence {
    stream: StreamKey,
    state: Arc<FenceState>,
    shared: Arc<Shared>,
}

impl Fence for TestFence {
    fn stream(&self) -> StreamKey {
        self.stream
    }

    fn is_complete(&self) -> bool {
        self.state.complete.load(Ordering::SeqCst)
    }

    fn order_before(&self, stream: StreamKey) -> dlbridge::Result<()> {
        if self.state.fail_order.load(Ordering::SeqCst) {
            return Err(Error::Driver {
                backend: "test",
                message: "cannot wait for the event".into(),
            });
        }
        self.shared
            .log
            .lock()
            .unwrap()
            .push(Event::Order(self.stream, stream));
        Ok(())
    }

    fn synchronize(&self) -> dlbridge::Result<()> {
        self.shared
            .log
            .lock()
            .unwrap()
            .push(Event::Sync(self.stream));
        self.state.complete.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn stream_ordered(&self) -> bool {
        !self.state.unordered.load(Ordering::SeqCst)
    }
}

fn test_pool() -> (Arc<Pool>, Arc<Shared>) {
    let shared = Arc::new(Shared::default());
    let pool = Pool::new(
        Device::CPU,
        StorageMode::Shared,
        TestDriver(Arc::clone(&shared)),
    );
    (pool, shared)
}

fn addr(block: &PooledBlock) -> usize {
    block.as_ptr().as_ptr() as usize
}

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Statistics and reuse.

#[test]
fn exact_statistics_after_a_known_sequence() {
    let (pool, shared) = test_pool();
    let s0 = pool.stats();
    assert_eq!(s0, MemoryStats::default());

    let a = pool.allocate(1000, None, false).unwrap(); // 1024-byte block
    let b = pool.allocate(3 * MIB + 1, None, false).unwrap(); // 3 MiB + 256 KiB
    assert_eq!(a.block_size(), 1024);
    assert_eq!(b.block_size(), 3 * MIB + 256 * KIB);
    let s = pool.stats();
    assert_eq!(s.active_bytes, 1024 + 3 * MIB + 256 * KIB);
    assert_eq!(s.active_blocks, 2);
    assert_eq!(s.requested_bytes, 1000 + 3 * MIB + 1);
    assert_eq!((s.cached_bytes, s.cached_blocks), (0, 0));
    assert_eq!(s.peak_active_bytes, s.active_bytes);
    assert_eq!((s.allocations, s.cache_hits, s.cache_misses), (2, 0, 2));
    assert_eq!((s.driver_allocations, s.driver_frees), (2, 0));

    drop(a);
    let s = pool.stats();
    assert_eq!((s.active_bytes, s.active_blocks), (3 * MIB + 256 * KIB, 1));
    assert_eq!((s.cached_bytes, s.cached_blocks), (1024, 1));
    assert_eq!(s.requested_bytes, 3 * MIB + 1);
    let peak = 1024 + 3 * MIB + 256 * KIB;
    assert_eq!(s.peak_active_bytes, peak);

    let c = pool.allocate(600, None, true).unwrap(); // same class: a hit
    drop(b);
    let s = pool.stats();
    assert_eq!((s.active_bytes, s.active_blocks), (1024, 1));
    assert_eq!((s.cached_bytes, s.cached_blocks), (3 * MIB + 256 * KIB, 1));
    assert_eq!((s.allocations, s.cache_hits, s.cache_misses), (3, 1, 2));
    assert_eq!((s.driver_allocations, s.driver_frees), (2, 0));
    assert_eq!(s.peak_active_bytes, peak);

    pool.reset_peak();
    assert_eq!(pool.stats().peak_active_bytes, 1024);
    drop(c);
    pool.clear_cache();
    let s = pool.stats();
    assert_eq!((s.active_bytes, s.cached_bytes, s.cached_blocks), (0, 0, 0));
    assert_eq!((s.driver_allocations, s.driver_frees), (2, 2));
    assert_eq!(s.peak_active_bytes, 1024);
    assert_eq!(shared.outstanding.load(Ordering::SeqCst), 0);
}

#[test]
fn freed_blocks_are_reused_without_a_driver_call() {
    let (pool, shared) = test_pool();
    let first = pool.allocate(MIB, None, false).unwrap();
    let address = addr(&first);
    drop(first);
    let driver_calls = shared.log().len();
    assert_eq!(pool.stats().driver_allocations, 1);

    // The same size and a smaller size of the same class both get the same block.
    for bytes in [MIB, MIB - 100, MIB - 64 * KIB + 1] {
        let again = pool.allocate(bytes, None, false).unwrap();
        assert_eq!(addr(&again), address, "{bytes} bytes");
        assert_eq!(again.block_size(), MIB);
        assert_eq!(again.len(), bytes);
    }
    assert_eq!(shared.log().len(), driver_calls, "no driver call on reuse");
    let s = pool.stats();
    assert_eq!(
        (s.cache_hits, s.cache_misses, s.driver_allocations),
        (3, 1, 1)
    );

    // A request of another class does not take it.
    let other = pool.allocate(MIB + 1, None, false).unwrap();
    assert_ne!(addr(&other), address);
    assert_eq!(pool.stats().driver_allocations, 2);
    assert_eq!(pool.stats().cached_blocks, 1);
}

#[test]
fn most_recently_released_block_of_a_size_is_reused_first() {
    let (pool, _) = test_pool();
    let a = pool.allocate(4 * KIB, None, false).unwrap();
    let b = pool.allocate(4 * KIB, None, false).unwrap();
    let (first, second) = (addr(&a), addr(&b));
    drop(a);
    drop(b);
    assert_eq!(addr(&pool.allocate(4 * KIB, None, false).unwrap()), second);
    // The block just dropped went back on top, so it comes back again.
    assert_eq!(addr(&pool.allocate(4 * KIB, None, false).unwrap()), second);
    let x = pool.allocate(4 * KIB, None, false).unwrap();
    let y = pool.allocate(4 * KIB, None, false).unwrap();
    assert_eq!(
        HashSet::from([addr(&x), addr(&y)]),
        HashSet::from([first, second])
    );
}

#[test]
fn reused_blocks_are_zeroed_again_when_asked() {
    let (pool, _) = test_pool();
    for bytes in [700, 100 * KIB, 2 * MIB + 3] {
        let block = pool.allocate(bytes, None, true).unwrap();
        let address = addr(&block);
        // SAFETY: the block holds `block_size() >= bytes` writable host bytes and is ours alone.
        let data = unsafe {
            std::slice::from_raw_parts_mut(block.as_ptr().as_ptr().cast::<u8>(), block.block_size())
        };
        assert!(data[..bytes].iter().all(|&x| x == 0));
        data.fill(0xAB);
        drop(block);
        let again = pool.allocate(bytes, None, true).unwrap();
        assert_eq!(addr(&again), address, "reused");
        // SAFETY: as above.
        let data = unsafe {
            std::slice::from_raw_parts(again.as_ptr().as_ptr().cast::<u8>(), again.len())
        };
        assert!(
            data.iter().all(|&x| x == 0),
            "{bytes}: stale bytes survived"
        );
        drop(again);
        // Without zeroing the old contents are left alone (proof that zeroing really ran above).
        let raw = pool.allocate(bytes, None, false).unwrap();
        assert_eq!(addr(&raw), address);
    }
}

#[test]
fn a_failed_zero_fill_puts_the_reused_block_back() {
    let (pool, shared) = test_pool();
    let address = addr(&pool.allocate(4 * KIB, None, false).unwrap());
    shared.fail_zero.store(true, Ordering::SeqCst);
    let err = pool.allocate(4 * KIB, None, true).unwrap_err();
    assert!(matches!(err, Error::Driver { .. }), "{err}");
    // Not counted as an allocation, and the block is back: nothing is active, the block is cached.
    let s = pool.stats();
    assert_eq!(
        (s.allocations, s.cache_hits, s.active_blocks, s.active_bytes),
        (1, 0, 0, 0)
    );
    assert_eq!((s.cached_blocks, s.cached_bytes), (1, 4 * KIB));
    shared.fail_zero.store(false, Ordering::SeqCst);
    assert_eq!(addr(&pool.allocate(4 * KIB, None, true).unwrap()), address);
    let s = pool.stats();
    assert_eq!(
        (s.allocations, s.cache_hits, s.driver_allocations),
        (2, 1, 1)
    );
}

#[test]
fn a_static_pool_hands_out_blocks_without_counting_references() {
    let pool: &'static Arc<Pool> = Box::leak(Box::new(test_pool().0));
    let block = pool.allocate_static(100 * KIB, None, false).unwrap();
    assert_eq!(Arc::strong_count(pool), 1, "the block holds no reference");
    assert!(std::ptr::eq(block.pool(), &**pool));
    let address = addr(&block);
    drop(block);
    // The same reuse and figures as through a counted reference.
    let counted = pool.allocate(100 * KIB, None, false).unwrap();
    assert_eq!(Arc::strong_count(pool), 2);
    assert_eq!(addr(&counted), address);
    drop(counted);
    assert_eq!(Arc::strong_count(pool), 1);
    let s = pool.stats();
    assert_eq!(
        (s.allocations, s.cache_hits, s.driver_allocations),
        (2, 1, 1)
    );
    assert_eq!(
        (s.active_bytes, s.cached_bytes),
        (0, pool.block_size(100 * KIB).unwrap())
    );
}

// ---------------------------------------------------------------------------------------------
// Limits and the cache.

#[test]
fn memory_limit_is_enforced() {
    let (pool, shared) = test_pool();
    pool.set_memory_limit(Some(MIB)).unwrap();
    let a = pool.allocate(512 * KIB, None, false).unwrap();
    let before = pool.stats();
    let driver_calls = shared.log().len();
    let err = pool.allocate(600 * KIB, None, false).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Memory);
    let text = err.to_string();
    for figure in [
        "614400 bytes".to_owned(), // the request
        format!("{} bytes active", before.active_bytes),
        format!("memory limit {} bytes", MIB),
        "memory limit".to_owned(),
    ] {
        assert!(text.contains(&figure), "{figure:?} missing in {text}");
    }
    assert_eq!(pool.stats(), before, "a refused allocation changes nothing");
    assert_eq!(
        shared.log().len(),
        driver_calls,
        "the limit is checked before the driver"
    );

    // Exactly up to the limit is fine; cached blocks do not count against it.
    let b = pool.allocate(MIB - 512 * KIB, None, false).unwrap();
    assert_eq!(pool.stats().active_bytes, MIB);
    assert!(pool.allocate(1, None, false).is_err());
    drop(b);
    let small = pool.allocate(1, None, false).unwrap();
    assert_eq!(pool.stats().cached_bytes, 512 * KIB);
    drop((a, small));
    let c = pool.allocate(MIB, None, false).unwrap();
    drop(c);
    // Lowering the limit below what is active is allowed; lifting it lets everything through.
    let d = pool.allocate(MIB, None, false).unwrap();
    pool.set_memory_limit(Some(1)).unwrap();
    assert!(pool.allocate(1, None, false).is_err());
    pool.set_memory_limit(None).unwrap();
    let e = pool.allocate(4 * MIB, None, false).unwrap();
    assert_eq!(pool.stats().memory_limit, None);
    drop((d, e));
}

#[test]
fn absurd_limits_are_rejected() {
    let (pool, _) = test_pool();
    for limit in [MAX_LIMIT + 1, usize::MAX] {
        for result in [
            pool.set_memory_limit(Some(limit)),
            pool.set_cache_limit(Some(limit)),
        ] {
            assert!(
                matches!(result, Err(Error::InvalidArgument(_))),
                "{result:?}"
            );
        }
    }
    assert_eq!(pool.stats().memory_limit, None);
    assert_eq!(pool.stats().cache_limit, None);
    pool.set_memory_limit(Some(MAX_LIMIT)).unwrap();
    pool.set_cache_limit(Some(0)).unwrap();
    assert_eq!(pool.stats().memory_limit, Some(MAX_LIMIT));
    assert_eq!(pool.stats().cache_limit, Some(0));
}

#[test]
fn cache_limit_releases_least_recently_used_blocks_first() {
    let (pool, shared) = test_pool();
    pool.set_cache_limit(Some(36 * KIB)).unwrap();
    let blocks: Vec<PooledBlock> = [4, 8, 12, 16]
        .iter()
        .map(|&k| pool.allocate(k * KIB, None, false).unwrap())
        .collect();
    let addresses: Vec<usize> = blocks.iter().map(addr).collect();
    shared.clear_log();
    for block in blocks {
        drop(block); // released in order 4, 8, 12, 16 KiB
    }
    // 40 KiB released, 36 KiB allowed: the oldest (4 KiB) went back to the driver.
    assert_eq!(shared.log(), vec![Event::Free(addresses[0])]);
    let s = pool.stats();
    assert_eq!(
        (s.cached_bytes, s.cached_blocks, s.driver_frees),
        (36 * KIB, 3, 1)
    );

    // Reusing the 8 KiB block and releasing it again makes it the most recent: lowering the
    // limit now releases 12 KiB, then 16 KiB, then 8 KiB.
    let b = pool.allocate(8 * KIB, None, false).unwrap();
    assert_eq!(addr(&b), addresses[1]);
    drop(b);
    shared.clear_log();
    pool.set_cache_limit(Some(9 * KIB)).unwrap();
    assert_eq!(
        shared.log(),
        vec![Event::Free(addresses[2]), Event::Free(addresses[3])]
    );
    assert_eq!(pool.stats().cached_bytes, 8 * KIB);
    pool.set_cache_limit(Some(0)).unwrap();
    assert_eq!(shared.log().last(), Some(&Event::Free(addresses[1])));
    assert_eq!(pool.stats().cached_blocks, 0);

    // With a zero limit nothing is cached.
    let c = pool.allocate(4 * KIB, None, false).unwrap();
    drop(c);
    let s = pool.stats();
    assert_eq!(
        (s.cached_bytes, s.driver_allocations, s.driver_frees),
        (0, 5, 5)
    );
    assert_eq!(shared.outstanding.load(Ordering::SeqCst), 0);
}

#[test]
fn clear_cache_returns_every_cached_block() {
    let (pool, shared) = test_pool();
    let kept = pool.allocate(10 * KIB, None, false).unwrap();
    let sizes = [100, 5000, 70 * KIB, 2 * MIB, 2 * MIB];
    let blocks: Vec<_> = sizes
        .iter()
        .map(|&n| pool.allocate(n, None, false).unwrap())
        .collect();
    let cached: usize = blocks.iter().map(PooledBlock::block_size).sum();
    drop(blocks);
    assert_eq!(pool.stats().cached_bytes, cached);
    assert_eq!(pool.stats().cached_blocks, sizes.len());
    pool.clear_cache();
    let s = pool.stats();
    assert_eq!((s.cached_bytes, s.cached_blocks), (0, 0));
    assert_eq!(s.driver_frees, sizes.len() as u64);
    assert_eq!((s.active_bytes, s.active_blocks), (kept.block_size(), 1));
    assert_eq!(shared.outstanding.load(Ordering::SeqCst), kept.block_size());
    // The next request of a cleared size goes to the driver again.
    drop(pool.allocate(2 * MIB, None, false).unwrap());
    assert_eq!(pool.stats().cache_misses, sizes.len() as u64 + 2);
}

#[test]
fn driver_failure_releases_the_cache_and_retries_once() {
    let (pool, shared) = test_pool();
    *shared.budget.lock().unwrap() = Some(64 * KIB);
    let a = pool.allocate(32 * KIB, None, false).unwrap();
    let b = pool.allocate(16 * KIB, None, false).unwrap();
    drop(a);
    drop(b);
    assert_eq!(pool.stats().cached_bytes, 48 * KIB);
    // 48 KiB cached + 40 KiB asked > 64 KiB budget: the driver refuses, the pool empties its
    // cache and the retry succeeds.
    let c = pool.allocate(40 * KIB, None, false).unwrap();
    let s = pool.stats();
    assert_eq!((s.cached_bytes, s.cached_blocks), (0, 0));
    assert_eq!((s.driver_allocations, s.driver_frees), (3, 2));
    assert_eq!((s.active_bytes, s.cache_misses), (40 * KIB, 3));

    // Now 40 KiB are active and 32 KiB more cannot fit even with an empty cache.
    let d = pool.allocate(8 * KIB, None, false).unwrap();
    drop(d); // 8 KiB cached
    let err = pool.allocate(32 * KIB, None, false).unwrap_err();
    let s = pool.stats();
    assert_eq!(err.kind(), ErrorKind::Memory);
    assert_eq!(s.cached_bytes, 0, "the cache was released before giving up");
    let text = err.to_string();
    for figure in [
        format!("cannot allocate {} bytes", 32 * KIB),
        format!(
            "{} bytes active in {} blocks",
            s.active_bytes, s.active_blocks
        ),
        format!("{} bytes cached", s.cached_bytes),
        "memory limit none".to_owned(),
    ] {
        assert!(text.contains(&figure), "{figure:?} missing in {text}");
    }
    assert!(matches!(err, Error::OutOfMemory { bytes, .. } if bytes == 32 * KIB));
    drop(c);
}

#[test]
fn other_driver_errors_pass_through_without_a_retry() {
    struct Broken;
    impl RawAllocator for Broken {
        fn allocate(&self, _: usize, _: bool) -> dlbridge::Result<NonNull<c_void>> {
            Err(Error::Driver {
                backend: "test",
                message: "context lost".into(),
            })
        }
        unsafe fn free(&self, _: NonNull<c_void>, _: usize) {}
        unsafe fn zero(
            &self,
            _: NonNull<c_void>,
            _: usize,
            _: Option<StreamKey>,
        ) -> dlbridge::Result<()> {
            Ok(())
        }
    }
    let pool = Pool::new(Device::CPU, StorageMode::Shared, Broken);
    let err = pool.allocate(100, None, false).unwrap_err();
    assert!(matches!(err, Error::Driver { .. }), "{err}");
    let s = pool.stats();
    assert_eq!(
        (s.allocations, s.active_bytes, s.driver_allocations),
        (0, 0, 0)
    );
    // The failed reservation no longer counts against a limit.
    pool.set_memory_limit(Some(GRANULE)).unwrap();
    assert!(matches!(
        pool.allocate(100, None, false).unwrap_err(),
        Error::Driver { .. }
    ));
}

#[test]
fn unrepresentable_sizes_are_out_of_memory() {
    let (pool, shared) = test_pool();
    for bytes in [usize::MAX, MAX_LIMIT + 1] {
        let err = pool.allocate(bytes, None, false).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Memory, "{err}");
    }
    assert!(shared.log().is_empty());
}

// ---------------------------------------------------------------------------------------------
// Concurrency.

/// A small deterministic generator, so every run does the same work.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as usize
    }
}

fn hammer(pool: &Arc<Pool>, threads: usize, rounds: usize) -> (Vec<PooledBlock>, u64) {
    const SIZES: [usize; 6] = [100, 1000, 5000, 70 * KIB, 300 * KIB, 2 * MIB];
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let pool = Arc::clone(pool);
            std::thread::spawn(move || {
                let mut rng = Lcg(t as u64 + 1);
                let mut held = Vec::new();
                let mut count = 0u64;
                for _ in 0..rounds {
                    if held.len() < 4 || rng.next() % 2 == 0 {
                        let bytes = SIZES[rng.next() % SIZES.len()];
                        held.push(pool.allocate(bytes, None, rng.next() % 3 == 0).unwrap());
                        count += 1;
                    } else {
                        let i = rng.next() % held.len();
                        held.swap_remove(i);
                    }
                    while held.len() > 3 + rng.next() % 4 {
                        held.pop();
                    }
                }
                (held, count)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut total = 0;
    for h in handles {
        let (held, count) = h.join().unwrap();
        all.extend(held);
        total += count;
    }
    (all, total)
}

fn check_consistent(pool: &Pool, shared: &Shared, held: &[PooledBlock], allocations: u64) {
    let s = pool.stats();
    assert_eq!(s.allocations, allocations);
    assert_eq!(s.cache_hits + s.cache_misses, s.allocations);
    assert_eq!(s.driver_allocations, s.cache_misses);
    assert_eq!(s.active_blocks, held.len());
    assert_eq!(
        s.active_bytes,
        held.iter().map(PooledBlock::block_size).sum::<usize>()
    );
    assert_eq!(
        s.requested_bytes,
        held.iter().map(PooledBlock::len).sum::<usize>()
    );
    assert_eq!(
        (s.driver_allocations - s.driver_frees) as usize,
        s.active_blocks + s.cached_blocks
    );
    // The driver's own count agrees with the pool's.
    assert_eq!(
        shared.outstanding.load(Ordering::SeqCst),
        s.active_bytes + s.cached_bytes
    );
    assert!(s.peak_active_bytes >= s.active_bytes);
    if let Some(limit) = s.cache_limit {
        assert!(s.cached_bytes <= limit);
    }
    let distinct: HashSet<usize> = held.iter().map(addr).collect();
    assert_eq!(distinct.len(), held.len(), "no block is handed out twice");
}

#[test]
fn statistics_are_exact_under_concurrency() {
    for cache_limit in [None, Some(600 * KIB)] {
        let (pool, shared) = test_pool();
        pool.set_cache_limit(cache_limit).unwrap();
        let (held, allocations) = hammer(&pool, 8, 4000);
        check_consistent(&pool, &shared, &held, allocations);
        let s = pool.stats();
        assert!(s.cache_hits > 0, "reuse happened: {s:?}");
        if cache_limit.is_none() {
            // Every size is soon cached, so misses are rare.
            assert!(s.cache_hits > 10 * s.cache_misses, "{s:?}");
        }
        if cache_limit.is_some() {
            assert!(s.driver_frees > 0, "the limit evicted blocks: {s:?}");
        }
        drop(held);
        check_consistent(&pool, &shared, &[], allocations);
        pool.clear_cache();
        let s = pool.stats();
        assert_eq!(s.driver_frees, s.driver_allocations);
        assert_eq!(shared.outstanding.load(Ordering::SeqCst), 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Stream ordering with fences.

const STREAM_A: StreamKey = 0xA;
const STREAM_B: StreamKey = 0xB;

/// A pool whose releases are fenced with a fence that is not complete; returns the fence state.
fn fenced_pool() -> (Arc<Pool>, Arc<Shared>, Arc<FenceState>) {
    let (pool, shared) = test_pool();
    let state = Arc::new(FenceState::default());
    *shared.pending.lock().unwrap() = Some(Arc::clone(&state));
    (pool, shared, state)
}

#[test]
fn a_fenced_block_is_reused_at_once_on_its_own_stream() {
    let (pool, shared, _) = fenced_pool();
    let block = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let address = addr(&block);
    drop(block);
    shared.clear_log();
    let again = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    assert_eq!(addr(&again), address);
    assert_eq!(shared.log(), vec![], "no wait, no driver call");
}

#[test]
fn another_stream_is_made_to_wait_before_reuse() {
    let (pool, shared, _) = fenced_pool();
    let block = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let address = addr(&block);
    drop(block);
    shared.clear_log();
    let again = pool.allocate(MIB, Some(STREAM_B), false).unwrap();
    assert_eq!(addr(&again), address);
    assert_eq!(shared.log(), vec![Event::Order(STREAM_A, STREAM_B)]);
    assert_eq!(again.stream(), Some(STREAM_B));
    assert_eq!(pool.stats().cache_hits, 1);
}

#[test]
fn a_request_without_a_stream_never_gets_an_incomplete_block() {
    let (pool, shared, state) = fenced_pool();
    let block = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let address = addr(&block);
    drop(block);
    shared.clear_log();
    let fresh = pool.allocate(MIB, None, false).unwrap();
    assert_ne!(addr(&fresh), address);
    assert_eq!(shared.log(), vec![Event::Alloc(MIB)]);
    assert_eq!(pool.stats().cached_blocks, 1);
    // Once the fenced work is done, it is handed out with no wait.
    state.complete.store(true, Ordering::SeqCst);
    shared.clear_log();
    let reused = pool.allocate(MIB, None, false).unwrap();
    assert_eq!(addr(&reused), address);
    assert_eq!(shared.log(), vec![]);
}

#[test]
fn a_complete_block_is_preferred_to_one_that_needs_a_wait() {
    let (pool, shared) = test_pool();
    let busy = Arc::new(FenceState::default());
    let done = Arc::new(FenceState::default());
    let x = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let y = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let (busy_addr, done_addr) = (addr(&x), addr(&y));
    *shared.pending.lock().unwrap() = Some(Arc::clone(&done));
    drop(y); // released first: the older block
    *shared.pending.lock().unwrap() = Some(Arc::clone(&busy));
    drop(x); // the most recent, still busy
    done.complete.store(true, Ordering::SeqCst);
    shared.clear_log();
    let got = pool.allocate(MIB, Some(STREAM_B), false).unwrap();
    assert_eq!(addr(&got), done_addr);
    assert_eq!(shared.log(), vec![], "no wait was needed");
    // The busy one needs a wait now.
    let got2 = pool.allocate(MIB, Some(STREAM_B), false).unwrap();
    assert_eq!(addr(&got2), busy_addr);
    assert_eq!(shared.log(), vec![Event::Order(STREAM_A, STREAM_B)]);
}

#[test]
fn a_failed_wait_fails_the_allocation_and_keeps_the_block() {
    let (pool, _, state) = fenced_pool();
    let block = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let address = addr(&block);
    drop(block);
    state.fail_order.store(true, Ordering::SeqCst);
    let before = pool.stats();
    let err = pool.allocate(MIB, Some(STREAM_B), false).unwrap_err();
    assert!(matches!(err, Error::Driver { .. }), "{err}");
    assert_eq!(pool.stats(), before);
    state.fail_order.store(false, Ordering::SeqCst);
    assert_eq!(
        addr(&pool.allocate(MIB, Some(STREAM_B), false).unwrap()),
        address
    );
}

#[test]
fn blocks_no_stream_orders_wait_for_their_fence_on_every_stream() {
    let (pool, shared, state) = fenced_pool();
    state.unordered.store(true, Ordering::SeqCst);
    let block = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let address = addr(&block);
    drop(block);
    shared.clear_log();
    // Neither its own stream nor another takes it early, and nobody is made to wait for it.
    let a = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let b = pool.allocate(MIB, Some(STREAM_B), false).unwrap();
    assert!(addr(&a) != address && addr(&b) != address);
    assert_eq!(shared.log(), vec![Event::Alloc(MIB), Event::Alloc(MIB)]);
    assert_eq!(pool.stats().cache_hits, 0);
    // Complete, it is the first choice of any stream.
    state.complete.store(true, Ordering::SeqCst);
    shared.clear_log();
    let again = pool.allocate(MIB, Some(STREAM_B), false).unwrap();
    assert_eq!(addr(&again), address);
    assert_eq!(shared.log(), vec![]);
}

#[test]
fn a_stream_ordered_block_is_taken_behind_an_unordered_one() {
    let (pool, shared) = test_pool();
    let host = Arc::new(FenceState::default());
    host.unordered.store(true, Ordering::SeqCst);
    let queued = Arc::new(FenceState::default());
    let x = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let y = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let queued_addr = addr(&y);
    *shared.pending.lock().unwrap() = Some(Arc::clone(&host));
    drop(x); // the oldest, but no stream may wait for it
    *shared.pending.lock().unwrap() = Some(Arc::clone(&queued));
    drop(y);
    shared.clear_log();
    let got = pool.allocate(MIB, Some(STREAM_B), false).unwrap();
    assert_eq!(addr(&got), queued_addr);
    assert_eq!(shared.log(), vec![Event::Order(STREAM_A, STREAM_B)]);
}

#[test]
fn incomplete_blocks_are_synchronized_before_the_driver_frees_them() {
    let (pool, shared, state) = fenced_pool();
    let block = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let address = addr(&block);
    drop(block);
    shared.clear_log();
    pool.clear_cache();
    assert_eq!(
        shared.log(),
        vec![Event::Sync(STREAM_A), Event::Free(address)]
    );
    // A complete fence needs no wait.
    let block = pool.allocate(MIB, Some(STREAM_A), false).unwrap();
    let address = addr(&block);
    drop(block);
    assert!(state.complete.load(Ordering::SeqCst));
    shared.clear_log();
    pool.set_cache_limit(Some(0)).unwrap();
    assert_eq!(shared.log(), vec![Event::Free(address)]);
    assert!(pool.take_error().is_none());
}

// ---------------------------------------------------------------------------------------------
// The process-wide CPU pool, through tensors. These tests share one pool, so they run one at a
// time.

static CPU_POOL: Mutex<()> = Mutex::new(());

fn cpu_pool_lock() -> MutexGuard<'static, ()> {
    CPU_POOL.lock().unwrap_or_else(|p| p.into_inner())
}

fn cpu_stats() -> MemoryStats {
    dlbridge::memory_stats(Device::CPU).unwrap()
}

#[test]
fn cpu_tensors_come_from_the_pool() {
    let _guard = cpu_pool_lock();
    dlbridge::empty_cache(Device::CPU).unwrap();
    let s0 = cpu_stats();
    assert_eq!(s0.cached_bytes, 0);
    let t = Tensor::zeros(&[1000], DType::F32, Device::CPU).unwrap(); // 4000 B -> 4096 B block
    let s1 = cpu_stats();
    assert_eq!(s1.active_blocks, s0.active_blocks + 1);
    assert_eq!(s1.active_bytes, s0.active_bytes + 4096);
    assert_eq!(s1.requested_bytes, s0.requested_bytes + 4000);
    assert_eq!(s1.cache_misses, s0.cache_misses + 1);
    let address = t.buffer().handle() as usize;
    drop(t);
    let s2 = cpu_stats();
    assert_eq!(s2.active_bytes, s0.active_bytes);
    assert_eq!(s2.cached_bytes, 4096);

    // Same size class (3584 < n <= 4096 bytes): the same memory, zeroed again, no driver call.
    let mut u = Tensor::empty(&[4090], DType::U8, Device::CPU).unwrap();
    assert_eq!(u.buffer().handle() as usize, address);
    u.as_mut_slice::<u8>().unwrap().fill(7);
    drop(u);
    let z = Tensor::zeros(&[4000], DType::U8, Device::CPU).unwrap();
    assert_eq!(z.buffer().handle() as usize, address);
    assert!(z.as_slice::<u8>().unwrap().iter().all(|&b| b == 0));
    let s3 = cpu_stats();
    assert_eq!(s3.driver_allocations, s2.driver_allocations);
    assert_eq!(s3.cache_hits, s2.cache_hits + 2);
    drop(z);

    // Zero bytes take nothing from the pool.
    let e = Tensor::empty(&[0, 5], DType::F64, Device::CPU).unwrap();
    assert_eq!(cpu_stats().allocations, s3.allocations);
    drop(e);

    dlbridge::reset_peak_memory(Device::CPU).unwrap();
    assert_eq!(cpu_stats().peak_active_bytes, cpu_stats().active_bytes);
    dlbridge::empty_cache(Device::CPU).unwrap();
    assert_eq!(cpu_stats().cached_bytes, 0);
}

#[test]
fn cpu_memory_limit_fails_tensor_allocation() {
    let _guard = cpu_pool_lock();
    let active = cpu_stats().active_bytes;
    dlbridge::set_memory_limit(Device::CPU, Some(active + MIB)).unwrap();
    let ok = Tensor::empty(&[MIB / 2], DType::U8, Device::CPU);
    let refused = Tensor::empty(&[MIB], DType::U8, Device::CPU);
    dlbridge::set_memory_limit(Device::CPU, None).unwrap();
    assert!(ok.is_ok());
    let err = refused.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Memory);
    assert!(err.to_string().contains(&format!("{MIB} bytes")), "{err}");
    assert!(matches!(
        dlbridge::set_cache_limit(Device::CPU, Some(usize::MAX)),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn foreign_memory_never_enters_the_pool() {
    let _guard = cpu_pool_lock();
    let before = cpu_stats();
    let mut data = vec![0u8; 3 * MIB];
    let ptr = data.as_mut_ptr();
    let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(data);
    // SAFETY: `owner` keeps the vector (and so its heap bytes) alive until the buffer drops it.
    let buffer = unsafe {
        Buffer::from_foreign(
            ptr.cast(),
            ptr,
            3 * MIB,
            Device::CPU,
            StorageMode::Shared,
            false,
            owner,
        )
    };
    let t = Tensor::new(
        buffer,
        DType::U8,
        dlbridge::Layout::contiguous(&[3 * MIB]).unwrap(),
    )
    .unwrap();
    let view = t.slice(0, dlbridge::SliceArg::range(10, 20)).unwrap();
    drop(t);
    drop(view);
    assert_eq!(cpu_stats(), before);
}

/// Whether `device`'s backend is compiled in and finds its device on this machine.
fn backend_present(device: Device) -> bool {
    match device.kind() {
        #[cfg(cuda)]
        DeviceKind::Cuda => dlbridge::backend::cuda::device_count().is_ok_and(|n| n > 0),
        DeviceKind::Metal => dlbridge::backend::metal::device_count() > 0,
        _ => false,
    }
}

#[test]
fn other_backends_say_they_are_unavailable() {
    for device in [Device::cuda(0), Device::metal(0)] {
        if backend_present(device) {
            // Its pool answers: the tests of that backend check what it says.
            assert!(dlbridge::memory_stats(device).is_ok(), "{device}");
            continue;
        }
        for result in [
            dlbridge::memory_stats(device).map(drop),
            dlbridge::empty_cache(device),
            dlbridge::reset_peak_memory(device),
            dlbridge::set_memory_limit(device, None),
            dlbridge::set_cache_limit(device, None),
            dlbridge::storage_mode(device).map(drop),
        ] {
            assert!(
                matches!(result, Err(Error::BackendUnavailable { .. })),
                "{device}: {result:?}"
            );
        }
    }
    let cpu = dlbridge::storage_mode(Device::CPU).unwrap();
    assert_eq!(cpu.mode, StorageMode::Shared);
}
