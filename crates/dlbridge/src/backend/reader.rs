//! Readers that last: a crew of worker threads kept across jobs, and a read session that keeps a
//! backend's reader (its threads, and on CUDA its streams, events and pinned staging) across the
//! loads of a stream's groups.
//!
//! A whole load reads once, and a reader made for it is dropped when it ends. A stream reads a
//! group at a time (a layer's arrays, a millisecond or two of reading each): starting threads,
//! making streams and events and taking staging for every group, and waiting for the group's
//! last copy before the next group's first read, would cost as much as the reading. A
//! [`ReadSession`] keeps the reader for the whole stream; each group's reads go to the live
//! workers, and a group's copies may still run when its read returns: the caller orders its own
//! queue after them ([`ReadSession::join_current`]) instead of waiting on the host.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::{FileRead, ReadOptions};
use crate::device::Device;
use crate::error::{Error, Result};

/// The work a [`Crew`] runs on each of its threads: called with the thread's index and the flag
/// that one thread's error sets, to tell the others to stop taking work.
type Work<'a> = dyn Fn(usize, &AtomicBool) -> Result<()> + Sync + 'a;

/// Worker threads kept across jobs: [`Crew::run`] runs one job on every thread and returns when
/// all have finished it, so a job may borrow from its caller as a scoped thread does.
pub(crate) struct Crew {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is posted (or the crew is told to quit).
    posted: Condvar,
    /// Signalled when the last thread finished the job.
    finished: Condvar,
    /// Set by a thread's error during a job, cleared when the next is posted.
    failed: AtomicBool,
}

struct State {
    /// The job being run; `None` between jobs.
    job: Option<JobRef>,
    /// Counts the jobs posted: a thread runs each once.
    posted: u64,
    /// Threads that have not finished the current job.
    running: usize,
    /// The first error of the current job.
    error: Option<Error>,
    quit: bool,
}

/// A job's work with its borrow's lifetime erased (see [`Crew::run`]).
#[derive(Clone, Copy)]
struct JobRef(*const Work<'static>);

// SAFETY: the work is `Sync` (shared by reference among the threads), and `Crew::run` keeps what
// it borrows alive until every thread is done with it.
unsafe impl Send for JobRef {}

/// How many crew threads a stream's loading thread started, and how many of those have ended,
/// in tests (a stream keeps its reader's crew for all its groups, and ends it when dropped).
#[cfg(test)]
pub(crate) static STREAM_CREW_THREADS: [std::sync::atomic::AtomicUsize; 2] = [
    std::sync::atomic::AtomicUsize::new(0),
    std::sync::atomic::AtomicUsize::new(0),
];

/// Whether the calling thread is a stream's loading thread, in tests.
#[cfg(test)]
fn on_stream_thread() -> bool {
    std::thread::current().name() == Some(crate::engine::STREAM_THREAD_NAME)
}

/// The name of a crew's threads.
pub(crate) const CREW_THREAD_NAME: &str = "dlbridge-reader";

impl Crew {
    /// A crew of `threads` (at least one) threads, waiting for jobs.
    ///
    /// # Errors
    /// [`Error::Driver`] where the system refuses a thread (those started are ended).
    pub(crate) fn new(threads: usize) -> Result<Crew> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                job: None,
                posted: 0,
                running: 0,
                error: None,
                quit: false,
            }),
            posted: Condvar::new(),
            finished: Condvar::new(),
            failed: AtomicBool::new(false),
        });
        let mut crew = Crew {
            shared,
            threads: Vec::with_capacity(threads.max(1)),
        };
        #[cfg(test)]
        let counted = on_stream_thread();
        for index in 0..threads.max(1) {
            let shared = Arc::clone(&crew.shared);
            let thread = std::thread::Builder::new()
                .name(CREW_THREAD_NAME.into())
                .spawn(move || {
                    serve(&shared, index);
                    #[cfg(test)]
                    if counted {
                        STREAM_CREW_THREADS[1].fetch_add(1, Ordering::Relaxed);
                    }
                })
                .map_err(|e| Error::Driver {
                    backend: "loader",
                    message: format!("starting a reader thread: {e}"),
                })?;
            #[cfg(test)]
            if counted {
                STREAM_CREW_THREADS[0].fetch_add(1, Ordering::Relaxed);
            }
            crew.threads.push(thread);
        }
        Ok(crew)
    }

    /// Runs `work(index, failed)` on every thread (`index` in `0..threads`) and returns the first
    /// error any of them met (a panic is one); that error also sets `failed`, which tells the
    /// others to stop taking work.
    pub(crate) fn run(&mut self, work: &Work<'_>) -> Result<()> {
        let erased: *const Work<'_> = work;
        // SAFETY: only the lifetime changes. The threads call the work only between this post and
        // the moment `running` drops to zero, and this function returns (it cannot unwind in
        // between: it only waits) after that moment, so `work` and what it borrows outlive every
        // call.
        let job =
            JobRef(unsafe { std::mem::transmute::<*const Work<'_>, *const Work<'static>>(erased) });
        let mut state = lock(&self.shared.state);
        self.shared.failed.store(false, Ordering::Relaxed);
        state.job = Some(job);
        state.posted += 1;
        state.running = self.threads.len();
        state.error = None;
        self.shared.posted.notify_all();
        while state.running > 0 {
            state = self
                .shared
                .finished
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
        }
        state.job = None;
        match state.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// A crew thread: runs each posted job once, until told to quit.
fn serve(shared: &Shared, index: usize) {
    let mut seen = 0;
    loop {
        let job = {
            let mut state = lock(&shared.state);
            while state.posted == seen && !state.quit {
                state = shared.posted.wait(state).unwrap_or_else(|p| p.into_inner());
            }
            if state.quit {
                return;
            }
            seen = state.posted;
            state.job
        };
        let result = match job {
            // SAFETY: a posted job's work lives until this thread reports it finished below
            // (`Crew::run` waits for that).
            Some(job) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
                (*job.0)(index, &shared.failed)
            }))
            .unwrap_or_else(|_| {
                Err(Error::Driver {
                    backend: "loader",
                    message: "a reader thread panicked".into(),
                })
            }),
            None => Ok(()),
        };
        let mut state = lock(&shared.state);
        if let Err(e) = result {
            shared.failed.store(true, Ordering::Relaxed);
            state.error.get_or_insert(e);
        }
        state.running -= 1;
        if state.running == 0 {
            shared.finished.notify_all();
        }
    }
}

