//! The Metal backend when it is not compiled in: the same functions, answering
//! [`Error::BackendUnavailable`].

use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

use super::{DeviceInfo, HostRegion, ImportOptions};
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::storage::Resolved;
use crate::tensor::Tensor;

pub(super) fn no_device() -> Error {
    let reason = if cfg!(target_vendor = "apple") {
        "this build of dlbridge does not include it (build with feature `metal`)"
    } else {
        "Metal exists only on Apple platforms"
    };
    Error::BackendUnavailable {
        backend: "Metal",
        reason: reason.into(),
    }
}

pub(super) fn device_count() -> usize {
    0
}

pub(super) fn device_info(_: Device) -> Result<DeviceInfo> {
    Err(no_device())
}

pub(super) fn allocate(_: Device, _: usize, _: Option<StorageMode>, _: bool) -> Result<Buffer> {
    Err(no_device())
}

pub(super) fn synchronize(_: Device) -> Result<()> {
    Err(no_device())
}

pub(super) fn pool(_: Device, _: Option<StorageMode>) -> Result<&'static Arc<Pool>> {
    Err(no_device())
}

pub(super) fn resolve_storage(_: Device, _: Option<StorageMode>) -> Result<Resolved> {
    Err(no_device())
}

pub(super) fn import_foreign(_: Tensor, _: ImportOptions) -> Result<Tensor> {
    Err(no_device())
}

pub(super) unsafe fn copy_unchecked(_: &Tensor, _: &Tensor) -> Result<()> {
    Err(no_device())
}

pub(super) fn host_wrote(_: &Buffer, _: Range<usize>) -> Result<()> {
    Err(no_device())
}

pub(super) unsafe fn wrap_host(
    _: Device,
    _: *const u8,
    _: usize,
    _: &[Range<usize>],
    _: bool,
    _: Arc<dyn Any + Send + Sync>,
) -> Result<HostRegion> {
    Err(no_device())
}

pub(super) fn residency_allocation_count(_: Device) -> Result<Option<usize>> {
    Err(no_device())
}
