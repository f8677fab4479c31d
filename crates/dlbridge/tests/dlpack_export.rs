//! Exporting tensors through DLPack: every field of the exported structs, the reference the export
//! holds on the buffer, zero-copy round trips of strided views, deleters called from other threads,
//! and the `READ_ONLY` / `IS_COPIED` / `IS_SUBBYTE_TYPE_PADDED` flags.
//!
//! Exports are held through `common::Export`, which reads the fields and calls the deleter once,
//! on drop, as a consumer would.

mod common;

use std::thread;

use common::{Export, Managed, Spec, export_legacy, export_versioned, round_trip};
use dlbridge::dlpack::ffi::{
    DLDataType, DLPACK_FLAG_BITMASK_IS_COPIED, DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED,
    DLPACK_FLAG_BITMASK_READ_ONLY, DLPackVersion, K_DL_CPU,
};
use dlbridge::dlpack::{self, ffi};
use dlbridge::{DType, Device, Error, SliceArg, Tensor};

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

/// Checks the descriptor of an export of the CPU view `t`: `data` is the first element's address
/// and `byte_offset` 0; ndim, dtype and device match; shape and strides are non-NULL (even for 0-d
/// views) and match.
#[track_caller]
fn assert_describes<M: Managed>(e: &Export<M>, t: &Tensor) {
    let dl = e.dl();
    assert_eq!(dl.data.cast::<u8>(), first_element(t));
    assert_eq!(dl.byte_offset, 0);
    assert_eq!(dl.ndim as usize, t.ndim());
    assert_eq!(dl.dtype, t.dtype().to_dlpack());
    assert_eq!(dl.device.device_type, K_DL_CPU);
    assert_eq!(dl.device.device_id, 0);
    let shape: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
    let strides: Vec<i64> = t.strides().iter().map(|&s| s as i64).collect();
    assert_eq!(e.shape(), &shape[..]);
    assert_eq!(e.strides(), &strides[..]);
}

// ---------------------------------------------------------------------------------------------
// Fields
// ---------------------------------------------------------------------------------------------

/// A versioned export of a column slice: version, flags, manager_ctx, deleter and the descriptor.
#[test]
fn versioned_export_fields() {
    assert_eq!(dlpack::VERSION, DLPackVersion { major: 1, minor: 3 });
    let t = matrix();
    let view = t.slice(1, SliceArg::range(1, 3)).unwrap(); // shape [3, 2], strides [4, 1]
    assert_eq!(view.byte_offset(), 4);
    for version in [dlpack::VERSION, DLPackVersion { major: 1, minor: 1 }] {
        // SAFETY: a fresh export we own, with `ndim`-long arrays.
        let e = unsafe { Export::new(view.to_dlpack_versioned(version, false)) };
        let m = e.get();
        assert_eq!(m.version, version);
        assert_eq!(m.flags, 0);
        assert!(!m.manager_ctx.is_null());
        assert!(m.deleter.is_some());
        assert_describes(&e, &view);
        assert_eq!((e.shape(), e.strides()), (&[3i64, 2][..], &[4i64, 1][..]));
        // SAFETY: `data` is the first element of a live int32 view.
        assert_eq!(unsafe { *e.dl().data.cast::<i32>() }, 1);
    }
}

/// A legacy export carries the same descriptor.
#[test]
fn legacy_export_fields() {
    let t = matrix();
    let view = t.transpose().unwrap();
    let e = export_legacy(&view).unwrap();
    assert!(!e.get().manager_ctx.is_null());
    assert!(e.get().deleter.is_some());
    assert_describes(&e, &view);
    assert_eq!((e.shape(), e.strides()), (&[4i64, 3][..], &[1i64, 4][..]));
}

/// 0-d and zero-size tensors still get non-NULL shape and strides arrays.
#[test]
fn export_of_0d_and_empty_tensors() {
    let scalar = matrix().index(0, 2).unwrap().index(0, 3).unwrap();
    assert_eq!(scalar.ndim(), 0);
    let empty = Tensor::zeros(&[0, 3], DType::F64, Device::CPU).unwrap();
    for t in [&scalar, &empty] {
        assert_describes(&export_versioned(t, false), t);
        assert_describes(&export_legacy(t).unwrap(), t);
    }
    let e = export_versioned(&scalar, false);
    // SAFETY: `data` is the one element of a live 0-d int32 view.
    assert_eq!(unsafe { *e.dl().data.cast::<i32>() }, 11);
}

