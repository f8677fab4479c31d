//! The lender and its clients on Linux: abstract Unix sockets, `SO_PEERCRED`, `poll`.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{NAME_PREFIX, Ticket, Wait, ticket_ttl};
use crate::error::{Error, Result};
use crate::share::fd::{send_fds, try_recv_fds};

/// The stack of a lender's connection thread: it only moves small messages.
const THREAD_STACK: usize = 64 * 1024;

/// A request: the token, the memory tag, then what is asked ([`FORGO`], [`CLAIM`] or
/// [`REDEEM`]).
const REQUEST_BYTES: usize = 17;

/// The ticket ends and its descriptor is closed; no reply.
const FORGO: u8 = 0;
/// The ticket ends and its descriptor is sent back.
const CLAIM: u8 = 1;
/// The ticket ends, its descriptor is closed, and the reply says whether it was valid.
const REDEEM: u8 = 2;

/// Replies: the descriptor follows; the ticket was valid and is redeemed; no such ticket was
/// lent; the ticket was claimed, redeemed or forgone already; the ticket expired unclaimed; the
/// ticket lends other memory than the request's tag names (and stays lent).
const REPLY_FD: u8 = 0;
const REPLY_REDEEMED: u8 = 1;
const REPLY_UNKNOWN: u8 = 2;
const REPLY_ENDED: u8 = 3;
const REPLY_EXPIRED: u8 = 4;
const REPLY_MISMATCH: u8 = 5;

/// How often a waiting claim calls [`Wait::interrupt`].
const TICK: Duration = Duration::from_millis(50);

/// Why a lender has no descriptor for a request (the ending ones are remembered for a while, to
/// tell a late or repeated claim what happened).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// No such ticket was lent (or it ended long ago).
    Unknown,
    /// Claimed, redeemed or forgone: used.
    Used,
    /// Not claimed within the ticket's lifetime.
    Expired,
    /// The ticket lends other memory than the request names: it stays lent.
    Mismatch,
}

/// The most ended tickets remembered; past it, the record starts afresh (a claim of a ticket
/// forgotten so is answered "unknown", which says as much).
const MAX_ENDED: usize = 16 * 1024;

/// A descriptor lent, the memory it is for, and until when it waits for its claim (`None`: a
/// lifetime beyond what an `Instant` holds).
struct Loan {
    fd: OwnedFd,
    tag: u64,
    until: Option<Instant>,
}

/// What a lender lends, by token, and how recent tickets ended.
#[derive(Default)]
struct Book {
    lent: HashMap<u64, Loan>,
    ended: HashMap<u64, Refusal>,
}

impl Book {
    /// Ends ticket `token` when it lends the memory `tag` names, and gives its descriptor;
    /// remembers it as used.
    fn take(&mut self, token: u64, tag: u64) -> std::result::Result<OwnedFd, Refusal> {
        match self.lent.get(&token) {
            Some(loan) if loan.tag != tag => Err(Refusal::Mismatch),
            Some(_) => {
                let loan = self.lent.remove(&token).ok_or(Refusal::Unknown)?;
                self.remember(token, Refusal::Used);
                Ok(loan.fd)
            }
            None => Err(self.ended.get(&token).copied().unwrap_or(Refusal::Unknown)),
        }
    }

    fn remember(&mut self, token: u64, end: Refusal) {
        if self.ended.len() >= MAX_ENDED {
            self.ended.clear();
        }
        self.ended.insert(token, end);
    }

    /// Closes the descriptors whose tickets expired by `now`, and returns when the next one
    /// expires.
    fn expire(&mut self, now: Instant) -> Option<Instant> {
        let expired: Vec<u64> = self
            .lent
            .iter()
            .filter(|(_, loan)| loan.until.is_some_and(|t| t <= now))
            .map(|(&token, _)| token)
            .collect();
        for token in expired {
            self.lent.remove(&token);
            self.remember(token, Refusal::Expired);
        }
        self.lent.values().filter_map(|loan| loan.until).min()
    }
}

