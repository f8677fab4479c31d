//! The Metal backend against a real GPU: what only Metal has (storage modes, residency, imports
//! of `id<MTLBuffer>`s, mapped files); its copies run in the shared bodies of
//! `views_and_copies.rs`. Compiled only for Apple targets with feature `metal`
//! (`cargo test -p dlbridge --features metal` on a Mac); every GPU test is
//! `#[ignore = "needs a Metal device"]`, so run them with `-- --include-ignored` (as
//! `scripts/test.sh` does on macOS).
//!
//! Foreign producers are played by dlbridge's own DLPack export of real `id<MTLBuffer>`s: the
//! importer sees exactly what it sees from PyTorch MPS or MLX (an `id<MTLBuffer>`, an offset in
//! `byte_offset`), and the buffers' storage modes can be chosen.

#![cfg(all(target_vendor = "apple", feature = "metal"))]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dlbridge::backend::metal::{
    self, ImportOptions, ResidencyStatus, residency::RESIDENCY_ENV, storage::MANAGED_AVAILABLE,
};
use dlbridge::dlpack::VERSION;
use dlbridge::{DType, Device, Error, SliceArg, StorageMode, Tensor};

/// The first Metal device, with a lock that runs the GPU tests one at a time: the residency test
/// counts the members of the device's set, which other tests' allocations would change under it.
/// Panics where there is none: an ignored test asked to run without a device fails rather than
/// passing.
fn gpu() -> (Device, MutexGuard<'static, ()>) {
    static SERIAL: Mutex<()> = Mutex::new(());
    assert!(
        metal::is_available(),
        "this test needs a Metal device, and this machine has none"
    );
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    (Device::metal(0), guard)
}

fn modes() -> Vec<StorageMode> {
    let mut m = vec![StorageMode::Shared, StorageMode::Private];
    if MANAGED_AVAILABLE {
        m.push(StorageMode::Managed);
    }
    m
}

fn iota_f32(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 0.5 - 7.0).collect()
}

/// Returns every cached block of the device's pools to Metal (cached blocks stay allocated, and
/// in the residency set).
fn empty_pools(device: Device) {
    for mode in modes() {
        metal::pool(device, Some(mode)).unwrap().clear_cache();
    }
}

/// A Metal tensor holding `data` in `shape`, in `storage`.
fn on_metal(device: Device, data: &[f32], shape: &[usize], storage: StorageMode) -> Tensor {
    let host = Tensor::from_slice(data, shape).unwrap();
    let t = metal::copy_to(&host, device, Some(storage)).unwrap();
    assert_eq!(t.buffer().storage_mode(), storage);
    t
}

/// The elements of any Metal view, read back through the host.
fn read<T: dlbridge::Element>(t: &Tensor) -> Vec<T> {
    metal::copy_to(t, Device::CPU, None)
        .unwrap()
        .as_slice::<T>()
        .unwrap()
        .to_vec()
}

/// Exports `t` and imports it back as a foreign, unresolved Metal tensor (what
/// `Tensor::from_dlpack_versioned` makes of a PyTorch MPS or MLX capsule).
fn through_dlpack(t: &Tensor) -> Tensor {
    metal::synchronize(t.device()).unwrap();
    let exported = t.to_dlpack_versioned(VERSION, false);
    // SAFETY: a live export whose ownership passes to the importer.
    unsafe { Tensor::from_dlpack_versioned(exported) }.unwrap()
}

#[test]
#[ignore = "needs a Metal device"]
fn devices_are_discovered() {
    let (device, _serial) = gpu();
    let all = metal::devices().unwrap();
    assert_eq!(all.len(), metal::device_count());
    let info = metal::device_info(device).unwrap();
    assert_eq!(info, all[0]);
    assert_eq!(info.device, Device::metal(0));
    assert!(!info.name.is_empty());
    assert!(info.max_buffer_length >= 1 << 28, "{info:?}");
    // The page size is the OS's, whatever it is.
    // SAFETY: sysconf has no preconditions.
    let os_page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    assert_eq!(info.page_size % os_page, 0, "{info:?}");
    assert!(info.page_size.is_power_of_two());
    if cfg!(target_arch = "aarch64") && info.has_unified_memory {
        assert_eq!(info.page_size, 16 * 1024, "Apple silicon pages are 16 KiB");
    }
    let no_env = [metal::storage::STORAGE_MODE_ENV, dlbridge::storage::ENV_VAR]
        .iter()
        .all(|var| std::env::var_os(var).is_none());
    if no_env {
        let expected = if info.has_unified_memory {
            StorageMode::Shared
        } else {
            StorageMode::Private
        };
        assert_eq!(info.default_storage, expected);
    }
    let missing = Device::metal(all.len() as u32);
    assert!(matches!(
        metal::allocate(missing, 16, None, false),
        Err(Error::UnsupportedDevice(_))
    ));
}

