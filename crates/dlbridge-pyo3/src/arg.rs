//! Array arguments: [`ArrayArg`] takes any framework's array without a copy; [`Expect`] checks
//! it at the border and hands out typed access ([`ReadArray`], [`WriteArray`]) under the
//! process-wide borrow rules ([`crate::borrow`]).

use std::marker::PhantomData;
use std::sync::OnceLock;

use dlbridge::{DType, Device, DeviceKind, Element, Layout, Tensor};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::borrow::{Borrow, Range};
use crate::error::named;
use crate::exchange::c_api::TableView;
use crate::numpy::{NumPyArray, Viewed};

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
enum Source {
    Tensor(Tensor),
    NumPy(NumPyArray),
    Table(TableView),
}

impl Source {
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
        let source = match crate::exchange::consumer::import(&obj)? {
            Viewed::Tensor(t) => Source::Tensor(t),
            Viewed::Struct(a) => Source::NumPy(a),
            Viewed::Table(b) => Source::Table(b),
        };
        Ok(ArrayArg { source })
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
    pub fn read<T: Element>(self, py: Python<'_>) -> PyResult<ReadArray<T>> {
        let this = self.dtype::<T>();
        this.verify()?;
        let borrow = borrow(py, this.name, &this.source, false)?;
        Ok(ReadArray {
            source: this.source,
            tensor: OnceLock::new(),
            name: this.name,
            _borrow: borrow,
            _element: PhantomData,
        })
    }

    /// Applies the checks (with element type `T` and writability) and borrows the memory
    /// mutably: refused while any array's memory overlapping it is borrowed at all, in any
    /// extension.
    pub fn write<T: Element>(self, py: Python<'_>) -> PyResult<WriteArray<T>> {
        let this = self.dtype::<T>().writable();
        this.verify()?;
        let borrow = borrow(py, this.name, &this.source, true)?;
        Ok(WriteArray {
            inner: ReadArray {
                source: this.source,
                tensor: OnceLock::new(),
                name: this.name,
                _borrow: borrow,
                _element: PhantomData,
            },
        })
    }

    #[inline]
    fn verify(&self) -> PyResult<()> {
        let t = &self.source;
        let layout = t.layout();
        let name = self.name;
        if let Some(dtype) = self.dtype
            && t.dtype() != dtype
        {
            return Err(PyTypeError::new_err(format!(
                "argument '{name}': expected an array of {dtype}, got {}",
                t.dtype()
            )));
        }
        if let Some(ndim) = self.ndim
            && layout.ndim() != ndim
        {
            return Err(PyValueError::new_err(format!(
                "argument '{name}': expected {ndim} {}, got {} (shape {})",
                if ndim == 1 { "axis" } else { "axes" },
                layout.ndim(),
                dlbridge::layout::shape_text(layout.shape())
            )));
        }
        if let Some(shape) = &self.shape {
            let fits = shape.len() == layout.ndim()
                && shape
                    .iter()
                    .zip(layout.shape())
                    .all(|(w, &h)| w.is_none_or(|w| w == h));
            if !fits {
                let wanted: Vec<String> = shape
                    .iter()
                    .map(|d| d.map_or_else(|| "?".to_owned(), |d| d.to_string()))
                    .collect();
                return Err(PyValueError::new_err(format!(
                    "argument '{name}': expected shape ({}), got {}",
                    wanted.join(", "),
                    dlbridge::layout::shape_text(layout.shape())
                )));
            }
        }
        if let Some(order) = self.order {
            let ok = match order {
                Order::C => layout.is_contiguous(),
                Order::F => layout.is_f_contiguous(),
            };
            if !ok {
                let which = if order == Order::C { "C" } else { "Fortran" };
                return Err(PyValueError::new_err(format!(
                    "argument '{name}': expected a {which}-contiguous array, got shape {} with \
                     strides {:?} (in elements); pass a contiguous copy",
                    dlbridge::layout::shape_text(layout.shape()),
                    layout.strides()
                )));
            }
        }
        if self.devices != 0 && self.devices & device_bit(t.device().kind()) == 0 {
            let kinds: Vec<String> = (0..64)
                .filter(|b| self.devices & (1 << b) != 0)
                .map(|b| DeviceKind::from_raw(b).name())
                .collect();
            return Err(PyValueError::new_err(format!(
                "argument '{name}': expected an array on {}, got one on {}",
                kinds.join(" or "),
                t.device()
            )));
        }
        if self.writable && t.is_read_only() {
            return Err(PyValueError::new_err(format!(
                "argument '{name}': expected a writable array, got a read-only one"
            )));
        }
        Ok(())
    }
}

/// Records a borrow of the bytes `source` addresses (none for an empty array, which has none).
#[inline]
fn borrow(
    py: Python<'_>,
    name: &str,
    source: &Source,
    exclusive: bool,
) -> PyResult<Option<Borrow>> {
    let Some((lo, hi)) = source.layout().element_extent() else {
        return Ok(None);
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
    _borrow: Option<Borrow>,
    _element: PhantomData<T>,
}

impl<T: Element> ReadArray<T> {
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
        self.source.layout().numel()
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
    fn host_first(&self, what: &str) -> PyResult<*mut T> {
        let first = self.source.host_first().map_err(|e| named(self.name, e))?;
        let Some(first) = first else {
            return Err(PyValueError::new_err(format!(
                "argument '{}': {what} needs host-accessible memory, got an array on {}",
                self.name,
                self.device()
            )));
        };
        let first = first.cast::<T>();
        if !first.is_aligned() {
            return Err(PyValueError::new_err(format!(
                "argument '{}': address {first:p} is not aligned for {}",
                self.name,
                T::DTYPE
            )));
        }
        Ok(first)
    }

    /// Element zero of C-contiguous host memory, for a slice.
    fn slice_first(&self) -> PyResult<*mut T> {
        let layout = self.source.layout();
        if !layout.is_contiguous() {
            return Err(PyValueError::new_err(format!(
                "argument '{}': a slice needs a C-contiguous array, got shape {} with strides \
                 {:?} (in elements)",
                self.name,
                dlbridge::layout::shape_text(layout.shape()),
                layout.strides()
            )));
        }
        self.host_first("a slice")
    }

    /// The elements as a slice: the memory must be host-accessible and C-contiguous
    /// (`ValueError` naming the argument otherwise).
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
