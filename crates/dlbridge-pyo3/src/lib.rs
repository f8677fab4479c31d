//! Accept and return any framework's arrays in PyO3 functions, without copies.
//!
//! An argument of type [`ArrayArg`] takes a NumPy, PyTorch, JAX, CuPy, MLX or dlbridge array,
//! a DLPack capsule or any buffer-protocol object, on any device, without a copy (through the
//! producer's DLPack 1.3 C exchange table where its type has one, else `__dlpack__`, else the
//! buffer protocol; NumPy arrays, `ml_dtypes`' `bfloat16` and 8-bit floats among them, are read
//! from NumPy's documented array struct). The function checks it at the border in one line and
//! gets typed access; a [`PyTensor`] returns a Rust-allocated [`dlbridge::Tensor`] to any
//! framework. A producer's arrays that are immutable by contract (JAX's) are read-only: readable
//! without a copy, refused for [`Expect::write`].
//!
//! | Python side | Rust side | how |
//! | --- | --- | --- |
//! | any array argument | [`ArrayArg`] | `FromPyObject`: imported, no copy, producer kept alive |
//! | dtype / ndim / shape / order / device / writable | [`Expect`] | `x.expect("x").dtype::<f32>().ndim(2)` |
//! | read-only access | [`ReadArray<T>`] | `.read::<T>(py)?`: `as_slice`, `as_array` (`ndarray`), `cuda_ptr`, `tensor` |
//! | mutable access | [`WriteArray<T>`] | `.write::<T>(py)?`: `as_slice_mut`, `as_array_mut`; exclusive across extensions |
//! | CUDA memory and stream | [`CudaPtr`] | device address + the stream the producer was ordered before |
//! | returned array | [`PyTensor`] | `__dlpack__`, `__dlpack_device__`, `__dlpack_c_exchange_api__` |
//! | caller's framework | [`to_framework`] | `"numpy"`, `"torch"`, `"jax"`, `"cupy"`, `"dlbridge"` |
//!
//! The exchange rules (device, copy, stream handoff, version) are the core's
//! ([`dlbridge::dlpack::ImportRequest`], [`dlbridge::dlpack::ExportRequest`]); imports ask for
//! no copy. Errors are Python exceptions naming the argument: `TypeError` for something that is
//! not an array or has the wrong element type, `ValueError` for the wrong axes, shape, order,
//! device or a read-only array where a writable one is needed, `BufferError` for a used capsule,
//! an inexpressible producer state (a PyTorch tensor that requires grad) or a borrow conflict.
//!
//! # Example
//!
//! ```
//! use dlbridge_pyo3::{ArrayArg, PyTensor};
//! use pyo3::prelude::*;
//!
//! /// Sum of a 1-D float32 array from any framework.
//! #[pyfunction]
//! fn total(py: Python<'_>, x: ArrayArg) -> PyResult<f32> {
//!     let x = x.expect("x").ndim(1).cpu().read::<f32>(py)?;
//!     Ok(x.as_slice()?.iter().sum())
//! }
//!
//! /// Doubles a float32 array in place.
//! #[pyfunction]
//! fn double(py: Python<'_>, x: ArrayArg) -> PyResult<()> {
//!     let mut x = x.expect("x").c_contiguous().cpu().write::<f32>(py)?;
//!     x.as_slice_mut()?.iter_mut().for_each(|v| *v *= 2.0);
//!     Ok(())
//! }
//!
//! /// A new array, 0..n.
//! #[pyfunction]
//! fn arange(n: usize) -> PyResult<PyTensor> {
//!     let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
//!     let t = dlbridge::Tensor::from_slice(&values, &[n]).map_err(dlbridge_pyo3::to_py)?;
//!     Ok(PyTensor::new(t))
//! }
//!
//! Python::attach(|py| -> PyResult<()> {
//!     let total = wrap_pyfunction!(total, py)?;
//!     let double = wrap_pyfunction!(double, py)?;
//!     let arange = wrap_pyfunction!(arange, py)?;
//!     // A buffer-protocol object: array.array of floats.
//!     let array = py.import("array")?.getattr("array")?;
//!     let x = array.call1(("f", vec![1.0f32, 2.0, 3.0]))?;
//!     assert_eq!(total.call1((&x,))?.extract::<f32>()?, 6.0);
//!     double.call1((&x,))?;
//!     assert_eq!(total.call1((&x,))?.extract::<f32>()?, 12.0);
//!     // Bytes are read-only: refused for mutable access, with the argument's name.
//!     let err = double.call1((pyo3::types::PyBytes::new(py, &[0; 8]),)).unwrap_err();
//!     assert!(err.to_string().contains("argument 'x'"));
//!     // A returned tensor goes back into any consumer, here our own argument type.
//!     let t = arange.call1((4,))?;
//!     assert_eq!(total.call1((t,))?.extract::<f32>()?, 6.0);
//!     Ok(())
//! })
//! .unwrap();
//! ```
//!
//! Borrows are tracked per byte range across every extension in the process that links this
//! crate (a shared registry in `sys.modules`, see [`borrow`](crate#borrows)): two mutable
//! borrows of overlapping memory, or a mutable and a shared one, are refused with a
//! `BufferError`.
//!
//! # Borrows
//!
//! The registry is a versioned C table in a capsule at
//! `sys.modules["_dlbridge_borrows"].registry_v1`, published by the first extension that needs
//! it; extensions built with other versions of this crate find and use the same one.

mod arg;
mod borrow;
mod error;
pub mod exchange;
mod numpy;
mod tensor;

pub use arg::{ArrayArg, CudaPtr, Expect, Order, ReadArray, WriteArray};
pub use dlbridge;
pub use error::to_py;
pub use tensor::{PyTensor, to_framework};