impl Drop for Crew {
    fn drop(&mut self) {
        lock(&self.shared.state).quit = true;
        self.shared.posted.notify_all();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// What a backend's reader that lasts across reads does for a [`ReadSession`].
#[cfg_attr(not(any(cuda, feature = "test-backend")), allow(dead_code))] // made by CUDA, ext_dev
pub(crate) trait DeviceReader: Send {
    /// Reads each of `reads` into its destination. When it returns the files' bytes have been
    /// read, and the device's copies of them may still run ([`DeviceReader::join_current`]).
    /// On error nothing it started still runs.
    fn read(&mut self, reads: &[FileRead<'_>], options: &ReadOptions<'_>) -> Result<()>;

    /// Makes the calling thread's current queue of the device wait (on the device) for the copies
    /// of every read so far.
    fn join_current(&self) -> Result<()>;
}

/// A reader kept across the reads of one device (a stream's groups): its threads, and on CUDA
/// their streams, events and pinned staging, made at the first read and kept until the session is
/// dropped, which waits for the copies still running and frees them. Where the device's backend
/// has no such reader, each read is a whole [`read_file`](super::read_file) (done when it
/// returns).
#[derive(Default)]
pub(crate) struct ReadSession {
    /// The device of the first read: the reader's. Reads on another device are whole
    /// [`read_file`](super::read_file)s.
    device: Option<Device>,
    reader: Option<Box<dyn DeviceReader>>,
}

impl ReadSession {
    /// A session that has read nothing yet.
    pub(crate) fn new() -> ReadSession {
        ReadSession::default()
    }

    /// Reads each of `reads` into its destination on `device` ([`DeviceReader::read`]): the
    /// device's copies may still run when it returns; [`ReadSession::join_current`] orders the
    /// caller's queue after them.
    pub(crate) fn read(
        &mut self,
        device: Device,
        reads: &[FileRead<'_>],
        options: &ReadOptions<'_>,
    ) -> Result<()> {
        match super::of(device) {
            Some(backend) if *self.device.get_or_insert(device) == device => {
                backend.read_in(device, &mut self.reader, reads, options)
            }
            _ => super::read_file(device, reads, options),
        }
    }

    /// Makes the calling thread's current queue of the device wait for the copies of every read
    /// so far (on the device, not the host); nothing where every read was done when it returned.
    pub(crate) fn join_current(&self) -> Result<()> {
        self.reader.as_ref().map_or(Ok(()), |r| r.join_current())
    }
}

/// The host's reader that lasts: [`read_to_host`](super::read_to_host)'s parallel positioned
/// reads on a crew kept across reads (memory the host writes: device kinds whose memory is host
/// memory).
#[cfg_attr(not(any(cuda, feature = "test-backend")), allow(dead_code))] // used by CUDA, ext_dev
pub(crate) struct HostReader {
    crew: Crew,
}

#[cfg_attr(not(any(cuda, feature = "test-backend")), allow(dead_code))]
impl HostReader {
    /// The session's host reader, made at its first read with `options.threads` threads.
    pub(crate) fn of<'a>(
        slot: &'a mut Option<Box<dyn DeviceReader>>,
        options: &ReadOptions<'_>,
    ) -> Result<&'a mut Box<dyn DeviceReader>> {
        if slot.is_none() {
            *slot = Some(Box::new(HostReader {
                crew: Crew::new(options.threads.max(1))?,
            }));
        }
        Ok(slot.as_mut().expect("made above"))
    }
}

impl DeviceReader for HostReader {
    fn read(&mut self, reads: &[FileRead<'_>], options: &ReadOptions<'_>) -> Result<()> {
        super::read_to_host_on(&mut self.crew, reads, options)
    }

    fn join_current(&self) -> Result<()> {
        // The host's writes are done when `read` returns.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Each job runs once on every thread, the same threads job after job, and may borrow from
    /// its caller; an error or a panic in one thread is the job's error, sets the flag the others
    /// see, and leaves the crew usable.
    #[test]
    fn a_crew_runs_each_job_once_per_thread_and_reports_the_first_error() {
        let mut crew = Crew::new(4).unwrap();
        let ids = Mutex::new(std::collections::HashSet::new());
        for round in 0..50 {
            let calls = AtomicUsize::new(0);
            let seen = Mutex::new(vec![false; 4]);
            crew.run(&|index, _| {
                calls.fetch_add(1, Ordering::Relaxed);
                seen.lock().unwrap()[index] = true;
                ids.lock().unwrap().insert(std::thread::current().id());
                assert_eq!(
                    std::thread::current().name(),
                    Some(CREW_THREAD_NAME),
                    "round {round}"
                );
                Ok(())
            })
            .unwrap();
            assert_eq!(calls.load(Ordering::Relaxed), 4);
            assert!(seen.lock().unwrap().iter().all(|&s| s));
        }
        assert_eq!(
            ids.lock().unwrap().len(),
            4,
            "the same four threads throughout"
        );
        let stopped = AtomicUsize::new(0);
        let failed = crew.run(&|index, failed| {
            if index == 2 {
                return Err(Error::InvalidArgument("piece 2".into()));
            }
            while !failed.load(Ordering::Relaxed) {
                std::thread::yield_now();
            }
            stopped.fetch_add(1, Ordering::Relaxed);
            Ok(())
        });
        assert!(matches!(failed, Err(Error::InvalidArgument(m)) if m == "piece 2"));
        assert_eq!(
            stopped.load(Ordering::Relaxed),
            3,
            "the others saw the flag"
        );
        let panicked = crew.run(&|index, _| {
            assert_ne!(index, 1, "a worker's bug");
            Ok(())
        });
        assert!(matches!(panicked, Err(Error::Driver { .. })));
        crew.run(&|_, failed| {
            assert!(!failed.load(Ordering::Relaxed), "cleared for the next job");
            Ok(())
        })
        .unwrap();
    }

    /// Dropping a crew ends its threads.
    #[test]
    fn dropping_a_crew_ends_its_threads() {
        let mut crew = Crew::new(3).unwrap();
        let alive = Arc::new(());
        let held = Mutex::new(Vec::new());
        crew.run(&|_, _| {
            held.lock().unwrap().push(Arc::clone(&alive));
            Ok(())
        })
        .unwrap();
        drop(held);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(crew);
            let _ = tx.send(());
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("dropping the crew did not end its threads");
        assert_eq!(Arc::strong_count(&alive), 1);
    }
}
