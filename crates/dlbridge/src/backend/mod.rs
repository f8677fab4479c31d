//! The seam between device-independent code and the backends.
//!
//! Each backend is a folder that implements `Backend`, the operations every backend has; the
//! rest of the crate reaches them only through the functions here, which pick the backend of a
//! device (`of`, reading the list of backends) and call it. What the core needs to know about a
//! device kind is data, not code: each backend lists its kinds in a table of [`KindFacts`]
//! ([`facts`]), which the core reads where it used to match on [`DeviceKind`].
//!
//! | capability | trait method(s) | default where a backend lacks it |
//! | --- | --- | --- |
//! | identity | `name`, `kinds` (the table) | required |
//! | memory | `allocate`, `pool`, `resolve_storage`, `host_barrier`, `synchronize` | `allocate`, `pool`, `synchronize` required |
//! | copies | `copy` | required |
//! | exchange | `export_handoff`, `validate_foreign`, `resolve_import`, `host_view`, streams | no streams, the producer's word |
//! | queues of work | `queue_after_current`, `record_event` ([`Queue`], [`Event`]) | none: work done when its call returns |
//! | devices | `device_count` | [`Error::BackendUnavailable`] |
//! | built-in kernels | `map`, `reduce`, `reduces`, `matmul` | required (may answer an error) |
//! | run-time kernels | `compile_kernel`, `launch_kernel` | [`Error::BackendUnavailable`] |
//! | across processes | `sharing`, one `Sharing` capability (export, open, IPC events, host registration, releasing kept mappings) | [`Error::BackendUnavailable`] |
//! | loading | `read_file`, `read_in` (a `ReadSession`'s reader, kept across reads), `wrap_host` | parallel reads into host memory; each read of a session a whole `read_file`; no wrapping |
//!
//! A backend that is not compiled in keeps its module's shape through a stub
//! (`cuda/unavailable.rs`, `metal/unavailable.rs`) whose operations answer
//! [`Error::BackendUnavailable`], never a panic; the build script's `cfg(cuda)` / `cfg(metal)` is
//! tested only where a backend's module is chosen.
//!
//! A new backend is a new folder plus two lines here: its `mod` line and its entry in
//! `BACKENDS` (`extdev/`, compiled with feature `test-backend`, is one: host memory as DLPack's
//! `kDLExtDev`, which `tests/test_backend.rs` runs the shared tests on). A backend folder imports
//! the core's types (requests, tensors, buffers, the plain data of `share/handle.rs`), never
//! `share/` or `compute/` behaviour; outside `backend/`, only the host's own pieces of
//! `backend/cpu` are named (its pool, whose blocks `share::cpu` moves into shared files, and the
//! host's page and memory sizes).

pub mod cpu;
#[cfg(cuda)]
pub mod cuda;
#[cfg(not(cuda))]
#[path = "cuda/unavailable.rs"]
pub mod cuda;
#[cfg(feature = "test-backend")]
mod extdev;
pub(crate) mod facts;
pub mod metal;
#[cfg_attr(not(cuda), allow(dead_code))] // the CUDA backend's copy planner
pub(crate) mod plan;
mod queue;
mod reader;

use std::ffi::c_void;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::buffer::{Buffer, StorageMode};
use crate::compute::kernel::{Kernel, KernelArg, LaunchConfig, LaunchTiming};
use crate::compute::{MapRequest, MatmulRequest, ReduceOp, ReduceRequest};
use crate::device::{Device, DeviceKind};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::pool::{MemoryStats, Pool};
use crate::share::handle::{BlockKey, IPC_HANDLE_BYTES, LegacyExported, VmmExported};
use crate::storage::{self, Resolved};
use crate::tensor::Tensor;
pub use facts::{KindFacts, Placement, ShareRoute, Storage};
#[cfg_attr(not(cuda), allow(unused_imports))] // CUDA's streams and events implement them
pub(crate) use queue::{DeviceEvent, DeviceQueue};
pub use queue::{Entered, Event, Queue};
#[cfg(all(test, feature = "test-backend"))]
pub(crate) use reader::STREAM_CREW_THREADS;
#[cfg_attr(not(cuda), allow(unused_imports))] // the readers CUDA and the test backend keep
pub(crate) use reader::{Crew, DeviceReader, HostReader, ReadSession};

/// The backends of this build, in the order [`of`] asks them which kinds they serve. A new
/// backend is a folder, its `mod` line above and its line here.
const BACKENDS: &[&dyn Backend] = &[
    &cpu::Cpu,
    &cuda::Cuda,
    &metal::Metal,
    #[cfg(feature = "test-backend")]
    &extdev::ExtDev,
];

/// The operations every backend has. One unit type per backend implements it (`cpu::Cpu`,
/// `cuda::Cuda`, `metal::Metal`); [`of`] picks the one for a device.
pub(crate) trait Backend: Sync {
    /// The backend's name, as errors say it (`CPU`, `CUDA`, `Metal`).
    fn name(&self) -> &'static str;

