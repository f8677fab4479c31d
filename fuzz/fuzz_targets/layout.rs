//! `Layout` arithmetic: a layout from fuzz bytes, then a sequence of view operations.
//!
//! Every layout that is built (and has at most 4096 elements) is checked against brute force:
//! `element_extent` and `byte_range` against the offsets of all its elements, `is_contiguous` and
//! `is_f_contiguous` against the definition (element `k` in C or F order sits at offset `k`), and
//! each operation's result against the elements of its input that it should select; the merged
//! loop nest of an element-wise kernel (`MapPlan`) against the offsets of its elements. Nothing
//! may panic or overflow (the targets are built with overflow checks).

#![no_main]

use dlbridge::compute::MapPlan;
use dlbridge::{Layout, MAX_NDIM, SliceArg};
use fuzz_support::{Input, element_offset, for_each_index, small_numel};
use libfuzzer_sys::fuzz_target;

/// Layouts up to this many elements are enumerated.
const BRUTE_FORCE_LIMIT: usize = 4096;

/// Element sizes the library meets: 1 to 16 bytes, and the widest DLPack dtype (128 bits x 65535
/// lanes).
fn pick_itemsize(input: &mut Input) -> usize {
    match input.below(8) {
        0 => 1,
        1 => 2,
        2 => 4,
        3 => 8,
        4 => 16,
        5 => usize::from(input.u16()).max(1),
        6 => 128 * 65535 / 8,
        _ => 3,
    }
}

fn index(input: &mut Input) -> isize {
    match input.u8() {
        b @ 0..=239 => isize::from(b as i8 % 8),
        240 => isize::MIN,
        241 => isize::MAX,
        _ => input.i64() as isize,
    }
}

fn opt_index(input: &mut Input) -> Option<isize> {
    if input.u8() < 64 {
        None
    } else {
        Some(index(input))
    }
}

/// Python's `range(len)[start:stop:step]`, written out independently of the library.
fn python_slice(len: usize, arg: SliceArg) -> Vec<usize> {
    let n = len as i128;
    let step = arg.step as i128;
    let norm = |i: isize| {
        let i = i as i128;
        if i < 0 { i + n } else { i }
    };
    let mut out = vec![];
    if step > 0 {
        let s = arg.start.map_or(0, |s| norm(s).clamp(0, n));
        let e = arg.stop.map_or(n, |e| norm(e).clamp(0, n));
        let mut i = s;
        while i < e {
            out.push(i as usize);
            i += step;
        }
    } else {
        let s = arg.start.map_or(n - 1, |s| norm(s).clamp(-1, n - 1));
        let e = arg.stop.map_or(-1, |e| norm(e).clamp(-1, n - 1));
        let mut i = s;
        while i > e {
            out.push(i as usize);
            i += step;
        }
    }
    out
}

/// Byte offset of the element at `idx`, exactly.
fn byte_at(l: &Layout, idx: &[usize], itemsize: usize) -> i128 {
    l.byte_offset() as i128 + element_offset(idx, l.strides()) * itemsize as i128
}

/// The brute-force checks of one layout.
fn check(l: &Layout, itemsize: usize) {
    assert!(l.ndim() <= MAX_NDIM);
    assert_eq!(l.shape().len(), l.strides().len());
    let Some(numel) = small_numel(l.shape(), BRUTE_FORCE_LIMIT) else {
        // Too big to enumerate; still nothing may panic.
        let _ = (
            l.element_extent(),
            l.byte_range(itemsize),
            l.is_contiguous(),
        );
        let _ = l.is_f_contiguous();
        return;
    };
    assert_eq!(l.numel(), numel);
    let mut offsets = Vec::with_capacity(numel);
    for_each_index(l.shape(), |idx| {
        offsets.push(element_offset(idx, l.strides()))
    });
    assert_eq!(offsets.len(), numel);
    check_merged(l, &offsets);
    let extent = offsets
        .iter()
        .min()
        .map(|&lo| (lo, *offsets.iter().max().unwrap()));
    assert_eq!(l.element_extent(), extent, "element_extent of {l:?}");

    let size = itemsize as i128;
    let want = match extent {
        None => Some(l.byte_offset()..l.byte_offset()),
        Some((lo, hi)) => {
            let start = l.byte_offset() as i128 + lo * size;
            let end = l.byte_offset() as i128 + (hi + 1) * size;
            if start < 0 || end > isize::MAX as i128 {
                None
            } else {
                Some(start as usize..end as usize)
            }
        }
    };
    match (l.byte_range(itemsize), want) {
        (Ok(got), Some(want)) => assert_eq!(got, want, "byte_range of {l:?} x {itemsize}"),
        (Err(_), None) => {}
        (got, want) => panic!("byte_range of {l:?} x {itemsize}: got {got:?}, want {want:?}"),
    }

    // C order: the k-th element in row-major order sits at offset k. F order: the same with the
    // axes reversed.
    let c = offsets.iter().enumerate().all(|(k, &o)| o == k as i128);
    assert_eq!(l.is_contiguous(), c, "is_contiguous of {l:?}");
    let t = l.transpose();
    let mut f_offsets = Vec::with_capacity(numel);
    for_each_index(t.shape(), |idx| {
        f_offsets.push(element_offset(idx, t.strides()))
    });
    let f = f_offsets.iter().enumerate().all(|(k, &o)| o == k as i128);
    assert_eq!(l.is_f_contiguous(), f, "is_f_contiguous of {l:?}");
}

