//! Loading arrays of mapped files onto any device: the engine behind every format's loads.
//!
//! | device | how | tensors |
//! | --- | --- | --- |
//! | CPU | each file mapped copy-on-write | views of the mapping (read-only, zero-copy), or private copies (`copy`, or where the system refused a copy-on-write mapping) |
//! | Metal | the mapping wrapped in `MTLBuffer`s over its pages, no copy (`newBufferWithBytesNoCopy:`) | shared storage: read-only views of the file's pages, each with its byte offset; private or managed storage, or `copy`: a GPU blit of each tensor into memory of its own |
//! | CUDA, and files a backend declines to wrap | the selected bytes read into one allocation per file, in the load's storage mode (CUDA device memory: pinned staging and asynchronous copies; Metal private memory: shared staging and blits) | views of that allocation |
//!
//! One rule for every device: a tensor is a view in place where the device addresses the file's
//! pages and nothing asks for memory of its own, and a copy otherwise, also when its bytes are
//! not aligned for its element type. Wrapping goes through the backend seam ([`crate::backend`]'s
//! `wrap_host`; `read_file` for the reads). A backend that cannot wrap host pages, or declines a
//! file's, leaves that file to the reader: a load never fails for it.

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::file::{MappedFile, is_aligned, open_regular};
use super::part::{DEFAULT_MAX_GAP, PartPlan};
use crate::backend::{self, FileRead, ReadOptions};
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// How [`load`] (and [`Checkpoint::load_to`](crate::safetensors::Checkpoint::load_to)) loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Where the tensors go.
    pub device: Device,
    /// `false`: read-only views of the mapped files where the device addresses them in place
    /// (the CPU; Metal in shared storage), memory of their own elsewhere; `true`: writable memory
    /// of their own everywhere.
    pub copy: bool,
    /// The storage mode of the tensors' memory (`None`: the device's default, as
    /// [`backend::resolve_storage`] gives it). On Metal, shared storage (the default on Apple
    /// silicon) lets the tensors be views of the mapped files, and private or managed storage
    /// copies them there on the GPU; on CUDA the mode picks the device kind, as
    /// [`backend::placement`] does. The CPU has one mode.
    pub storage: Option<StorageMode>,
    /// Convert every floating-point tensor to this dtype after loading, on the device.
    pub dtype: Option<DType>,
    /// Reader threads (`None`: chosen from the machine, see [`default_threads`], and
    /// [`default_direct_threads`] where every file is read directly).
    pub threads: Option<usize>,
    /// The largest single read and staging buffer (`None`: [`DEFAULT_CHUNK`], and
    /// [`DEFAULT_DIRECT_CHUNK`] where every file is read directly).
    pub chunk_bytes: Option<usize>,
    /// `Some(true)`: read around the page cache (`O_DIRECT`); `Some(false)`: buffered reads;
    /// `None`: buffered when most of the file is in the page cache, direct otherwise.
    pub direct_io: Option<bool>,
    /// Whether a CUDA load of a file read through the page cache copies straight from the
    /// file's pages (mapped shared and read-only, registered with the driver window by window:
    /// no staging copy and no pinned staging memory), or through pinned staging buffers. `None`:
    /// staging, unless the environment variable `DLBRIDGE_LOAD_REGISTER` is `1`. The driver's
    /// refusal falls back to staging. On the H100 machine registered pages loaded a warm 7 GB
    /// checkpoint at 14.2 GB/s against staging's 18.3 in the same run (`bench/bench_load.py`):
    /// the driver registers pages at about 42 GB/s on one thread and not faster on more.
    pub register_pages: Option<bool>,
    /// Whether a CUDA load reads through GPUDirect Storage (cuFile, loaded at run time where
    /// present): `Some(true)` always (an error where cuFile cannot be used), `Some(false)` never.
    /// `None`: the environment variable `DLBRIDGE_LOAD_GDS` (`1` or `0`), else for direct (cold)
    /// reads where the `nvidia-fs` kernel module lets the storage write GPU memory without a host
    /// copy; cuFile without it (its compatibility mode) is no faster than the staging reader.
    pub gds: Option<bool>,
    /// Devices whose tensors are read (not views of the file): one allocation per file, each
    /// tensor a view of it, or one per tensor. `None`: the environment variable
    /// `DLBRIDGE_LOAD_ALLOCATION` (`per-file` or `per-tensor`), else [`Allocation::PerFile`].
    pub allocation: Option<Allocation>,
    /// Whether [`load_parts_into`] first waits for the work queued on its targets' devices
    /// (default `true`); `false` where the caller has waited already (the later steps of a load
    /// in steps, which waited once at its start: each wait would also wait for the previous
    /// step's transfers and the caller's compute).
    pub wait_for_targets: bool,
}

/// How a load that reads tensors into device memory allocates it ([`LoadOptions::allocation`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Allocation {
    /// One allocation for a file's selected tensors, each a view of it: adjacent tensors are one
    /// read, and the memory is returned when the last of them is dropped.
    #[default]
    PerFile,
    /// One allocation per tensor: each tensor's memory is returned as soon as it is dropped.
    PerTensor,
}

impl std::str::FromStr for Allocation {
    type Err = Error;

    /// `per-file` or `per-tensor` (either case, `_` for `-`).
    fn from_str(name: &str) -> Result<Allocation> {
        match name.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "per-file" => Ok(Allocation::PerFile),
            "per-tensor" => Ok(Allocation::PerTensor),
            _ => Err(Error::InvalidArgument(format!(
                "unknown allocation {name:?}: expected 'per-file' or 'per-tensor'"
            ))),
        }
    }
}

impl Allocation {
    /// `options.allocation`, else the environment's `DLBRIDGE_LOAD_ALLOCATION` (an unknown value
    /// is warned about and ignored), else per file.
    fn of(options: &LoadOptions) -> Allocation {
        options.allocation.unwrap_or_else(|| {
            let Ok(name) = std::env::var("DLBRIDGE_LOAD_ALLOCATION") else {
                return Allocation::PerFile;
            };
            name.parse().unwrap_or_else(|e| {
                log::warn!("dlbridge: DLBRIDGE_LOAD_ALLOCATION: {e}; loading per file");
                Allocation::PerFile
            })
        })
    }
}

impl LoadOptions {
    /// The defaults for `device`.
    pub fn new(device: Device) -> LoadOptions {
        LoadOptions {
            device,
            copy: false,
            storage: None,
            dtype: None,
            threads: None,
            chunk_bytes: None,
            direct_io: None,
            register_pages: None,
            gds: None,
            allocation: None,
            wait_for_targets: true,
        }
    }
}

/// The default size of one read and staging buffer: large enough that a read is mostly copying,
/// small enough that a ring of them per thread stays modest in pinned memory and the first copy
/// to the device starts early (4 MiB was best of 1 to 64 MiB in `bench/bench_load.py --sweep`).
pub const DEFAULT_CHUNK: usize = 4 << 20;

/// Reader threads when none are asked for: three quarters of the machine's parallelism, 2 to 12.
/// On the 16-core H100 machines, five interleaved rounds of warm 7 GB loads with 4 MiB chunks
/// gave medians of 28.5 GB/s with 6 threads, 34.7 with 8, 37.4 with 10, 39.8 with 12 and 36.7
/// with 16 (2026-11-27, on a machine where every loader that copies through the CPU ran slower
/// than on another, which gave 44-48 GB/s with 8); earlier sweeps, on a load that also spent
/// 50 ms before its first read, had found 8 to 12 alike and 14 slower.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| (n.get() * 3 / 4).clamp(2, 12))
}

/// The read size when every file is read around the page cache (`O_DIRECT`, cold files), where
/// the storage, not the CPU, sets the pace and larger reads in flight keep it busy.
pub const DEFAULT_DIRECT_CHUNK: usize = 16 << 20;

/// Reader threads for direct reads when none are asked for: one per core, 4 to 16. On the H100
/// machine's virtual disk, cold loads of a 7 GB checkpoint ran at 1.32 GB/s with 8 threads of
/// 4 MiB, 1.55 with 8 of 16 MiB and 1.71 with 16 of 16 MiB (`bench/bench_load.py --sweep-cold`,
/// one run each); pinned staging is then at most 16 × 2 × 16 MiB.
pub fn default_direct_threads() -> usize {
    std::thread::available_parallelism().map_or(8, |n| n.get().clamp(4, 16))
}

/// One array the engine loads: where its bytes lie in its file and what they hold. The bytes
/// are one dense block; `layout` is the array over them (byte offset 0 at `byte_range.start`):
/// row-major for a safetensors tensor, column-major strides for a Fortran-ordered `.npy` array.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    /// The array's name in the result.
    pub name: String,
    /// Absolute byte range in the file.
    pub byte_range: Range<u64>,
    /// Element type (sub-byte types are stored densely packed).
    pub dtype: DType,
    /// Shape and strides over the bytes, its byte offset 0 at `byte_range.start`.
    pub layout: Layout,
}