/// Shapes of 8 axes (the most an export keeps inside its own allocation) and of 9 and 20 axes
/// (kept on the heap) are described exactly, in both flavours.
#[test]
fn export_of_many_axes() {
    for ndim in [8usize, 9, 20] {
        let shape: Vec<usize> = (0..ndim).map(|i| 1 + i % 2).collect();
        let t = Tensor::zeros(&shape, DType::F32, Device::CPU).unwrap();
        let view = t.transpose().unwrap();
        assert_describes(&export_versioned(&view, false), &view);
        assert_describes(&export_legacy(&view).unwrap(), &view);
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
        let e = export_versioned(&t, false);
        assert_eq!(e.dl().dtype, DLDataType { code, bits, lanes }, "{name}");
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

    let versioned = export_versioned(&t, false);
    assert_eq!(buffer.ref_count(), 3);
    let legacy = export_legacy(&t).unwrap();
    assert_eq!(buffer.ref_count(), 4);
    drop(t);
    assert_eq!(buffer.ref_count(), 3);

    for data in [versioned.dl().data, legacy.dl().data] {
        // SAFETY: each export keeps its 12 int32 elements alive.
        let values = unsafe { std::slice::from_raw_parts(data.cast::<i32>(), 12) };
        assert_eq!(values, &iota_i32(12)[..]);
    }
    drop(versioned); // calls the deleter
    assert_eq!(buffer.ref_count(), 2);
    drop(legacy);
    assert_eq!(buffer.ref_count(), 1);
}

/// Re-exporting an imported tensor keeps the original producer alive until the export's deleter
/// runs, after the tensor itself is gone.
#[test]
fn export_of_an_import_keeps_the_producer_alive() {
    let (t, probe) = Spec::f32(&[1.0, 2.0, 3.0], &[3]).import().tensor();
    let e = export_versioned(&t, false);
    drop(t);
    assert_eq!(probe.deletes(), 0);
    drop(e);
    assert_eq!(probe.deletes(), 1);
}

/// The deleter may be called from any thread; it releases the reference there.
#[test]
fn deleter_called_from_another_thread() {
    let t = matrix();
    let buffer = t.buffer().clone();
    let e = export_versioned(&t, false);
    drop(t);
    assert_eq!(buffer.ref_count(), 2);
    thread::spawn(move || drop(e)).join().unwrap();
    assert_eq!(buffer.ref_count(), 1);

    // Through a foreign producer: the export's deleter, called on another thread, drops the last
    // reference, so the producer's deleter runs on that thread.
    let (t, probe) = Spec::f32(&[1.0], &[1]).import().tensor();
    let e = export_legacy(&t).unwrap();
    drop(t);
    let id = thread::spawn(move || {
        drop(e);
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
    let step = |start: Option<isize>, step: isize| SliceArg {
        start,
        stop: None,
        step,
    };
    let rev = step(None, -1);
    vec![
        ("whole", t.clone()),
        ("rows 1..3", t.slice(0, SliceArg::range(1, 3)).unwrap()),
        ("every other column", t.slice(1, step(Some(1), 2)).unwrap()),
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
            t.index(1, 2).unwrap().slice(0, step(None, -2)).unwrap(),
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
            let back = round_trip(&view, legacy).unwrap();
            assert_eq!(first_element(&back), first_element(&view), "{what}");
            assert_eq!(back.shape(), view.shape(), "{what}");
            assert_eq!(back.strides(), view.strides(), "{what}");
            assert_eq!(back.dtype(), DType::I32, "{what}");
            assert_eq!(back.device(), Device::CPU, "{what}");
            assert_eq!(back.to_vec::<i32>().unwrap(), expected, "{what}");
            assert!(!back.buffer().same_allocation(view.buffer()));
            assert_eq!(
                t.buffer().ref_count(),
                refs + 1,
                "{what}: the import holds one ref"
            );
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

    assert_eq!(
        export_versioned(&ro, false).flags(),
        DLPACK_FLAG_BITMASK_READ_ONLY
    );
    let back = round_trip(&ro, false).unwrap();
    assert!(back.is_read_only());
    assert_eq!(back.to_vec::<i32>().unwrap(), iota_i32(8));

    assert!(matches!(export_legacy(&ro), Err(Error::ReadOnly(_))));
    assert_eq!(export_versioned(&t, false).flags(), 0);
}

/// `IS_COPIED` is set exactly when asked for, alongside other flags.
#[test]
fn is_copied_flag_when_requested() {
    let t = matrix();
    let ro = t.clone().into_read_only();
    assert_eq!(export_versioned(&t, false).flags(), 0);
    assert_eq!(
        export_versioned(&t, true).flags(),
        DLPACK_FLAG_BITMASK_IS_COPIED
    );
    assert_eq!(
        export_versioned(&ro, true).flags(),
        DLPACK_FLAG_BITMASK_IS_COPIED | DLPACK_FLAG_BITMASK_READ_ONLY
    );
}

/// dlbridge's own sub-byte tensors are one element per byte, so their exports say
/// `IS_SUBBYTE_TYPE_PADDED` and import back unpacked.
#[test]
fn padded_sub_byte_export() {
    let dtype: DType = "float4_e2m1fn".parse().unwrap();
    let t = Tensor::zeros(&[3], dtype, Device::CPU).unwrap();
    assert!(!t.is_packed());
    assert_eq!(
        export_versioned(&t, false).flags(),
        DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED
    );
    let back = round_trip(&t, false).unwrap();
    assert!(!back.is_packed());
    assert_eq!(back.nbytes(), 3);
}
