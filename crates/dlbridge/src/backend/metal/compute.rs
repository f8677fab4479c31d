//! Built-in kernels and run-time MSL kernels on Metal.
//!
//! | request | kernel | where decided |
//! | --- | --- | --- |
//! | [`MapRequest`] | one MSL kernel per (op, dtypes, scalar positions, flat / strided 32- or 64-bit indices); flat when every operand is compact | [`dispatch::plan_map`], source [`msl::map_source`] |
//! | [`ReduceRequest`] | a thread per output (short or strided reductions with many outputs), a threadgroup per output (`simd_sum` / `simd_max` / ... then threadgroup memory), or two passes through partial results when few outputs reduce many elements | [`dispatch::plan_reduce`], [`msl::reduce_source`] |
//! | [`MatmulRequest`] | a tiled kernel: 64 × 64 output tiles, 16 × 16 threads, 16-deep slices of both operands in threadgroup memory, `float` accumulation | [`dispatch::plan_matmul`], [`msl::matmul_source`] |
//! | user kernels | MSL compiled with `newLibraryWithSource:options:error:`; options in [`options`] | [`compile`], [`launch`] |
//!
//! The built-in kernels are compiled from source the first time a device needs a variant (fast
//! math off) and cached as compute pipelines for the life of the process. Their work is encoded
//! into dlbridge's queue, batched like copies, and this returns without waiting; read results
//! through [`super::copy_to`] or after [`super::synchronize`].
//!
//! Metal GPUs have no `float64`: requests in it fail with [`Error::UnsupportedDType`] naming it
//! (so do the front's `float64` results: integer division, integer means, transcendental
//! functions of 32- and 64-bit integers). 16-bit floats are computed in `float`; integer
//! arithmetic wraps; `max` / `min` propagate NaN; an empty `sum` is 0 and an empty `mean` NaN.
//! Views with more than [`dispatch::MAX_DIMS`] axes that do not merge, or whose first element is
//! not aligned to its element size, are first copied to compact memory on the GPU.
//!
//! User kernels: [`launch`] binds argument `i` at buffer index `i` — a tensor as its
//! `id<MTLBuffer>` at its byte offset, a scalar with `setBytes` (Metal reports no parameter
//! sizes without reflection, so [`KernelArg::Int`] passes an `int` (a `long` when the value needs
//! 64 bits), [`KernelArg::Float`] a `float`, [`KernelArg::Typed`] its dtype's bytes) — with
//! `shared_mem` bytes of threadgroup memory at index 0. It waits for the kernel and reports the
//! command buffer's GPU time.
//!
//! Off Apple platforms, or without feature `metal`, every function answers
//! [`Error::BackendUnavailable`].

#![cfg_attr(not(metal), allow(dead_code))]

pub(crate) mod dispatch;
pub(crate) mod msl;
pub(crate) mod options;

use crate::compute::kernel::{Kernel, KernelArg, LaunchConfig, LaunchTiming};
use crate::compute::{MapRequest, MatmulRequest, ReduceRequest};
use crate::device::Device;
#[cfg(not(metal))]
use crate::error::Error;
use crate::error::Result;

#[cfg(metal)]
use super::runtime::compute as imp;

#[cfg(not(metal))]
mod imp {
    use super::*;

    fn unavailable() -> Error {
        super::super::unavailable::no_device()
    }

    pub(super) fn map(_: &MapRequest<'_>) -> Result<()> {
        Err(unavailable())
    }

    pub(super) fn reduce(_: &ReduceRequest<'_>) -> Result<()> {
        Err(unavailable())
    }

    pub(super) fn matmul(_: &MatmulRequest<'_>) -> Result<()> {
        Err(unavailable())
    }

    pub(super) fn compile(_: Device, _: &str, _: &str, _: &[String]) -> Result<Kernel> {
        Err(unavailable())
    }

    pub(super) fn launch(_: &Kernel, _: LaunchConfig, _: &[KernelArg]) -> Result<LaunchTiming> {
        Err(unavailable())
    }
}

/// Runs an element-wise request (encoded, not waited for).
pub(crate) fn map(req: &MapRequest<'_>) -> Result<()> {
    imp::map(req)
}

/// Runs a reduction request (encoded, not waited for).
pub(crate) fn reduce(req: &ReduceRequest<'_>) -> Result<()> {
    imp::reduce(req)
}

/// Runs a batched matrix product (encoded, not waited for).
pub(crate) fn matmul(req: &MatmulRequest<'_>) -> Result<()> {
    imp::matmul(req)
}

/// Compiles MSL `source` for `device` and returns its kernel function `name`, cached by
/// (device, source, name, options); `options` as in [`options`].
pub(crate) fn compile(
    device: Device,
    source: &str,
    name: &str,
    options: &[String],
) -> Result<Kernel> {
    imp::compile(device, source, name, options)
}

/// Launches a compiled MSL kernel, waits for it, and reports its GPU time.
pub(crate) fn launch(
    kernel: &Kernel,
    config: LaunchConfig,
    args: &[KernelArg],
) -> Result<LaunchTiming> {
    imp::launch(kernel, config, args)
}

#[cfg(all(test, not(metal)))]
mod tests {
    use super::*;
    use crate::compute::{self, kernel};
    use crate::error::Error;

    #[test]
    fn compiled_out_answers_unavailable() {
        let err = kernel::compile(Device::metal(0), "kernel void k() {}", "k", &[]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::BackendUnavailable {
                    backend: "Metal",
                    ..
                }
            ),
            "{err}"
        );
        // The front cannot make a Metal tensor here, so the requests are reached directly.
        let t = crate::tensor::Tensor::zeros(&[2], crate::dtype::DType::F32, Device::CPU).unwrap();
        let req = compute::MapRequest {
            op: compute::MapOp::Unary(compute::UnaryOp::Abs),
            inputs: vec![compute::Operand::Tensor(&t)],
            out: &t,
            plan: compute::MapPlan::new(&[2], &[&[1], &[1]]),
        };
        assert!(matches!(map(&req), Err(Error::BackendUnavailable { .. })));
    }
}
