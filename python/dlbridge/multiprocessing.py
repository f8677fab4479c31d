"""``multiprocessing`` that shares dlbridge arrays between processes, as ``torch.multiprocessing``
shares tensors: a drop-in for the standard module (everything of it is re-exported).

Importing it registers reducers with ``multiprocessing.reduction.ForkingPickler``: an array sent
through a ``Queue``, a ``Pipe``, ``Pool`` arguments and results, or ``Process`` arguments is moved
into process-shareable memory **in place** on its first send (``Array.share_memory_()``) and
travels as a small handle; the receiver maps the same memory, so each side sees the other's
writes, with the ``spawn``, ``forkserver`` and ``fork`` start methods::

    import dlbridge
    import dlbridge.multiprocessing as mp

    def work(q, done):
        a = q.get()                       # the parent's memory, not a copy
        assert float(a[1]) == 7.0         # the parent's write, made before it sent the array
        a[0] = 42.0                       # the parent sees this write
        done.set()

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q, done = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=work, args=(q, done))
        p.start()
        a = dlbridge.zeros((1 << 20,))    # an ordinary array (4 MiB)
        a[1] = 7.0
        q.put(a)                          # the first send moves `a` into shared memory in place
        assert done.wait(60)
        p.join()
        assert a.is_shared() and float(a[0]) == 42.0

What moves where (``Array.share_memory_`` has the details):

* host memory dlbridge allocated in whole pages (arrays of 64 KiB and more, on Linux) moves in
  place: its bytes go into a shared file mapped at the same addresses, so every view and every
  export made before (a ``torch.from_dlpack`` tensor, a NumPy view) sees the shared memory too;
* other host memory (small arrays, which share pages with other allocations; a NumPy array's
  memory; pinned memory outside the shareable pool) is replaced by a shared copy: the ``Array``
  and what is made of it afterwards are shared, views and exports made before keep the old
  memory (a foreign producer's array is then disconnected, as with PyTorch's ``share_memory_``
  of a tensor from NumPy);
* CUDA device memory is shared as it is, as PyTorch shares CUDA tensors: memory of dlbridge's
  shareable (VMM) pool or received from another process by its VMM handle, which lives while
  any process maps it; other CUDA memory (dlbridge's ordinary pool, a PyTorch tensor's) by a
  legacy CUDA IPC handle, without a copy, **valid while the producer process lives** (send
  ``a.to_shareable()`` for memory that outlives its producer);
* an array opened from a handle is sent on as the same memory; arrays on devices without
  process-shareable memory (Metal) travel by value.

Process-shareable is not the storage mode: ``Array.storage == "shared"`` says that the host and
the device address the memory (every host array's mode); ``Array.is_shared()`` says whether
other processes can map it.

A ``Queue`` pickles in a background thread: the first send of an array moves it shortly after
``put`` returns. Call ``a.share_memory_()`` before sending where views or exports are made
meanwhile, or where other threads write the array.

With ``fork``, ``Process`` arguments are not pickled: the child inherits them. This module's
``Process`` (and its contexts' ``Process``, ``Pool`` and ``spawn``) moves the arrays among the
arguments into shared memory before it starts the child, so that the writes are shared as with
the other start methods (an array ``fork`` copies, PyTorch's tensors included, is the child's
own).

File descriptors are lent by the sending process (a native thread answers on an abstract Unix
socket; the receiver claims the descriptor with the message's one-time ticket when it unpickles
the array, or proves the ticket without the descriptor when it has the memory mapped already),
or inherited while a process starts. A message must be received while its sender lives, and
within ``DLBRIDGE_SHARE_TICKET_TTL`` seconds of being sent (600 by default); a claim waits for
the sender at most ``DLBRIDGE_SHARE_TIMEOUT`` seconds (30 by default) and answers Ctrl-C. Memory
lives while any process holds it and is freed when the last one lets go.

``spawn`` and ``start_processes`` start ``nprocs`` processes running ``fn(i, *args)`` as PyTorch's
do, and re-raise a child's exception in the parent (``ProcessRaisedException``, with the child's
traceback), or its death by a signal or exit status (``ProcessExitedException``).
"""

from __future__ import annotations

import multiprocessing as _mp
import multiprocessing.connection as _connection
import os as _os
import shutil as _shutil
import signal as _signal
import sys as _sys
import tempfile as _tempfile
import warnings as _warnings
from multiprocessing import *  # noqa: F403
from multiprocessing import context as _context
from multiprocessing import reduction as _reduction
from typing import TYPE_CHECKING, Any, Callable