/// A lender's book, shared by its threads.
type Lent = Arc<Mutex<Book>>;

fn lock(lent: &Lent) -> MutexGuard<'_, Book> {
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
    let ttl = ticket_ttl();
    std::thread::Builder::new()
        .name("dlbridge-fds".into())
        .stack_size(THREAD_STACK)
        .spawn(move || serve(listener, serving, ttl))
        .map_err(|e| io_failed("starting the descriptor lender's thread", &e))?;
    *slot = Some(Lender {
        name: name.clone(),
        generation,
        lent: lent.clone(),
    });
    Ok((name, lent))
}

/// Keeps `fd` for one claim by another process (or this one) and returns the ticket for it. The
/// descriptor is closed if no claim comes within [`ticket_ttl`](super::ticket_ttl). `tag` names
/// the memory `fd` gives (a number its handle derives from its own fields): only a request that
/// names the same memory claims, redeems or forgoes the ticket.
pub fn lend(fd: OwnedFd, tag: u64) -> Result<Ticket> {
    let (lender, lent) = lender()?;
    let mut book = lock(&lent);
    let token = loop {
        let t = random_u64()?;
        if !book.lent.contains_key(&t) && !book.ended.contains_key(&t) {
            break t;
        }
    };
    let until = Instant::now().checked_add(ticket_ttl());
    book.lent.insert(token, Loan { fd, tag, until });
    Ok(Ticket { lender, token })
}

/// The descriptor lent under `ticket` for the memory `tag` names, which ends. Fails with a clear
/// error when the lender's process has exited, is another user's or another process's, does not
/// answer within `wait.timeout`, or the ticket is unknown there (forged, damaged, claimed already
/// or expired) or lends other memory.
pub fn claim(ticket: &Ticket, tag: u64, wait: &Wait<'_>) -> Result<OwnedFd> {
    match ask(ticket, tag, CLAIM, wait)? {
        Some(fd) => Ok(fd),
        None => Err(Error::Driver {
            backend: "share",
            message: "the descriptor lender answered a claim without the descriptor".into(),
        }),
    }
}

/// Ends `ticket` without its descriptor, after the lender confirmed it was valid: what a
/// receiver that maps the memory already does, so that only the ticket's bytes, once, open it.
/// Fails as [`claim`] does.
pub fn redeem(ticket: &Ticket, tag: u64, wait: &Wait<'_>) -> Result<()> {
    ask(ticket, tag, REDEEM, wait).map(drop)
}

/// Ends `ticket` without its descriptor, which the lender closes: one message, not waited for,
/// and never blocking (a lender that is gone, or does not take the message at once, has it close
/// the descriptor by the ticket's lifetime instead).
pub fn forgo(ticket: &Ticket, tag: u64) {
    if let Some(book) = own_book(ticket) {
        let _ = lock(&book).take(ticket.token, tag);
        return;
    }
    let sent = checkout(ticket, None).and_then(|(mut conn, _)| {
        match send_request(&mut conn, ticket, tag, FORGO, None) {
            Ok(()) => {
                checkin(ticket, conn);
                Ok(())
            }
            Err(Failure::Broken(e)) => Err(gone(ticket, &e)),
            Err(Failure::Final(e)) => Err(e),
        }
    });
    if let Err(e) = sent {
        log::debug!("dlbridge: forgoing a lent descriptor: {e}");
    }
}

/// How many descriptors this process lends that are not claimed (nor expired) yet.
pub fn outstanding() -> usize {
    let slot = LENDER.lock().unwrap_or_else(PoisonError::into_inner);
    slot.as_ref()
        .filter(|l| l.generation == crate::fork::generation())
        .map_or(0, |l| lock(&l.lent).lent.len())
}

/// This process's own book when `ticket` is one of its lender's (no socket is needed then).
fn own_book(ticket: &Ticket) -> Option<Lent> {
    let slot = LENDER.lock().unwrap_or_else(PoisonError::into_inner);
    slot.as_ref()
        .filter(|l| l.name == ticket.lender && l.generation == crate::fork::generation())
        .map(|l| l.lent.clone())
}

