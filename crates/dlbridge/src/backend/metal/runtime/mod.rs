//! The part of the Metal backend that talks to Metal (compiled only under `cfg(metal)`): device
//! discovery, one [`Context`] per device, allocations (through the caching pools of [`pool`]),
//! copies, imports and no-copy wrapping.
//!
//! Devices are discovered once per process: index 0 is `MTLCreateSystemDefaultDevice()`, the
//! others follow in `MTLCopyAllDevices()` order. A device's [`Context`] (queue, residency set,
//! kernels) is created on first use and lives as long as the process.

mod buffer;
pub(super) mod compute;
mod context;
mod copy;
mod import;
mod objc;
mod pool;
mod wrap;

use std::sync::OnceLock;

use objc2::rc::Retained;
use objc2::runtime::ProtocolObject;
use objc2_metal::{MTLCopyAllDevices, MTLCreateSystemDefaultDevice, MTLDevice};

pub use buffer::{MetalAllocator, RawBuffer};
pub use context::{Context, MAX_OPS_PER_COMMAND_BUFFER};

pub(super) use buffer::host_wrote;
pub(super) use copy::copy_unchecked;
pub(super) use import::import_foreign;
pub(super) use pool::{allocate, pool};
pub(super) use wrap::wrap_host;

use super::pages::page_size_from;
use super::storage::{self, EnvChoice, MANAGED_AVAILABLE, STORAGE_MODE_ENV};
use super::{DeviceInfo, ResidencyStatus, order_devices, residency};
use crate::buffer::StorageMode;
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};
use crate::storage::Resolved;

// `MTLCreateSystemDefaultDevice` lives in CoreGraphics on macOS.
#[link(name = "CoreGraphics", kind = "framework")]
unsafe extern "C" {}

/// The environment, read once (`DLBRIDGE_STORAGE_MODE` is read, once, by [`crate::storage`]).
struct Env {
    storage: EnvChoice,
    residency: bool,
}

/// The storage mode of an allocation asking for `requested` on a device with or without unified
/// memory, and where it came from.
fn resolve_mode(requested: Option<StorageMode>, unified: bool) -> Result<Resolved> {
    storage::resolve_with_source(
        requested,
        &env().storage,
        crate::storage::environment_mode(),
        unified,
        MANAGED_AVAILABLE,
    )
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let storage = storage::parse_env(
            std::env::var(STORAGE_MODE_ENV).ok().as_deref(),
            MANAGED_AVAILABLE,
        );
        if let EnvChoice::Invalid(why) = &storage {
            log::warn!("dlbridge: {why}");
        }
        let residency =
            match residency::parse_env(std::env::var(residency::RESIDENCY_ENV).ok().as_deref()) {
                Ok(on) => on,
                Err(why) => {
                    log::warn!("dlbridge: {why}");
                    true
                }
            };
        Env { storage, residency }
    })
}

/// The OS page size: `sysconf(_SC_PAGESIZE)` and `vm_page_size`, never assumed.
fn page_size() -> Result<usize> {
    // SAFETY: sysconf has no preconditions; it returns -1 on error, which `page_size_from` refuses.
    let from_sysconf = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    // SAFETY: `vm_page_size` is a kernel-initialised global that is never written after start-up.
    let from_vm = unsafe { libc::vm_page_size };
    // `c_long` is 32 bits on arm64_32 (watchOS), 64 elsewhere.
    #[allow(clippy::useless_conversion)]
    page_size_from(i64::from(from_sysconf), from_vm)
}

struct Slot {
    device: Retained<ProtocolObject<dyn MTLDevice>>,
    context: OnceLock<std::result::Result<Context, String>>,
}