#[test]
#[ignore = "needs a Metal device"]
fn allocation_in_each_mode() {
    let (device, _serial) = gpu();
    for mode in modes() {
        for bytes in [0usize, 1, 4099, 1 << 20] {
            let b = metal::allocate(device, bytes, Some(mode), true).unwrap();
            assert_eq!(b.len(), bytes);
            assert_eq!(b.storage_mode(), mode);
            assert_eq!(b.device(), device);
            assert!(!b.handle().is_null(), "the handle is the id<MTLBuffer>");
            assert_eq!(
                b.host_ptr().is_some(),
                mode != StorageMode::Private,
                "{mode}"
            );
            let t = Tensor::new(
                b,
                DType::U8,
                dlbridge::Layout::contiguous(&[bytes]).unwrap(),
            )
            .unwrap();
            assert!(
                read::<u8>(&t).iter().all(|&x| x == 0),
                "{mode}, {bytes} bytes zeroed"
            );
        }
    }
    // The seam in `backend` reaches the Metal allocator.
    let t = Tensor::zeros(&[3, 5], DType::F32, device).unwrap();
    assert_eq!(t.device(), device);
    assert_eq!(read::<f32>(&t), vec![0.0; 15]);
    if !MANAGED_AVAILABLE {
        assert!(matches!(
            metal::allocate(device, 16, Some(StorageMode::Managed), false),
            Err(Error::InvalidArgument(_))
        ));
    }
    let too_big = metal::device_info(device).unwrap().max_buffer_length + 1;
    assert!(matches!(
        metal::allocate(device, too_big, None, false),
        Err(Error::OutOfMemory { .. })
    ));
}

#[test]
#[ignore = "needs a Metal device"]
fn host_access_follows_the_storage_mode() {
    let (device, _serial) = gpu();
    // Shared: the host writes in place; the GPU sees it.
    let mut shared =
        Tensor::allocate(&[8], DType::F32, device, Some(StorageMode::Shared), false).unwrap();
    shared
        .as_mut_slice::<f32>()
        .unwrap()
        .copy_from_slice(&iota_f32(8));
    let gpu_copy = metal::copy_to(&shared, device, Some(StorageMode::Private)).unwrap();
    assert_eq!(read::<f32>(&gpu_copy), iota_f32(8));

    // Private: no host access at all.
    let mut private = gpu_copy;
    assert!(private.buffer().host_ptr().is_none());
    assert!(matches!(
        private.as_slice::<f32>(),
        Err(Error::NotHostAccessible { .. })
    ));
    assert!(matches!(
        private.as_mut_slice::<f32>(),
        Err(Error::NotHostAccessible { .. })
    ));
    assert!(matches!(
        metal::host_wrote(private.buffer(), 0..4),
        Err(Error::NotHostAccessible { .. })
    ));

    // Managed: host writes are announced with didModifyRange, GPU writes synchronized back.
    if MANAGED_AVAILABLE {
        let mut managed =
            Tensor::allocate(&[8], DType::F32, device, Some(StorageMode::Managed), false).unwrap();
        managed
            .as_mut_slice::<f32>()
            .unwrap()
            .copy_from_slice(&[3.0; 8]);
        metal::host_wrote(managed.buffer(), 0..32).unwrap();
        assert_eq!(read::<f32>(&managed), vec![3.0; 8]);
        // A GPU write into the managed buffer is visible to the host after synchronize.
        metal::copy_from(&mut managed, &private).unwrap();
        metal::synchronize(device).unwrap();
        assert_eq!(managed.as_slice::<f32>().unwrap(), iota_f32(8).as_slice());
        assert!(metal::host_wrote(managed.buffer(), 0..33).is_err());
    }
}