/// Asks `ticket`'s lender to end it (`what`: [`CLAIM`] or [`REDEEM`]); the descriptor of a claim.
fn ask(ticket: &Ticket, tag: u64, what: u8, wait: &Wait<'_>) -> Result<Option<OwnedFd>> {
    if let Some(book) = own_book(ticket) {
        let taken = lock(&book).take(ticket.token, tag);
        return match taken {
            Ok(fd) => Ok((what == CLAIM).then_some(fd)),
            Err(why) => Err(refusal(ticket, why)),
        };
    }
    let deadline = Instant::now().checked_add(wait.timeout);
    let waiting = Some((deadline, wait));
    let (mut conn, cached) = checkout(ticket, waiting)?;
    let reply = match exchange(&mut conn, ticket, tag, what, waiting) {
        // A kept connection may be one the lender's process closed since: ask again on a new
        // one, which tells a lender that is gone from one that went quiet.
        Err(Failure::Broken(_)) if cached => {
            conn = connect(ticket, waiting)?;
            exchange(&mut conn, ticket, tag, what, waiting)
        }
        other => other,
    };
    let reply = match reply {
        Ok(reply) => reply,
        Err(Failure::Broken(e)) => return Err(gone(ticket, &e)),
        // The connection is dropped: a reply that comes late must not answer a later request.
        Err(Failure::Final(e)) => return Err(e),
    };
    checkin(ticket, conn);
    match reply {
        (REPLY_FD, Some(fd)) if what == CLAIM => Ok(Some(fd)),
        (REPLY_REDEEMED, None) if what == REDEEM => Ok(None),
        (REPLY_UNKNOWN, None) => Err(refusal(ticket, Refusal::Unknown)),
        (REPLY_ENDED, None) => Err(refusal(ticket, Refusal::Used)),
        (REPLY_EXPIRED, None) => Err(refusal(ticket, Refusal::Expired)),
        (REPLY_MISMATCH, None) => Err(refusal(ticket, Refusal::Mismatch)),
        (r, fd) => Err(Error::Driver {
            backend: "share",
            message: format!(
                "the descriptor lender sent reply {r} with {} descriptor(s) to request {what}",
                usize::from(fd.is_some())
            ),
        }),
    }
}

/// How an exchange with a lender failed: the connection broke (the lender's process may have
/// exited: a kept connection is worth one more try), or for good.
enum Failure {
    Broken(std::io::Error),
    Final(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Final(e)
    }
}

/// A deadline (`None`: none) and the wait it comes from; `None` for a message that must not
/// wait at all (a forgo).
type Waiting<'a, 'b> = Option<(Option<Instant>, &'a Wait<'b>)>;

/// One request and its reply: the reply code and the descriptor that came with it.
fn exchange(
    conn: &mut UnixStream,
    ticket: &Ticket,
    tag: u64,
    what: u8,
    waiting: Waiting<'_, '_>,
) -> std::result::Result<(u8, Option<OwnedFd>), Failure> {
    send_request(conn, ticket, tag, what, waiting)?;
    let mut reply = [0u8; 1];
    loop {
        ready(conn.as_raw_fd(), libc::POLLIN, ticket, waiting)?;
        match try_recv_fds(conn, &mut reply)? {
            Some((0, _)) => {
                return Err(Failure::Broken(std::io::ErrorKind::UnexpectedEof.into()));
            }
            Some((_, mut fds)) => {
                let fd = fds.pop();
                if !fds.is_empty() {
                    return Err(Failure::Final(Error::Driver {
                        backend: "share",
                        message: format!(
                            "the descriptor lender sent {} descriptors for one ticket",
                            fds.len() + 1
                        ),
                    }));
                }
                return Ok((reply[0], fd));
            }
            None => {} // woken without a message
        }
    }
}