/// Loads `items` of each mapped file onto `options.device`, calling `progress(done, total)`
/// (bytes) about ten times a second while a device load runs and once at the end. A format
/// opens its files ([`MappedFile::open`]) and gives the plan; this knows no format.
///
/// - CPU: each array a read-only view of the mapped file (zero-copy), or a private copy where
///   `copy` asks for one, its bytes are not aligned for its element type, or the system refused
///   a copy-on-write mapping (read-only without `copy`).
/// - A device that addresses the file's pages (Metal in shared storage, without `copy`):
///   read-only views of the wrapped pages; copies on the device otherwise.
/// - Elsewhere (CUDA; files a backend declines to wrap): the selected bytes read into one
///   allocation per file (or per array, [`LoadOptions::allocation`]) through the backend's
///   reader (parallel positioned reads; pinned staging and asynchronous copies on CUDA), each
///   array a view of it.
///
/// `options.dtype` then converts every real floating-point array, on the device.
///
/// # Errors
/// The device's allocation errors ([`Error::OutOfMemory`], an unavailable backend), the file's
/// I/O errors ([`Error::Io`], also for a file truncated while it is read), and the cast's. On
/// error nothing loaded stays allocated.
pub fn load(
    files: &[(&MappedFile, Vec<Item>)],
    options: &LoadOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<BTreeMap<String, Tensor>> {
    load_with(files, options, None, progress)
}

/// What the loads of one stream's groups ([`super::stream`]) decide or make once instead of at
/// every load: each file's reads through or around the page cache (a residency sample of the
/// whole file, and an `O_DIRECT` descriptor, per file per stream rather than per group), and the
/// backend's reader (its threads, and on CUDA their streams, events and pinned staging: a
/// [`backend::ReadSession`]). A load in a session reads on the calling thread (no progress thread:
/// a group reports no progress) and returns with its copies to the device possibly still running:
/// [`Session::join_current`] orders a queue after them. Where the load itself worked on the read
/// bytes on the device (a conversion, a copy of an array not aligned for its type), it ordered the
/// calling thread's current queue after them first ([`Session::joined_current`]).
pub(crate) struct Session {
    /// Each file's direct-I/O descriptor, decided at its first load (by address: the files of a
    /// stream outlive its session).
    direct: Vec<(*const MappedFile, Option<File>)>,
    /// The reader kept for the session's loads.
    reader: backend::ReadSession,
    /// Whether the last load ordered the calling thread's current queue after its copies.
    joined_current: bool,
}

impl Session {
    /// A session that has decided nothing yet.
    pub(crate) fn new() -> Session {
        Session {
            direct: Vec::new(),
            reader: backend::ReadSession::new(),
            joined_current: false,
        }
    }

    /// Makes the calling thread's current queue wait (on the device) for the copies of the
    /// session's loads so far.
    pub(crate) fn join_current(&self) -> Result<()> {
        self.reader.join_current()
    }

    /// Whether the last load already ordered the calling thread's current queue after its copies
    /// (it converted or copied the read bytes there).
    pub(crate) fn joined_current(&self) -> bool {
        self.joined_current
    }

    /// `mapped`'s direct-I/O descriptor, decided at its first call.
    fn decide(&mut self, mapped: &MappedFile, options: &LoadOptions) -> Option<&File> {
        let key: *const MappedFile = mapped;
        let index = match self.direct.iter().position(|(k, _)| *k == key) {
            Some(index) => index,
            None => {
                self.direct.push((key, direct_file(mapped, options)));
                self.direct.len() - 1
            }
        };
        self.direct[index].1.as_ref()
    }

    /// `mapped`'s descriptor where [`Session::decide`] decided one, in a session's `direct`.
    fn decided<'a>(
        direct: &'a [(*const MappedFile, Option<File>)],
        mapped: &MappedFile,
    ) -> Option<&'a File> {
        let key: *const MappedFile = mapped;
        direct
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, f)| f.as_ref())
    }
}

thread_local! {
    /// The [`Session`] a [`LoadSession`] entered on this thread.
    static CURRENT: std::cell::RefCell<Option<Session>> = const { std::cell::RefCell::new(None) };
    /// How many [`LoadSession`]s are entered on this thread.
    static DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A load session entered on the calling thread until dropped: the thread's
/// [`load_parts_into`] calls meanwhile (a loader's steps into a model's parameters, one per group
/// of a stream) share one reader and decide each file's direct reads once, as a stream's groups
/// do ([`stream`](super::stream)). Such a call reads on the calling thread (no progress thread)
/// and returns once the files' bytes are read and their copies to device memory enqueued, with
/// the thread's current queue of the device (a CUDA stream) ordered after the copies: work
/// enqueued there next sees the bytes, and an event recorded there completes once they landed;
/// the host does not wait for them. Dropping it waits for the copies still running and frees
/// the reader (its threads, and on CUDA their streams, events and pinned staging). A session
/// entered while another is restores the other when dropped.
#[must_use = "the session lasts only while the guard lives"]
pub struct LoadSession {
    previous: Option<Session>,
    /// Its place among the sessions entered on the thread (1: the outermost).
    depth: usize,
    /// Entered on one thread, left on it.
    _here: std::marker::PhantomData<*const ()>,
}

impl LoadSession {
    /// Enters a new session on the calling thread.
    pub fn enter() -> LoadSession {
        let depth = DEPTH.get() + 1;
        DEPTH.set(depth);
        LoadSession {
            previous: CURRENT.with_borrow_mut(|current| current.replace(Session::new())),
            depth,
            _here: std::marker::PhantomData,
        }
    }

    /// Whether this is the innermost session entered on the thread: sessions are left in the
    /// reverse order of entering (one left out of order would put back a session that was left
    /// already, and the thread's loads would go on in it). A binding whose users can leave them
    /// in any order (Python's context managers in generators) asks before dropping one.
    pub fn is_innermost(&self) -> bool {
        DEPTH.get() == self.depth
    }
}

impl Drop for LoadSession {
    fn drop(&mut self) {
        DEPTH.set(self.depth - 1);
        let ours =
            CURRENT.with_borrow_mut(|current| std::mem::replace(current, self.previous.take()));
        // Waits for its copies, then frees its reader.
        drop(ours);
    }
}

/// The thread's entered session, taken out of [`CURRENT`] for one call and put back when the
/// call ends, however it ends: the call's progress callback may enter a session or load itself.
struct Taken(Option<Session>);

impl Taken {
    fn take() -> Taken {
        Taken(CURRENT.with_borrow_mut(Option::take))
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some(session) = self.0.take() {
            // A session a callback entered and never left gives way to ours (and is dropped).
            drop(CURRENT.with_borrow_mut(|current| current.replace(session)));
        }
    }
}

impl std::fmt::Debug for LoadSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadSession").finish_non_exhaustive()
    }
}