#[test]
#[ignore = "needs a Metal device"]
fn residency_follows_our_allocations() {
    let (device, _serial) = gpu();
    let info = metal::device_info(device).unwrap();
    let count = || metal::residency_allocation_count(device).unwrap();
    match info.residency {
        ResidencyStatus::Enabled => {
            // Cached pool blocks stay in the set: start, and check, with empty caches.
            empty_pools(device);
            metal::synchronize(device).unwrap();
            let before = count().unwrap();
            let a = metal::allocate(device, 1 << 16, Some(StorageMode::Private), false).unwrap();
            let b = metal::allocate(device, 1 << 16, Some(StorageMode::Shared), false).unwrap();
            assert_eq!(
                count(),
                Some(before + 2),
                "both joined the set at the flush"
            );
            // A foreign buffer is not registered unless asked.
            let foreign = through_dlpack(
                &Tensor::new(
                    b.clone(),
                    DType::U8,
                    dlbridge::Layout::contiguous(&[16]).unwrap(),
                )
                .unwrap(),
            );
            let shared = metal::import_foreign(foreign, ImportOptions::default()).unwrap();
            assert_eq!(count(), Some(before + 2));
            drop(shared);
            drop((a, b));
            empty_pools(device);
            metal::synchronize(device).unwrap();
            assert_eq!(count(), Some(before), "released buffers left the set");
            // Asked for, the foreign buffer joins, and leaves with the import.
            let producer = metal::allocate(device, 64, None, false).unwrap();
            let t = Tensor::new(
                producer,
                DType::U8,
                dlbridge::Layout::contiguous(&[64]).unwrap(),
            )
            .unwrap();
            let registered = metal::import_foreign(
                through_dlpack(&t),
                ImportOptions {
                    residency: true,
                    ..ImportOptions::default()
                },
            )
            .unwrap();
            assert_eq!(count(), Some(before + 2), "ours and the registered import");
            drop((registered, t));
            empty_pools(device);
            metal::synchronize(device).unwrap();
            assert_eq!(count(), Some(before));
        }
        ResidencyStatus::DisabledByEnvironment => {
            let value = std::env::var(RESIDENCY_ENV).unwrap_or_default();
            assert_eq!(metal::residency::parse_env(Some(&value)), Ok(false));
            assert_eq!(count(), None);
        }
        ResidencyStatus::Unsupported | ResidencyStatus::Failed(_) => assert_eq!(count(), None),
    }
}

#[test]
#[ignore = "needs a Metal device"]
fn allocations_come_from_the_pool_and_are_rezeroed() {
    let (device, _serial) = gpu();
    for mode in modes() {
        let pool = metal::pool(device, Some(mode)).unwrap();
        assert_eq!((pool.device(), pool.storage_mode()), (device, mode));
        metal::synchronize(device).unwrap();
        let host = Tensor::from_slice(&[7u8; 10_000], &[10_000]).unwrap();
        let a = metal::copy_to(&host, device, Some(mode)).unwrap();
        let handle = a.buffer().handle();
        drop(a);
        let before = pool.stats();
        // A private block is reused in queue order; a shared one was written by the host only.
        let b = metal::allocate(device, 10_000, Some(mode), true).unwrap();
        assert_eq!(b.handle(), handle, "{mode}");
        let after = pool.stats();
        assert_eq!(after.cache_hits, before.cache_hits + 1, "{mode}");
        assert_eq!(
            after.driver_allocations, before.driver_allocations,
            "{mode}"
        );
        let t = Tensor::new(
            b,
            DType::U8,
            dlbridge::Layout::contiguous(&[10_000]).unwrap(),
        )
        .unwrap();
        assert!(
            read::<u8>(&t).iter().all(|&x| x == 0),
            "{mode}: zeroed again"
        );
    }
    // `metal:N` names the pool of the default mode; `pool_for` reaches the others.
    let default = metal::device_info(device).unwrap().default_storage;
    let default_pool = metal::pool(device, Some(default)).unwrap();
    assert!(Arc::ptr_eq(
        metal::pool(device, None).unwrap(),
        default_pool
    ));
    assert_eq!(
        dlbridge::memory_stats(device).unwrap(),
        default_pool.stats()
    );
    assert!(Arc::ptr_eq(
        dlbridge::backend::pool_for(device, Some(StorageMode::Private)).unwrap(),
        metal::pool(device, Some(StorageMode::Private)).unwrap()
    ));
    assert_eq!(
        dlbridge::backend::resolve_storage(device, None)
            .unwrap()
            .mode,
        default
    );
    assert!(
        default_pool.stats().cache_limit.is_some(),
        "a default cache limit"
    );
}

