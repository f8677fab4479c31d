//! Views and copies, checked against a plain-index-arithmetic reference model, on every device.
//!
//! The randomized tests use a tiny deterministic xorshift generator (fixed seeds, so a failure
//! reproduces), build chains of view operations on a tensor and on a [`Model`] side by side, and
//! compare every result. The model knows nothing of strides: it is the list of source elements a
//! view selects, in row-major order.

mod common;

use common::devices::{Dev, device_tests};
use common::{Rng, raw_bytes};
use dlbridge::{DType, Device, Error, Layout, SliceArg, Tensor};

// The view chains and the copies run on every device: `cpu::`, `cuda::`, `metal::` (see
// tests/common/devices.rs); the typed host access below is the CPU's.
device_tests! {
    all: [
        random_view_chains_match_the_reference,
        copy_from_into_strided_destinations,
        random_copy_from_matches_the_reference,
        overlapping_copies_go_through_a_temporary,
        strided_views_copy_to_compact_memory,
        copies_between_storage_modes_and_into_windows,
    ],
}

// ---------------------------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------------------------

/// Every multi-index of `shape` in row-major order.
fn indices(shape: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = shape.iter().product();
    (0..n)
        .map(|mut flat| {
            let mut idx = vec![0; shape.len()];
            for (i, &d) in idx.iter_mut().zip(shape).rev() {
                *i = flat % d;
                flat /= d;
            }
            idx
        })
        .collect()
}

