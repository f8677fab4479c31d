//! Files into device memory: parallel positioned reads into a ring of pinned staging buffers,
//! each filled buffer copied to its destination asynchronously while the next one is read.
//!
//! Every worker thread owns two pinned staging buffers (taken once from the pinned pool and
//! reused), one stream and one event per buffer. It takes the next piece of the work list, waits
//! until the buffer it will fill is no longer being copied from (its event), reads the piece into
//! it with `pread` (page-aligned, for `O_DIRECT`), and enqueues the host-to-device copy on its
//! stream. Pinned memory in use is bounded by `threads × 2 × chunk`.

use std::os::unix::fs::FileExt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use super::driver::{self, Named};
use super::stream::raw;
use super::{Event, Stream, context};
use crate::backend::{FileRead, ReadOptions};
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::error::{Error, Result};

/// The alignment `O_DIRECT` asks of file offsets, lengths and buffer addresses.
const DIRECT_ALIGN: usize = 4096;

/// One piece of a [`FileRead`], at most one chunk long.
#[derive(Clone, Copy)]
struct Piece {
    read: usize,
    /// Offset of the piece inside its read.
    start: usize,
    len: usize,
}

/// Reads every `reads` entry into its device destination on CUDA device `ordinal`.
pub(crate) fn read_to_device(
    ordinal: i32,
    reads: &[FileRead<'_>],
    options: &ReadOptions<'_>,
) -> Result<()> {
    let chunk = options
        .chunk
        .max(DIRECT_ALIGN)
        .next_multiple_of(DIRECT_ALIGN);
    let pieces: Vec<Piece> = reads
        .iter()
        .enumerate()
        .flat_map(|(read, r)| {
            (0..r.len.div_ceil(chunk)).map(move |k| Piece {
                read,
                start: k * chunk,
                len: chunk.min(r.len - k * chunk),
            })
        })
        .collect();
    if pieces.is_empty() {
        return Ok(());
    }
    let threads = options.threads.clamp(1, pieces.len());
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let worker = Worker::new(ordinal, chunk);
                let outcome = worker.and_then(|mut w| {
                    let run = w.run(reads, &pieces, &next, &failed, options.done);
                    // Whatever happened, nothing may still be copying out of our buffers when
                    // they go back to the pool.
                    run.and(w.stream.synchronize())
                });
                if let Err(e) = outcome {
                    failed.store(true, Ordering::Relaxed);
                    first_error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                }
            });
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// One reader thread's staging buffers, stream and events.
struct Worker {
    ordinal: i32,
    stream: Stream,
    slots: [Slot; 2],
}

struct Slot {
    /// Pinned memory from the pool, held for the whole load.
    _pinned: Buffer,
    /// The page-aligned start inside `buffer`.
    aligned: *mut u8,
    /// Recorded after the last copy out of this slot.
    event: Event,
    /// Whether a copy out of this slot was ever enqueued.
    used: bool,
}

impl Worker {
    fn new(ordinal: i32, chunk: usize) -> Result<Worker> {
        let _ctx = context(ordinal)?;
        let stream = Stream::new(ordinal, true)?;
        let slot = || -> Result<Slot> {
            // One page of slack so the start can be page-aligned whatever the pool returns, and
            // one more so an unaligned piece can be read as whole pages around it.
            let bytes = chunk + 2 * DIRECT_ALIGN;
            let buffer = crate::backend::allocate(
                Device::cuda_host(ordinal as u32),
                bytes,
                Some(StorageMode::Shared),
                false,
            )?;
            let base = buffer.require_host("staging a file read")?.as_ptr();
            let aligned = base.wrapping_add(base.align_offset(DIRECT_ALIGN));
            Ok(Slot {
                _pinned: buffer,
                aligned,
                event: Event::new(ordinal, false)?,
                used: false,
            })
        };
        Ok(Worker {
            ordinal,
            stream,
            slots: [slot()?, slot()?],
        })
    }

    fn run(
        &mut self,
        reads: &[FileRead<'_>],
        pieces: &[Piece],
        next: &AtomicUsize,
        failed: &AtomicBool,
        done: &AtomicU64,
    ) -> Result<()> {
        let _ctx = context(self.ordinal)?;
        let mut turn = 0usize;
        loop {
            if failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            let index = next.fetch_add(1, Ordering::Relaxed);
            let Some(&piece) = pieces.get(index) else {
                return Ok(());
            };
            let slot = &mut self.slots[turn % 2];
            turn += 1;
            if slot.used {
                // The copy out of this buffer, enqueued two pieces ago, must be done.
                slot.event.synchronize()?;
            }
            let read = &reads[piece.read];
            let offset = read.offset + piece.start as u64;
            let staged = fill(slot, read, offset, piece.len)?;
            let dst = read.dst.handle() as usize + read.dst_offset + piece.start;
            // SAFETY: `staged` addresses `piece.len` bytes of pinned memory this worker owns,
            // untouched until the event recorded below completes; `dst` lies inside the
            // destination allocation (the caller sized it for every read); the stream belongs
            // to the bound context.
            unsafe {
                driver::memcpy_htod_async(
                    dst as u64,
                    staged.cast(),
                    piece.len,
                    raw(self.stream.handle()),
                )
            }
            .named("cuMemcpyHtoDAsync")?;
            slot.event.record(self.stream.handle())?;
            slot.used = true;
            done.fetch_add(piece.len as u64, Ordering::Relaxed);
        }
    }
}

/// Reads `len` bytes at `offset` of `read`'s file into `slot`, returning where they start. Direct
/// reads cover whole pages around the range (the piece then starts `offset % 4096` bytes in).
fn fill(slot: &Slot, read: &FileRead<'_>, offset: u64, len: usize) -> Result<*const u8> {
    let (file, start, skip) = match read.direct {
        Some(direct) => {
            let start = offset - offset % DIRECT_ALIGN as u64;
            (direct, start, (offset - start) as usize)
        }
        None => (read.file, offset, 0),
    };
    let want = if read.direct.is_some() {
        (skip + len).next_multiple_of(DIRECT_ALIGN)
    } else {
        len
    };
    // SAFETY: `aligned` starts at most one page into the slot's `chunk + 2 pages` of pinned
    // memory, and `want <= chunk + page` bytes fit after it; the worker alone writes the slot, and
    // its event says no copy still reads it.
    let dst = unsafe { std::slice::from_raw_parts_mut(slot.aligned, want) };
    let mut filled = 0;
    while filled < skip + len {
        match file.read_at(&mut dst[filled..], start + filled as u64) {
            // End of file before the range ended: the file shrank after its header was read.
            Ok(0) => {
                return Err(Error::Io {
                    path: read.path.to_path_buf(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "the file ended at byte {} while reading bytes {}..{} (was it \
                             truncated while loading?)",
                            start + filled as u64,
                            offset,
                            offset + len as u64
                        ),
                    ),
                });
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(Error::Io {
                    path: read.path.to_path_buf(),
                    source,
                });
            }
        }
    }
    Ok(slot.aligned.wrapping_add(skip).cast_const())
}

// SAFETY: the raw pointer in a `Slot` points into the slot's own pinned `Buffer`, which the
// worker owns; a `Worker` is created, used and dropped by one thread at a time.
unsafe impl Send for Worker {}
