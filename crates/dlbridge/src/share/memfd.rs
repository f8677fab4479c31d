//! Anonymous shared files, the OS's part of sharing host memory: a sealed file of a fixed size
//! (`memfd_create` on Linux, an unlinked POSIX shared memory object elsewhere), its mapping, the
//! checks a received descriptor passes before it is mapped, and [`SharedCounter`], a count in
//! such a file that several processes update atomically. Nothing here knows a device or a
//! backend; `share::cpu` builds the shareable pool on it, and the CUDA backend's legacy IPC
//! counts its consumers with [`SharedCounter`].

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::host::page_size;

/// The error of a failed system call, naming it, with `errno`'s text.
pub(crate) fn os_error(call: &str) -> Error {
    let err = std::io::Error::last_os_error();
    Error::Driver {
        backend: "CPU",
        message: format!("{call} failed: {err}"),
    }
}

/// The seals of every shareable file (Linux): its size is fixed, so that no process it reaches
/// can shrink it under the others' mappings (each would then fault on the pages cut off: `SIGBUS`)
/// or grow it, and so are the seals themselves (nobody can add `F_SEAL_WRITE` or
/// `F_SEAL_FUTURE_WRITE`, which would refuse the writable mappings of later receivers).
#[cfg(target_os = "linux")]
pub(crate) const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A new anonymous shared file of `len` bytes (zero-filled), closed on `exec`; on Linux sealed at
/// that size ([`SEALS`]).
pub(crate) fn anonymous_file(len: usize) -> Result<OwnedFd> {
    #[cfg(target_os = "linux")]
    let raw = {
        let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        // SAFETY: the name is a NUL-terminated string; the flags are valid for memfd_create.
        unsafe { libc::memfd_create(c"dlbridge-shared".as_ptr(), flags) }
    };
    #[cfg(not(target_os = "linux"))]
    let raw = {
        // Elsewhere: a POSIX shared memory object, unlinked at once so that it has no name.
        let name = format!(
            "/dlbridge-{}-{}\0",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        // SAFETY: `name` is NUL-terminated; the flags create a new object or fail.
        let fd = unsafe {
            libc::shm_open(
                name.as_ptr().cast(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
                0o600,
            )
        };
        if fd >= 0 {
            // SAFETY: `name` is NUL-terminated; the object stays alive through `fd`.
            unsafe { libc::shm_unlink(name.as_ptr().cast()) };
        }
        fd
    };
    if raw < 0 {
        return Err(os_error("memfd_create"));
    }
    // SAFETY: `raw` is a descriptor we just opened and own alone.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let size = libc::off_t::try_from(len).map_err(|_| crate::error::overflow("file size"))?;
    // SAFETY: `fd` is an open, writable file.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
        return Err(os_error("ftruncate"));
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: F_ADD_SEALS on a memfd made with MFD_ALLOW_SEALING only adds seals to its file.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(os_error("sealing a shared memory file (fcntl F_ADD_SEALS)"));
        }
    }
    Ok(fd)
}

/// Fails unless `fd` is a file whose size nobody can change: on Linux a memfd carrying [`SEALS`]
/// (as every file [`anonymous_file`] makes does). A received descriptor is checked before it is
/// mapped: were its file shrunk later, every access to the pages cut off would kill the process
/// with `SIGBUS`. (Elsewhere a POSIX shared memory object, whose size is set once.)
pub(crate) fn check_sealed(fd: &OwnedFd) -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: F_GET_SEALS only reads the file's seals; a file that cannot be sealed (not a
        // memfd) makes it fail with EINVAL.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & SEALS != SEALS {
            return Err(Error::InvalidArgument(
                "the shared memory file is not sealed at its size (F_SEAL_SHRINK, F_SEAL_GROW, \
                 F_SEAL_SEAL): refused, as any process holding it could truncate it under every \
                 process that maps it (only dlbridge's own shareable files are opened)"
                    .into(),
            ));
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = fd;
    Ok(())
}