# `Array` here stays `multiprocessing.Array` (shared ctypes); dlbridge's is `_Array`.
from ._dlbridge import Array as _Array
from ._dlbridge import SharedHandle as _SharedHandle
from ._dlbridge import open_shared as _open_shared

# No `__all__`: `from dlbridge.multiprocessing import *` gives multiprocessing's public names and
# this module's (a computed `__all__` is one the type checkers cannot follow).

# Devices whose arrays are shared as memory; arrays of other devices travel by value.
_SHAREABLE_DEVICES = frozenset({"cpu", "cuda_host", "cuda"})


def _state(handle: _SharedHandle) -> tuple[bytes, Any]:
    """``handle`` as what travels: its bytes and, while a process starts, its descriptor.

    A starting child inherits the descriptor at launch (the handle, which owns it, must then live
    as long as the starting process object). Otherwise the bytes carry a ticket: the descriptor
    is lent by this process's descriptor lender (native threads, no Python) and claimed by the
    receiver when it opens the handle, or forgone when it finds the memory mapped already.
    """
    popen = _context.get_spawning_popen()
    fd = handle.fd
    if popen is not None and fd is not None:
        popen.__dict__.setdefault("_dlbridge_handles", []).append(handle)
        return handle._state(), _reduction.DupFd(fd)
    return handle._lend(), None


def _rebuild_handle(state: bytes, dup: Any) -> _SharedHandle:
    fd = dup.detach() if dup is not None else None
    return _SharedHandle._rebuild(state, fd)


def _rebuild_array(state: bytes, dup: Any) -> _Array:
    return _open_shared(_rebuild_handle(state, dup))


def _reduce_handle(handle: _SharedHandle) -> tuple[Callable[..., _SharedHandle], tuple[Any, ...]]:
    return _rebuild_handle, _state(handle)


def _reduce_array(array: _Array) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if array.device.type not in _SHAREABLE_DEVICES:
        return array.__reduce_ex__(5)  # Metal: by value
    array.share_memory_()  # in place; a no-op for memory that is shareable already
    return _rebuild_array, _state(array.share(copy=False))


def init_reductions() -> None:
    """Registers the reducers with ``ForkingPickler`` (done on import; idempotent)."""
    _reduction.ForkingPickler.register(_Array, _reduce_array)
    _reduction.ForkingPickler.register(_SharedHandle, _reduce_handle)


init_reductions()


# ---------------------------------------------------------------------------------------------
# Processes whose array arguments are shared before they start (what `fork` needs: it pickles
# nothing; the other start methods pickle the arguments, which shares them anyway).


def _share_arguments(*objects: Any) -> None:
    """Moves every dlbridge array among ``objects`` (and in the tuples, lists, sets and dicts
    they hold) into process-shareable memory in place (``Array.share_memory_``)."""
    seen: set[int] = set()
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if isinstance(obj, _Array):
            if obj.device.type in _SHAREABLE_DEVICES:
                obj.share_memory_()
        elif isinstance(obj, (tuple, list, set, frozenset, dict)) and id(obj) not in seen:
            seen.add(id(obj))
            stack.extend(obj.values() if isinstance(obj, dict) else obj)


class _SharesArguments:
    """Mixin of the processes this module makes: ``start()`` first moves the arrays among the
    arguments into process-shareable memory in place."""

    _args: tuple[Any, ...]
    _kwargs: dict[str, Any]

    def start(self) -> None:
        _share_arguments(self._args, self._kwargs)
        super().start()  # type: ignore[misc]


class _Process(_SharesArguments, _mp.Process):
    """``multiprocessing.Process`` (of the default start method) whose array arguments are moved
    into process-shareable memory in place when it starts: a child's writes to them are seen by
    this process with every start method, ``fork`` included."""


# The standard contexts and their processes, sharing array arguments. Module-level classes:
# `spawn` and `forkserver` pickle the process object, its class by name.
_CONTEXTS: dict[str, _context.BaseContext] = {}

if hasattr(_context, "ForkProcess"):  # POSIX

    class _ForkProcess(_SharesArguments, _context.ForkProcess):
        pass

    class _ForkContext(_context.ForkContext):
        Process = _ForkProcess

    class _SpawnProcess(_SharesArguments, _context.SpawnProcess):
        pass

    class _SpawnContext(_context.SpawnContext):
        Process = _SpawnProcess

    class _ForkServerProcess(_SharesArguments, _context.ForkServerProcess):
        pass

    class _ForkServerContext(_context.ForkServerContext):
        Process = _ForkServerProcess

    _CONTEXTS.update(fork=_ForkContext(), spawn=_SpawnContext(), forkserver=_ForkServerContext())