    /// The device kinds this backend serves and their facts; the first is the backend's own
    /// device kind (the one [`crate::compute::Backend`] runs on).
    fn kinds(&self) -> &'static [KindFacts];

    /// How many devices the backend has here (device indices `0..n`).
    fn device_count(&self) -> Result<usize> {
        Err(lacks(self.name(), "a device list"))
    }

    /// Compiles `source` for `device` and returns its entry point `name`
    /// ([`crate::compute::kernel::compile`]).
    fn compile_kernel(
        &self,
        _device: Device,
        _source: &str,
        _name: &str,
        _options: &[String],
    ) -> Result<Kernel> {
        Err(lacks(self.name(), "run-time kernels"))
    }

    /// Launches a kernel [`Backend::compile_kernel`] made and waits for it
    /// ([`crate::compute::kernel::launch`]).
    fn launch_kernel(
        &self,
        _kernel: &Kernel,
        _config: LaunchConfig,
        _args: &[KernelArg],
    ) -> Result<LaunchTiming> {
        Err(lacks(self.name(), "run-time kernels"))
    }

    /// The backend's cross-process sharing of device memory ([`Sharing`]), for kinds whose
    /// facts say [`ShareRoute::Device`] or a registered [`ShareRoute::HostFile`].
    fn sharing(&self) -> Result<&'static dyn Sharing> {
        Err(lacks(self.name(), "memory shared with other processes"))
    }

    /// Allocates `bytes` on `device` (zero-filled when `zeroed`) in `storage` (`None`: the
    /// environment's or the device's default, [`storage::resolve`]).
    fn allocate(
        &self,
        device: Device,
        bytes: usize,
        storage: Option<StorageMode>,
        zeroed: bool,
    ) -> Result<Buffer>;

    /// The pool that serves allocations on `device` in `storage` (`None`: the one the device
    /// names).
    fn pool(&self, device: Device, storage: Option<StorageMode>) -> Result<&'static Arc<Pool>>;

    /// The storage mode an allocation on `device` asking for `requested` gets.
    fn resolve_storage(&self, device: Device, requested: Option<StorageMode>) -> Result<Resolved> {
        self.pool(device, None)?;
        storage::resolve(kind_facts(device)?, requested)
    }

    /// Waits until dlbridge's pending work on `device` has finished.
    fn synchronize(&self, device: Device) -> Result<()>;

    /// Waits until the host may read or write `device`'s memory.
    fn host_barrier(&self, _device: Device) -> Result<()> {
        Ok(())
    }

    /// Checks `len` bytes at `addr` that a DLPack producer says live on `device`, where the
    /// backend can.
    fn validate_foreign(&self, _device: Device, _addr: usize, _len: usize) -> Result<()> {
        Ok(())
    }

    /// Copies between two views of one shape and dtype, one of which is on this backend's device
    /// (the other on it too, or on the CPU).
    ///
    /// # Safety
    /// As [`Tensor::copy_from_unchecked`].
    unsafe fn copy(&self, dst: &Tensor, src: &Tensor) -> Result<()>;

    /// Before a tensor on `device` leaves for a DLPack consumer: makes dlbridge's pending work
    /// visible to it, on the consumer's `stream` where the device has streams.
    fn export_handoff(&self, device: Device, stream: Option<i64>) -> Result<()>;

    /// Resolves a producer's tensor whose memory is an opaque handle into one dlbridge can use.
    fn resolve_import(&self, tensor: Tensor, _copy: Option<bool>) -> Result<Tensor> {
        Ok(tensor)
    }

    /// A host view of `tensor`'s memory, where the backend has one to give without a copy.
    fn host_view(&self, _tensor: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// The calling thread's current stream on `device` (`0`: the default, or none).
    fn current_stream(&self, _device: Device) -> usize {
        0
    }

    /// Makes our current stream on `device` wait for a producer's stream.
    fn order_after_producer(&self, _device: Device, _producer: usize) -> Result<()> {
        Ok(())
    }

    /// A new queue of `device`'s work that starts after the work enqueued so far on the calling
    /// thread's current queue there; `None` where the device has no queues.
    fn queue_after_current(&self, _device: Device) -> Result<Option<Queue>> {
        Ok(None)
    }

    /// An event recorded on the calling thread's current queue of `device`; `None` where the
    /// device has no queues.
    fn record_event(&self, _device: Device) -> Result<Option<Event>> {
        Ok(None)
    }

    /// Runs an element-wise kernel ([`crate::compute`]).
    fn map(&self, req: &MapRequest<'_>) -> Result<()>;

    /// Runs a reduction ([`crate::compute`]).
    fn reduce(&self, req: &ReduceRequest<'_>) -> Result<()>;

    /// Whether [`Backend::reduce`] has a kernel for `op`; the front composes the others of the
    /// built-in kernels (by default those it can: the arg reductions, `var` and `std`).
    fn reduces(&self, op: ReduceOp) -> bool {
        !op.has_fallback()
    }

    /// Runs a batched matrix product ([`crate::compute`]).
    fn matmul(&self, req: &MatmulRequest<'_>) -> Result<()>;

    /// Reads ranges of files into memory of `device` (the loaders' path from disk): by default
    /// straight into host-accessible destinations with parallel positioned reads.
    fn read_file(
        &self,
        _device: Device,
        reads: &[FileRead<'_>],
        options: &ReadOptions<'_>,
    ) -> Result<()> {
        read_to_host(reads, options)
    }

    /// Reads as [`Backend::read_file`] does, with the reader the session keeps in `reader` (made
    /// at its first read, kept until the session ends): the device's copies may still run when it
    /// returns ([`DeviceReader`]). By default each read is a whole [`Backend::read_file`].
    fn read_in(
        &self,
        device: Device,
        _reader: &mut Option<Box<dyn DeviceReader>>,
        reads: &[FileRead<'_>],
        options: &ReadOptions<'_>,
    ) -> Result<()> {
        self.read_file(device, reads, options)
    }

    /// Makes byte ranges `items` of `host`, a CPU buffer (a file's read-only mapping, say),
    /// addressable by `device` without a copy: item by item, the device buffer that holds it and
    /// the byte offset of its start there. The device buffers keep `host` alive and are as
    /// read-only as it is. `None` where the backend cannot share host memory so (the caller
    /// copies instead); an error where it could but this time did not.
    fn wrap_host(
        &self,
        _device: Device,
        _host: &Buffer,
        _items: &[Range<usize>],
    ) -> Option<Result<Vec<(Buffer, usize)>>> {
        None
    }
}

/// One range of a file headed for a buffer: `len` bytes at `offset` of `file` (or of `direct`, the
/// same file opened for direct I/O, where that is wanted) land at `dst_offset` in `dst`.
#[derive(Clone, Copy)]
pub(crate) struct FileRead<'a> {
    /// The file's path, for errors.
    pub(crate) path: &'a std::path::Path,
    /// The file, opened for buffered reads.
    pub(crate) file: &'a std::fs::File,
    /// The file opened with `O_DIRECT`, to read around the page cache (only the CUDA reader,
    /// whose staging buffers are page-aligned, uses it).
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) direct: Option<&'a std::fs::File>,
    /// Where the range starts in the file.
    pub(crate) offset: u64,
    /// Its length.
    pub(crate) len: usize,
    /// The destination allocation.
    pub(crate) dst: &'a Buffer,
    /// Where the range lands in it.
    pub(crate) dst_offset: usize,
}

impl FileRead<'_> {
    /// The error of a read that met the end of the file at byte `at` while reading file bytes
    /// `range`: the file shrank after its header was read.
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) fn ended_at(&self, at: u64, range: std::ops::Range<u64>) -> Error {
        Error::Io {
            path: self.path.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "the file ended at byte {at} while reading bytes {}..{} (was it truncated \
                     while loading?)",
                    range.start, range.end
                ),
            ),
        }
    }
}

