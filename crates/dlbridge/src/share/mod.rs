//! Arrays across processes without copies: shareable memory, a small handle that describes a view
//! of it, and the opening of a handle in another process.
//!
//! | memory | kind | handle carries | lives while |
//! | --- | --- | --- | --- |
//! | host (`cpu`), pinned (`cuda_host:N`) | [`SharedKind::HostFile`] | a descriptor of an anonymous shared file (`memfd_create`) | any process maps it |
//! | CUDA device memory of dlbridge's shareable pool, or opened from such a handle (shared on as the same memory) | [`SharedKind::CudaVmm`] | a POSIX descriptor of a VMM allocation (`cuMemExportToShareableHandle`) | any process maps it |
//! | other CUDA device memory (dlbridge's ordinary pool, a PyTorch tensor), shared with `copy` `false` | [`SharedKind::CudaIpc`] | a legacy IPC handle (`cuIpcGetMemHandle`) and a descriptor of a shared count of its consumers | **the producer process lives**; it keeps the memory out of reuse until every consumer closed it (one that never opens its handle, or crashes, holds it until the producer exits) |
//!
//! [`share`] makes a [`SharedHandle`] of a view of any layout (offset, strides): memory that is
//! not shareable is copied once into a shareable block of the same device, unless `copy` is
//! `false`, which refuses with [`Error::CopyRequired`] on the host and falls back to a legacy IPC
//! handle (no copy, the producer must stay alive) for CUDA device memory. [`open`]
//! maps the memory in the receiving process and returns a [`Tensor`] over it, which goes on to
//! any framework through DLPack without a copy.
//!
//! # Process-shareable memory
//! *Process-shareable* (or *shared*, as PyTorch's `is_shared()` says it) means memory another
//! process can map as it is: [`is_shared`]. It is not the storage mode
//! [`StorageMode::Shared`](crate::StorageMode::Shared), which says that the host and the device
//! address the same memory (every host array has it). [`share_memory`] makes memory
//! process-shareable, as PyTorch's `share_memory_()` does, and in place wherever it can:
//!
//! | memory | [`is_shared`] | what [`share_memory`] does |
//! | --- | --- | --- |
//! | host memory in a shared file: the shareable pool, a handle opened here, a block moved before | yes | nothing |
//! | a block of the CPU pool of at least [`PAGE_ALIGN_THRESHOLD`](crate::backend::cpu::PAGE_ALIGN_THRESHOLD) bytes (Linux) | no | moves it **in place**: the bytes go into a new sealed shared file mapped over the block's own addresses (`MAP_FIXED`), so every view and every export of it, made before or after, sees the shared memory at the same address |
//! | smaller CPU pool blocks (they share pages with other allocations), foreign host memory (a NumPy array's), pinned host memory outside the shareable pool, elsewhere than Linux | no | returns a compact copy in the shareable pool; the tensor given and its views and exports keep the old memory |
//! | CUDA device memory of the shareable (VMM) pool or opened from a handle | yes | nothing |
//! | other CUDA device memory the driver gives a legacy IPC handle for (`cuMemAlloc`: dlbridge's pool, PyTorch's) | yes | nothing: it is shared by a legacy IPC handle, without a copy, valid while this process lives (PyTorch's rule for CUDA tensors) |
//! | CUDA memory without legacy IPC (stream-ordered pools) | no | returns a copy in the shareable (VMM) pool |
//! | Metal, managed memory | no | refuses ([`Error::UnsupportedDevice`]) |
//!
//! A descriptor travels with [`fd::send_handle`] / [`fd::recv_handle`] (`SCM_RIGHTS` over a Unix
//! socket), where [`SharedHandle::to_bytes`] / [`SharedHandle::from_bytes`] carry the rest; or
//! the handle travels as bytes alone ([`SharedHandle::to_bytes_lent`], as `dlbridge`'s pickling
//! does): its descriptor is lent by this process's [`broker`] under a one-time ticket and claimed
//! by the receiver when it opens the handle, which must be while this process lives (and within
//! the ticket's lifetime, [`broker::ticket_ttl`]). Only the ticket's token opens it, once; the
//! [`broker`] says what that guarantees and what it does not (the boundary is the user).
//!
//! # What a consumer cannot do to the others
//! Every process a handle reaches holds a descriptor of the memory. A shared file is sealed at
//! its size (`share/cpu.rs`): no holder can shrink it under the others' mappings (which would kill
//! them with `SIGBUS`), and a received file without those seals is refused. Every mapping is
//! writable, read-only views included (read-only is a flag for the consumers that honour it), so
//! no consumer faults on a write.
//!
//! # Streams
//! A CUDA handle carries an IPC event recorded on the producer's current stream after its work on
//! the memory was queued; [`open`] makes the receiver's current stream wait for it
//! (`cuStreamWaitEvent`), without a host synchronize.
//!
//! ```
//! use dlbridge::{SliceArg, Tensor, share};
//!
//! let t = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0], &[2, 3])?;
//! let t = share::to_shareable(&t)?; // copied once into shareable memory
//! let column = t.slice(1, SliceArg::range(1, 2))?; // a view with an offset and strides
//! let handle = share::share(&column, false)?; // no copy: `t` is shareable
//! let opened = share::open(handle)?;
//! assert_eq!(opened.to_vec::<f32>()?, vec![1.0, 4.0]);
//! assert_eq!(opened.strides(), column.strides());
//! # Ok::<(), dlbridge::Error>(())
//! ```