#[test]
#[ignore = "needs a Metal device"]
fn host_visible_blocks_wait_for_their_gpu_work() {
    let (device, _serial) = gpu();
    let src = on_metal(device, &iota_f32(1024), &[1024], StorageMode::Private);
    for mode in modes() {
        metal::synchronize(device).unwrap();
        let pool = metal::pool(device, Some(mode)).unwrap();
        // A blit into `dst` is encoded, not committed, when `dst` is released.
        let dst = metal::copy_to(&src, device, Some(mode)).unwrap();
        let handle = dst.buffer().handle();
        drop(dst);
        let hits = pool.stats().cache_hits;
        let next = metal::allocate(device, 4096, Some(mode), false).unwrap();
        if mode == StorageMode::Private {
            assert_eq!(next.handle(), handle, "the queue orders private reuse");
            assert_eq!(pool.stats().cache_hits, hits + 1);
        } else {
            assert_ne!(next.handle(), handle, "{mode}: the blit may still write it");
        }
        drop(next);
        metal::synchronize(device).unwrap();
        // Complete now: every mode takes a cached block.
        let hits = pool.stats().cache_hits;
        let again = metal::allocate(device, 4096, Some(mode), false).unwrap();
        assert_eq!(pool.stats().cache_hits, hits + 1, "{mode}");
        drop(again);
    }
    // Foreign buffers never enter a pool.
    let producer = on_metal(device, &iota_f32(64), &[64], StorageMode::Shared);
    let pool = metal::pool(device, Some(StorageMode::Shared)).unwrap();
    let before = pool.stats();
    let imported =
        metal::import_foreign(through_dlpack(&producer), ImportOptions::default()).unwrap();
    drop(imported);
    assert_eq!(pool.stats(), before);
}

#[test]
#[ignore = "needs a Metal device"]
fn host_views_of_shared_memory() {
    let (device, _serial) = gpu();
    let t = on_metal(device, &iota_f32(12), &[3, 4], StorageMode::Shared);
    let row = t.index(0, 1).unwrap();
    let view = metal::host_view(&row).unwrap();
    assert_eq!(view.device(), Device::CPU);
    assert_eq!(view.as_slice::<f32>().unwrap(), &iota_f32(12)[4..8]);
    let contents = t.buffer().host_ptr().unwrap().as_ptr() as usize;
    assert_eq!(
        view.as_slice::<f32>().unwrap().as_ptr() as usize,
        contents + 16,
        "the same bytes"
    );
    let private = metal::copy_to(&t, device, Some(StorageMode::Private)).unwrap();
    assert!(matches!(
        metal::host_view(&private),
        Err(Error::NotHostAccessible { .. })
    ));
    if MANAGED_AVAILABLE {
        let managed = metal::copy_to(&t, device, Some(StorageMode::Managed)).unwrap();
        assert!(matches!(
            metal::host_view(&managed),
            Err(Error::CopyRequired(_))
        ));
    }
}

/// The status agrees with the environment; run once as is and once (by the next test) in a child
/// process with `DLBRIDGE_METAL_RESIDENCY=0`.
#[test]
#[ignore = "needs a Metal device"]
fn residency_status_matches_the_environment() {
    let (device, _serial) = gpu();
    let info = metal::device_info(device).unwrap();
    let off = std::env::var(RESIDENCY_ENV)
        .is_ok_and(|v| metal::residency::parse_env(Some(&v)) == Ok(false));
    if off {
        assert_eq!(info.residency, ResidencyStatus::DisabledByEnvironment);
    } else {
        assert_ne!(info.residency, ResidencyStatus::DisabledByEnvironment);
    }
    // Allocation and GPU work run the same either way.
    let t = on_metal(device, &iota_f32(10), &[10], StorageMode::Private);
    assert_eq!(read::<f32>(&t), iota_f32(10));
}

