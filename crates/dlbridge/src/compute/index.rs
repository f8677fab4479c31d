//! Advanced indexing: the elements that integer index arrays select on some axes of a view,
//! gathered into a new array ([`take`]) or written ([`put`]), by NumPy's rules, and the positions
//! of a mask's true elements ([`nonzero`]), which turn a boolean index into integer ones.
//!
//! The index arrays broadcast together to one shape `B`; the axes they index are replaced by `B`'s
//! axes, in the place of the first indexed axis when the caller says the indexed axes were
//! adjacent in the index, else first (NumPy's rule). Indices are checked against their axis
//! (negative ones count from the end) before anything is read or written.
//!
//! | step | where |
//! | --- | --- |
//! | index arrays read, checked, turned into one element offset per selected block | here, on the host (a device's index arrays are copied over) |
//! | blocks moved | the CPU's block copier (`BlockCopy`); a device's view is staged through host memory |
//! | single elements: a mask over every axis, one index array into a 1-d view | the CPU's selections (no block offsets: one pass over the mask or the positions, in parallel) |

use super::{MapPlan, broadcast_shapes, cast};
use crate::backend;
use crate::device::Device;
use crate::dtype::{DType, DTypeCode};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Where the blocks of a [`BlockCopy`] start in one tensor, in elements from its first element.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Offsets<'a> {
    /// Listed, one per block.
    List(&'a [isize]),
    /// Block `b` at `b * step` (blocks laid out evenly: a compact result, a broadcast value).
    Step(isize),
}

impl Offsets<'_> {
    /// The offset of block `b`.
    #[inline(always)]
    pub(crate) fn of(self, b: usize) -> isize {
        match self {
            Offsets::List(l) => l[b],
            Offsets::Step(s) => b as isize * s,
        }
    }
}

/// Copies of `count` equally shaped blocks from `src` to `dst`: block `b` starts at
/// `src_offsets.of(b)` in `src` and `dst_offsets.of(b)` in `dst`, and `block` addresses its
/// elements (operand 0 `dst`, operand 1 `src`). Both tensors are host memory of one dtype.
#[derive(Debug)]
pub(crate) struct BlockCopy<'a> {
    /// Where the blocks go.
    pub(crate) dst: &'a Tensor,
    /// Where they come from.
    pub(crate) src: &'a Tensor,
    /// How many blocks.
    pub(crate) count: usize,
    /// Where each block starts in `dst`.
    pub(crate) dst_offsets: Offsets<'a>,
    /// Where each block starts in `src`.
    pub(crate) src_offsets: Offsets<'a>,
    /// One block's index space: operand 0 `dst`'s strides, operand 1 `src`'s.
    pub(crate) block: MapPlan,
    /// Whether no two blocks write one element (a gather): blocks may then run in any order.
    pub(crate) disjoint: bool,
}

/// The positions of the true (non-zero) elements of `mask`, one `int64` host array per axis, in
/// row-major order: NumPy's `nonzero`. A 0-d mask gives no arrays.
///
/// # Errors
/// [`Error::UnsupportedOperand`] for a mask that is not `bool`.
pub fn nonzero(mask: &Tensor) -> Result<Vec<Tensor>> {
    let host = mask_bytes(mask)?;
    let bytes = host.as_slice::<u8>()?;
    let shape = mask.shape();
    let ndim = shape.len();
    if ndim == 0 {
        return Ok(Vec::new());
    }
    let count = bytes.iter().filter(|&&b| b != 0).count();
    let mut positions: Vec<Vec<i64>> = (0..ndim)
        .map(|_| crate::error::host_vec(count))
        .collect::<Result<_>>()?;
    for_each_true(bytes, shape, |row, j| {
        for (p, &i) in positions.iter_mut().zip(row) {
            p.push(i as i64);
        }
        positions[ndim - 1].push(j as i64);
    });
    positions
        .iter()
        .map(|p| Tensor::from_slice(p, &[p.len()]))
        .collect()
}

