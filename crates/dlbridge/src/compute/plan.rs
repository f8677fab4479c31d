//! Shapes and index spaces of the built-in kernels, platform-free: broadcasting, the collapsed
//! loop nest an element-wise kernel walks, the split of a reduction into kept and reduced axes,
//! and the matrix layout `matmul` hands to a BLAS.
//!
//! Every backend executes these plans; none re-derives them. Strides here are in elements, as in
//! [`Layout`](crate::Layout); kernels add each operand's byte offset themselves.

use crate::error::{Error, Result};

pub use crate::layout::broadcast_shapes;

/// The loop nest of an element-wise kernel: every operand (output first) addressed over one
/// shape, with axes that can be walked as one merged, and axes of length 1 dropped.
///
/// When [`MapPlan::is_flat`] holds, every operand is one run of consecutive elements and a kernel
/// can treat them as plain vectors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapPlan {
    /// The collapsed shape (at least one axis; `[n]` for a flat plan, `[1]` for a 0-d one).
    pub shape: Vec<usize>,
    /// Per operand, its strides in elements over `shape` (0 on broadcast axes).
    pub strides: Vec<Vec<isize>>,
}

impl MapPlan {
    /// Collapses `shape` as addressed by each operand's `strides` (all of `shape`'s length).
    pub fn new(shape: &[usize], operands: &[&[isize]]) -> MapPlan {
        if shape.contains(&0) {
            // No elements: one empty axis, whatever the strides.
            return MapPlan {
                shape: vec![0],
                strides: vec![vec![1]; operands.len()],
            };
        }
        let (mut out_shape, mut out_strides) = crate::layout::merge_axes(shape, operands);
        if out_shape.is_empty() {
            out_shape.push(1);
            for s in &mut out_strides {
                s.push(1);
            }
        }
        MapPlan {
            shape: out_shape,
            strides: out_strides,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One axis, and every operand walks it with stride 1.
    pub fn is_flat(&self) -> bool {
        self.shape.len() == 1 && self.strides.iter().all(|s| s[0] == 1)
    }

    /// The element offset operand `k` reaches at linear (row-major) index `i` of the plan.
    pub fn offset(&self, k: usize, mut i: usize) -> isize {
        let mut off = 0isize;
        for axis in (0..self.shape.len()).rev() {
            let n = self.shape[axis];
            off += (i % n) as isize * self.strides[k][axis];
            i /= n;
        }
        off
    }
}

/// A reduction's index space: for each output element (the kept axes, row-major), the elements
/// of the reduced axes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReducePlan {
    /// The output's shape with the reduced axes removed (what the kernel writes, compactly).
    pub out_shape: Vec<usize>,
    /// The output's shape with reduced axes kept as 1 (for `keepdims`).
    pub keepdims_shape: Vec<usize>,
    /// The kept axes, collapsed: their extents and the input's strides over them.
    pub kept: MapPlan,
    /// The reduced axes, collapsed: their extents and the input's strides over them.
    pub reduced: MapPlan,
    /// How many elements each output reduces (0 for an empty reduction).
    pub count: usize,
}

impl ReducePlan {
    /// The plan reducing `axes` (any order, negative counted from the end; `None`: all) of an
    /// input of `shape` and `strides`.
    pub(crate) fn new(
        shape: &[usize],
        strides: &[isize],
        axes: Option<&[isize]>,
    ) -> Result<ReducePlan> {
        let ndim = shape.len();
        let mut reduce = vec![axes.is_none(); ndim];
        for &axis in axes.unwrap_or(&[]) {
            let a = if axis < 0 { axis + ndim as isize } else { axis };
            if a < 0 || a >= ndim as isize {
                return Err(Error::OutOfBounds(format!(
                    "axis {axis} is out of range for an array of {ndim} dimensions"
                )));
            }
            if reduce[a as usize] {
                return Err(Error::InvalidArgument(format!("axis {axis} is repeated")));
            }
            reduce[a as usize] = true;
        }
        let pick = |want: bool| -> (Vec<usize>, Vec<isize>) {
            (0..ndim)
                .filter(|&i| reduce[i] == want)
                .map(|i| (shape[i], strides[i]))
                .unzip()
        };
        let (kept_shape, kept_strides) = pick(false);
        let (red_shape, red_strides) = pick(true);
        let keepdims_shape = (0..ndim)
            .map(|i| if reduce[i] { 1 } else { shape[i] })
            .collect();
        let count = red_shape.iter().product();
        // The output is written compactly: its strides are row-major over the kept shape.
        let out_strides = row_major_strides(&kept_shape);
        Ok(ReducePlan {
            kept: MapPlan::new(&kept_shape, &[&out_strides, &kept_strides]),
            reduced: MapPlan::new(&red_shape, &[&red_strides]),
            out_shape: kept_shape,
            keepdims_shape,
            count,
        })
    }