/// One piece of a [`FileRead`], at most one read's size long: what a reader worker takes at a
/// time.
#[derive(Clone, Copy)]
pub(crate) struct Piece {
    /// The index of its read.
    pub(crate) read: usize,
    /// Offset of the piece inside its read.
    pub(crate) start: usize,
    /// Its length.
    pub(crate) len: usize,
}

/// `reads` cut into pieces of at most `chunk` bytes, in order.
pub(crate) fn pieces(reads: &[FileRead<'_>], chunk: usize) -> Vec<Piece> {
    let chunk = chunk.max(1);
    reads
        .iter()
        .enumerate()
        .flat_map(|(read, r)| {
            (0..r.len.div_ceil(chunk)).map(move |k| Piece {
                read,
                start: k * chunk,
                len: chunk.min(r.len - k * chunk),
            })
        })
        .collect()
}

/// How many pieces [`pieces`] cuts `reads` into (without making them).
pub(crate) fn piece_count(reads: &[FileRead<'_>], chunk: usize) -> usize {
    let chunk = chunk.max(1);
    reads.iter().map(|r| r.len.div_ceil(chunk)).sum()
}

/// How [`read_file`] reads.
pub(crate) struct ReadOptions<'a> {
    /// Reader threads.
    pub(crate) threads: usize,
    /// The largest read (and staging buffer), in bytes.
    pub(crate) chunk: usize,
    /// Whether the CUDA reader may copy from the files' pages, mapped and registered with the
    /// driver, where they are read through the page cache (else: pinned staging buffers).
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) register: bool,
    /// Whether the CUDA reader goes through GPUDirect Storage (cuFile): `Some(true)` always (an
    /// error where cuFile cannot be used), `Some(false)` never, `None` for direct reads where
    /// cuFile reads without a host copy (the `nvidia-fs` module is loaded).
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) gds: Option<bool>,
    /// Bytes landed so far, for progress reports.
    pub(crate) done: &'a std::sync::atomic::AtomicU64,
}

