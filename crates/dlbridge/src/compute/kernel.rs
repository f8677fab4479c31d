//! User kernels compiled at run time: CUDA C through NVRTC on CUDA devices, MSL on Metal.
//!
//! [`compile`] caches by (device, source, entry name, options): compiling the same kernel twice
//! returns the cached module. [`launch`] enqueues on the calling thread's current stream (CUDA)
//! or dlbridge's queue (Metal), timed by device events, and waits for the kernel to finish so
//! the time can be reported.
//!
//! Scalar arguments are matched to the kernel's parameters by size where the driver reports
//! them (CUDA's `cuFuncGetParamInfo`): a [`KernelArg::Int`] fills a 4-byte parameter as `int32`
//! and an 8-byte one as `int64`; a [`KernelArg::Float`] a 4-byte one as `float` and an 8-byte one
//! as `double`. [`KernelArg::Typed`] passes exactly its dtype's bytes. A tensor argument passes
//! the address of its first element (its base pointer plus its byte offset).

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::backend;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A kernel compiled for one device.
#[derive(Clone)]
// Only the CUDA and Metal backends make kernels; a build with neither still has the type.
#[cfg_attr(not(any(cuda, metal)), allow(dead_code))]
pub struct Kernel {
    device: Device,
    name: String,
    params: Option<Vec<usize>>,
    inner: Arc<dyn Any + Send + Sync>,
}

#[cfg_attr(not(any(cuda, metal)), allow(dead_code))]
impl Kernel {
    /// Made by a backend: `params` are the sizes in bytes of the entry's parameters where the
    /// backend can tell them.
    pub(crate) fn new(
        device: Device,
        name: String,
        params: Option<Vec<usize>>,
        inner: Arc<dyn Any + Send + Sync>,
    ) -> Kernel {
        Kernel {
            device,
            name,
            params,
            inner,
        }
    }

    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The entry point's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The byte size of each parameter, when the backend can tell.
    pub fn param_sizes(&self) -> Option<&[usize]> {
        self.params.as_deref()
    }

    /// The backend's own state, for the backend that made it.
    pub(crate) fn inner<T: Any>(&self) -> Option<&T> {
        self.inner.downcast_ref()
    }
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernel")
            .field("device", &self.device)
            .field("name", &self.name)
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

/// One argument of a launch.
#[derive(Clone, Debug)]
pub enum KernelArg {
    /// An array on the kernel's device: passed as the address of its first element.
    Tensor(Tensor),
    /// An integer, sized to its parameter (4 bytes: `int32`, range-checked; 8 bytes: `int64`).
    Int(i64),
    /// A float, sized to its parameter (4 bytes: `float`; 8 bytes: `double`).
    Float(f64),
    /// A value of an exact dtype (its little-endian bytes, the first `dtype.itemsize()` used).
    Typed {
        /// The value's type.
        dtype: DType,
        /// The value's bytes, little-endian, zero-padded to 8.
        bytes: [u8; 8],
    },
}

impl KernelArg {
    /// The bytes this argument passes to a parameter of `size` bytes (`None` for tensors).
    pub fn scalar_bytes(&self, index: usize, size: Option<usize>) -> Result<Option<Vec<u8>>> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("argument {index}: {what}")));
        match (self, size) {
            (KernelArg::Tensor(_), _) => Ok(None),
            (KernelArg::Int(v), Some(4) | None) => match i32::try_from(*v) {
                Ok(v) => Ok(Some(v.to_le_bytes().to_vec())),
                Err(_) if size.is_some() => bad(format!(
                    "{v} does not fit the kernel's 4-byte integer parameter"
                )),
                Err(_) => Ok(Some(v.to_le_bytes().to_vec())),
            },
            (KernelArg::Int(v), Some(8)) => Ok(Some(v.to_le_bytes().to_vec())),
            (KernelArg::Float(v), Some(4) | None) => Ok(Some((*v as f32).to_le_bytes().to_vec())),
            (KernelArg::Float(v), Some(8)) => Ok(Some(v.to_le_bytes().to_vec())),
            (KernelArg::Typed { dtype, bytes }, size) => {
                let n = dtype.itemsize();
                if size.is_some_and(|s| s != n) {
                    return bad(format!(
                        "a {dtype} value ({n} bytes) for a parameter of {} bytes",
                        size.unwrap_or(0)
                    ));
                }
                Ok(Some(bytes[..n.min(8)].to_vec()))
            }
            (_, Some(s)) => bad(format!("a scalar for a parameter of {s} bytes")),
        }
    }
}

/// Grid and block dimensions of a launch, and the dynamic shared memory per block in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks (CUDA) or threadgroups (Metal) per axis.
    pub grid: [u32; 3],
    /// Threads per block per axis.
    pub block: [u32; 3],
    /// Dynamic shared (threadgroup) memory per block, in bytes.
    pub shared_mem: u32,
}

impl LaunchConfig {
    /// Refuses empty grids and blocks.
    pub fn validate(&self) -> Result<()> {
        if self.grid.contains(&0) || self.block.contains(&0) {
            return Err(Error::InvalidArgument(format!(
                "grid {:?} and block {:?} must have no zero dimension",
                self.grid, self.block
            )));
        }
        Ok(())
    }
}