    /// The number of output elements.
    pub(crate) fn outputs(&self) -> usize {
        self.out_shape.iter().product()
    }

    /// Whether each output's reduced elements are one run of consecutive input elements.
    pub(crate) fn reduced_contiguous(&self) -> bool {
        self.reduced.shape.len() == 1 && self.reduced.strides[0][0] == 1
    }

    /// The input's kept and reduced axes as a GPU reduction kernel's argument block holds them:
    /// arrays of `N` extents and strides (in elements), the axes past each side's count padded
    /// with extent 1 and stride 0. `None` when a side has more than `N` axes (the caller makes
    /// the input compact first, which collapses each side to one axis).
    pub(crate) fn kernel_axes<const N: usize>(&self) -> Option<KernelAxes<N>> {
        let side = |plan: &MapPlan, operand: usize| {
            let mut shape = [1u64; N];
            let mut strides = [0i64; N];
            if plan.shape.len() > N {
                return None;
            }
            for (d, (&n, &s)) in plan.shape.iter().zip(&plan.strides[operand]).enumerate() {
                shape[d] = n as u64;
                strides[d] = s as i64;
            }
            Some((shape, strides))
        };
        // Operand 1 of the kept side is the input (0 is the compact output).
        let (kept_shape, kept_strides) = side(&self.kept, 1)?;
        let (reduced_shape, reduced_strides) = side(&self.reduced, 0)?;
        Some(KernelAxes {
            kept_shape,
            kept_strides,
            reduced_shape,
            reduced_strides,
        })
    }

    /// Each output's reduced range cut into at most `wanted` chunks of a multiple of `multiple`
    /// elements (a vector load's width): the chunk length and how many chunks that makes (at
    /// least one, also for an empty range). A GPU reduction that has too few outputs to fill the
    /// device runs one group per chunk and combines the chunks' partial results after.
    pub(crate) fn split(&self, wanted: usize, multiple: usize) -> Split {
        let chunk = self
            .count
            .div_ceil(wanted.max(1))
            .next_multiple_of(multiple.max(1))
            .max(1);
        Split {
            chunk,
            splits: self.count.div_ceil(chunk).max(1),
        }
    }
}

/// A reduction's axes in fixed-size arrays ([`ReducePlan::kernel_axes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KernelAxes<const N: usize> {
    /// Extents of the kept axes.
    pub kept_shape: [u64; N],
    /// The input's strides over them.
    pub kept_strides: [i64; N],
    /// Extents of the reduced axes.
    pub reduced_shape: [u64; N],
    /// The input's strides over them.
    pub reduced_strides: [i64; N],
}

/// Each output's reduced range in chunks ([`ReducePlan::split`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Split {
    /// Elements per chunk (the last may be shorter).
    pub chunk: usize,
    /// How many chunks.
    pub splits: usize,
}

/// Row-major (C-order) strides in elements of a compact array of `shape`.
pub(crate) fn row_major_strides(shape: &[usize]) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    crate::layout::row_major_strides(shape, &mut strides);
    strides
}

/// How one `matmul` operand is laid out for a BLAS: a batch of `rows × cols` matrices, element
/// `[b, i, j]` at `b * batch_stride + i * row_stride + j * col_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatrixLayout {
    /// Rows of each matrix.
    pub rows: usize,
    /// Columns of each matrix.
    pub cols: usize,
    /// Elements between consecutive rows.
    pub row_stride: isize,
    /// Elements between consecutive columns.
    pub col_stride: isize,
    /// Elements between consecutive matrices (0: one matrix broadcast over the batch).
    pub batch_stride: isize,
}

