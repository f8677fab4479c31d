//! NCCL point-to-point transfers of arrays (`dlbridge::backend::cuda::nccl`), for
//! `dlbridge.ray`'s transport between GPUs and hosts: `_dlbridge.NcclCommunicator` and the
//! natives around it. The rules live in the core; this module turns Python objects into its calls.

use dlbridge::Tensor;
use dlbridge::backend::cuda::nccl::{self, Communicator, UNIQUE_ID_BYTES};
use dlbridge::share::runs::{RunPlan, RunView};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::array::PyArray;
use crate::device::PyDevice;
use crate::errors::IntoPyResult;
use crate::share;

/// One array of a transfer, as Python carries it: (run index or -1 for an array of no bytes,
/// dtype name, shape, strides in elements, byte offset from the run's start, read-only).
type ViewTuple = share::ViewTuple<isize>;

/// A run of a transfer, as Python carries it: (length in bytes, address phase).
type RunTuple = (usize, usize);

/// One rank of an NCCL communicator on one CUDA device (see `dlbridge.ray`). Joining waits until
/// every rank has joined, or fails after `timeout` seconds (NCCL 2.14 and later).
#[pyclass(frozen, module = "dlbridge._dlbridge", name = "NcclCommunicator")]
pub(crate) struct PyCommunicator {
    inner: Communicator,
}

