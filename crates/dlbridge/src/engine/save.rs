//! The saving engine: a file's bytes, from a head and arrays on any device, written at the
//! disk's speed. It knows no format: a format lays the file out (the head's bytes, each array's
//! byte offset) and the engine moves the bytes.
//!
//! The caller's thread fills a ring of page-aligned host buffers of [`DEFAULT_WRITE_CHUNK`] bytes
//! in file order, straight from each array: compact host arrays by copies of their bytes; strided
//! arrays, and CUDA arrays of any layout, piece by piece through the copy planner, each piece a
//! strided view of the array whose bytes fill the rest of a buffer (no compact copy of the array
//! first). CUDA arrays are copied asynchronously on a stream of the save's into pinned buffers
//! (the pool's pinned memory), many copies in flight: full buffers wait in a batch of up to
//! 256 MiB, and one synchronisation of the streams hands the whole batch on. Writer
//! threads take each full buffer and write it at its aligned file offset around the page cache
//! (`O_DIRECT`), while the next ones fill; the last, partial buffer, and every write where the
//! file system refuses `O_DIRECT` (ramfs), go through the page cache. The file is then synced.
//!
//! The ring holds `threads + 2` buffers, or, for an asynchronous save
//! ([`WriteOptions::whole`]), as many as the file needs, so that every byte is in host memory at
//! the speed of the copies ([`write_file_staged`] tells when) while the disk catches up. The
//! buffers are taken from their pool by `threads` threads of their own as the save starts (a
//! pool that has none yet makes them: pinning memory is the kernel zeroing it and the driver
//! registering it, which several threads do at once), the filler taking each as it comes; each
//! is exactly `chunk` bytes (a whole number of huge pages for the default chunk) where the pool
//! hands out page-aligned blocks, as the CPU's and the pinned pool do for blocks this large.
//! They go back to the pool after the save and serve the next one.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::backend::{self, Queue};
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

use super::file::io_error;

/// The size of one write and ring buffer: a multiple of every block size `O_DIRECT` asks to be
/// aligned to, large enough that the disk sees long writes.
pub const DEFAULT_WRITE_CHUNK: usize = 16 << 20;

/// How many bytes of full buffers wait for their device copies before one synchronisation of the
/// copy streams hands them to the writers (fewer where the ring is small): enough that the
/// copies run back to back, few enough that the disk starts early.
const COPY_BATCH: usize = 256 << 20;

/// The most bytes of one block of staging buffers ([`Slot::block`]).
const BLOCK_BYTES: usize = 256 << 20;

/// Writer threads when none are asked for: one per core, 2 to 8 (the writes wait on the disk,
/// not the CPU).
pub fn default_write_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get().clamp(2, 8))
}

/// One array the engine writes: its bytes (compact, row-major; sub-byte elements packed) land
/// at `offset` of the file and take `nbytes` bytes there.
#[derive(Clone, Copy, Debug)]
pub struct WriteItem<'a> {
    /// The array, on any device, in any layout.
    pub tensor: &'a Tensor,
    /// Where its bytes start in the file.
    pub offset: u64,
    /// How many bytes it takes in the file.
    pub nbytes: u64,
}

/// How [`write_file`] writes.
#[derive(Clone, Copy, Debug)]
pub struct WriteOptions {
    /// Writer threads (at least one); as many threads take the ring's buffers from their pool
    /// as the save starts.
    pub threads: usize,
    /// The size of one write and ring buffer, a multiple of 4096 bytes.
    pub chunk: usize,
    /// Whether full chunks are written around the page cache where the file system allows it.
    pub direct_io: bool,
    /// Whether the ring grows to hold the whole file, so that every byte reaches host memory
    /// at the speed of the copies instead of waiting for the disk (the asynchronous save: the
    /// arrays may change once they are all copied). The memory goes back to its pool (pinned
    /// memory for CUDA arrays, the CPU pool's otherwise), which keeps it for the next save
    /// (within the pool's cache limit; [`crate::empty_cache`] gives it back).
    pub whole: bool,
}

impl Default for WriteOptions {
    fn default() -> WriteOptions {
        WriteOptions {
            threads: default_write_threads(),
            chunk: DEFAULT_WRITE_CHUNK,
            direct_io: true,
            whole: false,
        }
    }
}

