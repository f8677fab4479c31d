//! The CPU backend: aligned host allocations and strided copies.
//!
//! # Alignment
//! Every allocation is aligned to at least [`MIN_ALIGN`] (64 bytes: a cache line, and the widest
//! SIMD load on x86-64). Allocations of at least [`PAGE_ALIGN_THRESHOLD`] bytes are aligned to the
//! OS page size (from `sysconf`, 16 KiB on Apple Silicon) and their length is rounded up to whole
//! pages, so that the same memory can later be wrapped without a copy by APIs that demand whole
//! pages (`newBufferWithBytesNoCopy` on Metal, `cudaHostRegister`, `mmap`-style remapping).
//!
//! # Pooling
//! Allocations come from one caching [`Pool`] ([`pool`]) over [`HostAllocator`]: block sizes are
//! rounded as [`crate::pool`] describes and then padded to the alignment rules above, and a freed
//! block is reused by the next request of its size. The cache is limited to
//! [`DEFAULT_CACHE_LIMIT`] unless [`Pool::set_cache_limit`] says otherwise.

pub(crate) mod cast;
pub(crate) mod compute;
mod hooks;
pub(crate) mod workers;

use std::alloc::Layout as AllocLayout;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use crate::backend::plan::copy_axes;
use crate::buffer::{Allocation, Buffer, StorageMode};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::pool::{Pool, RawAllocator, StreamKey};
use crate::tensor::Tensor;

pub(crate) use hooks::Cpu;

/// The smallest alignment of any CPU allocation, in bytes.
pub const MIN_ALIGN: usize = 64;

/// Allocations of at least this many bytes are page-aligned and padded to whole pages.
pub const PAGE_ALIGN_THRESHOLD: usize = 64 * 1024;

/// The machine's physical memory plus swap in bytes, read once: no single host allocation can be
/// larger and still be used. `usize::MAX` where it cannot be read.
pub(crate) fn host_memory_bytes() -> usize {
    static TOTAL: OnceLock<usize> = OnceLock::new();
    *TOTAL.get_or_init(|| {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: an all-zero `sysinfo` is a valid value of this plain C struct.
            let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
            // SAFETY: `info` is a valid, writable `sysinfo`.
            if unsafe { libc::sysinfo(&mut info) } == 0 {
                let unit = u64::from(info.mem_unit.max(1));
                let total = (info.totalram as u64)
                    .saturating_add(info.totalswap as u64)
                    .saturating_mul(unit);
                return usize::try_from(total).unwrap_or(usize::MAX);
            }
        }
        #[cfg(not(target_os = "linux"))]
        {
            // SAFETY: sysconf has no preconditions; it returns -1 on error, handled below.
            let (pages, size) = unsafe {
                (
                    libc::sysconf(libc::_SC_PHYS_PAGES),
                    libc::sysconf(libc::_SC_PAGESIZE),
                )
            };
            if pages > 0 && size > 0 {
                // Physical memory only: swap is not in sysconf; macOS grows its swap as needed,
                // so this is a bound below what the allocator could hand out, doubled for that.
                return (pages as usize)
                    .saturating_mul(size as usize)
                    .saturating_mul(2);
            }
        }
        usize::MAX
    })
}

pub use crate::host::page_size;

/// The alignment and padded length an allocation of `bytes` gets.
pub(crate) fn allocation_layout(bytes: usize) -> Result<AllocLayout> {
    let (align, len) = if bytes >= PAGE_ALIGN_THRESHOLD {
        let page = page_size();
        let len = bytes
            .checked_next_multiple_of(page)
            .ok_or_else(|| crate::error::overflow("page-rounded allocation size"))?;
        (page, len)
    } else {
        (MIN_ALIGN, bytes)
    };
    AllocLayout::from_size_align(len, align).map_err(|_| Error::OutOfMemory {
        bytes,
        device: Device::CPU,
        detail: ": the size exceeds what the allocator can describe".into(),
    })
}

/// The driver of the CPU pool: the global allocator, with the alignment the module documentation
/// describes.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostAllocator;

impl RawAllocator for HostAllocator {
    fn round_size(&self, bytes: usize) -> Option<usize> {
        if bytes < PAGE_ALIGN_THRESHOLD {
            // Below the threshold a block is exactly its size, as `allocation_layout` would say;
            // this skips building (and checking) a `Layout` on every pooled allocation.
            return Some(bytes);
        }
        allocation_layout(bytes).ok().map(|layout| layout.size())
    }

