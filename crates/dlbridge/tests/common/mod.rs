//! A hand-built DLPack producer for the integration tests.
//!
//! [`Spec`] describes one foreign tensor field by field (including fields a well-behaved producer
//! would never write, so the importer's rejections can be tested). [`Spec::make_versioned`] and
//! [`Spec::make_legacy`] box a `DLManagedTensorVersioned` / `DLManagedTensor` whose `manager_ctx`
//! owns the shape and strides arrays and the data, and whose deleter frees all of it and reports to
//! a [`Probe`]: how many times it ran and on which thread.

#![allow(dead_code)]

pub(crate) mod devices;
pub(crate) mod values;

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use dlbridge::dlpack::ffi::{
    DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLPackVersion, DLTensor,
    K_DL_CPU, K_DL_FLOAT,
};
use dlbridge::{DType, Error, Layout, Tensor};

/// What a producer's deleter reports.
#[derive(Default, Debug)]
pub(crate) struct Probe {
    deletes: AtomicUsize,
    thread: Mutex<Option<ThreadId>>,
}

impl Probe {
    /// How many times the deleter has run.
    pub(crate) fn deletes(&self) -> usize {
        self.deletes.load(Ordering::SeqCst)
    }

    /// The thread the deleter last ran on.
    pub(crate) fn thread(&self) -> Option<ThreadId> {
        *self.thread.lock().unwrap()
    }

    fn record(&self) {
        *self.thread.lock().unwrap() = Some(std::thread::current().id());
        self.deletes.fetch_add(1, Ordering::SeqCst);
    }
}

/// Everything one producer allocation owns; `manager_ctx` points at a boxed `Ctx`.
struct Ctx {
    _shape: Vec<i64>,
    _strides: Vec<i64>,
    _storage: Vec<u64>,
    probe: Arc<Probe>,
}

/// Where `DLTensor::data` points.
#[derive(Clone, Debug)]
pub(crate) enum Data {
    /// Into an 8-byte-aligned allocation the producer owns, `shift` bytes past its start.
    Storage { bytes: Vec<u8>, shift: usize },
    /// NULL.
    Null,
    /// A fake opaque handle (for Metal): a non-NULL value that must never be dereferenced.
    Fake(usize),
}

/// One foreign tensor, field by field.
#[derive(Clone, Debug)]
pub(crate) struct Spec {
    /// `None`: a legacy `DLManagedTensor`.
    pub(crate) version: Option<DLPackVersion>,
    pub(crate) flags: u64,
    pub(crate) ndim: i32,
    /// `None`: NULL.
    pub(crate) shape: Option<Vec<i64>>,
    /// `None`: NULL.
    pub(crate) strides: Option<Vec<i64>>,
    pub(crate) dtype: DLDataType,
    pub(crate) device: DLDevice,
    pub(crate) data: Data,
    pub(crate) byte_offset: u64,
}

/// Native-endian bytes of `values`.
pub(crate) fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// Compact row-major strides for `shape`.
pub(crate) fn row_major(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1i64;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.wrapping_mul(d.max(1)); // wraps only for shapes the importer must refuse
    }
    strides
}

impl Spec {
    /// A valid DLPack 1.3 CPU float32 tensor of `shape` holding `values`, compact row-major, with
    /// `data` at the start of the values.
    pub(crate) fn f32(values: &[f32], shape: &[i64]) -> Spec {
        Spec {
            version: Some(DLPackVersion { major: 1, minor: 3 }),
            flags: 0,
            ndim: shape.len() as i32,
            shape: Some(shape.to_vec()),
            strides: Some(row_major(shape)),
            dtype: DLDataType {
                code: K_DL_FLOAT,
                bits: 32,
                lanes: 1,
            },
            device: DLDevice {
                device_type: K_DL_CPU,
                device_id: 0,
            },
            data: Data::Storage {
                bytes: f32_bytes(values),
                shift: 0,
            },
            byte_offset: 0,
        }
    }

