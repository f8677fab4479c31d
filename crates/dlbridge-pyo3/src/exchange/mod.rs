//! The DLPack plumbing under [`ArrayArg`](crate::ArrayArg) and [`PyTensor`](crate::PyTensor),
//! for bindings that take the steps themselves (dlbridge's own Python extension is built on
//! these): Python objects and capsules turned into calls of the core's exchange
//! ([`dlbridge::dlpack::ImportRequest`], [`dlbridge::dlpack::ExportRequest`]), which decides
//! device, storage mode, copy, stream and version. Nothing here decides what a user gets.
//!
//! | module | direction | what it does |
//! | --- | --- | --- |
//! | [`capsule`] | both | `dltensor[_versioned]` capsules taken (renamed used) and made |
//! | [`c_api`] | both | the DLPack 1.3 C exchange table: a producer's looked up (cached per type) and used; a table published for any [`c_api::TensorClass`] |
//! | [`kind`] | in | what a producer's type is, looked up once per type: its table, NumPy or not, immutable by contract, states DLPack cannot express (refused on every path) |
//! | [`consumer`] | in | which path a producer's tensor comes through: table, `__dlpack__`, buffer; arrays immutable by contract imported read-only |
//! | [`producer`] | out | `__dlpack__`'s Python arguments to an export request |
//! | [`buffer`] | in | the buffer protocol as a zero-copy host source |
//! | [`ml_dtypes`] | both | NumPy arrays of `ml_dtypes` types (`bfloat16`, the 8-bit floats), which NumPy's DLPack refuses |

pub mod buffer;
pub mod c_api;
pub mod capsule;
pub mod consumer;
pub mod kind;
pub mod ml_dtypes;
pub mod producer;

pub use crate::error::{IntoPyResult, exception_name};