/// Writes `head` at offset 0 of `file` (opened for writing, empty, at `path`), then each of
/// `items` (in ascending, non-overlapping `offset` order, at or past the head; gaps are zeros),
/// and syncs the file; `progress(done, total)` is called about ten times a second and once at
/// the end. Returns the file's length. `path` is opened a second time with `O_DIRECT` for the
/// full chunks; where that fails (tmpfs refuses it, other systems have no such flag) or a direct
/// write is refused, the writes go through `file`. Errors ([`Error::Io`] naming `path`, such as
/// a full disk) leave the file partly written: the caller removes it.
///
/// Arrays of devices with queues of work (CUDA) are copied on queues ordered after the calling
/// thread's current ones ([`CopyStreams::after_current`]); [`write_file_staged`] takes queues
/// made earlier, and tells when every byte is in host memory.
pub fn write_file(
    path: &Path,
    file: &File,
    head: &[u8],
    items: &[WriteItem<'_>],
    options: &WriteOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64> {
    let streams = CopyStreams::after_current(items.iter().map(|i| i.tensor))?;
    write_file_staged(path, file, head, items, options, &streams, &|| {}, progress)
}

/// The queues a save copies device arrays on (CUDA streams, [`backend::queue_after_current`]):
/// one per device, each ordered after the queue that was current on the thread that made them,
/// so that the copies see every write enqueued there before (a save started on one thread may
/// copy on another: the asynchronous save).
#[derive(Debug, Default)]
pub struct CopyStreams {
    queues: Vec<Queue>,
    /// The arrays' devices, each with the index of its queue in `queues` (`None`: the device has
    /// no queues). Several kinds of one device (CUDA memory, pinned and managed memory of the
    /// same device) share its queue.
    devices: Vec<(Device, Option<usize>)>,
}

impl CopyStreams {
    /// For each device among `tensors` that has queues of work (CUDA: device, pinned or managed
    /// memory): a new queue that starts after the work enqueued so far on this thread's current
    /// queue of that device. None for other devices.
    pub fn after_current<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<CopyStreams> {
        let mut streams = CopyStreams::default();
        for tensor in tensors {
            let device = tensor.device();
            if streams.devices.iter().any(|(d, _)| *d == device) {
                continue;
            }
            // One queue per device the backend names (pinned and managed memory of a CUDA device
            // share the device's).
            let index = backend::queue_after_current(device)?.map(|queue| {
                let known = streams
                    .queues
                    .iter()
                    .position(|q| q.device() == queue.device());
                known.unwrap_or_else(|| {
                    streams.queues.push(queue);
                    streams.queues.len() - 1
                })
            });
            streams.devices.push((device, index));
        }
        Ok(streams)
    }

    /// The queue for arrays on `device`.
    fn of(&self, device: Device) -> Option<&Queue> {
        let (_, index) = self.devices.iter().find(|(d, _)| *d == device)?;
        index.map(|i| &self.queues[i])
    }

    /// Waits for every copy enqueued so far.
    fn synchronize(&self) -> Result<()> {
        self.queues.iter().try_for_each(Queue::synchronize)
    }
}

/// [`write_file`] with streams made beforehand ([`CopyStreams::after_current`], which must cover
/// the CUDA devices of `items`), calling `copied()` once every byte of the file is in host memory:
/// from then on the arrays may change without changing the file. With `options.whole` set that
/// happens at the speed of the copies, as the ring then grows to hold the whole file rather than
/// waiting for the disk.
#[allow(clippy::too_many_arguments)] // the engine's one entry point; `write_file` is the short form
pub fn write_file_staged(
    path: &Path,
    file: &File,
    head: &[u8],
    items: &[WriteItem<'_>],
    options: &WriteOptions,
    streams: &CopyStreams,
    copied: &(dyn Fn() + Sync),
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64> {
    let chunk = options.chunk.max(4096).next_multiple_of(4096);
    let mut total = head.len() as u64;
    for item in items {
        if item.offset < total {
            return Err(Error::InvalidArgument(format!(
                "an array at byte {} overlaps the bytes before it (which end at {total})",
                item.offset
            )));
        }
        let device = item.tensor.device();
        if item.nbytes > 0 && backend::has_streams(device.kind()) && streams.of(device).is_none() {
            return Err(Error::InvalidArgument(format!(
                "the save was given no copy queue for {device}"
            )));
        }
        total = item
            .offset
            .checked_add(item.nbytes)
            .ok_or_else(|| crate::error::overflow("file length"))?;
    }
    let direct = if options.direct_io && total >= chunk as u64 {
        open_direct(path)
    } else {
        None
    };
    let threads = options.threads.max(1);
    let chunks = total.div_ceil(chunk as u64).max(1) as usize;
    let ring = if options.whole {
        chunks
    } else {
        (threads + 2).min(chunks)
    };
    // Pinned memory of the first queue's device where an array of a device with queues is
    // saved (the copies from the device go straight into it), the CPU pool's otherwise.
    let staging_queue = streams.queues.first();
    let staging = match staging_queue {
        Some(queue) => backend::placement(queue.device(), Some(StorageMode::Shared))?,
        None => Device::CPU,
    };
    let done = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let first_error = Mutex::new(None);
    let record = |e: Error| {
        failed.store(true, Ordering::Relaxed);
        first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    };
    let (work_tx, work_rx) = mpsc::channel::<(u64, Slot)>();
    let work_rx = Mutex::new(work_rx);
    // Buffers for the filler: new ones from the staging threads, written ones from the writers;
    // an error tells the filler that a staging thread failed (its error is recorded).
    let (free_tx, free_rx) = mpsc::channel::<Result<Slot>>();
    let direct_refused = AtomicBool::new(false);
    let staged = AtomicUsize::new(0);
    let padded = AtomicBool::new(false);
    // The staging threads allocate on the copy queue of the staging device, the queue whose
    // copies fill the buffers.
    // The last, partial buffer, kept until the staging threads are done (back in the pool
    // earlier, it would serve one of their requests: the ring would hold one buffer fewer than
    // it was made of).
    let mut last: Option<Slot> = None;
    // Buffers per block ([`Slot::block`]): blocks of up to `BLOCK_BYTES`, enough of them for
    // every staging thread.
    let per_block = (BLOCK_BYTES / chunk)
        .min(ring.div_ceil(threads.min(ring)))
        .max(1);
    let blocks = ring.div_ceil(per_block);
    std::thread::scope(|scope| {
        for _ in 0..threads.min(blocks) {
            let free_tx = free_tx.clone();
            let (staged, padded, failed, record) = (&staged, &padded, &failed, &record);
            scope.spawn(move || {
                let _current = staging_queue.map(Queue::enter);
                while !failed.load(Ordering::Relaxed) {
                    let first = staged.fetch_add(1, Ordering::Relaxed) * per_block;
                    if first >= ring {
                        break;
                    }
                    match Slot::block(staging, chunk, per_block.min(ring - first), padded) {
                        Ok(slots) => {
                            for slot in slots {
                                let _ = free_tx.send(Ok(slot));
                            }
                        }
                        Err(e) => {
                            record(e);
                            // Wakes the filler should it wait for this buffer.
                            let _ = free_tx.send(Err(hung_up()));
                            return;
                        }
                    }
                }
            });
        }
        for _ in 0..threads {
            let free_tx = free_tx.clone();
            let (work_rx, done, failed, direct_refused) =
                (&work_rx, &done, &failed, &direct_refused);
            let (direct, record) = (direct.as_ref(), &record);
            scope.spawn(move || {
                loop {
                    let next = work_rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    let Ok((offset, slot)) = next else { return };
                    if !failed.load(Ordering::Relaxed) {
                        let written = slot.bytes(chunk).and_then(|bytes| {
                            write_chunk(file, direct, direct_refused, bytes, offset)
                                .map(|()| bytes.len())
                                .map_err(|e| io_error(path, e))
                        });
                        match written {
                            Ok(n) => {
                                done.fetch_add(n as u64, Ordering::Relaxed);
                            }
                            Err(e) => record(e),
                        }
                    }
                    // The filler waits for buffers: it gets each back, written or not.
                    let _ = free_tx.send(Ok(slot));
                }
            });
        }
        drop(free_tx);
        let mut filler = Filler {
            chunk,
            batch: (COPY_BATCH / chunk).clamp(1, (ring / 2).max(1)),
            free: &free_rx,
            work: work_tx,
            current: None,
            start: 0,
            fill: 0,
            pending: Vec::new(),
            device_copies: false,
            streams,
            failed: &failed,
        };
        let mut last_report = Instant::now();
        let result = (|| {
            filler.put(head)?;
            let mut at = head.len() as u64;
            for item in items {
                filler.zeros((item.offset - at) as usize)?;
                if item.nbytes > 0 {
                    filler.array(item.tensor, item.nbytes)?;
                }
                at = item.offset + item.nbytes;
                if last_report.elapsed() >= Duration::from_millis(100) {
                    progress(done.load(Ordering::Relaxed), total);
                    last_report = Instant::now();
                }
            }
            filler.settle()?;
            copied();
            // The last, partial chunk: through the page cache, at its exact length.
            last = filler.current.take();
            if let Some(slot) = &last {
                let bytes = &slot.bytes(chunk)?[..filler.fill];
                file.write_all_at(bytes, filler.start)
                    .map_err(|e| io_error(path, e))?;
                done.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            }
            Ok(())
        })();
        if let Err(e) = result {
            record(e);
            // No copy may still write into a buffer once it is back in its pool.
            let _ = streams.synchronize();
        }
        // Hanging up lets the writers finish what they hold and return.
        drop(filler);
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    file.sync_all().map_err(|e| io_error(path, e))?;
    progress(total, total);
    Ok(total)
}

/// One ring buffer: `chunk` page-aligned bytes of host memory (pinned where the save copies
/// from a device with queues), part of a block of several ([`Slot::block`]).
struct Slot {
    /// The buffer's bytes as a CPU array, over a buffer of its own (an alias of its part of the
    /// block), so that the filler's mutable access to it is its alone.
    host: Tensor,
    /// The block as its device knows it, where it is pinned, and where in it this buffer starts.
    pinned: Option<(Buffer, usize)>,
}

impl Slot {
    /// `count` buffers of `chunk` bytes of `staging` (the CPU, or a device's pinned memory),
    /// page-aligned, in one block: of exactly `count * chunk` bytes where the pool hands out
    /// page-aligned ones, else (and from then on, `padded`) a page more. One block for several
    /// buffers, as pinning has a large cost per block: on the H200 machine a first asynchronous
    /// save of 6 GB pinned 358 blocks of 16 MiB in 1.75 s (4.9 ms each), where a new block of
    /// 256 MiB took 17 ms.
    fn block(
        staging: Device,
        chunk: usize,
        count: usize,
        padded: &AtomicBool,
    ) -> Result<Vec<Slot>> {
        let storage = (!staging.is_cpu()).then_some(StorageMode::Shared);
        let allocate = |bytes| crate::backend::allocate(staging, bytes, storage, false);
        let bytes = chunk
            .checked_mul(count)
            .ok_or_else(|| crate::error::overflow("staging length"))?;
        let exact = match padded.load(Ordering::Relaxed) {
            true => None,
            false => {
                let buffer = allocate(bytes)?;
                let aligned =
                    buffer.require_host("staging a file write")?.as_ptr().addr() % PAGE == 0;
                if !aligned {
                    padded.store(true, Ordering::Relaxed);
                }
                aligned.then_some(buffer)
            }
        };
        let buffer = match exact {
            Some(buffer) => buffer,
            None => allocate(bytes + PAGE)?,
        };
        let base = buffer.require_host("staging a file write")?;
        let start = base.as_ptr().align_offset(PAGE);
        let pinned = (!staging.is_cpu()).then(|| buffer.clone());
        (0..count)
            .map(|i| {
                let at = start + i * chunk;
                // SAFETY: `[base + at, base + at + chunk)` lies inside the block (its `bytes`
                // after the alignment offset), host memory (the CPU pool's, or pinned) the host
                // may read and write, valid while the block lives, which the clone given as the
                // owner ensures; the buffers of one block are disjoint.
                let host = unsafe {
                    let ptr = base.as_ptr().wrapping_add(at);
                    Buffer::from_foreign(
                        ptr.cast(),
                        ptr,
                        chunk,
                        Device::CPU,
                        StorageMode::Shared,
                        false,
                        Box::new(buffer.clone()),
                    )
                };
                Ok(Slot {
                    host: Tensor::new(host, DType::U8, Layout::contiguous(&[chunk])?)?,
                    pinned: pinned.clone().map(|p| (p, at)),
                })
            })
            .collect()
    }

    /// The buffer's `chunk` bytes.
    fn bytes(&self, chunk: usize) -> Result<&[u8]> {
        Ok(&self.host.host_bytes()?[..chunk])
    }

    /// A compact byte array of `shape` at byte `at` of the buffer, in the memory a copy writes
    /// best: the pinned block for copies on a device's queue (`queued`), the CPU view for host
    /// sources.
    fn view(&self, at: usize, shape: &[usize], queued: bool) -> Result<Tensor> {
        let (buffer, start) = match &self.pinned {
            Some((pinned, start)) if queued => (pinned.clone(), *start),
            _ => (self.host.buffer().clone(), 0),
        };
        Tensor::new(buffer, DType::U8, Layout::contiguous_at(shape, start + at)?)
    }
}

/// The page size `O_DIRECT` aligns buffers to.
const PAGE: usize = 4096;

/// The caller's side of the ring: the buffer being filled and where it goes in the file, and
/// the full buffers whose device copies may still run.
struct Filler<'a> {
    chunk: usize,
    /// How many full buffers wait for their copies before one synchronisation hands them on.
    batch: usize,
    /// New buffers (from the staging threads) and written ones (from the writers).
    free: &'a mpsc::Receiver<Result<Slot>>,
    work: mpsc::Sender<(u64, Slot)>,
    current: Option<Slot>,
    /// The file offset of `current`'s first byte.
    start: u64,
    /// Bytes of `current` filled.
    fill: usize,
    /// Full buffers not yet handed on, with their file offsets.
    pending: Vec<(u64, Slot)>,
    /// Whether copies from a device into `current` or `pending` may still be running.
    device_copies: bool,
    streams: &'a CopyStreams,
    failed: &'a AtomicBool,
}

impl Filler<'_> {
    /// Appends `bytes` to the file's stream, handing each full buffer to the writers.
    fn put(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let n = self.room(bytes.len())?;
            self.space(n)?.copy_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            self.advance(n)?;
        }
        Ok(())
    }

    /// Appends `len` zero bytes.
    fn zeros(&mut self, mut len: usize) -> Result<()> {
        while len > 0 {
            let n = self.room(len)?;
            self.space(n)?.fill(0);
            len -= n;
            self.advance(n)?;
        }
        Ok(())
    }

    /// Appends the first `nbytes` bytes of `tensor`'s elements, compact and row-major: host
    /// arrays compact in memory by copies of their bytes; strided host arrays and CUDA arrays
    /// (compact or not) by copies of row-major pieces straight into the ring buffers, the CUDA
    /// ones on the save's streams into pinned memory; others (sub-byte elements, memory the host
    /// cannot address) through a compact host copy.
    fn array(&mut self, tensor: &Tensor, nbytes: u64) -> Result<()> {
        let nbytes = usize::try_from(nbytes).map_err(|_| crate::error::overflow("array length"))?;
        let device = tensor.device();
        let queue = self.streams.of(device);
        let host = if device.is_cpu() {
            Some(tensor.clone())
        } else if queue.is_some() {
            None
        } else {
            crate::backend::host_view(tensor)?
        };
        // Sub-byte elements (packed, or one per byte to be packed) keep the host copy's path.
        let direct = !tensor.dtype().is_sub_byte() && (queue.is_some() || host.is_some());
        if !direct {
            return self.put(host_bytes(tensor, nbytes as u64)?.as_slice()?);
        }
        let source = host.as_ref().unwrap_or(tensor);
        if source.is_contiguous() && source.device().is_cpu() {
            return self.put(&source.host_bytes()?[..nbytes]);
        }
        let bytes = byte_view(source)?;
        // The queue is current while the copies are enqueued (the backend's copies go to the
        // current queue); none for host sources.
        let queue = queue.filter(|_| host.is_none());
        let _current = queue.map(Queue::enter);
        let mut pos = 0;
        while pos < nbytes {
            let n = self.room(nbytes - pos)?;
            let at = self.fill;
            let slot = self.current.as_ref().ok_or_else(hung_up)?;
            let mut boxes = Vec::new();
            split_range(bytes.shape(), bytes.strides(), 0, pos, pos + n, &mut boxes);
            let mut filled = 0;
            for (offset, shape, strides) in boxes {
                let start = bytes.byte_offset() as isize + offset;
                let piece = Tensor::new(
                    bytes.buffer().clone(),
                    DType::U8,
                    Layout::new(&shape, &strides, start as usize)?,
                )?;
                let dst = slot.view(at + filled, &shape, queue.is_some())?;
                // SAFETY: `dst` lies in the part of the ring buffer not yet filled, which no
                // slice addresses and no other thread touches until the buffer is handed on
                // (after the copies are waited for, in `advance` and `settle`); `piece` is a
                // view of the caller's array, a different allocation.
                unsafe { dst.copy_from_unchecked(&piece)? };
                filled += piece.numel();
            }
            self.device_copies |= queue.is_some();
            pos += n;
            self.advance(n)?;
        }
        Ok(())
    }

    /// How many of `want` bytes fit in the current buffer (taking the next free one where none
    /// is being filled; before waiting for one, the full buffers are handed on, so that the
    /// writers can give them back).
    fn room(&mut self, want: usize) -> Result<usize> {
        if self.current.is_none() {
            let next = match self.free.try_recv() {
                Ok(next) => next,
                Err(_) => {
                    self.settle()?;
                    self.free.recv().map_err(|_| hung_up())?
                }
            };
            let slot = next?;
            if self.failed.load(Ordering::Relaxed) {
                // A writer or a staging thread failed: its error is the one reported.
                return Err(hung_up());
            }
            self.current = Some(slot);
        }
        Ok(want.min(self.chunk - self.fill))
    }

    /// The next `n` unfilled bytes of the current buffer.
    fn space(&mut self, n: usize) -> Result<&mut [u8]> {
        let fill = self.fill;
        match self.current.as_mut() {
            Some(slot) => Ok(&mut slot.host.host_bytes_mut()?[fill..fill + n]),
            None => Err(hung_up()),
        }
    }

    /// Counts `n` more bytes filled; a full buffer goes to the writers once the copies into it
    /// have run: at once when no device copy is running, else with its batch.
    fn advance(&mut self, n: usize) -> Result<()> {
        self.fill += n;
        if self.fill == self.chunk {
            let slot = self.current.take().ok_or_else(hung_up)?;
            self.pending.push((self.start, slot));
            self.start += self.chunk as u64;
            self.fill = 0;
            if !self.device_copies || self.pending.len() >= self.batch {
                self.settle()?;
            }
        }
        Ok(())
    }

    /// Waits for the device copies enqueued so far (one synchronisation of the copy streams),
    /// and hands the full buffers to the writers.
    fn settle(&mut self) -> Result<()> {
        if std::mem::take(&mut self.device_copies) {
            self.streams.synchronize()?;
        }
        for full in self.pending.drain(..) {
            self.work.send(full).map_err(|_| hung_up())?;
        }
        Ok(())
    }
}

/// `tensor`'s elements as bytes: a `U8` view of the same memory with one more axis, of the
/// element's bytes (strides in bytes), so that any piece of the row-major byte stream is a view;
/// one axis for a compact tensor (every piece then one linear copy).
fn byte_view(tensor: &Tensor) -> Result<Tensor> {
    let item = tensor.dtype().itemsize();
    if tensor.is_contiguous() {
        let layout = Layout::contiguous_at(&[tensor.numel() * item], tensor.byte_offset())?;
        return Tensor::new(tensor.buffer().clone(), DType::U8, layout);
    }
    let mut shape = tensor.shape().to_vec();
    let mut strides: Vec<isize> = tensor.strides().iter().map(|s| s * item as isize).collect();
    shape.push(item);
    strides.push(1);
    Tensor::new(
        tensor.buffer().clone(),
        DType::U8,
        Layout::new(&shape, &strides, tensor.byte_offset())?,
    )
}

/// Splits elements `lo..hi` (row-major order) of an array of `shape` and `strides` whose first
/// element is at `base` (in strides' units) into boxes, each a strided view `(offset, shape,
/// strides)` whose row-major elements are consecutive in that order: at most two per axis.
fn split_range(
    shape: &[usize],
    strides: &[isize],
    base: isize,
    lo: usize,
    hi: usize,
    out: &mut Vec<(isize, Vec<usize>, Vec<isize>)>,
) {
    if lo >= hi {
        return;
    }
    let Some((&step, inner_strides)) = strides.split_first() else {
        out.push((base, Vec::new(), Vec::new()));
        return;
    };
    let inner_shape = &shape[1..];
    let inner: usize = inner_shape.iter().product();
    let rows = |from: usize, to: usize, out: &mut Vec<_>| {
        let mut box_shape = vec![to - from];
        box_shape.extend_from_slice(inner_shape);
        out.push((base + from as isize * step, box_shape, strides.to_vec()));
    };
    let (first, last) = (lo / inner, (hi - 1) / inner);
    let (head, tail) = (lo - first * inner, hi - last * inner);
    let row = |r: usize| base + r as isize * step;
    if first == last {
        if head == 0 && tail == inner {
            rows(first, first + 1, out);
        } else {
            split_range(inner_shape, inner_strides, row(first), head, tail, out);
        }
        return;
    }
    let mut full = first;
    if head != 0 {
        split_range(inner_shape, inner_strides, row(first), head, inner, out);
        full += 1;
    }
    let end = if tail == inner { last + 1 } else { last };
    if full < end {
        rows(full, end, out);
    }
    if tail != inner {
        split_range(inner_shape, inner_strides, row(last), 0, tail, out);
    }
}

/// The error of a ring whose other side is gone (a writer failed, and its error is reported
/// instead).
fn hung_up() -> Error {
    Error::Driver {
        backend: "writer",
        message: "the writer threads stopped".into(),
    }
}

/// Writes one full chunk at `offset`: around the page cache where `direct` is open and no
/// direct write was refused yet, else (and after `EINVAL`, the refusal) through `file`.
fn write_chunk(
    file: &File,
    direct: Option<&File>,
    direct_refused: &AtomicBool,
    bytes: &[u8],
    offset: u64,
) -> std::io::Result<()> {
    if let Some(direct) = direct
        && !direct_refused.load(Ordering::Relaxed)
    {
        match direct.write_all_at(bytes, offset) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                direct_refused.store(true, Ordering::Relaxed);
            }
            other => return other,
        }
    }
    file.write_all_at(bytes, offset)
}

/// `path` opened again for writes around the page cache (`O_DIRECT`, Linux only); `None` where
/// the system or the file system has no such mode.
fn open_direct(path: &Path) -> Option<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(path)
            .ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        None
    }
}