def _get_context(method: str | None = None) -> Any:
    """``multiprocessing.get_context(method)`` (``None``: the default start method), whose
    ``Process`` and ``Pool`` move array arguments into process-shareable memory when a process
    starts (see ``Process``)."""
    std = _mp.get_context(method)
    return _CONTEXTS.get(std.get_start_method(), std)


def _pool(
    processes: int | None = None,
    initializer: Callable[..., object] | None = None,
    initargs: tuple[Any, ...] = (),
    maxtasksperchild: int | None = None,
) -> Any:
    """``multiprocessing.Pool`` of the default start method, its workers started by this
    module's ``Process`` (arrays among ``initargs`` are shared as ``Process`` arguments are)."""
    return _get_context().Pool(processes, initializer, initargs, maxtasksperchild)


if not TYPE_CHECKING:
    # In place of the standard module's (a type checker sees those: these are subclasses and
    # wrappers of them, with the same signatures). Process pickles by this name under spawn.
    _Process.__name__ = _Process.__qualname__ = "Process"
    Process = _Process
    get_context = _get_context
    Pool = _pool


# ---------------------------------------------------------------------------------------------
# torch.multiprocessing's sharing strategies.

_STRATEGIES = frozenset({"file_descriptor", "file_system"})
_strategy = "file_descriptor"


def get_all_sharing_strategies() -> set[str]:
    """The sharing strategies ``set_sharing_strategy`` accepts: ``{"file_descriptor",
    "file_system"}``, PyTorch's names. Accepted for compatibility; see ``set_sharing_strategy``."""
    return set(_STRATEGIES)


def get_sharing_strategy() -> str:
    """The strategy last set (``"file_descriptor"`` until one is)."""
    return _strategy


def set_sharing_strategy(new_strategy: str) -> None:
    """Accepts PyTorch's strategy names for compatibility, and changes nothing: dlbridge shares
    host memory one way, anonymous sealed files whose descriptors are lent per message (nothing
    is named in ``/dev/shm`` or the file system, so nothing is left behind by a killed process,
    and a process holds one descriptor per shared allocation, not one per tensor received).
    PyTorch's ``"file_system"`` exists to avoid descriptor limits that this design does not hit.
    An unknown name raises ``ValueError`` (PyTorch raises ``AssertionError``)."""
    global _strategy
    if new_strategy not in _STRATEGIES:
        raise ValueError(
            f"unknown sharing strategy {new_strategy!r}: expected one of {sorted(_STRATEGIES)}"
        )
    _strategy = new_strategy


# ---------------------------------------------------------------------------------------------
# spawn / start_processes, as torch.multiprocessing has them.


class ProcessException(Exception):
    """A process started by ``spawn`` or ``start_processes`` failed: ``error_index`` is its index
    ``i``, ``error_pid`` its process id."""

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.error_pid)


class ProcessRaisedException(ProcessException):
    """The process's ``fn`` raised: the message ends with its traceback, as the child printed
    it."""


class ProcessExitedException(ProcessException):
    """The process died without raising: killed by a signal (``signal_name``) or exited with a
    status other than 0 (``exit_code``, negative for a signal, as ``Process.exitcode``)."""

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name)


def _die_with_parent() -> None:
    """Asks Linux to send this process SIGINT when its parent dies (``PR_SET_PDEATHSIG``), so that
    non-daemonic children of a parent that dies do not run on alone; nothing elsewhere."""
    if not _sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(_signal.SIGINT))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run(fn: Callable[..., object], i: int, args: tuple[Any, ...], error_file: str) -> None:
    """A child of ``start_processes``: runs ``fn(i, *args)``; an exception's traceback goes to
    ``error_file`` (in the parent's private folder) and the child exits with status 1."""
    _die_with_parent()
    parent = _os.getppid()
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        if _os.getppid() != parent:
            _sys.exit(128 + int(_signal.SIGINT))  # the parent died: quietly
        _write_traceback(error_file)
        _sys.exit(128 + int(_signal.SIGINT))
    except Exception:
        _write_traceback(error_file)
        _sys.exit(1)


def _write_traceback(path: str) -> None:
    import traceback

    with open(path, "w", encoding="utf-8") as f:
        f.write(traceback.format_exc())


