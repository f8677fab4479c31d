//! Devices: where memory lives.

use std::fmt;
use std::str::FromStr;

use crate::dlpack::ffi::{self, DLDevice};
use crate::error::{Error, Result};

/// The kind of memory a [`Device`] names, one per DLPack device type dlbridge gives meaning to.
/// Every other DLPack device is kept as [`DeviceKind::Other`], so a foreign tensor on it can still
/// be held and handed on untouched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// Host memory (`kDLCPU`).
    Cpu,
    /// CUDA device memory (`kDLCUDA`).
    Cuda,
    /// Pinned host memory mapped for a CUDA device (`kDLCUDAHost`).
    CudaHost,
    /// CUDA managed memory (`kDLCUDAManaged`).
    CudaManaged,
    /// A Metal buffer (`kDLMetal`); the DLPack `data` is an `id<MTLBuffer>`.
    Metal,
    /// Any other DLPack device type, by its raw value.
    Other(i32),
}

impl DeviceKind {
    /// The DLPack `DLDeviceType` value.
    pub const fn to_raw(self) -> i32 {
        match self {
            DeviceKind::Cpu => ffi::K_DL_CPU,
            DeviceKind::Cuda => ffi::K_DL_CUDA,
            DeviceKind::CudaHost => ffi::K_DL_CUDA_HOST,
            DeviceKind::CudaManaged => ffi::K_DL_CUDA_MANAGED,
            DeviceKind::Metal => ffi::K_DL_METAL,
            DeviceKind::Other(raw) => raw,
        }
    }

    /// The kind for a raw DLPack device type.
    pub const fn from_raw(raw: i32) -> Self {
        match raw {
            ffi::K_DL_CPU => DeviceKind::Cpu,
            ffi::K_DL_CUDA => DeviceKind::Cuda,
            ffi::K_DL_CUDA_HOST => DeviceKind::CudaHost,
            ffi::K_DL_CUDA_MANAGED => DeviceKind::CudaManaged,
            ffi::K_DL_METAL => DeviceKind::Metal,
            other => DeviceKind::Other(other),
        }
    }

    /// The name used in device strings (`cpu`, `cuda`, `cuda_host`, `cuda_managed`, `metal`).
    pub fn name(self) -> String {
        match self {
            DeviceKind::Cpu => "cpu".into(),
            DeviceKind::Cuda => "cuda".into(),
            DeviceKind::CudaHost => "cuda_host".into(),
            DeviceKind::CudaManaged => "cuda_managed".into(),
            DeviceKind::Metal => "metal".into(),
            DeviceKind::Other(raw) => other_name(raw),
        }
    }

    /// Whether the DLPack `data` of this kind is an address in which byte arithmetic is meaningful
    /// (host and CUDA pointers), as opposed to an opaque handle (`id<MTLBuffer>`, `cl_mem`,
    /// Vulkan and WebGPU buffers, or any device dlbridge does not know), which must be handed on
    /// unchanged with the offset kept in `byte_offset`.
    pub const fn is_addressable(self) -> bool {
        matches!(
            self,
            DeviceKind::Cpu | DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged
        )
    }

    /// Whether this is CUDA memory of any kind: device, pinned host or managed.
    pub const fn is_cuda(self) -> bool {
        matches!(
            self,
            DeviceKind::Cuda | DeviceKind::CudaHost | DeviceKind::CudaManaged
        )
    }

    /// Whether host code may read and write memory of this kind through its address (CUDA managed
    /// and pinned memory after synchronization). Metal shared buffers are host-accessible through
    /// `contents()`, which is a property of the buffer, not of the device kind.
    pub const fn is_host_accessible(self) -> bool {
        matches!(
            self,
            DeviceKind::Cpu | DeviceKind::CudaHost | DeviceKind::CudaManaged
        )
    }
}

fn other_name(raw: i32) -> String {
    match raw {
        ffi::K_DL_OPENCL => "opencl".into(),
        ffi::K_DL_VULKAN => "vulkan".into(),
        ffi::K_DL_VPI => "vpi".into(),
        ffi::K_DL_ROCM => "rocm".into(),
        ffi::K_DL_ROCM_HOST => "rocm_host".into(),
        ffi::K_DL_EXT_DEV => "ext_dev".into(),
        ffi::K_DL_ONE_API => "oneapi".into(),
        ffi::K_DL_WEBGPU => "webgpu".into(),
        ffi::K_DL_HEXAGON => "hexagon".into(),
        ffi::K_DL_MAIA => "maia".into(),
        ffi::K_DL_TRN => "trn".into(),
        _ => format!("dlpack_device_{raw}"),
    }
}

/// A device: a [`DeviceKind`] and an index.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device {
    kind: DeviceKind,
    index: u32,
}