pub mod broker;
pub(crate) mod cpu;
pub(crate) mod fd;
pub(crate) mod handle;
pub(crate) mod memfd;

use std::os::fd::OwnedFd;

/// The runs plan, which lives at the crate's root (NCCL plans with it too); named here as before.
pub use crate::runs;
pub use fd::{adopt_fd, recv_fds, recv_handle, send_fds, send_handle};
pub(crate) use handle::{BlockKey, Exported};
pub use handle::{IPC_HANDLE_BYTES, SharedHandle, SharedKind};
use handle::{already_opened, boot_id, malformed};

use crate::backend::{self, ShareRoute};
use crate::buffer::Buffer;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::tensor::Tensor;

/// How memory of `device` goes to another process, by its backend's facts.
fn route(device: Device) -> ShareRoute {
    backend::facts(device.kind()).map_or(ShareRoute::None, |f| f.sharing)
}

/// The sharing capability of `device`'s backend for a handle of device memory (`what`), refused
/// for a device whose memory is not shared so (a forged or corrupted handle).
fn device_sharing(device: Device, what: &str) -> Result<&'static dyn backend::Sharing> {
    if route(device) != ShareRoute::Device {
        return Err(Error::UnsupportedDevice(format!("{what} of {device}")));
    }
    backend::sharing(device)
}

/// A new buffer of shareable memory of `bytes` on `device` (`cpu`, `cuda_host:N` or `cuda:N`),
/// from that device's shareable pool.
pub fn allocate(device: Device, bytes: usize, zeroed: bool) -> Result<Buffer> {
    match route(device) {
        ShareRoute::HostFile { .. } => cpu::allocate(device, bytes, zeroed),
        ShareRoute::Device => backend::sharing(device)?.allocate(device, bytes, zeroed),
        ShareRoute::None => Err(Error::UnsupportedDevice(format!(
            "dlbridge has no shareable memory on {device}"
        ))),
    }
}

/// The caching pool of shareable memory on `device` (`cpu`, `cuda_host:N` or `cuda:N`): its
/// statistics and limits work as for every other pool.
pub fn pool(device: Device) -> Result<&'static std::sync::Arc<crate::pool::Pool>> {
    match route(device) {
        ShareRoute::HostFile { .. } => cpu::pool(device),
        ShareRoute::Device => backend::sharing(device)?.pool(device),
        ShareRoute::None => Err(Error::UnsupportedDevice(format!(
            "dlbridge has no shareable memory on {device}"
        ))),
    }
}

/// Lets go of the CUDA memory of `device` received from other processes that this process keeps
/// mapped after its last array went. A receiver keeps the 64 most recently received mappings of
/// at most 256 MiB in all (`DLBRIDGE_SHARE_KEEP_MIB` sets the total; `0` keeps none), so that
/// memory sent again and again maps once; while kept, the memory stays allocated even when every
/// other process has let go. [`crate::empty_cache`] calls this. Host memory is never kept.
pub fn release_kept(device: Device) {
    if route(device) == ShareRoute::Device
        && let Ok(sharing) = backend::sharing(device)
    {
        sharing.release_kept(device);
    }
}

