//! Arrays sent between processes and machines over NCCL's point-to-point operations
//! (`ncclSend`/`ncclRecv`), for transports that copy device memory from one GPU to another
//! rather than share it: two GPUs of one host (NVLink or PCIe), or two hosts (InfiniBand,
//! RoCE, TCP), whichever NCCL finds.
//!
//! # Loading
//! `libnccl` is opened at run time on first use and never required: from the path in
//! `DLBRIDGE_NCCL_LIBRARY` if set, else from the paths given to [`add_library_path`] (the Python
//! package adds the copy that the `nvidia-nccl` wheel installs, the one PyTorch uses), else by its
//! name (`libnccl.so.2`, found through the loader's search path or already loaded by another
//! library). Only entry points present since NCCL 2.7 are called; a machine without the library
//! gets [`Error::BackendUnavailable`].
//!
//! # Many arrays at once
//! [`Communicator::send`] plans the arrays as runs ([`crate::runs`]): arrays carved from
//! one pool slab travel as one operation, so a thousand small arrays cost one send, not a
//! thousand. The operations of one call are grouped (`ncclGroupStart`/`ncclGroupEnd`).
//! [`Communicator::recv`] allocates **one** block from the caching pool for all of them.
//!
//! # Streams and waiting
//! Both sides enqueue on the communicator's own non-blocking stream, ordered after the work
//! already queued on the calling thread's current stream of the device (so a producer's pending
//! kernels finish before its bytes leave), and then wait for the transfer to finish, polling
//! NCCL for asynchronous errors: a peer that fails, or that does not take part within the
//! timeout, aborts the communicator (`ncclCommAbort`) and the call fails with a clear error
//! instead of hanging. An aborted communicator refuses further use.
//!
//! # Joining
//! Where NCCL has `ncclCommInitRankConfig` (2.14 and later), the communicator is made
//! non-blocking: [`Communicator::join`] polls the join, and a peer that never comes ends it by
//! its timeout (the half-made communicator is aborted) instead of blocking the thread for good.
//! Older NCCL joins blocking, with no timeout.
//!
//! One communicator serves one transfer at a time (the others wait for its lock). NCCL matches a
//! pair's operations in the order they are posted, so two threads that send to each other at
//! the same time over one pair of communicators wait for each other until the timeout: give
//! each direction its own communicator, or order the transfers (Ray runs an actor's transfers
//! on one thread).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::{context, current_stream, memory, stream};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};
use crate::runs::{self, RunPlan, RunView};
use crate::tensor::Tensor;

const BACKEND: &str = "NCCL";

/// The size of NCCL's unique id (`ncclUniqueId`): the bootstrap address every rank joins.
pub const UNIQUE_ID_BYTES: usize = 128;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; UNIQUE_ID_BYTES],
}

type Comm = *mut c_void;
type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
/// `ncclInProgress`: an operation of a non-blocking communicator still running.
const IN_PROGRESS: NcclResult = 7;
/// `ncclUint8`: every transfer here is bytes.
const UINT8: c_int = 1;

/// The NCCL version whose `ncclConfig_t` this crate fills (`NCCL_VERSION(2, 14, 0)`), the first
/// with non-blocking communicators.
const NON_BLOCKING_SINCE: c_int = 21400;

/// The leading fields of `ncclConfig_t`, as NCCL 2.14 defined it. NCCL reads `size` bytes of it
/// and gives every field that `version` did not have its default, so later versions accept it.
#[repr(C)]
struct Config {
    size: usize,
    /// `0xcafebeef`, the value of `NCCL_CONFIG_INITIALIZER`.
    magic: u32,
    version: u32,
    /// 0: non-blocking.
    blocking: c_int,
}

