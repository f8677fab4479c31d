//! Page arithmetic for wrapping host memory in Metal buffers without copying
//! (`newBufferWithBytesNoCopy:length:options:deallocator:`). Platform-free and overflow-checked.
//!
//! Metal wraps host memory only in whole pages: the pointer must be page-aligned and the length a
//! multiple of the page size, and no buffer may exceed the device's `maxBufferLength`. A region that
//! starts or ends inside a page (a tensor inside an `mmap`'d file, say) is therefore widened to the
//! pages around it, and the region's start becomes a `byte_offset` into the wrapped buffer. Every
//! byte so added lies in a page the region already touches, so it is mapped memory. The page size is
//! the operating system's (16 KiB on Apple silicon, 4 KiB on Intel Macs), never assumed.
//!
//! A region larger than `maxBufferLength` is split into several buffers ("chunks"). Given the byte
//! ranges of the items that will be viewed (the tensors of a checkpoint file), the split keeps every
//! item inside one chunk; two neighbouring chunks may then share the page where one item ends and
//! the next begins.

use std::ops::Range;

use crate::error::{Error, Result, overflow};

/// A page-aligned span of the address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PageSpan {
    /// Page-aligned start address.
    pub(crate) start: usize,
    /// Length in bytes, a multiple of the page size.
    pub(crate) len: usize,
}

impl PageSpan {
    /// One past the last byte.
    pub(crate) fn end(&self) -> usize {
        self.start + self.len
    }
}

/// One Metal buffer of a wrapped region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// The pages the buffer wraps.
    pub(crate) span: PageSpan,
    /// The region bytes (relative to the region's start) that the chunk is planned to hold. With
    /// items, the union of the items placed in it; without, its share of the region.
    pub(crate) covers: Range<usize>,
}

/// The page size from the operating system's two reports (`sysconf(_SC_PAGESIZE)`, and
/// `vm_page_size` where the system has it, else 0): the larger, which is a multiple of the other.
/// Fails when neither is a usable power of two.
pub(crate) fn page_size_from(sysconf: i64, vm_page_size: usize) -> Result<usize> {
    let from_sysconf = usize::try_from(sysconf)
        .ok()
        .filter(|p| p.is_power_of_two());
    let from_vm = Some(vm_page_size).filter(|p| p.is_power_of_two());
    match (from_sysconf, from_vm) {
        (Some(a), Some(b)) => Ok(a.max(b)),
        (Some(p), None) | (None, Some(p)) => Ok(p),
        (None, None) => Err(Error::Driver {
            backend: "Metal",
            message: format!(
                "the OS reported no usable page size (sysconf: {sysconf}, vm_page_size: \
                 {vm_page_size})"
            ),
        }),
    }
}

fn check_page(page: usize) -> Result<()> {
    if page.is_power_of_two() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "page size {page} is not a power of two"
        )))
    }
}

/// The whole pages around `[addr, addr + len)`, and the offset of `addr` in them.
pub(crate) fn page_span(addr: usize, len: usize, page: usize) -> Result<(PageSpan, usize)> {
    check_page(page)?;
    let end = addr
        .checked_add(len)
        .ok_or_else(|| overflow(format!("host region {addr:#x} + {len} bytes")))?;
    let start = addr & !(page - 1);
    let end = end
        .checked_next_multiple_of(page)
        .ok_or_else(|| overflow(format!("host region end {end:#x} rounded up to a page")))?;
    Ok((
        PageSpan {
            start,
            len: end - start,
        },
        addr - start,
    ))
}

/// Checks that `addr` suits elements that need `align`-byte alignment.
pub(crate) fn check_alignment(addr: usize, align: usize) -> Result<()> {
    if align > 1 && addr % align != 0 {
        return Err(Error::Misaligned(format!(
            "host address {addr:#x} is not aligned to the {align} bytes its elements need; the \
             GPU cannot load them there"
        )));
    }
    Ok(())
}