/// What a finished launch reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LaunchTiming {
    /// The kernel's execution time in milliseconds, measured by device events (CUDA) or the
    /// command buffer's GPU timestamps (Metal).
    pub elapsed_ms: f64,
}

/// Compiles `source` for `device` and returns its entry point `name` (cached by device, source,
/// name and options). CUDA: CUDA C for NVRTC (the entry may be `extern "C"` or C++-mangled;
/// `options` are NVRTC options, the target architecture is added unless given). Metal: MSL.
///
/// # Errors
/// [`Error::Compile`] with the compiler's log; [`Error::InvalidArgument`] when the entry point is
/// not in the program; [`Error::UnsupportedDevice`] on the CPU (CPU kernels are Python
/// callables in the Python API).
pub fn compile(device: Device, source: &str, name: &str, options: &[String]) -> Result<Kernel> {
    if name.is_empty() {
        return Err(Error::InvalidArgument(
            "a kernel needs an entry-point name".into(),
        ));
    }
    backend::compile_kernel(device, source, name, options)
}

/// Launches `kernel` with `config` and `args` and waits for it, returning its device time.
///
/// # Errors
/// [`Error::InvalidArgument`] for an empty grid, a wrong argument count, or an array on
/// another device; [`Error::Driver`] when the launch or the kernel fails (the message says when
/// the failure is one the driver keeps for the rest of the process).
pub fn launch(kernel: &Kernel, config: LaunchConfig, args: &[KernelArg]) -> Result<LaunchTiming> {
    config.validate()?;
    if let Some(params) = kernel.param_sizes()
        && params.len() != args.len()
    {
        return Err(Error::InvalidArgument(format!(
            "kernel `{}` takes {} arguments, {} were given",
            kernel.name(),
            params.len(),
            args.len()
        )));
    }
    for (i, arg) in args.iter().enumerate() {
        if let KernelArg::Tensor(t) = arg
            && !reachable(t.device(), kernel.device())
        {
            return Err(Error::InvalidArgument(format!(
                "argument {i} is on {}, the kernel runs on {}",
                t.device(),
                kernel.device()
            )));
        }
    }
    backend::launch_kernel(kernel, config, args)
}

/// Whether a kernel on `kernel` can address memory of `memory`: the same device, or memory of
/// another kind of the same backend and device index that places a storage mode there (on CUDA:
/// pinned or managed memory, by unified addressing).
fn reachable(memory: Device, kernel: Device) -> bool {
    let placed = |d: Device| backend::facts(d.kind()).and_then(|f| f.storage.placement());
    memory == kernel
        || (memory.index() == kernel.index()
            && placed(memory).is_some()
            && placed(memory) == placed(kernel))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_and_managed_memory_reach_cuda_kernels() {
        assert!(reachable(Device::cuda_managed(0), Device::cuda(0)));
        assert!(reachable(Device::cuda_host(1), Device::cuda(1)));
        assert!(!reachable(Device::cuda(1), Device::cuda(0)));
        assert!(!reachable(Device::CPU, Device::cuda(0)));
    }

    #[test]
    fn scalars_take_their_parameter_size() {
        let int = KernelArg::Int(-3);
        assert_eq!(
            int.scalar_bytes(0, Some(4)).unwrap().unwrap(),
            (-3i32).to_le_bytes()
        );
        assert_eq!(
            int.scalar_bytes(0, Some(8)).unwrap().unwrap(),
            (-3i64).to_le_bytes()
        );
        let big = KernelArg::Int(1 << 40);
        assert!(
            big.scalar_bytes(2, Some(4))
                .unwrap_err()
                .to_string()
                .contains("argument 2")
        );
        let float = KernelArg::Float(1.5);
        assert_eq!(
            float.scalar_bytes(0, Some(4)).unwrap().unwrap(),
            1.5f32.to_le_bytes()
        );
        assert_eq!(
            float.scalar_bytes(0, Some(8)).unwrap().unwrap(),
            1.5f64.to_le_bytes()
        );
        assert!(float.scalar_bytes(0, Some(2)).is_err());
        let typed = KernelArg::Typed {
            dtype: DType::U16,
            bytes: [7, 1, 0, 0, 0, 0, 0, 0],
        };
        assert_eq!(typed.scalar_bytes(0, Some(2)).unwrap().unwrap(), vec![7, 1]);
        assert!(typed.scalar_bytes(0, Some(4)).is_err());
    }

    #[test]
    fn empty_grids_are_refused() {
        let ok = LaunchConfig {
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_mem: 0,
        };
        assert!(ok.validate().is_ok());
        let zero = LaunchConfig {
            grid: [0, 1, 1],
            ..ok
        };
        assert!(matches!(zero.validate(), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn cpu_kernels_do_not_compile() {
        let err = compile(Device::CPU, "", "k", &[]).unwrap_err();
        assert!(matches!(err, Error::UnsupportedDevice(_)), "{err}");
    }
}
