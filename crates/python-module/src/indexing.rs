//! `Array.__getitem__` / `__setitem__`: NumPy's indexing rules.
//!
//! | index | result |
//! | --- | --- |
//! | integers, slices (any step), `...`, `None` | a view that shares memory |
//! | integer arrays (lists, dlbridge or NumPy or any DLPack arrays) and boolean masks, among basic indices | a copy ([`dlbridge::compute::index::take`]); assignment writes through ([`dlbridge::compute::index::put`]) |
//!
//! With advanced indices, every integer index counts as one too (NumPy's rule), a mask of `k`
//! dimensions stands for the `k` integer arrays of its true positions, the index arrays broadcast
//! together, and their axes replace the indexed ones: in place when the advanced indices are
//! adjacent in the index, else first. A 0-d boolean index (`a[True]`, a 0-d mask) adds an axis
//! that it indexes with `[0]` (true) or `[]` (false), as NumPy does.

use dlbridge::compute::index;
use dlbridge::{DType, DTypeCode, SliceArg, Tensor};
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyEllipsis, PyInt, PyList, PySlice, PyTuple};

use crate::array::PyArray;
use crate::convert;
use crate::errors::IntoPyResult;

/// What NumPy accepts as an index, for messages.
const VALID: &str = "only integers, slices (`:`), ellipsis (`...`), None and integer or boolean \
                     arrays are valid indices";

/// One item of an index.
enum Item<'py> {
    /// An integer (or an object with `__index__`, a 0-d integer array included).
    Int(Bound<'py, PyAny>),
    Slice(Bound<'py, PySlice>),
    NewAxis,
    Ellipsis,
    /// An integer index array.
    Ints(Tensor),
    /// A boolean mask of at least one dimension.
    Mask(Tensor),
    /// A 0-d boolean index: a new axis, indexed by `[0]` when true and `[]` when false.
    Flag(bool),
}

impl Item<'_> {
    /// How many of the array's axes the item consumes.
    fn consumes(&self) -> usize {
        match self {
            Item::Int(_) | Item::Slice(_) | Item::Ints(_) => 1,
            Item::Mask(m) => m.ndim(),
            Item::NewAxis | Item::Ellipsis | Item::Flag(_) => 0,
        }
    }

    fn is_advanced(&self) -> bool {
        matches!(self, Item::Ints(_) | Item::Mask(_) | Item::Flag(_))
    }
}

/// An array index's tensor: integers or a mask; `IndexError` for other dtypes, as NumPy's.
fn array_item<'py>(obj: &Bound<'py, PyAny>, t: Tensor) -> PyResult<Item<'py>> {
    match t.dtype().code() {
        DTypeCode::Bool if t.ndim() == 0 => Ok(Item::Flag(obj.is_truthy()?)),
        DTypeCode::Bool => Ok(Item::Mask(t)),
        DTypeCode::Int | DTypeCode::UInt if t.ndim() == 0 => Ok(Item::Int(obj.clone())),
        DTypeCode::Int | DTypeCode::UInt => Ok(Item::Ints(t)),
        _ => Err(PyIndexError::new_err(format!(
            "arrays used as indices must be of integer (or boolean) type, not {}",
            t.dtype()
        ))),
    }
}

/// Reads one item of an index.
fn item<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Item<'py>> {
    let py = obj.py();
    if obj.is_instance_of::<PyEllipsis>() {
        return Ok(Item::Ellipsis);
    }
    if obj.is_none() {
        return Ok(Item::NewAxis);
    }
    if let Ok(slice) = obj.cast::<PySlice>() {
        return Ok(Item::Slice(slice.clone()));
    }
    if obj.is_instance_of::<PyBool>() {
        return Ok(Item::Flag(obj.is_truthy()?));
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(Item::Int(obj.clone()));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        // A sequence: an index array (an empty one indexes nothing, with integers).
        if obj.len()? == 0 {
            return Ok(Item::Ints(
                Tensor::empty(&[0], DType::I64, dlbridge::Device::CPU).py()?,
            ));
        }
        let t = crate::creation::tensor_from(obj, None, None, None, None).map_err(|e| {
            PyIndexError::new_err(format!("{VALID} (a sequence that is not an array: {e})"))
        })?;
        return array_item(obj, t);
    }
    if let Ok(a) = obj.cast::<PyArray>() {
        let t = a.get().tensor()?.clone();
        return array_item(obj, t);
    }
    if obj.hasattr(intern!(py, "__dlpack__"))? {
        let t = crate::creation::tensor_from(obj, None, None, None, None)?;
        return array_item(obj, t);
    }
    if obj.hasattr(intern!(py, "__index__"))? {
        return Ok(Item::Int(obj.clone()));
    }
    Err(PyIndexError::new_err(format!(
        "{VALID} (got {})",
        obj.get_type().name()?
    )))
}

/// The advanced part of an index, on the view the basic part made.
enum Advanced {
    /// The view's axes, their index arrays, and whether the broadcast index axes go first (the
    /// advanced indices were not adjacent).
    Arrays(Vec<usize>, Vec<Tensor>, bool),
    /// One mask, the only advanced index, over the view's axes from this one on: gathered
    /// straight from the mask ([`index::take_mask`]), without index arrays.
    Mask(usize, Tensor),
}