/// Plans the Metal buffers that wrap the host region `[addr, addr + len)` without copying.
///
/// `max_len` is the device's `maxBufferLength`. Without `items` the region is split into
/// consecutive chunks; with `items` (byte ranges relative to `addr`), chunks are packed greedily in
/// address order so that each non-empty item lies wholly in one chunk (an item whose pages exceed
/// `max_len` is an error). Empty items are not planned for; [`locate`] places them.
pub(crate) fn plan_chunks(
    addr: usize,
    len: usize,
    page: usize,
    max_len: usize,
    items: &[Range<usize>],
) -> Result<Vec<Chunk>> {
    check_page(page)?;
    if len == 0 {
        return Err(Error::InvalidArgument(
            "cannot wrap an empty host region in a Metal buffer".into(),
        ));
    }
    let usable = max_len & !(page - 1);
    if usable == 0 {
        return Err(Error::InvalidArgument(format!(
            "maxBufferLength {max_len} is smaller than one {page}-byte page"
        )));
    }
    let (whole, _) = page_span(addr, len, page)?;
    for item in items {
        if item.start > item.end || item.end > len {
            return Err(Error::OutOfBounds(format!(
                "item bytes {}..{} are outside the {len}-byte host region",
                item.start, item.end
            )));
        }
    }
    if items.is_empty() {
        let mut chunks = Vec::new();
        let mut start = whole.start;
        while start < whole.end() {
            let end = start + usable.min(whole.end() - start);
            let lo = start.max(addr) - addr;
            let hi = end.min(addr + len) - addr;
            chunks.push(Chunk {
                span: PageSpan {
                    start,
                    len: end - start,
                },
                covers: lo..hi,
            });
            start = end;
        }
        return Ok(chunks);
    }
    let mut order: Vec<&Range<usize>> = items.iter().filter(|r| r.start < r.end).collect();
    order.sort_by_key(|r| (r.start, r.end));
    let mut chunks: Vec<Chunk> = Vec::new();
    for item in order {
        // Inside the region, which does not overflow (checked by `page_span` above).
        let (span, _) = page_span(addr + item.start, item.end - item.start, page)?;
        if span.len > usable {
            return Err(Error::InvalidArgument(format!(
                "item bytes {}..{} span {} bytes of pages, more than one Metal buffer may hold \
                 (maxBufferLength {max_len})",
                item.start, item.end, span.len
            )));
        }
        if let Some(last) = chunks.last_mut() {
            let end = last.span.end().max(span.end());
            if span.start >= last.span.start && end - last.span.start <= usable {
                last.span.len = end - last.span.start;
                last.covers.end = last.covers.end.max(item.end);
                continue;
            }
        }
        chunks.push(Chunk {
            span,
            covers: item.clone(),
        });
    }
    Ok(chunks)
}

