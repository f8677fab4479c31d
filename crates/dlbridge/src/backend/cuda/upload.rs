//! Files into device memory: parallel positioned reads into a ring of pinned staging buffers,
//! each filled buffer copied to its destination asynchronously while the next one is read.
//!
//! Every worker thread owns two pinned staging buffers of `chunk` bytes, one stream and one event
//! per buffer. It takes the next piece of the work list (at most `chunk` less two pages, so that
//! a direct read's whole pages fit the buffer), waits until the buffer it will fill is no longer
//! being copied from (its event), reads the piece into it with `pread` (page-aligned, for
//! `O_DIRECT`), and enqueues the host-to-device copy on its stream. The buffers of all workers are
//! one block of the pinned pool, `threads × 2 × chunk` bytes, taken once per load and reused by
//! the next: pinning is what a process's first load waits for, and one block pins in one driver
//! call (see `memory.rs`). A whole load makes its reader and waits for its copies; a stream's
//! read session keeps one reader (threads, streams, events, staging) for all its groups and waits
//! for none of a group's copies on the host ([`Reader`]).
//!
//! Asked to (`ReadOptions::register`), files read through the page cache go without the staging
//! copy: each file is mapped shared and read-only, its pages are registered with the driver a
//! window at a time, the device copies straight out of the page cache, and each window is
//! unregistered once its copies ran ([`read_registered`]). No pinned staging memory is used. It
//! is not the default: on the H100 machine the driver registers pages at about 42 GB/s on one
//! thread and no faster on several, and a warm 7 GB load ran at 14.2 GB/s against staging's 18.3.
//! Nor do they help beside staging: one worker registering windows while 8 staging workers ran
//! brought a warm load from 32.5 down to 19.3 GB/s (registration holds up the other threads' driver
//! calls), so the staging workers have the driver to themselves.
//! Registered memory in flight is bounded by `threads × (WINDOW_DEPTH + 1) × 16 chunks`.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use super::driver::{self, Named};
use super::stream::{raw, record_buffer_use};
use super::{Event, Stream, context};
use crate::backend::{
    Crew, DeviceReader, FileRead, Piece, ReadOptions, piece_count, pieces, run_workers,
};
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::error::{Error, Result};

/// The alignment `O_DIRECT` asks of file offsets, lengths and buffer addresses.
const DIRECT_ALIGN: usize = 4096;

/// The smallest staging buffer: a piece of two pages, and the two pages around it.
const STAGING_MIN: usize = 4 * DIRECT_ALIGN;

