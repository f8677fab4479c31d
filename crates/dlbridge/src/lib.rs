//! # dlbridge
//!
//! Zero-copy exchange of CPU, CUDA and Metal memory through [DLPack], and a small runtime for
//! that memory.
//!
//! | concept | type | what it is |
//! | --- | --- | --- |
//! | allocation | [`Buffer`] | shared ownership of one allocation: a handle, a length, a device, a [`StorageMode`], read-only-ness, and its owner (dlbridge, or a foreign producer kept alive) |
//! | view | [`Tensor`] | a [`Buffer`] + [`DType`] + [`Layout`]; slicing, transposing, reshaping make new views of the same memory |
//! | layout | [`Layout`] | shape, strides in elements, byte offset; every extent computed with overflow checks |
//! | element type | [`DType`] | DLPack's code, bits and lanes (`float32`, `bfloat16`, `float8_e4m3fn`, ...) |
//! | device | [`Device`] | a [`DeviceKind`] (CPU, CUDA, CUDA host, CUDA managed, Metal, or any other DLPack device, held opaquely) and an index |
//! | foreign tensor in | [`dlpack::ImportRequest`], [`Tensor::from_dlpack_versioned`] | validate a producer's descriptor once, at the border; share its memory, or copy as the request's device, storage mode and `copy` decide |
//! | our tensor out | [`dlpack::ExportRequest`], [`Tensor::to_dlpack_versioned`] | hand a consumer a view that keeps our buffer alive, after the stream handoff, moving or copying as asked |
//! | host access | [`Tensor::as_slice`] / [`Tensor::as_mut_slice`] | checked typed access honouring the view's offset and bounds |
//! | storage mode | [`StorageMode`], [`storage_mode`] | private, shared or managed memory: asked for, else `DLBRIDGE_STORAGE_MODE`, else the device's default ([`storage`]) |
//! | compute | [`compute`] | element-wise ops with broadcasting, reductions, matmul and casts on any backend; run-time user kernels ([`compute::kernel`]) |
//! | caching pool | [`Pool`], [`memory_stats`] | freed blocks kept per (device, storage mode) and reused without a driver call; limits and statistics ([`pool`]) |
//! | backends | [`backend`] | the seam: one folder per backend (CPU, CUDA, Metal) behind one trait, each with a table of its device kinds' facts ([`backend::KindFacts`]); stubs where one is not compiled in |
//! | loading engine | [`engine`] | files mapped copy-on-write, arrays (byte ranges + dtype + layout) onto any device: views of the mapping, or parallel reads through staging; no format |
//! | checkpoints | [`safetensors`] | safetensors files parsed once, planned for the engine, saving |
//! | NumPy files | [`npy`] | `.npy` arrays and `np.savez` archives, parsed once, through the same engine |
//! | across processes | [`share`] | shareable host and CUDA memory, handles another process opens without a copy; device memory through its backend's sharing capability |
//! | runs | [`runs`] | views of one allocation merged into a few byte runs, for a transport that moves bytes (NCCL) |
//!
//! ```
//! use dlbridge::{DType, Device, SliceArg, Tensor};
//!
//! let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
//! let column = t.slice(1, SliceArg::range(1, 2))?; // shape [2, 1], a view
//! assert_eq!(column.to_vec::<f32>()?, vec![2.0, 5.0]);
//!
//! // Export to DLPack and import back: the same memory, no copy.
//! let exported = t.to_dlpack_versioned(dlbridge::dlpack::VERSION, false);
//! // SAFETY: `exported` is a live DLPack tensor whose ownership we hand over.
//! let back = unsafe { Tensor::from_dlpack_versioned(exported)? };
//! assert_eq!(back.as_slice::<f32>()?.as_ptr(), t.as_slice::<f32>()?.as_ptr());
//! assert_eq!(back.dtype(), DType::F32);
//! assert_eq!(back.device(), Device::CPU);
//! # Ok::<(), dlbridge::Error>(())
//! ```
//!
//! # Layout, and where a change goes
//! | change | where | existing files it touches |
//! | --- | --- | --- |
//! | a backend | a new folder `backend/<name>/` implementing the `Backend` trait (allocation, copies, pool, handoff, compute, kernels, device count, sharing; each capability it lacks keeps the trait's default, a typed [`Error::BackendUnavailable`]) with the table of its device kinds | 2: its `mod` line and its entry in the list of backends (`backend/mod.rs`), plus its cargo feature (`Cargo.toml`); `backend/extdev` (feature `test-backend`) is the proof |
//! | a device kind of an existing backend | a row in that backend's table of [`backend::KindFacts`] (addressable, host-accessible, storage modes and where each places memory, foreign storage, sharing route, streams) | that backend's table; [`DeviceKind`] only for a name of its own (else `DeviceKind::Other(code)` serves) |
//! | a file format | a folder beside [`safetensors`] and [`npy`]: header parsing (bytes in, metadata out) and a plan of byte ranges for [`engine`] | the format's folder; its Python binding |
//! | a transport between processes | [`share`] for memory another process maps (plain data in `share/handle.rs`, the OS's shared files in `share/memfd.rs`), a backend's `Sharing` for its device memory, [`runs`] for one that moves bytes | `share/` or the backend's folder |
//!
//! `scripts/import-graph.py crates/dlbridge --seam` prints the module graph's circles other than
//! "the core registers its backends".
//!
//! [DLPack]: https://dmlc.github.io/dlpack/latest/

// Every public item is documented (`missing_docs`, on for the whole workspace in its Cargo.toml),
// and a doc link that does not resolve, or that sends a reader of the public docs to a
// crate-internal item, is an error rather than a dead link.
#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]

/// The README (`crates/dlbridge/README.md` links to the repository's), whose Rust example is
/// compiled and run with the other doctests; its other blocks are tagged `bash`, `python` or
/// `text`, which rustdoc leaves alone.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub mod backend;
pub mod buffer;
pub mod compute;
pub mod device;
pub mod dlpack;
pub mod dtype;
pub mod engine;
pub mod error;
mod fork;
mod host;
pub mod layout;
pub mod npy;
pub mod pool;
pub mod runs;
pub mod safetensors;
pub mod share;
pub mod storage;
pub mod tensor;

pub use backend::{
    empty_cache, memory_stats, reset_peak_memory, set_cache_limit, set_memory_limit, storage_mode,
};
pub use buffer::{Allocation, Buffer, StorageMode};
pub use device::{Device, DeviceKind};
pub use dtype::{DType, DTypeCode, Element};
pub use error::{Error, ErrorKind, Result};
pub use layout::{Layout, MAX_NDIM, SliceArg};
pub use pool::{MemoryStats, Pool};
pub use storage::{Resolved, Source};
pub use tensor::Tensor;