/// NCCL's entry points, resolved once.
struct Api {
    _lib: libloading::Library,
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult,
    /// `ncclCommInitRankConfig` (NCCL 2.14 and later).
    comm_init_rank_config:
        Option<unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> NcclResult>,
    comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    comm_abort: unsafe extern "C" fn(Comm) -> NcclResult,
    comm_async_error: unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult,
    send:
        unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, sys::CUstream) -> NcclResult,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, sys::CUstream) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
}

fn extra_paths() -> &'static Mutex<Vec<PathBuf>> {
    static PATHS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    &PATHS
}

/// Adds a path to try for `libnccl` before its name (ignored once the library is loaded).
pub fn add_library_path(path: impl Into<PathBuf>) {
    extra_paths()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(path.into());
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<Api> = OnceLock::new();
    if let Some(api) = API.get() {
        return Ok(api);
    }
    // Not cached on failure: a path added later (by the Python package) is tried next time.
    let api = load().map_err(|reason| Error::BackendUnavailable {
        backend: BACKEND,
        reason,
    })?;
    Ok(API.get_or_init(|| api))
}

fn load() -> std::result::Result<Api, String> {
    let candidates: Vec<PathBuf> = match std::env::var_os("DLBRIDGE_NCCL_LIBRARY") {
        Some(path) => vec![path.into()],
        None => {
            let mut c = extra_paths()
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            c.extend(["libnccl.so.2", "libnccl.so"].map(PathBuf::from));
            c
        }
    };
    let mut tried = Vec::new();
    for path in &candidates {
        // SAFETY: loading NCCL runs its initialisers, which only set up its own state.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => match resolve(lib) {
                Ok(api) => return Ok(api),
                Err(e) => tried.push(format!("{} ({e})", path.display())),
            },
            Err(e) => tried.push(format!("{} ({e})", path.display())),
        }
    }
    Err(format!(
        "no usable NCCL library (libnccl) was found; install it (`pip install nvidia-nccl-cu13`, \
         or the cu12 one, which PyTorch's CUDA wheels bring) or set DLBRIDGE_NCCL_LIBRARY to its \
         path. Tried: {}",
        tried.join("; ")
    ))
}

fn resolve(lib: libloading::Library) -> std::result::Result<Api, String> {
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is NCCL's, declared above with its C signature.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("{} is missing: {e}", $name))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = sym!("ncclGetVersion");
    let mut version = 0;
    // SAFETY: valid out-pointer.
    unsafe { get_version(&mut version) };
    if version < 20700 {
        return Err(format!(
            "NCCL {version} is too old (2.7 or newer is needed)"
        ));
    }
    let last_error = {
        // SAFETY: as above; only present since NCCL 2.13.
        unsafe { lib.get::<unsafe extern "C" fn(Comm) -> *const c_char>(b"ncclGetLastError\0") }
            .ok()
            .map(|s| *s)
    };
    let comm_init_rank_config = if version >= NON_BLOCKING_SINCE {
        // SAFETY: as above; present since NCCL 2.14.
        unsafe {
            lib.get::<unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> NcclResult>(
                b"ncclCommInitRankConfig\0",
            )
        }
        .ok()
        .map(|s| *s)
    } else {
        None
    };
    Ok(Api {
        version,
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank: sym!("ncclCommInitRank"),
        comm_init_rank_config,
        comm_destroy: sym!("ncclCommDestroy"),
        comm_abort: sym!("ncclCommAbort"),
        comm_async_error: sym!("ncclCommGetAsyncError"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        error_string: sym!("ncclGetErrorString"),
        last_error,
        _lib: lib,
    })
}

/// Whether NCCL can be loaded here.
pub fn is_available() -> bool {
    api().is_ok()
}

/// NCCL's version as `(major, minor, patch)`.
pub fn version() -> Result<(u32, u32, u32)> {
    let v = api()?.version as u32;
    Ok((v / 10000, (v / 100) % 100, v % 100))
}

fn failed(api: &Api, call: &str, code: NcclResult, comm: Option<Comm>) -> Error {
    // SAFETY: NCCL's own function, defined for every result code.
    let text = unsafe { (api.error_string)(code) };
    // SAFETY: NCCL returns a static NUL-terminated string for every code.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let detail = match (comm, api.last_error) {
        (Some(c), Some(last)) => {
            // SAFETY: a live communicator.
            let s = unsafe { last(c) };
            let s = if s.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL returns a NUL-terminated string it owns (possibly empty).
                unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
            };
            if s.is_empty() {
                String::new()
            } else {
                format!(": {s}")
            }
        }
        _ => String::new(),
    };
    Error::Driver {
        backend: BACKEND,
        message: format!("{call} failed: {text} (NCCL error {code}){detail}"),
    }
}