/// The merged loop nest of an element-wise kernel (`MapPlan`, built on the crate's one axis
/// merger) over the layout and a compact output addresses every element where the layout does,
/// in the same order.
fn check_merged(l: &Layout, offsets: &[i128]) {
    // The plan's offsets are `isize`: only layouts whose offsets all fit are walked. An empty
    // shape may have no compact layout (its other extents can multiply past `isize::MAX`).
    if offsets.iter().any(|&o| isize::try_from(o).is_err()) {
        return;
    }
    let Ok(compact) = Layout::contiguous(l.shape()) else {
        assert!(offsets.is_empty(), "{l:?} has elements but no compact layout");
        return;
    };
    let plan = MapPlan::new(l.shape(), &[compact.strides(), l.strides()]);
    assert_eq!(plan.len(), offsets.len(), "{plan:?} of {l:?}");
    for (k, &want) in offsets.iter().enumerate() {
        assert_eq!(plan.offset(0, k), k as isize, "{plan:?} of {l:?}");
        assert_eq!(plan.offset(1, k) as i128, want, "{plan:?} of {l:?}, element {k}");
    }
}

/// Checks that `out` addresses, at each index, the byte of `src` at `map(index)`.
fn check_view(src: &Layout, out: &Layout, itemsize: usize, map: impl Fn(&[usize]) -> Vec<usize>) {
    let (Some(_), Some(_)) = (
        small_numel(src.shape(), BRUTE_FORCE_LIMIT),
        small_numel(out.shape(), BRUTE_FORCE_LIMIT),
    ) else {
        return;
    };
    for_each_index(out.shape(), |idx| {
        let from = map(idx);
        assert_eq!(from.len(), src.ndim());
        assert!(
            from.iter().zip(src.shape()).all(|(&i, &d)| i < d),
            "{from:?} outside {src:?}"
        );
        assert_eq!(
            byte_at(out, idx, itemsize),
            byte_at(src, &from, itemsize),
            "element {idx:?} of {out:?} from {src:?}"
        );
    });
}