    fn allocate(&self, bytes: usize, zeroed: bool) -> Result<NonNull<c_void>> {
        let layout = allocation_layout(bytes)?;
        if layout.size() == 0 {
            return Err(Error::InvalidArgument(
                "the host allocator has no zero-byte blocks".into(),
            ));
        }
        if layout.size() > host_memory_bytes() {
            // Refused whatever the kernel's overcommit policy: under `vm.overcommit_memory=1`
            // the system allocator hands out any size, and the first writes then exhaust the
            // machine (or hang filling it) instead of failing here.
            return Err(Error::OutOfMemory {
                bytes,
                device: Device::CPU,
                detail: format!(
                    ": more than this machine's {} bytes of memory and swap",
                    host_memory_bytes()
                ),
            });
        }
        let raw = if zeroed {
            // SAFETY: the layout has a non-zero size.
            unsafe { std::alloc::alloc_zeroed(layout) }
        } else {
            // SAFETY: the layout has a non-zero size.
            unsafe { std::alloc::alloc(layout) }
        };
        NonNull::new(raw.cast::<c_void>()).ok_or_else(|| Error::OutOfMemory {
            bytes,
            device: Device::CPU,
            detail: ": the system allocator refused".into(),
        })
    }

    unsafe fn free(&self, ptr: NonNull<c_void>, bytes: usize) {
        // `allocate` succeeded with this size, so the layout exists and is the one it used.
        if let Ok(layout) = allocation_layout(bytes) {
            // SAFETY: by the caller's contract `ptr` came from `allocate(bytes)`, that is from
            // `alloc`/`alloc_zeroed` with exactly `layout`, and is freed once.
            unsafe { std::alloc::dealloc(ptr.as_ptr().cast::<u8>(), layout) };
        }
    }

    unsafe fn zero(
        &self,
        ptr: NonNull<c_void>,
        bytes: usize,
        _stream: Option<StreamKey>,
    ) -> Result<()> {
        // SAFETY: by the caller's contract `ptr` addresses at least `bytes` host bytes of a live
        // block that nothing else accesses during the fill.
        unsafe { ptr.cast::<u8>().write_bytes(0, bytes) };
        Ok(())
    }
}

/// The default [cache limit](Pool::set_cache_limit) of the CPU pool: 1 GiB. Host memory is
/// rarely refused outright (the system overcommits and swaps instead), so an unbounded cache
/// could hold on to memory the rest of the process needs.
pub const DEFAULT_CACHE_LIMIT: usize = 1 << 30;

/// The pool every CPU allocation comes from (made on first use).
pub fn pool() -> &'static Arc<Pool> {
    static POOL: OnceLock<Arc<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let pool = Pool::new(Device::CPU, StorageMode::Shared, HostAllocator);
        // The constant is far below `pool::MAX_LIMIT`, so this cannot fail.
        let _ = pool.set_cache_limit(Some(DEFAULT_CACHE_LIMIT));
        pool
    })
}

/// A zero-byte allocation: no memory, nothing to return.
struct NoMemory;

impl Allocation for NoMemory {}

/// Allocates `bytes` of host memory (zero-filled when `zeroed`) from the CPU [`pool`], aligned as
/// the module documentation says. Zero bytes take no memory and do not touch the pool.
#[inline]
pub fn allocate(bytes: usize, zeroed: bool) -> Result<Buffer> {
    if bytes == 0 {
        // A well-aligned, non-NULL address that is never dereferenced (there are no bytes).
        let ptr = std::ptr::without_provenance_mut::<u8>(MIN_ALIGN);
        // SAFETY: zero bytes at a non-NULL address are trivially valid for as long as anyone
        // likes; nothing is ever read or written through it.
        return Ok(unsafe {
            Buffer::from_allocation(
                ptr.cast::<c_void>(),
                ptr,
                0,
                Device::CPU,
                StorageMode::Shared,
                Box::new(NoMemory),
            )
        });
    }
    let block = pool().allocate_static(bytes, None, zeroed)?;
    let ptr = block.as_ptr();
    // SAFETY: the block addresses at least `bytes` host bytes (`block_size() >= len()`) that the
    // host may read and write, and it stays allocated until the boxed block is dropped.
    Ok(unsafe {
        Buffer::from_pooled(
            ptr.as_ptr(),
            ptr.as_ptr().cast::<u8>(),
            bytes,
            Device::CPU,
            StorageMode::Shared,
            block,
        )
    })
}

/// Copies between two views of host memory of one shape and dtype: the CPU's copy, and that of
/// every backend whose memory the host addresses.
///
/// # Safety
/// As [`Tensor::copy_from_unchecked`](crate::Tensor::copy_from_unchecked).
pub(crate) unsafe fn copy_host(dst: &Tensor, src: &Tensor) -> Result<()> {
    let dst_base = dst.buffer().require_host("copying into it")?;
    let src_base = src.buffer().require_host("copying from it")?;
    // Inside each live allocation: both views were bounds-checked when they were built.
    let src_first = src_base.as_ptr().wrapping_add(src.byte_offset());
    let dst_first = dst_base.as_ptr().wrapping_add(dst.byte_offset());
    // SAFETY: every element address of each layout lies inside its live allocation; the
    // caller guarantees the byte ranges are disjoint and that no reference into the
    // destination bytes is alive.
    unsafe {
        copy_strided(
            src_first,
            src.strides(),
            dst_first,
            dst.strides(),
            dst.shape(),
            dst.dtype().itemsize(),
        )
    };
    Ok(())
}