/// Returns the cached blocks of `device`'s shareable pool to the system (memory in use is
/// untouched) and lets go of the received memory kept mapped ([`release_kept`]): what
/// [`crate::empty_cache`] does for shareable memory. Nothing for devices without one.
pub fn empty_cache(device: Device) {
    if route(device) != ShareRoute::None
        && let Ok(pool) = pool(device)
    {
        pool.clear_cache();
    }
    release_kept(device);
}

/// Whether `t`'s memory is process-shareable as it is: whether another process can map it
/// without a copy (see the module's table). Not [`StorageMode::Shared`](crate::StorageMode),
/// which every host array has.
pub fn is_shared(t: &Tensor) -> bool {
    let device = t.device();
    match route(device) {
        ShareRoute::HostFile { .. } => cpu::is_shared(t.buffer()),
        ShareRoute::Device => backend::sharing(device).is_ok_and(|s| s.is_shared(t.buffer())),
        ShareRoute::None => false,
    }
}

/// `t` in process-shareable memory, as PyTorch's `share_memory_()` puts a tensor there (see the
/// module's table): `t` itself (the same allocation) when its memory is shareable already or was
/// just moved there **in place**, which every view and export of it sees at the same address;
/// else a compact copy in the shareable pool of its device, which the caller keeps in place of
/// `t` (`t`'s other views and exports keep the old memory). Read-only-ness is kept.
///
/// A block moved in place goes back to private memory when its last buffer goes (other processes
/// keep the shared file). Writes to `t`'s memory from other threads while it moves may be lost:
/// safe Rust cannot make them (the caller holds a handle, so no `&mut` access exists); writers
/// through raw pointers (a framework's own threads) must not run meanwhile.
///
/// # Errors
/// [`Error::UnsupportedDevice`] for devices without process-shareable memory (Metal, CUDA
/// managed memory); the system's or driver's error when a file or an allocation fails.
///
/// ```
/// use dlbridge::{DType, Device, Tensor, share};
///
/// let t = Tensor::zeros(&[1 << 16], DType::F32, Device::CPU)?; // 256 KiB: whole pages
/// let view = t.slice(0, dlbridge::SliceArg::range(8, 16))?;
/// let moved = share::share_memory(&t)?;
/// assert!(moved.buffer().same_allocation(t.buffer())); // in place: the same memory, same address
/// assert!(share::is_shared(&t) && share::is_shared(&view));
///
/// let small = Tensor::from_slice(&[1.0f32, 2.0], &[2])?; // shares its pages with others
/// let copy = share::share_memory(&small)?;
/// assert!(!copy.buffer().same_allocation(small.buffer()) && share::is_shared(&copy));
/// # Ok::<(), dlbridge::Error>(())
/// ```
pub fn share_memory(t: &Tensor) -> Result<Tensor> {
    if share_memory_in_place(t)? {
        Ok(t.clone())
    } else {
        to_shareable(t)
    }
}

/// [`share_memory`] short of the copy: `true` when `t`'s memory is process-shareable now (it was
/// already, or was just moved there in place), `false` where only a copy can put it there.
///
/// # Errors
/// As [`share_memory`].
pub fn share_memory_in_place(t: &Tensor) -> Result<bool> {
    let device = t.device();
    if route(device) == ShareRoute::None {
        return Err(Error::UnsupportedDevice(format!(
            "arrays on {device} cannot be put in process-shareable memory: dlbridge shares \
             host (cpu, cuda_host) and CUDA device memory with other processes"
        )));
    }
    Ok(is_shared(t) || (device.is_cpu() && cpu::move_in_place(t.buffer())?))
}

/// A compact copy of `t` in shareable memory of its device (the copy [`share`] makes of memory
/// that is not shareable).
pub fn to_shareable(t: &Tensor) -> Result<Tensor> {
    let buffer = allocate(t.device(), t.nbytes(), false)?;
    let dst = Tensor::new(buffer, t.dtype(), Layout::contiguous(t.shape())?)?;
    // SAFETY: `dst` is new memory no one else references.
    unsafe { dst.copy_from_unchecked(t) }?;
    Ok(if t.is_read_only() {
        dst.into_read_only()
    } else {
        dst
    })
}