/// What an advanced index selects from a view: one offset per block, and the shapes involved.
struct Selection {
    /// The index arrays' broadcast shape.
    index_shape: Vec<usize>,
    /// The view's axes that are not indexed, in order.
    rest: Vec<usize>,
    /// The result's shape.
    shape: Vec<usize>,
    /// The result's axes in the order `index_shape ++ rest` (a permutation of the result).
    first_order: Vec<usize>,
    /// Per selected block (row-major over `index_shape`), its element offset in the source
    /// whose strides it was computed with.
    offsets: Vec<isize>,
}

/// Adds `stride` times the integer positions of `index` (broadcast to `shape`, checked against
/// an axis of `len`, negative ones counted from the end) to `offsets` (`None`: sets them), one per
/// element of `shape` in row-major order. `axis` names the axis in messages.
fn add_positions(
    offsets: &mut Option<Vec<isize>>,
    index: &Tensor,
    shape: &[usize],
    len: usize,
    stride: isize,
    axis: usize,
) -> Result<()> {
    let dtype = index.dtype();
    if !matches!(dtype.code(), DTypeCode::Int | DTypeCode::UInt) || dtype.lanes() != 1 {
        return Err(Error::UnsupportedOperand(format!(
            "arrays used as indices must be of integer (or boolean) type, not {dtype}"
        )));
    }
    let wide = match dtype {
        DType::U64 | DType::I64 => index.clone(),
        _ => cast(index, DType::I64)?,
    };
    // Read in place when the positions are already compact host memory of the broadcast shape.
    let host = if wide.device().is_cpu() && wide.is_contiguous() && wide.shape() == shape {
        wide
    } else {
        wide.broadcast_to(shape)?.copy_to(Device::CPU)?
    };
    let len = len as i64;
    let place = |v: i64| -> Result<isize> {
        let at = if v < 0 { v + len } else { v };
        if (0..len).contains(&at) {
            Ok(at as isize * stride)
        } else {
            Err(Error::OutOfBounds(format!(
                "index {v} is out of bounds for axis {axis} with size {len}"
            )))
        }
    };
    // A `uint64` past `i64::MAX` saturates: it is out of bounds anyway.
    let values: Box<dyn Iterator<Item = i64> + '_> = if dtype == DType::U64 {
        Box::new(
            host.as_slice::<u64>()?
                .iter()
                .map(|&v| i64::try_from(v).unwrap_or(i64::MAX)),
        )
    } else {
        Box::new(host.as_slice::<i64>()?.iter().copied())
    };
    match offsets {
        None => *offsets = Some(values.map(place).collect::<Result<Vec<_>>>()?),
        Some(o) => {
            for (o, v) in o.iter_mut().zip(values) {
                *o += place(v)?;
            }
        }
    }
    Ok(())
}

/// Plans the selection of `indices` on `axes` of a view of `shape`, offsets computed over
/// `strides` (the view's, or a host copy's).
fn select(
    shape: &[usize],
    strides: &[isize],
    axes: &[usize],
    indices: &[Tensor],
    first: bool,
) -> Result<Selection> {
    let ndim = shape.len();
    if axes.is_empty() || axes.len() != indices.len() {
        return Err(Error::InvalidArgument(format!(
            "an advanced index needs one index array per indexed axis ({} axes, {} arrays)",
            axes.len(),
            indices.len()
        )));
    }
    let mut seen = vec![false; ndim];
    for &a in axes {
        if a >= ndim || std::mem::replace(&mut seen[a], true) {
            return Err(Error::InvalidArgument(format!(
                "indexed axes {axes:?} must be distinct axes of an array of {ndim} dimensions"
            )));
        }
    }
    let mut index_shape: Vec<usize> = Vec::new();
    for i in indices {
        index_shape = broadcast_shapes(&index_shape, i.shape()).map_err(|_| {
            Error::Shape(format!(
                "shape mismatch: indexing arrays could not be broadcast together with shapes {}",
                indices
                    .iter()
                    .map(|t| crate::layout::shape_text(t.shape()))
                    .collect::<Vec<_>>()
                    .join(" ")
            ))
        })?;
    }
    let mut offsets = None;
    for (&axis, index) in axes.iter().zip(indices) {
        add_positions(
            &mut offsets,
            index,
            &index_shape,
            shape[axis],
            strides[axis],
            axis,
        )?;
    }
    let offsets = offsets.unwrap_or_default();
    let rest: Vec<usize> = (0..ndim).filter(|a| !seen[*a]).collect();
    let place = if first {
        0
    } else {
        rest.iter().filter(|&&a| a < axes[0]).count()
    };
    let nb = index_shape.len();
    let mut out_shape: Vec<usize> = rest[..place].iter().map(|&a| shape[a]).collect();
    out_shape.extend(&index_shape);
    out_shape.extend(rest[place..].iter().map(|&a| shape[a]));
    let first_order: Vec<usize> = (place..place + nb)
        .chain(0..place)
        .chain(place + nb..out_shape.len())
        .collect();
    Ok(Selection {
        index_shape,
        rest,
        shape: out_shape,
        first_order,
        offsets,
    })
}

