//! Opening the files the loader reads: a regular file only (nothing that could block), mapped
//! whole and copy-on-write as a foreign, read-only CPU [`Buffer`]; no format.

use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A file opened and mapped for loading: its path, the open descriptor it was checked and mapped
/// through (readers read from it, not from the path again, which may name another file by now),
/// and a map of the whole file as a foreign, read-only CPU [`Buffer`] (byte 0 is the file's).
///
/// The file is mapped private and copy-on-write: its pages are the file's until written, the
/// file itself is never written, and a consumer that ignores a view's read-only flag (PyTorch
/// does, through DLPack) writes a page that becomes this process's own copy instead of faulting.
/// Where the system refuses a writable private mapping (strict overcommit,
/// `vm.overcommit_memory=2`), the file is mapped read-only and the loader hands out copies, so
/// that no write into one can fault ([`MappedFile::is_copy_on_write`] says which).
///
/// A view shows the file's pages: the file must not be truncated while mapped (reading a page
/// past the new end raises `SIGBUS`, as with any memory-mapped file).
#[derive(Clone, Debug)]
pub struct MappedFile {
    path: Arc<Path>,
    file: Arc<std::fs::File>,
    buffer: Buffer,
    copy_on_write: bool,
}

impl MappedFile {
    /// Opens the regular file at `path` (anything else, a FIFO, a socket, a device or a
    /// directory, is refused with an [`Error::Io`] saying what it is, before it is read, so that
    /// no open or read can block), maps it and hands its bytes to `parse` (a format's
    /// header parser) before any view of them exists; the mapping and what `parse` gave.
    ///
    /// An empty file cannot be mapped: `parse` is given no bytes, and its error is returned
    /// (an [`Error::InvalidFile`] where it accepts them).
    pub fn open<T>(
        path: impl AsRef<Path>,
        parse: impl FnOnce(&[u8]) -> Result<T>,
    ) -> Result<(MappedFile, T)> {
        let path = path.as_ref();
        let file = open_regular(path, 0)?;
        let len = file_len(&file, path)?;
        if len == 0 {
            parse(&[])?;
            return Err(Error::InvalidFile {
                path: PathBuf::from(path),
                reason: "the file is empty".into(),
            });
        }
        let map_len = usize::try_from(len).map_err(|_| Error::InvalidFile {
            path: PathBuf::from(path),
            reason: format!("{len} bytes cannot be mapped"),
        })?;
        let mapping = Mapping::copy_on_write(&file, map_len, path)?;
        let parsed = parse(mapping.bytes())?;
        let copy_on_write = mapping.is_writable();
        let base = mapping.ptr.as_ptr();
        // SAFETY: `base` addresses the `map_len` bytes of the mapping, readable for as long as
        // `mapping`, moved into the keep-alive, lives. The buffer is read-only, so dlbridge never
        // writes them; a consumer that ignores that writes private copy-on-write pages, or, where
        // the mapping is read-only, gets no view of them (the loader copies).
        let buffer = unsafe {
            Buffer::from_foreign(
                base.cast(),
                base,
                map_len,
                Device::CPU,
                StorageMode::Shared,
                true,
                Box::new(mapping),
            )
        };
        let mapped = MappedFile {
            path: Arc::from(path),
            file: Arc::new(file),
            buffer,
            copy_on_write,
        };
        Ok((mapped, parsed))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path, shared.
    pub(crate) fn shared_path(&self) -> &Arc<Path> {
        &self.path
    }

    /// The open file the mapping was made from, for readers (no second open of the path, which
    /// could have changed since).
    pub(crate) fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// The mapping of the whole file, a read-only CPU buffer (byte 0 is the start of the file).
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// Whether the file is mapped copy-on-write (writable private pages: tensors are views of
    /// them), or read-only because the system refused that (tensors are copies).
    pub fn is_copy_on_write(&self) -> bool {
        self.copy_on_write
    }
}

/// A memory map of a whole file, unmapped when dropped: private and copy-on-write (the file's
/// pages, readable and writable, a written page becoming the process's own copy and the file
/// never written), private and read-only where the system refuses that, or shared and read-only
/// for the CUDA reader that registers its pages with the driver (never handed out).
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping is owned by this value alone and `munmap` in `Drop` may run on any thread.
// This value itself only reads through it (`bytes`, while the file is opened, before any view of
// it exists); writes, where the mapping is writable, come from views' consumers, whose
// synchronisation is theirs, as for any memory a tensor views.
unsafe impl Send for Mapping {}
// SAFETY: as above: shared access only reads the immutable pointer and length.
unsafe impl Sync for Mapping {}

/// The environment variable that makes [`Mapping::copy_on_write`] act as if the system had
/// refused the writable mapping (`1`), so that tests can run the read-only fallback where no
/// strict overcommit policy refuses it. For tests only.
const REFUSE_COPY_ON_WRITE: &str = "_DLBRIDGE_TEST_REFUSE_COPY_ON_WRITE";

impl Mapping {
    /// Maps the first `len` (> 0) bytes of `file` privately and copy-on-write, without reserving
    /// swap for the pages a writer could copy (`MAP_NORESERVE`, so that a mapping larger than
    /// the machine's memory is not refused under the kernel's default overcommit heuristic).
    /// Where the system refuses a writable mapping (strict overcommit accounting,
    /// `vm.overcommit_memory=2`, charges the whole length), the bytes are mapped private and
    /// read-only instead: [`Mapping::is_writable`] then says `false`.
    pub(crate) fn copy_on_write(file: &std::fs::File, len: usize, path: &Path) -> Result<Mapping> {
        let refused = std::env::var_os(REFUSE_COPY_ON_WRITE).is_some_and(|v| v == "1");
        let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE;
        let writable = if refused {
            None
        } else {
            Mapping::map(file, len, path, libc::PROT_READ | libc::PROT_WRITE, flags).ok()
        };
        match writable {
            Some(mapping) => Ok(mapping),
            None => Mapping::map(file, len, path, libc::PROT_READ, libc::MAP_PRIVATE),
        }
    }

