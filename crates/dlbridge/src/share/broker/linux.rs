//! The lender and its clients on Linux: abstract Unix sockets, `SO_PEERCRED`, `/proc`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{NAME_PREFIX, Ticket};
use crate::error::{Error, Result};
use crate::share::fd::{recv_fds, send_fds};

/// The stack of a lender's connection thread: it only moves small messages.
const THREAD_STACK: usize = 64 * 1024;

/// A request: the token, then whether the descriptor is wanted (`1`, answered) or forgone (`0`,
/// not answered).
const REQUEST_BYTES: usize = 9;

/// Replies to a claim: the descriptor follows, no such ticket.
const REPLY_FD: u8 = 0;
const REPLY_UNKNOWN: u8 = 2;

/// Descriptors lent and not yet claimed, by token.
type Lent = Arc<Mutex<HashMap<u64, OwnedFd>>>;

fn lock(lent: &Lent) -> MutexGuard<'_, HashMap<u64, OwnedFd>> {
    lent.lock().unwrap_or_else(PoisonError::into_inner)
}

/// This process's lender: its name, the fork generation it was started in, and what it lends.
struct Lender {
    name: String,
    generation: u64,
    lent: Lent,
}

static LENDER: Mutex<Option<Lender>> = Mutex::new(None);

/// This process's lender, started on first use (and again in a forked child, whose parent's
/// lender thread does not exist there).
fn lender() -> Result<(String, Lent)> {
    let mut slot = LENDER.lock().unwrap_or_else(PoisonError::into_inner);
    let generation = crate::fork::generation();
    if let Some(l) = slot.as_ref().filter(|l| l.generation == generation) {
        return Ok((l.name.clone(), l.lent.clone()));
    }
    let name = format!("{NAME_PREFIX}{}/{:016x}", std::process::id(), random_u64()?);
    let listener = SocketAddr::from_abstract_name(name.as_bytes())
        .and_then(|addr| UnixListener::bind_addr(&addr))
        .map_err(|e| io_failed("binding the descriptor lender's socket", &e))?;
    let lent = Lent::default();
    let serving = lent.clone();
    std::thread::Builder::new()
        .name("dlbridge-fds".into())
        .stack_size(THREAD_STACK)
        .spawn(move || serve(listener, serving))
        .map_err(|e| io_failed("starting the descriptor lender's thread", &e))?;
    *slot = Some(Lender {
        name: name.clone(),
        generation,
        lent: lent.clone(),
    });
    Ok((name, lent))
}

/// Keeps `fd` for one claim by another process (or this one) and returns the ticket for it.
pub fn lend(fd: OwnedFd) -> Result<Ticket> {
    let (lender, lent) = lender()?;
    let mut lent = lock(&lent);
    let token = loop {
        let t = random_u64()?;
        if !lent.contains_key(&t) {
            break t;
        }
    };
    let number = fd.as_raw_fd();
    lent.insert(token, fd);
    Ok(Ticket {
        lender,
        token,
        fd: number,
    })
}

/// The descriptor lent under `ticket`, which ends. Fails with a clear error when the lender's
/// process has exited, or the ticket was claimed or forgone already.
pub fn claim(ticket: &Ticket) -> Result<OwnedFd> {
    ask(ticket, true)?.ok_or_else(|| Error::Driver {
        backend: "share",
        message: "the descriptor lender answered a claim without the descriptor".into(),
    })
}

/// Ends `ticket` without its descriptor, which the lender closes: one message, not waited for
/// (a lender that is gone has nothing left to close).
pub fn forgo(ticket: &Ticket) {
    if let Err(e) = ask(ticket, false) {
        log::debug!("dlbridge: forgoing a lent descriptor: {e}");
    }
}