/// Reads every `reads` entry into its device destination on CUDA device `ordinal`; the copies
/// are done when it returns. The staging reader is made for this read and dropped after it.
pub(crate) fn read_to_device(
    ordinal: i32,
    reads: &[FileRead<'_>],
    options: &ReadOptions<'_>,
) -> Result<()> {
    if read_unstaged(ordinal, reads, options)? {
        return Ok(());
    }
    let chunk = chunk_of(options);
    let pieces = piece_count(reads, piece_of(chunk));
    if pieces == 0 {
        return Ok(());
    }
    let mut reader = Reader::new(ordinal, options.threads.clamp(1, pieces), chunk)?;
    reader.read(reads, options)?;
    reader.joined.synchronize()
}

/// Reads every `reads` entry into its device destination on CUDA device `ordinal` with the
/// session's staging reader `slot` (made at its first read with `options`' threads and chunk,
/// kept until the session drops it): the copies may still run when it returns
/// ([`DeviceReader::join_current`] orders a queue after them). GPUDirect Storage and registered
/// pages, where they apply, read as [`read_to_device`] does.
pub(crate) fn read_in(
    ordinal: i32,
    slot: &mut Option<Box<dyn DeviceReader>>,
    reads: &[FileRead<'_>],
    options: &ReadOptions<'_>,
) -> Result<()> {
    if read_unstaged(ordinal, reads, options)? {
        return Ok(());
    }
    let reader = match slot {
        Some(reader) => reader,
        None => slot.insert(Box::new(Reader::new(
            ordinal,
            options.threads.max(1),
            chunk_of(options),
        )?)),
    };
    reader.read(reads, options)
}

/// The staging buffer's size for `options`; a piece leaves two pages of it for a direct read's
/// page-aligned ends ([`piece_of`]).
fn chunk_of(options: &ReadOptions<'_>) -> usize {
    options
        .chunk
        .max(STAGING_MIN)
        .next_multiple_of(DIRECT_ALIGN)
}

/// The largest piece a staging buffer of `chunk` bytes takes.
fn piece_of(chunk: usize) -> usize {
    chunk - 2 * DIRECT_ALIGN
}

/// Reads `reads` through GPUDirect Storage, or the files' registered pages, where those apply
/// (done when it returns): `true`; `false` where the staging reader is to read them.
fn read_unstaged(ordinal: i32, reads: &[FileRead<'_>], options: &ReadOptions<'_>) -> Result<bool> {
    let piece = piece_of(chunk_of(options));
    // GPUDirect Storage where asked, or by default for direct reads where cuFile reads without
    // a host copy; a default use that cuFile refuses falls back to the staging workers.
    let direct = reads.iter().all(|r| r.direct.is_some());
    let gds = match options.gds {
        Some(true) => Some(super::gds::register_files(ordinal, reads)?),
        None if direct && super::gds::native() => {
            match super::gds::register_files(ordinal, reads) {
                Ok(files) => Some(files),
                Err(e) => {
                    log::debug!("dlbridge: cuFile declined the load ({e}); staging instead");
                    None
                }
            }
        }
        _ => None,
    };
    if gds.is_none() && !options.register {
        return Ok(false);
    }
    // The destinations were allocated on this thread's current stream, whose pool hands out a
    // block released on that stream at once, its earlier users' work (a consumer's kernels still
    // reading it) possibly still queued there: the readers start after it (cuFile, which no
    // stream orders, after the host waited for it).
    let after = Event::new(ordinal, false)?;
    after.record(super::current_stream(ordinal))?;
    if let Some(files) = gds {
        after.synchronize()?;
        files.read(ordinal, reads, piece, options)?;
        return Ok(true);
    }
    if piece_count(reads, piece) > 0
        && reads.iter().all(|r| r.direct.is_none())
        && let Some(maps) = FileMaps::new(reads)
        && let Some(windows) = plan_windows(
            reads,
            |r| maps.of(r.file),
            piece.saturating_mul(CHUNKS_PER_WINDOW),
        )
        && can_register(ordinal, &windows)
    {
        // `maps` outlives every registration: `read_registered` unregisters all before returning.
        read_registered(ordinal, &windows, options, &after)?;
        return Ok(true);
    }
    Ok(false)
}

/// The piece size that gives each of `threads` workers the same number of pieces of `reads`
/// (the fewest rounds of pieces of at most `largest` bytes, each piece a whole number of pages):
/// a read returns when its last piece is copied, and a last round that only some workers have
/// pieces for leaves the others idle. A stream's group is a few pieces per worker, where that
/// round would be a large part of its time.
fn balanced_piece(reads: &[FileRead<'_>], threads: usize, largest: usize) -> usize {
    let total: usize = reads.iter().map(|r| r.len).sum();
    let threads = threads.max(1);
    let rounds = total.div_ceil(threads.saturating_mul(largest)).max(1);
    total
        .div_ceil(threads * rounds)
        .next_multiple_of(DIRECT_ALIGN)
        .clamp(DIRECT_ALIGN, largest)
}

/// The pieces that go to the device as one copy, as ranges of `pieces`: consecutive pieces of
/// buffered reads whose destinations follow one another in one allocation, together at most
/// `largest` bytes. A column split's part is one read per row (a few kilobytes each, landing one
/// after another): read into one staging buffer and copied by one call, its rows cost a `pread`
/// each rather than a copy, an event and a wait for the copy two rows back. Direct reads, whose
/// pieces need page-aligned room of their own, are a batch each.
fn batches(
    reads: &[FileRead<'_>],
    pieces: &[Piece],
    largest: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::with_capacity(pieces.len().min(1024));
    let mut len = 0usize;
    // Where the open batch's next piece must land (allocation, byte offset); `None` when it takes
    // no more (a direct read).
    let mut next: Option<(usize, usize)> = None;
    for (i, p) in pieces.iter().enumerate() {
        let r = &reads[p.read];
        let at = (r.dst.handle() as usize, r.dst_offset + p.start);
        match out.last_mut() {
            Some(open) if r.direct.is_none() && next == Some(at) && len + p.len <= largest => {
                open.end = i + 1;
                len += p.len;
            }
            _ => {
                out.push(i..i + 1);
                len = p.len;
            }
        }
        next = r.direct.is_none().then_some((at.0, at.1 + p.len));
    }
    out
}

/// The staging reader: a crew of threads, each with its stream, two staging buffers of pinned
/// memory and an event per buffer, kept across reads (a stream's groups) until dropped.
///
/// Each read hands its pieces to the live workers. A worker takes the next piece, waits until the
/// buffer it will fill is no longer being copied from (its event), reads the piece into it and
/// enqueues the copy to the device on its stream. The read returns once every piece is read and
/// its copy enqueued, without waiting for the copies: the reader's `join` stream waits (on the
/// device) for each worker's last copy of the read, and `joined`, recorded there, completes when
/// all of the read's copies have.
///
/// The workers' streams start each read after an event recorded on the calling thread's current
/// stream (where the destinations were allocated: see [`read_unstaged`]), once per read. The
/// streams the destinations' blocks were allocated for wait for the read's copies (`join`), as
/// they do for every copy of dlbridge's (`record_use`): a block its user released before the
/// copies into it ended is handed out again only after them. Dropping the reader waits for the
/// copies still running, then ends the threads and returns the staging memory to the pool.
struct Reader {
    ordinal: i32,
    /// The largest piece a staging buffer takes.
    piece: usize,
    /// The workers' streams and buffers, one per crew thread (thread `i` locks only `workers[i]`).
    workers: Vec<std::sync::Mutex<Worker>>,
    crew: Crew,
    /// Recorded on the calling thread's current stream at each read.
    after: Event,
    /// Waits for each worker's last copy of each read.
    join: Stream,
    /// Recorded on `join` after each read: all copies of the reads so far.
    joined: Event,
    /// Every worker's staging buffers (last: the workers' copies out of them end first).
    _staging: Staging,
}

/// How many staging readers were made, in tests (a stream makes one for all its groups).
#[cfg(test)]
pub(crate) static READERS_MADE: AtomicUsize = AtomicUsize::new(0);

impl Reader {
    /// A reader of `threads` workers with staging buffers of `chunk` bytes (a multiple of the
    /// page, at least [`STAGING_MIN`]).
    fn new(ordinal: i32, threads: usize, chunk: usize) -> Result<Reader> {
        let staging = Staging::new(ordinal, threads, chunk)?;
        let workers = (0..threads)
            .map(|i| Worker::new(ordinal, staging.slots(i)).map(std::sync::Mutex::new))
            .collect::<Result<Vec<_>>>()?;
        #[cfg(test)]
        READERS_MADE.fetch_add(1, Ordering::Relaxed);
        Ok(Reader {
            ordinal,
            piece: piece_of(chunk),
            workers,
            crew: Crew::new(threads)?,
            after: Event::new(ordinal, false)?,
            join: Stream::new(ordinal, true)?,
            joined: Event::new(ordinal, false)?,
            _staging: staging,
        })
    }

    /// Waits for every copy the workers enqueued (after a failed read, whose destinations are
    /// freed; and before the staging memory goes back to the pool).
    fn drain(&self) {
        for worker in &self.workers {
            let worker = worker.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = worker.stream.synchronize() {
                log::warn!("dlbridge: waiting for a reader's copies: {e}");
            }
        }
    }
}

impl DeviceReader for Reader {
    fn read(&mut self, reads: &[FileRead<'_>], options: &ReadOptions<'_>) -> Result<()> {
        let size = balanced_piece(reads, self.workers.len(), self.piece);
        let pieces = pieces(reads, size);
        if pieces.is_empty() {
            return Ok(());
        }
        let batches = batches(reads, &pieces, size);
        // One event for the read, however many workers wait for it.
        self.after.record(super::current_stream(self.ordinal))?;
        let next = AtomicUsize::new(0);
        let (ordinal, workers) = (self.ordinal, &self.workers);
        let (after, join) = (&self.after, &self.join);
        let run = self.crew.run(&|index, failed| {
            let mut w = workers[index].lock().unwrap_or_else(|p| p.into_inner());
            let _ctx = context(ordinal)?;
            w.stream.wait_event(after)?;
            if let Some(last) = w.run(reads, &pieces, &batches, &next, failed, options.done)? {
                join.wait_event(&w.slots[last].event)?;
            }
            Ok(())
        });
        // The copies use the destinations' pooled blocks: a block released before they end is
        // handed out again (on its own stream, where the next read's `after` is recorded too)
        // only after them, as for every copy of dlbridge's.
        let recorded = run.and_then(|()| {
            record_buffer_use(
                self.ordinal,
                self.join.handle(),
                reads.iter().map(|r| r.dst),
            )
        });
        match recorded {
            Ok(()) => self.joined.record(self.join.handle()),
            Err(e) => {
                // The read's destinations are freed when the error returns: nothing may still
                // be copying into them.
                self.drain();
                Err(e)
            }
        }
    }

    fn join_current(&self) -> Result<()> {
        super::order_streams(
            self.ordinal,
            self.join.handle(),
            super::current_stream(self.ordinal),
        )
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        // The crew is idle between reads; the copies out of the staging buffers may still run.
        self.drain();
    }
}

/// Every worker's two staging buffers: one block of pinned memory, `threads × 2 × chunk` bytes.
struct Staging {
    /// Pinned memory from the pool, held for the whole load.
    _pinned: Buffer,
    /// The page-aligned start of its `threads × 2 × chunk` bytes.
    base: *mut u8,
    chunk: usize,
    threads: usize,
}

// SAFETY: `base` points into the `Staging`'s own pinned block; each worker writes only its own two
// buffers of it (`slots` hands disjoint ones to each index).
unsafe impl Sync for Staging {}

// SAFETY: as for `Sync`: the pinned block is owned by the `Staging`, wherever it moves.
unsafe impl Send for Staging {}

impl Staging {
    fn new(ordinal: i32, threads: usize, chunk: usize) -> Result<Staging> {
        let bytes = threads
            .checked_mul(2 * chunk)
            .ok_or_else(|| Error::InvalidArgument("staging memory overflows".into()))?;
        let allocate = |bytes| {
            crate::backend::allocate(
                Device::cuda_host(ordinal as u32),
                bytes,
                Some(StorageMode::Shared),
                false,
            )
        };
        // Large blocks start on a page (the driver's own allocations); a small one may not, and is
        // taken again a page larger.
        let mut pinned = allocate(bytes)?;
        let mut base = pinned.require_host("staging a file read")?.as_ptr();
        if base.align_offset(DIRECT_ALIGN) != 0 {
            pinned = allocate(bytes + DIRECT_ALIGN)?;
            let start = pinned.require_host("staging a file read")?.as_ptr();
            base = start.wrapping_add(start.align_offset(DIRECT_ALIGN));
        }
        Ok(Staging {
            _pinned: pinned,
            base,
            chunk,
            threads,
        })
    }

    /// Worker `index`'s two buffers.
    fn slots(&self, index: usize) -> [*mut u8; 2] {
        assert!(index < self.threads, "more workers than staging buffers");
        let at = |k: usize| self.base.wrapping_add((2 * index + k) * self.chunk);
        [at(0), at(1)]
    }
}

/// One reader thread's staging buffers, stream and events.
struct Worker {
    ordinal: i32,
    stream: Stream,
    slots: [Slot; 2],
    /// Counts the pieces the worker took: it fills its slots in turn.
    turn: usize,
}

struct Slot {
    /// The page-aligned start of this worker's `chunk` bytes of the load's [`Staging`].
    aligned: *mut u8,
    /// Recorded after the last copy out of this slot.
    event: Event,
    /// Whether a copy out of this slot was ever enqueued.
    used: bool,
}

impl Worker {
    fn new(ordinal: i32, buffers: [*mut u8; 2]) -> Result<Worker> {
        let _ctx = context(ordinal)?;
        let stream = Stream::new(ordinal, true)?;
        let slot = |aligned: *mut u8| -> Result<Slot> {
            Ok(Slot {
                aligned,
                event: Event::new(ordinal, false)?,
                used: false,
            })
        };
        Ok(Worker {
            ordinal,
            stream,
            slots: [slot(buffers[0])?, slot(buffers[1])?],
            turn: 0,
        })
    }

    /// Takes batches of pieces ([`batches`]) until there are none left (or another worker
    /// failed): returns the slot of its last copy, `None` where it took none.
    fn run(
        &mut self,
        reads: &[FileRead<'_>],
        pieces: &[Piece],
        batches: &[std::ops::Range<usize>],
        next: &AtomicUsize,
        failed: &AtomicBool,
        done: &AtomicU64,
    ) -> Result<Option<usize>> {
        let _ctx = context(self.ordinal)?;
        let mut last = None;
        loop {
            if failed.load(Ordering::Relaxed) {
                return Ok(last);
            }
            let index = next.fetch_add(1, Ordering::Relaxed);
            let Some(batch) = batches.get(index) else {
                return Ok(last);
            };
            let batch = &pieces[batch.clone()];
            let turn = self.turn % 2;
            self.turn += 1;
            let slot = &mut self.slots[turn];
            if slot.used {
                // The copy out of this buffer, enqueued two pieces ago, must be done.
                slot.event.synchronize()?;
            }
            // One piece at the buffer's start (a direct read's pages around it); or several
            // pieces of buffered reads one after another, landing one after another.
            let mut staged = slot.aligned.cast_const();
            let mut len = 0usize;
            for piece in batch {
                let read = &reads[piece.read];
                let offset = read.offset + piece.start as u64;
                let at = fill(slot.aligned.wrapping_add(len), read, offset, piece.len)?;
                if len == 0 {
                    staged = at;
                }
                len += piece.len;
            }
            let (first, read) = (batch[0], &reads[batch[0].read]);
            let dst = read.dst.handle() as usize + read.dst_offset + first.start;
            // SAFETY: `staged` addresses `len` bytes of pinned memory this worker owns, untouched
            // until the event recorded below completes; `dst..dst + len` lies inside the
            // destination allocation (the caller sized it for every read, and a batch's pieces
            // land one after another in one allocation); the stream belongs to the bound context.
            unsafe {
                driver::memcpy_htod_async(dst as u64, staged.cast(), len, raw(self.stream.handle()))
            }
            .named("cuMemcpyHtoDAsync")?;
            slot.event.record(self.stream.handle())?;
            slot.used = true;
            last = Some(turn);
            done.fetch_add(len as u64, Ordering::Relaxed);
        }
    }
}

/// Reads `len` bytes at `offset` of `read`'s file into the staging memory at `into`, returning
/// where they start. Direct reads cover whole pages around the range (the piece then starts
/// `offset % 4096` bytes in); `into` is then a slot's page-aligned start.
fn fill(into: *mut u8, read: &FileRead<'_>, offset: u64, len: usize) -> Result<*const u8> {
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
    // SAFETY: `into` lies in a slot's `chunk` bytes of pinned memory with `want` bytes to its
    // end: a direct read starts the slot and `want <= len + 2 pages <= chunk` (a piece is at most
    // `chunk - 2 pages`); a batch of buffered pieces is at most a piece in all. The worker alone
    // writes the slot, and its event says no copy still reads it.
    let dst = unsafe { std::slice::from_raw_parts_mut(into, want) };
    let mut filled = 0;
    while filled < skip + len {
        match file.read_at(&mut dst[filled..], start + filled as u64) {
            // End of file before the range ended: the file shrank after its header was read.
            Ok(0) => {
                return Err(read.ended_at(start + filled as u64, offset..offset + len as u64));
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
    Ok(into.wrapping_add(skip).cast_const())
}

// SAFETY: the raw pointer in a `Slot` points into the load's `Staging`, which outlives every
// worker, at buffers no other worker uses; a `Worker` is created, used and dropped by one thread
// at a time.
unsafe impl Send for Worker {}

/// A window of registered pages is this many chunks (64 MiB for the default 4 MiB chunk): large
/// enough that a registration's fixed cost is small beside its pages'.
const CHUNKS_PER_WINDOW: usize = 16;

/// Windows a worker keeps registered while their copies may still run, past the one it is
/// filling.
const WINDOW_DEPTH: usize = 2;

/// `CU_MEMHOSTREGISTER_READ_ONLY`: the device only reads the pages (a file mapped read-only).
const REGISTER_READ_ONLY: u32 = 0x08;

/// One copy out of a registered window: host address, device address, bytes.
#[derive(Clone, Copy)]
struct Copy {
    src: usize,
    dst: u64,
    len: usize,
}

/// A page-aligned range of one file's mapping, registered while its copies run.
struct Window<'a> {
    start: usize,
    len: usize,
    copies: Vec<Copy>,
    /// The file, for errors.
    path: &'a std::path::Path,
}

/// Each file of a load mapped whole, shared and read-only, for the registered reader. (A private
/// mapping will not do: the kernel copies each private page that is pinned long-term.)
struct FileMaps {
    /// Each distinct file's descriptor and mapping.
    maps: Vec<(std::os::fd::RawFd, crate::engine::Mapping)>,
}

impl FileMaps {
    /// The mappings of `reads`' files; `None` where a file is empty or cannot be mapped.
    fn new(reads: &[FileRead<'_>]) -> Option<FileMaps> {
        use std::os::fd::AsRawFd;
        let mut maps = Vec::new();
        for r in reads {
            let fd = r.file.as_raw_fd();
            if maps.iter().any(|(f, _)| *f == fd) {
                continue;
            }
            let len = usize::try_from(r.file.metadata().ok()?.len()).ok()?;
            if len == 0 {
                return None;
            }
            let map = crate::engine::Mapping::shared(r.file, len, r.path).ok()?;
            maps.push((fd, map));
        }
        Some(FileMaps { maps })
    }

    /// The address of `file`'s byte 0 in its mapping, and the mapping's length (the file's when
    /// it was mapped).
    fn of(&self, file: &std::fs::File) -> Option<(usize, usize)> {
        use std::os::fd::AsRawFd;
        let fd = file.as_raw_fd();
        self.maps
            .iter()
            .find(|(f, _)| *f == fd)
            .map(|(_, m)| (m.as_ptr().expose_provenance(), m.len()))
    }
}

/// The windows that cover `reads` (each range of a mapping registered once, page-aligned, at most
/// `size` bytes), with every read split into copies at their edges; `map` gives the address of a
/// read's file in its mapping and the mapping's length. `None` when a read has no mapping, is read
/// directly, or lies beyond its mapping (a file shorter than its header says: the staged reader
/// reports that).
fn plan_windows<'a>(
    reads: &[FileRead<'a>],
    map: impl Fn(&FileRead<'a>) -> Option<(usize, usize)>,
    size: usize,
) -> Option<Vec<Window<'a>>> {
    let page = crate::backend::cpu::page_size();
    let size = size.next_multiple_of(page);
    let mut items = Vec::with_capacity(reads.len());
    for r in reads {
        if r.direct.is_some() {
            return None;
        }
        let (base, mapped) = map(r)?;
        let offset = usize::try_from(r.offset).ok()?;
        if offset.checked_add(r.len)? > mapped {
            return None;
        }
        let src = base.checked_add(offset)?;
        let dst = r.dst.handle() as u64 + r.dst_offset as u64;
        items.push((src, r.len, dst, r.path));
    }
    items.sort_by_key(|i| i.0);
    let mut windows: Vec<Window<'a>> = Vec::new();
    for (mut src, mut len, mut dst, path) in items {
        while len > 0 {
            let open = windows
                .last()
                .is_some_and(|w| src >= w.start && src < w.start + w.len);
            if !open {
                let floor = src - src % page;
                let start = windows.last().map_or(floor, |w| floor.max(w.start + w.len));
                let end = (start + size).min((src + len).next_multiple_of(page));
                windows.push(Window {
                    start,
                    len: end - start,
                    copies: Vec::new(),
                    path,
                });
            }
            let w = windows.last_mut()?;
            let n = len.min(w.start + w.len - src);
            w.copies.push(Copy { src, dst, len: n });
            src += n;
            dst += n as u64;
            len -= n;
        }
    }
    Some(windows)
}

/// Whether the driver registers file pages here: the first page of the first window, registered
/// and unregistered (a driver or system without read-only registration of file-backed memory
/// refuses, and the load goes through staging buffers instead).
fn can_register(ordinal: i32, windows: &[Window<'_>]) -> bool {
    let Some(first) = windows.first() else {
        return false;
    };
    let Ok(_ctx) = context(ordinal) else {
        return false;
    };
    let p = std::ptr::with_exposed_provenance::<std::ffi::c_void>(first.start);
    let page = crate::backend::cpu::page_size();
    // SAFETY: one page of a live read-only mapping of the file (the caller's `FileMaps`), not
    // registered yet (windows are registered only by this module, after this probe).
    if unsafe { driver::host_register(p, page, REGISTER_READ_ONLY) }.is_err() {
        return false;
    }
    // SAFETY: registered just above; nothing reads it.
    unsafe { driver::host_unregister(p) }.is_ok()
}

/// A worker's stream and its registered windows whose copies may still run, each with its event;
/// dropping it waits for the stream and unregisters them (also on an error path, where a window's
/// event may not be recorded yet).
struct InFlight<'w> {
    ordinal: i32,
    stream: Stream,
    windows: std::collections::VecDeque<(&'w Window<'w>, Event)>,
}

impl<'w> InFlight<'w> {
    /// Waits for the oldest window's copies and unregisters it.
    fn retire(&mut self, done: &AtomicU64) -> Result<()> {
        let Some((w, event)) = self.windows.pop_front() else {
            return Ok(());
        };
        let waited = event.synchronize();
        let p = std::ptr::with_exposed_provenance::<std::ffi::c_void>(w.start);
        // SAFETY: registered by this worker; its event says no copy reads it any more (or the
        // wait failed, and the context is unusable anyway).
        let unregistered = unsafe { driver::host_unregister(p) }.named("cuMemHostUnregister");
        waited?;
        unregistered?;
        done.fetch_add(
            w.copies.iter().map(|c| c.len as u64).sum(),
            Ordering::Relaxed,
        );
        Ok(())
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let Ok(_ctx) = context(self.ordinal) else {
            return;
        };
        if let Err(e) = self.stream.synchronize() {
            log::warn!("dlbridge: waiting for copies out of registered file pages: {e}");
        }
        let ignore = AtomicU64::new(0);
        while !self.windows.is_empty() {
            if let Err(e) = self.retire(&ignore) {
                log::warn!("dlbridge: releasing registered file pages: {e}");
            }
        }
    }
}

/// Copies every window's ranges to the device from the registered pages, `options.threads`
/// workers taking windows in turn, their streams after `after`.
fn read_registered(
    ordinal: i32,
    windows: &[Window<'_>],
    options: &ReadOptions<'_>,
    after: &Event,
) -> Result<()> {
    let next = AtomicUsize::new(0);
    run_workers(options.threads.clamp(1, windows.len()), |failed| {
        register_and_copy(ordinal, windows, &next, failed, options.done, after)
    })
}

/// One worker of [`read_registered`].
fn register_and_copy(
    ordinal: i32,
    windows: &[Window<'_>],
    next: &AtomicUsize,
    failed: &AtomicBool,
    done: &AtomicU64,
    after: &Event,
) -> Result<()> {
    let _ctx = context(ordinal)?;
    let mut in_flight = InFlight {
        ordinal,
        stream: Stream::new(ordinal, true)?,
        windows: std::collections::VecDeque::new(),
    };
    in_flight.stream.wait_event(after)?;
    let stream = in_flight.stream.handle();
    loop {
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let Some(w) = windows.get(next.fetch_add(1, Ordering::Relaxed)) else {
            break;
        };
        let p = std::ptr::with_exposed_provenance::<std::ffi::c_void>(w.start);
        // SAFETY: `w` is a page-aligned range of a live read-only mapping of its file (the
        // caller's `FileMaps`, unmapped after this returns), registered by no one else: windows do not overlap, and each
        // is taken by one worker.
        unsafe { driver::host_register(p, w.len, REGISTER_READ_ONLY) }.map_err(|e| Error::Io {
            path: w.path.to_path_buf(),
            source: std::io::Error::other(format!(
                "registering the file's pages with the driver failed ({}): was the file \
                     truncated while loading?",
                driver::describe(e)
            )),
        })?;
        let event = Event::new(ordinal, false);
        let event = match event {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: registered just above; no copy was queued.
                let _ = unsafe { driver::host_unregister(p) };
                return Err(e);
            }
        };
        // From here the window is retired (waited for and unregistered) by `in_flight`.
        in_flight.windows.push_back((w, event));
        for c in &w.copies {
            let src = std::ptr::with_exposed_provenance::<std::ffi::c_void>(c.src);
            // SAFETY: `src` lies in the registered window, which stays registered and mapped
            // until this copy's event completed; `dst` lies in the destination allocation (the
            // caller sized it for every read); the stream belongs to the bound context.
            unsafe { driver::memcpy_htod_async(c.dst, src, c.len, raw(stream)) }
                .named("cuMemcpyHtoDAsync")?;
        }
        if let Some((_, event)) = in_flight.windows.back() {
            event.record(stream)?;
        }
        while in_flight.windows.len() > WINDOW_DEPTH {
            in_flight.retire(done)?;
        }
    }
    while !in_flight.windows.is_empty() {
        in_flight.retire(done)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Tensor};

    /// A one-byte file that plans of reads name (nothing reads it), removed when dropped.
    struct Scratch {
        path: std::path::PathBuf,
        file: std::fs::File,
    }

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let path = std::env::temp_dir().join(format!("dlbridge-{tag}-{}", std::process::id()));
            std::fs::write(&path, b"x").unwrap();
            let file = std::fs::File::open(&path).unwrap();
            Scratch { path, file }
        }

        /// A buffered read of `len` bytes into `dst` at `dst_offset`.
        fn read<'a>(&'a self, dst: &'a Tensor, dst_offset: usize, len: usize) -> FileRead<'a> {
            FileRead {
                path: &self.path,
                file: &self.file,
                direct: None,
                offset: 0,
                len,
                dst: dst.buffer(),
                dst_offset,
            }
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// A group's pieces are spread evenly over the workers: the fewest rounds, each worker the
    /// same number of pieces (but the last few), none larger than a staging buffer takes.
    #[test]
    fn balanced_pieces_give_every_worker_the_same_rounds() {
        let scratch = Scratch::new("balance");
        let dst = Tensor::zeros(&[1], DType::U8, Device::CPU).unwrap();
        let read = |len: usize| scratch.read(&dst, 0, len);
        let largest = (4 << 20) - 2 * DIRECT_ALIGN;
        // A layer of a 2048-wide model in bf16 (two 33.5 MB matrices, one run): 17 pieces of
        // the largest size for 12 workers, 24 balanced ones.
        let layer = [read(67_108_864)];
        let piece = balanced_piece(&layer, 12, largest);
        assert_eq!(piece % DIRECT_ALIGN, 0);
        assert!(piece <= largest);
        assert_eq!(pieces(&layer, largest).len(), 17);
        assert_eq!(piece_count(&layer, largest), 17);
        assert_eq!(pieces(&layer, piece).len(), 24);
        // Many reads: each cut on its own, never more rounds than the largest pieces need.
        let many: Vec<FileRead<'_>> = (1..=9).map(|k| read(k * 3_000_000)).collect();
        let piece = balanced_piece(&many, 8, largest);
        assert!(piece <= largest && piece % DIRECT_ALIGN == 0);
        assert!(
            pieces(&many, piece).len().div_ceil(8) <= pieces(&many, largest).len().div_ceil(8) + 1
        );
        // Tiny and empty reads: one page.
        assert_eq!(balanced_piece(&[read(1)], 16, largest), DIRECT_ALIGN);
        assert_eq!(balanced_piece(&[], 16, largest), DIRECT_ALIGN);
    }

    /// A column split's rows (reads landing one after another) go as few copies, each at most
    /// the size asked; a gap in the destination, another allocation or a direct read starts a
    /// new one; every piece is in exactly one batch, in order.
    #[test]
    fn rows_landing_one_after_another_are_copied_together() {
        let scratch = Scratch::new("batches");
        let a = Tensor::zeros(&[1], DType::U8, Device::CPU).unwrap();
        let b = Tensor::zeros(&[1], DType::U8, Device::CPU).unwrap();
        let read = |in_b: bool, dst_offset: usize, len: usize| {
            scratch.read(if in_b { &b } else { &a }, dst_offset, len)
        };
        // 100 rows of 5,504 bytes (a 7B down projection's row at TP=4) into `a`, one after
        // another, then a gap, then rows into `b`, then a direct read.
        let mut reads: Vec<FileRead<'_>> = (0..100).map(|i| read(false, i * 5504, 5504)).collect();
        reads.push(read(false, 100 * 5504 + 64, 5504));
        reads.push(read(true, 0, 5504));
        reads.push(read(true, 5504, 5504));
        let mut direct = read(true, 2 * 5504, 5504);
        direct.direct = Some(&scratch.file);
        reads.push(direct);
        reads.push(read(true, 3 * 5504, 5504));
        let largest = 64 << 10; // 11 rows a batch
        let pieces = pieces(&reads, largest);
        let got = batches(&reads, &pieces, largest);
        let mut want: Vec<std::ops::Range<usize>> =
            (0..100).step_by(11).map(|i| i..(i + 11).min(100)).collect();
        want.extend([100..101, 101..103, 103..104, 104..105]);
        assert_eq!(got, want);
        for batch in &got {
            let bytes: usize = pieces[batch.clone()].iter().map(|p| p.len).sum();
            assert!(bytes <= largest);
        }
    }

    /// Windows are page-aligned, disjoint, at most the size asked, and their copies cover every
    /// read exactly once, each inside its window, with the destination following the source.
    #[test]
    fn windows_cover_reads_once_inside_disjoint_pages() {
        let page = crate::backend::cpu::page_size();
        let path = std::env::temp_dir().join(format!("dlbridge-windows-{}", std::process::id()));
        let file_len = 40 * page + 123;
        std::fs::write(&path, vec![0u8; file_len]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let dst = Tensor::zeros(&[64 * page], DType::U8, Device::CPU).unwrap();
        let mapping = 1usize << 32; // page-aligned; only arithmetic is done with it
        // Runs with gaps, sharing pages at their edges, one ending at the file's last byte.
        let runs = [
            (10, 5000),
            (5020, 3 * page),
            (9 * page + 7, 17),
            (12 * page, 28 * page + 123),
        ];
        for size in [page, 2 * page, 5 * page + 1, 64 * page] {
            let reads: Vec<FileRead<'_>> = runs
                .iter()
                .enumerate()
                .map(|(i, &(offset, len))| FileRead {
                    path: &path,
                    file: &file,
                    direct: None,
                    offset: offset as u64,
                    len,
                    dst: dst.buffer(),
                    dst_offset: i * 8 * page,
                })
                .collect();
            let windows = plan_windows(&reads, |_| Some((mapping, file_len)), size).unwrap();
            let limit = size.next_multiple_of(page);
            for pair in windows.windows(2) {
                assert!(
                    pair[0].start + pair[0].len <= pair[1].start,
                    "disjoint, in order"
                );
            }
            let mut covered = 0;
            for w in &windows {
                assert_eq!(w.start % page, 0);
                assert!(w.len > 0 && w.len <= limit);
                for c in &w.copies {
                    assert!(c.src >= w.start && c.src + c.len <= w.start + w.len);
                    let r = reads
                        .iter()
                        .find(|r| {
                            let s = mapping + r.offset as usize;
                            c.src >= s && c.src + c.len <= s + r.len
                        })
                        .expect("a copy lies in one read");
                    let into = c.src - (mapping + r.offset as usize);
                    assert_eq!(
                        c.dst,
                        dst.buffer().handle() as u64 + (r.dst_offset + into) as u64
                    );
                    covered += c.len;
                }
            }
            assert_eq!(covered, runs.iter().map(|r| r.1).sum::<usize>());
        }
        // A read past the file's end, a direct read, a read with no mapping: the staged reader.
        let past = FileRead {
            path: &path,
            file: &file,
            direct: None,
            offset: (40 * page) as u64,
            len: 124,
            dst: dst.buffer(),
            dst_offset: 0,
        };
        assert!(
            plan_windows(
                std::slice::from_ref(&past),
                |_| Some((mapping, file_len)),
                page
            )
            .is_none()
        );
        let direct = FileRead {
            direct: Some(&file),
            len: 1,
            dst: dst.buffer(),
            ..past
        };
        assert!(
            plan_windows(
                std::slice::from_ref(&direct),
                |_| Some((mapping, file_len)),
                page
            )
            .is_none()
        );
        let unmapped = FileRead {
            direct: None,
            ..direct
        };
        assert!(plan_windows(&[unmapped], |_| None, page).is_none());
        std::fs::remove_file(&path).unwrap();
    }
}
