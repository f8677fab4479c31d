//! How a copy between two layouts of one shape is planned: `copy_axes`, the one copy planner
//! of every backend, and what the CUDA backend makes of its axes ([`plan_copy`]: one linear copy,
//! one pitched 2-D copy, a tiled transpose kernel, or the general strided kernel).
//!
//! Platform-free (it only does arithmetic on shapes and strides), so it is unit-tested on every
//! machine. `copy_axes` treats each element as an inner axis of units, drops axes of extent 1
//! and merges axes that are contiguous with each other in both layouts; the CPU walks its axes,
//! Metal's planner (`backend::metal::kernel`) turns them into a blit or kernel dispatches.
//!
//! [`plan_copy`] works in bytes: it orders the axes by the destination's strides, plans them with
//! `copy_axes`, and then picks the widest word (16, 8, 4, 2 or 1 bytes) that divides every
//! stride, the innermost extent and both base addresses, so that a copy of float16 rows moves 16
//! bytes per thread.

use crate::error::{Error, Result};

/// The most axes the kernels take; further outer axes are walked by the host.
pub(crate) const MAX_KERNEL_DIMS: usize = 8;

/// Rows narrower than this go to a kernel rather than a pitched copy, which moves narrow rows
/// slowly.
const MIN_PITCHED_WIDTH: i64 = 128;

/// One axis of a copy: its extent and the strides of the source and destination, in words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Axis {
    /// Number of positions along the axis.
    pub extent: u64,
    /// Source stride in words (may be negative).
    pub src: i64,
    /// Destination stride in words (may be negative).
    pub dst: i64,
}

/// What a copy compiles to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CopyPlan {
    /// Nothing to copy.
    Empty,
    /// One linear copy of `bytes` bytes.
    Linear {
        /// Byte count.
        bytes: usize,
    },
    /// `height` rows of `width` bytes, rows `src_pitch` and `dst_pitch` bytes apart (both
    /// positive and at least `width`).
    Pitched {
        /// Bytes per row.
        width: usize,
        /// Rows.
        height: usize,
        /// Source row pitch in bytes.
        src_pitch: usize,
        /// Destination row pitch in bytes.
        dst_pitch: usize,
    },
    /// A kernel over words of `word` bytes. `axes` are ordered outermost first; the host walks
    /// `outer` (outermost first) and launches one kernel per position.
    Kernel {
        /// Bytes per word: 1, 2, 4, 8 or 16.
        word: usize,
        /// The kernel's axes (at most [`MAX_KERNEL_DIMS`]).
        axes: Vec<Axis>,
        /// Axes walked by the host, outside the kernel's.
        outer: Vec<Axis>,
        /// When set, the kernel is a tiled transpose: `axes[x]` is where the destination is
        /// contiguous, `axes[y]` where the source is.
        tiled: Option<(usize, usize)>,
    },
}

