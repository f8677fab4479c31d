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
//! | backends | [`backend`] | the seam: one implementation per backend (CPU, CUDA, Metal), stubs where one is not compiled in |
//! | loading engine | [`engine`] | files mapped copy-on-write, arrays (byte ranges + dtype + layout) onto any device: views of the mapping, or parallel reads through staging; no format |
//! | checkpoints | [`safetensors`] | safetensors files parsed once, planned for the engine, saving |
//! | NumPy files | [`npy`] | `.npy` arrays and `np.savez` archives, parsed once, through the same engine |
//! | across processes | [`share`] | shareable host and CUDA memory, handles another process opens without a copy |
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
//! [DLPack]: https://dmlc.github.io/dlpack/latest/

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
