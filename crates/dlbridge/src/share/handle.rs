//! The handle of shared memory as plain data: what travels to another process ([`SharedHandle`],
//! its byte format) and what a backend's sharing capability exchanges with `share/` (the
//! exported allocations, the key of a VMM allocation). Nothing here names a backend.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use super::{broker, fd};
use crate::device::{Device, DeviceKind};
use crate::dtype::{DType, DTypeCode};
use crate::error::{Error, Result};
use crate::layout::Layout;

/// How the memory of a [`SharedHandle`] is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedKind {
    /// An anonymous shared file holding host memory (`cpu`, or pinned `cuda_host:N`).
    HostFile,
    /// A CUDA VMM allocation exported as a POSIX file descriptor.
    CudaVmm,
    /// A CUDA legacy IPC memory handle; valid only while the producer process lives.
    CudaIpc,
}

impl SharedKind {
    /// The name used in handles' descriptions (`host_file`, `cuda_vmm`, `cuda_ipc`).
    pub const fn name(self) -> &'static str {
        match self {
            SharedKind::HostFile => "host_file",
            SharedKind::CudaVmm => "cuda_vmm",
            SharedKind::CudaIpc => "cuda_ipc",
        }
    }

    const fn to_raw(self) -> u8 {
        match self {
            SharedKind::HostFile => 1,
            SharedKind::CudaVmm => 2,
            SharedKind::CudaIpc => 3,
        }
    }

    fn from_raw(raw: u8) -> Result<Self> {
        match raw {
            1 => Ok(SharedKind::HostFile),
            2 => Ok(SharedKind::CudaVmm),
            3 => Ok(SharedKind::CudaIpc),
            _ => Err(malformed(format!("unknown memory kind {raw}"))),
        }
    }
}

/// The size of a CUDA IPC memory or event handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// A view of shareable memory, as another process needs it to map the memory: device, kind,
/// allocation (a file descriptor, or an IPC handle), the allocation's size, the view's element
/// type, shape, strides (in elements) and byte offset, read-only-ness, and where it came from.
///
/// Every handle owns one descriptor: the memory's, or for a legacy IPC handle the count of its
/// consumers (which tells the producer when the memory may be reused). [`open`](super::open) consumes the
/// handle, so a handle opens once.
#[derive(Debug)]
pub struct SharedHandle {
    pub(super) device: Device,
    pub(super) kind: SharedKind,
    pub(super) fd: Option<OwnedFd>,
    pub(super) ipc: Option<[u8; IPC_HANDLE_BYTES]>,
    pub(super) event: Option<[u8; IPC_HANDLE_BYTES]>,
    pub(super) alloc_len: usize,
    pub(super) dtype: DType,
    pub(super) layout: Layout,
    pub(super) read_only: bool,
    pub(super) boot_id: String,
    pub(super) pid: u32,
    pub(super) inode: u64,
    /// For a VMM allocation, which physical allocation it is (see [`BlockKey`]): the creating
    /// process's token and the allocation's number there; zero otherwise.
    pub(super) origin: u64,
    pub(super) block: u64,
    /// In place of `fd`: the claim on it, lent by the producer (see [`broker`]).
    pub(super) ticket: Option<broker::Ticket>,
}

/// The kernel's identifier of this boot, which tells a handle of a previous boot or another
/// machine (whose memory is gone) from one of this boot. Read once: it does not change while the
/// process lives.
pub(super) fn boot_id() -> &'static str {
    static BOOT_ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BOOT_ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    })
}

pub(super) fn malformed(why: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("not a dlbridge shared-memory handle: {why}"))
}

/// Version of the [`SharedHandle::to_bytes`] format (4: a ticket is a lender and a token; 3 also
/// carried the descriptor's number, which opened it through `/proc` without the token).
const FORMAT: u8 = 4;
const MAGIC: &[u8; 4] = b"DLSH";

impl SharedHandle {
    /// Where the memory lives.
    pub fn device(&self) -> Device {
        self.device
    }

    /// How the memory is reached.
    pub fn kind(&self) -> SharedKind {
        self.kind
    }