#[pymethods]
impl PyCommunicator {
    #[new]
    #[pyo3(signature = (unique_id, size, rank, device, timeout=None))]
    fn new(
        py: Python<'_>,
        unique_id: &[u8],
        size: usize,
        rank: usize,
        device: u32,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let id: [u8; UNIQUE_ID_BYTES] = unique_id.try_into().map_err(|_| {
            PyValueError::new_err(format!(
                "an NCCL unique id is {UNIQUE_ID_BYTES} bytes, not {}",
                unique_id.len()
            ))
        })?;
        let ordinal = i32::try_from(device).map_err(|_| PyValueError::new_err("device"))?;
        let timeout = share::timeout_of(timeout)?;
        let inner = py
            .detach(|| Communicator::join(&id, size, rank, ordinal, timeout))
            .py()?;
        Ok(PyCommunicator { inner })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    #[getter]
    fn device(&self) -> PyDevice {
        PyDevice(self.inner.device())
    }

    #[getter]
    fn aborted(&self) -> bool {
        self.inner.is_aborted()
    }

    /// The runs and views `send` would send these arrays as (what the receiver is told).
    fn plan(
        &self,
        py: Python<'_>,
        arrays: Vec<PyRef<'_, PyArray>>,
    ) -> PyResult<(Vec<RunTuple>, Vec<ViewTuple>)> {
        let tensors = share::tensors_of(&arrays)?;
        let plan = py.detach(|| self.inner.plan(&tensors)).py()?;
        Ok(plan_tuples(&plan))
    }

    /// Sends the arrays to rank `peer` and waits until they are sent. `runs`, when given, is the
    /// plan the receiver was told: the arrays must still have it.
    #[pyo3(signature = (arrays, peer, runs=None, timeout=None))]
    fn send(
        &self,
        py: Python<'_>,
        arrays: Vec<PyRef<'_, PyArray>>,
        peer: usize,
        runs: Option<Vec<RunTuple>>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let tensors = share::tensors_of(&arrays)?;
        let timeout = share::timeout_of(timeout)?;
        py.detach(|| self.inner.send(&tensors, peer, runs.as_deref(), timeout))
            .py()?;
        Ok(())
    }

    /// Receives the arrays rank `peer` sends with the plan `runs`/`views`, into one new block of
    /// this device, and waits until they are here.
    #[pyo3(signature = (runs, views, peer, timeout=None))]
    fn recv(
        &self,
        py: Python<'_>,
        runs: Vec<RunTuple>,
        views: Vec<ViewTuple>,
        peer: usize,
        timeout: Option<f64>,
    ) -> PyResult<Vec<PyArray>> {
        let views = views
            .iter()
            .map(|v| {
                let (dtype, layout) = share::view_of(v)?;
                Ok(RunView {
                    run: usize::try_from(v.0).ok(),
                    dtype,
                    layout,
                    read_only: v.5,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let timeout = share::timeout_of(timeout)?;
        let tensors = py
            .detach(|| self.inner.recv(&runs, &views, peer, timeout))
            .py()?;
        Ok(tensors.into_iter().map(PyArray::new).collect())
    }

    /// Makes the transfer waiting now (or the next one) give up and abort the communicator (for
    /// a caller that knows the peer will not take part).
    fn interrupt(&self) {
        self.inner.interrupt();
    }

    fn __repr__(&self) -> String {
        format!(
            "NcclCommunicator(rank={}, size={}, device={})",
            self.inner.rank(),
            self.inner.size(),
            self.inner.device()
        )
    }
}

fn plan_tuples(plan: &RunPlan) -> (Vec<RunTuple>, Vec<ViewTuple>) {
    let runs = plan.runs.iter().map(|r| (r.len, r.phase())).collect();
    let views = plan
        .views
        .iter()
        .map(|v| {
            share::view_tuple(
                v.run.map_or(-1, |r| r as isize),
                v.dtype,
                &v.layout,
                v.read_only,
            )
        })
        .collect();
    (runs, views)
}

/// The runs and views CUDA device arrays travel as over NCCL (`NcclCommunicator.plan` without a
/// communicator): arrays of one driver allocation merge into few runs.
#[pyfunction]
fn _nccl_plan(
    py: Python<'_>,
    arrays: Vec<PyRef<'_, PyArray>>,
) -> PyResult<(Vec<RunTuple>, Vec<ViewTuple>)> {
    let tensors = share::tensors_of(&arrays)?;
    if let Some(t) = tensors
        .iter()
        .find(|t| t.device().kind() != dlbridge::DeviceKind::Cuda)
    {
        return Err(PyValueError::new_err(format!(
            "NCCL sends CUDA device memory, not an array on {}",
            t.device()
        )));
    }
    let plan = py.detach(|| nccl::plan(&tensors)).py()?;
    Ok(plan_tuples(&plan))
}

/// The arrays `views` describe over `block`, a compact byte array standing for the one run of a
/// transfer (each view's byte offset counted from the block's first byte, its run index 0, or -1
/// for an array of no elements): what `recv(runs=[(len(block), 0)], views)` hands the receiver,
/// for the sender that packs its arrays into the block before one `send([block])`. Each view is
/// checked to lie inside the block; read-only where the block or the view is.
#[pyfunction]
fn _nccl_views(block: PyRef<'_, PyArray>, views: Vec<ViewTuple>) -> PyResult<Vec<PyArray>> {
    let block = block.tensor()?;
    if block.dtype() != dlbridge::DType::U8 || !block.is_contiguous() {
        return Err(PyValueError::new_err(format!(
            "the block of a transfer is a compact uint8 array, not a {} array of strides {:?}",
            block.dtype(),
            block.layout().strides()
        )));
    }
    let start = block.byte_offset();
    let end = start + block.nbytes();
    views
        .iter()
        .map(|v| {
            if v.0 != 0 && v.0 != -1 {
                return Err(PyValueError::new_err(format!(
                    "a view of a transfer's one run names run {}",
                    v.0
                )));
            }
            let (dtype, layout) = share::view_of(v)?;
            let at = start.checked_add(layout.byte_offset()).ok_or_else(|| {
                PyValueError::new_err("a view's byte offset is past the end of the block")
            })?;
            let t = Tensor::new(block.buffer().clone(), dtype, layout.with_byte_offset(at)).py()?;
            let bytes = t.byte_range();
            if !bytes.is_empty() && (bytes.start < start || bytes.end > end) {
                return Err(PyValueError::new_err(format!(
                    "a view of bytes {}..{} reaches outside the block's {} bytes",
                    bytes.start - start.min(bytes.start),
                    bytes.end - start.min(bytes.end),
                    end - start
                )));
            }
            Ok(PyArray::new(if v.5 || block.is_read_only() {
                t.into_read_only()
            } else {
                t
            }))
        })
        .collect()
}

/// A new NCCL unique id (the bootstrap address rank 0 serves while the ranks join).
#[pyfunction]
fn _nccl_unique_id(py: Python<'_>) -> PyResult<Bound<'_, PyBytes>> {
    let id = py.detach(nccl::unique_id).py()?;
    Ok(PyBytes::new(py, &id))
}

/// Adds a path to try for `libnccl` before its name.
#[pyfunction]
fn _nccl_add_library_path(path: std::path::PathBuf) {
    nccl::add_library_path(path);
}

/// NCCL's version `(major, minor, patch)`; raises where NCCL cannot be loaded.
#[pyfunction]
fn _nccl_version() -> PyResult<(u32, u32, u32)> {
    nccl::version().py()
}

/// Registers the natives.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCommunicator>()?;
    m.add_function(wrap_pyfunction!(_nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(_nccl_plan, m)?)?;
    m.add_function(wrap_pyfunction!(_nccl_views, m)?)?;
    m.add_function(wrap_pyfunction!(_nccl_add_library_path, m)?)?;
    m.add_function(wrap_pyfunction!(_nccl_version, m)?)?;
    Ok(())
}