/// The chunk holding region bytes `range` (relative to `addr`), and the byte offset of
/// `range.start` inside that chunk's buffer. An empty range is placed in the first chunk whose
/// pages contain its start.
pub(crate) fn locate(chunks: &[Chunk], addr: usize, range: Range<usize>) -> Option<(usize, usize)> {
    let start = addr.checked_add(range.start)?;
    let end = addr.checked_add(range.end)?;
    chunks
        .iter()
        .position(|c| {
            c.span.start <= start
                && end <= c.span.end()
                && (range.start < range.end || start < c.span.end())
        })
        .map(|i| (i, start - chunks[i].span.start))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 16 * 1024;

    #[test]
    fn page_size_prefers_the_larger_report() {
        assert_eq!(page_size_from(16384, 16384).unwrap(), 16384);
        assert_eq!(page_size_from(4096, 16384).unwrap(), 16384);
        assert_eq!(page_size_from(16384, 0).unwrap(), 16384);
        assert_eq!(page_size_from(-1, 4096).unwrap(), 4096);
        assert!(page_size_from(-1, 0).is_err());
        assert!(page_size_from(3000, 0).is_err());
    }

    #[test]
    fn spans_round_outward() {
        let base = 100 * PAGE;
        let (span, off) = page_span(base + 10, 20, PAGE).unwrap();
        assert_eq!(
            span,
            PageSpan {
                start: base,
                len: PAGE
            }
        );
        assert_eq!(off, 10);
        let (span, off) = page_span(base, PAGE, PAGE).unwrap();
        assert_eq!((span.len, off), (PAGE, 0), "an aligned page stays one page");
        let (span, off) = page_span(base + PAGE - 1, 2, PAGE).unwrap();
        assert_eq!((span.start, span.len, off), (base, 2 * PAGE, PAGE - 1));
        assert!(matches!(
            page_span(usize::MAX - 10, 20, PAGE),
            Err(Error::Overflow(_))
        ));
        assert!(matches!(
            page_span(usize::MAX - 10, 5, PAGE),
            Err(Error::Overflow(_))
        ));
        assert!(page_span(0, 1, 3000).is_err());
    }

    #[test]
    fn alignment() {
        assert!(check_alignment(0x1000, 4).is_ok());
        assert!(check_alignment(0x1003, 1).is_ok());
        let err = check_alignment(0x1002, 4).unwrap_err();
        assert!(
            matches!(err, Error::Misaligned(ref m) if m.contains("0x1002")),
            "{err}"
        );
    }

    #[test]
    fn small_region_is_one_chunk() {
        let addr = 7 * PAGE + 100;
        let chunks = plan_chunks(addr, 1000, PAGE, 1 << 30, &[]).unwrap();
        assert_eq!(chunks.len(), 1);
        assert_eq!(
            chunks[0].span,
            PageSpan {
                start: 7 * PAGE,
                len: PAGE
            }
        );
        assert_eq!(chunks[0].covers, 0..1000);
        assert_eq!(locate(&chunks, addr, 0..1000), Some((0, 100)));
        assert_eq!(locate(&chunks, addr, 10..20), Some((0, 110)));
        assert!(plan_chunks(addr, 0, PAGE, 1 << 30, &[]).is_err());
    }

    #[test]
    fn large_region_splits_without_items() {
        let addr = 3 * PAGE + 5;
        let len = 10 * PAGE;
        let chunks = plan_chunks(addr, len, PAGE, 4 * PAGE + 7, &[]).unwrap();
        // 11 pages in all (the region straddles one extra), at most 4 per chunk.
        let lens: Vec<_> = chunks.iter().map(|c| c.span.len / PAGE).collect();
        assert_eq!(lens, vec![4, 4, 3]);
        for pair in chunks.windows(2) {
            assert_eq!(
                pair[0].span.end(),
                pair[1].span.start,
                "chunks tile the pages"
            );
            assert_eq!(pair[0].covers.end, pair[1].covers.start, "and the region");
        }
        assert_eq!(chunks[0].covers.start, 0);
        assert_eq!(chunks.last().unwrap().covers.end, len);
        for c in &chunks {
            assert_eq!(c.span.start % PAGE, 0);
            assert!(c.span.len <= 4 * PAGE);
        }
        assert!(plan_chunks(addr, len, PAGE, PAGE - 1, &[]).is_err());
    }

    #[test]
    fn items_never_straddle_chunks() {
        let addr = 50 * PAGE;
        // Three 1.5-page tensors back to back, buffers of at most 4 pages.
        let t = 3 * PAGE / 2;
        let items = [0..t, t..2 * t, 2 * t..3 * t];
        let chunks = plan_chunks(addr, 3 * t, PAGE, 4 * PAGE, &items).unwrap();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].covers, 0..2 * t);
        assert_eq!(
            chunks[0].span,
            PageSpan {
                start: addr,
                len: 3 * PAGE
            }
        );
        assert_eq!(
            chunks[1].span,
            PageSpan {
                start: addr + 3 * PAGE,
                len: 2 * PAGE
            }
        );
        for item in &items {
            let (i, off) = locate(&chunks, addr, item.clone()).unwrap();
            let c = &chunks[i];
            assert!(c.span.start + off == addr + item.start);
            assert!(c.span.start + off + item.len() <= c.span.end());
        }
        // Two items that meet inside a page: the chunks share that page.
        let meet = [0..PAGE + 100, PAGE + 100..3 * PAGE];
        let shared = plan_chunks(addr, 3 * PAGE, PAGE, 2 * PAGE, &meet).unwrap();
        assert_eq!(
            shared[0].span,
            PageSpan {
                start: addr,
                len: 2 * PAGE
            }
        );
        assert_eq!(
            shared[1].span,
            PageSpan {
                start: addr + PAGE,
                len: 2 * PAGE
            }
        );
        assert_eq!(locate(&shared, addr, meet[1].clone()), Some((1, 100)));
        // Unsorted items plan the same.
        let shuffled = [items[2].clone(), items[0].clone(), items[1].clone()];
        assert_eq!(
            plan_chunks(addr, 3 * t, PAGE, 4 * PAGE, &shuffled).unwrap(),
            chunks
        );
    }

    #[test]
    fn item_checks() {
        let addr = 9 * PAGE;
        let err =
            plan_chunks(addr, 100, PAGE, 1 << 20, std::slice::from_ref(&(0..101))).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds(_)), "{err}");
        let err = plan_chunks(
            addr,
            5 * PAGE,
            PAGE,
            2 * PAGE,
            std::slice::from_ref(&(PAGE / 2..3 * PAGE)),
        )
        .unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains("maxBufferLength")),
            "{err}"
        );
        // Empty items are not planned, but can be located.
        let chunks = plan_chunks(addr, 5 * PAGE, PAGE, 2 * PAGE, &[0..10, 20..20]).unwrap();
        assert_eq!(chunks.len(), 1);
        assert_eq!(locate(&chunks, addr, 20..20), Some((0, 20)));
        assert_eq!(locate(&chunks, addr, 3 * PAGE..3 * PAGE + 1), None);
    }

    /// The engine's ranges (what it asks a backend to wrap) against the page plan: every tensor lands inside one wrapped
    /// buffer of whole pages, at its file offset from the mapping's start, also when the
    /// buffers are small enough that the file needs several.
    #[test]
    fn wrapped_ranges_fit_the_page_plan() {
        use crate::engine::wrapped_ranges;
        use crate::safetensors::SafeTensors;
        use crate::{DType, Device, Tensor};
        let big = Tensor::from_slice(&vec![0.25f32; 6000], &[6000]).unwrap();
        let small = Tensor::from_slice(&[7i64; 3], &[3]).unwrap();
        let empty = Tensor::zeros(&[0], DType::F16, Device::CPU).unwrap();
        let path = std::env::temp_dir().join(format!(
            "dlbridge-load-{}-pages.safetensors",
            std::process::id()
        ));
        crate::safetensors::save_file(
            &[
                ("big", &big),
                ("small", &small),
                ("empty", &empty),
                ("big2", &big),
            ],
            None,
            &path,
        )
        .unwrap();
        let file = SafeTensors::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let plan = file.items(|_| true).unwrap();
        let ranges = wrapped_ranges(&plan.iter().collect::<Vec<_>>());
        assert_eq!(ranges.len(), 3);
        // The plan is arithmetic on addresses: every alignment a mapping of 4 KiB pages can have
        // against 16 KiB pages is tried, since how many 16 KiB pages the file and each item touch
        // depends on it. The limit is the largest item's pages, less than the whole file's.
        let len = file.buffer().len();
        for base in (0..4).map(|k| (1usize << 32) + k * 4096) {
            let pages = |start: usize, end: usize| (end.div_ceil(PAGE) - start / PAGE) * PAGE;
            let whole = pages(base, base + len);
            let largest = ranges
                .iter()
                .map(|r| pages(base + r.start, base + r.end))
                .max()
                .unwrap();
            assert!(largest < whole, "{largest} {whole}");
            for max_len in [1 << 30, largest] {
                let chunks = plan_chunks(base, len, PAGE, max_len, &ranges).unwrap();
                assert!(max_len >= whole || chunks.len() > 1, "{chunks:?}");
                for r in &ranges {
                    let (i, offset) = locate(&chunks, base, r.clone()).unwrap();
                    let span = chunks[i].span;
                    assert_eq!(span.start % PAGE, 0);
                    assert_eq!(span.start + offset, base + r.start);
                    assert!(span.start + offset + r.len() <= span.end());
                }
            }
        }
    }
}
