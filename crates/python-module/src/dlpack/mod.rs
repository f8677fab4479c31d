//! DLPack in the Python binding: Python objects and capsules turned into calls of the core's
//! exchange ([`dlbridge::dlpack::ImportRequest`], [`dlbridge::dlpack::ExportRequest`]), which
//! decides device, storage mode, copy, stream and version. Nothing here decides what a user gets.
//!
//! The steps (capsules taken and made, a producer's C exchange table looked up and used, the
//! `__dlpack__` call, the buffer protocol, `__dlpack__`'s arguments) are `dlbridge-pyo3`'s
//! ([`dlbridge_pyo3::exchange`]), the one copy that every extension built on dlbridge shares.
//! What is dlbridge's own is here:
//!
//! | module | direction | what it does |
//! | --- | --- | --- |
//! | [`consumer`] | in | `from_dlpack`/`asarray`: our own arrays shared directly, the rest through the steps |
//! | [`table`] | out | `dlbridge.Array`'s C exchange table |

pub(crate) mod consumer;
pub(crate) mod table;

pub(crate) use dlbridge_pyo3::exchange::{buffer, capsule, kind, producer};
