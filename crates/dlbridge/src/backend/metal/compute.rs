//! Built-in kernels and run-time MSL kernels on Metal (placeholder until the Metal compute work
//! lands).

use crate::compute::kernel::{Kernel, KernelArg, LaunchConfig, LaunchTiming};
use crate::compute::{MapRequest, MatmulRequest, ReduceRequest};
use crate::device::Device;
use crate::error::{Error, Result};

fn todo() -> Error {
    Error::BackendUnavailable {
        backend: "Metal",
        reason: "compute is not built yet".into(),
    }
}

pub(crate) fn map(_req: &MapRequest<'_>) -> Result<()> {
    Err(todo())
}

pub(crate) fn reduce(_req: &ReduceRequest<'_>) -> Result<()> {
    Err(todo())
}

pub(crate) fn matmul(_req: &MatmulRequest<'_>) -> Result<()> {
    Err(todo())
}

pub(crate) fn compile(
    _device: Device,
    _source: &str,
    _name: &str,
    _options: &[String],
) -> Result<Kernel> {
    Err(todo())
}

pub(crate) fn launch(
    _kernel: &Kernel,
    _config: LaunchConfig,
    _args: &[KernelArg],
) -> Result<LaunchTiming> {
    Err(todo())
}