/// Maps `len` bytes of `fd` read-write and shared, at `fixed` when given (replacing what was
/// mapped there).
///
/// # Safety
/// When `fixed` is given, `[fixed, fixed + len)` must be a mapping this module made that nothing
/// reads or writes during the call (its old contents are gone afterwards).
pub(crate) unsafe fn map_file(
    fd: &OwnedFd,
    len: usize,
    fixed: Option<NonNull<c_void>>,
) -> Result<NonNull<c_void>> {
    let (addr, flags) = match fixed {
        Some(p) => (p.as_ptr(), libc::MAP_SHARED | libc::MAP_FIXED),
        None => (std::ptr::null_mut(), libc::MAP_SHARED),
    };
    // SAFETY: `fd` is an open file of at least `len` bytes; a fixed address replaces only a
    // mapping of ours, by the caller's contract.
    let ptr = unsafe {
        libc::mmap(
            addr,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(os_error("mmap"));
    }
    NonNull::new(ptr).ok_or_else(|| os_error("mmap"))
}

/// Unmaps a mapping this module made.
///
/// # Safety
/// `[ptr, ptr + len)` is one mapping of `map_file` that nothing uses any more.
pub(crate) unsafe fn unmap(ptr: NonNull<c_void>, len: usize) {
    // SAFETY: by the caller's contract the range is our mapping and unused.
    if unsafe { libc::munmap(ptr.as_ptr(), len) } != 0 {
        log::warn!("{}", os_error("munmap"));
    }
}

/// The inode of an open file, which a handle records to recognise its file on the other side.
pub(crate) fn inode(fd: &OwnedFd) -> Result<u64> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable; a closed descriptor makes fstat fail, handled below.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(Error::InvalidArgument(format!(
            "file descriptor {} is not open: {}",
            fd.as_raw_fd(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(st.st_ino as u64)
}

/// The size in bytes of an open file.
pub(crate) fn file_size(fd: &OwnedFd) -> Result<usize> {
    // SAFETY: as in `inode`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as in `inode`.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(os_error("fstat"));
    }
    Ok(usize::try_from(st.st_size).unwrap_or(0))
}

/// Writes all of `bytes` to the start of `fd`'s file (`pwrite`, again where it wrote less).
#[cfg(target_os = "linux")]
pub(crate) fn write_all_at(fd: &OwnedFd, bytes: &[u8]) -> Result<()> {
    let mut done = 0usize;
    while done < bytes.len() {
        let rest = &bytes[done..];
        let at = libc::off_t::try_from(done).map_err(|_| crate::error::overflow("file offset"))?;
        // SAFETY: `rest` is readable for its length; `fd` is an open, writable file.
        let n = unsafe { libc::pwrite(fd.as_raw_fd(), rest.as_ptr().cast(), rest.len(), at) };
        if n > 0 {
            done += n as usize;
        } else if n == 0 {
            return Err(os_error(
                "pwrite into a shared memory file (it wrote nothing)",
            ));
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Err(os_error("pwrite into a shared memory file"));
        }
    }
    Ok(())
}

/// Maps `len` bytes of `fd` shared and read-write over `[start, start + len)`, the pages faulted
/// in at once (`MAP_POPULATE`: the file's pages exist already).
///
/// # Safety
/// `[start, start + len)` is whole pages of memory this process owns, whose old contents the
/// caller no longer needs (they are gone afterwards).
#[cfg(target_os = "linux")]
pub(crate) unsafe fn map_over(fd: &OwnedFd, start: NonNull<c_void>, len: usize) -> Result<()> {
    let flags = libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: `fd` is an open file of `len` bytes; the fixed range is the caller's to replace.
    let ptr = unsafe { libc::mmap(start.as_ptr(), len, prot, flags, fd.as_raw_fd(), 0) };
    if ptr == libc::MAP_FAILED {
        return Err(os_error("mmap of a shared file over an array's memory"));
    }
    Ok(())
}

/// A count in a page of shared memory that several processes update atomically: how many
/// consumers still use memory that only its producer can keep alive (legacy CUDA IPC).
#[cfg_attr(not(cuda), allow(dead_code))] // legacy CUDA IPC is its only user
pub(crate) struct SharedCounter {
    ptr: NonNull<c_void>,
    fd: OwnedFd,
}

// SAFETY: the page is shared memory accessed only through `AtomicI64` operations; the address
// is a plain value and munmap may be called from any thread.
unsafe impl Send for SharedCounter {}
// SAFETY: as above; `&self` methods only perform atomic operations.
unsafe impl Sync for SharedCounter {}

#[cfg_attr(not(cuda), allow(dead_code))]
impl SharedCounter {
    /// A new counter at zero.
    pub(crate) fn new() -> Result<Self> {
        Self::map(anonymous_file(page_size())?)
    }

    /// The counter of a received descriptor.
    pub(crate) fn open(fd: OwnedFd) -> Result<Self> {
        check_sealed(&fd)?;
        if file_size(&fd)? < page_size() {
            return Err(Error::InvalidArgument(
                "the descriptor is not a dlbridge shared counter".into(),
            ));
        }
        Self::map(fd)
    }

    fn map(fd: OwnedFd) -> Result<Self> {
        // SAFETY: no fixed address.
        let ptr = unsafe { map_file(&fd, page_size(), None) }?;
        Ok(SharedCounter { ptr, fd })
    }

    fn atomic(&self) -> &std::sync::atomic::AtomicI64 {
        // SAFETY: the page is mapped read-write, page-aligned (so aligned for an i64) and lives
        // as long as `self`; every process touches it only atomically.
        unsafe { self.ptr.cast::<std::sync::atomic::AtomicI64>().as_ref() }
    }

    /// Adds `n` and returns the new value.
    pub(crate) fn add(&self, n: i64) -> i64 {
        self.atomic()
            .fetch_add(n, std::sync::atomic::Ordering::AcqRel)
            + n
    }

    /// The current value.
    pub(crate) fn get(&self) -> i64 {
        self.atomic().load(std::sync::atomic::Ordering::Acquire)
    }

    /// The inode of the counter's file: which counter it is, in every process that maps it.
    pub(crate) fn inode(&self) -> Result<u64> {
        inode(&self.fd)
    }

    /// A new descriptor of the counter's file, for another process.
    pub(crate) fn share(&self) -> Result<OwnedFd> {
        self.fd.try_clone().map_err(|e| Error::Driver {
            backend: "CPU",
            message: format!("dup of a shared counter failed: {e}"),
        })
    }
}

impl Drop for SharedCounter {
    fn drop(&mut self) {
        // SAFETY: `map` made this mapping of one page; no reference to it outlives `self`.
        unsafe { unmap(self.ptr, page_size()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_counter_is_one_count_across_mappings() {
        let a = SharedCounter::new().unwrap();
        assert_eq!(a.add(2), 2);
        let b = SharedCounter::open(a.share().unwrap()).unwrap();
        assert_eq!(b.add(-1), 1);
        assert_eq!(a.get(), 1);
        let (r, _w) = std::io::pipe().unwrap();
        assert!(SharedCounter::open(OwnedFd::from(r)).is_err());
    }
}