/// Reads ranges of files into memory on `device` ([`Backend::read_file`]).
pub(crate) fn read_file(
    device: Device,
    reads: &[FileRead<'_>],
    options: &ReadOptions<'_>,
) -> Result<()> {
    match of(device) {
        Some(backend) => backend.read_file(device, reads, options),
        None => Err(no_memory_of_ours(device)),
    }
}

/// Makes byte ranges of a CPU buffer addressable by `device` without a copy
/// ([`Backend::wrap_host`]); `None` where its backend cannot.
pub(crate) fn wrap_host(
    device: Device,
    host: &Buffer,
    items: &[Range<usize>],
) -> Option<Result<Vec<(Buffer, usize)>>> {
    of(device)?.wrap_host(device, host, items)
}

/// Parallel positioned reads straight into host-accessible destinations.
pub(crate) fn read_to_host(reads: &[FileRead<'_>], options: &ReadOptions<'_>) -> Result<()> {
    let pieces = piece_count(reads, options.chunk);
    read_to_host_on(
        &mut Crew::new(options.threads.clamp(1, pieces.max(1)))?,
        reads,
        options,
    )
}

/// [`read_to_host`] on the threads of `crew`.
pub(crate) fn read_to_host_on(
    crew: &mut Crew,
    reads: &[FileRead<'_>],
    options: &ReadOptions<'_>,
) -> Result<()> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let pieces = pieces(reads, options.chunk);
    let next = AtomicUsize::new(0);
    crew.run(&|_, failed| {
        while !failed.load(Ordering::Relaxed)
            && let Some(&Piece { read, start, len }) =
                pieces.get(next.fetch_add(1, Ordering::Relaxed))
        {
            let r = &reads[read];
            let base = r.dst.require_host("reading a file into it")?;
            // SAFETY: the caller sized `dst` for every read, and pieces of different reads land
            // in disjoint ranges that nothing else touches meanwhile.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    base.as_ptr().wrapping_add(r.dst_offset + start),
                    len,
                )
            };
            r.file
                .read_exact_at(dst, r.offset + start as u64)
                .map_err(|source| Error::Io {
                    path: r.path.to_path_buf(),
                    source,
                })?;
            options.done.fetch_add(len as u64, Ordering::Relaxed);
        }
        Ok(())
    })
}

/// Runs `work` on `threads` threads of a [`Crew`] made for it and returns the first error any of
/// them met. That error also sets the flag each worker is given, which tells the others to stop
/// taking work.
#[cfg_attr(not(cuda), allow(dead_code))] // the CUDA readers' workers
pub(crate) fn run_workers(
    threads: usize,
    work: impl Fn(&std::sync::atomic::AtomicBool) -> Result<()> + Sync,
) -> Result<()> {
    Crew::new(threads)?.run(&|_, failed| work(failed))
}

/// The backend that serves `device`, or `None` for devices dlbridge holds only opaquely.
#[inline]
pub(crate) fn of(device: Device) -> Option<&'static dyn Backend> {
    served(device.kind()).map(|(backend, _)| backend)
}

/// The backend that serves `kind` and the kind's facts.
#[inline]
fn served(kind: DeviceKind) -> Option<(&'static dyn Backend, &'static KindFacts)> {
    BACKENDS.iter().find_map(|&backend| {
        backend
            .kinds()
            .iter()
            .find(|facts| facts.kind == kind)
            .map(|facts| (backend, facts))
    })
}

/// The facts of a device `kind` ([`KindFacts`]), or `None` for kinds no backend of this build
/// serves (a foreign tensor on one is held opaquely).
#[inline]
pub fn facts(kind: DeviceKind) -> Option<&'static KindFacts> {
    served(kind).map(|(_, facts)| facts)
}

/// Whether the host reads and writes memory of `kind` directly, by its backend's facts.
#[inline]
pub(crate) fn host_accessible(kind: DeviceKind) -> bool {
    facts(kind).is_some_and(|f| f.host_accessible)
}

/// Whether a DLPack `data` pointer of `kind` is an address, by its backend's facts.
#[inline]
pub(crate) fn addressable(kind: DeviceKind) -> bool {
    facts(kind).is_some_and(|f| f.addressable)
}

/// Whether memory of `kind` has its storage mode per buffer (Metal), by its backend's facts: a
/// copy within one such device may change the mode.
#[inline]
pub(crate) fn storage_per_buffer(kind: DeviceKind) -> bool {
    facts(kind).is_some_and(|f| matches!(f.storage, Storage::PerBuffer { .. }))
}

/// Whether `kind` has streams, by its backend's facts.
#[inline]
pub(crate) fn has_streams(kind: DeviceKind) -> bool {
    facts(kind).is_some_and(|f| f.streams)
}

/// The facts of `device`'s kind, or the error of a device no backend here allocates on.
pub(crate) fn kind_facts(device: Device) -> Result<&'static KindFacts> {
    facts(device.kind()).ok_or_else(|| no_memory_of_ours(device))
}

/// The error of a backend asked for something it does not have.
fn lacks(backend: &'static str, what: &str) -> Error {
    Error::BackendUnavailable {
        backend,
        reason: format!("it has no {what}"),
    }
}

/// The sharing capability of `device`'s backend ([`Backend::sharing`]).
pub(crate) fn sharing(device: Device) -> Result<&'static dyn Sharing> {
    match of(device) {
        Some(backend) => backend.sharing(),
        None => Err(Error::UnsupportedDevice(format!(
            "arrays on {device} cannot be shared with other processes"
        ))),
    }
}

