//! Importing DLPack tensors from hand-built producers (see `common`): zero-copy, the deleter's
//! "exactly once, when the last view goes" contract, every rejection rule, read-only tensors,
//! negative strides and byte offsets, opaque (Metal) handles and sub-byte element types.

mod common;

use std::thread;

use common::{Data, Spec, export_legacy, export_versioned};
use dlbridge::dlpack::ffi;
use dlbridge::dlpack::ffi::{
    DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED, DLPACK_FLAG_BITMASK_READ_ONLY, K_DL_FLOAT4_E2M1FN,
    K_DL_METAL,
};
use dlbridge::{DType, Device, DeviceKind, Error, SliceArg, Tensor};

fn iota(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

/// Imports `spec`, expects a failure that `expected` accepts, and checks that the producer's
/// deleter already ran exactly once when the import returned.
#[track_caller]
fn assert_rejected(spec: Spec, what: &str, expected: impl Fn(&Error) -> bool) {
    let imported = spec.import();
    let probe = imported.probe.clone();
    match imported.result {
        Ok(t) => panic!("{what}: import accepted: {t:?}"),
        Err(e) => {
            assert!(expected(&e), "{what}: wrong error {e:?}");
            assert_eq!(
                probe.deletes(),
                1,
                "{what}: deleter must run once on rejection"
            );
            drop(e);
        }
    }
    assert_eq!(probe.deletes(), 1, "{what}: deleter ran again");
}

// ---------------------------------------------------------------------------------------------
// Ownership and zero-copy
// ---------------------------------------------------------------------------------------------

/// A valid versioned import shares the producer's memory (first element at `data + byte_offset`)
/// and the deleter runs only when the last view (clones and derived views) is dropped.
#[test]
fn versioned_import_is_zero_copy_and_deleter_waits_for_last_view() {
    // Two leading junk floats, then the 2x3 tensor; byte_offset 8 skips the junk.
    let mut values = vec![-1.0, -2.0];
    values.extend(iota(6));
    let imported = Spec::f32(&values, &[2, 3]).byte_offset(8).import();
    let data = imported.data;
    let (t, probe) = imported.tensor();

    assert_eq!(t.shape(), &[2, 3]);
    assert_eq!(t.strides(), &[3, 1]);
    assert_eq!(t.dtype(), DType::F32);
    assert_eq!(t.device(), Device::CPU);
    assert!(t.buffer().is_foreign());
    assert!(!t.is_read_only());
    let slice = t.as_slice::<f32>().unwrap();
    assert_eq!(
        slice.as_ptr().cast::<u8>(),
        data.cast::<u8>().wrapping_add(8)
    );
    assert_eq!(slice, &iota(6)[..]);

    let row = t.index(0, 1).unwrap();
    let copy = t.clone();
    let col = t.slice(1, SliceArg::range(2, 3)).unwrap();
    drop(t);
    assert_eq!(probe.deletes(), 0, "views are alive");
    assert_eq!(row.to_vec::<f32>().unwrap(), vec![3.0, 4.0, 5.0]);
    drop(copy);
    assert_eq!(probe.deletes(), 0, "views are alive");
    assert_eq!(col.to_vec::<f32>().unwrap(), vec![2.0, 5.0]);
    drop(col);
    assert_eq!(probe.deletes(), 0, "one view is alive");
    drop(row);
    assert_eq!(probe.deletes(), 1);
}

/// The same contract for a legacy `DLManagedTensor`.
#[test]
fn legacy_import_is_zero_copy_and_deleter_waits_for_last_view() {
    let imported = Spec::f32(&iota(4), &[4]).legacy().import();
    let data = imported.data;
    let (t, probe) = imported.tensor();
    assert_eq!(t.as_slice::<f32>().unwrap().as_ptr().cast(), data);
    let view = t.slice(0, SliceArg::range(1, 3)).unwrap();
    drop(t);
    assert_eq!(probe.deletes(), 0);
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    drop(view);
    assert_eq!(probe.deletes(), 1);
}

/// Writes through a writable import land in the producer's own memory.
#[test]
fn writes_through_an_import_reach_the_producer() {
    let imported = Spec::f32(&iota(3), &[3]).import();
    // The producer's second element.
    let second = imported.base.cast::<f32>().wrapping_add(1);
    let (mut t, probe) = imported.tensor();
    t.as_mut_slice::<f32>().unwrap()[1] = 42.0;
    // SAFETY: the producer's storage lives until its deleter runs, which `t` prevents; the mutable
    // slice above is no longer alive.
    let seen = unsafe { second.read() };
    assert_eq!(seen, 42.0);
    drop(t);
    assert_eq!(probe.deletes(), 1);
}

/// Dropping the last view on another thread runs the deleter exactly once, on that thread.
#[test]
fn deleter_runs_on_the_thread_that_drops_the_last_view() {
    let (t, probe) = Spec::f32(&iota(6), &[2, 3]).import().tensor();
    let view = t.transpose().unwrap();
    drop(t);
    let dropper = thread::spawn(move || {
        assert_eq!(
            view.to_vec::<f32>().unwrap(),
            vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
        drop(view);
        thread::current().id()
    });
    let dropper_id = dropper.join().unwrap();
    assert_eq!(probe.deletes(), 1);
    assert_eq!(probe.thread(), Some(dropper_id));
    assert_ne!(probe.thread(), Some(thread::current().id()));
}

// ---------------------------------------------------------------------------------------------
// Rejections: each returns the right error and runs the deleter exactly once
// ---------------------------------------------------------------------------------------------

/// Only DLPack 1.x is spoken.
#[test]
fn rejects_unsupported_major_versions() {
    let good = Spec::f32(&iota(6), &[2, 3]);
    assert_rejected(good.clone().version(2, 0), "major 2", |e| {
        matches!(e, Error::UnsupportedVersion { major: 2, minor: 0 })
    });
    assert_rejected(good.version(0, 8), "major 0", |e| {
        matches!(e, Error::UnsupportedVersion { major: 0, minor: 8 })
    });
}

/// `ndim` must lie in `0..=64`.
#[test]
fn rejects_ndim_out_of_range() {
    let good = Spec::f32(&iota(1), &[1]);
    assert_rejected(good.clone().ndim(-1), "ndim -1", |e| {
        matches!(e, Error::MalformedTensor(_))
    });
    assert_rejected(good.clone().ndim(-1).legacy(), "legacy ndim -1", |e| {
        matches!(e, Error::MalformedTensor(_))
    });
    // Give the arrays 65 entries, so that even a reader that ignored the limit would stay in bounds.
    let ones = vec![1i64; 65];
    let spec = good.ndim(65).shape(Some(ones.clone())).strides(Some(ones));
    assert_rejected(spec, "ndim 65", |e| matches!(e, Error::MalformedTensor(_)));
}

/// `shape` may not be NULL for `ndim > 0`, and extents may not be negative.
#[test]
fn rejects_bad_shapes() {
    let good = Spec::f32(&iota(6), &[2, 3]);
    assert_rejected(good.clone().shape(None), "NULL shape", |e| {
        matches!(e, Error::MalformedTensor(_))
    });
    assert_rejected(
        good.clone().shape(None).legacy(),
        "legacy NULL shape",
        |e| matches!(e, Error::MalformedTensor(_)),
    );
    assert_rejected(good.shape(Some(vec![2, -3])), "negative extent", |e| {
        matches!(e, Error::MalformedTensor(_))
    });
}

/// NULL strides are refused from DLPack >= 1.2 producers when `ndim > 0` ...
#[test]
fn rejects_null_strides_from_1_2_and_later() {
    for minor in [2, 3] {
        let spec = Spec::f32(&iota(6), &[2, 3]).version(1, minor).strides(None);
        assert_rejected(spec, &format!("NULL strides, 1.{minor}"), |e| {
            matches!(e, Error::MalformedTensor(_))
        });
    }
}

/// ... but mean compact row-major from 1.1 and legacy producers, and are fine for 0-d tensors.
#[test]
fn accepts_null_strides_as_row_major_before_1_2() {
    for spec in [
        Spec::f32(&iota(6), &[2, 3]).version(1, 1).strides(None),
        Spec::f32(&iota(6), &[2, 3]).legacy().strides(None),
    ] {
        let (t, probe) = spec.import().tensor();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.strides(), &[3, 1]);
        assert_eq!(t.to_vec::<f32>().unwrap(), iota(6));
        drop(t);
        assert_eq!(probe.deletes(), 1);
    }
    // A 0-d tensor needs neither array, whatever the version.
    let spec = Spec::f32(&[7.0], &[]).shape(None).strides(None);
    let (t, probe) = spec.import().tensor();
    assert_eq!(t.ndim(), 0);
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![7.0]);
    drop(t);
    assert_eq!(probe.deletes(), 1);
}

