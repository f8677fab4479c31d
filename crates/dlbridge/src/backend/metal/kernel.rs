//! The strided-copy compute kernel: its Metal Shading Language source, the parameter block it
//! reads, and the plan that turns two layouts into dispatches. Platform-free: the plan and a Rust
//! model of the kernel's index arithmetic ([`StridedCopyParams::offsets`]) are tested on every
//! host; the runtime compiles [`MSL_SOURCE`] once per device and dispatches what the plan says.
//!
//! The kernel copies "units" (1, 2, 4, 8 or 16 bytes, moved as `uchar`, `ushort`, `uint`,
//! `uint2`, `uint4`). An element whose size is not a unit size, or whose offsets are aligned to
//! less than its size, is moved as several smaller units: the plan adds an innermost axis over the
//! units of one element. Each thread copies one unit: it decomposes its linear index over the
//! shape (row-major) and adds the strides of each side. The axes are the shared copy planner's
//! (`copy_axes`: extent-1 axes dropped, axes contiguous with each other on both sides merged), so
//! a compact copy is one axis.

use crate::backend::plan::{check_ranks, copy_axes};
use crate::error::{Error, Result, overflow};

/// The most axes the kernel takes after merging.
pub(crate) const MAX_KERNEL_DIMS: usize = 16;

/// The kernel family's name; with the unit size it keys the pipeline cache.
pub(crate) const STRIDED_COPY: &str = "dlbridge_copy_strided";

/// The most threads one dispatch covers (the kernel's thread index is 32-bit).
pub(crate) const MAX_THREADS_PER_DISPATCH: u64 = 1 << 31;

/// The parameter block, laid out exactly as `StridedCopyParams` in [`MSL_SOURCE`] (passed with
/// `setBytes:length:atIndex:` at index 2). Offsets and strides count units, not bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StridedCopyParams {
    /// Units this dispatch copies (one per thread).
    pub(crate) count: u64,
    /// The linear index of the dispatch's first unit.
    pub(crate) base: u64,
    /// Source unit index of the first element, from the start of the source buffer.
    pub(crate) src_first: i64,
    /// Destination unit index of the first element.
    pub(crate) dst_first: i64,
    /// Axes in use.
    pub(crate) ndim: u32,
    /// Padding (keeps the arrays 8-byte aligned on both sides).
    pub(crate) pad: u32,
    /// Extents, outermost first.
    pub(crate) shape: [u64; MAX_KERNEL_DIMS],
    /// Source strides in units.
    pub(crate) src_strides: [i64; MAX_KERNEL_DIMS],
    /// Destination strides in units.
    pub(crate) dst_strides: [i64; MAX_KERNEL_DIMS],
}

impl StridedCopyParams {
    /// The source and destination unit indices of linear unit `i` (counted from the start of the
    /// whole copy, not of this dispatch): the arithmetic the kernel performs.
    #[cfg(test)]
    pub(crate) fn offsets(&self, i: u64) -> (i64, i64) {
        let (mut s, mut d, mut rest) = (self.src_first, self.dst_first, i);
        for k in (0..self.ndim as usize).rev() {
            let n = self.shape[k];
            let c = (rest % n) as i64;
            rest /= n;
            s += c * self.src_strides[k];
            d += c * self.dst_strides[k];
        }
        (s, d)
    }
}

/// How one strided copy runs: the unit size, the kernel's parameters, the number of units.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StridedCopyPlan {
    /// Bytes per unit (1, 2, 4, 8 or 16).
    pub(crate) unit: usize,
    /// Units to copy in all.
    pub(crate) total: u64,
    /// Parameters for the whole copy (`base` 0, `count` = `total`).
    pub(crate) params: StridedCopyParams,
}

/// The widest unit (at most 16 bytes) that divides `itemsize` and both byte offsets.
fn unit_for(itemsize: usize, src_offset: usize, dst_offset: usize) -> usize {
    let mut unit = 16;
    while unit > 1 && (itemsize % unit != 0 || src_offset % unit != 0 || dst_offset % unit != 0) {
        unit /= 2;
    }
    unit
}