fn check(api: &Api, call: &str, code: NcclResult, comm: Option<Comm>) -> Result<()> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(failed(api, call, code, comm))
    }
}

/// A new unique id (`ncclGetUniqueId`): the bootstrap address of a communicator, made by the
/// process of rank 0 (which serves the bootstrap while the ranks join) and handed to every rank.
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    let api = api()?;
    let mut id = UniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: valid out-pointer.
    let code = unsafe { (api.get_unique_id)(&mut id) };
    check(api, "ncclGetUniqueId", code, None)?;
    Ok(id.internal.map(|c| c as u8))
}

/// One rank of an NCCL communicator on one CUDA device; destroyed on drop. Every pair of ranks is
/// connected when the communicator is made ([`Communicator::new`]).
pub struct Communicator {
    /// The communicator, `None` once aborted.
    comm: Mutex<Option<SendComm>>,
    /// A non-blocking stream of the device for the transfers, ordered after the caller's current
    /// stream: a transfer waiting for its peer stalls neither the legacy default stream nor the
    /// caller's other work.
    stream: super::Stream,
    /// Set by [`Communicator::interrupt`]: the transfer waiting now gives up.
    interrupted: AtomicBool,
    /// Whether the communicator was aborted (readable without waiting for a transfer).
    aborted: AtomicBool,
    /// Made non-blocking (`ncclCommInitRankConfig`): its calls may return `ncclInProgress`.
    non_blocking: bool,
    rank: usize,
    size: usize,
    ordinal: i32,
}

struct SendComm(Comm);
// SAFETY: an NCCL communicator may be used from any thread; `Communicator` serialises its use
// with a mutex (NCCL does not allow concurrent operations on one communicator).
unsafe impl Send for SendComm {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.ordinal)
            .finish()
    }
}

impl Communicator {
    /// Joins the communicator `id` as `rank` of `size`, on CUDA device `ordinal`, and connects
    /// it with every other rank; waits for every rank to join, with no time limit
    /// ([`Communicator::join`] with `None`).
    pub fn new(id: &[u8; UNIQUE_ID_BYTES], size: usize, rank: usize, ordinal: i32) -> Result<Self> {
        Self::join(id, size, rank, ordinal, None)
    }

