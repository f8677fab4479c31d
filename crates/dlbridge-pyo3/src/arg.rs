//! Array arguments: [`ArrayArg`] takes any framework's array without a copy; [`Expect`] checks
//! it at the border and hands out typed access ([`ReadArray`], [`WriteArray`]) under the
//! process-wide borrow rules ([`crate::borrow`]).

use std::marker::PhantomData;

use dlbridge::{DType, Device, DeviceKind, Element, Tensor};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::borrow::{Borrow, Range};
use crate::error::named;

/// Any array, as a `#[pyfunction]` argument: an object with a DLPack C exchange table (PyTorch,
/// dlbridge), with `__dlpack__` (NumPy, JAX, CuPy, MLX, ...), a DLPack capsule, or a
/// buffer-protocol object (`bytearray`, `array.array`, `memoryview`), imported without a copy.
///
/// The import is done before the function body runs and keeps the Python object alive for as
/// long as the tensor (or any view of it) lives. Check it with [`ArrayArg::expect`].
#[derive(Clone, Debug)]
pub struct ArrayArg {
    tensor: Tensor,
}

impl<'a, 'py> FromPyObject<'a, 'py> for ArrayArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        crate::consumer::import(&obj).map(|tensor| ArrayArg { tensor })
    }
}

impl ArrayArg {
    /// The imported tensor (the producer's memory; dlbridge never frees it).
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The imported tensor, unchecked.
    pub fn into_tensor(self) -> Tensor {
        self.tensor
    }