fn step(input: &mut Input, l: &Layout, itemsize: usize) -> Option<Layout> {
    let ndim = l.ndim();
    match input.below(9) {
        0 => {
            let axis = index(input);
            let mut arg = SliceArg {
                start: opt_index(input),
                stop: opt_index(input),
                step: index(input),
            };
            if input.u8() < 8 {
                arg.step = 0;
            }
            let out = l.slice(axis, arg, itemsize).ok()?;
            let a = if axis < 0 { axis + ndim as isize } else { axis } as usize;
            if l.shape()[a] > BRUTE_FORCE_LIMIT {
                return Some(out);
            }
            let picked = python_slice(l.shape()[a], arg);
            assert_eq!(
                out.shape()[a],
                picked.len(),
                "slice {arg:?} of axis {a} of {l:?}"
            );
            check_view(l, &out, itemsize, |idx| {
                let mut from = idx.to_vec();
                from[a] = picked[idx[a]];
                from
            });
            Some(out)
        }
        1 => {
            let (axis, i) = (index(input), index(input));
            let out = l.index(axis, i, itemsize).ok()?;
            let a = if axis < 0 { axis + ndim as isize } else { axis } as usize;
            let len = l.shape()[a] as isize;
            let i = if i < 0 { i + len } else { i } as usize;
            check_view(l, &out, itemsize, |idx| {
                let mut from = idx.to_vec();
                from.insert(a, i);
                from
            });
            Some(out)
        }
        2 => {
            // A permutation from the bytes (a shuffle), sometimes broken on purpose.
            let mut axes: Vec<usize> = (0..ndim).collect();
            for k in (1..ndim).rev() {
                axes.swap(k, usize::from(input.u8()) % (k + 1));
            }
            match input.u8() {
                0..=7 if ndim > 0 => axes[0] = usize::from(input.u8()) % (ndim + 2),
                8..=11 => axes.push(0),
                _ => {}
            }
            let out = l.permute(&axes).ok()?;
            check_view(l, &out, itemsize, |idx| {
                let mut from = vec![0; ndim];
                for (k, &a) in axes.iter().enumerate() {
                    from[a] = idx[k];
                }
                from
            });
            Some(out)
        }
        3 => {
            let out = l.transpose();
            check_view(l, &out, itemsize, |idx| idx.iter().rev().copied().collect());
            Some(out)
        }
        4 => {
            let n = usize::from(input.below(7));
            let shape: Vec<Option<usize>> = (0..n)
                .map(|_| match input.u8() {
                    0..=31 => None,
                    b @ 32..=247 => Some(usize::from(b % 7)),
                    _ => Some(input.u64() as usize),
                })
                .collect();
            let out = l.reshape(&shape).ok()?;
            // Same elements in the same row-major order.
            check_view(l, &out, itemsize, |idx| {
                let mut flat = 0usize;
                for (&i, &d) in idx.iter().zip(out.shape()) {
                    flat = flat * d + i;
                }
                let mut from = vec![0; ndim];
                for (slot, &d) in from.iter_mut().zip(l.shape()).rev() {
                    *slot = flat % d;
                    flat /= d;
                }
                from
            });
            Some(out)
        }
        5 => {
            let lead = usize::from(input.below(3));
            let mut shape: Vec<usize> = (0..lead).map(|_| usize::from(input.below(4))).collect();
            for &d in l.shape() {
                shape.push(match input.u8() {
                    0..=199 => d,
                    200..=239 if d == 1 => usize::from(input.below(5)),
                    _ => usize::from(input.below(5)),
                });
            }
            if input.u8() < 8 {
                shape.pop();
            }
            let out = l.broadcast_to(&shape).ok()?;
            let lead = shape.len() - ndim;
            check_view(l, &out, itemsize, |idx| {
                (0..ndim)
                    .map(|j| if l.shape()[j] == 1 { 0 } else { idx[j + lead] })
                    .collect()
            });
            Some(out)
        }
        6 => {
            let axis = usize::from(input.below(8));
            let out = l.expand_dims(axis).ok()?;
            assert_eq!(out.shape()[axis], 1);
            check_view(l, &out, itemsize, |idx| {
                let mut from = idx.to_vec();
                from.remove(axis);
                from
            });
            Some(out)
        }
        7 => {
            let _ = l.byte_range(pick_itemsize(input));
            None
        }
        _ => Some(l.with_byte_offset(match input.u8() {
            0..=239 => usize::from(input.u16()),
            _ => input.u64() as usize,
        })),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let ndim = match input.u8() {
        b @ 0..=239 => usize::from(b % 7),
        b => usize::from(b - 240) + 60,
    };
    let shape: Vec<usize> = (0..ndim).map(|_| input.extent() as usize).collect();
    let strides: Vec<isize> = (0..ndim).map(|_| input.stride() as isize).collect();
    let byte_offset = match input.u8() {
        0..=199 => usize::from(input.u16() % 256),
        200..=239 => usize::from(input.u16()),
        _ => input.u64() as usize,
    };
    let itemsize = pick_itemsize(&mut input);
    let Ok(mut l) = Layout::new(&shape, &strides, byte_offset) else {
        return;
    };
    check(&l, itemsize);
    for _ in 0..16 {
        if input.is_empty() {
            break;
        }
        if let Some(next) = step(&mut input, &l, itemsize) {
            check(&next, itemsize);
            l = next;
        }
    }
});