/// The lent file opened again through `/proc/<pid>/fd/<n>` of the lender, read-write, without a
/// message to the lender, when that descriptor's link starts with `link_prefix` (what the file
/// must be: a process id reused by another process names other files, which are not opened);
/// `None` where that fails (the lender is gone, or the system hides its descriptors, or the file
/// cannot be reopened by path). The ticket stays valid: the caller checks that the file is the
/// one it expects, then [`forgo`]es the ticket, or [`claim`]s it.
pub fn reopen(ticket: &Ticket, link_prefix: &str) -> Option<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = format!("/proc/{}/fd/{}", ticket.lender_pid(), ticket.fd);
    let link = std::fs::read_link(&path).ok()?;
    if !link
        .as_os_str()
        .as_encoded_bytes()
        .starts_with(link_prefix.as_bytes())
    {
        return None;
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        // Never blocks (a FIFO) nor takes a terminal, whatever the link turned into meanwhile.
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .ok()
        .map(OwnedFd::from)
}

/// How many descriptors this process lends that are not claimed yet.
pub fn outstanding() -> usize {
    let slot = LENDER.lock().unwrap_or_else(PoisonError::into_inner);
    slot.as_ref()
        .filter(|l| l.generation == crate::fork::generation())
        .map_or(0, |l| lock(&l.lent).len())
}

fn ask(ticket: &Ticket, want: bool) -> Result<Option<OwnedFd>> {
    // This process's own ticket: no socket.
    {
        let slot = LENDER.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = slot
            .as_ref()
            .filter(|l| l.name == ticket.lender && l.generation == crate::fork::generation())
        {
            let fd = lock(&l.lent).remove(&ticket.token);
            return match fd {
                Some(fd) => Ok(want.then_some(fd)),
                None if want => Err(unknown(ticket)),
                None => Ok(None),
            };
        }
    }
    let (mut conn, cached) = checkout(ticket)?;
    let answer = match exchange(&mut conn, ticket, want) {
        // A cached connection may be one the lender's process closed since: ask again on a new
        // one, which tells a lender that is gone from one that went quiet.
        Err(_) if cached => {
            conn = connect(ticket)?;
            exchange(&mut conn, ticket, want)
        }
        other => other,
    }?;
    checkin(ticket, conn);
    answer
}

