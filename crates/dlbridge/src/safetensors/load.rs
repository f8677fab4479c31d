//! Loading a checkpoint onto any device: CPU tensors are views of the mapped files (or private
//! copies); other devices get the bytes read straight into their memory by the backend
//! ([`crate::backend`]'s `read_file`: pinned staging and asynchronous copies on CUDA), one
//! allocation per file, tensors as views of it.

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::file::{Checkpoint, SafeTensors, TensorLocation};
use crate::backend::{self, FileRead, ReadOptions};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// How [`Checkpoint::load_to`] loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Where the tensors go.
    pub device: Device,
    /// CPU only: `false` gives read-only views of the mapped files (zero-copy), `true` writable
    /// private memory. Other devices always get memory of their own.
    pub copy: bool,
    /// Convert every floating-point tensor to this dtype after loading, on the device.
    pub dtype: Option<DType>,
    /// Reader threads (`None`: chosen from the machine, see [`default_threads`]).
    pub threads: Option<usize>,
    /// The largest single read and staging buffer (`None`: [`DEFAULT_CHUNK`]).
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
    /// Otherwise, how many workers of a CUDA load copy from the files' registered pages beside
    /// the `threads` staging workers, where the files are read through the page cache (`0`:
    /// staging alone). `None`: the environment variable `DLBRIDGE_LOAD_REGISTER_THREADS`, else
    /// [`DEFAULT_REGISTER_THREADS`].
    pub register_threads: Option<usize>,
    /// Whether a CUDA load reads through GPUDirect Storage (cuFile, loaded at run time where
    /// present): `Some(true)` always (an error where cuFile cannot be used), `Some(false)` never.
    /// `None`: the environment variable `DLBRIDGE_LOAD_GDS` (`1` or `0`), else for direct (cold)
    /// reads where the `nvidia-fs` kernel module lets the storage write GPU memory without a host
    /// copy; cuFile without it (its compatibility mode) is no faster than the staging reader.
    pub gds: Option<bool>,
}

impl LoadOptions {
    /// The defaults for `device`.
    pub fn new(device: Device) -> LoadOptions {
        LoadOptions {
            device,
            copy: false,
            dtype: None,
            threads: None,
            chunk_bytes: None,
            direct_io: None,
            register_pages: None,
            register_threads: None,
            gds: None,
        }
    }
}

/// Workers copying from registered file pages beside the staging workers when none are asked
/// for.
pub const DEFAULT_REGISTER_THREADS: usize = 1;

/// The default size of one read and staging buffer: large enough that a read is mostly copying,
/// small enough that a ring of them per thread stays modest in pinned memory and the first copy
/// to the device starts early (4 MiB was best of 1 to 64 MiB in `bench/bench_load.py --sweep`).
pub const DEFAULT_CHUNK: usize = 4 << 20;

/// Reader threads when none are asked for: half the machine's parallelism, 2 to 8. On the
/// 16-core H100 machine, warm loads of a 7 GB checkpoint with 4 MiB chunks ran at 11.0 GB/s with
/// 2 threads, 19.0 with 4, 27.3 with 6 and 31.6 with 8; chunks of 16 MiB and more were slower at
/// every thread count (`bench/bench_load.py --sweep`, one sweep).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| (n.get() / 2).clamp(2, 8))
}