impl MatrixLayout {
    /// Whether a BLAS can read the matrices in place: one of the two strides is 1 and the other
    /// spans at least a whole row or column (its "leading dimension"), with a non-negative batch
    /// stride.
    pub(crate) fn blas_compatible(&self) -> bool {
        let ok =
            |unit: isize, lead: isize, extent: usize| unit == 1 && lead >= extent.max(1) as isize;
        self.batch_stride >= 0
            && (ok(self.col_stride, self.row_stride, self.cols)
                || ok(self.row_stride, self.col_stride, self.rows)
                || self.rows <= 1 && self.cols <= 1)
    }

    /// Whether rows are contiguous (`col_stride == 1`): "row-major"; else columns are.
    #[cfg_attr(not(cuda), allow(dead_code))] // the CUDA backend's BLAS calls
    pub(crate) fn is_row_major(&self) -> bool {
        self.col_stride == 1 && (self.row_stride >= self.cols.max(1) as isize || self.rows <= 1)
    }

    /// The leading dimension a BLAS is given: the stride between rows when row-major, else
    /// between columns (at least 1).
    #[cfg_attr(not(cuda), allow(dead_code))] // the CUDA backend's BLAS calls
    pub(crate) fn leading_dimension(&self) -> usize {
        let ld = if self.is_row_major() {
            self.row_stride
        } else {
            self.col_stride
        };
        (ld.max(1) as usize).max(1)
    }
}

/// The shapes of a (batched) matrix product by NumPy's `matmul` rules: a 1-d left operand is a
/// row vector, a 1-d right operand a column vector (the added axis is removed from the result),
/// and leading batch axes broadcast.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MatmulShape {
    /// The broadcast batch shape.
    pub batch: Vec<usize>,
    /// Rows of the left operand and of the result.
    pub m: usize,
    /// The contracted extent.
    pub k: usize,
    /// Columns of the right operand and of the result.
    pub n: usize,
    /// The result's shape (1-d operands' added axes removed).
    pub out_shape: Vec<usize>,
    /// The left operand's shape as a (batched) matrix: `batch + [m, k]`.
    pub a_shape: Vec<usize>,
    /// The right operand's shape as a (batched) matrix: `batch + [k, n]`.
    pub b_shape: Vec<usize>,
}

impl MatmulShape {
    /// The product of arrays of shapes `a` and `b`.
    pub(crate) fn new(a: &[usize], b: &[usize]) -> Result<MatmulShape> {
        if a.is_empty() || b.is_empty() {
            return Err(Error::Shape(
                "matmul needs arrays of at least one dimension (got a 0-d operand)".into(),
            ));
        }
        let (a_vec, b_vec) = (a.len() == 1, b.len() == 1);
        let a2: Vec<usize> = if a_vec { vec![1, a[0]] } else { a.to_vec() };
        let b2: Vec<usize> = if b_vec { vec![b[0], 1] } else { b.to_vec() };
        let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
        let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
        if k != k2 {
            return Err(Error::Shape(format!(
                "matmul: the contracted axes differ ({a:?} @ {b:?}: {k} vs {k2})"
            )));
        }
        let batch = broadcast_shapes(&a2[..a2.len() - 2], &b2[..b2.len() - 2])?;
        let mut out_shape = batch.clone();
        if !a_vec {
            out_shape.push(m);
        }
        if !b_vec {
            out_shape.push(n);
        }
        let with = |x: usize, y: usize| {
            let mut s = batch.clone();
            s.extend([x, y]);
            s
        };
        Ok(MatmulShape {
            a_shape: with(m, k),
            b_shape: with(k, n),
            batch,
            m,
            k,
            n,
            out_shape,
        })
    }

    /// The number of matrices in the batch.
    pub(crate) fn batch_count(&self) -> usize {
        self.batch.iter().product()
    }
}