    /// The same spec, as a legacy (unversioned) tensor.
    pub(crate) fn legacy(mut self) -> Spec {
        self.version = None;
        self
    }

    pub(crate) fn version(mut self, major: u32, minor: u32) -> Spec {
        self.version = Some(DLPackVersion { major, minor });
        self
    }

    pub(crate) fn flags(mut self, flags: u64) -> Spec {
        self.flags = flags;
        self
    }

    pub(crate) fn ndim(mut self, ndim: i32) -> Spec {
        self.ndim = ndim;
        self
    }

    pub(crate) fn shape(mut self, shape: Option<Vec<i64>>) -> Spec {
        self.shape = shape;
        self
    }

    pub(crate) fn strides(mut self, strides: Option<Vec<i64>>) -> Spec {
        self.strides = strides;
        self
    }

    pub(crate) fn dtype(mut self, code: u8, bits: u8, lanes: u16) -> Spec {
        self.dtype = DLDataType { code, bits, lanes };
        self
    }

    pub(crate) fn device(mut self, device_type: i32, device_id: i32) -> Spec {
        self.device = DLDevice {
            device_type,
            device_id,
        };
        self
    }

    pub(crate) fn data(mut self, data: Data) -> Spec {
        self.data = data;
        self
    }

    /// Moves `data` `shift` bytes into the producer's storage.
    pub(crate) fn data_shift(mut self, new_shift: usize) -> Spec {
        match &mut self.data {
            Data::Storage { shift, .. } => *shift = new_shift,
            _ => panic!("data_shift needs storage"),
        }
        self
    }

    pub(crate) fn byte_offset(mut self, byte_offset: u64) -> Spec {
        self.byte_offset = byte_offset;
        self
    }

    /// Allocates the producer's arrays and the descriptor; returns the descriptor, the context,
    /// and the storage's start address (NULL without storage).
    fn build(self, probe: &Arc<Probe>) -> (DLTensor, *mut c_void, *mut u8) {
        let mut shape = self.shape.clone().unwrap_or_default();
        let mut strides = self.strides.clone().unwrap_or_default();
        let (mut storage, shift, fake) = match self.data {
            Data::Storage { bytes, shift } => {
                let mut words = vec![0u64; bytes.len().div_ceil(8).max(1)];
                // SAFETY: `words` holds at least `bytes.len()` bytes; the two do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        words.as_mut_ptr().cast::<u8>(),
                        bytes.len(),
                    );
                }
                (words, shift, None)
            }
            Data::Null => (vec![], 0, None),
            Data::Fake(handle) => (vec![], 0, Some(handle)),
        };
        let base: *mut u8 = if storage.is_empty() {
            std::ptr::null_mut()
        } else {
            storage.as_mut_ptr().cast()
        };
        let data: *mut c_void = match fake {
            Some(handle) => std::ptr::without_provenance_mut(handle),
            None if base.is_null() => std::ptr::null_mut(),
            None => base.wrapping_add(shift).cast(),
        };
        let dl = DLTensor {
            data,
            device: self.device,
            ndim: self.ndim,
            dtype: self.dtype,
            shape: if self.shape.is_some() {
                shape.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            },
            strides: if self.strides.is_some() {
                strides.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            },
            byte_offset: self.byte_offset,
        };
        // Moving the vectors into the context moves no heap memory: the pointers above stay valid.
        let ctx = Box::new(Ctx {
            _shape: shape,
            _strides: strides,
            _storage: storage,
            probe: Arc::clone(probe),
        });
        (dl, Box::into_raw(ctx).cast(), base)
    }

    /// Boxes a `DLManagedTensorVersioned` (the spec's version must be set).
    pub(crate) fn make_versioned(self) -> Producer<DLManagedTensorVersioned> {
        let version = self.version.expect("a versioned spec");
        let flags = self.flags;
        let probe = Arc::new(Probe::default());
        let (dl_tensor, ctx, base) = self.build(&probe);
        let managed = Box::new(DLManagedTensorVersioned {
            version,
            manager_ctx: ctx,
            deleter: Some(delete_versioned),
            flags,
            dl_tensor,
        });
        let data = managed.dl_tensor.data;
        Producer {
            managed: NonNull::from(Box::leak(managed)),
            probe,
            base,
            data,
        }
    }

    /// Boxes a legacy `DLManagedTensor` (the spec's version and flags are ignored).
    pub(crate) fn make_legacy(self) -> Producer<DLManagedTensor> {
        let probe = Arc::new(Probe::default());
        let (dl_tensor, ctx, base) = self.build(&probe);
        let managed = Box::new(DLManagedTensor {
            dl_tensor,
            manager_ctx: ctx,
            deleter: Some(delete_legacy),
        });
        let data = managed.dl_tensor.data;
        Producer {
            managed: NonNull::from(Box::leak(managed)),
            probe,
            base,
            data,
        }
    }

    /// Builds the producer the spec names (legacy when `version` is `None`) and imports it.
    pub(crate) fn import(self) -> Imported {
        if self.version.is_some() {
            let p = self.make_versioned();
            // SAFETY: a live tensor just built by `make_versioned`, whose ownership we give up.
            let result = unsafe { Tensor::from_dlpack_versioned(p.managed) };
            Imported {
                result,
                probe: p.probe,
                base: p.base,
                data: p.data,
            }
        } else {
            let p = self.make_legacy();
            // SAFETY: a live tensor just built by `make_legacy`, whose ownership we give up.
            let result = unsafe { Tensor::from_dlpack_legacy(p.managed) };
            Imported {
                result,
                probe: p.probe,
                base: p.base,
                data: p.data,
            }
        }
    }
}