/// Writes one request; a message that must not wait (`waiting` `None`) fails where the socket
/// would block.
fn send_request(
    conn: &mut UnixStream,
    ticket: &Ticket,
    tag: u64,
    what: u8,
    waiting: Waiting<'_, '_>,
) -> std::result::Result<(), Failure> {
    let mut request = [0u8; REQUEST_BYTES];
    request[..8].copy_from_slice(&ticket.token.to_le_bytes());
    request[8..16].copy_from_slice(&tag.to_le_bytes());
    request[16] = what;
    let mut sent = 0;
    while sent < REQUEST_BYTES {
        let rest = &request[sent..];
        // SAFETY: `rest` is a live buffer of the length given; MSG_NOSIGNAL turns a closed peer
        // into EPIPE instead of a signal, MSG_DONTWAIT a full socket into EAGAIN.
        let n = unsafe {
            libc::send(
                conn.as_raw_fd(),
                rest.as_ptr().cast(),
                rest.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            sent += n as usize;
            continue;
        }
        let err = std::io::Error::last_os_error();
        match err.kind() {
            std::io::ErrorKind::Interrupted => {}
            std::io::ErrorKind::WouldBlock => {
                ready(conn.as_raw_fd(), libc::POLLOUT, ticket, waiting)?;
            }
            _ => return Err(Failure::Broken(err)),
        }
    }
    Ok(())
}

/// Waits until `fd` is ready for `events` (or hung up), calling the wait's interrupt every
/// [`TICK`]; fails when the deadline passes. A message that must not wait (`waiting` `None`)
/// fails at once instead of waiting.
fn ready(
    fd: RawFd,
    events: libc::c_short,
    ticket: &Ticket,
    waiting: Waiting<'_, '_>,
) -> std::result::Result<(), Failure> {
    let Some((deadline, wait)) = waiting else {
        return Err(Failure::Broken(std::io::ErrorKind::WouldBlock.into()));
    };
    loop {
        // What is left of the wait, a tick at most (zero: one look, without waiting).
        let slice = deadline.map_or(TICK, |d| {
            d.saturating_duration_since(Instant::now()).min(TICK)
        });
        let ms = if slice.is_zero() {
            0
        } else {
            slice.as_millis().max(1) as libc::c_int
        };
        let mut pfd = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n > 0 {
            return Ok(());
        }
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(Failure::Final(io_failed("poll", &err)));
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Failure::Final(timed_out(ticket, wait)));
        }
        wait.check()?;
    }
}

/// The kept connections of this process to other processes' lenders, by lender name, with the
/// fork generation they were made in (a forked child must not talk on its parent's).
type Connections = (u64, HashMap<String, UnixStream>);

static CONNECTIONS: Mutex<Option<Connections>> = Mutex::new(None);

/// The kept connection to `ticket`'s lender (taken out while in use) and `true`, or a new one and
/// `false`.
fn checkout(ticket: &Ticket, waiting: Waiting<'_, '_>) -> Result<(UnixStream, bool)> {
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
    Ok((connect(ticket, waiting)?, false))
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

/// A new connection to `ticket`'s lender (non-blocking), whose process was checked: this user's
/// (or root's), and the process the lender's name gives.
fn connect(ticket: &Ticket, waiting: Waiting<'_, '_>) -> Result<UnixStream> {
    // SAFETY: plain socket creation; the result is checked.
    let raw = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if raw < 0 {
        return Err(io_failed("socket", &std::io::Error::last_os_error()));
    }
    // SAFETY: a descriptor just opened, owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: an all-zero `sockaddr_un` is a valid value of this plain C struct.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let name = ticket.lender.as_bytes();
    // An abstract name: a NUL, then the name (checked by `Ticket::new` to fit: at most 64 bytes).
    if name.len() + 1 > addr.sun_path.len() {
        return Err(Error::InvalidArgument(format!(
            "{:?} is too long for a socket name",
            ticket.lender
        )));
    }
    for (dst, &src) in addr.sun_path[1..].iter_mut().zip(name) {
        *dst = src as libc::c_char;
    }
    let len = (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()) as u32;
    loop {
        // SAFETY: `addr` is a valid `sockaddr_un` of `len` bytes; `sock` is a socket.
        let rc = unsafe {
            libc::connect(
                sock.as_raw_fd(),
                (&raw const addr).cast(),
                len as libc::socklen_t,
            )
        };
        if rc == 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        match err.kind() {
            std::io::ErrorKind::Interrupted => {}
            // The lender's backlog is full (it is not accepting: stopped, or flooded).
            std::io::ErrorKind::WouldBlock => {
                let Some((deadline, wait)) = waiting else {
                    return Err(gone(ticket, &err));
                };
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(timed_out(ticket, wait));
                }
                std::thread::sleep(Duration::from_millis(10));
                wait.check()?;
            }
            _ => return Err(gone(ticket, &err)),
        }
    }
    let conn = UnixStream::from(sock);
    check_lender(&conn, ticket)?;
    Ok(conn)
}