/// [`load`], in a [`Session`] where one is given.
pub(crate) fn load_with(
    files: &[(&MappedFile, Vec<Item>)],
    options: &LoadOptions,
    session: Option<&mut Session>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<BTreeMap<String, Tensor>> {
    let total: u64 = files
        .iter()
        .flat_map(|(_, items)| items)
        .map(|item| item.byte_range.end - item.byte_range.start)
        .sum();
    check_cast(options.dtype)?;
    let mut loaded = if options.device.is_cpu() {
        let mut out = BTreeMap::new();
        for (file, items) in files {
            for item in items {
                let tensor = host_tensor(
                    file,
                    item.byte_range.clone(),
                    item.dtype,
                    &item.layout,
                    options.copy,
                )?;
                out.insert(item.name.clone(), tensor);
            }
        }
        progress(total, total);
        out
    } else {
        load_to_device(files, options, total, session, progress)?
    };
    for tensor in loaded.values_mut() {
        cast_floating(tensor, options.dtype)?;
    }
    Ok(loaded)
}

/// One array on the CPU: `layout` (byte offset 0) over bytes `byte_range` of `file`. With
/// `copy` false: a read-only view of the mapping (a read-only private copy where the bytes are
/// not aligned for the element type, or the mapping is not copy-on-write); with `copy` true:
/// writable memory of dlbridge's pool that nothing else references.
///
/// # Errors
/// A byte range outside the file ([`Error::OutOfBounds`]), a layout that does not fit it, and
/// the allocation's errors.
pub fn host_tensor(
    file: &MappedFile,
    byte_range: Range<u64>,
    dtype: DType,
    layout: &Layout,
    copy: bool,
) -> Result<Tensor> {
    let mapping = file.buffer();
    if byte_range.start > byte_range.end || byte_range.end > mapping.len() as u64 {
        return Err(Error::OutOfBounds(format!(
            "bytes {}..{} of {}, a file of {} bytes",
            byte_range.start,
            byte_range.end,
            file.path().display(),
            mapping.len()
        )));
    }
    // Inside the mapped file (checked above), so both ends fit in usize.
    let (start, len) = (
        byte_range.start as usize,
        (byte_range.end - byte_range.start) as usize,
    );
    let base = mapping.require_host("loading a tensor")?;
    let packed = dtype.is_sub_byte();
    let aligned = is_aligned((base.as_ptr() as usize).wrapping_add(start), dtype);
    if aligned && !copy && file.is_copy_on_write() {
        let layout = layout.with_byte_offset(start);
        return Tensor::with_packing(mapping.clone(), dtype, layout, packed);
    }
    let buffer = backend::allocate(Device::CPU, len, None, false)?;
    if len > 0 {
        let dst = buffer.require_host("copying a tensor")?;
        let src = base.as_ptr().wrapping_add(start);
        // SAFETY: `src` starts `len` bytes inside the live mapping (checked above); `dst` is a
        // new allocation of `len` bytes no one else references; a mapping and a pool block
        // never overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_ptr(), len) };
    }
    let tensor = Tensor::with_packing(buffer, dtype, layout.clone(), packed)?;
    // Without `copy` the caller gets read-only memory whether or not it had to be copied.
    Ok(if copy {
        tensor
    } else {
        tensor.into_read_only()
    })
}

/// The part of the array of `array_len` bytes at byte `start` of `file` that `part` selects,
/// on `options.device`, reading only the bytes it needs. `part` is a layout over the array's
/// elements (of `dtype`, row-major), its byte offset counted from the array's first byte: what
/// basic indexing gives (`Layout::contiguous(shape)` then [`Layout::slice`] and
/// [`Layout::index`]: integers, ranges with a positive step, new axes), as a tensor-parallel
/// rank takes its rows (one run of the file) or its columns (one run per row). [`PartPlan`]
/// says what is read.
///
/// - CPU: a read-only view of the mapped file, zero-copy, with the part's strides, unless
///   `copy` asks for memory of its own, the bytes are not aligned for the element type, or the
///   system refused a copy-on-write mapping: then a compact copy of only the part's bytes,
///   read from the file (read-only without `copy`).
/// - A device that addresses the file's pages (Metal in shared storage, without `copy`): a
///   read-only view of the wrapped pages of the part's byte range.
/// - Elsewhere (CUDA; Metal copies): only the part's runs of bytes are read, through the
///   loader's reader (pinned staging and asynchronous copies on CUDA), into one allocation
///   holding them one after another; the tensor is a view of it with the part's shape (and
///   strides in it, where gaps of at most [`DEFAULT_MAX_GAP`] bytes were read through).
///
/// `options.dtype` converts a floating-point part as [`load`] does; the other options tune the
/// reader as they do there.
///
/// # Errors
/// A part outside the array or not in storage order, as [`PartPlan::new`] says; and the errors
/// of [`load`].
pub fn load_part(
    file: &MappedFile,
    start: u64,
    array_len: usize,
    part: &Layout,
    dtype: DType,
    options: &LoadOptions,
) -> Result<Tensor> {
    check_cast(options.dtype)?;
    let plan = PartPlan::new(part, dtype.itemsize(), array_len, DEFAULT_MAX_GAP)?;
    let mut tensor = match view_part(file, start, part, dtype, options)? {
        Some(view) => view,
        None => read_part(file, start, &plan, dtype, options)?,
    };
    cast_floating(&mut tensor, options.dtype)?;
    Ok(tensor)
}

/// One part of an array read into existing memory ([`load_parts_into`]): the part `part` (as
/// [`load_part`] takes it) of the array of `array_len` bytes of `dtype` at byte `start` of
/// `file`, into `dst`.
#[derive(Clone, Debug)]
pub struct PartInto<'a> {
    /// The mapped file holding the array.
    pub file: &'a MappedFile,
    /// The array's first byte in the file.
    pub start: u64,
    /// The array's length in bytes.
    pub array_len: usize,
    /// The part: a layout over the array's elements, its byte offset counted from the array's
    /// first byte.
    pub part: Layout,
    /// The array's element type.
    pub dtype: DType,
    /// Existing memory of the part's shape, on any device.
    pub dst: &'a Tensor,
}