    /// The handle's descriptor (the memory's, or a legacy IPC handle's count of consumers);
    /// `None` for a handle received as bytes, whose descriptor is still the producer's to lend.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(AsFd::as_fd)
    }

    /// Takes the descriptor out of the handle (to send it by other means).
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fd.take()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The view's layout in the shared allocation (shape, strides, byte offset).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The size of the shared allocation in bytes.
    pub fn allocation_len(&self) -> usize {
        self.alloc_len
    }

    /// Whether the view is read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Names the device of a CUDA handle (device memory or pinned host memory) by `ordinal`: the
    /// same GPU as the receiving process numbers it, where its `CUDA_VISIBLE_DEVICES` orders GPUs
    /// differently from the producer's. Handles of other devices are left as they are.
    pub fn renumber_cuda_device(&mut self, ordinal: u32) {
        self.device = match self.device.kind() {
            DeviceKind::Cuda => Device::cuda(ordinal),
            DeviceKind::CudaHost => Device::cuda_host(ordinal),
            _ => return,
        };
    }

    /// The producer's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The handle as bytes that travel alone, by any means (a pickle, a message queue, a file
    /// read by another process of this user on this machine): a duplicate of the descriptor is
    /// lent by this process's [`broker`], and the receiver claims it when it opens the handle
    /// (or forgoes it when the handle is dropped unopened). The receiver must open it while this
    /// process lives, within the ticket's lifetime ([`broker::ticket_ttl`]). Each call lends
    /// anew; every one of them is valid once.
    pub fn to_bytes_lent(&mut self) -> Result<Vec<u8>> {
        self.to_bytes_lent_with(&broker::Wait::default())
    }

    /// [`SharedHandle::to_bytes_lent`], where a handle received as bytes first claims its
    /// descriptor from its producer within `wait`.
    pub fn to_bytes_lent_with(&mut self, wait: &broker::Wait<'_>) -> Result<Vec<u8>> {
        if self.fd.is_none() {
            // Received as bytes and not opened: its descriptor is claimed here, to be lent on.
            let fd = self.descriptor(wait)?;
            self.fd = Some(fd);
        }
        let fd = self.fd.as_ref().ok_or_else(already_opened)?;
        let dup = fd.try_clone().map_err(|e| Error::Driver {
            backend: "share",
            message: format!("dup of a shared-memory descriptor failed: {e}"),
        })?;
        let ticket = broker::lend(dup, self.tag())?;
        Ok(self.encode(Some(&ticket)))
    }

    /// Everything but the descriptor, as bytes (the descriptor travels beside it); a handle
    /// received as bytes keeps its ticket in them.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode(self.ticket.as_ref())
    }

    pub(super) fn encode(&self, ticket: Option<&broker::Ticket>) -> Vec<u8> {
        let mut w = Vec::with_capacity(256);
        w.extend_from_slice(MAGIC);
        w.push(FORMAT);
        w.push(self.kind.to_raw());
        w.extend_from_slice(&self.device.kind().to_raw().to_le_bytes());
        w.extend_from_slice(&self.device.index().to_le_bytes());
        w.push(self.dtype.code().to_raw());
        w.push(self.dtype.bits());
        w.extend_from_slice(&self.dtype.lanes().to_le_bytes());
        w.push(u8::from(self.read_only));
        w.extend_from_slice(&(self.alloc_len as u64).to_le_bytes());
        w.extend_from_slice(&(self.layout.byte_offset() as u64).to_le_bytes());
        w.extend_from_slice(&(self.layout.ndim() as u32).to_le_bytes());
        for &d in self.layout.shape() {
            w.extend_from_slice(&(d as u64).to_le_bytes());
        }
        for &s in self.layout.strides() {
            w.extend_from_slice(&(s as i64).to_le_bytes());
        }
        w.extend_from_slice(&(self.boot_id.len() as u32).to_le_bytes());
        w.extend_from_slice(self.boot_id.as_bytes());
        w.extend_from_slice(&self.pid.to_le_bytes());
        w.extend_from_slice(&self.inode.to_le_bytes());
        w.extend_from_slice(&self.origin.to_le_bytes());
        w.extend_from_slice(&self.block.to_le_bytes());
        for h in [&self.ipc, &self.event] {
            match h {
                Some(bytes) => {
                    w.push(1);
                    w.extend_from_slice(bytes);
                }
                None => w.push(0),
            }
        }
        match ticket {
            Some(t) => {
                w.push(1);
                w.push(t.lender().len() as u8);
                w.extend_from_slice(t.lender().as_bytes());
                w.extend_from_slice(&t.token().to_le_bytes());
            }
            None => w.push(0),
        }
        w
    }

    /// The handle's descriptor, taken out: its own, or the one its ticket claims from the
    /// producer (the only way a ticket opens: with its token, once).
    pub(super) fn descriptor(&mut self, wait: &broker::Wait<'_>) -> Result<OwnedFd> {
        if let Some(fd) = self.fd.take() {
            return fd::still_open(fd);
        }
        let ticket = self.ticket.take().ok_or_else(already_opened)?;
        broker::claim(&ticket, self.tag(), wait)
    }

    /// The memory this handle describes, as a number its lender and its claimer both derive from
    /// the handle's fields (FNV-1a of the kind, the file's inode, the VMM allocation's key, the
    /// IPC handle and the size): a ticket is good only for the memory it was lent for.
    pub(super) fn tag(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        eat(&[self.kind.to_raw()]);
        eat(&self.inode.to_le_bytes());
        eat(&self.origin.to_le_bytes());
        eat(&self.block.to_le_bytes());
        eat(&(self.alloc_len as u64).to_le_bytes());
        eat(self.ipc.as_ref().map_or(&[][..], |ipc| &ipc[..]));
        h
    }

    /// Ends the handle's ticket, if it still has one, with the producer's word that it was
    /// valid and unused: a handle whose memory is mapped here already needs no descriptor, but
    /// opens only as its ticket allows (once, with its token).
    pub(super) fn redeem(&mut self, wait: &broker::Wait<'_>) -> Result<()> {
        match self.ticket.take() {
            Some(ticket) => broker::redeem(&ticket, self.tag(), wait),
            None => Ok(()),
        }
    }

    /// The memory kind that [`SharedHandle::to_bytes`] bytes describe, without building the
    /// handle (to choose how its descriptor must travel).
    pub fn kind_of_bytes(bytes: &[u8]) -> Result<SharedKind> {
        Reader(bytes).header()
    }

    /// A handle from [`SharedHandle::to_bytes`] and the descriptor that travelled beside it
    /// (which the handle then owns, whatever the outcome), or from
    /// [`SharedHandle::to_bytes_lent`] alone (`fd` `None`). Fails on bytes that describe no
    /// handle, and on a missing or wrong descriptor.
    pub fn from_bytes(bytes: &[u8], fd: Option<OwnedFd>) -> Result<Self> {
        let mut r = Reader(bytes);
        let kind = r.header()?;
        let device = Device::new(DeviceKind::from_raw(r.i32()?), r.u32()?);
        let code = DTypeCode::from_raw(r.u8()?).ok_or_else(|| malformed("dtype code"))?;
        let dtype = DType::new(code, r.u8()?, r.u16()?)?;
        let read_only = r.u8()? != 0;
        let alloc_len = usize::try_from(r.u64()?).map_err(|_| malformed("allocation size"))?;
        let offset = usize::try_from(r.u64()?).map_err(|_| malformed("byte offset"))?;
        let ndim = r.u32()? as usize;
        if ndim > crate::layout::MAX_NDIM {
            return Err(malformed(format!("{ndim} dimensions")));
        }
        let shape = (0..ndim)
            .map(|_| {
                r.u64()
                    .and_then(|d| usize::try_from(d).map_err(|_| malformed("extent")))
            })
            .collect::<Result<Vec<_>>>()?;
        let strides = (0..ndim)
            .map(|_| {
                r.u64()
                    .and_then(|s| isize::try_from(s as i64).map_err(|_| malformed("stride")))
            })
            .collect::<Result<Vec<_>>>()?;
        let boot_len = r.u32()? as usize;
        let boot_id =
            String::from_utf8(r.take(boot_len)?.to_vec()).map_err(|_| malformed("boot id"))?;
        let pid = r.u32()?;
        let inode = r.u64()?;
        let origin = r.u64()?;
        let block = r.u64()?;
        let mut handles = [None, None];
        for h in &mut handles {
            if r.u8()? == 1 {
                let mut bytes = [0u8; IPC_HANDLE_BYTES];
                bytes.copy_from_slice(r.take(IPC_HANDLE_BYTES)?);
                *h = Some(bytes);
            }
        }
        let ticket = match r.u8()? {
            0 => None,
            _ => {
                let len = usize::from(r.u8()?);
                let name = String::from_utf8(r.take(len)?.to_vec())
                    .map_err(|_| malformed("lender name"))?;
                Some(broker::Ticket::new(name, r.u64()?)?)
            }
        };
        if !r.0.is_empty() {
            return Err(malformed("trailing bytes"));
        }
        let layout = Layout::new(&shape, &strides, offset)?;
        let [ipc, event] = handles;
        match (&fd, &ticket) {
            (None, None) => {
                return Err(Error::InvalidArgument(format!(
                    "a {} handle needs its file descriptor",
                    kind.name()
                )));
            }
            (Some(_), Some(_)) => {
                return Err(malformed("both a descriptor and a ticket for one"));
            }
            _ => {}
        }
        if kind == SharedKind::CudaIpc && ipc.is_none() {
            return Err(malformed("a legacy IPC handle without its IPC handle"));
        }
        Ok(SharedHandle {
            device,
            kind,
            fd,
            ipc,
            event,
            alloc_len,
            dtype,
            layout,
            read_only,
            boot_id,
            pid,
            inode,
            origin,
            block,
            ticket,
        })
    }
}

