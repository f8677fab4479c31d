//! Descriptors lent to other processes for one claim each: how a handle's descriptor travels when
//! the handle goes as bytes (a pickle through a `multiprocessing` queue, a message of the user's
//! own) rather than beside a socket message with `SCM_RIGHTS`.
//!
//! [`lend`] keeps a descriptor in this process under a one-time [`Ticket`]: the name of this
//! process's lender (an abstract Unix socket, so nothing is left in the file system when the
//! process dies; the name carries the process id) and a random 64-bit token. [`claim`], in any
//! process of the same user on this machine, asks the lender for it and receives it with
//! `SCM_RIGHTS`; [`redeem`] ends the ticket without the descriptor (a receiver that maps the
//! memory already); [`forgo`] tells the lender it is not needed. Each ends the ticket: a ticket
//! is good for one of them, and only its token opens it (the lender keys its descriptors by
//! token, never by anything a process could read from `/proc`). Each request also names the
//! memory it expects (a tag the handle derives from its own fields, as the lender did when it
//! lent): a ticket moved onto another handle's bytes opens nothing, and stays lent.
//!
//! The lender answers on its own threads, so a claim needs nothing of the producer's interpreter
//! (where `multiprocessing`'s resource sharer runs Python, with a challenge and an HMAC per
//! descriptor); each receiving process keeps one connection per lender, so a claim is one round
//! trip on a socket already open, and a forgo is one message, not waited for.
//!
//! # Who is trusted
//! The boundary is the user. The lender answers only processes of its own user (or root), by the
//! kernel's credentials of the connection (`SO_PEERCRED`); a claimer accepts only a lender of its
//! own user (or root) whose process id is the one its name gives, so a process of another user
//! that binds the name of a producer that exited is refused. A process of the same user can
//! read the producer's memory anyway (`ptrace`, `/proc/<pid>/mem`, `/proc/<pid>/fd`): the token
//! does not protect memory from it. What the token guarantees is that dlbridge's own API opens
//! a lent descriptor only for the bytes that carry its ticket, once: bytes with a zeroed, altered
//! or forged token, and bytes of one ticket used again (a replayed message, a handle opened
//! twice), are refused.
//!
//! # Waiting
//! A claim waits for the lender's answer at most [`Wait::timeout`] (`DLBRIDGE_SHARE_TIMEOUT`
//! seconds, 30 by default: a producer that is stopped, or a name squatted by a process that never
//! answers, ends in an error), and calls [`Wait::interrupt`] about every 50 ms meanwhile (the
//! Python binding checks for Ctrl-C there).
//!
//! A ticket is valid while the producer process lives, for at most `DLBRIDGE_SHARE_TICKET_TTL`
//! seconds (600 by default): one never claimed (its receiver crashed before opening it, or the
//! bytes were never read) gives its descriptor back then, and a claim after that is told so.
//!
//! ```
//! use dlbridge::share::broker::{self, Wait};
//!
//! let file = std::fs::File::open("/proc/self/stat")?;
//! let ticket = broker::lend(file.into(), 42)?; // 42: what the descriptor gives
//! assert!(broker::claim(&ticket, 7, &Wait::default()).is_err()); // not for other memory
//! let back = broker::claim(&ticket, 42, &Wait::default())?; // a descriptor of the same file
//! assert!(broker::claim(&ticket, 42, &Wait::default()).is_err()); // a ticket is claimed once
//! # drop(back);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::time::Duration;

use crate::error::{Error, Result};

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
pub use linux::{claim, forgo, lend, outstanding, redeem};

#[cfg(not(target_os = "linux"))]
mod other;
#[cfg(not(target_os = "linux"))]
pub use other::{claim, forgo, lend, outstanding, redeem};

/// Every lender's name starts with this; the process id and a random number follow.
const NAME_PREFIX: &str = "dlbridge-fds/";

/// The longest lender name a ticket may carry.
pub const MAX_NAME: usize = 64;

/// How long a claim waits for its lender when nothing says otherwise.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a lent descriptor waits for its claim when nothing says otherwise.
const DEFAULT_TICKET_TTL: Duration = Duration::from_secs(600);

/// A duration in seconds from the environment variable `name`, or `default` (with a warning
/// when the variable is set to something else than a positive number of seconds).
fn seconds_from_env(name: &str, default: Duration) -> Duration {
    let Ok(text) = std::env::var(name) else {
        return default;
    };
    match text.trim().parse::<f64>().ok().filter(|s| *s > 0.0) {
        Some(s) => Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX),
        None => {
            log::warn!(
                "dlbridge: {name}={text:?} is not a positive number of seconds; using {default:?}"
            );
            default
        }
    }
}

/// How long a claim waits for its lender by default: `DLBRIDGE_SHARE_TIMEOUT` seconds, or 30.
/// Read once per process.
pub fn default_timeout() -> Duration {
    static TIMEOUT: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *TIMEOUT.get_or_init(|| seconds_from_env("DLBRIDGE_SHARE_TIMEOUT", DEFAULT_TIMEOUT))
}

/// How long this process keeps a lent descriptor for its claim: `DLBRIDGE_SHARE_TICKET_TTL`
/// seconds, or 600. Read once per process.
pub fn ticket_ttl() -> Duration {
    static TTL: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *TTL.get_or_init(|| seconds_from_env("DLBRIDGE_SHARE_TICKET_TTL", DEFAULT_TICKET_TTL))
}