/// The kernel function that moves units of `unit` bytes.
pub(crate) fn function_name(unit: usize) -> Result<&'static str> {
    Ok(match unit {
        1 => "dlbridge_copy_strided_1",
        2 => "dlbridge_copy_strided_2",
        4 => "dlbridge_copy_strided_4",
        8 => "dlbridge_copy_strided_8",
        16 => "dlbridge_copy_strided_16",
        _ => {
            return Err(Error::InvalidArgument(format!(
                "no strided-copy kernel moves {unit}-byte units"
            )));
        }
    })
}

impl StridedCopyPlan {
    /// Plans copying the `shape` elements of `itemsize` bytes addressed by the source layout
    /// (strides in elements, first element `src_offset` bytes into its buffer) to those the
    /// destination layout addresses.
    pub(crate) fn new(
        shape: &[usize],
        src_strides: &[isize],
        src_offset: usize,
        dst_strides: &[isize],
        dst_offset: usize,
        itemsize: usize,
    ) -> Result<Self> {
        check_ranks(shape, src_strides, dst_strides)?;
        if itemsize == 0 {
            return Err(Error::UnsupportedDType(
                "zero-sized elements cannot be copied".into(),
            ));
        }
        let unit = unit_for(itemsize, src_offset, dst_offset);
        let per = itemsize / unit;
        // Strides in units; the element's own units are the planner's innermost axis.
        let mut src_units: Vec<isize> = Vec::with_capacity(shape.len());
        let mut dst_units: Vec<isize> = Vec::with_capacity(shape.len());
        let mut total: u64 = 1;
        for ((&n, &s), &d) in shape.iter().zip(src_strides).zip(dst_strides) {
            total = total
                .checked_mul(n as u64)
                .ok_or_else(|| overflow("element count of a Metal copy"))?;
            src_units.push(
                s.checked_mul(per as isize)
                    .ok_or_else(|| overflow("source stride in units"))?,
            );
            dst_units.push(
                d.checked_mul(per as isize)
                    .ok_or_else(|| overflow("destination stride in units"))?,
            );
        }
        total = total
            .checked_mul(per as u64)
            .ok_or_else(|| overflow("unit count of a Metal copy"))?;
        let merged = copy_axes(shape, &src_units, &dst_units, per)?;
        if merged.len() > MAX_KERNEL_DIMS {
            return Err(Error::Shape(format!(
                "the Metal copy kernel takes at most {MAX_KERNEL_DIMS} axes that cannot be \
                 merged; this copy has {}",
                merged.len()
            )));
        }
        let mut params = StridedCopyParams {
            count: total,
            base: 0,
            src_first: (src_offset / unit) as i64,
            dst_first: (dst_offset / unit) as i64,
            ndim: merged.len() as u32,
            pad: 0,
            shape: [1; MAX_KERNEL_DIMS],
            src_strides: [0; MAX_KERNEL_DIMS],
            dst_strides: [0; MAX_KERNEL_DIMS],
        };
        for (k, axis) in merged.into_iter().enumerate() {
            params.shape[k] = axis.extent;
            params.src_strides[k] = axis.src;
            params.dst_strides[k] = axis.dst;
        }
        Ok(StridedCopyPlan {
            unit,
            total,
            params,
        })
    }

    /// The kernel function for this plan.
    #[cfg(test)]
    pub(crate) fn function_name(&self) -> &'static str {
        function_name(self.unit).expect("units are powers of two up to 16")
    }

    /// The parameter blocks of the dispatches, each covering at most `max_threads` units.
    pub(crate) fn dispatches(&self, max_threads: u64) -> Vec<StridedCopyParams> {
        let step = max_threads.max(1);
        let mut out = Vec::new();
        let mut base = 0;
        while base < self.total {
            let count = step.min(self.total - base);
            out.push(StridedCopyParams {
                count,
                base,
                ..self.params
            });
            base += count;
        }
        out
    }
}

/// Blit copies on macOS need offsets and sizes that are multiples of this many bytes.
pub(crate) const BLIT_ALIGN: usize = 4;

