//! Imports hostile `DLManagedTensorVersioned` / `DLManagedTensor` descriptors.
//!
//! Each input builds one producer: a descriptor (ndim, shape, strides, dtype, device, byte offset,
//! flags, version, all from the fuzz bytes) over a real heap buffer that the producer owns, with
//! `data` pointing into that buffer, NULL, or anywhere. Checked:
//! - the producer's deleter runs exactly once: at once when the import fails, and only after the
//!   tensor and every clone and view of it are dropped when it succeeds;
//! - the imported buffer's bytes are exactly `[data + byte_offset + lo, data + byte_offset + hi)`
//!   computed independently from the descriptor;
//! - when those bytes lie inside the real buffer, a copy of the tensor equals an element-by-element
//!   gather from the descriptor;
//! - exporting the tensor again and importing the export gives the same tensor;
//! - nothing panics.
//!
//! The deleter frees the buffer and the shape and strides arrays, so with AddressSanitizer any
//! use of them after the deleter (or any read past `ndim` entries) is reported.

#![no_main]

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use dlbridge::dlpack::ffi::{
    DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned,
    DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED, DLPACK_FLAG_BITMASK_READ_ONLY, DLPackVersion,
    DLTensor, K_DL_CPU, K_DL_CUDA,
};
use dlbridge::{DeviceKind, Tensor};
use fuzz_support::{Input, element_offset, for_each_index, reference_extent};
use libfuzzer_sys::fuzz_target;

/// What the deleter frees: the memory the descriptor points into.
struct Owned {
    _buffer: Vec<u64>,
    _shape: Vec<i64>,
    _strides: Vec<i64>,
}

/// One producer. The harness owns this box (and frees it at the end of the case); the deleter only
/// counts the call and drops `owned`, so a second call is seen by the count, not as a double free.
#[repr(C)]
struct Producer<M> {
    managed: M,
    deletions: AtomicUsize,
    owned: Option<Owned>,
}

unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: `managed` is the first field of a live `Producer` (the harness frees it last).
    unsafe { delete(managed.cast::<Producer<DLManagedTensorVersioned>>()) }
}

unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    // SAFETY: as in `delete_versioned`.
    unsafe { delete(managed.cast::<Producer<DLManagedTensor>>()) }
}

/// # Safety
/// `producer` points to a live `Producer` no one else is using.
unsafe fn delete<M>(producer: *mut Producer<M>) {
    // SAFETY: forwarded.
    let producer = unsafe { &mut *producer };
    producer.deletions.fetch_add(1, Ordering::SeqCst);
    producer.owned = None;
}

/// The descriptor as the harness understands it, for the reference computations.
struct Plan {
    ndim: i32,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    dtype: DLDataType,
    device: DLDevice,
    byte_offset: u64,
    flags: u64,
    version: DLPackVersion,
    legacy: bool,
    /// Where `data` points: `Some(k)` is byte `k` of the buffer.
    data_at: Option<usize>,
    raw_data: usize,
    buffer_len: usize,
    null_shape: bool,
    with_deleter: bool,
}

const DTYPES: &[(u8, u8, u16)] = &[
    (2, 32, 1),  // float32
    (2, 64, 1),  // float64
    (0, 8, 1),   // int8
    (1, 8, 1),   // uint8
    (0, 16, 1),  // int16
    (0, 64, 1),  // int64
    (6, 8, 1),   // bool
    (4, 16, 1),  // bfloat16
    (5, 64, 1),  // complex64
    (5, 128, 1), // complex128
    (2, 32, 4),  // float32x4
    (17, 4, 1),  // float4_e2m1fn (sub-byte)
    (15, 6, 1),  // float6_e2m3fn (sub-byte)
    (10, 8, 1),  // float8_e4m3fn
    (2, 16, 1),  // float16
    (0, 4, 1),   // int4 (sub-byte)
];