/// Unknown type codes, widths a code does not allow, and zero lanes are refused.
#[test]
fn rejects_unsupported_dtypes() {
    let good = Spec::f32(&iota(4), &[4]);
    let cases = [
        (good.clone().dtype(99, 32, 1), "code 99"),
        (good.clone().dtype(ffi::K_DL_FLOAT, 24, 1), "float24"),
        (good.clone().dtype(ffi::K_DL_FLOAT, 32, 0), "0 lanes"),
        (good.dtype(99, 32, 1).legacy(), "legacy code 99"),
    ];
    for (spec, what) in cases {
        assert_rejected(spec, what, |e| matches!(e, Error::UnsupportedDType(_)));
    }
}

/// Device types DLPack does not define are refused; a negative device id is malformed.
#[test]
fn rejects_bad_devices() {
    let good = Spec::f32(&iota(4), &[4]);
    for device_type in [0, 5, 99] {
        assert_rejected(
            good.clone().device(device_type, 0),
            &format!("device type {device_type}"),
            |e| matches!(e, Error::UnsupportedDevice(_)),
        );
    }
    assert_rejected(good.device(ffi::K_DL_CPU, -1), "device_id -1", |e| {
        matches!(e, Error::MalformedTensor(_))
    });
}

/// `data` may be NULL only when there are no elements.
#[test]
fn null_data_only_for_empty_tensors() {
    assert_rejected(
        Spec::f32(&iota(6), &[2, 3]).data(Data::Null),
        "NULL data, 6 elements",
        |e| matches!(e, Error::MalformedTensor(_)),
    );

    let (t, probe) = Spec::f32(&[], &[3, 0]).data(Data::Null).import().tensor();
    assert_eq!(t.shape(), &[3, 0]);
    assert_eq!(t.numel(), 0);
    assert_eq!(t.as_slice::<f32>().unwrap(), &[] as &[f32]);
    assert_eq!(t.to_vec::<f32>().unwrap(), Vec::<f32>::new());
    drop(t);
    assert_eq!(probe.deletes(), 1);
}