impl Checkpoint {
    /// Loads the tensors `select` accepts onto `options.device`, calling `progress(done, total)`
    /// (bytes) about ten times a second while a device load runs and once at the end.
    ///
    /// # Errors
    /// The device's allocation errors ([`Error::OutOfMemory`], an unavailable backend), the
    /// file's I/O errors ([`Error::Io`], also for a file truncated while it is read), and the
    /// cast's. On error nothing loaded stays allocated.
    pub fn load_to(
        &self,
        select: impl FnMut(&str) -> bool,
        options: &LoadOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<BTreeMap<String, Tensor>> {
        let plan = self.plan(select);
        let total: u64 = plan
            .iter()
            .map(|l| l.byte_range.end - l.byte_range.start)
            .sum();
        let mut loaded = if options.device.is_cpu() {
            let names: Vec<&str> = plan.iter().map(|l| l.name.as_str()).collect();
            let out = self.load(&names, options.copy)?;
            progress(total, total);
            out
        } else {
            self.load_to_device(&plan, options, total, progress)?
        };
        if let Some(dtype) = options.dtype {
            for tensor in loaded.values_mut() {
                if tensor.dtype() != dtype && tensor.dtype().is_floating() {
                    *tensor = crate::compute::cast(tensor, dtype)?;
                }
            }
        }
        Ok(loaded)
    }

    fn load_to_device(
        &self,
        plan: &[TensorLocation],
        options: &LoadOptions,
        total: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<BTreeMap<String, Tensor>> {
        let device = options.device;
        let mut files: Vec<FileLoad<'_>> = Vec::new();
        for shard in self.shards() {
            let locations: Vec<&TensorLocation> =
                plan.iter().filter(|l| *l.file == *shard.path()).collect();
            if !locations.is_empty() {
                files.push(FileLoad::new(shard, locations, device, options.direct_io)?);
            }
        }
        let done = AtomicU64::new(0);
        let read_options = ReadOptions {
            threads: options.threads.unwrap_or_else(default_threads),
            chunk: options.chunk_bytes.unwrap_or(DEFAULT_CHUNK),
            register: options.register_pages.unwrap_or_else(|| {
                std::env::var("DLBRIDGE_LOAD_REGISTER").is_ok_and(|v| v.trim() == "1")
            }),
            register_threads: options.register_threads.unwrap_or_else(|| {
                std::env::var("DLBRIDGE_LOAD_REGISTER_THREADS")
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(DEFAULT_REGISTER_THREADS)
            }),
            gds: options
                .gds
                .or_else(|| match std::env::var("DLBRIDGE_LOAD_GDS").as_deref() {
                    Ok("1") => Some(true),
                    Ok("0") => Some(false),
                    _ => None,
                }),
            done: &done,
        };
        let reads: Vec<FileRead<'_>> = files.iter().flat_map(FileLoad::reads).collect();
        let caller = std::thread::current();
        let outcome = std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let r = backend::read_file(device, &reads, &read_options);
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
        });
        outcome?;
        progress(total, total);
        let mut out = BTreeMap::new();
        for file in &files {
            file.views(&mut out)?;
        }
        Ok(out)
    }
}

/// One file's part of a device load: its open handles and one destination allocation covering
/// the selected tensors.
struct FileLoad<'a> {
    path: &'a Path,
    file: File,
    direct: Option<File>,
    locations: Vec<&'a TensorLocation>,
    /// The file range the allocation mirrors.
    span: Range<u64>,
    dst: Tensor,
}

