//! CPU kernels (placeholder until the CPU compute work lands).

use crate::compute::{MapRequest, MatmulRequest, ReduceRequest};
use crate::error::{Error, Result};

fn todo() -> Error {
    Error::BackendUnavailable {
        backend: "CPU compute",
        reason: "not built yet".into(),
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