#[test]
#[ignore = "needs a Metal device"]
fn residency_can_be_turned_off() {
    drop(gpu());
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "--include-ignored",
            "--exact",
            "residency_status_matches_the_environment",
            "--nocapture",
        ])
        .env(RESIDENCY_ENV, "0")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("1 passed"), "{text}");
}

/// Unmaps a file mapping when the last holder lets go, and says so.
struct Mapping {
    addr: *mut libc::c_void,
    len: usize,
    unmapped: Arc<AtomicBool>,
}

// SAFETY: the mapping is plain memory; the struct only unmaps it on drop.
unsafe impl Send for Mapping {}
// SAFETY: shared references do not touch the memory.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` is the mapping made in the test, unmapped only here.
        unsafe { libc::munmap(self.addr, self.len) };
        self.unmapped.store(true, Ordering::SeqCst);
    }
}

#[test]
#[ignore = "needs a Metal device"]
fn no_copy_wrapping_of_an_mmapped_region() {
    let (device, _serial) = gpu();
    let page = metal::device_info(device).unwrap().page_size;
    // A file of 3 pages plus a bit, holding float32 values.
    let n = (3 * page + 400) / 4;
    let values = iota_f32(n);
    let mut path = std::env::temp_dir();
    path.push(format!("dlbridge-metal-{}.bin", std::process::id()));
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    std::fs::write(&path, &bytes).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let len = bytes.len();
    // SAFETY: maps the whole file, shared, read-write; checked for failure below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED);
    std::fs::remove_file(&path).unwrap();
    let unmapped = Arc::new(AtomicBool::new(false));
    let mapping = Arc::new(Mapping {
        addr,
        len,
        unmapped: unmapped.clone(),
    });
    // The "tensors" of the file: a header-like start 100 floats in, and the tail.
    let start = 400;
    let items = [start..start + 4 * 1000, start + 4 * 1000..len];
    let base = addr.cast::<u8>();
    // SAFETY: the file mapping covers `len` bytes and stays mapped until `mapping` is dropped.
    let region = unsafe { metal::wrap_host(device, base, len, &items, false, mapping) }.unwrap();
    let t = region.tensor(start, DType::F32, &[1000]).unwrap();
    // No copy: the tensor's host address is the file mapping's.
    let host = t
        .buffer()
        .host_ptr()
        .unwrap()
        .as_ptr()
        .wrapping_add(t.byte_offset());
    assert_eq!(host, base.wrapping_add(start));
    assert_eq!(
        t.buffer().host_ptr().unwrap().as_ptr() as usize % page,
        0,
        "whole pages"
    );
    assert_eq!(read::<f32>(&t), values[100..1100]);
    // A write into the mapping is what the GPU reads next.
    // SAFETY: inside the mapping, which is writable; no GPU work is pending on it.
    unsafe { *base.wrapping_add(start).cast::<f32>() = 1234.5 };
    let gpu = metal::copy_to(&t, device, Some(StorageMode::Private)).unwrap();
    assert_eq!(read::<f32>(&gpu)[0], 1234.5);
    // And a GPU write lands in the file's pages.
    let mut tail = region
        .tensor(start + 4000, DType::F32, &[(len - start - 4000) / 4])
        .unwrap();
    let ones = Tensor::from_slice(&vec![1.0f32; tail.numel()], tail.shape()).unwrap();
    let gpu_ones = metal::copy_to(&ones, device, Some(StorageMode::Private)).unwrap();
    // SAFETY: no host reference into the tail is alive.
    unsafe { metal::copy_unchecked(&gpu_ones, &tail).unwrap() };
    metal::synchronize(device).unwrap();
    // SAFETY: the last float of the mapping, after the GPU work completed.
    let last = unsafe { *base.wrapping_add(len - 4).cast::<f32>() };
    assert_eq!(last, 1.0);
    assert!(
        tail.as_mut_slice::<f32>().is_err(),
        "the region still shares the buffer"
    );
    // Misaligned and straddling views are refused.
    assert!(matches!(
        region.tensor(start + 2, DType::F32, &[4]),
        Err(Error::Misaligned(_))
    ));
    assert!(region.tensor(0, DType::F32, &[n + 1]).is_err());
    // The mapping is released once Metal lets the buffers go.
    drop((t, tail, gpu, region));
    metal::synchronize(device).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !unmapped.load(Ordering::SeqCst) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        unmapped.load(Ordering::SeqCst),
        "the deallocator released the mapping"
    );
}

