//! The CUDA backend when it is not compiled in (no feature `cuda`): the same public functions and
//! types as `backend/cuda`, each answering [`Error::BackendUnavailable`] (queries answer "no
//! device"), so code that names them builds either way and never panics.

use std::sync::Arc;

use crate::backend::{Backend, KindFacts, Sharing};
use crate::buffer::{Buffer, StorageMode};
use crate::compute::kernel::{Kernel, KernelArg, LaunchConfig, LaunchTiming};
use crate::compute::{MapRequest, MatmulRequest, ReduceRequest};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::tensor::Tensor;

/// The array API standard's handle of the legacy default stream.
pub const LEGACY_STREAM: usize = 1;
/// The array API standard's handle of the per-thread default stream.
pub const PER_THREAD_STREAM: usize = 2;

// The CUDA kinds' facts hold whether or not the backend is compiled in (foreign CUDA memory is
// described by them).
#[path = "kinds.rs"]
pub(crate) mod kinds;

fn no_cuda() -> Error {
    Error::BackendUnavailable {
        backend: "CUDA",
        reason: "this build of dlbridge does not include it".into(),
    }
}

/// Whether this process can open the CUDA driver library: this build never looks (it cannot
/// use CUDA memory, so it never names a stream to a producer).
pub fn driver_library_present() -> bool {
    false
}

/// Whether a CUDA driver and at least one device are present: never, in this build.
pub fn is_available() -> bool {
    false
}

/// The number of CUDA devices.
///
/// # Errors
/// Always [`Error::BackendUnavailable`] in this build.
pub fn device_count() -> Result<usize> {
    Err(no_cuda())
}

/// The driver's CUDA version.
///
/// # Errors
/// Always [`Error::BackendUnavailable`] in this build.
pub fn driver_version() -> Result<(i32, i32)> {
    Err(no_cuda())
}

/// The name of a CUDA device.
///
/// # Errors
/// Always [`Error::BackendUnavailable`] in this build.
pub fn device_name(_ordinal: i32) -> Result<String> {
    Err(no_cuda())
}

/// `(free, total)` bytes of a CUDA device's memory.
///
/// # Errors
/// Always [`Error::BackendUnavailable`] in this build.
pub fn mem_info(_ordinal: i32) -> Result<(usize, usize)> {
    Err(no_cuda())
}

/// Waits for all work on a CUDA device.
///
/// # Errors
/// Always [`Error::BackendUnavailable`] in this build.
pub fn synchronize(_ordinal: i32) -> Result<()> {
    Err(no_cuda())
}

/// Waits until the host may touch pinned or managed memory: without a driver no device work can
/// be pending.
///
/// # Errors
/// Never in this build.
pub fn host_barrier(_device: Device) -> Result<()> {
    Ok(())
}

/// Allocates CUDA memory.
///
/// # Errors
/// Always [`Error::BackendUnavailable`] in this build.
pub fn allocate(_device: Device, _bytes: usize, _zeroed: bool) -> Result<Buffer> {
    Err(no_cuda())
}

/// The pool of a CUDA device kind.
///
/// # Errors
/// Always [`Error::BackendUnavailable`] in this build.
pub fn pool(_device: Device) -> Result<&'static Arc<Pool>> {
    Err(no_cuda())
}

/// The calling thread's current stream: the legacy default stream (`0`).
pub fn current_stream(_ordinal: i32) -> usize {
    0
}

/// Sets the calling thread's current stream: there are no streams to set, so nothing changes.
pub fn set_current_stream(_ordinal: i32, _handle: usize) -> usize {
    0
}

/// A CUDA stream; none can be made in this build.
#[derive(Debug)]
pub struct Stream {
    _none: (),
}

