//! DLPack exchange: importing foreign tensors (consumer side) and exporting ours (producer side).
//!
//! # Import
//! A foreign `DLManagedTensor[Versioned]` is trusted for nothing but its deleter. Ownership passes
//! to dlbridge the moment an import function is called: whatever the outcome, the producer's
//! deleter runs exactly once, on the thread that drops the last reference (immediately, when the
//! import fails). The checks, in order:
//!
//! 1. the major version is 1 (versioned tensors);
//! 2. `0 <= ndim <=` [`MAX_NDIM`](crate::layout::MAX_NDIM), `shape` non-NULL when `ndim > 0`, every
//!    extent non-negative, the element count fits in `isize`;
//! 3. `strides` non-NULL when `ndim > 0`, except from producers older than DLPack 1.2, for which
//!    NULL means compact row-major;
//! 4. the dtype and device type are ones DLPack defines (any device is held; only known ones are
//!    used);
//! 5. every addressed byte lies in a range that does not overflow and, for opaque handles (Metal),
//!    does not start before the handle; `data` is NULL only for zero-size tensors;
//! 6. packed sub-byte tensors are compact.
//!
//! The result points at the producer's memory (no copy), keeps the producer alive, and carries
//! `READ_ONLY`, which dlbridge enforces.
//!
//! # Export
//! Strides are always emitted. For addressable memory (host and CUDA pointers) `data` points at
//! the first element and `byte_offset` is 0, the form every consumer understands; for opaque
//! handles (`id<MTLBuffer>`) `data` is the handle itself and the view's offset goes in
//! `byte_offset`. The exported struct holds a reference to the buffer; its deleter releases exactly
//! that, from any thread, and never unwinds.
//!
//! # Where each part lives
//! | module | direction | what it does |
//! | --- | --- | --- |
//! | [`ffi`] | both | the C structs of `dlpack.h` (1.3) and the C exchange table |
//! | `foreign` | in | a producer's descriptor validated once and wrapped: no copy, no rule applied |
//! | `local` | out | our views written as descriptors that keep their buffer alive |
//! | `exchange` | both | the rules: [`ImportRequest`] and [`ExportRequest`] (device, storage mode, `copy`, stream, version) |

mod exchange;
pub mod ffi;
mod foreign;
mod local;

pub(crate) use exchange::copy_to;
pub use exchange::{ExportRequest, ImportRequest, Imported, ManagedTensor};
pub use foreign::{
    Described, EXCHANGE_CHAIN_LIMIT, describe_borrowed, exchange_table_v1, release_legacy,
    release_versioned,
};

use ffi::DLPackVersion;

/// The DLPack version dlbridge produces.
pub const VERSION: DLPackVersion = DLPackVersion {
    major: ffi::DLPACK_MAJOR_VERSION,
    minor: ffi::DLPACK_MINOR_VERSION,
};
