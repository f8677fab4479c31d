//! The CPU kernels' worker threads: one rayon pool per process, made again in a forked child.
//!
//! rayon's global pool cannot be used after `fork()`: the child inherits the pool's state but not
//! its threads, so the first parallel loop there waits forever. dlbridge's kernels therefore run
//! on a pool of their own, tagged with the [`fork::generation`](crate::fork::generation) it was
//! built in; a child builds a new one on first use (the parent's, whose threads are gone, is
//! leaked: it cannot be shut down).

use std::sync::atomic::{AtomicPtr, Ordering};

struct Workers {
    generation: u64,
    pool: rayon::ThreadPool,
}

/// The current process's pool, leaked (never freed), or NULL before the first use.
static WORKERS: AtomicPtr<Workers> = AtomicPtr::new(std::ptr::null_mut());

/// This process's pool; `None` where no thread could be started (work then runs on the caller).
fn workers() -> Option<&'static rayon::ThreadPool> {
    let generation = crate::fork::generation();
    let current = WORKERS.load(Ordering::Acquire);
    // SAFETY: non-NULL pointers in `WORKERS` come from `Box::into_raw` and are never freed.
    match unsafe { current.as_ref() } {
        Some(w) if w.generation == generation => Some(&w.pool),
        _ => renew(current, generation),
    }
}

#[cold]
fn renew(current: *mut Workers, generation: u64) -> Option<&'static rayon::ThreadPool> {
    let pool = match rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("dlbridge-cpu-{i}"))
        .build()
    {
        Ok(pool) => pool,
        Err(err) => {
            log::warn!("no CPU worker threads ({err}): kernels run on the calling thread");
            return None;
        }
    };
    let fresh = Box::into_raw(Box::new(Workers { generation, pool }));
    match WORKERS.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // The old pool, if any, belonged to the parent process: leaked.
        // SAFETY: `fresh` is now in `WORKERS`, never freed.
        Ok(_) => Some(&unsafe { &*fresh }.pool),
        Err(winner) => {
            // Another thread of this process built one first: use it, drop ours.
            // SAFETY: `fresh` never left this function.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: as in `workers`; the winner was stored for this generation.
            unsafe { winner.as_ref() }.map(|w| &w.pool)
        }
    }
}

/// How many threads parallel kernels split their work over.
pub(crate) fn threads() -> usize {
    workers().map_or(1, rayon::ThreadPool::current_num_threads)
}

/// Runs `f` on this process's pool, so that rayon's parallel iterators (and gemm's rayon
/// parallelism) inside it use that pool; on the calling thread where there is none.
pub(crate) fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match workers() {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_runs_parallel_work() {
        // The parent's pool exists and has run work before the fork.
        let n: usize = install(|| {
            use rayon::prelude::*;
            (0..1000usize).into_par_iter().sum()
        });
        assert_eq!(n, 499_500);
        // SAFETY: the child runs parallel work and exits with `_exit`; it allocates (the new pool),
        // which glibc's fork makes safe by holding malloc's locks across it.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // Without a new pool this waits forever; the parent's timeout below catches that.
            let n: usize = install(|| {
                use rayon::prelude::*;
                (0..1000usize).into_par_iter().sum()
            });
            let ok = n == 499_500 && threads() >= 1;
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut status = 0;
        loop {
            // SAFETY: polls the child just forked; `status` is a valid out-pointer.
            let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if rc == pid {
                break;
            }
            if std::time::Instant::now() > deadline {
                // SAFETY: signals our own child, which has not been reaped yet.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                // SAFETY: reaps that child; `status` is a valid out-pointer.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                panic!("the forked child hung in a parallel loop");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }
}