/// Where the blocks of `t` (a view whose leading `nb` axes are the index shape) start, row-major
/// over those axes: a step when they collapse to one axis (a compact result, a value broadcast
/// along them), else a list.
enum BlockStarts {
    Step(isize),
    List(Vec<isize>),
}

impl BlockStarts {
    fn offsets(&self) -> Offsets<'_> {
        match self {
            BlockStarts::Step(s) => Offsets::Step(*s),
            BlockStarts::List(l) => Offsets::List(l),
        }
    }
}

fn block_offsets(t: &Tensor, nb: usize) -> BlockStarts {
    let plan = MapPlan::new(&t.shape()[..nb], &[&t.strides()[..nb]]);
    if plan.shape.len() == 1 {
        return BlockStarts::Step(plan.strides[0][0]);
    }
    BlockStarts::List(block_list(&plan))
}

/// The offsets of a collapsed plan's elements, row-major (an odometer: no division per block).
fn block_list(plan: &MapPlan) -> Vec<isize> {
    let (shape, strides) = (&plan.shape, &plan.strides[0]);
    // A row-major odometer over the collapsed axes (no division per block).
    let mut offsets = Vec::with_capacity(plan.len());
    let mut index = vec![0usize; shape.len()];
    let mut off = 0isize;
    for _ in 0..plan.len() {
        offsets.push(off);
        for axis in (0..shape.len()).rev() {
            index[axis] += 1;
            off += strides[axis];
            if index[axis] < shape[axis] {
                break;
            }
            off -= shape[axis] as isize * strides[axis];
            index[axis] = 0;
        }
    }
    offsets
}

/// The elements of `view` that integer arrays `indices` select on its axes `axes`, gathered into
/// a new compact array on `view`'s device: NumPy's advanced indexing of those axes (`first`: the
/// index arrays' broadcast axes go first, as NumPy places them when the indexed axes were not
/// adjacent in the index; otherwise where the first indexed axis was).
///
/// # Errors
/// [`Error::OutOfBounds`] for an index outside its axis; [`Error::Shape`] for index arrays that
/// do not broadcast; [`Error::UnsupportedOperand`] for index arrays that are not integers.
pub fn take(view: &Tensor, axes: &[usize], indices: &[Tensor], first: bool) -> Result<Tensor> {
    if let ([0], [index]) = (axes, indices)
        && view.ndim() == 1
        && index.device().is_cpu()
        && index.is_contiguous()
        && matches!(
            index.dtype(),
            DType::I8
                | DType::I16
                | DType::I32
                | DType::I64
                | DType::U8
                | DType::U16
                | DType::U32
                | DType::U64
        )
    {
        // One index array into a 1-d view: each position read, checked and its element copied
        // in one pass.
        let src = on_host(view)?;
        let out = Tensor::empty(index.shape(), src.dtype(), Device::CPU)?;
        backend::cpu::compute::take_positions(&src, index, &out)?;
        return back_to(view, out);
    }
    take_with(view, |src| {
        select(src.shape(), src.strides(), axes, indices, first)
    })
}