fn plan(input: &mut Input) -> Plan {
    let legacy = input.u8() & 1 == 1;
    let ndim = match input.u8() {
        b @ 0..=199 => i32::from(b % 5),
        b @ 200..=239 => i32::from(b - 200) + 5,
        240 => 64,
        241 => 65,
        242 => 128,
        243 => -1,
        244 => i32::MIN,
        245 => i32::MAX,
        _ => input.u32() as i32,
    };
    let entries = ndim.clamp(0, 128) as usize;
    let shape: Vec<i64> = (0..entries).map(|_| input.extent()).collect();
    let null_strides = input.u8() < 24;
    let strides: Vec<i64> = (0..entries).map(|_| input.stride()).collect();
    let dtype = match input.u8() {
        b @ 0..=239 => {
            let (code, bits, lanes) = DTYPES[b as usize % DTYPES.len()];
            DLDataType { code, bits, lanes }
        }
        _ => DLDataType {
            code: input.u8(),
            bits: input.u8(),
            lanes: input.u16(),
        },
    };
    let device = match input.u8() {
        0..=199 => DLDevice {
            device_type: K_DL_CPU,
            device_id: 0,
        },
        200..=229 => DLDevice {
            device_type: K_DL_CUDA,
            device_id: i32::from(input.u8() % 4) - 1,
        },
        _ => DLDevice {
            device_type: input.u32() as i32 % 24,
            device_id: input.u32() as i32,
        },
    };
    let buffer_len = usize::from(input.u16() % 4097);
    let (data_at, raw_data) = match input.u8() {
        0..=219 => (Some(usize::from(input.u16()) % (buffer_len + 1)), 0),
        220..=234 => (None, 0),
        _ => (None, input.u64() as usize),
    };
    let byte_offset = match input.u8() {
        0..=159 => 0,
        160..=229 => u64::from(input.u16() % 4097),
        230 => u64::MAX,
        231 => i64::MAX as u64,
        232 => (i64::MAX as u64) + 1,
        _ => input.u64(),
    };
    let flags = match input.u8() {
        0..=239 => u64::from(input.u8() & 7),
        _ => input.u64(),
    };
    let version = match input.u8() {
        0..=229 => DLPackVersion {
            major: 1,
            minor: u32::from(input.u8() % 5),
        },
        _ => DLPackVersion {
            major: input.u32() % 4,
            minor: input.u32(),
        },
    };
    let null_shape = input.u8() > 250;
    let with_deleter = input.u8() < 250;
    Plan {
        ndim,
        shape,
        strides: (!null_strides).then_some(strides),
        dtype,
        device,
        byte_offset,
        flags,
        version,
        legacy,
        data_at,
        raw_data,
        buffer_len,
        null_shape,
        with_deleter,
    }
}

/// A recognisable byte at every position of the buffer.
fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 8)) as u8
}

/// Builds the producer's memory and descriptor.
fn build_descriptor(plan: &Plan) -> (Owned, DLTensor, *const u8) {
    let mut buffer = vec![0u64; plan.buffer_len.div_ceil(8).max(1)];
    {
        // SAFETY: a `Vec<u64>` of at least `buffer_len` bytes, viewed as bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(buffer.as_mut_ptr().cast::<u8>(), plan.buffer_len)
        };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = pattern(i);
        }
    }
    let mut shape = plan.shape.clone();
    let mut strides = plan.strides.clone().unwrap_or_default();
    let base = buffer.as_mut_ptr().cast::<u8>();
    let data = match plan.data_at {
        Some(k) => base.wrapping_add(k).cast::<c_void>(),
        None => std::ptr::with_exposed_provenance_mut::<c_void>(plan.raw_data),
    };
    let dl = DLTensor {
        data,
        device: plan.device,
        ndim: plan.ndim,
        dtype: plan.dtype,
        shape: if plan.null_shape {
            std::ptr::null_mut()
        } else {
            shape.as_mut_ptr()
        },
        strides: if plan.strides.is_some() {
            strides.as_mut_ptr()
        } else {
            std::ptr::null_mut()
        },
        byte_offset: plan.byte_offset,
    };
    let owned = Owned {
        _buffer: buffer,
        _shape: shape,
        _strides: strides,
    };
    (owned, dl, base)
}

/// Bytes per element as stored, and whether elements are packed sub-byte values.
fn element_size(dtype: DLDataType, flags: u64, legacy: bool) -> (usize, bool) {
    if dtype.bits < 8 {
        let padded = !legacy && flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED != 0;
        (1, !padded)
    } else {
        (
            usize::from(dtype.bits) * usize::from(dtype.lanes) / 8,
            false,
        )
    }
}

