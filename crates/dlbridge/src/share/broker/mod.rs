//! Descriptors lent to other processes for one claim each: how a handle's descriptor travels when
//! the handle goes as bytes (a pickle through a `multiprocessing` queue, a message of the user's
//! own) rather than beside a socket message with `SCM_RIGHTS`.
//!
//! [`lend`] keeps a descriptor in this process under a one-time [`Ticket`]: the name of this
//! process's lender (an abstract Unix socket, so nothing is left in the file system when the
//! process dies), a random token, and the descriptor's number here. [`claim`], in any process of
//! the same user on this machine, asks the lender for it and receives it with `SCM_RIGHTS`;
//! [`forgo`] tells the lender it is not needed. Either ends the ticket.
//!
//! The lender answers on its own threads, so a claim needs nothing of the producer's interpreter
//! (where `multiprocessing`'s resource sharer runs Python, with a challenge and an HMAC per
//! descriptor); each receiving process keeps one connection per lender, so a claim is one round
//! trip on a socket already open, and a forgo is one message, not waited for.
//!
//! Files that can be opened again by path (a shared memory file, unlike a CUDA VMM allocation's
//! descriptor) need no round trip at all: [`reopen`] opens the lender's descriptor through
//! `/proc/<pid>/fd/<n>` (the receiver checks that it is the file it expects) and then forgoes the
//! ticket.
//!
//! A ticket is valid while the producer process lives; one never claimed (its receiver crashed
//! before opening it) keeps its descriptor until then, as the resource sharer's do. Connections
//! from processes of another user are refused.
//!
//! ```
//! use dlbridge::share::broker;
//!
//! let file = std::fs::File::open("/proc/self/stat")?;
//! let ticket = broker::lend(file.into())?;
//! let back = broker::claim(&ticket)?; // a descriptor of the same open file
//! assert!(broker::claim(&ticket).is_err()); // a ticket is claimed once
//! # drop(back);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::error::{Error, Result};

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
pub use linux::{claim, forgo, lend, outstanding, reopen};

#[cfg(not(target_os = "linux"))]
mod other;
#[cfg(not(target_os = "linux"))]
pub use other::{claim, forgo, lend, outstanding, reopen};

/// Every lender's name starts with this; the process id and a random number follow.
const NAME_PREFIX: &str = "dlbridge-fds/";

/// The longest lender name a ticket may carry.
pub const MAX_NAME: usize = 64;

/// A claim on one descriptor lent by another (or this) process: the lender's name, a token, and
/// the descriptor's number in the lender's process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ticket {
    lender: String,
    token: u64,
    fd: i32,
}

impl Ticket {
    /// A ticket from its parts, as read from a handle's bytes; a name that no lender has is a
    /// malformed ticket.
    pub fn new(lender: String, token: u64, fd: i32) -> Result<Self> {
        if !lender.starts_with(NAME_PREFIX) || lender.len() > MAX_NAME {
            return Err(Error::InvalidArgument(format!(
                "{lender:?} names no dlbridge descriptor lender"
            )));
        }
        Ok(Ticket { lender, token, fd })
    }

    /// The descriptor's number in the lender's process.
    pub fn fd(&self) -> i32 {
        self.fd
    }

    /// The lender's name (an abstract Unix socket).
    pub fn lender(&self) -> &str {
        &self.lender
    }

    /// The one-time token.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The lender's process id, from its name (for messages).
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    fn lender_pid(&self) -> &str {
        self.lender[NAME_PREFIX.len()..]
            .split('/')
            .next()
            .unwrap_or("?")
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

    #[test]
    fn a_ticket_is_claimed_once_in_process() {
        let fd = some_fd();
        let ino = inode(&fd);
        let before = outstanding();
        let t = lend(fd).unwrap();
        assert_eq!(outstanding(), before + 1);
        assert_eq!(inode(&claim(&t).unwrap()), ino);
        assert!(matches!(claim(&t), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn forgone_tickets_end() {
        let t = lend(some_fd()).unwrap();
        forgo(&t);
        assert!(claim(&t).is_err());
    }

    #[test]
    fn a_lent_file_reopens_by_path() {
        let file = tempfile_fd();
        let ino = inode(&file);
        let t = lend(file).unwrap();
        assert!(
            reopen(&t, "/proc/").is_none(),
            "a link of another kind is not opened"
        );
        let prefix = std::env::temp_dir().to_string_lossy().into_owned();
        assert_eq!(reopen(&t, &prefix).map(|fd| inode(&fd)), Some(ino));
        forgo(&t);
        assert!(claim(&t).is_err());
    }

    fn tempfile_fd() -> OwnedFd {
        let path = std::env::temp_dir().join(format!("dlbridge-broker-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f.into()
    }

    #[test]
    fn malformed_tickets_are_refused() {
        assert!(Ticket::new("somewhere-else/1".into(), 1, 3).is_err());
        assert!(Ticket::new(format!("{NAME_PREFIX}{}", "9".repeat(80)), 1, 3).is_err());
    }

    #[test]
    fn a_lender_that_is_gone_is_a_clear_error() {
        let t = Ticket::new(format!("{NAME_PREFIX}4242/0000000000000000"), 7, 3).unwrap();
        let e = claim(&t).unwrap_err().to_string();
        assert!(e.contains("pid 4242") && e.contains("exited"), "{e}");
    }
}