impl Drop for SharedHandle {
    /// A handle received as bytes and dropped unopened tells the producer, which closes the
    /// descriptor it kept for it.
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            broker::forgo(&ticket, self.tag());
        }
    }
}

/// A little-endian reader of [`SharedHandle::to_bytes`].
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    /// The magic, the format version and the memory kind that start every handle's bytes.
    fn header(&mut self) -> Result<SharedKind> {
        if self.take(4)? != MAGIC {
            return Err(malformed("bad magic"));
        }
        let format = self.u8()?;
        if format != FORMAT {
            return Err(malformed(format!(
                "format {format}, this dlbridge reads {FORMAT}"
            )));
        }
        SharedKind::from_raw(self.u8()?)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(malformed("truncated"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().map_err(|_| malformed("u16"))?,
        ))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().map_err(|_| malformed("u32"))?,
        ))
    }

    fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_le_bytes(
            self.take(4)?.try_into().map_err(|_| malformed("i32"))?,
        ))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().map_err(|_| malformed("u64"))?,
        ))
    }
}

/// An allocation as its exporter sees it.
pub(crate) struct Exported {
    /// A new descriptor of the allocation (a shared file, or a VMM allocation's POSIX handle).
    pub fd: OwnedFd,
    /// The allocation's size in bytes.
    pub len: usize,
    /// Where the buffer's byte 0 lies in the allocation.
    pub offset: usize,
}

