//! Array arguments: [`ArrayArg`] takes any framework's array without a copy; [`Expect`] checks
//! it at the border and hands out typed access ([`ReadArray`], [`WriteArray`]) under the
//! process-wide borrow rules ([`crate::borrow`]).

use std::marker::PhantomData;
use std::sync::OnceLock;

use dlbridge::{DType, Device, DeviceKind, Element, Layout, Tensor};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::borrow::{Borrow, Range};
use crate::error::named;
use crate::exchange::c_api::TableView;
use crate::numpy::NumPyArray;

/// Any array, as a `#[pyfunction]` argument: an object with a DLPack C exchange table (PyTorch,
/// dlbridge), with `__dlpack__` (NumPy, JAX, CuPy, MLX, ...), a DLPack capsule, or a
/// buffer-protocol object (`bytearray`, `array.array`, `memoryview`), imported without a copy.
///
/// The import is done before the function body runs and keeps the Python object alive for as
/// long as the tensor (or any view of it) lives. Check it with [`ArrayArg::expect`].
#[derive(Debug)]
pub struct ArrayArg {
    source: Source,
}

/// Where an argument's memory was found: an imported tensor, or a NumPy array read from its
/// struct, which becomes a tensor only when one is asked for (the common NumPy call then
/// allocates nothing).
#[derive(Debug)]
pub(crate) enum Source {
    /// Imported (through `__dlpack__`, a capsule or the buffer protocol).
    Tensor(Tensor),
    /// Read from NumPy's struct ([`crate::numpy`]).
    NumPy(NumPyArray),
    /// Described by a producer's exchange table ([`crate::exchange::c_api::borrow_via_table`]).
    Table(TableView),
}

impl Source {
    /// Reads `x` without a copy, by the cheapest path its type offers: a NumPy array from its
    /// struct, a PyTorch tensor from the descriptor its exchange table fills (either becomes a
    /// tensor only when one is asked for); anything else is imported.
    #[inline(always)]
    fn of(x: &Bound<'_, PyAny>) -> PyResult<Source> {
        use crate::error::IntoPyResult;
        use crate::exchange::consumer::{REQUEST, from_producer, import_via_dlpack};
        use crate::exchange::kind::{is_ndarray, type_info};
        let numpy = |x| match crate::numpy::view(x)? {
            Some(array) => Ok(Source::NumPy(array)),
            None => import_via_dlpack(x).map(Source::Tensor),
        };
        if is_ndarray(x) {
            return numpy(x);
        }
        if x.is_instance_of::<PyCapsule>() {
            let managed = crate::exchange::capsule::take(x)?;
            // SAFETY: the capsule handed over a live tensor whose ownership is now ours.
            let imported = unsafe { REQUEST.import(managed) }.py()?;
            return Ok(Source::Tensor(imported.tensor));
        }
        let info = type_info(x);
        if info.is_numpy {
            return numpy(x);
        }
        if let Some(borrowed) = crate::exchange::c_api::borrow_via_table(x, info) {
            return borrowed.map(Source::Table);
        }
        from_producer(x, info).map(Source::Tensor)
    }

    #[inline]
    fn dtype(&self) -> DType {
        match self {
            Source::Tensor(t) => t.dtype(),
            Source::NumPy(a) => a.dtype,
            Source::Table(b) => b.described.dtype(),
        }
    }

    #[inline]
    fn layout(&self) -> &Layout {
        match self {
            Source::Tensor(t) => t.layout(),
            Source::NumPy(a) => &a.layout,
            Source::Table(b) => b.described.layout(),
        }
    }

    #[inline]
    fn device(&self) -> Device {
        match self {
            Source::Tensor(t) => t.device(),
            Source::NumPy(_) => Device::CPU,
            Source::Table(b) => b.described.device(),
        }
    }

    #[inline]
    fn is_read_only(&self) -> bool {
        match self {
            Source::Tensor(t) => t.is_read_only(),
            Source::NumPy(a) => a.read_only,
            Source::Table(b) => b.described.is_read_only(),
        }
    }