fn compact_strides(shape: &[usize]) -> Vec<isize> {
    let mut out = vec![0isize; shape.len()];
    let mut acc = 1isize;
    for (s, &d) in out.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d.max(1) as isize);
    }
    out
}

/// The checks on a successful import.
fn check_tensor(plan: &Plan, t: &Tensor, real_base: *const u8) {
    let shape: Vec<usize> = plan.shape.iter().map(|&d| d as usize).collect();
    assert_eq!(t.shape(), &shape[..], "shape");
    let strides: Vec<isize> = match &plan.strides {
        Some(s) => s.iter().map(|&s| s as isize).collect(),
        None => compact_strides(&shape),
    };
    assert_eq!(t.strides(), &strides[..], "strides");
    assert_eq!(t.dtype().to_dlpack(), plan.dtype, "dtype");
    assert_eq!(t.device().to_dlpack(), plan.device, "device");
    let read_only = !plan.legacy && plan.flags & DLPACK_FLAG_BITMASK_READ_ONLY != 0;
    assert_eq!(t.is_read_only(), read_only, "read-only flag");
    let (itemsize, packed) = element_size(plan.dtype, plan.flags, plan.legacy);
    assert_eq!(t.is_packed(), packed, "packed");

    let numel: usize = shape.iter().product();
    let data = t.buffer().handle() as usize;
    let range = t.byte_range();
    let Some((lo, hi)) = reference_extent(&shape, &strides) else {
        assert_eq!(range.len(), 0, "an empty tensor addresses no bytes");
        return;
    };
    // The reference range, relative to the descriptor's `data`.
    let (lo_b, hi_b) = if packed {
        let bits = numel as i128 * i128::from(plan.dtype.bits);
        (0i128, (bits + 7) / 8)
    } else {
        (lo * itemsize as i128, (hi + 1) * itemsize as i128)
    };
    let desc_data = match plan.data_at {
        Some(k) => real_base as usize + k,
        None => plan.raw_data,
    };
    let first = desc_data as i128 + plan.byte_offset as i128;
    let kind = t.device().kind();
    let (start, end) = if kind.is_addressable() {
        (
            data as i128 + range.start as i128,
            data as i128 + range.end as i128,
        )
    } else {
        assert_eq!(data, desc_data, "an opaque handle is kept as it came");
        (
            desc_data as i128 + range.start as i128,
            desc_data as i128 + range.end as i128,
        )
    };
    assert_eq!(
        (start, end),
        (first + lo_b, first + hi_b),
        "addressed bytes (shape {shape:?}, strides {strides:?}, itemsize {itemsize})"
    );
    if kind.is_addressable() {
        assert_eq!(
            t.buffer().len() as i128,
            hi_b - lo_b,
            "buffer is the addressed range"
        );
    }

    // Read the elements when they lie inside the real buffer.
    let inside = plan.data_at.is_some()
        && start >= real_base as i128
        && end <= real_base as i128 + plan.buffer_len as i128;
    if inside && kind == DeviceKind::Cpu && !packed && numel <= 4096 {
        let copy = t.copy().expect("copying an in-bounds CPU tensor");
        assert!(copy.is_contiguous());
        let host = copy.buffer().host_ptr().expect("a CPU copy is host memory");
        // SAFETY: `copy` is a compact host tensor of `numel * itemsize` bytes from its offset.
        let got = unsafe {
            std::slice::from_raw_parts(host.as_ptr().add(copy.byte_offset()), numel * itemsize)
        };
        let mut k = 0;
        for_each_index(&shape, |idx| {
            let at = first - real_base as i128 + element_offset(idx, &strides) * itemsize as i128;
            for b in 0..itemsize {
                let want = pattern((at + b as i128) as usize);
                assert_eq!(got[k * itemsize + b], want, "element {idx:?} byte {b}");
            }
            k += 1;
        });
        assert_eq!(k, numel);
    }
}

