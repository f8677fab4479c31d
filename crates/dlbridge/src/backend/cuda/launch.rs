//! Run-time user kernels on CUDA (placeholder until the NVRTC work lands).

use crate::compute::kernel::{Kernel, KernelArg, LaunchConfig, LaunchTiming};
use crate::device::Device;
use crate::error::{Error, Result};

fn todo() -> Error {
    Error::BackendUnavailable {
        backend: "CUDA kernels",
        reason: "not built yet".into(),
    }
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
