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
//! | blocks moved | the CPU's block copier ([`BlockCopy`]); a device's view is staged through host memory |

use super::{MapPlan, broadcast_shapes, cast};
use crate::backend;
use crate::device::Device;
use crate::dtype::{DType, DTypeCode};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Copies of equally shaped blocks from `src` to `dst`: block `b` starts `src_offsets[b]`
/// elements after `src`'s first element and `dst_offsets[b]` after `dst`'s, and `block`
/// addresses its elements (operand 0 `dst`, operand 1 `src`). Both tensors are host memory of
/// one dtype.
#[derive(Debug)]
pub(crate) struct BlockCopy<'a> {
    /// Where the blocks go.
    pub(crate) dst: &'a Tensor,
    /// Where they come from.
    pub(crate) src: &'a Tensor,
    /// Per block, the element offset of its first element in `dst`.
    pub(crate) dst_offsets: &'a [isize],
    /// Per block, the element offset of its first element in `src`.
    pub(crate) src_offsets: &'a [isize],
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
    if mask.dtype() != DType::BOOL {
        return Err(Error::UnsupportedOperand(format!(
            "a mask is a bool array, not {}",
            mask.dtype()
        )));
    }
    // A compact host view of the bytes (a copy only when the mask is elsewhere or strided).
    let host = if mask.device().is_cpu() && mask.is_contiguous() {
        mask.clone()
    } else {
        mask.copy_to(Device::CPU)?
    };
    let host = super::bool_bytes(&host)?;
    let bytes = host.as_slice::<u8>()?;
    let shape = mask.shape();
    let ndim = shape.len();
    let count = bytes.iter().filter(|&&b| b != 0).count();
    let mut positions: Vec<Vec<i64>> = (0..ndim)
        .map(|_| crate::error::host_vec(count))
        .collect::<Result<_>>()?;
    if ndim == 0 {
        return Ok(Vec::new());
    }
    // Row by row along the last axis: a row's leading indices are worked out once (no division
    // per element).
    let (last, len) = (ndim - 1, shape[ndim - 1]);
    let mut row = vec![0usize; last];
    for (r, chunk) in bytes.chunks(len.max(1)).enumerate() {
        if len == 0 {
            break;
        }
        let mut rest = r;
        for axis in (0..last).rev() {
            row[axis] = rest % shape[axis];
            rest /= shape[axis];
        }
        for (j, _) in chunk.iter().enumerate().filter(|(_, b)| **b != 0) {
            for (axis, p) in positions[..last].iter_mut().enumerate() {
                p.push(row[axis] as i64);
            }
            positions[last].push(j as i64);
        }
    }
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

/// The integer positions of `index` broadcast to `shape`, on the host, as `i64` (a `uint64`
/// past `i64::MAX` saturates: it is out of bounds anyway).
fn positions(index: &Tensor, shape: &[usize]) -> Result<Vec<i64>> {
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
    if dtype == DType::U64 {
        Ok(host
            .as_slice::<u64>()?
            .iter()
            .map(|&v| i64::try_from(v).unwrap_or(i64::MAX))
            .collect())
    } else {
        Ok(host.as_slice::<i64>()?.to_vec())
    }
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
    let count: usize = index_shape.iter().product();
    let mut offsets: Vec<isize> = crate::error::host_vec(count)?;
    offsets.resize(count, 0);
    for (&axis, index) in axes.iter().zip(indices) {
        let len = shape[axis] as i64;
        let stride = strides[axis];
        for (o, v) in offsets.iter_mut().zip(positions(index, &index_shape)?) {
            let at = if v < 0 { v + len } else { v };
            if !(0..len).contains(&at) {
                return Err(Error::OutOfBounds(format!(
                    "index {v} is out of bounds for axis {axis} with size {len}"
                )));
            }
            *o += at as isize * stride;
        }
    }
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

/// The element offsets of the blocks of `t` (a view whose leading `nb` axes are the index
/// shape), row-major over those axes.
fn block_offsets(t: &Tensor, nb: usize) -> Vec<isize> {
    let plan = MapPlan::new(&t.shape()[..nb], &[&t.strides()[..nb]]);
    (0..plan.len()).map(|b| plan.offset(0, b)).collect()
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
    let device = view.device();
    // A device's view is read on the host (the bytes it spans, compact).
    let src = if device.is_cpu() {
        view.clone()
    } else {
        view.copy_to(Device::CPU)?
    };
    let sel = select(src.shape(), src.strides(), axes, indices, first)?;
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
        dst_offsets: &dst_offsets,
        src_offsets: &sel.offsets,
        block,
        disjoint: true,
    };
    // SAFETY: every offset is a checked index times its axis's stride, so each block lies inside
    // `src`'s view; the destination blocks tile the new `out`, which nothing else references.
    unsafe { backend::copy_blocks_on_host(&req)? };
    if device.is_cpu() {
        Ok(out)
    } else {
        out.copy_to_storage(device, Some(view.buffer().storage_mode()))
    }
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
    if view.is_read_only() {
        return Err(Error::ReadOnly("assigning to an indexed selection".into()));
    }
    let device = view.device();
    let dst = if device.is_cpu() {
        view.clone()
    } else {
        view.copy_to(Device::CPU)?
    };
    let sel = select(dst.shape(), dst.strides(), axes, indices, first)?;
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
        dst_offsets: &sel.offsets,
        src_offsets: &src_offsets,
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
