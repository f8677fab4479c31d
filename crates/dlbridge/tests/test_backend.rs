//! The backend seam: one body per test, instantiated for every host-memory backend of the build.
//! The CPU always; with feature `test-backend`, also `backend/extdev`, host memory presented as
//! DLPack's `kDLExtDev`, which the core knows only through its table of facts and the `Backend`
//! trait. These are the shared exchange, copy, pool and share tests: a backend that passes them
//! plugs into the core without the core naming it.
//!
//! Run the second instantiation with `cargo test -p dlbridge --features test-backend --test
//! test_backend`. The cross-process test re-runs this binary as the other process (`CHILD`).

mod common;

use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;

use common::{export_versioned, round_trip};
use dlbridge::backend::{self, ShareRoute};
use dlbridge::share::{self, SharedKind};
use dlbridge::{DType, Device, Error, SliceArg, Tensor};

/// The environment variable naming a child's role.
const CHILD: &str = "DLBRIDGE_SEAM_CHILD";
/// The environment variable naming the socket a child connects to.
const SOCKET: &str = "DLBRIDGE_SEAM_SOCKET";

/// `n` f32 values 0, 1, 2, ... on `device`.
fn iota(device: Device, n: usize, shape: &[usize]) -> Tensor {
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    Tensor::from_slice(&values, shape)
        .unwrap()
        .copy_to(device)
        .unwrap()
}

/// The address of the view's first element.
fn first(t: &Tensor) -> usize {
    t.buffer().host_ptr().unwrap().as_ptr() as usize + t.byte_offset()
}

/// The pool test reads the figures of a pool the whole process shares and sets its memory limit:
/// the tests of this binary run one at a time, so that no other test allocates there meanwhile (it
/// failed about one run in five with them in parallel).
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Allocation on the device lands in its own pool: figures, reuse of a cached block, the memory
/// limit, and emptying the cache.
fn pool(device: Device) {
    backend::empty_cache(device).unwrap();
    let pool = backend::pool_for(device, None).unwrap();
    let before = pool.stats();
    let t = Tensor::zeros(&[256, 4], DType::F32, device).unwrap();
    assert_eq!(t.device(), device);
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.0; 1024]);
    let during = backend::memory_stats(device).unwrap();
    assert!(
        during.active_bytes >= before.active_bytes + 4096,
        "{during:?}"
    );
    drop(t);
    let hits = pool.stats().cache_hits;
    let again = Tensor::empty(&[1024], DType::F32, device).unwrap();
    assert_eq!(
        pool.stats().cache_hits,
        hits + 1,
        "a cached block serves the same size"
    );
    drop(again);
    backend::set_memory_limit(device, Some(pool.stats().active_bytes + 4096)).unwrap();
    let refused = Tensor::empty(&[1 << 20], DType::F32, device);
    backend::set_memory_limit(device, None).unwrap();
    assert!(
        matches!(refused, Err(Error::OutOfMemory { .. })),
        "{refused:?}"
    );
    backend::empty_cache(device).unwrap();
    assert_eq!(pool.stats().cached_bytes, 0);
    assert_eq!(
        backend::storage_mode(device).unwrap().mode,
        dlbridge::StorageMode::Shared
    );
}

/// Copies to and from the CPU and within the device, of compact and strided views.
fn copies(device: Device) {
    let t = iota(device, 12, &[3, 4]);
    assert_eq!(t.device(), device);
    let column = t.slice(1, SliceArg::range(1, 3)).unwrap(); // strided: [3, 2] of [3, 4]
    let back = column.copy_to(Device::CPU).unwrap();
    assert_eq!(
        back.to_vec::<f32>().unwrap(),
        vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]
    );
    let transposed = t.transpose().unwrap().copy_to(device).unwrap();
    assert_eq!(transposed.device(), device);
    assert_eq!(
        transposed.to_vec::<f32>().unwrap(),
        vec![0.0, 4.0, 8.0, 1.0, 5.0, 9.0, 2.0, 6.0, 10.0, 3.0, 7.0, 11.0]
    );
    let mut dst = Tensor::zeros(&[3, 2], DType::F32, device).unwrap();
    dst.copy_from(&column).unwrap();
    assert_eq!(
        dst.to_vec::<f32>().unwrap(),
        vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]
    );
}