/// The matrix layout of a view of shape `batch + [rows, cols]` with `strides`, when its batch
/// axes collapse to one stride (else `None`: the operand must be made compact first).
pub(crate) fn matrix_layout(shape: &[usize], strides: &[isize]) -> Option<MatrixLayout> {
    let nd = shape.len();
    debug_assert!(nd >= 2);
    let (rows, cols) = (shape[nd - 2], shape[nd - 1]);
    let batch = MapPlan::new(&shape[..nd - 2], &[&strides[..nd - 2]]);
    let batch_stride = match batch.shape.as_slice() {
        [_] => batch.strides[0][0],
        _ => return None,
    };
    let batch_stride = if batch.len() <= 1 { 0 } else { batch_stride };
    Some(MatrixLayout {
        rows,
        cols,
        row_stride: strides[nd - 2],
        col_stride: strides[nd - 1],
        batch_stride,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        assert_eq!(broadcast_shapes(&[3, 1], &[4]).unwrap(), vec![3, 4]);
        assert_eq!(broadcast_shapes(&[], &[2, 3]).unwrap(), vec![2, 3]);
        assert_eq!(
            broadcast_shapes(&[5, 1, 3], &[4, 1]).unwrap(),
            vec![5, 4, 3]
        );
        assert_eq!(broadcast_shapes(&[0], &[1]).unwrap(), vec![0]);
        let err = broadcast_shapes(&[3], &[4]).unwrap_err();
        assert!(err.to_string().contains("do not broadcast"), "{err}");
    }

    #[test]
    fn compact_operands_collapse_to_one_axis() {
        let plan = MapPlan::new(&[2, 3, 4], &[&[12, 4, 1], &[12, 4, 1]]);
        assert_eq!(plan.shape, vec![24]);
        assert!(plan.is_flat());
    }

    #[test]
    fn broadcast_and_transposed_operands_keep_their_axes() {
        // out [2,3] compact; a broadcast row [3] (stride 0 on axis 0); b transposed.
        let plan = MapPlan::new(&[2, 3], &[&[3, 1], &[0, 1], &[1, 2]]);
        assert_eq!(plan.shape, vec![2, 3]);
        assert!(!plan.is_flat());
        assert_eq!(plan.offset(2, 4), 1 + 2); // [1, 1] in b
        assert_eq!(plan.offset(1, 4), 1);
    }

    #[test]
    fn unit_axes_drop_and_zero_d_is_one_element() {
        let plan = MapPlan::new(&[1, 5, 1], &[&[5, 1, 1], &[7, 2, 9]]);
        assert_eq!(plan.shape, vec![5]);
        assert_eq!(plan.strides, vec![vec![1], vec![2]]);
        let scalar = MapPlan::new(&[], &[&[], &[]]);
        assert_eq!(scalar.shape, vec![1]);
        assert_eq!(scalar.len(), 1);
        let empty = MapPlan::new(&[3, 0, 2], &[&[0, 2, 1], &[6, 2, 1]]);
        assert!(empty.is_empty());
        assert_eq!(empty.shape, vec![0]);
        // A compact batch with an empty axis after a longer one still collapses.
        assert_eq!(
            matrix_layout(&[2, 0, 3, 4], &[12, 12, 4, 1])
                .unwrap()
                .batch_stride,
            0
        );
    }

    #[test]
    fn negative_strides_merge_when_consistent() {
        // A fully reversed compact [2,3]: strides [-3, -1].
        let plan = MapPlan::new(&[2, 3], &[&[3, 1], &[-3, -1]]);
        assert_eq!(plan.shape, vec![6]);
        assert_eq!(plan.strides[1], vec![-1]);
        assert!(!plan.is_flat());
    }

    #[test]
    fn reduce_plans_split_axes() {
        let plan = ReducePlan::new(&[2, 3, 4], &[12, 4, 1], Some(&[-1, 0])).unwrap();
        assert_eq!(plan.out_shape, vec![3]);
        assert_eq!(plan.keepdims_shape, vec![1, 3, 1]);
        assert_eq!(plan.count, 8);
        assert_eq!(plan.kept.shape, vec![3]);
        assert_eq!(plan.kept.strides, vec![vec![1], vec![4]]);
        assert_eq!(plan.reduced.shape, vec![2, 4]);
        assert_eq!(plan.reduced.strides, vec![vec![12, 1]]);

        let all = ReducePlan::new(&[2, 3], &[3, 1], None).unwrap();
        assert_eq!(all.out_shape, Vec::<usize>::new());
        assert_eq!(all.outputs(), 1);
        assert_eq!(all.reduced.shape, vec![6]);

        assert!(matches!(
            ReducePlan::new(&[2], &[1], Some(&[1])),
            Err(Error::OutOfBounds(_))
        ));
        assert!(matches!(
            ReducePlan::new(&[2, 2], &[2, 1], Some(&[0, -2])),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(
            ReducePlan::new(&[0, 3], &[3, 1], Some(&[0])).unwrap().count,
            0
        );
    }

    #[test]
    fn matmul_shapes_follow_numpy() {
        let s = MatmulShape::new(&[2, 1, 3, 4], &[5, 4, 6]).unwrap();
        assert_eq!((s.m, s.k, s.n), (3, 4, 6));
        assert_eq!(s.batch, vec![2, 5]);
        assert_eq!(s.out_shape, vec![2, 5, 3, 6]);
        let v = MatmulShape::new(&[4], &[4, 6]).unwrap();
        assert_eq!(v.out_shape, vec![6]);
        let dot = MatmulShape::new(&[4], &[4]).unwrap();
        assert_eq!(dot.out_shape, Vec::<usize>::new());
        assert!(MatmulShape::new(&[3, 4], &[5, 6]).is_err());
        assert!(MatmulShape::new(&[], &[5, 6]).is_err());
    }

    #[test]
    fn matrix_layouts_for_blas() {
        let row = matrix_layout(&[2, 3, 4], &[12, 4, 1]).unwrap();
        assert!(row.blas_compatible() && row.is_row_major());
        assert_eq!((row.leading_dimension(), row.batch_stride), (4, 12));
        let col = matrix_layout(&[3, 4], &[1, 3]).unwrap();
        assert!(col.blas_compatible() && !col.is_row_major());
        assert_eq!(col.leading_dimension(), 3);
        let strided = matrix_layout(&[3, 4], &[8, 2]).unwrap();
        assert!(!strided.blas_compatible());
        // Broadcast batch: stride 0 is fine; batch axes that do not collapse are not.
        assert_eq!(
            matrix_layout(&[5, 3, 4], &[0, 4, 1]).unwrap().batch_stride,
            0
        );
        assert!(matrix_layout(&[2, 2, 3, 4], &[100, 12, 4, 1]).is_none());
    }

    #[test]
    fn kernel_axes_and_splits() {
        // Reduce axis 1 of a [3, 5, 7] array with strides [35, 7, 1]: kept [3, 7], reduced [5].
        let plan = ReducePlan::new(&[3, 5, 7], &[35, 7, 1], Some(&[1])).unwrap();
        let axes = plan.kernel_axes::<4>().unwrap();
        assert_eq!(axes.kept_shape, [3, 7, 1, 1]);
        assert_eq!(axes.kept_strides, [35, 1, 0, 0]);
        assert_eq!(axes.reduced_shape, [5, 1, 1, 1]);
        assert_eq!(axes.reduced_strides, [7, 0, 0, 0]);
        assert!(plan.kernel_axes::<1>().is_none());
        assert!(!plan.reduced_contiguous());
        let all = ReducePlan::new(&[1000], &[1], None).unwrap();
        assert!(all.reduced_contiguous());
        assert_eq!(
            all.split(3, 1),
            Split {
                chunk: 334,
                splits: 3
            }
        );
        assert_eq!(
            all.split(3, 16),
            Split {
                chunk: 336,
                splits: 3
            }
        );
        // More chunks asked than elements fill: as many as there are.
        assert_eq!(
            all.split(600, 4),
            Split {
                chunk: 4,
                splits: 250
            }
        );
        let empty = ReducePlan::new(&[0], &[1], None).unwrap();
        assert_eq!(
            empty.split(8, 1),
            Split {
                chunk: 1,
                splits: 1
            }
        );
    }
}