/// How many devices the backend of `kind` has here ([`Backend::device_count`]).
pub(crate) fn device_count(kind: DeviceKind) -> Result<usize> {
    match served(kind) {
        Some((backend, _)) => backend.device_count(),
        None => Err(Error::UnsupportedDevice(format!(
            "dlbridge has no backend for {} devices",
            kind.name()
        ))),
    }
}

/// The name of the backend that serves `kind` ([`Backend::name`]).
pub(crate) fn name_of(kind: DeviceKind) -> Option<&'static str> {
    served(kind).map(|(backend, _)| backend.name())
}

/// Whether `kind` is its backend's own device kind (the first of its table), the kind a compute
/// backend runs on.
pub(crate) fn is_primary(kind: DeviceKind) -> bool {
    served(kind).is_some_and(|(backend, _)| backend.kinds().first().map(|f| f.kind) == Some(kind))
}

/// Cross-process sharing of a backend's device memory, as `crate::share` asks for it: the
/// shareable pool, exporting an allocation (a POSIX descriptor of a VMM allocation, or a legacy
/// IPC handle), opening one in the receiving process, the events that order the consumer after
/// the producer, the registration of shared host files with the device (pinned memory), and the
/// mappings kept after their last array went. What travels is plain data from `share::handle`.
pub(crate) trait Sharing: Sync {
    /// Fails unless `device` exists here.
    fn check_device(&self, device: Device) -> Result<()>;

    /// Registers `len` bytes of host memory at `ptr` with `device` (pins them for its copies).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is a live mapping of this process that stays mapped until
    /// [`Sharing::host_unregister`].
    unsafe fn host_register(&self, device: Device, ptr: NonNull<c_void>, len: usize) -> Result<()>;

    /// Undoes [`Sharing::host_register`].
    ///
    /// # Safety
    /// `ptr` was registered with `device` by [`Sharing::host_register`] and nothing uses the
    /// registration any more.
    unsafe fn host_unregister(&self, device: Device, ptr: NonNull<c_void>) -> Result<()>;

    /// The caching pool of shareable memory on `device`.
    fn pool(&self, device: Device) -> Result<&'static Arc<Pool>>;

    /// A new buffer of shareable memory of `bytes` on `device`.
    fn allocate(&self, device: Device, bytes: usize, zeroed: bool) -> Result<Buffer>;

    /// Whether another process can open `buffer`'s memory as it is.
    fn is_shared(&self, buffer: &Buffer) -> bool;

    /// The shareable allocation `buffer` lies in, exported; `None` where it is not one.
    fn export(&self, buffer: &Buffer) -> Result<Option<VmmExported>>;

    /// `buffer`'s memory by a handle valid while this process lives (no copy).
    fn export_legacy(&self, buffer: &Buffer) -> Result<LegacyExported>;

    /// Maps the allocation `key` of `len` bytes on `device`, asking `fd` for its descriptor only
    /// where this process does not map it already.
    fn import(
        &self,
        device: Device,
        fd: &mut dyn FnMut() -> Result<OwnedFd>,
        len: usize,
        key: BlockKey,
    ) -> Result<Buffer>;

    /// Opens a handle of [`Sharing::export_legacy`] in the process that made it: the memory and
    /// where the exported buffer starts in its allocation.
    fn open_own_legacy(&self, users: OwnedFd) -> Result<(Buffer, usize)>;

    /// Opens a handle of [`Sharing::export_legacy`] of another process.
    fn open_legacy(
        &self,
        device: Device,
        handle: &[u8; IPC_HANDLE_BYTES],
        len: usize,
        users: OwnedFd,
    ) -> Result<Buffer>;

    /// An event recorded on the calling thread's current stream of `device`, as bytes another
    /// process opens.
    fn record_event(&self, device: Device) -> Result<[u8; IPC_HANDLE_BYTES]>;

    /// Makes the calling thread's current stream of `device` wait for `event`.
    fn wait_event(
        &self,
        device: Device,
        event: &[u8; IPC_HANDLE_BYTES],
        same_process: bool,
    ) -> Result<()>;

    /// Lets go of the received memory of `device` kept mapped after its last array went.
    fn release_kept(&self, device: Device);
}

/// Allocates `bytes` on `device`, zero-filled when `zeroed`. `storage` picks where the memory
/// lives; `None` takes the environment's or the device's default (asked for, else `DLBRIDGE_STORAGE_MODE`, else the device's default).
#[inline]
pub fn allocate(
    device: Device,
    bytes: usize,
    storage: Option<StorageMode>,
    zeroed: bool,
) -> Result<Buffer> {
    match of(device) {
        Some(backend) => backend.allocate(device, bytes, storage, zeroed),
        None => Err(no_memory_of_ours(device)),
    }
}