/// The elements of `view` where the `bool` array `mask` is true, `mask` covering `view`'s axes
/// from `axis` on (NumPy's `a[..., mask]`): a new compact array on `view`'s device whose masked
/// axes are replaced by one, of the true elements in row-major order. The same as [`take`] with
/// [`nonzero`]'s arrays, without making them.
///
/// # Errors
/// [`Error::Shape`] when `mask`'s shape is not that of the axes it covers.
pub fn take_mask(view: &Tensor, axis: usize, mask: &Tensor) -> Result<Tensor> {
    if axis == 0 && mask.ndim() > 0 && mask.shape() == view.shape() {
        // A mask over every axis: its true elements straight into the 1-d result.
        let bytes = mask_bytes(mask)?;
        let out = backend::cpu::compute::compress(&on_host(view)?, bytes.as_slice::<u8>()?)?;
        return back_to(view, out);
    }
    take_with(view, |src| {
        select_mask(src.shape(), src.strides(), axis, mask)
    })
}

/// `view` on the host: itself, or, for a device's view, a compact host copy of it.
fn on_host(view: &Tensor) -> Result<Tensor> {
    if view.device().is_cpu() {
        Ok(view.clone())
    } else {
        view.copy_to(Device::CPU)
    }
}

/// The host result `out` of a selection from `view`, on `view`'s device and storage mode.
fn back_to(view: &Tensor, out: Tensor) -> Result<Tensor> {
    if view.device().is_cpu() {
        Ok(out)
    } else {
        out.copy_to_storage(view.device(), Some(view.buffer().storage_mode()))
    }
}

/// Gathers the selection `plan` makes of `view` (read on the host).
fn take_with(view: &Tensor, plan: impl Fn(&Tensor) -> Result<Selection>) -> Result<Tensor> {
    // A device's view is read on the host (the bytes it spans, compact).
    let src = on_host(view)?;
    let sel = plan(&src)?;
    let out = Tensor::empty(&sel.shape, src.dtype(), Device::CPU)?;
    let out_first = out.permute(&sel.first_order)?;
    let nb = sel.index_shape.len();
    let rest_shape: Vec<usize> = sel.rest.iter().map(|&a| src.shape()[a]).collect();
    let rest_strides: Vec<isize> = sel.rest.iter().map(|&a| src.strides()[a]).collect();
    let dst_offsets = block_offsets(&out_first, nb);
    let block = MapPlan::new(&rest_shape, &[&out_first.strides()[nb..], &rest_strides]);
    let req = BlockCopy {
        dst: &out,
        src: &src,
        count: sel.offsets.len(),
        dst_offsets: dst_offsets.offsets(),
        src_offsets: Offsets::List(&sel.offsets),
        block,
        disjoint: true,
    };
    // SAFETY: every offset is a checked index times its axis's stride, so each block lies inside
    // `src`'s view; the destination blocks tile the new `out`, which nothing else references.
    unsafe { backend::copy_blocks_on_host(&req)? };
    back_to(view, out)
}

/// Writes `values` (broadcast to the selection's shape, converted to `view`'s dtype) into the
/// elements of `view` that `indices` select on `axes` ([`take`]'s selection). Where an element
/// is selected more than once, the last write wins, as in NumPy.
///
/// # Safety
/// As [`Tensor::copy_from_unchecked`] for `view`: no reference into the bytes it addresses may
/// be alive during the call, and no other thread may access them.
///
/// # Errors
/// As [`take`]; [`Error::ReadOnly`] for a read-only view; [`Error::Shape`] when `values` does not
/// broadcast to the selection.
pub unsafe fn put(
    view: &Tensor,
    axes: &[usize],
    indices: &[Tensor],
    first: bool,
    values: &Tensor,
) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe {
        put_with(
            view,
            |dst| select(dst.shape(), dst.strides(), axes, indices, first),
            values,
        )
    }
}

/// Writes `values` where `mask` is true ([`take_mask`]'s selection): NumPy's `a[mask] = values`.
///
/// # Safety
/// As [`put`].
///
/// # Errors
/// As [`take_mask`] and [`put`].
pub unsafe fn put_mask(view: &Tensor, axis: usize, mask: &Tensor, values: &Tensor) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe {
        put_with(
            view,
            |dst| select_mask(dst.shape(), dst.strides(), axis, mask),
            values,
        )
    }
}

