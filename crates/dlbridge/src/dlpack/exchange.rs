//! The exchange rules: what a consumer gets for each `device`, `storage` and `copy` it asks of an
//! import, and what a producer hands out for each `stream`, `max_version`, `dl_device` and `copy`.
//!
//! Every binding (Python's capsules and C exchange table, a Rust caller with a raw pointer) turns
//! its arguments into an [`ImportRequest`] or [`ExportRequest`] and gets the same answer here:
//! the same copy-or-share decision, the same refusal ([`Error::CopyRequired`]), the same stream
//! handoff. Device-specific parts (resolving a `kDLMetal` handle, ordering CUDA streams, host
//! views of Metal memory) are asked of the backend seam ([`crate::backend`]).

use std::ptr::NonNull;

use crate::backend;
use crate::buffer::StorageMode;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

use super::ffi::{DLManagedTensor, DLManagedTensorVersioned, DLPackVersion};
use super::{VERSION, foreign};

/// What a consumer asks of an import: the array API standard's `from_dlpack(x, device=, copy=)`,
/// plus a storage mode for Metal (CUDA devices name theirs in the device kind).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ImportRequest {
    /// Where the result must live; `None`: wherever the producer's memory is.
    pub device: Option<Device>,
    /// The storage mode the result must have on a Metal device; `None`: whatever it has (a copy
    /// gets the device's default).
    pub storage: Option<StorageMode>,
    /// `None`: share where possible, copy where needed; `Some(true)`: always new memory (unless
    /// the producer already copied); `Some(false)`: never copy, refusing with
    /// [`Error::CopyRequired`].
    pub copy: Option<bool>,
}

/// An imported tensor, and whether its memory is a copy (made by dlbridge, or by the producer,
/// which said so with `IS_COPIED`) rather than the producer's own.
#[derive(Clone, Debug)]
pub struct Imported {
    /// The tensor.
    pub tensor: Tensor,
    /// Whether `tensor`'s memory is a copy of the producer's.
    pub copied: bool,
}

impl ImportRequest {
    /// Imports a versioned DLPack tensor, taking ownership of it, and applies this request.
    ///
    /// The descriptor is validated once ([module documentation](super)); a `kDLMetal` handle is
    /// resolved to a view of a shared buffer or a copy of a private one; then `device`,
    /// `storage` and `copy` are applied. On failure the producer's deleter has already run (or
    /// runs when the last view of its memory is dropped).
    ///
    /// # Safety
    /// `managed` must point to a live `DLManagedTensorVersioned` whose ownership the caller gives
    /// up, and whose descriptor is readable as DLPack specifies (the descriptor's *values* are
    /// checked; its pointers cannot be).
    pub unsafe fn import_versioned(
        &self,
        managed: NonNull<DLManagedTensorVersioned>,
    ) -> Result<Imported> {
        // SAFETY: forwarded contract.
        let (tensor, copied) = unsafe { foreign::take_versioned(managed) }?;
        self.finish_foreign(Imported { tensor, copied })
    }

    /// As [`ImportRequest::import_versioned`], for a legacy (unversioned) tensor.
    ///
    /// # Safety
    /// As [`ImportRequest::import_versioned`], for a `DLManagedTensor`.
    pub unsafe fn import_legacy(&self, managed: NonNull<DLManagedTensor>) -> Result<Imported> {
        // SAFETY: forwarded contract.
        let tensor = unsafe { foreign::take_legacy(managed) }?;
        self.finish_foreign(Imported {
            tensor,
            copied: false,
        })
    }

    /// Imports a managed tensor of either flavour ([`ImportRequest::import_versioned`],
    /// [`ImportRequest::import_legacy`]).
    ///
    /// # Safety
    /// As [`ImportRequest::import_versioned`]: the tensor is live, readable as DLPack specifies,
    /// and its ownership passes to this call.
    pub unsafe fn import(&self, managed: ManagedTensor) -> Result<Imported> {
        match managed {
            // SAFETY: forwarded contract.
            ManagedTensor::Versioned(m) => unsafe { self.import_versioned(m) },
            // SAFETY: forwarded contract.
            ManagedTensor::Legacy(m) => unsafe { self.import_legacy(m) },
        }
    }

    /// Applies this request to a producer's tensor that was just validated and wrapped (by a
    /// binding's own path, such as a C exchange table): resolves an opaque device handle
    /// (`kDLMetal`: share a shared or managed buffer, copy a private one) unless the tensor is
    /// bound for another device anyway, then applies `device`, `storage` and `copy`
    /// ([`ImportRequest::finish`]).
    pub(crate) fn finish_foreign(&self, taken: Imported) -> Result<Imported> {
        let elsewhere = self.device.is_some_and(|d| d != taken.tensor.device());
        let taken = if elsewhere {
            // Another device is reached by a copy, which needs no resolution first.
            taken
        } else {
            let Imported { tensor, copied } = taken;
            let handle = tensor.buffer().handle();
            // A copy the producer already made is not made again.
            let copy = if copied { None } else { self.copy };
            let tensor = backend::resolve_import(tensor, copy)?;
            let copied = copied || tensor.buffer().handle() != handle;
            Imported { tensor, copied }
        };
        self.finish(taken)
    }

