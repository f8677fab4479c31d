//! One test body per behaviour, instantiated per device.
//!
//! A shared body is a plain function `fn name(dev: &Dev)` that makes its inputs on the host,
//! places them on `dev.device` with [`Dev::put`], and reads results back through the host.
//! [`device_tests!`] then writes one `#[test]` per body and device:
//!
//! | module | device | runs |
//! | --- | --- | --- |
//! | `cpu::name` | [`Device::CPU`] | always |
//! | `cuda::name` | CUDA device 0 | compiled with feature `cuda`; `#[ignore = "needs a CUDA device"]`: with `--include-ignored` (scripts/test.sh asks where `nvidia-smi -L` finds a device); fails, saying why, without one |
//! | `metal::name` | Metal device 0 | compiled only on macOS with feature `metal`; `#[ignore = "needs a Metal device"]`, run with `--include-ignored` |
//!
//! Where devices legitimately differ (Metal has no `float64`; tolerances of transcendental
//! functions), the body asks the fixture ([`Dev::computes`], [`Dev::tolerance`]) rather than
//! naming a device.

use dlbridge::{DType, Device, DeviceKind, Error, StorageMode, Tensor};

/// The device a shared body runs on.
pub(crate) struct Dev {
    /// The device under test.
    pub(crate) device: Device,
    /// Held for the test's length on Metal (see [`Dev::metal`]).
    _serial: Option<std::sync::MutexGuard<'static, ()>>,
}

impl Dev {
    /// The host.
    pub(crate) fn cpu() -> Dev {
        Dev {
            device: Device::CPU,
            _serial: None,
        }
    }

    /// CUDA device 0; panics, saying why, where there is none ([`super::gpu`]).
    pub(crate) fn cuda() -> Dev {
        Dev {
            device: super::gpu(),
            _serial: None,
        }
    }

    /// Metal device 0, with a lock that runs one test of this binary at a time on it (as the
    /// Metal files always did); panics where there is none, so an ignored test asked to run
    /// without a device fails rather than passing.
    #[cfg(all(target_os = "macos", feature = "metal"))]
    pub(crate) fn metal() -> Dev {
        static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
        assert!(
            dlbridge::backend::metal::is_available(),
            "this test needs a Metal device, and this machine has none"
        );
        let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        Dev {
            device: Device::metal(0),
            _serial: Some(guard),
        }
    }

    /// The kind of device under test.
    pub(crate) fn kind(&self) -> DeviceKind {
        self.device.kind()
    }

    /// Whether the device is the host.
    pub(crate) fn is_cpu(&self) -> bool {
        self.kind() == DeviceKind::Cpu
    }

    /// Whether the device's kernels compute in `dtype` (Metal GPUs have no `float64`: requests
    /// in it, or with a `float64` result, fail with `Error::UnsupportedDType`). Copies of any
    /// dtype work everywhere.
    pub(crate) fn computes(&self, dtype: DType) -> bool {
        !(self.kind() == DeviceKind::Metal && dtype == DType::F64)
    }

    /// `dtypes` without those the device does not compute in.
    pub(crate) fn computable(&self, dtypes: &[DType]) -> Vec<DType> {
        dtypes
            .iter()
            .copied()
            .filter(|&d| self.computes(d))
            .collect()
    }

    /// The result of an operation on operands and to a result of `dtypes`: `Some` where the device
    /// computes in all of them; `None` where it does not, after checking that it refused with
    /// `Error::UnsupportedDType` naming a dtype it lacks.
    pub(crate) fn result(
        &self,
        dtypes: &[DType],
        result: dlbridge::Result<Tensor>,
    ) -> Option<Tensor> {
        let lacking: Vec<DType> = dtypes
            .iter()
            .copied()
            .filter(|&d| !self.computes(d))
            .collect();
        if lacking.is_empty() {
            return Some(result.unwrap_or_else(|e| panic!("{dtypes:?} on {}: {e}", self.device)));
        }
        match result {
            Err(e @ Error::UnsupportedDType(_)) => {
                let message = e.to_string();
                assert!(
                    lacking.iter().any(|d| message.contains(&d.to_string())),
                    "{message}"
                );
                None
            }
            other => panic!("{} lacks {lacking:?}, yet gave {other:?}", self.device),
        }
    }

    /// The storage modes a test places memory in: the device's default (`None`) and, on Metal,
    /// each explicit mode (shared, private, and managed where macOS has it).
    pub(crate) fn storage_modes(&self) -> Vec<Option<StorageMode>> {
        let mut modes = vec![None];
        if self.kind() == DeviceKind::Metal {
            modes.extend([Some(StorageMode::Shared), Some(StorageMode::Private)]);
            if dlbridge::backend::metal::storage::MANAGED_AVAILABLE {
                modes.push(Some(StorageMode::Managed));
            }
        }
        modes
    }

    /// A compact copy of `host` on the device (for the CPU, a copy in new host memory).
    pub(crate) fn put(&self, host: &Tensor) -> Tensor {
        host.copy_to(self.device).unwrap()
    }

