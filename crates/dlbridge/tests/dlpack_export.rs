//! Exporting tensors through DLPack: every field of the exported structs, the reference the export
//! holds on the buffer, zero-copy round trips of strided views, deleters called from other threads,
//! and the `READ_ONLY` / `IS_COPIED` / `IS_SUBBYTE_TYPE_PADDED` flags.

mod common;

use std::ptr::NonNull;
use std::thread;

use common::Spec;
use dlbridge::dlpack::ffi::{
    DLDataType, DLManagedTensor, DLManagedTensorVersioned, DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED, DLPACK_FLAG_BITMASK_READ_ONLY, DLPackVersion,
    DLTensor, K_DL_CPU,
};
use dlbridge::dlpack::{self, ffi};
use dlbridge::{DType, Device, SliceArg, Tensor};

fn iota_i32(n: usize) -> Vec<i32> {
    (0..n as i32).collect()
}

/// A 3x4 int32 tensor holding 0..12.
fn matrix() -> Tensor {
    Tensor::from_slice(&iota_i32(12), &[3, 4]).unwrap()
}

/// The address of the view's first element.
fn first_element(t: &Tensor) -> *mut u8 {
    t.buffer()
        .host_ptr()
        .unwrap()
        .as_ptr()
        .wrapping_add(t.byte_offset())
}

/// The descriptor's shape and strides.
///
/// # Safety
/// `dl` must be a live descriptor whose arrays hold `ndim` entries each.
unsafe fn dims(dl: &DLTensor) -> (Vec<i64>, Vec<i64>) {
    let n = dl.ndim as usize;
    // SAFETY: the caller guarantees both arrays are live and `ndim` long.
    unsafe {
        (
            std::slice::from_raw_parts(dl.shape, n).to_vec(),
            std::slice::from_raw_parts(dl.strides, n).to_vec(),
        )
    }
}

/// Calls a versioned export's deleter.
///
/// # Safety
/// `m` must be a live export not yet deleted.
unsafe fn delete_versioned(m: NonNull<DLManagedTensorVersioned>) {
    // SAFETY: forwarded.
    unsafe { ((*m.as_ptr()).deleter.expect("a deleter"))(m.as_ptr()) }
}

/// Calls a legacy export's deleter.
///
/// # Safety
/// `m` must be a live export not yet deleted.
unsafe fn delete_legacy(m: NonNull<DLManagedTensor>) {
    // SAFETY: forwarded.
    unsafe { ((*m.as_ptr()).deleter.expect("a deleter"))(m.as_ptr()) }
}

/// Checks the descriptor of an export of a CPU view `t`: `data` is the first element's address and
/// `byte_offset` 0; ndim, dtype, device, shape and strides match; the arrays are non-NULL even for
/// 0-d views.
///
/// # Safety
/// `dl` must be a live exported descriptor.
unsafe fn assert_describes(dl: &DLTensor, t: &Tensor) {
    assert_eq!(dl.data.cast::<u8>(), first_element(t));
    assert_eq!(dl.byte_offset, 0);
    assert_eq!(dl.ndim as usize, t.ndim());
    assert_eq!(dl.dtype, t.dtype().to_dlpack());
    assert_eq!(dl.device.device_type, K_DL_CPU);
    assert_eq!(dl.device.device_id, 0);
    assert!(!dl.shape.is_null(), "shape must never be NULL");
    assert!(!dl.strides.is_null(), "strides must never be NULL");
    // SAFETY: forwarded; the arrays were just checked non-NULL.
    let (shape, strides) = unsafe { dims(dl) };
    let want_shape: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
    let want_strides: Vec<i64> = t.strides().iter().map(|&s| s as i64).collect();
    assert_eq!(shape, want_shape);
    assert_eq!(strides, want_strides);
}

// ---------------------------------------------------------------------------------------------
// Fields
// ---------------------------------------------------------------------------------------------

