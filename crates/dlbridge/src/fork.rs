//! Which process this is, across `fork()`.
//!
//! A forked child starts with one thread: the parent's worker threads do not exist in it, and a
//! driver initialised by the parent (CUDA's) cannot be used in it. State that depends on either
//! records the [`generation`] it was made in and is re-created (the CPU workers) or refused with a
//! clear error (CUDA) when the generation has changed, as PyTorch does with `pthread_atfork`.

use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};

/// Incremented in each forked child, before `fork()` returns there.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The number of `fork()`s between the first call of this function in the process's ancestry and
/// now: it differs from a value recorded before a fork when read in the child.
pub(crate) fn generation() -> u64 {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(register);
    GENERATION.load(Ordering::Acquire)
}

#[cfg(unix)]
fn register() {
    extern "C" fn in_child() {
        // Only an atomic add: async-signal-safe, as a handler that runs in a forked child of a
        // multi-threaded process must be.
        GENERATION.fetch_add(1, Ordering::AcqRel);
    }
    // SAFETY: registers a handler with no preconditions; `in_child` lives for the whole process
    // (it is a plain function) and does nothing but an atomic add.
    let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    if rc != 0 {
        log::warn!("pthread_atfork failed ({rc}): a forked child cannot tell it was forked");
    }
}

#[cfg(not(unix))]
fn register() {}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_sees_a_new_generation() {
        let before = generation();
        // SAFETY: the child only reads an atomic and exits with `_exit`, which is all a child of
        // a multi-threaded process (the test harness) may safely do.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let changed = generation() == before + 1;
            // SAFETY: ends the child at once, without running the parent's exit handlers.
            unsafe { libc::_exit(if changed { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked; `status` is a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert_eq!(
            generation(),
            before,
            "the parent's generation must not change"
        );
    }
}
