//! GPUDirect Storage: file ranges read straight into device memory through cuFile (`libcufile`,
//! opened at run time like the driver and never required), through `cudarc::cufile`'s `sys` and
//! `result` layers.
//!
//! Where the `nvidia-fs` kernel module is loaded (the driver's properties report its version),
//! cuFile has the storage DMA into GPU memory with no host copy at all; elsewhere cuFile runs in
//! its compatibility mode (POSIX reads through bounce buffers of its own), which is no faster than
//! the staging reader ([`super::upload`]). A load therefore takes this path by default only for
//! direct (cold) reads where `nvidia-fs` is loaded, and always where asked to
//! (`ReadOptions::gds`).

use std::os::fd::AsRawFd;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use cudarc::cufile::result::{self as cufile, CufileError};
use cudarc::cufile::sys;

use super::context;
use crate::backend::{FileRead, Piece, ReadOptions, pieces, run_workers};
use crate::error::{Error, Result};

/// What was found of cuFile in this process: `Err` says why it cannot be used.
#[derive(Clone, Copy, Debug)]
struct Found {
    /// The `nvidia-fs` module's major version, 0 where it is not loaded (compatibility mode).
    nvfs_major: u32,
}

/// Opens cuFile's driver once per process (it stays open until the process exits).
fn found() -> std::result::Result<Found, &'static str> {
    static FOUND: OnceLock<std::result::Result<Found, &'static str>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        // SAFETY: only tries to open the library by its known names; no symbol is called.
        if !unsafe { sys::is_culib_present() } {
            return Err("the cuFile library (libcufile) was not found");
        }
        cufile::driver_open().map_err(|_| "cuFileDriverOpen failed")?;
        let props =
            cufile::driver_get_properties().map_err(|_| "cuFileDriverGetProperties failed")?;
        Ok(Found {
            nvfs_major: props.nvfs.major_version,
        })
    })
}

/// Whether cuFile can be used here and would read without a host copy: the `nvidia-fs` module
/// is loaded. Asked of the kernel first (`/proc/driver/nvidia-fs`), so that a machine without
/// the module never opens cuFile's driver, whose start takes a tenth of a second and sets up
/// buffer pools, for nothing.
pub(crate) fn native() -> bool {
    static LOADED: OnceLock<bool> = OnceLock::new();
    *LOADED.get_or_init(|| std::path::Path::new("/proc/driver/nvidia-fs").exists())
        && found().is_ok_and(|f| f.nvfs_major > 0)
}

/// A file registered with cuFile; deregistered on drop.
struct Handle(sys::CUfileHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: registered by `register` and deregistered only here, after every read of it
        // returned (the workers are joined before the handles drop).
        if let Err(e) = unsafe { cufile::handle_deregister(self.0) } {
            log::warn!("dlbridge: cuFileHandleDeregister failed: {e}");
        }
    }
}

// SAFETY: a cuFile handle may be used from any thread (cuFile's reads are thread-safe on a
// shared handle); `Handle` only reads through it and deregisters it once.
unsafe impl Send for Handle {}
// SAFETY: as above: concurrent `cuFileRead`s on one handle are allowed.
unsafe impl Sync for Handle {}

fn register(read: &FileRead<'_>) -> Result<Handle> {
    let file = read.direct.unwrap_or(read.file);
    let descr = sys::CUfileDescr_t {
        type_: sys::CUfileFileHandleType::CU_FILE_HANDLE_TYPE_OPAQUE_FD,
        handle: sys::CUfileDescr_t__bindgen_ty_1 {
            fd: file.as_raw_fd(),
        },
        fs_ops: std::ptr::null(),
    };
    cufile::handle_register(&descr).map(Handle).map_err(|e| {
        io_error(
            read,
            format!(
                "cuFileHandleRegister failed: {} (cuFile reads through the nvidia-fs kernel \
                 module, or in its compatibility mode, and took this file in neither; load \
                 without GPUDirect Storage: DLBRIDGE_LOAD_GDS=0)",
                describe(&e)
            ),
        )
    })
}

fn describe(e: &CufileError) -> String {
    match e {
        CufileError::Cufile(code) => format!("{code:?}"),
        CufileError::IO(e) => e.to_string(),
    }
}