/// Which physical VMM allocation a handle describes: the process that created it
/// (`process_token` of the CUDA backend) and its number there. Every process that maps the allocation, and every
/// handle re-shared from such a mapping, carries the same key, so a consumer can tell an
/// allocation it already maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BlockKey {
    /// The creating process's `process_token`.
    pub origin: u64,
    /// The allocation's number in that process.
    pub block: u64,
}

/// A VMM allocation as [`export`] gives it: the descriptor and place, and the allocation's key.
pub(crate) struct VmmExported {
    /// The descriptor, size and offset.
    pub exported: Exported,
    /// Which physical allocation it is.
    pub key: BlockKey,
}

/// CUDA memory exported through a legacy IPC handle.
pub(crate) struct LegacyExported {
    /// The `CUipcMemHandle`'s bytes.
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// The descriptor of the count of consumers still using the memory (the producer keeps the
    /// memory until it is zero).
    pub users: OwnedFd,
    /// The size of the driver's allocation the buffer lies in, in bytes.
    pub len: usize,
    /// Where the buffer's byte 0 lies in that allocation.
    pub offset: usize,
}

/// The error of a handle opened a second time.
pub(super) fn already_opened() -> Error {
    Error::InvalidArgument(
        "this handle was already opened: a handle opens once (share the array again for \
         another)"
            .into(),
    )
}