/// Reads each part of `parts` straight into its `dst`, existing memory of the part's shape on
/// any device (a model's parameters, imported through DLPack), calling `progress(done, total)`
/// (bytes) as [`load`] does; returns the bytes of the files the parts need. Only the parts' bytes
/// are read, none through ([`PartPlan`] without gaps). Every part is checked before anything is
/// read.
///
/// - `dst` compact, of the array's dtype, on the CPU or a CUDA device: the parts of one device
///   are read together, by one run of the reader (parallel positioned reads; pinned staging and
///   asynchronous copies on CUDA), into the destinations themselves at their byte offsets: no
///   other memory on the device.
/// - Otherwise (strided `dst`, another dtype, another kind of device), one part after another:
///   the part as [`load_part`] gives it on `dst`'s device (a view of the mapped file on the CPU, a
///   compact allocation of the part's bytes elsewhere), converted on that device where the
///   dtypes differ (NumPy's `astype` rules, as `copy_` converts), then copied into `dst` with its
///   strides.
///
/// Work already queued on the `dst`s' devices is waited for first ([`backend::synchronize`];
/// unless `options.wait_for_targets` is off): the reader's streams do not wait for the caller's
/// (PyTorch's, say), and a kernel still filling a `dst` could otherwise land after the
/// checkpoint's bytes.
///
/// `options.device`, `copy` and `dtype` are ignored (each `dst` says them); the reader's options
/// and `wait_for_targets` apply.
///
/// # Errors
/// [`Error::Shape`] where a `dst`'s shape is not its part's; [`Error::ReadOnly`] where a `dst` is
/// read-only; the errors of [`PartPlan::new`] and [`load_part`].
///
/// # Safety
/// No reference (`&[T]`, `&mut [T]`) into the bytes the `dst`s address may be alive during the
/// call, no other thread (or device stream) may access them until it returns, and no two parts'
/// `dst`s may overlap, as for [`Tensor::copy_from_unchecked`].
pub unsafe fn load_parts_into(
    parts: &[PartInto<'_>],
    options: &LoadOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64> {
    let mut plans = Vec::with_capacity(parts.len());
    for p in parts {
        if p.dst.shape() != p.part.shape() {
            return Err(Error::Shape(format!(
                "the target has shape {} but the part read into it has shape {}",
                crate::layout::shape_text(p.dst.shape()),
                crate::layout::shape_text(p.part.shape())
            )));
        }
        if p.dst.is_read_only() {
            return Err(Error::ReadOnly(
                "reading a checkpoint into a read-only target".into(),
            ));
        }
        plans.push(PartPlan::new(&p.part, p.dtype.itemsize(), p.array_len, 0)?);
    }
    let total: u64 = plans.iter().map(PartPlan::bytes_read).sum();
    let in_place = |p: &PartInto<'_>| {
        let device = p.dst.device();
        p.dst.dtype() == p.dtype
            && !p.dtype.is_sub_byte()
            && p.dst.is_contiguous()
            && backend::facts(device.kind()).is_some_and(|f| f.reads_into)
    };
    let done = AtomicU64::new(0);
    {
        let mut current = Taken::take();
        let mut own = None;
        let entered = current.0.is_some();
        // The direct-I/O descriptors, one per file (by address: the caller's files outlive the
        // call): the thread's session's where one is entered ([`LoadSession`]).
        let session = match &mut current.0 {
            Some(session) => session,
            None => own.insert(Session::new()),
        };
        for p in parts
            .iter()
            .filter(|p| !p.dst.device().is_cpu() && in_place(p))
        {
            session.decide(p.file, options);
        }
        // Work already queued on the targets' devices (a kernel still filling a target, on any
        // stream: the readers' streams wait for none of them) finishes before anything is
        // written.
        let mut waited: Vec<Device> = Vec::new();
        for p in parts
            .iter()
            .filter(|p| options.wait_for_targets && !p.dst.device().is_cpu() && p.dst.numel() > 0)
        {
            if !waited.contains(&p.dst.device()) {
                crate::backend::synchronize(p.dst.device())?;
                waited.push(p.dst.device());
            }
        }
        let mut devices: Vec<Device> = Vec::new();
        for p in parts.iter().filter(|p| in_place(p) && p.dst.numel() > 0) {
            if !devices.contains(&p.dst.device()) {
                devices.push(p.dst.device());
            }
        }
        let (direct_files, reader) = (&session.direct, &mut session.reader);
        for device in devices {
            let mut reads: Vec<FileRead<'_>> = Vec::new();
            let mut all_direct = true;
            for (p, plan) in parts.iter().zip(&plans) {
                if !in_place(p) || p.dst.numel() == 0 || p.dst.device() != device {
                    continue;
                }
                // A plan without gaps is the part's elements, row-major, one run after another:
                // `dst`'s own order.
                let direct = if device.is_cpu() {
                    None
                } else {
                    Session::decided(direct_files, p.file)
                };
                all_direct &= direct.is_some();
                reads.extend(plan.runs.iter().map(|(run, dst_offset)| FileRead {
                    path: p.file.path(),
                    file: p.file.file(),
                    direct,
                    offset: p.start + run.start,
                    len: (run.end - run.start) as usize,
                    dst: p.dst.buffer(),
                    dst_offset: p.dst.byte_offset() + dst_offset,
                }));
            }
            if entered && !device.is_cpu() {
                // In an entered session: its reader, no progress thread; the calling thread's
                // current queue is ordered after the copies below.
                let read_options = read_options(options, all_direct, &done);
                reader.read(device, &reads, &read_options)?;
            } else {
                run_reads(&reads, device, options, all_direct, &done, total, progress)?;
            }
        }
        if entered {
            session.join_current()?;
        }
    }
    for p in parts.iter().filter(|p| !in_place(p) && p.dst.numel() > 0) {
        let on_device = LoadOptions {
            device: p.dst.device(),
            copy: false,
            storage: None,
            dtype: None,
            ..options.clone()
        };
        let mut part = load_part(p.file, p.start, p.array_len, &p.part, p.dtype, &on_device)?;
        if part.dtype() != p.dst.dtype() {
            part = crate::compute::cast(&part, p.dst.dtype())?;
        }
        // SAFETY: the caller guarantees no reference into `dst`'s bytes and no other access to
        // them during the call; `part` is another allocation (or the mapped file).
        unsafe { p.dst.copy_from_unchecked(&part)? };
        done.fetch_add(part.nbytes() as u64, Ordering::Relaxed);
        progress(done.load(Ordering::Relaxed).min(total), total);
    }
    progress(total, total);
    Ok(total)
}

fn load_to_device(
    files: &[(&MappedFile, Vec<Item>)],
    options: &LoadOptions,
    total: u64,
    mut session: Option<&mut Session>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<BTreeMap<String, Tensor>> {
    let device = backend::placement(options.device, options.storage)?;
    let allocation = Allocation::of(options);
    let mut out = BTreeMap::new();
    let mut wrapped: u64 = 0;
    let mut loads: Vec<FileLoad<'_>> = Vec::new();
    for (file, items) in files {
        let items: Vec<&Item> = items.iter().collect();
        if items.is_empty() {
            continue;
        }
        match wrap_file(file, &items, device, options)? {
            Some(tensors) => {
                wrapped += items
                    .iter()
                    .map(|l| l.byte_range.end - l.byte_range.start)
                    .sum::<u64>();
                out.extend(tensors);
            }
            None => {
                // A duplicate of the session's descriptor reads the same open file; one the
                // system refuses reads through the page cache.
                let direct = match session.as_deref_mut() {
                    Some(session) => session
                        .decide(file, options)
                        .and_then(|f| f.try_clone().ok()),
                    None => direct_file(file, options),
                };
                loads.push(FileLoad::new(
                    file, items, device, options, allocation, direct,
                )?);
            }
        }
    }
    let done = AtomicU64::new(wrapped);
    if let Some(session) = session.as_deref_mut() {
        // Said of this call's loads alone (a group without any joined nothing).
        session.joined_current = false;
    }
    if !loads.is_empty() {
        match session {
            // A session's loads (a stream's groups) report no progress, and leave their copies
            // running; work on the read bytes here (a conversion, an unaligned array's copy)
            // runs on this thread's current queue, ordered after them.
            Some(session) => {
                let direct = loads.iter().all(|f| f.direct.is_some());
                let reads: Vec<FileRead<'_>> = loads.iter().flat_map(FileLoad::reads).collect();
                let read_options = read_options(options, direct, &done);
                session.reader.read(device, &reads, &read_options)?;
                if options.dtype.is_some() || !loads.iter().all(FileLoad::aligned) {
                    session.reader.join_current()?;
                    session.joined_current = true;
                }
            }
            None => read_files(&loads, device, options, &done, total, progress)?,
        }
    }
    progress(total, total);
    for load in &loads {
        load.views(options.storage, &mut out)?;
    }
    Ok(out)
}

/// Refuses a conversion to a type that is not floating-point: a load converts floating-point
/// tensors only, and a cast to an integer type would truncate them silently.
fn check_cast(dtype: Option<DType>) -> Result<()> {
    match dtype {
        Some(dtype) if !is_real_floating(dtype) => Err(Error::InvalidArgument(format!(
            "dtype {dtype}: a load converts floating-point tensors to another floating-point \
                 type (float32, bfloat16, float16, ...), never to {dtype}, which would truncate \
                 them; convert the loaded tensors yourself if that is meant"
        ))),
        _ => Ok(()),
    }
}

/// Whether `dtype` is a real floating-point type (complex types hold two, and a cast to a real
/// type drops one: a load leaves them as they are).
fn is_real_floating(dtype: DType) -> bool {
    dtype.is_floating() && dtype.code() != crate::dtype::DTypeCode::Complex
}

/// `tensor` converted to `dtype` (on its device) where it is floating-point and of another type.
pub(crate) fn cast_floating(tensor: &mut Tensor, dtype: Option<DType>) -> Result<()> {
    if let Some(dtype) = dtype
        && tensor.dtype() != dtype
        && is_real_floating(tensor.dtype())
    {
        *tensor = crate::compute::cast(tensor, dtype)?;
    }
    Ok(())
}

/// The part `part` of the tensor at byte `start` of `mapped` as a view of the file's pages, where
/// the device addresses them in place and nothing asks for memory of its own (as
/// [`Placement::of`] decides); `None` where the part must be read.
fn view_part(
    mapped: &MappedFile,
    start: u64,
    part: &Layout,
    dtype: DType,
    options: &LoadOptions,
) -> Result<Option<Tensor>> {
    let mapping = mapped.buffer();
    // Views of pages a write would fault on are handed out nowhere.
    if !mapped.is_copy_on_write() || part.numel() == 0 {
        return Ok(None);
    }
    let base = mapping.require_host("loading a tensor")?.as_ptr() as usize;
    let aligned = is_aligned(base + start as usize, dtype);
    // Inside the mapped file (checked by the parser and the plan), so it fits in usize.
    let at = |offset: usize| part.with_byte_offset(offset);
    if options.device.is_cpu() {
        if options.copy || !aligned {
            return Ok(None);
        }
        let view = Tensor::new(
            mapping.clone(),
            dtype,
            at(start as usize + part.byte_offset()),
        )?;
        return Ok(Some(view));
    }
    let device = backend::placement(options.device, options.storage)?;
    let storage = backend::resolve_storage(device, options.storage)?.mode;
    if Placement::of(storage, options.copy, aligned) != Placement::View {
        return Ok(None);
    }
    let bytes = part.byte_range(dtype.itemsize())?;
    let covering = start as usize + bytes.start..start as usize + bytes.end;
    match backend::wrap_host(device, mapping, std::slice::from_ref(&covering)) {
        Some(Ok(wrapped)) => match wrapped.into_iter().next() {
            // The part's first element is its lowest byte (positive strides).
            Some((buffer, offset)) => Ok(Some(Tensor::new(buffer, dtype, at(offset))?)),
            None => Err(Error::Driver {
                backend: "loader",
                message: "the backend placed no range of the one it was given".into(),
            }),
        },
        Some(Err(e)) => {
            log::debug!(
                "dlbridge: {device} did not wrap the pages of {} ({e}); reading the part instead",
                mapped.path().display()
            );
            Ok(None)
        }
        None => Ok(None),
    }
}

/// The runs of `plan` (byte ranges of the tensor at byte `start` of `mapped`) read into one new
/// allocation on `options.device`, and the part as a view of it (read-only on the CPU without
/// `copy`, as every CPU load without it is).
fn read_part(
    mapped: &MappedFile,
    start: u64,
    plan: &PartPlan,
    dtype: DType,
    options: &LoadOptions,
) -> Result<Tensor> {
    let device = if options.device.is_cpu() {
        Device::CPU
    } else {
        backend::placement(options.device, options.storage)?
    };
    let memory = Tensor::allocate(&[plan.len], DType::U8, device, options.storage, false)?;
    // The CPU reader reads through the page cache (it has no staging buffers to align).
    let direct = if device.is_cpu() {
        None
    } else {
        direct_file(mapped, options)
    };
    let reads: Vec<FileRead<'_>> = plan
        .runs
        .iter()
        .map(|(run, dst_offset)| FileRead {
            path: mapped.path(),
            file: mapped.file(),
            direct: direct.as_ref(),
            offset: start + run.start,
            len: (run.end - run.start) as usize,
            dst: memory.buffer(),
            dst_offset: *dst_offset,
        })
        .collect();
    if !reads.is_empty() {
        let done = AtomicU64::new(0);
        let total = plan.bytes_read();
        run_reads(
            &reads,
            device,
            options,
            direct.is_some(),
            &done,
            total,
            &mut |_, _| {},
        )?;
    }
    let tensor = Tensor::new(memory.buffer().clone(), dtype, plan.layout.clone())?;
    Ok(if device.is_cpu() && !options.copy {
        tensor.into_read_only()
    } else {
        tensor
    })
}

/// Reads the files' selected bytes into their allocations, reporting `done` bytes of `total`
/// about ten times a second while the backend reads ([`run_reads`]).
fn read_files(
    files: &[FileLoad<'_>],
    device: Device,
    options: &LoadOptions,
    done: &AtomicU64,
    total: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let direct = files.iter().all(|f| f.direct.is_some());
    let reads: Vec<FileRead<'_>> = files.iter().flat_map(FileLoad::reads).collect();
    run_reads(&reads, device, options, direct, done, total, progress)
}

/// The engine: reads each (file, byte range) of `reads` into its destination (a buffer and an
/// offset there) on `device` through the backend's reader ([`backend::read_file`]: parallel
/// positioned reads, and pinned staging with asynchronous copies for device memory), reporting
/// `done` bytes of `total` about ten times a second while it reads. It knows no file format:
/// whole-file loads and partial reads ([`load_part`]) hand it their plans alike.
/// `direct`: every read has a direct-I/O descriptor (the reader's defaults follow).
fn run_reads(
    reads: &[FileRead<'_>],
    device: Device,
    options: &LoadOptions,
    direct: bool,
    done: &AtomicU64,
    total: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let read_options = read_options(options, direct, done);
    let caller = std::thread::current();
    #[cfg(test)]
    count_stream_thread_work();
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let r = backend::read_file(device, reads, &read_options);
            // Wake the caller now rather than at its next progress tick.
            caller.unpark();
            r
        });
        // `is_finished` also ends the wait when the reader panicked.
        while !reader.is_finished() {
            progress(done.load(Ordering::Relaxed), total);
            std::thread::park_timeout(Duration::from_millis(100));
        }
        reader.join().unwrap_or_else(|_| {
            Err(Error::Driver {
                backend: "loader",
                message: "a reader thread panicked".into(),
            })
        })
    })
}