/// Exports `t` and imports the export: the same view of the same bytes comes back.
fn round_trip(t: &Tensor) {
    let exported = t.to_dlpack_versioned(dlbridge::dlpack::VERSION, false);
    // SAFETY: a fresh export, given up to the importer.
    let back = unsafe { Tensor::from_dlpack_versioned(exported) }.expect("re-importing an export");
    assert_eq!(back.shape(), t.shape());
    assert_eq!(back.strides(), t.strides());
    assert_eq!(back.dtype(), t.dtype());
    assert_eq!(back.device(), t.device());
    assert_eq!(back.is_read_only(), t.is_read_only());
    assert_eq!(back.is_packed(), t.is_packed());
    if t.numel() > 0 && t.device().kind().is_addressable() {
        let abs = |x: &Tensor| {
            let r = x.byte_range();
            let h = x.buffer().handle() as usize;
            (h + r.start, h + r.end)
        };
        assert_eq!(abs(&back), abs(t), "round trip addresses the same bytes");
    }
    if let Ok(legacy) = t.to_dlpack_legacy() {
        // SAFETY: as above.
        let back =
            unsafe { Tensor::from_dlpack_legacy(legacy) }.expect("re-importing a legacy export");
        assert_eq!(back.shape(), t.shape());
        assert_eq!(back.strides(), t.strides());
    }
}

fn run<M>(
    plan: &Plan,
    make: impl FnOnce(DLTensor) -> M,
    import: unsafe fn(NonNull<M>) -> dlbridge::Result<Tensor>,
    drop_order: u8,
) {
    let (owned, dl, real_base) = build_descriptor(plan);
    let producer = Box::into_raw(Box::new(Producer {
        managed: make(dl),
        deletions: AtomicUsize::new(0),
        owned: Some(owned),
    }));
    // SAFETY: `producer` is live until freed below; `managed` is its first field.
    let deletions = unsafe { &(*producer).deletions };
    let managed = NonNull::new(producer.cast::<M>()).unwrap();
    // SAFETY: a live managed tensor whose ownership passes to the importer; the descriptor's
    // pointers are readable for `ndim.clamp(0, 128)` entries (more is the importer's bug).
    let result = unsafe { import(managed) };
    let expected_after = usize::from(plan.with_deleter);
    match result {
        Err(_) => {
            assert_eq!(
                deletions.load(Ordering::SeqCst),
                expected_after,
                "deleter after a failed import"
            );
        }
        Ok(t) => {
            assert_eq!(
                deletions.load(Ordering::SeqCst),
                0,
                "deleter ran while the tensor lives"
            );
            check_tensor(plan, &t, real_base);
            round_trip(&t);
            let clone = t.clone();
            let view = if t.ndim() > 0 {
                t.index(0, 0).ok()
            } else {
                t.expand_dims(0).ok()
            };
            let mut held = vec![Some(t), Some(clone), view];
            for k in 0..held.len() {
                if held.iter().any(Option::is_some) {
                    assert_eq!(
                        deletions.load(Ordering::SeqCst),
                        0,
                        "deleter ran while a view lives"
                    );
                }
                let i = (usize::from(drop_order) + k) % held.len();
                held[i] = None;
            }
            assert_eq!(
                deletions.load(Ordering::SeqCst),
                expected_after,
                "deleter after the last drop"
            );
        }
    }
    // SAFETY: the importer gave everything up (all views dropped); freed once, here.
    drop(unsafe { Box::from_raw(producer) });
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let plan = plan(&mut input);
    let drop_order = input.u8();
    if plan.legacy {
        let deleter = plan
            .with_deleter
            .then_some(delete_legacy as unsafe extern "C" fn(_));
        run(
            &plan,
            |dl_tensor| DLManagedTensor {
                dl_tensor,
                manager_ctx: std::ptr::null_mut(),
                deleter,
            },
            Tensor::from_dlpack_legacy,
            drop_order,
        );
    } else {
        let deleter = plan
            .with_deleter
            .then_some(delete_versioned as unsafe extern "C" fn(_));
        run(
            &plan,
            |dl_tensor| DLManagedTensorVersioned {
                version: plan.version,
                manager_ctx: std::ptr::null_mut(),
                deleter,
                flags: plan.flags,
                dl_tensor,
            },
            Tensor::from_dlpack_versioned,
            drop_order,
        );
    }
});