/// A DLPack export names the device and the view's address; importing it back is the same
/// memory (a write through one side shows on the other), and the export's deleter runs once.
fn exchange(device: Device) {
    let t = iota(device, 12, &[3, 4]);
    let view = t.slice(1, SliceArg::range(1, 3)).unwrap();
    {
        let e = export_versioned(&view, false);
        let dl = e.dl();
        assert_eq!(dl.device.device_type, device.kind().to_raw());
        assert_eq!(dl.device.device_id, device.index() as i32);
        assert_eq!(dl.data as usize + dl.byte_offset as usize, first(&view));
    }
    for legacy in [false, true] {
        let back = round_trip(&view, legacy).unwrap();
        assert_eq!(back.device(), device);
        assert_eq!(first(&back), first(&view), "zero-copy");
        assert_eq!(back.strides(), view.strides());
        let mut compact = round_trip(&t, legacy).unwrap();
        compact.as_mut_slice::<f32>().unwrap()[5] = 50.0 + legacy as u8 as f32;
        assert_eq!(t.to_vec::<f32>().unwrap()[5], 50.0 + legacy as u8 as f32);
    }
}

/// A shared handle of the device's memory opens as the same memory (a new mapping of its file),
/// on the same device.
fn share_here(device: Device) {
    let t = share::to_shareable(&iota(device, 6, &[2, 3])).unwrap();
    assert!(share::is_shared(&t));
    let column = t.slice(1, SliceArg::range(1, 2)).unwrap();
    let handle = share::share(&column, false).unwrap();
    assert_eq!(handle.device(), device);
    assert_eq!(handle.kind(), SharedKind::HostFile);
    let opened = share::open(handle).unwrap();
    assert_eq!(opened.device(), device);
    assert_eq!(opened.to_vec::<f32>().unwrap(), vec![1.0, 4.0]);
    // The same memory: a write through a whole opened view shows in the original.
    let mut whole = share::open(share::share(&t, false).unwrap()).unwrap();
    whole.as_mut_slice::<f32>().unwrap()[4] = 40.0;
    assert_eq!(
        t.to_vec::<f32>().unwrap(),
        vec![0.0, 1.0, 2.0, 3.0, 40.0, 5.0]
    );
    // Memory that is not shareable is refused without a copy, and copied with one.
    let private = iota(device, 4, &[4]);
    assert!(matches!(
        share::share(&private, false),
        Err(Error::CopyRequired(_))
    ));
    let copied = share::open(share::share(&private, true).unwrap()).unwrap();
    assert_eq!(copied.device(), device);
    assert_eq!(copied.to_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0, 3.0]);
}

/// Across processes: the child opens the handle on the same device kind and writes into it; the
/// parent sees the write.
fn share_across(device: Device, test: &str) {
    if let Ok(role) = std::env::var(CHILD) {
        if role == test {
            let socket = UnixStream::connect(std::env::var(SOCKET).unwrap()).unwrap();
            let handle = share::recv_handle(&socket).unwrap();
            let mut t = share::open(handle).unwrap();
            assert_eq!(t.device(), device);
            assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0, 3.0]);
            t.as_mut_slice::<f32>().unwrap()[3] = 30.0;
        }
        return;
    }
    let path =
        std::env::temp_dir().join(format!("dlbridge-seam-{}-{test}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture"])
        .env(CHILD, test)
        .env(SOCKET, &path)
        .spawn()
        .unwrap();
    let (socket, _) = listener.accept().unwrap();
    let t = share::to_shareable(&iota(device, 4, &[4])).unwrap();
    share::send_handle(&socket, share::share(&t, false).unwrap()).unwrap();
    let status = child.wait().unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(status.success(), "the child failed: {status}");
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0, 30.0]);
}