/// `t` itself when its memory is shareable already (the shareable pool, or memory opened from a
/// handle), else [`to_shareable`]'s copy: the array to keep when it will be shared many times,
/// so that no share copies it again.
pub fn into_shareable(t: &Tensor) -> Result<Tensor> {
    match export_allocation(t, true)? {
        Some(a) if a.kind != SharedKind::CudaIpc => Ok(t.clone()),
        _ => to_shareable(t),
    }
}

/// A handle to `t`'s memory for another process.
///
/// Shareable memory (see the module table) is shared as it is, with `t`'s offset and strides.
/// Other memory is copied once into shareable memory of the same device when `copy` is `true`.
/// When it is `false`, CUDA device memory is shared through a legacy IPC handle without a copy
/// (valid while this process lives; [`Error::CopyRequired`] where the driver refuses), and host
/// memory is refused with [`Error::CopyRequired`].
pub fn share(t: &Tensor, copy: bool) -> Result<SharedHandle> {
    let Some(allocation) = export_allocation(t, copy)? else {
        return share_copy(t, copy);
    };
    let event = record_event(t.device())?;
    let offset = allocation
        .start
        .checked_add(t.byte_offset())
        .ok_or_else(|| crate::error::overflow("shared byte offset"))?;
    allocation.into_handle(
        t.device(),
        event,
        t.dtype(),
        t.layout().with_byte_offset(offset),
        t.is_read_only(),
    )
}

/// An allocation exported for another process: how it is reached and where a buffer lies in it.
struct Allocation {
    kind: SharedKind,
    fd: OwnedFd,
    ipc: Option<[u8; IPC_HANDLE_BYTES]>,
    len: usize,
    /// Where the buffer's byte 0 lies in the allocation.
    start: usize,
    key: Option<BlockKey>,
}

impl Allocation {
    fn into_handle(
        self,
        device: Device,
        event: Option<[u8; IPC_HANDLE_BYTES]>,
        dtype: DType,
        layout: Layout,
        read_only: bool,
    ) -> Result<SharedHandle> {
        let inode = match self.kind {
            SharedKind::HostFile => memfd::inode(&self.fd)?,
            _ => 0,
        };
        Ok(SharedHandle {
            device,
            kind: self.kind,
            fd: Some(self.fd),
            ipc: self.ipc,
            event,
            alloc_len: self.len,
            dtype,
            layout,
            read_only,
            boot_id: boot_id().to_owned(),
            pid: std::process::id(),
            inode,
            origin: self.key.map_or(0, |k| k.origin),
            block: self.key.map_or(0, |k| k.block),
            ticket: None,
        })
    }
}

/// The allocation `t`'s buffer lies in, exported; `None` where the memory is not shareable and
/// `copy` allows a copy. CUDA memory outside the shareable pool goes by a legacy IPC handle when
/// `copy` is `false`.
fn export_allocation(t: &Tensor, copy: bool) -> Result<Option<Allocation>> {
    let device = t.device();
    let exported = match route(device) {
        ShareRoute::HostFile { .. } => cpu::export(t.buffer())?.map(|e| Allocation {
            kind: SharedKind::HostFile,
            fd: e.fd,
            ipc: None,
            len: e.len,
            start: e.offset,
            key: None,
        }),
        // A block of the shareable pool, or a mapping opened from another handle: the same
        // physical memory, never a copy.
        ShareRoute::Device => match backend::sharing(device)?.export(t.buffer())? {
            Some(v) => Some(Allocation {
                kind: SharedKind::CudaVmm,
                fd: v.exported.fd,
                ipc: None,
                len: v.exported.len,
                start: v.exported.offset,
                key: Some(v.key),
            }),
            // Copying is allowed: a VMM copy, which outlives its producer.
            None if copy => None,
            // No copy: the legacy handle, valid while this process lives (or the driver's
            // refusal, as `Error::CopyRequired`).
            None => {
                let e = backend::sharing(device)?.export_legacy(t.buffer())?;
                Some(Allocation {
                    kind: SharedKind::CudaIpc,
                    fd: e.users,
                    ipc: Some(e.handle),
                    len: e.len,
                    start: e.offset,
                    key: None,
                })
            }
        },
        ShareRoute::None => {
            return Err(Error::UnsupportedDevice(format!(
                "arrays on {device} cannot be shared with other processes"
            )));
        }
    };
    Ok(exported)
}