/// Copies `shape` elements of `itemsize` bytes from a strided source to a strided destination.
///
/// Strides are in elements; `src`/`dst` point at element `[0, 0, ...]`.
///
/// # Safety
/// Every element address the two layouts produce must be valid for reads (`src`) and writes
/// (`dst`) of `itemsize` bytes, and the two sets of addressed bytes must not overlap. Both stride
/// lists have `shape`'s length (else nothing is copied).
pub(crate) unsafe fn copy_strided(
    src: *const u8,
    src_strides: &[isize],
    dst: *mut u8,
    dst_strides: &[isize],
    shape: &[usize],
    itemsize: usize,
) {
    if shape.contains(&0) {
        return;
    }
    // Element strides (one unit per element), merged; a rank mismatch breaks the contract and
    // copies nothing.
    let Ok(axes) = copy_axes(shape, src_strides, dst_strides, 1) else {
        return;
    };
    let size = itemsize as isize;
    // Extents and byte strides, as the loops below use them.
    let axes: Vec<(usize, isize, isize)> = axes
        .iter()
        .map(|a| {
            (
                a.extent as usize,
                a.src as isize * size,
                a.dst as isize * size,
            )
        })
        .collect();
    let Some((&(len, inner_src, inner_dst), outer)) = axes.split_last() else {
        // SAFETY: one element; the caller guarantees both addresses are valid and disjoint.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, itemsize) };
        return;
    };
    let contiguous_inner = inner_src == size && inner_dst == size;
    let mut index = vec![0usize; outer.len()];
    let (mut s, mut d) = (src, dst);
    loop {
        if contiguous_inner {
            // SAFETY: the inner run is `len` contiguous elements on both sides, all valid
            // and disjoint by the caller's guarantee.
            unsafe { std::ptr::copy_nonoverlapping(s, d, len * itemsize) };
        } else {
            // SAFETY: each address is one the layouts produce, valid and disjoint by contract.
            unsafe { copy_run(s, inner_src, d, inner_dst, len, itemsize) };
        }
        // Advance the outer index like an odometer.
        let mut k = outer.len();
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            index[k] += 1;
            let (n, step_src, step_dst) = outer[k];
            s = s.wrapping_offset(step_src);
            d = d.wrapping_offset(step_dst);
            if index[k] < n {
                break;
            }
            s = s.wrapping_offset(-step_src * n as isize);
            d = d.wrapping_offset(-step_dst * n as isize);
            index[k] = 0;
        }
    }
}

/// Copies `n` elements with byte strides `ss`/`ds`.
///
/// # Safety
/// As [`copy_strided`], for the `n` addresses on each side.
#[inline]
unsafe fn copy_run(s: *const u8, ss: isize, d: *mut u8, ds: isize, n: usize, itemsize: usize) {
    macro_rules! run {
        ($t:ty) => {{
            for i in 0..n as isize {
                let from = s.wrapping_offset(i * ss).cast::<$t>();
                let to = d.wrapping_offset(i * ds).cast::<$t>();
                // SAFETY: an address the source layout produces; unaligned, because foreign
                // layouts only guarantee byte alignment.
                let v = unsafe { from.read_unaligned() };
                // SAFETY: as above, for the destination.
                unsafe { to.write_unaligned(v) };
            }
        }};
    }
    match itemsize {
        1 => run!(u8),
        2 => run!(u16),
        4 => run!(u32),
        8 => run!(u64),
        16 => run!(u128),
        _ => {
            for i in 0..n as isize {
                let (from, to) = (s.wrapping_offset(i * ss), d.wrapping_offset(i * ds));
                // SAFETY: as above, `itemsize` bytes at each address.
                unsafe { std::ptr::copy_nonoverlapping(from, to, itemsize) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_rules() {
        let small = allocation_layout(100).unwrap();
        assert_eq!(small.align(), MIN_ALIGN);
        let large = allocation_layout(PAGE_ALIGN_THRESHOLD + 1).unwrap();
        assert_eq!(large.align(), page_size());
        assert_eq!(large.size() % page_size(), 0);
        for bytes in [0, 1, 63, 4096, PAGE_ALIGN_THRESHOLD, 3 << 20] {
            let b = allocate(bytes, true).unwrap();
            let addr = b.host_ptr().unwrap().as_ptr() as usize;
            assert_eq!(addr % MIN_ALIGN, 0);
            if bytes >= PAGE_ALIGN_THRESHOLD {
                assert_eq!(addr % page_size(), 0);
            }
            assert_eq!(b.len(), bytes);
        }
        assert!(matches!(
            allocate(usize::MAX - 10, false),
            Err(Error::OutOfMemory { .. }) | Err(Error::Overflow(_))
        ));
    }

    #[test]
    fn zeroed_allocations_are_zero() {
        let b = allocate(1 << 20, true).unwrap();
        // SAFETY: the buffer holds 1 MiB of initialised (zeroed) host memory.
        let bytes = unsafe { std::slice::from_raw_parts(b.host_ptr().unwrap().as_ptr(), b.len()) };
        assert!(bytes.iter().all(|&x| x == 0));
    }
}