    /// The address of element zero: a host address, or a device address for CUDA memory (for
    /// other devices, the buffer handle plus the byte offset).
    #[inline]
    fn first_addr(&self) -> usize {
        match self {
            Source::Tensor(t) => (t.buffer().handle() as usize).wrapping_add(t.byte_offset()),
            Source::NumPy(a) => a.first() as usize,
            Source::Table(b) => b.first(),
        }
    }

    /// Element zero in host memory, after dlbridge's pending device work on it (Metal) is done;
    /// `None` where the memory is not host-accessible.
    #[inline]
    fn host_first(&self) -> dlbridge::Result<Option<*mut u8>> {
        match self {
            Source::Tensor(t) => {
                let Some(base) = t.buffer().host_ptr() else {
                    return Ok(None);
                };
                dlbridge::backend::host_barrier(t.device())?;
                Ok(Some(base.as_ptr().wrapping_add(t.byte_offset())))
            }
            Source::NumPy(a) => Ok(Some(a.first())),
            // Host memory, or CUDA device memory (the only kinds a borrowed descriptor takes).
            Source::Table(b) => Ok(b
                .described
                .device()
                .kind()
                .is_host_accessible()
                .then(|| std::ptr::with_exposed_provenance_mut(b.first()))),
        }
    }

    fn into_tensor(self) -> PyResult<Tensor> {
        match self {
            Source::Tensor(t) => Ok(t),
            Source::NumPy(a) => a.into_tensor(),
            Source::Table(b) => b.into_tensor(),
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for ArrayArg {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(ArrayArg {
            source: Source::of(&obj)?,
        })
    }
}

impl ArrayArg {
    /// Extents.
    pub fn shape(&self) -> &[usize] {
        self.source.layout().shape()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.source.dtype()
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.source.device()
    }

    /// The memory as a tensor, unchecked (the producer's memory; dlbridge never frees it).
    pub fn into_tensor(self) -> PyResult<Tensor> {
        self.source.into_tensor()
    }

    /// Starts the checks of argument `name` (the name its errors give).
    #[inline]
    pub fn expect(self, name: &'static str) -> Expect {
        Expect {
            source: self.source,
            name,
            dtype: None,
            ndim: None,
            shape: None,
            order: None,
            devices: 0,
            writable: false,
        }
    }
}

/// A memory order an argument may be required to have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Row-major, no gaps (C-contiguous).
    C,
    /// Column-major, no gaps (Fortran-contiguous).
    F,
}

/// The checks of one argument, built up and then applied by [`Expect::read`],
/// [`Expect::write`] or [`Expect::check`]. Each failed check raises an exception that names
/// the argument and says what was expected: `TypeError` for the element type, `ValueError` for
/// the axes, shape, order, device and writability.
#[derive(Debug)]
#[must_use = "the checks run when `read`, `write` or `check` is called"]
pub struct Expect {
    source: Source,
    name: &'static str,
    dtype: Option<DType>,
    ndim: Option<usize>,
    shape: Option<Vec<Option<usize>>>,
    order: Option<Order>,
    /// Accepted device kinds, one bit per DLPack device type (`0`: any).
    devices: u64,
    writable: bool,
}

/// A bit for `kind` in [`Expect`]'s device set.
#[inline]
fn device_bit(kind: DeviceKind) -> u64 {
    1u64.checked_shl(kind.to_raw() as u32).unwrap_or(0)
}

impl Expect {
    /// The element type must be `T`'s.
    #[inline]
    pub fn dtype<T: Element>(self) -> Self {
        self.dtype_of(T::DTYPE)
    }