/// How a GPU copy between two views runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CopyMethod {
    /// Nothing to copy (no elements).
    Nothing,
    /// One blit of `size` bytes: both views are compact, and the offsets and size suit a blit.
    Blit {
        /// Byte offset in the source buffer.
        src_offset: usize,
        /// Byte offset in the destination buffer.
        dst_offset: usize,
        /// Bytes to copy.
        size: usize,
    },
    /// The strided-copy kernel.
    Kernel(Box<StridedCopyPlan>),
}

/// Chooses between a blit and the strided-copy kernel for copying the elements of one layout
/// (strides in elements, first element at a byte offset) to another of the same shape.
pub(crate) fn plan_copy(
    shape: &[usize],
    src_strides: &[isize],
    src_offset: usize,
    dst_strides: &[isize],
    dst_offset: usize,
    itemsize: usize,
) -> Result<CopyMethod> {
    let plan = StridedCopyPlan::new(
        shape,
        src_strides,
        src_offset,
        dst_strides,
        dst_offset,
        itemsize,
    )?;
    if plan.total == 0 {
        return Ok(CopyMethod::Nothing);
    }
    let p = &plan.params;
    let compact = p.ndim == 0 || (p.ndim == 1 && p.src_strides[0] == 1 && p.dst_strides[0] == 1);
    let size = plan.total as usize * plan.unit;
    if compact
        && [src_offset, dst_offset, size]
            .iter()
            .all(|v| v % BLIT_ALIGN == 0)
    {
        return Ok(CopyMethod::Blit {
            src_offset,
            dst_offset,
            size,
        });
    }
    Ok(CopyMethod::Kernel(Box::new(plan)))
}

/// The kernels, compiled from source at run time (once per device). One function per unit size;
/// each thread copies one unit.
pub(crate) const MSL_SOURCE: &str = r#"
#include <metal_stdlib>
using namespace metal;

struct StridedCopyParams {
    ulong count;
    ulong base;
    long src_first;
    long dst_first;
    uint ndim;
    uint pad;
    ulong shape[16];
    long src_strides[16];
    long dst_strides[16];
};

#define DLBRIDGE_COPY_STRIDED(NAME, T)                                             \
kernel void NAME(device const T* src [[buffer(0)]],                                \
                 device T* dst [[buffer(1)]],                                      \
                 constant StridedCopyParams& p [[buffer(2)]],                      \
                 uint gid [[thread_position_in_grid]]) {                           \
    if (ulong(gid) >= p.count) {                                                   \
        return;                                                                    \
    }                                                                              \
    ulong rest = p.base + ulong(gid);                                              \
    long s = p.src_first;                                                          \
    long d = p.dst_first;                                                          \
    for (int k = int(p.ndim) - 1; k >= 0; --k) {                                   \
        ulong n = p.shape[k];                                                      \
        long c = long(rest % n);                                                   \
        rest /= n;                                                                 \
        s += c * p.src_strides[k];                                                 \
        d += c * p.dst_strides[k];                                                 \
    }                                                                              \
    dst[d] = src[s];                                                               \
}