/// A versioned export of a column slice: version, flags, manager_ctx, deleter and the descriptor.
#[test]
fn versioned_export_fields() {
    let t = matrix();
    let view = t.slice(1, SliceArg::range(1, 3)).unwrap(); // shape [3, 2], strides [4, 1]
    assert_eq!(view.byte_offset(), 4);
    for version in [dlpack::VERSION, DLPackVersion { major: 1, minor: 1 }] {
        let e = view.to_dlpack_versioned(version, false);
        // SAFETY: a live export we own, deleted once at the end.
        unsafe {
            let m = &*e.as_ptr();
            assert_eq!(m.version, version);
            assert_eq!(m.flags, 0);
            assert!(!m.manager_ctx.is_null());
            assert!(m.deleter.is_some());
            assert_describes(&m.dl_tensor, &view);
            assert_eq!(dims(&m.dl_tensor), (vec![3, 2], vec![4, 1]));
            assert_eq!(*m.dl_tensor.data.cast::<i32>(), 1);
            delete_versioned(e);
        }
    }
    assert_eq!(dlpack::VERSION, DLPackVersion { major: 1, minor: 3 });
}

/// A legacy export carries the same descriptor.
#[test]
fn legacy_export_fields() {
    let t = matrix();
    let view = t.transpose().unwrap();
    let e = view.to_dlpack_legacy().unwrap();
    // SAFETY: a live export we own, deleted once at the end.
    unsafe {
        let m = &*e.as_ptr();
        assert!(!m.manager_ctx.is_null());
        assert!(m.deleter.is_some());
        assert_describes(&m.dl_tensor, &view);
        assert_eq!(dims(&m.dl_tensor), (vec![4, 3], vec![1, 4]));
        delete_legacy(e);
    }
}

/// 0-d and zero-size tensors still get non-NULL shape and strides arrays.
#[test]
fn export_of_0d_and_empty_tensors() {
    let scalar = matrix().index(0, 2).unwrap().index(0, 3).unwrap();
    assert_eq!(scalar.ndim(), 0);
    let empty = Tensor::zeros(&[0, 3], DType::F64, Device::CPU).unwrap();
    for t in [&scalar, &empty] {
        let e = t.to_dlpack_versioned(dlpack::VERSION, false);
        // SAFETY: a live export we own, deleted once.
        unsafe {
            assert_describes(&(*e.as_ptr()).dl_tensor, t);
            delete_versioned(e);
        }
        let e = t.to_dlpack_legacy().unwrap();
        // SAFETY: as above.
        unsafe {
            assert_describes(&(*e.as_ptr()).dl_tensor, t);
            delete_legacy(e);
        }
    }
    let e = scalar.to_dlpack_versioned(dlpack::VERSION, false);
    // SAFETY: a live export of a 0-d int32 view: `data` points at its one element.
    unsafe {
        assert_eq!(*(*e.as_ptr()).dl_tensor.data.cast::<i32>(), 11);
        delete_versioned(e);
    }
}