fn io_error(read: &FileRead<'_>, message: String) -> Error {
    Error::Io {
        path: read.path.to_path_buf(),
        source: std::io::Error::other(message),
    }
}

/// The files of a load registered with cuFile, ready to read.
pub(crate) struct Registered {
    /// One handle per distinct file (reads of one file share its descriptor).
    handles: Vec<Handle>,
    /// For each read, the index of its file's handle.
    handle_of: Vec<usize>,
}

/// Registers the files of `reads` with cuFile on CUDA device `ordinal`. Fails with
/// [`Error::BackendUnavailable`] where cuFile cannot be used at all, and with [`Error::Io`] where
/// it refuses a file (on the H100 machine, whose virtual disk it cannot describe, it refuses every
/// file, also in its compatibility mode).
pub(crate) fn register_files(ordinal: i32, reads: &[FileRead<'_>]) -> Result<Registered> {
    found().map_err(|why| Error::BackendUnavailable {
        backend: "GPUDirect Storage",
        reason: format!("{why}; load without it (DLBRIDGE_LOAD_GDS=0, LoadOptions::gds)"),
    })?;
    let _ctx = context(ordinal)?;
    let mut fds: Vec<std::os::fd::RawFd> = Vec::new();
    let mut handles = Vec::new();
    let mut handle_of = Vec::with_capacity(reads.len());
    for r in reads {
        let fd = r.direct.unwrap_or(r.file).as_raw_fd();
        let index = match fds.iter().position(|f| *f == fd) {
            Some(i) => i,
            None => {
                handles.push(register(r)?);
                fds.push(fd);
                handles.len() - 1
            }
        };
        handle_of.push(index);
    }
    Ok(Registered { handles, handle_of })
}

impl Registered {
    /// Reads every `reads` entry (those it was registered for) into its device destination,
    /// `options.threads` workers taking pieces of at most `chunk` bytes.
    pub(crate) fn read(
        &self,
        ordinal: i32,
        reads: &[FileRead<'_>],
        chunk: usize,
        options: &ReadOptions<'_>,
    ) -> Result<()> {
        let pieces = pieces(reads, chunk);
        let next = AtomicUsize::new(0);
        run_workers(options.threads.clamp(1, pieces.len().max(1)), |failed| {
            let _ctx = context(ordinal)?;
            while !failed.load(Ordering::Relaxed)
                && let Some(&Piece { read, start, len }) =
                    pieces.get(next.fetch_add(1, Ordering::Relaxed))
            {
                let handle = &self.handles[self.handle_of[read]];
                read_piece(handle, &reads[read], start, len, options.done, failed)?;
            }
            Ok(())
        })
    }
}

/// Reads bytes `start..start + len` of `read` into its destination, however many calls that takes.
fn read_piece(
    handle: &Handle,
    read: &FileRead<'_>,
    start: usize,
    len: usize,
    done: &AtomicU64,
    failed: &AtomicBool,
) -> Result<()> {
    let base = read.dst.handle();
    let mut filled = 0;
    while filled < len {
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let file_offset = read.offset + (start + filled) as u64;
        let dst_offset = read.dst_offset + start + filled;
        let (Ok(file_offset), Ok(dst_offset)) =
            (i64::try_from(file_offset), i64::try_from(dst_offset))
        else {
            return Err(io_error(read, "an offset does not fit in off_t".into()));
        };
        // SAFETY: `base` is the device allocation the caller sized for every read, so the
        // `len - filled` bytes at `dst_offset` lie inside it, and no other worker writes them
        // (pieces are disjoint); the handle is registered and the device's context is current.
        let n = unsafe { cufile::read(handle.0, base, len - filled, file_offset, dst_offset) };
        match n {
            Ok(0) => {
                let range = read.offset + start as u64..read.offset + (start + len) as u64;
                return Err(read.ended_at(file_offset as u64, range));
            }
            Ok(n) => {
                filled += n as usize;
                done.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(CufileError::IO(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(io_error(
                    read,
                    format!("cuFileRead failed: {}", describe(&e)),
                ));
            }
        }
    }
    Ok(())
}