/// The device an allocation on `device` in `storage` lands on. For CUDA the storage mode picks the
/// kind (`private`: device memory `cuda:N`, `shared`: pinned host memory `cuda_host:N`,
/// `managed`: `cuda_managed:N`); a device that already names a host or managed kind must agree
/// with an explicit mode. Other devices are returned as they are.
pub fn placement(device: Device, storage: Option<StorageMode>) -> Result<Device> {
    let (Some(mode), Some(placement)) = (
        storage,
        facts(device.kind()).and_then(|f| f.storage.placement()),
    ) else {
        return Ok(device);
    };
    let wanted = Device::new(placement.of(mode), device.index());
    // The kind that names no mode (`cuda`) goes wherever a mode sends it; one that names its mode
    // (`cuda_host`) only where that mode is.
    let names_mode =
        matches!(facts(device.kind()), Some(f) if matches!(f.storage, Storage::Names(..)));
    if !names_mode || device == wanted {
        Ok(wanted)
    } else {
        Err(Error::InvalidArgument(format!(
            "storage mode {} conflicts with device {device}",
            storage.map_or("default", StorageMode::name)
        )))
    }
}

/// Waits until the host may read or write `device`'s memory: a no-op except for the host-visible
/// CUDA kinds (pinned and managed memory) and Metal devices (shared and managed buffers), whose
/// pending device work is waited for.
pub fn host_barrier(device: Device) -> Result<()> {
    of(device).map_or(Ok(()), |b| b.host_barrier(device))
}

/// Waits until dlbridge's pending work on `device` has finished: the CUDA device's work (all its
/// streams), or the Metal device's command buffers (committing the open one first). A no-op on the
/// CPU.
///
/// # Errors
/// [`Error::BackendUnavailable`] for a backend not in this build or without devices; the
/// driver's error (for Metal, GPU errors recorded since the last synchronization);
/// [`Error::UnsupportedDevice`] for devices dlbridge has no backend for.
pub fn synchronize(device: Device) -> Result<()> {
    match of(device) {
        Some(backend) => backend.synchronize(device),
        None => Err(Error::UnsupportedDevice(format!(
            "dlbridge has no work on {device} to wait for"
        ))),
    }
}

/// Checks memory a DLPack producer handed over, where the backend can: a CUDA pointer must be
/// one the driver knows, on the claimed device, with the whole addressed range inside one
/// allocation. Backends that are not compiled in (or have no driver) accept the producer's word:
/// nothing here will touch the memory either, the tensor is held and handed on as it came.
pub(crate) fn validate_foreign(device: Device, addr: usize, len: usize) -> Result<()> {
    of(device).map_or(Ok(()), |b| b.validate_foreign(device, addr, len))
}

/// Resolves a producer's tensor whose memory is named by an opaque handle (`kDLMetal`: an
/// `id<MTLBuffer>`) into one dlbridge can use: a view of a shared or managed buffer, a copy of a
/// private one (refused for `copy=Some(false)`), or a copy for `copy=Some(true)`. Tensors of other
/// devices, and Metal tensors where the backend is not available (held opaquely), pass through.
pub(crate) fn resolve_import(tensor: Tensor, copy: Option<bool>) -> Result<Tensor> {
    match of(tensor.device()) {
        Some(backend) => backend.resolve_import(tensor, copy),
        None => Ok(tensor),
    }
}

/// Before a tensor on `device` leaves for a consumer: makes dlbridge's pending work visible to it.
/// CUDA orders it before the consumer's `stream` (as the array API standard spells streams);
/// Metal, which has no stream in DLPack, waits for it (a no-op where the backend is not
/// available: a foreign Metal tensor, held opaquely, is handed on as it came). Other devices have
/// no streams, so a stream there is an error.
///
/// # Errors
/// [`Error::InvalidArgument`] for a stream value the standard forbids, or any stream on a device
/// without streams; the backend's error from waiting.
pub fn export_handoff(device: Device, stream: Option<i64>) -> Result<()> {
    match of(device) {
        Some(backend) => backend.export_handoff(device, stream),
        None => no_stream_here(device, stream),
    }
}

/// The handoff of a device without streams: nothing to order, and no stream to name.
pub(crate) fn no_stream_here(device: Device, stream: Option<i64>) -> Result<()> {
    match stream {
        None => Ok(()),
        Some(s) => Err(Error::InvalidArgument(format!(
            "stream must be None for arrays on {device} (got {s})"
        ))),
    }
}

/// A host view of `tensor`'s memory where its backend has one to give without a copy (shared
/// Metal buffers); `None` for devices whose memory needs no view or cannot have one; an error
/// saying why for Metal memory that cannot be viewed (private or managed storage).
pub(crate) fn host_view(tensor: &Tensor) -> Result<Option<Tensor>> {
    of(tensor.device()).map_or(Ok(None), |b| b.host_view(tensor))
}

/// The stream a consumer on `device` names to its producer (array API `__dlpack__(stream=)`):
/// the calling thread's current CUDA stream, with the legacy default stream spelled `1`; `None`
/// for devices without streams.
pub fn consumer_stream(device: Device) -> Option<i64> {
    if !has_streams(device.kind()) {
        return None;
    }
    Some(match current_stream(device) {
        0 => 1,
        s => s as i64,
    })
}