/// The IPC event a consumer on `device` waits for: recorded on the producer's current stream
/// after the work queued so far (none for plain host memory).
fn record_event(device: Device) -> Result<Option<[u8; IPC_HANDLE_BYTES]>> {
    if !backend::has_streams(device.kind()) {
        return Ok(None);
    }
    backend::sharing(device)?.record_event(device).map(Some)
}

/// [`share`] of a copy in shareable memory, or the refusal when `copy` is `false`.
fn share_copy(t: &Tensor, copy: bool) -> Result<SharedHandle> {
    if !copy {
        return Err(copy_required(t));
    }
    share(&to_shareable(t)?, false)
}

/// The refusal to share memory that is not process-shareable without a copy.
fn copy_required(t: &Tensor) -> Error {
    Error::CopyRequired(format!(
        "this array on {} is not in process-shareable memory (see is_shared); move it there \
         first with share_memory_ (in place where it can be), or share it with copy allowed to \
         copy it once",
        t.device()
    ))
}

/// Many arrays shared together (see [`share_many`]): one handle per allocation, and each array as
/// a view of one of them.
#[derive(Debug)]
pub struct SharedGroup {
    /// One handle per allocation, each a byte view of the whole allocation.
    pub handles: Vec<SharedHandle>,
    /// The arrays, in the order given, as views of `handles`.
    pub views: Vec<SharedView>,
}

/// One array of a [`SharedGroup`]: which handle's allocation it lies in, and its view there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedView {
    /// The index of the handle in [`SharedGroup::handles`].
    pub handle: usize,
    /// The element type.
    pub dtype: DType,
    /// Shape, strides and byte offset in the allocation.
    pub layout: Layout,
    /// Whether the view is read-only.
    pub read_only: bool,
}

/// Where packed arrays start: every slot of a packed block is aligned to this many bytes, enough
/// for every element type and for vector loads.
const PACK_ALIGN: usize = 256;

