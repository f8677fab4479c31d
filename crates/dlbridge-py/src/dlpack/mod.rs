//! DLPack in the Python binding: Python objects and capsules turned into calls of the core's
//! exchange ([`dlbridge::dlpack::ImportRequest`], [`dlbridge::dlpack::ExportRequest`]), which
//! decides device, storage mode, copy, stream and version. Nothing here decides what a user gets.
//!
//! | module | direction | what it does |
//! | --- | --- | --- |
//! | [`capsule`] | both | `dltensor[_versioned]` capsules taken (renamed used) and made |
//! | [`c_api`] | both | the DLPack 1.3 C exchange table: a producer's looked up and used, ours published |
//! | [`consumer`] | in | `from_dlpack`/`asarray`: which path a producer's tensor comes through |
//! | [`producer`] | out | `Array.__dlpack__`: Python arguments to an export request |
//! | [`buffer`] | in | the buffer protocol as a zero-copy host source |

pub(crate) mod buffer;
pub(crate) mod c_api;
pub(crate) mod capsule;
pub(crate) mod consumer;
pub(crate) mod producer;