/// The calling thread's current stream on a CUDA `device` as a raw handle (`0`: the legacy
/// default stream); `0` for devices without streams.
pub fn current_stream(device: Device) -> usize {
    of(device).map_or(0, |b| b.current_stream(device))
}

/// As a consumer of a producer that named its work stream instead of ordering it for us (the C
/// exchange table's "NoSync" exports): makes our current stream on `device` wait for the
/// producer's stream `producer`. A no-op for devices without streams.
///
/// # Errors
/// The backend's error recording or waiting for the event.
pub fn order_after_producer(device: Device, producer: usize) -> Result<()> {
    of(device).map_or(Ok(()), |b| b.order_after_producer(device, producer))
}

/// A new queue of `device`'s work (a CUDA stream) that starts after the work enqueued so far on
/// the calling thread's current queue there, for work of dlbridge's own that must see the
/// caller's ([`Queue::enter`] makes it current); `None` for devices without queues, whose work is
/// done when the call that does it returns.
///
/// # Errors
/// The backend's error making the queue or ordering it.
pub fn queue_after_current(device: Device) -> Result<Option<Queue>> {
    of(device).map_or(Ok(None), |b| b.queue_after_current(device))
}

/// An event recorded on the calling thread's current queue of `device`: it completes when the
/// work enqueued there so far has. `None` for devices without queues.
///
/// # Errors
/// The backend's error making or recording the event.
pub fn record_event(device: Device) -> Result<Option<Event>> {
    of(device).map_or(Ok(None), |b| b.record_event(device))
}

/// Copies between two views of one shape and dtype: by the backend of the side that is not CPU
/// memory (the CPU's when both are), which refuses a partner it cannot reach.
///
/// # Safety
/// As [`Tensor::copy_from_unchecked`](crate::Tensor::copy_from_unchecked).
pub(crate) unsafe fn copy(dst: &Tensor, src: &Tensor) -> Result<()> {
    let side = if src.device().is_cpu() {
        dst.device()
    } else {
        src.device()
    };
    match of(side) {
        // SAFETY: forwarded contract.
        Some(backend) => unsafe { backend.copy(dst, src) },
        None => Err(unreachable_copy(dst, src)),
    }
}

/// The error of a copy no backend here can make: names the side the host cannot address.
pub(crate) fn unreachable_copy(dst: &Tensor, src: &Tensor) -> Error {
    let (device, what) = if !host_accessible(src.device().kind()) {
        (src.device(), format!("copying from it to {}", dst.device()))
    } else {
        (
            dst.device(),
            format!("copying into it from {}", src.device()),
        )
    };
    Error::NotHostAccessible { device, what }
}

/// Runs an element-wise kernel on the request's device ([`crate::compute`]).
pub(crate) fn map(req: &MapRequest<'_>) -> Result<()> {
    compute_on(req.out.device())?.map(req)
}

/// Runs a reduction on the request's device ([`crate::compute`]).
pub(crate) fn reduce(req: &ReduceRequest<'_>) -> Result<()> {
    compute_on(req.out.device())?.reduce(req)
}

/// Whether the backend of `device` has a reduction kernel for `op` ([`Backend::reduces`]).
pub(crate) fn reduces(device: Device, op: ReduceOp) -> bool {
    compute_on(device).is_ok_and(|b| b.reduces(op))
}

/// Runs a batched matrix product on the request's device ([`crate::compute`]).
pub(crate) fn matmul(req: &MatmulRequest<'_>) -> Result<()> {
    compute_on(req.out.device())?.matmul(req)
}

fn compute_on(device: Device) -> Result<&'static dyn Backend> {
    of(device)
        .ok_or_else(|| Error::UnsupportedDevice(format!("dlbridge does not compute on {device}")))
}

/// `x` converted to `dtype` by the host converter, which covers every dtype (complex and the
/// minifloats included): the CPU's cast, and every backend's fallback for the dtypes its kernels
/// do not convert.
pub(crate) fn cast_on_host(x: &Tensor, dtype: DType) -> Result<Tensor> {
    cpu::cast::cast_tensor(x, dtype)
}

/// Moves blocks of elements between two host tensors ([`crate::compute::index`]).
///
/// # Safety
/// As `cpu::compute::copy_blocks`: every block lies inside both tensors' buffers, and nothing
/// else accesses the destination's bytes during the call.
pub(crate) unsafe fn copy_blocks_on_host(req: &crate::compute::index::BlockCopy<'_>) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe { cpu::compute::copy_blocks(req) }
}

/// Compiles a run-time kernel for `device` ([`Backend::compile_kernel`]).
pub(crate) fn compile_kernel(
    device: Device,
    source: &str,
    name: &str,
    options: &[String],
) -> Result<Kernel> {
    match of(device) {
        Some(backend) => backend.compile_kernel(device, source, name, options),
        None => Err(Error::UnsupportedDevice(format!(
            "run-time kernels compile for CUDA (NVRTC) and Metal (MSL), not {device}"
        ))),
    }
}

