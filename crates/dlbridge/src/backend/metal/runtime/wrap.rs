//! Host pages wrapped in Metal buffers without a copy (`newBufferWithBytesNoCopy:...`).

use std::any::Any;
use std::ffi::c_void;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use block2::RcBlock;
use objc2_metal::MTLDevice;

use super::buffer::resource_options;
use super::context;
use super::context::ResidencyGuard;
use super::objc::{MetalBuffer, driver};
use crate::backend::metal::HostRegion;
use crate::backend::metal::pages::plan_chunks;
use crate::buffer::{Buffer, StorageMode};
use crate::device::Device;
use crate::error::Result;

/// What a wrapped chunk keeps alive on dlbridge's side: the `id<MTLBuffer>` and its residency
/// registration. (The host memory's owner is held by the buffer's deallocator, which Metal calls
/// when it releases the buffer, i.e. after the GPU work that used it has completed.)
struct NoCopyBuffer {
    _buffer: MetalBuffer,
    _residency: Option<ResidencyGuard>,
}

/// See [`crate::backend::metal::wrap_host`].
///
/// # Safety
/// As there.
pub(crate) unsafe fn wrap_host(
    device: Device,
    addr: *const u8,
    len: usize,
    items: &[Range<usize>],
    read_only: bool,
    keep_alive: Arc<dyn Any + Send + Sync>,
) -> Result<HostRegion> {
    let context = context(device)?;
    let info = context.info();
    let base = addr as usize;
    let chunks = plan_chunks(base, len, info.page_size, info.max_buffer_length, items)?;
    let mut wrapped = Vec::with_capacity(chunks.len());
    for chunk in chunks {
        // The chunk's first page, derived from `addr` so that it keeps its provenance.
        let start = addr
            .cast_mut()
            .wrapping_byte_offset(chunk.span.start as isize - base as isize);
        let pointer = NonNull::new(start.cast::<c_void>())
            .ok_or_else(|| driver("cannot wrap host page 0 (NULL) in a Metal buffer"))?;
        let owner = Mutex::new(Some(Arc::clone(&keep_alive)));
        let deallocator = RcBlock::new(move |_: NonNull<c_void>, _: usize| {
            // Metal is done with the pages: let the owner go.
            let taken = owner.lock().map(|mut o| o.take()).unwrap_or(None);
            drop(taken);
        });
        // SAFETY: `pointer` is page-aligned and `chunk.span.len` a multiple of the page size
        // (`plan_chunks`); every page of the span is touched by the region, hence mapped, and the
        // caller keeps it mapped while `keep_alive` lives, which the deallocator holds until Metal
        // releases the buffer; the block captures only `Send` state, as Metal may call it on any
        // thread.
        let buffer = unsafe {
            context
                .device()
                .newBufferWithBytesNoCopy_length_options_deallocator(
                    pointer,
                    chunk.span.len,
                    resource_options(StorageMode::Shared),
                    Some(&deallocator),
                )
        }
        .ok_or_else(|| {
            driver(format!(
                "Metal refused to wrap host pages {:#x}..{:#x} without a copy",
                chunk.span.start,
                chunk.span.end()
            ))
        })?;
        let buffer = MetalBuffer(buffer);
        let residency = context.register(&buffer);
        let handle = buffer.handle();
        let keep = NoCopyBuffer {
            _buffer: buffer,
            _residency: residency,
        };
        // SAFETY: `handle` is the new `id<MTLBuffer>` over exactly the span's pages, retained by
        // `keep`; `start` addresses the same pages from the host, which stay mapped (see above)
        // while the buffer lives; they are writable unless `read_only`, as the caller promised.
        let buffer = unsafe {
            Buffer::from_foreign(
                handle,
                start,
                chunk.span.len,
                device,
                StorageMode::Shared,
                read_only,
                Box::new(keep),
            )
        };
        wrapped.push((chunk, buffer));
    }
    Ok(HostRegion::new(base, len, wrapped))
}