/// Counts, in tests, fixed work of a load (a residency sample, a progress thread) done on a
/// stream's loading thread: [`Session`] does it once per stream, not once per group.
#[cfg(test)]
fn count_stream_thread_work() {
    if std::thread::current().name() == Some(super::stream::THREAD_NAME) {
        STREAM_THREAD_WORK.fetch_add(1, Ordering::Relaxed);
    }
}

/// What [`count_stream_thread_work`] counted.
#[cfg(test)]
pub(crate) static STREAM_THREAD_WORK: AtomicU64 = AtomicU64::new(0);

/// The reader's options for `options` (`direct`: every read has a direct-I/O descriptor, and the
/// reader's defaults follow), counting landed bytes in `done`.
fn read_options<'a>(options: &LoadOptions, direct: bool, done: &'a AtomicU64) -> ReadOptions<'a> {
    ReadOptions {
        threads: options.threads.unwrap_or_else(if direct {
            default_direct_threads
        } else {
            default_threads
        }),
        chunk: options.chunk_bytes.unwrap_or(if direct {
            DEFAULT_DIRECT_CHUNK
        } else {
            DEFAULT_CHUNK
        }),
        register: options.register_pages.unwrap_or_else(|| {
            std::env::var("DLBRIDGE_LOAD_REGISTER").is_ok_and(|v| v.trim() == "1")
        }),
        gds: options
            .gds
            .or_else(|| match std::env::var("DLBRIDGE_LOAD_GDS").as_deref() {
                Ok("1") => Some(true),
                Ok("0") => Some(false),
                _ => None,
            }),
        done,
    }
}

/// How a tensor whose bytes the device addresses in place (a wrapped file mapping) reaches the
/// caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    /// A read-only view of the file's pages.
    View,
    /// A copy on the device, in memory of its own in the load's storage mode.
    Copy,
}

impl Placement {
    /// A view only in shared storage (the memory the host pages are), when no copy is asked for
    /// and the bytes are aligned for the tensor's elements.
    fn of(storage: StorageMode, copy: bool, aligned: bool) -> Placement {
        if storage == StorageMode::Shared && !copy && aligned {
            Placement::View
        } else {
            Placement::Copy
        }
    }
}

/// The byte ranges of the mapped file the device must address: those of the non-empty tensors
/// (an empty one needs no bytes, and may sit where no wrapped page is).
pub(crate) fn wrapped_ranges(locations: &[&Item]) -> Vec<Range<usize>> {
    locations
        .iter()
        .filter(|l| !l.byte_range.is_empty())
        // Inside the mapped file (checked by the parser), so both ends fit in usize.
        .map(|l| l.byte_range.start as usize..l.byte_range.end as usize)
        .collect()
}

/// One file's tensors on `device` straight from its mapping, which the backend makes addressable
/// by the device without a copy ([`backend::wrap_host`]): each a view of the mapping or a copy on
/// the device, as [`Placement::of`] decides. `None` where the backend cannot wrap host pages or
/// declines this file's, for the caller to read the file instead.
fn wrap_file(
    mapped: &MappedFile,
    locations: &[&Item],
    device: Device,
    options: &LoadOptions,
) -> Result<Option<Vec<(String, Tensor)>>> {
    let mapping = mapped.buffer();
    let ranges = wrapped_ranges(locations);
    // Views of pages a write would fault on are handed out nowhere: a read-only mapping is read.
    if ranges.is_empty() || !mapped.is_copy_on_write() {
        return Ok(None);
    }
    let wrapped = match backend::wrap_host(device, mapping, &ranges) {
        None => return Ok(None),
        Some(Ok(wrapped)) => wrapped,
        Some(Err(e)) => {
            log::debug!(
                "dlbridge: {device} did not wrap the pages of {} ({e}); reading the file instead",
                mapped.path().display()
            );
            return Ok(None);
        }
    };
    let storage = backend::resolve_storage(device, options.storage)?.mode;
    place(mapping, locations, wrapped, storage, options.copy).map(Some)
}

/// The tensors at `locations` in `mapping`, whose non-empty ranges ([`wrapped_ranges`]) the
/// device addresses at `wrapped` (a buffer and the byte offset there, range by range): each a
/// view or a copy in `storage`, as [`Placement::of`] decides.
fn place(
    mapping: &Buffer,
    locations: &[&Item],
    wrapped: Vec<(Buffer, usize)>,
    storage: StorageMode,
    copy: bool,
) -> Result<Vec<(String, Tensor)>> {
    let base = mapping.require_host("loading a tensor")?.as_ptr() as usize;
    // An empty tensor is a view of no bytes of any wrapped buffer.
    let anywhere = wrapped.first().map(|(buffer, _)| (buffer.clone(), 0));
    let mut wrapped = wrapped.into_iter();
    let mut out = Vec::with_capacity(locations.len());
    for l in locations {
        let placed = if l.byte_range.is_empty() {
            anywhere.clone()
        } else {
            wrapped.next()
        };
        let (buffer, offset) = placed.ok_or_else(|| Error::Driver {
            backend: "loader",
            message: "the backend placed fewer tensors than it was given".into(),
        })?;
        let aligned = is_aligned(base + l.byte_range.start as usize, l.dtype);
        let tensor = match Placement::of(storage, copy, aligned) {
            Placement::View => view(buffer, offset, l)?,
            Placement::Copy => copy_of(&buffer, offset, l, Some(storage))?,
        };
        out.push((l.name.clone(), tensor));
    }
    Ok(out)
}

/// The tensor at `l` as a view of `buffer`, which holds its bytes from `offset`.
fn view(buffer: Buffer, offset: usize, l: &Item) -> Result<Tensor> {
    let layout = l.layout.with_byte_offset(offset);
    Tensor::with_packing(buffer, l.dtype, layout, l.dtype.is_sub_byte())
}

/// The tensor at `l` as a copy, on `buffer`'s device in `storage`, of its bytes in `buffer` from
/// `offset`: compact, in new memory, aligned for any element type.
fn copy_of(
    buffer: &Buffer,
    offset: usize,
    l: &Item,
    storage: Option<StorageMode>,
) -> Result<Tensor> {
    let len = (l.byte_range.end - l.byte_range.start) as usize;
    let bytes = Tensor::new(
        buffer.clone(),
        DType::U8,
        Layout::contiguous_at(&[len], offset)?,
    )?;
    let copy = bytes.copy_to_storage(buffer.device(), storage)?;
    view(copy.buffer().clone(), 0, l)
}

/// One file's part of a device load: its open handles and the allocations its selected tensors
/// are read into ([`Allocation`]).
struct FileLoad<'a> {
    path: &'a Path,
    file: &'a File,
    direct: Option<File>,
    locations: Vec<&'a Item>,
    /// The allocations, in file order, each with the file range it mirrors.
    dsts: Vec<(Range<u64>, Tensor)>,
}