/// The dtype descriptor is written as DLPack spells it, vector lanes included.
#[test]
fn export_dtype_descriptors() {
    let cases = [
        ("float16", ffi::K_DL_FLOAT, 16, 1),
        ("bfloat16", ffi::K_DL_BFLOAT, 16, 1),
        ("int64", ffi::K_DL_INT, 64, 1),
        ("uint8", ffi::K_DL_UINT, 8, 1),
        ("bool", ffi::K_DL_BOOL, 8, 1),
        ("complex64", ffi::K_DL_COMPLEX, 64, 1),
        ("float8_e4m3fn", ffi::K_DL_FLOAT8_E4M3FN, 8, 1),
        ("float32x4", ffi::K_DL_FLOAT, 32, 4),
    ];
    for (name, code, bits, lanes) in cases {
        let dtype: DType = name.parse().unwrap();
        let t = Tensor::zeros(&[2], dtype, Device::CPU).unwrap();
        let e = t.to_dlpack_versioned(dlpack::VERSION, false);
        // SAFETY: a live export we own, deleted once.
        unsafe {
            assert_eq!(
                (*e.as_ptr()).dl_tensor.dtype,
                DLDataType { code, bits, lanes },
                "{name}"
            );
            delete_versioned(e);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Ownership
// ---------------------------------------------------------------------------------------------

/// An export holds one reference to the buffer: the memory outlives the tensor, and the deleter
/// releases exactly that reference.
#[test]
fn export_keeps_the_buffer_alive_until_its_deleter_runs() {
    let t = matrix();
    let buffer = t.buffer().clone();
    assert_eq!(buffer.ref_count(), 2);

    let versioned = t.to_dlpack_versioned(dlpack::VERSION, false);
    assert_eq!(buffer.ref_count(), 3);
    let legacy = t.to_dlpack_legacy().unwrap();
    assert_eq!(buffer.ref_count(), 4);
    drop(t);
    assert_eq!(buffer.ref_count(), 3);

    // SAFETY: live exports of a 3x4 int32 tensor; each deleter is called once.
    unsafe {
        let data = (*versioned.as_ptr()).dl_tensor.data.cast::<i32>();
        assert_eq!(std::slice::from_raw_parts(data, 12), &iota_i32(12)[..]);
        delete_versioned(versioned);
        assert_eq!(buffer.ref_count(), 2);
        let data = (*legacy.as_ptr()).dl_tensor.data.cast::<i32>();
        assert_eq!(std::slice::from_raw_parts(data, 12), &iota_i32(12)[..]);
        delete_legacy(legacy);
    }
    assert_eq!(buffer.ref_count(), 1);
}

/// Re-exporting an imported tensor keeps the original producer alive until the export's deleter
/// runs, after the tensor itself is gone.
#[test]
fn export_of_an_import_keeps_the_producer_alive() {
    let (t, probe) = Spec::f32(&[1.0, 2.0, 3.0], &[3]).import().tensor();
    let e = t.to_dlpack_versioned(dlpack::VERSION, false);
    drop(t);
    assert_eq!(probe.deletes(), 0);
    // SAFETY: a live export we own; deleted once.
    unsafe { delete_versioned(e) };
    assert_eq!(probe.deletes(), 1);
}

/// The deleter may be called from any thread; it releases the reference there.
#[test]
fn deleter_called_from_another_thread() {
    struct SendPtr(NonNull<DLManagedTensorVersioned>);
    // SAFETY: DLPack exports may be deleted from any thread; the pointer is only used for that.
    unsafe impl Send for SendPtr {}

    let t = matrix();
    let buffer = t.buffer().clone();
    let e = SendPtr(t.to_dlpack_versioned(dlpack::VERSION, false));
    drop(t);
    assert_eq!(buffer.ref_count(), 2);
    thread::spawn(move || {
        let e = e;
        // SAFETY: a live export, deleted once, here.
        unsafe { delete_versioned(e.0) };
    })
    .join()
    .unwrap();
    assert_eq!(buffer.ref_count(), 1);

    // Through a foreign producer: the export's deleter, called on another thread, is what drops
    // the last reference, so the producer's deleter runs on that thread.
    let (t, probe) = Spec::f32(&[1.0], &[1]).import().tensor();
    let e = SendPtr(t.to_dlpack_versioned(dlpack::VERSION, false));
    drop(t);
    let id = thread::spawn(move || {
        let e = e;
        // SAFETY: a live export, deleted once, here.
        unsafe { delete_versioned(e.0) };
        thread::current().id()
    })
    .join()
    .unwrap();
    assert_eq!(probe.deletes(), 1);
    assert_eq!(probe.thread(), Some(id));
}

// ---------------------------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------------------------

/// Views of a 3x4 int32 matrix that exercise every kind of stride.
fn strided_views(t: &Tensor) -> Vec<(&'static str, Tensor)> {
    let rev = SliceArg {
        start: None,
        stop: None,
        step: -1,
    };
    vec![
        ("whole", t.clone()),
        ("rows 1..3", t.slice(0, SliceArg::range(1, 3)).unwrap()),
        (
            "every other column",
            t.slice(
                1,
                SliceArg {
                    start: Some(1),
                    stop: None,
                    step: 2,
                },
            )
            .unwrap(),
        ),
        ("transposed", t.transpose().unwrap()),
        ("rows reversed", t.slice(0, rev).unwrap()),
        (
            "both reversed, transposed",
            t.slice(0, rev)
                .unwrap()
                .slice(1, rev)
                .unwrap()
                .transpose()
                .unwrap(),
        ),
        (
            "column 2, step -2",
            t.index(1, 2)
                .unwrap()
                .slice(
                    0,
                    SliceArg {
                        start: None,
                        stop: None,
                        step: -2,
                    },
                )
                .unwrap(),
        ),
        (
            "broadcast row",
            t.index(0, 1).unwrap().broadcast_to(&[2, 4]).unwrap(),
        ),
        ("expanded", t.expand_dims(1).unwrap()),
        ("scalar", t.index(0, 2).unwrap().index(0, 1).unwrap()),
        ("empty", t.slice(0, SliceArg::range(2, 2)).unwrap()),
    ]
}

/// Export then import gives the same memory (first element address), shape, strides and values,
/// for the versioned and the legacy struct; the import releases its reference when dropped.
#[test]
fn round_trip_is_zero_copy_for_strided_views() {
    let t = matrix();
    for (what, view) in strided_views(&t) {
        let refs = t.buffer().ref_count();
        let expected = view.to_vec::<i32>().unwrap();
        for legacy in [false, true] {
            let back = if legacy {
                let e = view.to_dlpack_legacy().unwrap();
                // SAFETY: a live export whose ownership we hand over.
                unsafe { Tensor::from_dlpack_legacy(e) }.unwrap()
            } else {
                let e = view.to_dlpack_versioned(dlpack::VERSION, false);
                // SAFETY: a live export whose ownership we hand over.
                unsafe { Tensor::from_dlpack_versioned(e) }.unwrap()
            };
            assert_eq!(first_element(&back), first_element(&view), "{what}");
            assert_eq!(back.shape(), view.shape(), "{what}");
            assert_eq!(back.strides(), view.strides(), "{what}");
            assert_eq!(back.dtype(), DType::I32, "{what}");
            assert_eq!(back.device(), Device::CPU, "{what}");
            assert_eq!(back.to_vec::<i32>().unwrap(), expected, "{what}");
            assert!(!back.buffer().same_allocation(view.buffer()));
            assert_eq!(t.buffer().ref_count(), refs + 1, "{what}: the import holds one ref");
            drop(back);
            assert_eq!(t.buffer().ref_count(), refs, "{what}: released on drop");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------------------------

/// A read-only view exports with `READ_ONLY` (and imports back read-only) and cannot be exported
/// as a legacy struct; the writable original exports without the flag.
#[test]
fn read_only_views_export_read_only() {
    let t = matrix();
    let ro = t.slice(0, SliceArg::range(0, 2)).unwrap().into_read_only();
    assert!(ro.is_read_only());
    assert!(!t.is_read_only());

    let e = ro.to_dlpack_versioned(dlpack::VERSION, false);
    // SAFETY: a live export we own.
    let flags = unsafe { (*e.as_ptr()).flags };
    assert_eq!(flags, DLPACK_FLAG_BITMASK_READ_ONLY);
    // SAFETY: ownership handed over.
    let back = unsafe { Tensor::from_dlpack_versioned(e) }.unwrap();
    assert!(back.is_read_only());
    assert_eq!(back.to_vec::<i32>().unwrap(), iota_i32(8));

    assert!(matches!(
        ro.to_dlpack_legacy(),
        Err(dlbridge::Error::ReadOnly(_))
    ));

    let e = t.to_dlpack_versioned(dlpack::VERSION, false);
    // SAFETY: a live export we own, deleted once.
    unsafe {
        assert_eq!((*e.as_ptr()).flags & DLPACK_FLAG_BITMASK_READ_ONLY, 0);
        delete_versioned(e);
    }
}

/// `IS_COPIED` is set exactly when asked for, alongside other flags.
#[test]
fn is_copied_flag_when_requested() {
    let t = matrix();
    let cases = [
        (t.clone(), false, 0),
        (t.clone(), true, DLPACK_FLAG_BITMASK_IS_COPIED),
        (
            t.clone().into_read_only(),
            true,
            DLPACK_FLAG_BITMASK_IS_COPIED | DLPACK_FLAG_BITMASK_READ_ONLY,
        ),
    ];
    for (view, is_copied, flags) in cases {
        let e = view.to_dlpack_versioned(dlpack::VERSION, is_copied);
        // SAFETY: a live export we own, deleted once.
        unsafe {
            assert_eq!((*e.as_ptr()).flags, flags);
            delete_versioned(e);
        }
    }
}

/// dlbridge's own sub-byte tensors are one element per byte, so their exports say
/// `IS_SUBBYTE_TYPE_PADDED` and import back unpacked.
#[test]
fn padded_sub_byte_export() {
    let dtype: DType = "float4_e2m1fn".parse().unwrap();
    let t = Tensor::zeros(&[3], dtype, Device::CPU).unwrap();
    assert!(!t.is_packed());
    let e = t.to_dlpack_versioned(dlpack::VERSION, false);
    // SAFETY: a live export we own.
    let flags = unsafe { (*e.as_ptr()).flags };
    assert_eq!(flags, DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED);
    // SAFETY: ownership handed over.
    let back = unsafe { Tensor::from_dlpack_versioned(e) }.unwrap();
    assert!(!back.is_packed());
    assert_eq!(back.nbytes(), 3);
}