/// Scatters `values` into the selection `plan` makes of `view`.
///
/// # Safety
/// As [`put`].
unsafe fn put_with(
    view: &Tensor,
    plan: impl Fn(&Tensor) -> Result<Selection>,
    values: &Tensor,
) -> Result<()> {
    if view.is_read_only() {
        return Err(Error::ReadOnly("assigning to an indexed selection".into()));
    }
    let device = view.device();
    let dst = if device.is_cpu() {
        view.clone()
    } else {
        view.copy_to(Device::CPU)?
    };
    let sel = plan(&dst)?;
    let values = if values.dtype() == view.dtype() {
        values.clone()
    } else {
        cast(values, view.dtype())?
    };
    let values = values
        .copy_to(Device::CPU)?
        .broadcast_to(&sel.shape)
        .map_err(|_| {
            Error::Shape(format!(
                "shape mismatch: value array of shape {} could not be broadcast to indexing \
                 result of shape {}",
                crate::layout::shape_text(values.shape()),
                crate::layout::shape_text(&sel.shape)
            ))
        })?;
    let src = values.permute(&sel.first_order)?;
    let nb = sel.index_shape.len();
    let rest_strides: Vec<isize> = sel.rest.iter().map(|&a| dst.strides()[a]).collect();
    let rest_shape: Vec<usize> = sel.rest.iter().map(|&a| dst.shape()[a]).collect();
    let src_offsets = block_offsets(&src, nb);
    let block = MapPlan::new(&rest_shape, &[&rest_strides, &src.strides()[nb..]]);
    let req = BlockCopy {
        dst: &dst,
        src: &src,
        count: sel.offsets.len(),
        dst_offsets: Offsets::List(&sel.offsets),
        src_offsets: src_offsets.offsets(),
        block,
        disjoint: false,
    };
    // SAFETY: every destination offset is a checked index times its axis's stride (inside
    // `dst`'s view), every source block lies inside the broadcast `values`; the caller vouches
    // that nothing else accesses the view meanwhile (for a device view, `dst` is a private host
    // copy).
    unsafe { backend::copy_blocks_on_host(&req)? };
    if !device.is_cpu() {
        // SAFETY: the caller's contract.
        unsafe { view.copy_from_unchecked(&dst)? };
    }
    Ok(())
}

/// The bytes of a `bool` mask on the host, compact (copied only when the mask is elsewhere or
/// strided).
fn mask_bytes(mask: &Tensor) -> Result<Tensor> {
    if mask.dtype() != DType::BOOL {
        return Err(Error::UnsupportedOperand(format!(
            "a mask is a bool array, not {}",
            mask.dtype()
        )));
    }
    let host = if mask.device().is_cpu() && mask.is_contiguous() {
        mask.clone()
    } else {
        mask.copy_to(Device::CPU)?
    };
    super::bool_bytes(&host)
}

/// Calls `hit(row, j)` for each true element of the compact mask bytes `bytes` of `shape` (at
/// least one axis), in row-major order: `row` the element's indices on the axes but the last
/// (worked out once per row), `j` its index on the last.
fn for_each_true(bytes: &[u8], shape: &[usize], mut hit: impl FnMut(&[usize], usize)) {
    let (last, len) = (shape.len() - 1, shape[shape.len() - 1]);
    if len == 0 {
        return;
    }
    let mut row = vec![0usize; last];
    for (r, chunk) in bytes.chunks(len).enumerate() {
        if chunk.iter().all(|&b| b == 0) {
            continue;
        }
        let mut rest = r;
        for axis in (0..last).rev() {
            row[axis] = rest % shape[axis];
            rest /= shape[axis];
        }
        for (j, _) in chunk.iter().enumerate().filter(|(_, b)| **b != 0) {
            hit(&row, j);
        }
    }
}

