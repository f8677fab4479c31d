//! Strided layouts: shape, strides in elements and a byte offset, with every size, extent and
//! offset computed with overflow checks.

use std::ops::Range;

use smallvec::SmallVec;

use crate::error::{Error, Result, overflow};

/// The most dimensions a layout may have. DLPack sets no bound; 64 is NumPy's (`NPY_MAXDIMS`), so
/// any array NumPy can hold fits, and a corrupt `ndim` is refused before anything is read.
pub const MAX_NDIM: usize = 64;

/// Axes a layout keeps inline; layouts of more axes put their extents and strides on the heap.
const INLINE_NDIM: usize = 4;

/// Writes the row-major strides of `shape` (each the product of the extents after its axis) to
/// `out`. A 0 extent counts as 1, which keeps later strides at the product of the extents after
/// them; the caller checked that the product of all extents fits, so no stride of a non-empty
/// shape overflows. An empty shape's other extents may multiply past `isize::MAX` (its strides
/// address nothing): those strides saturate there rather than wrap to negative values.
#[inline]
pub(crate) fn row_major_strides(shape: &[usize], out: &mut [isize]) {
    let mut acc = 1usize;
    for (stride, &dim) in out.iter_mut().zip(shape).rev() {
        *stride = acc.min(isize::MAX as usize) as isize;
        acc = acc.saturating_mul(dim.max(1));
    }
}

/// Merges the axes of several operands walked together over one `shape` (outermost first;
/// `strides[k]` is operand `k`'s, in any unit, as long as `shape`): axes of extent 1 are dropped,
/// and an axis of extent `n` is folded into the axis just outside it when, for every operand, one
/// step of the outer axis is `n` steps of the inner one. Returns the merged extents and each
/// operand's strides over them, outermost first; position `i` of the merged axes addresses, on
/// every operand, what position `i` (row-major) of `shape` addressed.
///
/// Every planner that walks strided operands (copies, element-wise kernels, reductions) merges
/// with this one routine. An axis folds only where `n` inner steps are exactly one outer step
/// without overflow, so a merged axis never reaches an offset the layout does not (found by the
/// `layout` fuzz target: strides `[isize::MIN, 2^62]` over `[2, 2]` "merged" by wrapping into one
/// axis whose last offset overflowed). Extents multiply with wrapping: only an empty shape's
/// extents can overflow, and they address nothing.
pub(crate) fn merge_axes(shape: &[usize], strides: &[&[isize]]) -> (Vec<usize>, Vec<Vec<isize>>) {
    debug_assert!(strides.iter().all(|s| s.len() == shape.len()));
    let mut extents: Vec<usize> = Vec::with_capacity(shape.len());
    let mut merged: Vec<Vec<isize>> = vec![Vec::with_capacity(shape.len()); strides.len()];
    for (axis, &n) in shape.iter().enumerate().filter(|&(_, &n)| n != 1) {
        let folds = extents.last().is_some()
            && strides.iter().zip(&merged).all(|(s, m)| {
                let step = isize::try_from(n).ok().and_then(|n| s[axis].checked_mul(n));
                m.last().is_some_and(|&outer| step == Some(outer))
            });
        if folds {
            let last = extents.len() - 1;
            extents[last] = extents[last].wrapping_mul(n);
            for (s, m) in strides.iter().zip(&mut merged) {
                m[last] = s[axis];
            }
        } else {
            extents.push(n);
            for (s, m) in strides.iter().zip(&mut merged) {
                m.push(s[axis]);
            }
        }
    }
    (extents, merged)
}

/// Extents or strides: inline up to [`INLINE_NDIM`] axes, so that making a view (or a new
/// array) of up to four axes allocates nothing for them.
pub(crate) type Dims<T> = SmallVec<[T; INLINE_NDIM]>;

/// How a strided array addresses its buffer: `shape`, `strides` in elements (negative and zero
/// allowed) and the byte offset of element `[0, 0, ...]` from the start of the buffer.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Layout {
    shape: Dims<usize>,
    strides: Dims<isize>,
    byte_offset: usize,
}

/// One axis of a slice, with Python semantics: `start`/`stop` may be negative (counted from the
/// end) or out of range (clamped), `step` must not be 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SliceArg {
    /// First index (default: 0, or the last index for a negative step).
    pub start: Option<isize>,
    /// One past the last index (default: the end in the step's direction).
    pub stop: Option<isize>,
    /// Step between indices; negative walks backwards.
    pub step: isize,
}

