//! Many arrays as a few contiguous byte runs, for a transport that moves bytes between two
//! processes' memory (NCCL's send and receive, an RDMA write) rather than sharing it.
//!
//! A transport that posts one operation per array pays its fixed cost a thousand times for a
//! thousand small arrays. [`plan`] sorts the arrays' byte spans by address and merges those that
//! overlap or touch, and those separated by a small gap inside one mapped region (one driver
//! allocation, such as a pool slab), into **runs**: a thousand arrays carved from one slab travel
//! as one run. Each array becomes a [`RunView`]: which run holds it and its layout relative to the
//! run's first byte. The receiver allocates one block, places the runs in it with [`place`] (each
//! at the same address phase modulo [`RUN_ALIGN`] as on the sender, so every element stays as
//! aligned as it was), receives each run at its place, and builds the views; arrays that shared
//! bytes on the sender share them on the receiver.

use std::ops::Range;

use crate::dtype::DType;
use crate::error::{Result, overflow};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// Runs keep the sender's address phase modulo this many bytes on the receiver (enough for every
/// element type and for vector loads).
pub const RUN_ALIGN: usize = 256;

/// The largest gap, in bytes, between two spans of one region that [`plan`] merges into one run
/// (the gap's bytes travel too).
#[cfg_attr(not(cuda), allow(dead_code))] // NCCL's
pub(crate) const MAX_GAP: usize = 64 << 10;

/// One contiguous range of the sender's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// The address of the run's first byte in the sender's address space.
    pub start: usize,
    /// Its length in bytes (never zero).
    pub len: usize,
}

impl Run {
    /// The run's address modulo [`RUN_ALIGN`], which the receiver keeps.
    pub fn phase(&self) -> usize {
        self.start % RUN_ALIGN
    }
}

/// One array of a [`RunPlan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunView {
    /// The index of the run holding the array's bytes; `None` for an array of no elements.
    pub run: Option<usize>,
    /// The element type.
    pub dtype: DType,
    /// Shape and strides, with the byte offset of element 0 from the run's first byte (`0` for
    /// an array of no elements).
    pub layout: Layout,
    /// Whether the array was read-only.
    pub read_only: bool,
}

/// Arrays as runs of bytes (see the module's documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunPlan {
    /// The runs, by ascending address.
    pub runs: Vec<Run>,
    /// The arrays, in the order given.
    pub views: Vec<RunView>,
}