/// The credentials of the process at the other end of `conn` (`SO_PEERCRED`): for a lender, the
/// process that listens on the name.
fn peer(conn: &impl AsRawFd) -> Option<libc::ucred> {
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
    (rc == 0).then_some(cred)
}

/// Whether `uid` is this process's user, or root.
fn trusted(uid: libc::uid_t) -> bool {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    uid == me || uid == 0
}

/// Fails unless the lender at the other end of `conn` runs as this user (or root) and is the
/// process `ticket`'s name gives: a name is visible to every user (`/proc/net/unix`), and once
/// its producer exited anyone may bind it.
fn check_lender(conn: &UnixStream, ticket: &Ticket) -> Result<()> {
    let Some(cred) = peer(conn) else {
        return Err(io_failed(
            "reading the lender's credentials (SO_PEERCRED)",
            &std::io::Error::last_os_error(),
        ));
    };
    let pid = ticket.lender_pid();
    if !trusted(cred.uid) {
        return Err(Error::Driver {
            backend: "share",
            message: format!(
                "the socket named by this handle's ticket ({:?}) is held by a process of another \
                 user (uid {}), not by the process that shared the array (pid {pid}, which has \
                 exited): refused",
                ticket.lender, cred.uid
            ),
        });
    }
    if u32::try_from(cred.pid).ok() != Some(pid) {
        return Err(Error::Driver {
            backend: "share",
            message: format!(
                "the socket named by this handle's ticket ({:?}) is held by process {}, not by \
                 the process that shared the array (pid {pid}): refused (the producer has \
                 exited, or runs in another PID namespace)",
                ticket.lender, cred.pid
            ),
        });
    }
    Ok(())
}

/// The lender's loop: accepts connections (one thread per connected process) and closes the
/// descriptors whose tickets expired.
fn serve(listener: UnixListener, lent: Lent, ttl: Duration) {
    loop {
        let next = lock(&lent).expire(Instant::now());
        // Until the next expiry; with nothing lent, a ticket lent meanwhile expires `ttl` from
        // now at the earliest.
        let wait = next.map_or(ttl, |t| t.saturating_duration_since(Instant::now()));
        let ms = wait.as_millis().clamp(1, libc::c_int::MAX as u128) as libc::c_int;
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        if unsafe { libc::poll(&mut pfd, 1, ms) } <= 0 {
            continue; // the next expiry, or a signal
        }
        let Ok((conn, _)) = listener.accept() else {
            continue;
        };
        if !peer(&conn).is_some_and(|c| trusted(c.uid)) {
            continue; // dropped: closed
        }
        // A client that stops reading cannot hold its thread for ever.
        let _ = conn.set_write_timeout(Some(super::default_timeout()));
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
        let word = |at: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&request[at..at + 8]);
            u64::from_le_bytes(bytes)
        };
        let taken = lock(lent).take(word(0), word(8));
        let reply = match (request[16], taken) {
            (FORGO, _) => continue, // the descriptor, if any, closes here; no reply
            (CLAIM, Ok(fd)) => {
                if send_fds(&conn, &[REPLY_FD], &[fd.as_fd()]).is_err() {
                    return;
                }
                continue;
            }
            (_, Ok(_)) => REPLY_REDEEMED,
            (_, Err(Refusal::Unknown)) => REPLY_UNKNOWN,
            (_, Err(Refusal::Used)) => REPLY_ENDED,
            (_, Err(Refusal::Expired)) => REPLY_EXPIRED,
            (_, Err(Refusal::Mismatch)) => REPLY_MISMATCH,
        };
        let sent = send_fds(&conn, &[reply], &[]);
        if sent.is_err() {
            return;
        }
    }
}