impl SliceArg {
    /// The whole axis.
    pub const FULL: SliceArg = SliceArg {
        start: None,
        stop: None,
        step: 1,
    };

    /// `start..stop` with step 1.
    pub fn range(start: isize, stop: isize) -> Self {
        SliceArg {
            start: Some(start),
            stop: Some(stop),
            step: 1,
        }
    }

    /// Resolves against an axis of length `len`: the first index and the number of elements.
    pub(crate) fn resolve(self, len: usize) -> Result<(usize, usize)> {
        if self.step == 0 {
            return Err(Error::InvalidArgument("slice step cannot be zero".into()));
        }
        let len = isize::try_from(len).map_err(|_| overflow("axis length"))?;
        let clamp = |i: isize, lo: isize, hi: isize| -> isize {
            let i = if i < 0 { i.saturating_add(len) } else { i };
            i.clamp(lo, hi)
        };
        let (start, stop) = if self.step > 0 {
            (
                self.start.map_or(0, |s| clamp(s, 0, len)),
                self.stop.map_or(len, |s| clamp(s, 0, len)),
            )
        } else {
            (
                self.start.map_or(len - 1, |s| clamp(s, -1, len - 1)),
                self.stop.map_or(-1, |s| clamp(s, -1, len - 1)),
            )
        };
        let count = if self.step > 0 {
            if stop > start {
                (stop - start - 1) / self.step + 1
            } else {
                0
            }
        } else if start > stop {
            // `unsigned_abs`: `-step` overflows for `isize::MIN`.
            ((start - stop - 1) as usize / self.step.unsigned_abs() + 1) as isize
        } else {
            0
        };
        Ok((if count == 0 { 0 } else { start as usize }, count as usize))
    }
}

/// The element count of `shape`, checked to fit in `isize`, as every extent must (also in an
/// empty shape, whose other extents could otherwise be anything).
#[inline]
fn checked_numel(shape: &[usize]) -> Result<usize> {
    match shape
        .iter()
        .try_fold(1usize, |acc, &d| {
            if d > isize::MAX as usize {
                None
            } else {
                acc.checked_mul(d)
            }
        })
        .filter(|&n| n <= isize::MAX as usize)
    {
        Some(n) => Ok(n),
        None => Err(numel_overflow(shape)),
    }
}

#[cold]
fn numel_overflow(shape: &[usize]) -> Error {
    overflow(format!("element count of shape {shape:?}"))
}

#[cold]
fn too_many_axes(ndim: usize) -> Error {
    Error::Shape(format!("{ndim} dimensions exceed the limit of {MAX_NDIM}"))
}

fn wrap_axis(axis: isize, ndim: usize) -> Result<usize> {
    let n = ndim as isize;
    let a = if axis < 0 { axis + n } else { axis };
    if (0..n).contains(&a) {
        Ok(a as usize)
    } else {
        Err(Error::OutOfBounds(format!(
            "axis {axis} is out of range for {ndim} dimensions"
        )))
    }
}

/// `offset + index * stride * itemsize` in bytes, checked to stay within `0..=isize::MAX`.
fn moved_offset(offset: usize, index: usize, stride: isize, itemsize: usize) -> Result<usize> {
    // `index * stride` fits in `i128`, but times `itemsize` it may not: checked, not wrapped.
    let moved = ((index as i128) * (stride as i128))
        .checked_mul(itemsize as i128)
        .and_then(|delta| delta.checked_add(offset as i128))
        .filter(|moved| (0..=isize::MAX as i128).contains(moved));
    match moved {
        Some(moved) => Ok(moved as usize),
        None => Err(overflow("view byte offset")),
    }
}

impl Layout {
    /// A compact row-major (C-order) layout.
    #[inline]
    pub fn contiguous(shape: &[usize]) -> Result<Self> {
        Self::contiguous_at(shape, 0)
    }

    /// A compact row-major layout starting `byte_offset` bytes into the buffer.
    #[inline(always)]
    pub fn contiguous_at(shape: &[usize], byte_offset: usize) -> Result<Self> {
        if shape.len() > MAX_NDIM {
            return Err(too_many_axes(shape.len()));
        }
        checked_numel(shape)?;
        let n = shape.len();
        let (shape, strides) = if n <= INLINE_NDIM {
            // Built in place from arrays: no copy call for the common few axes.
            let mut extents = [0usize; INLINE_NDIM];
            let mut strides = [0isize; INLINE_NDIM];
            extents[..n].copy_from_slice(shape);
            row_major_strides(shape, &mut strides[..n]);
            (
                Dims::from_buf_and_len(extents, n),
                Dims::from_buf_and_len(strides, n),
            )
        } else {
            let mut strides = Dims::from_elem(0, n);
            row_major_strides(shape, &mut strides);
            (Dims::from_slice(shape), strides)
        };
        Ok(Layout {
            shape,
            strides,
            byte_offset,
        })
    }