#[test]
#[ignore = "needs a Metal device"]
fn import_shares_host_visible_buffers() {
    let (device, _serial) = gpu();
    for mode in modes().into_iter().filter(|&m| m != StorageMode::Private) {
        let producer = on_metal(device, &iota_f32(24), &[4, 6], mode);
        let view = producer.slice(1, SliceArg::range(2, 5)).unwrap();
        let refs = producer.buffer().ref_count();
        let foreign = through_dlpack(&view);
        assert_eq!(foreign.buffer().handle(), producer.buffer().handle());
        assert_eq!(foreign.byte_offset(), view.byte_offset());
        let imported = metal::import_foreign(foreign, ImportOptions::default()).unwrap();
        assert_eq!(
            producer.buffer().ref_count(),
            refs + 1,
            "the import keeps the producer's export alive"
        );
        assert_eq!(
            imported.buffer().handle(),
            producer.buffer().handle(),
            "zero-copy"
        );
        assert_eq!(imported.buffer().storage_mode(), mode);
        assert_eq!(imported.buffer().host_ptr(), producer.buffer().host_ptr());
        assert_eq!(imported.byte_offset(), view.byte_offset());
        assert_eq!(read::<f32>(&imported), read::<f32>(&view));
        // A write through the producer is what the import reads.
        let mut row = Tensor::from_slice(&[99.0f32; 3], &[3]).unwrap();
        row = metal::copy_to(&row, device, Some(StorageMode::Private)).unwrap();
        // SAFETY: no host reference into the producer is alive.
        unsafe { metal::copy_unchecked(&row, &view.index(0, 0).unwrap()).unwrap() };
        assert_eq!(read::<f32>(&imported)[..3], [99.0; 3]);
        // copy=True: new memory, same values.
        let copied = metal::import_foreign(
            through_dlpack(&view),
            ImportOptions {
                copy: Some(true),
                ..ImportOptions::default()
            },
        )
        .unwrap();
        assert_ne!(copied.buffer().handle(), producer.buffer().handle());
        assert_eq!(copied.buffer().storage_mode(), StorageMode::Shared);
        assert_eq!(
            copied.as_slice::<f32>().unwrap(),
            read::<f32>(&view).as_slice()
        );
        assert_eq!(
            producer.buffer().ref_count(),
            refs + 1,
            "the copy let its producer go"
        );
        drop(imported);
        assert_eq!(
            producer.buffer().ref_count(),
            refs,
            "and so does the shared import, once"
        );
    }
}

#[test]
#[ignore = "needs a Metal device"]
fn import_copies_private_buffers() {
    let (device, _serial) = gpu();
    let producer = on_metal(device, &iota_f32(24), &[4, 6], StorageMode::Private);
    let view = producer.transpose().unwrap();
    let imported = metal::import_foreign(through_dlpack(&view), ImportOptions::default()).unwrap();
    assert_ne!(imported.buffer().handle(), producer.buffer().handle());
    assert_eq!(imported.buffer().storage_mode(), StorageMode::Shared);
    assert!(imported.is_contiguous());
    assert_eq!(
        imported.as_slice::<f32>().unwrap(),
        read::<f32>(&view).as_slice()
    );
    let refused = metal::import_foreign(
        through_dlpack(&view),
        ImportOptions {
            copy: Some(false),
            ..ImportOptions::default()
        },
    );
    assert!(
        matches!(refused, Err(Error::CopyRequired(_))),
        "{refused:?}"
    );
    // A dtype change converts, from private and shared producers alike.
    for mode in modes() {
        let p = on_metal(device, &iota_f32(6), &[6], mode);
        let converted = metal::import_foreign(
            through_dlpack(&p),
            ImportOptions {
                dtype: Some(DType::F64),
                ..ImportOptions::default()
            },
        )
        .unwrap();
        assert_eq!(converted.dtype(), DType::F64);
        let expected: Vec<f64> = iota_f32(6).iter().map(|&v| f64::from(v)).collect();
        assert_eq!(converted.as_slice::<f64>().unwrap(), expected.as_slice());
    }
}