fn slots() -> &'static [Slot] {
    static SLOTS: OnceLock<Vec<Slot>> = OnceLock::new();
    SLOTS.get_or_init(|| {
        let default = MTLCreateSystemDefaultDevice();
        let all: Vec<Retained<ProtocolObject<dyn MTLDevice>>> = MTLCopyAllDevices().to_vec();
        let ids: Vec<u64> = all.iter().map(|d| d.registryID()).collect();
        let mut found: Vec<Retained<ProtocolObject<dyn MTLDevice>>> =
            order_devices(default.as_ref().map(|d| d.registryID()), &ids)
                .into_iter()
                .map(|i| all[i].clone())
                .collect();
        // A default device that MTLCopyAllDevices did not list (it lists them all on macOS; on
        // other systems it falls back to the default) still comes first.
        if let Some(d) = default {
            if !ids.contains(&d.registryID()) {
                found.insert(0, d);
            }
        }
        found
            .into_iter()
            .map(|device| Slot {
                device,
                context: OnceLock::new(),
            })
            .collect()
    })
}

pub(super) fn no_device() -> Error {
    Error::BackendUnavailable {
        backend: "Metal",
        reason: "no Metal device found".into(),
    }
}

pub(super) fn device_count() -> usize {
    slots().len()
}

/// Fails unless `device` is a Metal device.
fn check_metal(device: Device, what: &str) -> Result<()> {
    if device.kind() == DeviceKind::Metal {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what} needs a Metal device, not {device}"
        )))
    }
}

fn describe(index: u32, device: &ProtocolObject<dyn MTLDevice>) -> Result<DeviceInfo> {
    let unified = device.hasUnifiedMemory();
    let macos = cfg!(any(target_os = "macos", target_env = "macabi"));
    Ok(DeviceInfo {
        device: Device::metal(index),
        name: device.name().to_string(),
        registry_id: device.registryID(),
        has_unified_memory: unified,
        max_buffer_length: device.maxBufferLength(),
        recommended_max_working_set_size: device.recommendedMaxWorkingSetSize(),
        low_power: macos && device.isLowPower(),
        removable: macos && device.isRemovable(),
        page_size: page_size()?,
        default_storage: resolve_mode(None, unified)?.mode,
        managed_storage: MANAGED_AVAILABLE,
        residency: ResidencyStatus::Unsupported,
    })
}

/// The runtime state of a Metal device, created on first use.
pub fn context(device: Device) -> Result<&'static Context> {
    check_metal(device, "a Metal context")?;
    let slots = slots();
    let slot = slots.get(device.index() as usize).ok_or_else(|| {
        if slots.is_empty() {
            no_device()
        } else {
            Error::UnsupportedDevice(format!(
                "{device} does not exist: this machine has {} Metal device(s)",
                slots.len()
            ))
        }
    })?;
    slot.context
        .get_or_init(|| {
            describe(device.index(), &slot.device)
                .and_then(|info| Context::new(slot.device.clone(), info, env().residency))
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::BackendUnavailable {
            backend: "Metal",
            reason: format!("{device} could not start: {e}"),
        })
}

/// The context of the device with IORegistry ID `registry_id`.
fn context_by_registry_id(registry_id: u64) -> Result<&'static Context> {
    let index = slots()
        .iter()
        .position(|s| s.device.registryID() == registry_id)
        .ok_or_else(|| {
            Error::UnsupportedDevice(format!(
                "the Metal buffer belongs to a device (registry ID {registry_id:#x}) that \
                 MTLCopyAllDevices does not list"
            ))
        })?;
    context(Device::metal(index as u32))
}

pub(super) fn device_info(device: Device) -> Result<DeviceInfo> {
    Ok(context(device)?.info().clone())
}

pub(super) fn synchronize(device: Device) -> Result<()> {
    context(device)?.synchronize()
}

pub(super) fn resolve_storage(device: Device, requested: Option<StorageMode>) -> Result<Resolved> {
    resolve_mode(requested, context(device)?.info().has_unified_memory)
}

pub(super) fn residency_allocation_count(device: Device) -> Result<Option<usize>> {
    Ok(context(device)?.residency_allocation_count())
}