impl Device {
    /// The host.
    pub const CPU: Device = Device {
        kind: DeviceKind::Cpu,
        index: 0,
    };

    /// A device of `kind` with ordinal `index`.
    pub const fn new(kind: DeviceKind, index: u32) -> Self {
        Device { kind, index }
    }

    /// CUDA device `index`.
    pub const fn cuda(index: u32) -> Self {
        Device::new(DeviceKind::Cuda, index)
    }

    /// Pinned host memory mapped for CUDA device `index`.
    pub const fn cuda_host(index: u32) -> Self {
        Device::new(DeviceKind::CudaHost, index)
    }

    /// CUDA managed memory of device `index`.
    pub const fn cuda_managed(index: u32) -> Self {
        Device::new(DeviceKind::CudaManaged, index)
    }

    /// Metal device `index`.
    pub const fn metal(index: u32) -> Self {
        Device::new(DeviceKind::Metal, index)
    }

    /// The kind.
    pub const fn kind(self) -> DeviceKind {
        self.kind
    }

    /// The ordinal.
    pub const fn index(self) -> u32 {
        self.index
    }

    /// Whether this is the host.
    pub const fn is_cpu(self) -> bool {
        matches!(self.kind, DeviceKind::Cpu)
    }

    /// The DLPack descriptor.
    pub const fn to_dlpack(self) -> DLDevice {
        DLDevice {
            device_type: self.kind.to_raw(),
            device_id: self.index as i32,
        }
    }

    /// Reads a DLPack descriptor from a foreign tensor. A negative index is malformed.
    pub fn from_dlpack(raw: DLDevice) -> Result<Self> {
        let index = u32::try_from(raw.device_id)
            .map_err(|_| Error::MalformedTensor(format!("negative device_id {}", raw.device_id)))?;
        Ok(Device::new(DeviceKind::from_raw(raw.device_type), index))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DeviceKind::Cpu => f.write_str("cpu"),
            kind => write!(f, "{}:{}", kind.name(), self.index),
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({self})")
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Parses `cpu`, `cuda`, `cuda:1`, `cuda_host:0`, `cuda_managed:0`, `metal`, `metal:0`, `mps`
    /// (an alias of `metal`, as PyTorch names it).
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let (name, index) = match lower.split_once(':') {
            Some((name, index)) => {
                let index = index.parse::<u32>().map_err(|_| {
                    let why = match index.trim().parse::<i128>() {
                        Ok(i) if i < 0 => "a device index cannot be negative",
                        Ok(_) => "the device index is too large",
                        Err(_) => "the device index is not a number",
                    };
                    Error::InvalidArgument(format!("device {s:?}: {why}"))
                })?;
                (name, index)
            }
            None => (lower.as_str(), 0),
        };
        let kind = match name {
            "cpu" => DeviceKind::Cpu,
            "cuda" | "gpu" => DeviceKind::Cuda,
            "cuda_host" => DeviceKind::CudaHost,
            "cuda_managed" => DeviceKind::CudaManaged,
            "metal" | "mps" => DeviceKind::Metal,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown device {s:?}: expected cpu, cuda[:N], cuda_host[:N], \
                     cuda_managed[:N] or metal[:N]"
                )));
            }
        };
        if kind == DeviceKind::Cpu && index != 0 {
            return Err(Error::InvalidArgument(format!(
                "device {s:?}: the host has only index 0"
            )));
        }
        Ok(Device::new(kind, index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display() {
        for (text, shown) in [
            ("cpu", "cpu"),
            ("CUDA", "cuda:0"),
            ("cuda:3", "cuda:3"),
            ("cuda_host:1", "cuda_host:1"),
            ("metal", "metal:0"),
            ("mps", "metal:0"),
        ] {
            assert_eq!(text.parse::<Device>().unwrap().to_string(), shown);
        }
        assert!("tpu".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
        assert!("cpu:1".parse::<Device>().is_err());
        let why = |text: &str| text.parse::<Device>().unwrap_err().to_string();
        assert!(why("cuda:-1").contains("a device index cannot be negative"));
        assert!(why("cuda:x").contains("the device index is not a number"));
        assert!(why("cuda:99999999999").contains("the device index is too large"));
    }

    #[test]
    fn every_dlpack_device_round_trips() {
        for raw in 1..=18 {
            let dl = DLDevice {
                device_type: raw,
                device_id: 2,
            };
            let device = Device::from_dlpack(dl).unwrap();
            assert_eq!(device.to_dlpack(), dl);
        }
        assert_eq!(
            Device::from_dlpack(DLDevice {
                device_type: 4,
                device_id: 0
            })
            .unwrap()
            .to_string(),
            "opencl:0"
        );
        assert!(
            Device::from_dlpack(DLDevice {
                device_type: 1,
                device_id: -1
            })
            .is_err()
        );
    }
}