impl<'a> FileLoad<'a> {
    fn new(
        mapped: &'a MappedFile,
        locations: Vec<&'a Item>,
        device: Device,
        options: &LoadOptions,
        allocation: Allocation,
        direct: Option<File>,
    ) -> Result<FileLoad<'a>> {
        let path = mapped.path();
        // The descriptor the file was opened and checked with: the path is not opened again
        // for buffered reads (it may name another file by now).
        let file = mapped.file();
        let mut spans: Vec<Range<u64>> = match allocation {
            Allocation::PerFile => {
                let start = locations.iter().map(|l| l.byte_range.start).min();
                let end = locations.iter().map(|l| l.byte_range.end).max();
                std::iter::once(start.unwrap_or(0)..end.unwrap_or(0)).collect()
            }
            Allocation::PerTensor => locations.iter().map(|l| l.byte_range.clone()).collect(),
        };
        spans.sort_by_key(|s| (s.start, s.end));
        let dsts = spans
            .into_iter()
            .map(|span| {
                let len = usize::try_from(span.end - span.start).map_err(|_| {
                    Error::Overflow(format!(
                        "{} bytes do not fit in memory",
                        span.end - span.start
                    ))
                })?;
                let memory = Tensor::allocate(&[len], DType::U8, device, options.storage, false)?;
                Ok((span, memory))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(FileLoad {
            path,
            file,
            direct,
            locations,
            dsts,
        })
    }

    /// The index of the allocation holding file range `range` (inside one of them, by
    /// construction).
    fn holder(&self, range: &Range<u64>) -> usize {
        let after = self
            .dsts
            .partition_point(|(span, _)| span.start <= range.start);
        let index = after.saturating_sub(1);
        debug_assert!({
            let span = &self.dsts[index].0;
            span.start <= range.start && range.end <= span.end
        });
        index
    }

    /// The allocation holding file range `range`, and the offset of the range's start there.
    fn destination(&self, range: &Range<u64>) -> (&Tensor, usize) {
        let (span, memory) = &self.dsts[self.holder(range)];
        (memory, (range.start - span.start) as usize)
    }

    /// The reads: maximal runs of adjacent selected tensors that land in one allocation, so a
    /// whole checkpoint loaded per file is read as one range per file.
    fn reads(&self) -> Vec<FileRead<'_>> {
        let mut runs: Vec<(usize, Range<u64>)> = Vec::new();
        for l in &self.locations {
            if l.byte_range.is_empty() {
                continue;
            }
            let dst = self.holder(&l.byte_range);
            match runs.last_mut() {
                Some((d, run)) if *d == dst && run.end == l.byte_range.start => {
                    run.end = l.byte_range.end;
                }
                _ => runs.push((dst, l.byte_range.clone())),
            }
        }
        runs.into_iter()
            .map(|(_, run)| {
                let (memory, dst_offset) = self.destination(&run);
                FileRead {
                    path: self.path,
                    file: self.file,
                    direct: self.direct.as_ref(),
                    offset: run.start,
                    len: (run.end - run.start) as usize,
                    dst: memory.buffer(),
                    dst_offset,
                }
            })
            .collect()
    }

    /// Whether every tensor's bytes are aligned for its element type in its allocation (each is
    /// a view of it, [`FileLoad::views`]).
    fn aligned(&self) -> bool {
        self.locations.iter().all(|l| {
            let (memory, offset) = self.destination(&l.byte_range);
            is_aligned(memory.buffer().handle() as usize + offset, l.dtype)
        })
    }

    /// Each tensor as a view of its allocation, or a copy of its bytes (in `storage`) where they
    /// are not aligned for its element type.
    fn views(
        &self,
        storage: Option<StorageMode>,
        out: &mut BTreeMap<String, Tensor>,
    ) -> Result<()> {
        for l in &self.locations {
            let (memory, offset) = self.destination(&l.byte_range);
            let buffer = memory.buffer();
            let tensor = if is_aligned(buffer.handle() as usize + offset, l.dtype) {
                view(buffer.clone(), offset, l)?
            } else {
                copy_of(buffer, offset, l, storage)?
            };
            out.insert(l.name.clone(), tensor);
        }
        Ok(())
    }
}

/// The file opened for reads around the page cache where `options` ask for them, or, by
/// default, where most of the file is not in the page cache; `None`: read through the page cache
/// (also where the file system refuses `O_DIRECT`, as tmpfs does).
fn direct_file(mapped: &MappedFile, options: &LoadOptions) -> Option<File> {
    let direct = match options.direct_io {
        Some(direct) => direct,
        None => resident_fraction(mapped) < 0.5,
    };
    direct.then(|| open_direct(mapped)).flatten()
}

/// The fraction of a file's pages in the page cache, estimated by `mincore` over
/// [`RESIDENCY_SAMPLES`] runs of [`RESIDENCY_RUN`] pages spread evenly over its mapping (the
/// whole mapping when it is smaller): 1.0 where it cannot be told. The estimate only chooses
/// between reads through and around the page cache; asking about every page of a large file
/// costs more than that choice is worth (11-14 ms per 1.75 GB shard on the H100 machine, 49 ms of
/// a 7 GB load that then read for 150 ms; the samples take 0.2 ms).
fn resident_fraction(mapped: &MappedFile) -> f64 {
    #[cfg(test)]
    count_stream_thread_work();
    let Some(base) = mapped.buffer().host_ptr() else {
        return 1.0;
    };
    let page = crate::backend::cpu::page_size();
    let pages = mapped.buffer().len().div_ceil(page);
    let mut vec = [0u8; RESIDENCY_RUN];
    let (mut resident, mut asked) = (0, 0);
    for run in residency_runs(pages) {
        // SAFETY: `run` lies inside the `pages` pages of the live, page-aligned mapping `base`
        // starts (the file's buffer; its last page may be partial, which mincore accepts);
        // `vec` has a byte for each of its at most `RESIDENCY_RUN` pages, as mincore writes.
        let rc = unsafe {
            libc::mincore(
                base.as_ptr().wrapping_add(run.start * page).cast(),
                run.len() * page,
                vec.as_mut_ptr().cast(),
            )
        };
        if rc != 0 {
            return 1.0;
        }
        resident += vec[..run.len()].iter().filter(|&&b| b & 1 != 0).count();
        asked += run.len();
    }
    if asked == 0 {
        return 1.0;
    }
    resident as f64 / asked as f64
}

/// How many runs of pages [`resident_fraction`] asks about, at most.
const RESIDENCY_SAMPLES: usize = 64;

/// Pages per run [`resident_fraction`] asks about, at most (256 KiB of 4 KiB pages).
const RESIDENCY_RUN: usize = 64;

/// The page ranges [`resident_fraction`] asks about in a mapping of `pages` pages: all of them
/// when they fit in the samples, else [`RESIDENCY_SAMPLES`] runs of [`RESIDENCY_RUN`] pages, the
/// first at the start, the last at the end, the others evenly between.
fn residency_runs(pages: usize) -> impl Iterator<Item = Range<usize>> {
    let sampled = pages > RESIDENCY_SAMPLES * RESIDENCY_RUN;
    let runs = if sampled {
        RESIDENCY_SAMPLES
    } else {
        pages.div_ceil(RESIDENCY_RUN)
    };
    (0..runs).map(move |i| {
        let start = if sampled {
            (pages - RESIDENCY_RUN) * i / (RESIDENCY_SAMPLES - 1)
        } else {
            i * RESIDENCY_RUN
        };
        start..(start + RESIDENCY_RUN).min(pages)
    })
}