/// What an index selects: a view of the array, and its advanced part if any.
struct Selection {
    view: Tensor,
    advanced: Option<Advanced>,
}

/// Applies `key` to `t`: the basic indices as a view, the advanced ones gathered for
/// [`index::take`] / [`index::put`].
fn select(t: &Tensor, key: &Bound<'_, PyAny>) -> PyResult<Selection> {
    let raw: Vec<Bound<'_, PyAny>> = match key.cast::<PyTuple>() {
        Ok(tuple) => tuple.iter().collect(),
        Err(_) => vec![key.clone()],
    };
    let items: Vec<Item<'_>> = raw.iter().map(item).collect::<PyResult<_>>()?;
    if items.iter().filter(|i| matches!(i, Item::Ellipsis)).count() > 1 {
        return Err(PyIndexError::new_err(
            "an index can only have a single ellipsis ('...')",
        ));
    }
    let consuming: usize = items.iter().map(Item::consumes).sum();
    let ndim = t.ndim();
    if consuming > ndim {
        return Err(PyIndexError::new_err(format!(
            "too many indices: the array has {ndim} dimensions but {consuming} were indexed"
        )));
    }
    let advanced = items.iter().any(Item::is_advanced);
    // One mask and no other advanced index (integers count as advanced ones beside it).
    let lone_mask = items
        .iter()
        .filter(|i| i.is_advanced() || matches!(i, Item::Int(_)))
        .count()
        == 1
        && items.iter().any(|i| matches!(i, Item::Mask(_)));
    let mut mask_selection = None;
    let mut view = t.clone();
    // `axis` counts the view's axes as it is built; `source` counts this array's, which messages
    // name (an integer index removes an axis from the view, not from the source).
    let (mut axis, mut source) = (0usize, 0usize);
    let (mut axes, mut arrays, mut positions) = (Vec::new(), Vec::new(), Vec::new());
    for (k, it) in items.iter().enumerate() {
        match it {
            Item::Ellipsis => {
                axis += ndim - consuming;
                source += ndim - consuming;
            }
            Item::NewAxis => {
                view = view.expand_dims(axis).py()?;
                axis += 1;
            }
            Item::Slice(slice) => {
                let arg = slice_arg(slice, view.shape()[axis])?;
                view = view.slice(axis as isize, arg).py()?;
                axis += 1;
                source += 1;
            }
            Item::Int(obj) => {
                let i = int_index(obj, source, view.shape()[axis])?;
                if advanced {
                    // Among advanced indices an integer is one too (a 0-d index array).
                    axes.push(axis);
                    arrays.push(Tensor::from_slice(&[i as i64], &[]).py()?);
                    positions.push(k);
                    axis += 1;
                } else {
                    view = view.index(axis as isize, i).py()?;
                }
                source += 1;
            }
            Item::Ints(idx) => {
                axes.push(axis);
                arrays.push(idx.clone());
                positions.push(k);
                axis += 1;
                source += 1;
            }
            Item::Mask(mask) => {
                for (j, &len) in mask.shape().iter().enumerate() {
                    let extent = view.shape()[axis + j];
                    if len != extent {
                        return Err(PyIndexError::new_err(format!(
                            "boolean index did not match indexed array along axis {}; size of \
                             axis is {extent} but size of corresponding boolean axis is {len}",
                            source + j
                        )));
                    }
                }
                if lone_mask {
                    mask_selection = Some(Advanced::Mask(axis, mask.clone()));
                } else {
                    let nonzero = key.py().detach(|| index::nonzero(mask)).py()?;
                    for (j, positions_j) in nonzero.into_iter().enumerate() {
                        axes.push(axis + j);
                        arrays.push(positions_j);
                    }
                }
                positions.push(k);
                axis += mask.ndim();
                source += mask.ndim();
            }
            Item::Flag(flag) => {
                view = view.expand_dims(axis).py()?;
                let selected: &[i64] = if *flag { &[0] } else { &[] };
                axes.push(axis);
                arrays.push(Tensor::from_slice(selected, &[selected.len()]).py()?);
                positions.push(k);
                axis += 1;
            }
        }
    }
    if !advanced || mask_selection.is_some() {
        return Ok(Selection {
            view,
            advanced: mask_selection,
        });
    }
    // The index arrays must broadcast together (an IndexError in NumPy).
    let mut shape: Vec<usize> = Vec::new();
    for a in &arrays {
        shape = dlbridge::compute::broadcast_shapes(&shape, a.shape()).map_err(|_| {
            PyIndexError::new_err(format!(
                "shape mismatch: indexing arrays could not be broadcast together with shapes {}",
                arrays
                    .iter()
                    .map(|a| dlbridge::layout::shape_text(a.shape()))
                    .collect::<Vec<_>>()
                    .join(" ")
            ))
        })?;
    }
    let adjacent = positions
        .last()
        .zip(positions.first())
        .map(|(l, f)| l - f + 1)
        == Some(positions.len());
    Ok(Selection {
        view,
        advanced: Some(Advanced::Arrays(axes, arrays, !adjacent)),
    })
}