    /// Maps the first `len` (> 0) bytes of `file` shared and read-only.
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) fn shared(file: &std::fs::File, len: usize, path: &Path) -> Result<Mapping> {
        Mapping::map(file, len, path, libc::PROT_READ, libc::MAP_SHARED)
    }

    fn map(
        file: &std::fs::File,
        len: usize,
        path: &Path,
        prot: libc::c_int,
        flags: libc::c_int,
    ) -> Result<Mapping> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh mapping at an address of the kernel's choosing (NULL hint, no
        // MAP_FIXED) replaces no existing memory; `fd` is an open descriptor that outlives the
        // call, and the mapping stays valid after the descriptor is closed. A writable mapping
        // is private (the callers never pass MAP_SHARED with PROT_WRITE): the file is not written.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, file.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io_error(path, std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io_error(path, std::io::Error::other("mmap returned a NULL mapping")))?;
        Ok(Mapping {
            ptr,
            len,
            writable: prot & libc::PROT_WRITE != 0,
        })
    }

    /// The address of the file's byte 0.
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The mapped length.
    #[cfg_attr(not(cuda), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the pages are writable (private and copy-on-write): a write through a view, by a
    /// consumer that ignores the views' read-only flag, then cannot fault.
    pub(crate) fn is_writable(&self) -> bool {
        self.writable
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` addresses `len` readable bytes mapped for as long as `self` lives. The file
        // may change under a private mapping if another process writes it; the header is parsed
        // once from these bytes, before any view of the mapping exists, and the result is what is
        // trusted afterwards.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly one live mapping made in `Mapping::map`; every view of
        // it holds a clone of the buffer that owns this value, so none outlives the unmap.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            log::warn!(
                "munmap of a file mapping failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Opens the file a caller named for reading, refusing anything but a regular file: the one way
/// dlbridge opens a user's file (checkpoints and their shards, an index, `.npy` and `.npz` files,
/// a direct-I/O descriptor with `flags`). A FIFO, socket or device could block the open or a read forever, or be a device
/// whose opening does something: the path is checked before it is opened, and the open file is
/// checked again (`fstat`) in case the path changed in between. The open itself does not block
/// (`O_NONBLOCK`, cleared once the file is known to be regular) and the descriptor is not
/// inherited by child processes (`O_CLOEXEC`, as `std` always sets).
///
/// Errors are [`Error::Io`] naming the path: the system's error (`NotFound`,
/// `PermissionDenied`, ...), `IsADirectory` for a directory, and for anything else that is not a
/// regular file an error saying what it is ("is a FIFO (named pipe), not a regular file").
pub(crate) fn open_regular(path: &Path, flags: libc::c_int) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let meta = std::fs::metadata(path).map_err(|e| io_error(path, e))?;
    check_regular(path, &meta)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | flags)
        .open(path)
        .map_err(|e| io_error(path, e))?;
    let meta = file.metadata().map_err(|e| io_error(path, e))?;
    check_regular(path, &meta)?;
    let fd = file.as_raw_fd();
    // SAFETY: `fcntl(F_GETFL)` reads the status flags of `fd`, a descriptor `file` owns.
    let status = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: `fcntl(F_SETFL)` on the same owned descriptor changes only how it blocks.
    if status == -1 || unsafe { libc::fcntl(fd, libc::F_SETFL, status & !libc::O_NONBLOCK) } == -1 {
        return Err(io_error(path, std::io::Error::last_os_error()));
    }
    Ok(file)
}

/// Fails with the [`Error::Io`] [`open_regular`] describes unless `meta` is a regular file's.
pub(crate) fn check_regular(path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    use std::io::ErrorKind;
    use std::os::unix::fs::FileTypeExt;
    let kind = meta.file_type();
    if kind.is_file() {
        return Ok(());
    }
    let (error_kind, what) = if kind.is_dir() {
        (ErrorKind::IsADirectory, "a directory")
    } else if kind.is_fifo() {
        (ErrorKind::InvalidInput, "a FIFO (named pipe)")
    } else if kind.is_socket() {
        (ErrorKind::InvalidInput, "a socket")
    } else if kind.is_char_device() {
        (ErrorKind::InvalidInput, "a character device")
    } else if kind.is_block_device() {
        (ErrorKind::InvalidInput, "a block device")
    } else {
        (ErrorKind::InvalidInput, "something else")
    };
    Err(io_error(
        path,
        std::io::Error::new(error_kind, format!("is {what}, not a regular file")),
    ))
}

/// The length of an open file.
pub(crate) fn file_len(file: &std::fs::File, path: &Path) -> Result<u64> {
    Ok(file.metadata().map_err(|e| io_error(path, e))?.len())
}

/// The [`Error::Io`] of `source`, naming `path`.
pub(crate) fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Whether bytes at `address` can be viewed in place as elements of `dtype`: aligned for its
/// item size (one byte for packed sub-byte elements). Bytes that are not are copied.
pub(crate) fn is_aligned(address: usize, dtype: DType) -> bool {
    address % dtype.itemsize() == 0
}
