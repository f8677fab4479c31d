//! `dlbridge.Array`: the Python type over a [`Tensor`], and the access to it every other file
//! uses. Its Python methods are in [`crate::array_methods`], which calls the files that do the
//! work (creation, ops, views, indexing, sharing, the DLPack exchange); those call this file, and
//! this file calls none of them.

use dlbridge::Tensor;
use std::ops::Deref;
use std::sync::{RwLock, RwLockReadGuard};

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;

/// A strided array on the CPU, a CUDA device or a Metal device, exchanged with other libraries
/// through DLPack without copies.
///
/// Indexing (integers, slices with any step, `...`, `None`) returns views that share memory.
/// `strides` are in elements, not bytes.
#[pyclass(frozen, module = "dlbridge", name = "Array", sequence, freelist = 64)]
pub(crate) struct PyArray {
    /// The view; `None` once `Backend.free` released the memory.
    slot: RwLock<Option<Tensor>>,
}

/// Read access to a live array's tensor (see [`PyArray::tensor`]).
pub(crate) struct TensorRef<'a>(RwLockReadGuard<'a, Option<Tensor>>);

impl Deref for TensorRef<'_> {
    type Target = Tensor;

    fn deref(&self) -> &Tensor {
        self.0
            .as_ref()
            .expect("TensorRef is made only for live arrays")
    }
}

impl PyArray {
    pub(crate) fn new(tensor: Tensor) -> Self {
        PyArray {
            slot: RwLock::new(Some(tensor)),
        }
    }

    /// The array's tensor; `ValueError` once the array was freed.
    pub(crate) fn tensor(&self) -> PyResult<TensorRef<'_>> {
        let guard = self
            .slot
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if guard.is_none() {
            return Err(PyValueError::new_err(
                "the array was freed (Backend.free); it has no memory any more",
            ));
        }
        Ok(TensorRef(guard))
    }

    /// Releases the array's memory now (`Backend.free`): only when no other view, export or
    /// running call shares it, so nothing can be left pointing at freed memory.
    pub(crate) fn free(&self) -> PyResult<()> {
        let mut slot = self.slot.try_write().map_err(|_| {
            PyBufferError::new_err("the array is in use by a running call and cannot be freed")
        })?;
        let Some(tensor) = slot.as_ref() else {
            return Err(PyValueError::new_err("the array was already freed"));
        };
        let others = tensor.buffer().ref_count() - 1;
        if others > 0 {
            return Err(PyBufferError::new_err(format!(
                "cannot free: {others} other view(s) or export(s) share this array's memory; \
                 free them (or let them go) first"
            )));
        }
        if tensor.buffer().is_foreign() {
            return Err(PyBufferError::new_err(
                "cannot free memory another library owns (an imported array); drop the array \
                 and the producer releases it",
            ));
        }
        *slot = None;
        Ok(())
    }

    /// Puts `f`'s tensor in place of the array's (`share_memory_`'s copy; `None` keeps it), under
    /// the array's write lock: a running call on another thread holds the array for a moment,
    /// so the lock is tried for up to ten seconds, the GIL released between tries (a blocking
    /// wait could deadlock with a reader waiting for the GIL), then `BufferError`.
    pub(crate) fn replace(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Tensor) -> PyResult<Option<Tensor>>,
    ) -> PyResult<()> {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut slot = loop {
            match self.slot.try_write() {
                Ok(slot) => break slot,
                Err(_) if std::time::Instant::now() < until => {
                    py.detach(|| std::thread::sleep(std::time::Duration::from_millis(1)));
                }
                Err(_) => {
                    return Err(PyBufferError::new_err(
                        "the array is in use by a running call on another thread",
                    ));
                }
            }
        };
        let tensor = slot.as_ref().ok_or_else(|| {
            PyValueError::new_err("the array was freed (Backend.free); it has no memory any more")
        })?;
        if let Some(new) = f(tensor)? {
            *slot = Some(new);
        }
        Ok(())
    }
}