/// A boxed managed tensor not yet handed to a consumer.
pub(crate) struct Producer<M> {
    pub(crate) managed: NonNull<M>,
    pub(crate) probe: Arc<Probe>,
    /// The start of the producer's storage (NULL without storage).
    pub(crate) base: *mut u8,
    /// `DLTensor::data` as written.
    pub(crate) data: *mut c_void,
}

/// The outcome of an import, with the producer's probe.
pub(crate) struct Imported {
    pub(crate) result: Result<Tensor, Error>,
    pub(crate) probe: Arc<Probe>,
    pub(crate) base: *mut u8,
    pub(crate) data: *mut c_void,
}

impl Imported {
    /// The tensor; panics (with the error) when the import failed.
    pub(crate) fn tensor(self) -> (Tensor, Arc<Probe>) {
        match self.result {
            Ok(t) => (t, self.probe),
            Err(e) => panic!("import failed: {e:?}"),
        }
    }
}

unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: `managed` was leaked from a box by `make_versioned`; the consumer calls the deleter
    // once, so it is reclaimed once.
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: `manager_ctx` was leaked from a boxed `Ctx` by `build`, and is reclaimed only here.
    let ctx = unsafe { Box::from_raw(managed.manager_ctx.cast::<Ctx>()) };
    ctx.probe.record();
}

unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    // SAFETY: as in `delete_versioned`, for `make_legacy`.
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: as in `delete_versioned`.
    let ctx = unsafe { Box::from_raw(managed.manager_ctx.cast::<Ctx>()) };
    ctx.probe.record();
}

/// A managed-tensor struct of either flavour, as a consumer sees it.
pub(crate) trait Managed {
    /// The descriptor.
    fn dl_tensor(&self) -> &DLTensor;
    /// The flags (0 for the legacy struct, which has none).
    fn flags(&self) -> u64;
    /// Calls the producer's deleter.
    ///
    /// # Safety
    /// `this` must be live and owned by the caller; it must not be used afterwards.
    unsafe fn delete(this: NonNull<Self>);
}

