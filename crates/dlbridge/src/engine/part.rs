//! Which bytes a strided part of a stored array needs, and where they land when read: the plan
//! behind partial reads ([`load_part`](super::load_part), as
//! [`Checkpoint::load_part`](crate::safetensors::Checkpoint::load_part) reads a tensor-parallel
//! rank's slice). It knows no file format: an array is a dense, row-major run of
//! bytes, a part is a [`Layout`] over its elements, and the plan is byte ranges of the array,
//! each with its offset in one compact destination.
//!
//! A part of a dim-0 range is one run; a range of an inner dimension is one run per outer index;
//! runs whose gap is at most `max_gap` bytes are read as one, gap included: a step through the
//! elements (`[:, ::2]`) would otherwise be one read per element, and copying a few hundred
//! bytes more costs less than another read. The default gap is small enough that the rows of a
//! tensor-parallel rank's columns (a kilobyte or more each) are read apart.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::layout::Layout;

/// The largest gap between two needed byte ranges that a plan reads through rather than reading
/// the two apart: 256 bytes.
pub const DEFAULT_MAX_GAP: usize = 256;

/// The reads that bring a strided part of a dense array into a compact destination
/// ([`PartPlan::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartPlan {
    /// Byte ranges of the array (counted from its first byte), increasing and disjoint, each with
    /// the byte offset in the destination where it lands.
    pub runs: Vec<(Range<u64>, usize)>,
    /// The destination's length in bytes: the runs, one after another.
    pub len: usize,
    /// The part as it lies in the destination (byte offset 0, strides in elements).
    pub layout: Layout,
}

impl PartPlan {
    /// Plans the reads of `part`, a layout over the elements (of `itemsize` bytes) of a dense
    /// row-major array of `array_len` bytes, its byte offset counted from the array's first byte.
    /// A part is what basic indexing selects: integers, ranges with a positive step, new axes of
    /// length 1. Runs with gaps of at most `max_gap` bytes between them are merged (the gap is
    /// read too).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] where the part reaches past the array; [`Error::InvalidArgument`]
    /// where it does not take its elements in storage order (a negative or zero stride on an axis
    /// longer than one, or an axis whose stride does not step over the axes inside it: a
    /// transposed or overlapping view).
    pub fn new(part: &Layout, itemsize: usize, array_len: usize, max_gap: usize) -> Result<Self> {
        let itemsize = itemsize.max(1);
        let shape = part.shape();
        if part.numel() == 0 {
            return Ok(PartPlan {
                runs: Vec::new(),
                len: 0,
                layout: Layout::contiguous(shape)?,
            });
        }
        let bytes = part.byte_range(itemsize)?;
        if bytes.end > array_len {
            return Err(Error::OutOfBounds(format!(
                "the part reaches byte {} of an array of {array_len} bytes",
                bytes.end
            )));
        }
        // The axes longer than one, outermost first: (axis, extent, stride).
        let dims: Vec<(usize, usize, usize)> = shape
            .iter()
            .zip(part.strides())
            .enumerate()
            .filter(|&(_, (&n, _))| n > 1)
            .map(|(axis, (&n, &stride))| {
                let stride = usize::try_from(stride).ok().filter(|&s| s > 0).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "axis {axis} of the part has stride {stride}: a part takes its elements \
                         forwards (a positive step)"
                    ))
                })?;
                Ok((axis, n, stride))
            })
            .collect::<Result<_>>()?;
        // Each axis must step over everything inside it: the part is in storage order and its
        // elements are distinct, so runs come out increasing and disjoint.
        let mut inner_extent = 1usize;
        for &(axis, n, stride) in dims.iter().rev() {
            if stride < inner_extent {
                return Err(Error::InvalidArgument(format!(
                    "axis {axis} of the part (stride {stride}) does not step over the axes inside \
                     it (extent {inner_extent}): a part keeps the array's order of axes"
                )));
            }
            inner_extent = inner_extent.saturating_add((n - 1).saturating_mul(stride));
        }
        // The block read at once: the innermost axes, taken outwards while the gap between two
        // of their blocks is at most `max_gap` (zero for axes the block already covers densely).
        let mut k = dims.len();
        let mut span = 1usize; // elements from the block's first to its last, inclusive
        while k > 0 {
            let (_, n, stride) = dims[k - 1];
            if (stride - span).saturating_mul(itemsize) > max_gap {
                break;
            }
            span += (n - 1) * stride;
            k -= 1;
        }
        let run_bytes = span * itemsize;
        let outer = &dims[..k];
        let blocks: usize = outer.iter().map(|&(_, n, _)| n).product();
        let mut runs: Vec<(Range<u64>, usize)> = Vec::new();
        let mut index = vec![0usize; outer.len()];
        for block in 0..blocks {
            let start = part.byte_offset()
                + outer
                    .iter()
                    .zip(&index)
                    .map(|(&(_, _, stride), &i)| i * stride * itemsize)
                    .sum::<usize>();
            let range = start as u64..(start + run_bytes) as u64;
            match runs.last_mut() {
                Some((last, _)) if last.end == range.start => last.end = range.end,
                _ => runs.push((range, block * run_bytes)),
            }
            // The next outer index, last axis fastest.
            for (i, &(_, n, _)) in index.iter_mut().zip(outer).rev() {
                *i += 1;
                if *i < n {
                    break;
                }
                *i = 0;
            }
        }
        // Strides in the destination: inside the block as in the array; outside it, blocks one
        // after another. An axis of length one takes the stride a compact layout gives it.
        let mut strides = vec![0isize; shape.len()];
        let mut outer_stride = span;
        let mut below = 1usize;
        let mut d = dims.len();
        for axis in (0..shape.len()).rev() {
            if shape[axis] == 1 {
                strides[axis] = below as isize;
                continue;
            }
            d -= 1;
            let (_, n, stride) = dims[d];
            let s = if d >= k {
                stride
            } else {
                let s = outer_stride;
                outer_stride *= n;
                s
            };
            strides[axis] = s as isize;
            below = s * n;
        }
        Ok(PartPlan {
            runs,
            len: blocks * run_bytes,
            layout: Layout::new(shape, &strides, 0)?,
        })
    }

    /// The bytes the runs read.
    pub fn bytes_read(&self) -> u64 {
        self.runs.iter().map(|(r, _)| r.end - r.start).sum()
    }
}
