//! The exchange rules alone, from Rust with no Python involved: `copy` (`None`, `Some(true)`,
//! `Some(false)`) × same or other device × read-only × version negotiation × stream values, for
//! imports ([`ImportRequest`]) and exports ([`ExportRequest`]). A Python caller gets the same
//! answers: `dlbridge-python-module` only turns its arguments into these requests.
//!
//! The "other device" cases use CUDA: on a machine without a driver a copy there is an exchange
//! the library "cannot handle" (`UnsupportedDevice`, a `BufferError` in Python); the tests that
//! need the device itself are ignored without one and run on the GPU machine.

mod common;

use common::{Data, Spec};
use dlbridge::dlpack::ffi::{DLPACK_FLAG_BITMASK_IS_COPIED, DLPACK_FLAG_BITMASK_READ_ONLY};
use dlbridge::dlpack::{self, ExportRequest, ImportRequest, Imported, ManagedTensor};
use dlbridge::{Device, Error, ErrorKind, StorageMode, Tensor};

fn values() -> Vec<f32> {
    (0..12).map(|i| i as f32 * 0.5 - 1.0).collect()
}

/// A foreign 3x4 float32 CPU tensor, its probe and its data pointer.
fn foreign(flags: u64) -> (ManagedTensor, std::sync::Arc<common::Probe>, *mut u8) {
    let p = Spec::f32(&values(), &[3, 4]).flags(flags).make_versioned();
    (
        ManagedTensor::Versioned(p.managed),
        p.probe,
        p.data.cast::<u8>(),
    )
}

fn import(
    flags: u64,
    request: ImportRequest,
) -> (
    Result<Imported, Error>,
    std::sync::Arc<common::Probe>,
    *mut u8,
) {
    let (managed, probe, data) = foreign(flags);
    // SAFETY: a live tensor just built, whose ownership we hand over.
    let result = unsafe { request.import(managed) };
    (result, probe, data)
}

fn first_byte(t: &Tensor) -> *const u8 {
    t.as_slice::<f32>().unwrap().as_ptr().cast()
}

fn cuda_present() -> bool {
    dlbridge::backend::cuda::device_count().is_ok_and(|n| n > 0)
}

#[test]
fn import_copy_none_shares_the_producers_memory() {
    let (result, probe, data) = import(0, ImportRequest::default());
    let imported = result.unwrap();
    assert!(!imported.copied);
    assert_eq!(first_byte(&imported.tensor), data.cast_const());
    assert_eq!(imported.tensor.to_vec::<f32>().unwrap(), values());
    assert_eq!(probe.deletes(), 0);
    drop(imported);
    assert_eq!(probe.deletes(), 1);
}

#[test]
fn import_copy_true_gives_new_memory_and_releases_nothing_early() {
    let request = ImportRequest {
        copy: Some(true),
        ..ImportRequest::default()
    };
    let (result, probe, data) = import(0, request);
    let imported = result.unwrap();
    assert!(imported.copied);
    assert_ne!(first_byte(&imported.tensor), data.cast_const());
    assert_eq!(imported.tensor.to_vec::<f32>().unwrap(), values());
    // The producer's tensor is released once the copy no longer needs it.
    assert_eq!(probe.deletes(), 1);
    assert!(!imported.tensor.buffer().is_foreign());
}

#[test]
fn import_copy_true_trusts_a_producer_copy() {
    let request = ImportRequest {
        copy: Some(true),
        ..ImportRequest::default()
    };
    let (result, probe, data) = import(DLPACK_FLAG_BITMASK_IS_COPIED, request);
    let imported = result.unwrap();
    assert!(imported.copied, "IS_COPIED is reported");
    assert_eq!(
        first_byte(&imported.tensor),
        data.cast_const(),
        "not copied twice"
    );
    drop(imported);
    assert_eq!(probe.deletes(), 1);
}