    /// Starts the checks of argument `name` (the name its errors give).
    pub fn expect(self, name: &'static str) -> Expect {
        Expect {
            tensor: self.tensor,
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
    tensor: Tensor,
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
fn device_bit(kind: DeviceKind) -> u64 {
    1u64.checked_shl(kind.to_raw() as u32).unwrap_or(0)
}

impl Expect {
    /// The element type must be `T`'s.
    pub fn dtype<T: Element>(self) -> Self {
        self.dtype_of(T::DTYPE)
    }

    /// The element type must be `dtype`.
    pub fn dtype_of(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// There must be `ndim` axes.
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
    pub fn c_contiguous(mut self) -> Self {
        self.order = Some(Order::C);
        self
    }

    /// The memory must be Fortran-contiguous (column-major, no gaps).
    pub fn f_contiguous(mut self) -> Self {
        self.order = Some(Order::F);
        self
    }

    /// The memory may be on devices of `kind` (call again to accept several kinds; without any
    /// call, every device is accepted).
    pub fn device(mut self, kind: DeviceKind) -> Self {
        self.devices |= device_bit(kind);
        self
    }

    /// The memory must be host memory (`kDLCPU`).
    pub fn cpu(self) -> Self {
        self.device(DeviceKind::Cpu)
    }

    /// The memory must be CUDA device memory (`kDLCUDA`).
    pub fn cuda(self) -> Self {
        self.device(DeviceKind::Cuda)
    }

    /// The memory must be writable (the producer did not mark it read-only).
    pub fn writable(mut self) -> Self {
        self.writable = true;
        self
    }

    /// Applies the checks and returns the tensor, with no typed access and no borrow.
    pub fn check(self) -> PyResult<Tensor> {
        self.verify()?;
        Ok(self.tensor)
    }

    /// Applies the checks (with element type `T`) and borrows the memory for reading: refused
    /// while any array's memory overlapping it is borrowed mutably, in any extension.
    pub fn read<T: Element>(self, py: Python<'_>) -> PyResult<ReadArray<T>> {
        let this = self.dtype::<T>();
        this.verify()?;
        let borrow = borrow(py, this.name, &this.tensor, false)?;
        Ok(ReadArray {
            tensor: this.tensor,
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
        let borrow = borrow(py, this.name, &this.tensor, true)?;
        Ok(WriteArray {
            inner: ReadArray {
                tensor: this.tensor,
                name: this.name,
                _borrow: borrow,
                _element: PhantomData,
            },
        })
    }

    fn verify(&self) -> PyResult<()> {
        let t = &self.tensor;
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
            && t.ndim() != ndim
        {
            return Err(PyValueError::new_err(format!(
                "argument '{name}': expected {ndim} {}, got {} (shape {})",
                if ndim == 1 { "axis" } else { "axes" },
                t.ndim(),
                dlbridge::layout::shape_text(t.shape())
            )));
        }
        if let Some(shape) = &self.shape {
            let fits = shape.len() == t.ndim()
                && shape
                    .iter()
                    .zip(t.shape())
                    .all(|(w, &h)| w.is_none_or(|w| w == h));
            if !fits {
                let wanted: Vec<String> = shape
                    .iter()
                    .map(|d| d.map_or_else(|| "?".to_owned(), |d| d.to_string()))
                    .collect();
                return Err(PyValueError::new_err(format!(
                    "argument '{name}': expected shape ({}), got {}",
                    wanted.join(", "),
                    dlbridge::layout::shape_text(t.shape())
                )));
            }
        }
        if let Some(order) = self.order {
            let ok = match order {
                Order::C => t.layout().is_contiguous(),
                Order::F => t.layout().is_f_contiguous(),
            };
            if !ok {
                let which = if order == Order::C { "C" } else { "Fortran" };
                return Err(PyValueError::new_err(format!(
                    "argument '{name}': expected a {which}-contiguous array, got shape {} with \
                     strides {:?} (in elements); pass a contiguous copy",
                    dlbridge::layout::shape_text(t.shape()),
                    t.strides()
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

/// Records a borrow of `tensor`'s bytes (none for an empty array, which has none).
fn borrow(py: Python<'_>, name: &str, t: &Tensor, exclusive: bool) -> PyResult<Option<Borrow>> {
    let bytes = t.byte_range();
    if bytes.is_empty() {
        return Ok(None);
    }
    let base = t.buffer().handle() as usize as u64;
    let dl = t.device().to_dlpack();
    let range = Range {
        device_type: dl.device_type,
        device_id: dl.device_id,
        start: base + bytes.start as u64,
        end: base + bytes.end as u64,
    };
    Borrow::acquire(py, name, range, exclusive).map(Some)
}

/// A checked array borrowed for reading, with elements of type `T`.
///
/// The memory cannot be borrowed mutably (by [`Expect::write`], in this or another extension)
/// while this lives. Its producer can still write to it, as with any DLPack consumer.
#[derive(Debug)]
pub struct ReadArray<T: Element> {
    tensor: Tensor,
    name: &'static str,
    _borrow: Option<Borrow>,
    _element: PhantomData<T>,
}

impl<T: Element> ReadArray<T> {
    /// The tensor (for [`dlbridge::compute::kernel::KernelArg::Tensor`] and other core calls).
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Extents.
    pub fn shape(&self) -> &[usize] {
        self.tensor.shape()
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[isize] {
        self.tensor.strides()
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.tensor.device()
    }

    /// The elements as a slice: the memory must be host-accessible and C-contiguous
    /// (`ValueError` naming the argument otherwise).
    pub fn as_slice(&self) -> PyResult<&[T]> {
        self.tensor.as_slice::<T>().map_err(|e| named(self.name, e))
    }

    /// The device address of the first element and the stream to use it on, for memory on a
    /// CUDA device (`ValueError` elsewhere).
    pub fn cuda_ptr(&self) -> PyResult<CudaPtr> {
        cuda_ptr(self.name, &self.tensor)
    }

    /// An `ndarray` view with `D` axes (`IxDyn` for any number) of host-accessible memory, in
    /// any strided layout.
    #[cfg(feature = "ndarray")]
    pub fn as_array<D: ndarray::Dimension>(&self) -> PyResult<ndarray::ArrayView<'_, T, D>> {
        let (ptr, shape) = self.host_first(false)?;
        // SAFETY: `host_first` checked that `ptr` is the aligned address of element zero of
        // host memory the shape and strides address, alive while `self` (which holds the
        // tensor and its keep-alive) is borrowed; `T` is the dtype's element type, so every bit
        // pattern is valid.
        let view = unsafe { ndarray::ArrayView::from_shape_ptr(shape, ptr.cast_const()) };
        view.into_dimensionality::<D>()
            .map_err(|e| PyValueError::new_err(format!("argument '{}': {e}", self.name)))
    }

    /// The address of element zero in host memory, and the `ndarray` shape with strides.
    #[cfg(feature = "ndarray")]
    fn host_first(&self, _write: bool) -> PyResult<(*mut T, ndarray::StrideShape<ndarray::IxDyn>)> {
        use ndarray::ShapeBuilder;
        let t = &self.tensor;
        let Some(base) = t.buffer().host_ptr() else {
            return Err(PyValueError::new_err(format!(
                "argument '{}': an ndarray view needs host-accessible memory, got an array on {}",
                self.name,
                t.device()
            )));
        };
        dlbridge::backend::host_barrier(t.device()).map_err(|e| named(self.name, e))?;
        let first = base.as_ptr().wrapping_add(t.byte_offset()).cast::<T>();
        if !first.is_aligned() {
            return Err(PyValueError::new_err(format!(
                "argument '{}': address {first:p} is not aligned for {}",
                self.name,
                T::DTYPE
            )));
        }
        // ndarray takes strides as `usize`, a negative stride as its two's complement.
        let strides: Vec<usize> = t.strides().iter().map(|&s| s as usize).collect();
        let shape = ndarray::IxDyn(t.shape()).strides(ndarray::IxDyn(&strides));
        Ok((first, shape))
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
        let len = self.inner.as_slice()?.len();
        let first = self.inner.as_slice()?.as_ptr().cast_mut();
        // SAFETY: `as_slice` checked that `first` starts `len` aligned, contiguous elements of
        // host memory that live while `self` does; the memory is writable (checked by `write`)
        // and this extension-wide exclusive borrow, held by `&mut self` for the slice's
        // lifetime, rules out every other reference handed out by this crate.
        Ok(unsafe { std::slice::from_raw_parts_mut(first, len) })
    }

    /// A mutable `ndarray` view with `D` axes of host-accessible memory, in any strided layout
    /// (`ndarray` refuses layouts in which two indices reach one element, such as broadcasts).
    #[cfg(feature = "ndarray")]
    pub fn as_array_mut<D: ndarray::Dimension>(
        &mut self,
    ) -> PyResult<ndarray::ArrayViewMut<'_, T, D>> {
        let (ptr, shape) = self.inner.host_first(true)?;
        if self.inner.strides().contains(&0) && self.inner.tensor.numel() > 1 {
            return Err(PyValueError::new_err(format!(
                "argument '{}': a broadcast (zero-stride) array cannot be written through a view",
                self.inner.name
            )));
        }
        // SAFETY: as in `ReadArray::as_array`, and the memory is writable with this the only
        // borrow of it (see `as_slice_mut`).
        let view = unsafe { ndarray::ArrayViewMut::from_shape_ptr(shape, ptr) };
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

fn cuda_ptr(name: &str, t: &Tensor) -> PyResult<CudaPtr> {
    if !t.device().kind().is_cuda() {
        return Err(PyValueError::new_err(format!(
            "argument '{name}': expected CUDA memory for a device pointer, got an array on {}",
            t.device()
        )));
    }
    Ok(CudaPtr {
        ptr: (t.buffer().handle() as usize as u64).wrapping_add(t.byte_offset() as u64),
        device: t.device(),
        stream: dlbridge::backend::current_stream(t.device()),
    })
}