fn random_u64() -> Result<u64> {
    let mut bytes = [0u8; 8];
    // SAFETY: `bytes` is a valid, writable buffer of the length given.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        return Err(crate::share::memfd::os_error("getrandom"));
    }
    Ok(u64::from_le_bytes(bytes))
}

fn io_failed(what: &str, e: &std::io::Error) -> Error {
    Error::Driver {
        backend: "share",
        message: format!("{what} failed: {e}"),
    }
}

/// The lender's process cannot be reached: it has exited.
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

/// The lender did not answer in time.
fn timed_out(ticket: &Ticket, wait: &Wait<'_>) -> Error {
    Error::Driver {
        backend: "share",
        message: format!(
            "the process that shared this array (pid {}) did not answer within {:.3} s (it is \
             stopped or busy): give it longer with open_shared(timeout=...) or \
             DLBRIDGE_SHARE_TIMEOUT=<seconds>",
            ticket.lender_pid(),
            wait.timeout.as_secs_f64()
        ),
    }
}

/// Why the lender has no descriptor under `ticket`.
fn refusal(ticket: &Ticket, why: Refusal) -> Error {
    let pid = ticket.lender_pid();
    match why {
        Refusal::Used => Error::InvalidArgument(format!(
            "this handle was already opened: the process that shared the array (pid {pid}) \
             lent its descriptor once, and these bytes were used (a handle opens once; share \
             the array again for another)"
        )),
        Refusal::Expired => Error::Driver {
            backend: "share",
            message: format!(
                "this handle was not opened in time: the process that shared the array (pid \
                 {pid}) kept its descriptor for the ticket's lifetime and let it go (set \
                 DLBRIDGE_SHARE_TICKET_TTL=<seconds> in the producer to keep it longer than \
                 the default 600 s)"
            ),
        },
        Refusal::Unknown => Error::InvalidArgument(format!(
            "the process that shared this array (pid {pid}) lends no descriptor under this \
             handle's ticket: the handle's bytes were altered or forged, or were already used \
             long ago (a handle opens once)"
        )),
        Refusal::Mismatch => Error::InvalidArgument(format!(
            "the process that shared this array (pid {pid}) lends other memory under this \
             handle's ticket: the handle's bytes were altered or forged (its ticket is another \
             handle's)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loan(until: Instant) -> Loan {
        Loan {
            fd: std::fs::File::open("/proc/self/stat").unwrap().into(),
            tag: 9,
            until: Some(until),
        }
    }

    #[test]
    fn a_book_closes_expired_loans_and_remembers_how_tickets_ended() {
        let now = Instant::now();
        let mut book = Book::default();
        book.lent.insert(1, loan(now));
        book.lent.insert(2, loan(now + Duration::from_secs(60)));
        book.lent.insert(3, loan(now + Duration::from_secs(30)));
        assert_eq!(book.expire(now), Some(now + Duration::from_secs(30)));
        assert_eq!(book.lent.len(), 2);
        assert!(matches!(book.take(1, 9), Err(Refusal::Expired)));
        assert!(matches!(book.take(3, 8), Err(Refusal::Mismatch)));
        assert!(book.take(3, 9).is_ok(), "a mismatch leaves the ticket lent");
        assert!(matches!(book.take(3, 9), Err(Refusal::Used)));
        assert!(matches!(book.take(4, 9), Err(Refusal::Unknown)));
        assert_eq!(book.expire(now + Duration::from_secs(61)), None);
        assert!(book.lent.is_empty());
    }
}
