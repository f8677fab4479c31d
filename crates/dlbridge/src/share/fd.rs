//! File descriptors between processes: `SCM_RIGHTS` messages over a Unix socket, and handles
//! sent and received with their descriptor.
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use dlbridge::{Tensor, share};
//!
//! let (a, b) = UnixStream::pair()?;
//! let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
//! share::send_handle(&a, share::share(&t, true)?)?;
//! let received = share::recv_handle(&b)?;
//! assert_eq!(share::open(received)?.to_vec::<f32>()?, vec![1.0, 2.0, 3.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use super::handle::SharedHandle;
use super::memfd::os_error;
use crate::error::{Error, Result};

/// The most descriptors one message carries.
pub(crate) const MAX_FDS: usize = 16;

/// The largest handle message, in bytes.
const MAX_MESSAGE: usize = 64 * 1024;

/// Takes ownership of descriptor `raw` after checking that it is open (a closed or negative
/// descriptor is an [`Error::InvalidArgument`]).
///
/// # Safety
/// If `raw` is open, the caller owns it and hands it over: nothing else may use or close it
/// afterwards.
pub unsafe fn adopt_fd(raw: RawFd) -> Result<OwnedFd> {
    if !is_open(raw) {
        return Err(Error::InvalidArgument(format!(
            "file descriptor {raw} is not open"
        )));
    }
    // SAFETY: open, and handed over by the caller's contract.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Whether `raw` is an open descriptor of this process.
fn is_open(raw: RawFd) -> bool {
    // SAFETY: F_GETFD only reads the descriptor's flags; a closed one makes it fail.
    raw >= 0 && unsafe { libc::fcntl(raw, libc::F_GETFD) } >= 0
}

/// `fd` when it is still open: a descriptor a handle owns can be closed behind its back (by
/// number, from Python's `os.close`). Such a one is let go of without closing it again (its
/// number may be another file's by now) and is an [`Error::InvalidArgument`].
pub(crate) fn still_open(fd: OwnedFd) -> Result<OwnedFd> {
    let raw = fd.as_raw_fd();
    if is_open(raw) {
        return Ok(fd);
    }
    std::mem::forget(fd);
    Err(Error::InvalidArgument(format!(
        "the handle's file descriptor {raw} was closed by someone else: the handle cannot be \
         opened"
    )))
}

/// Sends `data` and `fds` as one message (`sendmsg` with `SCM_RIGHTS`); the receiver gets new
/// descriptors of the same files.
pub fn send_fds(socket: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if fds.len() > MAX_FDS || data.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "a message carries 1 or more bytes and at most {MAX_FDS} descriptors"
        )));
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let payload = std::mem::size_of_val(raw.as_slice()) as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload) } as usize;
    let mut control = vec![0u8; space.max(1)];
    let iov = [IoSlice::new(data)];
    // SAFETY: an all-zero `msghdr` is a valid value of this plain C struct.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr().cast_mut().cast();
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` has a control buffer of CMSG_SPACE(payload) bytes, so the first header
        // exists and is writable.
        let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        // SAFETY: CMSG_LEN only computes a size.
        let len = unsafe { libc::CMSG_LEN(payload) };
        // SAFETY: an all-zero `cmsghdr` is a valid value of this plain C struct.
        let mut header: libc::cmsghdr = unsafe { std::mem::zeroed() };
        header.cmsg_level = libc::SOL_SOCKET;
        header.cmsg_type = libc::SCM_RIGHTS;
        header.cmsg_len = len as _;
        // SAFETY: `cmsg` points into `control` with room for a header, aligned by CMSG_FIRSTHDR.
        unsafe { cmsg.write(header) };
        // SAFETY: `cmsg` is the header just written inside `control`.
        let data = unsafe { libc::CMSG_DATA(cmsg) };
        // SAFETY: CMSG_DATA has room for `payload` bytes (CMSG_SPACE above); the source is the
        // `raw` vector of exactly that size. Bytes: CMSG_DATA guarantees no alignment.
        unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr().cast::<u8>(), data, payload as usize) };
    }
    // SAFETY: `msg` points at live buffers for the duration of the call.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(os_error("sendmsg"));
    }
    if sent as usize != data.len() {
        return Err(Error::Driver {
            backend: "CPU",
            message: format!("sendmsg sent {sent} of {} bytes", data.len()),
        });
    }
    Ok(())
}

/// `recvmsg` flags that mark received descriptors close-on-exec atomically, where the system has
/// one (Linux); elsewhere [`set_cloexec`] marks each one right after it arrives.
#[cfg(target_os = "linux")]
const RECV_CLOEXEC: libc::c_int = libc::MSG_CMSG_CLOEXEC;
#[cfg(not(target_os = "linux"))]
const RECV_CLOEXEC: libc::c_int = 0;

/// Marks `fd` close-on-exec.
fn set_cloexec(fd: &OwnedFd) {
    // SAFETY: F_SETFD on a descriptor this process owns changes only its close-on-exec flag.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
}

/// Receives one message of at most `buf.len()` bytes and its descriptors (closed on `exec`);
/// returns the byte count and the descriptors. Descriptors beyond what this process may open
/// are refused by the kernel: the call then fails and nothing is leaked.
///
/// Waits for a message as long as the socket's read timeout lets it
/// ([`UnixStream::set_read_timeout`]; none by default), and fails with a clear error after it;
/// a signal that interrupts the wait is retried.
pub fn recv_fds(socket: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
    recv_message(socket, buf, RECV_CLOEXEC)?.ok_or_else(|| Error::Driver {
        backend: "CPU",
        message: "no message came within the socket's read timeout".into(),
    })
}

/// [`recv_fds`] that never waits: `None` when no message is there.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))] // the descriptor lender's clients
pub(crate) fn try_recv_fds(
    socket: &UnixStream,
    buf: &mut [u8],
) -> Result<Option<(usize, Vec<OwnedFd>)>> {
    recv_message(socket, buf, RECV_CLOEXEC | libc::MSG_DONTWAIT)
}

/// One `recvmsg` with `flags` (retried when a signal interrupts it); `None` where it would block.
fn recv_message(
    socket: &UnixStream,
    buf: &mut [u8],
    flags: libc::c_int,
) -> Result<Option<(usize, Vec<OwnedFd>)>> {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero `msghdr` is a valid value of this plain C struct.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `msg` points at live, writable buffers for the duration of the call.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, flags) };
        if n >= 0 {
            break n;
        }
        let err = std::io::Error::last_os_error();
        match err.kind() {
            std::io::ErrorKind::Interrupted => {}
            std::io::ErrorKind::WouldBlock => return Ok(None),
            _ => {
                return Err(Error::Driver {
                    backend: "CPU",
                    message: format!("recvmsg failed: {err}"),
                });
            }
        }
    };
    let mut fds = Vec::new();
    // SAFETY: `msg` was filled by recvmsg; the macros walk its control buffer.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: `cmsg` is a header inside `control`, as CMSG_FIRSTHDR/CMSG_NXTHDR return.
        let header = unsafe { cmsg.read() };
        if header.cmsg_level == libc::SOL_SOCKET && header.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN(0) only computes a size.
            let empty = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = (header.cmsg_len as usize).saturating_sub(empty) / size_of::<RawFd>();
            // SAFETY: `cmsg` is a valid header; the kernel wrote `count` descriptors after it.
            let data = unsafe { libc::CMSG_DATA(cmsg) };
            for i in 0..count {
                let at = data.wrapping_add(i * size_of::<RawFd>()).cast::<RawFd>();
                // SAFETY: within the `count` descriptors the kernel wrote; unaligned because
                // CMSG_DATA guarantees no alignment.
                let raw = unsafe { at.read_unaligned() };
                // SAFETY: the kernel installed this descriptor for us; we own it alone.
                let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                if RECV_CLOEXEC == 0 {
                    set_cloexec(&fd);
                }
                fds.push(fd);
            }
        }
        // SAFETY: `cmsg` is a valid header of `msg`.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::InvalidArgument(
            "descriptors were dropped in transit: the receiver is at its descriptor limit \
             or the sender sent too many"
                .into(),
        ));
    }
    Ok(Some((n as usize, fds)))
}

/// Sends a handle (its description and its descriptor) over a Unix socket.
pub fn send_handle(socket: &UnixStream, handle: SharedHandle) -> Result<()> {
    let data = handle.to_bytes();
    if data.len() > MAX_MESSAGE {
        return Err(Error::InvalidArgument(
            "the handle is too large to send".into(),
        ));
    }
    let fds: Vec<BorrowedFd<'_>> = handle.fd().into_iter().collect();
    send_fds(socket, &data, &fds)
}

/// Receives a handle sent by [`send_handle`].
pub fn recv_handle(socket: &UnixStream) -> Result<SharedHandle> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let (n, mut fds) = recv_fds(socket, &mut buf)?;
    if fds.len() > 1 {
        return Err(Error::InvalidArgument(format!(
            "a handle message carries at most one descriptor, this one {}",
            fds.len()
        )));
    }
    SharedHandle::from_bytes(&buf[..n], fds.pop())
}