/// Compute and kernels go through the trait too: a backend without them answers a typed error.
fn compute_or_typed_error(device: Device) {
    let t = iota(device, 4, &[4]);
    match dlbridge::compute::binary(dlbridge::compute::BinaryOp::Add, &t, &t) {
        Ok(sum) => assert_eq!(sum.to_vec::<f32>().unwrap(), vec![0.0, 2.0, 4.0, 6.0]),
        Err(e) => assert!(matches!(e, Error::BackendUnavailable { .. }), "{e:?}"),
    }
}

/// One `#[test]` per body and device.
macro_rules! on_device {
    ($module:ident, $device:expr) => {
        mod $module {
            use super::*;

            #[test]
            fn pool() {
                let _serial = super::serial();
                super::pool($device);
            }

            #[test]
            fn copies() {
                let _serial = super::serial();
                super::copies($device);
            }

            #[test]
            fn exchange() {
                let _serial = super::serial();
                super::exchange($device);
            }

            #[test]
            fn share_here() {
                let _serial = super::serial();
                super::share_here($device);
            }

            #[test]
            fn share_across() {
                let _serial = super::serial();
                super::share_across($device, concat!(stringify!($module), "::share_across"));
            }

            #[test]
            fn compute_or_typed_error() {
                let _serial = super::serial();
                super::compute_or_typed_error($device);
            }
        }
    };
}

on_device!(cpu, Device::CPU);

/// DLPack's `kDLExtDev`, device 1 (the test backend has two).
#[cfg(feature = "test-backend")]
const EXT_DEV: Device = Device::new(
    dlbridge::DeviceKind::Other(dlbridge::dlpack::ffi::K_DL_EXT_DEV),
    1,
);

#[cfg(feature = "test-backend")]
on_device!(ext_dev, EXT_DEV);

/// The core learns the test backend's kind from its table alone.
#[cfg(feature = "test-backend")]
#[test]
fn the_test_backends_facts_come_from_its_table() {
    let facts = backend::facts(EXT_DEV.kind()).expect("registered");
    assert!(facts.addressable && facts.host_accessible && !facts.streams);
    assert_eq!(facts.sharing, ShareRoute::HostFile { registered: false });
    assert_eq!(
        dlbridge::compute::Backend::new(EXT_DEV)
            .unwrap()
            .device_count(),
        2
    );
    assert!(matches!(
        Tensor::zeros(&[1], DType::F32, Device::new(EXT_DEV.kind(), 2)),
        Err(Error::BackendUnavailable { .. })
    ));
    // A kind no backend serves is held opaquely: no facts, no allocation.
    let other = dlbridge::DeviceKind::Other(dlbridge::dlpack::ffi::K_DL_VULKAN);
    assert!(backend::facts(other).is_none());
}

/// Every built-in kind has its facts, and they say what the DLPack kinds are.
#[test]
fn the_built_in_facts() {
    use dlbridge::DeviceKind::*;
    for kind in [Cpu, Cuda, CudaHost, CudaManaged, Metal] {
        let facts = backend::facts(kind).expect("a built-in kind");
        assert_eq!(facts.kind, kind);
        assert_eq!(facts.host_accessible, kind.is_host_accessible(), "{kind:?}");
        assert_eq!(facts.addressable, kind.is_addressable(), "{kind:?}");
        assert_eq!(facts.streams, kind.is_cuda(), "{kind:?}");
    }
    assert_eq!(
        backend::facts(Cpu).unwrap().sharing,
        ShareRoute::HostFile { registered: false }
    );
    assert_eq!(backend::facts(Cuda).unwrap().sharing, ShareRoute::Device);
    assert_eq!(
        backend::placement(Device::cuda(1), Some(dlbridge::StorageMode::Managed)).unwrap(),
        Device::cuda_managed(1)
    );
    assert!(
        backend::placement(Device::cuda_host(0), Some(dlbridge::StorageMode::Private)).is_err()
    );
}