impl Stream {
    /// A new stream.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn new(_ordinal: i32, _non_blocking: bool) -> Result<Stream> {
        Err(no_cuda())
    }

    /// Wraps another library's stream handle.
    ///
    /// # Safety
    /// None is needed in this build (nothing is wrapped); the real backend's contract applies to
    /// callers that build either way.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub unsafe fn from_raw(_ordinal: i32, _handle: usize) -> Result<Stream> {
        Err(no_cuda())
    }

    /// The legacy default stream.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn legacy(_ordinal: i32) -> Result<Stream> {
        Err(no_cuda())
    }

    /// The raw handle.
    pub fn handle(&self) -> usize {
        0
    }

    /// The device ordinal.
    pub fn device(&self) -> i32 {
        0
    }

    /// Waits for the stream's work.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn synchronize(&self) -> Result<()> {
        Err(no_cuda())
    }

    /// Whether the stream's work is done.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn query(&self) -> Result<bool> {
        Err(no_cuda())
    }

    /// Makes the stream wait for an event.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn wait_event(&self, _event: &Event) -> Result<()> {
        Err(no_cuda())
    }
}

/// A CUDA event; none can be made in this build.
#[derive(Debug)]
pub struct Event {
    _none: (),
}

impl Event {
    /// A new event.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn new(_ordinal: i32, _timing: bool) -> Result<Event> {
        Err(no_cuda())
    }

    /// Records the event on a stream.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn record(&self, _stream: usize) -> Result<()> {
        Err(no_cuda())
    }

    /// Waits for the event.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn synchronize(&self) -> Result<()> {
        Err(no_cuda())
    }

    /// Whether the event has completed.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn query(&self) -> Result<bool> {
        Err(no_cuda())
    }

    /// Milliseconds between this event and `end`.
    ///
    /// # Errors
    /// Always [`Error::BackendUnavailable`] in this build.
    pub fn elapsed_ms(&self, _end: &Event) -> Result<f32> {
        Err(no_cuda())
    }

    /// The raw handle.
    pub fn handle(&self) -> usize {
        0
    }

    /// The device ordinal.
    pub fn device(&self) -> i32 {
        0
    }
}

/// CUDA's side of the backend seam in this build: every operation is unavailable, except those
/// that only take a producer's word (foreign pointers are held and handed on untouched).
pub(crate) struct Cuda;

impl Backend for Cuda {
    fn name(&self) -> &'static str {
        "CUDA"
    }

    fn kinds(&self) -> &'static [KindFacts] {
        kinds::KINDS
    }

    fn device_count(&self) -> Result<usize> {
        Err(no_cuda())
    }

    fn compile_kernel(&self, _: Device, _: &str, _: &str, _: &[String]) -> Result<Kernel> {
        Err(no_cuda())
    }

    fn launch_kernel(&self, _: &Kernel, _: LaunchConfig, _: &[KernelArg]) -> Result<LaunchTiming> {
        Err(no_cuda())
    }

    fn sharing(&self) -> Result<&'static dyn Sharing> {
        Err(no_cuda())
    }

    fn allocate(&self, _: Device, _: usize, _: Option<StorageMode>, _: bool) -> Result<Buffer> {
        Err(no_cuda())
    }

    fn pool(&self, _: Device, _: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
        Err(no_cuda())
    }

    fn synchronize(&self, _: Device) -> Result<()> {
        Err(no_cuda())
    }

    unsafe fn copy(&self, _: &Tensor, _: &Tensor) -> Result<()> {
        Err(no_cuda())
    }

    fn export_handoff(&self, _: Device, _: Option<i64>) -> Result<()> {
        // No work of ours can be pending on a device we never touched.
        Ok(())
    }

    fn order_after_producer(&self, _: Device, _: usize) -> Result<()> {
        Err(no_cuda())
    }

    fn map(&self, _: &MapRequest<'_>) -> Result<()> {
        Err(no_cuda())
    }

    fn reduce(&self, _: &ReduceRequest<'_>) -> Result<()> {
        Err(no_cuda())
    }

    fn matmul(&self, _: &MatmulRequest<'_>) -> Result<()> {
        Err(no_cuda())
    }
}