    /// A compact copy of `host` on the device in `storage` (`None`: the default).
    pub(crate) fn put_in(&self, host: &Tensor, storage: Option<StorageMode>) -> Tensor {
        let t = host.copy_to_storage(self.device, storage).unwrap();
        if let Some(mode) = storage {
            assert_eq!(t.buffer().storage_mode(), mode);
        }
        t
    }

    /// The element-wise tolerance `(rtol, atol)` of a float result of `dtype`, held against a
    /// reference rounded once from `f64`: a few units in the last place (CUDA's and Metal's math
    /// libraries are within a few ulp rather than one; Metal's a little further). Integer dtypes
    /// get `(0, 0)`.
    pub(crate) fn tolerance(&self, dtype: DType) -> (f64, f64) {
        let eps = match dtype {
            DType::F16 => 2f64.powi(-10),
            DType::BF16 => 2f64.powi(-7),
            DType::F32 => 2f64.powi(-23),
            DType::F64 => 2f64.powi(-52),
            _ => return (0.0, 0.0),
        };
        match (self.kind(), dtype) {
            // Metal's precise functions (fast math off): the bounds metal_compute.rs held
            // them to.
            (DeviceKind::Metal, DType::F32) => (1e-5, 1e-5),
            (_, DType::F32) => (4.0 * eps, 1e-6),
            (_, DType::F64) => (16.0 * eps, 1e-14),
            _ => (eps, eps),
        }
    }
}

/// Writes one test per device for each named body `fn name(dev: &Dev)` (see the module docs):
/// `cpu::name`, `cuda::name` (ignored unless asked for) and, on macOS with feature `metal`,
/// `metal::name` (likewise). Each group is optional:
/// - `all`: every device;
/// - `accelerators`: CUDA and Metal only, for bodies that check a device against the CPU's own
///   result (on the CPU they would compare it with itself);
/// - `cpu_and_cuda`: no Metal instance, for bodies that compute in `float64` throughout and have
///   not yet been taught to expect Metal's refusal ([`Dev::result`]).
///
/// ```ignore
/// device_tests! {
///     all: [unary_ops, copies],
///     accelerators: [agrees_with_the_cpu],
/// }
/// ```
#[allow(unused_macros)] // by the test files that include `common` without instantiating bodies
macro_rules! device_tests {
    (
        $(all: [$($all:ident),* $(,)?])?
        $(, accelerators: [$($acc:ident),* $(,)?])?
        $(, cpu_and_cuda: [$($cc:ident),* $(,)?])?
        $(cpu_and_cuda: [$($cc0:ident),* $(,)?])?
        $(,)?
    ) => {
        /// The shared bodies on the host.
        mod cpu {
            $($(
                #[test]
                fn $all() {
                    super::$all(&$crate::common::devices::Dev::cpu());
                }
            )*)?
            $($(
                #[test]
                fn $cc() {
                    super::$cc(&$crate::common::devices::Dev::cpu());
                }
            )*)?
            $($(
                #[test]
                fn $cc0() {
                    super::$cc0(&$crate::common::devices::Dev::cpu());
                }
            )*)?
        }

        // Without a GPU backend the accelerator bodies have no instance: still compiled, and used.
        #[cfg(not(any(feature = "cuda", all(target_os = "macos", feature = "metal"))))]
        const _: &[fn(&$crate::common::devices::Dev)] = &[$($($acc),*)?];

        /// The shared bodies on CUDA device 0 (compiled with feature `cuda` only: on a Mac,
        /// scripts/test.sh's `--include-ignored` must not run them).
        #[cfg(feature = "cuda")]
        mod cuda {
            $($(
                #[test]
                #[ignore = "needs a CUDA device"]
                fn $all() {
                    super::$all(&$crate::common::devices::Dev::cuda());
                }
            )*)?
            $($(
                #[test]
                #[ignore = "needs a CUDA device"]
                fn $acc() {
                    super::$acc(&$crate::common::devices::Dev::cuda());
                }
            )*)?
            $($(
                #[test]
                #[ignore = "needs a CUDA device"]
                fn $cc() {
                    super::$cc(&$crate::common::devices::Dev::cuda());
                }
            )*)?
            $($(
                #[test]
                #[ignore = "needs a CUDA device"]
                fn $cc0() {
                    super::$cc0(&$crate::common::devices::Dev::cuda());
                }
            )*)?
        }

        /// The shared bodies on Metal device 0.
        #[cfg(all(target_os = "macos", feature = "metal"))]
        mod metal {
            $($(
                #[test]
                #[ignore = "needs a Metal device"]
                fn $all() {
                    super::$all(&$crate::common::devices::Dev::metal());
                }
            )*)?
            $($(
                #[test]
                #[ignore = "needs a Metal device"]
                fn $acc() {
                    super::$acc(&$crate::common::devices::Dev::metal());
                }
            )*)?
        }
    };
}

#[allow(unused_imports)]
pub(crate) use device_tests;