impl<'a> FileLoad<'a> {
    fn new(
        shard: &'a SafeTensors,
        locations: Vec<&'a TensorLocation>,
        device: Device,
        direct_io: Option<bool>,
    ) -> Result<FileLoad<'a>> {
        let path = shard.path();
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let direct = match direct_io {
            Some(false) => false,
            Some(true) => true,
            None => resident_fraction(shard) < 0.5,
        };
        // Some file systems (tmpfs) refuse O_DIRECT: read through the page cache there.
        let direct = direct.then(|| open_direct(path)).flatten();
        let start = locations
            .iter()
            .map(|l| l.byte_range.start)
            .min()
            .unwrap_or(0);
        let end = locations
            .iter()
            .map(|l| l.byte_range.end)
            .max()
            .unwrap_or(0);
        let len = usize::try_from(end - start)
            .map_err(|_| Error::Overflow(format!("{} bytes do not fit in memory", end - start)))?;
        let dst = Tensor::empty(&[len], DType::U8, device)?;
        Ok(FileLoad {
            path,
            file,
            direct,
            locations,
            span: start..end,
            dst,
        })
    }

    /// The reads: maximal runs of adjacent selected tensors, so a whole checkpoint is read as one
    /// range per file.
    fn reads(&self) -> Vec<FileRead<'_>> {
        let mut runs: Vec<Range<u64>> = Vec::new();
        for l in &self.locations {
            match runs.last_mut() {
                Some(run) if run.end == l.byte_range.start => run.end = l.byte_range.end,
                _ if l.byte_range.is_empty() => {}
                _ => runs.push(l.byte_range.clone()),
            }
        }
        runs.into_iter()
            .map(|run| FileRead {
                path: self.path,
                file: &self.file,
                direct: self.direct.as_ref(),
                offset: run.start,
                len: (run.end - run.start) as usize,
                dst: self.dst.buffer(),
                dst_offset: (run.start - self.span.start) as usize,
            })
            .collect()
    }

    /// Each tensor as a view of the allocation, or a copy of its bytes where they are not
    /// aligned for its element type.
    fn views(&self, out: &mut BTreeMap<String, Tensor>) -> Result<()> {
        for l in &self.locations {
            let offset = (l.byte_range.start - self.span.start) as usize;
            let packed = l.dtype.is_sub_byte();
            let align = if packed { 1 } else { l.dtype.itemsize() };
            let address = self.dst.buffer().handle() as usize + offset;
            let tensor = if address % align == 0 {
                let layout = Layout::contiguous_at(&l.shape, offset)?;
                Tensor::with_packing(self.dst.buffer().clone(), l.dtype, layout, packed)?
            } else {
                let len = (l.byte_range.end - l.byte_range.start) as usize;
                let bytes = Tensor::new(
                    self.dst.buffer().clone(),
                    DType::U8,
                    Layout::contiguous_at(&[len], offset)?,
                )?;
                // A compact copy: new memory, aligned for any element type.
                let copy = bytes.copy()?;
                let layout = Layout::contiguous(&l.shape)?;
                Tensor::with_packing(copy.buffer().clone(), l.dtype, layout, packed)?
            };
            out.insert(l.name.clone(), tensor);
        }
        Ok(())
    }
}

/// The fraction of a file's pages in the page cache (`mincore` over its mapping): 1.0 where it
/// cannot be told.
fn resident_fraction(shard: &SafeTensors) -> f64 {
    let Some(base) = shard.buffer().host_ptr() else {
        return 1.0;
    };
    let len = shard.buffer().len();
    if len == 0 {
        return 1.0;
    }
    let page = crate::backend::cpu::page_size();
    let pages = len.div_ceil(page);
    let mut vec = vec![0u8; pages];
    // SAFETY: `base` is the page-aligned start of a live mapping of `len` bytes (the shard's
    // buffer); `vec` has one byte per page of it, as mincore writes.
    let rc = unsafe { libc::mincore(base.as_ptr().cast(), len, vec.as_mut_ptr().cast()) };
    if rc != 0 {
        return 1.0;
    }
    vec.iter().filter(|&&b| b & 1 != 0).count() as f64 / pages as f64
}

/// The file opened for reads around the page cache: `O_DIRECT` on Linux, `F_NOCACHE` on Apple
/// platforms; `None` where the system or the file system has no such mode.
fn open_direct(path: &Path) -> Option<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok()
    }
    #[cfg(target_vendor = "apple")]
    {
        use std::os::fd::AsRawFd;
        let file = File::open(path).ok()?;
        // SAFETY: `fcntl(F_NOCACHE)` on a descriptor this function owns changes only how reads
        // of it use the cache.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) };
        (rc != -1).then_some(file)
    }
    #[cfg(not(any(target_os = "linux", target_vendor = "apple")))]
    {
        let _ = path;
        None
    }
}
