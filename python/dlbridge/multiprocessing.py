"""``multiprocessing`` that passes dlbridge arrays by handle, not by value.

Importing this module registers reducers with ``multiprocessing.reduction.ForkingPickler``, so
``Queue``, ``Pipe``, ``Pool`` and ``Process`` arguments carry a :class:`dlbridge.Array` as a small
handle to shareable memory: the receiving process maps the same memory (CPU, pinned and CUDA
device memory) and sees the sender's writes. The module re-exports everything of the standard
``multiprocessing``, as ``torch.multiprocessing`` does::

    import dlbridge.multiprocessing as mp

    def work(q):
        a = q.get()          # the same memory as the parent's array
        a[0] = 42.0

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        a = dlbridge.zeros((1024,))
        p = ctx.Process(target=work, args=(q,))
        p.start()
        q.put(a)             # copied once into shareable memory; the child maps that copy
        p.join()

An array that is not in shareable memory yet is copied into it once when it is sent (see
``Array.share``); send the array that ``dlbridge.open_shared`` or an earlier send produced to avoid
the copy: such an array (CPU, pinned or CUDA) is sent on as the same memory, so writes are seen
in every direction. File descriptors are lent by the sending process (a native thread answers on
an abstract Unix socket; the receiver claims the descriptor with the message's one-time ticket
when it unpickles the array, or proves the ticket without the descriptor when it has the memory
mapped already), or inherited while a process starts, with the ``spawn``, ``forkserver`` and
``fork`` start methods. A message must be received while its sender lives, and within
``DLBRIDGE_SHARE_TICKET_TTL`` seconds of being sent (600 by default); a claim waits for the
sender at most ``DLBRIDGE_SHARE_TIMEOUT`` seconds (30 by default) and answers Ctrl-C.

Memory lives while any process holds it and is freed when the last one lets go. CUDA memory that
dlbridge did not allocate in its shareable pool (a PyTorch tensor, say) travels as a legacy CUDA
IPC handle: it stays valid only while the producer process lives.
"""

from __future__ import annotations

from multiprocessing import *  # noqa: F403
from multiprocessing import reduction as _reduction
from multiprocessing import context as _context
from typing import Any, Callable

# `Array` here stays `multiprocessing.Array` (shared ctypes); dlbridge's is `_Array`.
from ._dlbridge import Array as _Array
from ._dlbridge import SharedHandle as _SharedHandle
from ._dlbridge import open_shared as _open_shared

# No `__all__`: `from dlbridge.multiprocessing import *` gives multiprocessing's public names and
# `init_reductions` (a computed `__all__` is one the type checkers cannot follow).


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
    try:
        handle = array.share()
    except (BufferError, RuntimeError):
        # A device without shareable memory (Metal, a CUDA build without a device): by value.
        return array.__reduce_ex__(5)
    return _rebuild_array, _state(handle)


def init_reductions() -> None:
    """Registers the reducers with ``ForkingPickler`` (done on import; idempotent)."""
    _reduction.ForkingPickler.register(_Array, _reduce_array)
    _reduction.ForkingPickler.register(_SharedHandle, _reduce_handle)


init_reductions()