/// An array's bytes as the file stores them, on the host: a view where the array is compact in
/// host memory, else a compact host copy (the copy planner for strided arrays, the backend's
/// copy for device ones); sub-byte elements packed.
enum HostBytes {
    View(Tensor),
    Packed(Vec<u8>),
}

impl HostBytes {
    fn as_slice(&self) -> Result<&[u8]> {
        match self {
            HostBytes::View(bytes) => bytes.as_slice::<u8>(),
            HostBytes::Packed(bytes) => Ok(bytes),
        }
    }
}

/// The first `nbytes` bytes of `tensor`'s elements, compact and row-major, on the host.
fn host_bytes(tensor: &Tensor, nbytes: u64) -> Result<HostBytes> {
    let nbytes = usize::try_from(nbytes).map_err(|_| crate::error::overflow("array length"))?;
    if tensor.dtype().is_sub_byte() && !tensor.is_packed() {
        // One element per byte (DLPack's padded form): pack them.
        let host = tensor.copy_to(Device::CPU)?;
        let padded = raw_view(&host, tensor.numel())?;
        return Ok(HostBytes::Packed(pack(
            padded.as_slice::<u8>()?,
            tensor.dtype(),
            nbytes,
        )));
    }
    let compact = if tensor.is_contiguous() {
        tensor.clone()
    } else {
        tensor.copy()?
    };
    let bytes = raw_view(&compact, nbytes)?;
    Ok(HostBytes::View(if bytes.device().is_cpu() {
        bytes
    } else {
        bytes.copy_to(Device::CPU)?
    }))
}