#[test]
fn import_copy_false_on_the_same_device_shares() {
    let request = ImportRequest {
        device: Some(Device::CPU),
        copy: Some(false),
        ..ImportRequest::default()
    };
    let (result, _probe, data) = import(0, request);
    let imported = result.unwrap();
    assert!(!imported.copied);
    assert_eq!(first_byte(&imported.tensor), data.cast_const());
}

#[test]
fn import_copy_false_to_another_device_is_refused_and_releases_the_producer() {
    for device in [Device::cuda(0), Device::cuda_host(0)] {
        let request = ImportRequest {
            device: Some(device),
            copy: Some(false),
            ..ImportRequest::default()
        };
        let (result, probe, _) = import(0, request);
        let err = result.unwrap_err();
        assert!(matches!(err, Error::CopyRequired(_)), "{err:?}");
        assert_eq!(err.kind(), ErrorKind::Buffer);
        let text = err.to_string();
        assert!(
            text.contains("copy=False") && text.contains(&device.to_string()),
            "{text}"
        );
        assert_eq!(probe.deletes(), 1, "the producer's deleter ran once");
    }
}

#[test]
fn import_to_another_device_without_its_backend_is_a_buffer_error() {
    if cuda_present() {
        return; // the GPU case is `import_to_cuda_copies`
    }
    for copy in [None, Some(true)] {
        let request = ImportRequest {
            device: Some(Device::cuda(0)),
            copy,
            ..ImportRequest::default()
        };
        let (result, probe, _) = import(0, request);
        let err = result.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Buffer, "{err:?}");
        assert!(
            err.to_string().contains("CUDA backend not available"),
            "{err}"
        );
        assert_eq!(probe.deletes(), 1);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn import_to_cuda_copies() {
    assert!(cuda_present(), "needs a CUDA device");
    for copy in [None, Some(true)] {
        let request = ImportRequest {
            device: Some(Device::cuda(0)),
            copy,
            ..ImportRequest::default()
        };
        let (result, probe, _) = import(0, request);
        let imported = result.unwrap();
        assert!(imported.copied);
        assert_eq!(imported.tensor.device(), Device::cuda(0));
        assert_eq!(imported.tensor.to_vec::<f32>().unwrap(), values());
        assert_eq!(probe.deletes(), 1);
    }
}

#[test]
fn read_only_survives_a_shared_import_and_not_a_copy() {
    let (result, _probe, _) = import(DLPACK_FLAG_BITMASK_READ_ONLY, ImportRequest::default());
    let mut shared = result.unwrap().tensor;
    assert!(shared.is_read_only());
    assert!(matches!(
        shared.as_mut_slice::<f32>(),
        Err(Error::ReadOnly(_))
    ));
    let request = ImportRequest {
        copy: Some(true),
        ..ImportRequest::default()
    };
    let (result, _probe, _) = import(DLPACK_FLAG_BITMASK_READ_ONLY, request);
    let mut copied = result.unwrap().tensor;
    assert!(!copied.is_read_only(), "a copy is ours to write");
    copied.as_mut_slice::<f32>().unwrap()[0] = 7.0;
}

#[test]
fn legacy_imports_follow_the_same_rules() {
    let p = Spec::f32(&values(), &[3, 4]).legacy().make_legacy();
    let data = p.data.cast::<u8>().cast_const();
    let request = ImportRequest {
        copy: Some(true),
        ..ImportRequest::default()
    };
    // SAFETY: a live tensor just built, whose ownership we hand over.
    let imported = unsafe { request.import(ManagedTensor::Legacy(p.managed)) }.unwrap();
    assert!(imported.copied);
    assert_ne!(first_byte(&imported.tensor), data);
    assert_eq!(p.probe.deletes(), 1);
}

#[test]
fn an_unsupported_major_version_is_refused_before_any_rule() {
    let p = Spec::f32(&values(), &[3, 4]).version(2, 0).make_versioned();
    // SAFETY: as above.
    let err = unsafe { ImportRequest::default().import(ManagedTensor::Versioned(p.managed)) }
        .unwrap_err();
    assert!(
        matches!(err, Error::UnsupportedVersion { major: 2, .. }),
        "{err:?}"
    );
    assert_eq!(p.probe.deletes(), 1);
}

#[test]
fn finish_applies_rules_to_our_own_tensors() {
    let t = Tensor::from_slice(&values(), &[3, 4]).unwrap();
    let ptr = first_byte(&t);
    let shared = ImportRequest::default()
        .finish(Imported {
            tensor: t.clone(),
            copied: false,
        })
        .unwrap();
    assert_eq!(first_byte(&shared.tensor), ptr);
    let copy = ImportRequest {
        copy: Some(true),
        ..ImportRequest::default()
    }
    .finish(Imported {
        tensor: t.clone(),
        copied: false,
    })
    .unwrap();
    assert_ne!(first_byte(&copy.tensor), ptr);
    assert_eq!(copy.tensor.to_vec::<f32>().unwrap(), values());
    // The CPU has one storage mode: asking for the one it has is no copy.
    let same = ImportRequest {
        storage: Some(StorageMode::Shared),
        copy: Some(false),
        ..ImportRequest::default()
    }
    .finish(Imported {
        tensor: t,
        copied: false,
    })
    .unwrap();
    assert_eq!(first_byte(&same.tensor), ptr);
}

/// Reads back an export: its version (None for legacy), flags, and data pointer.
fn read(managed: &ManagedTensor) -> (Option<(u32, u32)>, u64, *mut u8) {
    match *managed {
        // SAFETY: a live export dlbridge just made.
        ManagedTensor::Versioned(m) => unsafe {
            let m = &*m.as_ptr();
            (
                Some((m.version.major, m.version.minor)),
                m.flags,
                m.dl_tensor.data.cast(),
            )
        },
        // SAFETY: as above.
        ManagedTensor::Legacy(m) => unsafe { (None, 0, (*m.as_ptr()).dl_tensor.data.cast()) },
    }
}

#[test]
fn export_negotiates_the_version() {
    let t = Tensor::from_slice(&values(), &[3, 4]).unwrap();
    let ours = (dlpack::VERSION.major, dlpack::VERSION.minor);
    for (asked, expected) in [
        (None, None),
        (Some((0, 9)), None),
        (Some((1, 0)), Some((1, 0))),
        (Some((1, 1)), Some((1, 1))),
        (Some((1, 99)), Some(ours)),
        (Some((2, 0)), Some(ours)),
    ] {
        let request = ExportRequest {
            max_version: asked,
            ..ExportRequest::default()
        };
        assert_eq!(request.version().map(|v| (v.major, v.minor)), expected);
        let managed = request.export(&t).unwrap();
        let (version, flags, data) = read(&managed);
        assert_eq!(version, expected, "asked {asked:?}");
        assert_eq!(flags & DLPACK_FLAG_BITMASK_IS_COPIED, 0);
        assert_eq!(data.cast_const(), first_byte(&t), "zero-copy");
        managed.release();
    }
}

#[test]
fn export_copy_true_sets_is_copied_and_copy_false_shares() {
    let t = Tensor::from_slice(&values(), &[3, 4]).unwrap();
    let refs = t.buffer().ref_count();
    for (copy, copied) in [(None, false), (Some(false), false), (Some(true), true)] {
        let request = ExportRequest {
            max_version: Some((1, 3)),
            copy,
            ..ExportRequest::default()
        };
        let managed = request.export(&t).unwrap();
        let (_, flags, data) = read(&managed);
        assert_eq!(
            flags & DLPACK_FLAG_BITMASK_IS_COPIED != 0,
            copied,
            "copy={copy:?}"
        );
        assert_eq!(
            data.cast_const() == first_byte(&t),
            !copied,
            "copy={copy:?}"
        );
        managed.release();
        assert_eq!(
            t.buffer().ref_count(),
            refs,
            "the export let go of the buffer"
        );
    }
}

#[test]
fn export_read_only_is_flagged_and_refused_as_legacy() {
    let t = Tensor::from_slice(&values(), &[3, 4])
        .unwrap()
        .into_read_only();
    let versioned = ExportRequest {
        max_version: Some((1, 3)),
        ..ExportRequest::default()
    }
    .export(&t)
    .unwrap();
    assert_ne!(read(&versioned).1 & DLPACK_FLAG_BITMASK_READ_ONLY, 0);
    versioned.release();
    let err = ExportRequest::default().export(&t).unwrap_err();
    assert!(matches!(err, Error::ReadOnly(_)), "{err:?}");
}

#[test]
fn export_to_another_device_with_copy_false_is_refused() {
    let t = Tensor::from_slice(&values(), &[3, 4]).unwrap();
    let err = ExportRequest {
        max_version: Some((1, 3)),
        dl_device: Some(Device::cuda(0)),
        copy: Some(false),
        ..ExportRequest::default()
    }
    .export(&t)
    .unwrap_err();
    assert!(matches!(err, Error::CopyRequired(_)), "{err:?}");
    assert!(err.to_string().contains("exporting to cuda:0"), "{err}");
    // The same device is no move at all.
    let same = ExportRequest {
        max_version: Some((1, 3)),
        dl_device: Some(Device::CPU),
        copy: Some(false),
        ..ExportRequest::default()
    }
    .export(&t)
    .unwrap();
    assert_eq!(read(&same).2.cast_const(), first_byte(&t));
    same.release();
}

#[test]
fn stream_values_are_refused_where_there_are_no_streams() {
    let t = Tensor::from_slice(&values(), &[3, 4]).unwrap();
    for stream in [-1i64, 0, 1, 2, 12345] {
        let err = ExportRequest {
            stream: Some(stream),
            max_version: Some((1, 3)),
            ..ExportRequest::default()
        }
        .export(&t)
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Value, "{err:?}");
        assert!(
            err.to_string()
                .contains("stream must be None for arrays on cpu"),
            "{err}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn stream_values_on_cuda_follow_the_array_api() {
    assert!(cuda_present(), "needs a CUDA device");
    let t = Tensor::from_slice(&values(), &[3, 4])
        .unwrap()
        .copy_to(Device::cuda(0))
        .unwrap();
    for stream in [None, Some(-1i64), Some(1), Some(2)] {
        let managed = ExportRequest {
            stream,
            max_version: Some((1, 3)),
            ..ExportRequest::default()
        }
        .export(&t)
        .unwrap();
        managed.release();
    }
    for stream in [0i64, -2] {
        let err = ExportRequest {
            stream: Some(stream),
            max_version: Some((1, 3)),
            ..ExportRequest::default()
        }
        .export(&t)
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Value, "stream={stream}: {err:?}");
    }
    assert_eq!(dlbridge::backend::consumer_stream(Device::cuda(0)), Some(1));
    assert_eq!(dlbridge::backend::consumer_stream(Device::CPU), None);
}

#[test]
fn an_opaque_metal_tensor_gets_the_same_decision_as_from_python() {
    // Where the Metal backend is not available, a `kDLMetal` tensor is held opaquely and handed
    // on as it came, whichever caller imports it; where it is, it is resolved (tests/metal.rs).
    let p = Spec::f32(&values(), &[3, 4])
        .device(dlbridge::dlpack::ffi::K_DL_METAL, 0)
        .data(Data::Fake(0x1000))
        .make_versioned();
    // SAFETY: as above.
    let imported =
        unsafe { ImportRequest::default().import(ManagedTensor::Versioned(p.managed)) }.unwrap();
    if dlbridge::backend::metal::is_available() {
        return;
    }
    assert!(!imported.copied);
    assert_eq!(imported.tensor.device(), Device::metal(0));
    assert_eq!(imported.tensor.buffer().handle() as usize, 0x1000);
    drop(imported);
    assert_eq!(p.probe.deletes(), 1);
}