#[test]
#[ignore = "needs a Metal device"]
fn import_checks_the_real_buffer() {
    let (device, _serial) = gpu();
    let producer = on_metal(device, &iota_f32(16), &[16], StorageMode::Shared);
    metal::synchronize(device).unwrap();
    let exported = producer.to_dlpack_versioned(VERSION, false);
    // A descriptor that claims more elements than the id<MTLBuffer> holds.
    // SAFETY: the export is live and ours.
    let shape = unsafe { (*exported.as_ptr()).dl_tensor.shape };
    // SAFETY: the export's shape array has one entry, which it owns.
    unsafe { *shape = 1 << 20 };
    // SAFETY: a live export whose ownership passes to the importer.
    let claimed = unsafe { Tensor::from_dlpack_versioned(exported) }.unwrap();
    let err = metal::import_foreign(claimed, ImportOptions::default()).unwrap_err();
    assert!(
        matches!(err, Error::OutOfBounds(ref m) if m.contains("id<MTLBuffer> holds")),
        "{err}"
    );
    // Not a Metal tensor at all.
    let cpu = Tensor::zeros(&[2], DType::F32, Device::CPU).unwrap();
    assert!(matches!(
        metal::import_foreign(cpu, ImportOptions::default()),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs a Metal device"]
fn export_hands_out_the_buffer_and_offset() {
    let (device, _serial) = gpu();
    let t = on_metal(device, &iota_f32(12), &[3, 4], StorageMode::Private);
    let row = t.index(0, 2).unwrap();
    metal::synchronize(device).unwrap();
    let exported = row.to_dlpack_versioned(VERSION, false);
    // SAFETY: a live export; read, then released through its deleter.
    let dl = unsafe { &(*exported.as_ptr()).dl_tensor };
    assert_eq!(dl.data, t.buffer().handle(), "data is the id<MTLBuffer>");
    assert_eq!(dl.byte_offset, 32);
    assert_eq!(dl.device.device_type, dlbridge::dlpack::ffi::K_DL_METAL);
    // SAFETY: the export is ours and released once.
    unsafe { dlbridge::dlpack::release_versioned(exported) };
}

/// A safetensors file written byte by byte (`save_file` orders tensors so that every one is
/// aligned): `u8` "a" [1, 2, 3], then `f32` "b" [1.5, -2.0] three bytes in, misaligned for its
/// elements, then an empty `f32` "e".
fn misaligned_safetensors(path: &std::path::Path) {
    let mut header = String::from(
        r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"F32","shape":[2],"data_offsets":[3,11]},"e":{"dtype":"F32","shape":[0],"data_offsets":[11,11]}}"#,
    );
    while (8 + header.len()) % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[1, 2, 3]);
    for v in [1.5f32, -2.0] {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
#[ignore = "needs a Metal device"]
fn checkpoint_loads_as_views_of_the_mapped_file() {
    use dlbridge::safetensors::{Checkpoint, LoadOptions, save_file};
    let (device, _serial) = gpu();
    let page = metal::device_info(device).unwrap().page_size;
    let dir = std::env::temp_dir().join(format!("dlbridge-metal-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Several pages of weights, and small tensors that share pages with them and the header.
    let n = 3 * page / 4 + 77;
    let w = Tensor::from_slice(&iota_f32(n), &[n]).unwrap();
    let bias = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 4.0, 8.0, -0.25, 3.0], &[7]).unwrap();
    let idx = Tensor::from_slice(&[5i64, -6, 7, 8, 9], &[5]).unwrap();
    let saved = dir.join("model-00001-of-00002.safetensors");
    save_file(&[("w", &w), ("bias", &bias), ("idx", &idx)], None, &saved).unwrap();
    let odd = dir.join("model-00002-of-00002.safetensors");
    misaligned_safetensors(&odd);
    let checkpoint = Checkpoint::open_files(&[&saved, &odd]).unwrap();
    // Gone before the loads: they use the mapped pages, never a read of the files (the reader
    // would fail to open them).
    std::fs::remove_dir_all(&dir).unwrap();
    let load = |storage: Option<StorageMode>, copy: bool, dtype: Option<DType>| {
        let options = LoadOptions {
            storage,
            copy,
            dtype,
            ..LoadOptions::new(device)
        };
        checkpoint
            .load_to(|_| true, &options, &mut |_, _| {})
            .unwrap()
    };
    let cpu = checkpoint
        .load_to(|_| true, &LoadOptions::new(Device::CPU), &mut |_, _| {})
        .unwrap();
    let same_values = |loaded: &std::collections::BTreeMap<String, Tensor>| {
        assert_eq!(read::<f32>(&loaded["w"]), cpu["w"].to_vec::<f32>().unwrap());
        assert_eq!(
            read::<f32>(&loaded["bias"]),
            cpu["bias"].to_vec::<f32>().unwrap()
        );
        assert_eq!(
            read::<i64>(&loaded["idx"]),
            cpu["idx"].to_vec::<i64>().unwrap()
        );
        assert_eq!(read::<u8>(&loaded["a"]), vec![1, 2, 3]);
        assert_eq!(read::<f32>(&loaded["b"]), vec![1.5, -2.0]);
        assert_eq!(loaded["e"].numel(), 0);
        for t in loaded.values() {
            assert_eq!(t.device(), device);
        }
    };

    // Shared storage: read-only views of the mapped pages, each at its file offset.
    let shared = load(Some(StorageMode::Shared), false, None);
    same_values(&shared);
    for name in ["w", "bias", "idx", "a"] {
        let t = &shared[name];
        let (shard, info) = checkpoint.info(name).unwrap();
        let in_file = shard
            .buffer()
            .host_ptr()
            .unwrap()
            .as_ptr()
            .wrapping_add(info.byte_range().start as usize);
        let contents = t.buffer().host_ptr().unwrap().as_ptr();
        assert_eq!(
            contents.wrapping_add(t.byte_offset()),
            in_file,
            "{name}: no copy"
        );
        assert_eq!(
            contents as usize % page,
            0,
            "{name}: whole pages are wrapped"
        );
        assert!(t.buffer().is_foreign(), "{name}: the file's memory");
        assert!(t.is_read_only(), "{name}: the mapping is read-only");
        assert_eq!(t.buffer().storage_mode(), StorageMode::Shared);
    }
    assert!(
        !shared["b"].buffer().is_foreign(),
        "misaligned bytes are copied"
    );
    let ones = on_metal(device, &[1.0; 7], &[7], StorageMode::Private);
    // SAFETY: no host reference into the view is alive.
    let write = unsafe { metal::copy_unchecked(&ones, &shared["bias"]) };
    assert!(matches!(write, Err(Error::ReadOnly(_))), "{write:?}");
    // The GPU reads the file's pages: a blit of a view into private memory.
    let blitted = metal::copy_to(&shared["w"], device, Some(StorageMode::Private)).unwrap();
    assert_eq!(read::<f32>(&blitted), iota_f32(n));

    // Private and managed storage, or a copy asked for: memory of their own, by a GPU blit.
    let mut own = vec![
        (Some(StorageMode::Private), false),
        (Some(StorageMode::Shared), true),
    ];
    if MANAGED_AVAILABLE {
        own.push((Some(StorageMode::Managed), false));
    }
    for (storage, copy) in own {
        let loaded = load(storage, copy, None);
        same_values(&loaded);
        for (name, t) in &loaded {
            assert_eq!(t.buffer().storage_mode(), storage.unwrap(), "{name}");
            assert!(!t.buffer().is_foreign(), "{name}: {storage:?} copy={copy}");
            assert!(!t.is_read_only(), "{name}: writable");
        }
    }

    // A dtype conversion runs after the load, on the device.
    let halves = load(None, false, Some(DType::F16));
    assert_eq!(halves["bias"].dtype(), DType::F16);
    assert_eq!(
        halves["idx"].dtype(),
        DType::I64,
        "integers are not converted"
    );
    let back = halves["bias"].cast(DType::F32).unwrap();
    assert_eq!(read::<f32>(&back), cpu["bias"].to_vec::<f32>().unwrap());

    // The views keep the mapping alive after the checkpoint is gone.
    drop((checkpoint, cpu));
    assert_eq!(read::<f32>(&shared["w"]), iota_f32(n));
}