/// Plans a copy of `shape` between byte strides `src` and `dst` whose first elements are at
/// addresses `src_addr` and `dst_addr`. Elements are `itemsize` bytes.
pub(crate) fn plan_copy(
    shape: &[usize],
    src: &[isize],
    dst: &[isize],
    itemsize: usize,
    src_addr: usize,
    dst_addr: usize,
) -> Result<CopyPlan> {
    check_ranks(shape, src, dst)?;
    if itemsize == 0 {
        return Err(Error::InvalidArgument("copy of zero-byte elements".into()));
    }
    if shape.contains(&0) {
        return Ok(CopyPlan::Empty);
    }
    // Order by the destination's strides, largest first (a stable sort), so the kernel's
    // innermost axis writes adjacent words; the element's bytes stay innermost.
    let mut order: Vec<usize> = (0..shape.len()).collect();
    order.sort_by_key(|&k| std::cmp::Reverse(dst[k].unsigned_abs()));
    let pick = |v: &[isize]| -> Vec<isize> { order.iter().map(|&k| v[k]).collect() };
    let sorted: Vec<usize> = order.iter().map(|&k| shape[k]).collect();
    let mut axes = copy_axes(&sorted, &pick(src), &pick(dst), itemsize)?;
    // One-byte elements leave no axis of their own (an extent of 1 is dropped): put back a run
    // of one byte unless an axis of byte strides 1 is innermost already.
    if axes.last().is_none_or(|a| (a.src, a.dst) != (1, 1)) {
        axes.push(Axis {
            extent: 1,
            src: 1,
            dst: 1,
        });
    }

    // The element's bytes have stride 1 on both sides, and merging keeps the inner axis's
    // strides, so the innermost axis is always a contiguous run of bytes.
    let inner = *axes.last().expect("at least the element axis");
    debug_assert!(inner.src == 1 && inner.dst == 1);
    if axes.len() == 1 {
        return Ok(CopyPlan::Linear {
            bytes: inner.extent as usize,
        });
    }
    if axes.len() == 2 {
        let outer = axes[0];
        let width = inner.extent as i64;
        let fits = |pitch: i64| pitch >= width && pitch <= i32::MAX as i64;
        if width >= MIN_PITCHED_WIDTH && fits(outer.src) && fits(outer.dst) {
            return Ok(CopyPlan::Pitched {
                width: width as usize,
                height: outer.extent as usize,
                src_pitch: outer.src as usize,
                dst_pitch: outer.dst as usize,
            });
        }
    }

    // The widest word dividing all byte strides, both addresses and the innermost run.
    let mut word = 16usize;
    let divides = |w: i64| {
        src_addr as i64 % w == 0
            && dst_addr as i64 % w == 0
            && inner.extent as i64 % w == 0
            && axes[..axes.len() - 1]
                .iter()
                .all(|a| a.src % w == 0 && a.dst % w == 0)
    };
    while word > 1 && !divides(word as i64) {
        word /= 2;
    }
    let last = axes.len() - 1;
    let mut axes: Vec<Axis> = axes
        .into_iter()
        .enumerate()
        .map(|(k, a)| {
            if k == last {
                Axis {
                    extent: a.extent / word as u64,
                    ..a
                }
            } else {
                Axis {
                    extent: a.extent,
                    src: a.src / word as i64,
                    dst: a.dst / word as i64,
                }
            }
        })
        .collect();
    axes.retain(|a| a.extent != 1);
    if axes.is_empty() {
        return Ok(CopyPlan::Linear { bytes: word });
    }
    let split = axes.len().saturating_sub(MAX_KERNEL_DIMS);
    let outer = axes[..split].to_vec();
    let axes = axes[split..].to_vec();
    let tiled = tile_axes(&axes);
    Ok(CopyPlan::Kernel {
        word,
        axes,
        outer,
        tiled,
    })
}

/// Refuses strides of another rank than the shape (the copy planners' first check).
pub(crate) fn check_ranks(shape: &[usize], src: &[isize], dst: &[isize]) -> Result<()> {
    if shape.len() != src.len() || shape.len() != dst.len() {
        return Err(Error::Shape(format!(
            "copy of shape {shape:?} with source strides {src:?} and destination strides {dst:?}"
        )));
    }
    Ok(())
}

/// The axes of a copy of `shape` from strides `src` to strides `dst`, outermost first: the one
/// copy planner every backend starts from. Strides count units (bytes, words or elements: the
/// caller's choice); each element is `per` units, walked as an innermost axis of stride 1 on both
/// sides. Axes of extent 1 are dropped and axes contiguous with each other on both sides merged
/// ([`merge_axes`](crate::layout::merge_axes)), so a copy between two compact layouts is one axis
/// (none for one unit). The CUDA planner turns the axes into linear, pitched or kernel copies,
/// the Metal planner into a blit or kernel dispatches, and the CPU walks them.
pub(crate) fn copy_axes(
    shape: &[usize],
    src: &[isize],
    dst: &[isize],
    per: usize,
) -> Result<Vec<Axis>> {
    check_ranks(shape, src, dst)?;
    let with_element = |v: &[isize]| -> Vec<isize> { v.iter().copied().chain([1]).collect() };
    let extents: Vec<usize> = shape.iter().copied().chain([per]).collect();
    let (extents, strides) =
        crate::layout::merge_axes(&extents, &[&with_element(src), &with_element(dst)]);
    Ok(extents
        .iter()
        .zip(&strides[0])
        .zip(&strides[1])
        .map(|((&n, &s), &d)| Axis {
            extent: n as u64,
            src: s as i64,
            dst: d as i64,
        })
        .collect())
}