    /// Applies `device`, `storage` and `copy` to a tensor whose memory dlbridge can use as it is
    /// (one of its own, a host view, a resolved foreign tensor): shares it when it is where it
    /// was asked to be, copies it otherwise, or refuses with [`Error::CopyRequired`] when a copy
    /// is needed and `copy` is `Some(false)`.
    ///
    /// # Errors
    /// [`Error::CopyRequired`]; a copy's errors ([`Error::OutOfMemory`], ...), where a backend
    /// not in this build is a device this exchange cannot reach ([`Error::UnsupportedDevice`],
    /// which the array API standard makes a `BufferError`).
    pub fn finish(&self, taken: Imported) -> Result<Imported> {
        let Imported { tensor, copied } = taken;
        let target = self.device.unwrap_or_else(|| tensor.device());
        let other_storage = backend::storage_per_buffer(target.kind())
            && self
                .storage
                .is_some_and(|s| s != tensor.buffer().storage_mode());
        if target != tensor.device() || other_storage {
            if self.copy == Some(false) {
                let (have, wanted) = match self.storage {
                    Some(s) if other_storage => (
                        format!(
                            "in {} storage on {}",
                            tensor.buffer().storage_mode(),
                            tensor.device()
                        ),
                        format!("{s} storage on {target}"),
                    ),
                    _ => (format!("on {}", tensor.device()), target.to_string()),
                };
                return Err(Error::CopyRequired(format!(
                    "the array is {have} and {wanted} was asked for, which needs a copy, but \
                     copy=False"
                )));
            }
            let tensor = copy_to(&tensor, target, self.storage).map_err(unreachable)?;
            return Ok(Imported {
                tensor,
                copied: true,
            });
        }
        if self.copy == Some(true) && !copied {
            let tensor = copy_to(&tensor, target, self.storage)?;
            return Ok(Imported {
                tensor,
                copied: true,
            });
        }
        Ok(Imported { tensor, copied })
    }
}

/// A compact copy of `t` on `device` in `storage` (`None`: the device's default; for a copy within
/// one Metal device, the source's mode).
pub(crate) fn copy_to(t: &Tensor, device: Device, storage: Option<StorageMode>) -> Result<Tensor> {
    let storage = match storage {
        None if device == t.device() && backend::storage_per_buffer(device.kind()) => {
            Some(t.buffer().storage_mode())
        }
        storage => storage,
    };
    let out = Tensor::allocate(t.shape(), t.dtype(), device, storage, false)?;
    // SAFETY: `out` is new memory that nothing else references.
    unsafe { out.copy_from_unchecked(t)? };
    Ok(out)
}

/// A device whose backend is not in this build (or has no driver) is, in the array API standard's
/// words, a device the exchange "cannot handle": a buffer error rather than a runtime one.
fn unreachable(err: Error) -> Error {
    match err {
        Error::BackendUnavailable { backend, reason } => {
            Error::UnsupportedDevice(format!("{backend} backend not available: {reason}"))
        }
        other => other,
    }
}

/// What a consumer asks of an export: the array API standard's `__dlpack__(stream=,
/// max_version=, dl_device=, copy=)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExportRequest {
    /// The consumer's stream, as the standard spells it (CUDA: `None` or `1` the legacy default
    /// stream, `2` the per-thread default stream, `-1` no synchronization, or a handle). Must be
    /// `None` for devices without streams.
    pub stream: Option<i64>,
    /// The highest DLPack version the consumer understands; `None` (or a major version 0): a
    /// legacy, unversioned tensor.
    pub max_version: Option<(u32, u32)>,
    /// The device the consumer wants the data on; `None`: where it is.
    pub dl_device: Option<Device>,
    /// As [`ImportRequest::copy`], for the producer.
    pub copy: Option<bool>,
}

/// An owned DLPack managed tensor of either flavour: one a producer handed over (to import with
/// [`ImportRequest::import`]) or one dlbridge exported ([`ExportRequest::export`]), owned by
/// whoever holds this until it is imported, given to a consumer (whose deleter call frees it) or
/// released with [`ManagedTensor::release`].
#[derive(Debug)]
#[must_use = "a managed tensor holds its producer's memory until it is imported or released"]
pub enum ManagedTensor {
    /// A DLPack 1.x tensor.
    Versioned(NonNull<DLManagedTensorVersioned>),
    /// A pre-1.0 tensor (a consumer that asked for no `max_version`).
    Legacy(NonNull<DLManagedTensor>),
}