    /// Joins the communicator `id` as `rank` of `size`, on CUDA device `ordinal`, and connects
    /// it with every other rank. Where NCCL has non-blocking communicators (2.14 and later), a
    /// join that has not finished within `timeout` (a rank that never comes) aborts the
    /// half-made communicator and fails; older NCCL blocks until every rank has joined.
    pub fn join(
        id: &[u8; UNIQUE_ID_BYTES],
        size: usize,
        rank: usize,
        ordinal: i32,
        timeout: Option<Duration>,
    ) -> Result<Self> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is not a rank of a communicator of {size}"
            )));
        }
        let n = |v: usize, what: &str| {
            c_int::try_from(v)
                .map_err(|_| Error::InvalidArgument(format!("{what} {v} is too large")))
        };
        let (c_size, c_rank) = (n(size, "size")?, n(rank, "rank")?);
        let api = api()?;
        // NCCL takes the device from the runtime's current device, which follows the bound
        // primary context.
        let _ctx = context(ordinal)?;
        // The communicator's own stream, made before the communicator so that nothing leaks
        // when it cannot be made.
        let stream = super::Stream::new(ordinal, true)?;
        let id = UniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comm: Comm = std::ptr::null_mut();
        let began = Instant::now();
        let non_blocking = match api.comm_init_rank_config {
            Some(init) => {
                let mut config = Config {
                    size: std::mem::size_of::<Config>(),
                    magic: 0xcafe_beef,
                    version: NON_BLOCKING_SINCE as u32,
                    blocking: 0,
                };
                // SAFETY: valid out-pointer, id and config; the device's context is bound.
                let code = unsafe { init(&mut comm, c_size, id, c_rank, &mut config) };
                let joined = if code == SUCCESS || code == IN_PROGRESS {
                    settle(api, comm, began, timeout, None, "joining the communicator")
                } else {
                    Err(failed(api, "ncclCommInitRankConfig", code, None))
                };
                if let Err(e) = joined {
                    if !comm.is_null() {
                        // SAFETY: the half-made communicator is never used again.
                        unsafe { (api.comm_abort)(comm) };
                    }
                    return Err(e);
                }
                true
            }
            None => {
                // SAFETY: valid out-pointer and id; the device's context is bound.
                let code = unsafe { (api.comm_init_rank)(&mut comm, c_size, id, c_rank) };
                check(api, "ncclCommInitRank", code, None)?;
                false
            }
        };
        let joined = Communicator {
            comm: Mutex::new(Some(SendComm(comm))),
            stream,
            interrupted: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            non_blocking,
            rank,
            size,
            ordinal,
        };
        // Connecting is part of joining: it gets what is left of the timeout.
        let left = timeout.map(|t| t.saturating_sub(began.elapsed()));
        joined.connect_all(left)?;
        Ok(joined)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The CUDA device the communicator runs on.
    pub fn device(&self) -> Device {
        Device::cuda(self.ordinal as u32)
    }

    /// Makes the transfer that waits now give up, which aborts the communicator: for a caller
    /// that knows the peer will not take part (its side failed). A transfer that starts later
    /// is not affected.
    pub fn interrupt(&self) {
        self.interrupted.store(true, Ordering::SeqCst);
    }

    /// Whether the communicator was aborted (after a failed or timed-out transfer).
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// The runs of `tensors` as [`Communicator::send`] sends them (what the receiver needs to
    /// know beforehand: run lengths and phases, and the views).
    pub fn plan(&self, tensors: &[Tensor]) -> Result<RunPlan> {
        for t in tensors {
            self.check_device(t)?;
        }
        plan(tensors)
    }

    /// Sends `tensors` to rank `peer` as the runs of [`Communicator::plan`], on the calling
    /// thread's current stream, and waits until they are sent (see the module's documentation).
    /// `expected` is the plan the receiver was told of: a different one (the arrays changed
    /// since) is refused before anything is sent.
    pub fn send(
        &self,
        tensors: &[Tensor],
        peer: usize,
        expected: Option<&[(usize, usize)]>,
        timeout: Option<Duration>,
    ) -> Result<RunPlan> {
        self.check_peer(peer)?;
        let plan = self.plan(tensors)?;
        if let Some(expected) = expected {
            let now: Vec<(usize, usize)> = plan.runs.iter().map(|r| (r.len, r.phase())).collect();
            if now != expected {
                return Err(Error::InvalidArgument(
                    "the arrays' memory changed since their transfer was announced (other runs \
                     of bytes than the receiver expects)"
                        .into(),
                ));
            }
        }
        let ops: Vec<Op> = plan
            .runs
            .iter()
            .map(|r| Op::Send(r.start, r.len, peer))
            .collect();
        self.run(&ops, timeout)?;
        Ok(plan)
    }

    /// Receives from rank `peer` the arrays it sends with [`Communicator::send`]: `runs` are the
    /// sender's run lengths and phases, `views` its views. Allocates one block on this device
    /// from the caching pool, receives every run into it, waits, and returns the arrays (owned by
    /// this process; read-only where the sender's were).
    pub fn recv(
        &self,
        runs: &[(usize, usize)],
        views: &[RunView],
        peer: usize,
        timeout: Option<Duration>,
    ) -> Result<Vec<Tensor>> {
        self.check_peer(peer)?;
        let (offsets, total) = runs::place(runs)?;
        // Views are checked before anything is received.
        let layouts = views
            .iter()
            .map(|v| runs::placed_layout(v, &offsets))
            .collect::<Result<Vec<_>>>()?;
        let block = memory::allocate(self.device(), total, false)?;
        let base = block.handle().expose_provenance();
        debug_assert_eq!(
            base % runs::RUN_ALIGN,
            0,
            "pool blocks are whole driver allocations"
        );
        let ops: Vec<Op> = runs
            .iter()
            .zip(&offsets)
            .map(|(&(len, _), &at)| Op::Recv(base + at, len, peer))
            .collect();
        let tensors = views
            .iter()
            .zip(layouts)
            .map(|(v, layout)| {
                let t = Tensor::new(block.clone(), v.dtype, layout)?;
                let bytes = t.byte_range();
                if let Some(r) = v.run
                    && !bytes.is_empty()
                    && (bytes.start < offsets[r] || bytes.end > offsets[r] + runs[r].0)
                {
                    return Err(Error::InvalidArgument(format!(
                        "a view reaches outside run {r}, which it names"
                    )));
                }
                // A copy, but it keeps the sender's read-only flag, as every DLPack exchange does.
                Ok(if v.read_only { t.into_read_only() } else { t })
            })
            .collect::<Result<Vec<_>>>()?;
        self.run(&ops, timeout)?;
        Ok(tensors)
    }

    fn check_device(&self, t: &Tensor) -> Result<()> {
        let d = t.device();
        if d.kind() != DeviceKind::Cuda || d.index() as i32 != self.ordinal {
            return Err(Error::InvalidArgument(format!(
                "this communicator sends from {}; an array on {d} must be moved there first",
                self.device()
            )));
        }
        Ok(())
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            return Err(Error::InvalidArgument(format!(
                "rank {peer} is not another rank of this communicator of {} (this is rank {})",
                self.size, self.rank
            )));
        }
        Ok(())
    }

    /// Connects this rank with every other (one byte each way, in one group), while all of them
    /// are known to be there: NCCL sets up a pair's connection on its first transfer, inside
    /// `ncclGroupEnd`, which blocks the host until the peer takes part too. Connected up front,
    /// a later transfer only enqueues, and a peer that is gone is caught by the timeout.
    fn connect_all(&self, timeout: Option<Duration>) -> Result<()> {
        let block = memory::allocate(self.device(), 2 * self.size, true)?;
        let base = block.handle().expose_provenance();
        let ops: Vec<Op> = (0..self.size)
            .filter(|&p| p != self.rank)
            .flat_map(|p| {
                [
                    Op::Send(base + p, 1, p),
                    Op::Recv(base + self.size + p, 1, p),
                ]
            })
            .collect();
        self.run(&ops, timeout)
    }

    /// Enqueues `ops` as one group on the current stream and waits for them.
    fn run(&self, ops: &[Op], timeout: Option<Duration>) -> Result<()> {
        let api = api()?;
        let mut guard = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        let comm = guard.as_ref().ok_or_else(aborted)?.0;
        // An interrupt meant for an earlier transfer does not reach this one.
        self.interrupted.store(false, Ordering::SeqCst);
        let _ctx = context(self.ordinal)?;
        // After the work the caller queued so far (a producer's writes to what is sent).
        let handle = self.stream.handle();
        super::order_streams(self.ordinal, current_stream(self.ordinal), handle)?;
        let s = stream::raw(handle);
        // SAFETY: group calls bracket the operations below.
        let code = unsafe { (api.group_start)() };
        check(api, "ncclGroupStart", code, Some(comm))?;
        let mut posted = Ok(());
        for op in ops {
            let code = match *op {
                // SAFETY (both): each range lies in device memory of this communicator's device
                // that the caller keeps alive until `run` returns (the wait below outlasts the
                // transfer).
                Op::Send(addr, len, peer) => {
                    let buf = addr as *const c_void;
                    // SAFETY: as above.
                    unsafe { (api.send)(buf, len, UINT8, peer as c_int, comm, s) }
                }
                Op::Recv(addr, len, peer) => {
                    let buf = addr as *mut c_void;
                    // SAFETY: as above.
                    unsafe { (api.recv)(buf, len, UINT8, peer as c_int, comm, s) }
                }
            };
            if code != SUCCESS && !(self.non_blocking && code == IN_PROGRESS) {
                posted = Err(failed(api, "ncclSend/ncclRecv", code, Some(comm)));
                break;
            }
        }
        // The group is always closed, even after a failed post.
        // SAFETY: closes the group opened above.
        let code = unsafe { (api.group_end)() };
        let began = Instant::now();
        let ended = if self.non_blocking && (code == SUCCESS || code == IN_PROGRESS) {
            // A non-blocking group may still be enqueueing its kernels: the event below must
            // come after them.
            settle(
                api,
                comm,
                began,
                timeout,
                Some(&self.interrupted),
                "an NCCL transfer",
            )
        } else {
            check(api, "ncclGroupEnd", code, Some(comm))
        };
        if let Err(e) = posted.and(ended) {
            self.abort(api, &mut guard, handle);
            return Err(e);
        }
        // Wait: an event after the operations, polled with NCCL's asynchronous error state, for
        // what is left of the timeout.
        let timeout = timeout.map(|t| t.saturating_sub(began.elapsed()));
        let done = wait(api, comm, self.ordinal, handle, timeout, &self.interrupted);
        if done.is_err() {
            self.abort(api, &mut guard, handle);
        }
        done
    }
}

