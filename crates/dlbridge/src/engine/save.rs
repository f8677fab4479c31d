//! The saving engine: a file's bytes, from a head and arrays on any device, written at the
//! disk's speed. It knows no format: a format lays the file out (the head's bytes, each array's
//! byte offset) and the engine moves the bytes.
//!
//! The caller's thread fills a ring of page-aligned host buffers of [`DEFAULT_WRITE_CHUNK`] bytes
//! (from the CPU pool) in file order: host arrays by copies of their compact bytes, strided ones
//! through the copy planner, device arrays through the backend's copy to the host, one array at
//! a time. Writer threads take each full buffer and write it at its aligned file offset around
//! the page cache (`O_DIRECT`), while the next ones fill; the last, partial buffer, and every
//! write where the file system refuses `O_DIRECT` (tmpfs), go through the page cache. The file is
//! then synced.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

use super::file::io_error;

/// The size of one write and ring buffer: a multiple of every block size `O_DIRECT` asks to be
/// aligned to, large enough that the disk sees long writes.
pub const DEFAULT_WRITE_CHUNK: usize = 16 << 20;

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
    /// Writer threads (at least one).
    pub threads: usize,
    /// The size of one write and ring buffer, a multiple of 4096 bytes.
    pub chunk: usize,
    /// Whether full chunks are written around the page cache where the file system allows it.
    pub direct_io: bool,
}

impl Default for WriteOptions {
    fn default() -> WriteOptions {
        WriteOptions {
            threads: default_write_threads(),
            chunk: DEFAULT_WRITE_CHUNK,
            direct_io: true,
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
pub fn write_file(
    path: &Path,
    file: &File,
    head: &[u8],
    items: &[WriteItem<'_>],
    options: &WriteOptions,
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
    let (work_tx, work_rx) = mpsc::channel::<(u64, Tensor)>();
    let work_rx = Mutex::new(work_rx);
    let (free_tx, free_rx) = mpsc::channel::<Tensor>();
    for _ in 0..(threads + 2).min(total.div_ceil(chunk as u64).max(1) as usize) {
        free_tx
            .send(Tensor::empty(&[chunk], DType::U8, Device::CPU)?)
            .map_err(|_| hung_up())?;
    }
    let direct_refused = AtomicBool::new(false);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let free_tx = free_tx.clone();
            let (work_rx, done, failed, direct_refused) =
                (&work_rx, &done, &failed, &direct_refused);
            let (direct, record) = (direct.as_ref(), &record);
            scope.spawn(move || {
                loop {
                    let next = work_rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    let Ok((offset, buffer)) = next else { return };
                    if !failed.load(Ordering::Relaxed) {
                        let bytes = match buffer.as_slice::<u8>() {
                            Ok(bytes) => bytes,
                            Err(e) => {
                                record(e);
                                &[]
                            }
                        };
                        match write_chunk(file, direct, direct_refused, bytes, offset) {
                            Ok(()) => {
                                done.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                            }
                            Err(e) => record(io_error(path, e)),
                        }
                    }
                    // The filler waits for buffers: it gets each back, written or not.
                    let _ = free_tx.send(buffer);
                }
            });
        }
        drop(free_tx);
        let mut filler = Filler {
            chunk,
            free: &free_rx,
            work: work_tx,
            current: None,
            start: 0,
            fill: 0,
            failed: &failed,
        };
        let mut last_report = Instant::now();
        let result = (|| {
            filler.put(head)?;
            let mut at = head.len() as u64;
            for item in items {
                filler.zeros((item.offset - at) as usize)?;
                if item.nbytes > 0 {
                    let bytes = host_bytes(item.tensor, item.nbytes)?;
                    filler.put(bytes.as_slice()?)?;
                }
                at = item.offset + item.nbytes;
                if last_report.elapsed() >= Duration::from_millis(100) {
                    progress(done.load(Ordering::Relaxed), total);
                    last_report = Instant::now();
                }
            }
            // The last, partial chunk: through the page cache, at its exact length.
            if let Some(buffer) = filler.current.take() {
                let bytes = &buffer.as_slice::<u8>()?[..filler.fill];
                file.write_all_at(bytes, filler.start)
                    .map_err(|e| io_error(path, e))?;
                done.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            }
            Ok(())
        })();
        // Hanging up lets the writers finish what they hold and return.
        drop(filler);
        if let Err(e) = result {
            record(e);
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    file.sync_all().map_err(|e| io_error(path, e))?;
    progress(total, total);
    Ok(total)
}

/// The caller's side of the ring: the buffer being filled and where it goes in the file.
struct Filler<'a> {
    chunk: usize,
    free: &'a mpsc::Receiver<Tensor>,
    work: mpsc::Sender<(u64, Tensor)>,
    current: Option<Tensor>,
    /// The file offset of `current`'s first byte.
    start: u64,
    /// Bytes of `current` filled.
    fill: usize,
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

    /// How many of `want` bytes fit in the current buffer (taking a free one where none is
    /// being filled).
    fn room(&mut self, want: usize) -> Result<usize> {
        if self.current.is_none() {
            let buffer = self.free.recv().map_err(|_| hung_up())?;
            if self.failed.load(Ordering::Relaxed) {
                // A writer failed: its error is the one reported.
                return Err(hung_up());
            }
            self.current = Some(buffer);
        }
        Ok(want.min(self.chunk - self.fill))
    }

    /// The next `n` unfilled bytes of the current buffer.
    fn space(&mut self, n: usize) -> Result<&mut [u8]> {
        let fill = self.fill;
        match self.current.as_mut() {
            Some(buffer) => Ok(&mut buffer.as_mut_slice::<u8>()?[fill..fill + n]),
            None => Err(hung_up()),
        }
    }

    /// Counts `n` more bytes filled; a full buffer goes to the writers.
    fn advance(&mut self, n: usize) -> Result<()> {
        self.fill += n;
        if self.fill == self.chunk
            && let Some(buffer) = self.current.take()
        {
            self.work
                .send((self.start, buffer))
                .map_err(|_| hung_up())?;
            self.start += self.chunk as u64;
            self.fill = 0;
        }
        Ok(())
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
}