/// `a[key]`: a view for basic indices, a copy for advanced ones.
pub(crate) fn get(t: &Tensor, key: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let sel = select(t, key)?;
    let view = sel.view;
    match sel.advanced {
        None => Ok(view),
        Some(Advanced::Arrays(axes, arrays, first)) => key
            .py()
            .detach(|| index::take(&view, &axes, &arrays, first))
            .py(),
        Some(Advanced::Mask(axis, mask)) => key
            .py()
            .detach(|| index::take_mask(&view, axis, &mask))
            .py(),
    }
}

/// `a[key] = value`: writes `value` (a Python number, a dlbridge array, or anything `asarray`
/// takes, broadcast to the selection) into the selected elements.
pub(crate) fn set(t: &Tensor, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
    let sel = select(t, key)?;
    let view = sel.view;
    let dtype = view.dtype();
    if let Some(advanced) = sel.advanced {
        let values = match value.cast::<PyArray>() {
            Ok(a) => a.get().tensor()?.clone(),
            Err(_) => crate::creation::tensor_from(value, Some(dtype), None, None, None)?,
        };
        return match advanced {
            // SAFETY: no Rust reference into this array's memory outlives a Python call, and the
            // GIL is held for the whole write (as for basic assignment below).
            Advanced::Arrays(axes, arrays, first) => unsafe {
                index::put(&view, &axes, &arrays, first, &values)
            },
            // SAFETY: as above.
            Advanced::Mask(axis, mask) => unsafe { index::put_mask(&view, axis, &mask, &values) },
        }
        .py();
    }
    if convert::scalar_kind(value).is_some() {
        let mut element = Vec::with_capacity(dtype.itemsize());
        convert::write_element(dtype, value, &mut element)?;
        // SAFETY: no Rust reference into this array's memory outlives a Python call, and the
        // GIL is held for the whole write. (Writers outside Python, such as a library's own
        // threads, race here exactly as they would with NumPy.)
        return unsafe { view.fill_bytes_unchecked(&element) }.py();
    }
    // Another dlbridge array is copied straight across devices (no intermediate copy).
    let src = match value.cast::<PyArray>() {
        Ok(a) if a.get().tensor()?.dtype() == dtype => a.get().tensor()?.clone(),
        _ => crate::creation::tensor_from(value, Some(dtype), Some(view.device()), None, None)?,
    };
    // SAFETY: as above.
    unsafe { view.copy_from_unchecked(&src) }.py()
}

/// An integer index from an `int` or any object with `__index__`, checked against an axis of
/// `len` elements (`axis` as the user counts it): `IndexError` as NumPy words it, also for
/// integers too large for 64 bits.
fn int_index(obj: &Bound<'_, PyAny>, axis: usize, len: usize) -> PyResult<isize> {
    let value = match obj.extract::<isize>() {
        Ok(i) => Some(i),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => None,
        Err(_) => {
            return Err(PyIndexError::new_err(format!(
                "{VALID} (got {})",
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            )));
        }
    };
    let len_i = len as isize;
    match value {
        Some(i) if (-len_i..len_i).contains(&i) => Ok(i),
        _ => Err(PyIndexError::new_err(format!(
            "index {} is out of bounds for axis {axis} with size {len}",
            obj.str()?
        ))),
    }
}

/// One bound or step of a slice: `None`, or an integer (through `__index__`) saturated to
/// `isize` (a bound past either end of the axis selects as the end itself, as in Python).
fn slice_part(v: &Bound<'_, PyAny>) -> PyResult<Option<isize>> {
    if v.is_none() {
        return Ok(None);
    }
    match v.extract::<isize>() {
        Ok(i) => Ok(Some(i)),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(v.py()) => {
            Ok(Some(if v.lt(0)? { isize::MIN } else { isize::MAX }))
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "slice indices must be integers or None or have an __index__ method (got {})",
            v.get_type().name()?
        ))),
    }
}

/// A Python slice over an axis of `len` elements, clamped as Python and NumPy clamp: any bound
/// (even past 64 bits) selects, and a step as long as the axis or longer picks one element.
fn slice_arg(slice: &Bound<'_, PySlice>, len: usize) -> PyResult<SliceArg> {
    let py = slice.py();
    let step = slice_part(&slice.getattr(intern!(py, "step"))?)?.unwrap_or(1);
    if step == 0 {
        return Err(PyValueError::new_err("slice step cannot be zero"));
    }
    // A step past the axis's length selects what a step of the length selects (the start
    // alone), and keeps the new stride far from overflow.
    let longest = len.max(1).min(isize::MAX as usize) as isize;
    Ok(SliceArg {
        start: slice_part(&slice.getattr(intern!(py, "start"))?)?,
        stop: slice_part(&slice.getattr(intern!(py, "stop"))?)?,
        step: step.clamp(-longest, longest),
    })
}