/// Offsets and extents that do not fit the address space are refused as overflows.
#[test]
fn rejects_overflowing_offsets_and_extents() {
    let good = Spec::f32(&iota(2), &[2]);
    for byte_offset in [isize::MAX as u64 + 1, u64::MAX] {
        assert_rejected(
            good.clone().byte_offset(byte_offset),
            &format!("byte_offset {byte_offset}"),
            |e| matches!(e, Error::Overflow(_)),
        );
    }
    // 2^80 elements.
    assert_rejected(Spec::f32(&[], &[1 << 40, 1 << 40]), "2^80 elements", |e| {
        matches!(e, Error::Overflow(_))
    });
    // The last element lies 2^61 * 4 = 2^63 bytes past the first: more than isize::MAX.
    assert_rejected(
        good.clone().strides(Some(vec![1 << 61])),
        "stride 2^61",
        |e| matches!(e, Error::Overflow(_)),
    );
    // Two axes whose reaches add up past isize::MAX, each of which fits on its own.
    let spec = Spec::f32(&iota(4), &[2, 2]).strides(Some(vec![1 << 60, 1 << 60]));
    assert_rejected(spec, "strides 2^60, 2^60", |e| {
        matches!(e, Error::Overflow(_))
    });
}

/// `data + byte_offset` past `isize::MAX` lies in the kernel's half of the address space (or wraps
/// around it), where no user-space pointer can be, though the offset alone fits.
#[test]
fn rejects_addresses_past_user_space() {
    let good = Spec::f32(&iota(2), &[2]);
    for byte_offset in [isize::MAX as u64, isize::MAX as u64 - 4095] {
        assert_rejected(
            good.clone().byte_offset(byte_offset),
            &format!("real data with byte_offset {byte_offset}"),
            |e| matches!(e, Error::MalformedTensor(m) if m.contains("user address space")),
        );
    }
}