DLBRIDGE_COPY_STRIDED(dlbridge_copy_strided_1, uchar)
DLBRIDGE_COPY_STRIDED(dlbridge_copy_strided_2, ushort)
DLBRIDGE_COPY_STRIDED(dlbridge_copy_strided_4, uint)
DLBRIDGE_COPY_STRIDED(dlbridge_copy_strided_8, uint2)
DLBRIDGE_COPY_STRIDED(dlbridge_copy_strided_16, uint4)
"#;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Layout, SliceArg};

    /// Runs the plan's arithmetic on the host over byte arrays: the kernel's semantics.
    fn run(plan: &StridedCopyPlan, src: &[u8], dst: &mut [u8]) {
        let u = plan.unit as i64;
        for p in plan.dispatches(7) {
            for gid in 0..p.count {
                let (s, d) = p.offsets(p.base + gid);
                let (s, d) = ((s * u) as usize, (d * u) as usize);
                dst[d..d + plan.unit].copy_from_slice(&src[s..s + plan.unit]);
            }
        }
    }

    /// The reference: element by element through `Layout` offsets.
    fn reference(src_layout: &Layout, itemsize: usize, src: &[u8]) -> Vec<u8> {
        let shape = src_layout.shape().to_vec();
        let numel: usize = shape.iter().product();
        let mut out = Vec::with_capacity(numel * itemsize);
        for linear in 0..numel {
            let mut rest = linear;
            let mut off = src_layout.byte_offset() as isize;
            for k in (0..shape.len()).rev() {
                let c = rest % shape[k];
                rest /= shape[k];
                off += c as isize * src_layout.strides()[k] * itemsize as isize;
            }
            let off = off as usize;
            out.extend_from_slice(&src[off..off + itemsize]);
        }
        out
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn struct_layout_matches_the_shader() {
        assert_eq!(
            std::mem::size_of::<StridedCopyParams>(),
            4 * 8 + 2 * 4 + 3 * 16 * 8
        );
        assert_eq!(std::mem::align_of::<StridedCopyParams>(), 8);
        assert_eq!(std::mem::offset_of!(StridedCopyParams, ndim), 32);
        assert_eq!(std::mem::offset_of!(StridedCopyParams, shape), 40);
        assert_eq!(
            std::mem::offset_of!(StridedCopyParams, dst_strides),
            40 + 2 * 128
        );
        for unit in [1, 2, 4, 8, 16] {
            let name = function_name(unit).unwrap();
            assert!(
                MSL_SOURCE.contains(&format!("DLBRIDGE_COPY_STRIDED({name},")),
                "{name} is defined in the source"
            );
            assert!(name.starts_with(STRIDED_COPY));
        }
        assert!(function_name(3).is_err());
    }

    #[test]
    fn compact_copies_collapse_to_one_axis() {
        let plan = StridedCopyPlan::new(&[4, 5, 6], &[30, 6, 1], 0, &[30, 6, 1], 0, 4).unwrap();
        assert_eq!(plan.unit, 4);
        assert_eq!(plan.params.ndim, 1);
        assert_eq!(plan.total, 120);
        assert_eq!(plan.function_name(), "dlbridge_copy_strided_4");
    }

    #[test]
    fn strided_views_match_layout_offsets() {
        for itemsize in [1usize, 2, 4, 8, 16, 12, 32] {
            let base = Layout::contiguous(&[6, 7, 5]).unwrap();
            let views = [
                base.clone(),
                base.transpose(),
                base.permute(&[1, 0, 2]).unwrap(),
                base.slice(
                    1,
                    SliceArg {
                        start: Some(6),
                        stop: None,
                        step: -2,
                    },
                    itemsize,
                )
                .unwrap(),
                base.slice(
                    0,
                    SliceArg {
                        start: Some(1),
                        stop: Some(5),
                        step: 3,
                    },
                    itemsize,
                )
                .unwrap()
                .slice(2, SliceArg::range(1, 4), itemsize)
                .unwrap(),
                base.index(2, 3, itemsize)
                    .unwrap()
                    .broadcast_to(&[2, 6, 7])
                    .unwrap(),
            ];
            let src = pattern(base.numel() * itemsize);
            for view in views {
                let dst_layout = Layout::contiguous(view.shape()).unwrap();
                let plan = StridedCopyPlan::new(
                    view.shape(),
                    view.strides(),
                    view.byte_offset(),
                    dst_layout.strides(),
                    0,
                    itemsize,
                )
                .unwrap();
                assert!(plan.unit <= itemsize && itemsize % plan.unit == 0);
                let mut dst = vec![0u8; view.numel() * itemsize];
                run(&plan, &src, &mut dst);
                assert_eq!(
                    dst,
                    reference(&view, itemsize, &src),
                    "itemsize {itemsize}, view {view:?}"
                );
            }
        }
    }

    #[test]
    fn strided_destination() {
        // Scatter a compact 3x4 source into every other column of a 3x8 destination, reversed.
        let itemsize = 4;
        let src = pattern(12 * itemsize);
        let dst_base = Layout::contiguous(&[3, 8]).unwrap();
        let dst_view = dst_base
            .slice(
                1,
                SliceArg {
                    start: Some(7),
                    stop: None,
                    step: -2,
                },
                itemsize,
            )
            .unwrap();
        let plan = StridedCopyPlan::new(
            &[3, 4],
            &[4, 1],
            0,
            dst_view.strides(),
            dst_view.byte_offset(),
            itemsize,
        )
        .unwrap();
        let mut dst = vec![0u8; 24 * itemsize];
        run(&plan, &src, &mut dst);
        let read_back = reference(&dst_view, itemsize, &dst);
        assert_eq!(read_back, src);
        // Untouched columns stay zero.
        assert!(dst[..itemsize].iter().all(|&b| b == 0));
    }

    #[test]
    fn misaligned_offsets_use_narrower_units() {
        // float32 elements at an offset of 2 bytes: moved as two 2-byte units each.
        let plan = StridedCopyPlan::new(&[10], &[2], 2, &[1], 0, 4).unwrap();
        assert_eq!(plan.unit, 2);
        assert_eq!(plan.total, 20);
        let src = pattern(100);
        let mut dst = vec![0u8; 40];
        run(&plan, &src, &mut dst);
        for e in 0..10 {
            assert_eq!(dst[e * 4..e * 4 + 4], src[2 + e * 8..2 + e * 8 + 4]);
        }
        let odd = StridedCopyPlan::new(&[3], &[1], 1, &[1], 0, 8).unwrap();
        assert_eq!((odd.unit, odd.total), (1, 24));
    }

    #[test]
    fn compact_aligned_copies_are_blits() {
        let shape = [4, 6];
        let c = Layout::contiguous(&shape).unwrap();
        assert_eq!(
            plan_copy(&shape, c.strides(), 8, c.strides(), 0, 2).unwrap(),
            CopyMethod::Blit {
                src_offset: 8,
                dst_offset: 0,
                size: 48
            }
        );
        // A 0-d tensor is one element.
        assert_eq!(
            plan_copy(&[], &[], 4, &[], 12, 4).unwrap(),
            CopyMethod::Blit {
                src_offset: 4,
                dst_offset: 12,
                size: 4
            }
        );
        // Offsets or sizes a macOS blit cannot take go to the kernel.
        for (src_off, n) in [(2, 4), (0, 3)] {
            let m = plan_copy(&[n], &[1], src_off, &[1], 0, 2).unwrap();
            assert!(matches!(m, CopyMethod::Kernel(_)), "{m:?}");
        }
        // Transposed: the kernel.
        let t = c.transpose();
        let d = Layout::contiguous(t.shape()).unwrap();
        let m = plan_copy(t.shape(), t.strides(), 0, d.strides(), 0, 4).unwrap();
        assert!(
            matches!(m, CopyMethod::Kernel(ref p) if p.params.ndim == 2),
            "{m:?}"
        );
        assert_eq!(
            plan_copy(&[0, 3], &[3, 1], 0, &[3, 1], 0, 4).unwrap(),
            CopyMethod::Nothing
        );
    }

    #[test]
    fn dispatch_split_and_limits() {
        let plan = StridedCopyPlan::new(&[10], &[1], 0, &[1], 0, 1).unwrap();
        let d = plan.dispatches(4);
        let spans: Vec<_> = d.iter().map(|p| (p.base, p.count)).collect();
        assert_eq!(spans, vec![(0, 4), (4, 4), (8, 2)]);
        let empty = StridedCopyPlan::new(&[3, 0], &[1, 1], 0, &[1, 1], 0, 4).unwrap();
        assert!(empty.dispatches(MAX_THREADS_PER_DISPATCH).is_empty());
        // 17 axes that cannot merge.
        let shape = [2usize; 17];
        let strides: Vec<isize> = (0..17).map(|k| 3isize.pow(17 - k as u32)).collect();
        let dst = Layout::contiguous(&shape).unwrap();
        let err = StridedCopyPlan::new(&shape, &strides, 0, dst.strides(), 0, 1).unwrap_err();
        assert!(matches!(err, Error::Shape(_)), "{err}");
        assert!(StridedCopyPlan::new(&[2], &[1], 0, &[1, 1], 0, 1).is_err());
    }
}