/// The first `nbytes` bytes of a compact tensor's elements, as a byte view of its buffer.
fn raw_view(compact: &Tensor, nbytes: usize) -> Result<Tensor> {
    let layout = Layout::contiguous_at(&[nbytes], compact.byte_offset())?;
    Tensor::new(compact.buffer().clone(), DType::U8, layout)
}

/// Packs one-per-byte sub-byte elements densely, element `i` at bit `i * bits`.
fn pack(padded: &[u8], dtype: DType, nbytes: usize) -> Vec<u8> {
    let bits = dtype.bits() as usize;
    let mask = (1u16 << bits) - 1;
    let mut out = vec![0u8; nbytes];
    for (i, &value) in padded.iter().enumerate() {
        let (byte, shift) = ((i * bits) / 8, (i * bits) % 8);
        let wide = (u16::from(value) & mask) << shift;
        if let Some(slot) = out.get_mut(byte) {
            *slot |= wide as u8;
        }
        if let Some(slot) = out.get_mut(byte + 1) {
            *slot |= (wide >> 8) as u8;
        }
    }
    out
}

/// The bytes `write_file` puts in a file, into memory: the same layout, for writers that are
/// not files.
pub(crate) fn write_to(
    writer: &mut dyn std::io::Write,
    head: &[u8],
    items: &[WriteItem<'_>],
    path: &Path,
) -> Result<()> {
    let io = |e| io_error(path, e);
    writer.write_all(head).map_err(io)?;
    let mut at = head.len() as u64;
    for item in items {
        if item.offset < at {
            return Err(Error::InvalidArgument(format!(
                "an array at byte {} overlaps the bytes before it (which end at {at})",
                item.offset
            )));
        }
        let gap = vec![0u8; (item.offset - at) as usize];
        writer.write_all(&gap).map_err(io)?;
        if item.nbytes > 0 {
            writer
                .write_all(host_bytes(item.tensor, item.nbytes)?.as_slice()?)
                .map_err(io)?;
        }
        at = item.offset + item.nbytes;
    }
    writer.flush().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head, a strided array, a gap of zeros, an empty array and a last partial chunk,
    /// written with chunks of 64 KiB (page-aligned pool buffers) so that several go through the
    /// ring and the writers, give the bytes `write_to` gives, with O_DIRECT and without.
    #[test]
    fn the_ring_writes_the_same_bytes_as_a_plain_writer() {
        let values: Vec<f32> = (0..20000).map(|i| i as f32).collect();
        let matrix = Tensor::from_slice(&values, &[200, 100]).unwrap();
        let transposed = matrix.transpose().unwrap();
        let small = Tensor::from_slice(&[7u8, 8, 9], &[3]).unwrap();
        let empty = Tensor::from_slice::<f32>(&[], &[0]).unwrap();
        let head = b"head bytes".to_vec();
        let items = [
            WriteItem {
                tensor: &transposed,
                offset: 16,
                nbytes: 80000,
            },
            WriteItem {
                tensor: &empty,
                offset: 80016,
                nbytes: 0,
            },
            WriteItem {
                tensor: &small,
                offset: 80100,
                nbytes: 3,
            },
            WriteItem {
                tensor: &matrix,
                offset: 80103,
                nbytes: 80000,
            },
        ];
        let mut expected = Vec::new();
        write_to(&mut expected, &head, &items, Path::new("<memory>")).unwrap();
        assert_eq!(expected.len(), 160103);
        for (direct_io, threads) in [(true, 3), (false, 1)] {
            let path = std::env::temp_dir().join(format!(
                "dlbridge-engine-save-{}-{direct_io}.bin",
                std::process::id()
            ));
            let file = File::create(&path).unwrap();
            let options = WriteOptions {
                threads,
                chunk: 65536,
                direct_io,
                whole: direct_io,
            };
            let mut reports = Vec::new();
            let len = write_file(&path, &file, &head, &items, &options, &mut |d, t| {
                reports.push((d, t))
            })
            .unwrap();
            assert_eq!(len, 160103);
            assert_eq!(reports.last(), Some(&(160103, 160103)));
            assert_eq!(
                std::fs::read(&path).unwrap(),
                expected,
                "direct_io={direct_io}"
            );
            std::fs::remove_file(&path).unwrap();
        }
    }

    /// Overlapping arrays are refused before anything is written.
    #[test]
    fn overlapping_items_are_refused() {
        let small = Tensor::from_slice(&[1u8, 2, 3, 4], &[4]).unwrap();
        let items = [WriteItem {
            tensor: &small,
            offset: 2,
            nbytes: 4,
        }];
        let mut out = Vec::new();
        assert!(matches!(
            write_to(&mut out, b"abcd", &items, Path::new("<memory>")),
            Err(Error::InvalidArgument(_))
        ));
        let path =
            std::env::temp_dir().join(format!("dlbridge-engine-overlap-{}", std::process::id()));
        let file = File::create(&path).unwrap();
        let result = write_file(
            &path,
            &file,
            b"abcd",
            &items,
            &WriteOptions::default(),
            &mut |_, _| {},
        );
        assert!(matches!(result, Err(Error::InvalidArgument(_))));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        std::fs::remove_file(&path).unwrap();
    }

    /// Every range of a permuted 3-d array's row-major elements splits into strided boxes whose
    /// elements, in row-major order, are exactly those of the range, at most two per axis plus
    /// one.
    #[test]
    fn split_range_gives_the_range_as_strided_boxes() {
        let shape = [3usize, 4, 5];
        let strides = [1isize, 15, 3]; // a permutation of a compact [4, 5, 3]
        let address = |mut i: usize| {
            let mut at = 0isize;
            for axis in (0..3).rev() {
                at += (i % shape[axis]) as isize * strides[axis];
                i /= shape[axis];
            }
            at
        };
        for lo in 0..60 {
            for hi in lo..=60 {
                let mut boxes = Vec::new();
                split_range(&shape, &strides, 0, lo, hi, &mut boxes);
                assert!(boxes.len() <= 7, "{lo}..{hi}: {} boxes", boxes.len());
                let mut got = Vec::new();
                for (base, box_shape, box_strides) in &boxes {
                    let count: usize = box_shape.iter().product();
                    for mut i in 0..count {
                        let mut at = *base;
                        for axis in (0..box_shape.len()).rev() {
                            at += (i % box_shape[axis]) as isize * box_strides[axis];
                            i /= box_shape[axis];
                        }
                        got.push(at);
                    }
                }
                let expected: Vec<isize> = (lo..hi).map(address).collect();
                assert_eq!(got, expected, "{lo}..{hi}");
            }
        }
    }

    /// A permuted 3-d array and a column slice placed so that chunk boundaries cut rows and
    /// elements, through a ring of 4 KiB buffers that holds the whole file and through one of
    /// two buffers: the bytes `write_to` gives, and `copied` told once.
    #[test]
    fn strided_pieces_cut_anywhere_give_the_compact_bytes() {
        let values: Vec<f64> = (0..6000).map(|i| i as f64 * 0.5).collect();
        let cube = Tensor::from_slice(&values, &[10, 20, 30]).unwrap();
        let permuted = cube.permute(&[2, 0, 1]).unwrap();
        let column = cube.slice(2, crate::layout::SliceArg::range(3, 4)).unwrap();
        let reversed = cube
            .slice(
                1,
                crate::layout::SliceArg {
                    start: None,
                    stop: None,
                    step: -1,
                },
            )
            .unwrap();
        let head = b"abc".to_vec();
        let items = [
            WriteItem {
                tensor: &permuted,
                offset: 3,
                nbytes: 48000,
            },
            WriteItem {
                tensor: &column,
                offset: 48003,
                nbytes: 1600,
            },
            WriteItem {
                tensor: &reversed,
                offset: 49605,
                nbytes: 48000,
            },
        ];
        let mut expected = Vec::new();
        write_to(&mut expected, &head, &items, Path::new("<memory>")).unwrap();
        for whole in [true, false] {
            let path = std::env::temp_dir().join(format!(
                "dlbridge-engine-pieces-{}-{whole}.bin",
                std::process::id()
            ));
            let file = File::create(&path).unwrap();
            let options = WriteOptions {
                threads: 1,
                chunk: 4096,
                direct_io: true,
                whole,
            };
            let copied = AtomicU64::new(0);
            write_file_staged(
                &path,
                &file,
                &head,
                &items,
                &options,
                &CopyStreams::default(),
                &|| {
                    copied.fetch_add(1, Ordering::Relaxed);
                },
                &mut |_, _| {},
            )
            .unwrap();
            assert_eq!(copied.load(Ordering::Relaxed), 1);
            assert_eq!(std::fs::read(&path).unwrap(), expected, "whole={whole}");
            std::fs::remove_file(&path).unwrap();
        }
    }

    /// CUDA arrays (compact, transposed, a strided slice, pinned host memory) go to the file
    /// through pinned ring buffers: the bytes of their host copies, with small chunks so that
    /// pieces cut rows, in a ring that waits for the disk and in one that holds the whole file.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_arrays_give_the_bytes_of_their_host_copies() {
        let gpu = Device::cuda(0);
        let values: Vec<f32> = (0..300_000).map(|i| i as f32).collect();
        let host = Tensor::from_slice(&values, &[600, 500]).unwrap();
        let on_device = host.copy_to(gpu).unwrap();
        let transposed = on_device.transpose().unwrap();
        let stepped = on_device
            .slice(
                1,
                crate::layout::SliceArg {
                    start: Some(1),
                    stop: None,
                    step: 3,
                },
            )
            .unwrap();
        let pinned = host.copy_to(Device::cuda_host(0)).unwrap();
        let arrays = [&on_device, &transposed, &stepped, &pinned];
        let host_copies: Vec<Tensor> = arrays
            .iter()
            .map(|a| a.copy_to(Device::CPU).unwrap())
            .collect();
        let mut offset = 5u64;
        let mut items = Vec::new();
        let mut host_items = Vec::new();
        for (array, copy) in arrays.iter().zip(&host_copies) {
            let nbytes = copy.nbytes() as u64;
            items.push(WriteItem {
                tensor: array,
                offset,
                nbytes,
            });
            host_items.push(WriteItem {
                tensor: copy,
                offset,
                nbytes,
            });
            offset += nbytes + 1;
        }
        let mut expected = Vec::new();
        write_to(&mut expected, b"head!", &host_items, Path::new("<memory>")).unwrap();
        for whole in [false, true] {
            let path = std::env::temp_dir().join(format!(
                "dlbridge-engine-cuda-{}-{whole}.bin",
                std::process::id()
            ));
            let file = File::create(&path).unwrap();
            let options = WriteOptions {
                threads: 3,
                chunk: 65536,
                direct_io: true,
                whole,
            };
            let streams = CopyStreams::after_current(arrays).unwrap();
            write_file_staged(
                &path,
                &file,
                b"head!",
                &items,
                &options,
                &streams,
                &|| {},
                &mut |_, _| {},
            )
            .unwrap();
            assert!(std::fs::read(&path).unwrap() == expected, "whole={whole}");
            std::fs::remove_file(&path).unwrap();
        }
    }
}