/// The C exchange table's chain is followed a bounded number of links: a loop ends the walk.
#[test]
fn exchange_table_chains_are_walked_a_bounded_number_of_links() {
    use dlbridge::dlpack::{EXCHANGE_CHAIN_LIMIT, exchange_table_v1};
    use ffi::{DLPackExchangeAPI, DLPackExchangeAPIHeader};
    unsafe extern "C" fn from_py(
        _: *mut std::ffi::c_void,
        _: *mut *mut ffi::DLManagedTensorVersioned,
    ) -> i32 {
        -1
    }
    let table = |major: u32, complete: bool| DLPackExchangeAPI {
        header: DLPackExchangeAPIHeader {
            version: ffi::DLPackVersion { major, minor: 0 },
            prev_api: std::ptr::null_mut(),
        },
        managed_tensor_allocator: None,
        managed_tensor_from_py_object_no_sync: complete.then_some(from_py as _),
        managed_tensor_to_py_object_no_sync: None,
        dltensor_from_py_object_no_sync: None,
        current_work_stream: None,
    };
    // tables[i] links to tables[i + 1]; the last links back to the first when `looped`.
    let chain = |majors: &[(u32, bool)], looped: bool| {
        let mut tables: Vec<Box<DLPackExchangeAPI>> =
            majors.iter().map(|&(m, c)| Box::new(table(m, c))).collect();
        let ptrs: Vec<*mut DLPackExchangeAPIHeader> = tables
            .iter_mut()
            .map(|t| (&raw mut **t).cast::<DLPackExchangeAPIHeader>())
            .collect();
        for (i, t) in tables.iter_mut().enumerate() {
            t.header.prev_api = match ptrs.get(i + 1) {
                Some(&p) => p,
                None if looped => ptrs[0],
                None => std::ptr::null_mut(),
            };
        }
        (tables, ptrs[0])
    };
    let find = |majors: &[(u32, bool)], looped: bool| {
        let (tables, first) = chain(majors, looped);
        // SAFETY: every link is NULL or one of `tables`, alive until the end of this closure.
        let found = unsafe { exchange_table_v1(first) };
        found.map(|api| {
            tables
                .iter()
                .position(|t| std::ptr::eq(&**t, api))
                .expect("one of the chain's tables")
        })
    };
    assert_eq!(find(&[(1, true)], false), Some(0));
    assert_eq!(find(&[(2, true), (1, true)], false), Some(1));
    assert_eq!(
        find(&[(1, false), (1, true)], false),
        None,
        "an incomplete v1 table"
    );
    assert_eq!(find(&[(2, true), (0, true)], false), None);
    // Loops of every length, with no major-1 table: the walk ends (before the fix, it spun).
    for len in 1..=EXCHANGE_CHAIN_LIMIT + 2 {
        assert_eq!(find(&vec![(0, true); len], true), None, "loop of {len}");
    }
    // A major-1 table behind more links than the limit is not reached.
    let mut far = vec![(2, true); EXCHANGE_CHAIN_LIMIT];
    far.push((1, true));
    assert_eq!(find(&far, false), None);
    far.remove(0);
    assert_eq!(find(&far, false), Some(EXCHANGE_CHAIN_LIMIT - 1));
    // SAFETY: NULL is an empty chain.
    assert!(unsafe { exchange_table_v1::<'static>(std::ptr::null()) }.is_none());
}

/// An opaque handle (Metal) cannot be offset backwards: negative strides that reach before the
/// handle are out of bounds. Reaching exactly to the handle is fine. The fake handle is never read.
#[test]
fn opaque_handle_negative_strides_must_stay_after_the_handle() {
    let metal = Spec::f32(&[], &[4])
        .data(Data::Fake(0x1000))
        .device(K_DL_METAL, 0)
        .strides(Some(vec![-1]));
    assert_rejected(
        metal.clone().byte_offset(8),
        "reaches 4 bytes before",
        |e| matches!(e, Error::OutOfBounds(_)),
    );

    let (t, probe) = metal.byte_offset(12).import().tensor();
    assert_eq!(t.byte_offset(), 12);
    assert_eq!(t.strides(), &[-1]);
    assert_eq!(t.byte_range(), 0..16);
    drop(t);
    assert_eq!(probe.deletes(), 1);
}

// ---------------------------------------------------------------------------------------------
// Read-only tensors
// ---------------------------------------------------------------------------------------------

/// `READ_ONLY` is imported and enforced, survives a versioned re-export, and forbids a legacy one.
#[test]
fn read_only_flag_is_imported_and_enforced() {
    let spec = Spec::f32(&iota(4), &[4]).flags(DLPACK_FLAG_BITMASK_READ_ONLY);
    let (mut t, probe) = spec.import().tensor();
    assert!(t.is_read_only());
    assert!(t.buffer().is_read_only());
    assert!(matches!(t.as_mut_slice::<f32>(), Err(Error::ReadOnly(_))));
    let src = dlbridge::Tensor::from_slice(&[9.0f32; 4], &[4]).unwrap();
    assert!(matches!(t.copy_from(&src), Err(Error::ReadOnly(_))));
    assert_eq!(t.to_vec::<f32>().unwrap(), iota(4), "nothing was written");
    // Derived views stay read-only.
    assert!(t.slice(0, SliceArg::range(1, 3)).unwrap().is_read_only());

    assert!(matches!(export_legacy(&t), Err(Error::ReadOnly(_))));

    let exported = export_versioned(&t, false);
    assert_ne!(exported.flags() & DLPACK_FLAG_BITMASK_READ_ONLY, 0);
    drop(t);
    assert_eq!(probe.deletes(), 0, "the export keeps the producer alive");
    drop(exported); // calls its deleter
    assert_eq!(probe.deletes(), 1);
}

// ---------------------------------------------------------------------------------------------
// Negative strides and byte offsets on the host
// ---------------------------------------------------------------------------------------------

/// `data` at the last element with stride -1 reads the producer's elements backwards.
#[test]
fn negative_strides_on_cpu() {
    let imported = Spec::f32(&iota(5), &[5])
        .data_shift(16)
        .strides(Some(vec![-1]))
        .import();
    let data = imported.data;
    let (t, probe) = imported.tensor();
    assert_eq!(t.strides(), &[-1]);
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![4.0, 3.0, 2.0, 1.0, 0.0]);
    // The first element is where the producer's `data` points.
    let first = t
        .buffer()
        .host_ptr()
        .unwrap()
        .as_ptr()
        .wrapping_add(t.byte_offset());
    assert_eq!(first, data.cast::<u8>());
    assert_eq!(t.nbytes(), 20);
    drop(t);
    assert_eq!(probe.deletes(), 1);

    // Rows reversed: `data` at row 1, row stride -3.
    let (t, probe) = Spec::f32(&iota(6), &[2, 3])
        .data_shift(12)
        .strides(Some(vec![-3, 1]))
        .import()
        .tensor();
    assert_eq!(
        t.to_vec::<f32>().unwrap(),
        vec![3.0, 4.0, 5.0, 0.0, 1.0, 2.0]
    );
    drop(t);
    assert_eq!(probe.deletes(), 1);
}

/// A nonzero `byte_offset` is honoured: the tensor starts 16 bytes (4 floats) past `data`.
#[test]
fn byte_offset_on_cpu() {
    let imported = Spec::f32(&iota(10), &[2, 3]).byte_offset(16).import();
    let data = imported.data;
    let (t, probe) = imported.tensor();
    assert_eq!(
        t.to_vec::<f32>().unwrap(),
        vec![4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    );
    assert_eq!(
        t.as_slice::<f32>().unwrap().as_ptr().cast::<u8>(),
        data.cast::<u8>().wrapping_add(16)
    );
    drop(t);
    assert_eq!(probe.deletes(), 1);
}

// ---------------------------------------------------------------------------------------------
// Opaque devices
// ---------------------------------------------------------------------------------------------

/// A Metal tensor is held by its handle: the offset stays in `byte_offset`, a re-export hands the
/// same handle back unchanged, and host access is refused.
#[test]
fn opaque_metal_handle_round_trips_untouched() {
    let spec = Spec::f32(&[], &[2, 2])
        .data(Data::Fake(0x1000))
        .device(K_DL_METAL, 3)
        .byte_offset(256);
    let (t, probe) = spec.import().tensor();
    assert_eq!(t.device(), Device::new(DeviceKind::Metal, 3));
    assert_eq!(t.byte_offset(), 256);
    assert_eq!(t.buffer().handle() as usize, 0x1000);
    assert!(t.buffer().host_ptr().is_none());
    assert!(matches!(
        t.as_slice::<f32>(),
        Err(Error::NotHostAccessible { .. })
    ));
    assert!(matches!(
        t.to_vec::<f32>(),
        Err(Error::NotHostAccessible { .. })
    ));

    // A view moves only the offset; both exports carry the untouched handle.
    let row1 = t.index(0, 1).unwrap();
    assert_eq!(row1.byte_offset(), 256 + 8);
    let cases = [
        (&t, 256, &[2i64, 2][..], &[2i64, 1][..]),
        (&row1, 264, &[2], &[1]),
    ];
    for (view, offset, shape, strides) in cases {
        let e = export_versioned(view, false);
        let dl = e.dl();
        assert_eq!(dl.data as usize, 0x1000);
        assert_eq!(dl.byte_offset, offset);
        assert_eq!(dl.device.device_type, K_DL_METAL);
        assert_eq!(dl.device.device_id, 3);
        assert_eq!(e.shape(), shape);
        assert_eq!(e.strides(), strides);
    }
    let legacy = export_legacy(&t).unwrap();
    assert_eq!(legacy.dl().data as usize, 0x1000);
    assert_eq!(legacy.dl().byte_offset, 256);
    drop(legacy);
    drop(row1);
    assert_eq!(probe.deletes(), 0);
    drop(t);
    assert_eq!(probe.deletes(), 1);
}

/// CUDA pointers are addresses: the import may rebase them and the export puts `data` at the first
/// element with `byte_offset` 0, but the host may not read them. Other devices (Vulkan) are opaque
/// handles, handed back unchanged. CUDA host memory is host-accessible. No fake pointer is read.
#[test]
fn addressable_and_opaque_devices() {
    // Where a CUDA driver and device exist, the importer asks the driver about CUDA pointers, so
    // the CUDA case uses real device memory there (on device 0); elsewhere nothing can check the
    // pointer, and a made-up one on device 1 is held as it came. Either way the same rules hold.
    let real = Tensor::empty(&[32], DType::F32, Device::cuda(0)).ok();
    let (cuda_base, cuda_id) = match &real {
        Some(t) => (t.buffer().handle().expose_provenance(), 0),
        None => (0x10_0000, 1),
    };
    let fake = |device_type: i32, base: usize, id: i32| {
        Spec::f32(&[], &[2, 2])
            .data(Data::Fake(base))
            .device(device_type, id)
            .byte_offset(64)
    };
    for (device_type, kind, base, id, data, byte_offset) in [
        (
            ffi::K_DL_CUDA,
            DeviceKind::Cuda,
            cuda_base,
            cuda_id,
            cuda_base + 64,
            0,
        ),
        (
            ffi::K_DL_VULKAN,
            DeviceKind::Other(ffi::K_DL_VULKAN),
            0x10_0000,
            1,
            0x10_0000,
            64,
        ),
    ] {
        let (t, probe) = fake(device_type, base, id).import().tensor();
        assert_eq!(t.device(), Device::new(kind, id as u32));
        assert!(t.buffer().host_ptr().is_none());
        assert!(matches!(
            t.as_slice::<f32>(),
            Err(Error::NotHostAccessible { .. })
        ));
        let e = export_versioned(&t, false);
        assert_eq!(e.dl().data as usize, data, "device type {device_type}");
        assert_eq!(e.dl().byte_offset, byte_offset, "device type {device_type}");
        assert_eq!(e.dl().device.device_type, device_type);
        assert_eq!(e.dl().device.device_id, id);
        drop(e);
        drop(t);
        assert_eq!(probe.deletes(), 1);
    }

    // Pinned host memory is addressable from the host. Where a CUDA driver exists it is asked
    // about the pointer, so the memory must really be pinned: dlbridge's own pinned memory there.
    let pinned = real.as_ref().map(|_| {
        let mut p = Tensor::empty(&[4], DType::F32, Device::cuda_host(0)).unwrap();
        p.as_mut_slice::<f32>().unwrap().copy_from_slice(&iota(4));
        p
    });
    let spec = match &pinned {
        Some(p) => Spec::f32(&[], &[4]).data(Data::Fake(p.buffer().handle().expose_provenance())),
        None => Spec::f32(&iota(4), &[4]),
    };
    let (t, probe) = spec.device(ffi::K_DL_CUDA_HOST, 0).import().tensor();
    assert_eq!(t.device().kind(), DeviceKind::CudaHost);
    assert_eq!(t.as_slice::<f32>().unwrap(), &iota(4)[..]);
    drop(t);
    assert_eq!(probe.deletes(), 1);
}

// ---------------------------------------------------------------------------------------------
// Sub-byte element types
// ---------------------------------------------------------------------------------------------

/// Packed 4-bit floats are accepted when compact (two per byte, rounded up) and refused otherwise;
/// with `IS_SUBBYTE_TYPE_PADDED` (one per byte) any strides are fine.
#[test]
fn sub_byte_float4_packed_and_padded() {
    let float4 = |spec: Spec| spec.dtype(K_DL_FLOAT4_E2M1FN, 4, 1);
    let packed = |shape: &[i64]| {
        float4(Spec::f32(&[], shape)).data(Data::Storage {
            bytes: vec![0x21, 0x43, 0x65, 0x87],
            shift: 0,
        })
    };

    // 5 packed elements occupy ceil(5 / 2) = 3 bytes.
    let (t, probe) = packed(&[5]).import().tensor();
    assert_eq!(t.dtype().to_string(), "float4_e2m1fn");
    assert!(t.is_packed());
    assert_eq!(t.nbytes(), 3);
    assert_eq!(t.byte_range(), 0..3);
    // Re-exported packed: no PADDED flag.
    let e = export_versioned(&t, false);
    assert_eq!(e.flags() & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED, 0);
    assert_eq!(e.dl().dtype.code, K_DL_FLOAT4_E2M1FN);
    assert_eq!(e.dl().dtype.bits, 4);
    drop(e);
    drop(t);
    assert_eq!(probe.deletes(), 1);

    let (t, probe) = packed(&[2, 3]).import().tensor();
    assert_eq!(t.nbytes(), 3);
    drop(t);
    assert_eq!(probe.deletes(), 1);

    // Packed but every other element: not compact.
    assert_rejected(
        packed(&[3]).strides(Some(vec![2])),
        "packed strided float4",
        |e| matches!(e, Error::MalformedTensor(_)),
    );

    // Padded: one byte per element, so the same strides address bytes 0, 2 and 4.
    let padded = packed(&[3])
        .strides(Some(vec![2]))
        .data(Data::Storage {
            bytes: vec![1, 0, 2, 0, 3, 0],
            shift: 0,
        })
        .flags(DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED);
    let (t, probe) = padded.import().tensor();
    assert!(!t.is_packed());
    assert_eq!(t.nbytes(), 3);
    assert_eq!(t.byte_range(), 0..5);
    let e = export_versioned(&t, false);
    assert_ne!(e.flags() & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED, 0);
    drop(e);
    drop(t);
    assert_eq!(probe.deletes(), 1);
}

/// Strides whose extent cannot be represented are an overflow, whatever the magnitude.
#[test]
fn huge_strides_are_an_overflow() {
    for strides in [
        vec![i64::MAX],
        vec![1 << 62],
        vec![-(1 << 61)],
        vec![-i64::MAX],
    ] {
        let imported = Spec::f32(&[0.0, 1.0], &[2])
            .strides(Some(strides.clone()))
            .import();
        let err = imported.result.unwrap_err();
        assert!(
            matches!(err, Error::Overflow(_)),
            "strides {strides:?}: {err:?}"
        );
        assert_eq!(imported.probe.deletes(), 1);
    }
}