impl Communicator {
    /// Aborts the communicator (its kernels see the abort flag and exit), then waits for the
    /// stream's work, so that no NCCL kernel still reads or writes the transfer's memory when
    /// the caller lets go of it.
    fn abort(&self, api: &Api, guard: &mut Option<SendComm>, handle: usize) {
        if let Some(SendComm(comm)) = guard.take() {
            self.aborted.store(true, Ordering::SeqCst);
            // SAFETY: the communicator is live; after the abort it is never used again.
            let code = unsafe { (api.comm_abort)(comm) };
            // A non-blocking communicator may report the abort as still running.
            if code != SUCCESS && code != IN_PROGRESS {
                log::warn!("dlbridge: ncclCommAbort failed with NCCL error {code}");
            }
            if let Err(e) = super::stream::synchronize_stream(self.ordinal, handle) {
                log::warn!("dlbridge: waiting for an aborted NCCL transfer failed: {e}");
            }
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let guard = self.comm.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let (Some(SendComm(comm)), Ok(api)) = (guard.take(), api()) {
            let _ctx = context(self.ordinal);
            // SAFETY: the communicator is live and used by no one else (we own it).
            let code = unsafe { (api.comm_destroy)(comm) };
            // A non-blocking communicator may report the destruction as still running.
            if code != SUCCESS && code != IN_PROGRESS {
                log::warn!("dlbridge: ncclCommDestroy failed with NCCL error {code}");
            }
        }
    }
}

/// One operation of a group: (address, length in bytes, peer rank).
#[derive(Clone, Copy)]
enum Op {
    Send(usize, usize, usize),
    Recv(usize, usize, usize),
}

fn aborted() -> Error {
    Error::InvalidArgument(
        "this NCCL communicator was aborted after a failed transfer; make a new one (with Ray: \
         dlbridge.ray.destroy_nccl_group, then create_nccl_group)"
            .into(),
    )
}

/// Polls a non-blocking communicator's state until its last call (a join, a group) has finished:
/// fails on an NCCL error, an interrupt, or when `timeout` has passed since `began`. `what` names
/// the operation in the error.
fn settle(
    api: &Api,
    comm: Comm,
    began: Instant,
    timeout: Option<Duration>,
    interrupted: Option<&AtomicBool>,
    what: &str,
) -> Result<()> {
    poll(api, comm, began, timeout, interrupted, what, |state| {
        Ok(state == SUCCESS)
    })
}

/// Waits until the work queued on stream `handle` so far is done, failing on an asynchronous NCCL
/// error, an interrupt, or after `timeout`.
fn wait(
    api: &Api,
    comm: Comm,
    ordinal: i32,
    handle: usize,
    timeout: Option<Duration>,
    interrupted: &AtomicBool,
) -> Result<()> {
    let event = super::Event::new(ordinal, false)?;
    event.record(handle)?;
    poll(
        api,
        comm,
        Instant::now(),
        timeout,
        Some(interrupted),
        "the transfer",
        |_| event.query(),
    )
}

/// The one polling loop of [`settle`] and [`wait`]: asks `done` with NCCL's asynchronous state
/// of `comm` until it answers `true`; fails on an NCCL error state, an interrupt, or when
/// `timeout` has passed since `began`. Naps between polls grow to at most 50 µs: a
/// millisecond's nap cost a 1 GiB transfer (8 ms) a tenth.
fn poll(
    api: &Api,
    comm: Comm,
    began: Instant,
    timeout: Option<Duration>,
    interrupted: Option<&AtomicBool>,
    what: &str,
    mut done: impl FnMut(NcclResult) -> Result<bool>,
) -> Result<()> {
    let mut pause = Duration::from_micros(5);
    loop {
        let mut state: NcclResult = IN_PROGRESS;
        // SAFETY: a live (possibly half-made) communicator and a valid out-pointer.
        let code = unsafe { (api.comm_async_error)(comm, &mut state) };
        check(api, "ncclCommGetAsyncError", code, Some(comm))?;
        if state != SUCCESS && state != IN_PROGRESS {
            return Err(failed(api, what, state, Some(comm)));
        }
        if done(state)? {
            return Ok(());
        }
        if interrupted.is_some_and(|i| i.load(Ordering::SeqCst)) {
            return Err(Error::Driver {
                backend: BACKEND,
                message: format!(
                    "{what} was interrupted (the other side failed); the communicator was aborted"
                ),
            });
        }
        if let Some(limit) = timeout
            && began.elapsed() > limit
        {
            return Err(Error::Driver {
                backend: BACKEND,
                message: format!(
                    "{what} did not finish within {:.1} s: a peer did not take part (it may have \
                     failed, exited or never started); the communicator was aborted",
                    limit.as_secs_f64()
                ),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_micros(50));
    }
}

/// The runs of CUDA device memory arrays (see [`crate::runs`]): spans merge across a gap
/// only inside one driver allocation (`cuMemGetAddressRange`), such as one slab of a caching
/// pool, so a run never covers unmapped addresses.
pub fn plan(tensors: &[Tensor]) -> Result<RunPlan> {
    runs::plan(tensors, runs::MAX_GAP, allocation_range)
}

fn allocation_range(t: &Tensor, addr: usize) -> Result<Range<usize>> {
    let _ctx = context(t.device().index() as i32)?;
    Ok(match super::driver::address_range(addr as u64) {
        Ok((base, size)) => base as usize..base as usize + size,
        // Memory the driver cannot place (a mapping it does not report): the array's own buffer.
        Err(_) => {
            let start = t.buffer().handle().expose_provenance();
            start..start + t.buffer().len()
        }
    })
}