    /// A layout from parts; checks the dimension count and that the element count fits.
    #[inline]
    pub fn new(shape: &[usize], strides: &[isize], byte_offset: usize) -> Result<Self> {
        let n = shape.len();
        if n <= INLINE_NDIM && strides.len() == n {
            // Built in place from arrays: no copy call for the common few axes (every argument
            // a binding reads from NumPy's struct comes this way).
            // A fixed trip count: unrolled, where a copy of `n` elements would call `memcpy`.
            let extents: [usize; INLINE_NDIM] =
                std::array::from_fn(|i| shape.get(i).map_or(0, |&d| d));
            let steps: [isize; INLINE_NDIM] =
                std::array::from_fn(|i| strides.get(i).map_or(0, |&s| s));
            checked_numel(shape)?;
            return Ok(Layout {
                shape: Dims::from_buf_and_len(extents, n),
                strides: Dims::from_buf_and_len(steps, n),
                byte_offset,
            });
        }
        Layout::from_dims(
            Dims::from_slice(shape),
            Dims::from_slice(strides),
            byte_offset,
        )
    }

    /// [`Layout::new`] taking the extents and strides it keeps (no copy of them).
    #[inline]
    pub(crate) fn from_dims(
        shape: Dims<usize>,
        strides: Dims<isize>,
        byte_offset: usize,
    ) -> Result<Self> {
        if shape.len() != strides.len() {
            return Err(Error::Shape(format!(
                "{} extents but {} strides",
                shape.len(),
                strides.len()
            )));
        }
        if shape.len() > MAX_NDIM {
            return Err(too_many_axes(shape.len()));
        }
        checked_numel(&shape)?;
        Ok(Layout {
            shape,
            strides,
            byte_offset,
        })
    }