/// The file opened again for reads around the page cache: `O_DIRECT` on Linux,
/// `F_NOCACHE` on Apple platforms; `None` where the system or the file system has no such mode,
/// or where the path no longer names the file that was mapped (which is then read through the
/// page cache, from the mapping's own descriptor).
fn open_direct(mapped: &MappedFile) -> Option<File> {
    use std::os::unix::fs::MetadataExt;
    if !cfg!(any(target_os = "linux", target_vendor = "apple")) {
        return None;
    }
    #[cfg(target_os = "linux")]
    let flags = libc::O_DIRECT;
    #[cfg(not(target_os = "linux"))]
    let flags = 0;
    let file = open_regular(mapped.path(), flags).ok()?;
    let (a, b) = (file.metadata().ok()?, mapped.file().metadata().ok()?);
    if (a.dev(), a.ino()) != (b.dev(), b.ino()) {
        return None;
    }
    #[cfg(target_vendor = "apple")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: `fcntl(F_NOCACHE)` on a descriptor this function owns changes only how reads
        // of it use the cache.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) };
        if rc == -1 {
            return None;
        }
    }
    Some(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::SafeTensors;

    /// A safetensors file written byte by byte: `u8` "a" [1, 2, 3], then `f32` "b" [1.5, -2.0]
    /// three bytes in (misaligned for its elements wherever the data starts 8-aligned), then an
    /// empty `f32` "e".
    fn misaligned_file(tag: &str) -> std::path::PathBuf {
        let header = r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"F32","shape":[2],"data_offsets":[3,11]},"e":{"dtype":"F32","shape":[0,4],"data_offsets":[11,11]}}"#;
        let mut header = header.to_owned();
        while (8 + header.len()) % 8 != 0 {
            header.push(' ');
        }
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[1, 2, 3]);
        for v in [1.5f32, -2.0] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        let path = std::env::temp_dir().join(format!(
            "dlbridge-load-{}-{tag}.safetensors",
            std::process::id()
        ));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    /// The read path of device loads (allocations, runs of reads, views or aligned copies), run
    /// into host memory: per file, every tensor is a view of one allocation and the adjacent
    /// tensors are one read; per tensor, each non-empty tensor has an allocation of its own. A
    /// selection with a gap, a misaligned tensor and an empty one, both ways, equal to the file.
    #[test]
    fn reads_per_file_and_per_tensor_give_the_file_s_tensors() {
        let big = Tensor::from_slice(&(0..1000).map(|i| i as f32).collect::<Vec<_>>(), &[10, 100])
            .unwrap();
        let small = Tensor::from_slice(&[7i64, -8, 9], &[3]).unwrap();
        let empty = Tensor::zeros(&[0, 5], DType::F16, Device::CPU).unwrap();
        let saved = std::env::temp_dir().join(format!(
            "dlbridge-load-{}-alloc.safetensors",
            std::process::id()
        ));
        crate::safetensors::save_file(
            &[
                ("big", &big),
                ("empty", &empty),
                ("gap", &small),
                ("small", &small),
            ],
            None,
            &saved,
        )
        .unwrap();
        let misaligned = misaligned_file("alloc-misaligned");
        for path in [&saved, &misaligned] {
            let file = SafeTensors::open(path).unwrap();
            let names: Vec<&str> = file.keys().collect();
            let expected = file.load(&names, true).unwrap();
            // In the saved file, leave out the second tensor in file order, between two others.
            let mut in_order = file.items(|_| true).unwrap();
            in_order.sort_by_key(|l| l.byte_range.start);
            let skip = if path == &saved {
                in_order[1].name.clone()
            } else {
                String::new()
            };
            let plan = file.items(|name| name != skip).unwrap();
            for allocation in [Allocation::PerFile, Allocation::PerTensor] {
                let options = LoadOptions {
                    allocation: Some(allocation),
                    chunk_bytes: Some(64),
                    threads: Some(3),
                    ..LoadOptions::new(Device::CPU)
                };
                let load = FileLoad::new(
                    file.mapped(),
                    plan.iter().collect(),
                    Device::CPU,
                    &options,
                    Allocation::of(&options),
                    direct_file(file.mapped(), &options),
                )
                .unwrap();
                let reads = load.reads().len();
                let runs = match allocation {
                    // The misaligned file's tensors are adjacent; the gap splits the saved one's.
                    Allocation::PerFile => 1 + usize::from(path == &saved),
                    Allocation::PerTensor => {
                        plan.iter().filter(|l| !l.byte_range.is_empty()).count()
                    }
                };
                assert_eq!(reads, runs, "{allocation:?} {}", path.display());
                let done = AtomicU64::new(0);
                read_files(
                    std::slice::from_ref(&load),
                    Device::CPU,
                    &options,
                    &done,
                    0,
                    &mut |_, _| {},
                )
                .unwrap();
                let mut out = BTreeMap::new();
                load.views(None, &mut out).unwrap();
                assert_eq!(out.len(), plan.len());
                for (name, got) in &out {
                    let want = &expected[name];
                    assert_eq!(
                        (got.dtype(), got.shape()),
                        (want.dtype(), want.shape()),
                        "{name}"
                    );
                    assert_eq!(got.to_vec::<u8>().ok(), want.to_vec::<u8>().ok(), "{name}");
                    if got.dtype().itemsize() == 4 {
                        assert_eq!(got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
                    }
                }
                let nonempty: Vec<&Tensor> = out
                    .iter()
                    .filter(|(name, t)| t.numel() > 0 && name.as_str() != "b")
                    .map(|(_, t)| t)
                    .collect();
                for (i, a) in nonempty.iter().enumerate() {
                    for b in &nonempty[i + 1..] {
                        let shared = a.buffer().same_allocation(b.buffer());
                        assert_eq!(shared, allocation == Allocation::PerFile, "{allocation:?}");
                    }
                }
            }
        }
        std::fs::remove_file(&saved).unwrap();
        std::fs::remove_file(&misaligned).unwrap();
    }

    /// The engine on a plan no format made (raw bytes, `MappedFile::open` with a parser that
    /// reads nothing): a row-major array, a column-major one and a misaligned one, through the
    /// read path of device loads (run into host memory, per file and per array) and the CPU path,
    /// all equal to the bytes read by hand.
    #[test]
    fn a_plan_of_raw_byte_ranges_loads_with_its_layouts() {
        let bytes: Vec<u8> = (0..64u8).collect();
        let path =
            std::env::temp_dir().join(format!("dlbridge-engine-{}-raw.bin", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let (mapped, ()) = MappedFile::open(&path, |_| Ok(())).unwrap();
        std::fs::remove_file(&path).unwrap();
        let element = |at: usize| i16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let items = vec![
            Item {
                name: "c".into(),
                byte_range: 0..12,
                dtype: DType::I16,
                layout: Layout::contiguous(&[2, 3]).unwrap(),
            },
            Item {
                name: "f".into(),
                byte_range: 12..24,
                dtype: DType::I16,
                layout: Layout::new(&[2, 3], &[1, 2], 0).unwrap(),
            },
            Item {
                name: "odd".into(),
                byte_range: 25..31,
                dtype: DType::I16,
                layout: Layout::contiguous(&[3]).unwrap(),
            },
        ];
        let want: BTreeMap<&str, Vec<i16>> = [
            ("c", (0..6).map(|k| element(2 * k)).collect()),
            // Element [i, j] of the column-major array is the (i + 2 j)-th.
            (
                "f",
                [0, 2, 4, 1, 3, 5]
                    .iter()
                    .map(|k| element(12 + 2 * k))
                    .collect(),
            ),
            ("odd", (0..3).map(|k| element(25 + 2 * k)).collect()),
        ]
        .into_iter()
        .collect();
        let check = |out: &BTreeMap<String, Tensor>, how: &str| {
            assert_eq!(out.len(), 3, "{how}");
            for (name, values) in &want {
                assert_eq!(&out[*name].to_vec::<i16>().unwrap(), values, "{how} {name}");
            }
            assert_eq!(out["f"].strides(), [1, 2], "{how}");
        };
        let cpu = load(
            &[(&mapped, items.clone())],
            &LoadOptions::new(Device::CPU),
            &mut |_, _| {},
        )
        .unwrap();
        check(&cpu, "cpu");
        assert!(cpu["c"].buffer().same_allocation(mapped.buffer()), "a view");
        assert!(
            !cpu["odd"].buffer().same_allocation(mapped.buffer()),
            "a copy"
        );
        for allocation in [Allocation::PerFile, Allocation::PerTensor] {
            let options = LoadOptions {
                allocation: Some(allocation),
                chunk_bytes: Some(4),
                threads: Some(2),
                ..LoadOptions::new(Device::CPU)
            };
            let load = FileLoad::new(
                &mapped,
                items.iter().collect(),
                Device::CPU,
                &options,
                allocation,
                direct_file(&mapped, &options),
            )
            .unwrap();
            let done = AtomicU64::new(0);
            read_files(
                std::slice::from_ref(&load),
                Device::CPU,
                &options,
                &done,
                0,
                &mut |_, _| {},
            )
            .unwrap();
            assert_eq!(done.load(Ordering::Relaxed), 30, "{allocation:?}");
            let mut out = BTreeMap::new();
            load.views(None, &mut out).unwrap();
            check(&out, &format!("{allocation:?}"));
        }
        // A plan past the file's end is an error, not a read of other memory.
        let past = Item {
            byte_range: 60..68,
            ..items[0].clone()
        };
        let e = host_tensor(&mapped, past.byte_range, past.dtype, &past.layout, false);
        assert!(matches!(e, Err(Error::OutOfBounds(_))), "{e:?}");
    }

    #[test]
    fn allocation_names() {
        for (name, want) in [
            ("per-file", Allocation::PerFile),
            ("PER_TENSOR", Allocation::PerTensor),
            (" per-tensor ", Allocation::PerTensor),
        ] {
            assert_eq!(name.parse::<Allocation>().unwrap(), want, "{name}");
        }
        let e = "per-array".parse::<Allocation>().unwrap_err();
        assert!(e.to_string().contains("'per-file' or 'per-tensor'"), "{e}");
    }

    #[test]
    fn placement_rule() {
        use Placement::{Copy, View};
        use StorageMode::{Managed, Private, Shared};
        for (storage, copy, aligned, expected) in [
            (Shared, false, true, View),
            (Shared, false, false, Copy),
            (Shared, true, true, Copy),
            (Private, false, true, Copy),
            (Managed, false, true, Copy),
            (Private, true, false, Copy),
        ] {
            assert_eq!(
                Placement::of(storage, copy, aligned),
                expected,
                "{storage} copy={copy} aligned={aligned}"
            );
        }
    }

    #[test]
    fn alignment_goes_by_item_size() {
        assert!(is_aligned(0x1000, DType::F32));
        assert!(!is_aligned(0x1002, DType::F32));
        assert!(is_aligned(0x1002, DType::BF16));
        assert!(!is_aligned(0x1004, DType::F64));
        assert!(is_aligned(0x1003, DType::U8));
        let fp4: DType = "float4_e2m1fn".parse().unwrap();
        assert!(is_aligned(0x1003, fp4), "packed elements are read as bytes");
    }

    /// The placement rule over a file whose "device" addresses the mapping in place (the CPU
    /// buffer itself, at each tensor's file offset): what a backend's `wrap_host` gives.
    #[test]
    fn wrapped_tensors_are_views_or_copies() {
        let path = misaligned_file("place");
        let file = SafeTensors::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let plan = file.items(|_| true).unwrap();
        let locations: Vec<&Item> = plan.iter().collect();
        let ranges = wrapped_ranges(&locations);
        assert_eq!(ranges.len(), 2, "the empty tensor is not wrapped");
        let mapping = file.buffer();
        let in_place = || ranges.iter().map(|r| (mapping.clone(), r.start)).collect();
        let by_name = |placed: Vec<(String, Tensor)>| -> BTreeMap<String, Tensor> {
            placed.into_iter().collect()
        };

        let shared =
            by_name(place(mapping, &locations, in_place(), StorageMode::Shared, false).unwrap());
        assert!(shared["a"].buffer().same_allocation(mapping), "a view");
        assert!(shared["a"].is_read_only());
        assert!(
            !shared["b"].buffer().same_allocation(mapping),
            "misaligned: a copy"
        );
        assert_eq!(shared["b"].to_vec::<f32>().unwrap(), vec![1.5, -2.0]);
        assert_eq!(shared["e"].shape(), [0, 4]);
        for (storage, copy) in [(StorageMode::Shared, true), (StorageMode::Private, false)] {
            let copies = by_name(place(mapping, &locations, in_place(), storage, copy).unwrap());
            for (name, t) in &copies {
                assert!(!t.buffer().same_allocation(mapping), "{name}: a copy");
                assert!(!t.is_read_only(), "{name}: memory of its own");
            }
            assert_eq!(copies["a"].to_vec::<u8>().unwrap(), vec![1, 2, 3]);
            assert_eq!(copies["b"].to_vec::<f32>().unwrap(), vec![1.5, -2.0]);
            assert_eq!(copies["e"].numel(), 0);
        }
        // A backend that placed fewer ranges than it was given is an error, not a panic.
        let short = vec![(mapping.clone(), ranges[0].start)];
        assert!(place(mapping, &locations, short, StorageMode::Shared, false).is_err());
    }

    #[cfg(not(metal))]
    #[test]
    fn metal_loads_without_the_backend_answer_unavailable() {
        let path = misaligned_file("unavailable");
        let checkpoint = crate::safetensors::Checkpoint::open(&path).unwrap();
        let shard = &checkpoint.shards()[0];
        let items = [0..3, 3..11];
        assert!(backend::wrap_host(Device::metal(0), shard.buffer(), &items).is_none());
        assert!(backend::wrap_host(Device::CPU, shard.buffer(), &items).is_none());
        let options = LoadOptions::new(Device::metal(0));
        let err = checkpoint
            .load_to(|_| true, &options, &mut |_, _| {})
            .unwrap_err();
        assert!(matches!(err, Error::BackendUnavailable { .. }), "{err}");
        std::fs::remove_file(&path).unwrap();
    }

    /// The residency samples cover a small mapping whole, run after run, and a large one with
    /// `RESIDENCY_SAMPLES` runs from its first page to its last, in order, inside it.
    #[test]
    fn residency_runs_cover_small_mappings_and_sample_large_ones() {
        for pages in [0, 1, 63, 64, 65, 4095, 4096] {
            let runs: Vec<_> = residency_runs(pages).collect();
            assert_eq!(
                runs.iter().map(|r| r.len()).sum::<usize>(),
                pages,
                "{pages}"
            );
            assert!(
                runs.windows(2).all(|w| w[0].end == w[1].start),
                "{pages}: {runs:?}"
            );
        }
        for pages in [4097, 10_000, 1 << 20, 427_393] {
            let runs: Vec<_> = residency_runs(pages).collect();
            assert_eq!(runs.len(), RESIDENCY_SAMPLES);
            assert!(
                runs.iter()
                    .all(|r| r.len() == RESIDENCY_RUN && r.end <= pages)
            );
            assert_eq!((runs[0].start, runs[RESIDENCY_SAMPLES - 1].end), (0, pages));
            assert!(
                runs.windows(2).all(|w| w[0].end <= w[1].start),
                "{pages}: {runs:?}"
            );
        }
    }

    /// The sampled residency of a 32 MiB file under `target/`: all of it just after it was
    /// written and read back, then about half once the kernel was told to drop the second half of
    /// its cached pages (written back first), then about none. (On a tmpfs, whose pages are the file and
    /// are never dropped, it stays all.)
    #[test]
    #[cfg(target_os = "linux")]
    fn resident_fraction_tells_cached_files_from_dropped_ones() {
        use std::os::fd::AsRawFd;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!(
            "dlbridge-residency-{}.safetensors",
            std::process::id()
        ));
        let data = Tensor::zeros(&[8 << 20], DType::F32, Device::CPU).unwrap();
        crate::safetensors::save_file(&[("w", &data)], None, &path).unwrap();
        // The save wrote around the page cache (O_DIRECT): a read brings the file into it.
        std::fs::read(&path).unwrap();
        let file = File::open(&path).unwrap();
        file.sync_all().unwrap();
        let len = file.metadata().unwrap().len() as i64;
        let estimate = || resident_fraction(SafeTensors::open(&path).unwrap().mapped());
        let first = estimate();
        let drop = |from: i64| {
            // SAFETY: advice on a descriptor this test owns; it changes only the page cache.
            let rc = unsafe {
                libc::posix_fadvise(
                    file.as_raw_fd(),
                    from,
                    len - from,
                    libc::POSIX_FADV_DONTNEED,
                )
            };
            assert_eq!(rc, 0);
        };
        drop(len / 2);
        let half = estimate();
        // The kernel skips pages it is busy with (seen once in 0.17 of the file, with the other
        // tests running): ask again a few times before reading what is left.
        let mut none = 1.0;
        for _ in 0..5 {
            drop(0);
            none = estimate();
            if none < 0.1 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // SAFETY: `statfs` is plain data, for which all zeroes is a value.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path and a struct `statfs` fills.
        let rc = unsafe { libc::statfs(c_path.as_ptr(), &mut fs) };
        assert_eq!(rc, 0);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(first, 1.0);
        if fs.f_type == libc::TMPFS_MAGIC {
            assert_eq!((half, none), (1.0, 1.0));
        } else {
            assert!((0.4..=0.6).contains(&half), "{half}");
            assert!(none < 0.1, "{none}");
        }
    }

    /// Sessions say which is innermost (a binding refuses to leave another out of order), and
    /// leaving the innermost makes the one around it innermost again.
    #[test]
    fn sessions_know_which_is_innermost() {
        let outer = LoadSession::enter();
        assert!(outer.is_innermost());
        let inner = LoadSession::enter();
        assert!(inner.is_innermost() && !outer.is_innermost());
        drop(inner);
        assert!(outer.is_innermost());
    }

    /// A progress callback of a load in an entered session may enter a session of its own (it
    /// found the thread's session borrowed for the whole call, and panicked, before); the
    /// thread's session is back afterwards.
    #[test]
    fn a_progress_callback_may_enter_a_session_inside_a_session_s_load() {
        let path = misaligned_file("session-progress");
        let (mapped, header) = MappedFile::open(&path, |bytes| {
            crate::safetensors::Header::parse(bytes, bytes.len() as u64, &path)
        })
        .unwrap();
        let start = header.tensor("a").unwrap().byte_range().start;
        let dst = Tensor::zeros(&[3], DType::U8, Device::CPU).unwrap();
        let part = PartInto {
            file: &mapped,
            start,
            array_len: 3,
            part: Layout::contiguous(&[3]).unwrap(),
            dtype: DType::U8,
            dst: &dst,
        };
        let outer = LoadSession::enter();
        let mut calls = 0;
        // SAFETY: `dst` is this test's own, read nowhere else during the call.
        unsafe {
            load_parts_into(&[part], &LoadOptions::new(Device::CPU), &mut |_, _| {
                let inner = LoadSession::enter();
                assert!(inner.is_innermost());
                calls += 1;
            })
        }
        .unwrap();
        assert!(calls > 0);
        assert!(outer.is_innermost());
        assert!(CURRENT.with_borrow(Option::is_some));
        assert_eq!(dst.to_vec::<u8>().unwrap(), [1, 2, 3]);
        drop(outer);
        assert!(CURRENT.with_borrow(Option::is_none));
        std::fs::remove_file(&path).unwrap();
    }
}