/// Launches a compiled kernel on its device ([`Backend::launch_kernel`]).
pub(crate) fn launch_kernel(
    kernel: &Kernel,
    config: LaunchConfig,
    args: &[KernelArg],
) -> Result<LaunchTiming> {
    match of(kernel.device()) {
        Some(backend) => backend.launch_kernel(kernel, config, args),
        None => Err(Error::UnsupportedDevice(format!(
            "no run-time kernels on {}",
            kernel.device()
        ))),
    }
}

/// The pool that serves allocations on `device` when nothing asks for a storage mode. CUDA device
/// kinds name a mode each, so `cuda:N`, `cuda_host:N` and `cuda_managed:N` name the private,
/// shared and managed pools of device `N`; `metal:N` names the pool of the device's default mode.
fn pool(device: Device) -> Result<&'static Arc<Pool>> {
    match of(device) {
        Some(backend) => backend.pool(device, None),
        None => Err(no_memory_of_ours(device)),
    }
}

/// The pool that serves allocations on `device` in `storage`: `None` gives the pool
/// [`memory_stats`] and friends use for `device`; a mode picks the CUDA kind as [`placement`]
/// does, or one of a Metal device's pools (the CPU has one pool, whatever the mode). Use it for
/// the figures and limits of a pool the device alone does not name, such as a Metal device's
/// private pool.
///
/// # Errors
/// As [`memory_stats`], and [`Error::InvalidArgument`] for a mode that conflicts with the device
/// or that the OS lacks (managed Metal storage outside macOS).
pub fn pool_for(device: Device, storage: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
    match (of(device), storage) {
        (_, None) => pool(device),
        (Some(backend), storage) => backend.pool(device, storage),
        (None, _) => Err(no_memory_of_ours(device)),
    }
}

fn no_memory_of_ours(device: Device) -> Error {
    Error::UnsupportedDevice(format!("dlbridge cannot allocate on {device}"))
}

/// The figures of `device`'s memory pool: active, cached and peak bytes, hits, misses, driver
/// calls and limits (see [`MemoryStats`]).
///
/// # Errors
/// [`Error::BackendUnavailable`] for a backend not in this build; [`Error::UnsupportedDevice`]
/// for devices dlbridge does not allocate on.
pub fn memory_stats(device: Device) -> Result<MemoryStats> {
    Ok(pool(device)?.stats())
}

/// Returns every cached block of `device`'s pool, and of its shareable pool, to the driver
/// (memory in use is untouched); on a CUDA device, also lets go of the memory received from
/// other processes that is kept mapped after its last array went ([`crate::share::empty_cache`]).
///
/// # Errors
/// As [`memory_stats`].
pub fn empty_cache(device: Device) -> Result<()> {
    pool(device)?.clear_cache();
    crate::share::empty_cache(device);
    Ok(())
}

/// Restarts the peak of `device`'s active bytes from the current active bytes.
///
/// # Errors
/// As [`memory_stats`].
pub fn reset_peak_memory(device: Device) -> Result<()> {
    pool(device)?.reset_peak();
    Ok(())
}

/// Limits the bytes of memory in use on `device` (`None`: no limit); an allocation that would
/// pass the limit fails with [`Error::OutOfMemory`].
///
/// # Errors
/// [`Error::InvalidArgument`] for a limit above [`pool::MAX_LIMIT`](crate::pool::MAX_LIMIT);
/// otherwise as [`memory_stats`].
pub fn set_memory_limit(device: Device, limit: Option<usize>) -> Result<()> {
    pool(device)?.set_memory_limit(limit)
}

/// Limits the bytes `device`'s pool keeps cached (`None`: no limit, `Some(0)`: no caching);
/// blocks beyond the limit go back to the driver, least recently released first.
///
/// # Errors
/// As [`set_memory_limit`].
pub fn set_cache_limit(device: Device, limit: Option<usize>) -> Result<()> {
    pool(device)?.set_cache_limit(limit)
}

/// The storage mode allocations on `device` get when they do not ask for one, and where that
/// came from.
///
/// # Errors
/// As [`memory_stats`].
pub fn storage_mode(device: Device) -> Result<Resolved> {
    resolve_storage(device, None)
}

/// The storage mode an allocation on `device` asking for `requested` gets (asked for, else `DLBRIDGE_STORAGE_MODE`, else the device's default),
/// for devices whose backend is in this build.
///
/// # Errors
/// As [`memory_stats`]; [`Error::InvalidArgument`] when the device kind names a mode itself (CUDA
/// host, CUDA managed) and `requested` asks for another.
pub fn resolve_storage(device: Device, requested: Option<StorageMode>) -> Result<Resolved> {
    match of(device) {
        Some(backend) => backend.resolve_storage(device, requested),
        None => Err(no_memory_of_ours(device)),
    }
}

/// The names of the backends compiled into this build.
pub fn compiled_backends() -> Vec<&'static str> {
    let mut out = vec!["cpu"];
    if cfg!(cuda) {
        out.push("cuda");
    }
    if cfg!(metal) {
        out.push("metal");
    }
    out
}