impl Managed for DLManagedTensorVersioned {
    fn dl_tensor(&self) -> &DLTensor {
        &self.dl_tensor
    }
    fn flags(&self) -> u64 {
        self.flags
    }
    unsafe fn delete(this: NonNull<Self>) {
        // SAFETY: forwarded; `this` is live, so reading its deleter is fine.
        let deleter = unsafe { this.as_ref() }.deleter.expect("a deleter");
        // SAFETY: forwarded: the owner gives the tensor up here, once.
        unsafe { deleter(this.as_ptr()) };
    }
}

impl Managed for DLManagedTensor {
    fn dl_tensor(&self) -> &DLTensor {
        &self.dl_tensor
    }
    fn flags(&self) -> u64 {
        0
    }
    unsafe fn delete(this: NonNull<Self>) {
        // SAFETY: as for the versioned struct.
        let deleter = unsafe { this.as_ref() }.deleter.expect("a deleter");
        // SAFETY: as for the versioned struct.
        unsafe { deleter(this.as_ptr()) };
    }
}

/// An exported tensor held the way a consumer holds one: its fields can be read, and dropping it
/// calls its deleter exactly once.
pub(crate) struct Export<M: Managed> {
    ptr: NonNull<M>,
}

impl<M: Managed> Export<M> {
    /// # Safety
    /// `ptr` must be a live managed tensor whose ownership passes to the result, with `shape` and
    /// `strides` either NULL or `ndim` entries long.
    pub(crate) unsafe fn new(ptr: NonNull<M>) -> Self {
        Export { ptr }
    }

    /// The managed struct.
    pub(crate) fn get(&self) -> &M {
        // SAFETY: live until `self` is dropped (`new`'s contract).
        unsafe { self.ptr.as_ref() }
    }

    /// The flags (0 for a legacy struct).
    pub(crate) fn flags(&self) -> u64 {
        self.get().flags()
    }

    /// The descriptor.
    pub(crate) fn dl(&self) -> &DLTensor {
        self.get().dl_tensor()
    }

    /// The shape array; panics when it is NULL.
    pub(crate) fn shape(&self) -> &[i64] {
        let dl = self.dl();
        assert!(!dl.shape.is_null(), "shape must not be NULL");
        // SAFETY: non-NULL, hence `ndim` entries long (`new`'s contract), alive with `self`.
        unsafe { std::slice::from_raw_parts(dl.shape, dl.ndim as usize) }
    }

    /// The strides array; panics when it is NULL.
    pub(crate) fn strides(&self) -> &[i64] {
        let dl = self.dl();
        assert!(!dl.strides.is_null(), "strides must not be NULL");
        // SAFETY: as in `shape`.
        unsafe { std::slice::from_raw_parts(dl.strides, dl.ndim as usize) }
    }

    /// Gives the tensor up without deleting it (to hand it to an importer).
    pub(crate) fn into_raw(self) -> NonNull<M> {
        let ptr = self.ptr;
        std::mem::forget(self);
        ptr
    }
}

impl<M: Managed> Drop for Export<M> {
    fn drop(&mut self) {
        // SAFETY: owned since `new`, deleted only here, once.
        unsafe { M::delete(self.ptr) };
    }
}

// SAFETY: DLPack deleters may be called from any thread, and `Export` does nothing else that is
// tied to a thread.
unsafe impl<M: Managed> Send for Export<M> {}

/// `t.to_dlpack_versioned(dlbridge::dlpack::VERSION, is_copied)`, held as a consumer.
pub(crate) fn export_versioned(t: &Tensor, is_copied: bool) -> Export<DLManagedTensorVersioned> {
    // SAFETY: a fresh export, owned by us, whose arrays are `ndim` long.
    unsafe { Export::new(t.to_dlpack_versioned(dlbridge::dlpack::VERSION, is_copied)) }
}

