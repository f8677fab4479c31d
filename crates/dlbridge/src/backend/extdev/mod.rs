//! A test-only backend: host memory presented as its own DLPack device kind, `kDLExtDev` (12),
//! compiled with feature `test-backend`. It exists to prove the seam: everything it needs is in
//! this folder, and the rest of the crate knows it only through its two registration lines in
//! `backend/mod.rs` (its `mod` line and its entry in the list of backends). `tests/test_backend.rs`
//! runs the shared exchange, copy, pool and share tests on it.
//!
//! | concept | here |
//! | --- | --- |
//! | device | `Device::new(DeviceKind::Other(12), i)`, any index (`ext_dev:i`) |
//! | facts | [`KINDS`]: addressable, host-accessible, always shared storage, shared with other processes through anonymous shared files, no streams |
//! | allocation | one caching [`Pool`] per device over the host allocator |
//! | copies | the host's strided copy, to and from the CPU and between its devices |
//! | DLPack | exported and imported as `kDLExtDev` with a host address, by the core alone |
//! | compute, kernels | none: the trait's defaults answer [`Error::BackendUnavailable`] |
//! | loading | the host's parallel reads; a read session keeps their threads ([`HostReader`]) |

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::backend::cpu::{HostAllocator, copy_host};
use crate::backend::{
    Backend, DeviceReader, FileRead, HostReader, KindFacts, ReadOptions, ShareRoute, Storage,
    lacks, no_stream_here, unreachable_copy,
};
use crate::buffer::{Buffer, StorageMode};
use crate::compute::{MapRequest, MatmulRequest, ReduceRequest};
use crate::device::{Device, DeviceKind};
use crate::error::Result;
use crate::pool::Pool;
use crate::storage;
use crate::tensor::Tensor;

/// DLPack's `kDLExtDev`.
const EXT_DEV: DeviceKind = DeviceKind::Other(crate::dlpack::ffi::K_DL_EXT_DEV);

/// The one kind this backend serves.
const KINDS: &[KindFacts] = &[KindFacts {
    kind: EXT_DEV,
    addressable: true,
    host_accessible: true,
    storage: Storage::Always(StorageMode::Shared),
    foreign_storage: StorageMode::Shared,
    sharing: ShareRoute::HostFile { registered: false },
    streams: false,
    faults_on_misaligned: false,
    reads_into: false,
}];

/// How many `ext_dev` devices there are.
const DEVICES: usize = 2;

/// The test backend.
pub(crate) struct ExtDev;

/// The caching pool of `device`, made on first use.
fn pool_of(device: Device) -> &'static Arc<Pool> {
    static POOLS: OnceLock<Mutex<HashMap<Device, &'static Arc<Pool>>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    pools.entry(device).or_insert_with(|| {
        Box::leak(Box::new(Pool::new(
            device,
            StorageMode::Shared,
            HostAllocator,
        )))
    })
}

fn check(device: Device) -> Result<()> {
    if device.index() as usize >= DEVICES {
        return Err(crate::error::Error::BackendUnavailable {
            backend: "ext_dev",
            reason: format!("{device} does not exist ({DEVICES} devices)"),
        });
    }
    Ok(())
}

impl Backend for ExtDev {
    fn name(&self) -> &'static str {
        "ext_dev"
    }

    fn kinds(&self) -> &'static [KindFacts] {
        KINDS
    }

    fn device_count(&self) -> Result<usize> {
        Ok(DEVICES)
    }

    fn allocate(
        &self,
        device: Device,
        bytes: usize,
        storage: Option<StorageMode>,
        zeroed: bool,
    ) -> Result<Buffer> {
        storage::resolve(&KINDS[0], storage)?;
        let pool = self.pool(device, None)?;
        let block = pool.allocate_static(bytes.max(1), None, zeroed)?;
        let ptr = block.as_ptr();
        // SAFETY: the block addresses at least `bytes` host bytes that the host may read and
        // write, and it stays allocated until the boxed block is dropped.
        Ok(unsafe {
            Buffer::from_pooled(
                ptr.as_ptr(),
                ptr.as_ptr().cast::<u8>(),
                bytes,
                device,
                StorageMode::Shared,
                block,
            )
        })
    }

    fn pool(&self, device: Device, storage: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
        check(device)?;
        if storage.is_some() {
            storage::resolve(&KINDS[0], storage)?;
        }
        Ok(pool_of(device))
    }

    fn synchronize(&self, device: Device) -> Result<()> {
        check(device)
    }

    unsafe fn copy(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let ours = |d: Device| d.is_cpu() || d.kind() == EXT_DEV;
        if !ours(dst.device()) || !ours(src.device()) {
            return Err(unreachable_copy(dst, src));
        }
        // SAFETY: forwarded contract; both sides are host memory.
        unsafe { copy_host(dst, src) }
    }

    fn export_handoff(&self, device: Device, stream: Option<i64>) -> Result<()> {
        no_stream_here(device, stream)
    }

    fn read_in(
        &self,
        device: Device,
        reader: &mut Option<Box<dyn DeviceReader>>,
        reads: &[FileRead<'_>],
        options: &ReadOptions<'_>,
    ) -> Result<()> {
        check(device)?;
        HostReader::of(reader, options)?.read(reads, options)
    }

    fn map(&self, _: &MapRequest<'_>) -> Result<()> {
        Err(lacks(self.name(), "kernels"))
    }

    fn reduce(&self, _: &ReduceRequest<'_>) -> Result<()> {
        Err(lacks(self.name(), "kernels"))
    }

    fn matmul(&self, _: &MatmulRequest<'_>) -> Result<()> {
        Err(lacks(self.name(), "kernels"))
    }
}
