//! The crate's one error type.

use crate::device::Device;

/// What went wrong, said in the caller's terms.
///
/// Each variant belongs to one [`ErrorKind`], which is what language bindings map to their own
/// exception types (the Python extension maps them in exactly one place).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A DLPack descriptor that breaks the specification (bad ndim, negative extent, data out of
    /// range, NULL where a pointer is required, ...).
    #[error("malformed DLPack tensor: {0}")]
    MalformedTensor(String),
    /// A DLPack major version this crate does not speak.
    #[error("DLPack version {major}.{minor} is not supported: dlbridge speaks DLPack 1.x")]
    UnsupportedVersion {
        /// The producer's major version.
        major: u32,
        /// The producer's minor version.
        minor: u32,
    },
    /// A DLPack data type this crate cannot hold, or cannot use for the requested operation.
    #[error("unsupported dtype: {0}")]
    UnsupportedDType(String),
    /// A dtype name or value that names no data type.
    #[error("invalid dtype: {0}")]
    InvalidDType(String),
    /// A device this crate cannot hold or cannot use for the requested operation.
    #[error("unsupported device: {0}")]
    UnsupportedDevice(String),
    /// The operation cannot be done without a copy, and a copy was forbidden.
    #[error("a copy is required but was forbidden: {0}")]
    CopyRequired(String),
    /// A write was asked of read-only memory.
    #[error("the buffer is read-only: {0}")]
    ReadOnly(String),
    /// Host access to memory the host cannot address (device memory, private storage).
    #[error("memory on {device} is not host-accessible: {what}")]
    NotHostAccessible {
        /// Where the memory lives.
        device: Device,
        /// What was attempted.
        what: String,
    },
    /// Mutable access to a buffer that is shared with other views.
    #[error("the buffer is shared by {count} views; mutable access needs the only one")]
    Aliased {
        /// How many references the buffer has.
        count: usize,
    },
    /// An index, slice or byte range outside the array or buffer.
    #[error("out of bounds: {0}")]
    OutOfBounds(String),
    /// An operation has no kernel or rule for its operands' dtypes (`sqrt` of `bool`, `matmul` of
    /// integers, `uint64 + int8`).
    #[error("unsupported operand types: {0}")]
    UnsupportedOperand(String),
    /// Shapes, strides or layouts that do not fit the operation.
    #[error("shape error: {0}")]
    Shape(String),
    /// The element type does not match what was asked for.
    #[error("dtype mismatch: {0}")]
    DTypeMismatch(String),
    /// A pointer or offset without the alignment its element type needs.
    #[error("misaligned: {0}")]
    Misaligned(String),
    /// A size or offset computation overflowed.
    #[error("size overflow: {0}")]
    Overflow(String),
    /// Any other invalid argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An allocation failed.
    #[error("out of memory: cannot allocate {bytes} bytes on {device}{detail}")]
    OutOfMemory {
        /// The requested size.
        bytes: usize,
        /// Where.
        device: Device,
        /// More figures, already formatted with a leading separator (may be empty).
        detail: String,
    },
    /// The backend needed for a device is not compiled in or not usable on this machine.
    #[error("{backend} backend not available: {reason}")]
    BackendUnavailable {
        /// Which backend.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// A run-time compiler (NVRTC, the Metal shader compiler) rejected a kernel.
    #[error("{backend} compilation of `{name}` failed:\n{log}")]
    Compile {
        /// Which backend.
        backend: &'static str,
        /// The kernel's entry point.
        name: String,
        /// The compiler's log.
        log: String,
    },
    /// A file that breaks its format (a safetensors header, a checkpoint index), named with the
    /// reason and, where one is to blame, the tensor.
    #[error("invalid file {}: {reason}", path.display())]
    InvalidFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading or writing a file failed. `source.kind()` keeps the system's [`std::io::ErrorKind`]
    /// (`NotFound`, `IsADirectory`, `PermissionDenied`, ...) for bindings to map.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// A driver or runtime call failed.
    #[error("{backend} error: {message}")]
    Driver {
        /// Which backend.
        backend: &'static str,
        /// The driver's own words.
        message: String,
    },
}

/// The coarse category of an [`Error`], which bindings map to their exception types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The exchange itself is impossible (Python: `BufferError`).
    Buffer,
    /// A bad value (Python: `ValueError`).
    Value,
    /// A bad type (Python: `TypeError`).
    Type,
    /// An index out of range (Python: `IndexError`).
    Index,
    /// Allocation failure (Python: `MemoryError`).
    Memory,
    /// The system or a backend failed (Python: `RuntimeError`).
    Runtime,
}

impl Error {
    /// The category bindings use to pick an exception type.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::MalformedTensor(_)
            | Error::UnsupportedVersion { .. }
            | Error::UnsupportedDType(_)
            | Error::UnsupportedDevice(_)
            | Error::CopyRequired(_)
            | Error::ReadOnly(_)
            | Error::NotHostAccessible { .. }
            | Error::Aliased { .. } => ErrorKind::Buffer,
            Error::InvalidDType(_) | Error::DTypeMismatch(_) | Error::UnsupportedOperand(_) => {
                ErrorKind::Type
            }
            Error::OutOfBounds(_) => ErrorKind::Index,
            Error::Shape(_)
            | Error::Misaligned(_)
            | Error::Overflow(_)
            | Error::InvalidArgument(_)
            | Error::InvalidFile { .. } => ErrorKind::Value,
            Error::OutOfMemory { .. } => ErrorKind::Memory,
            Error::BackendUnavailable { .. }
            | Error::Driver { .. }
            | Error::Compile { .. }
            | Error::Io { .. } => ErrorKind::Runtime,
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand for [`Error::InvalidFile`]: `path` is not a valid file of its format, for `reason`.
pub(crate) fn invalid_file(path: &std::path::Path, reason: String) -> Error {
    Error::InvalidFile {
        path: path.to_path_buf(),
        reason,
    }
}

/// Shorthand for an overflow error naming the computation.
pub(crate) fn overflow(what: impl std::fmt::Display) -> Error {
    Error::Overflow(what.to_string())
}

/// An empty vector with room for `len` values of `T`, or the [`Error::OutOfMemory`] of a host
/// allocation that large: the one way the crate sizes host memory by a number a caller controls
/// (an infallible `Vec` allocation of an impossible size aborts the process).
pub(crate) fn host_vec<T>(len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        bytes: len.saturating_mul(size_of::<T>()),
        device: Device::CPU,
        detail: String::new(),
    })?;
    Ok(v)
}