/// The runs of `tensors` (see the module's documentation). `region_of(address)` names the mapped
/// region holding `address` (for CUDA, the driver allocation); two spans separated by a gap of at
/// most `max_gap` bytes merge only where the gap is known to be mapped (inside a chain of the
/// arrays' buffers and regions that touch or overlap), and while a run carries no more gap bytes
/// than array bytes. A run never covers unmapped bytes. Spans that overlap or touch always merge.
/// Packed sub-byte arrays are refused (`Error::UnsupportedDType`).
pub fn plan(
    tensors: &[Tensor],
    max_gap: usize,
    mut region_of: impl FnMut(&Tensor, usize) -> Result<Range<usize>>,
) -> Result<RunPlan> {
    // (first byte, end, tensor index, address of element 0, start and end of its buffer), by
    // first byte.
    let mut spans = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if t.is_packed() {
            return Err(crate::Error::UnsupportedDType(format!(
                "packed sub-byte {} elements cannot travel as runs of bytes; unpack them first",
                t.dtype()
            )));
        }
        let base = t.buffer().handle().expose_provenance();
        let bytes = t.byte_range();
        if bytes.is_empty() {
            continue;
        }
        let at = |offset: usize| {
            base.checked_add(offset)
                .ok_or_else(|| overflow("an array's address"))
        };
        let (lo, hi) = (at(bytes.start)?, at(bytes.end)?);
        spans.push((lo, hi, i, at(t.byte_offset())?, base, at(t.buffer().len())?));
    }
    spans.sort_unstable_by_key(|s| s.0);

    let mut runs: Vec<Run> = Vec::new();
    let mut run_of = vec![None; tensors.len()];
    // How far the bytes from the current run's start are known to be mapped: a chain of the
    // spans' buffers and mapped regions that touch or overlap (a pool's blocks are driver
    // allocations of their own, often laid end to end). And the run's payload and gap bytes.
    let (mut covered, mut payload, mut gaps) = (0usize, 0usize, 0usize);
    for &(lo, hi, i, _, buffer_start, buffer_end) in &spans {
        let t = &tensors[i];
        // The span's mapped region, asked of `region_of` at most once (a driver call on CUDA).
        let mut span_region: Option<Range<usize>> = None;
        let joins = match runs.last() {
            None => false,
            Some(r) if lo <= r.start + r.len => true,
            Some(r) => {
                let gap = lo - (r.start + r.len);
                // A gap travels too: at most `max_gap` bytes, and never more gap than payload;
                // and only where it is known to be mapped.
                let joins = gap <= max_gap
                    && gaps + gap <= payload + (hi - lo)
                    && (lo <= covered
                        || buffer_start <= covered
                        || span_region.insert(region_of(t, lo)?).start <= covered);
                if joins {
                    gaps += gap;
                }
                joins
            }
        };
        if joins {
            let r = runs.last_mut().expect("joins a run");
            r.len = r.len.max(hi - r.start);
        } else {
            covered = 0;
            payload = 0;
            gaps = 0;
            runs.push(Run {
                start: lo,
                len: hi - lo,
            });
        }
        payload += hi - lo;
        // The span's buffer and its mapped region extend the chain (both hold `lo`, which lies
        // inside the chain or starts it).
        if buffer_end > covered {
            let region_end = match span_region {
                Some(r) => r.end,
                None => region_of(t, lo)?.end,
            };
            covered = covered.max(buffer_end).max(region_end);
        }
        run_of[i] = Some(runs.len() - 1);
    }

    let mut views = Vec::with_capacity(tensors.len());
    let mut element0 = vec![0usize; tensors.len()];
    for &(_, _, i, e0, _, _) in &spans {
        element0[i] = e0;
    }
    for (i, t) in tensors.iter().enumerate() {
        let offset = match run_of[i] {
            Some(r) => element0[i] - runs[r].start,
            None => 0,
        };
        views.push(RunView {
            run: run_of[i],
            dtype: t.dtype(),
            layout: t.layout().with_byte_offset(offset),
            read_only: t.is_read_only(),
        });
    }
    Ok(RunPlan { runs, views })
}

/// Where each run of `lens_and_phases` (a run's length and [`Run::phase`]) lies in one receiving
/// block: each at the sender's phase modulo [`RUN_ALIGN`], in order, and the block's length (at
/// least [`RUN_ALIGN`], so that even a plan of no runs has a block to view).
pub fn place(lens_and_phases: &[(usize, usize)]) -> Result<(Vec<usize>, usize)> {
    let mut offsets = Vec::with_capacity(lens_and_phases.len());
    let mut cursor = 0usize;
    for &(len, phase) in lens_and_phases {
        let phase = phase % RUN_ALIGN;
        let skip = (phase + RUN_ALIGN - cursor % RUN_ALIGN) % RUN_ALIGN;
        let at = cursor
            .checked_add(skip)
            .ok_or_else(|| overflow("the receiving block"))?;
        offsets.push(at);
        cursor = at
            .checked_add(len)
            .ok_or_else(|| overflow("the receiving block"))?;
    }
    Ok((offsets, cursor.max(RUN_ALIGN)))
}