/// A transpose pattern worth a tiled kernel: the destination is contiguous along the innermost
/// axis, the source along another, and both runs are long enough to fill a tile.
fn tile_axes(axes: &[Axis]) -> Option<(usize, usize)> {
    let x = axes.len().checked_sub(1)?;
    if axes[x].dst != 1 || axes[x].src == 1 || axes[x].extent < 8 {
        return None;
    }
    let y = axes[..x].iter().rposition(|a| a.src == 1)?;
    (axes[y].extent >= 8).then_some((x, y))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(strides: &[isize], item: usize) -> Vec<isize> {
        strides.iter().map(|s| s * item as isize).collect()
    }

    #[test]
    fn copy_axes_put_the_element_innermost() {
        let axis = |extent, src, dst| Axis { extent, src, dst };
        // Compact float32 rows in elements of 4 bytes: one run of bytes.
        assert_eq!(
            copy_axes(&[4, 5], &[20, 4], &[20, 4], 4).unwrap(),
            vec![axis(80, 1, 1)]
        );
        // Element strides (one unit an element): the element adds no axis.
        assert_eq!(
            copy_axes(&[3, 1, 4], &[1, 7, 3], &[4, 9, 1], 1).unwrap(),
            vec![axis(3, 1, 4), axis(4, 3, 1)]
        );
        // A reversed source keeps its sign; one element is its own units only.
        assert_eq!(
            copy_axes(&[5], &[-8], &[8], 8).unwrap(),
            vec![axis(5, -8, 8), axis(8, 1, 1)]
        );
        assert_eq!(copy_axes(&[], &[], &[], 2).unwrap(), vec![axis(2, 1, 1)]);
        assert!(copy_axes(&[], &[], &[], 1).unwrap().is_empty());
        assert!(matches!(
            copy_axes(&[2], &[1], &[], 1),
            Err(Error::Shape(_))
        ));
    }

    #[test]
    fn one_byte_elements_keep_a_byte_run() {
        // A one-byte element adds no axis of extent 1; the planner still ends in a byte run.
        let p = plan_copy(&[5], &[2], &[1], 1, 0, 0).unwrap();
        assert_eq!(
            p,
            CopyPlan::Kernel {
                word: 1,
                axes: vec![Axis {
                    extent: 5,
                    src: 2,
                    dst: 1
                }],
                outer: vec![],
                tiled: None
            }
        );
        assert_eq!(
            plan_copy(&[5, 3], &[3, 1], &[3, 1], 1, 1, 0).unwrap(),
            CopyPlan::Linear { bytes: 15 }
        );
    }

    #[test]
    fn compact_is_one_linear_copy() {
        let p = plan_copy(
            &[4, 5, 6],
            &bytes(&[30, 6, 1], 4),
            &bytes(&[30, 6, 1], 4),
            4,
            0,
            0,
        );
        assert_eq!(p.unwrap(), CopyPlan::Linear { bytes: 480 });
    }

    #[test]
    fn empty_shape_plans_nothing() {
        let p = plan_copy(&[4, 0], &[0, 4], &[4, 4], 4, 0, 0).unwrap();
        assert_eq!(p, CopyPlan::Empty);
    }

    #[test]
    fn zero_dim_is_one_element() {
        assert_eq!(
            plan_copy(&[], &[], &[], 8, 0, 0).unwrap(),
            CopyPlan::Linear { bytes: 8 }
        );
    }

    #[test]
    fn row_slice_is_pitched() {
        // a[:, :100] of a 64 x 256 float32 array into a compact 64 x 100 one.
        let p = plan_copy(
            &[64, 100],
            &bytes(&[256, 1], 4),
            &bytes(&[100, 1], 4),
            4,
            0,
            0,
        );
        assert_eq!(
            p.unwrap(),
            CopyPlan::Pitched {
                width: 400,
                height: 64,
                src_pitch: 1024,
                dst_pitch: 400
            }
        );
    }

    #[test]
    fn transpose_is_tiled() {
        // The transpose of a 300 x 500 float32 array made compact.
        let p = plan_copy(
            &[500, 300],
            &bytes(&[1, 500], 4),
            &bytes(&[300, 1], 4),
            4,
            0,
            0,
        );
        let CopyPlan::Kernel {
            word, axes, tiled, ..
        } = p.unwrap()
        else {
            panic!("expected a kernel")
        };
        assert_eq!(word, 4);
        assert_eq!(
            axes,
            vec![
                Axis {
                    extent: 500,
                    src: 1,
                    dst: 300
                },
                Axis {
                    extent: 300,
                    src: 500,
                    dst: 1
                }
            ]
        );
        assert_eq!(tiled, Some((1, 0)));
    }

    #[test]
    fn batched_transpose_keeps_the_batch_axis() {
        let p = plan_copy(
            &[3, 64, 32],
            &bytes(&[2048, 1, 64], 2),
            &bytes(&[2048, 32, 1], 2),
            2,
            0,
            0,
        );
        let CopyPlan::Kernel { axes, tiled, .. } = p.unwrap() else {
            panic!("expected a kernel")
        };
        assert_eq!(axes.len(), 3);
        assert_eq!(tiled, Some((2, 1)));
    }

    #[test]
    fn strided_rows_widen_to_16_byte_words() {
        // Every other row of float16 rows of 64 elements, three axes deep: not pitched.
        let p = plan_copy(
            &[2, 8, 64],
            &bytes(&[2048, 128, 1], 2),
            &bytes(&[512, 64, 1], 2),
            2,
            256,
            0,
        );
        let CopyPlan::Kernel {
            word, axes, tiled, ..
        } = p.unwrap()
        else {
            panic!("expected a kernel")
        };
        assert_eq!(word, 16);
        assert_eq!(axes.last().unwrap().extent, 8);
        assert_eq!(tiled, None);
    }

    #[test]
    fn misaligned_address_narrows_the_word() {
        let p = plan_copy(
            &[2, 8, 64],
            &bytes(&[2048, 128, 1], 2),
            &bytes(&[512, 64, 1], 2),
            2,
            2,
            0,
        );
        let CopyPlan::Kernel { word, .. } = p.unwrap() else {
            panic!("expected a kernel")
        };
        assert_eq!(word, 2);
    }

    #[test]
    fn negative_and_broadcast_strides_use_the_general_kernel() {
        // a[::-1] broadcast along a new axis of 5.
        let p = plan_copy(&[5, 7], &bytes(&[0, -1], 8), &bytes(&[7, 1], 8), 8, 48, 0);
        let CopyPlan::Kernel {
            word, axes, tiled, ..
        } = p.unwrap()
        else {
            panic!("expected a kernel")
        };
        assert_eq!(word, 8);
        assert_eq!(
            axes,
            vec![
                Axis {
                    extent: 5,
                    src: 0,
                    dst: 7
                },
                Axis {
                    extent: 7,
                    src: -1,
                    dst: 1
                }
            ]
        );
        assert_eq!(tiled, None);
    }

    #[test]
    fn wide_elements_not_contiguous_keep_an_inner_word_axis() {
        // complex128 (16 bytes) at a stride of 2 elements, into compact memory, 8-aligned.
        let p = plan_copy(&[10], &bytes(&[2], 16), &bytes(&[1], 16), 16, 8, 0);
        let CopyPlan::Kernel { word, axes, .. } = p.unwrap() else {
            panic!("expected a kernel")
        };
        assert_eq!(word, 8);
        assert_eq!(
            axes,
            vec![
                Axis {
                    extent: 10,
                    src: 4,
                    dst: 2
                },
                Axis {
                    extent: 2,
                    src: 1,
                    dst: 1
                }
            ]
        );
    }

    #[test]
    fn more_axes_than_the_kernel_takes_are_walked_by_the_host() {
        let shape = [2usize; 10];
        let dst: Vec<isize> = (0..10).rev().map(|k| 1isize << k).collect();
        // The full transpose of a 10-d array: no two axes merge.
        let src: Vec<isize> = dst.iter().rev().copied().collect();
        let p = plan_copy(&shape, &bytes(&src, 4), &bytes(&dst, 4), 4, 0, 0).unwrap();
        let CopyPlan::Kernel { axes, outer, .. } = p else {
            panic!("expected a kernel")
        };
        assert_eq!(axes.len(), MAX_KERNEL_DIMS);
        assert_eq!(outer.len(), 2);
        let total: u64 = axes.iter().chain(&outer).map(|a| a.extent).product();
        assert_eq!(total, 1024);
    }

    #[test]
    fn mismatched_ranks_are_rejected() {
        assert!(plan_copy(&[2, 3], &[12, 4], &[4], 4, 0, 0).is_err());
    }
}