/// How long a claim waits for the lender's answer, and what cuts the wait short.
#[derive(Clone, Copy)]
pub struct Wait<'a> {
    /// The longest the whole claim (connecting, asking, receiving) takes before it fails.
    pub timeout: Duration,
    /// Called about every 50 ms while the claim waits; an error it returns ends the claim with
    /// that error (the Python binding answers Ctrl-C here).
    pub interrupt: Option<&'a (dyn Fn() -> Result<()> + Sync)>,
}

impl Wait<'_> {
    /// A wait of `timeout` that nothing interrupts.
    pub fn new(timeout: Duration) -> Self {
        Wait {
            timeout,
            interrupt: None,
        }
    }

    /// Runs [`Wait::interrupt`], if any.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    fn check(&self) -> Result<()> {
        self.interrupt.map_or(Ok(()), |f| f())
    }
}

impl Default for Wait<'_> {
    /// [`default_timeout`], not interruptible.
    fn default() -> Self {
        Wait::new(default_timeout())
    }
}

impl std::fmt::Debug for Wait<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wait")
            .field("timeout", &self.timeout)
            .field("interruptible", &self.interrupt.is_some())
            .finish()
    }
}

/// A claim on one descriptor lent by another (or this) process: the lender's name and a one-time
/// token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ticket {
    lender: String,
    token: u64,
}

impl Ticket {
    /// A ticket from its parts, as read from a handle's bytes; a name that no lender has (not
    /// `dlbridge-fds/<pid>/<number>`, or longer than [`MAX_NAME`]) is a malformed ticket.
    pub fn new(lender: String, token: u64) -> Result<Self> {
        let pid_ok = lender
            .strip_prefix(NAME_PREFIX)
            .and_then(|rest| rest.split_once('/'))
            .is_some_and(|(pid, _)| pid.parse::<u32>().is_ok_and(|p| p > 0));
        if !pid_ok || lender.len() > MAX_NAME {
            return Err(Error::InvalidArgument(format!(
                "{lender:?} names no dlbridge descriptor lender"
            )));
        }
        Ok(Ticket { lender, token })
    }

    /// The lender's name (an abstract Unix socket).
    pub fn lender(&self) -> &str {
        &self.lender
    }

    /// The one-time token.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The lender's process id, from its name (checked by [`Ticket::new`]).
    pub fn lender_pid(&self) -> u32 {
        self.lender[NAME_PREFIX.len()..]
            .split('/')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, OwnedFd};

    fn inode(fd: &OwnedFd) -> u64 {
        // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open; `st` is a valid out-pointer.
        assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
        st.st_ino
    }

    fn some_fd() -> OwnedFd {
        std::fs::File::open("/proc/self/stat").unwrap().into()
    }

    fn wait() -> Wait<'static> {
        Wait::new(Duration::from_secs(5))
    }

    #[test]
    fn a_ticket_is_claimed_once_in_process() {
        let fd = some_fd();
        let ino = inode(&fd);
        let t = lend(fd, 1).unwrap();
        assert_eq!(inode(&claim(&t, 1, &wait()).unwrap()), ino);
        let again = claim(&t, 1, &wait()).unwrap_err();
        assert!(
            matches!(&again, Error::InvalidArgument(m) if m.contains("already opened")),
            "{again}"
        );
        assert!(
            redeem(&t, 1, &wait()).is_err(),
            "a claimed ticket is not redeemed"
        );
    }

    #[test]
    fn forgone_and_redeemed_tickets_end() {
        let t = lend(some_fd(), 1).unwrap();
        forgo(&t, 1);
        assert!(claim(&t, 1, &wait()).is_err());
        let t = lend(some_fd(), 1).unwrap();
        redeem(&t, 1, &wait()).unwrap();
        assert!(claim(&t, 1, &wait()).is_err());
        assert!(redeem(&t, 1, &wait()).is_err());
    }

    #[test]
    fn only_the_token_opens_a_ticket() {
        let t = lend(some_fd(), 1).unwrap();
        for token in [0, t.token() ^ 1, t.token().wrapping_add(1)] {
            let forged = Ticket::new(t.lender().to_owned(), token).unwrap();
            let e = claim(&forged, 1, &wait()).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains("altered or forged")),
                "{e}"
            );
        }
        let e = claim(&t, 2, &wait()).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("another handle's")),
            "{e}"
        );
        claim(&t, 1, &wait()).unwrap();
    }

    #[test]
    fn malformed_tickets_are_refused() {
        assert!(Ticket::new("somewhere-else/1/0".into(), 1).is_err());
        assert!(Ticket::new(format!("{NAME_PREFIX}{}", "9".repeat(80)), 1).is_err());
        assert!(Ticket::new(format!("{NAME_PREFIX}x/00"), 1).is_err());
        assert!(Ticket::new(format!("{NAME_PREFIX}0/00"), 1).is_err());
        assert!(Ticket::new(format!("{NAME_PREFIX}12"), 1).is_err());
        assert_eq!(
            Ticket::new(format!("{NAME_PREFIX}12/ab"), 1)
                .unwrap()
                .lender_pid(),
            12
        );
    }

    #[test]
    fn a_lender_that_is_gone_is_a_clear_error() {
        let t = Ticket::new(format!("{NAME_PREFIX}4242/0000000000000000"), 7).unwrap();
        let e = claim(&t, 1, &wait()).unwrap_err().to_string();
        assert!(e.contains("pid 4242") && e.contains("exited"), "{e}");
    }

    #[test]
    fn the_waits_default_comes_from_the_environment_once() {
        assert!(default_timeout() > Duration::ZERO);
        assert!(ticket_ttl() > Duration::ZERO);
        assert_eq!(
            seconds_from_env("DLBRIDGE_TEST_UNSET_SECONDS", Duration::from_secs(3)),
            Duration::from_secs(3)
        );
    }
}