/// One request and its reply (none for a forgo): `Ok(Err)` is the lender's answer that the
/// ticket is unknown.
fn exchange(conn: &mut UnixStream, ticket: &Ticket, want: bool) -> Result<Result<Option<OwnedFd>>> {
    let mut request = [0u8; REQUEST_BYTES];
    request[..8].copy_from_slice(&ticket.token.to_le_bytes());
    request[8] = u8::from(want);
    conn.write_all(&request).map_err(|e| gone(ticket, &e))?;
    if !want {
        return Ok(Ok(None));
    }
    let mut reply = [0u8; 1];
    let (n, mut fds) = recv_fds(conn, &mut reply)?;
    if n == 0 {
        return Err(gone(ticket, &std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(match (reply[0], fds.pop()) {
        (REPLY_FD, Some(fd)) if fds.is_empty() => Ok(Some(fd)),
        (REPLY_UNKNOWN, None) => Err(unknown(ticket)),
        (r, fd) => Err(Error::Driver {
            backend: "share",
            message: format!(
                "the descriptor lender sent reply {r} with {} descriptor(s)",
                usize::from(fd.is_some()) + fds.len()
            ),
        }),
    })
}

/// The kept connections of this process to other processes' lenders, by lender name, with the
/// fork generation they were made in (a forked child must not talk on its parent's).
type Connections = (u64, HashMap<String, UnixStream>);

static CONNECTIONS: Mutex<Option<Connections>> = Mutex::new(None);

/// The kept connection to `ticket`'s lender (taken out while in use) and `true`, or a new one and
/// `false`.
fn checkout(ticket: &Ticket) -> Result<(UnixStream, bool)> {
    {
        let mut kept = CONNECTIONS.lock().unwrap_or_else(PoisonError::into_inner);
        let generation = crate::fork::generation();
        if kept.as_ref().is_some_and(|(g, _)| *g != generation) {
            // Forked: the parent's sockets are left to the parent (forget, do not shut down).
            if let Some((_, old)) = kept.take() {
                old.into_values().for_each(drop);
            }
        }
        if let Some(conn) = kept
            .as_mut()
            .and_then(|(_, conns)| conns.remove(&ticket.lender))
        {
            return Ok((conn, true));
        }
    }
    Ok((connect(ticket)?, false))
}

fn checkin(ticket: &Ticket, conn: UnixStream) {
    let mut kept = CONNECTIONS.lock().unwrap_or_else(PoisonError::into_inner);
    let generation = crate::fork::generation();
    let (g, conns) = kept.get_or_insert_with(|| (generation, HashMap::new()));
    if *g != generation || conns.contains_key(&ticket.lender) {
        return; // a second connection made while the kept one was in use is closed
    }
    if conns.len() >= MAX_CONNECTIONS {
        // Lenders whose processes exited keep their entries until then: make room.
        conns.clear();
    }
    conns.insert(ticket.lender.clone(), conn);
}

/// The most lenders a process keeps a connection to.
const MAX_CONNECTIONS: usize = 64;

fn connect(ticket: &Ticket) -> Result<UnixStream> {
    SocketAddr::from_abstract_name(ticket.lender.as_bytes())
        .and_then(|addr| UnixStream::connect_addr(&addr))
        .map_err(|e| gone(ticket, &e))
}

/// The lender's loop: one thread per connected process.
fn serve(listener: UnixListener, lent: Lent) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        if !same_user(&conn) {
            continue; // dropped: closed
        }
        let lent = lent.clone();
        let started = std::thread::Builder::new()
            .name("dlbridge-fds-conn".into())
            .stack_size(THREAD_STACK)
            .spawn(move || answer(conn, &lent));
        if let Err(e) = started {
            log::warn!("dlbridge: a descriptor lender's connection thread did not start: {e}");
        }
    }
}

/// Answers one process's requests until it closes the connection.
fn answer(mut conn: UnixStream, lent: &Lent) {
    let mut request = [0u8; REQUEST_BYTES];
    while conn.read_exact(&mut request).is_ok() {
        let mut token = [0u8; 8];
        token.copy_from_slice(&request[..8]);
        let fd = lock(lent).remove(&u64::from_le_bytes(token));
        if request[8] == 0 {
            continue; // forgone: `fd` closes here, and no reply is waited for
        }
        let sent = match fd {
            Some(fd) => send_fds(&conn, &[REPLY_FD], &[fd.as_fd()]),
            None => send_fds(&conn, &[REPLY_UNKNOWN], &[]),
        };
        if sent.is_err() {
            return;
        }
    }
}

/// Whether the peer of `conn` runs as this process's user (or as root).
fn same_user(conn: &UnixStream) -> bool {
    // SAFETY: an all-zero `ucred` is a valid value of this plain C struct.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-pointers of the size given.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    rc == 0 && (cred.uid == me || cred.uid == 0)
}

fn random_u64() -> Result<u64> {
    let mut bytes = [0u8; 8];
    // SAFETY: `bytes` is a valid, writable buffer of the length given.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        return Err(crate::share::cpu::os_error("getrandom"));
    }
    Ok(u64::from_le_bytes(bytes))
}

fn io_failed(what: &str, e: &std::io::Error) -> Error {
    Error::Driver {
        backend: "share",
        message: format!("{what} failed: {e}"),
    }
}

/// The lender's process cannot be reached: it has exited (or is another user's).
fn gone(ticket: &Ticket, e: &std::io::Error) -> Error {
    Error::Driver {
        backend: "share",
        message: format!(
            "the process that shared this array (pid {}) cannot be reached ({e}): it has exited \
             before the handle was opened; a handle sent as bytes opens while its producer lives",
            ticket.lender_pid()
        ),
    }
}

fn unknown(ticket: &Ticket) -> Error {
    Error::InvalidArgument(format!(
        "the process that shared this array (pid {}) lends no descriptor under this handle's \
         ticket: it was opened already (a handle opens once)",
        ticket.lender_pid()
    ))
}