/// The layout of `view` in a receiving block whose runs start at `offsets`.
#[cfg_attr(not(cuda), allow(dead_code))] // NCCL's
pub(crate) fn placed_layout(view: &RunView, offsets: &[usize]) -> Result<Layout> {
    let Some(run) = view.run else {
        return Ok(view.layout.with_byte_offset(0));
    };
    let start = *offsets.get(run).ok_or_else(|| {
        crate::Error::InvalidArgument(format!("a view names run {run} of {}", offsets.len()))
    })?;
    let at = start
        .checked_add(view.layout.byte_offset())
        .ok_or_else(|| overflow("a received array's offset"))?;
    Ok(view.layout.with_byte_offset(at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SliceArg;

    fn own_buffer(t: &Tensor, _addr: usize) -> Result<Range<usize>> {
        let base = t.buffer().handle().expose_provenance();
        Ok(base..base + t.buffer().len())
    }

    #[test]
    fn views_of_one_buffer_merge_and_keep_their_offsets() {
        let whole =
            Tensor::from_slice(&(0..64).map(|i| i as f32).collect::<Vec<_>>(), &[8, 8]).unwrap();
        let row1 = whole.index(0, 1).unwrap();
        let row3 = whole.index(0, 3).unwrap();
        let col = whole.index(1, 2).unwrap(); // strided, spans rows 0..8
        let empty = whole.slice(0, SliceArg::range(2, 2)).unwrap();
        let reversed = row3
            .slice(
                0,
                SliceArg {
                    start: None,
                    stop: None,
                    step: -1,
                },
            )
            .unwrap();
        let arrays = [row3.clone(), row1.clone(), col.clone(), empty, reversed];
        // Gaps inside one buffer merge: the rows are 2 rows apart, the column covers them.
        let p = plan(&arrays, MAX_GAP, own_buffer).unwrap();
        assert_eq!(p.runs.len(), 1);
        let base = whole.buffer().handle().expose_provenance();
        assert_eq!(p.runs[0].start, base + 8); // column 2 of row 0 is the first byte
        assert_eq!(p.views[3].run, None);
        // Rebuilt over a copy of the run's bytes, each view reads what it read before.
        let (offsets, total) = place(&[(p.runs[0].len, p.runs[0].phase())]).unwrap();
        assert_eq!(offsets[0] % RUN_ALIGN, p.runs[0].phase());
        let bytes = whole.host_bytes().unwrap();
        let mut block = vec![0u8; total];
        block[offsets[0]..offsets[0] + p.runs[0].len].copy_from_slice(&bytes[8..8 + p.runs[0].len]);
        let received = Tensor::from_slice(&block, &[total]).unwrap();
        for (view, original) in p.views.iter().zip(&arrays) {
            let layout = placed_layout(view, &offsets).unwrap();
            let t = Tensor::new(received.buffer().clone(), view.dtype, layout).unwrap();
            assert_eq!(t.shape(), original.shape());
            if t.numel() > 0 {
                // The receiver's block is not f32-aligned at its start on every allocator; read
                // through a copy.
                assert_eq!(
                    t.copy().unwrap().to_vec::<f32>().unwrap(),
                    original.to_vec::<f32>().unwrap()
                );
            }
        }
    }

    #[test]
    fn gaps_across_regions_or_over_the_limit_split_runs() {
        let a = Tensor::from_slice(&[1u8; 4096], &[4096]).unwrap();
        let head = a.slice(0, SliceArg::range(0, 2048)).unwrap();
        let tail = a.slice(0, SliceArg::range(3000, 4096)).unwrap();
        let runs =
            |arrays: &[Tensor], max_gap| plan(arrays, max_gap, own_buffer).unwrap().runs.len();
        // A gap of 952 bytes: merged under a 1 KiB limit, split under a 512-byte one.
        assert_eq!(runs(&[head.clone(), tail.clone()], 1024), 1);
        assert_eq!(runs(&[head.clone(), tail.clone()], 512), 2);
        // Never more gap than payload: 16 + 96 bytes across a gap of 3,984 stay two runs.
        let small_head = a.slice(0, SliceArg::range(0, 16)).unwrap();
        let small_tail = a.slice(0, SliceArg::range(4000, 4096)).unwrap();
        assert_eq!(runs(&[small_head, small_tail], usize::MAX), 2);
        // Regions of one byte each: a gap merges only inside one buffer (here, `a`'s).
        let tiny = |_: &Tensor, addr: usize| Ok(addr..addr + 1);
        assert_eq!(
            plan(&[head.clone(), tail], usize::MAX, tiny)
                .unwrap()
                .runs
                .len(),
            1
        );
        // Two buffers laid end to end (as a pool's blocks often are): the gap between a span at
        // the start of one and a span at the end of the other is mapped, so they merge; with a
        // third buffer between them missing, they do not.
        let whole = Tensor::from_slice(&[0u8; 3 * 512], &[3 * 512]).unwrap();
        let base = whole.buffer().handle().cast::<u8>();
        let part = |k: usize| {
            // SAFETY: inside `whole`'s 1,536 bytes.
            let at = unsafe { base.add(k * 512) };
            // SAFETY: a third of `whole`'s bytes, kept alive by a clone of its buffer.
            let b = unsafe {
                crate::Buffer::from_foreign(
                    at.cast(),
                    at,
                    512,
                    crate::Device::CPU,
                    crate::StorageMode::Shared,
                    false,
                    Box::new(whole.buffer().clone()),
                )
            };
            Tensor::new(b, crate::DType::U8, Layout::contiguous(&[512]).unwrap()).unwrap()
        };
        let (p0, p1, p2) = (part(0), part(1), part(2));
        let start = p0.slice(0, SliceArg::range(0, 400)).unwrap();
        let mid = p1.slice(0, SliceArg::range(100, 512)).unwrap();
        let far = p2.slice(0, SliceArg::range(100, 512)).unwrap();
        assert_eq!(
            plan(&[start.clone(), mid], MAX_GAP, tiny)
                .unwrap()
                .runs
                .len(),
            1
        );
        assert_eq!(plan(&[start, far], MAX_GAP, tiny).unwrap().runs.len(), 2);
        // Two separate buffers stay two runs unless they touch.
        let b = Tensor::from_slice(&[2u8; 64], &[64]).unwrap();
        let p = plan(&[a.clone(), b], MAX_GAP, own_buffer).unwrap();
        assert!(p.runs.len() <= 2);
        assert_eq!(
            p.views.iter().filter_map(|v| v.run).max(),
            Some(p.runs.len() - 1)
        );
    }

    #[test]
    fn packed_sub_byte_arrays_are_refused() {
        let bytes = Tensor::from_slice(&[0u8; 8], &[8]).unwrap();
        let int4: DType = "int4".parse().unwrap();
        let packed = Tensor::with_packing(
            bytes.buffer().clone(),
            int4,
            Layout::contiguous(&[16]).unwrap(),
            true,
        )
        .unwrap();
        assert!(packed.is_packed());
        let e = plan(&[bytes.clone(), packed], MAX_GAP, own_buffer).unwrap_err();
        assert!(e.to_string().contains("packed"), "{e}");
    }

    #[test]
    fn placement_keeps_phases_and_never_overlaps() {
        let (offsets, total) = place(&[(10, 3), (1, 255), (300, 0), (5, 3)]).unwrap();
        let lens = [10, 1, 300, 5];
        let phases = [3, 255, 0, 3];
        for i in 0..4 {
            assert_eq!(offsets[i] % RUN_ALIGN, phases[i]);
            if i > 0 {
                assert!(offsets[i] >= offsets[i - 1] + lens[i - 1]);
            }
        }
        assert_eq!(total, offsets[3] + 5);
        assert_eq!(place(&[]).unwrap(), (vec![], RUN_ALIGN));
        assert!(place(&[(usize::MAX, 0), (1, 0)]).is_err());
    }
}