/// Plans the selection of `mask` on the axes of a view of `shape` from `axis` on, offsets over
/// `strides`.
fn select_mask(
    shape: &[usize],
    strides: &[isize],
    axis: usize,
    mask: &Tensor,
) -> Result<Selection> {
    let k = mask.ndim();
    if k == 0 || axis + k > shape.len() || mask.shape() != &shape[axis..axis + k] {
        return Err(Error::Shape(format!(
            "a mask of shape {} does not match the axes {axis}.. of an array of shape {}",
            crate::layout::shape_text(mask.shape()),
            crate::layout::shape_text(shape)
        )));
    }
    let host = mask_bytes(mask)?;
    let bytes = host.as_slice::<u8>()?;
    let count = bytes.iter().filter(|&&b| b != 0).count();
    let mut offsets: Vec<isize> = crate::error::host_vec(count)?;
    let mask_strides = &strides[axis..axis + k];
    let last = mask_strides[k - 1];
    for_each_true(bytes, mask.shape(), |row, j| {
        let base: isize = row
            .iter()
            .zip(mask_strides)
            .map(|(&i, &s)| i as isize * s)
            .sum();
        offsets.push(base + j as isize * last);
    });
    let rest: Vec<usize> = (0..shape.len())
        .filter(|a| !(axis..axis + k).contains(a))
        .collect();
    let mut out_shape: Vec<usize> = shape[..axis].to_vec();
    out_shape.push(count);
    out_shape.extend(&shape[axis + k..]);
    let first_order: Vec<usize> = std::iter::once(axis)
        .chain(0..axis)
        .chain(axis + 1..out_shape.len())
        .collect();
    Ok(Selection {
        index_shape: vec![count],
        rest,
        shape: out_shape,
        first_order,
        offsets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(values: &[i64], shape: &[usize]) -> Tensor {
        Tensor::from_slice(values, shape).unwrap()
    }

    #[test]
    fn take_places_the_index_axes_as_numpy() {
        let x = ints(&(0..24).collect::<Vec<_>>(), &[2, 3, 4]);
        // x[:, [2, 0]] (adjacent): shape (2, 2, 4).
        let t = take(&x, &[1], &[ints(&[2, 0], &[2])], false).unwrap();
        assert_eq!(t.shape(), &[2, 2, 4]);
        assert_eq!(
            t.to_vec::<i64>().unwrap(),
            vec![8, 9, 10, 11, 0, 1, 2, 3, 20, 21, 22, 23, 12, 13, 14, 15]
        );
        // x[[1, 0], :, [3, -1]] (not adjacent): shape (2, 3).
        let t = take(
            &x,
            &[0, 2],
            &[ints(&[1, 0], &[2]), ints(&[3, -1], &[2])],
            true,
        )
        .unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.to_vec::<i64>().unwrap(), vec![15, 19, 23, 3, 7, 11]);
        let err = take(&x, &[2], &[ints(&[4], &[1])], false).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds(_)), "{err}");
        assert!(
            err.to_string()
                .contains("index 4 is out of bounds for axis 2 with size 4")
        );
    }

    #[test]
    fn put_writes_the_last_of_repeated_indices() {
        let x = ints(&[0; 6], &[2, 3]);
        let values = ints(&[1, 2, 3], &[3]);
        // SAFETY: `x` is this test's own, and no reference into it is alive.
        unsafe {
            put(
                &x,
                &[1],
                &[ints(&[2, 2, 0], &[3])],
                false,
                &values
                    .reshape(&[Some(1), Some(3)])
                    .unwrap()
                    .broadcast_to(&[2, 3])
                    .unwrap(),
            )
            .unwrap()
        };
        assert_eq!(x.to_vec::<i64>().unwrap(), vec![3, 0, 2, 3, 0, 2]);
        let mask = Tensor::from_slice(&[1u8, 0, 1, 0, 0, 1], &[2, 3]).unwrap();
        let mask = Tensor::new(mask.buffer().clone(), DType::BOOL, mask.layout().clone()).unwrap();
        let where_ = nonzero(&mask).unwrap();
        assert_eq!(where_[0].to_vec::<i64>().unwrap(), vec![0, 0, 1]);
        assert_eq!(where_[1].to_vec::<i64>().unwrap(), vec![0, 2, 2]);
    }
}