/// The row-major position of `idx` in `shape`.
fn flat(shape: &[usize], idx: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// Python's `range(len)[start:stop:step]`, written out directly.
fn py_slice(len: usize, start: Option<isize>, stop: Option<isize>, step: isize) -> Vec<usize> {
    let n = len as isize;
    let norm = |i: isize| if i < 0 { i + n } else { i };
    let mut out = vec![];
    if step > 0 {
        let mut i = start.map_or(0, |s| norm(s).clamp(0, n));
        let end = stop.map_or(n, |e| norm(e).clamp(0, n));
        while i < end {
            out.push(i as usize);
            i += step;
        }
    } else {
        let mut i = start.map_or(n - 1, |s| norm(s).clamp(-1, n - 1));
        let end = stop.map_or(-1, |e| norm(e).clamp(-1, n - 1));
        while i > end {
            out.push(i as usize);
            i += step;
        }
    }
    out
}

/// A view as the list of source elements (row-major positions in the original compact tensor) it
/// selects, in its own row-major order.
#[derive(Clone, Debug)]
struct Model {
    shape: Vec<usize>,
    src: Vec<usize>,
}

impl Model {
    fn identity(shape: &[usize]) -> Model {
        Model {
            shape: shape.to_vec(),
            src: (0..shape.iter().product()).collect(),
        }
    }

    /// The view of `shape` whose element at `idx` is this view's element at `from(idx)`.
    fn map(&self, shape: Vec<usize>, from: impl Fn(&[usize]) -> Vec<usize>) -> Model {
        let src = indices(&shape)
            .iter()
            .map(|idx| self.src[flat(&self.shape, &from(idx))])
            .collect();
        Model { shape, src }
    }

    fn slice(&self, axis: usize, picked: &[usize]) -> Model {
        let mut shape = self.shape.clone();
        shape[axis] = picked.len();
        self.map(shape, |idx| {
            let mut from = idx.to_vec();
            from[axis] = picked[idx[axis]];
            from
        })
    }

    fn index(&self, axis: usize, i: usize) -> Model {
        let mut shape = self.shape.clone();
        shape.remove(axis);
        self.map(shape, |idx| {
            let mut from = idx.to_vec();
            from.insert(axis, i);
            from
        })
    }

    fn permute(&self, axes: &[usize]) -> Model {
        let shape = axes.iter().map(|&a| self.shape[a]).collect();
        self.map(shape, |idx| {
            let mut from = vec![0; idx.len()];
            for (k, &a) in axes.iter().enumerate() {
                from[a] = idx[k];
            }
            from
        })
    }

    fn expand_dims(&self, axis: usize) -> Model {
        let mut shape = self.shape.clone();
        shape.insert(axis, 1);
        self.map(shape, |idx| {
            let mut from = idx.to_vec();
            from.remove(axis);
            from
        })
    }

    fn broadcast_to(&self, shape: &[usize]) -> Model {
        let lead = shape.len() - self.shape.len();
        self.map(shape.to_vec(), |idx| {
            (0..self.shape.len())
                .map(|j| if self.shape[j] == 1 { 0 } else { idx[j + lead] })
                .collect()
        })
    }

    fn reshape(&self, shape: &[usize]) -> Model {
        Model {
            shape: shape.to_vec(),
            src: self.src.clone(),
        }
    }

    fn values(&self, data: &[i32]) -> Vec<i32> {
        self.src.iter().map(|&i| data[i]).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Random view chains
// ---------------------------------------------------------------------------------------------

fn random_slice_arg(rng: &mut Rng) -> SliceArg {
    let bound = |rng: &mut Rng| (!rng.chance(3)).then(|| rng.between(-7, 7));
    let start = bound(rng);
    let stop = bound(rng);
    let step = [-3, -2, -1, 1, 1, 2, 3][rng.below(7)];
    SliceArg { start, stop, step }
}

/// A random axis of `ndim`, counted from either end.
fn random_axis(rng: &mut Rng, ndim: usize) -> (isize, usize) {
    let axis = rng.below(ndim);
    if rng.chance(2) {
        (axis as isize - ndim as isize, axis)
    } else {
        (axis as isize, axis)
    }
}

/// A random shape of `numel` elements for `reshape`, possibly with one extent left to infer.
fn random_reshape(rng: &mut Rng, numel: usize) -> Vec<Option<usize>> {
    let mut dims = vec![];
    if numel == 0 {
        let n = 1 + rng.below(3);
        dims = (0..n).map(|_| rng.below(4)).collect();
        let zero = rng.below(n);
        dims[zero] = 0;
        return dims.into_iter().map(Some).collect();
    }
    let mut rest = numel;
    while rest > 1 && dims.len() < 4 {
        let divisors: Vec<usize> = (2..=rest).filter(|d| rest % d == 0).collect();
        let d = divisors[rng.below(divisors.len())];
        dims.push(d);
        rest /= d;
    }
    if rest > 1 {
        dims.push(rest);
    }
    for _ in 0..rng.below(3) {
        let at = rng.below(dims.len() + 1);
        dims.insert(at, 1);
    }
    let p = rng.permutation(dims.len());
    let mut out: Vec<Option<usize>> = p.iter().map(|&i| Some(dims[i])).collect();
    if !out.is_empty() && rng.chance(3) {
        let at = rng.below(out.len());
        out[at] = None;
    }
    out
}

/// Applies one random view operation (or a random invalid one, checking its error) to `t` and
/// `m`. `broadcast` allows `broadcast_to` (not for views that will be written to). Returns a
/// description for failure messages.
fn random_op(rng: &mut Rng, t: &mut Tensor, m: &mut Model, broadcast: bool) -> String {
    let ndim = t.ndim();
    let kinds = if broadcast { 8 } else { 7 };
    match rng.below(kinds) {
        0 | 1 if ndim == 0 => {
            let err = t.slice(0, SliceArg::FULL).unwrap_err();
            assert!(
                matches!(err, Error::OutOfBounds(_)),
                "slice of 0-d: {err:?}"
            );
            "slice of 0-d (refused)".into()
        }
        0 => {
            let (axis, a) = random_axis(rng, ndim);
            let arg = random_slice_arg(rng);
            *t = t.slice(axis, arg).unwrap();
            let picked = py_slice(m.shape[a], arg.start, arg.stop, arg.step);
            *m = m.slice(a, &picked);
            format!("slice({axis}, {arg:?})")
        }
        1 => {
            let (axis, a) = random_axis(rng, ndim);
            let len = m.shape[a];
            if len == 0 || rng.chance(6) {
                let bad = if rng.chance(2) {
                    len as isize
                } else {
                    -(len as isize) - 1
                };
                let err = t.index(axis, bad).unwrap_err();
                assert!(matches!(err, Error::OutOfBounds(_)), "index {bad}: {err:?}");
                return format!("index({axis}, {bad}) (refused)");
            }
            let i = rng.below(len);
            let arg = if rng.chance(2) {
                i as isize
            } else {
                i as isize - len as isize
            };
            *t = t.index(axis, arg).unwrap();
            *m = m.index(a, i);
            format!("index({axis}, {arg})")
        }
        2 => {
            let axes = rng.permutation(ndim);
            if ndim > 1 && rng.chance(6) {
                let mut bad = axes.clone();
                bad[0] = bad[1];
                let err = t.permute(&bad).unwrap_err();
                assert!(matches!(err, Error::Shape(_)), "permute {bad:?}: {err:?}");
                return format!("permute({bad:?}) (refused)");
            }
            *t = t.permute(&axes).unwrap();
            *m = m.permute(&axes);
            format!("permute({axes:?})")
        }
        3 => {
            *t = t.transpose().unwrap();
            let axes: Vec<usize> = (0..ndim).rev().collect();
            *m = m.permute(&axes);
            "transpose".into()
        }
        4 => {
            let axis = rng.below(ndim + 1);
            *t = t.expand_dims(axis).unwrap();
            *m = m.expand_dims(axis);
            format!("expand_dims({axis})")
        }
        5 | 6 => {
            let numel = t.numel();
            let shape = random_reshape(rng, numel);
            match t.reshape(&shape) {
                Ok(r) => {
                    assert_eq!(r.numel(), numel, "reshape {shape:?}");
                    for (got, want) in r.shape().iter().zip(&shape) {
                        if let Some(want) = want {
                            assert_eq!(got, want, "reshape {shape:?} gave {:?}", r.shape());
                        }
                    }
                    *m = m.reshape(r.shape());
                    *t = r;
                    format!("reshape({shape:?})")
                }
                Err(err) => {
                    assert!(matches!(err, Error::Shape(_)), "reshape {shape:?}: {err:?}");
                    assert!(
                        !t.is_contiguous(),
                        "a contiguous view must reshape to {shape:?}: {err:?}"
                    );
                    // The same reshape of a compact copy always works.
                    let c = t.copy().unwrap().reshape(&shape).unwrap();
                    assert_eq!(c.to_vec::<i32>().unwrap(), t.to_vec::<i32>().unwrap());
                    format!("reshape({shape:?}) (needs a copy)")
                }
            }
        }
        _ => {
            // Broadcast: stretch extents of 1 (possibly to 0), maybe add leading axes.
            let mut target: Vec<usize> = m
                .shape
                .iter()
                .map(|&d| if d == 1 { rng.below(4) } else { d })
                .collect();
            for _ in 0..rng.below(3) {
                target.insert(0, rng.below(4));
            }
            if let Some(k) = (0..ndim)
                .find(|&k| m.shape[k] > 1)
                .filter(|_| rng.chance(5))
            {
                let mut bad = target.clone();
                bad[target.len() - ndim + k] += 1;
                let err = t.broadcast_to(&bad).unwrap_err();
                assert!(matches!(err, Error::Shape(_)), "broadcast {bad:?}: {err:?}");
                return format!("broadcast_to({bad:?}) (refused)");
            }
            *t = t.broadcast_to(&target).unwrap();
            *m = m.broadcast_to(&target);
            format!("broadcast_to({target:?})")
        }
    }
}

/// Checks a view against its model: shape, values (`to_vec`, `copy`, `as_slice`), and the byte
/// address of every element computed from the view's own layout.
fn check(t: &Tensor, m: &Model, data: &[i32], original: &Tensor, trace: &[String]) {
    let expected = m.values(data);
    assert_eq!(t.shape(), &m.shape[..], "shape after {trace:?}");
    assert!(
        t.buffer().same_allocation(original.buffer()),
        "a view, not a copy: {trace:?}"
    );
    assert_eq!(
        t.to_vec::<i32>().unwrap(),
        expected,
        "to_vec after {trace:?}"
    );

    // The layout addresses exactly the model's source elements (the original is compact).
    for (idx, &src) in indices(&m.shape).iter().zip(&m.src) {
        let offset: isize = idx
            .iter()
            .zip(t.strides())
            .map(|(&i, &s)| i as isize * s)
            .sum();
        let byte = t.byte_offset() as isize + 4 * offset;
        assert_eq!(byte, 4 * src as isize, "address of {idx:?} after {trace:?}");
    }

    let c = t.copy().unwrap();
    assert!(c.is_contiguous());
    assert_eq!(c.device(), t.device());
    assert!(!c.buffer().same_allocation(original.buffer()));
    assert_eq!(c.shape(), t.shape());
    assert_eq!(c.to_vec::<i32>().unwrap(), expected, "copy after {trace:?}");

    // Host access (the CPU's; Metal's is tested in metal.rs).
    if t.device() != Device::CPU {
        return;
    }
    assert_eq!(
        c.as_slice::<i32>().unwrap(),
        &expected[..],
        "copy after {trace:?}"
    );
    if t.is_contiguous() {
        assert_eq!(
            t.as_slice::<i32>().unwrap(),
            &expected[..],
            "as_slice after {trace:?}"
        );
    } else {
        assert!(
            matches!(t.as_slice::<i32>(), Err(Error::Shape(_))),
            "{trace:?}"
        );
    }
}

/// Random chains of slice / index / permute / transpose / expand_dims / broadcast_to / reshape on
/// random shapes (0-4 dims, extents 0-5) agree with the reference model at every step, and copy
/// (on the device, and to the host) to the model's values.
fn random_view_chains_match_the_reference(dev: &Dev) {
    let mut rng = Rng::new(0xD1B2);
    for trial in 0..1500 {
        let shape = rng.shape(4, 5);
        let n: usize = shape.iter().product();
        let data: Vec<i32> = (0..n as i32).map(|i| 1000 + i * 3).collect();
        let original = dev.put(&Tensor::from_slice(&data, &shape).unwrap());
        let mut t = original.clone();
        let mut m = Model::identity(&shape);
        let mut trace = vec![format!("trial {trial}: shape {shape:?}")];
        check(&t, &m, &data, &original, &trace);
        for _ in 0..rng.below(7) {
            trace.push(random_op(&mut rng, &mut t, &mut m, true));
            check(&t, &m, &data, &original, &trace);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// copy_from
// ---------------------------------------------------------------------------------------------

// The copy bodies run on every device (`device_tests!`, at the top): sources and destinations
// live on the device under test, in each of its storage modes.

/// `n` floats `-7, -6.5, ...`.
fn iota_f32(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 0.5 - 7.0).collect()
}

/// The whole buffer of `t` as a compact `shape` view (to see the elements a view left alone).
fn whole(t: &Tensor, shape: &[usize]) -> Tensor {
    Tensor::new(
        t.buffer().clone(),
        t.dtype(),
        Layout::contiguous(shape).unwrap(),
    )
    .unwrap()
}

/// Writing every other column and reversed rows of a destination leaves the other elements alone.
fn copy_from_into_strided_destinations(dev: &Dev) {
    let on = |values: &[i32], shape: &[usize]| dev.put(&Tensor::from_slice(values, shape).unwrap());
    // Every other column of a 3x6 zero matrix.
    let base = Tensor::zeros(&[3, 6], DType::I32, dev.device).unwrap();
    let mut cols = base
        .slice(
            1,
            SliceArg {
                start: None,
                stop: None,
                step: 2,
            },
        )
        .unwrap();
    let src = on(&[1, 2, 3, 4, 5, 6, 7, 8, 9], &[3, 3]);
    // The base still shares the buffer, so the safe copy refuses.
    assert!(matches!(
        cols.copy_from(&src),
        Err(Error::Aliased { count: 2 })
    ));
    drop(base);
    cols.copy_from(&src).unwrap();
    assert_eq!(
        whole(&cols, &[3, 6]).to_vec::<i32>().unwrap(),
        vec![1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 8, 0, 9, 0]
    );

    // Reversed rows, from a broadcast row source.
    let rev = SliceArg {
        start: None,
        stop: None,
        step: -1,
    };
    let mut rows = Tensor::zeros(&[3, 2], DType::I32, dev.device)
        .unwrap()
        .slice(0, rev)
        .unwrap();
    rows.copy_from(&on(&[7, 8], &[2])).unwrap();
    assert_eq!(rows.to_vec::<i32>().unwrap(), vec![7, 8, 7, 8, 7, 8]);
    rows.copy_from(&on(&[1, 2, 3], &[3, 1])).unwrap();
    assert_eq!(rows.to_vec::<i32>().unwrap(), vec![1, 1, 2, 2, 3, 3]);
    // Shapes that do not broadcast, and other dtypes, are refused.
    assert!(matches!(
        rows.copy_from(&on(&[1, 2, 3], &[3])),
        Err(Error::Shape(_))
    ));
    let floats = dev.put(&Tensor::from_slice(&[1.0f32, 2.0], &[2]).unwrap());
    assert!(matches!(
        rows.copy_from(&floats),
        Err(Error::DTypeMismatch(_))
    ));
    assert_eq!(
        whole(&rows, &[3, 2]).to_vec::<i32>().unwrap(),
        vec![3, 3, 2, 2, 1, 1]
    );

    // A compact source into every other column, backwards, of a wider destination, from each
    // storage mode (Metal's strided copy kernel writes through the destination's strides).
    for mode in dev.storage_modes() {
        let mut dst = Tensor::zeros(&[4, 10], DType::F32, dev.device)
            .unwrap()
            .slice(
                1,
                SliceArg {
                    start: Some(9),
                    stop: None,
                    step: -2,
                },
            )
            .unwrap();
        let src = dev.put_in(&Tensor::from_slice(&iota_f32(20), &[4, 5]).unwrap(), mode);
        dst.copy_from(&src).unwrap();
        let got = whole(&dst, &[4, 10]).to_vec::<f32>().unwrap();
        for r in 0..4 {
            for c in 0..5 {
                assert_eq!(got[r * 10 + 9 - 2 * c], iota_f32(20)[r * 5 + c], "{mode:?}");
                assert_eq!(got[r * 10 + 8 - 2 * c], 0.0, "{mode:?}");
            }
        }
    }
}

/// Random strided destinations (chains without broadcasts) receive random, sometimes broadcast,
/// sources: exactly the destination's elements change, to the right values.
fn random_copy_from_matches_the_reference(dev: &Dev) {
    let mut rng = Rng::new(0xC0F7);
    for trial in 0..800 {
        let shape = rng.shape(4, 5);
        let n: usize = shape.iter().product();
        let initial: Vec<i32> = (0..n as i32).map(|i| -1 - i).collect();
        let mut dst = dev.put(&Tensor::from_slice(&initial, &shape).unwrap());
        let mut m = Model::identity(&shape);
        let mut trace = vec![format!("trial {trial}: shape {shape:?}")];
        for _ in 0..rng.below(5) {
            trace.push(random_op(&mut rng, &mut dst, &mut m, false));
        }
        // Every intermediate view is gone: `dst` holds the only reference.
        assert_eq!(dst.buffer().ref_count(), 1);

        // A source of the destination's shape, or one that broadcasts to it.
        let src_shape: Vec<usize> = if rng.chance(3) {
            let skip = rng.below(m.shape.len() + 1);
            m.shape[skip..]
                .iter()
                .map(|&d| if rng.chance(2) { 1 } else { d })
                .collect()
        } else {
            m.shape.clone()
        };
        let src_n: usize = src_shape.iter().product();
        let src_values: Vec<i32> = (0..src_n).map(|_| rng.below(1 << 20) as i32).collect();
        let src = dev.put(&Tensor::from_slice(&src_values, &src_shape).unwrap());
        trace.push(format!("copy_from {src_shape:?}"));
        dst.copy_from(&src).unwrap();

        let source = Model::identity(&src_shape).broadcast_to(&m.shape);
        let mut expected = initial.clone();
        for (k, &at) in m.src.iter().enumerate() {
            expected[at] = src_values[source.src[k]];
        }
        assert_eq!(
            dst.to_vec::<i32>().unwrap(),
            source.values(&src_values),
            "{trace:?}"
        );
        assert_eq!(
            whole(&dst, &shape).to_vec::<i32>().unwrap(),
            expected,
            "{trace:?}"
        );
    }
}

/// Copying between overlapping views of one buffer behaves as if through a temporary, in every
/// storage mode.
fn overlapping_copies_go_through_a_temporary(dev: &Dev) {
    for mode in dev.storage_modes() {
        let put = |data: &[i32], shape: &[usize]| {
            dev.put_in(&Tensor::from_slice(data, shape).unwrap(), mode)
        };
        let data: Vec<i32> = (0..10).collect();
        let run = |dst: SliceArg, src: SliceArg| -> Vec<i32> {
            let t = put(&data, &[10]);
            let d = t.slice(0, dst).unwrap();
            let s = t.slice(0, src).unwrap();
            // SAFETY: no slice into the buffer is alive and no other thread touches it.
            unsafe { d.copy_from_unchecked(&s) }.unwrap();
            t.to_vec::<i32>().unwrap()
        };
        let reference = |dst: SliceArg, src: SliceArg| -> Vec<i32> {
            let mut out = data.clone();
            let d = py_slice(10, dst.start, dst.stop, dst.step);
            let s = py_slice(10, src.start, src.stop, src.step);
            let staged: Vec<i32> = s.iter().map(|&i| data[i]).collect();
            for (&i, v) in d.iter().zip(staged) {
                out[i] = v;
            }
            out
        };
        let shift_right = (SliceArg::range(2, 10), SliceArg::range(0, 8));
        let shift_left = (SliceArg::range(0, 8), SliceArg::range(2, 10));
        assert_eq!(
            run(shift_right.0, shift_right.1),
            vec![0, 1, 0, 1, 2, 3, 4, 5, 6, 7],
            "{mode:?}"
        );
        assert_eq!(
            run(shift_left.0, shift_left.1),
            vec![2, 3, 4, 5, 6, 7, 8, 9, 8, 9],
            "{mode:?}"
        );

        // Random overlapping pairs, any steps.
        let mut rng = Rng::new(0x0E1A);
        for _ in 0..500 {
            let (dst, src) = (random_slice_arg(&mut rng), random_slice_arg(&mut rng));
            let count = |a: SliceArg| py_slice(10, a.start, a.stop, a.step).len();
            if count(dst) != count(src) {
                continue;
            }
            assert_eq!(
                run(dst, src),
                reference(dst, src),
                "{mode:?}: {dst:?} <- {src:?}"
            );
        }

        // A longer shift within one buffer: the source is read before it is overwritten.
        let long: Vec<i32> = (0..64).collect();
        let t = put(&long, &[64]);
        let src = t.slice(0, SliceArg::range(0, 48)).unwrap();
        let dst = t.slice(0, SliceArg::range(8, 56)).unwrap();
        // SAFETY: no host reference into the buffer exists.
        unsafe { dst.copy_from_unchecked(&src) }.unwrap();
        drop((src, dst));
        let got = t.to_vec::<i32>().unwrap();
        assert_eq!(&got[..8], &long[..8], "{mode:?}");
        assert_eq!(&got[8..56], &long[..48], "{mode:?}");
        assert_eq!(&got[56..], &long[56..], "{mode:?}");

        // A square matrix copied from its own transpose ends up transposed.
        let m = put(&(0..9).collect::<Vec<i32>>(), &[3, 3]);
        let mt = m.transpose().unwrap();
        // SAFETY: no slice into the buffer is alive and no other thread touches it.
        unsafe { m.copy_from_unchecked(&mt) }.unwrap();
        assert_eq!(
            m.to_vec::<i32>().unwrap(),
            vec![0, 3, 6, 1, 4, 7, 2, 5, 8],
            "{mode:?}"
        );
    }
}

/// The bytes of `view`, a view of a compact host tensor whose bytes are `base`, gathered in
/// row-major order by index arithmetic from its shape, strides and byte offset (a reference that
/// shares nothing with the copiers).
fn gathered(view: &Tensor, base: &[u8]) -> Vec<u8> {
    let size = view.dtype().itemsize() as isize;
    let mut out = Vec::with_capacity(view.nbytes());
    for idx in indices(view.shape()) {
        let element: isize = idx
            .iter()
            .zip(view.strides())
            .map(|(&i, &s)| i as isize * s)
            .sum();
        let at = (view.byte_offset() as isize + element * size) as usize;
        out.extend_from_slice(&base[at..at + size as usize]);
    }
    out
}

/// Transposed, permuted, reversed-and-strided, indexed and broadcast views of 1- to 16-byte
/// elements, in each storage mode, copied to compact memory in each storage mode on the device:
/// the bytes the view addresses, in row-major order.
fn strided_views_copy_to_compact_memory(dev: &Dev) {
    let shape = [5usize, 6, 7];
    let n: usize = shape.iter().product();
    let host_f32 = Tensor::from_slice(&iota_f32(n), &shape).unwrap();
    let host_u8 = Tensor::from_slice(&(0..n).map(|i| i as u8).collect::<Vec<_>>(), &shape).unwrap();
    let host_f64 = Tensor::from_slice(
        &(0..n).map(|i| i as f64 * -1.25).collect::<Vec<_>>(),
        &shape,
    )
    .unwrap();
    let host_f16 = host_f32.cast(DType::F16).unwrap();
    let host_c128 = host_f64.cast(DType::C128).unwrap();
    let views = |t: &Tensor| -> Vec<Tensor> {
        vec![
            t.transpose().unwrap(),
            t.permute(&[1, 0, 2]).unwrap(),
            t.slice(
                1,
                SliceArg {
                    start: Some(5),
                    stop: None,
                    step: -2,
                },
            )
            .unwrap(),
            t.slice(
                2,
                SliceArg {
                    start: Some(1),
                    stop: Some(6),
                    step: 3,
                },
            )
            .unwrap()
            .index(0, 2)
            .unwrap(),
            t.index(2, 4)
                .unwrap()
                .expand_dims(0)
                .unwrap()
                .broadcast_to(&[3, 5, 6])
                .unwrap(),
        ]
    };
    for host in [&host_f32, &host_u8, &host_f64, &host_f16, &host_c128] {
        let base = raw_bytes(host);
        for mode in dev.storage_modes() {
            let on_dev = dev.put_in(host, mode);
            for (dev_view, host_view) in views(&on_dev).into_iter().zip(views(host)) {
                let want = gathered(&host_view, &base);
                for to in dev.storage_modes() {
                    let compact = dev_view.copy_to_storage(dev.device, to).unwrap();
                    assert_eq!(compact.device(), dev.device);
                    assert!(compact.is_contiguous());
                    assert_eq!(
                        raw_bytes(&compact),
                        want,
                        "{} {mode:?} -> {to:?} {dev_view:?}",
                        host.dtype()
                    );
                }
            }
        }
    }
}

/// Compact copies between the device's storage modes land in new memory; a contiguous window of
/// one buffer copies into the middle of another, leaving the rest alone; mismatched shapes are
/// refused.
fn copies_between_storage_modes_and_into_windows(dev: &Dev) {
    let data = iota_f32(3 * 1024 + 5);
    let host = Tensor::from_slice(&data, &[data.len()]).unwrap();
    for from in dev.storage_modes() {
        let src = dev.put_in(&host, from);
        for to in dev.storage_modes() {
            let copy = src.copy_to_storage(dev.device, to).unwrap();
            assert_ne!(copy.buffer().handle(), src.buffer().handle());
            assert_eq!(copy.to_vec::<f32>().unwrap(), data, "{from:?} -> {to:?}");
            // Host-visible memory holds the values once the device is idle.
            if copy.buffer().host_ptr().is_some() {
                dlbridge::backend::synchronize(dev.device).unwrap();
                assert_eq!(copy.as_slice::<f32>().unwrap(), data.as_slice());
            }
        }
        // Buffer to buffer at offsets: a contiguous slice of one buffer into the middle of
        // another.
        let mut dst = Tensor::zeros(&[100], DType::F32, dev.device).unwrap();
        let part = src.slice(0, SliceArg::range(7, 57)).unwrap();
        let window = dst.slice(0, SliceArg::range(20, 70)).unwrap();
        // SAFETY: no host reference into `dst` is alive.
        unsafe { window.copy_from_unchecked(&part) }.unwrap();
        drop(window);
        let got = dst.to_vec::<f32>().unwrap();
        assert!(got[..20].iter().all(|&x| x == 0.0), "{from:?}");
        assert_eq!(&got[20..70], &data[7..57], "{from:?}");
        assert!(got[70..].iter().all(|&x| x == 0.0), "{from:?}");
        assert!(
            matches!(dst.copy_from(&part), Err(Error::Shape(_))),
            "shape mismatch"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Typed host access
// ---------------------------------------------------------------------------------------------

/// Mutable access needs the only reference: any clone or view makes it `Aliased`.
#[test]
fn as_mut_slice_refuses_shared_buffers() {
    let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let clone = t.clone();
    assert!(matches!(
        t.as_mut_slice::<f32>(),
        Err(Error::Aliased { count: 2 })
    ));
    let view = clone.slice(0, SliceArg::range(1, 2)).unwrap();
    assert!(matches!(
        t.as_mut_slice::<f32>(),
        Err(Error::Aliased { count: 3 })
    ));
    drop(clone);
    drop(view);
    t.as_mut_slice::<f32>().unwrap()[0] = 10.0;
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![10.0, 2.0, 3.0]);
    // Wrong dtype is refused even when unshared.
    assert!(matches!(
        t.as_mut_slice::<i32>(),
        Err(Error::DTypeMismatch(_))
    ));
}

/// `slice_view` starts its byte offset at the view's first element (not the buffer's start) and
/// refuses out-of-range, misaligned and non-contiguous requests.
#[test]
fn slice_view_honours_the_byte_offset() {
    let t = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0], &[6]).unwrap();
    let base = t.as_slice::<f32>().unwrap().as_ptr();
    let v = t.slice_view(8, 4).unwrap();
    assert_eq!(v.as_slice::<f32>().unwrap(), &[2.0, 3.0, 4.0, 5.0]);
    assert_eq!(v.as_slice::<f32>().unwrap().as_ptr(), base.wrapping_add(2));
    assert_eq!(v.byte_offset(), 8);

    // From a view that already starts one element in: bytes 8.. of it are elements 3..
    let tail = t.slice(0, SliceArg::range(1, 6)).unwrap();
    assert_eq!(
        tail.slice_view(8, 2).unwrap().to_vec::<f32>().unwrap(),
        vec![3.0, 4.0]
    );
    // The whole rest, and an empty view at the very end.
    assert_eq!(
        tail.slice_view(0, 5).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 2.0, 3.0, 4.0, 5.0]
    );
    assert_eq!(tail.slice_view(20, 0).unwrap().numel(), 0);
    // A 2-d contiguous view flattens.
    let m = t.reshape(&[Some(2), Some(3)]).unwrap();
    assert_eq!(
        m.slice_view(4, 4).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 2.0, 3.0, 4.0]
    );

    assert!(matches!(t.slice_view(8, 5), Err(Error::OutOfBounds(_))));
    assert!(matches!(tail.slice_view(8, 4), Err(Error::OutOfBounds(_))));
    assert!(matches!(t.slice_view(28, 0), Err(Error::OutOfBounds(_))));
    assert!(matches!(t.slice_view(2, 1), Err(Error::Misaligned(_))));
    assert!(matches!(
        t.slice_view(0, usize::MAX),
        Err(Error::Overflow(_))
    ));
    assert!(matches!(
        m.transpose().unwrap().slice_view(0, 1),
        Err(Error::Shape(_))
    ));
}

/// `as_slice` needs a contiguous view of the right dtype, and honours the view's offset.
#[test]
fn as_slice_refuses_strided_views_and_wrong_dtypes() {
    let t = Tensor::from_slice(&[0i32, 1, 2, 3, 4, 5], &[2, 3]).unwrap();
    assert!(matches!(
        t.transpose().unwrap().as_slice::<i32>(),
        Err(Error::Shape(_))
    ));
    let every_other = t
        .reshape(&[Some(6)])
        .unwrap()
        .slice(
            0,
            SliceArg {
                start: None,
                stop: None,
                step: 2,
            },
        )
        .unwrap();
    assert!(matches!(
        every_other.as_slice::<i32>(),
        Err(Error::Shape(_))
    ));
    assert!(matches!(t.as_slice::<f32>(), Err(Error::DTypeMismatch(_))));
    assert!(matches!(t.as_slice::<u32>(), Err(Error::DTypeMismatch(_))));
    assert!(matches!(t.to_vec::<i64>(), Err(Error::DTypeMismatch(_))));

    // A contiguous row in the middle of the buffer.
    let row = t.index(0, 1).unwrap();
    assert_eq!(row.as_slice::<i32>().unwrap(), &[3, 4, 5]);
    assert_eq!(
        row.as_slice::<i32>().unwrap().as_ptr(),
        t.as_slice::<i32>().unwrap().as_ptr().wrapping_add(3)
    );
    // Extents of 1 with odd strides are still contiguous.
    let col = t
        .slice(1, SliceArg::range(1, 2))
        .unwrap()
        .index(0, 0)
        .unwrap();
    assert_eq!(col.as_slice::<i32>().unwrap(), &[1]);
}

/// Slicing or indexing a zero-size tensor along an axis of nonzero extent gives an empty view
/// (NumPy: `np.zeros((0, 5))[:, 4:]` and `[:, 4]` have shapes (0, 1) and (0,)).
#[test]
fn views_of_empty_tensors_along_nonempty_axes() {
    let t = Tensor::zeros(&[0, 5], DType::F32, Device::CPU).unwrap();
    let s = t.slice(1, SliceArg::range(4, 5)).unwrap();
    assert_eq!(s.shape(), &[0, 1]);
    assert_eq!(s.to_vec::<f32>().unwrap(), Vec::<f32>::new());
    let i = t.index(1, 4).unwrap();
    assert_eq!(i.shape(), &[0]);
    assert_eq!(i.to_vec::<f32>().unwrap(), Vec::<f32>::new());
}