    /// Extents.
    #[inline]
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Strides in elements.
    #[inline]
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }

    /// Byte offset of the first element from the start of the buffer.
    #[inline]
    pub fn byte_offset(&self) -> usize {
        self.byte_offset
    }

    /// Number of dimensions.
    #[inline]
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (1 for a 0-d layout).
    #[inline]
    pub fn numel(&self) -> usize {
        // The product fits (checked when the layout was built), but only in some order when an
        // extent is 0: reordered axes (transpose, permute) can overflow before reaching the 0.
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .unwrap_or(0)
    }

    /// Whether elements are laid out compactly in row-major order. Extents of 1 may have any
    /// stride; an empty layout is contiguous.
    #[inline]
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expected = 1isize;
        for (&dim, &stride) in self.shape.iter().zip(&self.strides).rev() {
            if dim != 1 {
                if stride != expected {
                    return false;
                }
                expected *= dim as isize;
            }
        }
        true
    }

    /// Whether elements are laid out compactly in column-major order.
    pub fn is_f_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expected = 1isize;
        for (&dim, &stride) in self.shape.iter().zip(&self.strides) {
            if dim != 1 {
                if stride != expected {
                    return false;
                }
                expected *= dim as isize;
            }
        }
        true
    }

    /// The lowest and highest element offsets (in elements, relative to the first element) that
    /// the layout addresses; `None` when it has no elements.
    #[inline]
    pub fn element_extent(&self) -> Option<(i128, i128)> {
        if self.numel() == 0 {
            return None;
        }
        let (mut lo, mut hi) = (0i128, 0i128);
        for (&dim, &stride) in self.shape.iter().zip(&self.strides) {
            let reach = (dim as i128 - 1) * stride as i128;
            if reach < 0 { lo += reach } else { hi += reach }
        }
        Some((lo, hi))
    }

    /// The bytes the layout addresses for elements of `itemsize` bytes, relative to the start of the
    /// buffer; empty (at `byte_offset`) when there are no elements. Fails when the range starts
    /// before the buffer or does not fit in `isize`.
    pub fn byte_range(&self, itemsize: usize) -> Result<Range<usize>> {
        let Some((lo, hi)) = self.element_extent() else {
            return Ok(self.byte_offset..self.byte_offset);
        };
        let extent_overflow = || {
            overflow(format!(
                "extent of shape {:?} with strides {:?}",
                self.shape, self.strides
            ))
        };
        // The element extent fits in `i128` (at most 2^126 elements either way), but in bytes it
        // may not: a wrapped product would make a huge reach look small.
        let (lo, hi) = extent_bytes(lo, hi, itemsize).ok_or_else(extent_overflow)?;
        let start = self.byte_offset as i128 + lo;
        let end = self.byte_offset as i128 + hi;
        if start < 0 {
            return Err(Error::OutOfBounds(format!(
                "strides {:?} reach {} bytes before the start of the buffer",
                self.strides, -start
            )));
        }
        if end > isize::MAX as i128 {
            return Err(extent_overflow());
        }
        Ok(start as usize..end as usize)
    }

    /// Keeps the elements `arg` selects along `axis`.
    pub fn slice(&self, axis: isize, arg: SliceArg, itemsize: usize) -> Result<Layout> {
        let axis = wrap_axis(axis, self.ndim())?;
        let (start, count) = arg.resolve(self.shape[axis])?;
        let mut out = self.clone();
        out.shape[axis] = count;
        // An empty view addresses no bytes: keep its offset where it is.
        if out.numel() > 0 {
            out.byte_offset = moved_offset(self.byte_offset, start, self.strides[axis], itemsize)?;
        }
        out.strides[axis] = self.strides[axis]
            .checked_mul(arg.step)
            .ok_or_else(|| overflow("sliced stride"))?;
        Ok(out)
    }

    /// Picks index `index` (negative counts from the end) along `axis`, dropping the axis.
    pub fn index(&self, axis: isize, index: isize, itemsize: usize) -> Result<Layout> {
        let axis = wrap_axis(axis, self.ndim())?;
        let len = self.shape[axis] as isize;
        let i = if index < 0 { index + len } else { index };
        if !(0..len).contains(&i) {
            return Err(Error::OutOfBounds(format!(
                "index {index} is out of range for axis {axis} of length {len}"
            )));
        }
        let mut out = self.clone();
        if self.numel() > 0 {
            out.byte_offset =
                moved_offset(self.byte_offset, i as usize, self.strides[axis], itemsize)?;
        }
        out.shape.remove(axis);
        out.strides.remove(axis);
        Ok(out)
    }

    /// Inserts an axis of length 1 before position `axis` (`0..=ndim`).
    pub fn expand_dims(&self, axis: usize) -> Result<Layout> {
        if axis > self.ndim() {
            return Err(Error::OutOfBounds(format!(
                "cannot insert an axis at {axis} in {} dimensions",
                self.ndim()
            )));
        }
        if self.ndim() + 1 > MAX_NDIM {
            return Err(Error::Shape(format!("more than {MAX_NDIM} dimensions")));
        }
        let stride = if axis < self.ndim() {
            self.strides[axis].saturating_mul(self.shape[axis] as isize)
        } else {
            1
        };
        let mut out = self.clone();
        out.shape.insert(axis, 1);
        out.strides.insert(axis, stride);
        Ok(out)
    }

    /// Reorders the axes: axis `i` of the result is axis `axes[i]` of `self`.
    pub fn permute(&self, axes: &[usize]) -> Result<Layout> {
        let n = self.ndim();
        let mut seen = vec![false; n];
        if axes.len() != n {
            return Err(Error::Shape(format!(
                "permutation {axes:?} does not name each of {n} axes once"
            )));
        }
        for &a in axes {
            if a >= n || std::mem::replace(&mut seen[a], true) {
                return Err(Error::Shape(format!(
                    "permutation {axes:?} does not name each of {n} axes once"
                )));
            }
        }
        Ok(Layout {
            shape: axes.iter().map(|&a| self.shape[a]).collect(),
            strides: axes.iter().map(|&a| self.strides[a]).collect(),
            byte_offset: self.byte_offset,
        })
    }

    /// Reverses the axes (the matrix transpose for 2-d layouts).
    pub fn transpose(&self) -> Layout {
        Layout {
            shape: self.shape.iter().rev().copied().collect(),
            strides: self.strides.iter().rev().copied().collect(),
            byte_offset: self.byte_offset,
        }
    }

    /// The same elements in row-major order under a new shape, without moving data; fails when the
    /// strides cannot express it (copy first in that case). One extent may be given as `None`, to be
    /// inferred.
    pub fn reshape(&self, new_shape: &[Option<usize>]) -> Result<Layout> {
        let numel = self.numel();
        let shape = infer_shape(new_shape, numel)?;
        if numel == 0 {
            return Layout::contiguous_at(&shape, self.byte_offset);
        }
        let old: Vec<(usize, isize)> = self
            .shape
            .iter()
            .zip(&self.strides)
            .filter(|(d, _)| **d != 1)
            .map(|(&d, &s)| (d, s))
            .collect();
        let mut strides = vec![1isize; shape.len()];
        let (mut oi, mut ni) = (0usize, 0usize);
        while ni < shape.len() && oi < old.len() {
            let (mut np, mut op) = (shape[ni], old[oi].0);
            let (mut nj, mut oj) = (ni + 1, oi + 1);
            while np != op {
                if np < op {
                    np *= shape[nj];
                    nj += 1;
                } else {
                    op *= old[oj].0;
                    oj += 1;
                }
            }
            for k in oi..oj - 1 {
                // A product that overflows cannot equal a stride: the axes do not merge.
                if old[k + 1].1.checked_mul(old[k + 1].0 as isize) != Some(old[k].1) {
                    return Err(Error::Shape(format!(
                        "cannot reshape a view of shape {:?} and strides {:?} to {shape:?} \
                         without a copy",
                        self.shape, self.strides
                    )));
                }
            }
            strides[nj - 1] = old[oj - 1].1;
            for k in (ni..nj - 1).rev() {
                strides[k] = strides[k + 1]
                    .checked_mul(shape[k + 1] as isize)
                    .ok_or_else(|| overflow("reshaped stride"))?;
            }
            ni = nj;
            oi = oj;
        }
        Layout::new(&shape, &strides, self.byte_offset)
    }

    /// Broadcasts to `shape` by NumPy's rules (trailing axes aligned; extents of 1 stretched with
    /// stride 0).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Layout> {
        if shape.len() < self.ndim() {
            return Err(Error::Shape(format!(
                "cannot broadcast shape {:?} to fewer dimensions {shape:?}",
                self.shape
            )));
        }
        let lead = shape.len() - self.ndim();
        let mut strides: Dims<isize> = smallvec::smallvec![0; shape.len()];
        for (i, &target) in shape.iter().enumerate().skip(lead) {
            let (dim, stride) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = if dim == target {
                stride
            } else if dim == 1 {
                0
            } else {
                return Err(Error::Shape(format!(
                    "shape {:?} does not broadcast to {shape:?}",
                    self.shape
                )));
            };
        }
        Layout::new(shape, &strides, self.byte_offset)
    }

    /// The same shape and strides with the first element at `byte_offset`.
    pub fn with_byte_offset(&self, byte_offset: usize) -> Layout {
        Layout {
            byte_offset,
            ..self.clone()
        }
    }
}