    /// The element type must be `dtype`.
    #[inline]
    pub fn dtype_of(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// There must be `ndim` axes.
    #[inline]
    pub fn ndim(mut self, ndim: usize) -> Self {
        self.ndim = Some(ndim);
        self
    }

    /// The shape must be `shape`, where `None` accepts any extent of that axis.
    pub fn shape(mut self, shape: &[Option<usize>]) -> Self {
        self.shape = Some(shape.to_vec());
        self
    }

    /// The memory must be C-contiguous (row-major, no gaps).
    #[inline]
    pub fn c_contiguous(mut self) -> Self {
        self.order = Some(Order::C);
        self
    }

    /// The memory must be Fortran-contiguous (column-major, no gaps).
    #[inline]
    pub fn f_contiguous(mut self) -> Self {
        self.order = Some(Order::F);
        self
    }

    /// The memory may be on devices of `kind` (call again to accept several kinds; without any
    /// call, every device is accepted).
    #[inline]
    pub fn device(mut self, kind: DeviceKind) -> Self {
        self.devices |= device_bit(kind);
        self
    }

    /// The memory must be host memory (`kDLCPU`).
    #[inline]
    pub fn cpu(self) -> Self {
        self.device(DeviceKind::Cpu)
    }

    /// The memory must be CUDA device memory (`kDLCUDA`).
    #[inline]
    pub fn cuda(self) -> Self {
        self.device(DeviceKind::Cuda)
    }

    /// The memory must be writable (the producer did not mark it read-only).
    #[inline]
    pub fn writable(mut self) -> Self {
        self.writable = true;
        self
    }

    /// Applies the checks and returns the tensor, with no typed access and no borrow.
    pub fn check(self) -> PyResult<Tensor> {
        self.verify()?;
        self.source.into_tensor()
    }

    /// Applies the checks (with element type `T`) and borrows the memory for reading: refused
    /// while any array's memory overlapping it is borrowed mutably, in any extension.
    #[inline(always)]
    pub fn read<T: Element>(self, py: Python<'_>) -> PyResult<ReadArray<T>> {
        let this = self.dtype::<T>();
        this.verify()?;
        ReadArray::borrowed(py, this.name, this.source, false)
    }

    /// Applies the checks (with element type `T` and writability) and borrows the memory
    /// mutably: refused while any array's memory overlapping it is borrowed at all, in any
    /// extension.
    #[inline(always)]
    pub fn write<T: Element>(self, py: Python<'_>) -> PyResult<WriteArray<T>> {
        let this = self.dtype::<T>().writable();
        this.verify()?;
        let inner = ReadArray::borrowed(py, this.name, this.source, true)?;
        Ok(WriteArray { inner })
    }

    /// Applies the checks. The passing path is a few comparisons, inlined into the caller; each
    /// refusal is built out of line.
    #[inline(always)]
    fn verify(&self) -> PyResult<()> {
        let t = &self.source;
        let layout = t.layout();
        if let Some(dtype) = self.dtype
            && t.dtype() != dtype
        {
            return Err(self.wrong_dtype(dtype));
        }
        if let Some(ndim) = self.ndim
            && layout.ndim() != ndim
        {
            return Err(self.wrong_ndim(ndim));
        }
        if let Some(shape) = &self.shape {
            let fits = shape.len() == layout.ndim()
                && shape
                    .iter()
                    .zip(layout.shape())
                    .all(|(w, &h)| w.is_none_or(|w| w == h));
            if !fits {
                return Err(self.wrong_shape(shape));
            }
        }
        if let Some(order) = self.order {
            let ok = match order {
                Order::C => layout.is_contiguous(),
                Order::F => layout.is_f_contiguous(),
            };
            if !ok {
                return Err(self.wrong_order(order));
            }
        }
        if self.devices != 0 && self.devices & device_bit(t.device().kind()) == 0 {
            return Err(self.wrong_device());
        }
        if self.writable && t.is_read_only() {
            return Err(PyValueError::new_err(format!(
                "argument '{}': expected a writable array, got a read-only one",
                self.name
            )));
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn wrong_dtype(&self, dtype: DType) -> PyErr {
        PyTypeError::new_err(format!(
            "argument '{}': expected an array of {dtype}, got {}",
            self.name,
            self.source.dtype()
        ))
    }

    #[cold]
    #[inline(never)]
    fn wrong_ndim(&self, ndim: usize) -> PyErr {
        let layout = self.source.layout();
        PyValueError::new_err(format!(
            "argument '{}': expected {ndim} {}, got {} (shape {})",
            self.name,
            if ndim == 1 { "axis" } else { "axes" },
            layout.ndim(),
            dlbridge::layout::shape_text(layout.shape())
        ))
    }

    #[cold]
    #[inline(never)]
    fn wrong_shape(&self, shape: &[Option<usize>]) -> PyErr {
        let wanted: Vec<String> = shape
            .iter()
            .map(|d| d.map_or_else(|| "?".to_owned(), |d| d.to_string()))
            .collect();
        PyValueError::new_err(format!(
            "argument '{}': expected shape ({}), got {}",
            self.name,
            wanted.join(", "),
            dlbridge::layout::shape_text(self.source.layout().shape())
        ))
    }

    #[cold]
    #[inline(never)]
    fn wrong_order(&self, order: Order) -> PyErr {
        let layout = self.source.layout();
        let which = if order == Order::C { "C" } else { "Fortran" };
        PyValueError::new_err(format!(
            "argument '{}': expected a {which}-contiguous array, got shape {} with strides {:?} \
             (in elements); pass a contiguous copy",
            self.name,
            dlbridge::layout::shape_text(layout.shape()),
            layout.strides()
        ))
    }

    #[cold]
    #[inline(never)]
    fn wrong_device(&self) -> PyErr {
        let kinds: Vec<String> = (0..64)
            .filter(|b| self.devices & (1 << b) != 0)
            .map(|b| DeviceKind::from_raw(b).name())
            .collect();
        PyValueError::new_err(format!(
            "argument '{}': expected an array on {}, got one on {}",
            self.name,
            kinds.join(" or "),
            self.source.device()
        ))
    }
}

/// Records a borrow of the bytes `source` addresses, `len` elements that are C-contiguous or
/// not (none for an empty array, which has none).
#[inline(always)]
fn borrow(
    py: Python<'_>,
    name: &str,
    source: &Source,
    len: usize,
    contiguous: bool,
    exclusive: bool,
) -> PyResult<Option<Borrow>> {
    let (lo, hi) = if len == 0 {
        return Ok(None);
    } else if contiguous {
        (0, len as i128 - 1)
    } else {
        match source.layout().element_extent() {
            Some(extent) => extent,
            None => return Ok(None),
        }
    };
    let itemsize = source.dtype().itemsize() as i128;
    let first = source.first_addr() as i128;
    let dl = source.device().to_dlpack();
    let range = Range {
        device_type: dl.device_type,
        device_id: dl.device_id,
        start: (first + lo * itemsize) as u64,
        end: (first + (hi + 1) * itemsize) as u64,
    };
    Borrow::acquire(py, name, range, exclusive).map(Some)
}

/// A checked array borrowed for reading, with elements of type `T`.
///
/// The memory cannot be borrowed mutably (by [`Expect::write`], in this or another extension)
/// while this lives. Its producer can still write to it, as with any DLPack consumer.
#[derive(Debug)]
pub struct ReadArray<T: Element> {
    source: Source,
    /// The tensor of a NumPy or borrowed source, made when [`ReadArray::tensor`] first asks.
    tensor: OnceLock<Box<Tensor>>,
    name: &'static str,
    /// The number of elements, and whether they are C-contiguous (asked on every access).
    len: usize,
    contiguous: bool,
    _borrow: Option<Borrow>,
    _element: PhantomData<T>,
}

impl<T: Element> ReadArray<T> {
    /// Borrows the memory of the checked `source` (mutably if `exclusive`).
    #[inline(always)]
    fn borrowed(
        py: Python<'_>,
        name: &'static str,
        source: Source,
        exclusive: bool,
    ) -> PyResult<ReadArray<T>> {
        let layout = source.layout();
        let len = layout.numel();
        let contiguous = layout.is_contiguous();
        let borrow = borrow(py, name, &source, len, contiguous, exclusive)?;
        Ok(ReadArray {
            source,
            tensor: OnceLock::new(),
            name,
            len,
            contiguous,
            _borrow: borrow,
            _element: PhantomData,
        })
    }

    /// The memory as a tensor (for [`dlbridge::compute::kernel::KernelArg::Tensor`] and other
    /// core calls); for a NumPy array or a borrowed descriptor, made on the first call.
    pub fn tensor(&self) -> PyResult<&Tensor> {
        if let Source::Tensor(t) = &self.source {
            return Ok(t);
        }
        if let Some(t) = self.tensor.get() {
            return Ok(t);
        }
        let t = Python::attach(|py| match &self.source {
            Source::NumPy(a) => a.clone_ref(py).into_tensor(),
            Source::Table(b) => b.clone_ref(py).into_tensor(),
            Source::Tensor(_) => unreachable!("answered above"),
        })?;
        Ok(self.tensor.get_or_init(|| Box::new(t)))
    }

    /// Extents.
    pub fn shape(&self) -> &[usize] {
        self.source.layout().shape()
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[isize] {
        self.source.layout().strides()
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.source.device()
    }

    /// Element zero in host memory, aligned for `T`, or a `ValueError` naming the argument.
    #[inline(always)]
    fn host_first(&self, what: &str) -> PyResult<*mut T> {
        let first = self.source.host_first().map_err(|e| named(self.name, e))?;
        let Some(first) = first else {
            return Err(self.not_on_host(what));
        };
        let first = first.cast::<T>();
        if !first.is_aligned() {
            return Err(self.misaligned(first));
        }
        Ok(first)
    }

    #[cold]
    #[inline(never)]
    fn not_on_host(&self, what: &str) -> PyErr {
        PyValueError::new_err(format!(
            "argument '{}': {what} needs host-accessible memory, got an array on {}",
            self.name,
            self.device()
        ))
    }

    #[cold]
    #[inline(never)]
    fn misaligned(&self, first: *mut T) -> PyErr {
        PyValueError::new_err(format!(
            "argument '{}': address {first:p} is not aligned for {}",
            self.name,
            T::DTYPE
        ))
    }

    /// Element zero of C-contiguous host memory, for a slice.
    #[inline(always)]
    fn slice_first(&self) -> PyResult<*mut T> {
        if !self.contiguous {
            return Err(self.not_contiguous());
        }
        self.host_first("a slice")
    }

    #[cold]
    #[inline(never)]
    fn not_contiguous(&self) -> PyErr {
        let layout = self.source.layout();
        PyValueError::new_err(format!(
            "argument '{}': a slice needs a C-contiguous array, got shape {} with strides {:?} \
             (in elements)",
            self.name,
            dlbridge::layout::shape_text(layout.shape()),
            layout.strides()
        ))
    }

    /// The elements as a slice: the memory must be host-accessible and C-contiguous
    /// (`ValueError` naming the argument otherwise).
    #[inline]
    pub fn as_slice(&self) -> PyResult<&[T]> {
        let first = self.slice_first()?;
        if self.is_empty() {
            return Ok(&[]);
        }
        // SAFETY: `first` is the aligned address of `len` contiguous elements of host memory,
        // kept alive by the source `self` holds for the slice's lifetime; `T` is the checked
        // element type, for which every bit pattern is valid; no mutable borrow of these bytes
        // exists (the registry refused one while this shared borrow lives).
        Ok(unsafe { std::slice::from_raw_parts(first, self.len()) })
    }

    /// The device address of the first element and the stream to use it on, for memory on a
    /// CUDA device (`ValueError` elsewhere).
    pub fn cuda_ptr(&self) -> PyResult<CudaPtr> {
        let device = self.device();
        if !device.kind().is_cuda() {
            return Err(PyValueError::new_err(format!(
                "argument '{}': expected CUDA memory for a device pointer, got an array on \
                 {device}",
                self.name
            )));
        }
        Ok(CudaPtr {
            ptr: self.source.first_addr() as u64,
            device,
            stream: dlbridge::backend::current_stream(device),
        })
    }

    /// An `ndarray` view with `D` axes (`IxDyn` for any number) of host-accessible memory, in
    /// any strided layout.
    #[cfg(feature = "ndarray")]
    pub fn as_array<D: ndarray::Dimension>(&self) -> PyResult<ndarray::ArrayView<'_, T, D>> {
        let (ptr, shape, reversed) = self.ndarray_parts()?;
        // SAFETY: `ndarray_parts` checked that `ptr` is the aligned address of host memory that
        // the shape and its non-negative strides address, alive while `self` (which holds the
        // source and its keep-alive) is borrowed; `T` is the dtype's element type, so every bit
        // pattern is valid.
        let mut view = unsafe { ndarray::ArrayView::from_shape_ptr(shape, ptr.cast_const()) };
        for axis in reversed {
            view.invert_axis(ndarray::Axis(axis));
        }
        view.into_dimensionality::<D>()
            .map_err(|e| PyValueError::new_err(format!("argument '{}': {e}", self.name)))
    }

    /// What an `ndarray` view is made of: `ndarray` takes only non-negative strides, so an axis
    /// of negative stride is described from its last element with the stride's magnitude and
    /// listed, to be inverted once the view exists. Returns the address of the view's first
    /// element in host memory, the shape with strides, and the axes to invert.
    #[cfg(feature = "ndarray")]
    fn ndarray_parts(
        &self,
    ) -> PyResult<(*mut T, ndarray::StrideShape<ndarray::IxDyn>, Vec<usize>)> {
        use ndarray::ShapeBuilder;
        let mut first = self.host_first("an ndarray view")?;
        let layout = self.source.layout();
        let mut strides = Vec::with_capacity(layout.ndim());
        let mut reversed = Vec::new();
        for (axis, (&n, &s)) in layout.shape().iter().zip(layout.strides()).enumerate() {
            if s < 0 && n > 1 {
                // The axis's last element, `(n - 1) * s` elements from element zero, lies in the
                // addressed memory (the layout was validated); no offset overflows `isize`.
                first = first.wrapping_offset(s * (n as isize - 1));
                reversed.push(axis);
            }
            strides.push(s.unsigned_abs());
        }
        let shape = ndarray::IxDyn(layout.shape()).strides(ndarray::IxDyn(&strides));
        Ok((first, shape, reversed))
    }
}

/// A checked, writable array borrowed mutably, with elements of type `T`: no other borrow of
/// overlapping memory (shared or mutable, in any extension) exists while this lives.
#[derive(Debug)]
pub struct WriteArray<T: Element> {
    inner: ReadArray<T>,
}

impl<T: Element> std::ops::Deref for WriteArray<T> {
    type Target = ReadArray<T>;

    fn deref(&self) -> &ReadArray<T> {
        &self.inner
    }
}

impl<T: Element> WriteArray<T> {
    /// The elements as a mutable slice: the memory must be host-accessible and C-contiguous.
    #[inline]
    pub fn as_slice_mut(&mut self) -> PyResult<&mut [T]> {
        let first = self.inner.slice_first()?;
        if self.inner.is_empty() {
            return Ok(&mut []);
        }
        // SAFETY: `first` is the aligned address of `len` contiguous elements of host memory
        // that live while `self` does; the memory is writable (checked by `write`) and this
        // process-wide exclusive borrow, held by `&mut self` for the slice's lifetime, rules out
        // every other reference handed out by this crate.
        Ok(unsafe { std::slice::from_raw_parts_mut(first, self.inner.len()) })
    }

    /// A mutable `ndarray` view with `D` axes of host-accessible memory, in any strided layout
    /// (`ndarray` refuses layouts in which two indices reach one element, such as broadcasts).
    #[cfg(feature = "ndarray")]
    pub fn as_array_mut<D: ndarray::Dimension>(
        &mut self,
    ) -> PyResult<ndarray::ArrayViewMut<'_, T, D>> {
        let (ptr, shape, reversed) = self.inner.ndarray_parts()?;
        if self.inner.strides().contains(&0) && self.inner.len() > 1 {
            return Err(PyValueError::new_err(format!(
                "argument '{}': a broadcast (zero-stride) array cannot be written through a view",
                self.inner.name
            )));
        }
        // SAFETY: as in `ReadArray::as_array`, and the memory is writable with this the only
        // borrow of it (see `as_slice_mut`).
        let mut view = unsafe { ndarray::ArrayViewMut::from_shape_ptr(shape, ptr) };
        for axis in reversed {
            view.invert_axis(ndarray::Axis(axis));
        }
        let name = self.inner.name;
        view.into_dimensionality::<D>()
            .map_err(|e| PyValueError::new_err(format!("argument '{name}': {e}")))
    }
}

/// A CUDA device pointer with the device and the stream to order work on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaPtr {
    /// The device address of element zero.
    pub ptr: u64,
    /// The device.
    pub device: Device,
    /// The stream the producer's pending work was ordered before: the calling thread's current
    /// dlbridge stream on `device` (`0`: the legacy default stream), which the extension sets
    /// with [`dlbridge::backend::cuda::set_current_stream`] before the call.
    pub stream: usize,
}
