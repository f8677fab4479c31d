//! [`Backend`]: one device's compute backend, the Rust face of `dlbridge.Backend`.

use std::fmt;

use crate::backend;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::pool::MemoryStats;
use crate::tensor::Tensor;

use super::kernel::{self, Kernel, KernelArg, LaunchConfig, LaunchTiming};

/// The kinds of backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendType {
    /// The host.
    Cpu,
    /// An NVIDIA GPU.
    Cuda,
    /// An Apple GPU.
    Metal,
}

/// One device's compute backend: allocation from the caching pool, copies in and out,
/// synchronization, memory figures, and run-time kernels. The built-in kernels are the free
/// functions of [`crate::compute`], which run wherever their operands live.
///
/// ```
/// use dlbridge::compute::Backend;
/// use dlbridge::{DType, Tensor};
///
/// let be = Backend::new("cpu".parse()?)?;
/// let host = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
/// let a = be.copy_to_device(&host)?;
/// let doubled = dlbridge::compute::binary(dlbridge::compute::BinaryOp::Add, &a, &a)?;
/// assert_eq!(be.copy_to_host(&doubled)?.to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
/// assert_eq!(be.allocate_zeros(&[2], DType::I32)?.to_vec::<i32>()?, vec![0, 0]);
/// # Ok::<(), dlbridge::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Backend {
    device: Device,
}

impl Backend {
    /// The backend of `device` (`cpu`, `cuda:N`, `metal:N`).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the backend cannot run here or the device does not
    /// exist; [`Error::InvalidArgument`] for other device kinds.
    pub fn new(device: Device) -> Result<Backend> {
        if !backend::is_primary(device.kind()) {
            return Err(Error::InvalidArgument(format!(
                "a Backend runs on 'cpu', 'cuda[:N]' or 'metal[:N]', not '{device}'"
            )));
        }
        let count = backend::device_count(device.kind())?;
        if device.index() as usize >= count {
            return Err(Error::BackendUnavailable {
                backend: backend::name_of(device.kind()).unwrap_or("no"),
                reason: format!("{device} does not exist ({count} devices found)"),
            });
        }
        Ok(Backend { device })
    }

    /// The best backend available: CUDA device 0, else Metal device 0, else the CPU.
    pub fn best() -> Backend {
        [Device::cuda(0), Device::metal(0)]
            .into_iter()
            .find_map(|d| Backend::new(d).ok())
            .unwrap_or(Backend {
                device: Device::CPU,
            })
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The device's index.
    pub fn device_id(&self) -> u32 {
        self.device.index()
    }

    /// Which kind of backend this is.
    pub fn backend_type(&self) -> BackendType {
        match backend::name_of(self.device.kind()) {
            Some("CUDA") => BackendType::Cuda,
            Some("Metal") => BackendType::Metal,
            _ => BackendType::Cpu,
        }
    }

    /// How many devices of this backend's kind exist (1 for the CPU).
    pub fn device_count(&self) -> usize {
        backend::device_count(self.device.kind()).unwrap_or(0)
    }

    /// Whether the device is usable.
    pub fn is_available(&self) -> bool {
        (self.device_id() as usize) < self.device_count()
    }

    /// An uninitialised compact tensor on the device, from the caching pool.
    pub fn allocate(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::empty(shape, dtype, self.device)
    }

    /// A zero-filled compact tensor on the device.
    pub fn allocate_zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::zeros(shape, dtype, self.device)
    }

    /// Returns `tensor`'s memory to the pool now. In Rust ownership makes this `drop`; it is here
    /// so that a caller can say so, and it refuses when other views still share the memory
    /// (they would keep it alive anyway).
    ///
    /// # Errors
    /// [`Error::Aliased`] when other handles share the buffer (the tensor is dropped either way).
    pub fn free(&self, tensor: Tensor) -> Result<()> {
        let count = tensor.buffer().ref_count();
        drop(tensor);
        if count > 1 {
            return Err(Error::Aliased { count: count - 1 });
        }
        Ok(())
    }

    /// A compact copy of `tensor` (any device) in new memory on this device.
    pub fn copy_to_device(&self, tensor: &Tensor) -> Result<Tensor> {
        tensor.copy_to(self.device)
    }

    /// A compact copy of `tensor` in new host memory.
    pub fn copy_to_host(&self, tensor: &Tensor) -> Result<Tensor> {
        tensor.copy_to(Device::CPU)
    }

    /// Waits for the work dlbridge enqueued on the device.
    pub fn synchronize(&self) -> Result<()> {
        backend::synchronize(self.device)
    }

    /// The caching pool's figures.
    pub fn memory_info(&self) -> Result<MemoryStats> {
        backend::memory_stats(self.device)
    }

    /// Returns every cached block of the device's pool to the driver.
    pub fn clear_cache(&self) -> Result<()> {
        backend::empty_cache(self.device)
    }

    /// Compiles a run-time kernel for the device ([`kernel::compile`]).
    pub fn compile_kernel(&self, source: &str, name: &str, options: &[String]) -> Result<Kernel> {
        kernel::compile(self.device, source, name, options)
    }

    /// Launches a compiled kernel and waits for it ([`kernel::launch`]).
    pub fn execute_kernel(
        &self,
        kernel: &Kernel,
        config: LaunchConfig,
        args: &[KernelArg],
    ) -> Result<LaunchTiming> {
        if kernel.device() != self.device {
            return Err(Error::InvalidArgument(format!(
                "the kernel was compiled for {}, this backend is {}",
                kernel.device(),
                self.device
            )));
        }
        kernel::launch(kernel, config, args)
    }
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Backend({})", self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceKind;

    #[test]
    fn cpu_backend_round_trip_and_free() {
        let be = Backend::new(Device::CPU).unwrap();
        assert_eq!(be.backend_type(), BackendType::Cpu);
        assert!(be.is_available() && be.device_count() == 1);
        let a = be.allocate(&[4], DType::F32).unwrap();
        let view = a.clone();
        assert!(matches!(be.free(a), Err(Error::Aliased { count: 1 })));
        be.free(view).unwrap();
        be.synchronize().unwrap();
        assert!(be.memory_info().is_ok());
    }

    #[test]
    fn unknown_devices_are_refused() {
        assert!(Backend::new(Device::new(DeviceKind::Other(7), 0)).is_err());
        assert!(
            matches!(
                Backend::new(Device::metal(0)),
                Err(Error::BackendUnavailable { .. })
            ) || cfg!(metal)
        );
        assert_eq!(
            Backend::best().device().kind() == DeviceKind::Cpu,
            Backend::best().backend_type() == BackendType::Cpu
        );
    }
}