/// The byte range `[lo * itemsize, (hi + 1) * itemsize)` of the element extent `(lo, hi)` (see
/// [`Layout::element_extent`]), relative to the first element; `None` when it does not fit in
/// `i128`.
pub(crate) fn extent_bytes(lo: i128, hi: i128, itemsize: usize) -> Option<(i128, i128)> {
    let size = itemsize as i128;
    Some((lo.checked_mul(size)?, (hi + 1).checked_mul(size)?))
}

/// The shape two shapes broadcast to under NumPy's rules.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::Shape(format!(
                    "shapes {a:?} and {b:?} do not broadcast (axis {i}: {da} vs {db})"
                )));
            }
        };
    }
    Ok(out)
}

/// A shape as Python writes a tuple of its extents: `()`, `(3,)`, `(2, 3)`; for messages.
pub fn shape_text<D: std::fmt::Display>(dims: &[D]) -> String {
    match dims {
        [d] => format!("({d},)"),
        _ => {
            let dims: Vec<String> = dims.iter().map(D::to_string).collect();
            format!("({})", dims.join(", "))
        }
    }
}

fn infer_shape(new_shape: &[Option<usize>], numel: usize) -> Result<Vec<usize>> {
    let unknown: Vec<usize> = (0..new_shape.len())
        .filter(|&i| new_shape[i].is_none())
        .collect();
    if unknown.len() > 1 {
        return Err(Error::Shape("only one extent can be inferred".into()));
    }
    let known: Vec<usize> = new_shape.iter().map(|d| d.unwrap_or(1)).collect();
    // The shape as the caller wrote it: `(-1, 5)`, `(3,)`.
    let written = || {
        let dims: Vec<String> = new_shape
            .iter()
            .map(|d| d.map_or("-1".to_string(), |d| d.to_string()))
            .collect();
        shape_text(&dims)
    };
    let cannot = || {
        Error::Shape(format!(
            "cannot reshape {numel} elements into shape {}",
            written()
        ))
    };
    let known_numel = checked_numel(&known).map_err(|_| cannot())?;
    let mut shape = known;
    if let Some(&i) = unknown.first() {
        if known_numel == 0 || numel % known_numel != 0 {
            return Err(cannot());
        }
        shape[i] = numel / known_numel;
    } else if known_numel != numel {
        return Err(cannot());
    }
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every operand's offsets in row-major order over `shape`, wrapping as addresses do.
    fn walk(shape: &[usize], strides: &[isize]) -> Vec<isize> {
        let numel: usize = shape.iter().product();
        (0..numel)
            .map(|mut i| {
                let mut off = 0isize;
                for k in (0..shape.len()).rev() {
                    off = off.wrapping_add(((i % shape[k]) as isize).wrapping_mul(strides[k]));
                    i /= shape[k];
                }
                off
            })
            .collect()
    }

    #[test]
    fn merged_axes_address_what_the_shape_did() {
        // (shape, each operand's strides, the merged extents)
        type Case = (
            &'static [usize],
            &'static [&'static [isize]],
            &'static [usize],
        );
        let cases: &[Case] = &[
            // Compact on both sides: one axis.
            (&[2, 3, 4], &[&[12, 4, 1], &[12, 4, 1]], &[24]),
            // Size-1 axes drop whatever their strides; a 0-d shape has no axes.
            (&[1, 5, 1], &[&[99, 2, -7]], &[5]),
            (&[], &[&[], &[]], &[]),
            // Negative strides merge when consistent; a broadcast axis (0) merges only with
            // another broadcast axis.
            (&[2, 3], &[&[-3, -1]], &[6]),
            (&[4, 2, 3], &[&[0, 0, 1], &[6, 3, 1]], &[8, 3]),
            (&[4, 2, 3], &[&[0, 0, 0]], &[24]),
            // A transpose does not merge; a sliced row keeps its pitch.
            (&[3, 4], &[&[1, 3], &[4, 1]], &[3, 4]),
            (&[3, 4], &[&[8, 1]], &[3, 4]),
            // An empty shape stays empty.
            (&[3, 0, 2], &[&[0, 2, 1]], &[0]),
        ];
        for &(shape, strides, want) in cases {
            let (extents, merged) = merge_axes(shape, strides);
            assert_eq!(extents, want, "{shape:?} {strides:?}");
            for (s, m) in strides.iter().zip(&merged) {
                assert_eq!(m.len(), extents.len());
                assert_eq!(walk(&extents, m), walk(shape, s), "{shape:?} {s:?}");
            }
        }
    }

    #[test]
    fn merging_never_overflows() {
        // Found by the `layout` fuzz target: two inner steps of 2^62 wrap to isize::MIN, the
        // outer stride; merged, the last offset (3 * 2^62) would overflow although every offset
        // of the layout fits. Such axes stay apart.
        let quarter = 1isize << 62;
        let (extents, merged) = merge_axes(&[2, 2], &[&[isize::MIN, quarter]]);
        assert_eq!(extents, vec![2, 2]);
        assert_eq!(merged, vec![vec![isize::MIN, quarter]]);
        // An empty shape stays empty, whatever its other extents.
        let (extents, _) = merge_axes(&[0, usize::MAX, 3], &[&[0, 0, 0]]);
        assert_eq!(extents.first(), Some(&0));
    }

    fn offsets_bytes(l: &Layout, itemsize: i128) -> Vec<i128> {
        // Every element's byte offset in row-major order.
        let mut out = vec![];
        for flat in 0..l.numel() {
            let (mut rem, mut off) = (flat, 0i128);
            for (&d, &s) in l.shape().iter().zip(l.strides()).rev() {
                off += (rem % d) as i128 * s as i128;
                rem /= d;
            }
            out.push(l.byte_offset() as i128 + off * itemsize);
        }
        out
    }

    #[test]
    fn contiguous_strides() {
        let l = Layout::contiguous(&[2, 3, 4]).unwrap();
        assert_eq!(l.strides(), &[12, 4, 1]);
        assert!(l.is_contiguous());
        assert!(!l.is_f_contiguous());
        assert_eq!(l.byte_range(4).unwrap(), 0..96);
        assert_eq!(Layout::contiguous(&[]).unwrap().numel(), 1);
        assert_eq!(
            Layout::contiguous(&[3, 0]).unwrap().byte_range(8).unwrap(),
            0..0
        );
    }

    #[test]
    fn slice_semantics_match_python() {
        for len in 0..6usize {
            for start in [None, Some(-7), Some(-2), Some(0), Some(1), Some(4), Some(9)] {
                for stop in [None, Some(-7), Some(-1), Some(0), Some(2), Some(5), Some(9)] {
                    for step in [-3isize, -1, 1, 2] {
                        let v: Vec<isize> = (0..len as isize).collect();
                        let expected = python_slice(&v, start, stop, step);
                        let (first, count) = SliceArg { start, stop, step }.resolve(len).unwrap();
                        let got: Vec<isize> = (0..count)
                            .map(|k| first as isize + k as isize * step)
                            .collect();
                        assert_eq!(got, expected, "len {len} {start:?}:{stop:?}:{step}");
                    }
                }
            }
        }
        assert!(
            SliceArg {
                start: None,
                stop: None,
                step: 0
            }
            .resolve(3)
            .is_err()
        );
    }

    fn python_slice(
        v: &[isize],
        start: Option<isize>,
        stop: Option<isize>,
        step: isize,
    ) -> Vec<isize> {
        let n = v.len() as isize;
        let norm = |i: isize| if i < 0 { i + n } else { i };
        let mut out = vec![];
        if step > 0 {
            let s = start.map_or(0, |s| norm(s).clamp(0, n));
            let e = stop.map_or(n, |e| norm(e).clamp(0, n));
            let mut i = s;
            while i < e {
                out.push(v[i as usize]);
                i += step;
            }
        } else {
            let s = start.map_or(n - 1, |s| norm(s).clamp(-1, n - 1));
            let e = stop.map_or(-1, |e| norm(e).clamp(-1, n - 1));
            let mut i = s;
            while i > e {
                out.push(v[i as usize]);
                i += step;
            }
        }
        out
    }

    #[test]
    fn negative_steps_stay_in_bounds() {
        let l = Layout::contiguous(&[4, 5]).unwrap();
        let r = l
            .slice(
                1,
                SliceArg {
                    start: None,
                    stop: None,
                    step: -1,
                },
                4,
            )
            .unwrap();
        assert_eq!(r.byte_offset(), 16);
        assert_eq!(r.strides(), &[5, -1]);
        assert_eq!(r.byte_range(4).unwrap(), 0..80);
        let rr = r
            .slice(
                0,
                SliceArg {
                    start: Some(3),
                    stop: None,
                    step: -2,
                },
                4,
            )
            .unwrap();
        // rr takes rows 3 and 1 of r; r reverses each row of l. In elements: row 3 of l starts at
        // 15, row 1 at 5; reversed, each row runs from its last element down.
        let expected: Vec<i128> = [19i128, 18, 17, 16, 15, 9, 8, 7, 6, 5]
            .iter()
            .map(|e| e * 4)
            .collect();
        let got: Vec<i128> = offsets_bytes(&rr, 4);
        assert_eq!(got, expected);
        // Element [0, 0] of rr is element [3, 4] of l: byte 4 * (3 * 5 + 4).
        assert_eq!(rr.byte_offset(), 4 * 19);
        assert_eq!(rr.byte_range(4).unwrap(), 4 * 5..80);
    }

    #[test]
    fn reshape_refusals_name_the_shape_as_written() {
        let l = Layout::contiguous(&[12]).unwrap();
        let err = l.reshape(&[None, Some(5)]).unwrap_err().to_string();
        assert!(
            err.contains("cannot reshape 12 elements into shape (-1, 5)"),
            "{err}"
        );
        let err = l.reshape(&[Some(5)]).unwrap_err().to_string();
        assert!(
            err.contains("cannot reshape 12 elements into shape (5,)"),
            "{err}"
        );
        let err = l.reshape(&[Some(0), None]).unwrap_err().to_string();
        assert!(err.contains("into shape (0, -1)"), "{err}");
    }

    #[test]
    fn reshape_views_and_refusals() {
        let l = Layout::contiguous(&[2, 3, 4]).unwrap();
        let r = l.reshape(&[Some(6), None]).unwrap();
        assert_eq!(r.shape(), &[6, 4]);
        assert_eq!(r.strides(), &[4, 1]);
        let t = l.permute(&[2, 1, 0]).unwrap();
        assert!(t.reshape(&[Some(24)]).is_err());
        // Merging axes that are contiguous with each other works even in a transposed view.
        let t2 = l.permute(&[1, 2, 0]).unwrap(); // shape [3, 4, 2], strides [4, 1, 12]
        let m = t2.reshape(&[Some(12), Some(2)]).unwrap();
        assert_eq!(m.strides(), &[1, 12]);
        assert_eq!(offsets_bytes(&m, 1), offsets_bytes(&t2, 1));
        // Splitting a strided axis.
        let s = l
            .slice(
                2,
                SliceArg {
                    start: None,
                    stop: None,
                    step: 2,
                },
                1,
            )
            .unwrap(); // [2,3,2]
        let sp = s
            .reshape(&[Some(2), Some(3), Some(1), Some(2), Some(1)])
            .unwrap();
        assert_eq!(offsets_bytes(&sp, 1), offsets_bytes(&s, 1));
        assert!(l.reshape(&[Some(5), None]).is_err());
        assert!(l.reshape(&[None, None]).is_err());
        assert_eq!(
            Layout::contiguous(&[0, 3])
                .unwrap()
                .reshape(&[Some(3), Some(0)])
                .unwrap()
                .shape(),
            &[3, 0]
        );
    }

    #[test]
    fn broadcasting() {
        let l = Layout::contiguous(&[3, 1]).unwrap();
        let b = l.broadcast_to(&[2, 3, 4]).unwrap();
        assert_eq!(b.strides(), &[0, 1, 0]);
        assert!(l.broadcast_to(&[2, 2]).is_err());
        assert!(
            Layout::contiguous(&[3])
                .unwrap()
                .broadcast_to(&[2])
                .is_err()
        );
        assert_eq!(broadcast_shapes(&[3, 1], &[4]).unwrap(), vec![3, 4]);
        assert!(broadcast_shapes(&[3], &[4]).is_err());
    }

    #[test]
    fn overflow_is_an_error() {
        assert!(Layout::contiguous(&[usize::MAX, 2]).is_err());
        let l = Layout::new(&[2], &[isize::MAX], 0).unwrap();
        assert!(l.byte_range(8).is_err());
        let l = Layout::new(&[2], &[-1], 0).unwrap();
        assert!(matches!(l.byte_range(4), Err(Error::OutOfBounds(_))));
        assert!(Layout::contiguous(&vec![1; MAX_NDIM + 1]).is_err());
    }

    /// Found by the fuzz targets: merging axes multiplied a stride by an extent unchecked, and the
    /// row-major strides of an empty shape wrapped to negative values.
    #[test]
    fn huge_strides_in_reshape_and_empty_shapes() {
        let l = Layout::new(&[2, 3], &[5, 1 << 62], 0).unwrap();
        assert!(l.reshape(&[Some(6)]).is_err());
        let l = Layout::contiguous(&[0, (1 << 32) + 1, 1 << 32]).unwrap();
        assert!(l.strides().iter().all(|&s| s > 0), "{:?}", l.strides());
        assert_eq!(l.strides()[0], isize::MAX);
        // Reordered, an empty shape's extents may overflow before the 0 is reached.
        let l = Layout::contiguous(&[0, 1 << 62, 4]).unwrap().transpose();
        assert_eq!(l.numel(), 0);
        assert!(l.is_contiguous());
        assert_eq!(l.element_extent(), None);
        // An extent past `isize::MAX` is refused even beside a 0 (it broke `index`).
        assert!(Layout::new(&[0, usize::MAX], &[1, 1], 0).is_err());
        assert!(Layout::contiguous(&[0, isize::MAX as usize + 1]).is_err());
    }

    /// Found by the `layout` fuzz target: a step of `isize::MIN` was negated.
    #[test]
    fn most_negative_step() {
        let arg = SliceArg {
            start: None,
            stop: None,
            step: isize::MIN,
        };
        assert_eq!(arg.resolve(5).unwrap(), (4, 1));
        assert_eq!(arg.resolve(0).unwrap(), (0, 0));
        let l = Layout::contiguous(&[5]).unwrap().slice(0, arg, 4).unwrap();
        assert_eq!((l.shape(), l.byte_offset()), (&[1usize][..], 16));
    }

    /// Found by the `layout` fuzz target: an element extent near 2^125 elements times the item
    /// size overflowed `i128` (a panic with overflow checks, a wrapped and so wrong range
    /// without).
    #[test]
    fn byte_extent_overflow_is_an_error() {
        let l = Layout::new(&[1 << 62], &[isize::MIN], 0).unwrap();
        assert!(l.byte_range(8).is_err());
        let l = Layout::new(&[1 << 62], &[isize::MAX], 0).unwrap();
        assert!(l.byte_range(8).is_err());
        // Moving to an index whose byte offset is out of `i128` range.
        let l = Layout::new(&[1 << 62], &[isize::MIN], 0).unwrap();
        assert!(l.index(0, -1, 1 << 20).is_err());
        assert!(l.slice(0, SliceArg::range(-1, 1 << 62), 1 << 20).is_err());
    }
}