// SAFETY: a `ManagedTensor` is an owned pointer whose only use is its deleter (or an import that
// ends in it), and DLPack requires deleters to be callable from any thread.
unsafe impl Send for ManagedTensor {}

impl ManagedTensor {
    /// Gives the tensor back to its producer unused (calls its deleter, if it has one).
    pub fn release(self) {
        match self {
            // SAFETY: a `ManagedTensor` is live and owned (its constructor's contract), and is
            // consumed here, so the deleter runs once.
            ManagedTensor::Versioned(m) => unsafe { super::release_versioned(m) },
            // SAFETY: as above.
            ManagedTensor::Legacy(m) => unsafe { super::release_legacy(m) },
        }
    }
}

impl ExportRequest {
    /// The version a versioned export is written with: dlbridge's own, or the lower 1.x minor the
    /// consumer asked for; `None` for a legacy export.
    pub fn version(&self) -> Option<DLPackVersion> {
        match self.max_version {
            Some((1, minor)) => Some(DLPackVersion {
                major: 1,
                minor: minor.min(VERSION.minor),
            }),
            Some((major, _)) if major > 1 => Some(VERSION),
            _ => None,
        }
    }

    /// Exports `tensor` as this request asks: our pending device work made visible to the
    /// consumer (on its `stream` for CUDA; waited for on Metal, which has no streams in DLPack),
    /// the data moved to `dl_device` (a host view of shared Metal memory where no copy is asked
    /// for, else a copy), a copy for `copy=Some(true)` (marked `IS_COPIED`), and the version
    /// negotiated from `max_version`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a stream on a device without streams or a stream value the
    /// standard forbids; [`Error::CopyRequired`] where a copy is needed and `copy` is
    /// `Some(false)`; a legacy export of a read-only or padded sub-byte view; a copy's errors.
    pub fn export(&self, tensor: &Tensor) -> Result<ManagedTensor> {
        let device = tensor.device();
        backend::export_handoff(device, self.stream)?;
        let mut copied: Option<Tensor> = None;
        let mut viewed: Option<Tensor> = None;
        if let Some(target) = self.dl_device.filter(|&t| t != device) {
            viewed = self.host_view(tensor, target)?;
            if viewed.is_none() {
                if self.copy == Some(false) {
                    return Err(Error::CopyRequired(format!(
                        "exporting to {target} needs a copy from {device}, but copy=False"
                    )));
                }
                copied = Some(tensor.copy_to(target).map_err(unreachable)?);
            }
        }
        if self.copy == Some(true) && copied.is_none() {
            copied = Some(tensor.copy()?);
        }
        let is_copied = copied.is_some();
        let out = copied.as_ref().or(viewed.as_ref()).unwrap_or(tensor);
        Ok(match self.version() {
            Some(version) => ManagedTensor::Versioned(out.to_dlpack_versioned(version, is_copied)),
            None => ManagedTensor::Legacy(out.to_dlpack_legacy()?),
        })
    }

    /// A host view of `tensor` for a consumer that asked for the host (`target`), where the
    /// backend has one (shared Metal memory) and no copy is asked for; `None` where the caller
    /// should copy. With `copy=Some(false)`, memory that cannot be viewed says why.
    fn host_view(&self, tensor: &Tensor, target: Device) -> Result<Option<Tensor>> {
        if !target.is_cpu() || self.copy == Some(true) {
            return Ok(None);
        }
        match backend::host_view(tensor) {
            Ok(view) => Ok(view),
            Err(e) if self.copy == Some(false) => Err(e),
            Err(_) => Ok(None),
        }
    }
}

impl Tensor {
    /// Imports a versioned DLPack tensor, taking ownership of it: the same as
    /// [`ImportRequest::import_versioned`] with no device, storage or copy asked, which is what
    /// `dlbridge.from_dlpack(capsule)` does in Python (a `kDLMetal` handle is resolved to a shared
    /// view or a copy of private memory).
    ///
    /// On success the tensor keeps the producer alive until the last view is dropped; on failure
    /// the producer's deleter has already run. See the [module documentation](super) for the
    /// checks.
    ///
    /// # Safety
    /// As [`ImportRequest::import_versioned`].
    pub unsafe fn from_dlpack_versioned(
        managed: NonNull<DLManagedTensorVersioned>,
    ) -> Result<Tensor> {
        // SAFETY: forwarded contract.
        unsafe { ImportRequest::default().import_versioned(managed) }.map(|i| i.tensor)
    }

    /// Imports a legacy (unversioned) DLPack tensor, taking ownership of it.
    ///
    /// # Safety
    /// As [`Tensor::from_dlpack_versioned`], for a `DLManagedTensor`.
    pub unsafe fn from_dlpack_legacy(managed: NonNull<DLManagedTensor>) -> Result<Tensor> {
        // SAFETY: forwarded contract.
        unsafe { ImportRequest::default().import_legacy(managed) }.map(|i| i.tensor)
    }
}