/// `t.to_dlpack_legacy()`, held as a consumer.
pub(crate) fn export_legacy(t: &Tensor) -> Result<Export<DLManagedTensor>, Error> {
    // SAFETY: as in `export_versioned`.
    t.to_dlpack_legacy().map(|e| unsafe { Export::new(e) })
}

/// Exports `t` and imports it back (versioned, or legacy when `legacy`).
pub(crate) fn round_trip(t: &Tensor, legacy: bool) -> Result<Tensor, Error> {
    if legacy {
        let e = export_legacy(t)?.into_raw();
        // SAFETY: a live export whose ownership we hand over.
        unsafe { Tensor::from_dlpack_legacy(e) }
    } else {
        let e = export_versioned(t, false).into_raw();
        // SAFETY: as above.
        unsafe { Tensor::from_dlpack_versioned(e) }
    }
}

/// xorshift64: small and deterministic, so a failing test reproduces from its seed.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in `[lo, hi)`.
    pub(crate) fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next() >> 11) as f64 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn between(&mut self, lo: isize, hi: isize) -> isize {
        lo + self.below((hi - lo + 1) as usize) as isize
    }

    /// True once in `one_in` draws, on average.
    pub(crate) fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    /// A shape of up to `max_dims` axes of up to `max_extent` elements.
    pub(crate) fn shape(&mut self, max_dims: usize, max_extent: usize) -> Vec<usize> {
        let ndim = self.below(max_dims + 1);
        (0..ndim).map(|_| self.below(max_extent + 1)).collect()
    }

    /// A random permutation of `0..n`.
    pub(crate) fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
}

/// CUDA device 0; panics, saying why, where there is none (a test asked to run without a device
/// fails rather than passing without having run).
pub(crate) fn gpu() -> dlbridge::Device {
    #[cfg(feature = "cuda")]
    match dlbridge::backend::cuda::device_count() {
        Ok(n) if n > 0 => dlbridge::Device::cuda(0),
        Ok(_) => panic!("this test needs a CUDA device: the CUDA driver found no devices"),
        Err(e) => panic!("this test needs a CUDA device: {e}"),
    }
    #[cfg(not(feature = "cuda"))]
    panic!("this test needs a CUDA device: dlbridge was built without feature `cuda`")
}

/// NumPy's `divmod` of floats (`npy_divmod`) in the type `$t`.
macro_rules! numpy_divmod {
    ($t:ty, $a:expr, $b:expr) => {{
        let (a, b): ($t, $t) = ($a as $t, $b as $t);
        let m = a % b;
        if b == 0.0 {
            (a / b, m)
        } else {
            let (mut m, mut div) = (m, (a - m) / b);
            if m != 0.0 {
                if (b < 0.0) != (m < 0.0) {
                    m += b;
                    div -= 1.0;
                }
            } else {
                m = (0.0 as $t).copysign(b);
            }
            let q = if div != 0.0 {
                let f = div.floor();
                if div - f > 0.5 { f + 1.0 } else { f }
            } else {
                (0.0 as $t).copysign(a / b)
            };
            (q, m)
        }
    }};
}

/// NumPy's `floor_divide` and `remainder` of `x` by `y` as the kernels and NumPy compute them for
/// results of `dtype`: in `float64` for `float64`, in `float32` for `float32` and the 16-bit floats.
pub(crate) fn numpy_divmod(dtype: dlbridge::DType, x: f64, y: f64) -> (f64, f64) {
    if dtype == dlbridge::DType::F64 {
        numpy_divmod!(f64, x, y)
    } else {
        let (q, m) = numpy_divmod!(f32, x, y);
        (q as f64, m as f64)
    }
}

/// The bytes of a view's elements in row-major order (a compact copy read back as bytes), on any
/// device.
pub(crate) fn raw_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.copy().unwrap();
    let layout = Layout::contiguous_at(&[t.nbytes()], t.byte_offset()).unwrap();
    Tensor::new(t.buffer().clone(), DType::U8, layout)
        .unwrap()
        .to_vec::<u8>()
        .unwrap()
}