class ProcessContext:
    """The processes ``start_processes(..., join=False)`` started: ``join()`` them (in a loop
    until it returns ``True``), ``pids()``, ``processes``."""

    def __init__(self, processes: list[Any], error_files: list[str], folder: str | None = None) -> None:
        self.processes = processes
        self.error_files = error_files
        self.sentinels: dict[Any, int] = {p.sentinel: i for i, p in enumerate(processes)}
        self._folder = folder

    def pids(self) -> list[int]:
        """The processes' ids, by index."""
        return [int(p.pid) for p in self.processes]

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Waits up to ``timeout`` seconds (``None``: until one exits) for the processes.

        Returns ``True`` once every process has exited with status 0, ``False`` while some still
        run. When one failed, the others get ``grace_period`` seconds to end by themselves, then
        ``SIGTERM``, then (after the grace period again, or 30 s) ``SIGKILL``; and the failure is
        raised: ``ProcessRaisedException`` with the child's traceback when ``fn`` raised,
        ``ProcessExitedException`` when it died by a signal or exited with another status.
        """
        if not self.sentinels:
            return True
        ready = _connection.wait(list(self.sentinels), timeout=timeout)
        failed = None
        for sentinel in ready:
            index = self.sentinels.pop(sentinel)
            process = self.processes[index]
            process.join()
            if process.exitcode != 0:
                failed = index
                break
        if failed is None:
            if not self.sentinels:
                self._clean()
            return not self.sentinels
        self._stop_others(grace_period)
        raise self._failure(failed)

    def _stop_others(self, grace_period: float | None) -> None:
        if grace_period is not None:
            self._join_all(grace_period)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        self._join_all(30.0 if grace_period is None else grace_period)
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join()
        self.sentinels.clear()

    def _join_all(self, seconds: float) -> None:
        import time

        until = time.monotonic() + seconds
        for p in self.processes:
            p.join(max(0.0, until - time.monotonic()))

    def _failure(self, index: int) -> ProcessException:
        process = self.processes[index]
        try:
            with open(self.error_files[index], encoding="utf-8") as f:
                trace: str | None = f.read()
        except OSError:
            trace = None
        finally:
            self._clean()
        if trace is not None:
            msg = f"\n\n-- Process {index} terminated with the following error:\n{trace}"
            return ProcessRaisedException(msg, index, process.pid)
        code = process.exitcode
        if code < 0:
            try:
                name = _signal.Signals(-code).name
            except ValueError:
                name = f"<Unknown signal {-code}>"
            return ProcessExitedException(
                f"process {index} terminated with signal {name}", index, process.pid, code, name
            )
        return ProcessExitedException(f"process {index} terminated with exit code {code}", index, process.pid, code)

    def _clean(self) -> None:
        if self._folder is not None:
            _shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def start_processes(
    fn: Callable[..., object],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    """Starts ``nprocs`` processes with ``start_method`` (``spawn``, ``forkserver`` or ``fork``),
    process ``i`` running ``fn(i, *args)``; arrays in ``args`` are shared with every process
    (moved into process-shareable memory in place), so their writes are seen by the parent.

    With ``join`` (the default), waits for all of them and returns ``None``, or raises the first
    failure (see ``ProcessContext.join``); else returns the ``ProcessContext``. ``fn`` must be
    importable by the children (defined at the top level of a module) for ``spawn`` and
    ``forkserver``.
    """
    ctx: Any = _get_context(start_method)
    folder = _tempfile.mkdtemp(prefix="dlbridge-spawn-")  # private (0700): the children's tracebacks
    error_files = [_os.path.join(folder, f"{i}.traceback") for i in range(nprocs)]
    processes = []
    try:
        for i in range(nprocs):
            p = ctx.Process(target=_run, args=(fn, i, args, error_files[i]), daemon=daemon)
            p.start()
            processes.append(p)
    except BaseException:
        for p in processes:
            p.terminate()
            p.join()
        _shutil.rmtree(folder, ignore_errors=True)
        raise
    context = ProcessContext(processes, error_files, folder)
    if not join:
        return context
    while not context.join():
        pass
    return None


def spawn(
    fn: Callable[..., object],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    """``start_processes`` with the ``spawn`` start method, as ``torch.multiprocessing.spawn``:
    another ``start_method`` warns (``FutureWarning``) and is ignored, as PyTorch does; use
    ``start_processes`` for another start method."""
    if start_method != "spawn":
        _warnings.warn(
            f"spawn() always uses the spawn start method (got {start_method!r}); "
            "use dlbridge.multiprocessing.start_processes(...) for another one",
            FutureWarning,
            stacklevel=2,
        )
    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn")