/// Handles to many arrays at once, for a receiver that opens them all ([`open_many`]).
///
/// Arrays already in shareable memory are shared as they are, and the views of one allocation
/// (the rows of one weight matrix, the blocks of one pool slab) share one handle. Arrays that are
/// not are copied, when `copy` is `true`, into one new shareable block per device, packed at
/// `PACK_ALIGN`-byte slots: a thousand small arrays cost one allocation, one descriptor and one
/// mapping in the receiver rather than a thousand. With `copy` `false`, host memory that is not
/// shareable is refused with [`Error::CopyRequired`] and CUDA device memory goes by legacy IPC
/// handles (one per array; valid while this process lives). Every CUDA device gets one IPC event,
/// recorded after the copies were queued on the current stream.
pub fn share_many(tensors: &[Tensor], copy: bool) -> Result<SharedGroup> {
    use std::collections::HashMap;

    // Allocations by device and address of their byte 0, so views of one share its handle.
    let mut allocations: Vec<(Device, Allocation)> = Vec::new();
    let mut by_base: HashMap<(Device, usize), usize> = HashMap::new();
    let mut views: Vec<Option<SharedView>> = vec![None; tensors.len()];
    let mut to_pack: Vec<(Device, Vec<usize>)> = Vec::new();

    for (i, t) in tensors.iter().enumerate() {
        match export_allocation(t, copy)? {
            Some(allocation) => {
                let device = t.device();
                let base = t
                    .buffer()
                    .handle()
                    .expose_provenance()
                    .wrapping_sub(allocation.start);
                let at = allocation
                    .start
                    .checked_add(t.byte_offset())
                    .ok_or_else(|| crate::error::overflow("shared byte offset"))?;
                // Legacy IPC handles each carry their own count of consumers: never merged.
                let merge = allocation.kind != SharedKind::CudaIpc;
                let handle = match by_base.get(&(device, base)) {
                    Some(&h) if merge => h, // `allocation`'s duplicate descriptor closes here
                    _ => {
                        allocations.push((device, allocation));
                        if merge {
                            by_base.insert((device, base), allocations.len() - 1);
                        }
                        allocations.len() - 1
                    }
                };
                views[i] = Some(SharedView {
                    handle,
                    dtype: t.dtype(),
                    layout: t.layout().with_byte_offset(at),
                    read_only: t.is_read_only(),
                });
            }
            None if !copy => return Err(copy_required(t)),
            None => match to_pack.iter_mut().find(|(d, _)| *d == t.device()) {
                Some((_, list)) => list.push(i),
                None => to_pack.push((t.device(), vec![i])),
            },
        }
    }

    for (device, list) in &to_pack {
        let mut slots = Vec::with_capacity(list.len());
        let mut total = 0usize;
        for &i in list {
            slots.push(total);
            let size = tensors[i].nbytes().div_ceil(PACK_ALIGN) * PACK_ALIGN;
            total = total
                .checked_add(size)
                .ok_or_else(|| crate::error::overflow("packed size"))?;
        }
        // An allocation even when every array is empty, so each view has a handle to name.
        let len = total.max(PACK_ALIGN);
        let block = allocate(*device, len, false)?;
        if matches!(route(*device), ShareRoute::HostFile { .. }) {
            cpu::prefault(&block);
        }
        let whole = Tensor::new(block.clone(), DType::U8, Layout::contiguous(&[len])?)?;
        let allocation = export_allocation(&whole, false)?.ok_or_else(|| Error::Driver {
            backend: "share",
            message: format!("a new block of shareable memory on {device} was not shareable"),
        })?;
        let start = allocation.start;
        allocations.push((*device, allocation));
        let handle = allocations.len() - 1;
        for (&i, &slot) in list.iter().zip(&slots) {
            let src = &tensors[i];
            let layout = Layout::contiguous_at(src.shape(), slot)?;
            let dst = Tensor::new(block.clone(), src.dtype(), layout)?;
            let host = match (block.host_ptr(), src.buffer().host_ptr()) {
                // Plain host memory only: pinned and managed memory may still be written by queued
                // device work, which the copy machinery waits for.
                (Some(d), Some(s))
                    if device.is_cpu()
                        && src.device().is_cpu()
                        && src.is_contiguous()
                        && !src.is_packed() =>
                {
                    Some((d, s))
                }
                _ => None,
            };
            if let Some((d, s)) = host {
                // Host memory on both sides: the bytes directly (a thousand small arrays would
                // otherwise cost a thousand trips through the copy machinery).
                // SAFETY: the offset lies inside `src`'s live host buffer.
                let from = unsafe { s.as_ptr().add(src.byte_offset()) };
                // SAFETY: the slot lies inside the new block.
                let to = unsafe { d.as_ptr().add(slot) };
                // SAFETY: `src` addresses `nbytes` compact bytes from `from`; the slot holds as
                // many and is new memory no one else references (the two cannot overlap).
                unsafe { std::ptr::copy_nonoverlapping(from, to, src.nbytes()) };
            } else {
                // SAFETY: `dst` is a slot of new memory no one else references.
                unsafe { dst.copy_from_unchecked(src) }?;
            }
            let at = start
                .checked_add(slot)
                .ok_or_else(|| crate::error::overflow("shared byte offset"))?;
            views[i] = Some(SharedView {
                handle,
                dtype: src.dtype(),
                layout: dst.layout().with_byte_offset(at),
                read_only: src.is_read_only(),
            });
        }
    }

    let mut events: HashMap<Device, Option<[u8; IPC_HANDLE_BYTES]>> = HashMap::new();
    let mut handles = Vec::with_capacity(allocations.len());
    for (device, allocation) in allocations {
        let event = match events.get(&device) {
            Some(e) => *e,
            None => *events.entry(device).or_insert(record_event(device)?),
        };
        let len = allocation.len;
        let whole = Layout::contiguous(&[len])?;
        handles.push(allocation.into_handle(device, event, DType::U8, whole, false)?);
    }
    Ok(SharedGroup {
        handles,
        views: views
            .into_iter()
            .map(|v| v.expect("every array placed"))
            .collect(),
    })
}

/// Opens a [`SharedGroup`] (in this process or another): the arrays, in their order, each over
/// the same memory as the producer's. Every handle opens once (one mapping per allocation); a
/// view that names no handle or lies outside its allocation fails with a clear error, as does
/// any handle [`open`] refuses.
pub fn open_many(group: SharedGroup) -> Result<Vec<Tensor>> {
    open_many_with(group, &broker::Wait::default())
}

/// [`open_many`], each claim of a descriptor from a producer waiting as `wait` says.
pub fn open_many_with(group: SharedGroup, wait: &broker::Wait<'_>) -> Result<Vec<Tensor>> {
    let count = group.handles.len();
    if let Some(v) = group.views.iter().find(|v| v.handle >= count) {
        return Err(malformed(format!(
            "a view names handle {} of {count}",
            v.handle
        )));
    }
    let opened = group
        .handles
        .into_iter()
        .map(|h| open_with(h, wait))
        .collect::<Result<Vec<_>>>()?;
    group
        .views
        .into_iter()
        .map(|v| {
            let t = Tensor::new(opened[v.handle].buffer().clone(), v.dtype, v.layout)?;
            Ok(if v.read_only { t.into_read_only() } else { t })
        })
        .collect()
}

/// Opens a handle from [`share`] (in this process or another): a [`Tensor`] over the same memory,
/// with the handle's dtype, shape, strides and offset. The memory stays mapped while the tensor
/// or any view of it lives. A CUDA handle makes the calling thread's current stream wait for the
/// producer's work first.
///
/// Fails with a clear error for a handle of another boot or machine, a descriptor that is not the
/// handle's file (or a shared file not sealed at its size), a device this process does not have,
/// a legacy IPC handle whose producer has exited, and for a handle received as bytes: a ticket
/// that its producer does not know (altered, forged, used already: a handle opens once) or a
/// producer that does not answer within [`broker::default_timeout`].
pub fn open(handle: SharedHandle) -> Result<Tensor> {
    open_with(handle, &broker::Wait::default())
}

/// [`open`], a claim of the handle's descriptor from its producer waiting as `wait` says.
pub fn open_with(mut handle: SharedHandle, wait: &broker::Wait<'_>) -> Result<Tensor> {
    let here = boot_id();
    if handle.boot_id != here {
        return Err(Error::InvalidArgument(format!(
            "the handle comes from another boot or machine (boot id {:?}, this one {here:?}): \
             its memory no longer exists here",
            handle.boot_id
        )));
    }
    let device = handle.device;
    let buffer = match handle.kind {
        SharedKind::HostFile => {
            let fd = handle.descriptor(wait)?;
            if memfd::inode(&fd)? != handle.inode {
                return Err(Error::InvalidArgument(
                    "the file descriptor is not the handle's shared file".into(),
                ));
            }
            cpu::map(fd, handle.alloc_len, device)?
        }
        SharedKind::CudaVmm => {
            let key = BlockKey {
                origin: handle.origin,
                block: handle.block,
            };
            if key.origin == 0 {
                return Err(malformed("a VMM handle without its allocation's key"));
            }
            // The descriptor is claimed only when this process does not map the allocation
            // already; else the ticket is redeemed (proved and ended) without it.
            let len = handle.alloc_len;
            let sharing = device_sharing(device, "a VMM handle")?;
            let buffer = sharing.import(device, &mut || handle.descriptor(wait), len, key)?;
            handle.redeem(wait)?;
            buffer
        }
        SharedKind::CudaIpc => {
            let users = handle.descriptor(wait)?;
            if handle.pid == std::process::id() {
                // The driver opens legacy handles only in other processes: here, the memory the
                // handle was made of, the view placed in it as in the allocation.
                let sharing = device_sharing(device, "a CUDA IPC handle")?;
                let (buffer, start) = sharing.open_own_legacy(users)?;
                let offset = handle
                    .layout
                    .byte_offset()
                    .checked_sub(start)
                    .ok_or_else(|| {
                        malformed("a legacy IPC view before the start of its exported buffer")
                    })?;
                handle.layout = handle.layout.with_byte_offset(offset);
                buffer
            } else {
                let ipc_handle = handle.ipc.ok_or_else(already_opened)?;
                let len = handle.alloc_len;
                device_sharing(device, "a CUDA IPC handle")?.open_legacy(
                    device,
                    &ipc_handle,
                    len,
                    users,
                )?
            }
        }
    };
    if let Some(event) = &handle.event {
        let same_process = handle.pid == std::process::id();
        backend::sharing(device)?.wait_event(device, event, same_process)?;
    }
    let t = Tensor::new(buffer, handle.dtype, handle.layout.clone())?;
    Ok(if handle.read_only {
        t.into_read_only()
    } else {
        t
    })
}
